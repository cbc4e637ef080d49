"""What a switch between step widths costs with K chosen per step: the rollback flush (replay
folds its input history into the state on entering plain steps and before a narrower step) and
the forward of the step after the switch, against the same step without one.

The zoo's ``gdn-target`` decodes its prompts one at a time through ``specdec.wrap`` with
``num_speculative_tokens="auto"``, ``rollback="replay"`` and each drafter given; every call of
:meth:`specdec.cache.HybridCache.flush` and :meth:`specdec.decoding.StaticDecoder.forward` is timed
with the device synchronised before and after it (host and device time of that call alone; the
synchronisation takes away the overlap of host and device that the decode loop has, so these are
not the loop's step times: ``experiment=bench`` measures those). Prints per drafter the flushes'
median and the forwards' medians in four groups: a plain step after a plain one, a plain step
after a speculative one (the switch), a speculative step after one of the same width, and one
after a wider step (the narrowing flush). A first call on the first prompt, not timed, calibrates
the policy's costs (when measured) and captures the graphs; steps that capture one later take seconds, which the
medians keep out.

    python benchmarks/switch_cost.py                      # CUDA: the CUDA-graph path, bf16
    python benchmarks/switch_cost.py --drafters ngram --prompts 8 --max-new 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec import zoo
from specdec.cache import HybridCache
from specdec.decoding import StaticDecoder

GROUPS = ("plain after plain", "plain after speculative", "speculative after the same width",
          "speculative after a wider step")


def _group(width: int, plain: bool, before: tuple | None) -> str | None:
    if before is None:
        return None
    if plain:
        return GROUPS[0] if before[1] else GROUPS[1]
    if before[1] or before[0] < width:
        return None  # (after a plain or a narrower step: no flush, not one of the groups)
    return GROUPS[2] if before[0] == width else GROUPS[3]


def measure(drafter: str, prompts: list[str], max_new: int, device: str, decode_path: str, cost_model=None) -> dict:
    """Time every flush and forward of ``drafter``'s calls (see the module docstring): returns
    ``{"flush_ms": [...], "forward_ms": {group: [...]}, "k_histograms": [per call], "outputs":
    [per call, the generated ids]}``. ``cost_model``: the policy's (None: measured)."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, tok = zoo.load("gdn-target", device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    flush_ms, forward_ms, before = [], {g: [] for g in GROUPS}, [None]
    real_flush, real_forward = HybridCache.flush, StaticDecoder.forward

    def flush(self):
        sync()
        t = time.perf_counter()
        real_flush(self)
        sync()
        flush_ms.append((time.perf_counter() - t) * 1e3)

    def forward(self, tokens, plain=False):
        sync()
        t = time.perf_counter()
        out = real_forward(self, tokens, plain)
        sync()
        width, plain = tokens.shape[1], self.runs_plain(tokens.shape[1], plain)
        group = _group(width, plain, before[0])
        if group is not None:
            forward_ms[group].append((time.perf_counter() - t) * 1e3)
        before[0] = (width, plain)
        return out

    HybridCache.flush, StaticDecoder.forward = flush, forward
    try:
        sd = specdec.wrap(model, drafter=drafter, num_speculative_tokens="auto", rollback="replay",
                          decode_path=decode_path, cost_model=cost_model)
        warm = tok([prompts[0]], return_tensors="pt").to(device)  # (calibrates a measured cost model; captures)
        sd.generate(**warm, max_new_tokens=max_new, pad_token_id=0)
        flush_ms.clear()
        for ms in forward_ms.values():
            ms.clear()
        hists, outputs = [], []
        for prompt in prompts:
            before[0] = None
            enc = tok([prompt], return_tensors="pt").to(device)
            outputs.append(sd.generate(**enc, max_new_tokens=max_new, pad_token_id=0))
            hists.append(sd.last_stats.k_histogram)
    finally:
        HybridCache.flush, StaticDecoder.forward = real_flush, real_forward
    return {"flush_ms": flush_ms, "forward_ms": forward_ms, "k_histograms": hists, "outputs": outputs}


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="ngram,mtp", help="drafters specdec.wrap takes by name, comma-separated")
    p.add_argument("--prompts", type=int, default=32, help="the zoo's first N prompts (default 32)")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.max_new < 2:
        raise SystemExit(f"--prompts: >= 1, --max-new: >= 2; got {args.prompts}, {args.max_new}")
    path = "cuda_graph" if args.device.startswith("cuda") else "static"
    prompts = [p["prompt"] for p in zoo.prompts(limit=args.prompts)]
    print(f"gdn-target, {args.device}, {path}, replay, K chosen per step; {len(prompts)} zoo prompts x "
          f"{args.max_new} new tokens, one per call; medians in ms, each call timed with the device synchronised\n")
    print("| drafter | flushes | flush | " + " | ".join(GROUPS) + " |\n|---|---:|---:|" + "---:|" * len(GROUPS))
    for drafter in args.drafters.split(","):
        r = measure(drafter.strip(), prompts, args.max_new, args.device, path)
        cells = [f"{_median(r['forward_ms'][g])} (n={len(r['forward_ms'][g])})" for g in GROUPS]
        print(f"| {drafter} | {len(r['flush_ms'])} | {_median(r['flush_ms'])} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
