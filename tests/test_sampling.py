"""Lossless rejection sampling: the marginal distribution of each of the first new tokens equals
HF sampling's (two-sample chi-square over thousands of samples, tiny vocabulary), for both
drafters, and the acceptance rule itself against the analytic distribution."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_token_distribution
from tiny_models import make_model, perturbed_copy

import specdec
from specdec.drafters import DraftModelDrafter
from specdec.verify import SamplingConfig, sample_accept

V = 8
N = 3000
POSITIONS = 3


@pytest.fixture(scope="module")
def tiny_vocab_models():
    # the small model (one Gated DeltaNet and one attention layer): every case prefills its N identical rows
    target = make_model("qwen3_5", seed=3, vocab=V, small=True)
    return target, perturbed_copy(target, scale=0.3, seed=4)


@pytest.fixture(scope="module")
def hf_samples(tiny_vocab_models):
    """HF sampling's ``N`` continuations of ``ids`` under the settings ``kw``, drawn once per settings
    (the cases with the same settings share them)."""
    target, _ = tiny_vocab_models
    drawn = {}

    def samples(ids, kw):
        key = tuple(sorted(kw.items()))
        if key not in drawn:
            drawn[key] = target.generate(ids, max_new_tokens=POSITIONS, do_sample=True, top_k=kw.get("top_k", 0),
                                         top_p=kw.get("top_p", 1.0), temperature=kw["temperature"], pad_token_id=0)
        return drawn[key]
    return samples


@pytest.mark.parametrize(
    "drafter,kw",
    [
        ("ngram", dict(temperature=1.0)),
        # (a draft model's q at T = 1 stays checked by default in test_adaptive.py::
        # test_auto_sampling_keeps_the_target_distribution[draft], and filtered by the case below)
        pytest.param("draft", dict(temperature=1.0), marks=pytest.mark.slow),
        ("draft", dict(temperature=0.7, top_k=5, top_p=0.9)),
    ],
    ids=["ngram-T1", "draft-T1", "draft-T0.7-k5-p0.9"],
)
def test_marginals_match_hf_sampling(tiny_vocab_models, hf_samples, drafter, kw):
    target, draft = tiny_vocab_models
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])  # repetitive: n-gram lookup proposes
    ids = prompt.repeat(N, 1)
    hf = hf_samples(ids, kw)
    dr = "ngram" if drafter == "ngram" else DraftModelDrafter(draft)
    sd = specdec.wrap(target, drafter=dr, rollback="replay", num_speculative_tokens=2)
    gen = torch.Generator().manual_seed(1234)
    out = sd.generate(ids, max_new_tokens=POSITIONS, do_sample=True, generator=gen, pad_token_id=0,
                      top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0), temperature=kw["temperature"])
    assert sd.last_stats.proposed_tokens > N // 4, "the drafter must actually propose"
    assert 0 < sd.last_stats.acceptance_rate < 1
    assert_same_token_distribution(hf, out, prompt.shape[1], POSITIONS, V)


def test_sample_accept_is_lossless_analytically():
    """One step, one draft from a known q: P(first token = x) must equal p(x) exactly."""
    torch.manual_seed(0)
    p_logits = torch.randn(V)
    q = torch.softmax(torch.randn(V), -1)
    M = 40000
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.expand(M, V), 1, replacement=True, generator=g)
    logits = p_logits.expand(M, 2, V).clone()
    n, c = sample_accept(logits, drafts, torch.ones(M, dtype=torch.long), SamplingConfig(), q.expand(M, 1, V), g)
    first = torch.where(n >= 1, drafts[:, 0], c)
    freq = torch.bincount(first, minlength=V).float() / M
    p = torch.softmax(p_logits, -1)
    assert torch.allclose(freq, p, atol=4 * (p * (1 - p) / M).sqrt().max().item() + 1e-3)


def test_sampling_is_reproducible_with_generator():
    target = make_model("nemotron_h", seed=0)
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    sd = specdec.wrap(target, drafter="ngram", rollback="ring", num_speculative_tokens=3)
    a = sd.generate(ids, max_new_tokens=10, do_sample=True, generator=torch.Generator().manual_seed(7), pad_token_id=0)
    b = sd.generate(ids, max_new_tokens=10, do_sample=True, generator=torch.Generator().manual_seed(7), pad_token_id=0)
    assert torch.equal(a, b)
