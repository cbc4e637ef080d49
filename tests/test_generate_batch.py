"""Continuous batching (``SpeculativeGenerator.generate_batch``): with more requests than rows,
rows refilled between steps, every request's tokens equal HF greedy ``generate`` on its prompt
alone (fp32); failed requests leave the others intact; bad arguments raise before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import hf_greedy, record_prompt_forwards
from markers import needs_triton_interpreter
from tiny_models import FAMILIES, VOCAB, get_model

import specdec
from specdec.adaptive import FixedCosts
from specdec.batching import RequestStatus
from specdec.drafters import Drafter
from specdec.rollback import STRATEGIES, InPlaceUpdate, make_strategy

#: (prompt length, budget) of each request: more requests than rows, of different lengths and budgets
SHAPES = [(9, 12), (4, 7), (13, 10), (6, 1), (11, 14), (5, 9), (8, 6)]
ROWS = 3


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts of :data:`SHAPES`' lengths (ids >= 3), each repeating its first half (n-gram matches)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, _ in SHAPES:
        row = torch.randint(3, VOCAB, (n,), generator=g)
        half = n // 2
        row[n - half:] = row[:half]
        out.append(row.tolist())
    return out


def _alone(model, prompt, budget, eos):
    """HF greedy new tokens of ``prompt`` alone, up to and including the first EOS."""
    ids = torch.tensor([prompt], device=model.device)
    new = hf_greedy(model, ids, torch.ones_like(ids), budget, eos=eos)[0, len(prompt):].tolist()
    return new[:new.index(eos) + 1] if eos in new else new


_REF: dict = {}


def _reference(family):
    """``(prompts, budgets, eos, expected, full)``: eos is request 0's 6th greedy token, so that
    request 0 stops inside a step (the oracle drafter, which drafts ``full``, the greedy text
    without EOS, accepts its new tokens 4..7 in one step) and the others run on."""
    if family not in _REF:
        model = get_model(family)
        prompts, budgets = _prompts(), [b for _, b in SHAPES]
        eos = _alone(model, prompts[0], 6, None)[5]
        expected = [_alone(model, p, b, eos) for p, b in zip(prompts, budgets)]
        full = [p + _alone(model, p, b, None) for p, b in zip(prompts, budgets)]
        assert sum(len(e) < b for e, b in zip(expected, budgets)) < len(SHAPES) - 1, "EOS must not stop most requests"
        _REF[family] = (prompts, budgets, eos, expected, full)
    return _REF[family]


class TextOracle(Drafter):
    """A stateless drafter: looks up each row's text among known sequences (prompt + expected new
    tokens) and proposes what follows, every third position corrupted (partial acceptance)."""

    stateless = True

    def __init__(self, sequences):
        self.sequences = [list(s) for s in sequences]

    def propose(self, input_ids, lengths, K):
        drafts = torch.zeros(input_ids.shape[0], K, dtype=torch.long)
        counts = torch.zeros(input_ids.shape[0], dtype=torch.long)
        for i, L in enumerate(lengths.tolist()):
            text = input_ids[i, :L].tolist()
            for seq in self.sequences:
                if seq[:L] == text:
                    nxt = seq[L:L + K]
                    drafts[i, :len(nxt)] = torch.tensor(nxt, dtype=torch.long)
                    for j in range(len(nxt)):
                        if (L + j) % 6 == 0:
                            drafts[i, j] = (drafts[i, j] + 1) % VOCAB
                    counts[i] = len(nxt)
                    break
        return drafts, counts


class RequestOracle(Drafter):
    """A drafter with per-row state: :meth:`admit` tells it which request each row holds; it
    proposes that request's known continuation, every third position corrupted."""

    def __init__(self, sequences):
        self.sequences = [list(s) for s in sequences]
        self.admitted = []

    def start(self, *, target_vocab_size, batch_size, device, sampling=None, generator=None, max_length=None):
        self.held = [None] * batch_size

    def admit(self, rows, input_ids, attention_mask, hidden_states, requests):
        assert hidden_states is None and len(requests) == rows.numel() == input_ids.shape[0]
        for row, req, ids, m in zip(rows.tolist(), requests, input_ids.tolist(), attention_mask.tolist()):
            assert [t for t, keep in zip(ids, m) if keep] == list(req.prompt)
            self.held[row] = self.sequences[req.index]
            self.admitted.append(req.index)

    def propose(self, input_ids, lengths, K):
        drafts = torch.zeros(input_ids.shape[0], K, dtype=torch.long)
        counts = torch.zeros(input_ids.shape[0], dtype=torch.long)
        for i, L in enumerate(lengths.tolist()):
            seq = self.held[i]
            assert seq[:L] == input_ids[i, :L].tolist(), "a row's text is not its admitted request's"
            nxt = seq[L:L + K]
            drafts[i, :len(nxt)] = torch.tensor(nxt, dtype=torch.long)
            drafts[i, 2::3] = (drafts[i, 2::3] + 1) % VOCAB
            counts[i] = len(nxt)
        return drafts, counts


