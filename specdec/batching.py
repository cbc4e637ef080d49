"""Continuous batching: requests of any lengths through a fixed pool of decode rows.

:meth:`specdec.engine.SpeculativeGenerator.generate_batch` takes a list of prompts. A
:class:`RequestPool` holds them in a queue and gives the decode loop's ``max_batch_size`` rows
(slots) to them: the first requests are prefilled as the loop's batch; whenever rows finish
(EOS or their own ``max_new_tokens``), between two steps, their outputs are read and the next
requests take their slots (prefilled together, their states written straight into those rows:
:meth:`specdec.cache.HybridCache.load_rows`; with prefix caching each prompt continues from its
longest cached prefix, :mod:`specdec.prefix_cache`). The result is keyed and typed as Hugging Face's
``generate_batch`` returns it: ``req_0``, ``req_1``, ... in input order, each a
``transformers`` ``GenerationOutput``; a request that cannot run (empty, ids outside the
vocabulary, longer than the model's context) carries ``status=FAILED`` and its ``error``, as HF
reports a failed request, and the others run. :mod:`specdec.serving` runs the same pool open:
requests arrive while it decodes (Hugging Face's ``init_continuous_batching`` manager).

Memory: :func:`bytes_per_sequence` estimates what one row holds on the device (attention KV over
the pool's columns, SSM and conv state, the rollback strategy's extra state, the step's logits),
measured once per model from a one-token probe; :func:`plan_rows` turns it and a memory budget
(:func:`parse_bytes`; default: :func:`free_memory` x :data:`MEMORY_FRACTION`) into the pool's
rows for ``max_batch_size="auto"``, or checks a given count against it.

Each request's times (:class:`RequestTiming`: queued, admitted, first token, finished; host
``time.perf_counter()`` seconds taken where the loop syncs with the device anyway) are in
``SpeculativeGenerator.last_request_timings``; its output's ``created_time`` and ``lifespan``
(HF's fields) hold the queued time and (admitted, finished).
"""

from __future__ import annotations

import itertools
import logging
import numbers
import re
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from .adaptive import rollback_bytes
from .graphs import bucket_length
from .models import HybridAdapter, adapter_for
from .prefix_cache import PrefixCache
from .rollback import ReplayRollback, make_strategy
from .settings import as_budgets, default_budget, is_array, warn_caller

__all__ = ["ADMISSION_DIVISOR", "ADMISSION_LOOKAHEAD", "DEFAULT_MAX_BATCH_SIZE", "DEFAULT_MAX_BATCH_TOKENS",
           "MAX_AUTO_BATCH_SIZE", "MAX_WAITING_STEPS", "MEMORY_FRACTION",
           "GenerationOutput",
           "PoolPlan", "Request", "RequestPool", "RequestStatus", "RequestTiming", "SequenceBytes", "admission_bytes",
           "admission_rows",
           "bytes_per_sequence", "cache_bytes", "check_batch_tokens", "check_requests", "free_memory", "kv_columns",
           "left_pad",
           "parse_bytes", "plan_rows", "pool_size"]

logger = logging.getLogger(__name__)

#: the pool's rows when ``max_batch_size`` is not given: ``min(len(inputs), DEFAULT_MAX_BATCH_SIZE)``
DEFAULT_MAX_BATCH_SIZE = 32
#: the most prompt tokens one admission's prefill forward runs, padding included (requests x the
#: longest prompt among them), unless ``max_batch_tokens`` says otherwise: it bounds the prefill's
#: activations, which the pool's memory plan does not count (16,384 tokens fill an H200's tensor
#: cores with a 4B model)
DEFAULT_MAX_BATCH_TOKENS = 16384


def check_batch_tokens(max_batch_tokens) -> int:
    """``max_batch_tokens`` (an int >= 1) as an int.

    Raises: TypeError / ValueError naming what is accepted."""
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, numbers.Integral):
        raise TypeError(f"max_batch_tokens must be an int (prompt tokens of one prefill forward, padding included), "
                        f"got {type(max_batch_tokens).__name__}")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1 (prompt tokens of one prefill forward, padding included), "
                         f"got {max_batch_tokens}")
    return int(max_batch_tokens)


