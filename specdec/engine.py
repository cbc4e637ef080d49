"""The speculative loop: draft -> verify -> accept -> commit, batched with ragged acceptance.

One step (for each row): the drafter proposes k_i <= K tokens (or the tokens of a draft tree);
the target runs ``[pending, d_1 .. d_k]`` (rows padded with placeholders that never reach a
committed state) in one forward; acceptance picks n_i and a correction/bonus token c_i; the
cache commits n_i + 1 tokens per row (a tree: the accepted path); c_i becomes pending.

One loop body (:meth:`SpeculativeGenerator._decode`) runs every call: chains and trees, on
either :class:`~specdec.decoding.Decoder` (eager: dynamic shapes; static: fixed shapes,
optionally CUDA graphs). Acceptance, EOS, the budget, the text buffer and the statistics stay
on the device; the step's one host sync reads whether every row has finished (with the
drafter-output checks and, for a streamer, row 0's new tokens); in a fixed batch whose next K is
known on the host (a fixed K, or ``"auto"`` choosing before the sync) the next step's proposal is
launched before that sync, after the step has committed, so that the host's work of proposing
overlaps the device's (:func:`overlap_proposals`); without a per-token hook the whole next step
is launched before that sync, which then waits for the step's flags alone
(:func:`overlap_steps`). HF features that work token by
token (stopping criteria, logits processors, returned scores) are one optional per-step hook
(:class:`~specdec.step_hook.StepHook`). With ``num_speculative_tokens="auto"`` a
:class:`~specdec.adaptive.SpeculationPolicy` gives each step its K (the same sync brings its
expected tokens per K); with ``rollback="auto"`` the call's strategy is chosen before the
prefill (:mod:`specdec.adaptive`). Continuous batching (:meth:`SpeculativeGenerator.generate_batch`,
:mod:`specdec.batching`) runs the same loop over a pool of rows: each step starts with an admission
phase in which rows whose request ended take the next waiting prompts; :mod:`specdec.serving` runs
it on a background thread over a pool that stays open (``init_continuous_batching``).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from .adaptive import (AUTO, CostKey, CostModel, DrafterKey, PolicySettings, SpeculationPolicy, calibrate,
                       choose_strategy, costs_for, expected_tokens, rollback_bytes, strategy_label)
from .batching import (DEFAULT_MAX_BATCH_TOKENS, GenerationOutput, PoolPlan, RequestPool, RequestStatus, RequestTiming,
                       SequenceBytes, bytes_per_sequence, cache_bytes, check_batch_tokens, check_requests, format_bytes,
                       free_memory, kv_columns, left_pad, parse_bytes, plan_rows, pool_bytes)
from .clock import StepClock
from .decoding import Decoder, EagerDecoder, StaticDecoder
from .drafters import Drafter, make_drafter
from .drafters.base import (chain_drafts, check_draft_probs, check_proposal, check_tree_proposal, draft_prob_errors,
                             proposal_errors)
from .fusion import env_switch
from .graphs import CapturedProgram, warmups_run
from .models import adapter_for
from .placement import on_device
from .prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, PREFIX_BLOCK_SIZE, PrefixCache, check_prefix_cache_args
from .rollback import STRATEGIES, InPlaceUpdate, RollbackStrategy, make_strategy
from .serving import ContinuousBatchingManager
from .settings import context_length, resolve, warn_caller
from .stats import Stats
from .step_hook import StepHook
from .tree import tree_for
from .verify import accept_tree, greedy_accept, process_logits, sample_accept

__all__ = ["DECODE_PATHS", "MAX_SPECULATIVE_TOKENS", "SpeculativeGenerator"]

#: the largest ``num_speculative_tokens`` (K) the engine accepts
MAX_SPECULATIVE_TOKENS = 64
#: the strategy of plain decoding (K = 0): one shared stateless object, so static buckets are kept across calls
_IN_PLACE = InPlaceUpdate()
#: id of a drafter that keeps per-call state -> the generator whose decode loop drafts with it now
_DRAFTING: dict[int, "SpeculativeGenerator"] = {}
_DRAFTING_LOCK = threading.Lock()
#: ``decode_path=`` values: "auto" = CUDA graphs on CUDA when the call's settings allow the static
#: path, else eager; "eager", "static" (fixed shapes, no graphs; also on CPU) and "cuda_graph" force one
DECODE_PATHS = ("auto", "eager", "static", "cuda_graph")


class _StepInputs(NamedTuple):
    """What one step verifies, made by the decode loop's ``propose`` (with the overlap, before
    the sync of the step before): the K asked for; per row ``[B]``: running, draft budget
    (None for a plain step without a policy: nothing uses it), drafts used ``k``; the drafts ``[B, width - 1]``, the drafter-output error flags, the
    forward's width, the step's tokens ``[B, width]`` (pending token, drafts), and the drafter's
    counts as it returned them (None: no chain proposal, or one made inside the step programs, whose
    buffer the next proposal overwrites) and its proposal's width ``w``."""

    K: int
    active: torch.Tensor
    budget: torch.Tensor | None
    drafts: torch.Tensor
    k: torch.Tensor
    errors: torch.Tensor
    width: int
    tokens: torch.Tensor
    counts: torch.Tensor | None
    w: int


def overlap_proposals() -> bool:
    """Whether a fixed batch's decode loop makes each step's proposal before the last step's
    sync (``SPECDEC_OVERLAP``, default on; ``0`` makes every proposal after the sync, as a
    baseline to time it against). The outputs are the same either way."""
    return env_switch("SPECDEC_OVERLAP")


def overlap_steps() -> bool:
    """Whether a fixed batch's decode loop without a per-token hook launches each step before it
    reads the last step's flags (``SPECDEC_OVERLAP_STEPS``, default on; ``0`` reads every step's
    flags before the next step starts, as a baseline to time it against). With a fixed K the
    outputs, the statistics and the random state after the call are the same either way. What
    differs: a call that ends before the step count the host can bound (by EOS, or by
    speculation) runs one step more, dropped (its device time stays in the wall time), which
    leaves the SSM states of ``last_cache`` unspecified where that step ran at K = 0; a
    drafter's bad output is reported after one more step; with ``num_speculative_tokens="auto"``
    each choice of K reads the acceptance one step later, so its choices, and with them sampled
    outputs and the statistics, may differ (greedy outputs are exact either way). See
    ``docs/design.md``, "The decode loop"."""
    return env_switch("SPECDEC_OVERLAP_STEPS")


def shadow_proposals_enabled() -> bool:
    """Whether a greedy fixed batch under ``num_speculative_tokens="auto"`` with a stateless
    drafter observes its acceptance at plain steps (:class:`_ShadowProposals`) instead of probing
    (on by default; ``SPECDEC_SHADOW_PROPOSALS=0``: probes, as for other drafters; docs/design.md,
    "Shadow proposals", has the GPU runs that compare them). The greedy outputs are the same
    either way, up to the near-ties that another schedule of K meets in low precision."""
    return env_switch("SPECDEC_SHADOW_PROPOSALS", default=True)


#: a run of plain steps under K chosen per step makes a shadow proposal at one step in this many
#: (:class:`_ShadowProposals`), each of this many drafts, checked at the next one against the
#: tokens the plain steps between committed
SHADOW_EVERY = 4

#: the first shadow of a run of plain steps falls on its step of this index (0-based), the others
#: every :data:`SHADOW_EVERY` after. A step that makes a shadow and the step after it feed no cost
#: (:meth:`~specdec.adaptive.SpeculationPolicy.unmeasured`): where the loop is bound by its
#: launches, the host work a shadow leaves after its step's last lap (the update its observation
#: launches) shows in the next step's window (on an H100 it priced the zoo model's plain steps
#: 0.1 ms high when the shadows fell on steps 0, 4, 8, ... and the costs sampled steps 1, 9, ...).
#: Not step 0, whose extra time the costs take as the switch to plain steps, nor 1, the run's
#: first plain sample.
SHADOW_OFFSET = 2


class _ShadowProposals:
    """The acceptance a stateless drafter would have had at plain steps, observed without
    speculating: under ``num_speculative_tokens="auto"`` a run of plain steps (K = 0) asks the
    drafter for ``depth`` drafts (:data:`SHADOW_EVERY`, at most the policy's largest K) at its
    step :data:`SHADOW_OFFSET` and then every :data:`SHADOW_EVERY`-th, from the text as a speculative step there
    would have (a "shadow" proposal: nothing is verified), and at the next such step checks them
    against the tokens the plain steps between committed. With greedy decoding a draft is
    accepted exactly when it equals the target's token at its position, so the longest matching
    prefix (within the drafter's counts and the row's draft budget) is the drafts a step there
    would have accepted: an observation of the acceptance estimate like a speculative step's,
    where the policy would otherwise learn of a rise only from its probes (a whole speculative
    step each, spaced to cost ~1% of the time: a retrieval drafter's acceptance comes and goes
    with the text, and on the zoo model a run of plain steps outlasted the matches it missed).
    All device work, no host sync: per shadow the drafter's proposal and about twenty small
    kernels, then the estimate's update the observation brings (some 30 launches in all), which
    the policy's costs do not charge to plain steps (their ``"shadow"`` laps are not taken in;
    ``Stats.draft_s`` counts those). A speculative step ends the run and drops the
    shadow pending; a row that ended before committing the shadow's positions is not observed.

    Args:
        drafter: a stateless drafter (:attr:`~specdec.drafters.Drafter.stateless`).
        batch: B. device: the rows'. depth: the policy's largest K.
    """

    def __init__(self, drafter: Drafter, batch: int, device, depth: int):
        self.drafter, self.batch, self.depth = drafter, batch, min(depth, SHADOW_EVERY)
        self._j = torch.arange(self.depth, device=device)[None, :]
        self._run = 0  # plain steps in the current run, this one included
        self._pending: tuple | None = None  # (drafts [B, depth], counts [B], lengths [B], asked [B])

    def due(self, K: int) -> bool:
        """Called once per step with its K: whether this step makes a shadow (:meth:`make`). A
        step at K > 0 ends the run of plain steps and drops the shadow pending."""
        if K:
            self._run, self._pending = 0, None
            return False
        self._run += 1
        return (self._run - 1) % SHADOW_EVERY == SHADOW_OFFSET

    def make(self, text: torch.Tensor, bound: int, lengths: torch.Tensor, budget: torch.Tensor) -> tuple | None:
        """At a step :meth:`due` said makes one, before its forward, from the rows as they are then
        (``text [B, W]``, of which the first ``bound`` columns hold every row's text; ``lengths``
        and the draft ``budget``, ``[B]``, 0 for an ended row): this step's shadow. Returns the
        observation of the last one, ``(num_accepted, num_asked, ran)`` ``[B]`` each, for this
        step's :meth:`~specdec.adaptive.SpeculationPolicy.update`, or None. Raises what
        :func:`check_proposal` raises."""
        seen = None if self._pending is None else self._judge(text, lengths)
        lengths = lengths.clone()  # (the drafter gets copies, as at a speculative step; kept for the judge)
        drafts, counts = check_proposal(self.drafter.propose(text[:, :bound].clone(), lengths.clone(), self.depth),
                                        self.batch, self.depth)
        # (a drafter may return fewer columns than asked: the positions past them are not proposed,
        # which a speculative step observes as a rejection, as the counts here make them)
        self._pending = (_to_width(drafts.to(text.device).long(), self.depth),
                         counts.to(text.device).long().clamp(0, drafts.shape[1]), lengths,
                         budget.clamp(max=self.depth))
        return seen

    def _judge(self, text: torch.Tensor, lengths: torch.Tensor) -> tuple:
        """The pending shadow's observation (see :meth:`make`): a row ran it if it has since
        committed every position it was asked for (an ended row's length stays)."""
        drafts, counts, start, asked = self._pending  # (drafts: depth columns)
        j = self._j
        committed = text.gather(1, (start[:, None] + j).clamp(max=text.shape[1] - 1))
        hit = (committed == drafts) & (j < counts[:, None])
        n = torch.minimum(hit.long().cumprod(1).sum(1), asked)
        return n, asked, lengths >= start + asked


def _random_state(generator, device) -> tuple:
    """What a proposal may draw from, saved: the call's ``generator`` (if any), torch's CPU
    generator and, on CUDA, the device's default generator (host copies; no device sync)."""
    dev = torch.device(device)
    return (generator, None if generator is None else generator.get_state(), torch.get_rng_state(), dev,
            torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)


class _FlagReads:
    """The host copies of a call's step flags, each started as its step ends and read later: on
    CUDA two slots, each a pinned buffer per size and dtype of the flags and an event, used in
    turn (a step's copy is read before the copy two steps later starts), so a read waits for its
    own copy alone, not for work launched after it, and steps do not allocate; elsewhere the
    flags themselves (their values are ready). ``stream``: the decode loop's stream on CUDA
    (its step clock's, :attr:`StepClock.stream`), where the copies' events are recorded."""

    def __init__(self, device, stream=None):
        self._cuda = torch.device(device).type == "cuda"
        self._buffers: list[dict] = [{}, {}]  # per slot: (shape, dtype) -> pinned buffer
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else None
        self._stream = stream
        self._next = 0

    def start(self, values: torch.Tensor) -> tuple:
        """Start the host copy of ``values`` (a small 1-d device tensor); returns its handle."""
        if not self._cuda:
            return values, None
        i, self._next = self._next, 1 - self._next
        key = (tuple(values.shape), values.dtype)  # (the flags' size and dtype may vary from step to step)
        buffer = self._buffers[i].get(key)
        if buffer is None:
            buffer = self._buffers[i][key] = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        buffer.copy_(values, non_blocking=True)  # (on the current stream: the loop's)
        self._events[i].record(self._stream)
        return buffer, self._events[i]

    @staticmethod
    def read(handle: tuple) -> list:
        """The values of a started copy as a host list (waits for that copy)."""
        values, event = handle
        if event is not None:
            event.synchronize()
        return values.tolist()


def _restore_random_state(saved: tuple) -> None:
    """Put back what :func:`_random_state` saved."""
    generator, state, cpu, dev, cuda = saved
    if generator is not None:
        generator.set_state(state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, dev)


def _prefix_cache(prefix_caching, prefix_block_size, prefix_cache_bytes) -> PrefixCache | None:
    """The prefix cache of a ``generate_batch`` call or a manager (empty), or None without
    ``prefix_caching``; every argument checked either way (a size given without it warns).

    Raises: TypeError (``prefix_caching`` not a bool) / as :func:`check_prefix_cache_args`."""
    if not isinstance(prefix_caching, bool):
        raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
    given_bytes = prefix_cache_bytes
    if isinstance(prefix_cache_bytes, str):  # a size, as memory_budget takes it ("1GiB")
        prefix_cache_bytes = parse_bytes(prefix_cache_bytes, "prefix_cache_bytes", least=0)
    check_prefix_cache_args(prefix_block_size, prefix_cache_bytes)
    if not prefix_caching:
        given = [f"{name}={shown!r}" for name, value, shown, default in (
            ("prefix_block_size", prefix_block_size, prefix_block_size, PREFIX_BLOCK_SIZE),
            ("prefix_cache_bytes", prefix_cache_bytes, given_bytes, DEFAULT_PREFIX_CACHE_BYTES)) if value != default]
        if given:
            warn_caller(f"{', '.join(given)} has no effect without prefix_caching=True")
    return PrefixCache(prefix_block_size, prefix_cache_bytes) if prefix_caching else None


