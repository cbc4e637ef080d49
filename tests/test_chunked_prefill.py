"""Prompts longer than ``max_batch_tokens`` prefilled in chunks, one chunk per decode step while
the other rows decode (continuous batching): every request equals HF greedy ``generate`` on its
prompt alone (fp32) for further families, drafters with per-row state, the static path, adaptive
speculation, a first token that is EOS and budgets of one; a manager stopped (hard or soft) while
a prompt is being prefilled in chunks, and requests added meanwhile."""

from __future__ import annotations

import pytest
import torch
from test_generate_batch import _alone, _check, _reference
from tiny_models import VOCAB, get_model

import specdec
from specdec.batching import RequestStatus

#: prompt lengths: longer and shorter than the chunk (:data:`CHUNK`), the longest first so that
#: its chunks run while the others decode
LENGTHS = [5, 29, 4, 23, 6]
BUDGETS = [9, 6, 12, 1, 7]
CHUNK = 8


def _prompts(seed=11, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        row = torch.randint(3, VOCAB, (n,), generator=g)
        row[n - n // 2:] = row[:n // 2]  # n-gram matches
        out.append(row.tolist())
    return out


@pytest.mark.parametrize("family", ["mamba2", "zamba2", "falcon_h1", "lfm2", "bamba"])
def test_extra_families_exact(family):
    """Further families (Mamba-2 alone, shared attention blocks, parallel attention + SSM, short
    convolutions): every request as alone, each prompt forward at most max_batch_tokens tokens."""
    model = get_model(family)
    prompts = _prompts()
    expected = [_alone(model, p, b, None) for p, b in zip(prompts, BUDGETS)]
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")
    log = _events(sd)
    _check(sd.generate_batch(prompts, max_new_tokens=BUDGETS, max_batch_size=2, max_batch_tokens=CHUNK), expected,
           prompts)
    forwards = [n for kind, n in log if kind == "prefill"]
    assert max(forwards) <= CHUNK and len(forwards) >= -(-29 // CHUNK) + -(-23 // CHUNK)


@pytest.mark.parametrize("family, kind, strategy, path", [
    ("qwen3_5", "draft_model", "snapshot", "eager"),
    ("nemotron_h", "draft_model", "replay", "static"),
    ("qwen3_5", "medusa", "replay", "eager"),
    ("nemotron_h", "medusa_tree", "snapshot", "static"),
    ("qwen3_next", "mtp", "replay", "eager"),
])
def test_drafters_exact(family, kind, strategy, path):
    """Drafters with per-row state (Drafter.admit when a chunked prefill ends), chains and
    trees, eager and static paths: every request exact, and every proposal of a row decoding a
    request equals the first proposal on that row's text alone."""
    from test_generate_batch_drafters import first_proposal_alone, run
    sd, rec, target, make = run(kind, family, strategy, path=path, max_batch_tokens=4)
    prompts, _, _, expected, _ = _reference(family)
    texts_of = [p + e for p, e in zip(prompts, expected)]
    alone, checked = make(), 0
    for texts, proposal, logits in rec.proposals:
        for row, text in enumerate(texts):
            if not any(len(p) < len(text) < len(t) and t[:len(text)] == text for p, t in zip(prompts, texts_of)):
                continue  # a finished row, or one whose prompt is being prefilled: its proposal is unused
            want, want_logits = first_proposal_alone(target, alone, text)
            assert torch.equal(proposal[row], want), (text, proposal[row], want)
            checked += 1
    assert checked >= 5


def _events(sd):
    """Log ``("prefill", tokens)`` for every prompt forward and ``("step", rows)`` for every decode /
    verify forward of ``sd``'s adapter, in order."""
    log = []
    prompt, step = sd.adapter._prompt_forward, sd.adapter.forward

    def prompt_forward(input_ids, *args, **kwargs):
        log.append(("prefill", input_ids.numel()))
        return prompt(input_ids, *args, **kwargs)

    def forward(input_ids, cache):
        log.append(("step", input_ids.shape[0]))
        return step(input_ids, cache)

    sd.adapter._prompt_forward, sd.adapter.forward = prompt_forward, forward
    return log


@pytest.mark.parametrize("family, kw", [
    ("qwen3_5", dict(drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")),
    ("nemotron_h", dict(drafter="ngram", rollback="snapshot", num_speculative_tokens=3, decode_path="static")),
    ("kimi_linear", dict(drafter="ngram", rollback="auto", num_speculative_tokens="auto", decode_path="eager")),
    ("qwen3_next", dict(num_speculative_tokens=0, decode_path="static")),
])
def test_eos_first_and_tiny_budgets(family, kw):
    """Long prompts whose first token is EOS, with a budget of one or of zero, between others: each
    request as alone; each chunk is one forward of at most max_batch_tokens tokens, and a long
    prompt's chunks run between the decode steps of the other rows."""
    model = get_model(family)
    prompts = _prompts(seed=4, lengths=[6, 31, 5, 27, 26, 30, 7, 25])
    eos = _alone(model, prompts[3], 1, None)[0]
    budgets = [14, 8, 11, 6, 1, 0, 5, 9]
    expected = [_alone(model, p, b, eos) if b else [] for p, b in zip(prompts, budgets)]
    assert expected[3] == [eos] and len(expected[4]) == 1 and expected[5] == []
    assert sum(len(e) == b for e, b in zip(expected, budgets)) >= 5, "EOS must not stop most requests"
    sd = specdec.wrap(model, **kw)
    log = _events(sd)
    out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=3,
                            max_batch_tokens=CHUNK)
    _check(out, expected, prompts)
    assert max(n for kind, n in log if kind == "prefill") <= CHUNK
    # a chunk, a decode step, the next chunk: the prompt of 31 tokens is prefilled while row 0 decodes
    chunks = [i for i, (kind, n) in enumerate(log) if kind == "prefill" and n == CHUNK]
    assert any(log[i + 1][0] == "step" and log[i + 2] == ("prefill", CHUNK) for i in chunks)
    assert sd.last_stats.new_tokens == sum(map(len, expected))


def _manager_case(family="qwen3_5"):
    """``(model, sd, manager, prompts, expected)``: two rows, one token a step (a gated drafter that
    proposes nothing, :class:`test_generate_batch_stream.Gate`, holding its 3rd call); request 0
    decodes while request 1's prompt of 40 tokens is prefilled in chunks of 6 (7 chunks, one a
    step), request 2 waits."""
    from test_generate_batch_stream import Gate

    model = get_model(family)
    prompts = _prompts(seed=8, lengths=[5, 40, 4])
    budgets = [20, 6, 5]
    expected = [_alone(model, p, b, None) for p, b in zip(prompts, budgets)]
    sd = specdec.wrap(model, drafter=Gate([], hold_at=3), rollback="replay", num_speculative_tokens=2,
                      decode_path="eager")
    m = sd.init_continuous_batching(max_length=64, max_batch_size=2, max_new_tokens=20, max_batch_tokens=6)
    ids = [m.add_request(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    return model, sd, m, ids, prompts, budgets, expected


def _loop_threads():
    from test_generate_batch_stream import _loop_threads
    return _loop_threads()


def test_manager_hard_stop_during_chunked_prefill():
    """stop(hard_stop=True) while a long prompt is between its chunks: that request comes back
    FAILED with no tokens (it had none), the decoding one FAILED with a prefix of its text alone,
    the waiting one FAILED with none; nothing hangs, no thread is left, and the manager runs again."""
    model, sd, m, ids, prompts, budgets, expected = _manager_case()
    log = _events(sd)
    m.start()
    assert sd.drafter.entered.wait(30)
    assert sum(1 for kind, n in log if kind == "prefill" and n == 6) == 3  # 3 of the 7 chunks, 4 left
    m.stop(block=False, hard_stop=True)
    sd.drafter.gate.set()
    m.stop(block=True, timeout=60)
    assert not m.is_running() and not _loop_threads()
    out = {o.request_id: o for o in m}
    assert sorted(out) == sorted(ids)
    assert all(o.status == RequestStatus.FAILED and "hard_stop=True" in o.error for o in out.values())
    assert 0 < len(out[ids[0]].generated_tokens) < budgets[0]
    assert out[ids[0]].generated_tokens == expected[0][:len(out[ids[0]].generated_tokens)]
    assert out[ids[1]].generated_tokens == [] and out[ids[2]].generated_tokens == []
    assert sum(1 for kind, n in log if kind == "prefill" and n == 6) == 3  # no chunk after the stop
    with m:
        again = m.add_request(prompts[1], max_new_tokens=budgets[1])
        assert m.get_result(again, timeout=60).generated_tokens == expected[1]


def test_manager_requests_added_during_chunked_prefill():
    """Requests added while a long prompt is prefilled in chunks, then stop() (which finishes
    everything added before it): every request ends with its text alone."""
    model, sd, m, ids, prompts, budgets, expected = _manager_case()
    m.start()
    assert sd.drafter.entered.wait(30)
    more = _prompts(seed=9, lengths=[9, 3, 17])
    later = [m.add_request(p, max_new_tokens=4) for p in more]
    m.stop(block=False)
    sd.drafter.gate.set()
    m.stop(block=True, timeout=60)
    assert not _loop_threads()
    out = {o.request_id: o for o in m}
    assert sorted(out) == sorted(ids + later)
    for rid, p, e in zip(ids + later, prompts + more, expected + [_alone(model, p, 4, None) for p in more]):
        assert out[rid].status == RequestStatus.FINISHED and out[rid].generated_tokens == e, rid


def test_manager_hard_stop_while_only_a_chunked_prefill_runs():
    """A hard stop between the chunks of a long prompt while no row decodes (the chunks then run
    back to back, without steps): the request comes back FAILED with no tokens, at the next chunk
    boundary."""
    import threading

    model = get_model("nemotron_h")
    prompt = _prompts(seed=3, lengths=[40])[0]
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=2, decode_path="eager")
    m = sd.init_continuous_batching(max_length=64, max_batch_size=2, max_batch_tokens=6)
    entered, gate, chunks = threading.Event(), threading.Event(), []
    real = sd.adapter._prompt_forward

    def held(input_ids, *args, **kwargs):
        if input_ids.shape[0] == 1:  # (not the pool's placeholder rows)
            chunks.append(input_ids.numel())
        if len(chunks) == 2:
            entered.set()
            assert gate.wait(30)
        return real(input_ids, *args, **kwargs)

    sd.adapter._prompt_forward = held
    rid = m.add_request(prompt, max_new_tokens=5)
    m.start()
    assert entered.wait(30)
    m.stop(block=False, hard_stop=True)
    gate.set()
    m.stop(block=True, timeout=60)
    assert not _loop_threads()
    out = m.get_result(rid)
    assert out.status == RequestStatus.FAILED and out.generated_tokens == [] and "hard_stop=True" in out.error
    assert chunks == [6, 6]


@pytest.mark.parametrize("chunk", [4, None])
def test_sampling(chunk):
    """Sampling through chunked prefills: top_k=1 is greedy decoding (each request as alone), and
    one seed gives the same tokens twice."""
    model = get_model("qwen3_5")
    prompts = _prompts()
    expected = [_alone(model, p, b, None) for p, b in zip(prompts, BUDGETS)]
    kw = dict(max_new_tokens=BUDGETS, max_batch_size=2, do_sample=True)
    if chunk is not None:
        kw["max_batch_tokens"] = chunk
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")
    _check(sd.generate_batch(prompts, top_k=1, **kw), expected, prompts)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append([o.generated_tokens for o in sd.generate_batch(prompts, **kw).values()])
    assert runs[0] == runs[1] and [len(t) for t in runs[0]] == BUDGETS


def test_prefill_chunked_checks_its_arguments_when_called():
    """prefill_chunked raises for an empty prompt or chunks of no tokens when it is called, as its
    docstring says (not at the first chunk, wherever the caller first advances it); a prompt of
    one chunk gives what prefill gives, with nothing to yield."""
    sd = specdec.wrap(get_model("nemotron_h"), num_speculative_tokens=2, decode_path="eager")
    ad = sd.adapter
    cache = ad.new_cache(1, 32, 3, sd._strategy)
    with pytest.raises(ValueError, match="non-empty 1-D prompt"):
        ad.prefill_chunked(torch.tensor([], dtype=torch.long), cache, 4)
    with pytest.raises(ValueError, match="chunk_tokens >= 1"):
        ad.prefill_chunked(torch.tensor([5, 6, 7]), cache, 0)
    steps = ad.prefill_chunked(torch.tensor([5, 6, 7]), cache, 3)
    with pytest.raises(StopIteration) as stop:
        next(steps)
    logits, _ = stop.value.value
    fresh = ad.new_cache(1, 32, 3, sd._strategy)
    want, _ = ad.prefill(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), fresh)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
