"""Long low-precision runs (issue 9, item 5): N new tokens (default 2,048) in bf16 with each
rollback strategy, compared with plain greedy decoding of the same prompts in the same run.

Plain reference (``--reference``):

* ``engine`` (default, fast): specdec's own plain decoding (``num_speculative_tokens=0``) on
  ``decode_path="auto"`` (CUDA graphs on CUDA). Its top-2 logit margins come from one
  teacher-forced forward of each diverging row's prompt + plain text through the HF model in
  the run's dtype (the same prefix the plain run saw up to the divergence; the margin is the
  plain run's, up to the bf16 difference between a chunked prefill and step-by-step decoding);
* ``hf``: HF ``generate(output_scores=True)``: margins from its own scores (slow: eager HF decoding).

Divergences: greedy speculative vs plain tokens, per row the *first* divergence (position and
the plain run's top-2 margin there); after it the two texts differ, so later positions are not
compared (no re-sync). DESIGN.md allows a divergence only at a near-tie (margin < 0.25).
After each strategy's run it also checks that every stored SSM state (live, snapshot buffer,
ring, checkpoint) is fp32. Prints a ``PASS``/``FAIL`` line per strategy, an ``FP32-STATE`` line,
and a final ``LONG-RUN: PASS|FAIL`` line; writes a Markdown table to ``--out`` (rewritten after
every strategy, so a run cut short still reports; ``--max-seconds`` skips strategies that would
not fit the time left).

Drafters: ``oracle`` (default: the plain output corrupted at per-token rate ``1 - --acceptance``,
so every accepted count 0..K occurs; no draft forwards, fast), ``draft_model`` (the zoo's
gdn-draft, realistic acceptance; its drafting runs eagerly, launch-bound: several times
slower) or ``ngram``.
Models: a zoo model (default gdn-target) or a bench shape (``qwen35-4b-shape`` /
``nemotronh-4b-shape``, random weights, first ``--layers`` layers; drafter oracle or ngram).

    python benchmarks/long_run.py --out long_run.md                                # H200: < 1-2 min
    python benchmarks/long_run.py --drafter draft_model --out long_run_draft.md     # H200: minutes
    python benchmarks/long_run.py --tiny                                           # CPU smoke, seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import specdec
from specdec.drafters import DraftModelDrafter, OracleDrafter

NEAR_TIE = 0.25
STRATEGIES = "snapshot,ring,replay,replay_deferred"


def load_models(args, device, dtype):
    """(target, draft or None, tokenizer)."""
    from specdec import zoo

    if args.model in ("qwen35-4b-shape", "nemotronh-4b-shape"):
        if args.drafter == "draft_model":
            sys.exit("--drafter draft_model needs a zoo target (its draft is gdn-draft); use oracle or ngram")
        from cases_gpu import build_bench_model

        target, _ = build_bench_model(args.model, device, dtype, layers=args.layers or None, tiny=args.tiny)
        tok = zoo.load_tokenizer()
        draft = None
    else:
        target, tok = zoo.load(args.model, device=device, dtype=dtype)
        draft = zoo.load("gdn-draft", device=device, dtype=dtype)[0] if args.drafter == "draft_model" else None
    tok.padding_side = "left"
    for m in (target, draft):
        if m is not None:
            m.generation_config.eos_token_id = None  # every row runs the full length
    return target, draft, tok


def margins_teacher_forced(model, prompt_ids, gen_ids):
    """Top-2 logit margins ``[G]`` of ``model`` at each new-token position of one row (no padding):
    position j is predicted by the logits after ``prompt + gen[:j]``."""
    ids = torch.cat([prompt_ids, gen_ids])[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, prompt_ids.numel() - 1 : -1].float()
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).cpu()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny on CPU)")
    ap.add_argument("--model", default="gdn-target", help="zoo name or qwen35-4b-shape / nemotronh-4b-shape")
    ap.add_argument("--layers", type=int, default=8, help="bench shapes: first N layers (0: full depth)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per row (default 2048; --tiny: 24)")
    ap.add_argument("--prompts", type=int, default=None,
                    help="held-out 128-token prompts, one left-padded batch (default 4; --tiny: 2)")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--drafter", default=None, choices=["ngram", "draft_model", "oracle"],
                    help="oracle (default: fast, no draft forwards), draft_model (zoo gdn-draft; its drafting "
                         "runs eagerly, so a 2048-token run per strategy takes much longer) or ngram")
    ap.add_argument("--acceptance", type=float, default=0.8, help="oracle drafter: per-token acceptance")
    ap.add_argument("--strategies", default=STRATEGIES)
    ap.add_argument("--reference", default="engine", choices=["engine", "hf"],
                    help="plain reference: specdec K=0 on decode_path=auto (fast) or HF generate (slow)")
    ap.add_argument("--plain-rollback", default="ring", help="rollback strategy of the engine's K=0 reference")
    ap.add_argument("--decode-path", default="auto")
    ap.add_argument("--max-seconds", type=float, default=225.0,
                    help="skip strategies whose expected time would pass this wall time (0: no limit)")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test: defaults of 24 new tokens, 2 prompts, oracle drafter, fp32 on CPU; "
                         "bench shapes: their tiny stand-in")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="long_run.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.new is None:
        args.new = 24 if args.tiny else 2048
    if args.prompts is None:
        args.prompts = 2 if args.tiny else 4
    if args.drafter is None:
        args.drafter = "oracle"
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.float32 if args.tiny and device.type == "cpu" else torch.bfloat16)
    t_start = time.perf_counter()
    target, draft, tok = load_models(args, device, dtype)
    from specdec import zoo

    prompts = [p["prompt"] for p in zoo.prompts("128", limit=args.prompts)]
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    V = target.get_output_embeddings().weight.shape[0]
    if int(ids.max()) >= V:  # a tiny bench stand-in with a smaller vocabulary than the tokenizer's
        ids = torch.where(mask.bool(), 3 + ids % (V - 3), ids)
    L = ids.shape[1]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    # ---- plain reference
    print(f"plain greedy ({args.reference}): {ids.shape[0]} prompts x {args.new} tokens, {dtype} ...", flush=True)
    hf_margin = None
    sync(device)
    t0 = time.perf_counter()
    if args.reference == "hf":
        ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                              pad_token_id=pad, eos_token_id=None, output_scores=True, return_dict_in_generate=True)
        top2 = torch.stack([s.float().topk(2, dim=-1).values for s in ref.scores], 1)
        hf_margin = (top2[..., 0] - top2[..., 1]).cpu()  # [B, new]
        ref_full = ref.sequences
        plain_path = "hf generate"
    else:
        sd0 = specdec.wrap(target, drafter="ngram", rollback=args.plain_rollback, num_speculative_tokens=0,
                           decode_path=args.decode_path)
        ref_full = sd0.generate(ids, attention_mask=mask, max_new_tokens=args.new, pad_token_id=pad)
        plain_path = f"specdec K=0, {sd0.last_stats.decode_path}"
    sync(device)
    plain_s = time.perf_counter() - t0
    print(f"plain greedy took {plain_s:.1f} s ({plain_path})", flush=True)
    ref_ids = ref_full[:, L:].cpu()
    margin_cache: dict[int, torch.Tensor] = {}

    def margin_at(r, j):
        if hf_margin is not None:
            return float(hf_margin[r, j])
        if r not in margin_cache:
            with torch.no_grad():
                margin_cache[r] = margins_teacher_forced(target, ids[r][mask[r].bool()], ref_full[r, L:])
        return float(margin_cache[r][j])

    # ---- each strategy
    rows, ok_all, fp32_all, skipped = [], True, True, []
    last_dt = 0.0
    for strategy in [s for s in args.strategies.split(",") if s]:
        elapsed = time.perf_counter() - t_start
        if args.max_seconds and elapsed + 1.2 * last_dt > args.max_seconds:
            skipped.append(strategy)
            print(f"SKIP {strategy}: {elapsed:.0f} s elapsed, the last strategy took {last_dt:.0f} s; "
                  f"--max-seconds {args.max_seconds:.0f}", flush=True)
            continue
        if args.drafter == "draft_model":
            drafter = DraftModelDrafter(draft)
        elif args.drafter == "oracle":
            drafter = OracleDrafter(ref_full, mask, acceptance=args.acceptance, seed=0)
        else:
            drafter = "ngram"
        sd = specdec.wrap(target, drafter=drafter, rollback=strategy, num_speculative_tokens=args.K,
                          decode_path=args.decode_path)
        sync(device)
        t0 = time.perf_counter()
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=args.new, pad_token_id=pad)
        sync(device)
        last_dt = dt = time.perf_counter() - t0
        got = out[:, L:].cpu()
        events = []
        for r in range(got.shape[0]):
            n = min(got.shape[1], ref_ids.shape[1])
            diff = (got[r, :n] != ref_ids[r, :n]).nonzero()
            if diff.numel():
                j = int(diff[0, 0])
                events.append((r, j, margin_at(r, j)))
        bad = [e for e in events if e[2] >= NEAR_TIE]
        ok = not bad and got.shape == ref_ids.shape
        ok_all &= ok
        from cases_gpu import fp32_state_check

        ok32, names, bad32 = fp32_state_check(sd.last_cache)
        fp32_all &= ok32
        st = sd.last_stats
        print(f"{'PASS' if ok else 'FAIL'} {strategy}: {len(events)}/{got.shape[0]} rows diverged; first divergences "
              f"(row, position, plain top-2 margin) {[(r, j, round(m, 3)) for r, j, m in events]}; "
              f"{'fp32' if ok32 else 'NOT fp32 ' + '; '.join(bad32[:3])} states [{','.join(names)}]; "
              f"path {st.decode_path}, mean accepted {st.mean_accepted_tokens:.2f}, {dt:.1f} s", flush=True)
        rows.append((strategy, len(events), got.shape[0], events, st.mean_accepted_tokens, dt, st.decode_path,
                     ok32, names))
        write_table(args, argv, device, dtype, plain_s, plain_path, rows, skipped)
    n_div = sum(r[1] for r in rows)
    print(f"FP32-STATE: {'PASS' if fp32_all else 'FAIL'} -- every stored SSM state of "
          f"{', '.join(r[0] for r in rows)} is {'fp32' if fp32_all else 'NOT all fp32'}", flush=True)
    verdict = "PASS" if ok_all and fp32_all and not skipped and rows else "FAIL"
    print(f"LONG-RUN: {verdict} -- {len(rows)} strategies x {ids.shape[0]} rows x {args.new} tokens, {dtype}, "
          f"{n_div} (strategy, row) runs diverged, all at near-ties (< {NEAR_TIE}): {'yes' if ok_all else 'NO'}"
          + (f"; skipped (time): {','.join(skipped)}" if skipped else "")
          + f"; {time.perf_counter() - t_start:.0f} s", flush=True)
    write_table(args, argv, device, dtype, plain_s, plain_path, rows, skipped)
    return 0 if verdict == "PASS" else 1


def write_table(args, argv, device, dtype, plain_s, plain_path, rows, skipped):
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [
        (f"# Long run: {args.model}, {str(dtype).replace('torch.', '')}, {args.new} new tokens, K={args.K}, "
        f"drafter {args.drafter}, {dev}, {datetime.date.today()}"),
        "",
        f"`python benchmarks/long_run.py {' '.join(sys.argv[1:] if argv is None else argv)}`; plain reference: "
        f"{plain_path}, {plain_s:.1f} s. First divergence per row (no re-sync); margin = the plain run's top-2 "
        f"logit margin there" + (" (teacher-forced forward of the plain text)" if args.reference == "engine" else "")
        + ".",
        "",
        ("| strategy | rows diverged | first divergence (row: position, plain top-2 margin) | all at near-ties (< 0.25) "
        "| SSM states fp32 | decode path | mean accepted tokens | wall s |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for strategy, n, B, events, mat, dt, path, ok32, names in rows:
        ev = "; ".join(f"{r}: {j}, {m:.3f}" for r, j, m in events) or "none"
        lines.append(f"| {strategy} | {n}/{B} | {ev} | {'yes' if all(m < NEAR_TIE for _, _, m in events) else 'NO'} | "
                     f"{'yes' if ok32 else 'NO'} ({','.join(names)}) | {path} | {mat:.2f} | {dt:.1f} |")
    for s in skipped:
        lines.append(f"| {s} | skipped (time budget) | | | | | | |")
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