def _first_sentences(text: str, n: int) -> str:
    """The first ``n`` sentences of ``text``'s first line (an out-of-memory error's opening: what
    failed and the size asked for, without the allocator's advice)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return " ".join(re.split(r"(?<=\.)\s+", line)[:n])


class _Rows:
    """Per-row decode state on the device: the text buffer ``[B, width]`` (each row's prompt without
    padding, then its new tokens; the last one pending), ``lengths``, new-token counts ``n_gen``,
    ``finished`` and each row's budget ``max_new`` (all ``[B]``); ``append`` adds a step's tokens,
    cut at EOS and at the budget; ``reset`` gives rows to new prompts (continuous batching).
    ``lengths`` and ``n_gen`` are the two rows of one ``[2, B]`` buffer (a step adds to both at once)."""

    def __init__(self, input_ids, mask, width: int, max_new, eos: tuple[int, ...]):
        B = input_ids.shape[0]
        dev = input_ids.device
        self.text = torch.zeros(B, width, dtype=torch.long, device=dev)
        self.prompt_len = torch.zeros(B, dtype=torch.long, device=dev)
        self._counts = torch.zeros(2, B, dtype=torch.long, device=dev)
        self.lengths, self.n_gen = self._counts
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
        self.max_new = torch.zeros(B, dtype=torch.long, device=dev)
        # one EOS id compares as a scalar (one kernel); several as a tensor
        self.eos = (eos[0] if len(eos) == 1 else torch.tensor(eos, dtype=torch.long, device=dev)) if eos else None
        # column indices, sliced by append (no arange per step); the last one, width + 1, stands for "no EOS"
        self._cols = torch.arange(width + 2, device=dev)
        self.reset(torch.arange(B, device=dev), input_ids, mask, max_new)

    def reset(self, rows: torch.Tensor, input_ids, mask, max_new) -> None:
        """Rows ``rows [n]`` (int64) start the left-padded prompts ``input_ids [n, L]`` (mask 0/1) with
        budgets ``max_new`` (an int or ``[n]`` int64) and no new tokens."""
        Lp = input_ids.shape[1]
        prompt_len = mask.sum(1)
        cols = torch.arange(Lp, device=input_ids.device)[None, :]
        src = (cols + (Lp - prompt_len)[:, None]).clamp(max=Lp - 1)
        text = torch.zeros(rows.shape[0], self.text.shape[1], dtype=torch.long, device=input_ids.device)
        text[:, :Lp] = torch.where(cols < prompt_len[:, None], input_ids.gather(1, src), torch.zeros_like(cols))
        self.text[rows] = text
        self.prompt_len[rows] = prompt_len
        self.lengths[rows] = prompt_len
        self.n_gen[rows] = 0
        self.finished[rows] = False
        self.max_new[rows] = max_new

    def append(self, new: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        """Append up to ``limit[b]`` of ``new [B, W]`` to each live row, cut after the first EOS and at
        the budget; returns the appended counts ``[B]`` (columns past them are scratch)."""
        W = new.shape[1]
        take = limit
        if self.eos is not None:
            is_eos = new == self.eos if isinstance(self.eos, int) else (new[..., None] == self.eos).any(-1)
            # 1 + the first EOS's index (> W if none); an EOS at or past limit[b] changes nothing
            # (stop > limit >= take), so the columns past the limit need no mask
            stop = torch.where(is_eos, self._cols[None, 1:W + 1], self._cols[-1]).amin(1)
            take = torch.minimum(take, stop)
        take = torch.minimum(take, self.max_new - self.n_gen).masked_fill(self.finished, 0)
        self.text.scatter_(1, self.lengths[:, None] + self._cols[None, :W], new)
        self._counts += take  # lengths and n_gen
        done = self.n_gen >= self.max_new
        if self.eos is not None:
            done |= stop <= take  # the first EOS was appended
        self.finished |= done
        return take

    def generated(self, rows: list[int]) -> list[list[int]]:
        """The new tokens of ``rows`` (host lists; one device-to-host copy)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.text.device)
        host = torch.cat([self.text[idx], self.prompt_len[idx, None], self.n_gen[idx, None]], 1).tolist()
        return [t[a:a + n] for *t, a, n in host]

    def output(self, input_ids, n_gen, pad: int) -> torch.Tensor:
        """``[B, L + G]``: the prompts as given, then each row's ``n_gen`` new tokens, padded."""
        G = int(n_gen.max())
        cols = torch.arange(G, device=self.text.device)[None, :]
        gen = self.text.gather(1, (self.prompt_len[:, None] + cols).clamp(max=self.text.shape[1] - 1))
        return torch.cat([input_ids, torch.where(cols < n_gen[:, None], gen, torch.full_like(gen, pad))], dim=1)


@dataclasses.dataclass
class _ChunkedPrefill:
    """A long prompt being prefilled a chunk per step into row ``row`` (continuous batching): the
    prompt ``ids [1, L]`` (no padding), the fresh cache it is loaded into and ``steps``, the
    :meth:`HybridAdapter.prefill_chunked` generator."""

    row: int
    ids: torch.Tensor
    cache: object
    steps: object


