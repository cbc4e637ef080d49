"""Gated delta rule (GDN, and KDA with a per-channel gate): multi-token verify, commit and replay in Triton.

The recurrence is the one of :mod:`specdec.kernels.gdn.naive` (Yang, Kautz & Hatamizadeh,
"Gated Delta Networks", ICLR 2025; per-channel decay: Kimi Team, "Kimi Linear", 2025), token
by token as flash-linear-attention's ``fused_recurrent_gated_delta_rule`` runs it::

    S <- S * exp(g_t);  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t

One program owns one (row, head, block of BV value columns): the ``[K, BV]`` fp32 state block
stays in registers across the step's tokens; the key dim is whole in the block because
``S^T k`` reduces over it. One kernel serves every rollback strategy through ``MODE``:

* ``OVERWRITE`` (no rollback, the benchmark floor): the final state overwrites the state.
* ``SNAPSHOT``: s^(offset+1+j) goes to ``buf[:, offset+j]``.
* ``RING``: start at slot ``(head+offset) % R``; s^(offset+1+j) goes to slot ``(head+offset+1+j) % R``.
* ``REPLAY``: start at the checkpoint advanced by the cached ``(k, g, u)`` of the committed
  history; write no step state, append this call's ``(k, g, u)`` to the history. Two protocols
  (:func:`delta_rule_replay_verify`): *fused* (eager replay) folds the committed history into
  the checkpoint in the step's first call -- the fold of the last commit fused into this verify,
  so a step reads and writes the state once (2S, like the no-rollback update) and its commit
  only moves the accepted tokens' inputs (:func:`delta_rule_replay_commit`); *unfused*
  (deferred replay) folds in registers only and flushes with :func:`delta_rule_replay_fold`.

Tree steps (``parents=``, :mod:`specdec.kernels.tree_index`; Medusa trees): the same kernel
(``TREE``) walks the tree's tokens in order; token j starts from the register state when its
parent is token j - 1 (a chain, no memory traffic), else from its parent's state -- SNAPSHOT /
RING: the slot this program stored for the parent (same tile layout; a ``tl.debug_barrier``
between the store and the load), REPLAY: rebuilt in registers from the step's starting state
along the parent's ancestor chain (see :func:`delta_rule_replay_verify`).

Latency: a program requests every input it will need -- the T tokens' ``q, k, v, g, beta``, the
cached history and the state block -- before its first arithmetic, so it waits for memory once
rather than once per token (per-token loads issued behind the ``S^T k`` reductions' barriers
make the verify latency-bound, at 23% of DRAM bandwidth on an H200). In a chain, token j's
output ``s^(j+1)^T q_j`` and token j + 1's ``(exp(g) S)^T k`` reduce over the same state block,
so they run as one reduction of a pair of values (the two sums' shuffles interleave and their
cross-warp exchanges share barriers: 48 barriers against 60 in the sm_90 SASS of a K = 4 plain
update): each token waits on one reduction, not two, and a chain of T tokens makes T + 1 (token
0's sum and the last output alone). A tree node's output is reduced on its own (the next node
need not start from its state).

States are fp32 ``[N, H, K, V]``; inputs may be fp32/bf16/fp16 and are computed in fp32.
None of the calls syncs with the host or allocates a state-sized buffer (CUDA-graph safe), and
none is autotuned: the kernels update state in place, and an autotuner would run them several
times on the same state. Launch parameters are chosen by hand (:func:`_launch_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..protocol import LaunchConfig
from ..triton_common import (
    OVERWRITE,
    REPLAY,
    RING,
    SNAPSHOT,
    KernelSet,
    check_history,
    check_state,
    check_state_indices,
    fold_launch,
    fold_size,
    load_slot,
    next_pow2,
    num_warps_for,
    replay_commit_history,
    replay_half,
    ring_commit,
    state_copy_commit,
    step_state_args,
    runtime_tree_loop,
    tree_table,
    with_common_args,
)

__all__ = [
    "delta_rule_update",
    "delta_rule_snapshot_verify",
    "delta_rule_ring_verify",
    "delta_rule_replay_verify",
    "delta_rule_replay_fold",
    "delta_rule_replay_commit",
    "DeltaRuleKernels",
]

@triton.jit
def _token_inputs(q, k, v, g, beta, i_t, i_h, o_k, o_v, m_k, m_v, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, PER_CHANNEL: tl.constexpr):
    # one token's inputs for head i_h, in their own dtype (converted to fp32 at use)
    b_q = tl.load(q + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_k = tl.load(k + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_v = tl.load(v + (i_t * H + i_h) * V + o_v, mask=m_v, other=0.0)
    b_beta = tl.load(beta + i_t * H + i_h)
    if PER_CHANNEL:
        b_g = tl.load(g + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0)
    else:
        b_g = tl.load(g + i_t * H + i_h)
    return b_q, b_k, b_v, b_g, b_beta


@triton.jit
def _hist_item(h_k, h_g, h_u, pos, ok, i_h, o_k, o_v, m_k, m_v, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, PER_CHANNEL: tl.constexpr, MASKED: tl.constexpr):
    # cached (k, g, u) at history position pos (h_* point at the row's position 0). MASKED: the
    # loads are predicated on ok (no traffic for absent items); else they are issued without
    # waiting for ok (pos must be in bounds) and absent items are skipped by the caller.
    if MASKED:
        b_k = tl.load(h_k + pos * (H * K) + i_h * K + o_k, mask=m_k & ok, other=0.0)
        b_u = tl.load(h_u + pos * (H * V) + i_h * V + o_v, mask=m_v & ok, other=0.0)
        if PER_CHANNEL:
            b_g = tl.load(h_g + pos * (H * K) + i_h * K + o_k, mask=m_k & ok, other=0.0)
        else:
            b_g = tl.load(h_g + pos * H + i_h, mask=ok, other=0.0)
    else:
        b_k = tl.load(h_k + pos * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
        b_u = tl.load(h_u + pos * (H * V) + i_h * V + o_v, mask=m_v, other=0.0)
        if PER_CHANNEL:
            b_g = tl.load(h_g + pos * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
        else:
            b_g = tl.load(h_g + pos * H + i_h)
    return b_k, b_g, b_u


@triton.jit
def _fold_cached(b_s, h_k, h_g, h_u, base, cnt, i_h, o_k, o_v, m_k, m_v, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, PER_CHANNEL: tl.constexpr, NMAX: tl.constexpr, LA: tl.constexpr,
                 MASKED: tl.constexpr):
    # b_s: [BK, BV] fp32 block; apply the cached tokens at positions base .. base + cnt - 1
    # (cnt <= NMAX, runtime) in order. Unrolled NMAX times with LA items of loads in flight ahead
    # of the arithmetic (one memory round trip instead of one per token); an item i >= cnt is
    # skipped (its loads, when not MASKED, are issued and unused).
    hk = ()
    hg = ()
    hu = ()
    for i in tl.static_range(LA):
        if i < NMAX:
            a_k, a_g, a_u = _hist_item(h_k, h_g, h_u, base + i, i < cnt, i_h, o_k, o_v, m_k, m_v, H, K, V,
                                       PER_CHANNEL, MASKED)
            hk = hk + (a_k,)
            hg = hg + (a_g,)
            hu = hu + (a_u,)
    for i in tl.static_range(NMAX):
        if i + LA < NMAX:
            a_k, a_g, a_u = _hist_item(h_k, h_g, h_u, base + i + LA, i + LA < cnt, i_h, o_k, o_v, m_k, m_v, H, K,
                                       V, PER_CHANNEL, MASKED)
            hk = hk + (a_k,)
            hg = hg + (a_g,)
            hu = hu + (a_u,)
        if i < cnt:  # uniform per program: absent items cost no arithmetic (deferred replay's
            # history holds L >= 3 T positions, on average half of them committed)
            b_s = _decayed(b_s, hg[i], PER_CHANNEL) + hk[i].to(tl.float32)[:, None] * hu[i].to(tl.float32)[None, :]
    return b_s


@triton.jit
def _tree_parent_state(b_s, b_s0, j, tree, k, g, p_s0, s_dst, p_hu, i_n, i_b, i_h, i_head, pos0, R, stride_dst_n,
                       stride_dst_t, o_k, o_v, o_kv, m_k, m_v, m_kv, T: tl.constexpr, H: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, MODE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                       META_W: tl.constexpr, RUNTIME_LOOP: tl.constexpr):
    # the state tree node j starts from: the registers (b_s) when its parent is node j - 1 (a
    # chain, no memory traffic), else the parent's state, which this very program stored (same
    # tile, same layout) or, for replay, rebuilt from the step's starting state b_s0 along the
    # parent's ancestor chain (rank-1 updates: k, g from the step's inputs, u from the history
    # this program appended -- exact for an fp32 history)
    i_par = tl.load(tree + j * META_W).to(tl.int64)
    if i_par != j - 1:
        if MODE == SNAPSHOT:
            if i_par < 0:
                b_s = tl.load(p_s0 + o_kv, mask=m_kv, other=0.0)
            else:
                tl.debug_barrier()  # the parent's state was stored by other threads of this program
                b_s = tl.load(s_dst + i_n * stride_dst_n + i_par * stride_dst_t + o_kv, mask=m_kv, other=0.0)
        elif MODE == RING:
            if i_par < 0:
                b_s = tl.load(p_s0 + o_kv, mask=m_kv, other=0.0)
            else:
                tl.debug_barrier()  # the parent's state was stored by other threads of this program
                b_s = tl.load(s_dst + i_n * stride_dst_n + ((i_head + 1 + i_par) % R) * stride_dst_t + o_kv,
                              mask=m_kv, other=0.0)
        elif MODE == REPLAY:
            b_s = b_s0
            n_anc = tl.load(tree + j * META_W + 1)
            tl.debug_barrier()  # the ancestors' u were stored by other threads of this program
            if RUNTIME_LOOP:
                for i_a in range(META_W - 2):  # a loop at run time (range, not static_range)
                    if i_a < n_anc:
                        b_s = _ancestor_update(b_s, tree, k, g, p_hu, j, i_a, i_b, i_h, pos0, o_k, o_v, m_k, m_v, T,
                                               H, K, V, PER_CHANNEL, META_W)
            else:
                for i_a in tl.static_range(META_W - 2):  # unrolled to the tree's depth
                    if i_a < n_anc:
                        b_s = _ancestor_update(b_s, tree, k, g, p_hu, j, i_a, i_b, i_h, pos0, o_k, o_v, m_k, m_v, T,
                                               H, K, V, PER_CHANNEL, META_W)
    return b_s


@triton.jit
def _ancestor_update(b_s, tree, k, g, p_hu, j, i_a, i_b, i_h, pos0, o_k, o_v, m_k, m_v, T: tl.constexpr,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     META_W: tl.constexpr):
    # replay's rebuild of a parent state: apply ancestor i_a of node j (the tree table lists them root first)
    a_t = tl.load(tree + j * META_W + 2 + i_a).to(tl.int64)
    r_k = tl.load(k + ((i_b * T + a_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    r_u = tl.load(p_hu + (pos0 + a_t) * H * V + i_h * V + o_v, mask=m_v, other=0.0)
    if PER_CHANNEL:
        r_g = tl.load(g + ((i_b * T + a_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    else:
        r_g = tl.load(g + (i_b * T + a_t) * H + i_h)
    return _decayed(b_s, r_g, PER_CHANNEL) + r_k.to(tl.float32)[:, None] * r_u.to(tl.float32)[None, :]


@triton.jit
def _decayed(b_s, a_g, PER_CHANNEL: tl.constexpr):
    # S * exp(g_t): the state block decayed by one token's gate (a scalar, or one per key channel)
    b_g = a_g.to(tl.float32)
    if PER_CHANNEL:
        return b_s * tl.exp(b_g)[:, None]
    else:
        return b_s * tl.exp(b_g)


@triton.jit
def _delta(b_sd, b_k, a_v, a_b, b_r):
    # from the decayed state b_sd and r = b_sd^T k: u = beta (v - r) and the state after the token
    b_u = (a_v.to(tl.float32) - b_r) * a_b.to(tl.float32)
    return b_sd + b_k[:, None] * b_u[None, :], b_u


@triton.jit
def _store_output(b_o, o, i_b, j, i_h, o_v, m_v, T: tl.constexpr, H: tl.constexpr, V: tl.constexpr):
    i_t = i_b * T + j  # token row in the flattened [B * T]
    tl.store(o + (i_t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


@triton.jit
def _token_writes(b_s, b_u, a_k, a_g, j, s_dst, h_k, h_g, h_u, p_hk, p_hg, p_hu, i_n, i_v, i_h, i_head, offset, pos0,
                  R, stride_dst_n, stride_dst_t, o_k, o_v, o_kv, m_k, m_v, m_kv, H: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, MODE: tl.constexpr, PER_CHANNEL: tl.constexpr):
    # the per-token write of the strategy (SNAPSHOT / RING: the state s^(offset+1+j); REPLAY: the
    # token's k, g and u)
    if MODE == SNAPSHOT:
        tl.store(s_dst + i_n * stride_dst_n + (offset + j) * stride_dst_t + o_kv, b_s, mask=m_kv)
    elif MODE == RING:
        tl.store(s_dst + i_n * stride_dst_n + ((i_head + offset + 1 + j) % R) * stride_dst_t + o_kv, b_s, mask=m_kv)
    elif MODE == REPLAY:
        pos = pos0 + j
        tl.store(p_hu + pos * H * V + i_h * V + o_v, b_u.to(h_u.dtype.element_ty), mask=m_v)
        if i_v == 0:  # k and g are shared by every value block: one program writes them
            tl.store(p_hk + pos * H * K + i_h * K + o_k, a_k.to(h_k.dtype.element_ty), mask=m_k)
            if PER_CHANNEL:
                tl.store(p_hg + pos * H * K + i_h * K + o_k, a_g.to(h_g.dtype.element_ty), mask=m_k)
            else:
                tl.store(p_hg + pos * H + i_h, a_g.to(h_g.dtype.element_ty))


@triton.jit
def _token_update(b_s, a_q, a_k, a_v, a_g, a_b, j, o, s_dst, h_k, h_g, h_u, p_hk, p_hg, p_hu, i_n, i_b, i_v, i_h,
                  i_head, offset, pos0, R, stride_dst_n, stride_dst_t, o_k, o_v, o_kv, m_k, m_v, m_kv,
                  T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, MODE: tl.constexpr,
                  PER_CHANNEL: tl.constexpr):
    # tree node j: the delta-rule update of the state block, its output and the strategy's write
    # (chains merge each output's reduction into the next token's: _chain_token)
    b_k = a_k.to(tl.float32)
    b_sd = _decayed(b_s, a_g, PER_CHANNEL)
    b_s, b_u = _delta(b_sd, b_k, a_v, a_b, tl.sum(b_sd * b_k[:, None], 0))
    _store_output(tl.sum(b_s * a_q.to(tl.float32)[:, None], 0), o, i_b, j, i_h, o_v, m_v, T, H, V)
    _token_writes(b_s, b_u, a_k, a_g, j, s_dst, h_k, h_g, h_u, p_hk, p_hg, p_hu, i_n, i_v, i_h, i_head, offset, pos0,
                  R, stride_dst_n, stride_dst_t, o_k, o_v, o_kv, m_k, m_v, m_kv, H, K, V, MODE, PER_CHANNEL)
    return b_s


@triton.jit
def _chain_token(b_s, b_qp, a_k, a_v, a_g, a_b, j, o, i_b, i_h, o_v, m_v, T: tl.constexpr, H: tl.constexpr,
                 V: tl.constexpr, PER_CHANNEL: tl.constexpr):
    # token j of a chain from b_s, the state before it: the state after it, and its u. The output
    # of token j - 1 (b_s^T q_(j-1)) reduces over the same block as this token's S^T k, so the two
    # sums run as one reduction of the pair (one wait on the per-token dependent path; on the
    # interpreter each sum is bit-identical to the sum alone)
    b_k = a_k.to(tl.float32)
    b_sd = _decayed(b_s, a_g, PER_CHANNEL)
    if j == 0:
        b_r = tl.sum(b_sd * b_k[:, None], 0)
    else:
        b_o, b_r = tl.split(tl.sum(tl.join(b_s * b_qp[:, None], b_sd * b_k[:, None]), 0))
        _store_output(b_o, o, i_b, j - 1, i_h, o_v, m_v, T, H, V)
    return _delta(b_sd, b_k, a_v, a_b, b_r)


@triton.jit
def _delta_rule_step_kernel(
    q,  # [B, T, H, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    g,  # [B, T, H] or [B, T, H, K]
    beta,  # [B, T, H]
    o,  # [B, T, H, V] output
    s_src,  # source state: [N, H, K, V] (or a ring [N, R, H, K, V]); REPLAY: the checkpoint
    s_dst,  # destination: state (OVERWRITE), buf [N, T_max, ...] (SNAPSHOT) or the ring
    head,  # [N] ring heads (RING)
    hist_len,  # [N] committed history lengths (REPLAY)
    state_indices,  # [B] slot of each row, < 0 = padding (USE_STATE_INDICES)
    h_k,  # [N, L, H, K] replay history (REPLAY)
    h_g,  # [N, L, H] or [N, L, H, K]
    h_u,  # [N, L, H, V]
    tree,  # [T, META_W] int32 per-token tree table (TREE; specdec.kernels.tree_index.tree_meta)
    offset,
    R,
    stride_src_n,
    stride_src_t,
    stride_dst_n,
    stride_dst_t,
    stride_hk_n,
    stride_hg_n,
    stride_hu_n,
    T: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    MODE: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    FUSED: tl.constexpr,  # REPLAY: fused-fold protocol (module docstring)
    FIRST: tl.constexpr,  # offset == 0
    FOLD_LA: tl.constexpr,  # REPLAY, FUSED: history items whose loads run ahead (_fold_launch)
    FOLD_MASKED: tl.constexpr,  # REPLAY, FUSED: predicate the history loads on the committed length
    HALF: tl.constexpr,  # REPLAY: FUSED: T_max (history of 2 * T_max positions); else the history length L
    FOLD_N: tl.constexpr,  # REPLAY, FUSED, FIRST: the most committed positions a slot's history holds (<= HALF)
    PREFETCH: tl.constexpr,  # tokens whose inputs are loaded ahead of their arithmetic
    TREE: tl.constexpr,  # the T tokens are a tree (offset 0): token j starts from its parent's state
    META_W: tl.constexpr,  # TREE: columns of the tree table
    TREE_LOOP: tl.constexpr,  # TREE: walk the nodes in a loop at run time (large trees; triton_common.runtime_tree_loop)
):
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = i_h * K * V + o_k[:, None] * V + o_v[None, :]  # offsets inside one state

    # the first PREFETCH tokens' inputs are requested before anything else (they depend on no
    # load), so they travel together with the state block: one memory round trip, not one per token
    tq = ()
    tk = ()
    tv = ()
    tg = ()
    tb = ()
    for j in tl.static_range(PREFETCH):
        if j < T:
            a_q, a_k, a_v, a_g, a_b = _token_inputs(q, k, v, g, beta, i_b * T + j, i_h, o_k, o_v, m_k, m_v, H, K, V,
                                                    PER_CHANNEL)
            tq = tq + (a_q,)
            tk = tk + (a_k,)
            tv = tv + (a_v,)
            tg = tg + (a_g,)
            tb = tb + (a_b,)

    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return

    i_head = i_n * 0  # RING: the row's ring head
    if MODE == RING:
        i_head = tl.load(head + i_n).to(tl.int64)
        p_s0 = s_src + i_n * stride_src_n + ((i_head + offset) % R) * stride_src_t
    else:
        p_s0 = s_src + i_n * stride_src_n

    p_hk = h_k
    p_hg = h_g
    p_hu = h_u
    pos0 = i_n * 0  # REPLAY: the history position of this call's first token
    if MODE == REPLAY:
        p_hk = h_k + i_n * stride_hk_n
        p_hg = h_g + i_n * stride_hg_n
        p_hu = h_u + i_n * stride_hu_n
        if FUSED:
            if FIRST:
                # history positions 0 .. T_max - 1 are requested with the state (addresses known
                # up front); the committed length decides afterwards which of them count
                n_prev = tl.load(hist_len + i_n).to(tl.int64)
                b_s = tl.load(p_s0 + o_kv, mask=m_kv, other=0.0)
                b_s = _fold_cached(b_s, p_hk, p_hg, p_hu, 0, n_prev, i_h, o_k, o_v, m_k, m_v, H, K, V,
                                   PER_CHANNEL, FOLD_N, FOLD_LA, FOLD_MASKED)
                if n_prev > 0:  # absorb the committed history: the checkpoint is now s^(0)
                    tl.debug_barrier()  # in place: every thread has read its block before any writes back
                    tl.store(p_s0 + o_kv, b_s, mask=m_kv)
            else:  # the checkpoint is s^(0) (the step's first call absorbed); this step's first offset tokens
                b_s = tl.load(p_s0 + o_kv, mask=m_kv, other=0.0)
                b_s = _fold_cached(b_s, p_hk, p_hg, p_hu, HALF, offset, i_h, o_k, o_v, m_k, m_v, H, K, V,
                                   PER_CHANNEL, HALF, FOLD_LA, FOLD_MASKED)
            pos0 = HALF + offset
        else:
            n_prev = tl.load(hist_len + i_n).to(tl.int64) + offset
            b_s = tl.load(p_s0 + o_kv, mask=m_kv, other=0.0)
            b_s = _fold_cached(b_s, p_hk, p_hg, p_hu, 0, n_prev, i_h, o_k, o_v, m_k, m_v, H, K, V, PER_CHANNEL,
                               HALF, 4, True)
            pos0 = n_prev
    else:
        b_s = tl.load(p_s0 + o_kv, mask=m_kv, other=0.0)
    if TREE:
        b_s0 = b_s  # the step's starting state (replay: for tokens whose parent is not in registers)

    if TREE_LOOP:  # a large tree: one node loop at run time (no unrolling, no input lookahead)
        for j in range(T):
            b_s = _tree_parent_state(b_s, b_s0, j, tree, k, g, p_s0, s_dst, p_hu, i_n, i_b, i_h, i_head, pos0, R,
                                     stride_dst_n, stride_dst_t, o_k, o_v, o_kv, m_k, m_v, m_kv, T, H, K, V, MODE,
                                     PER_CHANNEL, META_W, True)
            a_q, a_k, a_v, a_g, a_b = _token_inputs(q, k, v, g, beta, i_b * T + j, i_h, o_k, o_v, m_k, m_v, H, K, V,
                                                    PER_CHANNEL)
            b_s = _token_update(b_s, a_q, a_k, a_v, a_g, a_b, j, o, s_dst, h_k, h_g, h_u, p_hk, p_hg, p_hu, i_n, i_b,
                                i_v, i_h, i_head, offset, pos0, R, stride_dst_n, stride_dst_t, o_k, o_v, o_kv, m_k,
                                m_v, m_kv, T, H, K, V, MODE, PER_CHANNEL)
    else:
        b_qp = tl.zeros([BK], dtype=tl.float32)  # a chain: the previous token's q (none before token 0)
        for j in tl.static_range(T):  # unrolled: T <= K + 1 is small (trees: up to 16 nodes)
            if TREE:
                if j > 0:
                    b_s = _tree_parent_state(b_s, b_s0, j, tree, k, g, p_s0, s_dst, p_hu, i_n, i_b, i_h, i_head,
                                             pos0, R, stride_dst_n, stride_dst_t, o_k, o_v, o_kv, m_k, m_v, m_kv, T,
                                             H, K, V, MODE, PER_CHANNEL, META_W, False)
            if j + PREFETCH < T:
                a_q, a_k, a_v, a_g, a_b = _token_inputs(q, k, v, g, beta, i_b * T + j + PREFETCH, i_h, o_k, o_v, m_k,
                                                        m_v, H, K, V, PER_CHANNEL)
                tq = tq + (a_q,)
                tk = tk + (a_k,)
                tv = tv + (a_v,)
                tg = tg + (a_g,)
                tb = tb + (a_b,)
            if TREE:
                b_s = _token_update(b_s, tq[j], tk[j], tv[j], tg[j], tb[j], j, o, s_dst, h_k, h_g, h_u, p_hk, p_hg,
                                    p_hu, i_n, i_b, i_v, i_h, i_head, offset, pos0, R, stride_dst_n, stride_dst_t, o_k,
                                    o_v, o_kv, m_k, m_v, m_kv, T, H, K, V, MODE, PER_CHANNEL)
            else:
                b_s, b_u = _chain_token(b_s, b_qp, tk[j], tv[j], tg[j], tb[j], j, o, i_b, i_h, o_v, m_v, T, H, V,
                                        PER_CHANNEL)
                _token_writes(b_s, b_u, tk[j], tg[j], j, s_dst, h_k, h_g, h_u, p_hk, p_hg, p_hu, i_n, i_v, i_h,
                              i_head, offset, pos0, R, stride_dst_n, stride_dst_t, o_k, o_v, o_kv, m_k, m_v, m_kv, H,
                              K, V, MODE, PER_CHANNEL)
                b_qp = tq[j].to(tl.float32)
        if not TREE:  # the chain's last output
            _store_output(tl.sum(b_s * b_qp[:, None], 0), o, i_b, T - 1, i_h, o_v, m_v, T, H, V)

    if MODE == OVERWRITE:
        tl.debug_barrier()  # in place: every thread has read its block before any writes back
        tl.store(s_dst + i_n * stride_dst_n + o_kv, b_s, mask=m_kv)


@triton.jit
def _delta_rule_fold_kernel(
    s,  # [N, H, K, V] checkpoint, updated in place
    h_k,
    h_g,
    h_u,
    num_tokens,  # [B]
    state_indices,
    stride_s_n,
    stride_hk_n,
    stride_hg_n,
    stride_hu_n,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
):
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    n = tl.load(num_tokens + i_b).to(tl.int64)
    if n <= 0:  # nothing to fold: no state traffic (deferred replay's common case)
        return
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = s + i_n * stride_s_n + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_kv, other=0.0)
    b_s = _fold_cached(
        b_s, h_k + i_n * stride_hk_n, h_g + i_n * stride_hg_n, h_u + i_n * stride_hu_n,
        0, n, i_h, o_k, o_v, m_k, m_v, H, K, V, PER_CHANNEL, L, 4, True,
    )
    tl.debug_barrier()  # in place: every thread has read its block before any writes back
    tl.store(p_s, b_s, mask=m_kv)


# ----------------------------------------------------------------------------------------------
# launch


def _launch_config(batch: int, H: int, K: int, V: int, block_v: int | None = None, num_warps: int | None = None,
                   mode: int | None = None, per_channel: bool = True, tree: bool = False, deferred: bool = False):
    """Hand-picked (BK, BV, num_warps); see the module docstring for why not autotuned.

    BK covers the whole key dim (the ``S^T k`` reduction runs over it). BV = 32 makes a
    128 x 32 fp32 block (16 KiB, 32 state registers per thread at 4 warps) and 4 * B * H
    programs; when that is under ~1024 programs (small batch, < 8 per SM on an H200) BV = 16
    doubles the programs, because at small batch the step is latency-bound, not bandwidth-bound.
    4 warps, not 8: with 8 the ``S^T k`` reduction spans 8 warps and, at the ~120 registers the
    prefetched inputs need (``PREFETCH_TOKENS``), only 2 programs (32 KiB of state) fit an SM
    instead of 4 (64 KiB in flight). Tree steps (``parents=``) take the same blocks: a tree node costs
    a chain token's arithmetic plus, off the chain, one block load of the parent's slot, so the
    same latency / occupancy trade-off holds (16-node tree at sm_90: 127 registers for snapshot,
    168 for fused replay, no spills). (sm_90 register counts: ``python benchmarks/triton_sm90_compile.py``;
    timings of the alternatives: ``benchmarks/sweep_rollback_configs.py``.)

    Chains (not trees) take other blocks, from that sweep on an H200 (batch 1-256, K = 4): BV = 16 with 2 warps (twice the
    programs, each a 128 x 16 block) for the plain update and replay of GDN and KDA (3-12%
    faster) and for GDN's snapshot and ring, except that from ~4096 programs (batch 32 at 32
    heads; measured at 64 and 256, while at batch 8 it was 7-12% slower) GDN's snapshot, ring
    and deferred replay take BV = 64 with 4 warps (5-8% faster: their per-token state stores, or
    deferred replay's longer in-register fold, go in wider rows). KDA's snapshot and ring keep
    BV = 32 / 16 (the sweep found no better).
    """
    BK = next_pow2(K)
    large = batch * H * triton.cdiv(V, 32) >= 1024
    if mode is not None and not tree and block_v is None and num_warps is None:  # a chain step (not the fold)
        stores = mode in (SNAPSHOT.value, RING.value)
        if not per_channel and batch * H * triton.cdiv(V, 32) >= 4096 and (stores or deferred):
            block_v, num_warps = 64, 4
        elif not (per_channel and stores):
            block_v, num_warps = 16, 2
    if block_v is None:
        block_v = 32 if large else 16
    BV = min(next_pow2(block_v), next_pow2(V))
    return BK, BV, num_warps or num_warps_for(BK * BV)


#: tokens whose inputs a program requests before its first arithmetic (all of them up to K = 4):
#: without it every token's loads are issued only after the previous token's reduction barriers
#: (one DRAM round trip per token, visible in the SASS); beyond 5 the registers (~170 at T = 9
#: for fused replay) would cost occupancy, and a 5-token lookahead already covers the latency.
PREFETCH_TOKENS = 5


def _prepare(q, k, v, g, beta, out):
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"expected q, k [B, T, H, K] and v [B, T, H, V]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, T, H, K = q.shape
    V = v.shape[-1]
    if g.shape not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"g must be [B, T, H] (GDN) or [B, T, H, K] (KDA), got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H], got {tuple(beta.shape)}")
    if out is None:
        out = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    elif out.shape != (B, T, H, V) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [B, T, H, V] tensor, got {tuple(out.shape)}")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    return q, k, v, g, beta, out, (B, T, H, K, V), g.dim() == 4


def _check_hist(hist_k, hist_g, hist_u, H, K, V, per_channel):
    N, L = hist_k.shape[:2]
    check_history({
        "hist_k": (hist_k, (N, L, H, K)),
        "hist_g": (hist_g, (N, L, H, K) if per_channel else (N, L, H)),
        "hist_u": (hist_u, (N, L, H, V)),
    })


def _step(mode, s_src, s_dst, q, k, v, g, beta, *, offset=0, head=None, hist=None, hist_len=None, fused=False,
          state_indices=None, out=None, block_v=None, num_warps=None, prefetch=None, src_lead=1, dst_lead=1,
          parents=None, tree_loop=None, fold_max=None):
    q, k, v, g, beta, out, (B, T, H, K, V), per_channel = _prepare(q, k, v, g, beta, out)
    tree = tree_table(parents, T, offset, q.device)
    tree_loop = runtime_tree_loop(tree, T, tree_loop)
    h_k = h_g = h_u = None
    half = 1
    if hist is not None:
        h_k, h_g, h_u = hist
        _check_hist(h_k, h_g, h_u, H, K, V, per_channel)
        half = replay_half(h_k.shape[1], offset, T, fused)
    first = bool(fused) and offset == 0
    fold_n = fold_size(half, fold_max, first)
    fold_la, fold_masked = fold_launch(fold_n)
    strides = step_state_args(s_src, s_dst, (H, K, V), src_lead, dst_lead, state_indices, B, hist)
    BK, BV, num_warps = _launch_config(B, H, K, V, block_v, num_warps, mode.value, per_channel, tree is not None,
                                       deferred=hist is not None and not fused)
    if B == 0 or T == 0:
        return out
    R = s_src.shape[1] if mode.value == RING.value else 1
    grid = (triton.cdiv(V, BV), H, B)  # B on axis 2: axis 1 is capped at 65535
    _delta_rule_step_kernel[grid](
        q, k, v, g, beta, out,
        s_src, s_dst if s_dst is not None else s_src, head, hist_len, state_indices,
        h_k, h_g, h_u, tree,
        offset, R,
        *strides,
        T=T, H=H, K=K, V=V, BK=BK, BV=BV, MODE=mode.value, PER_CHANNEL=per_channel,
        USE_STATE_INDICES=state_indices is not None,
        FUSED=bool(fused), FIRST=first, HALF=half, FOLD_N=fold_n, FOLD_LA=fold_la, FOLD_MASKED=fold_masked,
        PREFETCH=0 if tree_loop else min(T, PREFETCH_TOKENS) if prefetch is None else max(0, min(int(prefetch), T)),
        TREE=tree is not None, META_W=1 if tree is None else tree.shape[1], TREE_LOOP=tree_loop,
        num_warps=num_warps,
    )
    return out


_COMMON_ARGS = """
        q, k: ``[B, T, H, K]`` (q L2-normalised and scaled by ``K**-0.5``, k L2-normalised),
            fp32/bf16/fp16; v: ``[B, T, H, V]``; g: ``[B, T, H]`` (GDN) or ``[B, T, H, K]`` (KDA)
            log decay (<= 0); beta: ``[B, T, H]`` in (0, 1).
        state_indices: ``[B]`` int32/int64 state slot of each row; a negative id (padding,
            ``PAD_SLOT_ID = -1``) skips the row: its state and its outputs are not touched.
            None means row b uses slot b.
        out: optional contiguous ``[B, T, H, V]`` output (e.g. a CUDA-graph static buffer).
        block_v, num_warps, prefetch: override the value-block width, the warps per program and
            the tokens whose inputs are loaded ahead (testing / tuning only); tree_loop: walk a
            tree's nodes in a runtime loop (default: trees of more than ``triton_common.TREE_UNROLL_MAX`` nodes).

    Returns:
        ``o [B, T, H, V]`` fp32 (or ``out``'s dtype).

    Raises:
        ValueError: on inconsistent shapes, non-fp32 states, or states not contiguous per row.
"""


@with_common_args(_COMMON_ARGS)
def delta_rule_update(state, q, k, v, g, beta, state_indices=None, *, out=None, **tune):
    """Plain multi-token update with no rollback: run T tokens and overwrite ``state`` with s^(T).

    Args:
        state: ``[N, H, K, V]`` fp32, updated in place.
    """
    return _step(OVERWRITE, state, state, q, k, v, g, beta, state_indices=state_indices, out=out, **tune)


@with_common_args(_COMMON_ARGS)
def delta_rule_snapshot_verify(live, buf, q, k, v, g, beta, offset=0, state_indices=None, *, parents=None, out=None,
                               **tune):
    """Snapshot verify: run T tokens from ``live`` (offset 0) or ``buf[:, offset-1]``; write every state.

    Args:
        live: ``[N, H, K, V]`` fp32 committed states (read only).
        buf: ``[N, T_max, H, K, V]`` fp32; s^(offset+1+j) is written to ``buf[:, offset+j]``,
            other slots are not touched. Requires ``offset + T <= T_max`` (not checked on device).
        offset: step tokens already run by earlier calls of this step (a Python int).
        parents: None (a chain) or a tree of the T tokens (``parents[j] < j``, ``-1`` = from
            ``live``; offset 0): token j starts from its parent's state -- the registers when
            the parent is token j - 1, else ``buf[:, parents[j]]``, which the same program wrote.
            ``buf[:, j]`` receives token j's state.
    """
    if offset < 0 or offset + q.shape[1] > buf.shape[1]:
        raise ValueError(f"snapshot buffer holds {buf.shape[1]} states; got offset {offset} + {q.shape[1]} tokens")
    src, src_lead = (live, 1) if offset == 0 else (buf[:, offset - 1], 1)
    return _step(SNAPSHOT, src, buf, q, k, v, g, beta, offset=offset, state_indices=state_indices, out=out,
                 src_lead=src_lead, dst_lead=2, parents=parents, **tune)


@with_common_args(_COMMON_ARGS)
def delta_rule_ring_verify(ring, head, q, k, v, g, beta, offset=0, state_indices=None, *, parents=None, out=None,
                           **tune):
    """Ring verify: start at slot ``(head+offset) % R``; write s^(offset+1+j) to slot ``(head+offset+1+j) % R``.

    Args:
        ring: ``[N, R, H, K, V]`` fp32 ring of states; only the T written slots change.
        head: ``[N]`` int32/int64 slot of each sequence's committed state (read only; the
            commit is ``head = (head + num_tokens) % R``: no state moves; one launch with
            :func:`specdec.kernels.triton_common.ring_commit`).
        offset: step tokens already run by earlier calls of this step; needs ``offset + T < R``
            so the committed slot is never overwritten.
        parents: None (a chain) or a tree of the T tokens (offset 0): token j's state goes to
            slot ``(head+1+j) % R`` and token j starts from its parent's slot (``-1``: ``head``).
    """
    if offset + q.shape[1] >= ring.shape[1]:
        raise ValueError(f"ring of {ring.shape[1]} slots cannot hold offset {offset} + {q.shape[1]} step states")
    return _step(RING, ring, ring, q, k, v, g, beta, offset=offset, head=head, state_indices=state_indices,
                 out=out, src_lead=2, dst_lead=2, parents=parents, **tune)


@with_common_args(_COMMON_ARGS)
def delta_rule_replay_verify(ckpt, hist_k, hist_g, hist_u, hist_len, q, k, v, g, beta, offset=0, state_indices=None,
                             *, fused=False, parents=None, out=None, fold_max=None, **tune):
    """Replay verify: outputs from the checkpoint and the cached history; writes no step state.

    Both protocols start from the committed state ``ckpt[n]`` advanced by the first
    ``hist_len[n]`` cached ``(k, g, u)`` of the slot's history (u = beta (v - S^T k), the
    corrected value), then by this step's first ``offset`` tokens.

    * ``fused=False`` (deferred replay): everything is folded in registers, ``ckpt`` is read
      only; this call's ``(k, g, u)`` are appended at positions ``hist_len + offset + j``.
      Requires ``hist_len + offset + T <= L`` (not checked on device). Commit:
      :func:`delta_rule_replay_fold` of the slots whose history would overflow
      (:class:`specdec.rollback.ReplayRollback` with ``deferred=True``).
    * ``fused=True`` (eager replay, the fold fused into the next verify): the history has
      ``L = 2 T_max`` positions and ``hist_len <= T_max``. The step's first call (``offset ==
      0``) folds the committed history into ``ckpt`` in place (the one state write of the step:
      the checkpoint becomes s^(0)); every call appends its ``(k, g, u)`` at positions
      ``T_max + offset + j``. Commit: :func:`delta_rule_replay_commit` (moves the accepted
      prefix to positions ``0 ..`` and sets ``hist_len``; no state traffic). Requires ``offset
      + T <= T_max``.

    Args:
        ckpt: ``[N, H, K, V]`` fp32 checkpoint.
        hist_k: ``[N, L, H, K]``; hist_g: ``[N, L, H]`` or ``[N, L, H, K]``; hist_u: ``[N, L, H, V]``
            (any float dtype; fp32 keeps replay exact for u).
        hist_len: ``[N]`` int committed history length per slot (read only).
        fused: the protocol (above).
        fold_max: ``fused=True``, ``offset == 0``: the most committed positions any slot's history
            holds (``hist_len <= fold_max <= T_max``, not checked on device; None: T_max). The
            in-kernel fold is unrolled for ``fold_max`` positions, so a decoder sized for more
            drafts than the step commits (``num_speculative_tokens="auto"``) folds at the cost of
            a decoder sized for the step. Ignored by later calls of a step and without ``fused``;
            for the first fused call, ValueError outside ``[0, T_max]``.
        parents: None (a chain) or a tree of the T tokens (offset 0; token j's inputs are
            appended at position ``pos0 + j`` as for a chain). Replay writes no per-token state,
            so a token whose parent is not the token before it rebuilds its starting state in
            registers: the step's starting state advanced by the parent's root-first ancestor
            chain (k, g from the step's inputs, u read back from the history this program just
            appended; bit-faithful for an fp32 history). That costs ``depth`` rank-1 updates and
            a few vector loads per such token instead of a state-sized scratch buffer (a write
            and a read of K x V fp32 per node, the traffic replay exists to avoid).
    """
    return _step(REPLAY, ckpt, None, q, k, v, g, beta, offset=offset, hist=(hist_k, hist_g, hist_u),
                 hist_len=hist_len, fused=fused, state_indices=state_indices, out=out, parents=parents,
                 fold_max=fold_max, **tune)


def delta_rule_replay_commit(hist_k, hist_g, hist_u, hist_len, num_tokens, state_indices=None, max_tokens=None):
    """Commit of fused replay (one launch, no state traffic): per row, the first ``num_tokens[b]``
    tokens the step appended (positions ``T_max ..``) move to positions ``0 ..`` and
    ``hist_len[n] = num_tokens[b]``; the checkpoint already holds s^(0) (the verify folded it).

    Args:
        hist_k, hist_g, hist_u: the ``L = 2 T_max`` history of :func:`delta_rule_replay_verify`.
        hist_len: ``[N]`` int, written.
        num_tokens: ``[B]`` int in ``[0, max_tokens]`` (not checked on device).
        state_indices: ``[B]`` slot per row, negative = padding (skipped); None = ``arange(B)``.
        max_tokens: the step's width, ``[1, T_max]`` (None: ``T_max``); see
            :func:`specdec.kernels.triton_common.replay_commit_history`.
    """
    replay_commit_history(hist_len, (hist_k, hist_g, hist_u), num_tokens, state_indices, max_tokens)


def delta_rule_replay_fold(ckpt, hist_k, hist_g, hist_u, num_tokens, state_indices=None, *, block_v=None,
                           num_warps=None):
    """Replay commit / deferred flush: ``ckpt[n]`` advanced by its first ``num_tokens[b]`` cached tokens.

    Args:
        ckpt: ``[N, H, K, V]`` fp32, updated in place (rows with ``num_tokens == 0`` are not read).
        hist_k, hist_g, hist_u: the history of :func:`delta_rule_replay_verify`.
        num_tokens: ``[B]`` int32/int64 in ``[0, L]``.
        state_indices: as in :func:`delta_rule_replay_verify`.

    Raises:
        ValueError: on inconsistent shapes.
    """
    H, K, V = ckpt.shape[1:]
    check_state("ckpt", ckpt, (H, K, V), 1)
    per_channel = hist_g.dim() == 4
    _check_hist(hist_k, hist_g, hist_u, H, K, V, per_channel)
    B = num_tokens.shape[0]
    check_state_indices(state_indices, B)
    BK, BV, num_warps = _launch_config(B, H, K, V, block_v, num_warps)
    if B == 0:
        return
    _delta_rule_fold_kernel[(triton.cdiv(V, BV), H, B)](
        ckpt, hist_k, hist_g, hist_u, num_tokens, state_indices,
        ckpt.stride(0), hist_k.stride(0), hist_g.stride(0), hist_u.stride(0),
        H=H, K=K, V=V, BK=BK, BV=BV, L=hist_k.shape[1], PER_CHANNEL=per_channel,
        USE_STATE_INDICES=state_indices is not None, num_warps=num_warps,
    )


class DeltaRuleKernels(KernelSet):
    """The ``op.kernels`` of the GDN / KDA ops: :class:`specdec.kernels.protocol.RollbackKernels`
    over this module's entry points, with the launch settings of ``launch``.

    ``params``: optional ``y_dtype`` (:meth:`KernelSet.output
    <specdec.kernels.triton_common.KernelSet.output>`).

    Args:
        per_channel: False for GDN (``g [B, T, H]``), True for KDA (``g [B, T, H, K]``); a gate
            of the other shape raises ValueError.
        launch: overrides of the hand-picked launch settings (``block`` is BV).
    """

    def __init__(self, per_channel: bool, launch: LaunchConfig = LaunchConfig()):
        self.per_channel = bool(per_channel)
        self.launch = launch

    def _unpack(self, inputs):
        g = inputs["g"]
        if (g.dim() == 4) != self.per_channel:
            want = "[B, T, H, K] (KDA)" if self.per_channel else "[B, T, H] (GDN)"
            raise ValueError(f"gate g must be {want}, got {tuple(g.shape)}")
        return inputs["q"], inputs["k"], inputs["v"], g, inputs["beta"]

    def _call(self, inputs, params, out):
        """A call's keywords: its output (:meth:`KernelSet.output`) and the launch settings."""
        c = self.launch
        return dict(out=self.output(out, inputs["v"], params), block_v=c.block, num_warps=c.num_warps,
                    prefetch=c.prefetch, tree_loop=c.tree_loop)

    def update(self, state, inputs, params, *, state_indices=None, out=None):
        return delta_rule_update(state, *self._unpack(inputs), state_indices, **self._call(inputs, params, out))

    def snapshot_verify(self, live, buf, inputs, params, offset, *, state_indices=None, parents=None, out=None):
        return delta_rule_snapshot_verify(live, buf, *self._unpack(inputs), offset, state_indices, parents=parents,
                                          **self._call(inputs, params, out))

    def snapshot_commit(self, live, buf, num_tokens, *, state_indices=None):
        state_copy_commit(live, buf, num_tokens, state_indices)

    def ring_verify(self, ring, head, inputs, params, offset, *, state_indices=None, parents=None, out=None):
        return delta_rule_ring_verify(ring, head, *self._unpack(inputs), offset, state_indices, parents=parents,
                                      **self._call(inputs, params, out))

    def ring_commit(self, head, num_tokens, ring_size, *, state_indices=None):
        ring_commit(head, num_tokens, ring_size, state_indices)

    def replay_verify(self, ckpt, hist, hist_len, inputs, params, offset, *, fused=False, state_indices=None,
                      parents=None, out=None, fold_max=None):
        return delta_rule_replay_verify(ckpt, hist["k"], hist["g"], hist["u"], hist_len, *self._unpack(inputs), offset,
                                        state_indices, fused=fused, parents=parents, fold_max=fold_max,
                                        **self._call(inputs, params, out))

    def replay_commit(self, hist, hist_len, num_tokens, *, state_indices=None, max_tokens=None):
        delta_rule_replay_commit(hist["k"], hist["g"], hist["u"], hist_len, num_tokens, state_indices, max_tokens)

    def replay_fold(self, ckpt, hist, params, num_tokens, *, state_indices=None):
        delta_rule_replay_fold(ckpt, hist["k"], hist["g"], hist["u"], num_tokens, state_indices,
                               block_v=self.launch.block, num_warps=self.launch.num_warps)
