"""Each rollback strategy on each op, on fresh random inputs: after a step of T tokens (run in
one or several calls) and a commit of n tokens per row, the state equals the reference
recurrence over exactly the committed tokens; outputs equal the reference's."""

from __future__ import annotations

import pytest
import torch
from helpers import STRATEGY_FACTORIES, random_inputs, slice_inputs

from specdec.kernels import OPS
from specdec.rollback import ReplayRollback, RingRollback, SnapshotRollback

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
