"""Serving (``experiment=serve``): a workload of requests of mixed lengths through continuous
batching, against the same drafter in fixed batches and against continuous plain decoding.

The workload (:func:`build_workload`, seeded with ``seed``): ``experiment.requests`` requests,
each with a prompt of ``experiment.prompt_tokens = [min, max]`` tokens and a budget
(``max_new_tokens``) of ``experiment.output_tokens = [min, max]``, both drawn log-uniform
(many short requests, a few long ones); prompts are cut from
the zoo's held-out code prompts (``prompt_source=zoo``: a prompt's last tokens, so it ends where
code continues) or random token ids (``random``: speed does not depend on the text), or come
from a file (``requests_file``: one ``{"prompt_ids": [...]}`` or ``{"prompt": "text"}`` per
line, with an optional ``"max_new_tokens"``; ``"input_ids"`` as the acceptance experiment's
prompt files name it). ``shared_prefix_tokens`` puts one prefix of that many tokens before every
prompt (a system prompt); ``prefix_caching`` runs every continuous run a second time with
``generate_batch(prefix_caching=True)`` (with ``request_rate``: a manager made with
``prefix_caching=True``), which reuses the prefix's state: records with
``prefix_caching`` true carry ``prefix_hit_rate``, ``vs_no_prefix_cache`` (tokens/s) and
``ttft_speedup_vs_no_prefix_cache`` (mean time to first token without / with).

``max_batch_size=auto`` (with ``memory_budget``, e.g. ``40GiB``) lets ``generate_batch`` size each
continuous run's pool for its strategy (:func:`specdec.batching.bytes_per_sequence`: replay fits
more rows than snapshot in one budget); the record's ``batch`` is the rows it chose, and the same
drafter and strategy's fixed batches take that many requests.

Arrivals: with ``request_rate: null`` every request arrives at the start of a run (an offline
batch: time to first token is mostly the wait behind a full pool). With ``request_rate`` (requests
per second) request i arrives at ``Workload.arrivals[i]`` seconds after the run's start, a Poisson
process seeded with ``seed`` (:func:`poisson_arrivals`: exponential gaps of mean ``1 / rate``, the
first at 0; the same arrivals in every run), as vLLM's ``benchmark_serving --request-rate`` and
SGLang's ``bench_serving`` send them: each continuous run is then served by
``sd.init_continuous_batching`` (one manager per pass, its own prefix cache with
``prefix_caching``), a client adding each request at its arrival with ``streaming=True`` and timing
it from there (:func:`_serve_arrivals`: time to first token = the receipt of its first streamed
token - its arrival; its finish = the receipt of its final result); throughput is generated tokens
/ (last finish - first arrival). Fixed batches wait too: a batch starts once its last request has
arrived and the previous batch has ended. Records carry ``request_rate``.

Per target, in this order:

1. continuous plain decoding: ``generate_batch(..., max_batch_size=B)`` with
   ``num_speculative_tokens=0``: the baseline, and each request's greedy output, the reference
   every other run is compared with and the text the oracle drafter proposes;
2. per drafter of ``drafter.names`` (``oracle`` once per ``drafter.oracle_acceptance``:
   :meth:`specdec.drafters.OracleDrafter.for_requests` over the plain outputs) and rollback
   strategy: (i) continuous batching, ``generate_batch`` with ``max_batch_size=B``; (ii) the
   alternative without it: ``generate()`` on fixed batches of B requests in order, left-padded,
   each row ending at its request's budget (``max_new_tokens`` per row: as the request would end
   at EOS; its row then idles) and each batch running until its last row ends.

Timing (:class:`specdec.batching.RequestTiming`): offline continuous runs read each request's times
from ``sd.last_request_timings`` (with ``request_rate``: the client's, above; the loop's idle waits
for arrivals count in its ``Stats.prefill_s``, the ``prefill s`` column); in fixed batches a request
is queued at its arrival and admitted when its batch's
``generate()`` starts, its first token exists after the call's prefill (start +
``Stats.calibration_s + Stats.prefill_s``) and it finishes when the call returns (the caller
gets its tokens then). Per run: throughput (generated tokens / wall, the median of ``repeats``
runs with min-max), time to first token (queue wait + prefill) and time per output token
(``(finished - first token) / (tokens - 1)``) at p50 / p90 / p99 and mean over the requests of
every repeat, the time to first token's two parts likewise (``queue_wait_*``: arrival to
admission; ``admission_to_first_token_*``: the prompt forward and the first token's pick),
``mean_busy_rows`` (rows holding a request, averaged over the run), ``k_histogram`` (the run's
steps by the drafts they asked for: all at K for a fixed K; ``num_speculative_tokens=auto`` chooses
per step) and its mean ``mean_k``, the ratios
``vs_fixed_batches`` / ``vs_continuous_plain`` (throughput over theirs; a run with the prefix cache
over continuous plain decoding with it, so the ratio is speculation's alone, and over no fixed-batch
run, which has no cache), ``exact`` / ``diverged_requests`` / ``diverged_request_ids`` against
continuous plain decoding's tokens, with each diverged request's ``first_divergence`` and plain
decoding's logit margin there (``divergence_margins``, ``near_tie``: :func:`_divergence_fields`)
and, for continuous runs, ``prompt_forwards_cuda_graph`` / ``_captured`` / ``_static`` / ``_eager``: the timed
passes' prompt forwards replayed as a captured bucket, captured then replayed (a bucket's second
use: it pays the capture), run at a bucket's shape uncaptured (a bucket's first use), or run
eagerly because no bucket held them (:mod:`specdec.models.prompt_graphs`; on the
eager decode path no prompt forward is counted). One short untimed call
per configuration first when ``experiment.warmup`` (on the shortest prompts: it compiles the
kernels for the pool's size; the CUDA graphs of a run's KV length are captured inside the timed
run: once in a continuous run, once per length bucket in fixed batches), and one untimed prefill of
each group size (rows per prefill forward) a run's admissions or fixed batches will use that the
model has not met yet, over the workload's prompts (:func:`_warm_prefill`: kernels that compile
or autotune per prompt shape do so there, not in whichever timed run meets the shape first).
With ``experiment.rehearse`` each continuous run passes over the whole workload untimed before
its timed passes, again while a pass met a prompt bucket it left uncaptured (at most
:data:`MAX_REHEARSALS` passes, counted in the records' ``rehearsals``): the prompt forwards'
buckets (captured as CUDA graphs on their second use, :mod:`specdec.models.prompt_graphs`) are
then captured, as in a server that has run a while; without it a short run pays a capture per
bucket it meets. With
``experiment.manager_warmup`` (and ``request_rate``) each pass's manager runs
:meth:`~specdec.serving.ContinuousBatchingManager.warmup` before ``start()``, untimed, as a server
would before taking traffic: the grid of every bucket of a forward from scratch its admissions can meet, then, with
``prefix_caching``, the workload's first :data:`MANAGER_WARMUP_PROMPTS` prompts (a server warming
with its system prompt: the forwards continued from the shared prefix are captured too); records
carry ``manager_warmup`` and the timed passes' warm-ups summed, ``manager_warmup_s`` and
``manager_warmup_prompt_forwards_cuda_graph`` / ``_captured`` / ``_static`` / ``_eager`` (not
counted in ``prompt_forwards_*``). Records go to ``results.jsonl`` as measured; ``summary.md``
has the table, ``serve_latency.png`` the figures.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from ..batching import (DEFAULT_MAX_BATCH_TOKENS, GenerationOutput, Request, RequestPool, RequestStatus, RequestTiming,
                        admission_rows, left_pad)
from ..prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache
from ..settings import context_length
from .common import RunRecords, apply_cpu_threads, common_fields, make_drafter, progress_bar
from .models import load_target, resolve_device
from .prompts import check_token_ids, json_objects
from .report import SERVE_PERCENTILES, write_report

__all__ = ["Workload", "build_workload", "load_requests", "poisson_arrivals", "run", "SERVE_DRAFTERS"]

#: drafters the serving comparison runs (continuous batching needs Drafter.admit or a stateless drafter;
#: one that lacks it is refused by generate_batch, and the refusal is recorded)
SERVE_DRAFTERS = ("ngram", "oracle", "mtp")
#: new tokens per request of a warm-up call (on the shortest prompts: it compiles the kernels of the pool's size)
WARMUP_TOKENS = 4
#: requests of the warm-up call with ``max_batch_size="auto"`` (the shortest ones)
WARMUP_REQUESTS = 8
#: the most untimed passes over the workload ``experiment.rehearse`` makes before a continuous run's
#: timed passes: it passes again while the last pass met a prompt bucket it did not capture (met
#: once: the timed pass would capture it)
MAX_REHEARSALS = 3
#: the workload's first prompts a manager's warm-up runs with prefix caching (``experiment.manager_warmup``)
MANAGER_WARMUP_PROMPTS = 8


@dataclass(frozen=True)
class Workload:
    """The requests of a run: ``prompts`` (token-id lists, the shared prefix included) and their
    ``budgets`` (``max_new_tokens``); ``source`` says where the prompts came from."""

    prompts: list[list[int]]
    budgets: list[int]
    source: str
    shared_prefix_tokens: int = 0
    #: requests per second of the arrivals (None: every request at the start)
    request_rate: float | None = None
    #: request i's arrival, seconds after the run's start (non-decreasing, the first 0), or None
    arrivals: tuple[float, ...] | None = None

    def arriving(self, request_rate: float | None, seed: int) -> Workload:
        """This workload with the requests arriving at ``request_rate`` per second
        (:func:`poisson_arrivals` seeded with ``seed``); None: every request at the start."""
        arrivals = None if request_rate is None else poisson_arrivals(len(self.prompts), request_rate, seed)
        return replace(self, request_rate=request_rate, arrivals=arrivals)

    def requests(self) -> list[Request]:
        """The requests as the engine's pool holds them (``req_i`` is request i)."""
        return [Request(i, tuple(p), b) for i, (p, b) in enumerate(zip(self.prompts, self.budgets))]

    def shortest(self, n: int) -> list[int]:
        """The indices of the ``n`` shortest prompts (a warm-up's requests: a full pool, little prefill)."""
        return sorted(range(len(self.prompts)), key=lambda i: len(self.prompts[i]))[:n]

    def fields(self) -> dict:
        """The workload's record fields: its source, size, arrival rate and length statistics."""
        lens = [len(p) for p in self.prompts]
        return {"requests": len(self.prompts), "prompt_source": self.source, "request_rate": self.request_rate,
                "shared_prefix_tokens": self.shared_prefix_tokens,
                "prompt_tokens_mean": sum(lens) / len(lens), "prompt_tokens_max": max(lens),
                "max_new_tokens_mean": sum(self.budgets) / len(self.budgets), "max_new_tokens": max(self.budgets)}


