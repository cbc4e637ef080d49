"""Each rollback strategy on each op, on fresh random inputs: after a step of T tokens (run in
one or several calls) and a commit of n tokens per row, the state equals the reference
recurrence over exactly the committed tokens; outputs equal the reference's."""

from __future__ import annotations

import pytest
import torch
from helpers import STRATEGY_FACTORIES, random_inputs, slice_inputs

from markers import needs_triton_interpreter

from specdec.kernels import OPS
from specdec.rollback import ReplayRollback, RingRollback, SnapshotRollback

#: the backends these tests bind for CPU tensors: Triton's through its interpreter only
CPU_BACKENDS = ["torch", pytest.param("triton", marks=needs_triton_interpreter)]

B = 3


@pytest.mark.parametrize("split", [False, True], ids=["one-call", "two-calls"])
@pytest.mark.parametrize("strategy", list(STRATEGY_FACTORIES))
@pytest.mark.parametrize("op_name", ["mamba2", "gdn", "kda"])
def test_strategy_commits_exact_state(op_name, strategy, split):
    op = OPS[op_name]
    g = torch.Generator().manual_seed(0)
    Tmax = 4
    strat = STRATEGY_FACTORIES[strategy]()
    store = strat.new_store(B, Tmax)
    _, _, S = random_inputs(op_name, 1, g)
    state0 = torch.randn(B, *S, generator=g)
    strat.load(store, state0)
    ref_state = state0.clone()
    _, params, _ = random_inputs(op_name, 1, g)  # A, D are model constants: fixed across steps
    for step in range(12):  # enough steps to force deferred flushes
        T = 1 + step % Tmax
        inputs, _, _ = random_inputs(op_name, T, g)
        if split and T > 1:
            y = torch.cat([strat.verify(store, op, slice_inputs(inputs, 0, 1), params),
                           strat.verify(store, op, slice_inputs(inputs, 1, T), params)], 1)
        else:
            y = strat.verify(store, op, inputs, params)
        y_ref, states, _ = op.verify(ref_state, inputs, params, True)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        n = torch.tensor([step % (T + 1), T, 0])
        strat.commit(store, op, params, n)
        pick = states[torch.arange(B), (n - 1).clamp(min=0)]
        ref_state = torch.where((n == 0).view(-1, *[1] * len(S)), ref_state, pick)
        torch.testing.assert_close(strat.state(store, op, params), ref_state, rtol=1e-6, atol=1e-6)


def test_replay_fold_equals_sequential_bitwise():
    """Replaying cached inputs repeats the verify's arithmetic exactly (no drift)."""
    op = OPS["gdn"]
    g = torch.Generator().manual_seed(1)
    inputs, params, S = random_inputs("gdn", 5, g)
    s0 = torch.randn(B, *S, generator=g)
    _, states, replay = op.verify(s0, inputs, params, True)
    n = torch.tensor([5, 2, 0])
    folded = op.fold(s0, replay, params, n)
    assert torch.equal(folded[0], states[0, 4]) and torch.equal(folded[1], states[1, 1]) and torch.equal(folded[2], s0[2])


def test_step_overflow_and_ring_size_errors():
    strat = RingRollback(ring_size=3)
    store = strat.new_store(B, 4)
    with pytest.raises(ValueError, match="ring_size"):
        strat.load(store, torch.zeros(B, 2, 2))
    with pytest.raises(ValueError, match="deferred"):
        ReplayRollback(history=8)
    snap = SnapshotRollback()
    store = snap.new_store(B, 2)
    g = torch.Generator().manual_seed(0)
    inputs, params, S = random_inputs("gdn", 3, g)
    snap.load(store, torch.zeros(B, *S))
    with pytest.raises(ValueError, match="exceeds"):
        snap.verify(store, OPS["gdn"], inputs, params)


def test_reset_rows_keeps_other_rows():
    op = OPS["mamba2"]
    g = torch.Generator().manual_seed(2)
    for strat in (SnapshotRollback(), RingRollback(), ReplayRollback(deferred=True)):
        inputs, params, S = random_inputs("mamba2", 2, g)
        store = strat.new_store(B, 3)
        strat.load(store, torch.randn(B, *S, generator=g))
        strat.verify(store, op, inputs, params)
        strat.commit(store, op, params, torch.tensor([2, 1, 2]))
        before = strat.state(store, op, params).clone()
        strat.reset_rows(store, op, params, torch.tensor([1]))
        after = strat.state(store, op, params)
        assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
        assert float(after[1].abs().max()) == 0.0