@dataclass(frozen=True)
class Request:
    """One prompt of a ``generate_batch`` call (or of a manager): its position in ``inputs`` (the
    manager: in submission order), token ids, budget, when the caller named it, its id, whether
    its tokens are streamed as they are committed (a manager's ``streaming=True``), and whether it
    is a warm-up request."""

    index: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    custom_id: str | None = None
    streaming: bool = False
    #: a request of :meth:`~specdec.serving.ContinuousBatchingManager.warmup`: its output goes to
    #: no one, and a drafter that needs something of each request (OracleDrafter's reference) lets
    #: its row decode without it
    warmup: bool = False

    @property
    def request_id(self) -> str:
        """``custom_id``, else ``req_<index>``."""
        return self.custom_id if self.custom_id is not None else f"req_{self.index}"

    def output(self, status: RequestStatus, generated: list[int] | None = None,
               error: str | None = None) -> GenerationOutput:
        """This request's ``GenerationOutput`` with ``status``, its new tokens and ``error``."""
        return GenerationOutput(request_id=self.request_id, prompt_ids=list(self.prompt),
                                generated_tokens=[] if generated is None else generated, error=error, status=status)


@dataclass
class RequestTiming:
    """When a request went through the pool: ``time.perf_counter()`` seconds, each taken on the
    host at a point where the decode loop syncs with the device anyway (no sync of its own).

    Attributes:
        queued: the ``generate_batch`` call's start (every request waits in the queue from then);
            a manager's request: its ``add_request``.
        admitted: a row took it, before its prefill (None while queued).
        first_token: the host sync after its prefill: its first new token exists.
        finished: the host sync that showed it ended (EOS or its budget), its tokens read.
    """

    queued: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def time_to_first_token(self) -> float:
        """``first_token - queued`` seconds: waiting in the queue and the prefill."""
        return self.first_token - self.queued


