"""Adaptive speculation: the speculation length K of every step and the rollback strategy of a
call, chosen from measured step costs and the acceptance observed so far
(``num_speculative_tokens="auto"``, ``rollback="auto"``).

The rule is goodput, committed tokens per second, as SmartSpec chooses the speculation length
of a serving batch (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large
Language Models Using Goodput"), with the expected accepted length of Leviathan et al. 2023
(section 3.1) generalised from one acceptance rate to one per row and draft position. Before
every step, for each K in ``[0, max_speculative_tokens]``::

    E(K) = sum over live rows r of  1 + sum_{j=1..min(K, b_r)} prod_{i=1..j} a[r, i]
    t(K) = draft(K) + verify(B, K + 1) + commit(B, K + 1) + overhead
    K*   = argmax_K E(K) / t(K)

``a[r, i]`` is row r's estimated probability that draft i is accepted when drafts 1..i-1 were
(:class:`AcceptanceEstimator`), ``b_r`` the drafts the row's remaining budget can still use,
``t(K)`` the predicted seconds of one step of the whole batch (:class:`CostModel`). K = 0 is plain
decoding through the same engine (the drafter is not called).

:class:`SpeculationPolicy` turns K* into the step's K with these rules:

* **hysteresis**: the current K is kept unless K* is predicted faster by more than
  ``hysteresis`` (default 5%), so measurement noise does not switch between step widths (each
  width of the static path is its own captured CUDA graph) every step; a smaller gain that
  persists moves it too: once the predicted gains of one K* over the current K, summed over
  consecutive steps in which the band held the current K from that same K*, pass
  ``hysteresis_sum`` (default 0.2: a steady 3% after seven steps), so the band cannot hold a K
  a few percent slower for a whole call;
* **a margin to start speculating**: speculation starts only when predicted faster than K = 0 by
  more than ``min_gain`` (2% up to 8 rows, ``2% * sqrt(8 / B)`` above: 0.7% at 64 rows, as the
  noise of the batch's E(K) shrinks); it stops as any K is left, by the hysteresis and its sum
  (K = 0 predicted more than 5% faster, or faster by less for long enough), not at the first
  step predicted slower: at K = 0 only the probes observe acceptance, so a stop on a dip of the
  estimate would stand for the rest of the call;
* **measuring a neighbour**: once the current K's own step time is measured, a width next to it
  (K - 1 or K + 1) whose step time the costs have not measured in :data:`MEASURED_STEPS` real
  steps (:meth:`CostModel.measured`), runs in place of K while its predicted goodput is within
  ``hysteresis`` of K's, until real steps have measured it, at most :data:`MEASURING_STEPS`
  steps per width and call (``measure_neighbours``): a calibration a few percent off would
  otherwise hold the policy off a faster width for good, since only a width that runs is refined;
* **probe**: at K = 0 no draft is proposed, so nothing is observed; every ``probe_interval``-th
  step at K = 0 runs the speculative K of the best predicted goodput instead
  (:meth:`SpeculationPolicy.probe_k`), so a rising acceptance is seen and speculation resumes;
  probes are spaced further where one costs more than ``probe_budget`` of the steps between
  them (its own extra time beyond the plain steps that would commit its expected tokens, per
  step and for a lone row; a fixed batch of several rows ends with its slowest row, which one
  probe seldom moves, so there its whole extra time; and the extra time of the plain step after
  it, which may first flush the strategy's rollback data: replay folds its input history into
  the state; a drafter that catches up (draft model, MTP layers) first runs the plain steps'
  text at a probe, a cost per plain step that no spacing spreads: the probe's fixed part gets
  what it leaves of ``probe_budget``, at least a quarter; such a probe runs a second step at its
  K while the costs have not measured a proposal alone, which tells the catch-up from the
  proposal). A call that starts
  from the acceptance its drafter showed over the last call (on other prompts) at K = 0 probes at
  its first step: a call shorter than the probe spacing would otherwise never look at its own
  prompts' acceptance, and would hand the old estimate on to the next call unchanged (a call
  that speculates first has looked already).

For a batch that ends with its slowest row (``generate()``, not continuous batching), E(K) is
instead the tokens the rows have left over the steps the slowest row is expected to need at K
(:func:`expected_tokens` with ``until_last``): rows that speculate finish at different steps and
the batch waits for the last.

Every row runs the step's K: the verify forward pads rows to one width, so a per-row count below
the step's K would save no time in this loop (the drafter and the forward cost the same) and
could only lose accepted tokens. A row whose acceptance is low counts for less in E(K) instead.

The costs are measured, not assumed (:class:`MeasuredCosts`): the verify forward and the commit of
every step width on the call's own decoder after its prefill (a warm-up run of each width first:
it compiles the kernels and, on the CUDA-graph path, captures the width's graphs), then refined
online from the :class:`~specdec.clock.StepClock` laps of real steps; the drafter's time per K
online only (a proposal changes the drafter's state, so it cannot be timed apart). They are kept
per (model, device, dtype) (:func:`costs_for`) and per (decode path, strategy, batch): a call with
a new batch size measures again. :class:`FixedCosts` takes given step times instead (tests,
costs measured elsewhere).

``rollback="auto"`` measures every strategy of :data:`specdec.rollback.STRATEGIES` the same way
and keeps, for the call, the one with the best predicted goodput (fixed K: the lowest step time
at that K) among those whose rollback buffers fit the memory budget (:func:`choose_strategy`).
A strategy's buffers hold the rolled-back state, so it cannot change in the middle of a call: it
is chosen once per call, after the measured warm-up.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import math
import numbers
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .clock import StepClock
from .fusion import fusable, fusion_enabled
from .graphs import CaptureFailure, capture
from .rollback import ReplayRollback

__all__ = ["AUTO", "POLICY_GRAPHS_KEPT", "PolicySettings", "AcceptanceEstimator", "CostKey", "CostModel", "DrafterKey",
           "MeasuredCosts", "FixedCosts", "SpeculationPolicy", "StrategyChoice", "calibrate", "choose_k", "choose_strategy", "costs_for",
           "expected_tokens", "rollback_bytes", "speculation_gain", "step_measures", "strategy_label"]

#: the value of ``num_speculative_tokens`` / ``rollback`` that asks for the adaptive choice
AUTO = "auto"


@dataclass(frozen=True)
class PolicySettings:
    """Tunables of the adaptive policy (``specdec.wrap(..., policy=PolicySettings(...))``).

    Attributes:
        acceptance_weight: weight of a new observation in the per-row, per-position acceptance
            average (exponentially weighted: ``a := (1 - w) a + w x``), in (0, 1], for batches of
            at least ``acceptance_batch`` rows; a batch of B < ``acceptance_batch`` rows uses
            ``w * sqrt(B / acceptance_batch)``: E(K) sums fewer rows' estimates, so it is noisier,
            and a deep dip of a noisy estimate (K = 0 predicted ``hysteresis`` faster) sends the
            policy to K = 0 until its next probe.
        acceptance_batch: see ``acceptance_weight`` and ``min_gain`` (>= 1).
        prior_acceptance: the acceptance of every position of every row before anything was
            observed, in [0, 1]: a drafter's first call starts from it, later calls with the same
            drafter from what it showed over the last call (:meth:`AcceptanceEstimator.overall`).
        hysteresis: keep the current K unless another is predicted faster by more than this
            fraction (>= 0), or (``hysteresis_sum``) by less, but for long enough.
        hysteresis_sum: leave the current K for the best one also once the best's predicted
            gains over it (``rate(best) / rate(current) - 1``), summed over the consecutive steps in
            which the band held the current K from that same K, pass this (the sum restarts when
            the current K is the best again, the best changes or the K changes). >= 0; it is also
            how speculation stops on a small predicted loss (K = 0 the best by less than
            ``hysteresis``). ``math.inf``: off, the band alone (speculation predicted slower than
            plain decoding by less than ``hysteresis`` then runs on for good).
        measure_neighbours: once the current K's cost is measured, run a width next to it whose
            cost was not measured yet while its predicted goodput is within ``hysteresis`` of K's,
            until real steps have measured it (at most :data:`MEASURING_STEPS` steps per width and
            call; see the module docstring).
        min_gain: start speculating (a K > 0 after K = 0, or at the first step) only when predicted
            faster than plain decoding (K = 0) by more than this fraction (>= 0), for batches of
            at most ``acceptance_batch`` rows; a batch of B > ``acceptance_batch`` rows uses
            ``min_gain * sqrt(acceptance_batch / B)``, as E(K) sums more rows' estimates and its
            noise, which the margin is for, shrinks so; speculation that runs leaves for K = 0 as
            for any K, by ``hysteresis`` and ``hysteresis_sum`` (:func:`choose_k`).
        probe_interval: at K = 0, at most every this-many-th plain step since the last probe runs a
            probe, the speculative K of the best predicted goodput (>= 1).
        probe_budget: probes at K = 0 are spaced so that they cost at most this fraction of the
            time at K = 0 (in (0, 1]; at a large batch a speculative step costs much more than a
            K = 0 one); for a drafter that catches up, whose probes first run the plain steps'
            text, their fixed part gets what that catch-up leaves of it, at least a quarter
            (:meth:`SpeculationPolicy.probe_every`), so its probes may cost more.
        cost_weight: weight of a new step time in the online cost averages, in (0, 1].
        calibration_repeats: timed runs of each step width when measuring (>= 1; the fastest counts).
        memory_budget_bytes: ``rollback="auto"``: the most bytes a strategy's rollback buffers may
            take (all SSM layers, the batch); None: any strategy whose measurement did not run
            out of memory fits.

    Raises:
        ValueError: a value outside its range.
    """

    acceptance_weight: float = 0.25
    acceptance_batch: int = 8
    prior_acceptance: float = 0.6
    hysteresis: float = 0.05
    hysteresis_sum: float = 0.2
    measure_neighbours: bool = True
    min_gain: float = 0.02
    probe_interval: int = 8
    probe_budget: float = 0.01
    cost_weight: float = 0.2
    calibration_repeats: int = 3
    memory_budget_bytes: int | None = None

    def min_gain_for(self, batch: int) -> float:
        """The margin speculation must be predicted to beat K = 0 by before it starts, for a batch
        of ``batch`` rows (see ``min_gain``)."""
        return float(self.min_gain) * min(1.0, math.sqrt(self.acceptance_batch / batch))

    def acceptance_weight_for(self, batch: int) -> float:
        """The acceptance average's weight for a batch of ``batch`` rows (see ``acceptance_weight``)."""
        return float(self.acceptance_weight) * min(1.0, math.sqrt(batch / self.acceptance_batch))

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"PolicySettings.{name} must be {want}, got {getattr(self, name)!r}")

        for name in ("acceptance_weight", "cost_weight", "probe_budget", "prior_acceptance", "hysteresis",
                     "hysteresis_sum", "min_gain"):  # (a number: float("0.5") would let a string through)
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, numbers.Real):
                bad(name, f"a number, not {type(val).__name__}")
        for name in ("acceptance_weight", "cost_weight", "probe_budget"):
            if not 0.0 < float(getattr(self, name)) <= 1.0:
                bad(name, "in (0, 1]")
        if not 0.0 <= float(self.prior_acceptance) <= 1.0:
            bad("prior_acceptance", "in [0, 1]")
        for name in ("hysteresis", "hysteresis_sum", "min_gain"):
            if not float(getattr(self, name)) >= 0.0:
                bad(name, ">= 0")
        for name in ("probe_interval", "calibration_repeats", "acceptance_batch"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
                bad(name, "an int >= 1")
        if not isinstance(self.measure_neighbours, bool):
            bad("measure_neighbours", "a bool")
        budget = self.memory_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0):
            bad("memory_budget_bytes", "None or an int >= 0")


