"""Replay verify of the gated delta rule in chunked (WY) form: the T step tokens as one chunk.

The token-by-token verify (:mod:`.triton_step`) needs, per token, two reductions over the key
dim (``S^T k`` and ``S^T q``) across the warps that hold the state block, each waiting on the
last; on an H200 that dependent chain, not memory, bounds replay's verify at batch 64. The
chunked form (the WY representation of products of Householder-like matrices, Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024;
with gates, "Gated Delta Networks", ICLR 2025) touches the state with two matrix products and
solves the tokens' coupling in a ``T x T`` triangular system that does not involve the state.

With ``G_t = g_1 + ... + g_t`` (cumulative log decay of the step, per channel for KDA),
``S_0`` the state the step starts from and ``u_t = beta_t (v_t - S_{t-1}'^T k_t)`` the
corrected values (``S_{t-1}'`` the state after token t's decay)::

    S_t = exp(G_t) S_0 + sum_{s <= t} exp(G_t - G_s) k_s u_s^T
    (I + L) U = beta * (V - (K exp(G)) S_0),   L[t, s] = beta_t (k_t . k_s exp(G_t - G_s)), s < t
    O = (Q exp(G)) S_0 + (Q K^T exp(G_t - G_s))_{s <= t} U

(for KDA the decays sit inside the dot products, channel by channel; for a tree step, read "s
an ancestor of t" for ``s < t``, the path from the step's start for the sums ``G``, and the
path from s to t for ``G_t - G_s``). Every exponent is a sum
of log decays, so it is <= 0: nothing overflows; ``G_t - G_s`` is summed over the tokens between
s and t (:func:`specdec.kernels.triton_common.pair_sums`, ``sums_after``), not subtracted, so a
strong decay early in the step (or a decay of exactly 0: log decay ``-inf``) costs the later
tokens no precision. The committed history
is folded into ``S_0`` first, as the token-by-token kernel folds it (rank-1 updates, no
reduction: nothing there waits on other warps).

Same protocols, arguments, history layout and outputs as the token-by-token replay verify
(:func:`specdec.kernels.gdn.triton_step.delta_rule_replay_verify`, which dispatches here when
``chunked``, for steps of at most ``CHUNK_MAX`` = 16 tokens). A tree step is the same chunk with
each token's ancestors in place of the tokens before it: token t's state is ``S_0`` decayed
along its path plus the rank-1 writes of its ancestors and itself, so no node rebuilds its
parent's state. The arithmetic differs from the
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
    sums_after,
)
from .triton_step import _fold_cached

__all__ = ["launch_replay_chunk"]


@triton.jit
def _delta_rule_replay_chunk_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    g,  # [B, T, H] or [B, T, H, K]
    beta,  # [B, T, H]
    o,  # [B, T, H, V] output
    ckpt,  # [N, H, K, V] checkpoint
    hist_len,  # [N] committed history lengths
    state_indices,  # [B] slot of each row, < 0 = padding (USE_STATE_INDICES)
    h_k,  # [N, L, H, K]
    h_g,  # [N, L, H] or [N, L, H, K]
    h_u,  # [N, L, H, V]
    tree,  # [T, META_W] int32 tree table (TREE; specdec.kernels.tree_index.tree_meta)
    offset,
    stride_s_n,
    stride_hk_n,
    stride_hg_n,
    stride_hu_n,
    T: tl.constexpr,
    TP: tl.constexpr,  # T padded for tl.dot (a power of two >= 16); T <= 16
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
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
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, TP)
    m_k = o_k < K
    m_v = o_v < V
    m_t = o_t < T
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    i_row = i_b * T + o_t  # the tokens' rows in the flattened [B * T]

    # the step's inputs first: they depend on no load, so they travel with the state block
    a_k = tl.load(k + (i_row[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_q = tl.load(q + (i_row[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_v = tl.load(v + (i_row[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        a_g = tl.load(g + (i_row[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    else:
        a_g = tl.load(g + i_row * H + i_h, mask=m_t, other=0.0)
    b_k = a_k.to(tl.float32)
    b_g = a_g.to(tl.float32)

    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    p_hk = h_k + i_n * stride_hk_n
    p_hg = h_g + i_n * stride_hg_n
    p_hu = h_u + i_n * stride_hu_n
    p_s = ckpt + i_n * stride_s_n + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    base, cnt, pos0 = replay_window(hist_len, i_n, offset, FUSED, FIRST, HALF)
    b_s = tl.load(p_s, mask=m_kv, other=0.0)
    # the fold is rank-1 updates with no reduction (the token-by-token kernels' own)
    b_s = _fold_cached(b_s, p_hk, p_hg, p_hu, base, cnt, i_h, o_k, o_v, m_k, m_v, H, K, V, PER_CHANNEL, FOLD_N,
                       FOLD_LA, FOLD_MASKED)
    if FUSED:
        if FIRST:
            if cnt > 0:  # absorb the committed history: the checkpoint is now s^(0)
                tl.debug_barrier()  # in place: every thread has read its block before any writes back
                tl.store(p_s, b_s, mask=m_kv)

    # decays within the step, and the tokens' pairwise products (they do not involve the state);
    # a chain's token t sees every s <= t, a tree's its ancestors and itself
    anc = step_ancestors(tree, o_t, m_t, TREE, META_W)  # [t, s]
    anc_f = anc.to(tl.float32)
    b_g = floor_log_decay(b_g)
    if PER_CHANNEL:
        if TREE:  # log decay from the step's start through each token, along its path
            c_g = tl.dot(anc_f, b_g, input_precision="ieee")  # [TP, BK]
        else:
            c_g = tl.cumsum(b_g, axis=0)
        a_kk = tl.zeros([TP, TP], dtype=tl.float32)
        a_qk = tl.zeros([TP, TP], dtype=tl.float32)
        for s in tl.static_range(T):
            sel = (o_t == s)[:, None]
            k_s = tl.sum(tl.where(sel, b_k, 0.0), axis=0)
            d_s = tl.exp(sums_after(b_g, anc_f, o_t, s))  # [t, BK]: the decay from token s to t
            kd_s = k_s[None, :] * d_s
            col = (o_t == s)[None, :]
            a_kk = tl.where(col, tl.sum(b_k * kd_s, axis=1)[:, None], a_kk)
            a_qk = tl.where(col, tl.sum(b_q * kd_s, axis=1)[:, None], a_qk)
        a_kk = tl.where(anc, a_kk, 0.0)
        a_qk = tl.where(anc, a_qk, 0.0)
        e_g = tl.exp(c_g)
        k_g = b_k * e_g
        q_g = b_q * e_g
    else:
        if TREE:
            c_g = tl.sum(anc_f * b_g[None, :], axis=1)  # [TP]
        else:
            c_g = tl.cumsum(b_g, axis=0)
        dec = tl.where(anc, tl.exp(pair_sums(b_g, anc_f)), 0.0)  # [t, s]: the decay from token s to t
        a_kk = tl.dot(b_k, tl.trans(b_k), input_precision="ieee") * dec
        a_qk = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * dec
        e_g = tl.exp(c_g)[:, None]
        k_g = b_k * e_g
        q_g = b_q * e_g
    # (I + L)^-1, L = beta * a_kk over the strict ancestors (below the diagonal: a tree's tokens
    # come after their parents), by recursive block inversion: with
    # the inverses of the diagonal blocks of size b in X (block diagonal), those of size 2b are
    # X - X C X, C the lower-left b x b blocks of L inside each 2b block. log2(T) levels of two
    # small products, as accurate as substitution when the keys nearly repeat (a truncated
    # Neumann product, (I - L)(I + L^2)..., lost ~1e-4 there), without a T-step chain of
    # cross-thread reductions
    a_l = tl.where(anc & (o_t[:, None] != o_t[None, :]), b_beta[:, None] * a_kk, 0.0)
    inv = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in tl.static_range(4):  # block sizes 1, 2, 4, 8: T <= 16
        if (1 << i) < T:
            blk = o_t >> i
            c = tl.where(((blk[:, None] & 1) == 1) & (blk[None, :] == blk[:, None] - 1), a_l, 0.0)
            inv = inv - tl.dot(tl.dot(inv, c, input_precision="ieee"), inv, input_precision="ieee")

    # the state enters here: two products with S_0, then the triangular system and the outputs
    b_ks = tl.dot(k_g, b_s, input_precision="ieee")  # [TP, BV]
    b_qs = tl.dot(q_g, b_s, input_precision="ieee")
    b_u = tl.dot(inv, b_beta[:, None] * (b_v - b_ks), input_precision="ieee")
    b_o = b_qs + tl.dot(a_qk, b_u, input_precision="ieee")

    tl.store(o + (i_row[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    pos = pos0 + o_t
    tl.store(p_hu + pos[:, None] * (H * V) + i_h * V + o_v[None, :], b_u.to(h_u.dtype.element_ty), mask=m_tv)
    if i_v == 0:  # k and g are shared by every value block: one program writes them
        tl.store(p_hk + pos[:, None] * (H * K) + i_h * K + o_k[None, :], a_k.to(h_k.dtype.element_ty), mask=m_tk)
        if PER_CHANNEL:
            tl.store(p_hg + pos[:, None] * (H * K) + i_h * K + o_k[None, :], a_g.to(h_g.dtype.element_ty),
                     mask=m_tk)
        else:
            tl.store(p_hg + pos * H + i_h, a_g.to(h_g.dtype.element_ty), mask=m_t)


def launch_replay_chunk(q, k, v, g, beta, out, ckpt, hist, hist_len, state_indices, tree, strides, dims, *, offset,
                        fused, first, half, fold_n, per_channel, block_v=None, num_warps=None):
    """Launch the chunked replay verify on checked, contiguous arguments (the caller's
    :func:`specdec.kernels.gdn.triton_step._step` validates them). ``tree``: the step's tree table
    (:func:`specdec.kernels.triton_common.tree_table`) or None for a chain. ``fold_n``: the most
    history positions the fold may read (fused first call: ``fold_max``; later calls: T_max;
    deferred: L)."""
    B, T, H, K, V = dims
    if T > CHUNK_MAX:
        raise ValueError(f"the chunked replay verify takes at most {CHUNK_MAX} tokens per call, got {T}")
    BK, BV, num_warps = chunk_blocks(K, V, block_v, B, H, num_warps)
    h_k, h_g, h_u = hist
    fold_la, fold_masked = fold_launch(fold_n) if fused else (4, True)  # as the token-by-token kernel
    grid = (triton.cdiv(V, BV), H, B)  # B on axis 2: axis 1 is capped at 65535
    _delta_rule_replay_chunk_kernel[grid](
        q, k, v, g, beta, out, ckpt, hist_len, state_indices, h_k, h_g, h_u, tree, offset,
        strides[0], strides[4], strides[5], strides[6],
        T=T, TP=max(DOT_MIN, next_pow2(T)), H=H, K=K, V=V, BK=BK, BV=BV, PER_CHANNEL=per_channel,
        USE_STATE_INDICES=state_indices is not None, FUSED=bool(fused), FIRST=first, HALF=half, FOLD_N=fold_n,
        FOLD_LA=fold_la, FOLD_MASKED=fold_masked, TREE=tree is not None, META_W=1 if tree is None else tree.shape[1],
        num_warps=num_warps,
    )
    return out
