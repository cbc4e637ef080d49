"""Triton plumbing shared by the per-op kernels (GDN / KDA, Mamba-2, conv1d): launch helpers,
argument checks, tree tables, the step kernels' mode constants, the slot lookup, and the
strategy commits that move no state (snapshot copy, ring head, fused replay's history).

Nothing here allocates a state-sized buffer, reads a device value on the host or autotunes, so
every function is safe inside CUDA-graph capture. On CPU the kernels run through Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is imported), which is for testing only.
"""

from __future__ import annotations

import copy

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .protocol import LaunchConfig, triton_interpreting
from .slots import PAD_SLOT_ID, check_state_indices
from .tree_index import check_parents, tree_meta

__all__ = [
    "PAD_SLOT_ID",
    "OVERWRITE",
    "SNAPSHOT",
    "RING",
    "REPLAY",
    "TREE_UNROLL_MAX",
    "KernelSet",
    "next_pow2",
    "num_warps_for",
    "rows_of",
    "check_state",
    "check_state_indices",
    "check_history",
    "replay_half",
    "fold_launch",
    "fold_size",
    "tree_table",
    "runtime_tree_loop",
    "step_state_args",
    "with_common_args",
    "load_slot",
    "state_copy_commit",
    "ring_commit",
    "replay_commit_history",
]

#: the strategy a step kernel is compiled for (its ``MODE``); constexpr globals so kernels may read
#: them: ``OVERWRITE`` (no rollback: the final state overwrites the state), ``SNAPSHOT`` (every
#: state into a buffer), ``RING`` (every state into a ring), ``REPLAY`` (no state written; the
#: step's replay inputs appended to a history)
OVERWRITE, SNAPSHOT, RING, REPLAY = (tl.constexpr(i) for i in range(4))

#: trees of more nodes than this walk their nodes in a loop at run time instead of an unrolled one:
#: unrolled, the 64-node tree's replay kernel (nodes x depth ancestor updates) took 153 s to compile
#: for sm_90 on a CPU and over 300 s on an H200 machine; the loop compiles like a chain.
TREE_UNROLL_MAX = 16


class KernelSet:
    """Base of the per-op kernel sets (the ``kernels`` of :class:`specdec.kernels.SSMOp`): the
    :class:`~specdec.kernels.protocol.LaunchConfig` their calls use."""

    launch: LaunchConfig = LaunchConfig()

    @staticmethod
    def output(out: torch.Tensor | None, like: torch.Tensor, params: dict) -> torch.Tensor | None:
        """The ``out`` a call writes: the caller's, else (params' ``y_dtype`` given) a new contiguous
        tensor shaped as ``like`` in that dtype, which the kernels round their fp32 outputs to (as a
        cast would); else None (the kernels' default, fp32)."""
        dtype = params.get("y_dtype")
        if out is not None or dtype is None:
            return out
        return torch.empty(like.shape, dtype=dtype, device=like.device)

    def with_launch(self, launch: LaunchConfig):
        """The same kernels launched with ``launch`` (a copy; this object is unchanged)."""
        if not isinstance(launch, LaunchConfig):
            raise TypeError(f"launch must be a LaunchConfig, got {type(launch).__name__}")
        out = copy.copy(self)
        out.launch = launch
        return out


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t [..., D]`` as ``[M, D]`` rows contiguous in D: a view at any row stride (a slice of a
    wider tensor, a half of a fused projection) where the reshape allows, else a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def num_warps_for(block_elems: int, max_warps: int = 4) -> int:
    """Warps for a program whose register block has ``block_elems`` elements.

    Chosen so no element is replicated across threads (``32 * num_warps <= block_elems``):
    replicas waste registers and issue duplicate stores. (The in-place kernels also put a
    barrier between reading a block and writing it back, so they are race-free either way.)
    4 warps cover a 128 x 32 fp32 block with 32 registers per thread, enough to keep an
    H100/H200 SM busy with several programs resident.
    """
    w = max_warps
    while w > 1 and 32 * w > block_elems:
        w //= 2
    return w


