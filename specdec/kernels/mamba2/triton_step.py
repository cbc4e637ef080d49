"""Mamba-2 selective state update: multi-token verify, commit and replay in Triton.

The recurrence is the one of :mod:`specdec.kernels.mamba2.naive` (Dao & Gu, "Transformers are
SSMs", ICML 2024), per token as ``mamba_ssm``'s ``selective_state_update`` runs it::

    h <- exp(dt_t A) h + x_t (dt_t B_t)^T;   y_t = h C_t + D x_t      # h: [H, P, N] per row

One program owns one (row, head, block of BP head-dim rows): the ``[BP, N]`` fp32 state block
stays in registers across the step's tokens. One kernel serves every rollback strategy through
``MODE`` (as in :mod:`specdec.kernels.gdn.triton_step`):

* ``OVERWRITE`` (no rollback, the benchmark floor): the final state overwrites the state.
* ``SNAPSHOT``: s^(offset+1+j) goes to ``buf[:, offset+j]``.
* ``RING``: start at slot ``(head+offset) % R``; s^(offset+1+j) goes to slot ``(head+offset+1+j) % R``.
* ``REPLAY``: start at the checkpoint advanced by the cached ``(x, dt, B)`` of the committed
  history; write no step state, append this call's ``(x, dt, B)``. Fused (eager replay): the
  step's first call folds the committed history into the checkpoint (the last commit's fold,
  fused into this verify: one state read + one write per step) and the commit only moves the
  accepted tokens' inputs (:func:`mamba2_replay_commit`); unfused (deferred replay): folded in
  registers only, flushed by :func:`mamba2_replay_fold`. See :mod:`specdec.kernels.gdn.triton_step`.

Tree steps (``parents=``): the kernel (``TREE``) walks the tree's tokens in order, each from
its parent's state -- registers for a chain link, else the slot the same program stored for the
parent (SNAPSHOT / RING) or, for REPLAY, the starting state advanced in registers along the
parent's ancestor chain (as in :mod:`specdec.kernels.gdn.triton_step`).

A program requests the next tokens' inputs (``prefetch`` of them), the cached history and its
state block before its first arithmetic, so memory latency is paid about once per program
rather than once per token (not behind the previous token's barriers).
States are fp32 ``[num_slots, H, P, N]``; inputs may be fp32/bf16/fp16 and are computed in
fp32. No host sync, no state-sized allocation (CUDA-graph safe), no autotuning (the kernels
update state in place; launch parameters are chosen by hand in :func:`_launch_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..protocol import LaunchConfig
from . import decay
from ..triton_common import (
    OVERWRITE,
    REPLAY,
    RING,
    SNAPSHOT,
    SOFTPLUS_THRESHOLD,
    KernelSet,
    exp_f32,
    check_history,
    check_state,
    check_state_indices,
    fold_launch,
    fold_size,
    has_libdevice,
    load_slot,
    next_pow2,
    num_warps_for,
    replay_commit_history,
    replay_half,
    ring_commit,
    runtime_tree_loop,
    softplus,
    state_copy_commit,
    step_state_args,
    tree_table,
    with_common_args,
)

__all__ = [
    "mamba2_update",
    "mamba2_snapshot_verify",
    "mamba2_ring_verify",
    "mamba2_replay_verify",
    "mamba2_replay_fold",
    "mamba2_replay_commit",
    "Mamba2Kernels",
]

@triton.jit
def _token_xdB(x, dt, Bm, j, stride_xt, stride_dt, stride_bt, i_h, i_g, o_p, o_n, m_p, m_n, P: tl.constexpr,
               N: tl.constexpr):
    # token j's x, dt and B for head i_h (group i_g), as stored (formed at use: _step_dt, fp32); x, dt,
    # Bm point at the row's token 0. Loads only: a program requests its inputs before any arithmetic
    b_x = tl.load(x + j * stride_xt + i_h * P + o_p, mask=m_p, other=0.0)
    b_dt = tl.load(dt + j * stride_dt + i_h)
    b_B = tl.load(Bm + j * stride_bt + i_g * N + o_n, mask=m_n, other=0.0)
    return b_x, b_dt, b_B


@triton.jit
def _token_inputs(x, dt, Bm, Cm, j, stride_xt, stride_dt, stride_bt, stride_ct, i_h, i_g, o_p, o_n, m_p, m_n,
                  P: tl.constexpr, N: tl.constexpr):
    # token j's inputs (_token_xdB, and C)
    b_x, b_dt, b_B = _token_xdB(x, dt, Bm, j, stride_xt, stride_dt, stride_bt, i_h, i_g, o_p, o_n, m_p, m_n, P, N)
    b_C = tl.load(Cm + j * stride_ct + i_g * N + o_n, mask=m_n, other=0.0)
    return b_x, b_dt, b_B, b_C


@triton.jit
def _step_dt(a_d, b_dtb, threshold, DT_BIAS: tl.constexpr, ACCURATE: tl.constexpr):
    # a token's step in fp32: dt as given, or (DT_BIAS: the raw projection) softplus(dt + dt_bias), as
    # transformers' decode step forms it (b_dtb: the head's dt_bias in fp32)
    if DT_BIAS:
        return softplus(a_d.to(tl.float32) + b_dtb, threshold, ACCURATE)
    return a_d.to(tl.float32)


@triton.jit
def _hist_item(h_x, h_dt, h_B, pos, ok, i_h, i_g, o_p, o_n, m_p, m_n, H: tl.constexpr, P: tl.constexpr,
               N: tl.constexpr, G: tl.constexpr, MASKED: tl.constexpr):
    # cached (x, dt, B) at history position pos (h_* point at the row's position 0); MASKED as in
    # gdn/triton_step.py: predicated loads, or loads issued at once and absent items skipped later
    if MASKED:
        b_x = tl.load(h_x + pos * (H * P) + i_h * P + o_p, mask=m_p & ok, other=0.0)
        b_dt = tl.load(h_dt + pos * H + i_h, mask=ok, other=0.0)
        b_B = tl.load(h_B + pos * (G * N) + i_g * N + o_n, mask=m_n & ok, other=0.0)
    else:
        b_x = tl.load(h_x + pos * (H * P) + i_h * P + o_p, mask=m_p, other=0.0)
        b_dt = tl.load(h_dt + pos * H + i_h)
        b_B = tl.load(h_B + pos * (G * N) + i_g * N + o_n, mask=m_n, other=0.0)
    return b_x, b_dt, b_B


@triton.jit
def _fold_cached(b_h, h_x, h_dt, h_B, base, cnt, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H: tl.constexpr,
                 P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, NMAX: tl.constexpr, LA: tl.constexpr,
                 MASKED: tl.constexpr):
    # b_h: [BP, BN] fp32; apply the cached tokens at positions base .. base + cnt - 1 (cnt <= NMAX),
    # unrolled with LA items of loads in flight; an absent item (i >= cnt) is skipped
    hx = ()
    hd = ()
    hb = ()
    for i in tl.static_range(LA):
        if i < NMAX:
            a_x, a_d, a_b = _hist_item(h_x, h_dt, h_B, base + i, i < cnt, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N, G,
                                       MASKED)
            hx = hx + (a_x,)
            hd = hd + (a_d,)
            hb = hb + (a_b,)
    for i in tl.static_range(NMAX):
        if i + LA < NMAX:
            a_x, a_d, a_b = _hist_item(h_x, h_dt, h_B, base + i + LA, i + LA < cnt, i_h, i_g, o_p, o_n, m_p, m_n,
                                       H, P, N, G, MASKED)
            hx = hx + (a_x,)
            hd = hd + (a_d,)
            hb = hb + (a_b,)
        if i < cnt:  # uniform per program: absent items cost no arithmetic (see gdn's _fold_cached)
            b_x = hx[i].to(tl.float32)
            b_dt = hd[i].to(tl.float32)
            b_B = hb[i].to(tl.float32)
            b_h = b_h * tl.exp(b_dt * b_A) + b_x[:, None] * (b_dt * b_B)[None, :]
    return b_h


@triton.jit
def _tree_parent_state(b_h, b_h0, j, tree, x, dt, Bm, stride_xt, stride_dt, stride_bt, b_dtb, threshold, b_A,
                       p_h0, s_dst, i_n, i_h, i_g, i_head, R, stride_dst_n, stride_dst_t, o_p, o_n, o_pn, m_p, m_n,
                       m_pn, P: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr, META_W: tl.constexpr,
                       RUNTIME_LOOP: tl.constexpr, DT_BIAS: tl.constexpr, ACCURATE: tl.constexpr):
    # the state tree node j starts from (as in gdn/triton_step.py): the registers when its parent
    # is node j - 1, else the slot this program stored for the parent, or (replay) the starting
    # state b_h0 advanced along the parent's ancestor chain (the ancestors' (x, dt, B) come from
    # the step's inputs: no barrier needed)
    i_par = tl.load(tree + j * META_W).to(tl.int64)
    if i_par != j - 1:
        if MODE == SNAPSHOT:
            if i_par < 0:
                b_h = tl.load(p_h0 + o_pn, mask=m_pn, other=0.0)
            else:
                tl.debug_barrier()  # the parent's state was stored by other threads of this program
                b_h = tl.load(s_dst + i_n * stride_dst_n + i_par * stride_dst_t + o_pn, mask=m_pn, other=0.0)
        elif MODE == RING:
            if i_par < 0:
                b_h = tl.load(p_h0 + o_pn, mask=m_pn, other=0.0)
            else:
                tl.debug_barrier()  # the parent's state was stored by other threads of this program
                b_h = tl.load(s_dst + i_n * stride_dst_n + ((i_head + 1 + i_par) % R) * stride_dst_t + o_pn,
                              mask=m_pn, other=0.0)
        elif MODE == REPLAY:
            b_h = b_h0
            n_anc = tl.load(tree + j * META_W + 1)
            if RUNTIME_LOOP:
                for i_a in range(META_W - 2):  # a loop at run time (range, not static_range)
                    if i_a < n_anc:
                        b_h = _ancestor_update(b_h, tree, x, dt, Bm, stride_xt, stride_dt, stride_bt, b_dtb,
                                               threshold, b_A, j, i_a, i_h, i_g, o_p, o_n, m_p, m_n, P, N, META_W,
                                               DT_BIAS, ACCURATE)
            else:
                for i_a in tl.static_range(META_W - 2):  # unrolled to the tree's depth
                    if i_a < n_anc:
                        b_h = _ancestor_update(b_h, tree, x, dt, Bm, stride_xt, stride_dt, stride_bt, b_dtb,
                                               threshold, b_A, j, i_a, i_h, i_g, o_p, o_n, m_p, m_n, P, N, META_W,
                                               DT_BIAS, ACCURATE)
    return b_h


@triton.jit
def _ancestor_update(b_h, tree, x, dt, Bm, stride_xt, stride_dt, stride_bt, b_dtb, threshold, b_A, j, i_a, i_h, i_g,
                     o_p, o_n, m_p, m_n, P: tl.constexpr, N: tl.constexpr, META_W: tl.constexpr,
                     DT_BIAS: tl.constexpr, ACCURATE: tl.constexpr):
    # replay's rebuild of a parent state: apply ancestor i_a of node j (root first)
    a_t = tl.load(tree + j * META_W + 2 + i_a).to(tl.int64)
    r_x, r_dt, r_B = _token_xdB(x, dt, Bm, a_t, stride_xt, stride_dt, stride_bt, i_h, i_g, o_p, o_n, m_p, m_n, P, N)
    r_x, r_dt, r_B = r_x.to(tl.float32), _step_dt(r_dt, b_dtb, threshold, DT_BIAS, ACCURATE), r_B.to(tl.float32)
    return b_h * tl.exp(r_dt * b_A) + r_x[:, None] * (r_dt * r_B)[None, :]


@triton.jit
def _token_update(b_h, a_x, a_d, a_B, a_C, b_A, b_D, b_dtb, threshold, j, y, s_dst, h_x, h_dt, h_B, p_hx, p_hdt, p_hB,
                  i_n, i_b, i_p, i_h, i_g, i_head, offset, pos0, R, stride_dst_n, stride_dst_t, o_p, o_n, o_pn, m_p,
                  m_n, m_pn, T: tl.constexpr, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                  MODE: tl.constexpr, HAS_D: tl.constexpr, DT_BIAS: tl.constexpr, ACCURATE: tl.constexpr):
    # token j of the call: the SSM update of the state block, its output, and the per-token write of
    # the strategy (SNAPSHOT / RING: the state; REPLAY: the token's x, dt (its step) and B)
    b_x = a_x.to(tl.float32)
    b_dt = _step_dt(a_d, b_dtb, threshold, DT_BIAS, ACCURATE)
    b_B = a_B.to(tl.float32)
    b_C = a_C.to(tl.float32)
    b_h = b_h * tl.exp(b_dt * b_A) + b_x[:, None] * (b_dt * b_B)[None, :]
    b_y = tl.sum(b_h * b_C[None, :], 1)
    if HAS_D:
        b_y += b_x * b_D
    i_t = i_b * T + j  # token row in the flattened [B * T]
    tl.store(y + (i_t * H + i_h) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)
    if MODE == SNAPSHOT:
        tl.store(s_dst + i_n * stride_dst_n + (offset + j) * stride_dst_t + o_pn, b_h, mask=m_pn)
    elif MODE == RING:
        tl.store(s_dst + i_n * stride_dst_n + ((i_head + offset + 1 + j) % R) * stride_dst_t + o_pn, b_h, mask=m_pn)
    elif MODE == REPLAY:
        pos = pos0 + j
        tl.store(p_hx + pos * H * P + i_h * P + o_p, a_x.to(h_x.dtype.element_ty), mask=m_p)
        if i_p == 0:  # dt is per head, B per group: one program of each writes them
            tl.store(p_hdt + pos * H + i_h, b_dt.to(h_dt.dtype.element_ty))
            if i_h % (H // G) == 0:
                tl.store(p_hB + pos * G * N + i_g * N + o_n, a_B.to(h_B.dtype.element_ty), mask=m_n)
    return b_h


@triton.jit
def _mamba2_step_kernel(
    x,  # [B, T, H, P], each token's H * P contiguous (batch / token strides below)
    dt,  # [B, T, H], each token's H contiguous: softplus'ed, or (DT_BIAS) the raw projection
    A,  # [H]: A, or (A_LOG) A_log
    Bm,  # [B, T, G, N], each token's G * N contiguous
    Cm,  # [B, T, G, N], each token's G * N contiguous
    D,  # [H] (HAS_D)
    dt_bias,  # [H] (DT_BIAS)
    y,  # [B, T, H, P] output
    s_src,  # source state: [S, H, P, N] (or a ring [S, R, H, P, N]); REPLAY: the checkpoint
    s_dst,  # destination: state (OVERWRITE), buf [S, T_max, ...] (SNAPSHOT) or the ring
    head,  # [S] ring heads (RING)
    hist_len,  # [S] committed history lengths (REPLAY)
    state_indices,  # [B] slot of each row, < 0 = padding (USE_STATE_INDICES)
    h_x,  # [S, L, H, P] replay history (REPLAY)
    h_dt,  # [S, L, H]
    h_B,  # [S, L, G, N]
    tree,  # [T, META_W] int32 per-token tree table (TREE; specdec.kernels.tree_index.tree_meta)
    offset,
    R,
    stride_xb,
    stride_xt,
    stride_db,
    stride_dt,
    stride_bb,
    stride_bt,
    stride_cb,
    stride_ct,
    threshold,  # softplus's (DT_BIAS)
    stride_src_n,
    stride_src_t,
    stride_dst_n,
    stride_dst_t,
    stride_hx_n,
    stride_hdt_n,
    stride_hB_n,
    T: tl.constexpr,
    H: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    G: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    MODE: tl.constexpr,
    HAS_D: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    FUSED: tl.constexpr,  # REPLAY: fused-fold protocol (see gdn/triton_step.py)
    FIRST: tl.constexpr,  # offset == 0
    FOLD_LA: tl.constexpr,  # REPLAY, FUSED: history items whose loads run ahead (_fold_launch)
    FOLD_MASKED: tl.constexpr,  # REPLAY, FUSED: predicate the history loads on the committed length
    HALF: tl.constexpr,  # REPLAY: FUSED: T_max (history of 2 * T_max positions); else the history length L
    FOLD_N: tl.constexpr,  # REPLAY, FUSED, FIRST: the most committed positions a slot's history holds (<= HALF)
    PREFETCH: tl.constexpr,  # tokens whose inputs are loaded ahead of their arithmetic
    TREE: tl.constexpr,  # the T tokens are a tree (offset 0): token j starts from its parent's state
    META_W: tl.constexpr,  # TREE: columns of the tree table
    TREE_LOOP: tl.constexpr,  # TREE: walk the nodes in a loop at run time (large trees; triton_common.runtime_tree_loop)
    DT_BIAS: tl.constexpr,  # dt is the raw projection: each token's dt is softplus(dt + dt_bias), in fp32
    ACCURATE: tl.constexpr,  # DT_BIAS, A_LOG: the exps as triton_common.exp_f32's
    A_LOG: tl.constexpr,  # A holds A_log: the decay is -exp(A_log), formed here as transformers' step forms it
):
    i_p, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x += i_b * stride_xb  # the row's token 0 (the inputs are read where they are: a slice of a projection's output)
    dt += i_b * stride_db
    Bm += i_b * stride_bb
    Cm += i_b * stride_cb
    i_g = i_h // (H // G)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    o_pn = i_h * P * N + o_p[:, None] * N + o_n[None, :]  # offsets inside one state

    # the first PREFETCH tokens' inputs are requested before anything else (they depend on no load)
    tx = ()
    td = ()
    tB = ()
    tC = ()
    for j in tl.static_range(PREFETCH):
        if j < T:
            a_x, a_d, a_B, a_C = _token_inputs(x, dt, Bm, Cm, j, stride_xt, stride_dt, stride_bt, stride_ct, i_h, i_g,
                                               o_p, o_n, m_p, m_n, P, N)
            tx = tx + (a_x,)
            td = td + (a_d,)
            tB = tB + (a_B,)
            tC = tC + (a_C,)

    b_A = tl.load(A + i_h).to(tl.float32)
    if A_LOG:
        b_A = -exp_f32(b_A, ACCURATE)
    b_D = b_A * 0.0
    if HAS_D:
        b_D = tl.load(D + i_h).to(tl.float32)
    b_dtb = b_A * 0.0
    if DT_BIAS:
        b_dtb = tl.load(dt_bias + i_h).to(tl.float32)

    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return

    i_head = i_n * 0  # RING: the row's ring head
    if MODE == RING:
        i_head = tl.load(head + i_n).to(tl.int64)
        p_h0 = s_src + i_n * stride_src_n + ((i_head + offset) % R) * stride_src_t
    else:
        p_h0 = s_src + i_n * stride_src_n

    p_hx = h_x
    p_hdt = h_dt
    p_hB = h_B
    pos0 = i_n * 0  # REPLAY: the history position of this call's first token
    if MODE == REPLAY:
        p_hx = h_x + i_n * stride_hx_n
        p_hdt = h_dt + i_n * stride_hdt_n
        p_hB = h_B + i_n * stride_hB_n
        if FUSED:
            if FIRST:
                n_prev = tl.load(hist_len + i_n).to(tl.int64)
                b_h = tl.load(p_h0 + o_pn, mask=m_pn, other=0.0)
                b_h = _fold_cached(b_h, p_hx, p_hdt, p_hB, 0, n_prev, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N, G,
                                   FOLD_N, FOLD_LA, FOLD_MASKED)
                if n_prev > 0:  # absorb the committed history: the checkpoint is now s^(0)
                    tl.debug_barrier()  # in place: every thread has read its block before any writes back
                    tl.store(p_h0 + o_pn, b_h, mask=m_pn)
            else:  # the checkpoint is s^(0) (the step's first call absorbed); this step's first offset tokens
                b_h = tl.load(p_h0 + o_pn, mask=m_pn, other=0.0)
                b_h = _fold_cached(b_h, p_hx, p_hdt, p_hB, HALF, offset, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N,
                                   G, HALF, FOLD_LA, FOLD_MASKED)
            pos0 = HALF + offset
        else:
            n_prev = tl.load(hist_len + i_n).to(tl.int64) + offset
            b_h = tl.load(p_h0 + o_pn, mask=m_pn, other=0.0)
            b_h = _fold_cached(b_h, p_hx, p_hdt, p_hB, 0, n_prev, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N, G,
                               HALF, 4, True)
            pos0 = n_prev
    else:
        b_h = tl.load(p_h0 + o_pn, mask=m_pn, other=0.0)
    if TREE:
        b_h0 = b_h  # the step's starting state (replay: for tokens whose parent is not in registers)

    if TREE_LOOP:  # a large tree: one node loop at run time (no unrolling, no input lookahead)
        for j in range(T):
            b_h = _tree_parent_state(b_h, b_h0, j, tree, x, dt, Bm, stride_xt, stride_dt, stride_bt, b_dtb, threshold,
                                     b_A, p_h0, s_dst, i_n, i_h, i_g, i_head, R, stride_dst_n, stride_dst_t, o_p, o_n,
                                     o_pn, m_p, m_n, m_pn, P, N, MODE, META_W, True, DT_BIAS, ACCURATE)
            a_x, a_d, a_B, a_C = _token_inputs(x, dt, Bm, Cm, j, stride_xt, stride_dt, stride_bt, stride_ct, i_h, i_g,
                                               o_p, o_n, m_p, m_n, P, N)
            b_h = _token_update(b_h, a_x, a_d, a_B, a_C, b_A, b_D, b_dtb, threshold, j, y, s_dst, h_x, h_dt, h_B, p_hx,
                                p_hdt, p_hB, i_n, i_b, i_p, i_h, i_g, i_head, offset, pos0, R, stride_dst_n,
                                stride_dst_t, o_p, o_n, o_pn, m_p, m_n, m_pn, T, H, P, N, G, MODE, HAS_D, DT_BIAS,
                                ACCURATE)
    else:
        for j in tl.static_range(T):  # unrolled: T <= K + 1 is small (trees: up to 16 nodes)
            if TREE:
                if j > 0:
                    b_h = _tree_parent_state(b_h, b_h0, j, tree, x, dt, Bm, stride_xt, stride_dt, stride_bt, b_dtb,
                                             threshold, b_A, p_h0, s_dst, i_n, i_h, i_g, i_head, R, stride_dst_n,
                                             stride_dst_t, o_p, o_n, o_pn, m_p, m_n, m_pn, P, N, MODE, META_W, False,
                                             DT_BIAS, ACCURATE)
            if j + PREFETCH < T:
                a_x, a_d, a_B, a_C = _token_inputs(x, dt, Bm, Cm, j + PREFETCH, stride_xt, stride_dt, stride_bt,
                                                   stride_ct, i_h, i_g, o_p, o_n, m_p, m_n, P, N)
                tx = tx + (a_x,)
                td = td + (a_d,)
                tB = tB + (a_B,)
                tC = tC + (a_C,)
            b_h = _token_update(b_h, tx[j], td[j], tB[j], tC[j], b_A, b_D, b_dtb, threshold, j, y, s_dst, h_x, h_dt, h_B,
                                p_hx, p_hdt, p_hB, i_n, i_b, i_p, i_h, i_g, i_head, offset, pos0, R, stride_dst_n,
                                stride_dst_t, o_p, o_n, o_pn, m_p, m_n, m_pn, T, H, P, N, G, MODE, HAS_D, DT_BIAS,
                                ACCURATE)

    if MODE == OVERWRITE:
        tl.debug_barrier()  # in place: every thread has read its block before any writes back
        tl.store(s_dst + i_n * stride_dst_n + o_pn, b_h, mask=m_pn)


@triton.jit
def _mamba2_fold_kernel(
    s,  # [S, H, P, N] checkpoint, updated in place
    A,
    h_x,
    h_dt,
    h_B,
    num_tokens,  # [B]
    state_indices,
    stride_s_n,
    stride_hx_n,
    stride_hdt_n,
    stride_hB_n,
    H: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    G: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    L: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
):
    i_p, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_g = i_h // (H // G)
    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    n = tl.load(num_tokens + i_b).to(tl.int64)
    if n <= 0:  # nothing to fold: no state traffic (deferred replay's common case)
        return
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    p_s = s + i_n * stride_s_n + i_h * P * N + o_p[:, None] * N + o_n[None, :]
    b_h = tl.load(p_s, mask=m_pn, other=0.0)
    b_A = tl.load(A + i_h).to(tl.float32)
    b_h = _fold_cached(
        b_h, h_x + i_n * stride_hx_n, h_dt + i_n * stride_hdt_n, h_B + i_n * stride_hB_n,
        0, n, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N, G, L, 4, True,
    )
    tl.debug_barrier()  # in place: every thread has read its block before any writes back
    tl.store(p_s, b_h, mask=m_pn)


# ----------------------------------------------------------------------------------------------
# launch


def _launch_config(batch: int, H: int, P: int, N: int, block_p: int | None = None, num_warps: int | None = None,
                   prefetch: int | None = None, T: int = 1, mode: int | None = None, tree: bool = False,
                   deferred: bool = False):
    """Hand-picked (BP, BN, num_warps, prefetch); no autotuning (see the module docstring).

    BN covers the whole state dim (``h C`` reduces over it, inside a warp: a warp owns whole
    rows). BP = 32 makes a 32 x 128 fp32 block (16 KiB) and 2 * B * H programs at P = 64, run
    by 8 warps (4 rows each: half the per-token arithmetic of 4 warps, and at <= 128 registers
    3 programs per SM) with a 3-token input lookahead (5 tokens would take 120 registers at 4
    warps, 200 for fused replay). Under ~1024 programs (small batch, latency-bound) BP = 16
    doubles the programs and every token's inputs are requested up front (4 warps, <= 160
    registers: with at most ~4 programs per SM occupancy does not matter). Register counts for
    sm_90: ``python benchmarks/triton_sm90_compile.py``; timings of alternatives:
    ``benchmarks/sweep_rollback_configs.py``.

    At large batch the plain update and deferred replay take 4 warps and no lookahead (BP = 32),
    from that sweep on an H200 (batch 8-256, K = 4): 20-22% faster for the plain update at batch
    64-256 and 7% for deferred replay at batch 64 (with the in-register fold skipping absent
    history items, 8 warps with a lookahead do not pay). Snapshot and ring are within 2% across
    the configurations. Tree steps take the settings of the first paragraph (the unrolled 16-node
    fused replay would take 245 registers at 4 warps, 163 at 8).

    Fused replay at large batch (from batch 4 at the bench shape's 128 heads) takes BP = 8 rows
    with one warp and a 3-token lookahead: the whole block in one warp, so no token waits on a
    cross-warp barrier (5 barriers in the sm_90 SASS of a K = 4 step against 40 at 32 rows x 4
    warps; 128 registers, no spills: ``python benchmarks/sass_configs.py --op mamba2 --configs
    "32,4,0;8,1,3"``). On an H100 at K = 4 it took 247.8 us per layer and step at batch 64 and
    966.1 at batch 256, against 333.6 and 1287.6 at 32 rows x 4 warps (80-82% of copy bandwidth
    against 59-61%; ``benchmarks/sweep_rollback_configs.py``); not yet timed on an H200, where
    the 4-warp setting had been chosen. The plain update and deferred replay keep their settings:
    one warp was level for the update (222.2 against 221.3 us) and slower for deferred replay
    (342.8 against 337.2 us, its fold launched alike).

    The fold (:func:`mamba2_replay_fold`: replay's commit, deferred replay's flush) takes deferred
    replay's settings: at large batch 32 rows x 4 warps, where 8 warps had made deferred replay's
    step 393.0 against 337.2 us at batch 64 on the same H100 (its verify launched alike).
    """
    BN = next_pow2(N)
    large = batch * H * triton.cdiv(P, 32) >= 1024
    lean = large and not tree and mode in (OVERWRITE.value, REPLAY.value)
    if lean and mode == REPLAY.value and not deferred and (block_p, num_warps, prefetch) == (None, None, None):
        block_p, num_warps, prefetch = 8, 1, 3
    if block_p is None:
        block_p = 32 if large else 16
    BP = min(next_pow2(block_p), next_pow2(P))
    if num_warps is None:
        num_warps = min(4 if lean else 8 if large else 4, num_warps_for(BP * BN, 8))
    if prefetch is None:
        prefetch = 0 if lean else 3 if large else 5
    return BP, BN, num_warps, max(0, min(int(prefetch), T))


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """``t [B, T, ...]`` with each token's entries contiguous (read in place: e.g. a slice of a
    projection's output), else a contiguous copy."""
    inner = t.shape[2:]
    want = [1] * len(inner)
    for i in range(len(inner) - 2, -1, -1):
        want[i] = want[i + 1] * inner[i + 1]
    if all(t.stride(2 + i) == want[i] for i in range(len(inner)) if inner[i] > 1):
        return t
    return t.contiguous()


def _prepare(x, dt, A, Bm, Cm, D, out, dt_bias=None, A_log=None):
    if x.dim() != 4 or dt.shape != x.shape[:3] or Bm.dim() != 4 or Cm.shape != Bm.shape or Bm.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"expected x [B, T, H, P], dt [B, T, H], B and C [B, T, G, N]; got {tuple(x.shape)}, "
            f"{tuple(dt.shape)}, {tuple(Bm.shape)}, {tuple(Cm.shape)}"
        )
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2:]
    if H % G:
        raise ValueError(f"{H} heads are not divisible into {G} groups")
    if (A is None) == (A_log is None):
        raise ValueError("give the decay as A or as A_log (exactly one of them)")
    A = A if A is not None else A_log
    if A.shape != (H,) or (D is not None and D.shape != (H,)) or (dt_bias is not None and dt_bias.shape != (H,)):
        raise ValueError(f"A, D and dt_bias must be [H] = [{H}], got {tuple(A.shape)}, "
                         f"{None if D is None else tuple(D.shape)}, {None if dt_bias is None else tuple(dt_bias.shape)}")
    if out is None:
        out = torch.empty(Bsz, T, H, P, dtype=torch.float32, device=x.device)
    elif out.shape != (Bsz, T, H, P) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [B, T, H, P] tensor, got {tuple(out.shape)}")
    x, dt, Bm, Cm = (_token_major(t) for t in (x, dt, Bm, Cm))
    A, D, dt_bias = (t.contiguous() if t is not None else None for t in (A, D, dt_bias))
    return x, dt, A, Bm, Cm, D, dt_bias, out, (Bsz, T, H, P, G, N)


