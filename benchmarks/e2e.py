"""End-to-end decode speed on one GPU (issue 7): HF generate() vs specdec plain vs speculative.

Models:

* the bench shapes of ``shared/bench_models.md`` with random weights (``qwen35-4b-shape``:
  Gated DeltaNet hybrid, ``nemotronh-4b-shape``: Mamba-2 hybrid; configs from ``conf/model``),
  with the controlled-acceptance :class:`specdec.drafters.OracleDrafter`: it proposes the
  target's own plain greedy continuation (from the specdec-plain row of the same run), each
  token corrupted with probability 1 - a, so acceptance is fixed and known (a = 0.6, 0.8);
* the zoo's ``gdn-target`` with its real drafters (the ``gdn-draft`` model and n-gram) on the
  held-out 128-token prompts.

Rows per model and batch: HF ``generate()`` plain greedy (fastest configuration on the
machine: flash-linear-attention when installed), specdec plain (``num_speculative_tokens=0``,
same engine and decode path), and specdec speculative with each rollback strategy. Every
speculative output is compared with the specdec-plain output of the same run (bf16:
divergences happen only where the T-token verify and the 1-token step round differently near
a tie; they are counted, not hidden). Times are wall-clock per ``generate()`` call (prefill
included) after one warm-up call of the same shape (which captures the CUDA graphs); the
phase split comes from ``Stats`` (CUDA events). Peak memory: ``torch.cuda.max_memory_allocated``.

    python benchmarks/e2e.py --out e2e.jsonl                     # on the GPU: everything
    python benchmarks/e2e.py --report e2e.jsonl --md e2e.md --plot e2e.png   # table + plot
    python benchmarks/e2e.py --device cpu --tiny --out /tmp/e2e.jsonl        # CPU smoke run

Records are appended to ``--out`` (JSON lines) as they are measured, so a run cut short keeps
what it finished.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

import specdec
from specdec.drafters import DraftModelDrafter, OracleDrafter

STRATEGIES = ("snapshot", "ring", "replay")


# ----------------------------------------------------------------------------------- models
def bench_model(name: str, device, dtype, layers: int | None, tiny: bool, damp: float | None = None):
    """A random-weight bench-shaped model from ``conf/model/<name>.yaml`` (or a tiny one)."""
    import transformers
    import yaml

    spec = yaml.safe_load(open(os.path.join(ROOT, "conf", "model", f"{name}.yaml")))["targets"][0]
    cfg = dict(spec["config"])
    if tiny:  # same family and layer pattern, toy sizes: CPU smoke runs
        if "layer_types" in cfg:
            cfg.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, intermediate_size=128, vocab_size=512)
            cfg["layer_types"] = cfg["layer_types"][:4]
            cfg["num_hidden_layers"] = 4
        else:
            cfg.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=16, n_groups=2, intermediate_size=128, vocab_size=512)
            cfg["hybrid_override_pattern"] = "M-M*-"
            cfg["num_hidden_layers"] = 5
    elif layers:
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
            cfg["num_hidden_layers"] = layers
        else:
            cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:layers]
            cfg["num_hidden_layers"] = layers
    config = getattr(transformers, spec["config_class"])(**cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, spec["model_class"])._from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    if damp is not None:
        damp_residual_branches(model, damp)
    return model.eval()


def damp_residual_branches(model, factor: float) -> int:
    """Scale the output projection of every block (attention ``o_proj``, SSM ``out_proj``, MLP
    ``down_proj``) by ``factor``. Speed does not depend on the weights' values; but with the
    default random init the top-2 logit gap is within bf16 rounding noise every few tokens, so a
    T-token verify and a 1-token step (different GEMM tilings) pick different argmaxes and the
    oracle's reference is useless after a few tokens. A damped residual branch makes each greedy
    choice depend mostly on the (exact) embedding path, so flips become rare."""
    n = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("o_proj", "out_proj", "down_proj") and hasattr(mod, "weight"):
                mod.weight.mul_(factor)
                n += 1
        # an untied LM head gets the embedding's values (kept as its own tensor: the same bytes
        # are read): with the near-identity residual stream each token's own row then wins by a
        # margin of ~sqrt(hidden) over the rest, far above bf16 noise
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != emb.weight.data_ptr():
            head.weight.copy_(emb.weight)
    return n


def zoo_model(name, device, dtype):
    from transformers import AutoModelForCausalLM

    path = os.path.join(ROOT, "specdec", "zoo", name)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).to(device).eval()


def zoo_prompts(batch, device):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(ROOT, "specdec", "zoo", "tokenizer"))
    tok.padding_side = "left"
    lines = open(os.path.join(ROOT, "specdec", "data", "prompts", "code_128.jsonl")).read().splitlines()
    texts = [json.loads(x)["prompt"] for x in lines]
    texts = (texts * (batch // len(texts) + 1))[:batch]
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device), tok.pad_token_id


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def cuda_median_ms(fn, repeat: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (CUDA events), after ``warmup`` calls."""
    times = []
    for i in range(warmup + repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= warmup:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def copy_bandwidth(device) -> float | None:
    """Measured device-to-device copy bandwidth in bytes/s (read + write), median of 10."""
    if device.type != "cuda":
        return None
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = cuda_median_ms(lambda: b.copy_(a))  # the 4 GiB are freed on return
    return 2 * 2 * 1024**3 / (ms / 1e3)


# ----------------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat, warm=None):
    """(output of the last call, list of wall seconds) after one warm-up call (``warm`` or ``fn``)."""
    out = (warm or fn)()
    walls = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
    return out, walls


def peak_gib(device):
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def divergence(out, ref, prompt_width):
    """Rows whose generated tokens differ from the reference, and the first differing position of each."""
    a, b = out[:, prompt_width:], ref[:, prompt_width:]
    n = min(a.shape[1], b.shape[1])
    diff = a[:, :n] != b[:, :n]
    rows = diff.any(1)
    first = [int(d.nonzero()[0, 0]) for d in diff[rows]]
    return int(rows.sum()), first


@torch.no_grad()
def divergence_margins(model, out, ref, mask, prompt_width):
    """For each diverged row: the target's top-2 logit margin at its first divergence, from one
    teacher-forced forward over the reference prefix (a diagnostic: a recomputed forward, not the
    plain run's own logits). A small margin in bf16 means a near-tie (DESIGN.md allows those)."""
    a, b = out[:, prompt_width:], ref[:, prompt_width:]
    n = min(a.shape[1], b.shape[1])
    margins = []
    for r in (a[:, :n] != b[:, :n]).any(1).nonzero().flatten().tolist():
        pos = prompt_width + int((a[r, :n] != b[r, :n]).nonzero()[0, 0])
        row_mask = torch.cat([mask[r:r + 1], mask.new_ones(1, ref.shape[1] - mask.shape[1])], dim=1)[:, :pos]
        logits = model(input_ids=ref[r:r + 1, :pos], attention_mask=row_mask).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        margins.append(round(float(top[0] - top[1]), 4))
    return margins


class Recorder:
    def __init__(self, path, meta):
        self.path, self.meta = path, meta
        self.t0 = time.perf_counter()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def __call__(self, **rec):
        rec = {**self.meta, **rec, "t_s": round(time.perf_counter() - self.t0, 1)}
        line = json.dumps(rec)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def run_specdec(model, ids, mask, new, K, drafter, strategy, device, repeat, decode_path):
    from specdec.graphs import bucket_length

    sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K, decode_path=decode_path)
    L, T = ids.shape[1], K + 1
    # the warm-up (graph capture) generates fewer tokens in the same shape bucket; a draft model's
    # static buffers are sized by the run's max length, so its warm-up runs the full length (a
    # shorter one left its capture and compile to the timed run: the first draft row ran 3x slower)
    warm_new = max(1, min(new, bucket_length(L + new + 2 * T) - 255 - L - 2 * T))
    if isinstance(drafter, DraftModelDrafter):
        warm_new = new
    out, walls = timed(lambda: sd.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0), device, repeat,
                       warm=lambda: sd.generate(ids, attention_mask=mask, max_new_tokens=warm_new, pad_token_id=0))
    st = sd.last_stats
    steps_t = st.draft_s + st.verify_s + st.rollback_s
    res = dict(
        wall_s=statistics.median(walls), steps=st.steps, new_tokens=st.new_tokens,
        mean_accepted_tokens=st.mean_accepted_tokens, acceptance_rate=st.acceptance_rate,
        ms_per_step=1e3 * (st.wall_s - st.prefill_s) / max(st.steps, 1),
        draft_share=st.draft_s / steps_t if steps_t else 0.0, verify_share=st.verify_s / steps_t if steps_t else 0.0,
        rollback_share=st.rollback_s / steps_t if steps_t else 0.0, decode_path=st.decode_path,
        prefill_s=st.prefill_s, peak_gib=peak_gib(device),
    )
    res["tokens_per_s"] = res["new_tokens"] / res["wall_s"]
    sd.release()  # free the static buffers and graphs now
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, res


