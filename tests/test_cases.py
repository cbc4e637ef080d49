"""The failure kinds of ../shared/cases/README.md that apply on CPU, one test (or grid) each,
named after the case. Expected values come from plain autoregressive decoding (HF generate)
or from HF's own per-token decode of the accepted tokens."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from conftest import get_model
from test_core_exactness import hf_greedy, hf_states, rel_err
from tiny_models import VOCAB, ragged_prompts

import specdec
from specdec.drafters import DraftModelDrafter, Drafter
from specdec.rollback import STRATEGIES, make_strategy


class Ragged(Drafter):
    """Per-row draft counts from a schedule; tokens past the count are junk (placeholders)."""

    def __init__(self, inner, schedule):
        self.inner = specdec.drafters.make_drafter(inner)
        self.schedule = schedule  # fn(call, row, K) -> count
        self.calls = 0

    vocab_size = property(lambda self: self.inner.vocab_size)

    def start(self, **kw):
        self.calls = 0
        self.inner.start(**kw)

    def propose(self, input_ids, lengths, K):
        d, c = self.inner.propose(input_ids, lengths, K)
        want = torch.tensor([self.schedule(self.calls, i, K) for i in range(d.shape[0])])
        c = torch.minimum(c, want)
        junk = torch.randint(0, VOCAB, d.shape)
        d = torch.where(torch.arange(K)[None, :] < c[:, None], d, junk)
        self.calls += 1
        return d, c


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_C1_mixed_draft_counts_rows_equal_rows_alone(family, strategy):
    model = get_model(family)
    ids, mask = ragged_prompts(lengths=(12, 5, 9))
    ref = hf_greedy(model, ids, mask)
    # row 0 never drafts, row 1 drafts K, row 2 cycles 0..K
    sched = lambda call, row, K: [0, K, call % (K + 1)][row]  # noqa: E731
    sd = specdec.wrap(model, drafter=Ragged(DraftModelDrafter(get_model(family, "perturbed")), sched),
                      rollback=strategy, num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(out, ref)
    assert sd.last_stats.accept_histogram[0] > 0
    for i in range(3):
        row = ids[i : i + 1, mask[i].bool()]
        alone = specdec.wrap(model, drafter=DraftModelDrafter(get_model(family, "perturbed")), rollback=strategy,
                             num_speculative_tokens=3).generate(row, max_new_tokens=16, pad_token_id=0)
        assert torch.equal(alone[0, row.shape[1]:], out[i, ids.shape[1]:])


class StateCheckAfterCommit(Drafter):
    """Compares every SSM layer's committed state with HF's decode of the committed tokens."""

    def __init__(self, inner, model, prompt_lens):
        self.inner, self.model, self.prompt_lens = inner, model, prompt_lens
        self.sd = None
        self.checks = 0

    vocab_size = property(lambda self: self.inner.vocab_size)

    def start(self, **kw):
        self.inner.start(**kw)

    def propose(self, input_ids, lengths, K):
        texts = [input_ids[i, : int(lengths[i]) - 1].tolist() for i in range(input_ids.shape[0])]
        ref = hf_states(self.model, self.sd.adapter, texts, self.prompt_lens)
        for idx, (state, _) in ref.items():
            assert rel_err(self.sd.last_cache.ssm[idx].ssm_state(), state) < 1e-5
        self.checks += 1
        return self.inner.propose(input_ids, lengths, K)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_C2_placeholders_never_reach_committed_state(strategy):
    family = "qwen3_5"
    model = get_model(family)
    ids, mask = ragged_prompts()
    sched = lambda call, row, K: (call + row) % (K + 1)  # noqa: E731  rows padded with junk placeholders
    inner = Ragged(DraftModelDrafter(get_model(family, "perturbed")), sched)
    checker = StateCheckAfterCommit(inner, model, mask.sum(1).tolist())
    sd = specdec.wrap(model, drafter=checker, rollback=strategy, num_speculative_tokens=4)
    checker.sd = sd
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=14, pad_token_id=0), hf_greedy(model, ids, mask, 14))
    assert checker.checks >= 3


@pytest.mark.parametrize("K", range(1, 17))
def test_C3_every_family_every_K(family, K):
    model = get_model(family)
    ids, mask = ragged_prompts(seed=5)
    ref = hf_greedy(model, ids, mask, max_new=10)
    strategy = STRATEGIES[K % 3]
    sd = specdec.wrap(model, drafter=DraftModelDrafter(model), rollback=strategy, num_speculative_tokens=K)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(out, ref)
    cache = sd.last_cache
    for layer in cache.ssm.values():  # every place that sizes the conv window agrees on W-1+K+1
        assert layer.conv_window.shape[-1] == layer.conv_width - 1 + K + 1 == layer.conv_width + K


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_C5_snapshot_verify_restore_then_decode_one_by_one(family, strategy):
    """Verify T tokens, commit some, then feed the rest one token per step: logits equal HF's."""
    model = get_model(family)
    ad = specdec.models.adapter_for(model)
    ids, mask = ragged_prompts(seed=2)
    L = ids.shape[1]
    extra = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(3))
    full_ids = torch.cat([ids, extra], 1)
    full_mask = torch.cat([mask, torch.ones_like(extra)], 1)
    with torch.no_grad():
        ref = model(full_ids, attention_mask=full_mask).logits
    cache = ad.new_cache(3, L + 20, 5, make_strategy(strategy))
    ad.prefill(ids, mask, cache)
    ad.forward(torch.cat([extra[:, :4]], 1), cache)  # verify 4 tokens
    cache.commit(torch.tensor([2, 2, 2]))  # restore to s^(2)
    for t in range(2, 6):  # decode the remaining tokens again one by one
        logits, _ = ad.forward(extra[:, t : t + 1], cache)
        cache.commit(torch.ones(3, dtype=torch.long))
        assert rel_err(logits[:, 0], ref[:, L + t]) < 1e-4


