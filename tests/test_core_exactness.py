"""Greedy speculative output == HF greedy generate, token for token (fp32), for every family,
drafter, strategy and K; and the committed SSM / conv state equals the state of the accepted
tokens alone after every commit."""

from __future__ import annotations

import pytest
import torch
from helpers import ALL_STRATEGIES, MAX_NEW, GrowingHFStates, hf_greedy, make_drafter, reference, rel_err
from tiny_models import VOCAB, get_model, ragged_prompts

import specdec
from specdec.drafters import DraftModelDrafter, Drafter
from specdec.rollback import STRATEGIES


# K = 1 and 4 in the default run (every K up to 16 per family: test_commit_edge_cases); -m slow adds 2 and 8
@pytest.mark.parametrize("K", [1, pytest.param(2, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("drafter", ["ngram", "perturbed", "small"])
def test_greedy_exact_vs_hf(family, drafter, strategy, K):
    ids, mask, eos, ref = reference(family)
    sd = specdec.wrap(get_model(family), drafter=make_drafter(drafter, family), rollback=strategy, num_speculative_tokens=K)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert out.shape == ref.shape
    assert torch.equal(out, ref), f"\n{out[:, ids.shape[1]:]}\n{ref[:, ids.shape[1]:]}"
    st = sd.last_stats
    assert st.steps > 0 and 1.0 <= st.mean_accepted_tokens <= K + 1
    assert sum(st.accept_histogram) > 0 and len(st.accept_histogram) == K + 1
    gen = ref[:, ids.shape[1]:]
    expected = sum(int((row == eos).nonzero()[0, 0]) + 1 if bool((row == eos).any()) else row.numel() for row in gen)
    assert st.new_tokens == expected


def test_deferred_replay_exact(family):
    ids, mask, eos, ref = reference(family)
    sd = specdec.wrap(get_model(family), drafter=make_drafter("perturbed", family), rollback="replay_deferred",
                      num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------------------------
# state after every commit == state of only the accepted tokens (HF's own forward as reference)


class StateChecker(Drafter):
    """Wraps a drafter; before each proposal compares the target cache with HF's reference."""

    def __init__(self, inner, model):
        self.inner = specdec.drafters.make_drafter(inner)
        self.model = model
        self.sd = None
        self.checks = 0
        self.worst = 0.0
        self.prompt_lens = None
        self.reference = None

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def start(self, **kw):
        self.inner.start(**kw)

    def draft_probs(self):
        return self.inner.draft_probs()

    def propose(self, input_ids, lengths, K):
        cache = self.sd.last_cache
        texts = [input_ids[i, : int(lengths[i]) - 1].tolist() for i in range(input_ids.shape[0])]
        if self.reference is None:  # (HF's decode of each row's committed text, extended call after call)
            self.reference = GrowingHFStates(self.model, self.sd.adapter, self.prompt_lens)
        ref = self.reference(texts)
        for idx, (state, conv) in ref.items():
            layer = cache.ssm[idx]
            e1 = rel_err(layer.ssm_state(), state)
            W = layer.conv_width
            e2 = rel_err(layer.conv_state(), conv[:, :, conv.shape[-1] - (W - 1):])
            self.worst = max(self.worst, e1, e2)
            assert e1 < 1e-5 and e2 < 1e-5, f"layer {idx}: state rel err {e1:.2e}, conv {e2:.2e}"
        self.checks += 1
        return self.inner.propose(input_ids, lengths, K)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_committed_state_matches_accepted_tokens(family, strategy):
    model = get_model(family)
    ids, mask, eos, ref = reference(family)
    checker = StateChecker(DraftModelDrafter(get_model(family, "perturbed")), model)
    sd = specdec.wrap(model, drafter=checker, rollback=strategy, num_speculative_tokens=3)
    checker.sd = sd
    checker.prompt_lens = mask.sum(1).tolist()
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert torch.equal(out, hf_greedy(model, ids, mask))
    assert checker.checks >= 3


# --------------------------------------------------------------------------------------------
# scripted drafters: all accepted, first rejected, alternating accept-some / propose-none


class Scripted(Drafter):
    """Proposes from the known greedy continuation ``ref`` (left-justified texts)."""

    def __init__(self, ref_texts, mode):
        self.ref = ref_texts  # list of full token lists per row
        self.mode = mode
        self.calls = 0

    def propose(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        drafts = torch.zeros(B, K, dtype=torch.long)
        counts = torch.zeros(B, dtype=torch.long)
        for i in range(B):
            L = int(lengths[i])
            nxt = self.ref[i][L : L + K]
            nxt = nxt + [3] * (K - len(nxt))
            d = torch.tensor(nxt)
            if self.mode == "all":
                counts[i] = K
            elif self.mode == "first_rejected":
                d[0] = (d[0] + 1 - 3) % (VOCAB - 3) + 3
                counts[i] = K
            elif self.mode == "alternate":
                if self.calls % 2 == 0:
                    k = 1 + (i + self.calls) % K
                    d[k - 1 :] = (d[k - 1 :] + 1 - 3) % (VOCAB - 3) + 3  # accept k-1, then a wrong one
                    counts[i] = k
                else:
                    counts[i] = 0
            drafts[i] = d
        self.calls += 1
        return drafts, counts


@pytest.mark.parametrize("mode", ["all", "first_rejected", "alternate"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scripted_drafters_exact(family, mode, strategy):
    model = get_model(family)
    ids, mask = ragged_prompts(repeat=False)
    ref = hf_greedy(model, ids, mask, max_new=20)
    L = ids.shape[1]
    texts = [ids[i][mask[i].bool()].tolist() + ref[i, L:].tolist() for i in range(ids.shape[0])]
    K = 4
    sd = specdec.wrap(model, drafter=Scripted(texts, mode), rollback=strategy, num_speculative_tokens=K)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
    assert torch.equal(out, ref)
    st = sd.last_stats
    if mode == "all":
        assert st.acceptance_rate == 1.0 and st.mean_accepted_tokens > K  # last step may be truncated
    if mode == "first_rejected":
        assert st.accepted_tokens == 0 and st.mean_accepted_tokens == 1.0
    if mode == "alternate":
        assert st.accept_histogram[0] > 0 and st.proposed_tokens > st.accepted_tokens > 0
