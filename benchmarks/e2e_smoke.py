"""End-to-end smoke benchmark on one GPU: the zoo's gdn-target with its real drafters, eager path.

Times HF ``generate()`` (plain greedy) against specdec (n-gram and the gdn-draft model, each
rollback strategy) on the held-out 128-token prompts, batch 1 and a left-padded batch, in bf16
(or fp32 with --dtype float32), and checks every speculative output against plain greedy
decoding of the same run. This is the eager (no CUDA graph) path: launch-bound at these model
sizes, so it measures overheads rather than the memory-bound speed issue 7 targets.

    python benchmarks/e2e_smoke.py --out e2e_smoke.md [--device cuda] [--new 128] [--prompts 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import specdec  # noqa: E402
from specdec.drafters import DraftModelDrafter  # noqa: E402


def load(name, device, dtype):
    path = os.path.join(ROOT, "specdec", "zoo", name)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="batch size of the batched rows")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--out", default="e2e_smoke.md")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(ROOT, "specdec", "zoo", "tokenizer"))
    tok.padding_side = "left"
    prompts = [json.loads(line)["prompt"] for line in open(os.path.join(ROOT, "specdec", "data", "prompts", "code_128.jsonl"))]
    prompts = prompts[: max(args.prompts, args.batch)]
    target, draft = load("gdn-target", device, dtype), load("gdn-draft", device, dtype)
    pad = tok.pad_token_id
    rows = []

    def timed(fn):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        return out, time.perf_counter() - t0

    for batch in sorted({1, args.batch}):
        groups = [prompts[i : i + batch] for i in range(0, args.prompts if batch == 1 else batch, batch)]
        encs = [tok(g, return_tensors="pt", padding=True).to(device) for g in groups]
        target.generate(**encs[0], max_new_tokens=4, do_sample=False, pad_token_id=pad)  # warm-up
        plain = [timed(lambda e=e: target.generate(**e, max_new_tokens=args.new, do_sample=False, pad_token_id=pad))
                 for e in encs]
        # the plain run's logits, for the top-2 margin at any divergence (DESIGN.md: in bf16 a
        # divergence is allowed only where that margin is below 0.25)
        margins = []
        for e in encs:
            res = target.generate(**e, max_new_tokens=args.new, do_sample=False, pad_token_id=pad,
                                  output_scores=True, return_dict_in_generate=True)
            top2 = torch.stack([sc.float().topk(2, dim=-1).values for sc in res.scores], 1)  # [B, new, 2]
            margins.append(top2[..., 0] - top2[..., 1])
        plain_s = sum(t for _, t in plain)
        new_tokens = sum(int(o.shape[0]) * args.new for o, _ in plain)
        rows.append(dict(batch=batch, config="HF generate (plain)", tok_s=new_tokens / plain_s, speedup=1.0,
                         mean_acc=1.0, exact="ref", divergent_rows=0))
        for drafter_name in ("ngram", "draft_model"):
            for strategy in specdec.rollback.STRATEGIES:
                drafter = "ngram" if drafter_name == "ngram" else DraftModelDrafter(draft)
                sd = specdec.wrap(target, drafter=drafter, rollback=strategy, num_speculative_tokens=args.K)
                sd.generate(**encs[0], max_new_tokens=4, pad_token_id=pad)  # warm-up (compiles Triton kernels)
                outs, total, acc, div, near_tie, real = [], 0.0, [], 0, 0, []
                for (ref, _), e, marg in zip(plain, encs, margins):
                    out, t = timed(lambda e=e: sd.generate(**e, max_new_tokens=args.new, pad_token_id=pad))
                    total += t
                    acc.append(sd.last_stats.mean_accepted_tokens)
                    L = e["input_ids"].shape[1]
                    n = min(out.shape[1], ref.shape[1]) - L
                    for r in range(out.shape[0]):
                        diff = (out[r, L : L + n] != ref[r, L : L + n]).nonzero()
                        if diff.numel():
                            div += 1
                            j = int(diff[0, 0])
                            m = float(marg[r, j]) if j < marg.shape[1] else float("nan")
                            if m < 0.25:
                                near_tie += 1
                            else:
                                real.append((r, j, round(m, 3)))
                exact = "yes" if div == 0 else (f"near-ties only ({near_tie})" if not real else f"NO: {real[:3]}")
                rows.append(dict(batch=batch, config=f"specdec {drafter_name} / {strategy}", tok_s=new_tokens / total,
                                 speedup=plain_s / total, mean_acc=statistics.mean(acc), exact=exact,
                                 divergent_rows=div))
                print(rows[-1], flush=True)
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    head = (f"# e2e smoke: zoo gdn-target, {args.dtype}, K={args.K}, {args.new} new tokens, {dev_name}, "
            f"{datetime.date.today()}, backend={specdec.kernels.backend(device)}\n\n"
            f"`python benchmarks/e2e_smoke.py {' '.join(sys.argv[1:])}`\n\n"
            "| batch | configuration | tokens/s | speedup vs HF plain | mean accepted tokens | exact vs plain greedy (first divergence at a top-2 margin < 0.25 = near-tie) | rows diverged |\n"
            "|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['batch']} | {r['config']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {r['mean_acc']:.2f} | "
                   f"{r['exact']} | {r['divergent_rows']} |\n" for r in rows)
    with open(args.out, "w") as f:
        f.write(head + body)
    print(head + body)


if __name__ == "__main__":
    main()