def pool_size(max_batch_size, num_requests: int) -> int:
    """The pool's rows: ``max_batch_size`` (an int >= 1), or ``min(num_requests, 32)`` when None.

    Raises: ValueError for a string (``"auto"`` is :func:`plan_rows`' to size) or an int < 1;
    TypeError otherwise."""
    if max_batch_size is None:
        return max(1, min(num_requests, DEFAULT_MAX_BATCH_SIZE))
    if isinstance(max_batch_size, str):
        raise ValueError(f"max_batch_size must be an int >= 1, 'auto' (sized from free memory) or None "
                         f"(min(number of requests, {DEFAULT_MAX_BATCH_SIZE})), got {max_batch_size!r}")
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, numbers.Integral):
        raise TypeError(f"max_batch_size must be an int >= 1, 'auto' or None, got {type(max_batch_size).__name__}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return int(max_batch_size)


def check_requests(inputs, max_new_tokens, vocab_size: int, max_positions: int | None, *,
                   max_length: int | None = None, first_index: int = 0,
                   request_ids: list | None = None, default_length: int | None = None) -> tuple[list[Request], dict[int, GenerationOutput]]:
    """Split ``inputs`` into the requests that can run and the failed outputs of those that cannot.

    Args:
        inputs: a list of prompts, each a list (or 1-D tensor or NumPy array) of int token ids.
        max_new_tokens: one int >= 0 for every request, or one per request (a list, or a 1-D
            tensor or NumPy array), or None: ``default_length`` (at most ``max_positions`` and
            ``max_length``) less each prompt's length if given (a request whose prompt is longer
            than ``default_length`` fails), else each request's
            :func:`~specdec.settings.default_budget` within ``max_positions`` and ``max_length``
            (20 new tokens, or what fits).
        vocab_size: ids must be in ``[0, vocab_size)``.
        max_positions: the model's context (``config.max_position_embeddings``) or None: prompt +
            budget must not exceed it.
        max_length: a manager's bound on prompt + budget (its KV columns), or None.
        first_index: the :attr:`Request.index` of ``inputs[0]`` (the others follow).
        request_ids: one id (str) or None (``req_<index>``) per prompt, or None for all.
        default_length: with ``max_new_tokens=None``, prompt + new tokens of every request (the
            model's generation config's ``max_length``), or None.

    Returns: ``(requests, failed)``: the runnable :class:`Request` s in input order, and for each
    request that cannot run (empty prompt, ids outside the vocabulary, prompt + budget beyond the
    context or ``max_length``) its index -> a ``GenerationOutput`` with ``status=RequestStatus.FAILED``
    and ``error``.

    Raises:
        TypeError: ``inputs`` not a list/tuple, a prompt not a list of ints, a budget not an int.
        ValueError: a negative budget, or a list of budgets of another length than ``inputs``.
    """
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
    max_new_tokens = as_budgets(max_new_tokens)  # a 1-D tensor / array: one budget per request (0-d: an int)
    if not (max_new_tokens is None or isinstance(max_new_tokens, (list, tuple, numbers.Integral))):
        raise TypeError(f"max_new_tokens must be None, one int or a list of ints (one per request, in input order), "
                        f"got {type(max_new_tokens).__name__}")
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(inputs)
    defaulted = max_new_tokens is None
    if len(budgets) != len(inputs):
        raise ValueError(f"max_new_tokens is a list of {len(budgets)} budgets for {len(inputs)} requests; give one "
                         "int, or one per request")
    names = [None] * len(inputs) if request_ids is None else list(request_ids)
    labels = [Request(first_index + i, (), 0, name).request_id for i, name in enumerate(names)]
    for label, b in zip(labels, [] if defaulted else budgets):
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"max_new_tokens of {label} must be an int, got {type(b).__name__}")
        if b < 0:
            raise ValueError(f"max_new_tokens of {label} must be >= 0, got {b}")
    requests, failed = [], {}
    for i, prompt in enumerate(inputs):
        given = type(prompt).__name__  # (an array's type, named in an error after it became a list)
        if is_array(prompt) and (prompt.ndim == 1 or isinstance(prompt, torch.Tensor) and prompt.ndim == 0):
            given += f" of dtype {prompt.dtype}"
            prompt = prompt.reshape(-1).tolist()  # (a 0-d tensor: one token, as before; a NumPy scalar: refused)
        if not isinstance(prompt, (list, tuple)):
            dims = f" of {prompt.ndim} dims" if getattr(prompt, "ndim", None) is not None else ""
            raise TypeError(f"{labels[i]}: a prompt must be a list of int token ids (or a 1-D integer tensor or NumPy "
                            f"array), got {type(prompt).__name__}{dims}")
        # per distinct type, not per token (a server checks every prompt on its arrival)
        kinds = set(map(type, prompt))
        bad = {k for k in kinds if not issubclass(k, numbers.Integral) or issubclass(k, bool)}
        if bad:
            odd = next(t for t in prompt if type(t) in bad)
            raise TypeError(f"{labels[i]}: a prompt must be a list of int token ids (or a 1-D integer tensor or NumPy "
                            f"array), got a {given} holding {type(odd).__name__} {odd!r}")
        ids = tuple(prompt) if kinds <= {int} else tuple(map(int, prompt))
        if not defaulted:
            budget = int(budgets[i])
        elif default_length is None:
            budget = default_budget(len(ids), max_positions, max_length)
        else:  # (the length, within the context and max_length)
            budget = default_budget(len(ids), default_length, max_positions, max_length, most=None)
        error = None
        if defaulted and default_length is not None and len(ids) > default_length:
            error = (f"prompt ({len(ids)} tokens) is longer than the model's generation_config.max_length="
                     f"{default_length}, which sets the length of a request given no max_new_tokens: give "
                     "max_new_tokens")
        elif not ids:
            error = "empty prompt: give at least one token id"
        elif min(ids) < 0 or max(ids) >= vocab_size:
            outside = sorted({t for t in ids if not 0 <= t < vocab_size})
            error = f"token ids outside the vocabulary [0, {vocab_size}): {outside}"
        elif max_positions is not None and len(ids) + budget > max_positions:
            error = (f"prompt ({len(ids)} tokens) + max_new_tokens ({budget}) exceeds the model's context "
                     f"(max_position_embeddings={max_positions})")
        elif max_length is not None and len(ids) + budget > max_length:
            error = (f"prompt ({len(ids)} tokens) + max_new_tokens ({budget}) exceeds the manager's "
                     f"max_length={max_length} (its KV columns are sized once for it)")
        request = Request(first_index + i, ids, budget, names[i])
        if error is None:
            requests.append(request)
        else:
            failed[request.index] = request.output(RequestStatus.FAILED, error=error)
    return requests, failed


def left_pad(prompts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [n, L], attention_mask [n, L])`` int64: the prompts left-padded (pad id 0) to the longest."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, L - len(p):] = 1
    return tuple(torch.stack([ids, mask]).to(device))  # (one copy to the device: each waits for it)


