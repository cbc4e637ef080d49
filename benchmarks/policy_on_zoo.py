"""Replay ``num_speculative_tokens="auto"``'s policy with a real drafter on the zoo's prompts, on a
CPU, at step costs measured on a GPU: what does auto choose against every fixed K when the
acceptance is a real drafter's (not the oracle's independent draws of ``simulate_adaptive.py``)?

The zoo's ``gdn-target`` runs greedily through ``specdec.wrap`` (fp32, the eager path) with the
given drafter; the policy (:class:`specdec.adaptive.SpeculationPolicy`: its acceptance estimate,
probes, hysteresis) chooses each step's K against :class:`specdec.adaptive.FixedCosts`: the step
times, in milliseconds for K = 0..8, either given (``--costs``) or the ``predicted_step_ms`` that
an ``experiment=bench ... num_speculative_tokens=auto`` run recorded for that drafter and batch 1
(``--from-results``: the costs the GPU's policy held). Each K's time is then charged to every
step that ran it; the figure is plain decoding's time for the same tokens over that sum
(``T(0) * tokens / sum of T(K) over the steps``, the tokens the steps committed: the first new
token of each prompt is its prefill's). This predicts what the policy would give at
those costs; the GPU run (``experiment=bench``) measures.

    python benchmarks/policy_on_zoo.py --from-results benchmarks/results/e2e_zoo_auto_k_mtp_kept_entries_h100.jsonl
    python benchmarks/policy_on_zoo.py --costs 0.265,0.29,0.31,0.33,0.35,0.37,0.39,0.41,0.43 --prompts 32
"""

from __future__ import annotations

import argparse
import json

import torch

import specdec
from specdec import zoo
from specdec.adaptive import FixedCosts


def recorded_costs(path: str, drafter: str) -> list[float]:
    """The ``predicted_step_ms`` of the batch-1 record of ``drafter`` with K chosen per step."""
    for line in open(path):
        r = json.loads(line)
        if r.get("drafter") == drafter and r.get("batch") == 1 and r.get("num_speculative_tokens") == "auto":
            return [float(t) for t in r["predicted_step_ms"]]
    raise ValueError(f"{path}: no batch-1 record of drafter {drafter!r} with num_speculative_tokens='auto'")


def run(costs_ms: list[float], drafter: str, prompts: list[str], max_new: int, ks: list) -> list[dict]:
    """One row per K of ``ks`` (ints and ``"auto"``): its speedup over plain decoding at ``costs_ms``."""
    model, tok = zoo.load("gdn-target")
    fixed = FixedCosts(lambda strategy, batch, K: costs_ms[K] * 1e-3)
    rows = []
    for K in ks:
        sd = specdec.wrap(model, drafter=drafter, num_speculative_tokens=K, rollback="replay", decode_path="eager",
                          max_speculative_tokens=len(costs_ms) - 1, cost_model=fixed if K == "auto" else None)
        charged, tokens, hist = 0.0, 0, [0] * len(costs_ms)
        for text in prompts:
            sd.generate(tok(text, return_tensors="pt").input_ids, max_new_tokens=max_new, do_sample=False)
            st = sd.last_stats
            for k in st.k_per_step or [K] * st.steps:
                hist[k] += 1
                charged += costs_ms[k]
            tokens += st.new_tokens - 1  # (the first new token is the prefill's)
        rows.append({"K": K, "vs_plain": costs_ms[0] * tokens / charged, "steps": sum(hist), "k_histogram": hist,
                     "tokens_per_step": tokens / sum(hist)})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--costs", help="step ms for K = 0..M, comma-separated")
    src.add_argument("--from-results", help="results.jsonl of an experiment=bench run with num_speculative_tokens=auto")
    p.add_argument("--drafter", default="ngram", help="a drafter specdec.wrap takes by name (default ngram)")
    p.add_argument("--prompts", type=int, default=12, help="the zoo's first N prompts (default 12)")
    p.add_argument("--max-new", type=int, default=192)
    p.add_argument("--ks", default="0,2,4,6,auto", help="fixed K and/or auto, comma-separated")
    args = p.parse_args(argv)
    costs = ([float(t) for t in args.costs.split(",")] if args.costs
             else recorded_costs(args.from_results, args.drafter))
    if len(costs) < 2 or min(costs) <= 0:
        raise SystemExit(f"--costs: at least K = 0 and 1, every time > 0 ms; got {costs}")
    ks = [k if k == "auto" else int(k) for k in args.ks.split(",")]
    if any(k != "auto" and not 0 <= k < len(costs) for k in ks):
        raise SystemExit(f"--ks: each K in [0, {len(costs) - 1}] (the costs given) or 'auto'; got {args.ks}")
    torch.manual_seed(0)
    prompts = [p["prompt"] for p in zoo.prompts(limit=args.prompts)]
    print(f"drafter {args.drafter}, {len(prompts)} zoo prompts x {args.max_new} new tokens, step ms {costs}\n")
    print("| K | vs plain decoding | steps | tokens per step | K histogram |\n|---|---:|---:|---:|---|")
    for r in run(costs, args.drafter, prompts, args.max_new, ks):
        print(f"| {r['K']} | {r['vs_plain']:.3f} | {r['steps']} | {r['tokens_per_step']:.2f} | {r['k_histogram']} |",
              flush=True)


if __name__ == "__main__":
    main()
