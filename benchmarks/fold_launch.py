"""Fused replay's in-kernel fold of the committed history, per launch rule: one Mamba-2 and one GDN
layer's replay verify (``fused=True``) at a history half of ``T_max`` positions, for steps of T
tokens that committed T positions the step before.

A decoder sized for more drafts than a step asks for (``num_speculative_tokens="auto"`` sizes
every step for ``max_speculative_tokens``) runs its steps with ``T_max`` larger than the step's T.
:func:`specdec.kernels.triton_common.fold_launch` picks how the fold's history loads are issued:
``(lookahead, masked)``. This times the rules side by side (CUDA events around a CUDA graph of 20
launches replayed 10 times, the median: ``kernel_timing.time_in_graph``) against the same step sized ``T_max = T``:

* ``all, unmasked``: every one of the ``T_max`` positions' loads issued at once, unmasked;
* ``all, masked``: the same, predicated on the committed length;
* ``4 ahead, masked`` / ``2 ahead, masked``: a lookahead of 4 (2) positions, predicated;
* ``fold_max = T``: the library's rule with the fold sized for the step, as the static decoder
  runs a step narrower than itself (``HybridCache.set_fold_max``).

The shapes are the bench models' layers (Mamba-2: 112 heads x 64 x 128, 8 groups; GDN: 32 heads,
128 x 128), bf16 inputs, fp32 state::

    python benchmarks/fold_launch.py --batches 16,64 --t-max 9 --steps 2,4,9
    TRITON_INTERPRET=1 python benchmarks/fold_launch.py --device cpu --tiny --batches 2 --t-max 6 --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import specdec.kernels.gdn.triton_step as gdn_step  # noqa: E402
import specdec.kernels.mamba2.triton_step as mamba2_step  # noqa: E402
from specdec.experiments.kernel_timing import time_in_graph  # noqa: E402

RULES = {
    "all, unmasked": lambda half: (half, False),
    "all, masked": lambda half: (half, True),
    "4 ahead, masked": lambda half: (4, True),
    "2 ahead, masked": lambda half: (2, True),
}


DEVICE = ["cuda"]  # where median_us times (main sets it)


def median_us(fn, launches: int = 20, repeats: int = 10) -> float:
    """Median microseconds of one ``fn()``: :func:`~specdec.experiments.kernel_timing.time_in_graph`
    over a CUDA graph of ``launches`` calls, replayed ``repeats`` times (on a CPU: wall time)."""
    if DEVICE[0] == "cpu":  # (the interpreter: one call is enough to show the script works)
        launches = repeats = 1
    return time_in_graph(lambda: [fn() for _ in range(launches)], launches, DEVICE[0], repeats) * 1e6


#: (Mamba-2 heads, head dim, state size, groups), (GDN heads, key dim, value dim): the bench models'
#: layers, and tiny ones for the CPU (``--tiny``, through Triton's interpreter: a smoke test)
SHAPES = {False: ((112, 64, 128, 8), (32, 128, 128)), True: ((4, 16, 16, 2), (2, 16, 16))}


def mamba2_layer(B: int, T: int, t_max: int, dev, dims, fold_max=None):
    """A fused replay verify of one Mamba-2 layer (its history holds T committed positions)."""
    H, P, N, G = dims
    bf = torch.bfloat16
    ckpt = torch.randn(B, H, P, N, device=dev) * 0.1
    L = 2 * t_max
    hx, hdt = torch.randn(B, L, H, P, device=dev, dtype=bf), torch.rand(B, L, H, device=dev, dtype=bf) * 0.1
    hB, hist_len = torch.randn(B, L, G, N, device=dev, dtype=bf), torch.full((B,), T, device=dev)
    x, dt = torch.randn(B, T, H, P, device=dev, dtype=bf), torch.rand(B, T, H, device=dev) * 0.1
    A, D = -torch.rand(H, device=dev), torch.randn(H, device=dev)
    Bm, Cm = torch.randn(B, T, G, N, device=dev, dtype=bf), torch.randn(B, T, G, N, device=dev, dtype=bf)
    out = torch.empty(B, T, H, P, device=dev)
    return lambda: mamba2_step.mamba2_replay_verify(ckpt, hx, hdt, hB, hist_len, x, dt, A, Bm, Cm, D, fused=True,
                                                    out=out, fold_max=fold_max)


def gdn_layer(B: int, T: int, t_max: int, dev, dims, fold_max=None):
    """A fused replay verify of one GDN layer (its history holds T committed positions)."""
    H, K, V = dims
    L = 2 * t_max
    ckpt = torch.randn(B, H, K, V, device=dev) * 0.1
    hk = torch.nn.functional.normalize(torch.randn(B, L, H, K, device=dev), dim=-1).bfloat16()
    hg, hu = -torch.rand(B, L, H, device=dev) * 0.1, torch.randn(B, L, H, V, device=dev)
    hist_len = torch.full((B,), T, device=dev)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
    k, v = q.clone(), torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    g, beta = -torch.rand(B, T, H, device=dev) * 0.1, torch.rand(B, T, H, device=dev)
    out = torch.empty(B, T, H, V, device=dev)
    return lambda: gdn_step.delta_rule_replay_verify(ckpt, hk, hg, hu, hist_len, q, k, v, g, beta, fused=True, out=out,
                                                    fold_max=fold_max)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--t-max", type=int, default=9, help="the history half the decoder is sized for")
    ap.add_argument("--steps", default="2,4,9", help="step tokens T (each <= --t-max)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny layers (with --device cpu and TRITON_INTERPRET=1: a smoke test)")
    args = ap.parse_args(argv)
    dev, t_max = torch.device(args.device), args.t_max
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fold_launch.py: no CUDA device (a smoke test on the CPU: --device cpu --tiny with TRITON_INTERPRET=1)")
    DEVICE[0] = str(dev)
    shapes = dict(zip(("mamba2", "gdn"), SHAPES[args.tiny]))
    steps = [int(t) for t in args.steps.split(",")]
    if any(not 1 <= t <= t_max for t in steps):
        raise SystemExit(f"--steps must lie in 1..{t_max}, got {steps}")
    torch.manual_seed(0)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (not a timing)"
    print(f"# fused replay verify, one layer, microseconds (median), {where}, "
          f"T_max = {t_max}; library rule: {mamba2_step.fold_launch(t_max)}\n")
    hints = ("fold_max = T",)
    print("| op | batch | T = committed | sized T_max = T | " + " | ".join([*RULES, *hints]) + " |")
    print("|---|---:|---:|---:|" + "---:|" * (len(RULES) + len(hints)))
    for name, layer, module in (("mamba2", mamba2_layer, mamba2_step), ("gdn", gdn_layer, gdn_step)):
        rule = module.fold_launch
        for B in (int(b) for b in args.batches.split(",")):
            for T in steps:
                sized = median_us(layer(B, T, T, dev, shapes[name])) if T < t_max else float("nan")
                cells = []
                for launch in RULES.values():
                    module.fold_launch = launch
                    try:
                        cells.append(median_us(layer(B, T, t_max, dev, shapes[name])))
                    finally:
                        module.fold_launch = rule
                cells.append(median_us(layer(B, T, t_max, dev, shapes[name], fold_max=T)))
                print(f"| {name} | {B} | {T} | {sized:.1f} | " + " | ".join(f"{c:.1f}" for c in cells) + " |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