def _check_hist(hist_x, hist_dt, hist_B, H, P, G, N):
    S, L = hist_x.shape[:2]
    check_history({"hist_x": (hist_x, (S, L, H, P)), "hist_dt": (hist_dt, (S, L, H)), "hist_B": (hist_B, (S, L, G, N))})


def _step(mode, s_src, s_dst, x, dt, A, Bm, Cm, D, *, offset=0, head=None, hist=None, hist_len=None, fused=False,
          state_indices=None, out=None, block_p=None, num_warps=None, prefetch=None, src_lead=1, dst_lead=1,
          parents=None, tree_loop=None, fold_max=None, dt_bias=None, A_log=None):
    x, dt, A, Bm, Cm, D, dt_bias, out, (Bsz, T, H, P, G, N) = _prepare(x, dt, A, Bm, Cm, D, out, dt_bias, A_log)
    tree = tree_table(parents, T, offset, x.device)
    tree_loop = runtime_tree_loop(tree, T, tree_loop)
    h_x = h_dt = h_B = None
    half = 1
    if hist is not None:
        h_x, h_dt, h_B = hist
        _check_hist(h_x, h_dt, h_B, H, P, G, N)
        half = replay_half(h_x.shape[1], offset, T, fused)
    first = bool(fused) and offset == 0
    fold_n = fold_size(half, fold_max, first)
    fold_la, fold_masked = fold_launch(fold_n)
    strides = step_state_args(s_src, s_dst, (H, P, N), src_lead, dst_lead, state_indices, Bsz, hist)
    BP, BN, num_warps, prefetch = _launch_config(Bsz, H, P, N, block_p, num_warps, prefetch, T, mode.value,
                                                 tree=tree is not None, deferred=hist is not None and not fused)
    if Bsz == 0 or T == 0:
        return out
    R = s_src.shape[1] if mode.value == RING.value else 1
    _mamba2_step_kernel[(triton.cdiv(P, BP), H, Bsz)](  # B on axis 2: axis 1 is capped at 65535
        x, dt, A, Bm, Cm, D, dt_bias, out,
        s_src, s_dst if s_dst is not None else s_src, head, hist_len, state_indices,
        h_x, h_dt, h_B, tree,
        offset, R,
        *x.stride()[:2], *dt.stride()[:2], *Bm.stride()[:2], *Cm.stride()[:2], SOFTPLUS_THRESHOLD,
        *strides,
        T=T, H=H, P=P, N=N, G=G, BP=BP, BN=BN, MODE=mode.value, HAS_D=D is not None,
        USE_STATE_INDICES=state_indices is not None,
        FUSED=bool(fused), FIRST=first, HALF=half, FOLD_N=fold_n, FOLD_LA=fold_la, FOLD_MASKED=fold_masked,
        PREFETCH=0 if tree_loop else prefetch,
        TREE=tree is not None, META_W=1 if tree is None else tree.shape[1], TREE_LOOP=tree_loop,
        DT_BIAS=dt_bias is not None, ACCURATE=has_libdevice(x.device), A_LOG=A_log is not None,
        num_warps=num_warps,
    )
    return out