def run_hf(model, ids, mask, new, device, repeat, pad):
    def call():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad,
                              min_new_tokens=new)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up
    out, walls = timed(call, device, repeat - 1 if repeat > 1 else 1)
    w = statistics.median(walls)
    return out, dict(wall_s=w, new_tokens=ids.shape[0] * new, tokens_per_s=ids.shape[0] * new / w,
                     ms_per_step=1e3 * w / new, mean_accepted_tokens=1.0, peak_gib=peak_gib(device), decode_path="hf")


# ----------------------------------------------------------------------------------- main runs
def bench_random(name, args, device, dtype, rec):
    model = bench_model(name, device, dtype, args.layers, args.tiny, args.damp)
    wb = weight_bytes(model)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    for B in args.batches:
        ids = torch.randint(10, min(V, 8192), (B, args.prompt_len), generator=g).to(device)
        mask = torch.ones_like(ids)
        common = dict(model=name, batch=B, K=args.K, new=args.new, weight_bytes=wb)
        ref, res = run_specdec(model, ids, mask, args.new, 0, "ngram", "replay", device, args.repeat, args.decode_path)
        rec(row="specdec plain", strategy="-", acceptance=None, **common, **res)
        if not args.skip_hf:
            _, res = run_hf(model, ids, mask, args.hf_new, device, args.repeat, 0)
            rec(row="HF generate", strategy="-", acceptance=None, **{**common, "new": args.hf_new}, **res)
        for a in args.acceptance:
            for strat in args.strategies:
                drafter = OracleDrafter(ref, mask, acceptance=a, seed=7)
                out, res = run_specdec(model, ids, mask, args.new, args.K, drafter, strat, device, args.repeat,
                                       args.decode_path)
                nd, first = divergence(out, ref, ids.shape[1])
                margins = divergence_margins(model, out, ref, mask, ids.shape[1]) if nd else []
                rec(row="specdec spec", strategy=strat, acceptance=a, diverged_rows=nd, first_divergence=first,
                    divergence_margins=margins, **common, **res)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_zoo(args, device, dtype, rec):
    target = zoo_model("gdn-target", device, dtype)
    draft = zoo_model("gdn-draft", device, dtype)
    for B in args.zoo_batches:
        ids, mask, pad = zoo_prompts(B, device)
        common = dict(model="gdn-target (zoo)", batch=B, K=args.K, new=args.new, weight_bytes=weight_bytes(target))
        ref, res = run_specdec(target, ids, mask, args.new, 0, "ngram", "replay", device, args.repeat, args.decode_path)
        rec(row="specdec plain", strategy="-", acceptance=None, drafter="-", **common, **res)
        if not args.skip_hf:
            _, res = run_hf(target, ids, mask, args.hf_new, device, args.repeat, pad)
            rec(row="HF generate", strategy="-", acceptance=None, drafter="-", **{**common, "new": args.hf_new}, **res)
        for dname in ("draft model", "ngram"):
            for strat in args.strategies:
                drafter = DraftModelDrafter(draft) if dname == "draft model" else "ngram"
                out, res = run_specdec(target, ids, mask, args.new, args.K, drafter, strat, device, args.repeat,
                                       args.decode_path)
                nd, first = divergence(out, ref, ids.shape[1])
                margins = divergence_margins(target, out, ref, mask, ids.shape[1]) if nd else []
                rec(row="specdec spec", strategy=strat, acceptance=None, drafter=dname, diverged_rows=nd,
                    first_divergence=first, divergence_margins=margins, **common, **res)