def _check(out, expected, prompts):
    assert list(out) == [f"req_{i}" for i in range(len(expected))]
    for i, (p, e) in enumerate(zip(prompts, expected)):
        o = out[f"req_{i}"]
        assert o.request_id == f"req_{i}" and o.status == RequestStatus.FINISHED and o.error is None
        assert o.prompt_ids == p
        assert o.generated_tokens == e, f"req_{i}: {o.generated_tokens} != {e}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_generate_alone(family, strategy):
    """Oracle drafts (EOS inside an accepted chain) and n-gram drafts, eager path: every request
    equals HF greedy on its prompt alone; the stats count every request's tokens."""
    prompts, budgets, eos, expected, full = _reference(family)
    model = get_model(family)
    oracle = TextOracle(full)
    for drafter in (oracle, "ngram"):
        sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=4, decode_path="eager")
        out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS)
        _check(out, expected, prompts)
        st = sd.last_stats
        assert st.new_tokens == sum(len(e) for e in expected)
        if drafter is oracle:
            assert st.accept_histogram[4] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_admit_per_row_state(family):
    """A drafter with per-row state gets every request through Drafter.admit (the first ones
    too), with its row and prompt; exact; a per-row drafter without admit is refused."""
    prompts, budgets, eos, expected, full = _reference(family)
    model = get_model(family)
    oracle = RequestOracle(full)
    sd = specdec.wrap(model, drafter=oracle, rollback="replay", num_speculative_tokens=3, decode_path="eager")
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS), expected,
           prompts)
    # every request once; the oldest first (the first admission fills the rows, by like lengths)
    assert sorted(oracle.admitted) == list(range(len(prompts))) and oracle.admitted[0] == 0
    assert sd.last_stats.accepted_tokens > 0

    class NoAdmit(Drafter):
        def propose(self, input_ids, lengths, K):
            return torch.zeros(input_ids.shape[0], K, dtype=torch.long), torch.zeros(input_ids.shape[0])

    with pytest.raises(ValueError, match="NoAdmit: it keeps per-row state and does not define Drafter.admit"):
        specdec.wrap(model, drafter=NoAdmit(), num_speculative_tokens=2).generate_batch(prompts)


@pytest.mark.parametrize("family, strategy", [("qwen3_5", "snapshot"), ("nemotron_h", "ring"),
                                              ("kimi_linear", "replay"), ("qwen3_next", "replay_deferred")])
def test_static_path_across_admissions(family, strategy):
    """The static path (fixed shapes: the pool's bucket) stays exact across admissions, and a
    second call reuses the bucket's buffers (rows reset in place)."""
    prompts, budgets, eos, expected, full = _reference(family)
    sd = specdec.wrap(get_model(family), rollback=strategy, num_speculative_tokens=3, decode_path="static")
    for _ in range(2):
        out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS)
        _check(out, expected, prompts)
        assert sd.last_stats.decode_path == "static"
    assert len(sd._static) == 1


