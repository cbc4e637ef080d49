"""Launch the GDN step kernels once each at one shape, for a hardware-counter profile:

    ncu --clock-control none -k regex:delta_rule --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python benchmarks/profile_gdn_step.py --batch 64 --T 5

Kernels launched (after a warm-up that compiles them): the no-rollback update, snapshot verify,
replay verify and replay fold (the older 3-launch replay protocol, kept for deferred replay),
then the fused replay the engine uses (verify that folds the committed history, history of
2 T tokens; and its one-launch commit), all at batch B, T tokens, GDN 32 heads x 128 x 128,
bf16 inputs, fp32 state. ``-k regex:delta_rule`` catches the step/fold kernels; add
``-k regex:replay_commit`` for the fused protocol's commit.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specdec.kernels.gdn import triton_step as dr  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=5)
    args = ap.parse_args()
    B, T, H, K, V = args.batch, args.T, 32, 128, 128
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1).mul(K**-0.5).bfloat16()
    k = F.normalize(r(B, T, H, K), dim=-1).bfloat16()
    v = r(B, T, H, V).bfloat16()
    gate = -F.softplus(r(B, T, H))
    beta = torch.rand(B, T, H, device=dev, generator=g)
    state = r(B, H, K, V)
    buf = torch.empty(B, T, H, K, V, device=dev)
    L = 16
    hist = (torch.zeros(B, L, H, K, device=dev), torch.zeros(B, L, H, device=dev), torch.zeros(B, L, H, V, device=dev))
    hist_len = torch.zeros(B, dtype=torch.long, device=dev)
    n = torch.full((B,), T, dtype=torch.long, device=dev)
    hist2 = (torch.zeros(B, 2 * T, H, K, device=dev), torch.zeros(B, 2 * T, H, device=dev),
             torch.zeros(B, 2 * T, H, V, device=dev))
    hist2_len = torch.full((B,), T - 1, dtype=torch.long, device=dev)  # a committed history to absorb
    accepted = torch.full((B,), T - 1, dtype=torch.long, device=dev)
    for _ in range(2):  # warm-up compiles; the profiled launches are the last six
        dr.delta_rule_update(state.clone(), q, k, v, gate, beta)
        dr.delta_rule_snapshot_verify(state, buf, q, k, v, gate, beta, 0)
        dr.delta_rule_replay_verify(state, *hist, hist_len, q, k, v, gate, beta, 0)
        dr.delta_rule_replay_fold(state.clone(), *hist, n)
        ckpt = state.clone()
        dr.delta_rule_replay_verify(ckpt, *hist2, hist2_len.clone(), q, k, v, gate, beta, 0, fused=True)
        dr.delta_rule_replay_commit(*hist2, hist2_len.clone(), accepted)
    torch.cuda.synchronize()
    print("done", B, T)


if __name__ == "__main__":
    main()