# ------------------------------------------------------------------------------ acceptance


def _rates_on(prior, size: int, device) -> torch.Tensor:
    """``prior`` (a float, or ``[size]`` rates on any device) as ``[size]`` fp32 on ``device``
    without a host sync (a fill, or a copy through pinned memory: a plain host-to-device copy
    waits for the device's queued work, e.g. a prefill)."""
    device = torch.device(device)
    if not isinstance(prior, torch.Tensor):
        return torch.full((size,), float(prior), device=device)
    prior = prior.to(torch.float32).reshape(-1)
    if prior.device.type == "cpu" and device.type == "cuda":  # (to the host: a plain, waiting copy)
        return prior.pin_memory().to(device, non_blocking=True).expand(size)
    return prior.to(device).expand(size)


class AcceptanceEstimator:
    """Per-row, per-draft-position acceptance, exponentially weighted, on the device.

    ``rates[r, i]`` (``[B, M]`` fp32, M = ``max_speculative_tokens``) estimates the probability
    that row r's draft ``i + 1`` is proposed and accepted given that drafts ``1 .. i`` were. After
    a step in which row r was asked for ``asked[r]`` drafts and accepted ``n[r]``:

    * positions ``i < n[r]`` observed 1 (accepted);
    * position ``i = n[r]``, if ``n[r] < asked[r]``, observed 0 (rejected, or not proposed: a
      drafter that proposes fewer drafts than asked gains nothing there);
    * an observed position moves to ``(1 - w) rates + w x``;
    * a position after the first rejection (censored) keeps its rate: censoring says nothing of
      a later draft's acceptance given the earlier ones were accepted, and drafters differ there:
      a retrieval drafter (n-gram) that finds a match keeps being accepted, so its later positions
      are accepted far more often than its first. Pulled towards the position before on every
      censored step, they followed the first position's rate instead (on the zoo model an H100
      run held E(4) at 1.08 tokens a step where fixed K = 4 commits 1.81, and stayed at K = 0);
    * every other position ``i >= 1`` (not asked) moves the same way towards the position before
      it after those updates (one position per step: the move does not cascade), the i.i.d.
      assumption of Leviathan et al. 2023: a position the steps do not reach follows the ones they
      do, down as well as up (moved only up, a position would follow the highest value the noisy
      one before it reached). Across calls, :meth:`overall` lets a position seldom observed follow
      the one before it too.

    With sampling the observation is the accept/reject outcome itself, whose mean is the
    acceptance probability ``sum_x min(p(x), q(x))`` of the draft and target distributions;
    computing that sum would cost a softmax over the vocabulary per position, so it is not used.

    Args:
        batch: B. max_drafts: M >= 1. prior: ``[M]`` (or a float) starting rates.
        weight: w in (0, 1]. device: where the rates live.
    """

    def __init__(self, batch: int, max_drafts: int, prior, weight: float, device):
        self.rates = _rates_on(prior, max_drafts, device)[None, :].expand(batch, max_drafts).clone()
        self.weight = float(weight)
        self._pos = torch.arange(max_drafts, device=device)[None, :]
        #: per position, over every update: drafts observed, and of them accepted (``[M]`` fp32)
        self.observed = torch.zeros(max_drafts, device=device)
        self.accepted = torch.zeros(max_drafts, device=device)

    def reset(self, prior) -> None:
        """Start again from ``prior`` (``[M]`` or a float): every row's rates and the counts, in place."""
        self.rates.copy_(_rates_on(prior, self.rates.shape[1], self.rates.device).expand(self.rates.shape))
        self.observed.zero_()
        self.accepted.zero_()

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` (indices) took new sequences: their rates start from the mean of every
        row's, per position (what the drafter showed lately), in place (device ops only)."""
        self.rates[rows] = self.rates.mean(0)

    def update(self, num_accepted: torch.Tensor, num_asked: torch.Tensor, active: torch.Tensor) -> None:
        """One step's observations: ``num_accepted [B]`` / ``num_asked [B]`` int64 (n <= asked),
        ``active [B]`` bool (rows that ran the step). No host sync."""
        j, w = self._pos, self.weight
        n, asked = num_accepted[:, None], num_asked[:, None]
        accepted = j < n
        observed = (accepted | ((j == n) & (n < asked))) & active[:, None]
        self.observed += observed.sum(0)
        self.accepted += (accepted & observed).sum(0)
        new = torch.where(observed, (1 - w) * self.rates + w * accepted.float(), self.rates)
        left = torch.cat([new[:, :1], new[:, :-1]], dim=1)
        drift = (j >= asked) & (j >= 1) & active[:, None]  # (not asked; a censored position keeps its rate)
        self.rates.copy_(torch.where(drift, (1 - w) * new + w * left, new))  # in place: a captured update reads it

    def overall(self, prior, strength: float = 4.0) -> torch.Tensor:
        """``[M]``: each position's acceptance over every observation so far (not the recent ones
        the rates weigh), pulled by ``strength`` pseudo-observations towards, for the first
        position, ``prior`` (a float, or ``[M]`` of which the first value counts), and for each
        later one the value this gives the position before it: a position seldom observed follows
        the one before it, the i.i.d. assumption of Leviathan et al. 2023 (where the prior would
        leave the drafts a call never reached at the prior, e.g. above a low acceptance). On the
        host (fp32 on the CPU): one read of the counts, a host sync, made where a decode loop ends
        (its device work is done), as ``M`` device ops would cost more host time there."""
        accepted, observed = torch.stack([self.accepted, self.observed]).tolist()
        towards = float(torch.as_tensor(prior, dtype=torch.float32).reshape(-1)[0])
        out = []
        for a, n in zip(accepted, observed):
            towards = (a + strength * towards) / (n + strength)
            out.append(towards)
        return torch.tensor(out, dtype=torch.float32)

    def expected_tokens(self, budget: torch.Tensor, active: torch.Tensor, until_last: bool = False) -> torch.Tensor:
        """``[M + 1]`` fp64: E(K) for K = 0..M, the tokens one step at K is expected to commit,
        summed over the ``active [B]`` rows; ``budget [B]`` int64: the drafts each row can still use;
        ``until_last``: per step until the slowest row ends, the rows' rates shrunk by this
        estimator's weight (:func:`expected_tokens`)."""
        return expected_tokens(self.rates, budget, active, until_last, self.weight)


#: why compiling or capturing the fused policy update failed in this process (None: it has not);
#: once set, :meth:`SpeculationPolicy._capture` captures the update unfused at once
_FUSED_UPDATE_FAILED: list[str | None] = [None]

#: the real steps at a width after which :meth:`MeasuredCosts.measured` holds: one step's time can
#: be far off its width's mean (a host hiccup, a fold), and a width it makes look slow is not
#: chosen again to correct it
MEASURED_STEPS = 4

#: a real step's time counts at most this many times the estimate it updates (for the first step
#: at a width, its prediction from the calibration) in :class:`MeasuredCosts`: one step held up by
#: the host (a garbage collection, another process) would otherwise move a width's mean far up, and
#: a width that looks slow is not run again to correct it (one such plain step kept a call
#: speculating at acceptance 0); a real rise of the costs is still followed, by at most
#: ``OUTLIER_RATIO - 1`` of the online weight a step
OUTLIER_RATIO = 1.25

#: the most steps a call runs at a width next to its K to measure that width's cost
#: (:meth:`SpeculationPolicy._neighbour_to_measure`): its first step in a call is not counted, the
#: next :data:`MEASURED_STEPS` are, and with the choice made before the sync the step after them is
#: chosen before they are in
MEASURING_STEPS = MEASURED_STEPS + 2

#: a run of plain steps (K = 0 after K = 0) feeds the costs its first step and then one step in this
#: many (:meth:`SpeculationPolicy._observe`): a plain step's time is steady, and reading a step's laps
#: and refitting the costs after it (which the next choice then recomputes) is host work that, on a
#: small model at batch 1, is a tenth of a step the host launches
PLAIN_STEPS_PER_OBSERVATION = 8

#: a drafter's catch-up per plain step (:meth:`CostModel.observe_catch_up`) is taken from a first
#: speculative step after at least this many plain ones: after fewer, what it took beyond its
#: proposal is mostly the proposal's own variation, divided by a small count
CATCH_UP_MIN_PLAIN_STEPS = 4

#: the most policy update graphs (shapes) an engine keeps (:class:`SpeculationPolicy`'s ``graphs``)
POLICY_GRAPHS_KEPT = 8


def step_measures(K: int, before: int, run_before: bool, catches_up: bool = False) -> str | None:
    """What a real step at K after one at ``before`` measures (``run_before``: K ran earlier in the
    call; ``catches_up``: the drafter keeps state of its own, which it first brings up to the
    text, :attr:`DrafterKey.sequential`): ``"width"``, the cost of width K; ``"target"``, only
    the target's part of it: the first speculative step after plain ones of a drafter that
    catches up (a draft model, MTP layers: its proposal first runs the text of every plain step,
    a cost of the switch that grows with the plain steps, not of the width); ``"leave"``, the
    first plain step after speculative ones, the switch's extra cost
    (:meth:`CostModel.observe_leave`); None, nothing: the first step at a K in a call (its
    first proposal, compiles) and a step narrower than the one before (it first folds the wider
    one's replay history: the switch's cost, not the width's)."""
    if not run_before or 0 < K < before:
        return None
    if K == 0:
        return "leave" if before > 0 else "width"
    return "target" if before == 0 and catches_up else "width"


def _per_k_means(per_step: list[list[float]]) -> list[float]:
    """Per K, the mean over the steps of ``per_step`` (one list per step, one value per K)."""
    return [sum(col) / len(per_step) for col in zip(*per_step)]


def _nobody():
    return None


class _KeptUpdate:
    """A captured :meth:`SpeculationPolicy.update` (``graph`` None: its capture failed) with the
    estimator and input / output tensors it reads and writes, ``holder``, a weak reference to
    the policy using it (or a function returning None while no policy does), the side stream it
    is replayed on, ``host``, the host copy of its output each replay makes (pinned memory on
    CUDA), and ``done``, the event recorded after its last replay and copy (None before any;
    off CUDA, as a test's stand-in for a graph, both stay None and a replay runs in order)."""

    __slots__ = ("estimator", "graph", "inputs", "output", "host", "holder", "stream", "done")

    def __init__(self, estimator, graph, inputs, output):
        self.estimator, self.graph, self.inputs, self.output = estimator, graph, inputs, output
        self.holder = _nobody
        dev = estimator.rates.device
        cuda = graph is not None and dev.type == "cuda"
        self.stream = torch.cuda.Stream(device=dev) if cuda else None
        self.host = (None if output is None else
                     torch.empty(output.shape, dtype=output.dtype, pin_memory=cuda))
        self.done: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Make the current stream wait for the last replay (its estimate, inputs and output)."""
        if self.done is not None:
            torch.cuda.current_stream(self.estimator.rates.device).wait_event(self.done)


@fusable
def _update(est: AcceptanceEstimator, until_last: bool, num_accepted, num_asked, ran, live, budget) -> torch.Tensor:
    """:meth:`SpeculationPolicy.update`'s device work (what its graph captures, compiled while
    fusing: :meth:`SpeculationPolicy._capture`): ``est`` observes
    the step, then E(K) of the next one (with ``until_last``: per step until the slowest row
    ends, then per step)."""
    est.update(num_accepted, num_asked, ran)
    if not until_last:
        return est.expected_tokens(budget, live)
    return torch.cat([est.expected_tokens(budget, live, True), est.expected_tokens(budget, live)])


def expected_tokens(rates: torch.Tensor, budget: torch.Tensor, active: torch.Tensor,
                    until_last: bool = False, noise_weight: float | None = None, copies: int = 1) -> torch.Tensor:
    """E(K) for K = 0..M (``[M + 1]`` fp64): ``sum_r active[r] (1 + sum_{j <= min(K, budget[r])}
    prod_{i <= j} rates[r, i])``, the expected tokens a step commits when every row is asked for
    K drafts (per-position rates ``[B, M]``, Leviathan et al. 2023, section 3.1).

    With ``until_last`` (a batch that ends with its slowest row, as ``generate()``'s does): the
    tokens the active rows have left, ``L = sum_r l_r`` with ``l_r = budget[r] + 1``, over the
    steps the batch is expected to need to commit them, ``L / E[max_r N_r(K)]``. Row r commits
    ``X`` tokens a step (mean ``mu_r``, variance ``v_r``); the steps it needs to reach ``l_r``
    are taken as normal, with the renewal mean ``(l_r + E[X (X - 1)] / (2 mu_r)) / mu_r`` (the
    last step's unused drafts included) and variance ``l_r v_r / mu_r^3``; the expected largest
    of these independent normals is integrated numerically over :data:`_MAX_GRID` points. At K = 0
    every row commits one token a step, so this is ``L / max_r l_r``. Speculation makes rows finish
    at different steps and the batch waits for the last one: the per-step E(K) does not see that
    loss, this does.

    ``noise_weight``: the weight w of the exponentially weighted rates; each row's rate at a
    position is shrunk towards the active rows' mean by the share of their spread that the
    estimate's own noise explains (an empirical-Bayes shrinkage: an average of Bernoulli
    observations with weight w varies by ``w / (2 - w) p (1 - p)`` about its mean p), since
    the largest of many noisy estimates would otherwise always find a row that looks slow. None:
    the rates are taken as exact.

    ``copies``: each row stands for that many identical rows (e.g. a batch that starts with every
    row at the same prior and budget: one row with ``copies=B`` gives the batch's E(K) exactly,
    for a ``B``-th of the work; identical rows have no spread to shrink)."""
    B, M = rates.shape
    K = torch.arange(M + 1, device=rates.device)[None, :]
    live = active[:, None].double()
    if not until_last:
        cols = torch.minimum(K, budget.clamp(min=0)[:, None])
        return ((1.0 + _reached(rates.double()).gather(1, cols)) * live).sum(0) * copies
    r = rates.double()
    if noise_weight is not None and B > 1:
        n = live.sum().clamp(min=1.0)
        mean = (r * live).sum(0, keepdim=True) / n
        spread = (((r - mean) ** 2) * live).sum(0, keepdim=True) / n
        noise = noise_weight / (2.0 - noise_weight) * mean * (1.0 - mean)
        share = (1.0 - noise / spread.clamp(min=1e-12)).clamp(0.0, 1.0)
        r = mean + share * (r - mean)
    reach = torch.cumprod(r, dim=1)  # P(drafts 1..j all accepted)
    zero = r.new_zeros(B, 1)
    mu = 1.0 + torch.cat([zero, torch.cumsum(reach, dim=1)], dim=1)  # E[X], X = 1 + accepted, K = 0..M
    odd = torch.arange(1, 2 * M, 2, device=r.device, dtype=torch.float64)[None, :]  # 2j - 1
    second = torch.cat([zero, torch.cumsum(reach * odd, dim=1)], dim=1)  # E[n^2], n accepted
    ex2 = 2.0 * mu - 1.0 + second  # E[X^2] = 1 + 2 E[n] + E[n^2]
    left = (budget.clamp(min=0) + 1).double()[:, None]
    mean_steps = torch.where(active[:, None], (left + (ex2 - mu) / (2.0 * mu)) / mu, 0.0)
    sd = torch.where(active[:, None], torch.sqrt((left * (ex2 - mu * mu).clamp(min=0.0)) / mu ** 3), 0.0)
    lo = (mean_steps - 6.0 * sd).amax(0)  # [M + 1]: below this the largest is certainly higher
    hi = (mean_steps + 6.0 * sd).amax(0)
    grid = torch.linspace(0.0, 1.0, _MAX_GRID, device=r.device, dtype=torch.float64)[:, None]
    t = lo + grid * (hi - lo)  # [G, M + 1]
    # P(max < t), [G, M + 1]: a row certain of its steps (sd 0: K = 0, a finished row at 0 steps)
    # is a step function, to fp64 precision through the tiny sd
    z = (t[:, None, :] - mean_steps[None]) / sd.clamp(min=1e-12)[None]  # [G, B, M + 1]
    cdf = torch.exp(torch.special.log_ndtr(z).sum(1) * copies)
    slowest = lo + torch.trapezoid(1.0 - cdf, dx=1.0, dim=0) * (hi - lo) / (_MAX_GRID - 1)
    return (left * live).sum() * copies / slowest.clamp(min=1.0)


#: grid points of the numerical integral of the largest row's steps in :func:`expected_tokens`
_MAX_GRID = 128


def _reached(rates: torch.Tensor) -> torch.Tensor:
    """``[B, M + 1]``: column j is the expected accepted drafts of a step asked for j,
    ``sum_{i <= j} prod_{l <= i} rates[:, l]``."""
    reach = torch.cumprod(rates, dim=1)
    return torch.cat([reach.new_zeros(rates.shape[0], 1), torch.cumsum(reach, dim=1)], dim=1)


# ------------------------------------------------------------------------------ costs


@dataclass(frozen=True)
class CostKey:
    """What a step time is measured for: the decode path (``"eager"``, ``"static"``,
    ``"cuda_graph"``), the rollback strategy's name and the batch size."""

    path: str
    strategy: str
    batch: int


class CostModel(abc.ABC):
    """Predicted seconds of one decode step of the whole batch at each K (a ``cost_model=`` of
    :func:`specdec.wrap` is one of these; :class:`MeasuredCosts` is the default)."""

    #: changes whenever anything the policy reads from the model (:meth:`step_times`,
    #: :meth:`step_s`, :meth:`leave_s`, :meth:`catch_up_s`) may answer otherwise, or None where
    #: that is not known (a model of one's own may change as it likes): while it stays the same,
    #: the policy keeps the step times and probe spacing of its last choice instead of asking again
    version: int | None = None

    @abc.abstractmethod
    def step_s(self, key: CostKey, drafter_key, K: int) -> float:
        """Seconds of one step at K (the drafter's proposal, the verify forward with acceptance,
        the commit and the step's bookkeeping) for ``key``; ``drafter_key`` names the drafter."""

    def step_times(self, key: CostKey, drafter_key, max_k: int) -> list[float]:
        """:meth:`step_s` at every K = 0..``max_k``."""
        return [self.step_s(key, drafter_key, K) for K in range(max_k + 1)]

    def comparable_step_s(self, key: CostKey, drafter_key, K: int) -> float:
        """Seconds of one step at K measured the same way for every ``key`` (what ``rollback="auto"``
        compares strategies by): :meth:`step_s` unless a model refines it online for the strategy
        that ran."""
        return self.step_s(key, drafter_key, K)

    def needs_widths(self, key: CostKey, widths) -> list[int]:
        """The step widths (T = K + 1) of ``widths`` that still have to be measured for ``key``."""
        return []

    def record_width(self, key: CostKey, T: int, verify_s: float, commit_s: float) -> None:
        """A measured verify forward and commit (seconds) of width ``T``."""

    def record_bytes(self, key: CostKey, nbytes: int, step_tokens: int) -> None:
        """The measured bytes of the strategy's rollback buffers for ``key`` on a decoder whose steps
        take up to ``step_tokens`` tokens (they grow with it: snapshot keeps a state per draft)."""

    def rollback_bytes(self, key: CostKey, step_tokens: int) -> int | None:
        """The recorded bytes of ``key``'s rollback buffers at ``step_tokens`` (None: not known)."""
        return None

    def calibrated_s(self, key: CostKey, K: int) -> float | None:
        """The measured verify + commit of width K + 1 for ``key`` (seconds; None: not measured)."""
        return None

    def measured(self, key: CostKey, K: int) -> bool:
        """Whether real steps at K refined :meth:`step_s` for ``key`` (a model that learns nothing
        from real steps: True, nothing is left to measure)."""
        return True

    def observe(self, key: CostKey, drafter_key, K: int, draft_s: float | None, target_s: float) -> None:
        """One real step at K: the drafter's seconds (at K = 0, the step's glue where a proposal
        would be made; None where they measure no proposal of K, see :func:`step_measures`) and
        the target's (verify + commit + bookkeeping)."""

    def observe_leave(self, key: CostKey, extra_s: float) -> None:
        """The first plain step (K = 0) after speculative ones took ``extra_s`` seconds more than
        a plain step was predicted to (:meth:`step_s` at K = 0 when it was chosen): the strategy's flush into its
        plain state (:meth:`specdec.rollback.RollbackStrategy.flush`; replay folds its history)."""

    def leave_s(self, key: CostKey) -> float:
        """Seconds a switch from speculation to plain steps costs once (see :meth:`observe_leave`)."""
        return 0.0

    def observe_catch_up(self, key: CostKey, drafter_key, K: int, draft_s: float, plain_steps: int) -> None:
        """The first speculative step (at K) after ``plain_steps`` plain ones of a drafter that
        catches up (:attr:`DrafterKey.sequential`: a draft model, MTP layers): its proposal took
        ``draft_s`` seconds, a proposal at K after first running the plain steps' text."""

    def draft_measured(self, drafter_key, key: CostKey) -> bool:
        """Whether a real step measured ``drafter_key``'s proposal alone, at any K, for ``key``'s
        decode path and batch (a model that learns nothing from real steps: True, nothing is left
        to measure)."""
        return True

    def catch_up_s(self, key: CostKey, drafter_key) -> float:
        """Seconds a drafter that catches up adds, per plain step since its last proposal, to
        the next one (see :meth:`observe_catch_up`)."""
        return 0.0


class DrafterKey:
    """Names one drafter's proposal times in a :class:`CostModel` (the engine makes a new one for
    each drafter it is given: never reused), with ``sequential``, the drafter's
    :attr:`~specdec.drafters.Drafter.drafts_sequentially`: whether its proposal time grows with K."""

    __slots__ = ("sequential",)

    def __init__(self, sequential: bool):
        self.sequential = bool(sequential)


class MeasuredCosts(CostModel):
    """Step costs measured on the device: the verify forward and the commit of each width (from
    :func:`calibrate`), refined online by real steps.

    ``step_s(K) = draft(K) + target(K)``, where

    * ``target(K)``: the mean of the target's time in real steps at K (every online mean here is
      the plain mean of its first ``1 / weight`` values, then exponentially weighted with
      ``weight``) (verify + acceptance + commit + bookkeeping); before any real step at K, the
      calibrated verify + commit of width K + 1 plus, for K > 0, the gap between real steps and
      their calibration at K: the acceptance and bookkeeping, which the calibration does not
      run, and for replay the verify's replay of the tokens the last step committed (the
      calibration commits none), which grows with K, slowly (on the H200 at the bench shapes,
      0.01–0.05 ms per draft); measured per K run (weighted mean) and, for a K not yet run, on
      the straight line between the measured K around it, else the nearest measured K's, where
      plain steps (K = 0) count as measured below the smallest K > 0 run (their gap without the
      step's glue, which a K > 0 counts in ``draft(K)``), and with no K > 0 run every K takes the
      plain steps' gap. Where nothing was measured the estimate leans fast: a width predicted
      too fast runs and its first real steps correct it, one predicted too slow never runs and
      is never corrected (a line fitted through two neighbouring K and carried to K = 8 made
      wide drafts look far slower than the same run's fixed cells measured them; a gap measured only at long drafts made a
      never-run K = 1 look slower than plain decoding). A plain step (K = 0: nothing proposed,
      accepted or observed) not yet run is its bare calibration, as a speculative gap would
      make it look up to 7% slower than it is;
    * ``draft(K)``: the weighted mean of the proposal's time in real steps at K; for a K not yet
      run, for a drafter that drafts sequentially (:attr:`DrafterKey.sequential`) a
      least-squares line through the measured K (one measured K: proportional to K), for any
      other the mean of the measured K (its time does not grow with K); 0 before any
      measurement and at K = 0;
    * the switch from speculation to plain steps (:meth:`leave_s`): the weighted mean of the
      extra seconds of the first plain step after speculative ones (:meth:`observe_leave`), which
      is not counted in ``target(0)``: with replay that step first folds the input history into
      the state (at Nemotron-H 4B shape, batch 64, about one more state read and write), and
      counted there, each probe would make plain decoding look slower for the steps after it;
    * a drafter's catch-up (:meth:`catch_up_s`, a drafter that catches up only): the weighted
      mean, per plain step before it, of what the first proposal after plain steps took beyond
      ``draft(K)`` (:meth:`observe_catch_up`): it first ran the plain steps' text.

    A real step's target time counts at most :data:`OUTLIER_RATIO` times the estimate it updates
    (the first at a width: its calibrated prediction), and a proposal's time at most that many
    times its K's mean (its first at a K as it is), so one step held up by the host moves an
    estimate by a bounded amount.

    Args:
        weight: the online averages' weight of a new step once they hold 1 / weight steps, in (0, 1].
    """

    def __init__(self, weight: float = 0.2):
        self.weight = float(weight)
        self._widths: dict[tuple, tuple[float, float]] = {}  # (key, T) -> (verify_s, commit_s)
        self._target: dict[tuple, float] = {}  # (key, K) -> seconds
        self._gap: dict[CostKey, dict[int, float]] = {}  # key -> {K: mean (real - calibrated) seconds}
        self._draft: dict[tuple, dict[int, float]] = {}  # (drafter_key, path, batch) -> {K: seconds}
        self._bytes: dict[tuple, int] = {}  # (key, step tokens of the decoder) -> bytes
        self._leave: dict[CostKey, float] = {}  # key -> seconds of a switch to plain steps
        self._catch_up: dict[tuple, float] = {}  # (drafter_key, path, batch) -> seconds per plain step caught up
        self._n: dict[tuple, int] = {}  # (what, key..., K) -> values each online mean has taken in
        self.version = 0  # (CostModel.version: one more at every value taken in)

    def needs_widths(self, key, widths):
        return [T for T in widths if (key, T) not in self._widths]

    def record_width(self, key, T, verify_s, commit_s):
        self._widths[key, T] = (float(verify_s), float(commit_s))
        self.version += 1

    def record_bytes(self, key, nbytes, step_tokens):
        # the largest seen: a calibration of the plain width alone leaves replay's history unallocated
        self._bytes[key, step_tokens] = max(int(nbytes), self._bytes.get((key, step_tokens), 0))

    def rollback_bytes(self, key, step_tokens):
        return self._bytes.get((key, step_tokens))

    def _ewma(self, table: dict, k, x: float, name: tuple) -> None:
        """``table[k]`` takes in ``x``: the plain mean of the values so far while there are fewer
        than ``1 / weight`` of them, the weighted mean after (a first step far off its width's mean
        would otherwise weigh 1 - weight on the next); ``name``: the value's count's key."""
        n = self._n[name] = self._n.get(name, 0) + 1
        old = table.get(k)
        w = max(self.weight, 1.0 / n)
        table[k] = x if old is None else (1 - w) * old + w * x
        self.version += 1  # (after the value: a reader that sees the new version reads the new value)

    def observe(self, key, drafter_key, K, draft_s, target_s):
        # each part capped against its own estimate (OUTLIER_RATIO): the target's time against its
        # mean (the first at a K: its calibrated prediction), a proposal's (K > 0) or a plain step's
        # glue (K = 0) against theirs (their first as it is). K = 0: the whole step is the plain
        # step's time; its gap, without the glue that a K > 0 counts in draft(K), is where a
        # never-run K > 0's gap starts from
        calib = self._widths.get((key, K + 1))
        gaps = self._gap.setdefault(key, {})
        if K == 0:
            whole = self._target.get((key, 0))
            calibrated = None if calib is None else sum(calib)
            part = calibrated + gaps[0] if calibrated is not None and 0 in gaps else None  # (the target part's mean)
            target_s = _capped(target_s, calibrated if part is None else part)
            glue = _capped(draft_s, None if whole is None or part is None else whole - part)
            self._ewma(self._target, (key, 0), target_s + glue, ("target", key, 0))
        else:
            before = self._target.get((key, K))
            if before is None and calib is not None:  # (the first step at K: its calibrated prediction)
                before = self.target_s(key, K)
            target_s = _capped(target_s, before)
            self._ewma(self._target, (key, K), target_s, ("target", key, K))
            if draft_s is not None:
                where = (drafter_key, key.path, key.batch)  # (a proposal's first time at a K as it is: a
                seen = self._draft.setdefault(where, {})    # sequential drafter's grows with K)
                self._ewma(seen, K, _capped(draft_s, seen.get(K)), ("draft", *where, K))
        if calib is not None:
            self._ewma(gaps, K, target_s - sum(calib), ("gap", key, K))

    def observe_leave(self, key, extra_s):
        self._ewma(self._leave, key, max(0.0, float(extra_s)), ("leave", key))

    def leave_s(self, key):
        return self._leave.get(key, 0.0)

    def observe_catch_up(self, key, drafter_key, K, draft_s, plain_steps):
        # per plain step, what the proposal took beyond draft(K); taken in only once a proposal was
        # measured alone (before, its own time would count as catch-up), capped as the others
        if not self.draft_measured(drafter_key, key):
            return
        where = (drafter_key, key.path, key.batch)
        per_step = max(0.0, float(draft_s) - self.draft_s(drafter_key, key, K)) / max(1, int(plain_steps))
        self._ewma(self._catch_up, where, _capped(per_step, self._catch_up.get(where)), ("catch_up", *where))

    def draft_measured(self, drafter_key, key):
        return bool(self._draft.get((drafter_key, key.path, key.batch)))

    def catch_up_s(self, key, drafter_key):
        return self._catch_up.get((drafter_key, key.path, key.batch), 0.0)

    def measured(self, key, K):
        return self._n.get(("target", key, K), 0) >= MEASURED_STEPS

    def calibrated_s(self, key: CostKey, K: int) -> float | None:
        """The calibrated verify + commit of width K + 1 (seconds), or None."""
        calib = self._widths.get((key, K + 1))
        return None if calib is None else sum(calib)

    def target_s(self, key: CostKey, K: int, gap: Callable[[int], float] | None = None) -> float:
        """``target(K)`` (see the class docstring); ``gap``: :meth:`_gap_fit` of ``key`` when the
        caller fitted it already. Raises KeyError when K was neither run nor calibrated."""
        real = self._target.get((key, K))
        if real is not None:
            return real
        calib = self.calibrated_s(key, K)
        if calib is None:
            raise KeyError(f"no measurement of step width {K + 1} for {key}: calibrate() it first")
        if K == 0:
            return calib
        return calib + (gap or self._gap_fit(key))(K)

    def _gap_fit(self, key: CostKey) -> Callable[[int], float]:
        """The real-minus-calibrated gap at each K > 0 (see the class docstring)."""
        gaps = self._gap.get(key, {})
        if not any(gaps):  # no K > 0 run: the plain steps' gap, if they ran
            plain = gaps.get(0, 0.0)
            return lambda K: plain
        ks = sorted(gaps)  # (K = 0, where it ran, anchors the way below the smallest K > 0)
        return lambda K: _between(ks, gaps, K)

    def _draft_fit(self, drafter_key, key: CostKey) -> Callable[[int], float]:
        """``draft(K)`` at each K (see the class docstring)."""
        seen = self._draft.get((drafter_key, key.path, key.batch))
        if not seen:
            return lambda K: 0.0
        if not getattr(drafter_key, "sequential", True):  # its time does not grow with K: the mean of all
            mean = sum(seen.values()) / len(seen)
            return lambda K: seen.get(K, mean) if K else 0.0
        line = _line(seen)
        return lambda K: max(0.0, line(K)) if K else 0.0

    def draft_s(self, drafter_key, key: CostKey, K: int) -> float:
        """``draft(K)`` (see the class docstring)."""
        return self._draft_fit(drafter_key, key)(K)

    def step_s(self, key, drafter_key, K):
        return self.draft_s(drafter_key, key, K) + self.target_s(key, K)

    def step_times(self, key, drafter_key, max_k):
        # each line fitted once for all K (the policy asks every step, between its sync and the next launch)
        draft, gap = self._draft_fit(drafter_key, key), self._gap_fit(key)
        return [draft(K) + self.target_s(key, K, gap) for K in range(max_k + 1)]

    def comparable_step_s(self, key, drafter_key, K):
        """``draft(K)`` plus the calibrated verify + commit of width K + 1, without the online
        refinements: only the strategy that ran has them (they add its acceptance, bookkeeping and
        host gaps), so comparing them with another's calibration would favour the one not run."""
        calib = self.calibrated_s(key, K)
        return self.step_s(key, drafter_key, K) if calib is None else self.draft_s(drafter_key, key, K) + calib


def _capped(x: float, estimate: float | None) -> float:
    """``x`` at most :data:`OUTLIER_RATIO` times ``estimate`` (None or <= 0: as it is)."""
    return x if estimate is None or estimate <= 0.0 else min(x, OUTLIER_RATIO * estimate)


def _between(ks: list[int], seen: dict[int, float], K: int) -> float:
    """The value at K of measurements ``seen`` at the sorted ``ks`` (not empty): measured, on the
    straight line between the two measured K around it, else the nearest measured one's."""
    i = bisect.bisect_left(ks, K)
    if i == len(ks) or ks[i] == K or i == 0:
        return seen[ks[min(i, len(ks) - 1)]]
    lo, hi = ks[i - 1], ks[i]
    return seen[lo] + (seen[hi] - seen[lo]) * (K - lo) / (hi - lo)


def _line(seen: dict[int, float]) -> Callable[[int], float]:
    """The values at every K of measurements ``seen`` ({K: value}, not empty), as a function of K:
    the measured one, else a least-squares line through them; from one measured K, in
    proportion to K. Fitted once, read at any K."""
    if len(seen) == 1:
        (k1, v1), = seen.items()
        at = lambda K: v1 * K / k1  # noqa: E731
    else:
        ks, vs = list(seen), list(seen.values())
        mk, mv = sum(ks) / len(ks), sum(vs) / len(vs)
        slope = sum((k - mk) * (v - mv) for k, v in zip(ks, vs)) / sum((k - mk) ** 2 for k in ks)
        at = lambda K: mv + slope * (K - mk)  # noqa: E731
    return lambda K: seen[K] if K in seen else at(K)


class FixedCosts(CostModel):
    """Given step times instead of measured ones: ``step_s(strategy, batch, K)`` -> seconds of one
    step of the whole batch at K (every K in ``[0, max_speculative_tokens]``). Nothing is measured
    and nothing observed changes them (for tests, or costs measured elsewhere); the function is
    asked again at every choice (:attr:`CostModel.version` None), so it may change over time.

    Raises (when asked): ValueError if the function returns a time that is not > 0."""

    def __init__(self, step_s: Callable[[str, int, int], float]):
        self._fn = step_s

    def step_s(self, key, drafter_key, K):
        got = self._fn(key.strategy, key.batch, K)
        try:
            t = float(got)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"FixedCosts: step time at K={K} for {key} must be a finite number > 0 (seconds), got "
                             f"{type(got).__name__} {got!r}") from None
        if not t > 0 or math.isinf(t):
            raise ValueError(f"FixedCosts: step time at K={K} for {key} must be a finite number > 0, got {t!r}")
        return t


_COSTS: dict[tuple, MeasuredCosts] = {}


def costs_for(model, device, dtype, weight: float = 0.2) -> MeasuredCosts:
    """The measured costs of ``model`` on ``device`` in ``dtype``, shared by every generator of that
    model (kept while the model lives)."""
    key = (id(model), str(torch.device(device)), dtype)
    costs = _COSTS.get(key)
    if costs is None:
        costs = _COSTS[key] = MeasuredCosts(weight)
        weakref.finalize(model, _COSTS.pop, key, None)
    return costs


def rollback_bytes(cache, device=None) -> int:
    """Bytes of every SSM layer's rollback store in ``cache`` (a :class:`~specdec.cache.HybridCache`):
    the live or checkpoint state and whatever the strategy keeps to roll back; with ``device``,
    only the tensors on it."""
    dev = None if device is None else torch.device(device)

    def size(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size() if dev is None or x.device == dev else 0
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        return 0

    return sum(size(layer.store.tensors) for layer in cache.ssm.values())


@torch.no_grad()
def calibrate(decoder, widths, repeats: int) -> dict[int, tuple[float, float]]:
    """Time the verify forward and the commit of every step width in ``widths`` on ``decoder``
    (prefilled): per width one untimed run (compiles its kernels; on the CUDA-graph path it
    captures the width's graphs), then ``repeats`` timed runs of a forward of ``T`` placeholder
    tokens followed by a commit of zero tokens, which leaves the committed state as it was (a
    tree decoder: its tree's ``T`` nodes, and a commit of no path). A chain step of one token is
    timed as the plain step K = 0 runs (:meth:`Decoder.forward`'s ``plain``), inside
    :meth:`HybridCache.plain_state_kept <specdec.cache.HybridCache.plain_state_kept>`, which
    writes the state it updated in place back afterwards.

    Returns ``{T: (verify seconds, commit seconds)}``, each the fastest of the timed runs (other
    work on the device or host only adds time; the online refinement then adds what real steps
    cost beyond the calibration)."""
    B, dev, tree = decoder.batch, decoder.cache.device, decoder.tree
    zeros = torch.zeros(B, dtype=torch.long, device=dev)
    path = None if tree is None else torch.zeros(B, tree.max_depth + 1, dtype=torch.long, device=dev)
    clock = StepClock(dev)
    for T in widths:
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        plain = decoder.runs_plain(T, True)
        with decoder.cache.plain_state_kept() if plain else contextlib.nullcontext():
            for rep in range(repeats + 1):
                clock.lap(None)
                decoder.forward(tokens, plain=plain)
                clock.lap(("verify", T, rep))
                decoder.commit(zeros, path)
                clock.lap(("commit", T, rep))
    clock.totals()  # waits for the device
    spans = {phase: s for phase, s in clock.laps() if phase is not None}
    return {T: (min(spans["verify", T, r] for r in range(1, repeats + 1)),
                min(spans["commit", T, r] for r in range(1, repeats + 1))) for T in widths}


# ------------------------------------------------------------------------------ choices


def speculation_gain(expected: list[float], step_s: list[float]) -> float:
    """The predicted goodput of the best K > 0 over that of K = 0: ``max_{K > 0} (expected[K] /
    step_s[K]) / (expected[0] / step_s[0])`` (1.0 when there is no K > 0, or when K = 0 is expected
    to commit nothing: no live rows). From plain steps (or none) :func:`choose_k` starts speculating
    when it exceeds ``1 + max(min_gain, hysteresis)`` (no current K: ``1 + min_gain``), or ``1 +
    min_gain`` for long enough (``hysteresis_sum``); speculating, it stops when K = 0's goodput
    beats the current K's (which may be below the best K's) by more than ``hysteresis``, or by
    less for long enough. Args as :func:`choose_k`."""
    rate = [e / t for e, t in zip(expected, step_s)]
    return max(rate[1:], default=rate[0]) / rate[0] if rate[0] > 0 else 1.0


def choose_k(expected: list[float], step_s: list[float], current: int | None, hysteresis: float,
             min_gain: float = 0.0) -> int:
    """The K of the next step: ``argmax_K expected[K] / step_s[K]`` (the smallest K on a tie),
    unless ``current`` is within ``hysteresis`` of it (``best <= (1 + hysteresis) * rate(current)``).
    Speculation starts (a K > 0 after K = 0 or at the first step) only when its rate beats K = 0's
    by more than ``min_gain`` (``rate(K) > (1 + min_gain) * rate(0)``); a speculating ``current``
    is left for K = 0 as for any other K, when K = 0's rate beats it by more than ``hysteresis``:
    the band keeps an acceptance estimate near the threshold from switching speculation on and
    off, and a dip of the estimate from stopping it (at K = 0 nothing is observed but the
    probes, so a stop on a dip would stand). Where every K commits 0 tokens (no live row: a
    pool about to refill) ``current`` stands (0 when None).

    Args: expected, step_s: per K = 0..M, tokens a step commits and its seconds (> 0).
        current: the K of the last step, or None. hysteresis, min_gain: fractions (>= 0)."""
    rate = [e / t for e, t in zip(expected, step_s)]
    speculating = current is not None and 0 < current < len(rate)
    if not any(rate):  # no live row (a pool refilled after they all ended): nothing to choose by
        return current if current is not None and current < len(rate) else 0

    def worth(K: int) -> bool:  # (the start margin; a speculating K moves by the hysteresis alone)
        return K == 0 or speculating or rate[K] > (1.0 + min_gain) * rate[0]

    best = max(range(len(rate)), key=lambda K: (rate[K], -K))
    if not worth(best):
        best = 0
    if (current is not None and current < len(rate) and worth(current)
            and rate[best] <= (1.0 + hysteresis) * rate[current]):
        return current
    return best


@dataclass(frozen=True)
class StrategyChoice:
    """``rollback="auto"``'s choice: the strategy ``name``, the K it was compared at, and ``reason``:
    every candidate's predicted tokens/s (or step time) and why any was left out."""

    name: str
    K: int
    reason: str


def choose_strategy(step_s: dict[str, dict[int, float]], expected: list[float], fixed_k: int | None,
                    nbytes: dict[str, int | None], budget: int | None,
                    left_out: dict[str, str] | None = None) -> StrategyChoice:
    """The strategy with the lowest predicted step time at ``fixed_k``, or (``fixed_k`` None: the
    policy chooses K) the best predicted goodput ``max_K expected[K] / step_s[K]``, among those
    whose rollback buffers (``nbytes``, bytes) fit ``budget`` (None: no limit).

    Args:
        step_s: ``{strategy: {K: seconds of one step}}`` (with ``fixed_k``: at least that K).
        expected: tokens a step commits per K = 0..M (the acceptance known when the call starts).
        left_out: ``{strategy: why}`` for those left out before comparing (e.g. out of memory
            while measuring); named in the reason.

    Raises: ValueError when no strategy remains."""
    notes = [f"{name} left out: {why}" for name, why in (left_out or {}).items()]
    rates = {}
    for name, times in step_s.items():
        size = nbytes.get(name)
        if budget is not None and size is not None and size > budget:
            from .batching import format_bytes  # (batching imports this module)

            notes.append(f"{name} left out: its rollback buffers take {format_bytes(size)}, over the budget of "
                         f"{format_bytes(budget)}")
            continue
        ks = [fixed_k] if fixed_k is not None else sorted(times)
        K = max(ks, key=lambda k: (expected[k] / times[k], -k))
        rates[name] = (expected[K] / times[K], K, times[K])
    if not rates:
        raise ValueError("rollback='auto': no rollback strategy could be measured within the memory budget ("
                         + "; ".join(notes) + ")")
    ranked = sorted(rates.items(), key=lambda x: -x[1][0])
    name, (_, K, _) = ranked[0]
    if fixed_k is not None:
        what = ", ".join(f"{n} {1e3 * t:.3f} ms" for n, (_, _, t) in ranked)
        reason = f"{name}: the lowest measured step time at K={K} ({what})"
    else:
        what = ", ".join(f"{n} {r:.1f} tokens/s at K={k}" for n, (r, k, _) in ranked)
        reason = f"{name}: the best predicted goodput ({what})"
    return StrategyChoice(name, K, "; ".join([reason] + notes))


def strategy_label(strategy) -> str:
    """The name a strategy's costs are kept under: its ``name``, ``"replay_deferred"`` for
    deferred replay (which shares replay's name)."""
    return "replay_deferred" if isinstance(strategy, ReplayRollback) and strategy.deferred else strategy.name


class SpeculationPolicy:
    """The K of each step of one ``generate()`` call (see the module docstring).

    Per step the engine calls :meth:`next_k` (host: the K to ask the drafter for), then, on the
    device, :meth:`update` with what the step accepted (returns E(K) for the next step, read at
    the step's one host sync, or None when nothing changed), then :meth:`after_step` with those
    values, the live rows and the step clock. With a kept update graph (:attr:`reads_ahead`)
    the values :meth:`update` returns are already on the host (the last replay's), and the
    engine calls :meth:`before_sync` with them before the step's blocking sync, which chooses
    the next K while the device still runs the step, and :meth:`after_sync` with the live rows
    after it: the policy's host work leaves the gap between a step's sync and the next launch.

    Args:
        settings: :class:`PolicySettings`. costs: the :class:`CostModel`. key: the call's
            :class:`CostKey`. drafter_key: names the drafter in ``costs``.
        max_speculative_tokens: M. batch: B. max_new_tokens: each row's budget.
        prior: ``[M]`` starting acceptance rates, or a float (a tensor on the host keeps making
            the policy free of host syncs). device: the decode loop's device.
        until_last: the call ends when its slowest row does (a fixed batch, as ``generate()``'s;
            not continuous batching, whose rows are refilled): E(K) counts the steps until then
            (:func:`expected_tokens`).
        graphs: a dict in which to keep :meth:`update` as CUDA graphs (the CUDA-graph decode
            path; None: eager). The first policy of a shape (batch, M, ``until_last``, weight)
            captures it when it is made, before the decode loop (:func:`specdec.graphs.capture`,
            after a warm-up run on a scratch estimator), and every :meth:`update` of it and of
            later policies of the shape replays it: a step launches a handful of kernels for it
            instead of about 140 small ones (with ``until_last``). A later policy takes the
            captured estimator's tensors and resets them to its prior, unless a policy not yet
            closed (:meth:`close`: a decode loop running alongside) holds them; it then updates
            eagerly. A failed capture warns once per shape and updates eagerly. At most
            :data:`POLICY_GRAPHS_KEPT` shapes are kept (the least recently made go first).
            The graph is replayed on a side stream, so its work (some 100 small kernels: a few
            tenths of a millisecond of device time) runs beside the next step's forward instead
            of before the step's sync, and copies its values to the host; they are read at
            the next step, one step late (:meth:`update`), before its sync (:meth:`before_sync`).
        prior_from_last_call: ``prior`` is what the drafter showed over an earlier call: a call
            that starts at K = 0 probes at its first step (see the module docstring).
    """

    def __init__(self, settings: PolicySettings, costs: CostModel, key: CostKey, drafter_key,
                 max_speculative_tokens: int, batch: int, max_new_tokens: int, prior, device,
                 until_last: bool = False, graphs: dict | None = None, prior_from_last_call: bool = False):
        self.settings = settings
        self._graph: _KeptUpdate | None = None  # the captured update() this policy replays
        self.until_last = until_last
        self.prior = prior  #: where the rows' acceptance started
        self.costs = costs
        self.key = key
        self.drafter_key = drafter_key
        self.max_k = max_speculative_tokens
        weight = settings.acceptance_weight_for(batch)
        self.min_gain = settings.min_gain_for(batch)  #: the start margin at this batch (``PolicySettings.min_gain``)
        self._graph_key = (batch, max_speculative_tokens, until_last, weight, str(torch.device(device)))
        # (CUDA) the decode loop's stream, which a side-stream update waits for: fetched once (each
        # torch.cuda.current_stream() call costs microseconds of host time)
        self._stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None
        self._held: _KeptUpdate | None = None  # the kept graph this policy holds
        kept = None if graphs is None else graphs.pop(self._graph_key, None)
        if graphs is not None:
            if kept is None:  # (a shape seen last goes last: the oldest are dropped first)
                kept = self._capture(AcceptanceEstimator(batch, max_speculative_tokens, prior, weight, device))
            graphs[self._graph_key] = kept
            while len(graphs) > POLICY_GRAPHS_KEPT:  # (a replay of a policy dropped without close() may still run)
                graphs.pop(next(iter(graphs))).wait()
        if kept is None or kept.graph is None or kept.holder() is not None:
            self.acceptance = AcceptanceEstimator(batch, max_speculative_tokens, prior, weight, device)
        else:  # the captured graph reads and writes that estimator's tensors
            self.acceptance, self._graph, self._held = kept.estimator, kept, kept
            kept.holder = weakref.ref(self)
            kept.wait()  # (a policy dropped without close() may have left a replay running)
            self.acceptance.reset(prior)
        # every row starts at the prior with the same budget: E(K) computed on the host (the
        # estimator's function on CPU tensors), so that making the policy leaves the prefill running
        # (one row standing for the batch's identical ones: at batch 256 the batch's would take ~10 ms)
        rates = _rates_on(prior, max_speculative_tokens, "cpu")[None, :]
        one, budget = torch.ones(1, dtype=torch.bool), torch.full((1,), max(0, max_new_tokens - 1), dtype=torch.long)
        #: E(K), K = 0..M, the next choice maximises against the step times (with ``until_last``: per
        #: step until the slowest row ends); and the tokens one step at K is expected to commit
        self.expected = expected_tokens(rates, budget, one, until_last, weight, copies=batch).tolist()
        self.step_expected = expected_tokens(rates, budget, one, False, weight, copies=batch).tolist()
        self.current: int | None = None  # the K the policy settled on (a probe does not change it)
        # plain steps since the last probe (-1: the call's first step at K = 0 probes, where the prior is
        # another call's; module docstring)
        self.steps_at_zero = -1 if prior_from_last_call else 0
        #: (the K the hysteresis held ``current`` from, its predicted gains over ``current`` summed
        #: over the consecutive steps it did so), or None (see ``hysteresis_sum``)
        self.held: tuple[int, float] | None = None
        #: the K of every step, in order
        self.k_per_step: list[int] = []
        self._predicted_tokens = self._added_tokens = 0.0
        self._live: int | None = None  # live rows after the last step (read at its sync)
        self._live_estimated: int | None = None  # ... when the values held were computed
        self._pending = False  # a side-stream update ran whose values were not read yet
        self._launched_at = 0  # ... at the step of this many (len(k_per_step) then)
        self._late = False  # the values read last came more than one step after their replay's launch
        self._seen: set[int] = set()  # K values run in this call (the first step at each is a warm-up)
        self._measuring: dict[int, int] = {}  # K -> steps run at it in this call to measure a neighbour
        # (K, first mark, last mark, K before, predicted plain seconds, unmeasured) of the step whose laps
        # are pending
        self._last: tuple | None = None
        self._warming = False  # the step next_k gave last ran a program's warm-up or capture (unmeasured)
        self._ahead: tuple | None = None  # the next step's choice, made by before_sync (see _decide)
        #: per step, the predicted goodput of the best K > 0 over plain decoding's (K = 0) when its K
        #: was chosen (:func:`speculation_gain`: where speculation starts and stops)
        self.gain_per_step: list[float] = []
        self._predicted: list[list[float]] = []  # per step, the seconds of a step at each K when its K was chosen
        self._expected_seen: list[list[float]] = []  # per step, the E(K) its K was chosen by
        self._measured: dict[int, list[float]] = {}  # K -> [seconds, steps] of this call's steps the costs took
        self._plain_run = 0  # plain steps after plain ones since the last speculative step (_observe)
        self._probe_again: int | None = None  # the K of a probe's second step, where it takes one (_decide)
        self._values_seen = 0  # values received (receive): a new choice's inputs
        # (what the last choice rested on, (the K settled on, held, times, gain, probe K, probe spacing)):
        # kept while the values, the costs' version, the K settled on, the held gains and the live rows stay
        self._choice: tuple | None = None
        #: the decode loop observes the acceptance at plain steps (shadow proposals of a stateless
        #: drafter): no probes from K = 0 then
        self.shadowed = False

    def step_times(self) -> list[float]:
        """Predicted seconds of one step at each K = 0..M."""
        return self.costs.step_times(self.key, self.drafter_key, self.max_k)

    def next_k(self) -> int:
        """The K of the next step (host side; no device work): the one :meth:`before_sync` chose
        ahead, or chosen now."""
        (K, self.current, self.steps_at_zero, self.held, times, gain), self._ahead = self._ahead or self._decide(), None
        self.k_per_step.append(K)
        self.gain_per_step.append(gain)
        self._predicted.append(times)
        self._expected_seen.append(self.expected)
        self._added_tokens = self.step_expected[K]
        self._predicted_tokens += self._added_tokens
        self._warming = False
        if self.current and K != self.current:  # (a probe from K = 0 is not a neighbour's)
            self._measuring[K] = self._measuring.get(K, 0) + 1
        again, self._probe_again = self._probe_again, None
        if (again is None and K and self.current == 0 and getattr(self.drafter_key, "sequential", True)
                and not self.costs.draft_measured(self.drafter_key, self.key)):
            self._probe_again = K  # (a drafter that catches up: see _decide)
        return K

    def unmeasured(self) -> None:
        """The step :meth:`next_k` gave last captured a graph or warmed up a program
        (:func:`specdec.graphs.warmups_run`): its laps feed no cost (as a K's first step in a
        call does not), since the capture's syncs, not the width, would set its time. (Counted,
        a capture in the first measured plain step, e.g. of the step programs at K = 0, makes
        plain decoding look slower than it is, and a K that looks slow is not run again to
        correct it: on a CPU, with the capture simulated as twice a step's time, the policy
        then ran K = 1 at an acceptance of 0.01 in every later call.)"""
        self._warming = True

    def drop_last_step(self) -> None:
        """Forget the step :meth:`next_k` gave last: the decode loop launched it after the call's
        last step and dropped it (its K, gain, predicted times and E(K) leave this call's records;
        the choice state it moved is the call's end's, which nothing reads)."""
        self.k_per_step.pop()
        self.gain_per_step.pop()
        self._predicted.pop()
        self._expected_seen.pop()
        self._predicted_tokens -= self._added_tokens

    @property
    def upcoming_k(self) -> int | None:
        """The K :meth:`next_k` will return, where :meth:`before_sync` chose it (None before
        that): the decode loop proposes for it before the step's sync."""
        return None if self._ahead is None else self._ahead[0]

    def _decide(self) -> tuple[int, int, int, tuple[int, float] | None, list[float], float]:
        """(K of the next step, the K settled on, plain steps since the last probe, the K the hysteresis holds
        it from with the summed gains (:attr:`held`), the step times, the :func:`speculation_gain`
        they give) from the values and costs held now; changes nothing but the kept choice
        (:meth:`next_k` takes it). With a kept graph it runs before the step's sync.

        While the values, the costs (:attr:`CostModel.version`), the K settled on, the held gains and
        the live rows are those of the last choice (a run of plain steps between the costs'
        observations, :data:`PLAIN_STEPS_PER_OBSERVATION`), its times and probe spacing are kept:
        only the count of plain steps since the last probe moves."""
        settings, version = self.settings, self.costs.version
        # (the values by identity too: every list of them is kept in _expected_seen, so no id is reused)
        sig = (self._values_seen, id(self.expected), version, self.current, self.held, self._live)
        if version is not None and self._choice is not None and self._choice[0] == sig:
            current, held, times, gain, probe, every = self._choice[1]
        else:
            times, expected = self.step_times(), self.expected
            current = choose_k(expected, times, self.current, settings.hysteresis, self.min_gain)
            held, last = None, self.current
            if current == last and last is not None and math.isfinite(settings.hysteresis_sum) and expected[last] > 0:
                target = choose_k(expected, times, last, 0.0, self.min_gain)  # the band held it: from what?
                if target != last:
                    gain = (expected[target] / times[target]) / (expected[last] / times[last]) - 1.0
                    total = gain + (self.held[1] if self.held is not None and self.held[0] == target else 0.0)
                    current, held = (target, None) if total > settings.hysteresis_sum else (last, (target, total))
            probe = every = None
            if current == 0 and len(times) > 1 and not self.shadowed:  # (the probe spacing moves with the costs)
                probe = self.probe_k(expected, times)
                # (a batch that ends with its slowest row: one probe seldom moves that row, so its
                # expected tokens do not shorten the call; only a lone row's do)
                live = self._live if self._live is not None else self.acceptance.rates.shape[0]
                every = self.probe_every(times, probe, expected if not self.until_last or live <= 1 else None)
            gain = speculation_gain(expected, times)
            self._choice = (sig, (current, held, times, gain, probe, every))
        K, at_zero = current, self.steps_at_zero
        if self._probe_again is not None and current == 0:
            # a probe of a drafter that catches up runs a second step at its K while the costs have
            # not measured a proposal of it alone: the first step's proposal first runs the plain
            # steps' text, so only a second one tells the proposal from that catch-up (on the
            # CUDA-graph path the first probes' second steps may capture a program, and are then
            # not measured: those probes run two steps again)
            return self._probe_again, current, 0, held, times, gain
        if probe is not None:  # (at_zero: plain steps since the last probe)
            at_zero += 1
            if at_zero == 0 or at_zero >= every:
                K, at_zero = probe, 0  # probe: observe acceptance again
        else:
            at_zero = 0
            if settings.measure_neighbours and current:  # (K = 0 without probes: shadow proposals observe)
                K = self._neighbour_to_measure(K, self.expected, times)
        return K, current, at_zero, held, times, gain

    def _neighbour_to_measure(self, K: int, expected: list[float], times: list[float]) -> int:
        """K, or, once K's own cost is measured, the width next to it (K - 1 or K + 1, >= 1; the
        better predicted of two) whose cost is not measured yet and whose predicted goodput is
        within ``hysteresis`` of K's; at most :data:`MEASURING_STEPS` steps per width and call (its
        first step in the call is not counted, :meth:`_observe`, the next :data:`MEASURED_STEPS`
        measure it; a cost model that never takes them in would otherwise hold the call at the
        neighbour)."""
        if not self.costs.measured(self.key, K):  # (K's own cost first: not one calibration against another)
            return K

        def rate(k):
            return expected[k] / times[k]
        near = [k for k in (K - 1, K + 1)
                if 1 <= k <= self.max_k and not self.costs.measured(self.key, k)
                and self._measuring.get(k, 0) < MEASURING_STEPS
                and rate(k) * (1.0 + self.settings.hysteresis) >= rate(K)]
        return max(near, key=rate, default=K)

    @staticmethod
    def probe_k(expected: list[float], times: list[float]) -> int:
        """The K a probe from K = 0 runs: the speculative K of the best predicted goodput
        (E(K) / t(K), K >= 1; the smallest of equals). A probe at K = 1 would observe only the
        first draft, and the later positions, not asked, would move towards its rate
        (:class:`AcceptanceEstimator`): for a drafter whose later drafts are accepted more often
        than its first (the n-gram drafter) that held E(K) below what speculating commits."""
        return max(range(1, len(times)), key=lambda k: (expected[k] / times[k], -k))

    def probe_every(self, times: list[float], K: int = 1, expected: list[float] | None = None) -> int:
        """Steps between probes at K = 0: ``probe_interval``, or more where a probe (a step at
        ``K``, ``times[K]`` seconds, and the switch back to plain steps after it,
        :meth:`CostModel.leave_s`) costs more than ``probe_budget`` of the time at K = 0 spread
        over the interval. With ``expected`` (E(K) per K), the probe's cost is what it takes
        beyond the plain steps that would commit the tokens it is expected to commit
        (``times[K] - times[0] E(K) / E(0)``): a probe at a longer K commits more. (The policy
        passes it per step, and for a batch that ends with its slowest row only where one row
        is left: one probe step seldom moves the slowest of several.)

        A drafter that catches up (:meth:`CostModel.catch_up_s`) makes each probe run the text of
        the plain steps since the last one: per plain step a share ``c`` of the plain step's
        time, spent whatever the spacing. The spacing ``n`` then holds the fixed part ``a``
        within what is left, ``n >= a / max(probe_budget - c, probe_budget / 4)``: where ``c``
        takes more than three quarters of the budget, the probes come four times further apart
        than without it, and still come (they are what sees a rising acceptance)."""
        if len(times) <= K or times[0] <= 0:
            return self.settings.probe_interval
        budget = self.settings.probe_budget
        plain = times[0] * (expected[K] / expected[0] if expected is not None and expected[0] > 0 else 1.0)
        extra = max(0.0, times[K] - plain + self.costs.leave_s(self.key)) / times[0]
        room = max(budget - self.costs.catch_up_s(self.key, self.drafter_key) / times[0], budget / 4)
        return max(self.settings.probe_interval, math.ceil(extra / room - 1e-9))

    @property
    def read_size(self) -> int:
        """How many values :meth:`update` returns when it returns any: E(K) for the choice and,
        with ``until_last``, after them the per-step E(K) the prediction counts."""
        return (self.max_k + 1) * (2 if self.until_last else 1)

    @property
    def skips_update(self) -> bool:
        """Whether the next :meth:`update` returns None without computing (see there): the caller
        may then spare building its arguments."""
        return bool(self.until_last and self.k_per_step and self.k_per_step[-1] == 0
                    and self._live is not None and self._live == self._live_estimated)

    def update(self, num_accepted, num_asked, ran, live, budget,
               observed: bool = False) -> torch.Tensor | list[float] | None:
        """Device side, after the step's acceptance: update the acceptance estimate with the
        step's ``num_accepted`` / ``num_asked`` ``[B]`` int64 of the rows that ran it (``ran [B]``
        bool) and compute E(K) for the next step's ``live [B]`` rows with ``budget [B]`` drafts
        left each. Returns the values (see :attr:`read_size`), or None when there are none.

        Eagerly these are this update's values, ``[read_size]`` fp64 on the device, to read at
        this step's sync (no host sync here). With a kept graph (:attr:`reads_ahead`) the update
        is replayed on a side stream and runs beside the next step's forward, and copies its
        values to the host; the values returned are the last replay's, already on the host (a
        list; None after a step that launched none: the host waits for that replay, which ran
        beside this step's forward, and so for nothing in the common case), and the ones of
        this replay come at the next step: the choice reads them one step late.

        After a step at K = 0 of a fixed batch (``until_last``), while the live rows are those
        the last values were computed for (as :meth:`receive` was told, one step late), nothing
        is computed and the estimate is unchanged (only pending values are returned): such a
        step observed no draft, and with the estimate and the live rows unchanged and every row
        one token nearer its end, speculating can only have become less worth it, so the last
        values stand until a probe or until a row ends; the step is spared the estimate's device
        ops, as a plain step would be. :attr:`skips_update` says so ahead: :meth:`skipped_values`
        then gives the same without the arguments. ``observed``: the step at K = 0 brings observations
        all the same (a shadow proposal's drafts checked, :attr:`shadowed`): it is computed."""
        if self.skips_update and not observed:
            return self.skipped_values()
        args = (num_accepted, num_asked, ran, live, budget)
        if self._graph is None:
            return _update(self.acceptance, self.until_last, *args)
        kept = self._graph
        out = self.pending()  # (the host waited for the last replay: it read the inputs and wrote the output)
        for dst, src in zip(kept.inputs, args):  # on this stream, after the tensors it made
            dst.copy_(src)
        if kept.stream is None:
            kept.graph.replay()
            kept.host.copy_(kept.output)
        else:
            kept.stream.wait_stream(self._stream)
            with torch.cuda.stream(kept.stream):
                kept.graph.replay()
                kept.host.copy_(kept.output, non_blocking=True)
                kept.done = torch.cuda.Event()
                kept.done.record(kept.stream)
        self._pending, self._launched_at = True, len(self.k_per_step)
        return out

    def skipped_values(self) -> list[float] | None:
        """What a step that skips its update (:attr:`skips_update`) reads: the :meth:`pending`
        values, waited for unless shadow proposals run (:attr:`shadowed`)."""
        return self.pending(wait=not self.shadowed)

    def pending(self, wait: bool = True) -> list[float] | None:
        """The values of a side-stream update not read yet (``read_size`` floats, read on the host
        after waiting for that replay and its copy), or None. Read them before the next
        :meth:`update`, whose copy overwrites them. ``wait=False``: None (and the values left
        pending) while that replay has not finished, instead of waiting for it: with shadow
        proposals (:attr:`shadowed`) a step that skips its update then does not wait for the
        device (at the plain step after a shadow's update, a host sync in the middle of the
        loop's overlap). Values read more than one step after their replay was launched are not
        taken as computed for the live rows then (:meth:`receive`): the next step updates."""
        if not self._pending:
            return None
        if self._graph.done is not None:
            if not wait and not self._graph.done.query():
                return None
            self._graph.done.synchronize()
        self._pending = False
        self._late = len(self.k_per_step) > self._launched_at + 1
        return self._graph.host.tolist()

    @property
    def reads_ahead(self) -> bool:
        """Whether :meth:`update` returns host values (a kept graph), so that the engine calls
        :meth:`before_sync` / :meth:`after_sync` instead of :meth:`after_step`."""
        return self._graph is not None

    def settle(self) -> None:
        """Order the current stream after a side-stream update still running (before reading or
        writing :attr:`acceptance` on it)."""
        if self._graph is not None:
            self._graph.wait()

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Rows that took new requests (continuous batching) start from the mean of every row's
        estimate (per position: what the drafter showed lately on this workload, the call's prior
        before any step), not from the policy's prior again: rows that live a few steps would
        otherwise never get far from it (device ops only)."""
        self.settle()
        self.acceptance.restart_rows(rows)

    def close(self) -> None:
        """The decode loop is over: a kept update graph this policy holds may serve the next policy
        of its shape (which resets the estimator: read :attr:`acceptance` before making it)."""
        self.settle()
        self._pending, self._ahead = False, None
        if self._held is not None and self._held.holder() is self:
            self._held.holder = _nobody
        self._held = None

    def _capture(self, est: AcceptanceEstimator) -> _KeptUpdate:
        """Capture the update of ``est`` (capturing runs nothing: its estimate is unchanged) after
        one warm-up run on a scratch estimator of the same shape (loads the kernels). The update
        is :func:`~specdec.fusion.fusable`: with fusion on (``SPECDEC_FUSE``), its ~100 small
        element-wise and reduction ops become a few compiled kernels, so its replay beside the next
        step takes microseconds of the device instead of ~0.2 ms; if compiling or capturing the
        fused update fails, warn (once: :data:`_FUSED_UPDATE_FAILED` keeps the reason, and later
        shapes are captured unfused at once) and capture it unfused. On failure of both, warn and return a
        :class:`_KeptUpdate` without a graph (the shape then updates eagerly)."""
        B, M = est.rates.shape
        dev = est.rates.device
        counts = torch.zeros(B, dtype=torch.long, device=dev)
        every = torch.ones(B, dtype=torch.bool, device=dev)
        inputs = [counts, counts.clone(), every, every.clone(), counts.clone()]
        scratch = AcceptanceEstimator(B, M, 0.5, est.weight, dev)
        until_last = self.until_last
        fuse_first = fusion_enabled() and _FUSED_UPDATE_FAILED[0] is None
        for fuse in (None, False) if fuse_first else (False,):  # fused (SPECDEC_FUSE), then unfused
            try:
                graph, out = capture(lambda: _update(est, until_last, *inputs), model=None,
                                     what="the speculation policy's update", warmup=1,
                                     warmup_fn=lambda: _update(scratch, until_last, *inputs), fuse=fuse)
                return _KeptUpdate(est, graph, inputs, out)
            except CaptureFailure as err:
                failure = err
                if fuse is None:  # said once; later shapes go unfused at once
                    _FUSED_UPDATE_FAILED[0] = str(err)
                    warnings.warn(f"{err}; the speculation policy's update is captured unfused from now on",
                                  RuntimeWarning, stacklevel=3)
        warnings.warn(f"{failure}; the speculation policy updates without a graph", RuntimeWarning, stacklevel=3)
        return _KeptUpdate(est, None, inputs, None)

    def receive(self, values: list[float] | None, live_rows: int | None = None) -> None:
        """Keep what :meth:`update` returned (read on the host) for the next choice (None: keep the
        last), and ``live_rows``, the rows not finished after the step (None: not known). Values
        of a side-stream update (a kept graph) were computed for the step before's live rows."""
        if values is not None:
            M1 = self.max_k + 1
            self.expected, self.step_expected = list(values[:M1]), list(values[-M1:])
            self._values_seen += 1
            self._live_estimated = (None if self._late else self._live) if self._graph is not None else live_rows
        self._live = live_rows

    def after_step(self, expected: list[float] | None, clock: StepClock, first_mark: int,
                   live_rows: int | None = None, end: int | None = None) -> None:
        """Host side, after the step's sync: :meth:`receive` ``expected`` and ``live_rows`` and feed
        the costs with the laps of the previous step (complete now: this step's sync came after
        them); ``first_mark`` is ``clock.marks`` before this step's first lap; ``end`` the mark
        this step's laps end at (default ``clock.marks`` now; see :meth:`_observe`).

        A decode loop that launches each step before it reads the last one's flags calls this
        after that read, with the last step's ``expected`` and ``live_rows`` and the ``end`` of
        the step just launched: the choice of K then reads E(K) one step late, as with a kept
        graph.

        A step at K = 0 proposes nothing: all of it is the target's time (its ``draft`` lap is the
        loop's own host and budget work, which the step pays as well). The first step at K = 0
        after speculative ones is counted as the switch's extra time instead
        (:meth:`CostModel.observe_leave`)."""
        self.receive(expected, live_rows)
        self._observe(clock, first_mark, end)

    def before_sync(self, expected: list[float] | None, clock: StepClock, first_mark: int,
                    end: int | None = None) -> None:
        """Host side, with a kept graph (:attr:`reads_ahead`), after the step's last lap and
        before its blocking sync: keep ``expected`` (the host values :meth:`update` returned),
        feed the costs with the previous step's laps (complete: that step's sync came after
        them), as :meth:`after_step` does, and choose the next step's K now, while the device
        runs this step (:meth:`next_k` returns it). The choice is the one :meth:`next_k` would
        make after the sync: it reads nothing the sync brings. :meth:`after_sync` then takes
        the live rows. ``end``: as in :meth:`after_step` (a loop that launches each step before
        it reads the last one's flags calls this after that read)."""
        if expected is not None:
            self.receive(expected, self._live)  # (the live rows are told after the sync)
        self._observe(clock, first_mark, end)
        self._ahead = self._decide()

    def after_sync(self, live_rows: int | None) -> None:
        """Host side, after the step's sync (with :meth:`before_sync`): the rows not finished."""
        self._live = live_rows

    def _observe(self, clock: StepClock, first_mark: int, end: int | None = None) -> None:
        """Feed the costs with the laps of the step before this one, and hold this step's: the
        laps from the end of the step before's up to mark ``end`` (default: the last lap now;
        without ``prefill`` laps: a pool's admissions between steps). Chained so, a lap recorded
        after the point a step's window ended (:meth:`before_sync`'s: the work after the step's
        sync) counts in the next step's, not in none. The laps read must be complete: those of a
        window that ended before the last host read of the device's progress. Of a run of plain
        steps after plain ones, the first and then one in :data:`PLAIN_STEPS_PER_OBSERVATION` are
        read and taken in."""
        if self._last is not None:
            K, start, stop, before, plain_s, warming = self._last
            what = None if warming else step_measures(K, before, K in self._seen,
                                                      getattr(self.drafter_key, "sequential", True))
            if what == "width" and K == 0:  # (a plain step after a plain one)
                self._plain_run += 1
                if (self._plain_run - 1) % PLAIN_STEPS_PER_OBSERVATION:
                    what = None
            elif K or before:
                self._plain_run = 0
            laps = [] if what is None else [(phase, s) for phase, s in clock.laps(start, stop)
                                            if phase not in ("prefill", "shadow")]
            total = sum(s for _, s in laps)
            if what == "leave":
                self.costs.observe_leave(self.key, total - plain_s)
            elif what in ("width", "target"):
                draft = sum(s for phase, s in laps if phase == "draft")  # (K = 0: the step's glue; see observe)
                self.costs.observe(self.key, self.drafter_key, K, draft if what == "width" else None, total - draft)
                plain_steps = self._plain_steps_before(len(self.k_per_step) - 2) if what == "target" else 0
                if plain_steps >= CATCH_UP_MIN_PLAIN_STEPS:  # (its proposal first ran the plain steps' text)
                    self.costs.observe_catch_up(self.key, self.drafter_key, K, draft, plain_steps)
                if what == "width":
                    seen = self._measured.setdefault(K, [0.0, 0])
                    seen[0], seen[1] = seen[0] + total, seen[1] + 1
            self._seen.add(K)
        ks = self.k_per_step
        start = self._last[2] - 1 if self._last is not None else first_mark - 1  # (a mark's index: count - 1)
        self._last = (ks[-1], start, clock.marks if end is None else end, ks[-2] if len(ks) > 1 else 0,
                      self._predicted[-1][0], self._warming)

    def _plain_steps_before(self, step: int) -> int:
        """Steps at K = 0 right before step ``step`` (an index into :attr:`k_per_step`)."""
        n = 0
        while step - n - 1 >= 0 and self.k_per_step[step - n - 1] == 0:
            n += 1
        return n

    def predicted_step_s(self) -> list[float]:
        """Per K = 0..M, the mean over this call's steps of the seconds the policy predicted for a
        step at K when it chose each step's K (before the costs took that step): what its choices
        rested on, every K included (:meth:`step_times` after the call has taken the call's own
        steps in)."""
        return _per_k_means(self._predicted) if self._predicted else self.step_times()

    def expected_tokens_seen(self) -> list[float]:
        """Per K = 0..M, the mean over this call's steps of the E(K) each step's K was chosen by
        (with ``until_last``: the tokens per step until the slowest row ends): with
        :meth:`predicted_step_s`, the goodput the choices compared."""
        return _per_k_means(self._expected_seen) if self._expected_seen else list(self.expected)

    def calibrated_step_s(self) -> list[float | None]:
        """Per K = 0..M, the cost model's measured verify + commit of width K + 1 alone (None: not
        measured; :meth:`CostModel.calibrated_s`): what :meth:`predicted_step_s` adds the online
        refinements and the drafter's time to, for a K the call did not run."""
        return [self.costs.calibrated_s(self.key, K) for K in range(self.max_k + 1)]

    def measured_step_s(self) -> list[float | None]:
        """Per K = 0..M, the mean seconds of this call's steps at K that the costs took (None: none
        did). Not counted: a K's first step in the call (its first proposal, compiles), a step that
        ran a program's warm-up or capture (:meth:`unmeasured`), the first
        plain step after speculative ones (its switch cost, :meth:`CostModel.observe_leave`), a
        step at K > 0 after a wider one (it first folds the wider one's replay history: the
        switch's cost, not the width's) or, for a drafter that catches up, after a plain one (its
        proposal first runs the plain steps' text; the target's part is taken), of a run of plain
        steps after plain ones all but the first and one in :data:`PLAIN_STEPS_PER_OBSERVATION`,
        and the call's last step (its laps complete after the loop). Set against
        :meth:`predicted_step_s`."""
        return [(seen[0] / seen[1]) if (seen := self._measured.get(K)) else None for K in range(self.max_k + 1)]

    def k_histogram(self) -> list[int]:
        """Steps run at each K = 0..M."""
        hist = [0] * (self.max_k + 1)
        for K in self.k_per_step:
            hist[K] += 1
        return hist

    @property
    def predicted_tokens_per_s(self) -> float | None:
        """The predicted goodput of the steps run: sum of E(K) / sum of t(K) over the chosen K."""
        seconds = sum(times[K] for times, K in zip(self._predicted, self.k_per_step))
        return self._predicted_tokens / seconds if seconds > 0 else None