def test_auto_speculation_and_rollback():
    """num_speculative_tokens="auto" and rollback="auto" through the same loop: exact, K varies per
    step, the strategy is one of STRATEGIES."""
    family = "qwen3_5"
    prompts, budgets, eos, expected, full = _reference(family)
    sd = specdec.wrap(get_model(family), drafter=TextOracle(full), rollback="auto", num_speculative_tokens="auto",
                      max_speculative_tokens=4, decode_path="eager",
                      cost_model=FixedCosts(lambda strategy, batch, K: 1.0 + 0.2 * K + 0.1 * (strategy == "replay")))
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS), expected,
           prompts)
    st = sd.last_stats
    assert st.rollback in STRATEGIES and st.rollback_reason and max(st.k_per_step) > 0
    assert st.new_tokens == sum(len(e) for e in expected)


def test_admission_waits_for_a_group():
    """While rows decode, free rows take requests in groups of admit_limit (or the rest of the
    queue), or after MAX_WAITING_STEPS steps of waiting; with no row decoding at once."""
    from specdec.batching import MAX_WAITING_STEPS, Request, RequestPool

    pool = RequestPool([Request(i, (5, 6), 4) for i in range(5)], 16)
    assert pool.admit_limit == 2
    for _ in range(MAX_WAITING_STEPS):
        assert pool.take([3], decoding=True) == [] and len(pool.queue) == 5
    assert [r.index for r in pool.take([3], decoding=True)] == [0]  # waited long enough
    assert pool.take([4], decoding=True) == []
    assert [r.index for r in pool.take([4, 5], decoding=True)] == [1, 2]  # a full group
    assert [r.index for r in pool.take([6], decoding=False)] == [3]  # nothing decodes: at once
    assert [r.index for r in pool.take([7], decoding=True)] == [4]  # the whole (short) queue


def test_admission_bounded_by_batch_tokens():
    """An admission takes requests while their prompts, left-padded to one width, hold at most
    max_batch_tokens tokens; a longer prompt alone; the first requests of a pool too."""
    from specdec.batching import Request, RequestPool

    reqs = [Request(0, (5,) * 4, 2), Request(1, (5,) * 6, 2), Request(2, (5,) * 3, 2), Request(3, (5,) * 20, 2),
            Request(4, (5,) * 2, 2)]
    pool = RequestPool(reqs, 5, max_batch_tokens=12)
    # the oldest (4 tokens), then by closeness to its length: 3 (2 x 4 = 8), not 6 (3 x 6 > 12), 2 (3 x 4 = 12)
    assert [r.index for r in pool.take(range(5), at_most=5)] == [0, 2, 4]
    assert [r.index for r in pool.take([1, 3])] == [1]  # with 3: 2 x 20 > 12
    assert [r.index for r in pool.take([3])] == [3] and not pool.queue  # 20 > 12: alone
    # while rows decode, free rows do not wait for a group that would not fit in one admission
    pool = RequestPool([Request(i, (5,) * 10, 2) for i in range(4)], 16, max_batch_tokens=12)
    assert pool.admit_limit == 2 and [r.index for r in pool.take([0], decoding=True)] == [0]


def test_admission_groups_like_lengths():
    """An admission takes the oldest request, then those of the next ADMISSION_LOOKAHEAD x its
    limit whose prompt lengths are closest to its (ties in queue order), so a group pads little;
    the oldest is never passed over; requests beyond the window wait."""
    from specdec.batching import ADMISSION_LOOKAHEAD, Request, RequestPool

    lengths = [10, 40, 11, 9, 38, 12, 41, 10, 10, 10]
    pool = RequestPool([Request(i, (5,) * n, 2) for i, n in enumerate(lengths)], 16)  # admit_limit 2
    assert ADMISSION_LOOKAHEAD * pool.admit_limit == 8  # the window: requests 0..7
    assert [r.index for r in pool.take([0, 1])] == [0, 7]  # 10: the next 10 in the window (7), not 11 (2)
    assert [r.index for r in pool.take([2, 3])] == [1, 6]  # the oldest is now 40: 41 is closest
    assert [r.index for r in pool.take([4, 5])] == [2, 5]  # 11, then 12 (the 10s are as close, later in the queue)
    assert [len(r.prompt) for r in pool.take([6, 7, 8])] == [9, 10]


