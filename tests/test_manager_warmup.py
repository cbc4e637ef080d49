"""The continuous batching manager's warm-up (``ContinuousBatchingManager.warmup``): it runs
warm-up requests through the manager's own loop on closed pools, so serving afterwards is
exact (greedy, as ``generate`` alone) with plain decoding, drafters and prefix caching, and the
manager's queue, results, ids and prefix cache are untouched; the synthetic grid meets every
prompt bucket an admission of the pool can meet, each once per round (counted on the static
path, where prompt forwards run at bucketed shapes); bad prompts and a running loop are refused
before any work; the oracle drafter lets warm-up rows decode without a reference. Serving the
prompts warmed up meets no prompt bucket the warm-up did not make, and on CUDA captures no
prompt graph."""

from __future__ import annotations

import pytest
import torch
from helpers import record_prompt_forwards
from markers import needs_cuda
from test_generate_batch import ROWS, _check, _reference
from test_prefix_cache import BS, BUDGETS, EOS, _simulate
from test_prefix_cache import _prompts as _shared_prompts
from tiny_models import VOCAB, get_model

import specdec
from specdec.batching import Request
from specdec.drafters import DraftModelDrafter, OracleDrafter
from specdec.models.prompt_graphs import PROMPT_GRAPH_ROWS, PROMPT_GRAPH_TOKENS, prompt_bucket
from specdec.prefix_cache import PrefixCacheStats

FAMILY = "qwen3_5"
#: a bound above every request of the reference (longest prompt 13 + largest budget 14)
MAX_LENGTH = 32


def _manager(drafter="ngram", K=3, path="static", rows=ROWS, max_length=MAX_LENGTH, **kw):
    eos = _reference(FAMILY)[2]
    sd = specdec.wrap(get_model(FAMILY), drafter=drafter, rollback="replay", num_speculative_tokens=K,
                      decode_path=path)
    return sd, sd.init_continuous_batching(max_length=max_length, max_batch_size=rows, eos_token_id=eos, **kw)


def _serve(m, prompts, budgets) -> dict:
    """Every request added before the loop starts; the results by id."""
    ids = m.add_requests(prompts, max_new_tokens=budgets)
    with m:
        got = {o.request_id: o for o in m}
    assert ids == [f"req_{i}" for i in range(len(prompts))]
    return {rid: got[rid] for rid in ids}


def _untouched(m):
    """Nothing of a warm-up reached the manager's queue, results, ids or prefix cache."""
    assert m.warmed_up and not m.is_running()
    assert not m._queue and not m._results and not m._in_flight and not m._added and m._count == 0
    assert m.get_result() is None
    if m.prefix_cache is not None:
        assert len(m.prefix_cache) == 0 and m.prefix_cache.stats == PrefixCacheStats()