POOL_STRATS = ["snapshot", "ring", "replay", "replay_deferred"]


# every strategy on both backends; deferred replay through the Triton interpreter (its slowest case)
# with -m slow (the default run keeps it on torch, and on Triton in the plain-steps test below)
@pytest.mark.parametrize("op_name, strategy, backend", [
    pytest.param(op, st, be, marks=marks + ([pytest.mark.slow] if (st, be) == ("replay_deferred", "triton") else []))
    for op in ("mamba2", "gdn") for st in POOL_STRATS
    for be, marks in (("torch", []), ("triton", [needs_triton_interpreter]))])
def test_state_indices_pool_equals_identity(op_name, strategy, backend):
    """A store over a pool of 6 slots with a permuted row -> slot map and a padding row: chain steps
    (one and two calls), tree steps (tree_verify, compact_path) and commits give bit for bit the
    outputs and committed states of the identity store; slots no row maps to never change."""
    from specdec.rollback import make_strategy

    op = OPS[op_name].on(backend, "cpu")  # triton: the kernels through Triton's interpreter
    g = torch.Generator().manual_seed(5)
    Tmax, slots = 4, 6
    si = torch.tensor([4, 0, 3, -1])  # rows 0..2 on slots 4, 0, 3; row 3 pads; slots 1, 2, 5 unused
    real = si[:3]
    unused = torch.tensor([1, 2, 5])
    _, params, S = random_inputs(op_name, 1, g)
    state0 = torch.randn(B, *S, generator=g)
    pool = torch.randn(slots, *S, generator=g)
    pool[real] = state0
    ident, pooled = make_strategy(strategy), make_strategy(strategy)
    s_id, s_pool = ident.new_store(B, Tmax), pooled.new_store(4, Tmax, state_indices=si)
    ident.load(s_id, state0)
    pooled.load(s_pool, pool)
    unused0 = pooled.state(s_pool, op, params)[unused].clone()

    def both(fn_id, fn_pool):
        return fn_id(ident, s_id), fn_pool(pooled, s_pool)

    def check(what):
        got, want = pooled.state(s_pool, op, params), ident.state(s_id, op, params)
        assert torch.equal(got[real], want), f"{what}: pooled committed states differ from the identity store's"
        assert torch.equal(got[unused], unused0), f"{what}: a slot no row maps to changed"

    parents = (-1, 0, 0, 1)
    for step in range(8):  # enough commits for deferred replay to flush
        T = 1 + step % Tmax
        inputs, _, _ = random_inputs(op_name, T, g, batch=4)  # row 3 (padding) has inputs of its own
        rows3 = {k: v[:3] for k, v in inputs.items()}
        n = torch.tensor([step % (T + 1), T, 0])
        n_pool = torch.cat([n, torch.tensor([T])])  # the padding row's count is never used
        if step % 3 == 2:  # a tree step of 4 nodes; path[b] = the accepted nodes
            inputs, _, _ = random_inputs(op_name, len(parents), g, batch=4)
            rows3 = {k: v[:3] for k, v in inputs.items()}
            y_id, y_pool = both(lambda s, st: s.tree_verify(st, op, rows3, params, parents),
                                lambda s, st: s.tree_verify(st, op, inputs, params, parents))
            path = torch.tensor([[0, 2, 0], [0, 1, 3], [0, 1, 0]])
            n = torch.tensor([2, 3, 0])
            n_pool = torch.cat([n, torch.tensor([1])])
            ident.compact_path(s_id, op, params, path, n)
            pooled.compact_path(s_pool, op, params, torch.cat([path, path[:1]]), n_pool)
        elif T > 1 and step % 2:
            ys = [both(lambda s, st, a=a, b=b: s.verify(st, op, {k: v[:, a:b] for k, v in rows3.items()}, params),
                       lambda s, st, a=a, b=b: s.verify(st, op, {k: v[:, a:b] for k, v in inputs.items()}, params))
                  for a, b in ((0, 1), (1, T))]
            y_id, y_pool = torch.cat([y[0] for y in ys], 1), torch.cat([y[1] for y in ys], 1)
        else:
            y_id, y_pool = both(lambda s, st: s.verify(st, op, rows3, params),
                                lambda s, st: s.verify(st, op, inputs, params))
        assert torch.equal(y_pool[:3], y_id), f"step {step}: pooled outputs differ"
        ident.commit(s_id, op, params, n)
        pooled.commit(s_pool, op, params, n_pool)
        check(f"step {step}")