def poisson_arrivals(n: int, request_rate: float, seed: int) -> tuple[float, ...]:
    """The arrival times (seconds from the start) of ``n`` requests of a Poisson process of
    ``request_rate`` requests per second, the first at 0: the gaps between arrivals are drawn
    exponential with mean ``1 / request_rate`` from a ``torch.Generator`` seeded with ``seed``
    (as vLLM's ``benchmark_serving --request-rate`` and SGLang's ``bench_serving`` send requests).

    Raises: ValueError for ``n < 1`` or a rate that is not a finite number > 0."""
    if n < 1 or not 0 < request_rate < math.inf:
        raise ValueError(f"poisson_arrivals needs n >= 1 and 0 < request_rate < inf, got n={n}, "
                         f"request_rate={request_rate}")
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n - 1, dtype=torch.float64).exponential_(request_rate, generator=g)
    return (0.0, *torch.cumsum(gaps, 0).tolist())


def _log_uniform(n: int, bounds, g: torch.Generator) -> list[int]:
    """``n`` ints in ``[lo, hi]`` drawn log-uniform (``exp(U(log lo, log(hi + 1)))``, floored)."""
    lo, hi = int(bounds[0]), int(bounds[1])
    u = torch.rand(n, generator=g, dtype=torch.float64)
    x = torch.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo))).floor().clamp(lo, hi)
    return [int(v) for v in x]


