"""Per-layer SSM verify time of a Medusa draft tree against a chain of the same depth (Triton kernels).

``specdec-run experiment=tree_verify`` times the whole target forward, where host overhead
(eager path) and the non-SSM layers weigh in; this script isolates what tree verification adds
inside the SSM layers. For each op at the kernel table's shapes
(:data:`specdec.experiments.kernel_table.SHAPES`: Mamba-2 like Nemotron-H, GDN like Qwen3.5, KDA
like Kimi-Linear; bf16 inputs, fp32 state), each rollback strategy's verify through the library
(:class:`specdec.experiments.kernel_timing.LayerStep` on the op's Triton kernels; snapshot:
per-node states into a buffer; ring: per-node states into the ring; replay: the fused-fold
verify, from a checkpoint plus 3 committed history tokens, writing per-node inputs only) runs on

* ``chain``: K + 1 = 5 tokens (depth 4);
* ``tree-16``: Medusa's "default" 16-node tree (depth 4), nodes unrolled in the kernel;
* ``tree-16-loop``: the same tree walked by the runtime node loop (``LaunchConfig(tree_loop=True)``);
* ``tree-64``: Medusa's 64-node ``mc_sim_7b_63`` tree (depth 4), runtime node loop (the default
  above ``TREE_UNROLL_MAX`` = 16 nodes).

Time: median per layer and verify call, from a CUDA graph of ``ROUNDS`` calls over rotated
copies of the buffers (the working set exceeds L2; :func:`specdec.experiments.kernel_timing.time_in_graph`).
Each verify's step is discarded, not committed (a tree's commit compacts the accepted path
first: ``experiment=tree_verify`` times it).

    python benchmarks/tree_kernels.py --out tree_kernels.md        # H200 (about a minute)
    python benchmarks/tree_kernels.py --device cpu --tiny --batches 1   # smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from specdec.experiments.kernel_table import ROT_BYTES, SHAPES  # noqa: E402
from specdec.experiments.kernel_timing import LayerStep, synthetic_params, time_in_graph  # noqa: E402
from specdec.kernels import OPS, LaunchConfig  # noqa: E402
from specdec.tree import make_tree  # noqa: E402

STRATEGIES = ("snapshot", "ring", "replay")
VARIANTS = ("chain", "tree-16", "tree-16-loop", "tree-64")
COMMITTED = 3  # history tokens the fused replay verify folds in (a typical accepted count)
ROUNDS = 16  # verify calls per graph


def variant_tree(name):
    """(parents or None, tree_loop or None) of a variant."""
    if name == "chain":
        return None, None
    parents = tuple(make_tree("default" if name.startswith("tree-16") else "medusa-63", num_heads=4).parents)
    return parents, (True if name.endswith("-loop") else None)


def time_verify(op, shape, strategy, B, parents, device, reps, gen) -> float:
    """Seconds per verify call: ``ROUNDS`` calls over rotated layer steps, each verify then discarded."""
    params = synthetic_params(shape, device, gen)

    def layer():
        return LayerStep(op, shape, strategy, B, 5, params, device, gen, dtype=torch.bfloat16, parents=parents,
                         prime=COMMITTED)

    first = layer()
    n_rot = max(1, min(8, math.ceil(ROT_BYTES / max(1, first.nbytes())))) if device == "cuda" else 1
    sets = [first] + [layer() for _ in range(n_rot - 1)]

    def run():
        for _ in range(ROUNDS):
            for st in sets:
                st.verify()
                st.discard()

    sec = time_in_graph(run, ROUNDS * len(sets), device, reps)
    del sets, first
    if device == "cuda":
        torch.cuda.empty_cache()
    return sec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="gdn,mamba2,kda")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke test)")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    args = ap.parse_args(argv)
    for name, given, known in (("strategy", args.strategies, STRATEGIES), ("variant", args.variants, VARIANTS)):
        bad = [x for x in given.split(",") if x not in known]
        if bad:
            ap.error(f"unknown {name} {bad}; accepted: {', '.join(known)}")
    t_start = time.time()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in args.ops.split(","):
        shape = SHAPES["tiny" if args.tiny else "bench"][name]
        op = OPS[name].on("triton", args.device)  # on the CPU through Triton's interpreter
        for strategy in args.strategies.split(","):
            for B in (int(x) for x in args.batches.split(",")):
                base = None
                for variant in args.variants.split(","):
                    parents, loop = variant_tree(variant)
                    T = len(parents) if parents else 5
                    us = 1e6 * time_verify(op.with_launch(LaunchConfig(tree_loop=loop)), shape, strategy, B, parents,
                                           args.device, args.reps, gen)
                    base = us if variant == "chain" else base
                    rows.append((name, strategy, B, variant, T, us, us / base if base else float("nan")))
                    print(f"{name:7s} {strategy:9s} B={B:<3d} {variant:13s} T={T:<3d} {us:9.1f} us "
                          f"({time.time() - t_start:.0f} s)", flush=True)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU interpreter"
    lines = [f"Per-layer SSM verify, tree vs chain ({dev}; "
             f"`python benchmarks/tree_kernels.py {' '.join(argv if argv is not None else sys.argv[1:])}`). "
             "bf16 inputs, fp32 state; median per verify call (CUDA graph, rotated buffers); depth 4 everywhere; "
             "commit not included.", "",
             "| op | strategy | batch | variant | nodes | us / verify | vs chain | us / node |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for op, s, B, v, T, us, r in rows:
        lines.append(f"| {op} | {s} | {B} | {v} | {T} | {us:.1f} | {r:.2f}x | {us / T:.2f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