def test_group_admissions_exact():
    """A pool whose admissions wait for groups (9 rows: groups of 2) gives every request the
    tokens it gets alone."""
    model = get_model("qwen3_5")
    g = torch.Generator().manual_seed(3)
    lengths, budgets = torch.randint(3, 12, (20,), generator=g).tolist(), torch.randint(1, 16, (20,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    expected = [_alone(model, p, b, None) for p, b in zip(prompts, budgets)]
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, max_batch_size=9), expected, prompts)
    assert sd.last_stats.new_tokens == sum(budgets)
    # prefill forwards of at most 12 tokens: mostly one request each, the first ones too
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, max_batch_size=9, max_batch_tokens=12), expected,
           prompts)
    # the call's max_batch_tokens bounds its forwards, not the wrapper's (restored after the call)
    shapes = record_prompt_forwards(sd)
    sd.max_batch_tokens = 4
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, max_batch_size=9, max_batch_tokens=40), expected,
           prompts)
    assert 4 < max(r * t for r, t in shapes) <= 40 and sd.max_batch_tokens == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_long_prompts_prefill_in_chunks_exact(family):
    """Prompts longer than max_batch_tokens are prefilled a chunk per step while the other rows
    decode (and all at once when nothing decodes): every request gets the tokens it gets alone;
    each chunk is one forward of at most max_batch_tokens tokens."""
    model = get_model(family)
    g = torch.Generator().manual_seed(5)
    lengths = [30, 4, 41, 6, 5, 23, 3]
    budgets = [5, 12, 7, 9, 3, 6, 10]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    expected = [_alone(model, p, b, None) for p, b in zip(prompts, budgets)]
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")
    shapes = record_prompt_forwards(sd)
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, max_batch_size=3, max_batch_tokens=8), expected, prompts)
    forwards = [r * t for r, t in shapes]
    assert max(forwards) <= 8 and len(forwards) >= sum(-(-n // 8) for n in lengths if n > 8) + 1
    assert sd.last_stats.new_tokens == sum(budgets)


def test_long_prompt_chunks_with_mtp():
    """The MTP drafter gets every position's hidden state of a prompt prefilled in chunks."""
    from test_generate_batch_drafters import mtp_target
    from specdec.drafters import MTPDrafter

    family = "qwen3_5"
    prompts, budgets, eos, expected, _ = _reference(family)
    target, layers = mtp_target(family)
    sd = specdec.wrap(target, drafter=MTPDrafter(target, layers), rollback="snapshot", num_speculative_tokens=3,
                      decode_path="eager")
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS,
                             max_batch_tokens=max(1, max(len(p) for p in prompts) // 3)), expected, prompts)
    assert sd.last_stats.accepted_tokens > 0


def test_plain_decoding_and_one_row():
    """K = 0 (the in-place strategy) on the static path, and a pool of one row (every request alone)."""
    family = "nemotron_h"
    prompts, budgets, eos, expected, full = _reference(family)
    for K, rows, path in ((0, ROWS, "static"), (2, 1, "eager")):
        sd = specdec.wrap(get_model(family), num_speculative_tokens=K, decode_path=path)
        _check(sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=rows), expected,
               prompts)


def test_sampling_path():
    """Sampling runs through the pool (the first token of each admitted row is sampled from its
    prefill logits, drafts by rejection sampling): with top_k=1 it is greedy decoding."""
    family = "kimi_linear"
    prompts, budgets, eos, expected, full = _reference(family)
    sd = specdec.wrap(get_model(family), num_speculative_tokens=3)
    out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS, do_sample=True,
                            top_k=1)
    _check(out, expected, prompts)
    # a generator makes sampling reproducible; another seed samples other tokens
    runs = [sd.generate_batch(prompts, max_new_tokens=budgets, max_batch_size=ROWS, do_sample=True,
                              generator=torch.Generator().manual_seed(seed)) for seed in (1, 1, 2)]
    tokens = [[o.generated_tokens for o in r.values()] for r in runs]
    assert tokens[0] == tokens[1] != tokens[2]
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        sd.generate_batch(prompts, max_new_tokens=2, do_sample=True, generator=1)


@needs_triton_interpreter
def test_triton_backend(monkeypatch):
    """The fused kernels stay exact across admissions: eager replay, whose committed history is
    folded inside the next verify (so an admitted slot's history length must restart); here
    through Triton's CPU interpreter."""
    family, strategy = "nemotron_h", "replay"
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    prompts, budgets, eos, expected, full = _reference(family)
    sd = specdec.wrap(get_model(family), drafter=TextOracle(full), rollback=strategy, num_speculative_tokens=3,
                      decode_path="eager")
    _check(sd.generate_batch(prompts[:5], max_new_tokens=budgets[:5], eos_token_id=eos, max_batch_size=2),
           expected[:5], prompts[:5])
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values())