@pytest.mark.parametrize("config", ["plain", "ngram", "draft_model", "oracle", "ngram_prefix_cache"])
def test_serving_after_warmup_is_exact(config):
    """Warm-up (the grid, then some of the requests' prompts) and then serving: every request
    equals HF greedy on its prompt alone; the warm-up left the manager as it was made."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    drafter, K, kw = "ngram", 3, {}
    if config == "plain":
        K = 0
    elif config == "draft_model":
        drafter = DraftModelDrafter(get_model(FAMILY, "perturbed"))
    elif config == "oracle":
        drafter = OracleDrafter.for_requests(full, acceptance=1.0)
    elif config == "ngram_prefix_cache":
        kw = dict(prefix_caching=True, prefix_block_size=4)
    sd, m = _manager(drafter, K, **kw)
    assert not m.warmed_up
    grid = m.warmup()
    assert grid["pool_runs"] == 2 * 3 and grid["seconds"] > 0  # rows 1, 2, 3 of one width, twice
    assert sum(grid["prompt_forwards"].values()) == 2 * grid["pool_runs"]  # (placeholders + prompts)
    given = m.warmup([prompts[0], prompts[2] + prompts[0]], rounds=1)
    # each prompt alone, then both in one forward; with the cache, both again through an empty one
    assert given["pool_runs"] == 3 + (config == "ngram_prefix_cache")
    _untouched(m)
    _check(_serve(m, prompts, budgets), expected, prompts)
    if config == "oracle":
        assert sd.last_stats.accepted_tokens > 0  # the requests drafted their references
    if config == "ngram_prefix_cache":
        assert sd.last_stats.prefix_cache["lookups"] == len(prompts)  # the manager's own counters only


@pytest.mark.parametrize("rows, prompts, sizes", [(16, 9, [1, 2, 4, 8]), (64, 20, [1, 2, 4, 8]), (3, 9, [1, 2, 3]),
                                                  (64, 3, [1, 2, 3]), (1, 5, [1]), (8, 1, [1])])
def test_warmup_groups_reach_every_row_bucket_of_an_admission(rows, prompts, sizes):
    """The user's prompts warm up alone and in groups, one per row bucket (powers of two up to
    PROMPT_GRAPH_ROWS) a forward of at most min(rows, prompts) of them rounds up to."""
    from specdec.serving import warmup_group_sizes

    assert warmup_group_sizes(rows, prompts) == sizes
    assert {prompt_bucket(n, 32)[0] for n in range(1, min(rows, prompts, PROMPT_GRAPH_ROWS) + 1)} == \
        {prompt_bucket(n, 32)[0] for n in sizes}


def _grid_buckets(rows: int, max_length: int, max_batch_tokens: int) -> set[tuple[int, int]]:
    """Every bucket an admission of a pool of ``rows`` rows can prefill in: r <= rows prompts of
    n <= max_length - 1 tokens in one forward (r x n <= max_batch_tokens), where a bucket holds them."""
    limit = min(PROMPT_GRAPH_TOKENS, max_batch_tokens)
    return {prompt_bucket(r, n, PROMPT_GRAPH_ROWS, limit)
            for r in range(1, rows + 1) for n in range(1, max_length) if r * n <= max_batch_tokens} - {None}


@pytest.mark.parametrize("rows, max_length, max_batch_tokens", [(3, 70, 128), (1, 40, 16384), (6, 34, 16384)])
def test_grid_meets_every_bucket_once_per_round(rows, max_length, max_batch_tokens):
    """The static path: the grid's pool runs prefill, per round, each bucket an admission can
    meet once (plus each run's placeholder rows, one bucket of the pool's rows), and the counts
    it returns are those forwards, run at a bucket's shape."""
    sd, m = _manager(rows=rows, max_length=max_length, max_batch_tokens=max_batch_tokens)
    buckets = _grid_buckets(rows, max_length, max_batch_tokens)
    placeholder = prompt_bucket(rows, 1, max_tokens=min(PROMPT_GRAPH_TOKENS, max_batch_tokens))
    for rounds in (1, 2):
        shapes = record_prompt_forwards(sd)
        got = m.warmup(rounds=rounds)
        assert got["pool_runs"] == rounds * len(buckets)
        assert got["prompt_forwards"] == {"cuda_graph": 0, "captured": 0, "static": 2 * rounds * len(buckets),
                                          "eager": 0}
        assert sorted(shapes) == sorted(rounds * (list(buckets) + [placeholder] * len(buckets)))
    _untouched(m)


