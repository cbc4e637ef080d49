"""Property-based tests (hypothesis) over random per-row accept patterns: 0..K accepted per row
and step, steps with zero drafts right after steps that accepted several, steps run in
several calls, batch compositions, prompt lengths and K — for every strategy and SSM type.
Exactness of outputs and of the committed state against the reference recurrence (op level)
and against HF generate / HF's own decode (model level).

Profiles: the default ``ci`` runs a few hundred examples in well under a minute;
``SPECDEC_HYPOTHESIS_PROFILE=slow`` runs ten times more.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import get_model
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_core_exactness import hf_greedy, hf_states, rel_err
from test_rollback import STRATS, random_inputs, slice_inputs
from tiny_models import FAMILIES, VOCAB, ragged_prompts

import specdec
from specdec.drafters import Drafter
from specdec.kernels import OPS

settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.register_profile("slow", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SPECDEC_HYPOTHESIS_PROFILE", "ci"))


@st.composite
def step_plans(draw):
    """(B, K, steps): each step = (T, split point or 0, per-row commit counts in [0, T])."""
    B = draw(st.integers(1, 4))
    K = draw(st.integers(1, 6))
    steps = []
    for _ in range(draw(st.integers(1, 10))):
        # bias towards the hard transitions: full acceptance, then a zero-draft (T = 1) step
        T = draw(st.one_of(st.just(1), st.just(K + 1), st.integers(1, K + 1)))
        split = draw(st.integers(0, T - 1))
        n = draw(st.lists(st.one_of(st.just(0), st.just(T), st.integers(0, T)), min_size=B, max_size=B))
        steps.append((T, split, n))
    return B, K, steps


@pytest.mark.parametrize("strategy", list(STRATS))
@pytest.mark.parametrize("op_name", ["mamba2", "gdn", "kda"])
@given(plan=step_plans(), seed=st.integers(0, 2**16))
def test_strategy_property(op_name, strategy, plan, seed):
    B, K, steps = plan
    assume(strategy != "replay_deferred_L8" or 2 * (K + 1) <= 8)  # history 8 holds K <= 3 (else a clear error)
    op = OPS[op_name]
    g = torch.Generator().manual_seed(seed)
    strat = STRATS[strategy]()
    store = strat.new_store(B, K + 1)
    _, params, S = random_inputs(op_name, 1, g)
    ref = torch.randn(B, *S, generator=g)
    strat.load(store, ref)
    for T, split, n in steps:
        inputs = random_inputs(op_name, T, g, batch=B)[0]
        if split:
            y = torch.cat([strat.verify(store, op, slice_inputs(inputs, 0, split), params),
                           strat.verify(store, op, slice_inputs(inputs, split, T), params)], 1)
        else:
            y = strat.verify(store, op, inputs, params)
        y_ref, states, _ = op.verify(ref, inputs, params, True)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        n = torch.tensor(n)
        strat.commit(store, op, params, n)
        pick = states[torch.arange(B), (n - 1).clamp(min=0)]
        ref = torch.where((n == 0).view(-1, *[1] * len(S)), ref, pick)
        torch.testing.assert_close(strat.state(store, op, params), ref, rtol=1e-6, atol=1e-6)


class PatternDrafter(Drafter):
    """Proposes the reference continuation with a hypothesis-drawn number of correct tokens
    per row and step, then wrong ones; counts 0..K."""

    def __init__(self, ref_texts, pattern):
        self.ref, self.pattern, self.calls = ref_texts, pattern, 0

    def propose(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        drafts = torch.zeros(B, K, dtype=torch.long)
        counts = torch.zeros(B, dtype=torch.long)
        for i in range(B):
            count, good = self.pattern[(self.calls * B + i) % len(self.pattern)]
            count, good = min(count, K), min(good, count)
            L = int(lengths[i])
            nxt = (self.ref[i][L : L + K] + [3] * K)[:K]
            d = torch.tensor(nxt)
            d[good:] = (d[good:] - 3 + 1) % (VOCAB - 3) + 3  # wrong from position `good` on
            drafts[i], counts[i] = d, count
        self.calls += 1
        return drafts, counts


_REFS: dict = {}


@pytest.mark.parametrize("strategy", ["snapshot", "ring", "replay", "replay_deferred"])
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=6 if os.environ.get("SPECDEC_HYPOTHESIS_PROFILE", "ci") == "ci" else 60)
@given(
    pattern=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12),
    K=st.integers(1, 5),
    batch=st.integers(1, 3),
)
def test_engine_property(family, strategy, pattern, K, batch):
    model = get_model(family)
    key = (family, batch)
    if key not in _REFS:
        ids, mask = ragged_prompts(batch=batch, lengths=(9, 4, 7), seed=batch)
        ref = hf_greedy(model, ids, mask, max_new=12)
        _REFS[key] = (ids, mask, ref)
    ids, mask, ref = _REFS[key]
    L = ids.shape[1]
    texts = [ids[i][mask[i].bool()].tolist() + ref[i, L:].tolist() for i in range(batch)]
    sd = specdec.wrap(model, drafter=PatternDrafter(texts, pattern), rollback=strategy, num_speculative_tokens=K)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(out, ref)
    # the committed state equals HF's decode of exactly the committed tokens (text minus pending)
    committed = [t[: len(t) - 1] for t in texts]
    states = hf_states(model, sd.adapter, committed, mask.sum(1).tolist())
    for idx, (state, _) in states.items():
        assert rel_err(sd.last_cache.ssm[idx].ssm_state(), state) < 1e-5


def test_debug_mode_reports_nan_with_row_layer_step(monkeypatch):
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    op = OPS["gdn"]
    g = torch.Generator().manual_seed(0)
    inputs, params, S = random_inputs("gdn", 2, g)
    strat = STRATS["snapshot"]()
    store = strat.new_store(3, 3, layer=7)
    strat.load(store, torch.randn(3, *S, generator=g))
    strat.verify(store, op, inputs, params)
    strat.commit(store, op, params, torch.tensor([1, 1, 1]))
    inputs["v"][2, 1] = float("nan")
    strat.verify(store, op, inputs, params)
    with pytest.raises(FloatingPointError, match=r"row 2, layer 7, step 2"):
        strat.commit(store, op, params, torch.tensor([1, 1, 2]))