def test_failed_requests_leave_others_intact():
    """An empty prompt, out-of-vocabulary ids and a prompt + budget beyond max_position_embeddings
    fail alone (status FAILED, error says why); a zero budget finishes with no tokens."""
    family = "qwen3_5"
    prompts, budgets, eos, expected, full = _reference(family)
    model = get_model(family)
    limit = model.config.max_position_embeddings
    bad = [[], [5, VOCAB, 7, -1], list(range(3, 13))]
    inputs = [prompts[0], bad[0], prompts[1], bad[1], bad[2], prompts[2], prompts[3]]
    budget = [budgets[0], 4, budgets[1], 4, limit, budgets[2], 0]
    sd = specdec.wrap(model, num_speculative_tokens=3)
    out = sd.generate_batch(inputs, max_new_tokens=budget, eos_token_id=eos, max_batch_size=2, progress_bar=True)
    assert list(out) == [f"req_{i}" for i in range(len(inputs))]
    for i, e in ((0, expected[0]), (2, expected[1]), (5, expected[2])):
        assert out[f"req_{i}"].status == RequestStatus.FINISHED and out[f"req_{i}"].generated_tokens == e
    for i, what in ((1, "empty prompt"), (3, "outside the vocabulary"), (4, "max_position_embeddings")):
        o = out[f"req_{i}"]
        assert o.status == RequestStatus.FAILED and what in o.error and o.generated_tokens == []
    assert str(VOCAB) in out["req_3"].error and "-1" in out["req_3"].error
    assert out["req_6"].status == RequestStatus.FINISHED and out["req_6"].generated_tokens == []


