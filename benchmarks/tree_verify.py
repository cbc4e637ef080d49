"""Verify-step time of a Medusa draft tree against a chain of the same depth, per rollback strategy.

On the qwen35-4b-shape model (shared/bench_models.md: Qwen3.5-4B shapes, random bf16 weights;
``--layers`` keeps the first L layers of its 3 GDN : 1 attention pattern) it times, for each
strategy and batch size, one speculative step of

* ``chain``: K + 1 = 5 tokens (depth 4) on the default backend (Triton step kernels on CUDA),
* ``tree-16``: the ``"default"`` 16-node tree of depth 4 (specdec.tree.default_tree_paths) on the
  default backend (on CUDA the Triton tree kernels: SSM and conv per node from its parent),
* ``tree-64``: Medusa's 64-node ``mc_sim_7b_63`` (depth 4),
* ``chain-torch`` / ``tree-16-torch`` / ``tree-64-torch``: the same on the torch reference ops
  (CUDA only: on CPU the default backend already is torch),
* ``tree-16-loop``: tree-16 with the Triton kernels' runtime node loop (the default above
  ``TREE_UNROLL_MAX`` = 16 nodes) instead of unrolled nodes: what the unrolling buys,

as the target's verify forward (all layers, SSM per-node state or inputs, LM head; the tree with
its tree mask and parent-state SSM verify) and the commit of a depth-4 path (path compaction +
the strategy's commit). Medians of ``--steps`` timed steps after ``--warmup``, with
``torch.cuda.synchronize()`` around each phase; a fresh prefilled cache per configuration.

    python benchmarks/tree_verify.py --out tree_verify.md                 # GPU: qwen35-4b-shape (< 60 s)
    python benchmarks/tree_verify.py --variants chain tree-16 tree-16-torch tree-64 tree-64-torch \
        --strategies snapshot ring replay --max-seconds 500                # GPU: the full grid (minutes)
    python benchmarks/tree_verify.py --path cuda_graph --variants chain tree-16 tree-64 \
        --strategies snapshot replay --out tree_verify_graph.md          # GPU: on the CUDA-graph path
    python benchmarks/tree_verify.py --device cpu --tiny --out /tmp/t.md  # CPU smoke test (seconds)

``--path static`` / ``--path cuda_graph`` time the same step through the engine's fixed-shape
bucket (:class:`specdec.decoding.StaticDecoder`, what ``generate()`` runs on CUDA: the tree forward
and the path commit captured as CUDA graphs), where the eager path's host overhead is gone.

``--profile FILE`` adds one more step per configuration under ``torch.profiler`` and reports,
beside the timings, where the verify's time goes: host ops dispatched, host-side self time,
GPU kernels launched and the GPU's busy time (the sum of kernel durations). A step whose wall
time is far above its GPU busy time is host-bound; FILE gets each configuration's top host ops.

The default grid (snapshot and replay, batch 1 and 16, chain / tree-16 / tree-16-torch, 8 timed
steps) fits a minute on an H200 including Triton's first-launch compiles; ``--max-seconds`` skips
what is left, and every row is printed as soon as it is measured.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from specdec.experiments.models import build_random_shape  # noqa: E402
from specdec.models import adapter_for  # noqa: E402
from specdec.rollback import make_strategy  # noqa: E402
from specdec.decoding import EagerDecoder, StaticDecoder  # noqa: E402
from specdec.graphs import bucket_length  # noqa: E402
from specdec.tree import make_tree  # noqa: E402

DEPTH = 4
VARIANTS = ("chain", "chain-torch", "tree-16", "tree-16-torch", "tree-16-loop", "tree-64", "tree-64-torch")
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "vocab_size": 8192, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}


def model_spec(tiny: bool, layers: int):
    spec = OmegaConf.load(os.path.join(ROOT, "conf", "model", "qwen35-4b-shape.yaml")).targets[0]
    cfg = OmegaConf.to_container(spec.config)
    if tiny:
        cfg.update(TINY)
        layers = layers or 4
    n = layers or int(cfg["num_hidden_layers"])
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    cfg["num_hidden_layers"] = n
    cfg["layer_types"] = [pattern[i % 4] for i in range(n)]
    spec.config = cfg
    spec.name = "tiny-qwen35" if tiny else f"qwen35-4b-shape[{n} layers]"
    return spec


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_config(ad, device, strategy, batch, variant, spec, args, ids, mask):
    """(verify ms, commit ms, peak GiB) medians for one configuration."""
    T = spec.num_nodes if spec is not None else DEPTH + 1
    saved = os.environ.get("SPECDEC_BACKEND")
    if variant.endswith("-torch"):
        os.environ["SPECDEC_BACKEND"] = "torch"
    from specdec.kernels import triton_common

    unroll_max = triton_common.TREE_UNROLL_MAX
    if variant.endswith("-loop"):  # every tree takes the runtime node loop (read at each launch)
        triton_common.TREE_UNROLL_MAX = 0
    try:
        return _run_config(ad, device, strategy, batch, spec, args, ids, mask, T, saved)
    finally:
        triton_common.TREE_UNROLL_MAX = unroll_max


def profile_verify(verify_fn, toks, device):
    """One ``verify_fn(toks)`` under torch.profiler: (summary dict, top-host-ops table text).

    Summary: ``host_ops`` (top-level torch ops dispatched), ``host_ms`` (their summed self CPU
    time, profiler overhead included), ``kernels`` (GPU kernels launched: torch's and Triton's)
    and ``device_ms`` (summed kernel durations; NaN on CPU). The forward is a verify only: no
    commit follows it, so the cache must not be stepped again afterwards.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        verify_fn(toks)
        sync(device)
    events = prof.events()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None and e.name.startswith("aten::")]
    summary = {
        "host_ops": len(host),
        "host_ms": sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU) / 1e3,
        "kernels": len(gpu),
        "device_ms": sum(e.time_range.elapsed_us() for e in gpu) / 1e3 if device.type == "cuda" else float("nan"),
    }
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return summary, table


