"""Skinny linear layer: ``y = x @ weight.T + bias`` for inputs of at most 64 rows, the weight read
once for all rows (:func:`skinny_linear`); its fp32 torch reference (:mod:`.naive`) and its
Triton kernels (:mod:`.triton_skinny`, imported on first use).

A decode step multiplies 1 row per sequence by every weight matrix, a verify step B x T rows
(at most 64 here): the weight bytes set the time. :func:`skinny_linear` is the kernel;
:class:`SkinnyLinear` an ``nn.Linear`` that takes it for such inputs and ``F.linear`` otherwise,
and :func:`skinny_linears` puts it in a model's place for the span of a ``with`` block (for
any input of at most 64 rows). The CUDA-graph decode path routes the linears it does not merge
(below) through it for at most :data:`SINGLE_MAX_ROWS` rows while it captures
(:func:`single_linears`, entered by :func:`specdec.fusion.fused`), where it beats cuBLAS.
``specdec-run experiment=skinny_linear`` times it against cuBLAS on the bench models' weight
shapes.

Sibling projections -- linears that read the same input, as a layer's query / key / value or a
Gated DeltaNet's qkv / z / b / a projections -- are merged into one launch ("horizontal
fusion"): :func:`grouped_skinny_linear` multiplies one x by up to :data:`MAX_MEMBERS` weights in
one kernel, each into its own output, without concatenating the weights (no copy).
:func:`merged_linears` routes a model's sibling ``nn.Linear`` modules through it for the span of
a ``with`` block; the CUDA-graph decode path does so while it captures
(:func:`specdec.fusion.fused`), where a kernel launch costs the same few microseconds as reading
a small projection's weights.

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
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...placement import unhooked
from ..protocol import FLOAT_DTYPES
from .naive import ACTIVATIONS, activation_ref, gated_linear_ref, linear_ref

__all__ = ["MAX_ROWS", "MAX_MEMBERS", "SINGLE_MAX_ROWS", "DTYPES", "ACTIVATIONS", "SkinnyConfig", "skinny_config",
           "split_k_for", "skinny_linear", "gated_skinny_linear", "grouped_skinny_linear", "SkinnyLinear",
           "skinny_linears", "merged_linears", "single_linears", "mlp_hidden", "linear_ref", "gated_linear_ref", "activation_ref",
           "num_sms", "mlp_activation", "mlp_activation_reference"]

#: the most rows (``M = prod(x.shape[:-1])``) :func:`skinny_linear` takes: four 16-row tiles
MAX_ROWS = 64
#: the most weights :func:`grouped_skinny_linear` multiplies in one launch
MAX_MEMBERS = 4
#: the most rows for which :func:`single_linears` takes the kernel: on an H200 it beat cuBLAS on the
#: bench models' weights at 1 and 16 rows and lost at 64 (``specdec-run experiment=skinny_linear``)
SINGLE_MAX_ROWS = 16
#: the dtypes it takes (x, weight, bias and the result share one)
DTYPES = FLOAT_DTYPES
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


def _check_activation(activation, gated: bool = False) -> int:
    """The epilogue code of ``activation``; ValueError naming what is accepted otherwise."""
    from .triton_skinny import ACT_CODES

    if activation is None and gated or (activation is not None and activation not in ACTIVATIONS):
        accepted = f"one of {ACTIVATIONS}" + ("" if gated else " or None")
        raise ValueError(f"activation must be {accepted}, got {activation!r}")
    return ACT_CODES[activation]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, *, activation: str | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """``activation(x @ weight.T + bias)`` for at most :data:`MAX_ROWS` rows, reading the weight once
    for all rows.

    fp32 accumulation, the result in ``x.dtype`` (as ``F.linear``, which accumulates bf16 / fp16
    in fp32 too). An activation is applied in the same launch (or in the split-K reduction's) to
    the linear's result rounded to ``x.dtype``, in fp32, as the eager ``act(linear(x))`` computes
    it. Batch-invariant: row i of the result equals ``skinny_linear(x[i:i+1], ...)`` bit
    for bit, for any M (the launch does not depend on M; :mod:`.triton_skinny`). Runs on CUDA;
    on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, for tests).

    Args:
        x: ``[..., K]`` bf16 / fp16 / fp32 with ``M = prod(x.shape[:-1]) <= 64`` (any strides).
        weight: ``[N, K]``, x's dtype and device (K-contiguous rows read fastest).
        bias: ``[N]`` or None.
        out: ``[..., N]`` to write into (x's dtype), or None for a new tensor.
        activation: one of :data:`ACTIVATIONS` (``"silu"``, ``"relu2"``), or None.
        config: the launch; None takes :func:`skinny_config` for the weight and device.

    Returns:
        ``[..., N]`` in ``x.dtype`` (``out`` when given).

    Raises:
        ValueError: M > 64, x's last dim not the weight's K, a bias or out of the wrong shape,
            mixed or unsupported dtypes, tensors on different devices, an unknown activation, or a
            CPU tensor without the interpreter.
    """
    M = _check(x, weight, bias, out)
    act = _check_activation(activation)
    N, K = weight.shape
    if bias is not None and bias.stride(0) != 1:  # (the kernels read the bias contiguously)
        bias = bias.contiguous()
    y = out if out is not None else torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    if N == 0 or K == 0:
        const = bias.expand_as(y) if bias is not None else torch.zeros_like(y)
        return y.copy_(activation_ref(const.to(x.dtype), activation) if activation else const)
    from .triton_skinny import skinny_launch  # lazy: triton is optional, and the interpreter is decided first

    cfg = config if config is not None else skinny_config(N, K, x.dtype, num_sms(x.device))
    y2 = y.view(M, N) if y.is_contiguous() else torch.empty(M, N, device=y.device, dtype=y.dtype)
    skinny_launch(x.reshape(M, K), weight, bias, y2, cfg, act)
    if not y.is_contiguous():  # a strided out: the contiguous result copied in
        y.copy_(y2.view(y.shape))
    return y


def gated_skinny_linear(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                        gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, *, activation: str = "silu",
                        config: SkinnyConfig | None = None) -> torch.Tensor:
    """``activation(x @ gate_weight.T + gate_bias) * (x @ up_weight.T + up_bias)`` -- a gated MLP's
    input to its down projection (SwiGLU for SiLU; Shazeer, "GLU Variants Improve Transformer",
    2020) -- in one launch for at most :data:`MAX_ROWS` rows: each program reads the same rows of
    both weights and multiplies them by each x tile loaded once, and the activation and product
    are its epilogue (or the split-K reduction's), so neither projection's result is written
    (with K split, their fp32 partial sums are, for the reduction).

    Rounding follows the eager module's ``act(gate(x)) * up(x)`` in ``x.dtype``: both projections
    are rounded to ``x.dtype``, the activation is computed in fp32 and rounded, the product in fp32
    and rounded. Batch-invariant (row i equals the 1-row call's bit for bit); the launch is
    :func:`skinny_config` of ``[N, K]``, as for one of the projections alone. Runs on CUDA; on the
    CPU through Triton's interpreter.

    Args:
        x: ``[..., K]`` bf16 / fp16 / fp32, ``M = prod(x.shape[:-1]) <= 64`` rows (any strides).
        gate_weight, up_weight: ``[N, K]`` each, x's dtype and device, with one set of strides
            (e.g. both contiguous, or both row halves of one ``[2N, K]`` weight).
        gate_bias, up_bias: both ``[N]``, or both None.
        out: ``[..., N]`` to write into (x's dtype), or None for a new tensor.
        activation: one of :data:`ACTIVATIONS`, applied to the gate projection.
        config: the launch; None takes :func:`skinny_config` for ``[N, K]`` and the device.

    Returns:
        ``[..., N]`` in ``x.dtype`` (``out`` when given).

    Raises:
        ValueError: what :func:`skinny_linear` refuses of either projection, weights of different
            shapes or strides, one bias without the other, or an activation not in
            :data:`ACTIVATIONS`.
    """
    M = _check(x, gate_weight, gate_bias, out)
    for name, w, b in (("up_weight", up_weight, up_bias),):
        try:
            _check(x, w, b, None)
        except ValueError as err:
            raise ValueError(f"gated_skinny_linear, {name}: {err}") from None
    if tuple(up_weight.shape) != tuple(gate_weight.shape) or up_weight.stride() != gate_weight.stride():
        raise ValueError(f"gate_weight and up_weight must share shape and strides, got {tuple(gate_weight.shape)} / "
                         f"{tuple(up_weight.shape)} with strides {gate_weight.stride()} / {up_weight.stride()}")
    if (gate_bias is None) != (up_bias is None):
        raise ValueError("gate_bias and up_bias must both be given or both be None, got "
                         f"{'None' if gate_bias is None else 'a tensor'} and {'None' if up_bias is None else 'a tensor'}")
    act = _check_activation(activation, gated=True)
    N, K = gate_weight.shape
    if gate_bias is not None:  # (the kernels read the biases contiguously)
        gate_bias, up_bias = gate_bias.contiguous(), up_bias.contiguous()
    y = out if out is not None else torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    if K == 0:
        g = gate_bias.expand_as(y) if gate_bias is not None else torch.zeros_like(y)
        u = up_bias.expand_as(y) if up_bias is not None else torch.zeros_like(y)
        return y.copy_(activation_ref(g, activation).to(x.dtype).float() * u.float())
    from .triton_skinny import skinny_launch

    cfg = config if config is not None else skinny_config(N, K, x.dtype, num_sms(x.device))
    y2 = y.view(M, N) if y.is_contiguous() else torch.empty(M, N, device=y.device, dtype=y.dtype)
    skinny_launch(x.reshape(M, K), gate_weight, gate_bias, y2, cfg, act, up_weight, up_bias)
    if not y.is_contiguous():
        y.copy_(y2.view(y.shape))
    return y


def grouped_skinny_linear(x: torch.Tensor, weights, biases=None, outs=None, *, config: SkinnyConfig | None = None
                          ) -> list[torch.Tensor]:
    """``[x @ w.T + b for w, b in zip(weights, biases)]`` in one kernel launch, each weight read once
    for all rows of x: the sibling projections of one input (e.g. a layer's q / k / v).

    fp32 accumulation, results in ``x.dtype``. Batch-invariant as
    :func:`skinny_linear` (row i of a result equals the 1-row call's); the launch (``block_n``,
    ``block_k``, warps, stages: :func:`skinny_config` of the summed N, no K split) depends on the
    weights alone, so a member's result may differ in rounding from its own
    :func:`skinny_linear` call. Runs on CUDA; on the CPU through Triton's interpreter.

    Args:
        x: ``[..., K]`` bf16 / fp16 / fp32, ``M = prod(x.shape[:-1]) <= 64`` rows (any strides).
        weights: 1 to :data:`MAX_MEMBERS` contiguous ``[N_i, K]`` tensors of x's dtype and device.
        biases: None, or one contiguous ``[N_i]`` tensor per weight.
        outs: None (new tensors), or one contiguous ``[..., N_i]`` tensor of x's dtype per weight
            to write into.
        config: the launch; None takes :func:`skinny_config` for the group.

    Returns:
        ``[..., N_i]`` per weight, in order (``outs`` when given).

    Raises:
        ValueError: no weights or more than :data:`MAX_MEMBERS`, a non-contiguous weight, bias or
            out, biases or outs not one per weight, and whatever :func:`skinny_linear` refuses of
            one member.
    """
    weights = list(weights)
    if not 1 <= len(weights) <= MAX_MEMBERS:
        raise ValueError(f"grouped_skinny_linear takes 1 to {MAX_MEMBERS} weights, got {len(weights)}")
    if biases is not None:
        biases = list(biases)
        if len(biases) != len(weights) or any(b is None for b in biases):
            raise ValueError(f"biases must be None or one tensor per weight ({len(weights)}), got "
                             f"{['None' if b is None else tuple(b.shape) for b in biases]}")
    if outs is not None:
        outs = list(outs)
        if len(outs) != len(weights):
            raise ValueError(f"outs must be None or one tensor per weight ({len(weights)}), got {len(outs)}")
    M = 0
    for i, w in enumerate(weights):
        b = biases[i] if biases is not None else None
        y = outs[i] if outs is not None else None
        if y is None and outs is not None:
            raise ValueError(f"outs[{i}] is None: outs must be None or one tensor per weight")
        try:
            M = _check(x, w, b, y)
        except ValueError as err:
            raise ValueError(f"grouped_skinny_linear, weight {i}: {err}") from None
        if not all(t is None or t.is_contiguous() for t in (w, b, y)):
            raise ValueError(f"weight {i}, its bias and its out must be contiguous for grouped_skinny_linear; "
                             "use skinny_linear for strided ones")
    K = x.shape[-1]
    if outs is None:
        outs = [torch.empty(*x.shape[:-1], w.shape[0], device=x.device, dtype=x.dtype) for w in weights]
    if M > 0 and K > 0 and sum(w.shape[0] for w in weights) > 0:
        from .triton_skinny import grouped_launch

        cfg = config if config is not None else skinny_config(sum(w.shape[0] for w in weights), K, x.dtype,
                                                              num_sms(x.device))
        grouped_launch(x.reshape(M, K), weights, biases, [y.view(M, y.shape[-1]) for y in outs], cfg)
    elif M > 0:  # K == 0: the bias alone
        for i, y in enumerate(outs):
            y.copy_(biases[i].expand_as(y) if biases is not None else torch.zeros_like(y))
    return outs


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
        if _kernel_applies(x, w, self.use_kernel, self.bias):
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


def _kernel_applies(x: torch.Tensor, w: torch.Tensor, use_kernel: bool, b: torch.Tensor | None = None) -> bool:
    """Whether :func:`skinny_linear` can take ``x @ w.T + b`` (and no gradient is wanted)."""
    return (use_kernel and x.dtype == w.dtype and w.dtype in DTYPES and x.device == w.device
            and x.dim() >= 1 and x.shape[-1] == w.shape[1] and 0 < x.numel() // max(1, w.shape[1]) <= MAX_ROWS
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))))


def tensor_version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, None for an inference tensor (which has none)."""
    return None if t.is_inference() else t._version


def _capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s device is capturing a CUDA graph on the current stream."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _takes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether a routed linear of weight ``w`` and bias ``b`` may run the kernels on ``x``: where
    :func:`skinny_linear` applies, with a contiguous weight and bias."""
    return _kernel_applies(x, w, True, b) and w.is_contiguous() and (b is None or b.is_contiguous())


class _Variants:
    """Launch variants of a kernel (keys of what its Triton build depends on) that ran outside a
    CUDA-graph capture (``warm``) or failed there (``failed``): a capture runs only warm ones, so
    no kernel is first built inside one; a failed one is not tried again."""

    def __init__(self):
        self.warm: set = set()
        self.failed: set = set()

    def run(self, key, x: torch.Tensor, launch, failure: str):
        """``launch()``'s result, or None where variant ``key`` may not run (failed before; not warm
        while ``x``'s device captures) or its launch fails outside a capture (then a
        ``RuntimeWarning`` "<failure first part> (error); <failure second part>", ``failure``
        split at ``;``). A failure inside a capture is raised."""
        capturing = _capturing(x)
        if key in self.failed or (capturing and key not in self.warm):
            return None
        try:
            out = launch()
        except Exception as err:  # noqa: BLE001 -- a kernel that cannot be built or run here: the caller's F.linear
            if capturing:
                raise
            head, _, tail = failure.partition(";")
            warnings.warn(f"{head} ({type(err).__name__}: {err});{tail}", RuntimeWarning, stacklevel=4)
            self.failed.add(key)
            return None
        self.warm.add(key)
        return out


class _Siblings:
    """Linears of one parent module that may read one input: which of them were seen to share it,
    what a merged call left for the members not yet called, and which launch variants ran
    outside a capture (see :func:`merged_linears`). Kept per group across blocks
    (:data:`_SIBLINGS`), so a capture in a later block uses what an earlier block's warm-up learnt.
    What a forward leaves in flight (the learning round, results not yet handed out) is per
    thread, and only threads inside a block merge."""

    def __init__(self, members: list[nn.Linear]):
        self._members = [weakref.ref(m) for m in members]  # (weak: :data:`_SIBLINGS` must not keep a model alive)
        #: the members seen to read one input one after another (>= 2), or None while learning
        self.merge: tuple[int, ...] | None = None
        self._variants = _Variants()  # of the grouped launch (:meth:`_variant`)
        self._local = threading.local()  # .depth (blocks entered), .round/.called (learning), .of/.left

    def is_for(self, members: list[nn.Linear]) -> bool:
        return len(members) == len(self._members) and all(ref() is m for ref, m in zip(self._members, members))

    @property
    def members(self) -> list[nn.Linear]:
        return [ref() for ref in self._members]

    def enter(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def exit(self) -> None:
        """The block ends on this thread: drop merged results not handed out (what was learnt stays)."""
        self._local.depth -= 1
        self._local.of, self._local.left = None, {}

    @staticmethod
    def _state(x: torch.Tensor):
        """What identifies ``x`` as an input: the object, its version counter (in-place writes through
        autograd bump it) and the grad mode; None for an inference tensor, which has no version
        counter (such inputs are neither merged nor learnt from)."""
        if x.is_inference():
            return None
        return weakref.ref(x), x._version, torch.is_grad_enabled()

    @staticmethod
    def _is(state, x: torch.Tensor) -> bool:
        return state is not None and state[0]() is x and x._version == state[1] and torch.is_grad_enabled() == state[2]

    @staticmethod
    def _params(member: nn.Linear):
        """The member's weight and bias as a merged result used them: the objects and versions (an
        inference tensor, e.g. a weight made under ``torch.inference_mode()``, has none: None)."""
        w, b = member.weight, member.bias
        return w, tensor_version(w), b, None if b is None else tensor_version(b)

    @staticmethod
    def _variant(x: torch.Tensor, merge, ms: list[nn.Linear]):
        """What the launch's compiled variant depends on: x's rows, strides, 16-byte alignment,
        dtype and device, the members merged (``merge``, the modules ``ms``), and their tensors'
        alignment (Triton specialises integers and pointers on such properties)."""
        aligned = all(t.data_ptr() % 16 == 0 for m in ms for t in (m.weight, m.bias) if t is not None)
        return (x.numel() // max(1, x.shape[-1]), x.stride(), x.data_ptr() % 16 == 0, x.dtype, x.device, merge,
                aligned)

    def _applies(self, x: torch.Tensor, merge) -> bool:
        members = self.members
        return all(_takes(x, members[j].weight, members[j].bias) for j in merge)

    def _grouped(self, x: torch.Tensor, merge) -> list[torch.Tensor] | None:
        """The members' results for ``x`` in one launch, or None where this launch variant has not
        run outside a capture yet (building a kernel inside a capture may not be allowed) or its
        kernel failed here (then that variant runs unmerged from now on, with a warning)."""
        ms = [self.members[j] for j in merge]
        return self._variants.run(
            self._variant(x, merge, ms), x,
            lambda: grouped_skinny_linear(x, [m.weight for m in ms],
                                          None if ms[0].bias is None else [m.bias for m in ms]),
            "merged projections: the grouped kernel failed; these linears run one by one for such inputs")

    def call(self, i: int, x: torch.Tensor) -> torch.Tensor:
        member = self._members[i]()
        local = self._local
        # the model's own linear: traced by torch.compile (a program compiled whole: the compiler fuses
        # it, and this group's bookkeeping -- version counters, weak references, thread state -- cannot
        # be traced), or on a thread outside every block
        if torch.compiler.is_compiling() or getattr(local, "depth", 0) < 1:
            return F.linear(x, member.weight, member.bias)
        left = getattr(local, "left", {})
        if i in left and self._is(local.of, x):
            y, params = left.pop(i)
            if params == self._params(member):  # (the member's tensors unchanged since the merged call)
                return y
        state = self._state(x)
        merge = self.merge
        if merge and i in merge and state is not None:
            if left:  # an earlier merged call's results were not all taken: the members stopped sharing
                self.merge, local.round, local.called = None, None, []
                local.of, local.left = None, {}
            elif self._applies(x, merge):
                outs = self._grouped(x, merge)
                if outs is not None:
                    ms = self.members
                    local.of = state
                    local.left = {j: (y, self._params(ms[j])) for j, y in zip(merge, outs) if j != i}
                    return outs[merge.index(i)]
        if self.merge is None and state is not None:
            called = getattr(local, "called", [])
            if not self._is(getattr(local, "round", None), x) or i in called:  # a new round: the last one shared?
                if len(called) > 1:
                    self.merge = tuple(sorted(called))
                local.round, called = state, []
            called.append(i)
            local.called = called
            if len(called) == len(self._members):
                self.merge = tuple(range(len(self._members)))
                if not _capturing(x) and self._applies(x, self.merge):
                    self._grouped(x, self.merge)  # built and run once now, so a capture right after merges
        return _unmerged(member, x)


#: each group's :class:`_Siblings`, by its first member (kept while the module lives)
_SIBLINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _siblings(members: list[nn.Linear]) -> _Siblings:
    kept = _SIBLINGS.get(members[0])
    if kept is None or not kept.is_for(members):
        kept = _SIBLINGS[members[0]] = _Siblings(members)
    return kept


def sibling_groups(model: nn.Module, skip=lambda module: False) -> list[list[nn.Linear]]:
    """Candidate sibling groups of ``model``: for each module (not under one ``skip`` accepts), its
    direct ``nn.Linear`` children (exactly that class, without forward hooks) of one
    ``in_features``, dtype, device and bias presence, in registration order, cut into groups of at most :data:`MAX_MEMBERS`; groups of
    one are left out. Whether they read the same input is learnt at run time (:func:`merged_linears`)."""
    groups = []
    skipped: set[int] = set()
    for parent in model.modules():
        if id(parent) in skipped or skip(parent):
            skipped.update(id(m) for m in parent.modules())
            continue
        kinds: dict = {}
        for child in parent.children():
            # (a linear with forward hooks, e.g. pruning's or an offloading hook, may change its weight per call)
            if type(child) is nn.Linear and unhooked(child):
                w = child.weight
                kinds.setdefault((child.in_features, w.dtype, w.device, child.bias is None), []).append(child)
        for members in kinds.values():
            for at in range(0, len(members), MAX_MEMBERS):
                chunk = members[at:at + MAX_MEMBERS]
                if len(chunk) > 1:
                    groups.append(chunk)
    return groups


@contextlib.contextmanager
def merged_linears(model: nn.Module, *, backend_name: str | None = None, groups=None):
    """Within the block, sibling linears of ``model`` that read one input run as one
    :func:`grouped_skinny_linear` launch: the first member called computes every member's result
    and the others take theirs. ``groups``: the candidate groups (lists of ``model``'s
    ``nn.Linear`` modules, at most :data:`MAX_MEMBERS` each); None takes :func:`sibling_groups`.
    Yields the number of candidate groups.

    A group merges only the members seen to share their input: until two or more of them have
    been called with the same tensor (the same object, its version counter unchanged, the same
    grad mode) one after another -- all of them, or a round of calls ended by another input --
    each runs ``F.linear``; the members seen together merge from then on: a member called with an
    input the last merged call did not see runs the group's launch and keeps the others' results
    for them; when some of those results are never taken (the members stopped sharing their
    input), the group learns again. So a first forward runs unmerged and the ones after it
    merged. A CUDA-graph capture merges only launch variants (rows, strides, alignment) that ran
    before it outside a capture, so no kernel is first built inside one; a group whose members
    were all seen together runs its launch once right then, so one warm-up suffices. What a group
    learnt is kept for its modules across blocks; what one forward leaves in flight is per thread,
    and a thread outside every block runs ``F.linear``. A merged result is handed out only while
    the member's weight and bias are the same tensors at the same versions; linears with forward
    hooks (pruning, offloading) are not grouped. If the grouped kernel fails outside a capture, a
    ``RuntimeWarning`` says why and inputs of that launch variant run unmerged from then on.

    Members run the kernel where :func:`skinny_linear` applies (``backend_name`` or the weights'
    device's backend is ``"triton"``, at most :data:`MAX_ROWS` rows, no gradient, not inside
    ``torch.compile``), ``F.linear`` otherwise; groups on another backend are not routed at all.
    Inference tensors (``torch.inference_mode``) have no version counter: they run ``F.linear``.
    Writes to an input that bypass its version counter (``x.data``, another library's kernel)
    between two members' calls are not seen: the block is meant for model forwards, as the
    CUDA-graph capture runs them. The modules themselves are not replaced (their ``forward`` is
    routed for the block, for every thread), so parameters, state dicts and hooks stay as they are.

    Raises:
        ValueError: an unknown backend name, a group of more than :data:`MAX_MEMBERS`, a group
            whose members differ in input width, dtype, device or having a bias, or a linear in
            two groups.
    """
    from .. import BACKENDS, backend
    from ...placement import routed_forward

    if backend_name is not None and backend_name not in BACKENDS:
        raise ValueError(f"backend_name must be one of {BACKENDS} or None, got {backend_name!r}")
    groups = sibling_groups(model) if groups is None else [list(g) for g in groups]
    if any(len(g) > MAX_MEMBERS for g in groups):
        raise ValueError(f"merged_linears: groups of at most {MAX_MEMBERS} linears, got sizes {[len(g) for g in groups]}")
    seen: set[int] = set()
    for g in groups:
        kinds = {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in g}
        if len(kinds) > 1:
            raise ValueError("merged_linears: a group's linears must share input width, dtype, device and having a "
                             f"bias or not; got (in_features, dtype, device, no bias) = {sorted(map(str, kinds))}")
        if any(id(m) in seen for m in g) or len({id(m) for m in g}) < len(g):
            raise ValueError("merged_linears: a linear may belong to one group only")
        seen.update(id(m) for m in g)
    sibs = []
    try:
        with contextlib.ExitStack() as stack:
            for members in groups:
                if (backend_name or backend(members[0].weight.device)) != "triton":
                    continue
                sib = _siblings(members)  # (routed only where the kernel's backend is on)
                sib.enter()
                sibs.append(sib)
                for i, m in enumerate(members):
                    stack.enter_context(routed_forward(m, lambda mod, x, _i=i, _s=sib: _s.call(_i, x)))
            yield len(groups)
    finally:
        for sib in sibs:
            sib.exit()



_SINGLE = threading.local()  # .depth: single_linears blocks this thread is inside; .max_rows: the innermost's
#: the launch variants (:func:`_single_variant`) run outside a capture / failed there (a variant is
#: the kernel Triton builds for such arguments, whichever linear's they were)
_SINGLE_VARIANTS = _Variants()


def _single_variant(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """What a :func:`skinny_linear` launch's compiled variant depends on (Triton specialises integers
    and pointers on their values' divisibility): the ``[M, K]`` input's rows, strides and
    alignment, the weight's shape and alignment, the bias's alignment, dtype and device."""
    return (tuple(x2.shape), x2.stride(), x2.data_ptr() % 16 == 0, x2.dtype, x2.device, tuple(w.shape), w.stride(),
            w.data_ptr() % 16 == 0, None if b is None else b.data_ptr() % 16 == 0)


def _single_guarded(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """:func:`skinny_linear` for a thread inside a :func:`single_linears` block where its launch
    variant may run (not first built inside a capture, not failed before), ``F.linear`` otherwise;
    a failure outside a capture warns once per variant."""
    if getattr(_SINGLE, "depth", 0) < 1:
        return F.linear(x, w, b)
    y = _SINGLE_VARIANTS.run(_single_variant(x.reshape(-1, x.shape[-1]), w, b), x, lambda: skinny_linear(x, w, b),
                             f"skinny linears: the kernel failed; a linear of weight {tuple(w.shape)} runs F.linear "
                             "for such inputs")
    return F.linear(x, w, b) if y is None else y


@torch.library.custom_op("specdec::single_linear", mutates_args=())
def _single_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_single_guarded` as one opaque op for ``torch.compile``: the guards (the thread's
    block, the launch variants run outside a capture, failures) are checked when it runs, not when
    it is traced."""
    return _single_guarded(x, weight, bias)


@_single_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _single_call(mod: nn.Linear, x: torch.Tensor, max_rows: int) -> torch.Tensor:
    w, b = mod.weight, mod.bias
    if not (_takes(x, w, b) and x.numel() // max(1, w.shape[1]) <= max_rows):
        return F.linear(x, w, b)
    if torch.compiler.is_compiling():  # traced inside a compiled module: one opaque op, its guards run with it
        return _single_linear_op(x, w, b)
    return _single_guarded(x, w, b)


def _unmerged(member: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A sibling group's member that runs on its own: through the skinny kernel inside a
    :func:`single_linears` block on this thread (at that block's rows), ``F.linear`` otherwise."""
    if getattr(_SINGLE, "depth", 0) > 0:
        return _single_call(member, x, _SINGLE.max_rows)
    return F.linear(x, member.weight, member.bias)


@contextlib.contextmanager
def single_linears(linears, *, max_rows: int = SINGLE_MAX_ROWS, backend_name: str | None = None):
    """Within the block, on threads inside it, each of ``linears`` (``nn.Linear`` modules, exactly
    that class) runs :func:`skinny_linear` for inputs of at most ``max_rows`` rows, ``F.linear``
    otherwise; so do the members of :func:`merged_linears` groups that run on their own (not
    merged: a group still learning, or members that do not share their input). This is for the
    linears a decode step does not merge (an MLP's, an output projection, the LM head), where the
    kernel reads a decode step's weights faster than cuBLAS (see :data:`SINGLE_MAX_ROWS`). Inside
    ``torch.compile`` (a compiled module around the linear) it is one opaque op
    (``torch.ops.specdec.single_linear``) that checks the guards below when it runs. Yields the
    number of linears routed.

    As in :func:`merged_linears`: the kernel runs where :func:`skinny_linear` applies (the
    linear's device's backend, or ``backend_name``, is ``"triton"``; no gradient; a contiguous
    weight and bias); a CUDA-graph capture runs the kernel only for launch variants (rows,
    strides, alignment) that ran before it outside a capture, so no kernel is first built inside
    one; a kernel that fails outside a capture gives a ``RuntimeWarning`` and ``F.linear`` for
    that variant from then on. The modules are not replaced (their ``forward`` is routed for the
    block), so parameters, state dicts and hooks stay as they are.

    Raises:
        ValueError: an unknown backend name, ``max_rows`` not an int in 1..:data:`MAX_ROWS`, or
            ``linears`` not an iterable of ``nn.Linear`` modules (subclasses, whose own forward
            would be bypassed, included).
    """
    from .. import BACKENDS, backend
    from ...placement import routed_forward

    if backend_name is not None and backend_name not in BACKENDS:
        raise ValueError(f"backend_name must be one of {BACKENDS} or None, got {backend_name!r}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_ROWS:
        raise ValueError(f"max_rows must be an int in 1..{MAX_ROWS}, got {max_rows!r}")
    if isinstance(linears, nn.Module):
        raise ValueError(f"single_linears takes an iterable of nn.Linear modules, got one {type(linears).__name__}")
    unique = list({id(m): m for m in linears}.values())
    bad = [type(m).__name__ for m in unique if type(m) is not nn.Linear]
    if bad:
        raise ValueError(f"single_linears takes nn.Linear modules (exactly that class: a subclass's own forward "
                         f"would be bypassed), got {sorted(set(bad))}")
    outer = getattr(_SINGLE, "max_rows", None)
    _SINGLE.depth, _SINGLE.max_rows = getattr(_SINGLE, "depth", 0) + 1, max_rows
    try:
        with contextlib.ExitStack() as stack:
            routed = 0
            for m in unique:
                if (backend_name or backend(m.weight.device)) == "triton":
                    stack.enter_context(routed_forward(m, lambda mod, x: _single_call(mod, x, max_rows)))
                    routed += 1
            yield routed
    finally:
        _SINGLE.depth -= 1
        _SINGLE.max_rows = outer


#: the launch variants of :func:`mlp_hidden` run outside a capture / failed there
_MLP_VARIANTS = _Variants()


def mlp_hidden(x: torch.Tensor, plan) -> torch.Tensor | None:
    """The input of an MLP's down projection -- ``act(gate(x)) * up(x)`` by
    :func:`gated_skinny_linear`, or ``act(up(x))`` by :func:`skinny_linear` with its activation --
    in one launch, for a thread inside a :func:`single_linears` block and an ``x`` of at most that
    block's rows; None where the MLP must run its own forward instead: outside such a block, more
    rows, a weight or bias the kernel does not take (:func:`skinny_linear`'s conditions, a
    non-contiguous weight), a launch variant not yet run outside a CUDA-graph capture (none is
    first built inside one) or one that failed before (a ``RuntimeWarning`` the first time).

    Args:
        x: ``[..., K]``, the MLP's input.
        plan: a :class:`specdec.models.mlp.MLPPlan` (its projections and activation).

    Returns:
        ``[..., N]`` in ``x.dtype``, or None.
    """
    if getattr(_SINGLE, "depth", 0) < 1 or x.numel() // max(1, x.shape[-1]) > _SINGLE.max_rows:
        return None
    if plan.halves:  # one [2N, K] projection whose output's first half is the gate
        w, b = plan.up.weight, plan.up.bias
        n = w.shape[0] // 2
        gw, gb, uw, ub = w[:n], None if b is None else b[:n], w[n:], None if b is None else b[n:]
    elif plan.gate is not None:
        gw, gb, uw, ub = plan.gate.weight, plan.gate.bias, plan.up.weight, plan.up.bias
    else:
        gw, gb, uw, ub = plan.up.weight, plan.up.bias, None, None
    if not (_takes(x, gw, gb) and (uw is None or _takes(x, uw, ub) and (gb is None) == (ub is None))):
        return None
    x2 = x.reshape(-1, x.shape[-1])
    key = (plan.activation, _single_variant(x2, gw, gb), None if uw is None else (uw.data_ptr() % 16 == 0,
                                                                                  None if ub is None else ub.data_ptr() % 16 == 0))
    if uw is None:
        launch = lambda: skinny_linear(x, gw, gb, activation=plan.activation)  # noqa: E731
    else:
        launch = lambda: gated_skinny_linear(x, gw, uw, gb, ub, activation=plan.activation)  # noqa: E731
    return _MLP_VARIANTS.run(key, x, launch, f"fused MLP: the kernel failed; an MLP of weight {tuple(gw.shape)} runs "
                             "its own forward for such inputs")


def mlp_activation_reference(g: torch.Tensor, u: torch.Tensor | None, activation: str) -> torch.Tensor:
    """An MLP's hidden state from its projections as its eager module computes it: ``act(g) * u``
    (a gated MLP; the activation rounded to g's dtype first) or ``act(g)`` (``u`` None), in g's
    dtype (:func:`activation_ref`'s activations)."""
    h = activation_ref(g, activation).to(g.dtype)
    return h if u is None else h * u


def mlp_activation(g: torch.Tensor, u: torch.Tensor | None, activation: str) -> torch.Tensor:
    """:func:`mlp_activation_reference` in one Triton launch (one pass over the rows, where eagerly
    a gated MLP's activation and product are two launches and three passes).

    Args:
        g: ``[..., N]`` the gate projection's output (a gated MLP) or the up projection's, fp32 /
            bf16 / fp16, rows contiguous in N at any row stride (e.g. a half of a fused gate-up
            projection's output; else copied). u: the up projection's output of g's shape, dtype
            and device, or None. activation: ``"silu"`` or ``"relu2"``.

    Returns:
        ``[..., N]`` in g's dtype, contiguous.

    Raises:
        ValueError: another activation or dtype, or ``u`` not like ``g``.
    """
    from .triton_activation import mlp_activation_triton

    return mlp_activation_triton(g, u, activation)