@pytest.mark.parametrize("strategy", STRATEGIES + ("replay_deferred",))
def test_C7_fuzz_random_accept_counts_debug_mode(family, strategy, monkeypatch):
    """Hundreds of steps with random per-row commit counts in [0, T] (including 0 and all)."""
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    model = get_model(family)
    ad = specdec.models.adapter_for(model)
    rng = random.Random(zlib.crc32(f"{family}/{strategy}".encode()))  # str hash() is salted per process
    ids, mask = ragged_prompts(seed=4)
    B, K = 3, 4
    steps = 150
    cache = ad.new_cache(B, ids.shape[1] + steps * (K + 1) + 8, K + 1, make_strategy(strategy))
    ad.prefill(ids, mask, cache)
    texts = [ids[i][mask[i].bool()].tolist() for i in range(B)]
    prompt_lens = [len(t) for t in texts]
    for step in range(steps):
        T = rng.randint(1, K + 1)
        toks = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(step))
        if rng.random() < 0.3:  # a step run in two calls (as a draft model does)
            ad.forward(toks[:, :1], cache)
            if T > 1:
                ad.forward(toks[:, 1:], cache)
        else:
            ad.forward(toks, cache)
        n = [rng.choice([0, T, rng.randint(0, T)]) for _ in range(B)]
        cache.commit(torch.tensor(n))
        for i in range(B):
            texts[i] += toks[i, : n[i]].tolist()
    ref = hf_states(model, ad, texts, prompt_lens)
    for idx, (state, conv) in ref.items():
        assert rel_err(cache.ssm[idx].ssm_state(), state) < 1e-4
        W = cache.ssm[idx].conv_width
        # conv inputs are projections of the layer's input, which carries fp32 rounding from the
        # layers below: the DESIGN.md bound (rel. err. < 1e-5) applies, not bit-equality
        assert rel_err(cache.ssm[idx].conv_state(), conv[:, :, -(W - 1):]) < 1e-5


