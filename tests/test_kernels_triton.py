"""Triton kernels against the fp32 torch references (``naive.py``), through Triton's interpreter.

The kernels are driven through the library's own objects: each op's kernel set
(``OPS[name].on("triton").kernels``, the :class:`specdec.kernels.RollbackKernels` contract, with
launch overrides from :class:`specdec.kernels.LaunchConfig`), the conv op, and the rollback
strategies; inputs come from the experiments' generators (``synthetic_inputs``). Every test
draws fresh random inputs (never zeros), poisons outputs with NaN first and checks
they are fully written, and asserts that the state a call must not touch (ring slots outside
the write set, snapshot slots past offset + t, history positions outside the append, rows whose
``state_indices`` is the pad id, slots no row uses) stays bit-exact. Sizes are tiny: the
interpreter runs each program in numpy.

``SPECDEC_TEST_CUDA=1`` runs the same grid compiled on a GPU (and enables the real-size
``@pytest.mark.gpu`` tests: ``SPECDEC_TEST_CUDA=1 pytest tests/test_kernels_triton.py -m "gpu or not gpu"``).
"""

import os
import subprocess
import sys

from markers import ON_CUDA, needs_cuda  # conftest sets TRITON_INTERPRET=1 unless SPECDEC_TEST_CUDA=1

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # specdec without installing

import pytest  # noqa: E402
import torch  # noqa: E402

from specdec.experiments.kernel_timing import synthetic_inputs, synthetic_params  # noqa: E402
from specdec.experiments.models import SSMShape  # noqa: E402
from specdec.kernels import OPS, LaunchConfig, RollbackKernels, conv1d_op, get_op  # noqa: E402
from specdec.kernels.conv1d import CONV1D  # noqa: E402
from specdec.kernels.conv1d.naive import conv1d_commit, conv1d_tree_verify, conv1d_update, conv1d_verify  # noqa: E402
from specdec.kernels.gdn import triton_step as dr  # noqa: E402
from specdec.kernels.mamba2 import triton_step as m2  # noqa: E402
from specdec.kernels.triton_common import TREE_UNROLL_MAX  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}  # relative RMS; both sides compute in fp32


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_close(a, ref, tol, what):
    assert torch.isfinite(a).all(), f"{what}: not fully written (NaN/Inf left)"
    err = rel_err(a, ref)
    assert err < tol, f"{what}: relative RMS error {err:.2e} >= {tol:.0e}"


def garbage(*shape, dtype=torch.float32):
    """Random sentinel contents for memory a kernel must not touch (compared bit-exactly)."""
    return torch.randn(*shape, dtype=dtype, device=DEVICE) * 3 + 7


# ----------------------------------------------------------------------------------------------
# the library's objects at test sizes


def op_shape(op, dims) -> SSMShape:
    """dims: GDN/KDA ``(H, K, V)``; Mamba-2 ``(H, P, N, G[, with_D])``."""
    if op == "mamba2":
        H, P, N, G = dims[:4]
        return SSMShape(op, 1, heads=H, head_dim=P, state_size=N, n_groups=G)
    H, K, V = dims
    return SSMShape(op, 1, heads=H, key_dim=K, value_dim=V)


def op_params(op, dims, gen) -> dict:
    params = synthetic_params(op_shape(op, dims), DEVICE, gen)
    if op == "mamba2" and len(dims) > 4 and not dims[4]:
        params = {"A": params["A"]}  # no skip weight D
    return params


def kernels(op, block=None, tree_loop=None) -> RollbackKernels:
    """The op's Triton kernel set, launched with state block ``block`` (None: the default)."""
    return OPS[op].on("triton", DEVICE).kernels.with_launch(LaunchConfig(block=block, tree_loop=tree_loop))


def step_inputs(op, dims, B, T, dtype, gen) -> dict:
    return synthetic_inputs(op_shape(op, dims), B, T, DEVICE, gen, dtype=dtype)


def random_history(op, dims, S, L, gen) -> dict:
    """A replay history ``{key: [S, L, ...]}`` fp32 of real replay inputs (the op's ``replay_keys``)."""
    inp = step_inputs(op, dims, S, L, torch.float32, gen)
    state = torch.randn(S, *op_shape(op, dims).state_shape, generator=gen).to(DEVICE) * 0.3
    _, _, replay = OPS[op].verify(state, inp, op_params(op, dims, gen), False)
    return {k: v.float().contiguous() for k, v in replay.items()}


def nan_like(y):
    return torch.full_like(y, float("nan"))


def cat_inputs(calls):
    return {key: torch.cat([c[key] for c in calls], dim=1) for key in calls[0]}


def reference(op, s0, inputs, params, parents=None):
    """(y, states, replay inputs) of the torch op from ``s0`` (``[B, *S]``) over all step tokens."""
    inputs = {k: v.float() for k, v in inputs.items()}
    if parents is None:
        return OPS[op].verify(s0, inputs, params, True)
    return OPS[op].tree_verify(s0, inputs, params, parents, True)


# ----------------------------------------------------------------------------------------------
# the grid: (op, dims, block, B, per-call token counts, dtype, state_indices)
#   dims: GDN/KDA (H, K, V); Mamba-2 (H, P, N, G). Blocks smaller than V / P (and a V, P that is
#   not a power of two) exercise several programs per head and the masks.

GRID = [
    pytest.param("gdn", (1, 16, 16), 16, 1, (1,), torch.float32, False, id="gdn-B1-T1-H1-K16-V16"),
    pytest.param("gdn", (2, 16, 24), 8, 2, (3,), torch.float32, False, id="gdn-B2-T3-H2-K16-V24"),
    pytest.param("gdn", (2, 8, 16), 8, 3, (2, 2), torch.bfloat16, True, id="gdn-B3-T2+2-H2-K8-V16-bf16-si"),
    pytest.param("gdn", (1, 16, 8), 8, 4, (1, 1, 1), torch.float32, False, id="gdn-B4-T1+1+1-H1-K16-V8"),
    pytest.param("gdn", (2, 32, 16), 16, 6, (5,), torch.float16, False, id="gdn-B6-T5-H2-K32-V16-fp16"),
    pytest.param("kda", (2, 16, 24), 16, 2, (3,), torch.float32, False, id="kda-B2-T3-H2-K16-V24"),
    pytest.param("kda", (3, 16, 16), 8, 5, (2, 2), torch.float32, True, id="kda-B5-T2+2-H3-K16-V16-si"),
    pytest.param("kda", (1, 8, 16), 8, 3, (1, 2), torch.bfloat16, True, id="kda-B3-T1+2-H1-K8-V16-bf16-si"),
    pytest.param("mamba2", (2, 16, 16, 1), 16, 1, (2,), torch.float32, False, id="mamba2-B1-T2-H2-P16-N16-G1"),
    pytest.param("mamba2", (4, 24, 16, 2), 8, 2, (3,), torch.float32, False, id="mamba2-B2-T3-H4-P24-N16-G2"),
    pytest.param("mamba2", (2, 8, 16, 2), 8, 3, (2, 1), torch.bfloat16, True, id="mamba2-B3-T2+1-H2-P8-N16-G2-bf16-si"),
    pytest.param("mamba2", (3, 16, 32, 1, False), 8, 6, (5,), torch.float32, False, id="mamba2-B6-T5-H3-P16-N32-G1-noD"),
    pytest.param("mamba2", (4, 8, 8, 4), 8, 2, (1, 1, 2), torch.bfloat16, False, id="mamba2-B2-T1+1+2-H4-P8-N8-G4-bf16"),
]


def _layout(B, use_si, seed):
    """(num_slots, state_indices [B] or None, rows that run): with indices, a permutation over B+1
    slots (one slot unused) and the last row padded when B > 1."""
    if not use_si:
        return B, None, list(range(B))
    g = torch.Generator().manual_seed(seed)
    si = torch.randperm(B + 1, generator=g)[:B]
    if B > 1:
        si[-1] = -1
    live = [b for b in range(B) if si[b] >= 0]
    return B + 1, si.to(DEVICE), live


