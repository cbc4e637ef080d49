"""Decode step time with the grouped step attention against transformers' ``sdpa`` (which copies
the KV cache per query head), side by side in one run.

    python benchmarks/step_attention.py --model nemotronh-4b-shape --batch 1,32,64 --columns 128,2048

For each batch B and prompt length L (the KV columns a step reads): plain greedy ``generate()``
of ``--new`` tokens on the CUDA-graph path (the default decode path on CUDA) with the step's
attention folded (:mod:`specdec.models.step_attention`) and with it switched off, alternating
(``time_side_by_side``, ``--repeats`` rounds after one warm-up round); prints the median decode
step (``Stats.verify_s / steps``) of each and their ratio, and checks both give the same tokens.
The models are the app's (``model=`` names of ``conf/model``, random weights at the benchmark
shapes). ``--device cpu --tiny`` is a smoke test on the zoo's tiny target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nemotronh-4b-shape")
    ap.add_argument("--batch", default="1,32,64")
    ap.add_argument("--columns", default="128,2048", help="prompt lengths (KV columns a step reads)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the zoo's tiny target (smoke test)")
    args = ap.parse_args(argv)
    import specdec
    from specdec.experiments.models import load_app_model
    from specdec.experiments.timing import time_side_by_side

    name = "gdn-target" if args.tiny else args.model
    model, dev = load_app_model(name, args.device)
    sd = specdec.wrap(model, num_speculative_tokens=0)
    grouped = sd.adapter._grouped_attention
    g = torch.Generator().manual_seed(0)
    print(f"{name}, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
          f"{len(grouped)} grouped-query attention config(s); decode step ms, median of {args.repeats}")
    for B in (int(b) for b in args.batch.split(",")):
        for L in (int(c) for c in args.columns.split(",")):
            ids = torch.randint(0, model.config.vocab_size, (B, L), generator=g).to(dev)
            steps: dict[str, list[float]] = {"grouped": [], "sdpa": []}

            def call(name):
                def run():
                    sd.adapter._grouped_attention = grouped if name == "grouped" else []
                    out = sd.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new)
                    steps[name].append(1e3 * sd.last_stats.verify_s / sd.last_stats.steps)
                    return out
                return run

            res = time_side_by_side({n: call(n) for n in steps}, args.repeats, dev, warmup=1)
            same = torch.equal(res["grouped"][1], res["sdpa"][1])
            a, b = (statistics.median(steps[n][1:]) for n in ("grouped", "sdpa"))  # [0]: the warm-up round
            print(f"B={B:3d} L={L:5d}: grouped {a:7.2f} ms, sdpa {b:7.2f} ms, sdpa/grouped {b / a:5.2f}x, "
                  f"same tokens: {same}", flush=True)
    sd.adapter._grouped_attention = grouped
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
