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
from helpers import ALL_STRATEGIES, STRATEGY_FACTORIES, hf_greedy, hf_states, random_inputs, rel_err, slice_inputs
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tiny_models import FAMILIES, VOCAB, get_model, ragged_prompts

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


@pytest.mark.parametrize("strategy", list(STRATEGY_FACTORIES))
@pytest.mark.parametrize("op_name", ["mamba2", "gdn", "kda"])
@given(plan=step_plans(), seed=st.integers(0, 2**16))
def test_strategy_property(op_name, strategy, plan, seed):
    B, K, steps = plan
    assume(strategy != "replay_deferred_L8" or 2 * (K + 1) <= 8)  # history 8 holds K <= 3 (else a clear error)
    op = OPS[op_name]
    g = torch.Generator().manual_seed(seed)
    strat = STRATEGY_FACTORIES[strategy]()
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


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
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
        _REFS[key] = (ids, mask, ref, {})
    ids, mask, ref, ref_states = _REFS[key]
    L = ids.shape[1]
    texts = [ids[i][mask[i].bool()].tolist() + ref[i, L:].tolist() for i in range(batch)]
    sd = specdec.wrap(model, drafter=PatternDrafter(texts, pattern), rollback=strategy, num_speculative_tokens=K)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(out, ref)
    # the committed state equals HF's decode of exactly the committed tokens (text minus pending): the same
    # texts for every example of this family and batch, so HF's decode of them runs once
    if not ref_states:
        committed = [t[: len(t) - 1] for t in texts]
        ref_states.update(hf_states(model, sd.adapter, committed, mask.sum(1).tolist()))
    for idx, (state, _) in ref_states.items():
        assert rel_err(sd.last_cache.ssm[idx].ssm_state(), state) < 1e-5


def test_debug_mode_reports_nan_with_row_layer_step(monkeypatch):
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    op = OPS["gdn"]
    g = torch.Generator().manual_seed(0)
    inputs, params, S = random_inputs("gdn", 2, g)
    strat = STRATEGY_FACTORIES["snapshot"]()
    store = strat.new_store(3, 3, layer=7)
    strat.load(store, torch.randn(3, *S, generator=g))
    strat.verify(store, op, inputs, params)
    strat.commit(store, op, params, torch.tensor([1, 1, 1]))
    inputs["v"][2, 1] = float("nan")
    strat.verify(store, op, inputs, params)
    with pytest.raises(FloatingPointError, match=r"row 2, layer 7, step 2"):
        strat.commit(store, op, params, torch.tensor([1, 1, 2]))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    B=st.integers(1, 12), W=st.integers(1, 40), K=st.integers(1, 6), vocab=st.integers(1, 5),
    ngrams=st.sampled_from([(1, 1), (1, 3), (2, 3), (2, 2), (3, 5)]), seed=st.integers(0, 2**16),
)
def test_ngram_batched_search_equals_the_per_row_reference(B, W, K, vocab, ngrams, seed):
    """NGramDrafter's batched search (propose_batched) proposes exactly what the readable per-row loop
    does (longest suffix n-gram, most recent earlier occurrence, continuation cut at the text's
    end): ragged lengths 0..W, tiny vocabularies (many repeats), random tokens past each row's end."""
    from specdec.drafters import NGramDrafter
    from specdec.drafters.ngram import propose_ngram_reference

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, W), generator=g)
    lengths = torch.randint(0, W + 1, (B,), generator=g)
    # entries past each row's end are random tokens too: they must be ignored
    drafts, counts = NGramDrafter(*ngrams).propose_batched(ids, lengths, K)
    ref_drafts, ref_counts = propose_ngram_reference(ids, lengths, K, *ngrams)
    assert torch.equal(counts, ref_counts) and torch.equal(drafts, ref_drafts)
    assert drafts.dtype == counts.dtype == torch.long and drafts.shape == (B, K)


def test_ngram_propose_picks_the_host_loop_for_small_batches(monkeypatch):
    """propose: up to HOST_SEARCH_MAX_BATCH rows the per-row loop, above it the batched search;
    the same proposals either way."""
    from specdec.drafters import NGramDrafter
    from specdec.drafters import ngram

    g = torch.Generator().manual_seed(0)
    calls = []
    batched = NGramDrafter.propose_batched
    monkeypatch.setattr(NGramDrafter, "propose_batched", lambda self, *a: calls.append(a[0].shape[0]) or batched(self, *a))
    for B in (1, ngram.HOST_SEARCH_MAX_BATCH, ngram.HOST_SEARCH_MAX_BATCH + 1, 40):
        ids = torch.randint(0, 4, (B, 30), generator=g)
        lengths = torch.randint(0, 31, (B,), generator=g)
        drafts, counts = NGramDrafter().propose(ids, lengths, 4)
        ref = ngram.propose_ngram_reference(ids, lengths, 4)
        assert torch.equal(drafts, ref[0]) and torch.equal(counts, ref[1])
    assert calls == [ngram.HOST_SEARCH_MAX_BATCH + 1, 40]


def test_ngram_proposes_the_continuation_of_the_most_recent_longest_match():
    from specdec.drafters import NGramDrafter

    #            0  1  2  3  4  5  6  7  8  9 10
    ids = torch.tensor([[5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6],     # "5 6" occurs at 0 and 4: the later one -> 8 2 9
                        [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0]])    # no repeat in its 4 tokens -> nothing
    drafts, counts = NGramDrafter(1, 3).propose(ids, torch.tensor([11, 4]), 4)
    assert counts.tolist() == [4, 0]
    assert drafts.tolist() == [[8, 2, 9, 5], [0, 0, 0, 0]]
    drafts, counts = NGramDrafter(1, 3).propose(ids, torch.tensor([10, 4]), 4)  # suffix "9 5": only "5" repeats
    assert counts.tolist()[0] == 4 and drafts[0].tolist() == [6, 8, 2, 9]  # most recent "5" (at 4), then 6 8 2 9
