"""Replay ``num_speculative_tokens="auto"``'s policy with a real drafter on the zoo's prompts, on a
CPU, at step costs measured on a GPU: what does auto choose against every fixed K when the
acceptance is a real drafter's (not the oracle's independent draws of ``simulate_adaptive.py``)?

The zoo's ``gdn-target`` runs greedily through ``specdec.wrap`` (fp32, the eager path) with the
given drafter; the policy (:class:`specdec.adaptive.SpeculationPolicy`: its acceptance estimate,
probes, hysteresis) chooses each step's K against :class:`specdec.adaptive.FixedCosts`: the step
times, in milliseconds for K = 0..8, either given (``--costs``) or the ``predicted_step_ms`` that
an ``experiment=bench ... num_speculative_tokens=auto`` run recorded for that drafter and batch
(``--from-results``: the costs the GPU's policy held). Each K's time is then charged to every
step that ran it; the figure is plain decoding's time for the same tokens over that sum
(``T(0) * plain steps / sum of T(K) over the steps``; plain decoding takes one step per new
token of a batch's longest row but the first, which is the prefill's). This predicts what the policy would give at
those costs, with no cost for the switch from speculative back to plain steps (``FixedCosts``
has none; on a GPU it spaces the probes further apart) nor for the n-gram drafter's shadow
proposals at plain steps (on by default; ``SPECDEC_SHADOW_PROPOSALS=0``: probes; one proposal,
~20 small kernels and an update every 4 plain steps); the GPU run (``experiment=bench``) measures.

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


def recorded_costs(path: str, drafter: str, batch: int = 1) -> list[float]:
    """The ``predicted_step_ms`` of the record of ``drafter`` at ``batch`` with K chosen per step."""
    for line in open(path):
        r = json.loads(line)
        if r.get("drafter") == drafter and r.get("batch") == batch and r.get("num_speculative_tokens") == "auto":
            return [float(t) for t in r["predicted_step_ms"]]
    raise ValueError(f"{path}: no batch-{batch} record of drafter {drafter!r} with num_speculative_tokens='auto'")


def run(costs_ms: list[float], drafter: str, prompts: list[str], max_new: int, ks: list, batch: int = 1) -> list[dict]:
    """One row per K of ``ks`` (ints and ``"auto"``): its speedup over plain decoding at ``costs_ms``,
    the prompts in batches of ``batch`` (left-padded; a batch runs until its longest row ends)."""
    model, tok = zoo.load("gdn-target")
    fixed = FixedCosts(lambda strategy, B, K: costs_ms[K] * 1e-3)
    rows = []
    for K in ks:
        sd = specdec.wrap(model, drafter=drafter, num_speculative_tokens=K, rollback="replay", decode_path="eager",
                          max_speculative_tokens=len(costs_ms) - 1, cost_model=fixed if K == "auto" else None)
        charged, plain, hist = 0.0, 0.0, [0] * len(costs_ms)
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
            out = sd.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=max_new,
                              do_sample=False)
            st = sd.last_stats
            for k in st.k_per_step or [K] * st.steps:
                hist[k] += 1
                charged += costs_ms[k]
            plain += (out.shape[1] - enc.input_ids.shape[1] - 1) * costs_ms[0]  # (the first new token: the prefill's)
        rows.append({"K": K, "vs_plain": plain / charged, "steps": sum(hist), "k_histogram": hist})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--costs", help="step ms for K = 0..M, comma-separated")
    src.add_argument("--from-results", help="results.jsonl of an experiment=bench run with num_speculative_tokens=auto")
    p.add_argument("--drafter", default="ngram", help="a drafter specdec.wrap takes by name (default ngram)")
    p.add_argument("--prompts", type=int, default=12, help="the zoo's first N prompts (default 12)")
    p.add_argument("--max-new", type=int, default=192)
    p.add_argument("--batch", type=int, default=1, help="prompts per generate() call (default 1)")
    p.add_argument("--ks", default="0,2,4,6,auto", help="fixed K and/or auto, comma-separated")
    args = p.parse_args(argv)
    if args.batch < 1 or args.prompts < 1 or args.max_new < 2:
        raise SystemExit(f"--batch, --prompts: >= 1, --max-new: >= 2 (the first new token is the prefill's); got "
                         f"{args.batch}, {args.prompts}, {args.max_new}")
    try:
        costs = [float(t) for t in args.costs.split(",")] if args.costs else None
        ks = [k if k == "auto" else int(k) for k in (k.strip() for k in args.ks.split(","))]
    except ValueError as err:
        raise SystemExit(f"policy_on_zoo.py: {err} (--costs: ms for K = 0..M, comma-separated; --ks: fixed K and/or "
                         "auto, comma-separated)") from None
    if costs is None:
        try:
            costs = recorded_costs(args.from_results, args.drafter, args.batch)
        except (OSError, ValueError, KeyError) as err:  # (json.JSONDecodeError is a ValueError)
            raise SystemExit(f"policy_on_zoo.py: --from-results: {err}") from None
    if len(costs) < 2 or min(costs) <= 0:
        raise SystemExit(f"--costs: at least K = 0 and 1, every time > 0 ms; got {costs}")
    if any(k != "auto" and not 0 <= k < len(costs) for k in ks):
        raise SystemExit(f"--ks: each K in [0, {len(costs) - 1}] (the costs given) or 'auto'; got {args.ks}")
    torch.manual_seed(0)
    prompts = [p["prompt"] for p in zoo.prompts(limit=args.prompts)]
    print(f"drafter {args.drafter}, {len(prompts)} zoo prompts x {args.max_new} new tokens in batches of {args.batch}, "
          f"step ms {[round(t, 3) for t in costs]}\n")
    print("| K | vs plain decoding | steps | K histogram |\n|---|---:|---:|---|")
    for r in run(costs, args.drafter, prompts, args.max_new, ks, args.batch):
        print(f"| {r['K']} | {r['vs_plain']:.3f} | {r['steps']} | {r['k_histogram']} |", flush=True)


if __name__ == "__main__":
    main()