def test_C7_debug_mode_catches_out_of_range_commit(monkeypatch):
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    ad = specdec.models.adapter_for(get_model("qwen3_5"))
    ids, mask = ragged_prompts()
    cache = ad.new_cache(3, 40, 3, make_strategy("ring"))
    ad.prefill(ids, mask, cache)
    ad.forward(ids[:, :2], cache)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        cache.commit(torch.tensor([0, 3, 1]))
    with pytest.raises(IndexError, match="row 1, layer 0, step"):
        layer = next(iter(cache.ssm.values()))
        layer.strategy.commit(layer.store, layer.op, layer.params, torch.tensor([0, 3, 1]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_C11_row_finishes_at_eos_inside_accepted_drafts(strategy):
    """EOS lands among accepted drafts of one row while the others go on."""
    family = "nemotron_h"
    model = get_model(family)
    ids, mask = ragged_prompts()
    plain = hf_greedy(model, ids, mask, max_new=18)
    L = ids.shape[1]
    eos = int(plain[0, L + 5])
    ref = hf_greedy(model, ids, mask, max_new=18, eos=eos)
    sd = specdec.wrap(model, drafter=DraftModelDrafter(model), rollback=strategy, num_speculative_tokens=6)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=18, eos_token_id=[eos, VOCAB - 1], pad_token_id=0)
    assert torch.equal(out, ref)
    # the finished row's cache stops exactly at its text (EOS is its last, pending token)
    row_len = int((out[0, L:] == eos).nonzero()[0, 0]) + 1
    assert int(sd.last_cache.seq_len[0]) == L + row_len - 1


class ProposalRecorder(Drafter):
    def __init__(self, inner):
        self.inner = inner
        self.log = []

    vocab_size = property(lambda self: self.inner.vocab_size)

    def start(self, **kw):
        self.kw = kw
        self.inner.start(**kw)

    def propose(self, input_ids, lengths, K):
        d, c = self.inner.propose(input_ids, lengths, K)
        self.log.append(([input_ids[i, : int(lengths[i])].tolist() for i in range(input_ids.shape[0])], d.clone()))
        return d, c


@pytest.mark.parametrize("draft_family", ["qwen3_5", "nemotron_h", "kimi_linear"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_C12_hybrid_draft_state_rolled_back(draft_family, strategy):
    """The draft's proposals after rejections equal a fresh draft's proposals on the accepted text."""
    target = get_model(draft_family)
    draft = get_model(draft_family, "perturbed")
    rec = ProposalRecorder(DraftModelDrafter(draft, rollback=strategy))
    ids, mask = ragged_prompts()
    sd = specdec.wrap(target, drafter=rec, rollback="replay", num_speculative_tokens=4)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(out, hf_greedy(target, ids, mask))
    assert sd.last_stats.accept_histogram[0] + sum(sd.last_stats.accept_histogram[1:4]) > 0, "need rejections"
    checked = 0
    for (prev, _), (texts, drafts) in zip(rec.log, rec.log[1:]):
        live = [len(t) > len(p) for t, p in zip(texts, prev)]  # finished rows stop growing: skip them
        fresh = DraftModelDrafter(draft, rollback="snapshot")
        fresh.start(**rec.kw)
        L = max(len(t) for t in texts)
        ids2 = torch.zeros(len(texts), L, dtype=torch.long)
        for i, t in enumerate(texts):
            ids2[i, : len(t)] = torch.tensor(t)
        d2, _ = fresh.propose(ids2, torch.tensor([len(t) for t in texts]), 4)
        for i in range(len(texts)):
            if live[i]:
                assert torch.equal(d2[i], drafts[i]), f"row {i}: {d2[i].tolist()} vs {drafts[i].tolist()}"
                checked += 1
    assert checked >= 6