def load_requests(path: str | Path, tok, limit: int | None = None) -> list[tuple[list[int], int | None]]:
    """``(prompt ids, max_new_tokens or None)`` per line of a JSON-lines workload file: each line
    an object with ``"prompt_ids"`` (or ``"input_ids"``: a non-empty list of ints >= 0) or
    ``"prompt"`` (text, encoded with ``tok``), and optionally ``"max_new_tokens"`` (an int >= 1);
    blank lines skipped; the first ``limit`` requests.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not such an object (the message names the line), or no requests.
    """
    out: list[tuple[list[int], int | None]] = []
    example = '{"prompt_ids": [...], "max_new_tokens": 64} or {"prompt": "..."}'
    for _, where, obj in json_objects(path, "experiment.requests_file", example):
        key = "prompt_ids" if "prompt_ids" in obj else "input_ids" if "input_ids" in obj else None
        if key is not None:
            ids = check_token_ids(obj[key], where, key)
        elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
            ids = list(tok(obj["prompt"]).input_ids)
        else:
            raise ValueError(f'{where}: needs "prompt_ids" (token ids) or a non-empty "prompt" string; keys: '
                             f"{sorted(obj)}")
        budget = obj.get("max_new_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f'{where}: "max_new_tokens" must be an int >= 1, got {budget!r}')
        out.append((ids, budget))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"experiment.requests_file={path}: the file holds no requests")
    return out


def build_workload(exp, tok, vocab_size: int, seed: int, max_positions: int | None = None) -> Workload:
    """The workload of ``experiment`` (see the module docstring), seeded with ``seed``.

    Raises: ValueError when a drawn length exceeds the longest zoo prompt, a token id is outside
    ``[0, vocab_size)``, or prompt + budget exceeds ``max_positions`` (the model's context)."""
    g = torch.Generator().manual_seed(seed)
    n = int(exp.requests)
    prefix_len = int(exp.shared_prefix_tokens)
    if exp.requests_file:
        given = load_requests(str(exp.requests_file), tok, limit=n)
        drawn = _log_uniform(len(given), exp.output_tokens, g)
        own = [ids for ids, _ in given]
        budgets = [b if b is not None else d for (_, b), d in zip(given, drawn)]
        source = "file"
    else:
        lengths = _log_uniform(n, exp.prompt_tokens, g)
        budgets = _log_uniform(n, exp.output_tokens, g)
        source = str(exp.prompt_source)
    high = min(int(vocab_size), 8192)  # (the zoo tokenizer's ids; random ids as experiment=bench draws them)
    if source == "zoo":
        from .. import zoo

        pool = [list(tok(p["prompt"]).input_ids) for p in zoo.prompts("all")]
        longest = max(len(p) for p in pool)
        need = max([prefix_len] + ([] if exp.requests_file else lengths))
        if need > longest:
            raise ValueError(f"the zoo's prompts have at most {longest} tokens; experiment.prompt_tokens and "
                             f"experiment.shared_prefix_tokens must not exceed it (or use prompt_source=random)")
        prefix = max(pool, key=len)[:prefix_len]
        own = []
        for L in lengths:  # the last L tokens of a prompt that long (it ends where the code continues)
            fits = [p for p in pool if len(p) >= L]
            own.append(fits[int(torch.randint(len(fits), (1,), generator=g))][-L:])
    else:
        prefix = torch.randint(10, high, (prefix_len,), generator=g).tolist()
        if source == "random":
            own = [torch.randint(10, high, (L,), generator=g).tolist() for L in lengths]
    prompts = [prefix + p for p in own]
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {i}: token ids outside the model's vocabulary [0, {vocab_size}): {bad[:5]}")
        if max_positions is not None and len(p) + b > max_positions:
            raise ValueError(f"request {i}: prompt ({len(p)} tokens) + max_new_tokens ({b}) exceeds the model's "
                             f"context (max_position_embeddings={max_positions}); lower experiment.prompt_tokens, "
                             "output_tokens or shared_prefix_tokens")
    return Workload(prompts, budgets, source, prefix_len)


@dataclass
class RunResult:
    """One run of the workload: each request's ``tokens`` (last repeat), ``samples`` (a request's
    timing and token count, over every repeat), the ``walls`` (seconds per repeat), ``stats``
    (:class:`specdec.Stats` of every call of the last repeat), or the ``error`` that stopped it."""

    tokens: list[list[int]] = field(default_factory=list)
    samples: list[tuple[RequestTiming, int]] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    stats: list = field(default_factory=list)
    error: str | None = None
    #: prompt forwards of the timed passes by how they ran (:attr:`PromptGraphs.counts`)
    prompt_forwards: dict | None = None
    #: the timed passes' manager warm-ups, summed: ``{"prompt_forwards": {...}, "seconds": s}``, or None
    manager_warmup: dict | None = None
    #: untimed passes over the workload before the timed ones (``experiment.rehearse``)
    rehearsals: int = 0


def _timed(calls, repeats: int, device, arrivals: bool = False) -> RunResult:
    """Run ``calls()`` (returns ``(tokens, samples, stats)`` of one pass over the workload)
    ``repeats`` times through :func:`.timing.time_runs`; a ValueError (a setting the engine
    refuses, checked before any work) becomes the result's ``error``. A pass's wall is the
    call's; with ``arrivals`` (requests arriving over the pass) from the first request's arrival
    to the last one's finish (the client's view: no setup or shutdown around them)."""
    from .timing import time_runs

    res = RunResult()
    spans = []

    def once():
        res.tokens, samples, res.stats = calls()
        res.samples += samples
        spans.append(max(t.finished for t, _ in samples) - min(t.queued for t, _ in samples))

    try:
        wall, _ = time_runs(once, repeats, device)
    except ValueError as err:
        return RunResult(error=str(err))
    res.walls = spans if arrivals else list(wall.samples)
    return res