def _accepted(B, T, seed):
    """Accepted counts per row in [0, T]: 0 and T always (B > 1), all of 0..T when B > T."""
    if B == 1:
        return torch.full((1,), T, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    n = torch.arange(B) % (T + 1)  # every count 0..T once B > T
    n[1] = T
    return n[torch.randperm(B, generator=g)].to(DEVICE)


def _slots(si, rows):
    return [int(si[b]) if si is not None else b for b in rows]


def _check_untouched_rows(before, after, used_slots, what):
    for s in range(before.shape[0]):
        if s not in used_slots:
            assert torch.equal(before[s], after[s]), f"{what}: slot {s} (unused / pad) was modified"


def _check_outputs(y, y_ref, rows, B, tol, what):
    assert_close(y[rows], y_ref[rows], tol, what)
    pad = [b for b in range(B) if b not in rows]
    assert torch.isnan(y[pad]).all(), f"{what}: outputs of padded rows were written"


@pytest.mark.parametrize("op,dims,block,B,calls,dtype,use_si", GRID)
def test_snapshot(op, dims, block, B, calls, dtype, use_si):
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    kern, params, S_shape = kernels(op, block), op_params(op, dims, gen), op_shape(op, dims).state_shape
    T, T_max = sum(calls), sum(calls) + 1
    S, si, rows = _layout(B, use_si, 2)
    slots = _slots(si, rows)
    live = torch.randn(S, *S_shape, device=DEVICE)
    buf = garbage(S, T_max, *S_shape)
    live0, buf0 = live.clone(), buf.clone()
    inps = [step_inputs(op, dims, B, t, dtype, gen) for t in calls]
    y_ref, states_ref, _ = reference(op, live[si.clamp(min=0) if si is not None else slice(None)], cat_inputs(inps),
                                     params)
    off = 0
    for inp in inps:
        t = inp[next(iter(inp))].shape[1]
        y = nan_like(y_ref[:, off:off + t])
        ret = kern.snapshot_verify(live, buf, inp, params, off, state_indices=si, out=y)
        assert ret is y
        _check_outputs(y, y_ref[:, off:off + t], rows, B, TOL[dtype], f"snapshot y (offset {off})")
        off += t
    assert torch.equal(live, live0), "snapshot verify wrote the live state"
    assert torch.equal(buf[:, T:], buf0[:, T:]), "snapshot verify wrote slots past offset + t"
    _check_untouched_rows(buf0, buf, slots, "snapshot buf")
    for b, s in zip(rows, slots):
        assert_close(buf[s, :T], states_ref[b], TOL[dtype], f"snapshot buf row {b}")

    n = _accepted(B, T, 3)
    kern.snapshot_commit(live, buf, n, state_indices=si)
    _check_untouched_rows(live0, live, slots, "snapshot commit")
    for b, s in zip(rows, slots):
        if n[b] == 0:
            assert torch.equal(live[s], live0[s]), f"row {b}: commit of 0 tokens changed the state"
        else:
            assert torch.equal(live[s], buf[s, n[b] - 1]), f"row {b}: commit did not copy slot n-1"


@pytest.mark.parametrize("op,dims,block,B,calls,dtype,use_si", GRID)
def test_ring(op, dims, block, B, calls, dtype, use_si):
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(4)
    kern, params, S_shape = kernels(op, block), op_params(op, dims, gen), op_shape(op, dims).state_shape
    T = sum(calls)
    R = T + 2  # one spare slot, so the write set wraps and leaves a slot that must stay intact
    S, si, rows = _layout(B, use_si, 5)
    slots = _slots(si, rows)
    ring = garbage(S, R, *S_shape)
    head = torch.randint(0, R, (S,), device=DEVICE)
    s0 = torch.randn(S, *S_shape, device=DEVICE)
    ring[torch.arange(S), head] = s0
    ring0, head0 = ring.clone(), head.clone()
    inps = [step_inputs(op, dims, B, t, dtype, gen) for t in calls]
    y_ref, states_ref, _ = reference(op, s0[si.clamp(min=0) if si is not None else slice(None)], cat_inputs(inps),
                                     params)
    off = 0
    for inp in inps:
        t = inp[next(iter(inp))].shape[1]
        y = nan_like(y_ref[:, off:off + t])
        kern.ring_verify(ring, head, inp, params, off, state_indices=si, out=y)
        _check_outputs(y, y_ref[:, off:off + t], rows, B, TOL[dtype], f"ring y (offset {off})")
        off += t
    assert torch.equal(head, head0), "ring verify moved the head"
    _check_untouched_rows(ring0, ring, slots, "ring")
    for b, s in zip(rows, slots):
        written = [(int(head[s]) + 1 + j) % R for j in range(T)]
        for j, slot in enumerate(written):
            assert_close(ring[s, slot], states_ref[b, j], TOL[dtype], f"ring row {b} token {j}")
        for slot in set(range(R)) - set(written):
            assert torch.equal(ring[s, slot], ring0[s, slot]), f"ring row {b}: slot {slot} outside the write set changed"


@pytest.mark.parametrize("op,dims,block,B,calls,dtype,use_si", GRID)
def test_replay(op, dims, block, B, calls, dtype, use_si):
    torch.manual_seed(6)
    gen = torch.Generator().manual_seed(6)
    kern, params, S_shape = kernels(op, block), op_params(op, dims, gen), op_shape(op, dims).state_shape
    T = sum(calls)
    L = 2 * T + 3
    S, si, rows = _layout(B, use_si, 7)
    slots = _slots(si, rows)
    ckpt = torch.randn(S, *S_shape, device=DEVICE)
    hist = random_history(op, dims, S, L, gen)  # positions >= hist_len hold garbage the kernel must not read
    hist_len = torch.randint(0, T + 2, (S,), device=DEVICE)
    hist_len[0] = 0
    ckpt0, hist0 = ckpt.clone(), {k: v.clone() for k, v in hist.items()}
    s0 = OPS[op].fold(ckpt, hist, params, hist_len)  # the state the step starts from
    idx = si.clamp(min=0) if si is not None else slice(None)
    inps = [step_inputs(op, dims, B, t, dtype, gen) for t in calls]
    y_ref, states_ref, replay_ref = reference(op, s0[idx], cat_inputs(inps), params)
    off = 0
    for inp in inps:
        t = inp[next(iter(inp))].shape[1]
        y = nan_like(y_ref[:, off:off + t])
        kern.replay_verify(ckpt, hist, hist_len, inp, params, off, state_indices=si, out=y)
        _check_outputs(y, y_ref[:, off:off + t], rows, B, TOL[dtype], f"replay y (offset {off})")
        off += t
    assert torch.equal(ckpt, ckpt0), "replay verify wrote the checkpoint"
    for key in hist:
        _check_untouched_rows(hist0[key], hist[key], slots, f"replay hist {key}")
        for b, s in zip(rows, slots):
            h0 = int(hist_len[s])
            assert torch.equal(hist[key][s, :h0], hist0[key][s, :h0]), f"row {b}: committed history {key} changed"
            assert torch.equal(hist[key][s, h0 + T:], hist0[key][s, h0 + T:]), f"row {b}: history {key} written past the step"
            tol = TOL[dtype] if key == "u" else 0.0  # raw inputs are stored exactly
            got, want = hist[key][s, h0:h0 + T], replay_ref[key][b]
            if tol:
                assert_close(got, want, tol, f"replay hist {key} row {b}")
            else:
                assert torch.equal(got, want), f"row {b}: history {key} is not the step's inputs"

    # commit: fold the committed history plus the accepted prefix (eager replay; deferred is the
    # same call with n = 0 for rows that do not flush)
    n = _accepted(B, T, 8)
    num = torch.zeros(B, dtype=torch.long, device=DEVICE)
    for b, s in zip(rows, slots):
        num[b] = hist_len[s] + n[b]
    num[0] = 0  # row 0 does not flush: its checkpoint must stay bit-exact (no state traffic)
    ckpt_before = ckpt.clone()
    kern.replay_fold(ckpt, hist, params, num, state_indices=si)
    _check_untouched_rows(ckpt_before, ckpt, slots, "replay fold")
    for b, s in zip(rows, slots):
        if num[b] == 0:
            assert torch.equal(ckpt[s], ckpt_before[s]), f"row {b}: fold of 0 tokens changed the checkpoint"
        elif n[b] == 0:
            assert_close(ckpt[s], s0[s], TOL[dtype], f"replay fold row {b} (n = 0)")
        else:
            assert_close(ckpt[s], states_ref[b, n[b] - 1], TOL[dtype], f"replay fold row {b} (n = {int(n[b])})")


#: fused replay with T_max >= 6 (the fold's loads predicated, 4 ahead: triton_common.fold_launch),
#: several calls per step (offset > 0: the step's first tokens folded too) and each op
MASKED_FOLD_GRID = [
    pytest.param("gdn", (2, 8, 16), 8, 3, (3, 2, 1), torch.float32, True, id="gdn-T3+2+1-si"),
    pytest.param("kda", (1, 8, 16), 8, 2, (8,), torch.float32, False, id="kda-T8"),
    pytest.param("mamba2", (2, 8, 16, 2), 8, 3, (4, 4), torch.float32, True, id="mamba2-T4+4-si"),
]


@pytest.mark.parametrize("op_name", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("strategy", ["snapshot", "ring", "replay", "replay_deferred", "replay-tree"])
def test_a_strategy_step_on_the_kernels_is_its_two_launches(op_name, strategy, monkeypatch):
    """A chain step (verify, then commit) of each strategy on the Triton kernels launches the op's
    step kernel and the strategy's commit kernel and nothing else (a tree's verify and deferred
    replay's verify: their one kernel; deferred replay's commit picks the slots to fold with
    torch ops by design): inside a captured decode step every other device op is a kernel of its
    own per layer and step (replay's verify once also computed its history positions with three
    torch ops that only the torch reference reads). Debug mode adds checks; it is off here."""
    from helpers import DeviceOps

    from specdec.experiments.kernel_table import SHAPES
    from specdec.experiments.kernel_timing import LayerStep

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    shape, gen = SHAPES["tiny"][op_name], torch.Generator().manual_seed(0)
    op = get_op(op_name, DEVICE) if ON_CUDA else OPS[op_name].on("triton", DEVICE)
    params = synthetic_params(shape, DEVICE, gen)
    tree = strategy.endswith("-tree")
    parents = (-1, 0, 0, 1) if tree else None
    step = LayerStep(op, shape, strategy.removesuffix("-tree"), 2, 5, params, DEVICE, gen, prime=3, parents=parents)
    verify_only = tree or strategy == "replay_deferred"
    n = torch.tensor([3, 1], device=DEVICE)
    for _ in range(2):
        with DeviceOps() as ops:
            step.verify()
            if not verify_only:
                step.commit(n)
        if tree:
            step.discard()
        elif verify_only:
            step.commit(n)
        assert ops.ops == {}, ops.ops
        assert sum(ops.triton.values()) == (1 if verify_only else 2), ops.triton


def test_fused_replay_grids_reach_both_fold_launches():
    """GRID's single steps of T <= 4 and the small tree fold with every load issued unmasked;
    MASKED_FOLD_GRID's steps (T_max = T + 1 >= 6) with predicated loads, 4 ahead."""
    from specdec.kernels.triton_common import fold_launch

    assert {fold_launch(sum(p.values[4]) + 1) for p in MASKED_FOLD_GRID} == {(4, True)}
    assert any(fold_launch(sum(p.values[4]) + 1) == (sum(p.values[4]) + 1, False) for p in GRID)
    assert fold_launch(len(TREES["small4"]) + 1) == (5, False)


@pytest.mark.parametrize("op,dims,block,B,calls,dtype,use_si", GRID + MASKED_FOLD_GRID)
def test_replay_fused(op, dims, block, B, calls, dtype, use_si):
    """Fused (eager) replay: the step's first call folds the committed history into the checkpoint,
    every call appends at T_max + offset, and the commit moves the accepted prefix to 0.. ."""
    _fused_replay_step(op, dims, block, B, calls, dtype, use_si, sum(calls) + 1, None)


#: a decoder sized for more drafts than its step (num_speculative_tokens="auto"): T_max > T, the
#: fold sized for fold_max committed tokens (the step's own width, as the decoder sets it; or any)
FOLD_MAX_GRID = [
    pytest.param("mamba2", (2, 8, 16, 2), 8, 3, (2,), torch.float32, True, 5, 2, id="mamba2-T2-Tmax5-fold2-si"),
    pytest.param("gdn", (2, 8, 16), 8, 3, (3,), torch.bfloat16, False, 9, 3, id="gdn-T3-Tmax9-fold3"),
    pytest.param("kda", (1, 8, 16), 8, 2, (1, 2), torch.float32, False, 9, 6, id="kda-T1+2-Tmax9-fold6"),
    pytest.param("mamba2", (2, 8, 16, 2), 8, 2, (1,), torch.float32, False, 5, 0, id="mamba2-T1-Tmax5-fold0"),
]


@pytest.mark.parametrize("op,dims,block,B,calls,dtype,use_si,T_max,fold_max", FOLD_MAX_GRID)
def test_replay_fused_fold_max(op, dims, block, B, calls, dtype, use_si, T_max, fold_max):
    """Fused replay in a decoder sized for T_max > T with ``fold_max``: every committed history
    of at most fold_max tokens (fold_max itself included) is folded exactly; the committed half's
    positions past it hold garbage that must not count."""
    _fused_replay_step(op, dims, block, B, calls, dtype, use_si, T_max, fold_max)
    kern = kernels(op, block)
    gen = torch.Generator().manual_seed(3)
    hist = random_history(op, dims, B, 2 * T_max, gen)
    inp = step_inputs(op, dims, B, 1, dtype, gen)
    ckpt = torch.randn(B, *op_shape(op, dims).state_shape, device=DEVICE)
    hist_len = torch.zeros(B, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=rf"fold_max must be in \[0, T_max = {T_max}\].*got {T_max + 1}"):
        kern.replay_verify(ckpt, hist, hist_len, inp, op_params(op, dims, gen), 0, fused=True, fold_max=T_max + 1)
    n = torch.ones(B, dtype=torch.long, device=DEVICE)
    for bad in (0, T_max + 1, 2.0):
        with pytest.raises(ValueError, match=rf"max_tokens must be an int in \[1, T_max = {T_max}\].*got {bad}"):
            kern.replay_commit(hist, hist_len, n, max_tokens=bad)


def _fused_replay_step(op, dims, block, B, calls, dtype, use_si, T_max, fold_max):
    torch.manual_seed(16)
    gen = torch.Generator().manual_seed(16)
    kern, params, S_shape = kernels(op, block), op_params(op, dims, gen), op_shape(op, dims).state_shape
    T = sum(calls)
    assert T < T_max  # at least one spare position per half: it must stay intact
    longest = T_max if fold_max is None else fold_max
    L = 2 * T_max
    S, si, rows = _layout(B, use_si, 17)
    slots = _slots(si, rows)
    ckpt = torch.randn(S, *S_shape, device=DEVICE)
    hist = random_history(op, dims, S, L, gen)  # positions >= hist_len (committed half) hold garbage that must not count
    hist_len = torch.randint(0, longest + 1, (S,), device=DEVICE)
    hist_len[slots[0]] = 0  # a row with no committed history: its checkpoint must stay bit-exact
    if len(slots) > 1:
        hist_len[slots[1]] = longest
    ckpt0, hist0, len0 = ckpt.clone(), {k: v.clone() for k, v in hist.items()}, hist_len.clone()
    s0 = OPS[op].fold(ckpt, hist, params, hist_len)  # the committed state
    idx = si.clamp(min=0) if si is not None else slice(None)
    inps = [step_inputs(op, dims, B, t, dtype, gen) for t in calls]
    y_ref, states_ref, replay_ref = reference(op, s0[idx], cat_inputs(inps), params)
    off = 0
    for inp in inps:
        t = inp[next(iter(inp))].shape[1]
        y = nan_like(y_ref[:, off:off + t])
        kern.replay_verify(ckpt, hist, hist_len, inp, params, off, fused=True, state_indices=si, out=y,
                           fold_max=fold_max)
        _check_outputs(y, y_ref[:, off:off + t], rows, B, TOL[dtype], f"fused replay y (offset {off})")
        off += t
    assert torch.equal(hist_len, len0), "fused replay verify wrote hist_len"
    _check_untouched_rows(ckpt0, ckpt, slots, "fused replay ckpt")
    for b, s in zip(rows, slots):
        if len0[s] == 0:
            assert torch.equal(ckpt[s], ckpt0[s]), f"row {b}: no committed history, yet the checkpoint changed"
        else:
            assert_close(ckpt[s], s0[s], 1e-5, f"row {b}: checkpoint after absorbing {int(len0[s])} tokens")
    for key in hist:
        _check_untouched_rows(hist0[key], hist[key], slots, f"fused replay hist {key}")
        for b, s in zip(rows, slots):
            assert torch.equal(hist[key][s, :T_max], hist0[key][s, :T_max]), f"row {b}: committed half of {key} changed"
            assert torch.equal(hist[key][s, T_max + T:], hist0[key][s, T_max + T:]), f"row {b}: {key} written past the step"
            got, want = hist[key][s, T_max:T_max + T], replay_ref[key][b]
            if key == "u":
                assert_close(got, want, TOL[dtype], f"fused replay hist u row {b}")
            else:
                assert torch.equal(got, want), f"row {b}: history {key} is not the step's inputs"

    n = _accepted(B, T, 18)
    ckpt1, hist1 = ckpt.clone(), {k: v.clone() for k, v in hist.items()}
    # in a decoder sized for more drafts the commit is sized for the step's width, as replay's is
    kern.replay_commit(hist, hist_len, n, state_indices=si, max_tokens=None if fold_max is None else T)
    assert torch.equal(ckpt, ckpt1), "fused replay commit touched the checkpoint"
    _check_untouched_rows(len0, hist_len, slots, "fused replay commit hist_len")
    for key in hist:
        _check_untouched_rows(hist1[key], hist[key], slots, f"fused replay commit {key}")
    state = OPS[op].fold(ckpt, hist, params, hist_len)
    for b, s in zip(rows, slots):
        k = int(n[b])
        assert int(hist_len[s]) == k, f"row {b}: hist_len {int(hist_len[s])} after committing {k}"
        for key in hist:
            assert torch.equal(hist[key][s, :k], hist1[key][s, T_max:T_max + k]), f"row {b}: {key} not moved"
            assert torch.equal(hist[key][s, k:], hist1[key][s, k:]), f"row {b}: {key} written past the accepted prefix"
        want = s0[s] if k == 0 else states_ref[b, k - 1]
        assert_close(state[s], want, TOL[dtype], f"fused replay committed state row {b} (n = {k})")


@pytest.mark.parametrize("op,dims,block,B,calls,dtype,use_si", [p for p in GRID if len(p.values[4]) == 1])
def test_update_no_rollback(op, dims, block, B, calls, dtype, use_si):
    torch.manual_seed(9)
    gen = torch.Generator().manual_seed(9)
    kern, params, S_shape = kernels(op, block), op_params(op, dims, gen), op_shape(op, dims).state_shape
    S, si, rows = _layout(B, use_si, 10)
    slots = _slots(si, rows)
    state = torch.randn(S, *S_shape, device=DEVICE)
    state0 = state.clone()
    inp = step_inputs(op, dims, B, calls[0], dtype, gen)
    y_ref, states_ref, _ = reference(op, state[si.clamp(min=0) if si is not None else slice(None)], inp, params)
    y = nan_like(y_ref)
    kern.update(state, inp, params, state_indices=si, out=y)
    _check_outputs(y, y_ref, rows, B, TOL[dtype], "update y")
    _check_untouched_rows(state0, state, slots, "update")
    for b, s in zip(rows, slots):
        assert_close(state[s], states_ref[b, -1], TOL[dtype], f"update state row {b}")


@pytest.mark.parametrize("use_si", [False, True], ids=["B5", "B5-si"])
def test_ring_commit_bookkeeping(use_si):
    """The ring kernels' commit (one launch) against the torch op of the ring strategy."""
    B, T_max, R = 5, 4, 5
    S, si, rows = _layout(B, use_si, 15)
    slots = _slots(si, rows)
    n = _accepted(B, T_max, 16)
    head = torch.randint(0, R, (S,), device=DEVICE)
    want = head.clone()
    for b, s in zip(rows, slots):
        want[s] = (want[s] + n[b]) % R
    kernels("gdn").ring_commit(head, n, R, state_indices=si)
    assert torch.equal(head, want)


@pytest.mark.parametrize("op", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("strategy", ["update", "snapshot", "ring", "replay"])
@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float16])
def test_outputs_in_the_dtype_the_params_ask_for(op, strategy, y_dtype):
    """With params' ``y_dtype`` every kernel set's call writes y in that dtype (the layers then need no
    cast): the fp32 call's y rounded to it (to nearest on a GPU; Triton's interpreter may truncate:
    within one unit in the last place there), the stores the same bit for bit; the torch reference
    op returns the same dtype."""
    dims = (2, 8, 16, 2) if op == "mamba2" else (2, 16, 16)
    gen = torch.Generator().manual_seed(21)
    kern, params, S_shape = kernels(op), op_params(op, dims, gen), op_shape(op, dims).state_shape
    B, T = 3, 3
    inp = step_inputs(op, dims, B, T, torch.float32, gen)
    state = torch.randn(B, *S_shape, generator=gen).to(DEVICE)
    runs = []
    for p in (params, {**params, "y_dtype": y_dtype}):
        st = state.clone()
        if strategy == "update":
            y = kern.update(st, inp, p)
            stores = (st,)
        elif strategy == "snapshot":
            buf = torch.zeros(B, T, *S_shape, device=DEVICE)
            y = kern.snapshot_verify(st, buf, inp, p, 0)
            stores = (st, buf)
        elif strategy == "ring":
            ring = torch.zeros(B, T + 1, *S_shape, device=DEVICE)
            ring[:, 0] = st
            y = kern.ring_verify(ring, torch.zeros(B, dtype=torch.long, device=DEVICE), inp, p, 0)
            stores = (ring,)
        else:
            hist = {k: torch.zeros(B, 2 * T, *shape, dtype=dtype, device=DEVICE)
                    for k, (shape, dtype) in OPS[op].replay_spec(inp).items()}
            y = kern.replay_verify(st, hist, torch.zeros(B, dtype=torch.long, device=DEVICE), inp, p, 0, fused=True)
            stores = (st, *hist.values())
        runs.append((y, stores))
    (y32, stores32), (y, stores) = runs
    assert y32.dtype == torch.float32 and y.dtype == y_dtype and y.shape == y32.shape
    want = y32.to(y_dtype)
    ulp = (want.float().abs() * (2.0 ** -7 if y_dtype == torch.bfloat16 else 2.0 ** -10)).clamp_min(1e-30)
    if ON_CUDA:
        assert torch.equal(y, want)
    else:
        assert ((y.float() - want.float()).abs() <= ulp).all()
    assert all(torch.equal(a, b) for a, b in zip(stores, stores32))
    ref, _, _ = OPS[op].verify(state, inp, {**params, "y_dtype": y_dtype}, False)
    assert ref.dtype == y_dtype


# ----------------------------------------------------------------------------------------------
# conv1d

CONV_GRID = [
    pytest.param(1, 8, 4, 2, (1,), torch.float32, True, "silu", False, id="B1-C8-W4-T1"),
    pytest.param(2, 40, 4, 5, (3,), torch.float32, True, "silu", False, id="B2-C40-W4-T3"),
    pytest.param(3, 24, 3, 4, (2, 2), torch.bfloat16, False, None, True, id="B3-C24-W3-T2+2-bf16-si"),
    pytest.param(2, 16, 2, 3, (1, 1, 1), torch.float32, True, None, False, id="B2-C16-W2-T1+1+1"),
]


def _conv_window(S, C, cols, layout, dtype=torch.float32):
    """A random conv window ``[S, C, cols]``: channel-major (contiguous) or time-major (the layer
    caches' layout, :func:`specdec.kernels.conv1d.new_conv_window`)."""
    if layout == "time-major":
        return torch.randn(S, cols, C, device=DEVICE).to(dtype).transpose(1, 2)
    return torch.randn(S, C, cols, device=DEVICE).to(dtype)


def _conv_input(B, t, C, x_layout, dtype):
    """Random conv inputs ``[B, t, C]``: contiguous, a channel slice of a wider projection output
    (Mamba-2's ``xBC``), or dense with the batch and token dims swapped."""
    if x_layout == "slice":
        return torch.randn(B, t, C + 12, device=DEVICE).to(dtype)[..., 7 : 7 + C]
    if x_layout == "permuted":
        return torch.randn(t, B, C, device=DEVICE).to(dtype).transpose(0, 1)
    return torch.randn(B, t, C, device=DEVICE).to(dtype)


@pytest.mark.parametrize("x_layout", ["contiguous", "slice", "permuted"])
@pytest.mark.parametrize("layout", ["channel-major", "time-major"])
@pytest.mark.parametrize("B,C,W,T_max,calls,dtype,bias,act,use_si", CONV_GRID)
def test_conv1d(B, C, W, T_max, calls, dtype, bias, act, use_si, layout, x_layout):
    """Verify calls, then the commit, against the reference, over a slot pool and window layouts;
    inputs of any batch / token strides are read where they are (a slice of a projection's
    output is not copied first) and the outputs come back contiguous."""
    from helpers import DeviceOps

    torch.manual_seed(11)
    S, si, rows = _layout(B, use_si, 12)
    slots = _slots(si, rows)
    window = _conv_window(S, C, W - 1 + T_max, layout, dtype)
    weight = torch.randn(C, W, device=DEVICE)
    b = torch.randn(C, device=DEVICE) if bias else None
    ref = window.clone()
    idx = torch.tensor(slots, device=DEVICE)
    ref_rows = ref[idx]
    off = 0
    for t in calls:
        x = _conv_input(B, t, C, x_layout, dtype)
        y = torch.full((B, t, C), float("nan"), dtype=dtype, device=DEVICE)
        before = window.clone()
        with DeviceOps() as ops:
            CONV1D.on("triton", DEVICE).kernels.verify(window, x, weight, b, act, off, state_indices=si, out=y)
        assert ops.ops == {}, ops.ops  # no copy of x, whatever its batch / token strides
        y_ref = conv1d_verify(ref_rows, x[rows], weight, b, act, off)
        tol = TOL[dtype] if dtype == torch.float32 else 1e-2  # bf16 outputs are rounded to bf16
        assert_close(y[rows].float(), y_ref.float(), tol, f"conv y (offset {off})")
        assert torch.isnan(y[[b for b in range(B) if b not in rows]]).all(), "conv wrote outputs of padded rows"
        _check_untouched_rows(before, window, slots, "conv window")
        assert torch.equal(window[idx], ref_rows), "conv window differs from the reference's"
        off += t
    n = _accepted(B, off, 13)
    before = window.clone()
    CONV1D.on("triton", DEVICE).kernels.commit(window, n, W, state_indices=si)
    conv1d_commit(ref_rows, n[rows], W)
    _check_untouched_rows(before, window, slots, "conv commit")
    assert torch.equal(window[idx, :, : W - 1], ref_rows[:, :, : W - 1]), "conv commit differs from the reference's"


@pytest.mark.parametrize("x_layout", ["contiguous", "slice"])
@pytest.mark.parametrize("layout", ["channel-major", "time-major"])
@pytest.mark.parametrize("B,C,W,dtype,bias,act,use_si", [
    pytest.param(1, 8, 4, torch.float32, True, "silu", False, id="B1-C8-W4"),
    pytest.param(3, 150, 4, torch.bfloat16, False, "silu", True, id="B3-C150-W4-bf16-si"),
    pytest.param(2, 24, 3, torch.float32, True, None, True, id="B2-C24-W3-si"),
    pytest.param(2, 16, 2, torch.float32, False, None, False, id="B2-C16-W2"),
    pytest.param(2, 16, 1, torch.float32, True, "silu", False, id="B2-C16-W1"),
])
def test_conv1d_update(B, C, W, dtype, bias, act, use_si, layout, x_layout):
    """A plain step's conv (verify of one token and its commit in one launch) against the reference
    (``conv1d_update``: verify, then commit of 1 token), twice in a row, over a slot pool with a
    padding row: outputs, the rows' new history, slots no row maps to and every window column
    from ``W-1`` on (the kernel writes the history only) bit for bit; one Triton launch, no
    other device op."""
    from helpers import DeviceOps

    torch.manual_seed(17)
    S, si, rows = _layout(B, use_si, 18)
    slots = _slots(si, rows)
    idx = torch.tensor(slots, device=DEVICE)
    window = _conv_window(S, C, W - 1 + 3, layout, dtype)
    weight = torch.randn(C, W, device=DEVICE)
    b = torch.randn(C, device=DEVICE) if bias else None
    ref_rows = window[idx].clone()
    kernels = CONV1D.on("triton", DEVICE).kernels
    for step in range(2):
        x = _conv_input(B, 1, C, x_layout, dtype)
        y = torch.full((B, 1, C), float("nan"), dtype=dtype, device=DEVICE)
        before = window.clone()
        with DeviceOps() as ops:
            kernels.update(window, x, weight, b, act, state_indices=si, out=y)
        assert ops.ops == {} and sum(ops.triton.values()) == 1, (ops.ops, ops.triton)
        y_ref = conv1d_update(ref_rows, x[rows], weight, b, act)
        tol = TOL[dtype] if dtype == torch.float32 else 1e-2
        assert_close(y[rows].float(), y_ref.float(), tol, f"conv update y (step {step})")
        assert torch.isnan(y[[r for r in range(B) if r not in rows]]).all(), "conv update wrote a padded row's outputs"
        _check_untouched_rows(before, window, slots, "conv update")
        assert torch.equal(window[idx, :, : W - 1], ref_rows[:, :, : W - 1]), "conv update history differs"
        assert torch.equal(window[:, :, W - 1 :], before[:, :, W - 1 :]), "conv update wrote a step column"
    with pytest.raises(ValueError, match="one token per row"):
        kernels.update(window, _conv_input(B, 2, C, x_layout, dtype), weight, b, act, state_indices=si)
    with pytest.raises(ValueError, match="one token per row"):
        conv1d_update(ref_rows, x[rows].expand(-1, 2, -1), weight, b, act)


def test_conv1d_allocates_contiguous_outputs_for_any_input_strides():
    """Without ``out``, the outputs are a new contiguous tensor (the kernel writes them densely), also
    for inputs that are dense with their dims permuted (``empty_like`` would keep that order)."""
    torch.manual_seed(12)
    B, T, C, W = 3, 2, 24, 4
    weight, b = torch.randn(C, W, device=DEVICE), torch.randn(C, device=DEVICE)
    x = _conv_input(B, T, C, "permuted", torch.float32)
    window = _conv_window(B, C, W - 1 + T, "time-major")
    again = window.clone()
    conv = CONV1D.on("triton", DEVICE).kernels
    y = conv.verify(window, x, weight, b, "silu", 0)
    want = conv.verify(again, x.contiguous(), weight, b, "silu", 0)
    assert y.is_contiguous() and torch.equal(y, want)
    assert torch.equal(window, again)


def test_conv1d_rejects_overflow():
    conv = CONV1D.on("triton", DEVICE)
    window = torch.randn(1, 4, 3 + 2, device=DEVICE)
    with pytest.raises(ValueError, match="step tokens"):
        conv.verify(window, torch.randn(1, 3, 4, device=DEVICE), torch.randn(4, 4, device=DEVICE), None, None, 0)
    with pytest.raises(ValueError, match="activation"):
        conv.verify(window, torch.randn(1, 1, 4, device=DEVICE), torch.randn(4, 4, device=DEVICE), None, "gelu", 0)


@pytest.mark.parametrize("layout", ["channel-major", "time-major"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("use_si", [False, True], ids=["rows", "pool-si"])
def test_conv1d_op_matches_reference(backend, use_si, layout, monkeypatch):
    """The layer caches' conv op (``conv1d_op``) on each backend, over a window pool with a
    permuted row -> slot map and a padding row, in both window layouts: chain calls, a plain
    step's update, a tree step and the commits equal the reference on the rows' own (contiguous) windows; slots no row maps
    to stay bit for bit."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    conv = conv1d_op(DEVICE)
    assert conv.backend == backend and (conv.kernels is not None) == (backend == "triton")
    torch.manual_seed(31)
    B, C, W, T_max = 3, 24, 4, 7
    S, si, rows = _layout(B, use_si, 32)
    slots = _slots(si, rows)
    idx = torch.tensor(slots, device=DEVICE)
    window = _conv_window(S, C, W - 1 + T_max, layout)
    weight, bias = torch.randn(C, W, device=DEVICE), torch.randn(C, device=DEVICE)
    ref = window[idx].contiguous()
    off = 0
    for t in (2, 1):
        x = torch.randn(B, t, C, device=DEVICE)
        before = window.clone()
        y = conv.verify(window, x, weight, bias, "silu", off, state_indices=si)
        assert_close(y[rows], conv1d_verify(ref, x[rows], weight, bias, "silu", off), TOL[torch.float32], "conv op y")
        _check_untouched_rows(before, window, slots, "conv op window")
        assert torch.equal(window[idx], ref), "conv op window differs from the reference's"
        off += t
    n = _accepted(B, off, 33)
    conv.commit(window, n, W, state_indices=si)
    conv1d_commit(ref, n[rows], W)
    assert torch.equal(window[idx], ref), "conv op commit differs from the reference's"
    x = torch.randn(B, 1, C, device=DEVICE)
    before = window.clone()
    y = conv.update(window, x, weight, bias, "silu", state_indices=si)
    assert_close(y[rows], conv1d_update(ref, x[rows], weight, bias, "silu"), TOL[torch.float32], "conv op update y")
    _check_untouched_rows(before, window, slots, "conv op update window")
    assert torch.equal(window[idx, :, : W - 1], ref[:, :, : W - 1]), "conv op update differs from the reference's"
    window[idx, :, W - 1 :] = ref[:, :, W - 1 :]  # (stale step columns: the kernel leaves them, the reference writes one)
    parents = _tree("random7")
    x = torch.randn(B, len(parents), C, device=DEVICE)
    before = window.clone()
    y = conv.tree_verify(window, x, weight, bias, "silu", parents, state_indices=si)
    y_ref = conv1d_tree_verify(ref, x[rows], weight, bias, "silu", parents)
    assert_close(y[rows], y_ref, TOL[torch.float32], "conv op tree y")
    _check_untouched_rows(before, window, slots, "conv op tree window")
    assert torch.equal(window[idx], ref), "conv op tree window differs from the reference's"


# ----------------------------------------------------------------------------------------------
# tree steps (Medusa trees): each token starts from its parent's state (parents=)


def _random_tree(T, seed, extra_roots=True):
    g = torch.Generator().manual_seed(seed)
    par = [-1] + [int(torch.randint(-1 if extra_roots else 0, j, (1,), generator=g)) for j in range(1, T)]
    return tuple(par)


def _default_tree():
    from specdec.tree import make_tree

    return tuple(make_tree("default", num_heads=4).parents)


TREES = {
    "chain": tuple(range(-1, 4)),
    "star": (-1, 0, 0, 0, 0),
    "default16": None,  # Medusa's "default" 16-node tree (built lazily: specdec.tree)
    "random7": _random_tree(7, 0),  # includes a second root (parent -1) and non-adjacent parents
    "random9": _random_tree(9, 3, extra_roots=False),  # one root, deeper ancestor chains
    "small4": (-1, 0, 0, 1),  # T_max <= 5: fused replay's fold issues every history load unmasked
}


def _tree(name):
    if name == "medusa63":  # Medusa's 64-node tree
        from specdec.tree import make_tree

        return tuple(make_tree("medusa-63", num_heads=4).parents)
    return _default_tree() if name == "default16" else TREES[name]


TREE_GRID = [
    pytest.param("gdn", (2, 8, 16), 8, 2, "random7", torch.float32, False, id="gdn-random7-B2-H2-K8-V16"),
    pytest.param("gdn", (1, 16, 8), 8, 1, "default16", torch.bfloat16, False, id="gdn-default16-B1-bf16"),
    pytest.param("gdn", (1, 8, 8), 8, 3, "star", torch.float32, True, id="gdn-star-B3-si"),
    pytest.param("gdn", (1, 8, 8), 8, 1, "random9", torch.float32, False, id="gdn-random9-B1"),
    pytest.param("gdn", (1, 8, 8), 8, 1, "medusa63", torch.float32, False, id="gdn-medusa63-B1"),
    pytest.param("kda", (2, 8, 16), 16, 2, "random7", torch.bfloat16, True, id="kda-random7-B2-bf16-si"),
    pytest.param("kda", (1, 8, 8), 8, 1, "chain", torch.float32, False, id="kda-chain-B1"),
    pytest.param("gdn", (2, 8, 16), 8, 2, "small4", torch.float32, True, id="gdn-small4-B2-si"),
    pytest.param("mamba2", (2, 8, 8, 1), 8, 2, "small4", torch.float32, True, id="mamba2-small4-B2-si"),
    pytest.param("mamba2", (2, 8, 8, 1), 8, 2, "random7", torch.float32, False, id="mamba2-random7-B2-H2-G1"),
    pytest.param("mamba2", (1, 8, 8, 1), 8, 1, "random9", torch.float32, False, id="mamba2-random9-B1"),
    pytest.param("mamba2", (2, 8, 8, 2), 8, 1, "default16", torch.bfloat16, False, id="mamba2-default16-B1-bf16"),
    pytest.param("mamba2", (4, 8, 8, 2, False), 8, 3, "star", torch.float32, True, id="mamba2-star-B3-H4-noD-si"),
    pytest.param("mamba2", (2, 8, 8, 1), 8, 2, "medusa63", torch.bfloat16, False, id="mamba2-medusa63-B2-bf16",
                 marks=pytest.mark.slow),  # (the 64-node tree runs by default on GDN)
]


# every tree with the default node walk, and the small trees (the large ones loop by default)
# again with the runtime loop forced
TREE_LOOP_GRID = [pytest.param(*p.values, None, id=f"{p.id}-default-loop", marks=p.marks) for p in TREE_GRID] + [
    pytest.param(*p.values, True, id=f"{p.id}-runtime-loop", marks=p.marks) for p in TREE_GRID
    if p.values[4] != "medusa63"]


@pytest.mark.parametrize("op,dims,block,B,tree,dtype,use_si,tree_loop", TREE_LOOP_GRID)
def test_tree_verify(op, dims, block, B, tree, dtype, use_si, tree_loop):
    """Snapshot, ring and both replay protocols of a tree step against the naive ``parents=`` reference;
    with the default node walk (unrolled up to ``TREE_UNROLL_MAX`` nodes, a runtime loop above) and
    with the runtime loop forced on small trees."""
    torch.manual_seed(21)
    gen = torch.Generator().manual_seed(21)
    parents = _tree(tree)
    T = len(parents)
    kern, params, S_shape = kernels(op, block, tree_loop), op_params(op, dims, gen), op_shape(op, dims).state_shape
    S, si, rows = _layout(B, use_si, 22)
    slots = _slots(si, rows)
    idx = si.clamp(min=0) if si is not None else slice(None)
    tol = TOL[dtype]
    inp = step_inputs(op, dims, B, T, dtype, gen)

    # snapshot: buf[:, j] <- token j's state; slots past T and the live state untouched
    live = torch.randn(S, *S_shape, device=DEVICE)
    y_ref, states_ref, replay_ref = reference(op, live[idx], inp, params, parents)
    buf = garbage(S, T + 1, *S_shape)
    live0, buf0 = live.clone(), buf.clone()
    y = nan_like(y_ref)
    kern.snapshot_verify(live, buf, inp, params, 0, state_indices=si, parents=parents, out=y)
    _check_outputs(y, y_ref, rows, B, tol, "tree snapshot y")
    assert torch.equal(live, live0), "tree snapshot wrote the live state"
    assert torch.equal(buf[:, T:], buf0[:, T:]), "tree snapshot wrote slots past the tree"
    _check_untouched_rows(buf0, buf, slots, "tree snapshot buf")
    for b, s in zip(rows, slots):
        assert_close(buf[s, :T], states_ref[b], tol, f"tree snapshot states row {b}")

    # ring: token j -> slot (head + 1 + j) % R, wrapping; the spare slot and the head untouched
    R = T + 2
    ring = garbage(S, R, *S_shape)
    head = torch.randint(0, R, (S,), device=DEVICE)
    ring[torch.arange(S), head] = live
    ring0, head0 = ring.clone(), head.clone()
    y = nan_like(y_ref)
    kern.ring_verify(ring, head, inp, params, 0, state_indices=si, parents=parents, out=y)
    _check_outputs(y, y_ref, rows, B, tol, "tree ring y")
    assert torch.equal(head, head0)
    _check_untouched_rows(ring0, ring, slots, "tree ring")
    for b, s in zip(rows, slots):
        written = [(int(head[s]) + 1 + j) % R for j in range(T)]
        for j, slot in enumerate(written):
            assert_close(ring[s, slot], states_ref[b, j], tol, f"tree ring row {b} token {j}")
        for slot in set(range(R)) - set(written):
            assert torch.equal(ring[s, slot], ring0[s, slot]), f"tree ring row {b}: slot {slot} changed"

    # replay, both protocols: outputs from the checkpoint + committed history; the tree's inputs
    # appended at pos0 + j (unfused: hist_len + j; fused: T_max + j, the checkpoint absorbs the history)
    for fused in (False, True):
        T_max = T + 1
        L = 2 * T_max
        ckpt = torch.randn(S, *S_shape, device=DEVICE)
        hist = random_history(op, dims, S, L, gen)
        hist_len = torch.randint(0, T_max + 1 if fused else T_max - T + 2, (S,), device=DEVICE)
        hist_len[slots[0]] = 1
        ckpt0, hist0 = ckpt.clone(), {k: v.clone() for k, v in hist.items()}
        s0 = OPS[op].fold(ckpt, hist, params, hist_len)
        y_ref, states_ref, replay_ref = reference(op, s0[idx], inp, params, parents)
        y = nan_like(y_ref)
        kern.replay_verify(ckpt, hist, hist_len, inp, params, 0, fused=fused, state_indices=si, parents=parents,
                           out=y)
        what = f"tree replay (fused={fused})"
        _check_outputs(y, y_ref, rows, B, tol, f"{what} y")
        _check_untouched_rows(ckpt0, ckpt, slots, f"{what} ckpt")
        for b, s in zip(rows, slots):
            if fused:
                assert_close(ckpt[s], s0[s], 1e-5, f"{what}: checkpoint row {b} after absorbing the history")
            else:
                assert torch.equal(ckpt[s], ckpt0[s]), f"{what}: wrote the checkpoint"
        for key in hist:
            _check_untouched_rows(hist0[key], hist[key], slots, f"{what} hist {key}")
            for b, s in zip(rows, slots):
                p0 = T_max if fused else int(hist_len[s])
                assert torch.equal(hist[key][s, :p0], hist0[key][s, :p0]), f"{what}: {key} before the step changed"
                assert torch.equal(hist[key][s, p0 + T:], hist0[key][s, p0 + T:]), f"{what}: {key} written past the step"
                got, want = hist[key][s, p0:p0 + T], replay_ref[key][b]
                if key == "u":
                    assert_close(got, want, tol, f"{what} hist u row {b}")
                else:
                    assert torch.equal(got, want), f"{what}: history {key} is not the tree's inputs"


@pytest.mark.parametrize("tree", ["random7", "default16"])
@pytest.mark.parametrize("dtype,use_si", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-si"])
def test_conv1d_tree(tree, dtype, use_si):
    conv = CONV1D.on("triton", DEVICE).kernels
    torch.manual_seed(23)
    parents = _tree(tree)
    T, B, C, W = len(parents), 3, 24, 4
    S, si, rows = _layout(B, use_si, 24)
    slots = _slots(si, rows)
    window = torch.randn(S, C, W - 1 + T + 1, device=DEVICE).to(dtype)
    weight, bias = torch.randn(C, W, device=DEVICE), torch.randn(C, device=DEVICE)
    idx = torch.tensor(slots, device=DEVICE)
    ref_rows = window[idx].clone()
    x = torch.randn(B, T, C, device=DEVICE).to(dtype)
    y = torch.full_like(x, float("nan"))
    before = window.clone()
    conv.tree_verify(window, x, weight, bias, "silu", parents, state_indices=si, out=y)
    y_ref = conv1d_tree_verify(ref_rows, x[rows], weight, bias, "silu", parents)
    tol = TOL[dtype] if dtype == torch.float32 else 1e-2
    assert_close(y[rows].float(), y_ref.float(), tol, "conv tree y")
    assert torch.isnan(y[[b for b in range(B) if b not in rows]]).all(), "conv tree wrote outputs of padded rows"
    _check_untouched_rows(before, window, slots, "conv tree window")
    assert torch.equal(window[idx], ref_rows), "conv tree window differs from the reference's"
    with pytest.raises(ValueError, match="earlier token"):
        conv.tree_verify(window, x, weight, bias, "silu", (-1, 2) + parents[2:], state_indices=si)


def test_tree_rejects_offset_and_bad_parents():
    kern = kernels("gdn")
    inp = step_inputs("gdn", (1, 8, 8), 1, 3, torch.float32, torch.Generator().manual_seed(0))
    live, buf = torch.zeros(1, 1, 8, 8, device=DEVICE), torch.zeros(1, 5, 1, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="offset 0"):
        kern.snapshot_verify(live, buf, inp, {}, 1, parents=(-1, 0, 0))
    with pytest.raises(ValueError, match="earlier token"):
        kern.snapshot_verify(live, buf, inp, {}, 0, parents=(-1, 1, 0))
    with pytest.raises(ValueError, match="entries"):
        kern.snapshot_verify(live, buf, inp, {}, 0, parents=(-1, 0))


TREE_STRATEGY_CASES = [pytest.param(op, strat, id=f"{op}-{strat}") for op in ("gdn", "mamba2")
                       for strat in ("snapshot", "ring", "replay", "replay_deferred")]
TREE_STRATEGY_CASES.append(pytest.param("kda", "ring", id="kda-ring"))  # KDA runs GDN's kernel (per-channel gate)


@pytest.mark.parametrize("name,strategy", TREE_STRATEGY_CASES)
def test_rollback_tree_step_end_to_end(monkeypatch, name, strategy):
    """Tree steps through a rollback strategy (tree_verify, compact_path, commit), then a chain step:
    Triton == torch, and the Triton side never calls the torch tree reference."""
    from specdec.kernels import GDNOp, Mamba2Op
    from specdec.rollback import make_strategy

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    op_triton = get_op(name, DEVICE)
    op_torch = OPS[name]
    gen = torch.Generator().manual_seed(25)
    dims = (2, 8, 8, 2) if name == "mamba2" else (2, 8, 8)
    params = op_params(name, dims, gen)
    parents = (-1, 0, 0, 1, 2, 1)  # node 3 and 5 share parent 1; node 4 hangs off 2
    T = len(parents)
    B = 3
    paths = torch.tensor([[0, 2, 4, 0], [0, 1, 5, 0], [0, 1, 3, 0]], device=DEVICE)
    state = torch.randn(B, *op_shape(name, dims).state_shape, generator=gen).to(DEVICE)
    stores = {}
    for key, op in (("triton", op_triton), ("torch", op_torch)):
        strat = make_strategy(strategy)
        store = strat.new_store(B, T)
        strat.load(store, state)
        stores[key] = (strat, store, op)
    for step, n in enumerate([[3, 2, 1], [0, 3, 2], [1, 1, 3]]):
        inp = step_inputs(name, dims, B, T, torch.float32, gen)
        num = torch.tensor(n, device=DEVICE)
        ys = {}
        for key, (strat, store, op) in stores.items():
            if key == "triton":
                def boom(*a, **k):
                    raise AssertionError("the Triton backend ran the torch tree reference")

                with monkeypatch.context() as mp:
                    mp.setattr(Mamba2Op, "tree_verify", boom)
                    mp.setattr(GDNOp, "tree_verify", boom)
                    ys[key] = strat.tree_verify(store, op, inp, params, parents)
            else:
                ys[key] = strat.tree_verify(store, op, inp, params, parents)
            strat.compact_path(store, op, params, paths, num)
            strat.commit(store, op, params, num)
        assert_close(ys["triton"], ys["torch"], 1e-5, f"step {step} tree outputs")
        got = stores["triton"][0].state(stores["triton"][1], op_triton, params)
        want = stores["torch"][0].state(stores["torch"][1], op_torch, params)
        assert_close(got, want, 1e-5, f"committed state after tree step {step}")
        inp = step_inputs(name, dims, B, 2, torch.float32, gen)  # a chain step after the tree step
        ys = {key: strat.verify(store, op, inp, params) for key, (strat, store, op) in stores.items()}
        assert_close(ys["triton"], ys["torch"], 1e-5, f"chain step after tree step {step}")
        for strat, store, op in stores.values():
            strat.commit(store, op, params, torch.tensor([2, 1, 0], device=DEVICE))


# ----------------------------------------------------------------------------------------------
# argument checks (no kernel launch)


def test_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    kern = kernels("gdn")
    inp = step_inputs("gdn", (1, 8, 8), 1, 2, torch.float32, gen)
    with pytest.raises(ValueError, match="float32"):
        kern.update(torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16, device=DEVICE), inp, {})
    with pytest.raises(ValueError, match="per-row shape"):
        kern.update(torch.zeros(1, 1, 8, 4, device=DEVICE), inp, {})
    with pytest.raises(ValueError, match="snapshot buffer"):
        kern.snapshot_verify(torch.zeros(1, 1, 8, 8, device=DEVICE), torch.zeros(1, 2, 1, 8, 8, device=DEVICE), inp, {},
                             1)
    with pytest.raises(ValueError, match="ring"):
        kern.ring_verify(torch.zeros(1, 2, 1, 8, 8, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
                         inp, {}, 0)
    with pytest.raises(ValueError, match="state_indices"):
        kern.update(torch.zeros(1, 1, 8, 8, device=DEVICE), inp, {}, state_indices=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="gate g"):
        kernels("kda").update(torch.zeros(1, 1, 8, 8, device=DEVICE), inp, {})
    with pytest.raises(TypeError, match="LaunchConfig"):
        kern.with_launch({"block": 8})
    with pytest.raises(ValueError, match="groups"):
        dims = (3, 8, 8, 2)
        kernels("mamba2").update(torch.zeros(1, 3, 8, 8, device=DEVICE), step_inputs("mamba2", dims, 1, 1, torch.float32,
                                                                                     gen), op_params("mamba2", dims, gen))


# ----------------------------------------------------------------------------------------------
# the backend and the rollback strategies end to end


@pytest.mark.parametrize("name", ["gdn", "kda", "mamba2"])
def test_get_op_triton_backend(monkeypatch, name):
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    op = get_op(name, DEVICE)
    assert type(op) is type(OPS[name]) and op.kernels is not None
    assert OPS[name].kernels is None, "the shared reference op must stay on the torch path"
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")
    assert get_op(name, DEVICE).kernels is None


STRATEGY_CASES = [
    pytest.param("gdn", "snapshot", id="gdn-snapshot"),
    pytest.param("gdn", "ring", id="gdn-ring"),
    pytest.param("gdn", "replay", id="gdn-replay"),
    pytest.param("gdn", "replay_deferred", id="gdn-replay_deferred"),
    pytest.param("kda", "replay", id="kda-replay"),
    pytest.param("mamba2", "snapshot", id="mamba2-snapshot"),
    pytest.param("mamba2", "replay_deferred", id="mamba2-replay_deferred"),
]


@pytest.mark.parametrize("name,strategy", STRATEGY_CASES)
def test_rollback_strategy_end_to_end(monkeypatch, name, strategy):
    """Two speculative steps (the first in two calls) through a rollback strategy: Triton == torch."""
    from specdec.rollback import make_strategy

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    op_triton = get_op(name, DEVICE)
    op_torch = OPS[name]
    gen = torch.Generator().manual_seed(14)
    dims = (2, 16, 8, 2) if name == "mamba2" else (2, 8, 16)
    params = op_params(name, dims, gen)
    B, T_max = 2, 3
    state = torch.randn(B, *op_shape(name, dims).state_shape, generator=gen).to(DEVICE)
    stores = {}
    for key, op in (("triton", op_triton), ("torch", op_torch)):
        strat = make_strategy(strategy)
        store = strat.new_store(B, T_max)
        strat.load(store, state)
        stores[key] = (strat, store, op)
    for step, (calls, n) in enumerate([((1, 2), [3, 0]), ((3,), [1, 2]), ((2,), [2, 1])]):
        inps = [step_inputs(name, dims, B, t, torch.float32, gen) for t in calls]
        for inp in inps:
            ys = {key: strat.verify(store, op, inp, params) for key, (strat, store, op) in stores.items()}
            assert_close(ys["triton"], ys["torch"], 1e-5, f"step {step} outputs")
        num = torch.tensor(n, device=DEVICE)
        for strat, store, op in stores.values():
            strat.commit(store, op, params, num)
        got = stores["triton"][0].state(stores["triton"][1], op_triton, params)
        want = stores["torch"][0].state(stores["torch"][1], op_torch, params)
        assert_close(got, want, 1e-5, f"committed state after step {step}")


# ----------------------------------------------------------------------------------------------
# compiled for a real GPU


def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: compile one variant of each kernel for sm_90."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "triton_sm90_compile.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, script, "--quick"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "COMPILED" in res.stdout


def test_sass_configs_counts_barriers_per_launch_setting():
    """benchmarks/sass_configs.py compiles the update and fused replay per launch setting for sm_90
    and counts their SASS: no spills, and a one-warp program reduces without the barriers a
    four-warp one needs (the lead the next GPU sweep checks)."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "sass_configs.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, script, "--op", "mamba2", "--configs", "32,4,0;8,1,5"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = [[c.strip() for c in x.split("|")[1:-1]] for x in res.stdout.splitlines() if x.startswith("| mamba2 |")]
    assert [(r[1], r[2]) for r in rows] == [("update", "32,4,0"), ("replay_fused", "32,4,0"), ("update", "8,1,5"),
                                            ("replay_fused", "8,1,5")]
    assert all(int(r[3]) > 0 and r[4] == "0" and int(r[5]) > 100 for r in rows)  # regs, no spills, instructions
    bar = {(r[1], r[2]): int(r[6]) for r in rows}
    assert bar[("update", "8,1,5")] < bar[("update", "32,4,0")]
    assert bar[("replay_fused", "8,1,5")] < bar[("replay_fused", "32,4,0")]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tree", ["default16", "medusa63"])
@pytest.mark.parametrize("op,dims", [("gdn", (32, 128, 128)), ("kda", (32, 128, 128)), ("mamba2", (128, 64, 128, 8))],
                         ids=["gdn", "kda", "mamba2"])
@pytest.mark.parametrize("B", [1, 8])
def test_tree_real_size(op, dims, tree, B):
    """Tree kernels (snapshot, ring, both replays) at the benchmark's head shapes, bf16 inputs, the
    launch configs the launchers pick for batch 1 and 8, Medusa's 16-node tree (nodes unrolled) and
    64-node tree (a runtime node loop)."""
    test_tree_verify(op, dims, None, B, tree, torch.bfloat16, B > 1, None)


@pytest.mark.gpu
@needs_cuda
def test_conv1d_tree_real_size(monkeypatch):
    """The conv tree kernel at Mamba-2's conv width (C = 8192 + 2 * 8 * 128 channels), 64-node tree."""
    parents = _tree("medusa63")
    B, C, W, T = 8, 8192 + 2048, 4, len(parents)
    window = torch.randn(B, C, W - 1 + T, device=DEVICE).bfloat16()
    weight, bias = torch.randn(C, W, device=DEVICE).bfloat16(), torch.randn(C, device=DEVICE).bfloat16()
    x = torch.randn(B, T, C, device=DEVICE).bfloat16()
    ref = window.clone()
    y = CONV1D.on("triton", DEVICE).tree_verify(window, x, weight, bias, "silu", parents)
    y_ref = conv1d_tree_verify(ref, x, weight.float(), bias.float(), "silu", parents)
    assert_close(y.float(), y_ref.float(), 1e-2, "conv tree y (bf16 outputs)")
    assert torch.equal(window, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["mamba2", "gdn", "kda"])
def test_real_size_against_reference(op):
    """Every strategy at the kernel table's shapes (bf16 inputs, fp32 state), B = 8, K = 4, through the
    library's strategies (the kernel table's check)."""
    from specdec.experiments.kernel_table import SHAPES, check_point

    shape, gen = SHAPES["bench"][op], torch.Generator().manual_seed(0)
    params = synthetic_params(shape, DEVICE, gen)
    bad = {}
    for strategy in ("baseline", "snapshot", "ring", "replay", "replay_deferred"):
        r = check_point(OPS[op].on("triton", DEVICE), OPS[op], shape, strategy, 8, 4, DEVICE, params=params, gen=gen)
        if not r["exact"]:
            bad[strategy] = r
    assert not bad, bad


TREE_BIG = TREE_UNROLL_MAX + 3


@pytest.mark.parametrize("op", ["gdn", "mamba2"])
def test_tree_loop_reaches_the_kernel(op, monkeypatch):
    """The node walk a launch compiles: unrolled for trees up to TREE_UNROLL_MAX nodes, the runtime
    loop (with no input lookahead) above it or when forced with tree_loop=True, never for a chain;
    and the launch settings of a large batch (the tree keeps its own) as _launch_config says."""
    kernel = dr._delta_rule_step_kernel if op == "gdn" else m2._mamba2_step_kernel
    seen = []
    original = kernel.run

    def record(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("TREE", "TREE_LOOP", "PREFETCH", "num_warps")})
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", record)
    small = _tree("random7")
    big = tuple(j - 1 for j in range(TREE_BIG))  # a chain-shaped tree of more than TREE_UNROLL_MAX nodes
    for parents, tree_loop, want in ((None, None, False), (small, None, False), (small, True, True),
                                     (big, None, True), (big, False, False)):
        T = 5 if parents is None else len(parents)
        dims = (2, 8, 8) if op == "gdn" else (2, 8, 8, 1)
        gen = torch.Generator().manual_seed(T)
        inp = step_inputs(op, dims, 1, T, torch.float32, gen)
        live = torch.randn(1, *op_shape(op, dims).state_shape, device=DEVICE)
        buf = garbage(1, T, *op_shape(op, dims).state_shape)
        kernels(op, 8, tree_loop).snapshot_verify(live, buf, inp, op_params(op, dims, gen), 0, parents=parents)
        got = seen[-1]
        assert got["TREE"] == (parents is not None) and got["TREE_LOOP"] == want, (parents, tree_loop, got)
        if want:
            assert got["PREFETCH"] == 0
    # large batch: chains take the sweep's settings, trees the earlier ones
    if op == "gdn":
        assert dr._launch_config(64, 32, 128, 128, None, None, 0, False, False) == (128, 16, 2)
        assert dr._launch_config(64, 32, 128, 128, None, None, 1, False, False) == (128, 64, 4)
        assert dr._launch_config(64, 32, 128, 128, None, None, 1, False, True) == (128, 32, 4)
        assert dr._launch_config(64, 32, 128, 128, None, None, 1, True, False) == (128, 32, 4)  # KDA snapshot
    else:
        assert m2._launch_config(64, 128, 64, 128, None, None, None, 5, 3) == (8, 128, 1, 3)  # fused replay
        assert m2._launch_config(64, 128, 64, 128, None, None, None, 5, 3, deferred=True) == (32, 128, 4, 0)
        assert m2._launch_config(64, 128, 64, 128, None, None, None, 5, 0) == (32, 128, 4, 0)  # plain update
        assert m2._launch_config(64, 128, 64, 128, None, None, None, 5, 3, tree=True) == (32, 128, 8, 3)
        assert m2._launch_config(1, 128, 64, 128, None, None, None, 5, 3) == (16, 128, 4, 5)
