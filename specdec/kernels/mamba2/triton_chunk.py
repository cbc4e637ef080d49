"""Replay verify of the Mamba-2 selective state update in chunked (SSD) form: the T step tokens as one chunk.

The token-by-token verify (:mod:`.triton_step`) reduces the ``[BP, N]`` state block against
``C_t`` once per token, each token waiting on the previous update. The chunked form is the
state space duality of Dao & Gu ("Transformers are SSMs", ICML 2024) applied to one chunk:
with ``l_t = dt_1 A + ... + dt_t A`` (cumulative log decay of the step, per head) and ``h_0``
the state the step starts from::

    h_t = exp(l_t) h_0 + sum_{s <= t} exp(l_t - l_s) dt_s x_s B_s^T
    Y   = exp(l) * (C h_0^T) + M X + D X,   M[t, s] = exp(l_t - l_s) dt_s (C_t . B_s), s <= t

so the state enters one ``[T, N] x [N, BP]`` product and the tokens' coupling is a ``T x T``
matrix that does not involve the state. Every exponent is <= 0 (A < 0, dt > 0), so nothing
overflows, and ``l_t - l_s`` is summed over the tokens between s and t
(:func:`specdec.kernels.triton_common.pair_sums`), not subtracted, so a strong decay early in the
step costs the later tokens no precision. The committed history is folded into ``h_0`` first, as the token-by-token kernel
folds it (rank-1 updates).

Same protocols, arguments, history layout and outputs as the token-by-token replay verify
(:func:`specdec.kernels.mamba2.triton_step.mamba2_replay_verify`, which dispatches here when
``chunked``, for steps of at most ``CHUNK_MAX`` = 16 tokens). A tree step is the same chunk with
each token's ancestors in place of the tokens before it (paths' decays, an ancestor mask). The arithmetic differs from the
token-by-token order by rounding only (fp32 throughout; matrix products in IEEE fp32, not TF32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import (
    CHUNK_MAX,
    DOT_MIN,
    chunk_blocks,
    floor_log_decay,
    fold_launch,
    load_slot,
    next_pow2,
    pair_sums,
    replay_window,
    step_ancestors,
)
from .triton_step import _fold_cached

__all__ = ["launch_replay_chunk"]


@triton.jit
def _mamba2_replay_chunk_kernel(
    x,  # [B, T, H, P]
    dt,  # [B, T, H] (already softplus'ed)
    A,  # [H]
    Bm,  # [B, T, G, N]
    Cm,  # [B, T, G, N]
    D,  # [H] (HAS_D)
    y,  # [B, T, H, P] output
    ckpt,  # [S, H, P, N] checkpoint
    hist_len,  # [S] committed history lengths
    state_indices,  # [B] slot of each row, < 0 = padding (USE_STATE_INDICES)
    h_x,  # [S, L, H, P]
    h_dt,  # [S, L, H]
    h_B,  # [S, L, G, N]
    tree,  # [T, META_W] int32 tree table (TREE; specdec.kernels.tree_index.tree_meta)
    offset,
    stride_s_n,
    stride_hx_n,
    stride_hdt_n,
    stride_hB_n,
    T: tl.constexpr,
    TP: tl.constexpr,  # T padded for tl.dot (a power of two >= 16); T <= CHUNK_MAX = 16
    H: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    G: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_D: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    FUSED: tl.constexpr,
    FIRST: tl.constexpr,
    HALF: tl.constexpr,  # FUSED: T_max (history of 2 * T_max positions); else the history length L
    FOLD_N: tl.constexpr,  # the most history positions the fold reads
    FOLD_LA: tl.constexpr,  # history items whose loads run ahead (triton_common.fold_launch)
    FOLD_MASKED: tl.constexpr,  # predicate the history loads on the folded length
    TREE: tl.constexpr,  # the T tokens are a tree (offset 0): token t continues from its parent
    META_W: tl.constexpr,  # TREE: columns of the tree table
):
    i_p, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_g = i_h // (H // G)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    o_t = tl.arange(0, TP)
    m_p = o_p < P
    m_n = o_n < N
    m_t = o_t < T
    m_tp = m_t[:, None] & m_p[None, :]
    m_tn = m_t[:, None] & m_n[None, :]
    i_row = i_b * T + o_t  # the tokens' rows in the flattened [B * T]

    # the step's inputs first: they depend on no load, so they travel with the state block
    a_x = tl.load(x + (i_row[:, None] * H + i_h) * P + o_p[None, :], mask=m_tp, other=0.0)
    a_d = tl.load(dt + i_row * H + i_h, mask=m_t, other=0.0)
    a_B = tl.load(Bm + (i_row[:, None] * G + i_g) * N + o_n[None, :], mask=m_tn, other=0.0)
    b_C = tl.load(Cm + (i_row[:, None] * G + i_g) * N + o_n[None, :], mask=m_tn, other=0.0).to(tl.float32)
    b_A = tl.load(A + i_h).to(tl.float32)
    b_x = a_x.to(tl.float32)
    b_dt = a_d.to(tl.float32)
    b_B = a_B.to(tl.float32)

    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    p_hx = h_x + i_n * stride_hx_n
    p_hdt = h_dt + i_n * stride_hdt_n
    p_hB = h_B + i_n * stride_hB_n
    p_s = ckpt + i_n * stride_s_n + i_h * P * N + o_p[:, None] * N + o_n[None, :]
    m_pn = m_p[:, None] & m_n[None, :]
    base, cnt, pos0 = replay_window(hist_len, i_n, offset, FUSED, FIRST, HALF)
    b_h = tl.load(p_s, mask=m_pn, other=0.0)
    # the fold is rank-1 updates with no reduction (the token-by-token kernels' own)
    b_h = _fold_cached(b_h, p_hx, p_hdt, p_hB, base, cnt, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N, G, FOLD_N,
                       FOLD_LA, FOLD_MASKED)
    if FUSED:
        if FIRST:
            if cnt > 0:  # absorb the committed history: the checkpoint is now s^(0)
                tl.debug_barrier()  # in place: every thread has read its block before any writes back
                tl.store(p_s, b_h, mask=m_pn)

    # the tokens' coupling within the step (it does not involve the state)
    # (a chain's token t sees every s <= t, a tree's its ancestors and itself)
    anc = step_ancestors(tree, o_t, m_t, TREE, META_W)  # [t, s]
    anc_f = anc.to(tl.float32)
    b_l = floor_log_decay(b_dt * b_A)  # [TP] log decays
    if TREE:  # log decay from the step's start through each token, along its path
        c_l = tl.sum(anc_f * b_l[None, :], axis=1)
    else:
        c_l = tl.cumsum(b_l, axis=0)
    dec = tl.where(anc, tl.exp(pair_sums(b_l, anc_f)), 0.0)  # [t, s]: the decay from token s to t
    m_ts = tl.dot(b_C, tl.trans(b_B), input_precision="ieee") * dec * b_dt[None, :]  # [TP, TP]
    # the state enters one product
    b_y = tl.exp(c_l)[:, None] * tl.dot(b_C, tl.trans(b_h), input_precision="ieee")  # [TP, BP]
    b_y += tl.dot(m_ts, b_x, input_precision="ieee")
    if HAS_D:
        b_y += b_x * tl.load(D + i_h).to(tl.float32)

    tl.store(y + (i_row[:, None] * H + i_h) * P + o_p[None, :], b_y.to(y.dtype.element_ty), mask=m_tp)
    pos = pos0 + o_t
    tl.store(p_hx + pos[:, None] * (H * P) + i_h * P + o_p[None, :], a_x.to(h_x.dtype.element_ty), mask=m_tp)
    if i_p == 0:  # dt is per head, B per group: one program of each writes them
        tl.store(p_hdt + pos * H + i_h, a_d.to(h_dt.dtype.element_ty), mask=m_t)
        if i_h % (H // G) == 0:
            tl.store(p_hB + pos[:, None] * (G * N) + i_g * N + o_n[None, :], a_B.to(h_B.dtype.element_ty), mask=m_tn)


def launch_replay_chunk(x, dt, A, Bm, Cm, D, out, ckpt, hist, hist_len, state_indices, tree, strides, dims, *,
                        offset, fused, first, half, fold_n, block_p=None, num_warps=None):
    """Launch the chunked replay verify on checked, contiguous arguments (the caller's
    :func:`specdec.kernels.mamba2.triton_step._step` validates them). ``tree``: the step's tree
    table (:func:`specdec.kernels.triton_common.tree_table`) or None for a chain. ``fold_n``: the
    most history positions the fold may read (fused first call: ``fold_max``; later calls: T_max;
    deferred: L)."""
    Bsz, T, H, P, G, N = dims
    if T > CHUNK_MAX:
        raise ValueError(f"the chunked replay verify takes at most {CHUNK_MAX} tokens per call, got {T}")
    BN, BP, num_warps = chunk_blocks(N, P, block_p, Bsz, H, num_warps)
    h_x, h_dt, h_B = hist
    fold_la, fold_masked = fold_launch(fold_n) if fused else (4, True)  # as the token-by-token kernel
    _mamba2_replay_chunk_kernel[(triton.cdiv(P, BP), H, Bsz)](  # B on axis 2: axis 1 is capped at 65535
        x, dt, A, Bm, Cm, D, out, ckpt, hist_len, state_indices, h_x, h_dt, h_B, tree, offset,
        strides[0], strides[4], strides[5], strides[6],
        T=T, TP=max(DOT_MIN, next_pow2(T)), H=H, P=P, N=N, G=G, BP=BP, BN=BN, HAS_D=D is not None,
        USE_STATE_INDICES=state_indices is not None, FUSED=bool(fused), FIRST=first, HALF=half, FOLD_N=fold_n,
        FOLD_LA=fold_la, FOLD_MASKED=fold_masked, TREE=tree is not None, META_W=1 if tree is None else tree.shape[1],
        num_warps=num_warps,
    )
    return out
