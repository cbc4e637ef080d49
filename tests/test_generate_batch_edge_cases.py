"""Edge cases of continuous batching: ``last_stats`` of a ``generate_batch`` call with nothing
to decode, a manager's automatic request ids next to ids a caller chose, and its requests' timings;
``generate()`` with a budget per row (the engine's per-row budgets) and returned scores, a minimum
length, a streamer, or budgets of a type it does not take."""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch
from helpers import hf_greedy
from helpers import StreamRecorder
from tiny_models import VOCAB, get_model, ragged_prompts

import specdec
from specdec.batching import Request, RequestPool, RequestStatus, RequestTiming

FAMILY = "qwen3_5"


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, VOCAB, (16,), generator=g).tolist()
    return [base[:8], base[:5], base[:11]]


def _alone(model, prompt, budget) -> list[int]:
    return hf_greedy(model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                     budget)[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["zero_budgets", "all_failed"])
def test_last_stats_of_a_call_with_nothing_to_decode(case):
    """A generate_batch call whose requests all have a budget of 0 (or all fail) describes itself in
    last_stats (no steps, no tokens, its pool's rows), not the previous call."""
    sd = specdec.wrap(get_model(FAMILY), num_speculative_tokens=3)
    prompts = _prompts()
    sd.generate_batch(prompts, max_new_tokens=4, max_batch_size=2)
    assert sd.last_stats.new_tokens == 4 * len(prompts)
    if case == "zero_budgets":
        out = sd.generate_batch(prompts, max_new_tokens=0, max_batch_size=2)
        assert all(o.status == RequestStatus.FINISHED and o.generated_tokens == [] for o in out.values())
    else:
        out = sd.generate_batch([[], [VOCAB + 1]], max_new_tokens=4)
        assert all(o.status == RequestStatus.FAILED for o in out.values())
    st = sd.last_stats
    assert st is not None and st.steps == 0 and st.new_tokens == 0 and st.proposed_tokens == 0
    assert st.accept_histogram == [0] * 4 and st.k_per_step == [] and st.rollback == "none"
    assert sd.last_request_timings == {}


def test_manager_automatic_ids_skip_ids_a_caller_chose():
    """A caller names a request ``req_1``; unnamed requests added while it is in flight get ids
    that are free (not an error telling the caller to choose ids they did not give), and every
    request is exact."""
    model = get_model(FAMILY)
    prompts = _prompts()
    sd = specdec.wrap(model, num_speculative_tokens=3)
    m = sd.init_continuous_batching(max_length=24, max_batch_size=2, max_new_tokens=5)
    named = m.add_request(prompts[0], request_id="req_1")
    first = m.add_request(prompts[1])
    rest = m.add_requests([prompts[2], prompts[1]])
    ids = [named, first, *rest]
    assert named == "req_1" and len(set(ids)) == len(ids)
    with m:
        out = {i: m.get_result(i, timeout=60) for i in ids}
    for rid, prompt in zip(ids, [prompts[0], prompts[1], prompts[2], prompts[1]]):
        assert out[rid].status == RequestStatus.FINISHED and out[rid].generated_tokens == _alone(model, prompt, 5)


def test_manager_created_time_is_when_a_request_was_added():
    """HF's ``created_time`` is when a request was created: a manager's result carries the time of
    its ``add_request``, so requests that waited for the one row show the wait (created before
    admitted, admitted in turn), not their admission time."""
    model = get_model(FAMILY)
    prompts = _prompts()
    sd = specdec.wrap(model, num_speculative_tokens=3)
    m = sd.init_continuous_batching(max_length=24, max_batch_size=1, max_new_tokens=5)
    before = time.perf_counter()
    ids = m.add_requests(prompts)
    added = time.perf_counter()
    with m:
        out = [m.get_result(i, timeout=60) for i in ids]
    for o in out:
        assert before <= o.created_time <= added
        assert o.created_time <= o.lifespan[0] <= o.lifespan[1]
    # one row: each request is admitted after the previous one finished
    assert all(a.lifespan[1] <= b.lifespan[0] for a, b in zip(out, out[1:]))


def _live_timings() -> int:
    return sum(type(o) is RequestTiming for o in gc.get_objects())


def test_manager_keeps_no_timings_of_delivered_requests():
    """A manager's loop runs for as long as it serves: the times of a request whose result was
    delivered are in its output (``created_time``, ``lifespan``), and the open pool does not keep
    them (memory would grow with every request served)."""
    prompts = _prompts() * 4
    sd = specdec.wrap(get_model(FAMILY), num_speculative_tokens=3)
    m = sd.init_continuous_batching(max_length=24, max_batch_size=2, max_new_tokens=3)
    with m:
        before = _live_timings()
        out = [m.get_result(i, timeout=60) for i in m.add_requests(prompts)]
        assert all(o.status == RequestStatus.FINISHED for o in out)
        gc.collect()
        assert _live_timings() - before <= m.max_batch_size


