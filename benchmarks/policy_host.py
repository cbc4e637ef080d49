"""The speculation policy's own host time per decode step (``num_speculative_tokens="auto"``),
on any machine, without a model: the part of a step that choosing K adds to the host's launches.
On a model small enough that its steps are bound by the host (the zoo's 4.4M-parameter
``gdn-target``: a whole step takes 0.3-0.5 ms on an H100's host), every microsecond here is a
microsecond of the step.

    python benchmarks/policy_host.py --batch 1 --acceptance 0.7 --steps 2000

Drives a :class:`~specdec.adaptive.SpeculationPolicy` as the decode loop does when it launches
each step before it reads the last one's flags: per step ``next_k()``, the step's laps on a host
:class:`~specdec.clock.StepClock` (``draft``, ``verify``, ``rollback``, two ``bookkeeping``), then
``after_step()`` with the last step's E(K) values (a new list every step, as the device sends,
drawn around the E(K) of ``--acceptance`` per draft position with a small jitter). The costs are a
:class:`~specdec.adaptive.MeasuredCosts` calibrated at every width (verify + commit of width T:
``0.30 + 0.01 T`` ms), and the clock's laps last a modelled step's times (:class:`ModelClock`:
those plus 0.005 ms per draft and 0.01 ms per bookkeeping lap), which the costs take in as they
would a real step's. The first ``--warmup`` steps are not timed. Prints the median and
mean microseconds per step of ``next_k`` and ``after_step`` and of both, and the steps per K.
The acceptance estimate's device update (:meth:`SpeculationPolicy.update`: one graph replay on
CUDA) is not part of this; neither is the decode loop's own work.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdec.adaptive import CostKey, DrafterKey, MeasuredCosts, PolicySettings, SpeculationPolicy  # noqa: E402
from specdec.clock import StepClock  # noqa: E402


def expected_per_k(acceptance: float, max_k: int, batch: int, jitter: float, rng: random.Random) -> list[float]:
    """E(K), K = 0..max_k, of ``batch`` rows whose every draft is accepted with ``acceptance``
    (each position's rate moved by up to ``jitter``, as an estimate moves step to step)."""
    out, total, prod = [], 1.0, 1.0
    out.append(float(batch))
    for _ in range(max_k):
        prod *= min(1.0, max(0.0, acceptance + rng.uniform(-jitter, jitter)))
        total += prod
        out.append(batch * total)
    return out


def verify_ms(T: int) -> float:
    """The modelled verify forward of width T, ms (a small model, bound by its launches)."""
    return 0.25 + 0.01 * T


#: the modelled commit, a draft position's proposal and a step's bookkeeping, ms
COMMIT_MS, DRAFT_MS, BOOKKEEPING_MS = 0.05, 0.005, 0.01


class ModelClock(StepClock):
    """A host :class:`StepClock` whose laps last the modelled times of a step at :attr:`K`, not
    the host's microseconds between them (which the costs would take in as the step's time)."""

    def __init__(self):
        self.K, self._now = 0, 0.0
        super().__init__("cpu")

    def lap(self, phase) -> None:
        ms = {"draft": DRAFT_MS * self.K, "verify": verify_ms(self.K + 1), "rollback": COMMIT_MS,
              "bookkeeping": BOOKKEEPING_MS}.get(phase, 0.0)
        self._now += ms / 1e3
        self._marks.append(self._now)
        self._phases.append(phase)


def run(batch: int, acceptance: float, steps: int, warmup: int, max_k: int, seed: int = 0) -> dict:
    """Time ``steps`` policy steps (after ``warmup`` untimed ones); returns ``next_k_us``,
    ``after_step_us`` and ``step_us`` (lists, per timed step) and ``k_histogram``."""
    rng = random.Random(seed)
    costs, key = MeasuredCosts(), CostKey("cuda_graph", "replay", batch)
    for T in range(1, max_k + 2):
        costs.record_width(key, T, verify_ms(T) / 1e3, COMMIT_MS / 1e3)
    policy = SpeculationPolicy(PolicySettings(), costs, key, DrafterKey(False), max_k, batch, 10 ** 9,
                               acceptance, "cpu")
    clock = ModelClock()
    next_k_us, after_us, hist = [], [], [0] * (max_k + 1)
    values = None
    for i in range(warmup + steps):
        t0 = time.perf_counter_ns()
        K = policy.next_k()
        t1 = time.perf_counter_ns()
        first_mark, clock.K = clock.marks, K
        for phase in ("draft", "verify", "rollback", "bookkeeping", "bookkeeping"):
            clock.lap(phase)
        last, values = values, expected_per_k(acceptance, max_k, batch, 0.02, rng)
        t2 = time.perf_counter_ns()
        policy.after_step(last, clock, first_mark, batch)
        t3 = time.perf_counter_ns()
        if i >= warmup:
            next_k_us.append((t1 - t0) / 1e3)
            after_us.append((t3 - t2) / 1e3)
            hist[K] += 1
    return {"next_k_us": next_k_us, "after_step_us": after_us,
            "step_us": [a + b for a, b in zip(next_k_us, after_us)], "k_histogram": hist}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--acceptance", type=float, default=0.7, help="per draft position, in [0, 1]")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--max-speculative-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    if not 0.0 <= args.acceptance <= 1.0:
        ap.error(f"--acceptance must be in [0, 1]; got {args.acceptance}")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.max_speculative_tokens < 1:
        ap.error("--steps, --batch and --max-speculative-tokens must be >= 1, --warmup >= 0")
    out = run(args.batch, args.acceptance, args.steps, args.warmup, args.max_speculative_tokens)
    parts = []
    for name in ("next_k", "after_step", "step"):
        xs = out[f"{name}_us"]
        parts.append(f"{name} {statistics.median(xs):.1f} us median, {statistics.fmean(xs):.1f} mean")
    print(f"policy host time per step, batch {args.batch}, acceptance {args.acceptance}, {args.steps} steps: "
          + "; ".join(parts) + f"; steps per K {out['k_histogram']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
