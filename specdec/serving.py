"""Continuous batching as a service: requests added and results taken while the pool decodes.

:meth:`specdec.engine.SpeculativeGenerator.init_continuous_batching` returns a
:class:`ContinuousBatchingManager`, with the methods of Hugging Face's class of that name
(``transformers.generation.continuous_batching``): ``start``, ``stop``, ``add_request``,
``add_requests``, ``get_result``, ``request_id_iter``, iteration, ``is_running``, ``warmup`` /
``warmed_up``, and use as a context manager. ``start()`` runs ``generate_batch``'s decode loop
on a background thread over a :class:`~specdec.batching.RequestPool` that stays open: when every
row is idle the loop waits for a request (a blocking wait, woken by ``add_request`` and
``stop``) instead of ending, and rows whose request ended take waiting requests between two
steps, as in ``generate_batch``. A request's result (a ``transformers`` ``GenerationOutput``) is
ready when the request ends; with
``add_request(..., streaming=True)`` its partial results come before that, one per step that
commits tokens to it (status ``DECODING``, every token so far: a step commits up to K + 1), a
newer one replacing one not taken yet. With ``prefix_caching=True`` the manager holds one
:class:`~specdec.prefix_cache.PrefixCache` for its life: every run's prompts are prefilled through
it, so a request reuses the prefix state of any request prefilled before it, in this run or an
earlier one (``start()`` after ``stop()`` keeps it).

Warm-up: the loop's first meeting with a shape costs more than its later ones (kernels compile
or autotune; on the CUDA-graph path the decode step's graphs are captured for the pool, and each
prompt forward's bucket is captured the second time it is met, holding up every decoding row
meanwhile). ``warmup()`` pays for that before serving, on the calling thread: warm-up requests
through the same loop, a grid of every prompt bucket of a forward from scratch the pool can meet (or the prompts given,
e.g. a system prompt and sample requests), twice; nothing of them reaches the queue or the results.

Stopping, as Hugging Face's manager does it: ``stop()`` lets the loop finish every request added
so far (decoding or waiting), then ends it; their results stay available to ``get_result``.
``stop(hard_stop=True)`` ends it at the next step: decoding requests come back ``FAILED`` with
the tokens they had, waiting ones ``FAILED`` with none. An exception inside the loop ends it too:
every unfinished request comes back ``FAILED`` with ``error`` naming the exception, and once the
ready results are taken, ``get_result`` and iteration raise ``RuntimeError`` from it.

Example::

    manager = sd.init_continuous_batching(max_length=512, max_batch_size="auto")
    manager.warmup()                                # before taking requests: first runs and captures
    with manager:                                   # start(); stop() on leaving
        rid = manager.add_request(prompt_ids, max_new_tokens=64)
        out = manager.get_result(rid, timeout=60)   # GenerationOutput, or None after 60 s
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import numbers
import os
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator

import torch

from .batching import DEFAULT_MAX_BATCH_TOKENS, GenerationOutput, Request, RequestPool, RequestStatus, check_requests
from .graphs import bucket_width
from .models.prompt_graphs import PROMPT_GRAPH_ROWS, PROMPT_GRAPH_TOKENS
from .placement import on_device
from .prefix_cache import PrefixCache
from .settings import as_budgets

__all__ = ["ContinuousBatchingManager", "EXIT_JOIN_S", "WAIT_S", "WARMUP_NEW_TOKENS", "WARMUP_SEED", "shared_prefixes", "warmup_grid", "warmup_group_sizes"]

logger = logging.getLogger(__name__)

#: seconds a waiting loop or caller sleeps between checks at most (new requests, results and
#: ``stop()`` wake them at once)
WAIT_S = 0.5

#: seconds the interpreter's exit waits for each running manager's loop, hard-stopped, to end
EXIT_JOIN_S = 30.0

#: new tokens of a warm-up request, where ``max_length`` leaves room (else 1): the first comes
#: from its prefill, the second from a decode step, so the step's kernels and graphs run too
WARMUP_NEW_TOKENS = 2

#: the seed of the random token ids of :meth:`ContinuousBatchingManager.warmup`'s synthetic prompts
WARMUP_SEED = 0

_IDLE, _RUNNING, _FLUSHING, _HARD_STOP = "idle", "running", "flushing", "hard_stop"

_STARTED: weakref.WeakSet = weakref.WeakSet()  # managers whose loop was started (the exit hook's to stop)


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, hard-stop every manager whose loop still runs and wait for it to end:
    a loop thread left inside a CUDA or Triton call while the interpreter finalises aborts the
    process (``terminate called without an active exception``)."""
    running = [m for m in list(_STARTED) if m.is_running()]
    for manager in running:  # every loop told first: the waits below overlap
        manager.stop(block=False, hard_stop=True)
    for manager in running:
        manager.stop(block=True, timeout=EXIT_JOIN_S, hard_stop=True)


