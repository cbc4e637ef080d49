"""Mamba-2 over a whole prompt: the chunked state-space-dual (SSD) scan, in torch matmuls and
through flash-linear-attention's chunked kernel.

The recurrence is the one of :mod:`specdec.kernels.mamba2.naive` (``h_t = exp(dt_t A) h_{t-1} +
dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``, state ``[B, H, P, N]``). Over a prompt it is computed
in chunks of ``l`` tokens (Dao & Gu, "Transformers are SSMs", ICML 2024, Listing 1,
``ssd_minimal_discrete``): inside a chunk as a masked, decay-weighted attention
``(C_i . B_j) exp(a_i - a_j) (dt_j x_j)`` (``a`` the within-chunk cumulative sum of ``dt A``),
across chunks through each chunk's final state. Memory is ``O(B * L * l * H)`` (the
``[.., l, l]`` decay-weighted scores per chunk and head), never the ``[.., l, l, H, N]`` product
of transformers' torch fallback; long prompts run in segments that carry the state, so the
scores of at most :data:`SEGMENT_BYTES` are alive at once.

:func:`mamba2_chunk_scan_fla` runs the same scan through ``fla.ops.simple_gla.chunk_simple_gla``
(flash-linear-attention, CUDA): q = C, k = B (groups expanded to heads, :func:`expand_groups`),
v = dt x, log decay ``g = dt A``, scale 1. Its matmuls run in TF32 for fp32 operands, so it agrees
with the fp32 scan to about 1e-3 relative, not 1e-6; a bf16 model's prefill hands it bf16
operands and gets ``y`` back in bf16, as mamba_ssm's kernels take and return them (about 1e-2).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

__all__ = ["SCANS", "SEGMENT_BYTES", "FLA_MIN_VERSION", "resolve_scan", "fla_available", "fla_version", "mamba2_chunk_scan", "mamba2_chunk_scan_fla",
           "mamba2_prompt_scan", "expand_groups", "discretized_input", "add_skip_"]

#: the prompt-scan choices: ``auto`` (``fla`` for a bf16 / fp16 model on CUDA when importable,
#: else ``torch``), ``fla``,
#: ``torch`` (:func:`mamba2_chunk_scan`), ``hf`` (transformers' own mixer forward)
SCANS = ("auto", "fla", "torch", "hf")
#: bytes of fp32 chunk scores (``[B, chunks, H, l, l]``) one segment of :func:`mamba2_chunk_scan` may hold
SEGMENT_BYTES = 1 << 30


#: the oldest flash-linear-attention release whose kernels take what specdec passes them (the
#: V-first state layout, key heads shared by groups of value heads)
FLA_MIN_VERSION = "0.6"


def fla_version() -> str | None:
    """The installed flash-linear-attention's version (its ``fla-core`` or
    ``flash-linear-attention`` distribution's; without distribution metadata, e.g. a source
    checkout on the path, ``fla.__version__``), or None when ``fla`` is not importable."""
    if importlib.util.find_spec("fla") is None:
        return None
    from importlib import metadata

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        import fla

        return str(getattr(fla, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 (an fla that fails to import is not available, whatever it raised)
        return "unknown"


def fla_available() -> bool:
    """Whether flash-linear-attention (``fla``) is installed, at :data:`FLA_MIN_VERSION` or later
    (its pre-releases and development builds included)."""
    from packaging.version import InvalidVersion, Version

    found = fla_version()
    try:
        return found is not None and Version(found).release >= Version(FLA_MIN_VERSION).release
    except InvalidVersion:
        return False


def resolve_scan(scan: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """The scan ``scan`` (one of :data:`SCANS`) means for a model of ``dtype`` on ``device``:
    ``"fla"``, ``"torch"`` or ``"hf"``.

    ``auto`` is ``fla`` on CUDA when flash-linear-attention (:data:`FLA_MIN_VERSION` or later) is installed and the model is not
    fp32 (fla's TF32 matmuls round below a bf16 model's own precision, not an fp32 model's),
    else ``torch``.

    Raises:
        ValueError: ``scan`` is not one of :data:`SCANS`, or ``"fla"`` where flash-linear-attention
            is not installed (or older than :data:`FLA_MIN_VERSION`) or ``device`` is not CUDA.
    """
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}; got {scan!r}")
    on_cuda = torch.device(device).type == "cuda"
    if scan == "auto":
        return "fla" if on_cuda and dtype != torch.float32 and fla_available() else "torch"
    if scan == "fla" and not (on_cuda and fla_available()):
        found = fla_version()
        fla = "is not installed" if found is None else f"{found} is installed"
        raise ValueError(f"scan='fla' needs CUDA tensors and flash-linear-attention >= {FLA_MIN_VERSION} (pip install "
                         f"'specdec[fla]'); device is {torch.device(device)}, fla {fla}; use scan='torch' or 'auto'")
    return scan


def _check(x, dt, A, B, C, initial_state):
    b, L, H, P = x.shape
    if dt.shape != (b, L, H) or A.shape != (H,) or B.shape != C.shape or B.shape[:2] != (b, L) or H % B.shape[2]:
        raise ValueError(f"mamba2 scan shapes: x {tuple(x.shape)} [B, L, H, P], dt {tuple(dt.shape)} [B, L, H], "
                         f"A {tuple(A.shape)} [H], B {tuple(B.shape)} / C {tuple(C.shape)} [B, L, G, N] with G | H")
    N = B.shape[-1]
    if initial_state is not None and initial_state.shape != (b, H, P, N):
        raise ValueError(f"initial_state must be [B, H, P, N] = {(b, H, P, N)}; got {tuple(initial_state.shape)}")


def _chunk_scan_segment(x, dt, A, B, C, chunk_size: int, h0):
    """One segment of :func:`mamba2_chunk_scan` (no D): ``(y [b, L, H, P], h [b, H, P, N])`` fp32."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    R = H // G
    l = chunk_size
    pad = (-L) % l
    if pad:  # zero inputs after the prompt: a = 0 (no decay), dt x = 0 (no input); outputs cut below
        x, dt, B, C = (F.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad)) for t in (x, dt, B, C))
    c = (L + pad) // l
    xdt = (x * dt[..., None]).view(b, c, l, G, R, P)
    a = torch.cumsum((dt * A).view(b, c, l, H), dim=2)                    # within-chunk cumsum of dt A
    Bc, Cc = B.view(b, c, l, G, N), C.view(b, c, l, G, N)

    # 1. within each chunk: y_i = sum_{j <= i} (C_i . B_j) exp(a_i - a_j) dt_j x_j
    at = a.permute(0, 1, 3, 2)                                            # [b, c, H, l]
    causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
    scores = at[..., :, None] - at[..., None, :]                          # [b, c, H, l, l], in place below
    scores = scores.masked_fill_(~causal, float("-inf")).exp_().view(b, c, G, R, l, l)
    scores.mul_(torch.einsum("bcign,bcjgn->bcgij", Cc, Bc)[:, :, :, None])  # (C_i . B_j) exp(a_i - a_j)
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", scores, xdt)
    del scores

    # 2. each chunk's final state from a zero start: sum_j exp(a_last - a_j) dt_j x_j B_j^T
    to_end = torch.exp(a[:, :, -1:] - a).view(b, c, l, G, R, 1)
    S = torch.einsum("bcjgrp,bcjgn->bcgrpn", xdt * to_end, Bc)             # [b, c, G, R, P, N]

    # 3. across chunks: the state entering chunk z, from h0 and the chunks before it; the
    # decays between chunk ends are segment sums (no cumsum differences: stable for long prompts)
    total = a[:, :, -1].transpose(1, 2)                                   # [b, H, c]
    seg = F.pad(total, (1, 0))[..., :, None].expand(b, H, c + 1, c + 1)   # [z, j] = total'_z
    lower = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device)
    seg = seg.masked_fill(~lower.tril(-1), 0).cumsum(-2).masked_fill(~lower.tril(), float("-inf"))
    chunk_decay = torch.exp(seg).view(b, G, R, c + 1, c + 1)               # [z, j]: exp(sum_{j<k<=z} total_k)
    starts = torch.cat([h0.reshape(b, 1, G, R, P, N), S], dim=1)           # h0, then chunk 0.. c-1 states
    states = torch.einsum("bgrzj,bjgrpn->bzgrpn", chunk_decay, starts)    # [b, c + 1, G, R, P, N]
    h_in, h_last = states[:, :-1], states[:, -1]

    # 4. the entering state's contribution: exp(a_i) C_i . h_in
    y = y + torch.einsum("bcign,bcgrpn->bcigrp", Cc, h_in) * torch.exp(a).view(b, c, l, G, R, 1)
    y = y.reshape(b, c * l, H, P)[:, :L]
    return y, h_last.reshape(b, H, P, N)


