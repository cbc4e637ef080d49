"""Skinny linear layer: ``y = x @ weight.T + bias`` for inputs of at most 64 rows, the weight read
once for all rows (:func:`skinny_linear`); its fp32 torch reference (:mod:`.naive`) and its
Triton kernels (:mod:`.triton_skinny`, imported on first use).

A decode step multiplies 1 row per sequence by every weight matrix, a verify step B x T rows
(at most 64 here): the weight bytes set the time. :func:`skinny_linear` is the kernel;
:class:`SkinnyLinear` an ``nn.Linear`` that takes it for such inputs and ``F.linear`` otherwise,
and :func:`skinny_linears` puts it in a model's place for the span of a ``with`` block (opt in:
nothing in the engine uses it by default). ``specdec-run experiment=skinny_linear`` times it
against cuBLAS on the bench models' weight shapes.

Example::

    y = skinny_linear(x, lm_head.weight)                 # x [B, T, K] bf16 on CUDA, B * T <= 64
    with skinny_linears(model):                          # every nn.Linear of the model
        out = model.generate(**enc, max_new_tokens=64)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .naive import linear_ref

__all__ = ["MAX_ROWS", "DTYPES", "SkinnyConfig", "skinny_config", "split_k_for", "skinny_linear", "SkinnyLinear", "skinny_linears",
           "linear_ref", "num_sms"]

#: the most rows (``M = prod(x.shape[:-1])``) :func:`skinny_linear` takes: four 16-row tiles
MAX_ROWS = 64
#: the dtypes it takes (x, weight, bias and the result share one)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: SMs assumed off CUDA (an H200's), so CPU runs choose the launch an H200 would
DEFAULT_SMS = 132


@dataclass(frozen=True)
class SkinnyConfig:
    """A launch of the skinny kernel: weight rows per program (``block_n``, a power of two >= 16),
    K per step (``block_k``, a power of two >= 16), K splits (``split_k``; fewer run when K has
    fewer ``block_k`` steps), ``num_warps``, ``num_stages`` (software-pipelined K steps)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SkinnyConfig.{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"SkinnyConfig.split_k, num_warps and num_stages must be >= 1, got {self}")

    def describe(self) -> str:
        """E.g. ``n64 k128 split3 w4 s4``."""
        return f"n{self.block_n} k{self.block_k} split{self.split_k} w{self.num_warps} s{self.num_stages}"


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device; :data:`DEFAULT_SMS` elsewhere."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return DEFAULT_SMS
    return _cuda_sms(dev.index if dev.index is not None else torch.cuda.current_device())


def skinny_config(N: int, K: int, dtype: torch.dtype, sms: int = DEFAULT_SMS) -> SkinnyConfig:
    """The launch :func:`skinny_linear` uses for a ``[N, K]`` weight of ``dtype`` on a device of
    ``sms`` SMs. It never depends on M, which keeps the result batch-invariant.

    ``block_n`` 64 (less for N < 64), ``block_k`` 128 elements (256 bytes of a bf16 row; 64 for
    fp32), 4 warps, 4 pipelined stages; when the ``block_n`` slices fill less than one wave of
    SMs, K is split so they fill it (each split at least 4 ``block_k`` steps): e.g. N = 2560,
    K = 9216 on 132 SMs runs 40 x 3 programs.
    """
    block_n = min(64, max(16, 1 << max(0, N - 1).bit_length()))
    block_k = 64 if dtype == torch.float32 else 128
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k_for(N, K, block_n, block_k, sms))