def warmup_grid(rows: int, max_length: int, max_batch_tokens: int) -> list[tuple[int, int]]:
    """The ``(requests, prompt tokens)`` of each pool run of the synthetic warm-up
    (:meth:`ContinuousBatchingManager.warmup`): one per prompt bucket ``(B, W)``
    (:func:`~specdec.models.prompt_graphs.prompt_bucket`) that an admission of a pool of ``rows``
    rows, whose requests hold at most ``max_length`` tokens (a prompt of at most ``max_length -
    1``) and whose prefill forwards at most ``max_batch_tokens`` tokens, can run in: ``min(B,
    rows)`` prompts of ``min(W, max_length - 1)`` tokens, where those land in that bucket (B a power
    of two up to :data:`~specdec.models.prompt_graphs.PROMPT_GRAPH_ROWS`, W a
    :func:`~specdec.graphs.bucket_width` from 32 on, ``B x W`` at most
    :data:`~specdec.models.prompt_graphs.PROMPT_GRAPH_TOKENS` and ``max_batch_tokens``). Ordered
    by rows, then tokens."""
    longest = max_length - 1
    limit = min(PROMPT_GRAPH_TOKENS, max_batch_tokens)
    grid = []
    B = 1
    while B <= PROMPT_GRAPH_ROWS and B // 2 < rows:
        W = bucket_width(1)
        while W <= limit // B and bucket_width(longest) >= W:
            grid.append((min(B, rows), min(W, longest)))
            W = bucket_width(W + 1)
        B *= 2
    return grid


def warmup_group_sizes(rows: int, prompts: int) -> list[int]:
    """How many of the user's ``prompts`` each pool run of :meth:`ContinuousBatchingManager.warmup`
    on a pool of ``rows`` rows gives its first admission: 1 (each prompt alone), then ``min(B,
    rows, prompts)`` for each row bucket ``B`` = 2, 4, ... up to
    :data:`~specdec.models.prompt_graphs.PROMPT_GRAPH_ROWS` that a prefill forward of at most that
    many prompts can round up to. (An admission while rows decode takes at most
    :func:`~specdec.batching.admission_rows` requests; the loop's first one, of requests queued
    before ``start()``, up to every row, a forward holding at most ``PROMPT_GRAPH_ROWS`` of them.)"""
    most = min(rows, prompts)
    sizes, B = [1], 2
    while B <= PROMPT_GRAPH_ROWS and B // 2 < most:
        sizes.append(min(B, most))
        B *= 2
    return sizes


def shared_prefixes(prompts: list[tuple], block_size: int) -> list[tuple]:
    """The prefixes, in whole blocks of ``block_size`` tokens, that the warm-up's ``prompts``
    share, which a prefix cache serves to later requests that start with them (a system prompt):
    for each prompt, its longest common prefix with another prompt (a lone prompt: itself)
    rounded down to whole blocks, where that is at least one block; each once, in order."""
    out = []
    for i, p in enumerate(prompts):
        common = max((len(os.path.commonprefix([p, q])) for j, q in enumerate(prompts) if j != i), default=len(p))
        n = common // block_size * block_size
        if n and p[:n] not in out:
            out.append(p[:n])
    return out


class _HardStop(Exception):
    """Raised by an open pool's ``take`` to end the decode loop at once (``stop(hard_stop=True)``)."""


