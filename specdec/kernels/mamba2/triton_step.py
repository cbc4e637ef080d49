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
* ``REPLAY``: start at the checkpoint folded (in registers) with the first ``hist_len+offset``
  cached ``(x, dt, B)``; write no state, append this call's ``(x, dt, B)`` to the history.

A second kernel folds the first ``num_tokens`` cached tokens into the checkpoint (replay commit).
States are fp32 ``[num_slots, H, P, N]``; inputs may be fp32/bf16/fp16 and are computed in
fp32. No host sync, no state-sized allocation (CUDA-graph safe), no autotuning (the kernels
update state in place; launch parameters are chosen by hand in :func:`_launch_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import check_state, check_state_indices, next_pow2, num_warps_for, state_copy_commit, step_state_args

__all__ = [
    "mamba2_update",
    "mamba2_snapshot_verify",
    "mamba2_ring_verify",
    "mamba2_replay_verify",
    "mamba2_replay_fold",
    "Mamba2Kernels",
]

# the strategy a step kernel is compiled for (MODE); constexpr globals so kernels may read them
OVERWRITE, SNAPSHOT, RING, REPLAY = (tl.constexpr(i) for i in range(4))


@triton.jit
def _fold_cached(
    b_h,
    h_x,
    h_dt,
    h_B,
    n,
    b_A,
    i_h,
    i_g,
    o_p,
    o_n,
    m_p,
    m_n,
    H: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    G: tl.constexpr,
):
    # b_h: [BP, BN] fp32; h_x / h_dt / h_B point at this row's history, position 0;
    # positions are H*P (x), H (dt) and G*N (B) elements apart.
    i = 0
    while i < n:  # a while loop: n is read from memory (see gdn/triton_step.py)
        b_x = tl.load(h_x + i * H * P + i_h * P + o_p, mask=m_p, other=0.0).to(tl.float32)
        b_dt = tl.load(h_dt + i * H + i_h).to(tl.float32)
        b_B = tl.load(h_B + i * G * N + i_g * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_h = b_h * tl.exp(b_dt * b_A) + b_x[:, None] * (b_dt * b_B)[None, :]
        i += 1
    return b_h


@triton.jit
def _mamba2_step_kernel(
    x,  # [B, T, H, P]
    dt,  # [B, T, H] (already softplus'ed)
    A,  # [H]
    Bm,  # [B, T, G, N]
    Cm,  # [B, T, G, N]
    D,  # [H] (HAS_D)
    y,  # [B, T, H, P] output
    s_src,  # source state: [S, H, P, N] (or a ring [S, R, H, P, N])
    s_dst,  # destination: state (OVERWRITE), buf [S, T_max, ...] (SNAPSHOT) or the ring
    head,  # [S] ring heads (RING)
    hist_len,  # [S] committed history lengths (REPLAY)
    state_indices,  # [B] slot of each row, < 0 = padding (USE_STATE_INDICES)
    h_x,  # [S, L, H, P] replay history (REPLAY)
    h_dt,  # [S, L, H]
    h_B,  # [S, L, G, N]
    offset,
    R,
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
):
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    i_g = i_h // (H // G)
    if USE_STATE_INDICES:
        i_n = tl.load(state_indices + i_b).to(tl.int64)
        if i_n < 0:
            return
    else:
        i_n = i_b

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    o_pn = i_h * P * N + o_p[:, None] * N + o_n[None, :]  # offsets inside one state

    b_A = tl.load(A + i_h).to(tl.float32)
    if HAS_D:
        b_D = tl.load(D + i_h).to(tl.float32)

    if MODE == RING:
        i_head = tl.load(head + i_n).to(tl.int64)
        p_h0 = s_src + i_n * stride_src_n + ((i_head + offset) % R) * stride_src_t
    else:
        p_h0 = s_src + i_n * stride_src_n
    b_h = tl.load(p_h0 + o_pn, mask=m_pn, other=0.0)

    if MODE == REPLAY:
        n_prev = tl.load(hist_len + i_n).to(tl.int64) + offset
        b_h = _fold_cached(
            b_h, h_x + i_n * stride_hx_n, h_dt + i_n * stride_hdt_n, h_B + i_n * stride_hB_n,
            n_prev, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N, G,
        )

    for j in tl.static_range(T):  # T <= K + 1 is small: unrolled, so input loads can be issued early
        i_t = i_b * T + j  # token row in the flattened [B * T]
        b_x = tl.load(x + (i_t * H + i_h) * P + o_p, mask=m_p, other=0.0).to(tl.float32)
        b_dt = tl.load(dt + i_t * H + i_h).to(tl.float32)
        b_B = tl.load(Bm + (i_t * G + i_g) * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_C = tl.load(Cm + (i_t * G + i_g) * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_h = b_h * tl.exp(b_dt * b_A) + b_x[:, None] * (b_dt * b_B)[None, :]
        b_y = tl.sum(b_h * b_C[None, :], 1)
        if HAS_D:
            b_y += b_x * b_D
        tl.store(y + (i_t * H + i_h) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)

        if MODE == SNAPSHOT:
            p_h = s_dst + i_n * stride_dst_n + (offset + j) * stride_dst_t
            tl.store(p_h + o_pn, b_h, mask=m_pn)
        elif MODE == RING:
            p_h = s_dst + i_n * stride_dst_n + ((i_head + offset + 1 + j) % R) * stride_dst_t
            tl.store(p_h + o_pn, b_h, mask=m_pn)
        elif MODE == REPLAY:
            pos = n_prev + j
            p_x = h_x + i_n * stride_hx_n + pos * H * P + i_h * P + o_p
            tl.store(p_x, b_x.to(h_x.dtype.element_ty), mask=m_p)
            if i_p == 0:  # dt is per head, B per group: one program of each writes them
                tl.store(h_dt + i_n * stride_hdt_n + pos * H + i_h, b_dt.to(h_dt.dtype.element_ty))
                if i_h % (H // G) == 0:
                    p_B = h_B + i_n * stride_hB_n + pos * G * N + i_g * N + o_n
                    tl.store(p_B, b_B.to(h_B.dtype.element_ty), mask=m_n)

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
    USE_STATE_INDICES: tl.constexpr,
):
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    i_g = i_h // (H // G)
    if USE_STATE_INDICES:
        i_n = tl.load(state_indices + i_b).to(tl.int64)
        if i_n < 0:
            return
    else:
        i_n = i_b
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
        n, b_A, i_h, i_g, o_p, o_n, m_p, m_n, H, P, N, G,
    )
    tl.debug_barrier()  # in place: every thread has read its block before any writes back
    tl.store(p_s, b_h, mask=m_pn)


# ----------------------------------------------------------------------------------------------
# launch


def _launch_config(batch: int, H: int, P: int, N: int, block_p: int | None):
    """Hand-picked (BP, BN, num_warps); no autotuning (see the module docstring).

    BN covers the whole state dim (``h C`` reduces over it). BP = 32 makes a 32 x 128 fp32
    block (16 KiB, 32 registers per thread at 4 warps) and 2 * B * H programs at P = 64; when
    that is under ~1024 programs (small batch, latency-bound) BP = 16 doubles the programs.
    """
    BN = next_pow2(N)
    if block_p is None:
        block_p = 32 if batch * H * triton.cdiv(P, 32) >= 1024 else 16
    BP = min(next_pow2(block_p), next_pow2(P))
    return BP, BN, num_warps_for(BP * BN)


def _prepare(x, dt, A, Bm, Cm, D, out):
    if x.dim() != 4 or dt.shape != x.shape[:3] or Bm.dim() != 4 or Cm.shape != Bm.shape or Bm.shape[:2] != x.shape[:2]:
        raise ValueError(
            f"expected x [B, T, H, P], dt [B, T, H], B and C [B, T, G, N]; got {tuple(x.shape)}, "
            f"{tuple(dt.shape)}, {tuple(Bm.shape)}, {tuple(Cm.shape)}"
        )
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2:]
    if H % G:
        raise ValueError(f"{H} heads are not divisible into {G} groups")
    if A.shape != (H,) or (D is not None and D.shape != (H,)):
        raise ValueError(f"A and D must be [H] = [{H}], got {tuple(A.shape)}, {None if D is None else tuple(D.shape)}")
    if out is None:
        out = torch.empty(Bsz, T, H, P, dtype=torch.float32, device=x.device)
    elif out.shape != (Bsz, T, H, P) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [B, T, H, P] tensor, got {tuple(out.shape)}")
    x, dt, A, Bm, Cm = (t.contiguous() for t in (x, dt, A, Bm, Cm))
    D = D.contiguous() if D is not None else None
    return x, dt, A, Bm, Cm, D, out, (Bsz, T, H, P, G, N)


def _check_hist(hist_x, hist_dt, hist_B, H, P, G, N):
    S, L = hist_x.shape[:2]
    want = {"hist_x": (hist_x, (S, L, H, P)), "hist_dt": (hist_dt, (S, L, H)), "hist_B": (hist_B, (S, L, G, N))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or not t[0].is_contiguous():
            raise ValueError(f"{name} must be [num_slots, L, ...] = {shape} with contiguous rows, got {tuple(t.shape)}")


def _step(mode, s_src, s_dst, x, dt, A, Bm, Cm, D, *, offset=0, head=None, hist=None, hist_len=None,
          state_indices=None, out=None, block_p=None, src_lead=1, dst_lead=1):
    x, dt, A, Bm, Cm, D, out, (Bsz, T, H, P, G, N) = _prepare(x, dt, A, Bm, Cm, D, out)
    h_x = h_dt = h_B = None
    if hist is not None:
        h_x, h_dt, h_B = hist
        _check_hist(h_x, h_dt, h_B, H, P, G, N)
    strides = step_state_args(s_src, s_dst, (H, P, N), src_lead, dst_lead, state_indices, Bsz, hist)
    BP, BN, num_warps = _launch_config(Bsz, H, P, N, block_p)
    if Bsz == 0 or T == 0:
        return out
    R = s_src.shape[1] if mode.value == RING.value else 1
    _mamba2_step_kernel[(triton.cdiv(P, BP), Bsz * H)](
        x, dt, A, Bm, Cm, D, out,
        s_src, s_dst if s_dst is not None else s_src, head, hist_len, state_indices,
        h_x, h_dt, h_B,
        offset, R,
        *strides,
        T=T, H=H, P=P, N=N, G=G, BP=BP, BN=BN, MODE=mode.value, HAS_D=D is not None,
        USE_STATE_INDICES=state_indices is not None,
        num_warps=num_warps,
    )
    return out


_COMMON_ARGS = """
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` discretised step (softplus already applied, > 0);
            A: ``[H]`` (< 0); Bm, Cm: ``[B, T, G, N]`` (B and C of the SSD, G groups of H / G
            heads); D: ``[H]`` skip weight or None. Any of fp32/bf16/fp16; computed in fp32.
        state_indices: ``[B]`` int32/int64 state slot of each row; a negative id (padding,
            ``PAD_SLOT_ID = -1``) skips the row: its state and its outputs are not touched.
            None means row b uses slot b.
        out: optional contiguous ``[B, T, H, P]`` output (e.g. a CUDA-graph static buffer).
        block_p: override the head-dim block (testing / tuning only).

    Returns:
        ``y [B, T, H, P]`` fp32 (or ``out``'s dtype).

    Raises:
        ValueError: on inconsistent shapes, H not divisible by G, non-fp32 states, or states
            not contiguous per row.
"""


def _with_common_args(fn):
    fn.__doc__ = fn.__doc__.rstrip() + "\n" + _COMMON_ARGS.lstrip("\n")
    return fn


@_with_common_args
def mamba2_update(state, x, dt, A, Bm, Cm, D=None, state_indices=None, *, out=None, block_p=None):
    """Plain multi-token update with no rollback: run T tokens and overwrite ``state`` with s^(T).

    Args:
        state: ``[num_slots, H, P, N]`` fp32, updated in place.
    """
    return _step(OVERWRITE, state, state, x, dt, A, Bm, Cm, D, state_indices=state_indices, out=out, block_p=block_p)


@_with_common_args
def mamba2_snapshot_verify(live, buf, x, dt, A, Bm, Cm, D=None, offset=0, state_indices=None, *, out=None,
                           block_p=None):
    """Snapshot verify: run T tokens from ``live`` (offset 0) or ``buf[:, offset-1]``; write every state.

    Args:
        live: ``[num_slots, H, P, N]`` fp32 committed states (read only).
        buf: ``[num_slots, T_max, H, P, N]`` fp32; s^(offset+1+j) is written to ``buf[:, offset+j]``,
            other slots are not touched. Requires ``offset + T <= T_max``.
        offset: step tokens already run by earlier calls of this step (a Python int).
    """
    if offset < 0 or offset + x.shape[1] > buf.shape[1]:
        raise ValueError(f"snapshot buffer holds {buf.shape[1]} states; got offset {offset} + {x.shape[1]} tokens")
    src = live if offset == 0 else buf[:, offset - 1]
    return _step(SNAPSHOT, src, buf, x, dt, A, Bm, Cm, D, offset=offset, state_indices=state_indices, out=out,
                 block_p=block_p, dst_lead=2)


@_with_common_args
def mamba2_ring_verify(ring, head, x, dt, A, Bm, Cm, D=None, offset=0, state_indices=None, *, out=None,
                       block_p=None):
    """Ring verify: start at slot ``(head+offset) % R``; write s^(offset+1+j) to slot ``(head+offset+1+j) % R``.

    Args:
        ring: ``[num_slots, R, H, P, N]`` fp32 ring of states; only the T written slots change.
        head: ``[num_slots]`` int32/int64 slot of the committed state (read only; the commit is
            ``head = (head + num_tokens) % R``: no state moves; one launch with
            :func:`specdec.kernels.triton_common.ring_commit`).
        offset: step tokens already run by earlier calls of this step; needs ``offset + T < R``.
    """
    if offset + x.shape[1] >= ring.shape[1]:
        raise ValueError(f"ring of {ring.shape[1]} slots cannot hold offset {offset} + {x.shape[1]} step states")
    return _step(RING, ring, ring, x, dt, A, Bm, Cm, D, offset=offset, head=head, state_indices=state_indices,
                 out=out, block_p=block_p, src_lead=2, dst_lead=2)


@_with_common_args
def mamba2_replay_verify(ckpt, hist_x, hist_dt, hist_B, hist_len, x, dt, A, Bm, Cm, D=None, offset=0,
                         state_indices=None, *, out=None, block_p=None):
    """Replay verify: outputs from the checkpoint folded with the cached history; write no state.

    The state before the call is ``ckpt`` advanced by the first ``hist_len[s] + offset`` cached
    ``(x, dt, B)`` of the slot's history (folded in registers); this call's ``(x, dt, B)`` are
    appended at positions ``hist_len[s] + offset + j``.

    Args:
        ckpt: ``[num_slots, H, P, N]`` fp32 checkpoint (read only).
        hist_x: ``[num_slots, L, H, P]``; hist_dt: ``[num_slots, L, H]``; hist_B: ``[num_slots, L, G, N]``
            (any float dtype able to hold the inputs exactly, e.g. the input dtype or fp32);
            requires ``hist_len + offset + T <= L`` (not checked on device).
        hist_len: ``[num_slots]`` int committed history length per slot.
    """
    return _step(REPLAY, ckpt, None, x, dt, A, Bm, Cm, D, offset=offset, hist=(hist_x, hist_dt, hist_B),
                 hist_len=hist_len, state_indices=state_indices, out=out, block_p=block_p)


def mamba2_replay_fold(ckpt, hist_x, hist_dt, hist_B, A, num_tokens, state_indices=None, *, block_p=None):
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
    BP, BN, num_warps = _launch_config(Bsz, H, P, N, block_p)
    if Bsz == 0:
        return
    _mamba2_fold_kernel[(triton.cdiv(P, BP), Bsz * H)](
        ckpt, A.contiguous(), hist_x, hist_dt, hist_B, num_tokens, state_indices,
        ckpt.stride(0), hist_x.stride(0), hist_dt.stride(0), hist_B.stride(0),
        H=H, P=P, N=N, G=G, BP=BP, BN=BN, USE_STATE_INDICES=state_indices is not None,
        num_warps=num_warps,
    )


class Mamba2Kernels:
    """The ``op.kernels`` object of the Mamba-2 op (contract: :mod:`specdec.rollback`).

    ``inputs``: ``x, dt, B, C``; ``params``: ``A``, optional ``D``; replay history keys ``x, dt, B``.
    """

    @staticmethod
    def _unpack(inputs, params):
        return inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], params.get("D")

    def update(self, state, inputs, params):
        return mamba2_update(state, *self._unpack(inputs, params))

    def snapshot_verify(self, live, buf, inputs, params, offset):
        return mamba2_snapshot_verify(live, buf, *self._unpack(inputs, params), offset)

    def snapshot_commit(self, live, buf, num_tokens):
        state_copy_commit(live, buf, num_tokens)

    def ring_verify(self, ring, head, inputs, params, offset):
        return mamba2_ring_verify(ring, head, *self._unpack(inputs, params), offset)

    def replay_verify(self, ckpt, hist, hist_len, inputs, params, offset):
        return mamba2_replay_verify(ckpt, hist["x"], hist["dt"], hist["B"], hist_len, *self._unpack(inputs, params),
                                    offset)

    def replay_fold(self, ckpt, hist, params, num_tokens):
        mamba2_replay_fold(ckpt, hist["x"], hist["dt"], hist["B"], params["A"], num_tokens)