def mamba2_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      chunk_size: int, D: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                      segment_bytes: int = SEGMENT_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 over ``L`` tokens by the chunked SSD algorithm, in fp32 torch matmuls.

    Args:
        x: ``[B, L, H, P]``; dt: ``[B, L, H]`` discretised step (softplus'd, clamped); A: ``[H]`` (< 0);
            B, C: ``[B, L, G, N]``, each group shared by ``H / G`` consecutive heads; any float dtype
            (computed in fp32).
        chunk_size: tokens per chunk ``l`` (the model config's ``chunk_size``); any L works.
        D: ``[H]`` skip weight or None.
        initial_state: ``[B, H, P, N]`` or None (zeros).
        segment_bytes: the fp32 chunk scores ``[B, chunks, H, l, l]`` of one segment stay within
            this many bytes (at least one chunk per segment); the state carries across segments.

    Returns:
        ``(y [B, L, H, P], final_state [B, H, P, N])``, fp32.

    Raises:
        ValueError: inconsistent shapes, or ``chunk_size < 1``.
    """
    _check(x, dt, A, B, C, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    f32 = torch.float32
    x, dt, A, B, C = (t.to(f32) for t in (x, dt, A, B, C))
    b, L, H, P = x.shape
    h = initial_state.to(f32) if initial_state is not None else x.new_zeros(b, H, P, B.shape[-1])
    per_chunk = 4 * b * H * chunk_size * chunk_size
    seg_len = chunk_size * max(1, segment_bytes // per_chunk)
    ys = []
    for s in range(0, L, seg_len):
        e = min(L, s + seg_len)
        y, h = _chunk_scan_segment(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], chunk_size, h)
        ys.append(y)
    y = torch.cat(ys, dim=1) if len(ys) != 1 else ys[0]
    if D is not None:
        y = y + x * D.to(f32)[:, None]
    return y, h


def expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t [B, L, G, N]`` with each group repeated for its ``heads / G`` consecutive heads:
    ``[B, L, heads, N]``, bit for bit ``t.repeat_interleave(heads // G, dim=2)`` (a contiguous
    copy; ``t`` itself where ``G == heads``).

    ``repeat_interleave`` by a number is an expand and a copy whose source repeats along one dim
    (stride 0): PyTorch's element-wise copy cannot vectorise it and moves one element per thread
    step, 2 bytes for bf16. Where each row's ``N`` elements are whole 8-byte words (row, strides
    and offset aligned) the same copy moves them as int64 words: the same bytes in a quarter of
    the element steps (bf16; half for fp32). ``heads`` must be a multiple of ``G`` (checked by
    the scans' callers).
    """
    b, L, G, N = t.shape
    R = heads // G
    ratio = 8 // t.element_size()
    words = (ratio > 1 and t.stride(-1) == 1 and N % ratio == 0 and t.storage_offset() % ratio == 0
             and all(s % ratio == 0 for s in t.stride()[:-1]))
    src = t.view(torch.int64) if words else t
    out = src.unsqueeze(3).expand(b, L, G, R, src.shape[-1]).reshape(b, L, heads, src.shape[-1])
    return out.view(t.dtype) if words else out


def _triton(t: torch.Tensor) -> bool:
    from ...fusion import prompt_kernels_enabled
    from .. import backend

    return backend(t.device) == "triton" and prompt_kernels_enabled()


def discretized_input(x: torch.Tensor, dt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mamba-2's discretised input ``v = dt x``: ``x [B, L, H, P]`` (any float dtype, any layout
    whose head channels are contiguous, e.g. a slice of the conv's output) times ``dt [B, L, H]``,
    the product in fp32 rounded once to ``dtype``. One Triton launch on the Triton backend
    (:mod:`specdec.kernels.mamba2.triton_heads`; unless ``SPECDEC_PROMPT_KERNELS=0``), else
    ``torch.mul`` (the reference).

    Returns: ``[B, L, H, P]`` in ``dtype``, contiguous.

    Raises: ValueError: ``dt`` not ``[B, L, H]``; on the Triton backend, ``x`` or ``dtype`` not fp32,
        bf16 or fp16.
    """
    if _triton(x):
        from .triton_heads import discretized_input_triton

        return discretized_input_triton(x, dt, dtype)
    if dt.shape != x.shape[:3]:
        raise ValueError(f"expected x [B, L, H, P] and dt [B, L, H]; got {tuple(x.shape)} and {tuple(dt.shape)}")
    return torch.mul(x, dt.to(torch.float32)[..., None], out=x.new_empty(x.shape, dtype=dtype))


def add_skip_(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """Mamba-2's skip added in place: ``y += x D`` for ``y [B, L, H, P]`` (contiguous), ``x`` of its
    shape (any layout whose head channels are contiguous), ``D [H]``; the multiply-add in fp32
    rounded once to y's dtype. One Triton launch on the Triton backend, else ``Tensor.addcmul_``
    (the reference). Returns ``y``.

    Raises: ValueError: shapes that do not fit, or ``y`` not contiguous; on the Triton backend,
        ``x`` or ``y`` not fp32, bf16 or fp16.
    """
    if _triton(y):
        from .triton_heads import add_skip_triton_

        return add_skip_triton_(y, x, D)
    if y.shape != x.shape or D.shape != x.shape[2:3] or not y.is_contiguous():
        raise ValueError(f"expected y [B, L, H, P] contiguous, x of its shape and D [H]; got {tuple(y.shape)}, "
                         f"{tuple(x.shape)}, {tuple(D.shape)}{'' if y.is_contiguous() else ' (y not contiguous)'}")
    return y.addcmul_(x, D.to(torch.float32)[:, None])


def mamba2_chunk_scan_fla(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None = None,
                          initial_state: torch.Tensor | None = None,
                          operand_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mamba2_chunk_scan` through flash-linear-attention's ``chunk_simple_gla`` (CUDA only).

    Mamba-2 is scalar-gated linear attention: ``q = C``, ``k = B`` (groups expanded to heads),
    ``v = dt x``, log decay ``g = dt A``, scale 1; fla keeps the state V-first, ``[B, H, V, K] =
    [B, H, P, N]``, this module's layout. Arguments as :func:`mamba2_chunk_scan` (fla picks its own
    chunk size).

    ``operand_dtype`` is the dtype of the matmul operands ``q``, ``k``, ``v`` and of ``y``: fp32
    (fla's matmuls then run in TF32), or a bf16 / fp16 model's own dtype, as mamba_ssm's
    ``mamba_chunk_scan_combined`` takes them and returns ``y`` (Dao & Gu, "Transformers are SSMs",
    2024): half the bytes of the head-expanded ``q`` and ``k``. ``x``, ``B``, ``C`` may come in
    that dtype (a bf16 model's prefill hands them so) or any other float dtype; ``v = dt x`` is
    formed in fp32 and rounded once, the skip ``y + D x`` added in fp32 and rounded once (as
    mamba_ssm's kernel adds it). The decay, the accumulation and the final state are fp32; fla keeps
    the per-chunk states the output is read from in ``operand_dtype`` (as mamba_ssm's chunk scan
    does), so with fp16 operands a large state can overflow.

    Returns:
        ``(y [B, L, H, P] in operand_dtype, final_state [B, H, P, N] fp32)``.

    Raises:
        ValueError: inconsistent shapes, or ``operand_dtype`` not fp32, bf16 or fp16.
        ImportError: flash-linear-attention is not installed.
    """
    _check(x, dt, A, B, C, initial_state)
    if operand_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"operand_dtype must be torch.float32, torch.bfloat16 or torch.float16; got {operand_dtype}")
    from fla.ops.simple_gla import chunk_simple_gla

    f32 = torch.float32
    H = x.shape[2]
    q = expand_groups(C.to(operand_dtype), H)
    k = expand_groups(B.to(operand_dtype), H)
    v = discretized_input(x, dt, operand_dtype)  # fp32 product, one rounding
    h0 = initial_state.to(f32) if initial_state is not None else None
    y, ht = chunk_simple_gla(q, k, v, g=dt.to(f32) * A.to(f32), scale=1.0, initial_state=h0,
                             output_final_state=True, state_v_first=True)  # y in operand_dtype
    if D is not None:
        add_skip_(y, x, D)  # y + D x in fp32, one rounding
    return y, ht  # [B, H, P, N], as the caches keep it


def mamba2_prompt_scan(scan: str, x, dt, A, B, C, chunk_size: int, D=None, initial_state=None,
                       operand_dtype: torch.dtype = torch.float32):
    """:func:`mamba2_chunk_scan_fla` for ``scan == "fla"`` (with ``operand_dtype``; ``y`` in that
    dtype), else :func:`mamba2_chunk_scan` (fp32 throughout); ``scan`` as :func:`resolve_scan`
    returns it; arguments and returns as those."""
    if scan == "fla":
        return mamba2_chunk_scan_fla(x, dt, A, B, C, D, initial_state, operand_dtype)
    return mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D, initial_state)