def check_state(name: str, state: torch.Tensor, inner: tuple[int, ...], lead: int) -> None:
    """Raise ValueError unless ``state`` is fp32 with trailing dims ``inner`` laid out contiguously.

    ``lead`` is the number of leading (batch / slot) dims, which may have any strides.
    """
    if state.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (SSM states are kept in fp32), got {state.dtype}")
    if tuple(state.shape[lead:]) != tuple(inner):
        raise ValueError(f"{name} has per-row shape {tuple(state.shape[lead:])}, expected {tuple(inner)}")
    expect = 1
    for size, stride in zip(reversed(state.shape[lead:]), reversed(state.stride()[lead:])):
        if size > 1 and stride != expect:
            raise ValueError(f"{name} must be contiguous in its per-row dims {tuple(inner)}; strides {state.stride()}")
        expect *= size


def step_state_args(s_src, s_dst, inner, src_lead, dst_lead, state_indices, batch, hist=None):
    """Checks and launch arguments shared by every op's step kernel.

    Validates the source / destination states (fp32, per-row ``inner`` dims contiguous), the
    optional ``state_indices`` and the row count, and returns the strides the kernels take:
    ``(src_row, src_slot, dst_row, dst_slot, *hist_row_strides)`` (slot strides are 0 for states
    without a slot dim; history strides 0 for absent histories).

    Raises:
        ValueError: on any inconsistency (see :func:`check_state`).
    """
    check_state("source state", s_src, inner, src_lead)
    if s_dst is not None:
        check_state("destination state", s_dst, inner, dst_lead)
    check_state_indices(state_indices, batch)
    if state_indices is None and s_src.shape[0] < batch:
        raise ValueError(f"the state holds {s_src.shape[0]} rows, inputs have {batch}")
    strides = (
        s_src.stride(0),
        s_src.stride(1) if src_lead > 1 else 0,
        s_dst.stride(0) if s_dst is not None else 0,
        s_dst.stride(1) if (s_dst is not None and dst_lead > 1) else 0,
    )
    return strides + tuple(h.stride(0) if h is not None else 0 for h in (hist or (None, None, None)))


def check_history(want: dict) -> None:
    """Raise ValueError unless every replay-history tensor has its shape, with contiguous rows.

    Args:
        want: ``{name: (tensor, expected shape)}``, each ``[num_slots, L, ...]``.
    """
    for name, (t, shape) in want.items():
        if tuple(t.shape) != tuple(shape) or not t[0].is_contiguous():
            raise ValueError(f"{name} must be [num_slots, L, ...] = {tuple(shape)} with contiguous rows, "
                             f"got {tuple(t.shape)}")


def replay_half(L: int, offset: int, T: int, fused: bool) -> int:
    """The step kernels' ``HALF`` for a replay history of ``L`` positions: ``T_max = L / 2`` for
    fused replay (committed half, then the step's half), else ``L``.

    Raises:
        ValueError: a fused history of odd length, or ``offset + T > T_max``.
    """
    if not fused:
        return L
    if L % 2 or offset < 0 or offset + T > L // 2:
        raise ValueError(f"fused replay needs a history of 2 * T_max positions and offset + t <= T_max; "
                         f"got L = {L}, offset {offset} + {T} tokens")
    return L // 2


def fold_size(half: int, fold_max: int | None, first: bool) -> int:
    """History positions a fused replay call's in-kernel fold unrolls: ``fold_max`` for a step's
    first call when given (the most committed tokens any slot's history holds), else ``half``
    (T_max).

    Raises:
        ValueError: ``fold_max`` outside ``[0, half]`` on a first call.
    """
    n = half if fold_max is None or not first else int(fold_max)
    if not 0 <= n <= half:
        raise ValueError(f"fold_max must be in [0, T_max = {half}] (the most committed positions a slot's "
                         f"history holds), got {fold_max}")
    return n


def fold_launch(half: int):
    """(lookahead, masked) of fused replay's in-kernel fold of the committed history, unrolled
    over ``half`` positions (the step's first call: ``fold_max``, by default T_max; later calls
    of a step: T_max).

    * ``half`` <= 5 (chains of K <= 4, and the narrower steps of ``num_speculative_tokens=
      "auto"``, whose decoder sizes the fold for the step's own width: the settings the launch
      sweeps tuned): every position's loads are issued at once, unmasked, ahead of the
      arithmetic (one memory round trip; the absent ones are skipped after).
    * Larger (steps of K >= 5, auto's widest steps; trees of 16 .. 64 nodes, whose committed
      history is at most the accepted path): the loads are predicated on the committed length
      (no traffic for absent positions) with a 4-item lookahead. On an H200 (bf16 inputs, fp32
      state, T_max = 9) that made the fused replay verify 10-20% faster than issuing all nine
      unmasked, for 2, 4 and all 9 positions committed, Mamba-2 and GDN, batch 16 and 64 --
      within 2-5% of a step sized T_max = T; issuing 64 unmasked items at once cost 255
      registers and minutes of compile time for the 64-node tree."""
    return (half, False) if half <= 5 else (4, True)


