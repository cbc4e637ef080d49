"""Continuous batching as a service (``init_continuous_batching``) and memory-aware pool sizing
(``max_batch_size="auto"``): every request equals HF greedy ``generate`` on its prompt alone,
requests added while the loop runs, results by id and in the order requests end, both ways of
stopping, errors of the loop thread reaching the caller, no thread left behind; "auto" admits
more rows under replay than under snapshot, as the layer arithmetic of the config says."""

from __future__ import annotations

import copy
import logging
import math
import threading
import time

import pytest
import torch
from test_generate_batch import ROWS, TextOracle, _check, _reference
from tiny_models import VOCAB, get_model

import specdec
from specdec.batching import (ADMISSION_DIVISOR, MEMORY_FRACTION, GenerationOutput, RequestStatus, admission_bytes,
                              admission_rows, bytes_per_sequence, cache_bytes, parse_bytes, plan_rows, pool_bytes)

FAMILY = "qwen3_5"
#: a bound above every request of the reference (longest prompt 13 + largest budget 14)
MAX_LENGTH = 32


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "specdec-continuous-batching"]


def _manager(drafter="ngram", rows=ROWS, **kw):
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd = specdec.wrap(get_model(FAMILY), drafter=drafter, rollback="replay", num_speculative_tokens=3,
                      decode_path="eager")
    return sd, sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=rows, eos_token_id=eos, **kw)


class Gate(TextOracle):
    """The text oracle; its ``hold_at``-th proposal waits until ``gate`` is set (``entered`` says it
    is waiting), and its ``fail_at``-th raises."""

    def __init__(self, sequences, hold_at=None, fail_at=None):
        super().__init__(sequences)
        self.calls, self.hold_at, self.fail_at = 0, hold_at, fail_at
        self.entered, self.gate = threading.Event(), threading.Event()

    def propose(self, input_ids, lengths, K):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter broke")
        if self.calls == self.hold_at:
            self.entered.set()
            assert self.gate.wait(30), "the test did not open the gate"
        return super().propose(input_ids, lengths, K)