_COMMON_ARGS = """
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` discretised step (softplus already applied, > 0;
            with ``dt_bias``, the raw projection); A: ``[H]`` (< 0); Bm, Cm: ``[B, T, G, N]`` (B
            and C of the SSD, G groups of H / G heads); D: ``[H]`` skip weight or None. Any of
            fp32/bf16/fp16; computed in fp32. Read where they are when each token's entries are
            contiguous (any batch / token strides: e.g. slices of a projection's output), else copied.
        dt_bias: ``[H]`` or None: with it the kernel forms each token's step as transformers'
            decode step does, ``softplus(dt + dt_bias)`` in fp32 (what replay caches too), so the
            raw projection needs no kernel of its own.
        A_log: ``[H]`` or None: given instead of ``A`` (then None), the kernel forms the decay
            ``A = -exp(A_log)`` in fp32, as transformers' decode step does.
        state_indices: ``[B]`` int32/int64 state slot of each row; a negative id (padding,
            ``PAD_SLOT_ID = -1``) skips the row: its state and its outputs are not touched.
            None means row b uses slot b.
        out: optional contiguous ``[B, T, H, P]`` output (e.g. a CUDA-graph static buffer).
        block_p, num_warps, prefetch: override the head-dim block, the warps per program and the
            tokens whose inputs are loaded ahead (testing / tuning only); tree_loop: walk a tree's
            nodes in a runtime loop (default: trees of more than ``triton_common.TREE_UNROLL_MAX``
            nodes).

    Returns:
        ``y [B, T, H, P]`` fp32 (or ``out``'s dtype).

    Raises:
        ValueError: on inconsistent shapes, H not divisible by G, non-fp32 states, or states
            not contiguous per row.
"""