def test_warmup_prompts_counts():
    """warmup(prompts) on a one-row pool: each prompt alone, in order, once per round: without
    the prefix cache one prompt forward each (and its run's placeholders); with it, through a
    fresh scratch cache per round, the forwards an empty cache makes them run (a branch point
    takes two), then the grid continued after their shared prefix (here one bucket: 1 row of
    32 tokens), while the manager's cache stays empty. On a pool of 3 rows, the prompts run in
    twos and threes too (and the grid in rows of 1, 2 and 3), and with the cache those groups
    again through an empty one."""
    prompts = _shared_prompts()[:5]
    for caching in (False, True):
        kw = dict(prefix_caching=True, prefix_block_size=BS) if caching else {}
        sd, m = _manager(rows=1, **kw)
        forwards = sum(f for _, f, _ in _simulate(prompts)) if caching else len(prompts)
        grid = int(caching)
        got = m.warmup(prompts)
        assert got["pool_runs"] == 2 * (len(prompts) + grid)
        assert got["prompt_forwards"]["static"] == 2 * (len(prompts) + forwards + 2 * grid), caching
        assert sum(got["prompt_forwards"].values()) == got["prompt_forwards"]["static"]
        _untouched(m)
        sd, m = _manager(rows=3, **kw)
        groups = 3 + 2  # five prompts in twos, then in threes (with the cache: again, each size through an empty one)
        assert m.warmup(prompts)["pool_runs"] == 2 * (len(prompts) + groups + (3 + groups if caching else 0))
        _untouched(m)


def test_shared_prefixes_are_whole_blocks_each_prompt_shares():
    from specdec.serving import shared_prefixes

    a, b = (1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 4, 5, 9)
    assert shared_prefixes([a, b, (8, 8, 8, 8, 8)], 2) == [a[:4]]  # 5 shared tokens: two blocks of 2
    assert shared_prefixes([a, b], 8) == []  # less than a block
    assert shared_prefixes([a], 3) == [a[:6]]  # a lone prompt: its own whole blocks
    assert shared_prefixes([a, a + (1,), b], 2) == [a[:6], a[:4]]  # each prompt's longest, each once


def test_scratch_cache_within_what_the_managers_cache_leaves(monkeypatch):
    """A warm-up after serving: its scratch prefix cache is bounded by the bytes the manager's
    cache (holding the served prompts' blocks) leaves of their common bound, and the manager's
    cache keeps its blocks and counters."""
    import copy

    import specdec.serving as serving

    prompts, budgets = _shared_prompts()[:4], BUDGETS[:4]
    sd, m = _manager(prefix_caching=True, prefix_block_size=BS)
    _serve(m, prompts, budgets)
    held, stats = m.prefix_cache.nbytes, copy.copy(m.prefix_cache.stats)
    assert held > 0
    made = []
    real = serving.PrefixCache
    monkeypatch.setattr(serving, "PrefixCache", lambda *a: made.append(a) or real(*a))
    m.warmup(prompts[:2])
    assert made == [(BS, m.prefix_cache.max_bytes - held)] * 4  # per round: the prompts alone and in twos; the twos
    assert m.prefix_cache.nbytes == held and m.prefix_cache.stats == stats