class _OpenPool(RequestPool):
    """The pool of one manager run: its queue is the manager's; ``take`` waits while every row is
    idle and the manager runs, and raises :class:`_HardStop` on a hard stop; ``busy`` then ends
    every row (with the tokens it has); ``finish`` hands each output to the manager (and drops
    the request's times, which its output carries)."""

    def __init__(self, manager: ContinuousBatchingManager, size: int, span: int):
        super().__init__([], size, span, prefix_cache=manager.prefix_cache, max_batch_tokens=manager.max_batch_tokens)
        self.on_stream = manager._deliver_partial
        self.queue = manager._queue
        self._manager = manager
        self._cut: set[int] = set()  # rows a hard stop ended before their request did

    def take(self, rows, at_most: int | None = None, decoding: bool = False) -> list[Request]:
        m = self._manager
        with m._changed:
            while not self.queue and m._state == _RUNNING and all(r is None for r in self.slots):
                m._changed.wait(WAIT_S)
            if m._state == _HARD_STOP:
                raise _HardStop
            taken = super().take(rows, at_most, decoding)
            for req in taken:  # (queued when it was added, as HF's created_time)
                self.timings[req.index].queued = m._added.pop(req.index)
            return taken

    def busy(self, finished: list[bool]) -> list[int]:
        if self._manager._state != _HARD_STOP:
            return super().busy(finished)
        held = [b for b, req in enumerate(self.slots) if req is not None]
        chunked = self.prefilling_chunks.row if self.prefilling_chunks is not None else None
        self._cut = {b for b in held if not finished[b] or b == chunked}  # (a prefill in chunks ends too)
        return held

    def finish(self, row: int, generated: list[int]) -> None:
        req = self.slots[row]
        super().finish(row, generated)
        out = self.outputs.pop(req.index)
        del self.timings[req.index]  # (its times are in out; the pool serves on)
        if row in self._cut:
            out.status = RequestStatus.FAILED
            out.error = f"stopped by stop(hard_stop=True) after {len(generated)} new tokens"
        self._manager._deliver([out])