def tree_table(parents, T: int, offset: int, device):
    """The ``[T, META_W]`` int32 tree table of a tree step (:func:`specdec.kernels.tree_index.tree_meta`,
    cached per tree), or None for a chain (``parents=None``).

    Raises:
        ValueError: a tree step with ``offset != 0``, or ``parents`` not a tree of the T tokens.
    """
    if parents is None:
        return None
    if offset != 0:
        raise ValueError(f"a tree step must be the step's only call (offset 0), got offset {offset}")
    return tree_meta(check_parents(parents, T), device)


def runtime_tree_loop(tree, T: int, loop: bool | None) -> bool:
    """Whether a step walks its tree nodes in a runtime loop (``loop=None``: above
    :data:`TREE_UNROLL_MAX` nodes, read at each launch; True/False force it); never for a chain."""
    if tree is None:
        return False
    return T > TREE_UNROLL_MAX if loop is None else bool(loop)


def with_common_args(common: str):
    """Decorator: append ``common`` (the ``Args`` lines every entry point of an op shares, then
    ``Returns`` / ``Raises``) to the function's docstring."""

    def wrap(fn):
        fn.__doc__ = fn.__doc__.rstrip() + "\n" + common.lstrip("\n")
        return fn

    return wrap


#: torch's softplus threshold (``F.softplus(x)`` is ``x`` above it)
SOFTPLUS_THRESHOLD = 20.0


@triton.jit
def exp_f32(x, ACCURATE: tl.constexpr):
    """``exp(x)`` in fp32: with ``ACCURATE`` libdevice's ``expf`` (within 2 ulp, as torch's), else
    ``tl.exp``, which on NVIDIA GPUs is ``ex2.approx`` of ``x * log2(e)`` (relative error up to
    ~``|x| * 1e-7``). Triton's interpreter has no libdevice: pass ``ACCURATE=``
    :func:`has_libdevice` of the tensors' device."""
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


def has_libdevice(device) -> bool:
    """Whether kernels on ``device`` can take libdevice's exp (:func:`exp_f32`): compiled for a
    CUDA device, not in Triton's interpreter (which has no libdevice)."""
    return torch.device(device).type == "cuda" and not triton_interpreting()


@triton.jit
def softplus(x, threshold, ACCURATE: tl.constexpr):
    """torch's ``F.softplus(x)`` in fp32: ``x`` above ``threshold``, else ``log1p(exp(x))``, the
    log1p as ``log(u) * e / (u - 1)`` with ``u = 1 + e`` (D. Goldberg, "What Every Computer
    Scientist Should Know About Floating-Point Arithmetic", 1991), accurate where ``1 + e`` rounds;
    NaN stays NaN. ``ACCURATE``: the exp of :func:`exp_f32`."""
    e = exp_f32(tl.where(x > threshold, threshold, x), ACCURATE)
    u = 1.0 + e
    d = u - 1.0
    return tl.where(x > threshold, x, tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d))))


@triton.jit
def load_slot(state_indices, i_b, USE_STATE_INDICES: tl.constexpr):
    """The state slot of row ``i_b`` (int64): ``state_indices[i_b]`` (negative: a padding row,
    which the caller skips), or ``i_b`` itself without ``state_indices``."""
    if USE_STATE_INDICES:
        i_n = tl.load(state_indices + i_b).to(tl.int64)
    else:
        i_n = i_b.to(tl.int64)
    return i_n


@triton.jit
def _state_copy_commit_kernel(
    live,
    buf,
    num_tokens,
    state_indices,
    stride_live_n,
    stride_buf_n,
    stride_buf_t,
    NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
):
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    n = tl.load(num_tokens + i_b).to(tl.int64)
    if n <= 0:
        return
    o_s = i_c * BLOCK + tl.arange(0, BLOCK)
    m_s = o_s < NUMEL
    b_s = tl.load(buf + i_n * stride_buf_n + (n - 1) * stride_buf_t + o_s, mask=m_s)
    tl.store(live + i_n * stride_live_n + o_s, b_s, mask=m_s)


