"""Per-layer SSM verify time of a Medusa draft tree against a chain of the same depth (Triton kernels).

``benchmarks/tree_verify.py`` times the whole target forward on the eager path, where host
overhead and the non-SSM layers dominate; this script isolates what tree verification adds
inside the SSM layers. For each op at the bench shapes of ``benchmarks/rollback_kernels.py``
(Mamba-2 like Nemotron-H, GDN like Qwen3.5, KDA like Kimi-Linear; bf16 inputs, fp32 state), each
rollback strategy's verify kernel (snapshot: per-node states into a buffer; ring: per-node
states into the ring; replay: the fused-fold verify, from a checkpoint plus 3 committed history
tokens, writing per-node inputs only) runs on

* ``chain``: K + 1 = 5 tokens (depth 4);
* ``tree-16``: Medusa's "default" 16-node tree (depth 4), nodes unrolled in the kernel;
* ``tree-16-loop``: the same tree walked by the runtime node loop;
* ``tree-64``: Medusa's 64-node ``mc_sim_7b_63`` tree (depth 4), runtime node loop (the default
  above ``TREE_UNROLL_MAX`` = 16 nodes).

Time: median per layer and verify call, from a CUDA graph of ``ROUNDS`` calls over rotated
copies of the buffers (the working set exceeds L2), as ``rollback_kernels.py`` does. The commit
is not included (a tree's commit compacts the accepted path first: ``tree_verify.py`` times it).

    python benchmarks/tree_kernels.py --out tree_kernels.md        # H200 (about a minute)
    TRITON_INTERPRET=1 python benchmarks/tree_kernels.py --device cpu --tiny --batches 1   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import rollback_kernels as rk  # noqa: E402
from specdec.tree import make_tree  # noqa: E402

STRATEGIES = ("snapshot", "ring", "replay")
VARIANTS = ("chain", "tree-16", "tree-16-loop", "tree-64")
COMMITTED = 3  # history tokens the fused replay verify folds in (a typical accepted count)


def variant_tree(name):
    """(parents or None, tree_loop or None) of a variant."""
    if name == "chain":
        return None, None
    parents = tuple(make_tree("default" if name.startswith("tree-16") else "medusa-63", num_heads=4).parents)
    return parents, (True if name.endswith("-loop") else None)


class VerifySet:
    """One layer's buffers for one strategy's verify over T tokens (a rotation copy)."""

    def __init__(self, b, strategy, B, T, device):
        self.st = rk.StepSet(b, "replay" if strategy == "replay" else strategy, B, T, device)
        if strategy == "replay":
            self.st.hist_len.fill_(COMMITTED)
        self.b, self.strategy = b, strategy

    def step(self, n=None):  # the interface of rollback_kernels.time_sets (no commit: n unused)
        self.verify()

    def verify(self):
        st, b = self.st, self.b
        if self.strategy == "snapshot":
            b.snapshot_verify(st.live, st.buf, st.inp, st.out)
        elif self.strategy == "ring":
            b.ring_verify(st.ring, st.head, st.inp, st.out)
        else:
            b.replay_verify(st.ckpt, st.hist, st.hist_len, st.inp, st.out, fused=True)

    def nbytes(self):
        return self.st.nbytes()


def time_verify(b, strategy, B, T, device, reps):
    """Seconds per verify call (``rollback_kernels.time_sets``: a CUDA graph of ROUNDS calls over
    rotated buffer sets, median of ``reps`` replays)."""
    first = VerifySet(b, strategy, B, T, device)
    n_rot = max(1, min(8, math.ceil(rk.ROT_BYTES / max(1, first.nbytes())))) if device == "cuda" else 1
    sets = [first] + [VerifySet(b, strategy, B, T, device) for _ in range(n_rot - 1)]
    sec = rk.time_sets(sets, torch.ones(rk.ROUNDS, B, dtype=torch.long), device, reps)
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
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the kernels through Triton's interpreter: start it with TRITON_INTERPRET=1")
    for name, given, known in (("strategy", args.strategies, STRATEGIES), ("variant", args.variants, VARIANTS)):
        bad = [x for x in given.split(",") if x not in known]
        if bad:
            ap.error(f"unknown {name} {bad}; accepted: {', '.join(known)}")
    t_start = time.time()
    torch.manual_seed(0)
    rows = []
    for op in args.ops.split(","):
        b = rk.make_bench(op, args.tiny, args.device)
        for strategy in args.strategies.split(","):
            for B in (int(x) for x in args.batches.split(",")):
                base = None
                for variant in args.variants.split(","):
                    parents, loop = variant_tree(variant)
                    T = len(parents) if parents else 5
                    b.tune = {} if parents is None else {"parents": parents, "tree_loop": loop}
                    us = 1e6 * time_verify(b, strategy, B, T, args.device, args.reps)
                    base = us if variant == "chain" else base
                    rows.append((op, strategy, B, variant, T, us, us / base if base else float("nan")))
                    print(f"{op:7s} {strategy:9s} B={B:<3d} {variant:13s} T={T:<3d} {us:9.1f} us "
                          f"({time.time() - t_start:.0f} s)", flush=True)
                b.tune = {}
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU interpreter"
    lines = [f"Per-layer SSM verify, tree vs chain ({dev}, {datetime.date.today()}; "
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