def test_generate_budget_per_row_with_scores_min_length_and_streamer():
    """max_new_tokens per row with return_dict_in_generate / output_scores: each row's tokens and
    its scores up to its budget are HF's for that row alone with its budget; with min_new_tokens
    (an EOS that would end row 0 early) too; a batch of one streams its tokens as with an int."""
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    L, budgets = ids.shape[1], [7, 12, 3]
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=budgets, pad_token_id=0, return_dict_in_generate=True,
                      output_scores=True)
    assert out.sequences.shape == (3, L + 12) and len(out.scores) == 12
    eos = int(out.sequences[0, L + 1])
    floor = sd.generate(ids, attention_mask=mask, max_new_tokens=budgets, pad_token_id=0, eos_token_id=eos,
                        min_new_tokens=4)
    for b, n in enumerate(budgets):
        kw = dict(attention_mask=mask[b:b + 1], max_new_tokens=n, do_sample=False, pad_token_id=0)
        ref = model.generate(ids[b:b + 1], return_dict_in_generate=True, output_scores=True, **kw)
        assert out.sequences[b, L:L + n].tolist() == ref.sequences[0, L:].tolist()
        assert (out.sequences[b, L + n:] == 0).all()
        for i in range(n):
            torch.testing.assert_close(out.scores[i][b], ref.scores[i][0], rtol=1e-4, atol=1e-4)
        want = model.generate(ids[b:b + 1], eos_token_id=eos, min_new_tokens=min(4, n), **kw)[0, L:].tolist()
        assert floor[b, L:L + len(want)].tolist() == want and (floor[b, L + len(want):] == 0).all(), b
    rec = StreamRecorder()
    one = sd.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=torch.tensor([5]), pad_token_id=0, streamer=rec)
    assert sum(rec.puts, []) == one[0].tolist() and rec.ended and rec.new_tokens() == one[0, L:].tolist()


@pytest.mark.parametrize("given, error, match", [
    (torch.tensor([[4], [4], [4]]), ValueError, r"one int or one per row / request, got an array of shape \(3, 1\)"),
    (torch.tensor([4.0, 4.0, 4.0]), TypeError, "max_new_tokens per row must hold integers, got torch.float32"),
    ("4", TypeError, r"one per row \(a list of ints or a 1-D integer tensor\), got str"),
    ([[4], [4], [4]], TypeError, r"max_new_tokens\[0\] must be an int, got list"),
    ([4, True, 4], TypeError, r"max_new_tokens\[1\] must be an int, got bool"),
])
def test_generate_budget_per_row_of_a_wrong_type(given, error, match):
    """Budgets of a type generate() does not take: the error says what it takes (an int, or one
    per row), not only that an int was expected. (A 0-d tensor or a NumPy integer is an int:
    test_generate_args.)"""
    ids, mask = ragged_prompts()
    sd = specdec.wrap(get_model(FAMILY), num_speculative_tokens=2)
    with pytest.raises(error, match=match):
        sd.generate(ids, attention_mask=mask, max_new_tokens=given, pad_token_id=0)


@pytest.mark.parametrize("given", [{"req_0": 3}, {3, 4}])
def test_generate_batch_budgets_of_a_wrong_type(given):
    """generate_batch's max_new_tokens of a type it does not take (a dict by request id, a set)
    is refused as a whole, saying what it takes, before any request runs."""
    sd = specdec.wrap(get_model(FAMILY), num_speculative_tokens=2)
    with pytest.raises(TypeError, match=r"max_new_tokens must be None, one int or a list of ints \(one per request, "
                                        rf"in input order\), got {type(given).__name__}"):
        sd.generate_batch([[5, 6, 7], [8, 9]], max_new_tokens=given)


@pytest.mark.parametrize("max_batch_tokens", [1, 12, 40, 16384])
def test_admissions_take_the_oldest_and_leave_no_request_behind(max_batch_tokens):
    """Admissions of a pool whose requests of mixed prompt lengths and budgets come in random
    rows, some while rows decode: each takes the oldest waiting request first, at most its limit
    and the free rows, the others only where their longest prompt + largest budget fit ``span``
    and their padded prompts ``max_batch_tokens`` (the oldest alone may exceed it); a request
    that never fits beside another still gets its turn, and every request is taken once."""
    rng = random.Random(max_batch_tokens)
    lengths = [rng.choice([1, 3, 10, 30]) for _ in range(60)]
    reqs = [Request(i, (5,) * n, rng.choice([1, 10] if n == 30 else [1, 10, 30])) for i, n in enumerate(lengths)]
    pool = RequestPool(reqs, 64, span=40, max_batch_tokens=max_batch_tokens)  # (a manager: max_length)
    seen, calls, groups = [], 0, 0
    while pool.queue:
        calls += 1
        assert calls < 1000, "a request is never admitted"
        oldest = pool.queue[0]
        rows = rng.sample(range(64), rng.randint(1, 10))  # admit_limit 8
        taken = pool.take(rows, decoding=rng.random() < 0.5)
        for row, req in zip(rows, taken):
            assert pool.slots[row] is req
            pool.slots[row] = None
        if not taken:
            continue
        assert taken[0] is oldest and len(taken) <= min(len(rows), pool.admit_limit)
        width = max(len(r.prompt) for r in taken)
        assert len(taken) == 1 or (width + max(r.max_new_tokens for r in taken) <= pool.span
                                   and len(taken) * width <= max_batch_tokens)
        seen += [r.index for r in taken]
        groups += len(taken) > 1
    assert sorted(seen) == list(range(len(reqs)))
    assert groups > 0 or max_batch_tokens == 1