@with_common_args(_COMMON_ARGS)
def mamba2_update(state, x, dt, A, Bm, Cm, D=None, state_indices=None, *, out=None, dt_bias=None, A_log=None,
                  **tune):
    """Plain multi-token update with no rollback: run T tokens and overwrite ``state`` with s^(T).

    Args:
        state: ``[num_slots, H, P, N]`` fp32, updated in place.
    """
    return _step(OVERWRITE, state, state, x, dt, A, Bm, Cm, D, state_indices=state_indices, out=out, dt_bias=dt_bias,
                 A_log=A_log, **tune)


@with_common_args(_COMMON_ARGS)
def mamba2_snapshot_verify(live, buf, x, dt, A, Bm, Cm, D=None, offset=0, state_indices=None, *, parents=None, out=None,
                           dt_bias=None, A_log=None, **tune):
    """Snapshot verify: run T tokens from ``live`` (offset 0) or ``buf[:, offset-1]``; write every state.

    Args:
        live: ``[num_slots, H, P, N]`` fp32 committed states (read only).
        buf: ``[num_slots, T_max, H, P, N]`` fp32; s^(offset+1+j) is written to ``buf[:, offset+j]``,
            other slots are not touched. Requires ``offset + T <= T_max``.
        offset: step tokens already run by earlier calls of this step (a Python int).
        parents: None (a chain) or a tree of the T tokens (offset 0): token j starts from its
            parent's state (``buf[:, parents[j]]``, registers for a chain link, ``live`` for -1);
            ``buf[:, j]`` receives token j's state.
    """
    if offset < 0 or offset + x.shape[1] > buf.shape[1]:
        raise ValueError(f"snapshot buffer holds {buf.shape[1]} states; got offset {offset} + {x.shape[1]} tokens")
    src = live if offset == 0 else buf[:, offset - 1]
    return _step(SNAPSHOT, src, buf, x, dt, A, Bm, Cm, D, offset=offset, state_indices=state_indices, out=out,
                 dst_lead=2, parents=parents, dt_bias=dt_bias, A_log=A_log, **tune)