def _continuous(sd, work: Workload, B, prefix_block: int | None, device, repeats: int, warmup: bool,
                drafter_for=None, memory_budget=None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                warmed: set | None = None, rehearse: bool = False, manager_warmup: bool = False) -> RunResult:
    """``sd.generate_batch`` over the workload with ``max_batch_size=B`` (an int, or ``"auto"``
    with ``memory_budget``: the rows the call chose are in its ``Stats.max_batch_size``),
    ``max_batch_tokens`` and,
    given ``prefix_block`` (tokens per block), prefix caching; ``drafter_for(indices)`` gives the
    drafter of a call over those requests (None: keep ``sd``'s). With ``warmup`` and ``warmed``
    (the model's prefill shapes warmed so far), :func:`_warm_prefill` of every admission's row
    count (:func:`_admission_sizes`; through a prefix cache with ``prefix_block``) after the
    warm-up call. With ``rehearse``, untimed passes over the whole workload before the timed
    ones, until a pass leaves no bucket it met first uncaptured (:meth:`PromptGraphs.pending
    <specdec.models.prompt_graphs.PromptGraphs.pending>`; at most :data:`MAX_REHEARSALS`): the
    prompt forwards' buckets the workload meets are captured then, as in a server that has run a
    while. The result's ``rehearsals`` counts the passes. With ``manager_warmup`` and arrivals,
    each pass's manager warms up first (:func:`_serve_arrivals`); the timed passes' warm-ups are
    summed in the result's ``manager_warmup``, their prompt forwards left out of ``prompt_forwards``."""
    kw = {"max_batch_size": B, "max_batch_tokens": max_batch_tokens, **({"memory_budget": memory_budget} if memory_budget is not None else {}),
          **({"prefix_caching": True, "prefix_block_size": prefix_block} if prefix_block is not None else {})}

    warmups = [] if manager_warmup and work.arrivals is not None else None  # each pass's warm-up counts

    def calls():
        if work.arrivals is not None:
            return _serve_arrivals(sd, work, kw, warmups)
        out = sd.generate_batch(work.prompts, max_new_tokens=work.budgets, **kw)
        tokens = [out[f"req_{i}"].generated_tokens for i in range(len(work.prompts))]
        times = sd.last_request_timings
        return tokens, [(times[f"req_{i}"], len(t)) for i, t in enumerate(tokens)], [sd.last_stats]

    if warmup:
        idx = work.shortest(B if isinstance(B, int) else WARMUP_REQUESTS)
        if drafter_for is not None:
            sd.drafter = drafter_for(idx)
        try:
            sd.generate_batch([work.prompts[i] for i in idx], max_new_tokens=WARMUP_TOKENS, **kw)
        except ValueError as err:
            return RunResult(error=str(err))
        if warmed is not None:
            _warm_prefill(sd, work, _admission_sizes(sd, work, B, max_batch_tokens, memory_budget,
                                                     prefix_block is not None), max_batch_tokens,
                          warmed, prefix_block)
    if drafter_for is not None:
        sd.drafter = drafter_for(list(range(len(work.prompts))))
    passes = 0
    if rehearse:  # a server in its steady state: the prompt buckets this workload meets are captured
        graphs = sd.adapter.prompt_graphs
        while passes < MAX_REHEARSALS:
            known = graphs.pending()
            try:
                calls()
            except ValueError as err:
                return RunResult(error=str(err))
            passes += 1
            if not graphs.pending() - known:  # no bucket this pass met first waits for its capture
                break
        else:
            print(f"specdec-run: after {passes} rehearsal passes a prompt bucket met in the last one still waits for "
                  "its capture; the timed pass may capture it", flush=True)
    before = dict(sd.adapter.prompt_graphs.counts)
    if warmups is not None:
        warmups.clear()  # (the rehearsal's)
    res = _timed(calls, repeats, device, arrivals=work.arrivals is not None)
    res.rehearsals = passes
    res.prompt_forwards = {k: v - before[k] for k, v in sd.adapter.prompt_graphs.counts.items()}
    if warmups:
        # (None on the eager decode path, where prompt forwards are not counted: 0s, as in prompt_forwards)
        warm = {k: sum((w["prompt_forwards"] or {}).get(k, 0) for w in warmups) for k in res.prompt_forwards}
        res.prompt_forwards = {k: v - warm[k] for k, v in res.prompt_forwards.items()}
        res.manager_warmup = {"prompt_forwards": warm, "seconds": sum(w["seconds"] for w in warmups)}
    return res


def _serve_arrivals(sd, work: Workload, kw: dict, warmups: list | None = None):
    """One pass over ``work`` as a client of a server: a new manager (``sd.init_continuous_batching
    (**kw)``, ``max_length`` the longest prompt + the largest budget; so a new prefix cache) is
    made; given ``warmups`` (a list), it warms up first
    (:meth:`~specdec.serving.ContinuousBatchingManager.warmup`: the grid, then with prefix caching
    the workload's first :data:`MANAGER_WARMUP_PROMPTS` prompts), each warm-up's returned
    ``{"prompt_forwards": ..., "seconds": ...}`` appended there; then it is started, request
    i added (``add_request(..., request_id="req_i", streaming=True)``) at its arrival
    ``work.arrivals[i]`` after the pass's start, and the results taken as they come; one
    thread adds and takes (it waits for a result until the next arrival, or sleeps until then
    while no request is in flight). Each request's times are the client's: ``queued`` = its
    arrival (the scheduled time: a late add counts in its wait), ``first_token`` = the receipt
    of its first result holding a token (partial or final), ``finished`` = the receipt of its
    final result; ``admitted`` is the pool's (the output's ``lifespan[0]``, the same clock).
    The manager is stopped after the last result (``last_stats`` then describes the pass). With
    ``max_batch_size="auto"`` its rows are planned as ``generate_batch`` plans them, at most one
    per request of ``work`` (as the warm-up predicted them); a manager left to plan them alone
    counts no requests: up to :data:`~specdec.batching.MAX_AUTO_BATCH_SIZE` rows, idle ones
    decoded too.

    Returns: ``(tokens, samples, [sd.last_stats])`` as the offline pass's.

    Raises: RuntimeError when a request fails (its ``error``) or the loop ends before every
    request finished."""
    n = len(work.prompts)
    span = RequestPool.span_of(work.requests())
    plan = _pool_plan(sd, work, "auto", kw.get("memory_budget"), kw.get("prefix_caching", False)) \
        if kw["max_batch_size"] == "auto" else None
    manager = sd.init_continuous_batching(max_length=span, **{**kw, **({"max_batch_size": plan.rows} if plan else {})})
    if warmups is not None:  # as a server before taking traffic (untimed: before the pass's start)
        warmups.append(manager.warmup())
        if manager.prefix_cache is not None:
            warmups.append(manager.warmup(work.prompts[:MANAGER_WARMUP_PROMPTS]))
    final: dict[int, GenerationOutput] = {}
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    manager.start()
    try:
        start = time.perf_counter()
        due = [start + a for a in work.arrivals]
        sent = 0
        while len(final) < n:
            now = time.perf_counter()
            while sent < n and due[sent] <= now:
                manager.add_request(work.prompts[sent], request_id=f"req_{sent}", max_new_tokens=work.budgets[sent],
                                    streaming=True)
                sent += 1
            out = manager.get_result(timeout=None if sent == n else due[sent] - now)
            received = time.perf_counter()
            if out is None:
                if sent == n:
                    raise RuntimeError(f"the continuous batching loop ended with {n - len(final)} requests unfinished")
                time.sleep(max(0.0, due[sent] - received))  # (nothing in flight: get_result did not wait)
                continue
            i = int(out.request_id.removeprefix("req_"))
            if out.status == RequestStatus.FAILED:
                raise RuntimeError(f"{out.request_id} failed: {out.error}")
            if out.generated_tokens:
                first.setdefault(i, received)
            if out.status == RequestStatus.FINISHED:
                final[i], done[i] = out, received
    finally:
        manager.stop(hard_stop=len(final) < n)
    tokens = [final[i].generated_tokens for i in range(n)]
    samples = [(RequestTiming(start + work.arrivals[i], final[i].lifespan[0], first[i], done[i]), len(tokens[i]))
               for i in range(n)]
    if plan is not None:  # (the manager was given the planned rows as an int)
        sd.last_stats.batch_size_reason = plan.reason
    return tokens, samples, [sd.last_stats]