def test_argument_errors():
    """Bad arguments and settings not supported yet raise before any work, naming what is accepted."""
    model = get_model("qwen3_5")
    sd = specdec.wrap(model, num_speculative_tokens=2)
    ok = [[5, 6, 7]]
    cases = [
        (dict(inputs=torch.tensor([[5, 6]])), TypeError, "list of prompts"),
        (dict(inputs=[[5, "a"]]), TypeError, "req_0"),
        (dict(inputs=[[5, 6], [5.0, 6.0]]), TypeError, r"req_1: a prompt must be a list of int token ids \(or a 1-D "
                                                       r"integer tensor or NumPy array\), got a list holding float 5.0"),
        (dict(inputs=[[5, 6], np.array([5.0, 6.0])]), TypeError, "req_1: .* got a ndarray of dtype float64 holding "
                                                                 "float 5.0"),
        (dict(inputs=[[5, None]]), TypeError, "req_0: .* holding NoneType None"),
        (dict(prefix_caching=True, prefix_cache_bytes="lots"), ValueError, "prefix_cache_bytes 'lots'"),
        (dict(max_new_tokens=[3, 4]), ValueError, "one per request"),
        (dict(max_new_tokens=torch.tensor([3, 4])), ValueError, "one per request"),
        (dict(max_new_tokens=torch.ones(1, 1, dtype=torch.long)), ValueError, r"one per row / request, got an array of "
                                                                               r"shape \(1, 1\)"),
        (dict(do_sample="no"), TypeError, "do_sample must be True or False"),
        (dict(max_new_tokens=-1), ValueError, ">= 0"),
        (dict(max_batch_size="big"), ValueError, "'auto'"),
        (dict(max_batch_size=0), ValueError, ">= 1"),
        (dict(prefix_caching=True, prefix_block_size=0), ValueError, "prefix_block_size"),
        (dict(max_batch_tokens=0), ValueError, "max_batch_tokens must be >= 1"),
        (dict(max_batch_tokens=2.5), TypeError, "max_batch_tokens must be an int"),
        (dict(max_length=10), ValueError, "max_new_tokens"),
        (dict(repetition_penalty=1.2), ValueError, "repetition_penalty"),
        (dict(num_beams=2), ValueError, r"num_beams=2 \(from the call's arguments\): specdec's generate_batch\(\) "
                                        r"supports max_new_tokens, do_sample"),
        (dict(num_beams=True), ValueError, r"num_beams=True"),  # (not 1: a bool is not a count)
        (dict(bad_words_ids=True), ValueError, r"bad_words_ids=True"),
        (dict(progress_bar="no"), TypeError, "progress_bar must be a bool"),
        (dict(forced_eos_token_id=0), ValueError, "forced_eos_token_id=0"),  # (a token id: 0 acts)
        (dict(min_p=1.0), ValueError, r"min_p=1.0"),
        (dict(guidance_scale=0), ValueError, r"guidance_scale=0"),  # (transformers guides at any scale but 1)
        (dict(top_h=1.0), ValueError, r"top_h=1.0"),
        (dict(inputs=[np.int64(5), np.int64(6)]), TypeError, "req_0: a prompt must be a list of int token ids"),
        (dict(inputs=[torch.tensor([[5, 6]])]), TypeError, "or a 1-D integer tensor or NumPy array.*got Tensor of 2 dims"),
        (dict(beams=2), ValueError, r"unsupported generate_batch\(\) argument\(s\): \['beams'\]; supported: "
                                    r"generate_batch\(\)'s own parameters"),
    ]
    for kw, err, match in cases:
        kw = {"inputs": ok, "max_new_tokens": 3, **kw}
        with pytest.raises(err, match=match):
            sd.generate_batch(kw.pop("inputs"), **kw)
    with pytest.raises(ValueError) as err:  # (what it lists is what it takes)
        sd.generate_batch(ok, max_new_tokens=3, num_beams=2)
    assert not any(x in str(err.value) for x in ("repetition_penalty", "min_new_tokens", "max_time", "output_scores"))
    assert sd.generate_batch([]) == {}
    for off in (dict(no_repeat_ngram_size=False), dict(min_p=0.0), dict(bad_words_ids=[]),
                dict(guidance_scale=1.0)):  # (these leave it off)
        assert len(sd.generate_batch(ok, max_new_tokens=3, **off)["req_0"].generated_tokens) == 3, off
    # a generation_config's max_length is refused as the keyword is, where it sets the budget
    from transformers import GenerationConfig

    for call in (lambda gc: sd.generate_batch(ok, generation_config=gc),
                 lambda gc: sd.init_continuous_batching(gc, max_length=16)):
        with pytest.raises(ValueError, match="the generation_config passed sets max_length=9 and no max_new_tokens"):
            call(GenerationConfig(max_length=9))
    assert len(sd.generate_batch(ok, generation_config=GenerationConfig(max_length=9, max_new_tokens=2))["req_0"]
               .generated_tokens) == 2  # (max_new_tokens wins, as in generate())
    with pytest.raises(ValueError, match=r"must be in \[0, max_length - 1 = 15\]"):
        sd.init_continuous_batching(max_length=16, max_new_tokens=100)
    # settings the model's generation_config holds: the error says where they come from
    saved = model.generation_config
    try:
        model.generation_config = GenerationConfig(repetition_penalty=1.05)
        with pytest.raises(ValueError, match=r"model.generation_config.repetition_penalty = 1.0"):
            sd.generate_batch(ok, max_new_tokens=3)
        assert len(sd.generate_batch(ok, max_new_tokens=3, repetition_penalty=1.0)["req_0"].generated_tokens) == 3
        model.generation_config = GenerationConfig(num_beams=2)
        with pytest.raises(ValueError, match=r"num_beams=2 \(from the model's generation_config: clear it there, "
                                             r"model.generation_config.num_beams = 1\)"):
            sd.generate_batch(ok, max_new_tokens=3)
        model.generation_config.num_beams = 1  # (what the message says)
        assert len(sd.generate_batch(ok, max_new_tokens=3)["req_0"].generated_tokens) == 3
    finally:
        model.generation_config = saved
    # a prompt as a NumPy array, as a list gives it
    want = sd.generate_batch([[5, 6, 7]], max_new_tokens=3)["req_0"].generated_tokens
    assert sd.generate_batch([np.array([5, 6, 7])], max_new_tokens=3)["req_0"].generated_tokens == want
    # budgets as a tensor or NumPy array: one per request, as a list gives them
    prompts = [[5, 6, 7], [8, 9]]
    want = sd.generate_batch(prompts, max_new_tokens=[2, 4])
    for budgets in (torch.tensor([2, 4]), np.array([2, 4])):
        got = sd.generate_batch(prompts, max_new_tokens=budgets)
        assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in want.values()]
    assert [len(o.generated_tokens) for o in want.values()] == [2, 4]
    # a cache size without the cache: said, not silently dropped; with a fixed K and strategy
    # nothing is calibrated
    with pytest.warns(UserWarning, match="prefix_block_size=16 has no effect without prefix_caching=True"):
        sd.generate_batch(prompts, max_new_tokens=2, prefix_block_size=16)
    assert sd.last_stats.calibration_s == 0.0
    with pytest.warns(UserWarning, match="memory_budget='1KiB' has no effect without max_batch_size"):
        sd.generate_batch(prompts, max_new_tokens=2, memory_budget="1KiB")
    # the cache's bound as a size, as memory_budget takes one
    want = sd.generate_batch(prompts, max_new_tokens=2)
    for size in ("64MiB", "0B"):  # (0: a cache that keeps nothing)
        got = sd.generate_batch(prompts, max_new_tokens=2, prefix_caching=True, prefix_cache_bytes=size)
        assert [o.generated_tokens for o in got.values()] == [o.generated_tokens for o in want.values()]