class RequestPool:
    """The queue of requests and the request each of the loop's ``size`` rows decodes.

    ``span`` bounds every row's committed length: the KV columns and text buffers are sized from
    it once. Given (a manager's ``max_length``), or the longest prompt + largest budget of
    ``requests``. One admission takes at most ``admit_limit`` (:func:`admission_rows`) requests,
    and only requests whose longest prompt + largest budget fit ``span`` together and whose
    prompts, left-padded to one width, hold at most ``max_batch_tokens`` tokens (one request
    always: a longer prompt is prefilled alone). ``prefix_cache``: the
    :class:`~specdec.prefix_cache.PrefixCache` every prompt of the pool is prefilled through
    (``prefix_caching=True``), or None.
    """

    def __init__(self, requests: list[Request], size: int, span: int | None = None,
                 prefix_cache: PrefixCache | None = None, queued: float | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS):
        self.prefix_cache = prefix_cache
        self.max_batch_tokens = max_batch_tokens
        #: the long prompt being prefilled a chunk per step (the decode loop's record), or None
        self.prefilling_chunks = None
        #: called with a streaming request's partial output (status DECODING, its tokens so far)
        #: whenever the loop commits tokens to it (:meth:`stream`), or None
        self.on_stream: Callable[[GenerationOutput], None] | None = None
        self._streamed: dict[int, list[int]] = {}  # a streaming request's tokens so far, by index
        self.num_streaming = 0  # rows holding a streaming request
        self.queue = deque(requests)
        #: each request's times by index; ``queued``: the call's start (default: now)
        self.timings = {r.index: RequestTiming(time.perf_counter() if queued is None else queued) for r in requests}
        self._prefilling: list[Request] = []  # admitted, first token not yet seen
        self.slots: list[Request | None] = [None] * size
        self.outputs: dict[int, GenerationOutput] = {}
        self.span = self.span_of(requests) if span is None else span
        self.admit_limit = admission_rows(size)
        #: the steps the free rows have waited for a full admission (see :meth:`take`)
        self.waited = 0
        #: finished requests and their new tokens, over the pool's life
        self.num_finished = self.new_tokens = 0
        #: called once per finished request (the progress bar), or None
        self.on_finish: Callable[[], None] | None = None

    @staticmethod
    def span_of(requests: list[Request]) -> int:
        """The longest prompt + the largest budget of ``requests`` (not empty)."""
        return max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)

    def take(self, rows, at_most: int | None = None, decoding: bool = False) -> list[Request]:
        """Give queued requests to ``rows`` (as many as there are of both, at most ``at_most``,
        default ``admit_limit``); returns them. An admission takes the oldest waiting request,
        then, among the next ``ADMISSION_LOOKAHEAD`` x its limit, those whose prompt lengths are
        closest to its (ties in queue order), while they fit ``span`` and ``max_batch_tokens``
        together: its prompts are left-padded to one width, so requests of like lengths waste
        less of the prefill, and the oldest request is never passed over. With a prefix cache the
        next ``its limit`` in queue order instead: a forward pads what follows each prompt's hit,
        and the prompts are looked up in the order taken, so a prompt finds the blocks an earlier
        one of the same admission stores.

        While other rows are ``decoding``, free rows wait for a full admission: they take requests
        when they are ``admit_limit`` (or as many as one admission could take, if fewer), or when
        they have waited :data:`MAX_WAITING_STEPS` calls (steps) for that; until then nothing is
        taken."""
        if decoding and rows and self.queue:
            if len(rows) < len(self._select(self.admit_limit)) and self.waited < MAX_WAITING_STEPS:
                self.waited += 1
                return []
        self.waited = 0
        limit = min(len(rows), self.admit_limit if at_most is None else at_most)
        chosen = self._select(limit) if limit > 0 else []
        taken = [self.queue[i] for i in chosen]
        for i in sorted(chosen, reverse=True):
            del self.queue[i]
        for row, req in zip(rows, taken):
            self.slots[row] = req
        now = time.perf_counter()
        for req in taken:  # (a request an open pool got later: queued set by its manager)
            self.timings.setdefault(req.index, RequestTiming(now)).admitted = now
        self._prefilling += taken
        self.num_streaming += sum(r.streaming for r in taken)
        return taken

    def _select(self, limit: int) -> list[int]:
        """The queue positions an admission of at most ``limit`` requests takes (see :meth:`take`),
        in the order it takes them: the oldest first; none from an empty queue."""
        if not self.queue or limit < 1:
            return []
        # (with prefix caching a forward pads the rests after each prompt's hit, not whole prompts, and
        # the prompts are looked up in the order taken, a prompt's blocks stored before a later one's
        # lookup: queue order)
        window = list(itertools.islice(self.queue, ADMISSION_LOOKAHEAD * limit if self.prefix_cache is None else limit))
        head = len(window[0].prompt)
        order = (range(1, len(window)) if self.prefix_cache is not None
                 else sorted(range(1, len(window)), key=lambda i: (abs(len(window[i].prompt) - head), i)))
        chosen, width, budget = [0], head, window[0].max_new_tokens
        for i in order:
            if len(chosen) == limit:
                break
            w, b = max(width, len(window[i].prompt)), max(budget, window[i].max_new_tokens)
            if w + b > self.span or (len(chosen) + 1) * w > self.max_batch_tokens:
                continue
            chosen.append(i)
            width, budget = w, b
        return chosen

    def prefilled(self) -> None:
        """Called at the host sync after an admission's prefill: the requests taken since have
        their first token."""
        now = time.perf_counter()
        for req in self._prefilling:
            self.timings[req.index].first_token = now
        self._prefilling = []

    def finish(self, row: int, generated: list[int]) -> None:
        """Row ``row``'s request ended with ``generated``: record its output and free the row."""
        req, self.slots[row] = self.slots[row], None
        if req.streaming:
            self.num_streaming -= 1
            self._streamed.pop(req.index, None)
        t = self.timings[req.index]
        t.finished = time.perf_counter()
        out = self.outputs[req.index] = req.output(RequestStatus.FINISHED, generated)
        out.created_time, out.lifespan = t.queued, (t.admitted, t.finished)
        self.num_finished += 1
        self.new_tokens += len(generated)
        if self.on_finish is not None:
            self.on_finish()

    def streaming_rows(self) -> list[int]:
        """The rows holding a request whose tokens are streamed."""
        if not self.num_streaming:
            return []
        return [b for b, req in enumerate(self.slots) if req is not None and req.streaming]

    def stream(self, row: int, tokens: list[int]) -> None:
        """Row ``row``'s (streaming) request committed ``tokens``: hand its partial output, every
        token so far with status ``DECODING``, to :attr:`on_stream`."""
        req = self.slots[row]
        so_far = self._streamed.setdefault(req.index, [])
        so_far += tokens
        if tokens and self.on_stream is not None:
            self.on_stream(req.output(RequestStatus.DECODING, list(so_far)))

    def busy(self, finished: list[bool]) -> list[int]:
        """The rows holding a request that ``finished`` (host copy of the loop's flags) says ended
        (not the row whose prompt is being prefilled in chunks: it has not started)."""
        chunked = self.prefilling_chunks.row if self.prefilling_chunks is not None else None
        return [b for b, req in enumerate(self.slots) if req is not None and finished[b] and b != chunked]