@with_common_args(_COMMON_ARGS)
def mamba2_ring_verify(ring, head, x, dt, A, Bm, Cm, D=None, offset=0, state_indices=None, *, parents=None, out=None,
                       dt_bias=None, A_log=None, **tune):
    """Ring verify: start at slot ``(head+offset) % R``; write s^(offset+1+j) to slot ``(head+offset+1+j) % R``.

    Args:
        ring: ``[num_slots, R, H, P, N]`` fp32 ring of states; only the T written slots change.
        head: ``[num_slots]`` int32/int64 slot of the committed state (read only; the commit is
            ``head = (head + num_tokens) % R``: no state moves; one launch with
            :func:`specdec.kernels.triton_common.ring_commit`).
        offset: step tokens already run by earlier calls of this step; needs ``offset + T < R``.
        parents: None (a chain) or a tree of the T tokens (offset 0): token j's state goes to
            slot ``(head+1+j) % R``; it starts from its parent's slot (``-1``: ``head``).
    """
    if offset + x.shape[1] >= ring.shape[1]:
        raise ValueError(f"ring of {ring.shape[1]} slots cannot hold offset {offset} + {x.shape[1]} step states")
    return _step(RING, ring, ring, x, dt, A, Bm, Cm, D, offset=offset, head=head, state_indices=state_indices,
                 out=out, src_lead=2, dst_lead=2, parents=parents, dt_bias=dt_bias, A_log=A_log, **tune)