def split_k_for(N: int, K: int, block_n: int, block_k: int, sms: int = DEFAULT_SMS) -> int:
    """K splits for ``block_n`` x ``block_k`` tiles of a ``[N, K]`` weight: 1 when the ``block_n``
    slices fill a wave of ``sms`` SMs, else as many as fit in one wave with each split at least 4
    ``block_k`` steps long (software pipelining needs a few)."""
    n_blocks, k_steps = -(-N // block_n), -(-K // block_k)
    return max(1, min(sms // n_blocks, k_steps // 4)) if n_blocks < sms else 1


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> int:
    """Rows M of a valid call; ValueError saying what was given and what is accepted otherwise."""
    names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K] (2-D), got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., K] with K = {K} (weight is [N, K] = {tuple(weight.shape)}), got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x is {x.dtype}; skinny_linear takes {names}")
    for name, t in (("weight", weight), ("bias", bias), ("out", out)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name} is {t.dtype} but x is {x.dtype}: x, weight, bias and out must share one dtype "
                             f"({names})")
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: all tensors must be on one device")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x is on {x.device}; skinny_linear runs on CUDA (or on the CPU through Triton's "
                         "interpreter, TRITON_INTERPRET=1)")
    M = math.prod(x.shape[:-1])
    if M > MAX_ROWS:
        raise ValueError(f"x has M = {M} rows (the product of its leading dims {tuple(x.shape[:-1])}); skinny_linear "
                         f"takes at most {MAX_ROWS} (use F.linear for more)")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [N] = [{N}], got shape {tuple(bias.shape)}")
    if out is not None and tuple(out.shape) != tuple(x.shape[:-1]) + (N,):
        raise ValueError(f"out must be x's leading dims + [N] = {tuple(x.shape[:-1]) + (N,)}, got shape "
                         f"{tuple(out.shape)}")
    return M


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for at most :data:`MAX_ROWS` rows, reading the weight once for all rows.

    fp32 accumulation, the result in ``x.dtype`` (as ``F.linear``, which accumulates bf16 / fp16
    in fp32 too). Batch-invariant: row i of the result equals ``skinny_linear(x[i:i+1], ...)`` bit
    for bit, for any M (the launch does not depend on M; :mod:`.triton_skinny`). Runs on CUDA;
    on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, for tests).

    Args:
        x: ``[..., K]`` bf16 / fp16 / fp32 with ``M = prod(x.shape[:-1]) <= 64`` (any strides).
        weight: ``[N, K]``, x's dtype and device (K-contiguous rows read fastest).
        bias: ``[N]`` or None.
        out: ``[..., N]`` to write into (x's dtype), or None for a new tensor.
        config: the launch; None takes :func:`skinny_config` for the weight and device.

    Returns:
        ``[..., N]`` in ``x.dtype`` (``out`` when given).

    Raises:
        ValueError: M > 64, x's last dim not the weight's K, a bias or out of the wrong shape,
            mixed or unsupported dtypes, tensors on different devices, or a CPU tensor without
            the interpreter.
    """
    M = _check(x, weight, bias, out)
    N, K = weight.shape
    y = out if out is not None else torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    if N == 0 or K == 0:
        return y.copy_(bias.expand_as(y) if bias is not None else torch.zeros_like(y))
    from .triton_skinny import skinny_launch  # lazy: triton is optional, and the interpreter is decided first

    cfg = config if config is not None else skinny_config(N, K, x.dtype, num_sms(x.device))
    y2 = y.view(M, N) if y.is_contiguous() else torch.empty(M, N, device=y.device, dtype=y.dtype)
    skinny_launch(x.reshape(M, K), weight, bias, y2, cfg)
    if not y.is_contiguous():  # a strided out: the contiguous result copied in
        y.copy_(y2.view(y.shape))
    return y


@torch.library.custom_op("specdec::skinny_linear", mutates_args=())
def _skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`skinny_linear` as one opaque op for ``torch.compile`` (no graph break inside a
    compiled module, e.g. the MLPs :func:`specdec.fusion.fused` compiles)."""
    return skinny_linear(x, weight, bias)


@_skinny_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose forward runs :func:`skinny_linear` for inputs of at most :data:`MAX_ROWS`
    rows when the Triton backend is on (:func:`specdec.kernels.backend`: CUDA, or
    ``SPECDEC_BACKEND=triton`` on the CPU with the interpreter), x and the weight share a
    supported dtype, and no gradient is needed; ``F.linear`` otherwise. Built from an
    ``nn.Linear`` by :meth:`of`, sharing its parameters (tied weights stay tied). Under
    ``torch.compile`` the kernel is one custom op (``torch.ops.specdec.skinny_linear``), so a
    compiled module around it traces without a graph break."""

    use_kernel: bool = False

    @classmethod
    def of(cls, linear: nn.Linear, backend_name: str | None = None) -> "SkinnyLinear":
        """A SkinnyLinear holding ``linear``'s own weight and bias Parameters (no copy), on
        ``backend_name`` (``"triton"``: the kernel where it applies; ``"torch"``: ``F.linear``
        always) or, for None, the backend :func:`specdec.kernels.backend` picks for the weight's device.

        Raises:
            ValueError: an unknown backend name.
        """
        from .. import BACKENDS, backend

        if backend_name is not None and backend_name not in BACKENDS:
            raise ValueError(f"backend_name must be one of {BACKENDS} or None, got {backend_name!r}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = linear.in_features, linear.out_features
        mod.weight, mod.bias = linear.weight, linear.bias
        mod.use_kernel = (backend_name or backend(linear.weight.device)) == "triton"
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (self.use_kernel and x.dtype == w.dtype and w.dtype in DTYPES and x.device == w.device
                and x.dim() >= 1 and x.shape[-1] == w.shape[1] and 0 < x.numel() // max(1, w.shape[1]) <= MAX_ROWS
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            if torch.compiler.is_compiling():  # traced: one op; eager: the direct call (no dispatcher overhead)
                return _skinny_linear_op(x, w, self.bias)
            return skinny_linear(x, w, self.bias)
        return F.linear(x, w, self.bias)


@contextlib.contextmanager
def skinny_linears(model: nn.Module, *, backend_name: str | None = None):
    """Within the block, every ``nn.Linear`` of ``model`` (exactly that class: decoder
    projections, the LM head) is a :class:`SkinnyLinear` sharing its parameters, on
    ``backend_name`` (:meth:`SkinnyLinear.of`; None: the device's backend, Triton on CUDA); on
    exit the original modules are back. Yields the number of modules replaced. Hooks registered
    on the original modules do not run inside the block.

    Raises:
        ValueError: an unknown backend name.

    Example::

        with skinny_linears(model) as n:
            out = specdec.wrap(model, ...).generate(ids, max_new_tokens=64)
    """
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, SkinnyLinear.of(child, backend_name))
                    swapped.append((parent, name, child))
        yield len(swapped)
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)