def _warm_prefill(sd, work: Workload, sizes, max_batch_tokens: int, warmed: set,
                  prefix_block: int | None = None) -> None:
    """Prefill, untimed, one forward of each row count in ``sizes`` not yet in ``warmed`` (then
    added to it), of the workload's own prompts: the ``b`` rows are ``b`` prompts short enough to
    run in one forward of at most ``max_batch_tokens`` padded tokens (as any ``b``-row forward's
    are), taken by length just below the ``b / max(sizes)`` quantile of those (the largest count
    gets the longest that fit); where fewer than ``b`` prompts fit (the pool's one-token
    placeholder rows), the ``b`` shortest cut to ``max_batch_tokens // b`` tokens.

    A prefill compiles or autotunes kernels per shape the first time it meets it
    (flash-linear-attention autotunes some per batch size or token-count bucket: about 10 s each
    for Qwen3.5's GDN on an H200). A warm-up call on the shortest prompts meets few of those
    shapes; without this the first timed run of a model would pay for every later run's kernels.
    With ``prefix_block`` (a prefix-caching run's block size) the forwards are those of a prefix
    cache instead, which run other kernels (prompts continued from a saved state): each group is
    prefilled through a fresh :class:`~specdec.prefix_cache.PrefixCache` first cut at the block
    boundary nearest its middle (stored), then whole (continued from there); ``warmed`` holds
    ``("cached", b)`` for those. The later chunks of a prompt longer than ``max_batch_tokens``
    are not warmed.
    """
    from ..rollback.inplace import InPlaceUpdate

    ad = sd.adapter
    sd.release()  # the warm-up call's pool and graphs: the largest group below needs the pool's memory
    by_length = sorted(work.prompts, key=len)
    sizes = sorted({int(b) for b in sizes if int(b) >= 1})
    for b in sizes:
        key = b if prefix_block is None else ("cached", b)
        if key in warmed or b > min(len(by_length), max_batch_tokens):
            continue
        warmed.add(key)
        fits = [p for p in by_length if len(p) * b <= max_batch_tokens]
        if len(fits) >= b:
            start = max(0, b * len(fits) // sizes[-1] - b)
            prompts = fits[start:start + b]
        else:
            prompts = [p[:max_batch_tokens // b] for p in by_length[:b]]
        if prefix_block is None:
            passes, prefix_cache = [prompts], None
        else:  # stored up to a block boundary, then continued from it
            cut = [len(p) // 2 // prefix_block * prefix_block for p in prompts]
            passes, prefix_cache = [[p[:c] for p, c in zip(prompts, cut) if c], prompts], PrefixCache(prefix_block)
        for group in passes:
            if not group:
                continue
            ids, mask = left_pad(group, ad.device)
            # plain decoding's strategy: the states alone, no rollback store (a snapshot store of the
            # pool's row count doubled this cache and did not fit beside the model on an 80 GB GPU)
            cache = ad.new_cache(len(group), ids.shape[1] + 8, 1, InPlaceUpdate())
            ad.prefill(ids, mask, cache, max_tokens=max_batch_tokens, prefix_cache=prefix_cache)
            del cache


def _pool_plan(sd, work: Workload, B, memory_budget, prefix_caching: bool):
    """The pool ``sd.generate_batch`` plans for ``work`` with ``max_batch_size=B``, ``memory_budget``
    and ``prefix_caching`` (its cache's default byte bound set aside), as the call plans it."""
    requests = work.requests()
    return sd._plan_pool(B, memory_budget, RequestPool.span_of(requests), len(requests),
                         DEFAULT_PREFIX_CACHE_BYTES if prefix_caching else 0)


def _admission_sizes(sd, work: Workload, B, max_batch_tokens: int, memory_budget,
                     prefix_caching: bool = False) -> set[int]:
    """The row counts of the prefill forwards of a continuous run: the pool's rows (its one-token
    placeholders), :meth:`RequestPool.take` of its first requests (up to its rows, within
    ``max_batch_tokens``: predicted with the pool's own selection), then 1 .. ``admission_rows``.
    ``B``: ``max_batch_size`` (``"auto"`` with ``memory_budget``: planned as the call plans it,
    :func:`_pool_plan`)."""
    requests = work.requests()
    rows = _pool_plan(sd, work, B, memory_budget, prefix_caching).rows
    pool = RequestPool(requests, rows, max_batch_tokens=max_batch_tokens)
    first = len(pool.take(range(rows), at_most=rows))
    return {rows, first, *range(1, admission_rows(rows) + 1)}


def _fixed_groups(work: Workload, B: int, max_batch_tokens: int) -> set[int]:
    """The rows per prefill forward of ``generate()`` on the workload's fixed batches of ``B``
    (:func:`specdec.models.base.prefill_groups` of each batch)."""
    from ..models.base import prefill_groups

    sizes = set()
    for lo in range(0, len(work.prompts), B):
        _, mask = left_pad(work.prompts[lo:lo + B], "cpu")
        groups = prefill_groups(mask, max_batch_tokens)
        sizes |= {mask.shape[0]} if groups is None else {len(g) for g in groups}
    return sizes


def _own_tokens(new: list[int], budget: int, eos: set[int]) -> list[int]:
    """A request's tokens in a fixed batch's row: its own budget's, up to and including EOS."""
    new = new[:budget]
    cut = next((j for j, t in enumerate(new) if t in eos), None)
    return new if cut is None else new[:cut + 1]


def _fixed(sd, work: Workload, B: int, pad: int, eos: set[int], device, repeats: int, warmup: bool,
           drafter_for=None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
           warmed: set | None = None) -> RunResult:
    """``sd.generate()`` on fixed batches of ``B`` requests in order (left-padded), each row ending
    at its request's budget (``max_new_tokens`` per row, as a request would end at EOS) and the
    batch running until its last row ends, its prefill forwards within ``max_batch_tokens``;
    ``drafter_for(indices)`` gives the batch's drafter (None: keep ``sd``'s). With ``warmup``, a
    warm-up call on the shortest prompts, and given ``warmed``, :func:`_warm_prefill` of the
    batches' prefill group sizes."""
    sd.max_batch_tokens = max_batch_tokens
    N = len(work.prompts)
    batches = [list(range(lo, min(N, lo + B))) for lo in range(0, N, B)]

    def one(idx: list[int], budget: int | None = None):
        if drafter_for is not None:
            sd.drafter = drafter_for(idx)
        ids, mask = left_pad([work.prompts[i] for i in idx], device)
        budgets = [budget or work.budgets[i] for i in idx]  # each row ends at its own budget, as at EOS
        return ids.shape[1], sd.generate(ids, attention_mask=mask, max_new_tokens=budgets, pad_token_id=pad)

    arrivals = work.arrivals if work.arrivals is not None else (0.0,) * N

    def calls():
        begin = time.perf_counter()
        tokens, samples, stats = [], [], []
        for idx in batches:  # (a batch starts once its last request arrived and the previous one ended)
            time.sleep(max(0.0, begin + arrivals[idx[-1]] - time.perf_counter()))
            start = time.perf_counter()
            width, out = one(idx)
            end = time.perf_counter()  # (generate() returned its Stats: the device is done)
            st = sd.last_stats
            first = start + st.calibration_s + st.prefill_s
            for i, new in zip(idx, out[:, width:].tolist()):
                tokens.append(_own_tokens(new, work.budgets[i], eos))
                samples.append((RequestTiming(begin + arrivals[i], start, first, end), len(tokens[-1])))
            stats.append(st)
        return tokens, samples, stats

    if warmup:
        one(work.shortest(B), WARMUP_TOKENS)
        if warmed is not None:
            _warm_prefill(sd, work, _fixed_groups(work, B, max_batch_tokens), max_batch_tokens, warmed)
    return _timed(calls, repeats, device, arrivals=work.arrivals is not None)


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (linear interpolation, as numpy's default) of ``values``; None if empty."""
    return float(torch.tensor(values, dtype=torch.float64).quantile(q)) if values else None


def _latency_fields(name: str, values_ms: list[float]) -> dict:
    """``<name>_p50_ms``, ``_p90_ms``, ``_p99_ms`` and ``_mean_ms`` of ``values_ms``."""
    out = {f"{name}_p{p}_ms": _quantile(values_ms, p / 100) for p in SERVE_PERCENTILES}
    out[f"{name}_mean_ms"] = sum(values_ms) / len(values_ms) if values_ms else None
    return out


def _run_fields(res: RunResult, reference: list[list[int]] | None) -> dict:
    """A run's record fields (see the module docstring)."""
    from .timing import Timing

    if res.error is not None:
        return {"error": res.error, "exact": None}
    generated = sum(len(t) for t in res.tokens)
    wall = Timing(tuple(res.walls))
    ttft = [1e3 * t.time_to_first_token for t, _ in res.samples]
    tpot = [1e3 * (t.finished - t.first_token) / (n - 1) for t, n in res.samples if n >= 2]
    def summed(name: str) -> list[int]:  # a histogram of the run's calls, bin by bin
        return [sum(col) for col in itertools.zip_longest(*(getattr(st, name) for st in res.stats), fillvalue=0)]

    hist, k_hist = summed("accept_histogram"), summed("k_histogram")
    steps = sum(st.steps for st in res.stats)
    row_steps = sum(hist)
    accepted = sum(st.accepted_tokens for st in res.stats)
    proposed = sum(st.proposed_tokens for st in res.stats)
    diverged = None if reference is None else [i for i, (a, b) in enumerate(zip(res.tokens, reference)) if a != b]
    return {
        "error": None, "generated_tokens": generated,
        **wall.fields("wall_s"), **wall.rate(generated).fields("tokens_per_s"),
        **_latency_fields("ttft", ttft), **_latency_fields("tpot", tpot),
        **_latency_fields("queue_wait", [1e3 * (t.admitted - t.queued) for t, _ in res.samples]),
        **_latency_fields("admission_to_first_token", [1e3 * (t.first_token - t.admitted) for t, _ in res.samples]),
        "ttft_ms_samples": ttft, "tpot_ms_samples": tpot,
        "mean_busy_rows": sum(t.finished - t.admitted for t, _ in res.samples) / sum(res.walls),
        "steps": steps, "k_histogram": k_hist,
        "mean_k": sum(k * n for k, n in enumerate(k_hist)) / steps if steps else None,
        **_time_split(res.stats),
        "mean_accepted_tokens": (accepted + row_steps) / row_steps if row_steps else None,
        "acceptance_rate": accepted / proposed if proposed else None, "accept_histogram": hist,
        "decode_path": res.stats[-1].decode_path, "capture_error": res.stats[-1].capture_error,
        **{f"prompt_forwards_{k}": v for k, v in (res.prompt_forwards or {}).items()},
        "rehearsals": res.rehearsals,
        **({} if res.manager_warmup is None else {
            "manager_warmup_s": res.manager_warmup["seconds"],
            **{f"manager_warmup_prompt_forwards_{k}": v for k, v in res.manager_warmup["prompt_forwards"].items()}}),
        "rollback_used": res.stats[-1].rollback,
        **_prefix_fields(res.stats),
        "exact": None if diverged is None else not diverged,
        "diverged_requests": None if diverged is None else len(diverged), "diverged_request_ids": diverged,
    }


def _divergence_fields(model, prompts: list[list[int]], reference: list[list[int]], tokens: list[list[int]],
                       diverged: list[int] | None) -> dict:
    """Where each diverged request's tokens first differ from continuous plain decoding's
    (``first_divergence``: its index among the request's new tokens) and plain decoding's top-2
    logit margin there (``divergence_margins``: :func:`specdec.experiments.e2e.divergence_margins`
    over the request's prompt and plain tokens; None where one of the two had already ended), and
    ``near_tie``: every margin < :data:`~specdec.experiments.acceptance.NEAR_TIE_MARGIN` in
    bf16/fp16, the only divergence the exactness contract allows (None without divergences)."""
    from .acceptance import HALF_DTYPES, NEAR_TIE_MARGIN, first_divergence
    from .e2e import divergence_margins

    if not diverged:
        return {"first_divergence": None if diverged is None else [], "divergence_margins": None if diverged is None
                else [], "near_tie": None}
    dev = next(model.parameters()).device
    positions, margins = [], []
    for i in diverged:
        plain = torch.tensor([prompts[i] + reference[i]], device=dev)
        pos = first_divergence(torch.tensor([tokens[i]]), torch.tensor([reference[i]]))
        positions.append(pos)
        if pos >= min(len(tokens[i]), len(reference[i])):  # one of the two had already ended
            margins.append(None)
            continue
        ones = torch.ones(1, len(prompts[i]), dtype=torch.long, device=dev)
        margins.append(divergence_margins(model, plain, ones, [0], [pos], len(prompts[i]))[0])
    near_tie = all(m is not None and m < NEAR_TIE_MARGIN for m in margins) and model.dtype in HALF_DTYPES
    return {"first_divergence": positions, "divergence_margins": margins, "near_tie": near_tie}


def _time_split(stats) -> dict:
    """Where a run's calls spent their time (``Stats`` of each call, summed): ``admission_s``
    (prefills: the first requests' and every admission's), ``step_ms`` (draft + verify + commit
    per decode step) and ``other_s`` (the rest of the calls' wall time: host bookkeeping between
    steps, calibration, graph captures)."""
    wall = sum(st.wall_s for st in stats)
    admission = sum(st.prefill_s for st in stats)
    steps = sum(st.steps for st in stats)
    step_s = sum(st.draft_s + st.verify_s + st.rollback_s for st in stats)
    return {"admission_s": admission, "step_ms": 1e3 * step_s / steps if steps else None,
            "other_s": wall - admission - step_s}


def _prefix_fields(stats) -> dict:
    """The prefix cache's counters summed over a run's calls (None without caching):
    ``prefix_hit_tokens`` (prompt tokens whose state was reused), ``prefix_hit_rate`` (their share
    of the prompt tokens looked up), ``prefix_forwards_per_prompt`` (prefill forwards per prompt
    looked up) and ``prefix_cache_stored_mib`` (the cache's size at the end)."""
    counters = [st.prefix_cache for st in stats if st.prefix_cache is not None]
    if not counters:
        return {"prefix_hit_tokens": None, "prefix_hit_rate": None, "prefix_forwards_per_prompt": None,
                "prefix_cache_stored_mib": None}
    hit = sum(c["hit_tokens"] for c in counters)
    total = hit + sum(c["prefilled_tokens"] for c in counters)
    lookups = sum(c["lookups"] for c in counters)
    return {"prefix_hit_tokens": hit, "prefix_hit_rate": hit / total if total else None,
            "prefix_forwards_per_prompt": sum(c["prefill_forwards"] for c in counters) / lookups if lookups else None,
            "prefix_cache_stored_mib": counters[-1]["stored_bytes"] / 2**20}


def _ratio(a: dict, b: dict | None) -> float | None:
    if b is None or a.get("tokens_per_s") is None or not b.get("tokens_per_s"):
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the serving comparison; returns the records (also in ``out_dir``)."""
    import specdec

    from .bench import drafter_runs
    from .e2e import release

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    seed, repeats, path = int(cfg.seed), int(cfg.repeats), str(exp.decode_path)
    K = cfg.num_speculative_tokens if cfg.num_speculative_tokens == "auto" else int(cfg.num_speculative_tokens)
    B = "auto" if exp.max_batch_size == "auto" else int(exp.max_batch_size)
    budget = None if exp.memory_budget is None else str(exp.memory_budget)
    warmup, prefix_caching = bool(exp.warmup), bool(exp.prefix_caching)
    block = int(exp.prefix_block_size)
    if prefix_caching and int(exp.shared_prefix_tokens) < block:
        print(f"specdec-run: experiment.shared_prefix_tokens={int(exp.shared_prefix_tokens)} is less than one cached "
              f"block (experiment.prefix_block_size={block}): the prefix cache reuses whole blocks, so the shared "
              "prefix alone gives it nothing to hit", flush=True)
    manager_warmup = bool(exp.manager_warmup) and exp.request_rate is not None
    if bool(exp.manager_warmup) and not manager_warmup:
        print("specdec-run: experiment.manager_warmup=true warms the managers that serve arrivals; without "
              "experiment.request_rate no manager runs (generate_batch serves the workload): nothing to warm up",
              flush=True)
    batch_tokens = int(exp.max_batch_tokens)
    strategies = [str(s) for s in cfg.rollback.strategies]
    log = RunRecords(out_dir)
    bar = None
    for spec in cfg.model.targets:
        model, tok = load_target(spec, device, dtype, seed)
        if exp.ignore_eos:
            model.generation_config.eos_token_id = None
        runs = drafter_runs(cfg, spec)
        if bar is None:
            apply_cpu_threads(cfg, model, device)
            total = len(cfg.model.targets) * (1 + prefix_caching) * (1 + len(runs) * len(strategies) * (
                1 + bool(exp.fixed_batches)))
            bar = log.bar = progress_bar(cfg, total, str(exp.name)) or False
        work = build_workload(exp, tok, model.config.vocab_size, seed, context_length(model))
        work = work.arriving(None if exp.request_rate is None else float(exp.request_rate), seed)
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
        eos = _eos_ids(model)
        base = {**common_fields(cfg, "serve", spec, device, dtype), **work.fields(), "prompt_set": work.source,
                "repeats": repeats, "memory_budget": budget, "rehearse": bool(exp.rehearse),
                "manager_warmup": manager_warmup}

        def add(res: RunResult, run_name: str, drafter: str, acceptance, strategy: str, k, reference, plain=None,
                fixed=None, caching: bool = False, uncached=None, rows=None):
            rows = rows or next((st.max_batch_size for st in res.stats if st.max_batch_size is not None), None)
            rec = {**base, "run": run_name, "drafter": drafter, "acceptance": acceptance, "rollback": strategy,
                   "num_speculative_tokens": k, "prefix_caching": caching if run_name == "continuous" else None,
                   "batch": rows if rows is not None else B if isinstance(B, int) else None,
                   "batch_size_reason": res.stats[-1].batch_size_reason if res.stats else None,
                   **_run_fields(res, reference)}
            if res.error is None and reference is not None:
                rec.update(_divergence_fields(model, work.prompts, reference, res.tokens, rec["diverged_request_ids"]))
            rec["vs_continuous_plain"] = _ratio(rec, plain)
            rec["vs_fixed_batches"] = _ratio(rec, fixed)
            # with caching: tokens/s and mean time to first token against the same run without it
            rec["vs_no_prefix_cache"] = _ratio(rec, uncached)
            rec["ttft_speedup_vs_no_prefix_cache"] = (
                uncached["ttft_mean_ms"] / rec["ttft_mean_ms"] if uncached is not None and rec.get("ttft_mean_ms")
                and uncached.get("ttft_mean_ms") else None)
            label = f"{drafter}{'' if acceptance is None else f' a={acceptance}'} {strategy}"
            log.add(rec, f"{spec.name} {run_name} {label}: " + (
                f"error: {rec['error']}" if rec["error"] else
                f"{rec['tokens_per_s']:.1f} tokens/s, TTFT p50 {rec['ttft_p50_ms']:.1f} ms, "
                f"TPOT p50 {_fmt_ms(rec['tpot_p50_ms'])}"))
            return rec

        sd = specdec.wrap(model, num_speculative_tokens=0, decode_path=path)
        rehearse = bool(exp.rehearse)
        warmed: set = set()  # prefill shapes this model has met (_warm_prefill)
        plain_res = _continuous(sd, work, B, None, device, repeats, warmup, memory_budget=budget,
                                max_batch_tokens=batch_tokens, warmed=warmed, rehearse=rehearse,
                                manager_warmup=manager_warmup)
        reference = None if plain_res.error else plain_res.tokens
        plain = add(plain_res, "continuous", "plain", None, "none", 0, reference)
        plain_cached = plain  # the baseline of the runs with the prefix cache: plain decoding with it too
        if prefix_caching:  # the same run with the prefix cache, side by side
            plain_cached = add(_continuous(sd, work, B, block, device, repeats, warmup, memory_budget=budget,
                                           max_batch_tokens=batch_tokens, warmed=warmed, rehearse=rehearse,
                                           manager_warmup=manager_warmup),
                               "continuous", "plain", None, "none", 0, reference, caching=True, uncached=plain)
        sd.release()
        references = None if reference is None else [p + t for p, t in zip(work.prompts, reference)]
        for name, acceptance in runs:
            for strategy in strategies:
                if name == "oracle" and references is None:
                    err = RunResult(error=f"the oracle drafts the continuous plain run's outputs, which failed: "
                                          f"{plain_res.error}")
                    add(err, "continuous", name, acceptance, strategy, K, None, plain)
                    if exp.fixed_batches:
                        add(err, "fixed_batches", name, acceptance, strategy, K, None, plain)
                    continue

                if name == "oracle":  # a drafter of the requests' references, per call
                    def drafter_for(idx, acceptance=acceptance):
                        return specdec.drafters.OracleDrafter.for_requests([references[i] for i in idx],
                                                                           acceptance=acceptance, seed=seed)
                    drafter = drafter_for(range(len(references)))
                else:
                    drafter_for = None
                    drafter = make_drafter(cfg, name, target=model, tokenizer=tok,
                                           random_mtp=str(spec.source) == "random_shape" and not spec.get("mtp"))
                sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K,
                                  decode_path=path)
                cont_res = _continuous(sd, work, B, None, device, repeats, warmup, drafter_for, budget, batch_tokens,
                                       warmed, rehearse, manager_warmup)
                cached_res = (_continuous(sd, work, B, block, device, repeats, warmup, drafter_for, budget, batch_tokens,
                                          warmed, rehearse, manager_warmup) if prefix_caching else None)
                sd.release()
                fixed = None
                if exp.fixed_batches:
                    sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K,
                                      decode_path=path)
                    # with "auto", batches of the rows the continuous run chose
                    rows = B if isinstance(B, int) else next(
                        (st.max_batch_size for st in cont_res.stats if st.max_batch_size), None)
                    fixed_res = (_fixed(sd, work, rows, pad, eos, device, repeats, warmup, drafter_for, batch_tokens,
                                        warmed) if rows else
                                 RunResult(error=f"no fixed batch size: the continuous run failed ({cont_res.error})"))
                    sd.release()
                    fixed = add(fixed_res, "fixed_batches", name, acceptance, strategy, K, reference, plain, rows=rows)
                uncached = add(cont_res, "continuous", name, acceptance, strategy, K, reference, plain, fixed)
                if cached_res is not None:  # (fixed batches run without the cache: no ratio to them)
                    add(cached_res, "continuous", name, acceptance, strategy, K, reference, plain_cached, None, True,
                        uncached)
                release(device)
        model = None  # (not del: add() reads the name when it runs)
        release(device)
    log.close()
    arriving = ("every request at the start" if exp.request_rate is None else
                f"Poisson arrivals at {float(exp.request_rate):g} requests/s")
    title = (f"Serving: {', '.join(t.name for t in cfg.model.targets)}, max_batch_size={B}, K={K}, {arriving}, "
             f"{device}, {str(dtype).replace('torch.', '')}, {repeats} repeat{'s' if repeats > 1 else ''}")
    write_report(log.records, log.out_dir, title)
    return log.records


def _fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.2f} ms"