def test_requests_added_while_running(caplog):
    """Requests added before start and while the loop runs (after a result was taken) all equal
    generate alone (before start, get_result returns None at once with a warning that they wait
    for it); iteration ends when every result was taken; stats cover every request."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(TextOracle(full))
    first = m.add_requests(prompts[:3], max_new_tokens=budgets[:3])
    with caplog.at_level(logging.WARNING, logger="specdec.serving"):
        assert m.get_result(timeout=5) is None  # not started: at once, saying why
    assert "3 request(s) wait, but the continuous batching loop is not running: start() the manager" in caplog.text
    with m:
        assert m.is_running() and _loop_threads()
        got = [m.get_result(timeout=60)]
        later = [m.add_request(p, max_new_tokens=b) for p, b in zip(prompts[3:], budgets[3:])]
        got += list(m)
        assert m.get_result() is None  # nothing waiting or decoding: no wait
    assert first + later == [f"req_{i}" for i in range(len(prompts))]
    _check({o.request_id: o for o in sorted(got, key=lambda o: int(o.request_id[4:]))}, expected, prompts)
    assert all(isinstance(o, GenerationOutput) for o in got)
    st = sd.last_stats
    assert st.new_tokens == sum(len(e) for e in expected) and st.max_batch_size == ROWS
    assert st.batch_size_reason is None and st.accepted_tokens > 0
    assert not m.is_running() and not _loop_threads()


def test_results_by_id_and_in_finish_order():
    """One row: requests end in the order they were added and get_result() gives them in that
    order; get_result(id) waits for that one (the others stay); request_id_iter gives its one
    result; ids can be chosen, not reused while in use; a taken result is gone."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(rows=1)
    ids = m.add_requests(prompts[:6], max_new_tokens=budgets[:6])
    mine = m.add_request(prompts[6], request_id="mine", max_new_tokens=budgets[6])
    with pytest.raises(ValueError, match="already in use"):
        m.add_request(prompts[0], request_id="mine")
    with m:
        by_id = m.get_result("req_2", timeout=60)
        ordered = [m.get_result(timeout=60) for _ in range(5)]
        streamed = list(m.request_id_iter(mine))
        with pytest.raises(KeyError, match="req_2"):
            m.get_result("req_2")
    assert ids == [f"req_{i}" for i in range(6)]
    assert by_id.request_id == "req_2" and by_id.generated_tokens == expected[2]
    assert [o.request_id for o in ordered] == ["req_0", "req_1", "req_3", "req_4", "req_5"]
    assert [o.generated_tokens for o in ordered] == [expected[i] for i in (0, 1, 3, 4, 5)]
    assert len(streamed) == 1 and streamed[0].request_id == "mine" and streamed[0].generated_tokens == expected[6]


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_streaming_requests(drafter):
    """streaming=True: the loop hands out a partial result (DECODING) at the prefill's first token
    and at every step that commits tokens, each the final tokens' next longer prefix, the last
    one all of them; requests that do not stream hand out none. request_id_iter gives partial
    results (a newer one replacing one not taken) and then the final one, equal to generate
    alone."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(TextOracle(full) if drafter == "oracle" else "ngram")
    handed = []
    deliver = m._deliver_partial

    def record(out):
        handed.append(out)
        deliver(out)

    m._deliver_partial = record  # (the pool takes it when start() makes it)
    with m:
        ids = [m.add_request(p, max_new_tokens=b, streaming=i % 2 == 0)
               for i, (p, b) in enumerate(zip(prompts, budgets))]
        seen = {rid: list(m.request_id_iter(rid)) for rid in ids}
    growth = []
    for i, rid in enumerate(ids):
        final = seen[rid][-1]
        assert final.status == RequestStatus.FINISHED and final.generated_tokens == expected[i]
        partial = [o.generated_tokens for o in handed if o.request_id == rid]
        assert all(o.status == RequestStatus.DECODING for o in handed)
        if i % 2:
            assert partial == [] and len(seen[rid]) == 1
            continue
        lengths = [len(t) for t in partial]
        assert lengths[0] == 1 and lengths[-1] == len(expected[i])
        assert all(a < b for a, b in zip(lengths, lengths[1:]))
        assert all(t == expected[i][:len(t)] for t in partial)
        assert all(o.generated_tokens in partial for o in seen[rid][:-1])  # what the caller got was handed out
        growth += [b - a for a, b in zip(lengths, lengths[1:])]
    if drafter == "oracle":  # accepted drafts: a step commits several tokens at once
        assert max(growth) > 1


def test_failed_requests_and_bad_arguments():
    """A request beyond max_length or with ids outside the vocabulary fails at once, alone and
    clearly; the others run; bad arguments raise."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    with m:
        long = m.add_request(list(range(3, 3 + MAX_LENGTH - 1)), max_new_tokens=2)
        outside = m.add_request([5, VOCAB], max_new_tokens=2)
        ok = m.add_request(prompts[0], max_new_tokens=budgets[0])
        zero = m.add_request(prompts[1], max_new_tokens=0)
        out = {o.request_id: o for o in m}
    assert out[long].status == RequestStatus.FAILED and f"max_length={MAX_LENGTH}" in out[long].error
    assert out[outside].status == RequestStatus.FAILED and "outside the vocabulary" in out[outside].error
    assert out[ok].status == RequestStatus.FINISHED and out[ok].generated_tokens == expected[0]
    assert out[zero].status == RequestStatus.FINISHED and out[zero].generated_tokens == []
    with pytest.raises(TypeError, match="list of int token ids"):
        m.add_request("hello")
    with pytest.raises(TypeError, match="streaming must be a bool"):
        m.add_request(prompts[0], streaming="yes")
    with pytest.raises(TypeError, match="max_new_tokens of one request must be an int or None"):
        m.add_request(prompts[0], max_new_tokens=[3])
    with pytest.raises(TypeError, match="max_new_tokens of one request must be an int or None"):
        m.add_request(prompts[0], max_new_tokens=torch.tensor([3]))
    with pytest.raises(ValueError, match="request_id must not be empty"):
        m.add_request(prompts[0], request_id="")
    sd = specdec.wrap(get_model(FAMILY), num_speculative_tokens=2)
    for kw, err, match in [(dict(), TypeError, "max_length"), (dict(max_length=1), ValueError, "max_length"),
                           (dict(max_length=10**6), ValueError, "max_position_embeddings"),
                           (dict(max_length=8, max_batch_size="big"), ValueError, "'auto'"),
                           (dict(max_length=8, repetition_penalty=1.2), ValueError, "repetition_penalty"),
                           (dict(max_length=8, max_time=3.0), ValueError, "init_continuous_batching does not support"),
                           (dict(max_length=8, num_beams=2), ValueError, r"init_continuous_batching\(\) supports")]:
        with pytest.raises(err, match=match):
            sd.init_continuous_batching(**kw)