def _stepper(ad, device, strategy, batch, spec, args, ids, mask, T, saved):
    """(verify(tokens), commit(num_tokens, path), cache) of one configuration on ``args.path``:
    ``eager`` calls the adapter's forward (under the tree view for a tree) and the commit; ``static``
    / ``cuda_graph`` run the engine's :class:`~specdec.decoding.StaticDecoder` bucket (graphs captured
    on load for ``cuda_graph``)."""
    max_len = ids.shape[1] + (args.warmup + args.steps + 1) * (DEPTH + 1) + T + 8
    try:
        if args.path == "eager":
            dec = EagerDecoder(ad, make_strategy(strategy), batch, T, max_len, tree=spec)
        else:
            dec = StaticDecoder(ad, make_strategy(strategy), batch, T, bucket_length(max_len),
                                args.path == "cuda_graph", tree=spec)
        dec.prefill(ids, mask)  # captures the graphs (cuda_graph)
        if args.path == "cuda_graph" and dec.path != "cuda_graph":
            raise RuntimeError(f"CUDA-graph capture failed: {dec.capture_error}")
        return dec.forward, dec.commit, dec.cache
    finally:
        if saved is None:
            os.environ.pop("SPECDEC_BACKEND", None)
        else:
            os.environ["SPECDEC_BACKEND"] = saved