@with_common_args(_COMMON_ARGS)
def mamba2_replay_verify(ckpt, hist_x, hist_dt, hist_B, hist_len, x, dt, A, Bm, Cm, D=None, offset=0,
                         state_indices=None, *, fused=False, parents=None, out=None, fold_max=None, dt_bias=None,
                         A_log=None, **tune):
    """Replay verify: outputs from the checkpoint and the cached history; writes no step state.

    Both protocols start from the committed state ``ckpt[s]`` advanced by the first
    ``hist_len[s]`` cached ``(x, dt, B)`` of the slot's history, then by this step's first
    ``offset`` tokens (the two protocols of :func:`specdec.kernels.gdn.triton_step.delta_rule_replay_verify`):

    * ``fused=False`` (deferred replay): folded in registers, ``ckpt`` read only; this call's
      inputs are appended at positions ``hist_len + offset + j`` (requires ``hist_len + offset
      + T <= L``, not checked on device); commit with :func:`mamba2_replay_fold` of the slots
      whose history would overflow.
    * ``fused=True`` (eager replay): ``L = 2 T_max``, ``hist_len <= T_max``; the step's first
      call folds the committed history into ``ckpt`` in place (it becomes s^(0)); every call
      appends at positions ``T_max + offset + j``; commit with :func:`mamba2_replay_commit`.

    Args:
        ckpt: ``[num_slots, H, P, N]`` fp32 checkpoint.
        hist_x: ``[num_slots, L, H, P]``; hist_dt: ``[num_slots, L, H]``; hist_B: ``[num_slots, L, G, N]``
            (any float dtype able to hold the inputs exactly, e.g. the input dtype or fp32).
        hist_len: ``[num_slots]`` int committed history length per slot (read only).
        fused: the protocol (above).
        fold_max: ``fused=True``, ``offset == 0``: the most committed positions any slot's history
            holds (as in ``delta_rule_replay_verify``; None: T_max).
        parents: None (a chain) or a tree of the T tokens (offset 0; token j's inputs are
            appended at ``pos0 + j`` as for a chain). A token whose parent is not the token
            before it rebuilds its starting state in registers from the step's starting state
            and the ancestors' ``(x, dt, B)`` (the step's inputs): ``depth`` rank-1 updates
            instead of a state-sized scratch buffer (see ``delta_rule_replay_verify``).
    """
    return _step(REPLAY, ckpt, None, x, dt, A, Bm, Cm, D, offset=offset, hist=(hist_x, hist_dt, hist_B),
                 hist_len=hist_len, fused=fused, state_indices=state_indices, out=out, parents=parents,
                 fold_max=fold_max, dt_bias=dt_bias, A_log=A_log, **tune)


