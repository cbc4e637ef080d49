"""Replay ``num_speculative_tokens="auto"``'s policy on the step costs an ``experiment=adaptive`` run
measured, with the oracle drafter's acceptance drawn on the host: what would auto choose, and
how would it fare against every fixed K, for policy settings the GPU has not run?

The policy is :class:`specdec.adaptive.SpeculationPolicy` itself (its acceptance estimator,
``choose_k``, hysteresis and its sum, ``min_gain``, probes), driven with :class:`specdec.adaptive.FixedCosts`:
the step time at K is the fastest strategy's ``decode_ms_per_step`` at that K in the run (K = 0:
the run's plain ``plain_decode_ms_per_step``), linear between the measured K. Each row accepts
each draft with the workload's probability, independently, until the first rejection (as
:class:`specdec.drafters.OracleDrafter` corrupts drafts); a fixed batch runs until its slowest
row has its ``max_new_tokens``, every step costing the whole batch's time, and the policy counts
E(K) until that row ends, as ``generate()`` does (``--per-step``: per step, as continuous batching
does). This predicts; the
GPU run (``experiment=adaptive``) measures.

``--learned``: the policy predicts as on the device instead, from :class:`specdec.adaptive.MeasuredCosts`:
the calibration the run's auto cell recorded (``calibrated_step_ms``) refined by the steps it
runs, each observed at the fixed cells' time of its K times ``1 + --excess`` (auto's own steps
may cost more than a fixed K's) and a normal measurement noise of relative spread ``--noise``
(left out as the policy leaves them out: the first step at each K in a call, a step narrower
than the one before, the first plain step after speculative ones); the proposal's share of a
step is the fixed cells' median draft lap, a plain step's glue their plain runs' median. One cost model serves a batch's
workloads in order, each a warm-up call then the timed one, as in the experiment. How a policy
learns, not only how it chooses, is then under test.

    python benchmarks/simulate_adaptive.py benchmarks/results/adaptive_qwen35_shape_b1.jsonl
    python benchmarks/simulate_adaptive.py RUN/results.jsonl --max-new 256 --seeds 4 --min-gain 0
    python benchmarks/simulate_adaptive.py RUN/results.jsonl --max-new 128 --learned --excess 0.04
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import numpy as np
import torch

from specdec.adaptive import (CostKey, DrafterKey, FixedCosts, MeasuredCosts, PolicySettings, SpeculationPolicy,
                              step_measures)


#: the PolicySettings fields the command line sets (``--min-gain`` ...)
TUNABLES = ("min_gain", "probe_budget", "acceptance_weight", "prior_acceptance", "hysteresis", "hysteresis_sum")


def step_costs(records: list[dict], batch: int, max_k: int) -> list[float]:
    """Seconds of one step at K = 0..max_k for ``batch``: the fastest fixed cell of each measured K
    over every strategy and workload, K = 0 from plain decoding, linear in between."""
    rows = [r for r in records if r.get("batch") == batch and isinstance(r.get("num_speculative_tokens"), int)
            and r.get("rollback") != "auto"]
    if not rows:
        raise ValueError(f"no fixed-K records of batch {batch} in the results")
    measured = {0: statistics.median(r["plain_decode_ms_per_step"] for r in rows)}
    for r in rows:
        K = r["num_speculative_tokens"]
        measured[K] = min(measured.get(K, float("inf")), r["decode_ms_per_step"])
    ks = sorted(measured)
    return [float(np.interp(K, ks, [measured[k] for k in ks])) / 1e3 for K in range(max_k + 1)]


class Learning:
    """The ``--learned`` cost model of one batch (see the module docstring): ``model``, a
    :class:`MeasuredCosts` calibrated with ``calibrated`` (seconds of verify + commit per K), and
    :meth:`observe`, which feeds it one real step at K."""

    KEY, DRAFTER = CostKey("sim", "sim", 0), DrafterKey(False)

    def __init__(self, calibrated: list[float], draft_s: float, glue_s: float, excess: float, noise: float,
                 seed: int):
        self.model = MeasuredCosts()
        for K, t in enumerate(calibrated):
            self.model.record_width(self.KEY, K + 1, verify_s=t, commit_s=0.0)
        self.draft_s, self.glue_s, self.excess, self.noise = draft_s, glue_s, excess, noise
        self.gen = torch.Generator().manual_seed(seed)

    def observe(self, K: int, before: int, run_before: bool, true_s: float) -> None:
        """One step at K after one at ``before`` that took ``true_s`` seconds, taken in as the
        policy takes a real one in (:func:`specdec.adaptive.step_measures`)."""
        what = step_measures(K, before, run_before)
        if what == "leave":
            self.model.observe_leave(self.KEY, 0.0)  # (no switch cost in the fixed cells' times)
        if what != "width":
            return
        seen = true_s * (1.0 + self.excess * (K > 0)) * (1.0 + self.noise * float(torch.randn(1, generator=self.gen)))
        draft = min(self.draft_s if K else self.glue_s, 0.5 * seen)
        self.model.observe(self.KEY, self.DRAFTER, K, draft, seen - draft)


def simulate(costs: list[float], batch: int, acceptance, max_new: int, settings: PolicySettings,
             fixed_k: int | None, seed: int, until_last: bool = True, prior=None, learning: Learning | None = None):
    """Tokens/s of one batch (``acceptance``: a rate, or a function of a row's new-token count)
    under the policy (``fixed_k`` None) or a fixed K; the K of every step; and the per-position
    acceptance the policy saw over the call (where the drafter's next call starts; None for a
    fixed K). ``prior``: where the policy starts (None: ``settings.prior_acceptance``);
    ``learning``: the policy's costs are learned (``--learned``), not the fixed cells' times."""
    M = len(costs) - 1
    gen = torch.Generator().manual_seed(seed)
    model, key, dk = ((FixedCosts(lambda s, b, K: costs[K]), CostKey("sim", "sim", batch), None) if learning is None
                      else (learning.model, Learning.KEY, Learning.DRAFTER))
    policy = SpeculationPolicy(settings, model, key, dk, M, batch, max_new,
                               settings.prior_acceptance if prior is None else prior, "cpu", until_last,
                               prior_from_last_call=prior is not None)
    run_at: set[int] = set()  # K run in this call (the first step at each is not measured)
    rate = acceptance if callable(acceptance) else (lambda p: acceptance)
    n_gen = torch.zeros(batch, dtype=torch.long)
    seconds, ks = 0.0, []
    while bool((n_gen < max_new).any()):
        K = policy.next_k() if fixed_k is None else fixed_k
        live = n_gen < max_new
        asked = torch.minimum(torch.full((batch,), K), (max_new - n_gen - 1).clamp(min=0)) * live
        a = torch.tensor([rate(int(p)) for p in n_gen])
        hit = torch.rand(batch, max(M, 1), generator=gen) < a[:, None]
        first_miss = torch.where(~hit, torch.arange(hit.shape[1])[None, :], hit.shape[1]).min(1).values
        n = torch.minimum(first_miss, asked)
        n_gen = torch.minimum(n_gen + (n + 1) * live, torch.full_like(n_gen, max_new))
        if fixed_k is None:
            left = (max_new - n_gen - 1).clamp(min=0)
            values = policy.update(n, asked, live, n_gen < max_new, left)
            policy.receive(None if values is None else values.tolist(), int((n_gen < max_new).sum()))
        seconds += costs[K] * (1.0 + (learning.excess if learning is not None and fixed_k is None and K else 0.0))
        if learning is not None and fixed_k is None:
            learning.observe(K, ks[-1] if ks else 0, K in run_at, costs[K])
            run_at.add(K)
        ks.append(K)
    return batch * max_new / seconds, ks, None if fixed_k is not None else policy.acceptance.overall(policy.prior)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="results.jsonl of an experiment=adaptive run")
    p.add_argument("--max-new", type=int, default=256, help="new tokens per row (default 256)")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--seeds", type=int, default=3, help="acceptance draws averaged per cell")
    p.add_argument("--phases", type=float, nargs="*", default=[0.9, 0.1], help="the changing workload")
    p.add_argument("--per-step", action="store_true",
                   help="E(K) per step, as continuous batching uses it (default: until the batch's slowest row ends, "
                        "as generate() does)")
    p.add_argument("--learned", action="store_true",
                   help="the policy learns its costs from the run's calibration and the steps it runs (see above)")
    p.add_argument("--excess", type=float, default=0.0,
                   help="with --learned: auto's steps at K > 0 cost this much more than a fixed K's (e.g. 0.04)")
    p.add_argument("--noise", type=float, default=0.02, help="with --learned: the relative spread of a measured step")
    for name in TUNABLES:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None)
    args = p.parse_args(argv)
    records = [json.loads(line) for line in open(args.results)]
    given = {k: getattr(args, k) for k in TUNABLES if getattr(args, k) is not None}
    settings = replace(PolicySettings(), **given)
    workloads = sorted({r["acceptance"] for r in records if isinstance(r.get("acceptance"), (int, float))})
    share = max(1, args.max_new // max(1, len(args.phases)))
    changing = (lambda pos: args.phases[min(pos // share, len(args.phases) - 1)]) if args.phases else None
    print(f"{args.results}: {args.max_new} new tokens, {args.seeds} draws per cell, {settings}\n")
    print("| batch | acceptance | best fixed K | auto / best fixed | auto / plain | auto / worst fixed K | auto's K histogram |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for batch in sorted({r["batch"] for r in records if "batch" in r}):
        costs = step_costs(records, batch, args.max_k)
        learning = None
        if args.learned:  # one cost model for the batch's workloads, in order, as the experiment keeps it
            autos = [r for r in records if r.get("batch") == batch and r.get("num_speculative_tokens") == "auto"]
            if not autos or not autos[0].get("calibrated_step_ms"):
                raise SystemExit(f"--learned: no auto record with calibrated_step_ms at batch {batch}")
            calibrated = [t / 1e3 for t in autos[0]["calibrated_step_ms"]][:args.max_k + 1]
            fixed = [r for r in records if r.get("batch") == batch and isinstance(r.get("num_speculative_tokens"), int)]
            draft = statistics.median(r["draft_ms"] for r in fixed) / 1e3
            glue = statistics.median(r.get("plain_draft_ms", r["draft_ms"]) for r in fixed) / 1e3
            learning = Learning(calibrated, draft, glue, args.excess, args.noise, batch)
        cells = [(f"{a:g}", a) for a in workloads] + ([("->".join(f"{a:g}" for a in args.phases), changing)]
                                                       if changing else [])
        for label, acc in cells:
            def mean_rate(k):
                return statistics.fmean(simulate(costs, batch, acc, args.max_new, settings, k, s)[0]
                                        for s in range(args.seeds))
            fixed = {k: mean_rate(k) for k in range(args.max_k + 1)}
            runs = []
            for s in range(args.seeds):  # a warm-up call first, as the experiment runs: the timed call
                # starts from the acceptance the warm-up ended with
                learned = simulate(costs, batch, acc, args.max_new, settings, None, 1000 + s, not args.per_step,
                                   learning=learning)[2]
                runs.append(simulate(costs, batch, acc, args.max_new, settings, None, s, not args.per_step, learned,
                                     learning))
            auto = statistics.fmean(r for r, *_ in runs)
            best = max(fixed, key=fixed.get)
            worst = min(v for k, v in fixed.items() if k > 0)
            hist = np.bincount(runs[0][1], minlength=args.max_k + 1).tolist()
            print(f"| {batch} | {label} | {best} | {auto / fixed[best]:.3f} | {auto / fixed[0]:.3f} | "
                  f"{auto / worst:.2f} | {hist} |")


if __name__ == "__main__":
    main()