def _run_config(ad, device, strategy, batch, spec, args, ids, mask, T, saved):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    verify_fn, commit_fn, cache = _stepper(ad, device, strategy, batch, spec, args, ids, mask, T, saved)
    n = torch.full((batch,), DEPTH + 1, dtype=torch.long, device=device)
    path = None
    if spec is not None:  # commit the top-1 chain's path root -> depth 4 (node indices in BFS order)
        index = {p: i + 1 for i, p in enumerate(spec.paths)}
        path = torch.tensor([0] + [index[(0,) * d] for d in range(1, DEPTH + 1)], device=device).repeat(batch, 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    verify, commit = [], []
    for i in range(args.warmup + args.steps):
        toks = torch.randint(0, 8192, (batch, T), generator=g).to(device)
        sync(device)
        t0 = time.perf_counter()
        verify_fn(toks)
        sync(device)
        t1 = time.perf_counter()
        commit_fn(n, path)
        sync(device)
        t2 = time.perf_counter()
        if i >= args.warmup:
            verify.append(t1 - t0)
            commit.append(t2 - t1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    prof = None
    if args.profile:  # after the timed steps, so the profiler's overhead touches none of them
        prof = profile_verify(verify_fn, torch.randint(0, 8192, (batch, T), generator=g).to(device), device)
    del cache, verify_fn, commit_fn
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 1e3 * statistics.median(verify), 1e3 * statistics.median(commit), peak, prof


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same family (CPU smoke test)")
    ap.add_argument("--layers", type=int, default=0, help="keep the first L layers (0: all 32; tiny: 4)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--strategies", nargs="+", default=["snapshot", "replay"])
    ap.add_argument("--variants", nargs="+", default=["chain", "tree-16", "tree-16-torch"], choices=VARIANTS,
                    help="*-torch: the torch reference ops (CUDA only; skipped on CPU)")
    ap.add_argument("--path", default="eager", choices=["eager", "static", "cuda_graph"],
                    help="eager: the adapter's forward; static / cuda_graph: the engine's fixed-shape bucket, "
                         "without / with CUDA graphs (cuda_graph needs CUDA)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens prefilled before the steps")
    ap.add_argument("--max-seconds", type=float, default=50.0, help="skip the remaining configurations after this")
    ap.add_argument("--out", default=None, help="also write the Markdown table to this file")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="profile one more verify per configuration: host ops, host ms, GPU kernels and GPU busy ms "
                         "as table columns; each configuration's top host ops into FILE")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.path == "cuda_graph" and args.device == "cpu":
        ap.error("--path cuda_graph needs --device cuda; use --path static on the CPU")
    start = time.perf_counter()
    if args.device == "cpu":
        torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    mspec = model_spec(args.tiny, args.layers)
    model, _ = build_random_shape(mspec, device, dtype)
    ad = adapter_for(model)
    trees = {"tree-16": make_tree("default", num_heads=DEPTH), "tree-64": make_tree("medusa-63", num_heads=DEPTH)}
    variants = [(name, trees.get(name.removesuffix("-torch").removesuffix("-loop"))) for name in args.variants
                if device.type == "cuda" or not name.endswith("-torch")]
    rows, skipped, profiles = [], [], []
    for strategy in args.strategies:
        for batch in args.batch:
            g = torch.Generator(device="cpu").manual_seed(batch)
            ids = torch.randint(0, 8192, (batch, args.prompt), generator=g).to(device)
            mask = torch.ones_like(ids)
            base = None
            for name, spec in variants:
                if time.perf_counter() - start > args.max_seconds:
                    skipped.append(f"{strategy}/B{batch}/{name}")
                    continue
                v, c, peak, prof = run_config(ad, device, strategy, batch, name, spec, args, ids, mask)
                base = v if name == "chain" else base
                T = spec.num_nodes if spec is not None else DEPTH + 1
                rows.append((strategy, batch, name, T, v, c, v / base if base else float("nan"), peak,
                             prof[0] if prof else None))
                extra = ""
                if prof:
                    p = prof[0]
                    extra = (f"  [profiled: {p['host_ops']} host ops, {p['host_ms']:.2f} host ms, {p['kernels']} "
                             f"kernels, {p['device_ms']:.2f} GPU ms]")
                    profiles.append(f"## {strategy} B={batch} {name} (T={T})\n\n{extra.strip(' []')}\n\n```\n"
                                    f"{prof[1]}\n```\n")
                print(f"  {strategy:9s} B={batch:<3d} {name:14s} T={T:<3d} verify {v:8.2f} ms  commit {c:7.3f} ms  "
                      f"({time.perf_counter() - start:.0f} s){extra}", flush=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"Tree vs chain verify step: {mspec.name}, {str(dtype).replace('torch.', '')}, {gpu}, "
        f"{args.prompt}-token prompt, {args.path} path, median of {args.steps} steps ({datetime.date.today()}; "
        f"{time.perf_counter() - start:.0f} s). Depth 4 everywhere; chain = 5 tokens; chain and tree-N on the "
        + "default backend (CUDA: Triton step / tree kernels), *-torch on the torch reference ops. Peak GiB: "
        + "torch.cuda.max_memory_allocated during the configuration, weights included.",
        "",
        "| strategy | batch | variant | step tokens | verify ms | commit ms | verify / chain | peak GiB |"
        + (" host ops | host ms | GPU kernels | GPU busy ms |" if args.profile else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if args.profile else ""),
    ]
    if args.profile:
        lines[0] += (" Profiled columns: one extra verify under torch.profiler (host ms includes the profiler's "
                     "overhead; GPU busy ms = summed kernel durations).")
    for s, b, name, T, v, c, r, peak, p in rows:
        peak_s = "-" if math.isnan(peak) else f"{peak:.1f}"
        line = f"| {s} | {b} | {name} | {T} | {v:.2f} | {c:.3f} | {r:.2f}x | {peak_s} |"
        if p is not None:
            dev = "-" if math.isnan(p["device_ms"]) else f"{p['device_ms']:.2f}"
            line += f" {p['host_ops']} | {p['host_ms']:.2f} | {p['kernels']} | {dev} |"
        lines.append(line)
    if skipped:
        lines.append("")
        lines.append(f"Skipped after --max-seconds={args.max_seconds:g}: {', '.join(skipped)}")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    if args.profile:
        with open(args.profile, "w") as f:
            f.write(f"# Top host ops per configuration (torch.profiler, one verify each)\n\n{lines[0]}\n\n"
                    + "\n".join(profiles))


if __name__ == "__main__":
    main()