PLAIN_STRATS = ["snapshot", "replay", "replay_deferred", "replay_deferred_L8"]
#: a run of step kinds: a speculative step of T tokens, or "plain" (K = 0: one token, in place)
PLAIN_SCRIPT = [3, "plain", "plain", 4, 2, "plain", 1, "plain", 4, 4, "plain", "plain", "plain", 2]


@pytest.mark.parametrize("mapped", [True, False], ids=["slot_map", "no_slot_map"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("strategy", PLAIN_STRATS)
@pytest.mark.parametrize("op_name", ["mamba2", "gdn", "kda"])
def test_plain_steps_between_speculative_steps_exact(op_name, strategy, backend, mapped):
    """Plain steps (flush, then one token updated in place) mixed with speculative steps and
    commits of every count, over a pool with a permuted slot map and a padding row (or a batch
    without a slot map, whose flush folds every slot at once): outputs and committed states equal
    the reference recurrence over exactly the committed tokens, and slots no row maps to stay bit
    for bit (flush folds only the batch's slots)."""
    op = OPS[op_name].on(backend, "cpu")  # triton: the kernels through Triton's interpreter
    g = torch.Generator().manual_seed(7)
    Tmax, slots, rows = (4, 6, 4) if mapped else (4, 3, 3)
    si = torch.tensor([4, 0, 3, -1]) if mapped else None
    real, unused = (si[:3], torch.tensor([1, 2, 5])) if mapped else (torch.arange(3), torch.tensor([], dtype=torch.long))
    strat = STRATEGY_FACTORIES[strategy]()
    assert strat.has_plain_steps
    store = strat.new_store(rows, Tmax, state_indices=si)
    _, params, S = random_inputs(op_name, 1, g)
    pool = torch.randn(slots, *S, generator=g)
    strat.load(store, pool)
    unused0 = pool[unused].clone()
    ref = pool[real].clone()
    for step, kind in enumerate(PLAIN_SCRIPT):
        plain = kind == "plain"
        T = 1 if plain else kind
        inputs, _, _ = random_inputs(op_name, T, g, batch=rows)  # row 3 (padding) has inputs of its own
        if plain:
            strat.flush(store, op, params)
            torch.testing.assert_close(strat.plain_state(store)[real], ref, rtol=1e-5, atol=1e-5)
            y = strat.plain_verify(store, op, inputs, params)
            n = torch.ones(rows, dtype=torch.long)
        else:
            y = strat.verify(store, op, inputs, params)
            n = torch.tensor([step % (T + 1), T, 0, T])[:rows]  # the padding row's count is never used
        y_ref, states, _ = op.verify(ref, {k: v[:3] for k, v in inputs.items()}, params, True)
        torch.testing.assert_close(y[:3], y_ref, rtol=1e-4, atol=1e-4)
        (strat.plain_commit if plain else strat.commit)(store, op, params, n)
        pick = states[torch.arange(3), (n[:3] - 1).clamp(min=0)]
        ref = torch.where((n[:3] == 0).view(-1, *[1] * len(S)), ref, pick)
        got = strat.state(store, op, params)
        torch.testing.assert_close(got[real], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(got[unused], unused0), f"step {step}: a slot no row maps to changed"


def test_plain_step_errors():
    """A plain step runs one token as its step's only call, and a strategy without plain steps
    (ring) says so; flush needs a closed step."""
    op = OPS["gdn"]
    g = torch.Generator().manual_seed(3)
    _, params, S = random_inputs("gdn", 1, g)
    snap = SnapshotRollback()
    store = snap.new_store(B, 4)
    snap.load(store, torch.randn(B, *S, generator=g))
    with pytest.raises(ValueError, match="exactly 1 token"):
        snap.plain_verify(store, op, random_inputs("gdn", 2, g)[0], params)
    snap.verify(store, op, random_inputs("gdn", 2, g)[0], params)
    with pytest.raises(ValueError, match="exactly 1 token"):
        snap.plain_verify(store, op, random_inputs("gdn", 1, g)[0], params)
    with pytest.raises(ValueError, match="flush needs no open step"):
        snap.flush(store, op, params)
    ring = RingRollback()
    assert not ring.has_plain_steps
    with pytest.raises(ValueError, match="has no plain steps"):
        ring.plain_state(ring.new_store(B, 4))


def test_state_indices_checks():
    strat = SnapshotRollback()
    with pytest.raises(ValueError, match="state_indices"):
        strat.new_store(3, 2, state_indices=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="state_indices"):
        strat.new_store(3, 2, state_indices=torch.tensor([0, 1]))
    store = strat.new_store(2, 2, state_indices=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="state_indices"):
        strat.load(store, torch.zeros(2, 3), state_indices=torch.tensor([0, 1, 2]))
    strat.load(store, torch.zeros(4, 3), state_indices=torch.tensor([3, -1]))
    assert store.state_indices.tolist() == [3, -1] and strat.state(store, OPS["gdn"], {}).shape == (4, 3)


def test_state_indices_debug_bounds(monkeypatch):
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    strat = RingRollback()
    store = strat.new_store(2, 2, state_indices=torch.tensor([0, 3]))
    with pytest.raises(IndexError, match="outside"):
        strat.load(store, torch.zeros(3, 2, 2))
    store = strat.new_store(2, 2, state_indices=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="two rows"):
        strat.load(store, torch.zeros(3, 2, 2))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_layer_cache_state_indices(backend):
    """SSMLayerCache with a row -> slot map: its conv op and store run the batch over window and
    state pools; each step's outputs and the committed conv / SSM states equal an identity layer's
    (conv_op on the same backend as the recurrence); unused slots keep theirs."""
    from specdec.cache import SSMLayerCache
    from specdec.rollback import make_strategy

    op = OPS["gdn"].on(backend, "cpu")
    g = torch.Generator().manual_seed(9)
    B, Tmax, W, C, slots = 2, 3, 4, 8, 4
    si = torch.tensor([3, 1])
    _, params, S = random_inputs("gdn", 1, g, batch=B)
    conv0, ssm0 = torch.randn(slots, C, W - 1, generator=g), torch.randn(slots, *S, generator=g)
    ident = SSMLayerCache(op, make_strategy("ring"), B, Tmax, 0)
    pooled = SSMLayerCache(op, make_strategy("ring"), B, Tmax, 0, state_indices=si)
    assert pooled.conv_op.backend == backend and pooled.state_indices is si
    ident.load(conv0[si].clone(), ssm0[si].clone(), W)
    pooled.load(conv0.clone(), ssm0.clone(), W)
    for layer, n in ((ident, B), (pooled, slots)):  # time-major windows: a column is contiguous over channels
        assert layer.conv_window.shape == (n, C, W - 1 + Tmax) and layer.conv_window.stride() == (
            (W - 1 + Tmax) * C, 1, C)
    weight = torch.randn(C, W, generator=g)
    for step in range(3):
        inputs, _, _ = random_inputs("gdn", 2, g, batch=B)
        x = torch.randn(B, 2, C, generator=g)
        for layer in (ident, pooled):
            layer.out = (layer.conv(x, weight, None, "silu"), layer.ssm(inputs, params))
            layer.advance(2)
        assert all(torch.equal(a, b) for a, b in zip(pooled.out, ident.out))
        n = torch.tensor([step % 3, 2])
        ident.commit(n)
        pooled.commit(n)
        assert torch.equal(pooled.conv_state()[si], ident.conv_state())
        assert torch.equal(pooled.ssm_state()[si], ident.ssm_state())
        assert torch.equal(pooled.conv_state()[[0, 2]], conv0[[0, 2]])
        assert torch.equal(pooled.ssm_state()[[0, 2]], ssm0[[0, 2]])