def state_copy_commit(
    live: torch.Tensor,
    buf: torch.Tensor,
    num_tokens: torch.Tensor,
    state_indices: torch.Tensor | None = None,
) -> None:
    """Snapshot commit: ``live[i] = buf[i, n_b - 1]`` for each row b with ``n_b > 0`` (i = slot of b).

    Args:
        live: ``[N, *S]`` fp32 live states (N >= B slots), modified in place.
        buf: ``[N, T_max, *S]`` fp32 snapshot buffer written by a snapshot verify.
        num_tokens: ``[B]`` int32/int64, tokens each row commits (0 keeps the live state);
            must be <= the tokens run this step (not checked on device).
        state_indices: ``[B]`` int slot of each row, ``-1`` (padding) skips the row; None = ``arange(B)``.

    Raises:
        ValueError: on mismatched shapes, non-fp32 states or non-contiguous per-row states.
    """
    inner = tuple(live.shape[1:])
    check_state("live", live, inner, 1)
    check_state("buf", buf, inner, 2)
    batch = num_tokens.shape[0]
    check_state_indices(state_indices, batch)
    if state_indices is None and batch > live.shape[0]:
        raise ValueError(f"num_tokens has {batch} rows but live holds {live.shape[0]}")
    numel = live[0].numel() if live.shape[0] else 0
    # a pure copy: 4096 fp32 (16 KiB) per program and 4 warps gives 32 elements per thread,
    # long enough vector loads to saturate HBM with a few thousand programs at batch >= 8.
    BLOCK = min(4096, next_pow2(numel))
    grid = (triton.cdiv(numel, BLOCK), batch)
    if batch == 0 or numel == 0:
        return
    _state_copy_commit_kernel[grid](
        live,
        buf,
        num_tokens,
        state_indices,
        live.stride(0),
        buf.stride(0),
        buf.stride(1),
        NUMEL=numel,
        BLOCK=BLOCK,
        USE_STATE_INDICES=state_indices is not None,
        num_warps=num_warps_for(BLOCK),
    )


@triton.jit
def _ring_commit_kernel(head, num_tokens, state_indices, R, B, BLOCK: tl.constexpr, USE_STATE_INDICES: tl.constexpr):
    o_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_b = o_b < B
    if USE_STATE_INDICES:
        o_n = tl.load(state_indices + o_b, mask=m_b, other=-1).to(tl.int64)
        m_b = m_b & (o_n >= 0)
    else:
        o_n = o_b.to(tl.int64)
    b_n = tl.load(num_tokens + o_b, mask=m_b, other=0).to(tl.int64)
    b_head = tl.load(head + o_n, mask=m_b, other=0).to(tl.int64)
    tl.store(head + o_n, ((b_head + b_n) % R).to(head.dtype.element_ty), mask=m_b)


def ring_commit(head: torch.Tensor, num_tokens: torch.Tensor, ring_size: int,
                state_indices: torch.Tensor | None = None) -> None:
    """Ring commit in one launch: ``head[i] = (head[i] + num_tokens[b]) % R`` (no state moves).

    Args:
        head: ``[num_slots]`` int32/int64, updated in place.
        num_tokens: ``[B]`` int32/int64 accepted step tokens per row.
        ring_size: R.
        state_indices: ``[B]`` slot per row, negative = padding (skipped); None = ``arange(B)``.
    """
    B = num_tokens.shape[0]
    check_state_indices(state_indices, B)
    if B == 0:
        return
    BLOCK = min(1024, next_pow2(B))
    _ring_commit_kernel[(triton.cdiv(B, BLOCK),)](head, num_tokens, state_indices, ring_size, B, BLOCK=BLOCK,
                                                  USE_STATE_INDICES=state_indices is not None,
                                                  num_warps=num_warps_for(BLOCK))


@triton.jit
def _move_accepted(h, o, n, E: tl.constexpr, HALF: tl.constexpr, MOVE: tl.constexpr):
    # h: one row of a [*, 2 * HALF, E] history; positions HALF + j -> j for j < n <= MOVE <= HALF
    # (disjoint ranges)
    m = o < E
    vals = ()
    for j in tl.static_range(MOVE):
        vals = vals + (tl.load(h + (HALF + j) * E + o, mask=m & (j < n)),)
    for j in tl.static_range(MOVE):
        tl.store(h + j * E + o, vals[j], mask=m & (j < n))


