"""Time hand-picked launch configurations of the rollback step kernels side by side, to choose the
defaults of ``_launch_config`` by measurement.

The step kernels update state in place, so they are never autotuned at run time (an autotuner
would run them several times on the same state); instead this script measures a short list of
hand-picked configurations -- state block (BV for GDN/KDA, BP for Mamba-2), ``num_warps`` and
``prefetch`` (tokens whose inputs are requested before the first arithmetic; 0 = each token's
inputs at its use), a :class:`specdec.kernels.LaunchConfig` of the op's Triton kernel set -- for
the per-layer step of the kernel table (``experiment=kernels``,
:func:`specdec.experiments.kernel_table.bench_point`: the library's strategy, verify + commit, CUDA
graph of 16 steps over rotated buffers), at its shapes and K. Every variant is compiled first in
parallel worker processes (Triton's on-disk cache), so the timing loop does not wait for the compiler.

    python benchmarks/sweep_rollback_configs.py --batches 1,64 --out sweep.md
    specdec-run experiment=kernels experiment.launch_from=sweep.json     # the table with the fastest

Output: one line per (op, batch, strategy, config) and, per (op, batch, strategy), the best
configuration and its time against the default one; JSON rows next to the Markdown.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from specdec.experiments.kernel_table import SHAPES, bench_point  # noqa: E402
from specdec.experiments.kernel_timing import BASELINE, LayerStep, copy_bandwidth, synthetic_params  # noqa: E402
from specdec.kernels import OPS, LaunchConfig  # noqa: E402

STRATEGIES = (BASELINE, "snapshot", "ring", "replay", "replay_deferred")
# (block, num_warps, prefetch); None = the default of _launch_config / all T tokens
CONFIGS = {  # (None, None, None) = the defaults; (16|32, 4, 0) = no input lookahead
    "delta": [(None, None, None), (16, 4, 0), (32, 4, 0), (16, 4, 5), (32, 4, 5), (32, 4, 3), (32, 8, 5),
              (16, 2, 5), (64, 4, 5), (8, 4, 5)],
    "mamba2": [(None, None, None), (16, 4, 0), (32, 4, 0), (16, 4, 5), (32, 8, 3), (32, 8, 5), (32, 8, 0),
               (32, 4, 5), (64, 8, 3), (8, 4, 5)],
}
KDA_CONFIGS = [(None, None, None), (16, 4, 0), (32, 4, 0), (32, 4, 5), (16, 4, 5), (16, 2, 5), (64, 4, 5)]


def configs_for(op, spec=None):
    """The configurations swept for ``op``: the hand-picked list, or ``spec`` (see :func:`parse_configs`)."""
    if spec is not None:
        return spec
    return KDA_CONFIGS if op == "kda" else CONFIGS["mamba2" if op == "mamba2" else "delta"]


def parse_configs(text: str) -> list:
    """``"def;16,2,5;8,1,5"`` -> ``[(None, None, None), (16, 2, 5), (8, 1, 5)]``: semicolon-separated
    ``block,num_warps,prefetch`` triples, ``def`` for a default (of ``_launch_config``) anywhere.

    Raises: ValueError for a triple that does not have three fields or has a non-integer field."""
    out = []
    for item in text.split(";"):
        item = item.strip()
        if item == "def":
            out.append((None, None, None))
            continue
        parts = [x.strip() for x in item.split(",")]
        if len(parts) != 3:
            raise ValueError(f"--configs entry {item!r}: expected block,num_warps,prefetch (or def), e.g. 16,2,5")
        try:
            out.append(tuple(None if x == "def" else int(x) for x in parts))
        except ValueError:
            raise ValueError(f"--configs entry {item!r}: fields must be integers or def") from None
    return out


def launch_of(cfg) -> LaunchConfig:
    block, warps, prefetch = cfg
    return LaunchConfig(block=block, num_warps=warps, prefetch=prefetch)


def cfg_name(cfg):
    block, warps, pf = cfg
    return f"block={block or 'def'} warps={warps or 'def'} prefetch={'def' if pf is None else pf}"


def triton_op(name: str, device: str, cfg):
    """The op on the Triton backend (on the CPU through the interpreter), launched with ``cfg``."""
    return OPS[name].on("triton", device).with_launch(launch_of(cfg))


def _compile_task(args):
    op, strategy, cfg, K, device, shapes = args
    gen = torch.Generator().manual_seed(0)
    shape = SHAPES[shapes][op]
    params = synthetic_params(shape, device, gen)
    st = LayerStep(triton_op(op, device, cfg), shape, strategy, 2, K + 1, params, device, gen, dtype=torch.bfloat16)
    n = torch.ones(2, dtype=torch.long, device=device)
    st.step(n)
    st.step(n)
    if device == "cuda":
        torch.cuda.synchronize()
    return op, strategy, cfg


def precompile(tasks, workers):
    """Compile every (op, strategy, config) in ``workers`` processes (fills Triton's disk cache)."""
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        for fut in cf.as_completed([ex.submit(_compile_task, t) for t in tasks]):
            fut.result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="gdn,mamba2,kda")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--configs", default=None,
                    help="configurations to sweep for every op instead of the hand-picked lists: "
                         "'def;16,2,5;8,1,5' (block,num_warps,prefetch; def = the default)")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--out", default="sweep_rollback_configs.md")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: interpreter smoke test (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--precompile-only", action="store_true", help="fill the compile cache and exit")
    ap.add_argument("--no-precompile", action="store_true", help="skip the parallel compile step")
    args = ap.parse_args(argv)
    try:
        spec = parse_configs(args.configs) if args.configs else None
    except ValueError as err:
        ap.error(str(err))
    ops = args.ops.split(",")
    batches = [int(x) for x in args.batches.split(",")]
    strategies = args.strategies.split(",")
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        ap.error(f"unknown strategy {bad[0]!r}; accepted: {', '.join(STRATEGIES)}")
    shapes = "tiny" if args.tiny else "bench"
    t0 = time.time()
    dev = args.device
    tasks = [(op, s, cfg, args.K, dev, shapes) for op in ops for s in strategies for cfg in configs_for(op, spec)]
    if not args.no_precompile:
        precompile(tasks, args.workers)
        print(f"precompiled {len(tasks)} variants in {time.time() - t0:.0f}s", flush=True)
    if args.precompile_only:
        return 0
    bw = copy_bandwidth(dev) / 1e9
    gen = torch.Generator().manual_seed(0)
    rows = []
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU interpreter"
    lines = [f"# Launch-config sweep ({name}), K = {args.K}", "",
             f"copy bandwidth {bw:.0f} GB/s; per layer and step, verify + commit; median of {args.reps} graph replays",
             "", "| op | batch | strategy | config | us/step | GB/s | % copy BW |", "|---|---:|---|---|---:|---:|---:|"]
    json_path = os.path.splitext(args.out)[0] + ".json"
    for B in batches:  # batch-major: the first batch given is measured for every op first
        for op in ops:
            shape = SHAPES[shapes][op]
            params = synthetic_params(shape, dev, gen)
            for s in strategies:
                for cfg in configs_for(op, spec):
                    r = bench_point(triton_op(op, dev, cfg), shape, s, B, args.K, dev, params=params, gen=gen,
                                    reps=args.reps)
                    rows.append(dict(op=op, batch=B, rollback=s, launch=list(cfg), config=cfg_name(cfg),
                                     us_per_step=r["us_per_step"], GBps=r["GBps"]))
                    line = (f"| {op} | {B} | {s} | {cfg_name(cfg)} | {r['us_per_step']:.1f} | {r['GBps']:.0f} "
                            f"| {100 * r['GBps'] / bw:.0f}% |")
                    lines.append(line)
                    print(line, f"({time.time() - t0:.0f}s)", flush=True)
                    with open(json_path, "w") as fh:  # as it goes (a time limit may stop us)
                        json.dump(rows, fh, indent=1)
    lines += ["", "## Best per (op, batch, strategy)", "",
              "| op | batch | strategy | best config | us | default us | best with prefetch 0 us |",
              "|---|---:|---|---|---:|---:|---:|"]
    for op in ops:
        for B in batches:
            for s in strategies:
                grp = [r for r in rows if r["op"] == op and r["batch"] == B and r["rollback"] == s]
                if not grp:
                    continue
                best = min(grp, key=lambda r: r["us_per_step"])
                default = next((r for r in grp if r["launch"] == [None, None, None]), None)
                old = [r["us_per_step"] for r in grp if r["launch"][2] == 0]
                lines.append(f"| {op} | {B} | {s} | {best['config']} | {best['us_per_step']:.1f} "
                             f"| {default['us_per_step'] if default else float('nan'):.1f} "
                             f"| {min(old) if old else float('nan'):.1f} |")
    md = "\n".join(lines) + "\n"
    with open(args.out, "w") as fh:
        fh.write(md)
    print(md)
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
