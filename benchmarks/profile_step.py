"""Launch one step of every rollback strategy of one SSM op, for a hardware-counter profile.

    ncu --clock-control none --profile-from-start off --nvtx --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        python benchmarks/profile_step.py --op mamba2 --batch 64 --K 4

The step of each strategy is the per-layer step of the kernel table (``experiment=kernels``):
the library's strategy on the op's Triton kernels (:class:`specdec.experiments.kernel_timing.LayerStep`:
verify + commit, the fold included for deferred replay) at the table's shapes (Mamba-2 like
Nemotron-H, GDN like Qwen3.5, KDA like Kimi-Linear), bf16 inputs, fp32 state, batch B, T = K + 1
tokens. Each strategy runs a few warm-up steps (compile; the replay histories fill), then one
step inside ``cudaProfilerStart/Stop`` and an NVTX range named after the strategy, so ncu (with
``--profile-from-start off --nvtx``) profiles exactly those launches and labels them. For
deferred replay a second profiled range, ``replay_deferred/flush``, runs the kernels' fold with
every row flushing (its steady-state step folds only rows whose history is full).

Prints, per strategy, the bytes per row its kernels move and the bytes the cost model assigns to
the step (the kernel names are in ncu's report). ``--device cpu --tiny`` runs the kernels through
Triton's interpreter (a smoke test).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from specdec.experiments.kernel_table import SHAPES, step_traffic  # noqa: E402
from specdec.experiments.kernel_timing import BASELINE, LayerStep, accepted_counts, synthetic_params  # noqa: E402
from specdec.kernels import OPS  # noqa: E402

STRATEGIES = (BASELINE, "snapshot", "ring", "replay", "replay_deferred")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="mamba2", choices=["mamba2", "gdn", "kda"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: interpreter smoke test (--tiny)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    dev, T = args.device, args.K + 1
    strategies = args.strategies.split(",")
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:  # before any profiled run (an ncu session would otherwise fail only at the typo)
        raise SystemExit(f"unknown strategy {bad[0]!r}; accepted: {', '.join(STRATEGIES)}")
    gen = torch.Generator().manual_seed(0)
    shape = SHAPES["tiny" if args.tiny else "bench"][args.op]
    op = OPS[args.op].on("triton", dev)  # on the CPU through Triton's interpreter
    params = synthetic_params(shape, dev, gen)
    n_seq = accepted_counts(4, args.batch, args.K, 0.7, gen).to(dev)
    cuda = dev == "cuda"
    for strategy in strategies:
        st = LayerStep(op, shape, strategy, args.batch, T, params, dev, gen, dtype=torch.bfloat16)
        for r in range(3):  # compile, and fill the replay histories
            st.step(n_seq[r])
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push(strategy)
        st.step(n_seq[3])
        if cuda:
            torch.cuda.nvtx.range_pop()
        if strategy == "replay_deferred":
            hist, hist_len = st.store.tensors["hist"], st.store.tensors["hist_len"]
            full = torch.full_like(hist_len, next(iter(hist.values())).shape[1] // 2)
            hist_len.copy_(full)
            if cuda:
                torch.cuda.nvtx.range_push("replay_deferred/flush")
            op.kernels.replay_fold(st.store.tensors["ckpt"], hist, params, full)
            if cuda:
                torch.cuda.nvtx.range_pop()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        tr = step_traffic(st, shape, n_seq[:1].cpu())
        print(f"{args.op} B={args.batch} T={T} {strategy}: kernel bytes/row {tr['kernel_bytes'] / 1e6:.2f} MB, "
              f"cost model {tr['design_bytes'] / 1e6:.2f} MB", flush=True)
        del st
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