def test_stop_flushes_pending_requests():
    """stop() (HF's default) finishes every request added before it, decoding or waiting; their
    results stay available; new requests are refused while it stops; no thread is left."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(Gate(full, hold_at=2))
    m.start()
    m.add_requests(prompts, max_new_tokens=budgets)
    assert sd.drafter.entered.wait(30)
    m.stop(block=False)
    with pytest.raises(RuntimeError, match="stopping"):
        m.add_request(prompts[0])
    sd.drafter.gate.set()
    m.stop(block=True, timeout=60)
    assert not m.is_running() and not _loop_threads()
    out = {o.request_id: o for o in m}
    _check({k: out[k] for k in sorted(out, key=lambda k: int(k[4:]))}, expected, prompts)


def test_the_running_loop_owns_the_generator():
    """While a manager's loop runs, the generator's own calls and setters, and starting a second
    manager of it, raise RuntimeError naming the running manager (they would share its caches);
    the loop is untouched and its results exact; a second wrap() of the model decodes alongside;
    after stop() the generator is free again."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(Gate(full, hold_at=2))
    other = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=ROWS, eos_token_id=eos)
    m.add_requests(prompts, max_new_tokens=budgets)
    m.start()
    try:
        assert sd.drafter.entered.wait(30)
        ids = torch.tensor([prompts[0]])
        for call in (lambda: sd.generate(ids, max_new_tokens=3), lambda: sd.generate_batch([prompts[0]]),
                     sd.release, lambda: setattr(sd, "drafter", "ngram"), lambda: setattr(sd, "rollback", "snapshot"),
                     lambda: setattr(sd, "num_speculative_tokens", 2),
                     lambda: setattr(sd, "max_speculative_tokens", 2), lambda: setattr(sd, "policy", None),
                     lambda: setattr(sd, "cost_model", None), lambda: setattr(sd, "decode_path", "eager"),
                     lambda: setattr(sd, "max_batch_tokens", 64),
                     other.start):
            with pytest.raises(RuntimeError, match="continuous batching manager is running"):
                call()
        assert not other.is_running()
        alone = specdec.wrap(get_model(FAMILY), num_speculative_tokens=0)
        assert alone.generate_batch([prompts[0]], max_new_tokens=budgets[0],
                                    eos_token_id=eos)["req_0"].generated_tokens == expected[0]
    finally:
        sd.drafter.gate.set()
        m.stop(block=True, timeout=60)
    out = {o.request_id: o for o in m}
    _check({k: out[k] for k in sorted(out, key=lambda k: int(k[4:]))}, expected, prompts)
    got = sd.generate_batch([prompts[1]], max_new_tokens=budgets[1], eos_token_id=eos)
    assert got["req_0"].generated_tokens == expected[1]