@triton.jit
def _replay_commit_history_kernel(hist_len, num_tokens, state_indices, h0, h1, h2, stride0, stride1, stride2,
                                  E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, HALF: tl.constexpr,
                                  MOVE: tl.constexpr, BLOCK: tl.constexpr, USE_STATE_INDICES: tl.constexpr):
    i_c, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    n = tl.load(num_tokens + i_b).to(tl.int64)
    o = i_c * BLOCK + tl.arange(0, BLOCK)
    _move_accepted(h0 + i_n * stride0, o, n, E0, HALF, MOVE)
    _move_accepted(h1 + i_n * stride1, o, n, E1, HALF, MOVE)
    _move_accepted(h2 + i_n * stride2, o, n, E2, HALF, MOVE)
    if i_c == 0:  # nothing in this launch reads hist_len, so one program may write it
        tl.store(hist_len + i_n, n.to(hist_len.dtype.element_ty))


def replay_commit_history(hist_len: torch.Tensor, hist: tuple, num_tokens: torch.Tensor,
                          state_indices: torch.Tensor | None = None, max_tokens: int | None = None) -> None:
    """Commit of fused replay in one launch (no state traffic): per row b with slot i, move the
    first ``num_tokens[b]`` positions of the step's half of each history tensor (positions
    ``T_max ..``) to positions ``0 ..`` and set ``hist_len[i] = num_tokens[b]``.

    Args:
        hist_len: ``[num_slots]`` int, written (never read: the launch needs no ordering
            between its programs).
        hist: three ``[num_slots, 2 * T_max, ...]`` tensors with contiguous rows (the op's
            replay history; any dtypes).
        num_tokens: ``[B]`` int in ``[0, max_tokens]`` (not checked on device).
        state_indices: ``[B]`` slot per row, negative = padding (skipped); None = ``arange(B)``.
        max_tokens: the most tokens any row commits, in ``[1, T_max]`` (the step's width; None:
            ``T_max``): the launch issues the moves of that many positions, so a step narrower
            than the history it runs in (a decoder sized for more drafts) moves as one sized for
            it does; positions past it are never touched.

    Raises:
        ValueError: on a history of odd length, mismatched lengths or non-contiguous rows, or a
            ``max_tokens`` outside ``[1, T_max]``.
    """
    B = num_tokens.shape[0]
    check_state_indices(state_indices, B)
    if len(hist) != 3:
        raise ValueError(f"expected the three history tensors of a replay store, got {len(hist)}")
    L = hist[0].shape[1]
    for t in hist:
        if t.dim() < 2 or t.shape[1] != L or not t[0].is_contiguous() or t.shape[0] != hist[0].shape[0]:
            raise ValueError(f"history tensors must be [num_slots, L, ...] with contiguous rows and one L; got "
                             f"{[tuple(h.shape) for h in hist]}")
    if L % 2:
        raise ValueError(f"a fused replay history holds 2 * T_max positions; got L = {L}")
    if state_indices is None and B > hist_len.shape[0]:
        raise ValueError(f"num_tokens has {B} rows but hist_len holds {hist_len.shape[0]}")
    move = L // 2 if max_tokens is None else max_tokens
    if isinstance(move, bool) or not isinstance(move, int) or not 1 <= move <= L // 2:
        raise ValueError(f"max_tokens must be an int in [1, T_max = {L // 2}] (the step's width) or None; "
                         f"got {max_tokens!r}")
    E = [t[0, 0].numel() for t in hist]
    if B == 0:
        return
    # a copy of at most max_tokens x 16 KiB per program; 4 warps move 16-byte vectors (fp32)
    BLOCK = min(1024, next_pow2(max(E)))
    _replay_commit_history_kernel[(triton.cdiv(max(E), BLOCK), B)](
        hist_len, num_tokens, state_indices, *hist, *(t.stride(0) for t in hist),
        E0=E[0], E1=E[1], E2=E[2], HALF=L // 2, MOVE=move, BLOCK=BLOCK,
        USE_STATE_INDICES=state_indices is not None, num_warps=num_warps_for(BLOCK),
    )
