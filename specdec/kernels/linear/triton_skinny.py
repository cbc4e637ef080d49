"""Triton kernels of the skinny linear layer (:func:`specdec.kernels.linear.skinny_linear`):
``y [M, N] = x [M, K] @ weight[N, K].T + bias`` for M <= 64 rows, with the weight streamed once.

Layout (the weight as the MMA's M side, "swap AB", as TensorRT-LLM's small-M GEMMs): each program owns a
``BLOCK_N`` slice of the weight's rows and, for split ``i_s``, a range of K; it walks its K
range in ``BLOCK_K`` steps, loading a ``[BLOCK_N, BLOCK_K]`` weight tile (K contiguous: 16-byte
vector loads, software-pipelined over ``num_stages`` steps) and, for each 16-row tile of x, a
``[16, BLOCK_K]`` x tile; every x tile multiplies the same weight tile (``tl.dot``: tensor cores
for bf16 / fp16, exact fp32 FMAs for fp32), so the weight is read once for all M rows. The
accumulators are fp32 ``[BLOCK_N, 16]``, one per 16-row tile (at most four). Off CUDA (Triton's
interpreter, for tests) bf16 tiles are upcast to fp32 before the dot (``UPCAST``): the
interpreter cannot multiply bf16, and bf16 products are exact in fp32.

Batch invariance (as in H. He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines Lab, 2025: one kernel configuration for every batch size): every 16-row tile runs the
same instructions (the same dot shape, the same K order), and the launch setting depends on
(N, K, dtype) alone, never on M; so each output element's reduction order is the same whatever M
is, and row i of an M-row call equals the 1-row call on x[i] bit for bit
(tests/test_skinny_linear.py).

Split K (``split_k > 1``): each split writes its fp32 partial sums to ``[split_k, M, N]``; a
second small kernel adds them in split order (0, 1, ...), adds the bias and casts: deterministic,
no atomics. Nothing here autotunes, synchronises with the host or reads a device value, so a
call is safe inside CUDA-graph capture once compiled.

Epilogues (where the result is stored: the kernel's, or the split-K reduction's): an activation
(``ACT``: SiLU or squared ReLU, :data:`ACT_CODES`) of the result rounded to the output dtype, as
``act(linear(x))`` computes it eagerly; and ``GATED``: a second weight of the same shape (a gated
MLP's up projection) multiplied in the same K loop -- each x tile loaded once for both, a second
set of accumulators (partials ``[2, split_k, M, N]`` when split) -- and the stored value
``act(gate) * up``, each factor rounded where the eager module rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import next_pow2, num_warps_for
from . import MAX_MEMBERS

__all__ = ["TILE_M", "ACT_CODES", "skinny_launch", "grouped_launch"]

#: rows of x per tile (the smallest dot dimension Triton accepts)
TILE_M = 16
#: the epilogue's activation code for each name of :data:`specdec.kernels.linear.ACTIVATIONS` (None: none)
ACT_CODES = {None: 0, "silu": 1, "relu2": 2}


@triton.jit
def _x_tile(x, i_t, M, k, k_hi, stride_xm, stride_xk, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """x's ``[16, BLOCK_K]`` tile: rows of tile i_t, columns ``k : k + BLOCK_K`` (zeros past M and k_hi)."""
    o_m = i_t * 16 + tl.arange(0, 16)
    o_k = k + tl.arange(0, BLOCK_K)
    p_x = x + o_m[:, None] * stride_xm + o_k[None, :] * stride_xk
    if EVEN_K:
        return tl.load(p_x, mask=(o_m < M)[:, None], other=0.0)
    return tl.load(p_x, mask=(o_m < M)[:, None] & (o_k < k_hi)[None, :], other=0.0)