def test_start_after_a_stop_under_way():
    """start() while stop(block=False) is still finishing the requests: the old loop ends first
    (every request it had finishes), then a new loop takes requests added after start()."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(Gate(full, hold_at=2))
    m.add_requests(prompts[:4], max_new_tokens=budgets[:4])
    m.start()
    assert sd.drafter.entered.wait(30)
    m.stop(block=False)
    threading.Timer(0.2, sd.drafter.gate.set).start()  # the old loop finishes while start() waits for it
    m.start()
    try:
        assert m.is_running()
        late = m.add_requests(prompts[4:], max_new_tokens=budgets[4:])
        out = {o.request_id: o for o in m}
    finally:
        m.stop(block=True, timeout=60)
    assert sorted(out, key=lambda k: int(k[4:])) == [f"req_{i}" for i in range(len(prompts))]
    assert late == [f"req_{i}" for i in range(4, len(prompts))]
    _check({k: out[k] for k in sorted(out, key=lambda k: int(k[4:]))}, expected, prompts)


def test_start_while_the_ended_loop_thread_exits():
    """start() in the moment between the loop's end (state idle) and its thread's exit waits for
    the thread, then starts a new loop (it did nothing but warn "already running")."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    deliver = m._deliver

    def slow_last_delivery(outputs):  # the loop's final delivery, after it set the state idle
        if threading.current_thread() is m._thread and m._state == "idle":
            time.sleep(0.5)
        deliver(outputs)

    m._deliver = slow_last_delivery
    m.start()
    old = m._thread
    m.stop(block=False)  # no requests: the loop ends at once, then delivers slowly
    time.sleep(0.1)
    m.start()
    try:
        assert m.is_running() and m._thread is not old and not old.is_alive()
        rid = m.add_request(prompts[0], max_new_tokens=budgets[0])
        assert m.get_result(rid, timeout=60).generated_tokens == expected[0]
    finally:
        m.stop(block=True, timeout=60)


def test_interpreter_exit_with_a_running_loop(tmp_path):
    """A script that ends while its manager still decodes exits cleanly (status 0): the exit hook
    hard-stops the loop and waits for it, where a loop thread left inside torch aborted the
    process."""
    import os
    import subprocess
    import sys

    script = tmp_path / "serve_and_leave.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import specdec\n"
        "from tiny_models import make_model\n"
        "sd = specdec.wrap(make_model('qwen3_5'), drafter='ngram', num_speculative_tokens=3, decode_path='eager')\n"
        "m = sd.init_continuous_batching(max_length=300, max_batch_size=2)\n"
        "m.start()\n"
        "for p in ([5, 6, 7, 8, 9], [10, 11, 12]):\n"
        "    m.add_request(p, max_new_tokens=250)\n"
        "time.sleep(0.5)\n"
        "print('left with the loop running:', m.is_running())\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "left with the loop running: True" in run.stdout
    assert "terminate called" not in run.stderr


def test_hard_stop_fails_unfinished_requests():
    """stop(hard_stop=True) ends the loop at the next step: decoding requests come back FAILED with
    the tokens they had (a prefix of their text alone), waiting ones FAILED with none."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(Gate(full, hold_at=2))
    m.add_requests(prompts, max_new_tokens=budgets)
    m.start()
    assert sd.drafter.entered.wait(30)
    m.stop(block=False, hard_stop=True)
    sd.drafter.gate.set()
    m.stop(block=True, timeout=60)
    assert not _loop_threads()
    out = {o.request_id: o for o in m}
    assert sorted(out) == sorted(f"req_{i}" for i in range(len(prompts)))
    cut = [k for k, o in out.items() if o.status == RequestStatus.FAILED]
    assert len(cut) >= len(prompts) - ROWS - 1  # at least the requests that never got a row
    for k, o in out.items():
        e = expected[int(k[4:])]
        if o.status == RequestStatus.FAILED:
            assert "hard_stop=True" in o.error and o.generated_tokens == e[:len(o.generated_tokens)]
        else:
            assert o.generated_tokens == e
    assert any(out[k].generated_tokens for k in cut), "a decoding request keeps the tokens it had"


def test_loop_error_reaches_the_caller():
    """An exception inside the loop thread: every unfinished request comes back FAILED naming it,
    then get_result and iteration raise; adding requests raises; nothing hangs, no thread is
    left; start() runs again."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(Gate(full, fail_at=3))
    m.add_requests(prompts, max_new_tokens=budgets)
    m.start()
    got = []
    with pytest.raises(RuntimeError, match="drafter broke") as info:
        while True:
            got.append(m.get_result(timeout=60))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert len(got) == len(prompts) and not _loop_threads()
    failed = [o for o in got if o.status == RequestStatus.FAILED]
    assert failed and all("drafter broke" in o.error for o in failed)
    with pytest.raises(RuntimeError, match="drafter broke"):
        list(m)
    with pytest.raises(RuntimeError, match="start"):
        m.add_request(prompts[0])
    sd.drafter = TextOracle(full)
    with m:
        m.add_requests(prompts[:2], max_new_tokens=budgets[:2])
        assert [o.generated_tokens for o in sorted(m, key=lambda o: o.request_id)] == expected[:2]