def test_warmup_refused_while_the_loop_runs():
    """warmup() while the manager's loop runs, or while another manager of the generator runs,
    raises RuntimeError and runs nothing; the manager serves on, exact."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    other = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=ROWS, eos_token_id=eos)
    with m:
        before = dict(sd.adapter.prompt_graphs.counts)
        with pytest.raises(RuntimeError, match="before start"):
            m.warmup()
        with pytest.raises(RuntimeError, match=r"warmup\(\): this generator's continuous batching manager is running"):
            other.warmup()
        assert sd.adapter.prompt_graphs.counts == before and not m.warmed_up and not other.warmed_up
        rid = m.add_request(prompts[0], max_new_tokens=budgets[0])
        assert m.get_result(rid, timeout=60).generated_tokens == expected[0]
    m.warmup(rounds=1)  # once stop() has ended the loop
    assert m.warmed_up


def test_other_callers_refused_while_a_warmup_runs():
    """While a warm-up runs on one thread (its first pool run held open here), another manager of
    the generator cannot start and the generator's own calls are refused, as while a loop runs;
    afterwards both serve, exact."""
    import threading

    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    other = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=ROWS, eos_token_id=eos)
    inside, go = threading.Event(), threading.Event()
    run = m._run

    def held(pool):
        inside.set()
        assert go.wait(60)
        run(pool)

    m._run = held
    warming = threading.Thread(target=m.warmup, kwargs={"rounds": 1})
    warming.start()
    try:
        assert inside.wait(60)
        with pytest.raises(RuntimeError, match=r"start\(\): this generator's continuous batching manager is running"):
            other.start()
        with pytest.raises(RuntimeError, match="is running"):
            sd.generate(torch.tensor([prompts[0]]), max_new_tokens=2)
    finally:
        go.set()
        warming.join(120)
    m._run = run
    assert m.warmed_up and not other.is_running()
    for manager in (m, other):
        rid = manager.add_request(prompts[0], max_new_tokens=budgets[0])
        with manager:
            assert manager.get_result(rid, timeout=60).generated_tokens == expected[0]


def test_a_generate_call_on_another_thread_holds_the_generator():
    """While generate() runs on one thread (held inside its decode loop here), a manager's
    start() and warmup(), another thread's generate() / generate_batch() and the setters are
    refused; afterwards every call works, exact."""
    import threading

    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    inside, go = threading.Event(), threading.Event()
    decode = sd._decode

    def held(*args, **kwargs):
        inside.set()
        assert go.wait(60)
        return decode(*args, **kwargs)

    sd._decode = held
    out = {}
    caller = threading.Thread(target=lambda: out.update(
        tokens=sd.generate(torch.tensor([prompts[0]]), max_new_tokens=budgets[0], eos_token_id=eos)))
    caller.start()
    try:
        assert inside.wait(60)
        busy = r"another thread \(.*\) is inside this generator's generate\(\) or generate_batch\(\)"
        for call in (m.start, m.warmup, lambda: sd.generate(torch.tensor([prompts[1]]), max_new_tokens=2),
                     lambda: sd.generate_batch([prompts[1]], max_new_tokens=2), sd.release,
                     lambda: setattr(sd, "num_speculative_tokens", 2)):
            with pytest.raises(RuntimeError, match=busy):
                call()
        assert not m.is_running() and not m.warmed_up
    finally:
        go.set()
        caller.join(120)
    sd._decode = decode
    assert out["tokens"][0, len(prompts[0]):].tolist() == expected[0]
    m.warmup(rounds=1)
    rid = m.add_request(prompts[1], max_new_tokens=budgets[1])
    with m:
        assert m.get_result(rid, timeout=60).generated_tokens == expected[1]


def test_a_start_under_way_holds_the_generator(monkeypatch):
    """A start() paused between its check and its loop thread's start (making the pool, held
    here) holds the generator already: another thread's generate() / generate_batch() and the
    other manager's start() and warmup() are refused meanwhile, not run on caches the loop is
    about to use; once it has started, the manager serves exact and the generator is free after
    stop()."""
    import threading

    from specdec import serving

    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    other = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=ROWS, eos_token_id=eos)
    inside, go = threading.Event(), threading.Event()
    make_pool = serving._OpenPool.__init__

    def held(self, *args, **kwargs):
        inside.set()
        assert go.wait(60)
        make_pool(self, *args, **kwargs)

    monkeypatch.setattr(serving._OpenPool, "__init__", held)
    starter = threading.Thread(target=m.start)
    starter.start()
    try:
        assert inside.wait(60)
        running = "this generator's continuous batching manager is running"
        for call in (lambda: sd.generate(torch.tensor([prompts[0]]), max_new_tokens=2),
                     lambda: sd.generate_batch([prompts[0]], max_new_tokens=2), other.start, other.warmup):
            with pytest.raises(RuntimeError, match=running):
                call()
    finally:
        go.set()
        starter.join(120)
    monkeypatch.undo()
    try:
        assert m.is_running() and not other.is_running()
        rid = m.add_request(prompts[0], max_new_tokens=budgets[0])
        assert m.get_result(rid, timeout=60).generated_tokens == expected[0]
    finally:
        m.stop()
    out = sd.generate(torch.tensor([prompts[1]]), max_new_tokens=budgets[1], eos_token_id=eos)
    assert out[0, len(prompts[1]):].tolist() == expected[1]


def test_a_manager_cannot_start_inside_a_generate_call_on_its_thread():
    """A manager's start() or warmup() called from inside the generator's own generate() on the
    same thread (here from a streamer's put) is refused: its loop would decode on the caches the
    call is using. The call goes on exact, and afterwards the manager serves."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    refused = []

    class Streamer:
        def put(self, value):
            for call in (m.start, m.warmup):
                try:
                    call()
                except RuntimeError as err:
                    refused.append(str(err))

        def end(self):
            pass

    out = sd.generate(torch.tensor([prompts[0]]), max_new_tokens=budgets[0], eos_token_id=eos, streamer=Streamer())
    assert out[0, len(prompts[0]):].tolist() == expected[0]
    assert refused and len(refused) % 2 == 0 and all("on the same thread" in r for r in refused), refused
    assert not m.is_running() and not m.warmed_up
    rid = m.add_request(prompts[1], max_new_tokens=budgets[1])
    with m:
        assert m.get_result(rid, timeout=60).generated_tokens == expected[1]


@pytest.mark.parametrize("call", ["start", "warmup"])
def test_a_drafter_set_after_the_manager_is_checked_when_it_starts(call):
    """A drafter that cannot give a row a new request, set on the generator after the manager was
    made, is refused at start() / warmup() with generate_batch's error, before anything runs; with
    a drafter that can, the same manager then serves exact."""
    from specdec.drafters import Drafter

    class PerRow(Drafter):  # keeps per-row state and cannot reset a row
        def propose(self, input_ids, lengths, K):
            raise AssertionError("not reached")

    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager()
    ngram = sd.drafter
    sd.drafter = PerRow()
    before = dict(sd.adapter.prompt_graphs.counts)
    with pytest.raises(ValueError, match="does not support the drafter PerRow"):
        getattr(m, call)()
    assert not m.is_running() and not m.warmed_up and sd.adapter.prompt_graphs.counts == before
    sd.drafter = ngram
    rid = m.add_request(prompts[0], max_new_tokens=budgets[0])
    with m:
        assert m.get_result(rid, timeout=60).generated_tokens == expected[0]


def test_warmup_on_the_eager_path_counts_no_prompt_forwards():
    """On the eager decode path prompt forwards run at their own shapes, not through the buckets
    the counts count: the warm-up still runs its pool runs, and says it counted nothing (None),
    not that none ran."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd, m = _manager(path="eager")
    got = m.warmup(rounds=1)
    assert got["prompt_forwards"] is None and got["pool_runs"] > 0 and m.warmed_up
    assert _serve(m, prompts[:2], budgets[:2])["req_1"].generated_tokens == expected[1]


def test_warmup_with_no_bucket_says_so(caplog):
    """max_batch_tokens below the smallest bucket: the grid is empty, and the warm-up says nothing ran."""
    sd, m = _manager(max_batch_tokens=16)
    with caplog.at_level("WARNING", logger="specdec.serving"):
        out = m.warmup()
    assert out["pool_runs"] == 0 and "nothing ran" in caplog.text


@pytest.mark.parametrize("prompts, err, match", [
    ([], ValueError, "at least one prompt"),
    ([[5, 6], []], ValueError, "warm-up prompt 1 cannot run: empty prompt"),
    ([[5, 6], [7, VOCAB]], ValueError, rf"warm-up prompt 1 cannot run: token ids outside the vocabulary \[0, {VOCAB}"),
    ([[5] * MAX_LENGTH], ValueError, f"warm-up prompt 0 cannot run: .* max_length={MAX_LENGTH}"),
    ([[5, 6], [7.0]], TypeError, "warm-up prompt 1: a prompt must be a list of int token ids"),
    ("5 6 7", TypeError, r"warmup\(prompts=...\) takes None .* or a list of prompts.*got str"),
])
def test_bad_prompts_raise_before_any_work(prompts, err, match):
    """A prompt add_request would fail (or that is no prompt) raises, naming its index; nothing
    runs and the manager is not warmed up; so does a bad ``rounds``."""
    sd, m = _manager()
    before = dict(sd.adapter.prompt_graphs.counts)
    with pytest.raises(err, match=match):
        m.warmup(prompts)
    for rounds, rerr in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(rerr, match="rounds must be"):
            m.warmup(rounds=rounds)
    assert sd.adapter.prompt_graphs.counts == before and not m.warmed_up
    assert m.warmup([[5] * (MAX_LENGTH - 1)], rounds=1)["pool_runs"] == 1  # room for one new token: it runs


def test_oracle_proposes_nothing_for_a_warmup_row():
    """OracleDrafter.admit: a warm-up request (no reference; its index and prompt match none)
    gets its prompt as reference and proposes nothing; the row beside it drafts its request's
    reference; a request that is not a warm-up one with such a prompt is still refused."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    K = 3
    d = OracleDrafter.for_requests(full, acceptance=1.0)
    d.start(target_vocab_size=VOCAB, batch_size=2, device="cpu")
    stranger = tuple(range(3, 3 + len(full[0]) + 5))  # longer than any reference
    warm = Request(0, stranger, 2, warmup=True)
    d.admit(torch.tensor([0, 1]), None, None, None, [Request(1, tuple(prompts[1]), budgets[1]), warm])
    width = len(stranger) + 1
    text = torch.zeros(2, width, dtype=torch.long)
    text[0, :len(full[1])] = torch.tensor(full[1])
    text[1, :len(stranger)] = torch.tensor(stranger)
    lengths = torch.tensor([len(prompts[1]) + 1, len(stranger) + 1])
    drafts, counts = d.propose(text, lengths, K)
    assert counts.tolist() == [K, 0]
    assert drafts[0].tolist() == full[1][len(prompts[1]) + 1:len(prompts[1]) + 1 + K]
    with pytest.raises(ValueError, match="does not start with its prompt"):
        d.admit(torch.tensor([1]), None, None, None, [Request(0, stranger, 2)])


def _serve_warmed(model, path: str, caching: bool, rows: int = ROWS, together: bool = False):
    """Warm a manager of ``model`` with ``rows`` rows on decode ``path`` up with its prompts
    (``caching``: prompts sharing a prefix, through the prefix cache), then serve them one at a
    time (``together``: all queued before the loop starts, so admissions take several at once);
    returns the manager's generator, the warm-up's report, the prompt buckets and counts before
    serving; the tokens are checked against the eager path's on the same model."""
    if caching:
        prompts, budgets, eos = _shared_prompts(), BUDGETS, EOS
        kw = dict(prefix_caching=True, prefix_block_size=BS)
    else:
        prompts, budgets, eos = _reference(FAMILY)[:3]
        kw = {}
    eager = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")
    want = eager.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS)
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path=path)
    m = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=rows, eos_token_id=eos, **kw)
    pg = sd.adapter.prompt_graphs
    got = m.warmup(prompts)
    buckets, counts = set(pg._buckets), dict(pg.counts)
    if together:
        ids = [m.add_request(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
        with m:
            for i, rid in enumerate(ids):
                assert m.get_result(rid, timeout=60).generated_tokens == want[f"req_{i}"].generated_tokens, i
    else:
        with m:
            for i, (p, b) in enumerate(zip(prompts, budgets)):
                out = m.get_result(m.add_request(p, max_new_tokens=b), timeout=60)
                assert out.generated_tokens == want[f"req_{i}"].generated_tokens, i
    if caching:
        assert sd.last_stats.prefix_cache["hit_blocks"] > 0
    return sd, got, buckets, counts


@pytest.mark.parametrize("caching", [False, True])
def test_serving_the_warmed_prompts_meets_no_new_bucket(caching):
    """The static path: serving the prompts warmed up, one at a time as the warm-up ran them,
    runs every prompt forward in a bucket the warm-up made (with the prefix cache: the forwards
    continued from the shared prefix too), exactly."""
    sd, got, buckets, counts = _serve_warmed(get_model(FAMILY), "static", caching)
    pg = sd.adapter.prompt_graphs
    assert set(pg._buckets) == buckets and pg.counts["static"] > counts["static"]
    assert not caching or any(key[2] for key in buckets)  # (a forward continued from restored columns)


@pytest.mark.parametrize("caching", [False, True])
def test_admissions_of_several_warmed_prompts_meet_no_new_bucket(caching):
    """The warm-up runs its prompts in groups of 2, 4 and 8 too after running each alone, so
    serving them all queued before start() (the loop's first admission takes them all, a forward
    of up to 8; later admissions of a pool of 16 rows take up to 2), with the prefix cache
    continued from the cached prefix, meets only its buckets."""
    sd, got, buckets, counts = _serve_warmed(get_model(FAMILY), "static", caching, rows=16, together=True)
    pg = sd.adapter.prompt_graphs
    assert any(key[0] == 2 for key in buckets) and (not caching or any(key[0] == 2 and key[2] for key in buckets))
    assert set(pg._buckets) == buckets and pg.counts["static"] > counts["static"], (set(pg._buckets) - buckets)


def test_requests_after_a_warmed_shared_prefix_meet_no_new_bucket():
    """With the prefix cache, warm-up prompts sharing a system prompt warm every bucket of a
    forward continued after it, rows x new tokens up to max_length (not only their own
    questions' widths); with the grid for forwards from scratch, requests with questions of
    other lengths, one at a time and then queued together, meet only warmed buckets, exactly."""
    g = torch.Generator().manual_seed(11)

    def rand(n):
        return torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()

    system, length = rand(16), 100
    warm = [system + rand(5), system + rand(9)]  # short questions: one width bucket of their own
    traffic = [system + rand(n) for n in (20, 40, 60, 79, 33, 50, 27, 70, 45, 12)]
    budgets = [4, 3, 5, 2, 4, 3, 2, 4, 3, 5]
    eager = specdec.wrap(get_model(FAMILY), drafter="ngram", rollback="replay", num_speculative_tokens=3,
                         decode_path="eager")
    want = eager.generate_batch(traffic, max_new_tokens=budgets, max_batch_size=ROWS)
    sd, m = _manager(rows=16, max_length=length, prefix_caching=True, prefix_block_size=BS)
    m.warmup()
    m.warmup(warm)
    pg = sd.adapter.prompt_graphs
    buckets = set(pg._buckets)
    with m:
        for i, (p, b) in enumerate(zip(traffic[:4], budgets[:4])):
            assert m.get_result(m.add_request(p, max_new_tokens=b), timeout=60).generated_tokens == \
                want[f"req_{i}"].generated_tokens, i
    ids = m.add_requests(traffic[4:], max_new_tokens=budgets[4:])  # queued together: admitted several at once
    with m:
        got = {o.request_id: o for o in m}
    for i, rid in enumerate(ids, 4):
        assert got[rid].generated_tokens == want[f"req_{i}"].generated_tokens, i
    assert sd.last_stats.prefix_cache["hit_blocks"] > 0
    assert set(pg._buckets) == buckets, set(pg._buckets) - buckets


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("caching", [False, True])
def test_serving_the_warmed_prompts_captures_nothing(caching):
    """On CUDA (the CUDA-graph path): after warmup(prompts), serving the same prompts one at a
    time replays every prompt forward's graph: no capture; the tokens are the eager path's."""
    model = get_model(FAMILY).cuda()
    try:
        sd, got, buckets, before = _serve_warmed(model, "cuda_graph", caching)
        pg = sd.adapter.prompt_graphs
        assert pg.error is None and got["prompt_forwards"]["captured"] >= 1, (got, pg.error)
        assert pg.counts["captured"] == before["captured"], (before, pg.counts)
        assert pg.counts["cuda_graph"] > before["cuda_graph"]
    finally:
        get_model(FAMILY).cpu()


@pytest.mark.parametrize("change", ["snapshot", "more_drafts"])
@pytest.mark.parametrize("call", ["start", "warmup"])
def test_settings_needing_more_memory_than_planned_are_refused_when_it_starts(change, call):
    """The pool's rows were sized from the memory a row needed under the settings of
    init_continuous_batching (here ``max_batch_size="auto"`` in a budget): a rollback strategy or
    K set since, under which the rows no longer fit the budget, is refused at start() / warmup()
    before anything runs, with the bytes planned and needed; back to settings that fit, the same
    manager serves exact."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd = specdec.wrap(get_model(FAMILY), drafter="ngram", rollback="replay", num_speculative_tokens=3,
                      decode_path="static")
    m = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size="auto", memory_budget="8MiB",
                                    eos_token_id=eos)
    if change == "snapshot":
        sd.rollback = "snapshot"
    else:
        sd.num_speculative_tokens = 8
    before = dict(sd.adapter.prompt_graphs.counts)
    with pytest.raises(ValueError, match=r"planned at .* per row .* now needs .* more than planned") as err:
        getattr(m, call)()
    assert "init_continuous_batching" in str(err.value)
    assert not m.is_running() and not m.warmed_up and sd.adapter.prompt_graphs.counts == before
    sd.rollback, sd.num_speculative_tokens = "replay", 3
    rid = m.add_request(prompts[0], max_new_tokens=budgets[0])
    with m:
        assert m.get_result(rid, timeout=60).generated_tokens == expected[0]


def test_settings_needing_less_memory_than_planned_serve_exact():
    """A strategy under which a row needs less than planned (snapshot to replay) is fine."""
    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd = specdec.wrap(get_model(FAMILY), drafter="ngram", rollback="snapshot", num_speculative_tokens=3,
                      decode_path="static")
    m = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size="auto", memory_budget="8MiB",
                                    eos_token_id=eos)
    sd.rollback = "replay"
    assert _serve(m, prompts[:2], budgets[:2])["req_1"].generated_tokens == expected[1]


def test_a_setter_racing_start_waits_for_the_claim_and_is_refused():
    """A setter called on another thread while start() checks its memory plan (under the claim)
    waits for the claim to end and is then refused, as the loop runs: it cannot change K after
    start() checked the plan under it."""
    import threading

    from specdec.engine import SpeculativeGenerator

    prompts, budgets, eos, expected, full = _reference(FAMILY)
    sd = specdec.wrap(get_model(FAMILY), drafter="ngram", rollback="replay", num_speculative_tokens=3,
                      decode_path="static")
    m = sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size="auto", memory_budget="8MiB",
                                    eos_token_id=eos)
    seen = {}
    real_check_plan = SpeculativeGenerator._check_plan

    def set_k():
        try:
            sd.num_speculative_tokens = 8
        except RuntimeError as err:
            seen["error"] = err

    def check_plan(self, what, plan, span):
        setter = seen["setter"] = threading.Thread(target=set_k)
        setter.start()
        setter.join(timeout=1.0)
        seen["set_during_the_claim"] = not setter.is_alive()
        return real_check_plan(self, what, plan, span)

    SpeculativeGenerator._check_plan = check_plan
    try:
        m.start()
    finally:
        SpeculativeGenerator._check_plan = real_check_plan
    try:
        seen["setter"].join(timeout=30)
        assert not seen["set_during_the_claim"] and sd.num_speculative_tokens == 3
        assert "manager is running" in str(seen["error"])
        rid = m.add_request(prompts[0], max_new_tokens=budgets[0])
        assert m.get_result(rid, timeout=60).generated_tokens == expected[0]
    finally:
        m.stop()