@triton.jit
def _dot(b_acc, b_w, b_x, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``b_acc [BLOCK_N, 16] += b_w [BLOCK_N, BLOCK_K] @ b_x [16, BLOCK_K].T``."""
    if UPCAST:  # Triton's interpreter multiplies bf16 bit patterns as integers; bf16 x bf16 products are exact in fp32
        return tl.dot(b_w.to(tl.float32), tl.trans(b_x.to(tl.float32)), b_acc, input_precision=DOT_PRECISION)
    return tl.dot(b_w, tl.trans(b_x), b_acc, input_precision=DOT_PRECISION)


@triton.jit
def _tile_dots(b_acc, b_acc_u, b_w, b_w_u, x, i_t, M, k, k_hi, stride_xm, stride_xk, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, GATED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Tile i_t's sums over ``k : k + BLOCK_K``: ``b_acc += b_w @ x_tile.T`` and, ``GATED``, ``b_acc_u +=
    b_w_u @ x_tile.T`` (the x tile loaded once for both)."""
    b_x = _x_tile(x, i_t, M, k, k_hi, stride_xm, stride_xk, BLOCK_K, EVEN_K)
    b_acc = _dot(b_acc, b_w, b_x, DOT_PRECISION, UPCAST)
    if GATED:
        b_acc_u = _dot(b_acc_u, b_w_u, b_x, DOT_PRECISION, UPCAST)
    return b_acc, b_acc_u


@triton.jit
def _activate(v, ACT: tl.constexpr):
    """``act(v)`` in fp32 (codes: :data:`ACT_CODES`; 0 is the identity)."""
    if ACT == 1:  # silu, as torch computes it: v / (1 + exp(-v))
        return v / (1.0 + tl.exp(-v))
    if ACT == 2:  # squared ReLU (NaN stays NaN, as torch.relu leaves it)
        r = tl.where(v < 0.0, 0.0, v)
        return r * r
    return v


@triton.jit
def _epilogue(b_acc, b_acc_u, dtype: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr):
    """The value to store from fp32 sums (biases added): ``act(y)``, or ``GATED`` ``act(g) * u``, with
    each intermediate rounded to ``dtype`` where the eager module's would be (the linears' outputs,
    the activation's), so a bf16 result equals the eager chain's up to the activation's last bit."""
    if ACT != 0:
        b_acc = _activate(b_acc.to(dtype).to(tl.float32), ACT)
    if GATED:
        b_acc = b_acc.to(dtype).to(tl.float32) * b_acc_u.to(dtype).to(tl.float32)
    return b_acc


@triton.jit
def _tile_store(b_acc, b_acc_u, b, b_u, y, i_s, i_t, o_n, M, N, stride_ys, stride_ym, stride_yn, stride_yg,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr):
    """Store tile i_t's ``[BLOCK_N, 16]`` sums: fp32 partials of split i_s (``GATED``: the second
    weight's ``stride_yg`` further on), or (+ bias, through the epilogue) the result."""
    o_m = i_t * 16 + tl.arange(0, 16)
    m_y = (o_n < N)[:, None] & (o_m < M)[None, :]
    p_y = y + o_m[None, :] * stride_ym + o_n[:, None] * stride_yn
    if PARTIAL:
        tl.store(p_y + i_s * stride_ys, b_acc, mask=m_y)
        if GATED:
            tl.store(p_y + i_s * stride_ys + stride_yg, b_acc_u, mask=m_y)
    else:
        if HAS_BIAS:
            b_acc += tl.load(b + o_n, mask=o_n < N, other=0.0).to(tl.float32)[:, None]
            if GATED:
                b_acc_u += tl.load(b_u + o_n, mask=o_n < N, other=0.0).to(tl.float32)[:, None]
        b_acc = _epilogue(b_acc, b_acc_u, y.dtype.element_ty, ACT, GATED)
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_y)