def mamba2_replay_commit(hist_x, hist_dt, hist_B, hist_len, num_tokens, state_indices=None, max_tokens=None):
    """Commit of fused replay (one launch, no state traffic): the first ``num_tokens[b]`` tokens the
    step appended (positions ``T_max ..``) move to positions ``0 ..``; ``hist_len[s] = num_tokens[b]``;
    ``max_tokens``: the step's width (None: ``T_max``).
    See :func:`specdec.kernels.triton_common.replay_commit_history`."""
    replay_commit_history(hist_len, (hist_x, hist_dt, hist_B), num_tokens, state_indices, max_tokens)


def mamba2_replay_fold(ckpt, hist_x, hist_dt, hist_B, A, num_tokens, state_indices=None, *, block_p=None,
                       num_warps=None):
    """Replay commit / deferred flush: ``ckpt[s]`` advanced by its first ``num_tokens[b]`` cached tokens.

    Args:
        ckpt: ``[num_slots, H, P, N]`` fp32, updated in place (rows with ``num_tokens == 0`` are not read).
        hist_x, hist_dt, hist_B: the history of :func:`mamba2_replay_verify`; A: ``[H]``.
        num_tokens: ``[B]`` int32/int64 in ``[0, L]``.
        state_indices: ``[B]`` slot per row, negative = padding (skipped); None = ``arange(B)``.

    Raises:
        ValueError: on inconsistent shapes.
    """
    H, P, N = ckpt.shape[1:]
    G = hist_B.shape[2]
    check_state("ckpt", ckpt, (H, P, N), 1)
    _check_hist(hist_x, hist_dt, hist_B, H, P, G, N)
    if A.shape != (H,):
        raise ValueError(f"A must be [H] = [{H}], got {tuple(A.shape)}")
    Bsz = num_tokens.shape[0]
    check_state_indices(state_indices, Bsz)
    BP, BN, num_warps, _ = _launch_config(Bsz, H, P, N, block_p, num_warps, mode=REPLAY.value, deferred=True)
    if Bsz == 0:
        return
    _mamba2_fold_kernel[(triton.cdiv(P, BP), H, Bsz)](
        ckpt, A.contiguous(), hist_x, hist_dt, hist_B, num_tokens, state_indices,
        ckpt.stride(0), hist_x.stride(0), hist_dt.stride(0), hist_B.stride(0),
        H=H, P=P, N=N, G=G, BP=BP, BN=BN, L=hist_x.shape[1], USE_STATE_INDICES=state_indices is not None,
        num_warps=num_warps,
    )