# ----------------------------------------------------------------------------------- report
def report(path, md_path, plot_path):
    recs = [json.loads(x) for x in open(path) if x.strip()]
    meta = recs[0] if recs else {}
    lines = [f"Device: {meta.get('device')}; date {meta.get('date')}; torch {meta.get('torch')}; "
             f"copy bandwidth {meta.get('copy_gbps')} GB/s; command: `{meta.get('command')}`", ""]
    lines += [("| model | batch | row | strategy | accept. | tokens/s | decode tokens/s | ms/step | mean acc. | "
               "vs plain (decode) | vs HF | draft/verify/rollback % | peak GiB | path | diverged rows |"),
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|"]

    def decode_tps(r):  # new tokens / (wall - prefill): the decode loop alone (HF: the whole call)
        return r["new_tokens"] / (r["wall_s"] - r["prefill_s"]) if r.get("prefill_s") else r["tokens_per_s"]

    base, base_dec = {}, {}
    for r in recs:
        if r["row"] in ("specdec plain", "HF generate"):
            base[(r["model"], r["batch"], r["row"])] = r["tokens_per_s"]
            base_dec[(r["model"], r["batch"], r["row"])] = decode_tps(r)
    for r in recs:
        key = (r["model"], r["batch"])
        plain = base_dec.get((*key, "specdec plain"))
        hf = base.get((*key, "HF generate"))
        vs_plain = f"{decode_tps(r) / plain:.2f}x" if plain else "-"
        vs_hf = f"{r['tokens_per_s'] / hf:.2f}x" if hf else "-"
        split = "-"
        if "draft_share" in r:
            split = f"{100 * r['draft_share']:.0f}/{100 * r['verify_share']:.0f}/{100 * r['rollback_share']:.0f}"
        acc = r.get("acceptance")
        label = r.get("drafter") if r.get("drafter") not in (None, "-") else ("oracle" if acc is not None else "")
        strat = r["strategy"] + (f" ({label})" if label and r["row"] == "specdec spec" else "")
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['row']} | {strat} | {acc if acc is not None else '-'} | "
            f"{r['tokens_per_s']:.0f} | {decode_tps(r):.0f} | {r['ms_per_step']:.2f} | {r['mean_accepted_tokens']:.2f} | {vs_plain} | "
            f"{vs_hf} | {split} | {peak} | {r.get('decode_path', '-')} | {r.get('diverged_rows', '-')} |"
        )
    text = "\n".join(lines) + "\n"
    if md_path:
        open(md_path, "w").write(text)
    print(text)
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        models = sorted({r["model"] for r in recs if r.get("acceptance") is not None})
        fig, axes = plt.subplots(1, max(len(models), 1), figsize=(5.5 * max(len(models), 1), 4), squeeze=False)
        for ax, m in zip(axes[0], models):
            for a, style in ((0.8, "-"), (0.6, "--")):
                for strat in STRATEGIES:
                    pts = sorted((r["batch"], decode_tps(r) / base_dec[(m, r["batch"], "specdec plain")])
                                 for r in recs if r["model"] == m and r.get("acceptance") == a
                                 and r["strategy"] == strat and (m, r["batch"], "specdec plain") in base_dec)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{strat}, a={a}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel("decode speedup over specdec plain")
            ax.set_title(m)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--models", default="qwen35-4b-shape,nemotronh-4b-shape,zoo")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--zoo-batches", default="1,16")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--hf-new", type=int, default=64, help="new tokens of the HF rows (HF is launch-bound, "
                    "its tokens/s does not depend on the length; fewer tokens keep the run short)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--acceptance", default="0.8,0.6")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--repeat", type=int, default=1, help="timed calls per row after the warm-up (median)")
    ap.add_argument("--layers", type=int, default=None, help="cut the bench models to their first N layers")
    ap.add_argument("--decode-path", default="auto")
    ap.add_argument("--damp", type=float, default=0.01, help="scale of the blocks' output projections in the "
                    "random-weight models (see damp_residual_branches); 1 = HF's init as is")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke run)")
    ap.add_argument("--out", default=None, help="JSON-lines file the records are appended to")
    ap.add_argument("--report", default=None, help="only build the table/plot from this JSON-lines file")
    ap.add_argument("--md", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    if args.report:
        report(args.report, args.md, args.plot)
        return
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    args.batches = [int(x) for x in args.batches.split(",") if x]
    args.zoo_batches = [int(x) for x in args.zoo_batches.split(",") if x]
    args.acceptance = [float(x) for x in args.acceptance.split(",") if x]
    args.strategies = [x for x in args.strategies.split(",") if x]
    bw = copy_bandwidth(device)
    meta = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        date=datetime.date.today().isoformat(), torch=torch.__version__, dtype=str(dtype),
        copy_gbps=round(bw / 1e9) if bw else None, command="python benchmarks/e2e.py " + " ".join(sys.argv[1:]),
    )
    try:
        import fla  # noqa: F401

        meta["fla"] = True
    except ImportError:
        meta["fla"] = False
    rec = Recorder(args.out, meta)
    for name in args.models.split(","):
        if name == "zoo":
            bench_zoo(args, device, dtype, rec)
        elif name:
            bench_random(name, args, device, dtype, rec)
    if args.md or args.plot:
        report(args.out, args.md, args.plot)


if __name__ == "__main__":
    main()