@triton.jit
def _row_tiles(x, w, w_u, o_n, M, N, k_lo, k_hi, stride_xm, stride_xk, stride_wn, stride_wk, NUM_TILES: tl.constexpr,
               K_STEPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               GATED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 sums ``[BLOCK_N, 16]`` of up to four 16-row tiles of x (unused ones stay zero)
    against weight rows ``o_n`` (those < N) over K in ``[k_lo, k_hi)``, in ``K_STEPS`` steps of
    ``BLOCK_K``: each weight tile is loaded once and multiplies every x tile. ``GATED``: the same
    for a second weight ``w_u`` of the same shape and strides, in the same loop (each x tile loaded
    once for both); four more sums, zeros otherwise."""
    m_n = o_n < N
    o_k = tl.arange(0, BLOCK_K)
    off_w = o_n[:, None].to(tl.int64) * stride_wn + (k_lo + o_k)[None, :] * stride_wk
    p_w = w + off_w
    p_w_u = w_u + off_w
    b_acc0 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    b_acc1 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    b_acc2 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    b_acc3 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    b_u0 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    b_u1 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    b_u2 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    b_u3 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for i_k in range(K_STEPS):  # the same trip count in every split; a short last split masks the rest
        k = k_lo + i_k * BLOCK_K
        if EVEN_K:
            m_w = m_n[:, None]
        else:
            m_w = m_n[:, None] & ((k + o_k) < k_hi)[None, :]
        b_w = tl.load(p_w, mask=m_w, other=0.0)
        b_w_u = b_w
        if GATED:
            b_w_u = tl.load(p_w_u, mask=m_w, other=0.0)
        b_acc0, b_u0 = _tile_dots(b_acc0, b_u0, b_w, b_w_u, x, 0, M, k, k_hi, stride_xm, stride_xk, BLOCK_K, EVEN_K,
                                  GATED, DOT_PRECISION, UPCAST)
        if NUM_TILES > 1:
            b_acc1, b_u1 = _tile_dots(b_acc1, b_u1, b_w, b_w_u, x, 1, M, k, k_hi, stride_xm, stride_xk, BLOCK_K,
                                      EVEN_K, GATED, DOT_PRECISION, UPCAST)
        if NUM_TILES > 2:
            b_acc2, b_u2 = _tile_dots(b_acc2, b_u2, b_w, b_w_u, x, 2, M, k, k_hi, stride_xm, stride_xk, BLOCK_K,
                                      EVEN_K, GATED, DOT_PRECISION, UPCAST)
        if NUM_TILES > 3:
            b_acc3, b_u3 = _tile_dots(b_acc3, b_u3, b_w, b_w_u, x, 3, M, k, k_hi, stride_xm, stride_xk, BLOCK_K,
                                      EVEN_K, GATED, DOT_PRECISION, UPCAST)
        p_w += BLOCK_K * stride_wk
        p_w_u += BLOCK_K * stride_wk
    return b_acc0, b_acc1, b_acc2, b_acc3, b_u0, b_u1, b_u2, b_u3


@triton.jit
def _store_tiles(b_acc0, b_acc1, b_acc2, b_acc3, b_u0, b_u1, b_u2, b_u3, b, b_u, y, i_s, o_n, M, N, stride_ys,
                 stride_ym, stride_yn, stride_yg, NUM_TILES: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PARTIAL: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr):
    """:func:`_tile_store` of each of the ``NUM_TILES`` tiles' sums."""
    _tile_store(b_acc0, b_u0, b, b_u, y, i_s, 0, o_n, M, N, stride_ys, stride_ym, stride_yn, stride_yg, HAS_BIAS,
                PARTIAL, ACT, GATED)
    if NUM_TILES > 1:
        _tile_store(b_acc1, b_u1, b, b_u, y, i_s, 1, o_n, M, N, stride_ys, stride_ym, stride_yn, stride_yg, HAS_BIAS,
                    PARTIAL, ACT, GATED)
    if NUM_TILES > 2:
        _tile_store(b_acc2, b_u2, b, b_u, y, i_s, 2, o_n, M, N, stride_ys, stride_ym, stride_yn, stride_yg, HAS_BIAS,
                    PARTIAL, ACT, GATED)
    if NUM_TILES > 3:
        _tile_store(b_acc3, b_u3, b, b_u, y, i_s, 3, o_n, M, N, stride_ys, stride_ym, stride_yn, stride_yg, HAS_BIAS,
                    PARTIAL, ACT, GATED)


@triton.jit
def _skinny_linear_kernel(
    x,
    w,
    w_u,
    b,
    b_u,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ys,
    stride_ym,
    stride_yn,
    stride_yg,
    NUM_TILES: tl.constexpr,
    K_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = i_s * K_STEPS * BLOCK_K
    k_hi = tl.minimum(K, k_lo + K_STEPS * BLOCK_K)
    b_acc0, b_acc1, b_acc2, b_acc3, b_u0, b_u1, b_u2, b_u3 = _row_tiles(
        x, w, w_u, o_n, M, N, k_lo, k_hi, stride_xm, stride_xk, stride_wn, stride_wk, NUM_TILES, K_STEPS, BLOCK_N,
        BLOCK_K, EVEN_K, GATED, DOT_PRECISION, UPCAST)
    _store_tiles(b_acc0, b_acc1, b_acc2, b_acc3, b_u0, b_u1, b_u2, b_u3, b, b_u, y, i_s, o_n, M, N, stride_ys,
                 stride_ym, stride_yn, stride_yg, NUM_TILES, HAS_BIAS, PARTIAL, ACT, GATED)


@triton.jit
def _split_k_reduce_kernel(part, b, b_u, y, N, stride_ps, stride_pm, stride_pg, stride_ym, stride_yn,
                           SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                           GATED: tl.constexpr):
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    p_p = part + i_m * stride_pm + o_n
    b_acc = tl.load(p_p, mask=m_n, other=0.0)
    for i_s in tl.static_range(1, SPLIT_K):  # in split order: the sum does not depend on scheduling
        b_acc += tl.load(p_p + i_s * stride_ps, mask=m_n, other=0.0)
    b_acc_u = b_acc
    if GATED:  # the second weight's partials, stride_pg further on
        b_acc_u = tl.load(p_p + stride_pg, mask=m_n, other=0.0)
        for i_s in tl.static_range(1, SPLIT_K):
            b_acc_u += tl.load(p_p + stride_pg + i_s * stride_ps, mask=m_n, other=0.0)
    if HAS_BIAS:
        b_acc += tl.load(b + o_n, mask=m_n, other=0.0).to(tl.float32)
        if GATED:
            b_acc_u += tl.load(b_u + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_acc = _epilogue(b_acc, b_acc_u, y.dtype.element_ty, ACT, GATED)
    tl.store(y + i_m * stride_ym + o_n * stride_yn, b_acc.to(y.dtype.element_ty), mask=m_n)


def skinny_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, config,
                  activation: int = 0, up_weight: torch.Tensor | None = None,
                  up_bias: torch.Tensor | None = None) -> None:
    """Launch the kernels for checked arguments: ``y [M, N] = act(x [M, K] @ weight [N, K].T + bias)``,
    or with ``up_weight`` ``act(x @ weight.T + bias) * (x @ up_weight.T + up_bias)`` (a gated MLP's
    gate and up projections).

    Args:
        x: ``[M, K]``, 1 <= M <= 64. weight: ``[N, K]``. bias: ``[N]`` or None. y: ``[M, N]``,
            written. All one dtype and device (checked by the caller). config: a
            :class:`specdec.kernels.linear.SkinnyConfig`. activation: an :data:`ACT_CODES` value.
            up_weight: None, or ``[N, K]`` with ``weight``'s strides; up_bias: ``[N]`` with it
            where ``bias`` is given.
    """
    M, K = x.shape
    N = weight.shape[0]
    gated = up_weight is not None
    num_tiles = triton.cdiv(M, TILE_M)
    k_per_split = triton.cdiv(triton.cdiv(K, config.split_k), config.block_k) * config.block_k
    split = triton.cdiv(K, k_per_split)  # every split non-empty
    even_k = K % k_per_split == 0  # then every split is k_per_split long, whole BLOCK_K steps: no K mask
    precision = "ieee"  # fp32: exact FMAs, not TF32 (ignored by bf16 / fp16 dots)
    # split K: fp32 partials [weights, split, M, N] (the gate's, then the up projection's)
    dst = y if split == 1 else torch.empty(1 + gated, split, M, N, device=y.device, dtype=torch.float32)
    _skinny_linear_kernel[(triton.cdiv(N, config.block_n), split)](
        x, weight, up_weight if gated else weight, bias, up_bias if gated else bias, dst, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        dst.stride(1) if split > 1 else 0, dst.stride(-2), dst.stride(-1), dst.stride(0) if split > 1 else 0,
        NUM_TILES=num_tiles, K_STEPS=k_per_split // config.block_k, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=even_k, HAS_BIAS=bias is not None, PARTIAL=split > 1, ACT=activation, GATED=gated,
        DOT_PRECISION=precision, UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        block = min(1024, next_pow2(N))
        _split_k_reduce_kernel[(triton.cdiv(N, block), M)](
            dst, bias, up_bias if gated else bias, y, N, dst.stride(1), dst.stride(2), dst.stride(0), y.stride(0),
            y.stride(1), SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, ACT=activation, GATED=gated,
            num_warps=num_warps_for(block),
        )


# The sizes are not specialised on (== 1, divisible by 16): a model's groups differ in them, and each
# specialisation would be a compile of its own (the loads that matter, the weight's, are aligned by K).
@triton.jit(do_not_specialize=["M", "N0", "N1", "N2", "N3", "NB1", "NB2", "NB3"])
def _grouped_skinny_kernel(
    x, M, K, stride_xm, stride_xk,
    W0, W1, W2, W3,
    B0, B1, B2, B3,
    Y0, Y1, Y2, Y3,
    N0, N1, N2, N3,
    NB1, NB2, NB3,
    NUM_TILES: tl.constexpr,
    K_STEPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i_b = tl.program_id(0)
    # the member owning weight block i_b: members' blocks start at 0, NB1, NB2, NB3
    w, b, y, N, start = W0, B0, Y0, N0, 0
    if i_b >= NB1:
        w, y, N, start = W1, Y1, N1, NB1
        if HAS_BIAS:
            b = B1
    if i_b >= NB2:
        w, y, N, start = W2, Y2, N2, NB2
        if HAS_BIAS:
            b = B2
    if i_b >= NB3:
        w, y, N, start = W3, Y3, N3, NB3
        if HAS_BIAS:
            b = B3
    o_n = (i_b - start) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_acc0, b_acc1, b_acc2, b_acc3, b_u0, b_u1, b_u2, b_u3 = _row_tiles(
        x, w, w, o_n, M, N, 0, K, stride_xm, stride_xk, K, 1, NUM_TILES, K_STEPS, BLOCK_N, BLOCK_K, EVEN_K, False,
        DOT_PRECISION, UPCAST)
    _store_tiles(b_acc0, b_acc1, b_acc2, b_acc3, b_u0, b_u1, b_u2, b_u3, b, b, y, 0, o_n, M, N, 0, N, 1, 0,
                 NUM_TILES, HAS_BIAS, False, 0, False)


def grouped_launch(x: torch.Tensor, weights, biases, outs, config) -> None:
    """Launch one kernel for checked arguments: ``outs[i] [M, N_i] = x [M, K] @ weights[i] [N_i, K].T
    + biases[i]`` for every member i (at most :data:`MAX_MEMBERS`).

    The grid is every member's ``block_n`` weight blocks one after the other; a program finds its
    member from its block index (each member's weight, bias and output are arguments of their own,
    so the compiled variant depends on their tensors' 16-byte alignment, K, the tile count of M and
    the block shape, not on how far apart the members lie in memory nor on their widths). No K
    split: a group exists to fill the device with several weights' blocks at once. Each output element is reduced in the same order whatever M is (batch-invariant, as
    :func:`skinny_launch`).

    Args:
        x: ``[M, K]``, 1 <= M <= 64. weights: ``[N_i, K]`` each, contiguous. biases: ``[N_i]`` each,
            contiguous, or None. outs: ``[M, N_i]`` each, contiguous, written. All one dtype and
            device (checked by the caller). config: a :class:`specdec.kernels.linear.SkinnyConfig`
            (its ``block_n``, ``block_k``, ``num_warps``, ``num_stages``; ``split_k`` is not used).
    """
    M, K = x.shape
    n = len(weights)
    Ns = [w.shape[0] for w in weights] + [0] * (MAX_MEMBERS - n)
    blocks = [triton.cdiv(N, config.block_n) for N in Ns[:n]]
    starts = [sum(blocks[:i]) if i < n else sum(blocks) for i in range(1, MAX_MEMBERS)]  # absent: past the grid
    ws = list(weights) + [weights[0]] * (MAX_MEMBERS - n)  # (absent members' arguments are never read)
    ys = list(outs) + [outs[0]] * (MAX_MEMBERS - n)
    bs = list(biases) + [biases[0]] * (MAX_MEMBERS - n) if biases is not None else [None] * MAX_MEMBERS
    _grouped_skinny_kernel[(sum(blocks),)](
        x, M, K, x.stride(0), x.stride(1), *ws, *bs, *ys, *Ns, *starts,
        NUM_TILES=triton.cdiv(M, TILE_M), K_STEPS=triton.cdiv(K, config.block_k), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN_K=K % config.block_k == 0, HAS_BIAS=biases is not None, DOT_PRECISION="ieee",
        UPCAST=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
