"""Continuous batching: requests of any lengths through a fixed pool of decode rows.

:meth:`specdec.engine.SpeculativeGenerator.generate_batch` takes a list of prompts. A
:class:`RequestPool` holds them in a queue and gives the decode loop's ``max_batch_size`` rows
(slots) to them: the first requests are prefilled as the loop's batch; whenever rows finish
(EOS or their own ``max_new_tokens``), between two steps, their outputs are read and the next
requests take their slots (prefilled together into a fresh cache and moved in with
:meth:`specdec.cache.HybridCache.reset_rows`). The result is keyed and typed as Hugging Face's
``generate_batch`` returns it: ``req_0``, ``req_1``, ... in input order, each a
``transformers`` ``GenerationOutput``; a request that cannot run (empty, ids outside the
vocabulary, longer than the model's context) carries ``status=FAILED`` and its ``error``, as HF
reports a failed request, and the others run.

Each request's times (:class:`RequestTiming`: queued, admitted, first token, finished; host
``time.perf_counter()`` seconds taken where the loop syncs with the device anyway) are in
``SpeculativeGenerator.last_request_timings``; its output's ``created_time`` and ``lifespan``
(HF's fields) hold the queued time and (admitted, finished).
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

__all__ = ["DEFAULT_MAX_BATCH_SIZE", "GenerationOutput", "Request", "RequestPool", "RequestStatus", "RequestTiming",
           "check_requests", "left_pad", "pool_size"]

#: the pool's rows when ``max_batch_size`` is not given: ``min(len(inputs), DEFAULT_MAX_BATCH_SIZE)``
DEFAULT_MAX_BATCH_SIZE = 32


@dataclass(frozen=True)
class Request:
    """One prompt of a ``generate_batch`` call: its position in ``inputs``, token ids and budget."""

    index: int
    prompt: tuple[int, ...]
    max_new_tokens: int

    @property
    def request_id(self) -> str:
        return f"req_{self.index}"


@dataclass
class RequestTiming:
    """When a request went through the pool: ``time.perf_counter()`` seconds, each taken on the
    host at a point where the decode loop syncs with the device anyway (no sync of its own).

    Attributes:
        queued: the ``generate_batch`` call's start (every request waits in the queue from then).
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

    Raises: ValueError for ``"auto"`` (not available yet) or an int < 1; TypeError otherwise."""
    if max_batch_size is None:
        return max(1, min(num_requests, DEFAULT_MAX_BATCH_SIZE))
    if max_batch_size == "auto":
        raise ValueError("max_batch_size='auto' (sized from free memory) is not available yet; give an int >= 1 "
                         f"or None (min(len(inputs), {DEFAULT_MAX_BATCH_SIZE}))")
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, numbers.Integral):
        raise TypeError(f"max_batch_size must be an int >= 1 or None, got {type(max_batch_size).__name__}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return int(max_batch_size)


def check_requests(inputs, max_new_tokens, vocab_size: int,
                   max_positions: int | None) -> tuple[list[Request], dict[int, GenerationOutput]]:
    """Split ``inputs`` into the requests that can run and the failed outputs of those that cannot.

    Args:
        inputs: a list of prompts, each a list (or 1-D tensor) of int token ids.
        max_new_tokens: one int >= 0 for every request, or a list of them (one per request).
        vocab_size: ids must be in ``[0, vocab_size)``.
        max_positions: the model's context (``config.max_position_embeddings``) or None: prompt +
            budget must not exceed it.

    Returns: ``(requests, failed)``: the runnable :class:`Request` s in input order, and for each
    request that cannot run (empty prompt, ids outside the vocabulary, prompt + budget beyond the
    context) its index -> a ``GenerationOutput`` with ``status=RequestStatus.FAILED`` and ``error``.

    Raises:
        TypeError: ``inputs`` not a list/tuple, a prompt not a list of ints, a budget not an int.
        ValueError: a negative budget, or a list of budgets of another length than ``inputs``.
    """
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(inputs)
    if len(budgets) != len(inputs):
        raise ValueError(f"max_new_tokens is a list of {len(budgets)} budgets for {len(inputs)} requests; give one "
                         "int, or one per request")
    for i, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"max_new_tokens of req_{i} must be an int, got {type(b).__name__}")
        if b < 0:
            raise ValueError(f"max_new_tokens of req_{i} must be >= 0, got {b}")
    requests, failed = [], {}
    for i, prompt in enumerate(inputs):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist() if prompt.dim() <= 1 else prompt
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"req_{i}: a prompt must be a list of int token ids, got {type(prompt).__name__}")
        ids, budget = tuple(int(t) for t in prompt), int(budgets[i])
        error = None
        if not ids:
            error = "empty prompt: give at least one token id"
        elif any(t < 0 or t >= vocab_size for t in ids):
            outside = sorted({t for t in ids if not 0 <= t < vocab_size})
            error = f"token ids outside the vocabulary [0, {vocab_size}): {outside}"
        elif max_positions is not None and len(ids) + budget > max_positions:
            error = (f"prompt ({len(ids)} tokens) + max_new_tokens ({budget}) exceeds the model's context "
                     f"(max_position_embeddings={max_positions})")
        if error is None:
            requests.append(Request(i, ids, budget))
        else:
            failed[i] = GenerationOutput(request_id=f"req_{i}", prompt_ids=list(ids), error=error,
                                         status=RequestStatus.FAILED)
    return requests, failed


def left_pad(prompts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [n, L], attention_mask [n, L])`` int64: the prompts left-padded (pad id 0) to the longest."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, L - len(p):] = 1
    return ids.to(device), mask.to(device)


class RequestPool:
    """The queue of requests and the request each of the loop's ``size`` rows decodes.

    ``span`` bounds every row's committed length (longest prompt + largest budget): the KV
    columns and text buffers are sized from it once, for every request of the call.
    """

    def __init__(self, requests: list[Request], size: int, queued: float | None = None):
        self.queue = deque(requests)
        #: each request's times by index; ``queued``: the call's start (default: now)
        self.timings = {r.index: RequestTiming(time.perf_counter() if queued is None else queued) for r in requests}
        self._prefilling: list[Request] = []  # admitted, first token not yet seen
        self.slots: list[Request | None] = [None] * size
        self.outputs: dict[int, GenerationOutput] = {}
        self.span = max(len(r.prompt) for r in requests) + max(r.max_new_tokens for r in requests)
        #: called once per finished request (the progress bar), or None
        self.on_finish: Callable[[], None] | None = None

    def take(self, rows: list[int]) -> list[Request]:
        """Give the first queued requests to ``rows`` (as many as there are of both); returns them."""
        taken = []
        for row in rows:
            if not self.queue:
                break
            self.slots[row] = req = self.queue.popleft()
            taken.append(req)
        now = time.perf_counter()
        for req in taken:
            self.timings[req.index].admitted = now
        self._prefilling += taken
        return taken

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
        t = self.timings[req.index]
        t.finished = time.perf_counter()
        self.outputs[req.index] = GenerationOutput(request_id=req.request_id, prompt_ids=list(req.prompt),
                                                   generated_tokens=generated, status=RequestStatus.FINISHED,
                                                   created_time=t.queued, lifespan=(t.admitted, t.finished))
        if self.on_finish is not None:
            self.on_finish()

    def busy(self, finished: list[bool]) -> list[int]:
        """The rows holding a request that ``finished`` (host copy of the loop's flags) says ended."""
        return [b for b, req in enumerate(self.slots) if req is not None and finished[b]]