def _to_width(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t [B, w, ...]`` cut or zero-padded to ``cols`` columns along dim 1 (the step's draft columns)."""
    if t.shape[1] >= cols:
        return t[:, :cols]
    return torch.cat([t, t.new_zeros(t.shape[0], cols - t.shape[1], *t.shape[2:])], dim=1)


def _new_tokens(chain: torch.Tensor, n: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """A step's new tokens ``[B, W]``: the accepted drafts ``chain[:, :n]`` (``chain [B, W - 1]``),
    then ``c``; the columns past them are scratch."""
    new = c[:, None]
    if chain.shape[1]:
        new = torch.cat([chain, new], dim=1).scatter(1, n[:, None], new)
    return new


class _StepState:
    """A fixed batch's rows (:class:`_Rows`), the step counters and the constants a step reads, on
    the device, with the device work of a chain step before and after its forward. The state of a
    call whose steps run as :class:`_StepPrograms` is kept by its static bucket's decoder between
    calls of one shape, with the programs whose captured graphs read these tensors
    (``StaticDecoder.loop_state``); other calls make their own.

    Args: dec: the call's decoder (its ``width``; held weakly: the decoder keeps the state). B, K
    (the most drafts of a step), V (the vocabulary), dev; the rows' ``width`` and ``eos``, the
    prompts and budgets (see :class:`_Rows`). ``policed``: a speculation policy reads every step
    (:mod:`specdec.adaptive`): a step without drafts computes the draft budget too, and a greedy
    chain step's flags end with the count of rows still running (:meth:`greedy_chain`).
    """

    def __init__(self, dec: Decoder, B: int, K: int, V: int, dev, width: int, eos, input_ids, mask, max_new,
                 policed: bool = False):
        self._dec, self.V, self.policed = weakref.ref(dec), V, policed
        self.key = self.key_of(B, K, V, dev, width, eos, policed)
        self.rows = _Rows(input_ids, mask, width, max_new, eos)
        self.hist = torch.zeros(K + 1, dtype=torch.long, device=dev)
        self.totals = torch.zeros(3, dtype=torch.long, device=dev)  # row-steps, proposed, accepted
        self.no_errors = torch.zeros(2, dtype=torch.bool, device=dev)  # (errors of a step without a proposal)
        self.no_prob_errors = torch.zeros(1, dtype=torch.bool, device=dev)  # (... and of one without draft_probs)
        self.no_drafts = torch.zeros(B, dtype=torch.long, device=dev)
        self.empty = torch.zeros(B, 0, dtype=torch.long, device=dev)
        self.ones = torch.ones(B, dtype=torch.long, device=dev)

    @staticmethod
    def key_of(B: int, K: int, V: int, dev, width: int, eos, policed: bool) -> tuple:
        """What a kept state must match to serve a call."""
        return B, K, V, str(dev), width, tuple(eos), policed

    def reset(self, input_ids, mask, max_new) -> None:
        """Start a call: every row takes its prompt and budget (:meth:`_Rows.reset`), the counters zero."""
        self.rows.reset(torch.arange(self.rows.text.shape[0], device=self.rows.text.device), input_ids, mask, max_new)
        self.hist.zero_()
        self.totals.zero_()

    def draft_budget(self) -> torch.Tensor:
        """The drafts each row may use: its budget after the pending token (>= 0 for a live row,
        which has n_gen < max_new; clamped all the same, as chain_drafts and the policy need it);
        ``[B]`` int64."""
        rows = self.rows
        return (rows.max_new - rows.n_gen - 1).clamp(min=0).masked_fill(rows.finished, 0)

    def pending_and(self, drafts: torch.Tensor) -> torch.Tensor:
        """The step's tokens ``[B, 1 + columns]``: each row's pending token, then ``drafts``."""
        rows = self.rows
        tokens = rows.text.gather(1, (rows.lengths - 1)[:, None])
        return torch.cat([tokens, drafts], dim=1) if drafts.shape[1] else tokens

    def chain_inputs(self, K: int, drafts: torch.Tensor | None, counts: torch.Tensor | None) -> tuple:
        """A chain step's device inputs from a proposal (``drafts [B, w]``, ``counts [B]``, int64
        on the device; None: a step without drafts): ``(active, budget, drafts, k, errors,
        width, tokens)``, as :class:`_StepInputs` names them. A step without drafts computes the
        draft budget only where a policy reads it (``policed``; a plain step needs none: four
        kernels fewer)."""
        active = ~self.rows.finished  # the rows that run this step
        budget = self.draft_budget() if drafts is not None or self.policed else None
        if drafts is None:
            return active, budget, self.empty, self.no_drafts, self.no_errors, 1, self.pending_and(self.empty)
        drafts, k, errors = chain_drafts(drafts, counts, budget, self.V)
        width = self._dec().width(k, K)
        drafts = _to_width(drafts, width - 1)
        return active, budget, drafts, k, errors, width, self.pending_and(drafts)

    def proposed_inputs(self, K: int, drafter) -> tuple:
        """:meth:`chain_inputs` of ``drafter``'s proposal of K on the rows' own buffers
        (``rows.text`` at its full width, ``rows.lengths``; no copies: a
        :meth:`~specdec.drafters.base.Drafter.graph_safe` drafter reads them only), then the
        proposal's width ``w``. Raises what :func:`~specdec.drafters.base.check_proposal` raises."""
        rows = self.rows
        drafts, counts = check_proposal(drafter.propose(rows.text, rows.lengths, K), rows.text.shape[0], K)
        dev = rows.text.device
        return *self.chain_inputs(K, drafts.to(dev).long(), counts.to(dev).long()), drafts.shape[1]

    def counted(self, n: torch.Tensor, active: torch.Tensor, k: torch.Tensor) -> None:
        """The step's counters: the histogram of accepted drafts (a finished row has k = n = 0:
        its steps leave bin 0 after the loop), and the running rows, drafts used and accepted."""
        self.hist.index_add_(0, n, self.ones)
        self.totals.add_(torch.stack([active, k, n]).sum(1))

    def greedy_chain(self, logits: torch.Tensor, inputs: tuple) -> tuple:
        """A greedy chain step without a per-token hook from its forward's ``logits`` and
        ``inputs`` (:meth:`chain_inputs`) to its flags: ``(n, new, take, flags)`` (the settle
        program of :class:`_StepPrograms`; ``inputs`` may carry more entries after those seven).
        ``policed``: the flags end with the count of rows still running, which the policy reads."""
        active, _, drafts, k, errors = inputs[:5]
        n, c = greedy_accept(logits, drafts, k)
        new = _new_tokens(drafts, n, c)
        take = self.rows.append(new, n + 1)
        self.counted(n, active, k)
        flags = self.flags(errors, self.no_prob_errors)
        if self.policed:
            flags.append(self.live_rows())
        return n, new, take, torch.cat(flags)

    def flags(self, errors: torch.Tensor, prob_errors: torch.Tensor) -> list[torch.Tensor]:
        """The flags every step's sync reads: whether every row has finished, then the drafter
        output's error flags (``errors [2]``, ``prob_errors [1]``, bool); a caller may append more
        (``torch.cat`` promotes them to the parts' int64)."""
        return [self.rows.finished.all()[None], errors, prob_errors]

    def live_rows(self) -> torch.Tensor:
        """``[1]`` int64: the rows that have not ended (a policy's last flag)."""
        return (~self.rows.finished).sum()[None]


def captured_proposals_enabled() -> bool:
    """Whether the step programs (:class:`_StepPrograms`) run a
    :meth:`~specdec.drafters.base.Drafter.graph_safe` drafter's proposal inside their ``proposal``
    program, in place of the ``inputs`` one (``SPECDEC_CAPTURED_PROPOSALS``, default on; ``0``
    makes it propose outside them, on copies of the rows, as other drafters do, as a baseline to
    time it against). The outputs and statistics are the same either way, but for
    ``Stats.draft_path`` / ``draft_error``, which tell of the proposal program."""
    return env_switch("SPECDEC_CAPTURED_PROPOSALS")


def step_programs_enabled() -> bool:
    """Whether a greedy chain step on the static path runs its device work around the verify
    forward as captured programs (:class:`_StepPrograms`; ``SPECDEC_STEP_GRAPHS``,
    default on; ``0`` launches that work op by op, as a baseline to time it against). The outputs
    and statistics are the same either way."""
    return env_switch("SPECDEC_STEP_GRAPHS")


def compiled_steps_enabled() -> bool:
    """Whether the step programs (:class:`_StepPrograms`) are compiled whole with ``torch.compile``
    before their capture (``SPECDEC_COMPILED_STEPS=1``; default off: each program compiles once
    per K and batch shape on its first use). Their dozens of small ops then run as a few fused
    kernels, and a graph-safe drafter's proposal with them; the outputs and statistics are the
    same either way. Read when a program is first made; off where fusion is
    (``SPECDEC_FUSE=0``)."""
    return env_switch("SPECDEC_COMPILED_STEPS", default=False)


class _ProgramSlot:
    """A step program's arguments (the tensors a captured program read; None once an uncaptured
    run ended) and the outputs of its last run (after a capture: fixed tensors)."""

    __slots__ = ("args", "out")

    def __init__(self):
        self.args: tuple | None = None
        self.out: tuple | None = None


class _StepPrograms:
    """The device work of a greedy chain step around the target's verify forward, as captured
    programs per K (:class:`~specdec.graphs.CapturedProgram`; run eagerly at their first use, captured at
    the second and replayed from then on; with ``capture`` off, always eagerly):

    * ``inputs``: from the drafter's proposal (copied into fixed buffers) to the step's tokens:
      the draft budget, :func:`~specdec.drafters.base.chain_drafts`, the pending tokens
      (:meth:`_StepState.chain_inputs`); for a :meth:`~specdec.drafters.base.Drafter.graph_safe`
      drafter ``proposal`` instead, the same with the drafter's proposal itself inside
      (:meth:`_StepState.proposed_inputs`), so its kernels are replayed with the rest and its
      Python runs only until the capture;
    * ``settle``: from the forward's logits to the flags of the step's one sync: greedy
      acceptance, the rows' append (EOS, budget), the step counters
      (:meth:`_StepState.greedy_chain`; one program after each kind of inputs).

    Op by op these are dozens of small launches a step; two graph launches replace them, which matters
    where the host issuing a step bounds it (small models, small batches); with
    :func:`compiled_steps_enabled` each program is compiled whole before its capture, so its
    graph holds a few fused kernels. Their functions are
    those the loop runs op by op for its other steps (a proposal's, :meth:`_StepState.chain_inputs`
    after the drafter's own call).

    A ``proposal`` program is the proposing drafter's: another drafter gets its own programs,
    warmed up and captured anew (:meth:`proposal`; :meth:`drop_proposals` frees them). Where its
    capture fails (the drafter's proposal could not be captured), that drafter proposes outside
    the programs from then on.

    The settle program reads the forward's output tensor: a forward that returns another tensor
    than the one it was captured with (the decoder lost its graphs) runs the function eagerly
    from then on."""

    def __init__(self, state: _StepState, capture: bool):
        self.state, self.capture = state, capture
        self._fns = {"inputs": state.chain_inputs, "proposal": state.proposed_inputs, "settle": state.greedy_chain}
        self._source: dict[int, str] = {}  # K -> the kind of program ("inputs" / "proposal") that ran last for K
        self._proposer = None  # the drafter whose proposals the proposal programs make
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # K -> fixed (drafts, counts)
        self._programs: dict[tuple[str, int], CapturedProgram] = {}
        self._slots: dict[tuple[str, int], _ProgramSlot] = {}

    @staticmethod
    def _store(slot: _ProgramSlot, fn) -> None:
        """A program's body: ``slot.out = fn(*slot.args)`` (no reference to the programs object, so
        dropping it frees its graphs at once; one slot per program, so a program compiled whole
        guards on its own arguments only)."""
        slot.out = fn(*slot.args)

    def _run(self, kind: str, K: int, args: tuple, fn_kind: str | None = None) -> tuple:
        """Run program ``(kind, K)`` of ``self._fns[fn_kind or kind]`` on ``args``; its outputs."""
        key = kind, K
        program, slot = self._programs.get(key), self._slots.get(key)
        if program is not None and program.graph is not None and any(
                a is not b for a, b in zip(args, slot.args, strict=True)):
            program = None  # (captured reading other tensors: their reads would be stale) eagerly from now on
            self.capture = False
        if program is None:
            slot = self._slots[key] = _ProgramSlot()
            body = functools.partial(self._store, slot, self._fns[fn_kind or kind])
            program = self._programs[key] = CapturedProgram(body, model=None, what=f"the step's {kind} (K = {K})",
                                                            graphs=self.capture, fuse=False,
                                                            compile_whole=compiled_steps_enabled())
        if program.graph is None:  # (replays read the arguments it was captured with)
            slot.args = args
        try:
            program()
        finally:
            if program.graph is None:  # (not captured: keep no tensor of this step, e.g. its logits, alive)
                slot.args = None
        return slot.out

    @property
    def path(self) -> str:
        """``"cuda_graph"`` once a program has been captured, else ``"static"``."""
        return "cuda_graph" if any(p.graph is not None for p in self._programs.values()) else "static"

    def inputs(self, K: int, drafts: torch.Tensor | None, counts: torch.Tensor | None) -> tuple:
        """:meth:`_StepState.chain_inputs`'s ``(active, budget, drafts, k, errors, width, tokens)`` for a proposal of
        exactly K columns (``drafts [B, K]``, ``counts [B]``, any integer dtype and device; copied
        into fixed buffers), or for K = 0 none; valid until the next step of this K."""
        self._source[K] = "inputs"
        if K == 0:
            return self._run("inputs", 0, (0, None, None))
        if K not in self._buffers:
            like = self.state.no_drafts  # ([B] int64 on the device)
            self._buffers[K] = (like.new_zeros(like.shape[0], K), like.new_zeros(like.shape[0]))
        fixed_drafts, fixed_counts = self._buffers[K]
        fixed_drafts.copy_(drafts)
        fixed_counts.copy_(counts)
        return self._run("inputs", K, (K, fixed_drafts, fixed_counts))

    def proposal(self, K: int, drafter) -> tuple | None:
        """:meth:`_StepState.proposed_inputs` of ``drafter`` (a graph-safe one) for K >= 1: the
        inputs as :meth:`inputs` gives them, then the proposal's width; valid until the next step
        of this K. None where this drafter's proposal program failed to capture: the caller then
        proposes outside (:meth:`inputs`)."""
        if self._proposer is not drafter:  # (another drafter's kernels: not replayed for this one)
            self.drop_proposals()
            self._proposer = drafter
        program = self._programs.get(("proposal", K))
        if program is not None and program.error is not None:  # (this drafter proposes outside; the
            self._forget(("settle after proposal", K))  # program stays for its error, without a graph)
            return None
        self._source[K] = "proposal"
        return self._run("proposal", K, (K, drafter))

    def proposal_path(self, K: int) -> tuple[str | None, str | None]:
        """How K's last proposal program ran (``"static"`` / ``"cuda_graph"``; None: none ran) and
        why its capture failed (its error, then proposals of K ran outside; else None)."""
        program = self._programs.get(("proposal", K))
        if program is None:
            return None, None
        return ("cuda_graph" if program.graph is not None else "static"), program.error

    def _forget(self, key: tuple[str, int]) -> None:
        """Free program ``key`` with what it read and made."""
        for kept in (self._programs, self._slots):
            kept.pop(key, None)

    def _drop(self, K: int) -> None:
        """Free K's proposal program and the settle program that read its outputs."""
        self._forget(("proposal", K))
        self._forget(("settle after proposal", K))

    def drop_proposals(self) -> None:
        """Free every proposal program (and the settle programs after them), and the drafter."""
        for K in [K for kind, K in self._programs if kind == "proposal"]:
            self._drop(K)
        self._proposer = None

    def settle(self, K: int, logits: torch.Tensor) -> tuple:
        """:meth:`_StepState.greedy_chain` of ``logits`` and the inputs the last :meth:`inputs` or
        :meth:`proposal` of K made."""
        source = self._source[K]
        return self._run("settle" if source == "inputs" else "settle after proposal", K,
                         (logits, self._slots[source, K].out), "settle")


def _claims_generator(what: str):
    """Decorate a generator method that decodes: it first checks the generator is free
    (:meth:`SpeculativeGenerator._check_free`, naming ``what``), then holds it for its thread
    until it returns, so another thread's call, or a manager's ``start()`` / ``warmup()``, is
    refused meanwhile (a generate() / generate_batch() on the same thread, e.g. nested, is not; a
    manager's start() / warmup() there is). The call runs with the model's device current
    (:func:`specdec.placement.on_device`)."""

    def wrap(method):
        @functools.wraps(method)
        def claimed(self, *args, **kwargs):
            with self._claiming:  # (checked and held at once: two threads' calls cannot both pass)
                self._check_free(what)
                outer, self._caller = self._caller, threading.current_thread()
            try:
                with on_device(self.adapter.device):  # (its kernels and graphs on the model's device)
                    return method(self, *args, **kwargs)
            finally:
                self._caller = outer

        return claimed

    return wrap


def _setting(what: str):
    """Decorate a setting's setter (or ``release()``): under the lock that ``generate()`` /
    ``generate_batch()`` and a manager's ``start()`` / ``warmup()`` claim the generator under, it
    checks the generator is free (:meth:`SpeculativeGenerator._check_free`, naming ``what``) and
    sets, so a setter racing a ``start()`` on another thread either lands before ``start()``
    checks its memory plan or is refused after it."""

    def wrap(setter):
        @functools.wraps(setter)
        def guarded(self, *args):
            with self._claiming:
                self._check_free(what)
                return setter(self, *args)

        return guarded

    return wrap


class SpeculativeGenerator:
    """Exact speculative decoding for a Hugging Face hybrid causal LM (what :func:`specdec.wrap` returns).

    Args:
        model: a loaded HF causal LM of a supported family (see ``specdec.models.supported_families()``).
        drafter: ``"ngram"``, ``"mtp"`` (the MTP layers of the checkpoint the model was loaded from,
            :class:`specdec.drafters.MTPDrafter`) or a :class:`specdec.drafters.Drafter` instance.
        rollback: ``"snapshot"``, ``"ring"``, ``"replay"`` (or ``"replay_deferred"``), a
            :class:`specdec.rollback.RollbackStrategy`, or ``"auto"``: per call, the strategy of
            ``specdec.rollback.STRATEGIES`` with the best measured cost for the batch and K that
            fits the memory budget (:mod:`specdec.adaptive`; ``last_stats.rollback_reason`` says why).
        num_speculative_tokens: K, drafts per step, 0..``MAX_SPECULATIVE_TOKENS`` (0 = plain
            decoding through the same engine: one token per forward, the drafter is not called),
            or ``"auto"``: each step's K in ``[0, max_speculative_tokens]`` chosen from measured
            costs and the acceptance observed so far (:mod:`specdec.adaptive`).
        decode_path: ``"auto"`` (default: the static path with CUDA graphs on CUDA when the call
            allows it, the eager path otherwise), ``"eager"``, ``"static"`` or ``"cuda_graph"``.
            A model whose weights accelerate loads for each forward (``device_map`` offloading to
            ``"cpu"`` or ``"disk"``: :mod:`specdec.placement`) runs eager or static, without graphs.
            A model whose decoder layers compute on several devices (a ``device_map`` spreading
            whole layers over GPUs, or a GPU and the CPU) runs without graphs too: ``"auto"`` takes
            the static path when every layer and the LM head are on CUDA devices, else the eager
            path; each layer's state lives on its device, the step's bookkeeping on the LM head's.
            The static path needs greedy or plain sampling without stopping criteria, repetition
            penalty, min length or returned scores; forcing it with those raises.
        max_speculative_tokens: with ``num_speculative_tokens="auto"``, the largest K a step may
            ask for, 1..``MAX_SPECULATIVE_TOKENS`` (the caches are sized for it); checked whatever
            ``num_speculative_tokens`` is, used only with ``"auto"``.
        cost_model: the :class:`specdec.adaptive.CostModel` the ``"auto"`` choices read (default:
            step costs measured on the device, :func:`specdec.adaptive.costs_for`); e.g.
            :class:`specdec.adaptive.FixedCosts` to give the costs.
        policy: :class:`specdec.adaptive.PolicySettings` of the ``"auto"`` choices (default: its defaults).

    Attributes:
        last_stats: :class:`Stats` of the last ``generate()``. last_cache: its target cache (the
            SSM state of a row that ended before the call's last step is unspecified where later
            steps ran at K = 0: a plain step updates every row's state in place; with the step
            overlap (:func:`overlap_steps`) so is every row's where a step launched after the
            last one ran at K = 0, as in a plain call whose rows all end by EOS;
            ``SPECDEC_OVERLAP_STEPS=0`` keeps them).
        last_request_timings: the last ``generate_batch``'s ``{request id: RequestTiming}`` of
            the requests that decoded (:class:`specdec.batching.RequestTiming`).
        decoder: the :class:`~specdec.decoding.Decoder` of the last ``generate()``.

    Raises:
        TypeError: model is not a causal LM, drafter/rollback/cost_model/policy of the wrong type,
            K not an int or ``"auto"``.
        ValueError: unsupported family, unknown drafter/strategy name, K or
            ``max_speculative_tokens`` out of range, a drafter whose vocabulary differs from the
            target's or that reads another model's weights (:meth:`Drafter.check_target
            <specdec.drafters.Drafter.check_target>`), ``"auto"`` with a drafter that drafts a fixed tree, a model dispatched by
            accelerate in a layout :func:`specdec.placement.check_placement` refuses (a layer split
            between devices, a device other than CUDA or CPU, a CUDA device the process lacks),
            ``decode_path="cuda_graph"`` for one whose weights are offloaded or whose layers
            compute on several devices, ``SPECDEC_BACKEND=triton`` for one whose layers spread
            over several devices, some of them or its LM head on the CPU.
    """

    def __init__(self, model, drafter="ngram", rollback="replay", num_speculative_tokens: int | str = 4,
                 decode_path: str = "auto", max_speculative_tokens: int = 8, cost_model: CostModel | None = None,
                 policy: PolicySettings | None = None):
        # the managers init_continuous_batching made: while one's loop runs, the generator is that loop's
        self._managers: weakref.WeakSet = weakref.WeakSet()
        self._caller: threading.Thread | None = None  # the thread inside generate() / generate_batch(), meanwhile
        self._claiming = threading.Lock()
        self._static: dict = {}  # static bucket key -> StaticDecoder (the most recent one is kept)
        self._policy_graphs: dict = {}  # the speculation policy's captured updates, per shape (SpeculationPolicy)
        # rollback="auto": (path, batch, T, tree, K or None) -> (strategy name, reason), decided once per shape
        self._choices: dict[tuple, tuple[str, str]] = {}
        # num_speculative_tokens="auto": the drafter's per-position acceptance over the last call,
        # where the next call with the same drafter starts (None: the policy's prior)
        self._learned_acceptance: torch.Tensor | None = None
        self.adapter = adapter_for(model)
        self.adapter.device  # (a dispatched model in a layout specdec refuses raises here, not at generate)
        self.adapter.check_backend()  # (and a forced backend its layers' devices cannot run)
        self.model = model
        self._drafter: Drafter | None = None
        self._K: int | str = 0
        self.max_speculative_tokens = max_speculative_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.decode_path = decode_path
        self.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
        self.drafter = drafter
        self.strategy = rollback
        self.cost_model = cost_model
        self.policy = policy
        self.last_stats: Stats | None = None
        self.last_request_timings: dict[str, RequestTiming] = {}
        self.last_cache = None
        self._step_programs_path: str | None = None
        self.decoder: Decoder | None = None

    # settings: validated whenever they are set, also after construction ---------------------
    @property
    def num_speculative_tokens(self) -> int | str:
        """K, drafts per step (0 = plain decoding), or ``"auto"`` (chosen per step)."""
        return self._K

    @num_speculative_tokens.setter
    @_setting("setting num_speculative_tokens")
    def num_speculative_tokens(self, value):
        if isinstance(value, str):
            if value != AUTO:
                raise ValueError(f"num_speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}] or 'auto', "
                                 f"got {value!r}")
            self._check_adaptive(self._drafter, value)
        elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"num_speculative_tokens must be an int or 'auto', got {type(value).__name__}")
        elif not 0 <= value <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0 = plain decoding) or 'auto', "
                f"got {value}"
            )
        self._K = value if value == AUTO else int(value)
        self._static.clear()

    @property
    def max_speculative_tokens(self) -> int:
        """The largest K ``num_speculative_tokens="auto"`` may choose."""
        return self._max_K

    @property
    def _most_drafts(self) -> int:
        """The most drafts one step of a call asks for: ``max_speculative_tokens`` with
        ``num_speculative_tokens="auto"``, else K; at most the drafter's
        :attr:`~specdec.drafters.Drafter.max_drafts` (a chain of Medusa heads: one per head)."""
        K = self._max_K if self._K == AUTO else self._K
        d = self._drafter
        cap = d.max_drafts if d is not None and d.tree is None else None
        return K if cap is None else min(K, cap)

    @max_speculative_tokens.setter
    @_setting("setting max_speculative_tokens")
    def max_speculative_tokens(self, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"max_speculative_tokens must be an int, got {type(value).__name__}")
        if not 1 <= value <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"max_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] (the most drafts "
                             f"num_speculative_tokens='auto' may ask for in one step), got {value}")
        self._max_K = int(value)
        self._static.clear()

    @property
    def cost_model(self) -> CostModel:
        """The step costs ``"auto"`` reads (see the class docstring; None may be assigned: measured)."""
        if self._costs is None:
            return costs_for(self.model, self.adapter.device, self.adapter.dtype, self.policy.cost_weight)
        return self._costs

    @cost_model.setter
    @_setting("setting the cost model")
    def cost_model(self, value):
        if value is not None and not isinstance(value, CostModel):
            raise TypeError(f"cost_model must be a specdec.adaptive.CostModel (e.g. FixedCosts) or None, got "
                            f"{type(value).__name__}")
        self._costs = value
        self._choices.clear()

    @property
    def policy(self) -> PolicySettings:
        """The :class:`specdec.adaptive.PolicySettings` of the ``"auto"`` choices (None may be assigned: defaults)."""
        return self._policy

    @policy.setter
    @_setting("setting the policy")
    def policy(self, value):
        if value is not None and not isinstance(value, PolicySettings):
            raise TypeError(f"policy must be a specdec.adaptive.PolicySettings or None, got {type(value).__name__}")
        self._policy = value or PolicySettings()
        self._learned_acceptance = None
        self._choices.clear()

    @staticmethod
    def _check_adaptive(drafter, K) -> None:
        """``"auto"`` varies the chain's length per step; a drafter that drafts a fixed tree cannot."""
        if K == AUTO and drafter is not None and drafter.tree is not None:
            raise ValueError(f"num_speculative_tokens='auto' chooses a chain length per step, but {drafter!r} drafts a "
                             "tree (made with tree=..., or Medusa's acceptance='typical'); give it an int K, or use the "
                             "drafter as a chain (without tree=)")

    @property
    def max_batch_tokens(self) -> int:
        """The most prompt tokens, left padding included, one prefill forward runs (default
        ``DEFAULT_MAX_BATCH_TOKENS``, 16,384): ``generate()`` prefills more rows in several
        forwards (each group at its own width) and a longer prompt in chunks, so a prefill's
        activations stay bounded; ``generate_batch``'s default. Raises TypeError / ValueError
        when set to anything but an int >= 1."""
        return self.adapter.max_prefill_tokens

    @max_batch_tokens.setter
    @_setting("setting max_batch_tokens")
    def max_batch_tokens(self, value):
        self.adapter.max_prefill_tokens = check_batch_tokens(value)

    @property
    def decode_path(self) -> str:
        """``"auto"``, ``"eager"``, ``"static"`` or ``"cuda_graph"`` (see the class docstring)."""
        return self._decode_path

    @decode_path.setter
    @_setting("setting the decode path")
    def decode_path(self, value):
        if value not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {DECODE_PATHS}, got {value!r}")
        if value == "cuda_graph":
            self._check_one_device()
        if value == "cuda_graph" and self.adapter.offloads_weights:
            raise ValueError("decode_path='cuda_graph' cannot replay a model whose weights accelerate loads for each "
                             "forward (offloaded to 'cpu' or 'disk' by its device_map): a graph would read the "
                             "weights of its capture; use 'static', 'eager' or 'auto' (which picks the eager path)")
        if value == "cuda_graph" and self.adapter.device.type != "cuda":
            raise ValueError(f"decode_path='cuda_graph' needs a CUDA model, this one is on {self.adapter.device}; "
                             "use 'static' or 'eager'")
        self._decode_path = value

    def _check_one_device(self) -> None:
        """Raise ValueError when the model's layers and LM head compute on several devices (CUDA
        graphs capture one device's work)."""
        place = self.adapter.placement
        if place.multi_device:
            raise ValueError(f"decode_path='cuda_graph' needs every decoder layer and the LM head on one CUDA device; "
                             f"this model computes on several ({place.layout()}); use 'static' (every layer on "
                             "CUDA), 'eager' or 'auto' (which picks between them)")

    @property
    def drafter(self) -> Drafter:
        """The drafter (``"ngram"``, ``"mtp"`` or a :class:`specdec.drafters.Drafter` may be assigned)."""
        return self._drafter

    @drafter.setter
    def drafter(self, value):
        self._check_free("setting the drafter")  # (again under the claim lock when it is set)
        d = make_drafter(value, target=self.model)  # (outside the lock: a name may load a checkpoint)
        d.check_target(self.model)
        dv = d.vocab_size
        if dv is not None and dv != self.adapter.vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({dv} tokens) differs from the target's ({self.adapter.vocab_size}); "
                "speculative decoding needs the same tokenizer and vocabulary"
            )
        self._set_drafter(d)

    @_setting("setting the drafter")
    def _set_drafter(self, d: Drafter) -> None:
        """The :attr:`drafter` setter's last part, under the claim lock."""
        self._check_adaptive(d, self._K)
        self._drafter = d
        self._drafter_key = DrafterKey(d.drafts_sequentially)  # its proposal times in the cost model
        self._learned_acceptance = None
        self._choices.clear()

    @property
    def strategy(self) -> RollbackStrategy | None:
        """The rollback strategy (a name from ``specdec.rollback.STRATEGIES``, an instance or ``"auto"``
        may be assigned); with ``"auto"`` the one the last call ran (None before the first call)."""
        return self._strategy

    @strategy.setter
    @_setting("setting the rollback strategy")
    def strategy(self, value):
        try:  # (checked before anything changes: a refused value leaves the strategy as it was)
            strategy = None if value == AUTO else make_strategy(value)
        except ValueError as err:
            raise ValueError(f"{err}; or 'auto' (measured per call)") from None
        self._candidates = {name: make_strategy(name) for name in STRATEGIES} if value == AUTO else None
        self._strategy = strategy
        self._choices.clear()
        self._static.clear()

    #: :attr:`strategy` under the name of ``wrap()``'s argument (``sd.rollback = "ring"``)
    rollback = strategy

    @_setting("release()")
    def release(self) -> None:
        """Free the static buffers and CUDA graphs kept for the next call of the same shape.

        Raises: RuntimeError while a continuous batching manager of this generator runs."""
        self._static.clear()
        self.decoder = self.last_cache = None

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    @_claims_generator("generate()")
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id=None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        generation_config=None,
        streamer=None,
        stopping_criteria=None,
        max_length: int | None = None,
        **kwargs,
    ):
        """Generate with speculative decoding; the output is laid out as HF ``generate()`` lays it out.

        Args:
            input_ids: ``[B, L]`` int64 left-padded prompts (moved to the model's device if elsewhere).
            attention_mask: ``[B, L]`` 0/1 (default: inferred from ``pad_token_id`` as HF does, else ones).
            max_new_tokens: new tokens per row (default from the generation config); or one per row
                (a list of ints or a 1-D integer tensor, an extension of HF's ``generate()``): row b
                ends after its own ``max_new_tokens[b]`` tokens as it would at EOS, and is padded
                with ``pad_token_id`` (else the first EOS id; unequal budgets with neither raise
                ``ValueError``) after them; the output is as wide as the longest row.
            do_sample, temperature, top_k, top_p: sampling (lossless rejection sampling) or greedy.
            eos_token_id: int or list of ints; pad_token_id: fills rows that stopped early.
            generator: ``torch.Generator`` for reproducible sampling at a fixed K (with
                ``num_speculative_tokens="auto"`` each step's K follows measured step times and its
                random draws depend on K: the same seed can give another sample of the same
                distribution).
            generation_config: a ``transformers.GenerationConfig`` (explicit arguments override it).
            streamer: an HF streamer (batch 1): as in HF, first the prompt, then the committed tokens
                in order, then ``end()``.
            stopping_criteria: an HF ``StoppingCriteriaList`` (or a list of criteria), checked after
                every committed token on that row's own sequence (prompt row + its new tokens).
            max_length: prompt + new tokens (when ``max_new_tokens`` is not given).
            **kwargs: further ``GenerationConfig`` fields, as HF's ``generate()`` takes them:
                ``min_new_tokens``, ``min_length``, ``repetition_penalty``, ``max_time``,
                ``return_dict_in_generate``, ``output_scores``, ``output_logits``; any other setting that
                changes decoding raises ``ValueError``.

        Returns:
            ``[B, L + G]`` int64: prompts as given, then G = the longest row's new tokens; rows that
            stopped early are padded with ``pad_token_id``. With ``return_dict_in_generate=True`` a
            ``transformers.generation.GenerateDecoderOnlyOutput`` with ``sequences`` (that tensor) and,
            when asked, ``scores`` / ``logits`` (tuples of G ``[B, V]`` fp32 tensors: the processed
            and the raw target scores of each new token; positions after a row stopped hold zeros).
            Stats of the call in ``self.last_stats``.

        Raises:
            TypeError / ValueError: bad arguments (checked before any work), unsupported settings
            (:func:`specdec.settings.resolve`); ValueError when the drafter returns a bad proposal,
            or when a prompt + budget beyond the model's context (a warning alone, as in HF) would
            need caches larger than the device's free memory.
            RuntimeError: a continuous batching manager of this generator is running (or warming
            up), another thread is inside this generator's ``generate()`` / ``generate_batch()``,
            or the drafter (one with per-call state) drafts for another generator's call now.
        """
        if input_ids is None:  # (HF's generate() also takes inputs_embeds alone)
            raise ValueError("generate() needs input_ids (token ids, [B, L]); inputs_embeds is not supported: the "
                             "drafters and the verify step work on token ids" if "inputs_embeds" in kwargs
                             else "generate() needs input_ids (token ids, [B, L])")
        overrides = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                         top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id, max_length=max_length,
                         **kwargs)
        settings = resolve(self.model, self.adapter.vocab_size, self.adapter.device, input_ids, attention_mask,
                           generation_config, overrides=overrides, streamer=streamer,
                           stopping_criteria=stopping_criteria, generator=generator)
        limit = context_length(self.model)
        reach = settings.input_ids.shape[1] + max(settings.row_budgets or (settings.max_new_tokens,))
        if limit is not None and reach > limit:  # (as HF's generate(): a warning, the call runs)
            warn_caller(f"prompt ({settings.input_ids.shape[1]} tokens, padding included) + max_new_tokens reach "
                        f"{reach} positions, beyond the model's context (config.max_position_embeddings={limit}): "
                        "tokens past it may be meaningless (generate_batch() refuses such a request)")
            rows, free = settings.input_ids.shape[0], self._available_memory()
            need = rows * self._row_bytes(reach).total
            if free is not None and need > free:
                raise ValueError(f"max_new_tokens={settings.max_new_tokens}: the caches of {rows} rows of {reach} "
                                 f"positions need {format_bytes(need)}, more than the {format_bytes(free)} "
                                 + (f"free on {self.adapter.device}" if not self.adapter.placement.multi_device else
                                    "available on the device with the least of it among "
                                    f"{', '.join(map(str, self.adapter.placement.devices))} (its free memory and "
                                    "this generator's caches there)")
                                 + "; ask for fewer new tokens")
        return self._decode(settings)

    @torch.no_grad()
    @_claims_generator("generate_batch()")
    def generate_batch(self, inputs, generation_config=None, *, max_new_tokens=None, eos_token_id=None,
                       progress_bar: bool = False, max_batch_size: int | str | None = None,
                       memory_budget: int | str | None = None, prefix_caching: bool = False,
                       prefix_block_size: int = PREFIX_BLOCK_SIZE, prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                       max_batch_tokens: int | None = None,
                       **generate_kwargs) -> dict[str, GenerationOutput]:
        """Continuous batching (Hugging Face's ``generate_batch`` interface): prompts of any lengths
        through a pool of ``max_batch_size`` decode rows; a row whose request ends (EOS or its own
        budget) takes the next queued request between two steps, so no row idles while requests
        wait. The steps are ``generate()``'s decode loop (:mod:`specdec.batching`); every request's
        tokens are those it gets alone from ``generate()`` (greedy: plain autoregressive decoding).

        Args:
            inputs: ``list`` of prompts, each a list (or 1-D tensor) of int token ids, any lengths.
            generation_config: a ``transformers.GenerationConfig`` (default: the model's).
            max_new_tokens: new tokens per request: one int, or one per request (a list, a 1-D tensor or NumPy array);
                default: the ``max_new_tokens`` of the generation config passed, else of the model's,
                else what the model's generation config's ``max_length`` leaves after the prompt, else
                20 new tokens, or fewer where the prompt leaves less of the model's context (as
                ``generate()``: :func:`~specdec.settings.default_budget`).
            eos_token_id: int or list of ints (default from the generation config).
            progress_bar: show a ``tqdm`` bar of finished requests.
            max_batch_size: the pool's rows: an int >= 1 (checked against the memory it needs,
                :func:`specdec.batching.plan_rows`), ``"auto"`` (as many as fit the memory budget:
                :func:`specdec.batching.bytes_per_sequence` of the call's strategy, K and lengths;
                with ``rollback="auto"``, of the candidate that needs most), or None (default
                ``min(len(inputs), 32)``).
            memory_budget: the device bytes the pool may take, an int or a string such as
                ``"40GiB"``; default: free device memory (x ``specdec.batching.MEMORY_FRACTION``
                for ``"auto"``). With ``prefix_caching`` the cache's ``prefix_cache_bytes`` come out
                of it. Unused with ``max_batch_size=None``.
            max_batch_tokens: the most prompt tokens one prefill forward runs, left padding
                included (requests x their longest prompt; default: :attr:`max_batch_tokens`,
                16,384 unless set): an admission (the first requests' too) takes requests while they fit,
                at least one, so a large pool's prefill activations stay bounded; a longer prompt
                is prefilled in chunks of that many tokens (with prefix caching: of whole blocks,
                after its hit), one per step while other rows decode.
            prefix_caching: prefill every prompt through a :class:`~specdec.prefix_cache.PrefixCache`
                kept for the call: prompts that share a prefix of whole blocks reuse its state
                (attention keys / values and every SSM layer's conv window and recurrent state at
                the block boundary) instead of computing it. Each prompt is then prefilled on its
                own (batch 1), in one forward (two where it makes a branch point, see
                :mod:`specdec.prefix_cache`); outputs are those without it (the states agree to
                rounding). Counters in ``last_stats.prefix_cache``.
            prefix_block_size: tokens per cached block (default ``PREFIX_BLOCK_SIZE``, 64).
            prefix_cache_bytes: the most bytes of state the prefix cache holds, an int or a size
                string as ``memory_budget`` takes (default ``DEFAULT_PREFIX_CACHE_BYTES``, 1 GiB, on
                the model's device); least recently used blocks are evicted.
            **generate_kwargs: ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``generator``
                (a ``torch.Generator``: the same call with the same seed samples the same tokens),
                ``pad_token_id`` and other ``GenerationConfig`` fields ``generate()`` takes, except those that need
                its per-token hook (stopping criteria, ``max_time``, repetition penalty, minimum
                lengths, returned scores) and ``max_length``.

        Returns:
            ``dict[str, GenerationOutput]`` keyed ``"req_0"``, ``"req_1"``, ... in input order
            (``transformers.generation.continuous_batching.requests.GenerationOutput``):
            ``prompt_ids`` and ``generated_tokens`` (lists of ints; up to and including EOS),
            ``status`` ``RequestStatus.FINISHED``. A request that cannot run (an empty prompt, ids
            outside ``[0, vocab_size)``, prompt + budget beyond ``config.max_position_embeddings``)
            has ``status=RequestStatus.FAILED``, its reason in ``error`` and no tokens; the other
            requests run (HF's convention for a failed request). Stats of the call (all requests)
            in ``self.last_stats``, with the pool's rows (``max_batch_size``) and, for ``"auto"``,
            how they were chosen (``batch_size_reason``, also logged on ``specdec.batching``);
            each decoded request's times (queued, admitted, first token, finished) in
            ``self.last_request_timings``, and as HF's ``created_time`` / ``lifespan`` of its output.

        Raises:
            TypeError / ValueError: bad arguments, checked before any work: ``inputs`` not a list
            of lists of ints, bad budgets, ``max_batch_size`` or ``memory_budget``; an int
            ``max_batch_size`` whose rows need more memory than the budget (or the free memory),
            ``"auto"`` where not one row fits or free memory is unknown (a device other than CUDA
            and Linux CPUs) and no budget is given; ``max_batch_tokens`` not an int >= 1;
            ``prefix_caching`` not a bool,
            ``prefix_block_size`` not an int >= 1,
            ``prefix_cache_bytes`` not an int >= 0 or a size string; settings ``generate()`` rejects or that need its
            per-token hook; a drafter with per-row state that does not define
            :meth:`Drafter.admit` (supported, chains and trees: ``Drafter.stateless`` drafters such
            as the n-gram drafter, drafters that define ``admit``, i.e. the draft-model, MTP,
            Medusa and oracle drafters; and ``num_speculative_tokens=0``); the static path with a
            strategy that does not reset rows in place (``RollbackStrategy.resets_in_place``), the
            target's or a draft model's. RuntimeError: a continuous batching manager of this
            generator is running (or warming up), or another thread is inside this generator's
            ``generate()`` / ``generate_batch()``.
        """
        queued = time.perf_counter()
        if not isinstance(progress_bar, bool):
            raise TypeError(f"progress_bar must be a bool, got {type(progress_bar).__name__}")
        cache = _prefix_cache(prefix_caching, prefix_block_size, prefix_cache_bytes)
        max_batch_tokens = self.max_batch_tokens if max_batch_tokens is None else check_batch_tokens(max_batch_tokens)
        if "max_length" in generate_kwargs:
            raise ValueError("generate_batch takes max_new_tokens (an int, or one per request), not max_length")
        self._check_batching()
        length = None
        if max_new_tokens is None:
            max_new_tokens, length = self._default_budget(generation_config, "generate_batch()")
        requests, results = check_requests(inputs, max_new_tokens, self.adapter.vocab_size, context_length(self.model),
                                           default_length=length)
        for r in [r for r in requests if r.max_new_tokens == 0]:  # nothing to generate
            results[r.index] = r.output(RequestStatus.FINISHED)
        requests = [r for r in requests if r.max_new_tokens > 0]
        settings = self._batching_settings(generation_config, max((r.max_new_tokens for r in requests), default=0),
                                           eos_token_id, generate_kwargs)
        plan = self._plan_pool(max_batch_size, memory_budget, RequestPool.span_of(requests) if requests else 1,
                               len(requests), cache.max_bytes if cache is not None else 0)
        self.last_request_timings = {}
        if requests:
            pool = RequestPool(requests, plan.rows, queued=queued, prefix_cache=cache,
                               max_batch_tokens=max_batch_tokens)
            with tqdm(total=len(inputs), disable=not progress_bar, unit="request") as bar:
                bar.update(len(inputs) - len(requests))
                pool.on_finish = lambda: bar.update(1)
                self._run_pool(settings, plan, pool)
            results.update(pool.outputs)
            self.last_request_timings = {f"req_{i}": pool.timings[i] for i in sorted(pool.timings)}
        else:  # (nothing to decode: the call's stats say so, not the previous call's)
            self._idle_stats(plan)
        return {f"req_{i}": results[i] for i in range(len(inputs))}

    def init_continuous_batching(self, generation_config=None, *, max_length: int,
                                 max_batch_size: int | str | None = None, memory_budget: int | str | None = None,
                                 max_new_tokens: int | None = None, eos_token_id=None,
                                 max_batch_tokens: int | None = None, prefix_caching: bool = False,
                                 prefix_block_size: int = PREFIX_BLOCK_SIZE,
                                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                                 **generate_kwargs) -> ContinuousBatchingManager:
        """Continuous batching as a service (Hugging Face's ``init_continuous_batching``): a
        :class:`specdec.serving.ContinuousBatchingManager` that, once started, runs
        :meth:`generate_batch`'s decode loop on a background thread over a pool that stays open:
        requests are added while others decode and each result is taken when its request ends.

        Args:
            generation_config, eos_token_id, **generate_kwargs: as :meth:`generate_batch` takes them.
            max_length: the most tokens a request may hold, prompt + ``max_new_tokens`` (an int
                >= 2, at most ``config.max_position_embeddings``): the KV columns are sized for it
                once; a longer request fails alone (``status=FAILED``, ``error``).
            max_batch_size: the pool's rows: an int >= 1, ``"auto"`` (as many as fit the memory
                budget for requests of ``max_length`` tokens) or None (``DEFAULT_MAX_BATCH_SIZE``, 32).
            memory_budget, max_batch_tokens: as :meth:`generate_batch` takes them.
            max_new_tokens: a request's budget when ``add_request`` gives none, at most
                ``max_length - 1`` (default: the ``max_new_tokens`` of the generation config passed,
                else of the model's, else what the model's generation config's ``max_length`` leaves
                after the prompt, else 20 new tokens or what a request's prompt leaves of
                ``max_length``; a request whose prompt and budget exceed ``max_length`` fails alone).
            prefix_caching, prefix_block_size, prefix_cache_bytes: as :meth:`generate_batch` takes
                them, but the cache is the manager's (``manager.prefix_cache``): it lives as long as
                the manager, across its ``start()`` / ``stop()`` runs, so a request reuses the
                prefixes of every request prefilled before it, as a server's cache does. Its
                counters (``last_stats.prefix_cache`` after ``stop()``) count since the manager was
                made; bounded by ``prefix_cache_bytes`` as in :meth:`generate_batch`.

        Returns: the manager (not started: ``start()``, or use it as a context manager;
        ``manager.warmup()`` first runs warm-up requests through it, so the first requests served
        do not pay for the shapes' first runs and CUDA graph captures).

        Raises:
            TypeError / ValueError: as :meth:`generate_batch` raises them, checked here; a bad
            ``max_length`` or ``max_new_tokens`` (also one above ``max_length - 1``).
        """
        limit = context_length(self.model)
        if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
            raise TypeError(f"max_length must be an int (prompt + new tokens of a request), got "
                            f"{type(max_length).__name__}")
        if max_length < 2 or (limit is not None and max_length > limit):
            raise ValueError(f"max_length must be in [2, {limit if limit is not None else 'inf'}] (prompt + new tokens "
                             f"of a request, at most config.max_position_embeddings), got {max_length}")
        self._check_batching()
        cache = _prefix_cache(prefix_caching, prefix_block_size, prefix_cache_bytes)
        max_batch_tokens = self.max_batch_tokens if max_batch_tokens is None else check_batch_tokens(max_batch_tokens)
        given, length = max_new_tokens is not None, None
        if not given:  # (None still: each request's own, within max_length)
            max_new_tokens, length = self._default_budget(generation_config, "init_continuous_batching()")
        if max_new_tokens is not None:
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
                raise TypeError(f"max_new_tokens must be an int (the default budget of a request), got "
                                f"{type(max_new_tokens).__name__}")
            if max_new_tokens < 0 or (given and max_new_tokens > max_length - 1):
                raise ValueError(f"max_new_tokens (the default budget of a request) must be in [0, max_length - 1 = "
                                 f"{max_length - 1}]: a request holds its prompt (at least one token) and its new "
                                 f"tokens in max_length; got {max_new_tokens}")
        settings = self._batching_settings(generation_config, int(max_length) - 1, eos_token_id, generate_kwargs,
                                           "init_continuous_batching")
        # (inherited: a manager whose requests all give their own budget is fine)
        if max_new_tokens is not None and max_new_tokens > max_length - 1:
            warn_caller(f"the default budget of a request, max_new_tokens={max_new_tokens} (the generation "
                        f"config's), does not fit max_length={max_length} with a prompt: every request added "
                        "without max_new_tokens will fail; pass init_continuous_batching(max_new_tokens=...) or a "
                        "larger max_length")
        plan = self._plan_pool(max_batch_size, memory_budget, int(max_length), None,
                               cache.max_bytes if cache is not None else 0)
        manager = ContinuousBatchingManager(functools.partial(self._run_pool, settings, plan), rows=plan.rows,
                                            max_length=int(max_length),
                                            max_new_tokens=None if max_new_tokens is None else int(max_new_tokens),
                                            default_length=length,
                                            max_batch_tokens=max_batch_tokens, prefix_cache=cache,
                                            vocab_size=self.adapter.vocab_size, max_positions=limit,
                                            device=self.adapter.device,
                                            claim=functools.partial(self._claim_for_manager, plan=plan,
                                                                    span=int(max_length)),
                                            prompt_counts=self._prompt_counts)
        self._managers.add(manager)
        return manager

    def _default_budget(self, generation_config, caller: str) -> tuple[int | None, int | None]:
        """``(budget, length)`` of a request given no budget, as ``generate()`` sets them: the
        ``max_new_tokens`` of the generation config passed, else of the model's (as ``resolve``
        merges them), and no length; else None and the model's generation config's
        ``max_length`` (prompt + new tokens: a checkpoint's setting), or None and None: each
        request's :func:`~specdec.settings.default_budget` (20 new tokens, or what fits). For
        :func:`~specdec.batching.check_requests` (a generation_config of another type is refused
        by ``resolve`` later).

        Raises: ValueError: a ``generation_config`` passed to the call sets ``max_length`` (not the
        default) and no ``max_new_tokens``: a budget of prompt + new tokens, which these calls do not
        take (as for their ``max_length`` keyword)."""
        budget = getattr(generation_config, "max_new_tokens", None)
        if budget is None and generation_config is not None:
            from transformers import GenerationConfig

            length = getattr(generation_config, "max_length", None)
            if length is not None and length != GenerationConfig().max_length:
                raise ValueError(f"{caller} takes max_new_tokens (an int, or one per request), not max_length; the "
                                 f"generation_config passed sets max_length={length} and no max_new_tokens: set "
                                 "max_new_tokens (on it or as an argument)")
        own = self.model.generation_config
        budget = budget if budget is not None else getattr(own, "max_new_tokens", None)
        return budget, None if budget is not None else getattr(own, "max_length", None)

    def _batching_settings(self, generation_config, max_new_tokens: int, eos_token_id, generate_kwargs,
                           caller: str = "generate_batch"):
        """The settings of a pool's decode loop, checked before any work (resolved on a placeholder
        prompt: :meth:`_run_pool` gives the loop its rows' placeholders); ``generator`` (a
        ``torch.Generator`` for sampling) may be among ``generate_kwargs``; errors name ``caller``."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.adapter.device)
        generate_kwargs = dict(generate_kwargs)
        generator = generate_kwargs.pop("generator", None)
        overrides = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, **generate_kwargs)
        settings = resolve(self.model, self.adapter.vocab_size, self.adapter.device, ids, torch.ones_like(ids),
                           generation_config, overrides=overrides, generator=generator, batch=True,
                           caller=f"{caller}()")
        blockers = settings.per_token_features
        if blockers or settings.return_dict:
            raise ValueError(f"{caller} does not support {', '.join(blockers) or 'return_dict_in_generate'}"
                             "; use generate() for these. They come from the call's arguments or its "
                             "generation_config (a passed one is completed from model.generation_config): clear them "
                             "there (e.g. model.generation_config.repetition_penalty = 1.0), or pass a neutral value "
                             "where one exists (repetition_penalty=1.0, min_new_tokens=0)")
        self._check_resets_in_place(caller)
        return settings

    def _check_resets_in_place(self, caller: str) -> None:
        """Raise ValueError when the rollback strategy cannot reset a row in place on a static decode path."""
        custom = self._K and self._candidates is None and not self._strategy.resets_in_place  # (built-ins do)
        if custom and self._pick_path(self.adapter.device, None) != "eager":
            raise ValueError(f"{caller}: rollback strategy {self._strategy.name!r} does not reset rows in place "
                             "(resets_in_place=False), which the static decode path needs across admissions; "
                             "use decode_path='eager' or a built-in strategy")

    def _plan_pool(self, max_batch_size, memory_budget, span: int, num_requests: int | None,
                   reserved: int = 0) -> PoolPlan:
        """The pool's rows (:func:`specdec.batching.plan_rows`) for rows of ``span`` tokens: the bytes
        of a row under the call's strategy (``rollback="auto"``: the candidate that needs most), K
        (``"auto"``: ``max_speculative_tokens``) and decode path; the free device memory counts what
        this generator's kept buffers hold (the call frees or reuses them); ``reserved`` bytes (a
        prefix cache's ``max_bytes``: it fills while the pool decodes) are left out of the budget."""
        per_row = functools.partial(self._row_bytes, span)

        return plan_rows(max_batch_size, num_requests, per_row, memory_budget, self._available_memory, reserved)

    def _available_memory(self) -> int | None:
        """Bytes a call's caches may take: the device's free memory
        (:func:`specdec.batching.free_memory`) plus what this generator's kept caches hold there
        (the call frees or reuses them); for a model whose layers spread over several devices, the
        least of that over them (the rows' bytes are checked against it whole: more than any one
        device holds). None where a device's free memory is unknown."""
        caches = {id(c): c for c in [self.last_cache, *(d.cache for d in self._static.values())] if c is not None}
        place = self.adapter.placement
        available = []
        for dev in place.devices:
            free = free_memory(dev)
            if free is None:
                return None
            available.append(free + sum(cache_bytes(c, dev if place.multi_device else None) for c in caches.values()))
        return min(available)

    def _row_bytes(self, span: int) -> SequenceBytes:
        """The bytes one pool row of ``span`` tokens needs under the generator's settings now: its
        strategy (``rollback="auto"``: the candidate that needs most), K (``"auto"``:
        ``max_speculative_tokens``) and decode path (:func:`specdec.batching.bytes_per_sequence`)."""
        K = self._most_drafts
        if K == 0:
            strategies = [_IN_PLACE]
        else:
            strategies = list(self._candidates.values()) if self._candidates is not None else [self._strategy]
        static = self._pick_path(self.adapter.device, None) != "eager"
        return max((bytes_per_sequence(self.adapter, st, span, K, static=static) for st in strategies),
                   key=lambda b: b.total)

    def _check_plan(self, what: str, plan: PoolPlan, span: int) -> None:
        """Raise ValueError when ``plan``'s rows (of ``span`` tokens) sized or checked against a memory
        budget no longer fit it under the generator's settings now (a strategy, K or decode path set
        since the manager was made, under which a row needs more)."""
        if plan.per_row is None:  # (rows not sized or checked from memory: nothing planned to keep)
            return
        now = self._row_bytes(span)
        if now.total > plan.per_row.total and pool_bytes(plan.rows, now) > plan.budget:
            raise ValueError(f"{what}: the manager's {plan.rows} rows were planned at {format_bytes(plan.per_row.total)} "
                             f"per row ({plan.per_row.describe()}) in {format_bytes(plan.budget)}; a row now needs "
                             f"{format_bytes(now.total)} ({now.describe()}) under the rollback strategy, "
                             f"num_speculative_tokens or decode path set since, and the rows need "
                             f"{format_bytes(pool_bytes(plan.rows, now))} with an admission's: more than planned. "
                             "Restore those settings, or make a new manager with init_continuous_batching(), "
                             "which plans its rows for the settings then")

    @torch.no_grad()
    def _run_pool(self, s, plan: PoolPlan, pool: RequestPool) -> None:
        """Decode ``pool``'s requests (:meth:`generate_batch`, and a manager's loop thread): its first
        requests (up to its rows and ``max_batch_tokens``; an open pool waits for one) are taken, every
        row starts on a placeholder prompt with no budget (finished at once), the first admission
        prefills the first requests into their rows as any admission does, and the decode loop runs
        until the pool has nothing left to decode. Every admission's prefill forward holds at most
        the pool's ``max_batch_tokens`` tokens (:meth:`_admit`)."""
        size = len(pool.slots)
        first = pool.take(range(size), at_most=size)
        if not first:
            self._idle_stats(plan)
            return
        ids, mask = left_pad([(0,)] * size, self.adapter.device)  # placeholders; the first admission takes `first`
        self.decoder = self.last_cache = None  # (their memory was counted as free by the plan)
        self._decode(dataclasses.replace(s, input_ids=ids, attention_mask=mask), pool, first)
        self.last_stats.max_batch_size, self.last_stats.batch_size_reason = size, plan.reason

    def _idle_stats(self, plan: PoolPlan) -> None:
        """``last_stats`` of a pool that decoded nothing (every request finished or failed before a
        step, or a manager stopped before a request came): no steps, no tokens, the pool's rows."""
        K = self._most_drafts
        self.last_stats = Stats(accept_histogram=[0] * (K + 1), k_histogram=[0] * (K + 1),
                                max_batch_size=plan.rows, batch_size_reason=plan.reason)

    def _check_free(self, what: str) -> None:
        """Raise RuntimeError when a continuous batching manager of this generator runs its loop, or
        its warm-up, or a ``start()`` of it is under way, on another thread, or another thread is inside this generator's
        ``generate()`` / ``generate_batch()``: the caches, drafter and rollback state are theirs
        until they end."""
        caller = self._caller
        if caller is not None and caller is not threading.current_thread():
            raise RuntimeError(f"{what}: another thread ({caller.name}) is inside this generator's generate() or "
                               "generate_batch(), which uses its caches, drafter and rollback state until it returns; "
                               "wait for it, or make a second generator (specdec.wrap(model, ...)) for other threads")
        if any(m.runs_elsewhere() for m in list(self._managers)):
            raise RuntimeError(f"{what}: this generator's continuous batching manager is running (started or "
                               "starting, and not yet ended by stop(), or inside warmup()); its decode loop uses the generator's "
                               "caches, drafter and rollback state. Call manager.stop() first (or wait for its "
                               "warmup() to return), or make a second generator (specdec.wrap(model, ...)) for "
                               "other calls")

    def _prompt_counts(self) -> dict[str, int] | None:
        """The prompt forwards run so far at bucketed shapes, by how they ran (the adapter's
        :attr:`PromptGraphs.counts <specdec.models.prompt_graphs.PromptGraphs>`), or None on the
        eager decode path, whose prompt forwards run at their own shapes, uncounted."""
        if self._pick_path(self.adapter.device, None) == "eager":
            return None
        return dict(self.adapter.prompt_graphs.counts)

    def _claim_for_manager(self, what: str, mark: Callable[[], None], plan: PoolPlan | None = None,
                           span: int | None = None) -> None:
        """A manager's ``start()`` / ``warmup()`` (named ``what``) claims the generator: under the
        lock that ``generate()`` / ``generate_batch()`` check and claim it under, raise as
        :meth:`_check_free`, :meth:`_check_batching` (the drafter may have been set since the
        manager was made), :meth:`_check_resets_in_place` and, for the manager's ``plan`` of rows of
        ``span`` tokens, :meth:`_check_plan` do (the strategy or K may have been set since), and
        also inside a ``generate()`` / ``generate_batch()`` of the calling thread (a streamer's or
        stopping criterion's call), else ``mark()`` the manager as holding it."""
        with self._claiming:
            self._check_free(what)
            if self._caller is not None:  # this thread's own call (_check_free refused another thread's)
                raise RuntimeError(f"{what}: called inside this generator's generate() or generate_batch() on the "
                                   "same thread (e.g. from a streamer or a stopping criterion); the manager would "
                                   "decode on the caches that call is using. Call it once the call has returned")
            self._check_batching()
            with _DRAFTING_LOCK:
                self._check_drafter_free()
            self._check_resets_in_place(what)
            if plan is not None:
                self._check_plan(what, plan, span)
            mark()

    def _check_batching(self) -> None:
        """Raise ValueError when the drafter cannot give a row a new request (:meth:`generate_batch`)."""
        d = self._drafter
        if self._K and not d.resets_rows:
            raise ValueError(f"generate_batch does not support the drafter {type(d).__name__}: it keeps per-row state "
                             "and does not define Drafter.admit, which resets a row that takes a new request; "
                             "supported: drafters that are Drafter.stateless (e.g. drafter='ngram'; a drafter of "
                             "yours whose propose() reads nothing but its arguments: set the class attribute "
                             "stateless = True) or define Drafter.admit (the draft-model, MTP and Medusa drafters), "
                             "chains or trees, and plain decoding (num_speculative_tokens=0)")

    def _decode(self, s, pool: RequestPool | None = None, first_requests: list | None = None):
        """The decode loop (see the module docstring) for the settings ``s``; returns the output of
        ``generate()``. With ``pool`` (continuous batching, :meth:`_run_pool`), ``s`` holds one
        placeholder prompt per row (no budget: every row finishes at once), every step starts with
        an admission phase (:meth:`_admit`; the first one admits ``first_requests``, the requests the pool
        took for its rows before the loop) and the outputs go to the pool
        (:meth:`RequestPool.finish`; returns None).

        A drafter that keeps per-call state (not :attr:`Drafter.stateless
        <specdec.drafters.Drafter.stateless>`) drafts for one generator's loop at a time: raises
        RuntimeError while another generator's loop drafts with it (on another thread)."""
        d = self._drafter
        with _DRAFTING_LOCK:
            claims = self._check_drafter_free() is None and self._claims_drafter
            if claims:
                _DRAFTING[id(d)] = self
        try:
            return self._decode_loop(s, pool, first_requests)
        finally:
            if claims:
                with _DRAFTING_LOCK:
                    del _DRAFTING[id(d)]

    @property
    def _claims_drafter(self) -> bool:
        """Whether a decode loop holds the drafter for itself: one with per-call state, at K > 0
        (plain decoding does not draft)."""
        return not self._drafter.stateless and self._K != 0

    def _check_drafter_free(self) -> SpeculativeGenerator | None:
        """Raise RuntimeError when this generator's drafter (one with per-call state, at K > 0)
        drafts for another generator's decode loop now; else the generator whose loop holds it
        (this one, a nested call) or None. Call it holding ``_DRAFTING_LOCK``."""
        d = self._drafter
        user = _DRAFTING.get(id(d)) if self._claims_drafter else None
        if user is not None and user is not self:
            raise RuntimeError(f"the drafter ({type(d).__name__}) is drafting for another generator's call, and it "
                               "keeps per-call state (its caches) that this call would overwrite; give each "
                               "generator its own drafter (one made the same way), or wait for that call")
        return user

    def _decode_loop(self, s, pool: RequestPool | None, first_requests: list | None):
        """:meth:`_decode`'s loop."""
        ids, dev = s.input_ids, s.input_ids.device
        B, Lp = ids.shape
        adaptive = self._K == AUTO
        K = self._most_drafts
        V, max_new = self.adapter.vocab_size, s.max_new_tokens
        if max_new == 0:
            self.last_stats = Stats(accept_histogram=[0] * (K + 1), k_histogram=[0] * (K + 1))
            if s.streamer is not None:
                s.streamer.put(ids.cpu())
                s.streamer.end()
            return self._output(s, ids.clone(), None, 0)
        hook = StepHook.make(s, V)
        path, path_reason = self._choose_path(dev, hook)
        if s.streamer is not None:  # after every check: HF streams the prompt first
            s.streamer.put(ids.cpu())  # (TextStreamer(skip_prompt=True) drops it)
        drafter = self.drafter if K > 0 else None  # K = 0: plain decoding, the drafter is not used
        tree = tree_for(drafter, K)  # a draft tree (Medusa): its N nodes run in one forward
        T = tree.num_nodes if tree is not None else K + 1  # the most tokens of one verify forward
        W = tree.max_depth + 1 if tree is not None else K + 1  # the most tokens one step commits
        clock = StepClock(dev)
        span = Lp + max_new if pool is None else pool.span  # the longest committed text, padding included
        needed = kv_columns(span, T)
        strategy, reason = self._rollback(s, path, needed, T, tree, K, adaptive, until_last=pool is None)
        if adaptive or self._candidates is not None:  # (a fixed K and strategy measure nothing: calibration_s 0)
            clock.lap("calibration")
        dec = self.decoder = self._decoder(path, B, needed, T, tree, strategy)
        every = drafter is not None and drafter.wants_all_hidden_states  # e.g. MTP layers: every position's
        logits, hidden = dec.prefill(ids, s.attention_mask, all_hidden_states=every,  # (a pool's: placeholders)
                                     max_tokens=None if pool is None else pool.max_batch_tokens)
        self.last_cache = dec.cache
        policy = None
        if adaptive:  # measures the step widths on this decoder if its costs are not known yet
            clock.lap("prefill")
            policy = self._speculation_policy(s, path, dec, strategy, K, until_last=pool is None)
            clock.lap("calibration")
        if pool is not None:  # placeholders: no budget, every row finishes at once for the first admission
            budgets = torch.zeros(B, dtype=torch.long, device=dev)
        else:
            budgets = max_new if s.row_budgets is None else torch.tensor(s.row_budgets, device=dev)
        # a greedy chain step of a fixed batch with nothing read per token runs its device work
        # around the forward as captured programs where the forward is captured (else the same
        # functions eagerly: the static path on a CPU runs them too); its bucket keeps them
        glue = (isinstance(dec, StaticDecoder) and pool is None and hook is None and s.sampling is None
                and tree is None and s.streamer is None and step_programs_enabled())
        policed = policy is not None
        programs = None
        if glue:  # rows as wide as the bucket allows (>= span + T), so calls of one bucket share them
            width = dec.max_len - T
            kept = dec.loop_state
            if kept is not None and kept.state.key == _StepState.key_of(B, K, V, dev, width, s.eos_token_ids, policed):
                programs, st = kept, kept.state
                st.reset(ids, s.attention_mask, budgets)
            else:
                dec.loop_state = None  # (the kept state's memory goes first)
                st = _StepState(dec, B, K, V, dev, width, s.eos_token_ids, ids, s.attention_mask, budgets, policed)
                programs = dec.loop_state = _StepPrograms(st, capture=dec.path == "cuda_graph")
        else:
            st = _StepState(dec, B, K, V, dev, span + T, s.eos_token_ids, ids, s.attention_mask, budgets, policed)
        rows = st.rows
        raw = logits.float()[:, None]
        scores = hook.process(raw, None, rows.n_gen) if hook else raw
        first = self._pick_first(scores[:, 0], s)
        self._append(rows, hook, first[:, None], torch.ones_like(first), scores, raw)
        if s.streamer is not None:
            s.streamer.put(first[:1].cpu())
        if drafter is not None:
            drafter.set_decode_path(dec.path)
            drafter.set_speculation(K, adaptive)
            drafter.start(target_vocab_size=V, batch_size=B, device=dev, sampling=s.sampling, generator=s.generator,
                          max_length=rows.text.shape[1])
            if pool is None and every:  # (a pool's rows get their prompts' states at admission)
                drafter.observe_prompt(hidden, s.attention_mask)
            if pool is None and drafter.wants_hidden_states:  # e.g. Medusa heads: the target's last hidden state
                drafter.observe(hidden[:, -1] if every else hidden)
        hist, totals, no_prob_errors = st.hist, st.totals, st.no_prob_errors
        steps, idx = 0, torch.arange(B, device=dev)
        clock.lap("prefill")
        *finished, last_step = torch.cat([rows.finished.long(), (rows.max_new - rows.n_gen).amax()[None]]).tolist()
        finished = [bool(f) for f in finished]  # host copy: which rows ended (read with each step's sync)
        done = all(finished)
        # a fixed batch without a per-token hook launches each step before it reads the last
        # step's flags (a step past the end ran on finished rows only, and is dropped); after
        # last_step steps every row has ended (each step keeps >= 1 token of every live row)
        pipelined = pool is None and hook is None and overlap_steps()
        in_flight = None  # the last step's flags, read after the next step is launched (pipelined)
        flag_reads = _FlagReads(dev, clock.stream) if pipelined else None
        draws = s.sampling is not None or drafter is not None  # (greedy plain decoding draws nothing)
        grown = Lp + 1  # host-side bound on every row's text length (grows by <= W a step)
        # the next step's proposal is made before this step's sync where nothing the sync brings can
        # change it: a fixed batch (no admissions) whose next K is known on the host
        overlap = pool is None and drafter is not None and overlap_proposals()
        # a graph-safe drafter proposes inside the step programs (its kernels replayed with theirs)
        in_program = (programs is not None and drafter is not None and captured_proposals_enabled()
                      and drafter.stateless and not (drafter.wants_hidden_states or drafter.wants_all_hidden_states)
                      and drafter.graph_safe(rows.text))
        if programs is not None and not in_program:
            programs.drop_proposals()  # (a drafter proposing outside keeps no other drafter's graphs alive)

        proposed_in_program = None  # the K of the last proposal asked of the step programs
        # K chosen per step with a stateless drafter, greedy: its acceptance observed at plain steps too
        # (shadow_proposals_enabled: SPECDEC_SHADOW_PROPOSALS, on by default)
        shadows = (_ShadowProposals(drafter, B, dev, policy.max_k)
                   if policy is not None and pool is None and tree is None and s.sampling is None
                   and drafter.stateless and shadow_proposals_enabled() else None)
        if shadows is not None:
            policy.shadowed = True

        def propose(K_step: int) -> _StepInputs:
            """The inputs of a step of ``K_step`` drafts, from the rows as the device holds them
            (device work only: it may run before the last step's sync)."""
            nonlocal grown, proposed_in_program
            bound, grown = min(rows.text.shape[1], grown), grown + W
            if tree is not None:
                active, budget = ~rows.finished, st.draft_budget()
                nodes = check_tree_proposal(drafter.propose_tree(rows.text[:, :bound].clone(), rows.lengths.clone(),
                                                                 tree), B, tree).to(dev).long()
                errors = proposal_errors(nodes, None, V)
                k = budget.clamp(max=tree.max_depth)  # the deepest node a row may accept
                drafts = nodes.clamp(0, V - 1)
                return _StepInputs(K_step, active, budget, drafts, k, errors, T, st.pending_and(drafts), None, 0)
            made = None
            if in_program and K_step > 0:  # (its program's path, or why its capture failed: the call's draft path)
                made, proposed_in_program = programs.proposal(K_step, drafter), K_step
            if made is not None:  # (the counts live in the program's buffer: not kept for messages)
                *inputs, w = made
                return _StepInputs(K_step, *inputs, counts=None, w=w)
            drafts = counts = None
            if drafter is not None and K_step > 0:
                drafts, counts = check_proposal(drafter.propose(rows.text[:, :bound].clone(), rows.lengths.clone(),
                                                                K_step), B, K_step)
            w = 0 if drafts is None else drafts.shape[1]
            if programs is not None and w == K_step:  # (a narrower proposal runs op by op)
                return _StepInputs(K_step, *programs.inputs(K_step, drafts, counts), counts=counts, w=w)
            if drafts is not None:
                drafts, counts = drafts.to(dev).long(), counts.to(dev).long()
            return _StepInputs(K_step, *st.chain_inputs(K_step, drafts, counts), counts=counts, w=w)

        def appended(chain, n, c, path, scores, logits) -> tuple[torch.Tensor, torch.Tensor]:
            """A step's new tokens (:func:`_new_tokens`) appended to the rows (:meth:`_append`);
            returns ``(new, take)``, take the kept counts."""
            new = _new_tokens(chain, n, c)
            return new, self._append(rows, hook, new, n + 1, scores, logits, path)

        def settle(synced: list, counts, w: int, with_expected: bool) -> tuple[bool, list | None, int | None]:
            """A step's flags, read on the host: raises for a bad proposal, streams the committed
            tokens, notes which rows ended (a pool); returns whether every row has ended, and with
            a policy the step's E(K) (where the flags carry them, ``with_expected``; else None) and
            its live rows."""
            nonlocal finished
            expected = live_rows = None
            if with_expected:
                expected, synced = synced[-policy.read_size:], [int(v) for v in synced[:-policy.read_size]]
            if policy is not None:
                *synced, live_rows = synced
                live_rows = int(live_rows)
            all_done, bad_counts, bad_ids, bad_probs, *rest = synced
            if bad_counts or bad_ids:
                raise ValueError(f"drafter returned num_draft_tokens outside [0, {w}] (its draft_tokens have {w} "
                                 "columns; a count may not exceed them)"
                                 + (f": {counts.tolist()}" if counts is not None else "") if bad_counts
                                 else f"drafter returned token ids outside the target's vocabulary [0, {V})")
            if bad_probs:
                raise ValueError("Drafter.draft_probs returned a distribution its drafts could not have been sampled "
                                 "from: an entry that is not finite or is negative (e.g. logits, not probabilities), "
                                 "or probability 0 at its own draft token; return the distributions the drafts were "
                                 "sampled from, or None for deterministic drafts")
            if s.streamer is not None:  # rest: how many tokens row 0 kept, then the step's tokens
                for tok in rest[1:1 + rest[0]]:
                    s.streamer.put(torch.tensor([tok]))
            if pool is not None:
                finished = [bool(f) for f in rest[:B]]
                if streaming:
                    kept, committed, w_new = rest[B:2 * B], rest[2 * B:], new.shape[1]
                    for b in streaming:
                        pool.stream(b, committed[b * w_new: b * w_new + kept[b]])
            return bool(all_done), expected, live_rows

        def settle_flight(flight: tuple, undo) -> tuple[bool, list | None, int | None]:
            """:func:`settle` of a step whose flags were copied as it ended (``(handle, counts, w,
            with_expected)``), read now; if they raise, the random state ``undo`` (saved before the
            work that should not have run: a later step, a proposal for it) is put back first."""
            try:
                return settle(_FlagReads.read(flight[0]), *flight[1:])
            except Exception:
                if undo is not None:
                    _restore_random_state(undo)
                raise

        def drop_step(marks) -> None:
            """A step launched after the call's last one (or its proposal) is dropped: its laps
            (``marks``) count apart, the policy forgets it, its random draws are put back after the
            loop."""
            nonlocal dropped, done
            for mark in marks:
                clock.relabel(mark, "dropped step")
            if policy is not None:
                policy.drop_last_step()
            dropped, done = step_rs, True

        def propose_ahead(K_next: int) -> None:
            """The next step's proposal, made while the device runs this step (overlap): unused, with
            any error it raised, if this step ends the call; its random draws put back then."""
            nonlocal ready, drawn, drafted_at
            drawn = _random_state(s.generator, dev)
            try:
                ready = propose(K_next)
            except Exception as err:  # (raised when its step runs: a drafter past its text may fail)
                ready = err
            clock.lap("draft")
            drafted_at = clock.marks - 1  # (its lap, counted apart if its step never runs)

        ready = None  # the next step's inputs, made before this step's sync (overlap)
        warmed = warmups_run()  # (programs' warm-ups and captures so far: a step that adds one is unmeasured)
        shadowed_step = False  # (whether the last step made a shadow proposal)
        drawn = drafted_at = None  # (overlap) the random state before that proposal, and its lap's mark
        dropped = step_rs = None  # (pipelined) the random state before a step that ran past the call's end
        while True:
            if pool is not None:  # admission: finished rows take the next requests (continuous batching)
                live, longest = self._admit(pool, dec, rows, s, finished, policy, drafter, first_requests)
                first_requests, done, grown = None, not live, max(grown, longest)
                clock.lap("prefill")  # (the newcomers' prefill is not the step's drafting)
            if done:
                break
            first_mark = clock.marks
            K_step = policy.next_k() if policy is not None else K  # drafts this step asks for
            if pipelined:  # should this step run past the end: what it draws from, and its laps so far
                step_rs, step_laps = ((drawn, [drafted_at]) if ready is not None
                                      else (_random_state(s.generator, dev) if draws else None, []))
            if ready is None:
                try:
                    ready = propose(K_step)
                except Exception as err:  # (pipelined: the last step may have ended the call)
                    ready = err
            if isinstance(ready, Exception):
                if in_flight is not None and settle_flight(in_flight, step_rs)[0]:  # the call ended: no step
                    ready = in_flight = None
                    drop_step(step_laps)
                    break
                err, ready = ready, None  # (no reference cycle through this frame)
                raise err
            (K_ready, active, budget, drafts, k, errors, width, tokens, counts, w), ready = ready, None
            if K_ready != K_step:  # (the K known before the sync must be the one the step runs)
                raise RuntimeError(f"the proposal made before the sync asked for {K_ready} drafts, the step {K_step}")
            proposed = counts is not None
            prob_errors = no_prob_errors  # (set below when the step's drafts come with their distributions)
            clock.lap("draft")
            logits, hidden = dec.forward(tokens, plain=K_step == 0)  # K = 0: a plain step (state updated in place)
            shadow_seen = None
            shadowed_step, after_shadow = shadows is not None and shadows.due(K_step), shadowed_step
            if shadowed_step:  # (the text as this step started: appended below)
                clock.lap("verify")
                shadow_seen = shadows.make(rows.text, min(rows.text.shape[1], grown), rows.lengths, budget)
                clock.lap("shadow")
            glued = programs is not None and w == K_step  # (its inputs came from the step's programs)
            if glued:  # acceptance, append, counters and flags: one program
                n, new, take, read = programs.settle(K_step, logits)
                seen, path = n, None
            else:
                scores = hook.process(logits, tokens, rows.n_gen, tree) if hook else logits
                if tree is not None:
                    best, n, c = accept_tree(scores, tokens, tree, k, s.sampling, s.generator, drafter.acceptance,
                                             drafter.posterior_threshold, drafter.posterior_alpha)
                    j = torch.arange(W, device=dev)[None, :]
                    path = torch.where(j <= n[:, None], tree.tensors(dev)["path_of"][best], j)  # the accepted path
                    chain, seen = tokens.gather(1, path)[:, 1:], best
                else:
                    if s.sampling is None:
                        n, c = greedy_accept(scores, drafts, k)
                    else:
                        probs = check_draft_probs(drafter.draft_probs(), B, w, V) if proposed else None
                        probs = None if probs is None else _to_width(probs.to(dev), width - 1)
                        if probs is not None:
                            prob_errors = draft_prob_errors(probs, drafts, k)
                        n, c = sample_accept(scores, drafts, k, s.sampling, probs, s.generator)
                    chain, seen, path = drafts, n, None
                new, take = appended(chain, n, c, path, scores, logits)
            clock.lap("verify")
            dec.commit(take, path)  # take <= n + 1: the accepted prefix, cut at EOS / the budget / criteria
            if drafter is not None and drafter.wants_hidden_states:  # the hidden state whose logits gave c
                drafter.observe(hidden[idx, seen])
            if every:  # the committed positions' hidden states (a tree step: its accepted path's)
                drafter.observe_tokens(hidden if path is None else hidden[idx[:, None], path], take)
            clock.lap("rollback")
            steps += 1
            streaming = pool.streaming_rows() if pool is not None else []
            if not glued:  # (the programs run only where none of the extra flags below is wanted)
                st.counted(n, active, k)
                flags = st.flags(errors, prob_errors)
                if s.streamer is not None:  # the same sync also brings row 0's committed tokens
                    flags += [take[:1], new[0]]
                if pool is not None:  # ... or which rows ended, for the next admission
                    flags.append(rows.finished.long())
                if streaming:  # ... and the committed tokens of every row, for the streaming requests
                    flags += [take, new.reshape(-1)]
                if policy is not None:  # the live rows (the last flag), and E(K) of the next step, on the same sync
                    flags.append(st.live_rows())
                read = torch.cat(flags)
            if policy is not None and warmups_run() != warmed:  # (a graph captured or a program warmed up in this step)
                warmed = warmups_run()
                policy.unmeasured()
            elif shadowed_step or after_shadow:  # (its time holds a shadow's host work: SHADOW_OFFSET)
                policy.unmeasured()
            expected = live_rows = None
            ahead = policy is not None and policy.reads_ahead  # its values are on the host: choose before the sync
            if policy is not None:  # (a skipped update needs no arguments; it may still have values to read)
                if policy.skips_update and shadow_seen is None:
                    expected = policy.skipped_values()
                else:  # (a plain step that checked a shadow observes its drafts instead of none)
                    left = (rows.max_new - rows.n_gen - 1).clamp(min=0)
                    observation = shadow_seen if shadow_seen is not None else (n, budget.clamp(max=K_step), active)
                    expected = policy.update(*observation, ~rows.finished, left, observed=shadow_seen is not None)
                if ahead and not pipelined:  # the next K is chosen while the device still runs this step
                    clock.lap("bookkeeping")
                    policy.before_sync(expected, clock, first_mark)
                elif expected is not None and not ahead:
                    read = torch.cat([read.double(), expected])
            read_expected = expected is not None and not ahead  # (E(K) in this step's flags)
            if overlap and not pipelined and (policy is None or ahead):  # the next step's proposal, launched
                if not ahead:                                              # while the device runs
                    clock.lap("bookkeeping")  # (the flags above; ahead, already lapped)
                propose_ahead(K if policy is None else policy.upcoming_k)
            if pipelined:  # this step's flags are copied as it ends and read after the next step is launched
                clock.lap("bookkeeping")  # (this step's laps end before its flags' copy: complete once it is read)
                flight_mark = clock.marks
                flight = (flag_reads.start(read), counts, w, read_expected)
                last = None
                if in_flight is not None:
                    last, in_flight = settle_flight(in_flight, step_rs), None  # (done, E(K), live rows) of the last step
                    if last[0]:  # the call ended: this step ran on ended rows
                        drop_step(step_laps + list(range(first_mark, clock.marks)))
                        clock.lap("dropped step")
                        steps -= 1
                        hist[0] -= B  # (its rows' n = 0; totals: no active row, so no counts)
                        break
                if ahead:  # the K after this step's, from the values of the update before this one
                    if last is not None:  # (first: those values were computed for the last step's live rows)
                        policy.after_sync(last[2])
                    policy.before_sync(expected, clock, first_mark, flight_mark)
                elif policy is not None:  # the last step's E(K) (none at the first): the next K, one step late
                    _, values, live = last if last is not None else (None, None, None)
                    policy.after_step(values, clock, first_mark, live, flight_mark)
                if steps >= last_step:  # every row has ended now (each step keeps >= 1 token of a live row)
                    done = settle_flight(flight, None)[0]
                    clock.lap("bookkeeping")
                    continue
                in_flight, done = flight, False
                if overlap and (policy is None or ahead):  # the next step's proposal, while the device runs this one
                    clock.lap("bookkeeping")
                    propose_ahead(K if policy is None else policy.upcoming_k)
                clock.lap("bookkeeping")
                continue
            try:  # the step's one host sync
                done, expected, live_rows = settle(read.tolist(), counts, w, read_expected)
            except Exception:  # (a bad proposal: the one made ahead, for a step that will not run, is undone)
                if ready is not None:
                    _restore_random_state(drawn)
                raise
            clock.lap("bookkeeping")  # (ahead: the step's second bookkeeping lap, its work after the sync)
            if ahead:
                policy.after_sync(live_rows)
            elif policy is not None:
                policy.after_step(expected, clock, first_mark, live_rows)
        if ready is not None:  # the proposal for a step that never ran: dropped, its random draws undone
            ready = None
            _restore_random_state(drawn)
            clock.relabel(drafted_at, "dropped proposal")  # (in the wall time, not in a step's)
        if dropped is not None:  # (pipelined) a step launched after the call's last one: its draws undone
            _restore_random_state(dropped)
        if s.streamer is not None:
            s.streamer.end()
        times = clock.totals()
        # how the step's programs ran (for tests and profiles): None where the call ran none
        self._step_programs_path = None if programs is None or not steps else programs.path
        row_steps, proposed, accepted = totals.tolist()
        # how the last proposal ran: the step programs' of its K where it was asked of them (a failed
        # capture's error included), else the drafter's own; None where this call used no draft
        inside = programs.proposal_path(proposed_in_program) if proposed_in_program is not None else (None, None)
        if drafter is None or not proposed:
            draft_path = draft_error = None
        elif inside[0] is not None:
            draft_path, draft_error = inside
        else:
            draft_path = drafter.last_path
            draft_error = "; ".join(f"{what}: {err}" for what, err in (("capture", drafter.capture_error),
                                                                       ("compile", drafter.compile_error)) if err) or None
        hist[0] -= steps * B - row_steps  # the steps of finished rows (n = 0), which ran nothing
        n_gen = hook.final_counts(rows.n_gen) if hook else rows.n_gen  # the tokens returned
        new_tokens = int(n_gen.sum()) if pool is None else pool.new_tokens
        step_s = sum(times.get(phase, 0.0) for phase in ("draft", "shadow", "verify", "rollback", "bookkeeping"))
        if policy is not None:
            k_histogram, k_per_step = policy.k_histogram(), policy.k_per_step
            policy_view = dict(predicted_step_s=policy.predicted_step_s(), measured_step_s=policy.measured_step_s(),
                               calibrated_step_s=policy.calibrated_step_s(),
                               expected_tokens=policy.expected_tokens_seen(),
                               leave_s=policy.costs.leave_s(policy.key),
                               catch_up_s=policy.costs.catch_up_s(policy.key, policy.drafter_key),
                               speculation_gain_per_step=policy.gain_per_step)
            policy.settle()
            self._learned_acceptance = policy.acceptance.overall(policy.prior)  # (on the host)
            policy.close()  # (its kept update graph may serve the next call)
        else:
            k_histogram, k_per_step = [0] * K + [steps], [K] * steps
            policy_view = {}
        self.last_stats = Stats(
            steps=steps, new_tokens=new_tokens, proposed_tokens=proposed, accepted_tokens=accepted,
            mean_accepted_tokens=(accepted + row_steps) / row_steps if row_steps else 0.0,
            acceptance_rate=accepted / proposed if proposed else 0.0, accept_histogram=hist.tolist(),
            draft_s=times.get("draft", 0.0) + times.get("shadow", 0.0), verify_s=times.get("verify", 0.0),
            rollback_s=times.get("rollback", 0.0),
            prefill_s=times["prefill"], wall_s=times["wall"], decode_path=dec.path, capture_error=dec.capture_error,
            path_reason=path_reason, devices=self.adapter.placement.layout(),
            draft_path=draft_path, draft_error=draft_error,
            k_histogram=k_histogram, k_per_step=k_per_step, rollback=strategy_label(strategy),
            rollback_reason=reason, calibration_s=times.get("calibration", 0.0),
            predicted_tokens_per_s=policy.predicted_tokens_per_s if policy is not None else None, **policy_view,
            # the steps' tokens: every row's (request's) first new token came from its prefill
            measured_tokens_per_s=((new_tokens - (B if pool is None else pool.num_finished)) / step_s
                                   if policy is not None and step_s > 0 else None),
            prefix_cache=(pool.prefix_cache.stats.as_dict() if pool is not None and pool.prefix_cache is not None
                          else None),
        )
        if pool is not None:
            return None
        out = rows.output(ids, n_gen, s.pad_token_id)
        return self._output(s, out, hook, out.shape[1] - Lp)

    def _admit(self, pool: RequestPool, dec: Decoder, rows: _Rows, s, finished: list[bool],
               policy: SpeculationPolicy | None, drafter: Drafter | None, first: list | None = None
               ) -> tuple[bool, int]:
        """The admission phase of a continuous-batching step: the rows whose request ended
        (``finished``, the host copy of ``rows.finished``) give their new tokens to ``pool`` and
        take the next queued requests: their prompts are prefilled together (left-padded) straight
        into those rows of ``dec``'s cache (:meth:`HybridCache.load_rows`, in place: the other rows
        and the captured graphs are untouched), and each row's first new token is picked from its prefill logits, as in
        ``generate()``; the drafter resets those rows (:meth:`Drafter.admit`, with the prompts'
        hidden states when it wants them); with ``num_speculative_tokens="auto"`` their acceptance
        estimates restart from the prior. Repeats while rows end at once (EOS first, a budget of one).
        While other rows decode, free rows wait for a group (:meth:`RequestPool.take`).

        A prompt longer than ``pool.max_batch_tokens`` is prefilled in chunks of that many tokens
        (:meth:`HybridAdapter.prefill_chunked`; with prefix caching, after its hit, in whole
        blocks): one chunk per step
        while other rows decode, so it does not stall them for its whole prefill (its row waits,
        and no other request is admitted meanwhile); all at once when nothing decodes.

        ``first``: requests the pool already gave rows (its first ones, :meth:`_run_pool`), admitted
        before anything else.

        Returns ``(live, longest)``: whether any row decodes, and the longest text admitted (0: none)."""
        longest = 0
        dev = rows.text.device
        every = drafter is not None and drafter.wants_all_hidden_states
        while True:
            job = None
            if first:  # the rows the pool gave its first requests (they hold them, finished as placeholders)
                taken, first = first, None
                free = [b for b, req in enumerate(pool.slots) if req is not None]
            else:
                ended = pool.busy(finished)
                generated = rows.generated(ended) if ended else []
                job = pool.prefilling_chunks
                if job is not None and job.row in ended:  # a hard stop ends it before its first token
                    generated[ended.index(job.row)] = []
                    pool.prefilling_chunks = job = None
                for row, tokens in zip(ended, generated):
                    pool.finish(row, tokens)
                live = not all(finished)
                if job is not None:  # a long prompt, a chunk a step
                    try:
                        next(job.steps)
                        if live:
                            return live, longest
                        continue  # nothing else decodes: its next chunk now
                    except StopIteration as stop:
                        pool.prefilling_chunks = None
                        logits, hidden = stop.value
                        taken, ids, fresh, slots = [pool.slots[job.row]], job.ids, job.cache, [job.row]
                        mask = torch.ones_like(ids)
                else:
                    free = [b for b, req in enumerate(pool.slots) if req is None and finished[b]]
                    taken = pool.take(free, decoding=live)
                    if not taken:
                        return live, longest
            if job is None:
                slots = free[:len(taken)]
                ids, mask = left_pad([r.prompt for r in taken], dev)
                if len(taken) == 1 and ids.shape[1] > pool.max_batch_tokens:
                    # a cache of its own, its chunks prefilled between the other rows' steps
                    fresh = self.adapter.new_cache(1, dec.cache.max_len, dec.step_tokens, dec.strategy)
                    pool.prefilling_chunks = _ChunkedPrefill(
                        free[0], ids, fresh,
                        self.adapter.prefill_chunked(ids[0], fresh, pool.max_batch_tokens, every,
                                                     prefix_cache=pool.prefix_cache))
                    continue  # its first chunk now
                # straight into the free rows (host ints: checked without waiting for the device)
                logits, hidden = self.adapter.prefill(ids, mask, dec.cache, every, prefix_cache=pool.prefix_cache,
                                                      max_tokens=pool.max_batch_tokens, prompt_path=dec.prompt_path,
                                                      rows=slots)
            else:  # a long prompt's last chunk ran: its cache's row moves into the pool's
                dec.cache.reset_rows(slots, fresh)
            # the rows and their budgets in one copy to the device (each copy from the host waits for it)
            idx, budgets = torch.tensor([slots, [r.max_new_tokens for r in taken]], dtype=torch.long, device=dev)
            if drafter is not None:
                self._admit_drafter(drafter, idx, ids, mask, hidden, taken)
            rows.reset(idx, ids, mask, budgets)
            new = torch.zeros(rows.text.shape[0], 1, dtype=torch.long, device=dev)
            new[idx, 0] = self._pick_first(logits.float(), s)
            limit = torch.zeros(rows.text.shape[0], dtype=torch.long, device=dev)
            limit[idx] = 1
            rows.append(new, limit)
            if policy is not None:
                policy.restart_rows(idx)
            finished = rows.finished.tolist()
            pool.prefilled()
            if any(r.streaming for r in taken):  # their first tokens, from the prefill
                for b, tok in zip(slots, new[idx, 0].tolist()):
                    if pool.slots[b].streaming:
                        pool.stream(b, [tok])
            longest = max(longest, ids.shape[1] + 1)

    @staticmethod
    def _admit_drafter(drafter: Drafter, rows, input_ids, attention_mask, hidden, requests) -> None:
        """:meth:`Drafter.admit` of ``rows`` with their prompts' prefill ``hidden`` states (every
        position's or the last one's, as the prefill gave them) when the drafter wants them."""
        wanted = drafter.wants_all_hidden_states or drafter.wants_hidden_states
        drafter.admit(rows, input_ids, attention_mask, hidden if wanted else None, requests)

    @staticmethod
    def _append(rows, hook, new, limit, scores, raw, pos=None):
        """``rows.append`` then the hook's per-token work; returns the kept counts. ``pos [B, W]``:
        the verify positions whose scores chose each new token (None: 0..W-1)."""
        if hook is None:
            return rows.append(new, limit)
        before, finished = rows.n_gen.clone(), rows.finished.clone()
        take = rows.append(new, limit)
        if pos is not None:
            b = torch.arange(new.shape[0], device=new.device)[:, None]
            scores, raw = scores[b, pos], raw[b, pos]
        return hook.after_append(rows, new, take, before, finished, scores, raw)

    def _pick_first(self, logits, s):
        if s.sampling is None:
            return logits.argmax(-1)
        return torch.multinomial(process_logits(logits, s.sampling), 1, generator=s.generator)[:, 0]

    def _pick_path(self, dev, hook) -> str:
        """``"eager"``, ``"static"`` or ``"cuda_graph"`` for this call (see ``decode_path``)."""
        return self._choose_path(dev, hook)[0]

    def _choose_path(self, dev, hook) -> tuple[str, str]:
        """:meth:`_pick_path`'s path and why it was chosen (what :attr:`Stats.path_reason` says)."""
        blockers = hook.settings.per_token_features if hook is not None else []
        want = self.decode_path
        if want == "auto":  # (accelerate's per-forward weight loading cannot be replayed: see the setter)
            place = self.adapter.placement
            if blockers:
                return "eager", f"auto: {', '.join(blockers)} need the eager path"
            if self.adapter.offloads_weights:
                return "eager", "auto: accelerate loads offloaded weights for each forward (no CUDA graphs)"
            if place.multi_device:  # (static: no host read of seq_len per attention layer, as eager's)
                if place.all_cuda:
                    return "static", "auto: layers on several CUDA devices: the static path, no CUDA graphs"
                return "eager", (f"auto: layers on several devices ({', '.join(map(str, place.devices))}), not all "
                                 "CUDA: the eager path")
            if dev.type != "cuda":
                return "eager", f"auto: the model is on {dev}, not CUDA"
            return "cuda_graph", "auto: the model is on one CUDA device"
        if want != "eager" and blockers:
            raise ValueError(f"decode_path={want!r} does not support {', '.join(blockers)}; use decode_path='eager' "
                             "or 'auto' (which picks the eager path for such calls)")
        if want == "cuda_graph":
            self._check_one_device()
        if want == "cuda_graph" and dev.type != "cuda":
            raise ValueError(f"decode_path='cuda_graph' needs a CUDA model, this one is on {dev}; use 'static' or 'eager'")
        return want, f"decode_path={want!r} asked for"

    def _decoder(self, path: str, batch: int, needed_len: int, step_tokens: int, tree,
                 strategy: RollbackStrategy) -> Decoder:
        """A decoder for ``strategy``: a fresh eager one, or the static bucket's (kept between calls:
        one bucket at a time, its buffers can be large)."""
        if path == "eager":
            return EagerDecoder(self.adapter, strategy, batch, step_tokens, needed_len, tree)
        dec = StaticDecoder.bucket(self.adapter, strategy, batch, step_tokens, needed_len, path == "cuda_graph", tree)
        kept = self._static.get(dec.key)
        if kept is None or kept.strategy is not strategy:
            self._static.clear()
            kept = self._static[dec.key] = dec
        return kept

    # the "auto" choices (specdec.adaptive) ----------------------------------------------------
    def _prefilled(self, s, path: str, needed_len: int, step_tokens: int, tree, strategy) -> Decoder:
        """A decoder for ``strategy`` prefilled with the call's prompts."""
        dec = self._decoder(path, s.input_ids.shape[0], needed_len, step_tokens, tree, strategy)
        dec.prefill(s.input_ids, s.attention_mask)
        return dec

    def _measure(self, dec: Decoder, key: CostKey, widths: list[int]) -> None:
        """Record in the cost model the verify and commit times of the step ``widths`` that ``key``
        lacks, and the bytes of the rollback buffers, measured on ``dec`` (prefilled)."""
        costs = self.cost_model
        todo, unsized = self._unmeasured(key, widths, dec.step_tokens)
        if todo:
            for T, (verify_s, commit_s) in calibrate(dec, todo, self.policy.calibration_repeats).items():
                costs.record_width(key, T, verify_s, commit_s)
        elif unsized:  # (widths timed on a decoder of another size) untimed: a step allocates what a
            calibrate(dec, [dec.step_tokens], 1)  # prefill does not (replay's history)
        else:
            return
        costs.record_bytes(key, rollback_bytes(dec.cache), dec.step_tokens)

    def _unmeasured(self, key: CostKey, widths: list[int], step_tokens: int) -> tuple[list[int], bool]:
        """What :meth:`_measure` has left to measure for ``key``: the step widths not timed yet, and
        whether the rollback buffers' bytes at ``step_tokens`` are wanted (a memory budget is set:
        they grow with the step) and not known."""
        costs = self.cost_model
        unsized = self.policy.memory_budget_bytes is not None and costs.rollback_bytes(key, step_tokens) is None
        return costs.needs_widths(key, widths), unsized

    def _rollback(self, s, path: str, needed_len: int, step_tokens: int, tree, K: int,
                  adaptive: bool, until_last: bool = False) -> tuple[RollbackStrategy, str | None]:
        """The call's rollback strategy and, for ``rollback="auto"``, why: every candidate is
        measured (once per path and batch, on a decoder prefilled with the call's prompts; see
        :mod:`specdec.adaptive`) and compared at K (a fixed K) or at its best K under the
        acceptance known now ("auto"). A tree step always runs the tree's ``step_tokens`` nodes, so
        trees are compared at that width (as a chain of ``step_tokens - 1`` drafts); ``until_last``:
        E(K) counts the steps until the slowest row ends, as the call's policy does (no pool)."""
        if K == 0 and not adaptive:
            plain = "plain decoding (num_speculative_tokens=0) updates the state in place: nothing to roll back"
            return _IN_PLACE, None if self._candidates is None else plain
        if self._candidates is None:
            return self._strategy, None
        B = s.input_ids.shape[0]
        memo = (path, B, step_tokens, tree, None if adaptive else K, until_last)
        if memo in self._choices:  # decided once per shape: a strategy that changed between calls would
            name, reason = self._choices[memo]  # drop the kept decoder and its graphs each time
            self._strategy = self._candidates[name]
            return self._strategy, reason
        widths = list(range(1, step_tokens + 1)) if adaptive else [step_tokens]
        at = step_tokens - 1 if tree is not None else K  # the drafts of the width a step runs (fixed K)
        costs, step_s, nbytes, left_out = self.cost_model, {}, {}, {}
        for name, strategy in self._candidates.items():
            key = CostKey(path, name, B)
            if any(self._unmeasured(key, widths, step_tokens)):
                try:  # (a decoder of its own, freed before the next strategy's)
                    self._measure(self._prefilled(s, path, needed_len, step_tokens, tree, strategy), key, widths)
                except torch.OutOfMemoryError as err:
                    self._static.clear()
                    left_out[name] = f"out of memory while measuring it ({_first_sentences(str(err), 2)})"
                    continue
            step_s[name] = {k: costs.comparable_step_s(key, self._drafter_key, k)
                            for k in (range(K + 1) if adaptive else [at])}
            nbytes[name] = costs.rollback_bytes(key, step_tokens)
        rates = torch.full((1, at), self.policy.prior_acceptance)  # (one row for the batch's identical ones)
        budget = torch.full((1,), max(0, s.max_new_tokens - 1), dtype=torch.long)
        # (at a fixed width every strategy commits the same tokens: the choice is the fastest step)
        expected = expected_tokens(rates, budget, torch.ones(1, dtype=torch.bool), until_last, copies=B).tolist()
        choice = choose_strategy(step_s, expected, None if adaptive else at, nbytes, self.policy.memory_budget_bytes,
                                 left_out)
        self._strategy = self._candidates[choice.name]
        if s.max_new_tokens >= step_tokens:  # (a call too short for a step's every draft compares fewer: not kept)
            self._choices[memo] = (choice.name, choice.reason)
        return self._strategy, choice.reason

    def _speculation_policy(self, s, path: str, dec: Decoder, strategy, K: int, until_last: bool) -> SpeculationPolicy:
        """The call's K policy, after measuring the step widths of ``dec`` (prefilled) whose costs
        are not known yet; ``until_last``: the call ends with its slowest row (no pool). Its rows
        start from the acceptance the drafter showed over the last call (per draft position, all
        its steps: the end of a call need not be like the start of the next), or from
        ``prior_acceptance`` for a drafter's first call."""
        key = CostKey(path, strategy_label(strategy), dec.batch)
        widths = list(range(1, K + 2))
        self._measure(dec, key, widths)
        dec.prepare(widths)  # graphs of widths measured on another decoder: captured now, not mid-decode
        learned = self._learned_acceptance
        carried = learned is not None and learned.shape[0] == K
        prior = learned if carried else self.policy.prior_acceptance
        return SpeculationPolicy(self.policy, self.cost_model, key, self._drafter_key, K, dec.batch, s.max_new_tokens,
                                 prior, s.input_ids.device, until_last,
                                 graphs=self._policy_graphs if dec.path == "cuda_graph" else None,
                                 prior_from_last_call=carried)

    @staticmethod
    def _output(s, sequences, hook, G):
        """The tensor, or HF's ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``."""
        if not s.return_dict:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        def steps(buf):
            return None if buf is None else tuple(buf[:, i] for i in range(G))

        return GenerateDecoderOnlyOutput(sequences=sequences, scores=steps(hook.scores if hook else None),
                                         logits=steps(hook.raw_logits if hook else None))

    def __repr__(self):
        return (
            f"SpeculativeGenerator({type(self.model).__name__}, drafter={self.drafter!r}, "
            f"rollback={AUTO if self._candidates is not None else self.strategy.name!r}, "
            f"num_speculative_tokens={self.num_speculative_tokens!r})"
        )