def test_generate_batch_auto_exact():
    """generate_batch with max_batch_size="auto" and a budget: exact, the rows and why on last_stats."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd = specdec.wrap(get_model(FAMILY), drafter=TextOracle(full), rollback="snapshot", num_speculative_tokens=3,
                      decode_path="eager")
    out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size="auto",
                            memory_budget="1MiB")
    _check(out, expected, prompts)
    st = sd.last_stats
    assert st.max_batch_size == len(prompts) and "max_batch_size=auto" in st.batch_size_reason
    assert "snapshot" in st.batch_size_reason and "capped at 7 (requests)" in st.batch_size_reason


def _row_bytes(config, strategy: str, span: int, K: int) -> tuple[int, int]:
    """One row's bytes from the tiny Qwen3.5 config's fields (fp32): KV of the full-attention
    layers over span + 2T columns; per Gated DeltaNet layer its state, conv window and the
    strategy's extra state (snapshot: T states; replay: 2T tokens of cached k, g, u); the logits.
    Returns (all of it, its KV and SSM state and conv window alone)."""
    T, f32 = K + 1, 4
    n_attn, n_gdn = config.layer_types.count("full_attention"), config.layer_types.count("linear_attention")
    kv = n_attn * 2 * config.num_key_value_heads * config.head_dim * f32 * (span + 2 * T)
    hv, hk = config.linear_num_value_heads, config.linear_num_key_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    state = hv * dk * dv * f32
    conv = (2 * hk * dk + hv * dv) * f32 * (config.linear_conv_kernel_dim - 1 + T)
    replay_token = (hv * dk + hv + hv * dv) * f32
    extra = {"snapshot": T * state, "replay": 2 * T * replay_token}[strategy]
    workspace = T * config.vocab_size * (f32 + 4) + (span + T) * 8
    return kv + n_gdn * (state + conv + extra) + workspace, kv + n_gdn * (state + conv)


def test_auto_rows_replay_above_snapshot():
    """max_batch_size="auto" with a given budget: the rows are those the config's arithmetic gives
    (r rows' bytes and one admission's transient within the budget: ceil(r / ADMISSION_DIVISOR)
    prompts' KV and SSM state, at least one whole row), and replay's smaller extra state admits
    more rows than snapshot's."""
    model = get_model(FAMILY)
    budget, K = 1 << 20, 3
    rows = {}
    for strategy in ("snapshot", "replay"):
        per_row, kv_and_state = _row_bytes(model.config, strategy, MAX_LENGTH, K)
        assert bytes_per_sequence(model, strategy, MAX_LENGTH, K).total == per_row
        want = max(r for r in range(1, budget // per_row + 1)
                   if r * per_row + max(math.ceil(r / ADMISSION_DIVISOR) * kv_and_state, per_row) <= budget)
        sd = specdec.wrap(model, rollback=strategy, num_speculative_tokens=K, decode_path="eager")
        m = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size="auto", memory_budget=budget)
        rows[strategy] = m.max_batch_size
        assert rows[strategy] == want, (strategy, rows[strategy], want)
    assert rows["replay"] > rows["snapshot"]


def test_a_default_budget_that_does_not_fit_max_length():
    """A default budget given to init_continuous_batching beyond max_length - 1 raises; one
    inherited from a generation config warns, since requests added with their own budget still
    serve: those added without one fail alone, naming max_length. With no budget set anywhere a
    request gets 20 new tokens or what its prompt leaves of max_length, as generate() within the
    model's context."""
    from transformers import GenerationConfig

    model = get_model(FAMILY)
    sd = specdec.wrap(model, rollback="replay", num_speculative_tokens=3, decode_path="eager")
    with pytest.raises(ValueError, match=r"must be in \[0, max_length - 1 = 9\].*got 10"):
        sd.init_continuous_batching(max_length=10, max_new_tokens=10)
    with pytest.warns(UserWarning, match=r"max_new_tokens=20 \(the generation config's\), does not fit max_length=10"):
        m = sd.init_continuous_batching(max_length=10, generation_config=GenerationConfig(max_new_tokens=20))
    fits = m.add_request([5, 6, 7], max_new_tokens=4)
    default = m.add_request([5, 6, 7])
    with m:
        assert m.get_result(fits, timeout=60).status == RequestStatus.FINISHED
        out = m.get_result(default, timeout=60)
    assert out.status == RequestStatus.FAILED and "max_length=10" in out.error
    assert model.generation_config.max_new_tokens is None
    m = sd.init_continuous_batching(max_length=10)
    short, long = m.add_request([5, 6, 7]), m.add_request(list(range(5, 14)))
    with m:
        outs = [m.get_result(r, timeout=60) for r in (short, long)]
    assert [o.status for o in outs] == [RequestStatus.FINISHED] * 2
    assert [len(o.generated_tokens) for o in outs] == [7, 1]  # (no EOS set: each runs its whole budget)


def test_generate_batch_default_budgets_as_generate():
    """With no max_new_tokens given, generate_batch budgets each request as generate() does: the
    max_new_tokens of the generation config passed, else of the model's (a config passed without
    one inherits the model's), else what the model's config's max_length leaves after the prompt
    (a longer prompt fails alone), else 20 new tokens or what the prompt leaves of the context;
    the manager takes a 0-d tensor as one request's budget."""
    from transformers import GenerationConfig

    model = copy.deepcopy(get_model(FAMILY))
    sd = specdec.wrap(model, rollback="replay", num_speculative_tokens=3, decode_path="eager")
    g = torch.Generator().manual_seed(5)
    context = model.config.max_position_embeddings
    prompts = [torch.randint(3, VOCAB - 1, (n,), generator=g).tolist() for n in (6, context - 8)]

    def lengths(inputs=prompts, **kw):
        outs = sd.generate_batch(inputs, eos_token_id=None, **kw).values()
        assert all(o.status == RequestStatus.FINISHED for o in outs), [o.error for o in outs]
        return [len(o.generated_tokens) for o in outs]

    def alone(p, **kw):
        return sd.generate(torch.tensor([p]), eos_token_id=None, **kw).shape[1] - len(p)

    assert lengths() == [alone(p) for p in prompts] == [20, 8]
    assert lengths(generation_config=GenerationConfig(max_new_tokens=5)) == [5, 5]
    model.generation_config.max_length = 12  # (a checkpoint's length of prompt + new tokens)
    assert [alone(prompts[0])] == lengths(inputs=prompts[:1]) == [6]
    out = sd.generate_batch(prompts, eos_token_id=None)
    assert out["req_1"].status == RequestStatus.FAILED and "generation_config.max_length=12" in out["req_1"].error
    model.generation_config.max_new_tokens = 4  # (wins over max_length, as in generate())
    assert lengths() == lengths(generation_config=GenerationConfig(do_sample=False)) == [4, 4]
    assert [alone(p, generation_config=GenerationConfig(do_sample=False)) for p in prompts] == [4, 4]
    m = sd.init_continuous_batching(max_length=16)
    tensor_budget = m.add_request(prompts[0], max_new_tokens=torch.tensor(2))  # (a 0-d tensor: an int)
    inherited = m.add_request(prompts[0])
    with m:
        outs = [m.get_result(r, timeout=60) for r in (tensor_budget, inherited)]
    assert [len(o.generated_tokens) for o in outs] == [2, 4]
    model.generation_config.max_new_tokens, model.generation_config.max_length = None, 4 * context
    assert lengths(inputs=prompts[:1]) == [context - 6]  # (a length beyond the context: what fits)
    m = sd.init_continuous_batching(max_length=16)  # (beyond the manager's max_length: what fits it)
    first = m.add_request(prompts[0])
    with m:
        assert len(m.get_result(first, timeout=60).generated_tokens) == 16 - 6


def test_oversize_int_and_budget_errors():
    """An int max_batch_size beyond the budget raises before any work, naming the numbers; so does
    "auto" where not one row fits, or where free memory is unknown and no budget is given."""
    model = get_model(FAMILY)
    sd = specdec.wrap(model, rollback="replay", num_speculative_tokens=3, decode_path="eager")
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    with pytest.raises(ValueError, match=r"max_batch_size=100000: 7 rows need about .* but memory_budget 64.0 KiB"):
        sd.generate_batch(prompts, max_new_tokens=budgets, max_batch_size=100_000, memory_budget="64KiB")
    with pytest.raises(ValueError, match=r"max_batch_size=1000: 1000 rows need about .* but memory_budget 1.0 MiB"):
        sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=1000, memory_budget="1MiB")
    with pytest.raises(ValueError, match="not one row fits"):
        sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size="auto", memory_budget=1000)
    with pytest.raises(ValueError, match="memory_budget"):
        sd.generate_batch(prompts, max_batch_size="auto", memory_budget="lots")
    row = bytes_per_sequence(model, "replay", MAX_LENGTH, 3)
    with pytest.raises(ValueError, match="free memory of the device, which is unknown"):
        plan_rows("auto", None, lambda: row, None, lambda: None)
    free = 10 * row.total
    plan = plan_rows("auto", None, lambda: row, None, lambda: free)
    assert plan.budget == int(free * MEMORY_FRACTION)
    # the most rows whose bytes and one admission's transient fit: the admitted prompts' states
    # (KV and SSM state, written straight into the rows), at least one whole row (a chunked prompt's cache)
    assert pool_bytes(plan.rows, row) <= plan.budget < pool_bytes(plan.rows + 1, row)
    assert admission_bytes(plan.rows, row) == max(admission_rows(plan.rows) * (row.kv_bytes + row.state_bytes),
                                                  row.total)
    snap = bytes_per_sequence(model, "snapshot", MAX_LENGTH, 3)  # (its rollback extra is K states a row)
    assert snap.rollback_bytes > 0 and admission_bytes(64, snap) == (64 // ADMISSION_DIVISOR) * (snap.kv_bytes + snap.state_bytes) < (64 // ADMISSION_DIVISOR) * snap.total
    assert plan_rows(4, 100, lambda: row, None, lambda: None).rows == 4  # unknown free memory: not checked
    # a prefix cache's byte bound comes out of the budget (it fills while the pool decodes)
    budget = 40 * row.total
    alone = plan_rows("auto", None, lambda: row, budget)
    shared = plan_rows("auto", None, lambda: row, budget, reserved=20 * row.total)
    assert shared.budget == budget - 20 * row.total and "less the prefix cache's" in shared.reason
    assert pool_bytes(shared.rows, row) <= shared.budget < alone.budget
    assert shared.rows < alone.rows
    with pytest.raises(ValueError, match="nothing is left for the pool's rows"):
        plan_rows("auto", None, lambda: row, budget, reserved=budget)
    nbytes = 10 * row.total  # through the engine: with prefix_caching the rows chosen leave its bound free
    assert sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size="auto", memory_budget=budget,
                                       prefix_caching=True, prefix_cache_bytes=nbytes).max_batch_size == \
        plan_rows("auto", None, lambda: row, budget, reserved=nbytes).rows < \
        sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size="auto", memory_budget=budget).max_batch_size
    assert parse_bytes("40GiB") == 40 << 30 and parse_bytes("1.5 kB") == 1500 and parse_bytes(7) == 7
    with pytest.raises(TypeError):
        parse_bytes(1.5)
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("family, strategy", [("qwen3_5", "snapshot"), ("nemotron_h", "replay"),
                                              ("kimi_linear", "ring")])
def test_estimate_matches_the_cache(family, strategy):
    """bytes_per_sequence's KV + state + rollback bytes are what a generate_batch pool's cache holds
    per row (up to the strategies' int64 per-slot cursors: a ring's head, replay's history length)."""
    prompts, budgets, eos, expected, full = _reference(family)
    model = get_model(family)
    sd = specdec.wrap(model, rollback=strategy, num_speculative_tokens=3, decode_path="eager")
    sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS)
    row = bytes_per_sequence(model, strategy, max(map(len, prompts)) + max(budgets), 3)
    held = cache_bytes(sd.last_cache) / ROWS
    assert 0 <= held - (row.kv_bytes + row.state_bytes + row.rollback_bytes) <= 8 * len(sd.last_cache.ssm)