class ContinuousBatchingManager:
    """Requests in, results out, while a background thread decodes them (see the module docstring).

    Made by :meth:`SpeculativeGenerator.init_continuous_batching`, which checks every setting.
    While it runs, the generator is the loop's: its ``generate``, ``generate_batch``, ``release``,
    setting its drafter, rollback strategy or K, and starting or warming up another of its
    managers raise ``RuntimeError`` (a second ``specdec.wrap`` of the model serves other calls
    meanwhile). At interpreter exit a loop still running is hard-stopped and waited for (at most
    :data:`EXIT_JOIN_S`); ``last_stats`` describes a run once ``stop()`` has ended it (not
    after a hard stop or an error, which end the loop inside a step), idle waits counted in its
    ``prefill_s`` (the admission phase waits for requests) and ``wall_s``.

    Args:
        run: decodes a pool until it has nothing left (the generator's loop, settings bound).
        rows: the pool's rows (``max_batch_size``). max_length: the most tokens of a request,
            prompt + budget. max_new_tokens: the budget of a request that gives none (None:
            ``default_length`` less its prompt if given, else 20 new tokens, or what its prompt
            leaves of ``max_length``). default_length: see ``max_new_tokens`` (the model's
            generation config's ``max_length``), or None.
        vocab_size, max_positions: what :func:`specdec.batching.check_requests` checks prompts against.
        device: the model's device (the loop thread makes it current on CUDA).
        max_batch_tokens: the most prompt tokens one admission's prefill forward runs (padding included).
        prefix_cache: the :class:`~specdec.prefix_cache.PrefixCache` every run's pool prefills its
            prompts through (``prefix_caching=True``), or None.
        claim: called with the caller's name (``"start()"``, ``"warmup()"``) and a function that
            marks this manager as holding the generator, before the loop starts or a warm-up
            runs: it raises to refuse (the generator's: another thread's call or manager holds
            it, or its drafter cannot serve a pool), else calls the function, both under the
            generator's claim lock, so that a racing call's check sees the mark.
        prompt_counts: None, or a function that gives the prompt forwards run so far by how they
            ran (the adapter's :attr:`PromptGraphs.counts
            <specdec.models.prompt_graphs.PromptGraphs>`), or None where they are not counted (the
            eager decode path); :meth:`warmup` reports their increase.

    Attributes:
        max_batch_size, max_length, max_new_tokens, max_batch_tokens: as given.
        prefix_cache: as given: kept for the manager's life, across ``start()`` / ``stop()`` runs
            (a request reuses the prefixes of every request prefilled before it, in any run);
            ``last_stats.prefix_cache`` holds its counters, counted since the manager was made.
        warmed_up: whether :meth:`warmup` has run to its end (False until then), as Hugging
            Face's manager says it.
    """

    def __init__(self, run: Callable[[RequestPool], None], *, rows: int, max_length: int, max_new_tokens: int | None,
                 vocab_size: int, max_positions: int | None, device, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 prefix_cache: PrefixCache | None = None,
                 claim: Callable[[str, Callable[[], None]], None] | None = None,
                 prompt_counts: Callable[[], dict[str, int]] | None = None, default_length: int | None = None):
        self._run = run
        self._claim = claim
        self._prompt_counts = prompt_counts
        self.warmed_up = False
        #: the thread inside start() (until its loop thread runs) or warmup() (until it returns)
        self._claimant: threading.Thread | None = None
        self.max_batch_size = rows
        self.max_length = max_length
        self.max_new_tokens = max_new_tokens
        self._default_length = default_length
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache = prefix_cache
        self._vocab_size, self._max_positions, self._device = vocab_size, max_positions, torch.device(device)
        self._changed = threading.Condition()  # guards everything below; notified on every change
        self._queue: deque[Request] = deque()  # waiting requests (the open pool's queue)
        self._in_flight: set[str] = set()  # ids of the requests waiting or decoding
        self._results: dict[str, GenerationOutput] = {}  # ended requests whose result was not taken
        self._order: deque[str] = deque()  # their ids, in the order they ended
        self._count = 0  # requests added so far (the next one's Request.index)
        self._added: dict[int, float] = {}  # Request.index of each waiting request -> time.perf_counter() it was added
        self._state = _IDLE
        self._error: BaseException | None = None  # what ended the last run, if it failed
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # one start() at a time

    # control ---------------------------------------------------------------------------------
    def is_running(self) -> bool:
        """Whether the loop thread was started and has not ended."""
        return self._thread is not None and self._thread.is_alive()

    def runs_elsewhere(self) -> bool:
        """Whether the loop thread runs, or a :meth:`start` or :meth:`warmup` is under way, on a
        thread other than the calling one (the generator's caches, drafter and rollback state are
        theirs meanwhile)."""
        here = threading.current_thread()
        if here is self._thread:  # the loop itself
            return False
        claimant = self._claimant
        return self.is_running() or (claimant is not None and claimant is not here)

    def _hold(self, what: str) -> None:
        """Claim the generator for this thread's ``what`` (see ``claim``); :attr:`_claimant`
        marks it until the caller clears it."""
        def mark():
            self._claimant = threading.current_thread()

        if self._claim is None:
            mark()
        else:
            self._claim(what, mark)

    def start(self) -> None:
        """Start the loop on a background thread (a warning, nothing else, when it runs already;
        while a ``stop()`` is under way, the loop it stops ends first, then a new one starts).

        Raises:
            RuntimeError: another manager of the same generator runs its loop or a warm-up, or
                another thread is inside the generator's ``generate()`` / ``generate_batch()``
                (the generator's caches are theirs until they end).
            ValueError: the generator's drafter (set since the manager was made) cannot give a
                row a new request (as ``generate_batch`` says)."""
        with self._starting:
            thread = self._thread
            if thread is not None and thread.is_alive():
                with self._changed:
                    running = self._state == _RUNNING
                if running or thread is threading.current_thread():
                    logger.warning("the continuous batching manager is already running")
                    return
                thread.join()  # a loop that is stopping or has just ended: it finishes first
            self._hold("start()")
            try:
                _STARTED.add(self)
                pool = _OpenPool(self, self.max_batch_size, self.max_length)
                with self._changed:
                    self._state, self._error = _RUNNING, None
                self._thread = threading.Thread(target=self._loop, args=(pool,), name="specdec-continuous-batching",
                                                daemon=True)
                try:
                    self._thread.start()
                except BaseException:  # (e.g. no thread can start): as before, not running
                    self._thread = None
                    with self._changed:
                        self._state = _IDLE
                    raise
            finally:
                self._claimant = None  # (the running loop holds the generator from here on)

    def stop(self, block: bool = True, timeout: float | None = None, hard_stop: bool = False) -> None:
        """End the loop: by default once every request added so far has ended (their results stay
        available); with ``hard_stop`` at the next step, unfinished requests ``FAILED`` (see the
        module docstring). ``block``: wait for the thread to end, at most ``timeout`` seconds
        (None: no limit; a warning if it is still running then). While it stops, ``add_request``
        raises ``RuntimeError``; once the loop has ended, requests added are queued, as before the
        first ``start()``, and decode from the next ``start()``."""
        with self._changed:
            idle = self._state == _IDLE  # (not started, or its loop has ended or is ending)
            if not idle:
                self._state = _HARD_STOP if hard_stop or self._state == _HARD_STOP else _FLUSHING
                self._changed.notify_all()
        thread = self._thread
        if idle and thread is None:
            logger.warning("the continuous batching manager was not started")
            return
        if block and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning(f"the continuous batching loop did not end within {timeout} s")

    def __enter__(self) -> ContinuousBatchingManager:
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """``stop()``; a hard stop when the block raised."""
        self.stop(block=True, hard_stop=exc_type is not None)

    # warm-up ---------------------------------------------------------------------------------
    def warmup(self, prompts=None, *, rounds: int = 2) -> dict:
        """Run warm-up requests through the manager's decode loop, on the calling thread, before
        serving (Hugging Face's manager's ``warmup()``, which pre-captures its CUDA graphs): the
        work a shape costs the first times the loop meets it is done here, not while requests
        wait. Kernels compile or autotune; the decode step's static buffers and CUDA graphs are
        made for the manager's pool (the generator keeps them); each prompt forward's bucket
        (:mod:`specdec.models.prompt_graphs`: up to 8 rows and 2,048 tokens, rows and width
        rounded up) runs at its shape in the first round and is captured as a CUDA graph in the
        second (on the CUDA-graph decode path), where serving would hold up every decoding row
        for the capture. Call it before ``start()``.

        Each run is a closed :class:`~specdec.batching.RequestPool` of the manager's rows,
        ``max_length`` and ``max_batch_tokens``, decoded to its end by the loop ``start()`` runs.
        Its requests (:attr:`~specdec.batching.Request.warmup`) have budgets of
        :data:`WARMUP_NEW_TOKENS` (1 where ``max_length`` leaves no more room: then no decode step
        runs) and stay out of the manager's queue, request ids and results. What a generator call
        leaves, a warm-up leaves too: ``last_stats`` describes its last run (the next ``stop()``
        replaces them), and with ``do_sample`` it draws from the manager's ``generator``, so seeded
        samples after a warm-up differ from those without one. A drafter's
        :meth:`~specdec.drafters.Drafter.admit` gets the warm-up requests as any others (their
        ``warmup`` set): one that looks something up per request must let them pass, as
        :class:`~specdec.drafters.OracleDrafter` does.

        Args:
            prompts: None: the synthetic grid: per bucket an admission can meet
                (:func:`warmup_grid`), one run whose requests' prompts (random ids, seeded with
                :data:`WARMUP_SEED`) its first admission prefills in one forward of that bucket;
                without the prefix cache (a prompt that hits nothing in it runs in the same
                buckets). Or a list of prompts, each a list (or 1-D tensor) of token ids, e.g. a
                system prompt and sample requests after it: each runs alone (one row), in order,
                then in consecutive groups of 2, 4 and 8 (at most the pool's rows:
                :func:`warmup_group_sizes`), each group admitted at once, as admissions of several
                requests are (one forward where it fits ``max_batch_tokens``). So n prompts make
                about 2n pool runs a round (about 3n with prefix caching, and the grid below).
                With prefix caching, each round runs them through a scratch
                :class:`~specdec.prefix_cache.PrefixCache` of the manager's block size, bounded by
                what the manager's cache leaves of its byte bound (the pool's plan counts one
                cache) and dropped after the pass, so prompts sharing a prefix hit it within the
                round and the forwards continued from it, of one row and of each group, warm up
                too. After every prefix the prompts share in whole blocks (a system prompt:
                :func:`shared_prefixes`; one per width bucket of prefix lengths), the grid runs
                continued: prompts of that prefix and random ids, one run per bucket of new tokens
                a later request's forward after it can meet, within ``max_length``. Then each
                size's groups run once more through an empty scratch cache, where prompts unlike
                any cached before miss together, as in an admission of several such prompts
                (prompts sharing a prefix continue from the first of them again). The manager's cache
                and its counters stay as they are. The grid and the prompts warm the decode step's
                buffers and graphs the generator keeps for this pool: a call of the generator with
                another shape between ``warmup()`` and ``start()`` replaces them.
            rounds: how many times the grid (or the prompts) runs, an int >= 1: the first round
                runs each bucket at its shape, the second captures it.

        Returns: ``{"prompt_forwards": {"cuda_graph": n, "captured": n, "static": n, "eager":
        n}, "pool_runs": n, "seconds": s}``: the prompt forwards the warm-up ran, by how they ran
        (the increase of :attr:`PromptGraphs.counts <specdec.models.prompt_graphs.PromptGraphs>`;
        None on the eager decode path, whose prompt forwards run at their own shapes, uncounted,
        and for a manager given no ``prompt_counts``; every pool run also prefills its rows'
        one-token placeholders once), the runs and the wall seconds; logged on
        ``specdec.serving`` too. Sets :attr:`warmed_up`.

        Raises:
            RuntimeError: the manager's loop runs (call it before ``start()``, or once ``stop()``
                has ended the loop), or another manager of the same generator runs its loop or a
                warm-up, or another thread is inside the generator's ``generate()`` /
                ``generate_batch()`` (while this one runs, the generator refuses other threads'
                calls likewise).
            ValueError: the generator's drafter (set since the manager was made) cannot give a
                row a new request (as ``generate_batch`` says).
            TypeError / ValueError: ``rounds`` not an int >= 1; ``prompts`` not a list, or empty;
                a prompt that is not a list of int token ids, or that ``add_request`` would fail
                (empty, ids outside the vocabulary, longer than ``max_length - 1``, no room for a
                new token in the model's context): named by its index, before anything runs.
        """
        if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral):
            raise TypeError(f"rounds must be an int (passes over the warm-up's requests), got {type(rounds).__name__}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1 (passes over the warm-up's requests), got {rounds}")
        passes = self._warmup_runs(prompts)
        runs = sum(len(p) for p in passes)
        if not runs:
            logger.warning(f"warm-up: no prompt bucket fits max_batch_tokens={self.max_batch_tokens} and "
                           f"max_length={self.max_length} (the smallest bucket is 32 tokens): nothing ran")
        scratch = prompts is not None and self.prefix_cache is not None
        with self._starting:
            if self.is_running():
                raise RuntimeError("warmup(): the manager's loop is running; warm it up before start(), or once "
                                   "stop() has ended the loop")
            self._hold("warmup()")
            try:
                before = None if self._prompt_counts is None else self._prompt_counts()
                start = time.perf_counter()
                with on_device(self._device):
                    for _ in range(rounds):
                        for runs_of_pass in passes:
                            cache = (PrefixCache(self.prefix_cache.block_size,  # (within the pool's planned bytes)
                                                 max(0, self.prefix_cache.max_bytes - self.prefix_cache.nbytes))
                                     if scratch else None)
                            for requests in runs_of_pass:
                                self._run(RequestPool(list(requests), self.max_batch_size, self.max_length,
                                                      prefix_cache=cache, max_batch_tokens=self.max_batch_tokens))
            finally:
                self._claimant = None
            seconds = time.perf_counter() - start
        after = None if before is None else self._prompt_counts()
        forwards = None if after is None else {k: v - before.get(k, 0) for k, v in after.items()}
        self.warmed_up = True
        how = "" if forwards is None else (f"{sum(forwards.values())} prompt forwards ("
                                           + ", ".join(f"{k} {v}" for k, v in forwards.items()) + ") ")
        logger.info(f"warm-up: {how}in {rounds * runs} pool runs, {seconds:.2f} s")
        return {"prompt_forwards": forwards, "pool_runs": rounds * runs, "seconds": seconds}

    def _warmup_runs(self, prompts) -> list[list[list[Request]]]:
        """The requests of each pool run of one round of :meth:`warmup`, by pass (each pass with
        its own scratch prefix cache where there is one); checked, raises as it says."""
        if prompts is None:
            return [self._grid_runs(())]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"warmup(prompts=...) takes None (the synthetic grid of prompt buckets) or a list of "
                            f"prompts, each a list (or 1-D tensor) of token ids; got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("warmup(prompts=[]): give at least one prompt, or None for the synthetic grid")
        names = [f"warm-up prompt {i}" for i in range(len(prompts))] if isinstance(prompts, (list, tuple)) else None
        requests, failed = check_requests(prompts, 1, self._vocab_size, self._max_positions,
                                          max_length=self.max_length, request_ids=names)
        if failed:
            out = failed[min(failed)]
            raise ValueError(f"{out.request_id} cannot run: {out.error}")
        requests = [dataclasses.replace(r, max_new_tokens=min(WARMUP_NEW_TOKENS, self.max_length - len(r.prompt)),
                                        warmup=True) for r in requests]
        by_size = [[requests[i:i + n] for i in range(0, len(requests), n)]
                   for n in warmup_group_sizes(self.max_batch_size, len(requests))]
        runs = [run for runs in by_size for run in runs]
        if self.prefix_cache is None:
            return [runs]
        # the grid continued after each shared prefix (its blocks cached by the runs before), then
        # each size's groups again through an empty cache, where they miss
        widths = {}  # a continued forward's bucket holds its prefix's length rounded up: one prefix per width, the shortest
        for prefix in sorted(shared_prefixes([r.prompt for r in requests], self.prefix_cache.block_size), key=len):
            widths.setdefault(bucket_width(len(prefix)), prefix)
        for prefix in widths.values():
            runs += self._grid_runs(prefix)
        return [runs] + by_size[1:]

    def _grid_runs(self, prefix: tuple) -> list[list[Request]]:
        """The synthetic grid's pool runs (:func:`warmup_grid`) for forwards after ``prefix``: each
        request's prompt is ``prefix`` and random ids (seeded with :data:`WARMUP_SEED`) filling a
        bucket of new tokens, within ``max_length``."""
        g = torch.Generator().manual_seed(WARMUP_SEED)
        room = self.max_length - len(prefix)
        return [[Request(i, prefix + tuple(torch.randint(0, self._vocab_size, (n,), generator=g).tolist()),
                         min(WARMUP_NEW_TOKENS, room - n), warmup=True) for i in range(rows)]
                for rows, n in warmup_grid(self.max_batch_size, room, self.max_batch_tokens)
                if rows == 1 or rows * (len(prefix) + n) <= self.max_batch_tokens]  # (an admission counts whole prompts)

    # requests --------------------------------------------------------------------------------
    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False) -> str:
        """Queue one request; it decodes as soon as a row is free (after ``start()``).

        Args:
            input_ids: the prompt, a list (or 1-D tensor) of int token ids.
            request_id: its id (default ``req_<n>``, n counting the manager's requests); must not
                name a request that is waiting, decoding or whose result was not taken yet.
            max_new_tokens: its budget (default: the manager's ``max_new_tokens``).
            streaming: also hand out partial results while it decodes (``get_result`` /
                ``request_id_iter`` / iteration give them: status ``DECODING``, every new token so
                far; a newer one replaces one not taken yet), then its final result.

        Returns: the request's id. A request that cannot run (empty prompt, ids outside the
        vocabulary, prompt + budget beyond ``max_length`` or the model's context) gets a ``FAILED``
        result at once, with its reason in ``error``; one with a budget of 0 a ``FINISHED`` one.

        Raises:
            TypeError: a prompt that is not a list of ints, a budget or id of the wrong type.
            ValueError: a negative budget, an empty id, an id in use.
            RuntimeError: the manager is stopping, or its last run failed (``start()`` it again).
        """
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
        if request_id == "":
            raise ValueError("request_id must not be empty: give a name, or None for req_<n>")
        budget = as_budgets(max_new_tokens)  # (a 0-d tensor or array: an int)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Integral)):
            raise TypeError(f"max_new_tokens of one request must be an int or None (add_requests takes one per "
                            f"prompt), got {type(max_new_tokens).__name__}")
        return self._add([input_ids], max_new_tokens, [request_id], streaming)[0]

    def add_requests(self, inputs, max_new_tokens=None, streaming: bool = False) -> list[str]:
        """Queue several requests (``inputs``: a list of prompts; ``max_new_tokens``: None, one int
        or one per prompt); returns their ids in order. See :meth:`add_request`."""
        if not isinstance(inputs, (list, tuple)):
            raise TypeError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
        return self._add(inputs, max_new_tokens, [None] * len(inputs), streaming)

    def _add(self, inputs, max_new_tokens, names: list, streaming: bool) -> list[str]:
        if not isinstance(streaming, bool):
            raise TypeError(f"streaming must be a bool, got {type(streaming).__name__}")
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        now = time.perf_counter()
        with self._changed:
            if self._state in (_FLUSHING, _HARD_STOP):
                raise RuntimeError("the manager is stopping (stop() was called): it takes no requests until start()")
            if self._error is not None:
                raise RuntimeError(f"the manager's decode loop failed ({type(self._error).__name__}: {self._error}); "
                                   "start() it again to add requests") from self._error
            first = self._first_free_index(names)
            requests, failed = check_requests(inputs, budget, self._vocab_size, self._max_positions,
                                              max_length=self.max_length, first_index=first, request_ids=names,
                                              default_length=self._default_length)
            ids = [Request(first + i, (), 0, name).request_id for i, name in enumerate(names)]
            repeated = {i for i, n in Counter(ids).items() if n > 1}
            clash = sorted(repeated | {i for i in ids if self._in_use(i)})
            if clash:
                raise ValueError(f"request id(s) {clash} already in use (waiting, decoding, or a result not taken "
                                 "yet); give other request_id values")
            self._count = first + len(ids)
            ready = list(failed.values())
            if streaming:
                requests = [dataclasses.replace(r, streaming=True) for r in requests]
            for r in requests:
                if r.max_new_tokens == 0:
                    ready.append(r.output(RequestStatus.FINISHED))
                else:
                    self._queue.append(r)
                    self._in_flight.add(r.request_id)
                    self._added[r.index] = now
            self._deliver(ready)
        return ids

    def _in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` names a request waiting, decoding or whose result was not taken."""
        return request_id in self._in_flight or request_id in self._results

    def _first_free_index(self, names: list) -> int:
        """The first :attr:`Request.index` from ``_count`` on at which the automatic ids of the
        unnamed requests of ``names`` (``req_<index>``, one index per name) are all free (a
        caller may have named a request ``req_<n>``)."""
        first = self._count
        while any(name is None and self._in_use(Request(first + i, (), 0).request_id) for i, name in enumerate(names)):
            first += 1
        return first

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        """Make ``outputs`` the (final) results of their requests (any thread)."""
        with self._changed:
            for out in outputs:
                self._in_flight.discard(out.request_id)
                self._post(out)
            self._changed.notify_all()

    def _deliver_partial(self, out: GenerationOutput) -> None:
        """A streaming request's partial result (the loop thread): it replaces one not taken yet."""
        with self._changed:
            self._post(out)
            self._changed.notify_all()

    def _post(self, out: GenerationOutput) -> None:
        """``out`` becomes its request's result to take, in the order results came (a request
        keeps its place while a newer result of it replaces one not taken)."""
        if out.request_id not in self._results:
            self._order.append(out.request_id)
        self._results[out.request_id] = out

    # results ---------------------------------------------------------------------------------
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The result of the request that ended first among those not taken (or of ``request_id``),
        removed from the manager; waits for it while the loop runs, at most ``timeout`` seconds
        (None: no limit).

        Returns: the ``GenerationOutput`` (``FINISHED``, or ``FAILED`` with ``error``; a streaming
        request's partial result, ``DECODING``, while it decodes), or None:
        after ``timeout``, or at once when no request is waiting or decoding and no result is
        ready, or when the loop is not running (with a warning where requests wait for it:
        added before ``start()`` or after the loop ended).

        Raises:
            KeyError: ``request_id`` names no request waiting, decoding or with a result to take.
            RuntimeError: the loop failed and no result is ready (chained to its exception).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                if request_id is None and self._order:
                    return self._results.pop(self._order.popleft())
                if request_id is not None:
                    if request_id in self._results:
                        self._order.remove(request_id)
                        return self._results.pop(request_id)
                    if request_id not in self._in_flight:
                        raise KeyError(f"no request {request_id!r} is waiting, decoding or has a result to take")
                if self._error is not None:
                    raise RuntimeError(f"the continuous batching loop failed: {type(self._error).__name__}: "
                                       f"{self._error}") from self._error
                if not self._in_flight:
                    return None
                if not self.is_running():  # (queued requests wait for start(): said, not left to a timeout)
                    logger.warning(f"{len(self._in_flight)} request(s) wait, but the continuous batching loop is not "
                                   "running: start() the manager to decode them")
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(WAIT_S if left is None else min(left, WAIT_S))

    def __iter__(self) -> Iterator[GenerationOutput]:
        """The results, in the order their requests end, while requests are waiting or decoding;
        ends when none is (or the loop is not running) and every result was taken. Raises as
        :meth:`get_result` does."""
        while (out := self.get_result()) is not None:
            yield out

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The results of ``request_id``: its partial ones if it streams (status ``DECODING``), then
        its final one (``FINISHED`` or ``FAILED``); ends after that, or when the loop is not
        running. Raises as :meth:`get_result` does."""
        while (out := self.get_result(request_id)) is not None:
            yield out
            if out.status in (RequestStatus.FINISHED, RequestStatus.FAILED):
                return

    # the loop thread -------------------------------------------------------------------------
    def _loop(self, pool: _OpenPool) -> None:
        error, failure = None, None
        try:
            with on_device(self._device):
                self._run(pool)
        except _HardStop:
            error = "stopped by stop(hard_stop=True) before it finished"
        except BaseException as err:  # (reaches the caller: FAILED results, then get_result raises)
            logger.error("the continuous batching loop failed", exc_info=True)
            error, failure = f"the decode loop failed: {type(err).__name__}: {err}", err
        finally:
            with self._changed:
                left = [r for r in pool.slots if r is not None] + list(self._queue)
                self._queue.clear()
                self._added.clear()
                self._state, self._error = _IDLE, failure
                self._deliver([r.output(RequestStatus.FAILED, error=error or "the decode loop ended before it ran")
                               for r in left])

    def __repr__(self) -> str:
        return (f"ContinuousBatchingManager(max_batch_size={self.max_batch_size}, max_length={self.max_length}, "
                f"running={self.is_running()}, waiting={len(self._queue)}, results={len(self._results)})")