# ------------------------------------------------------------------------------ memory

#: the share of free device memory ``max_batch_size="auto"`` plans for when no ``memory_budget``
#: is given (the rest is left to prefill activations, CUDA graph pools and fragmentation)
MEMORY_FRACTION = 0.9
#: one admission prefills at most ``ceil(rows / ADMISSION_DIVISOR)`` requests (:func:`admission_rows`)
ADMISSION_DIVISOR = 8
#: while other rows decode, free rows wait for a full admission (:func:`admission_rows` of them, or
#: the whole queue if shorter) at most this many steps (Text Generation Inference's
#: ``max_waiting_tokens``, 20 there too): a prefill of a few prompts costs about as much as one of
#: a group (its kernels are latency-bound), so a group amortises it over more rows
MAX_WAITING_STEPS = 20
#: an admission picks its requests, after the oldest waiting one, among the next
#: ``ADMISSION_LOOKAHEAD`` x its limit queued requests (:meth:`RequestPool.take`)
ADMISSION_LOOKAHEAD = 4
#: the most rows ``max_batch_size="auto"`` chooses
MAX_AUTO_BATCH_SIZE = 1024

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, name: str = "memory_budget", least: int = 1) -> int:
    """Bytes from an int >= ``least`` or a string: a number and a unit, e.g. ``"40GiB"``,
    ``"512 MiB"``, ``"1.5GB"`` (B; kB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of
    1024; any case). ``name``: the argument's name in the errors.

    Raises: TypeError for another type; ValueError for a string of another form or a value below
    ``least`` bytes."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", value)
        unit = m and _UNITS.get(m.group(2).lower())
        if not unit:
            raise ValueError(f"{name} {value!r}: give bytes as an int or a number with a unit, e.g. '40GiB', "
                             "'512MiB', '1.5GB' (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        nbytes = int(float(m.group(1)) * unit)
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be bytes (an int) or a string such as '40GiB', got {type(value).__name__}")
    else:
        nbytes = int(value)
    if nbytes < least:
        raise ValueError(f"{name} must be at least {least} byte{'s' * (least != 1)}, got {value!r}")
    return nbytes


def format_bytes(nbytes: float) -> str:
    """``nbytes`` for people: ``"1.9 MiB"``, ``"40.0 GiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def free_memory(device) -> int | None:
    """Bytes free for new tensors on ``device``: on CUDA the driver's free memory
    (``torch.cuda.mem_get_info``) plus what PyTorch's caching allocator holds unused; on CPU the
    kernel's ``MemAvailable`` (``/proc/meminfo``); None where unknown (other devices, no ``/proc``)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def cache_bytes(cache, device=None) -> int:
    """Bytes of a :class:`~specdec.cache.HybridCache`'s buffers: attention KV, conv windows and the
    rollback stores (:func:`specdec.adaptive.rollback_bytes`); with ``device``, only those on it
    (a cache whose layers spread over several devices)."""
    on = (lambda t: True) if device is None else (lambda t, dev=torch.device(device): t.device == dev)
    kv = sum(t.numel() * t.element_size() for pair in cache.kv.values() for t in pair if on(t))
    conv = sum(layer.conv_window.numel() * layer.conv_window.element_size()
               for layer in cache.ssm.values() if layer.conv_window is not None and on(layer.conv_window))
    return kv + conv + rollback_bytes(cache, device)


def kv_columns(span: int, step_tokens: int) -> int:
    """KV columns of a decode whose rows commit at most ``span`` tokens (prompt with padding + new
    tokens) in steps of at most ``step_tokens``: the span and two steps of slack."""
    return span + 2 * step_tokens


def admission_rows(size: int) -> int:
    """The most requests one admission of a pool of ``size`` rows prefills at once:
    ``ceil(size / ADMISSION_DIVISOR)`` (their prefill states are a transient of that many rows:
    :func:`admission_bytes`)."""
    return max(1, -(-size // ADMISSION_DIVISOR))


@dataclass(frozen=True)
class _SSMLayerBytes:
    state_bytes: int  # S: one sequence's recurrent state as the strategies store it (fp32); 0: conv only
    conv_bytes_per_column: int  # one column of the conv window (channels x dtype size); 0: no conv
    conv_width: int
    input_bytes_per_token: int  # I: what replay caches per token


@dataclass(frozen=True)
class _ModelBytes:
    kv_bytes_per_token: int  # keys + values of every attention layer, one column
    ssm: tuple[_SSMLayerBytes, ...]
    vocab_size: int
    dtype_bytes: int


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ((dtype, device), _ModelBytes)


def _probe(adapter: HybridAdapter) -> _ModelBytes:
    """Each cached layer's bytes per sequence, read from a one-row cache after a one-token prompt
    and a one-token replay step (which allocates replay's per-token input history); once per model."""
    key = (adapter.dtype, adapter.device)
    found = _PROBED.get(adapter.model)
    if found is not None and found[0] == key:
        return found[1]
    cache = adapter.new_cache(1, kv_columns(1, 1), 1, ReplayRollback())
    ids = torch.zeros(1, 1, dtype=torch.long, device=adapter.device)
    adapter.prefill(ids, torch.ones_like(ids), cache)
    adapter.forward(ids, cache)
    kv = sum(k[0, :, 0].numel() * k.element_size() + v[0, :, 0].numel() * v.element_size()
             for k, v in cache.kv.values())
    layers = []
    for layer in cache.ssm.values():
        state = layer.ssm_state() if layer.has_recurrence else None
        hist = layer.store.tensors.get("hist") if layer.has_recurrence else None
        win = layer.conv_window
        layers.append(_SSMLayerBytes(
            state_bytes=0 if state is None else state[0].numel() * state.element_size(),
            conv_bytes_per_column=0 if win is None else win.shape[1] * win.element_size(),
            conv_width=layer.conv_width,
            input_bytes_per_token=sum(h[0, 0].numel() * h.element_size() for h in (hist or {}).values())))
    found = _ModelBytes(kv, tuple(layers), adapter.vocab_size, torch.empty((), dtype=adapter.dtype).element_size())
    _PROBED[adapter.model] = (key, found)
    return found


@dataclass(frozen=True)
class SequenceBytes:
    """Device bytes one row (sequence) of a decode pool holds (:func:`bytes_per_sequence`).

    kv_bytes: attention keys and values over ``kv_columns`` columns. state_bytes: every SSM layer's
    committed recurrent state (fp32) and conv window. rollback_bytes: what the rollback strategy
    keeps beyond the committed state (:meth:`RollbackStrategy.extra_state_bytes`). workspace_bytes:
    the step's logits (``T x vocab`` in the model's dtype and an fp32 copy) and the row's text
    buffer (int64).
    """

    strategy: str
    kv_columns: int
    kv_bytes: int
    state_bytes: int
    rollback_bytes: int
    workspace_bytes: int

    @property
    def total(self) -> int:
        return self.kv_bytes + self.state_bytes + self.rollback_bytes + self.workspace_bytes

    def describe(self) -> str:
        """e.g. ``"replay: 1.9 MiB state + 4.0 MiB KV per row"`` (state: committed + rollback)."""
        return (f"{self.strategy}: {format_bytes(self.state_bytes + self.rollback_bytes)} state + "
                f"{format_bytes(self.kv_bytes)} KV + {format_bytes(self.workspace_bytes)} workspace per row")


def bytes_per_sequence(model, strategy, span: int, num_speculative_tokens: int, *,
                       static: bool = False) -> SequenceBytes:
    """Device bytes one decode row holds, by part (:class:`SequenceBytes`).

    Per row, with T = K + 1 step tokens and C = :func:`kv_columns` ``(span, T)`` KV columns
    (the static path: rounded up to its bucket, :func:`specdec.graphs.bucket_length`):
    KV = C x (keys + values of every attention layer per token); state = per SSM layer, its fp32
    state S and its conv window (channels x (width - 1 + T)); rollback = per SSM layer,
    ``strategy.extra_state_bytes(S, T, I)`` (I: the bytes replay caches per token); workspace =
    T x vocab x (dtype size + 4) + (span + T) x 8. The layers' sizes are read once per model from
    a one-row cache after a one-token prompt and step (a small forward on the model's device).
    Not counted: the drafter's own state, prefill activations, CUDA graph pools.

    Args:
        model: a Hugging Face model of a supported family, or its :class:`~specdec.models.HybridAdapter`.
        strategy: a :class:`~specdec.rollback.RollbackStrategy` or a name (``"snapshot"``,
            ``"ring"``, ``"replay"``, ``"replay_deferred"``); for plain decoding (K = 0),
            :class:`~specdec.rollback.InPlaceUpdate`.
        span: the longest text a row commits, in tokens: prompt (left padding included) + new
            tokens (``generate_batch``: the longest prompt + the largest budget; a manager: its
            ``max_length``).
        num_speculative_tokens: K, the most drafts of one step (with ``"auto"``: ``max_speculative_tokens``).
        static: the static / CUDA-graph decode path.

    Raises: ValueError / TypeError: an unknown strategy; an unsupported model family.
    """
    adapter = model if isinstance(model, HybridAdapter) else adapter_for(model)
    strategy = make_strategy(strategy)
    T = int(num_speculative_tokens) + 1
    cols = kv_columns(int(span), T)
    cols = bucket_length(cols) if static else cols
    m = _probe(adapter)
    state = sum(layer.state_bytes + layer.conv_bytes_per_column * (layer.conv_width - 1 + T) for layer in m.ssm)
    extra = sum(int(strategy.extra_state_bytes(layer.state_bytes, T, layer.input_bytes_per_token))
                for layer in m.ssm if layer.state_bytes)
    workspace = T * m.vocab_size * (m.dtype_bytes + 4) + (int(span) + T) * 8
    return SequenceBytes(strategy=strategy.name, kv_columns=cols, kv_bytes=m.kv_bytes_per_token * cols,
                         state_bytes=state, rollback_bytes=extra, workspace_bytes=workspace)


def admission_bytes(rows: int, row: SequenceBytes) -> int:
    """The transient bytes one admission of a pool of ``rows`` rows of ``row`` bytes holds beside
    them: its prompts' prefill states before they are written into the pool's rows
    (:func:`admission_rows` prompts, each at most a row's KV and its SSM state and conv window:
    the rollback store's extra and the workspace are the pool's own), and at least one whole row
    (a prompt prefilled in chunks fills a one-row cache of its own)."""
    return max(admission_rows(rows) * (row.kv_bytes + row.state_bytes), row.total)


def pool_bytes(rows: int, row: SequenceBytes) -> int:
    """The bytes a pool of ``rows`` rows of ``row`` bytes each needs: its rows and one admission's
    transient (:func:`admission_bytes`)."""
    return rows * row.total + admission_bytes(rows, row)


@dataclass(frozen=True)
class PoolPlan:
    """A pool's rows and, with ``max_batch_size="auto"``, how they were chosen (``reason``, also
    logged on ``specdec.batching``); ``per_row`` and ``budget`` (bytes) when memory was looked at."""

    rows: int
    reason: str | None = None
    per_row: SequenceBytes | None = None
    budget: int | None = None


def plan_rows(max_batch_size, num_requests: int | None, per_row: Callable[[], SequenceBytes],
              memory_budget=None, available: Callable[[], int | None] | None = None, reserved: int = 0) -> PoolPlan:
    """The rows of a decode pool.

    A pool of r rows needs :func:`pool_bytes` bytes (its rows and one admission's transient). ``"auto"``: the most rows that fit the budget (``memory_budget``,
    else :data:`MEMORY_FRACTION` x ``available()``), at most :data:`MAX_AUTO_BATCH_SIZE` and
    ``num_requests``. An int: ``min(max_batch_size, num_requests)`` rows, checked against
    ``memory_budget``, else ``available()`` when known. None: ``min(num_requests,
    DEFAULT_MAX_BATCH_SIZE)`` (``DEFAULT_MAX_BATCH_SIZE`` for a manager), not checked.

    Args:
        max_batch_size: an int >= 1, ``"auto"`` or None.
        num_requests: how many requests will run (``generate_batch``), or None (a manager: any).
        per_row: gives one row's :class:`SequenceBytes` (called only for an int or ``"auto"``).
        memory_budget: bytes (an int or a :func:`parse_bytes` string), or None.
        available: gives the bytes the pool could take (free device memory and what the
            generator's kept buffers hold), or None where unknown.
        reserved: bytes the budget must leave to something beside the pool that grows while it
            decodes (a prefix cache's ``max_bytes``): the rows get the budget less these.

    Raises:
        TypeError / ValueError: a bad ``max_batch_size`` or ``memory_budget``; ``"auto"`` with no
        budget where free memory is unknown; ``"auto"`` where not one row fits; an int whose
        rows need more than the budget (the message gives the numbers).
    """
    auto = max_batch_size == "auto"
    rows = None if auto else pool_size(max_batch_size, DEFAULT_MAX_BATCH_SIZE if num_requests is None else num_requests)
    if rows is not None and num_requests is not None:
        rows = max(1, min(rows, num_requests))
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    if max_batch_size is None:
        if budget is not None:
            warn_caller(f"memory_budget={memory_budget!r} has no effect without max_batch_size (an int, checked "
                        f"against it, or 'auto', sized by it): the pool has {rows} rows")
        return PoolPlan(rows)
    if budget is not None:
        source = f"memory_budget {format_bytes(budget)}"
    else:
        free = available() if available is not None else None
        if free is None:
            if auto:
                raise ValueError("max_batch_size='auto' needs the free memory of the device, which is unknown here; "
                                 "give memory_budget= (bytes, or e.g. '8GiB')")
            return PoolPlan(rows)
        budget = int(free * MEMORY_FRACTION) if auto else free
        source = (f"{MEMORY_FRACTION:g} x {format_bytes(free)} free" if auto
                  else f"the {format_bytes(free)} free on the device")
    if reserved:
        if reserved >= budget:
            raise ValueError(f"the prefix cache may hold {format_bytes(reserved)} (prefix_cache_bytes), as much as "
                             f"{source} or more: nothing is left for the pool's rows; lower prefix_cache_bytes or "
                             "raise "
                             "memory_budget")
        budget -= reserved
        source += f" less the prefix cache's {format_bytes(reserved)}"
    row = per_row()

    def need(r: int) -> int:
        return pool_bytes(r, row)

    if not auto:
        if need(rows) > budget:
            raise ValueError(f"max_batch_size={max_batch_size}: {rows} rows need about {format_bytes(need(rows))} "
                             f"({rows} rows x {format_bytes(row.total)} + an admission's "
                             f"{format_bytes(admission_bytes(rows, row))}; "
                             f"{row.describe()}, {row.kv_columns} KV columns) but {source} is less; lower "
                             "max_batch_size, use "
                             "max_batch_size='auto', or give memory_budget=")
        return PoolPlan(rows, None, row, budget)
    rows = budget // row.total  # (need(r) > r rows' bytes: from there down to the most that fit)
    while rows > 0 and need(rows) > budget:
        rows -= 1
    if rows < 1:
        raise ValueError(f"max_batch_size='auto': not one row fits {source} (a row needs {format_bytes(need(1))} "
                         f"with its admission: {row.describe()}, {row.kv_columns} KV columns); give a larger "
                         "memory_budget or "
                         "lower the requests' length bound")
    cap, why = min([(MAX_AUTO_BATCH_SIZE, "MAX_AUTO_BATCH_SIZE")]
                   + ([(num_requests, "requests")] if num_requests is not None else []))
    chosen = max(1, min(rows, cap))
    reason = (f"max_batch_size=auto: {chosen} rows ({row.describe()}, {source}"
              + (f"; {rows} rows fit, capped at {cap} ({why})" if rows > cap else "") + ")")
    logger.info(reason)
    return PoolPlan(chosen, reason, row, budget)