def test_reset_rows_in_place():
    """Every built-in strategy's reset_rows writes into the store's own tensors (what a captured
    CUDA graph reads): same storage, other slots bit for bit, reset slots at the given state."""
    from helpers import random_inputs
    from specdec.kernels import get_op

    op = get_op("mamba2")
    g = torch.Generator().manual_seed(3)
    for strat in [make_strategy(n) for n in (*STRATEGIES, "replay_deferred")] + [InPlaceUpdate()]:
        T = 1 if isinstance(strat, InPlaceUpdate) else 3
        inputs, params, S = random_inputs("mamba2", T, g)
        store = strat.new_store(3, T)
        strat.load(store, torch.randn(3, *S, generator=g))
        strat.verify(store, op, inputs, params)
        strat.commit(store, op, params, torch.tensor([T, 1, T]))
        ptrs = {k: v.data_ptr() for k, v in store.tensors.items() if isinstance(v, torch.Tensor)}
        before = strat.state(store, op, params).clone()
        new = torch.randn(1, *S, generator=g)
        strat.reset_rows(store, op, params, torch.tensor([1]), new)
        assert {k: v.data_ptr() for k, v in store.tensors.items() if isinstance(v, torch.Tensor)} == ptrs
        after = strat.state(store, op, params)
        assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2]) and torch.equal(after[1], new[0])
        strat.verify(store, op, inputs, params)
        with pytest.raises(ValueError, match="open step"):
            strat.reset_rows(store, op, params, torch.tensor([1]))