class Mamba2Kernels(KernelSet):
    """The ``op.kernels`` of the Mamba-2 op: :class:`specdec.kernels.protocol.RollbackKernels`
    over this module's entry points, with the launch settings of ``launch`` (``block`` is BP).

    ``inputs``: ``x, dt, B, C``; ``params``: ``A`` or ``A_log``, optional ``D``, optional ``dt_bias``
    (then ``dt`` is the raw projection: see ``dt_bias`` of :func:`mamba2_update`), optional ``y_dtype``
    (:meth:`KernelSet.output <specdec.kernels.triton_common.KernelSet.output>`); replay history
    keys ``x, dt, B`` (dt softplus'ed).
    """

    def __init__(self, launch: LaunchConfig = LaunchConfig()):
        self.launch = launch

    @staticmethod
    def _unpack(inputs, params):
        return inputs["x"], inputs["dt"], params.get("A"), inputs["B"], inputs["C"], params.get("D")

    def _call(self, inputs, params, out):
        """A call's keywords: its output (:meth:`KernelSet.output`), ``dt_bias`` and the launch settings."""
        c = self.launch
        return dict(out=self.output(out, inputs["x"], params), dt_bias=params.get("dt_bias"),
                    A_log=params.get("A_log") if params.get("A") is None else None, block_p=c.block,
                    num_warps=c.num_warps, prefetch=c.prefetch, tree_loop=c.tree_loop)

    def update(self, state, inputs, params, *, state_indices=None, out=None):
        return mamba2_update(state, *self._unpack(inputs, params), state_indices, **self._call(inputs, params, out))

    def snapshot_verify(self, live, buf, inputs, params, offset, *, state_indices=None, parents=None, out=None):
        return mamba2_snapshot_verify(live, buf, *self._unpack(inputs, params), offset, state_indices, parents=parents,
                                      **self._call(inputs, params, out))

    def snapshot_commit(self, live, buf, num_tokens, *, state_indices=None):
        state_copy_commit(live, buf, num_tokens, state_indices)

    def ring_verify(self, ring, head, inputs, params, offset, *, state_indices=None, parents=None, out=None):
        return mamba2_ring_verify(ring, head, *self._unpack(inputs, params), offset, state_indices, parents=parents,
                                  **self._call(inputs, params, out))

    def ring_commit(self, head, num_tokens, ring_size, *, state_indices=None):
        ring_commit(head, num_tokens, ring_size, state_indices)

    def replay_verify(self, ckpt, hist, hist_len, inputs, params, offset, *, fused=False, state_indices=None,
                      parents=None, out=None, fold_max=None):
        return mamba2_replay_verify(ckpt, hist["x"], hist["dt"], hist["B"], hist_len, *self._unpack(inputs, params),
                                    offset, state_indices, fused=fused, parents=parents, fold_max=fold_max,
                                    **self._call(inputs, params, out))

    def replay_commit(self, hist, hist_len, num_tokens, *, state_indices=None, max_tokens=None):
        mamba2_replay_commit(hist["x"], hist["dt"], hist["B"], hist_len, num_tokens, state_indices, max_tokens)

    def replay_fold(self, ckpt, hist, params, num_tokens, *, state_indices=None):
        mamba2_replay_fold(ckpt, hist["x"], hist["dt"], hist["B"], decay(params), num_tokens, state_indices,
                           block_p=self.launch.block, num_warps=self.launch.num_warps)
