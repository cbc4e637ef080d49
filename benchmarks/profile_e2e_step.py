"""Where a CUDA-graph decode step of a bench-shaped model spends its time (issue 7 analysis).

Builds the model (``benchmarks/e2e.py``'s ``bench_model``), runs one ``generate()`` per K to
capture the graphs, then for the captured verify forward: the median replay time (CUDA events,
20 replays), and a ``torch.profiler`` trace of 3 replays: number of kernels per replay, the sum
of their durations, and the kernels with the largest total time, grouped by name. Compares the
step with its floor: weight bytes / measured copy bandwidth.

    python benchmarks/profile_e2e_step.py --model qwen35-4b-shape --batch 1 --K 0,4 [--fuse 0|1]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from e2e import bench_model, copy_bandwidth, cuda_median_ms, weight_bytes

import specdec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen35-4b-shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--K", default="0,4")
    ap.add_argument("--strategy", default="replay")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = bench_model(args.model, dev, torch.bfloat16, None, False, 0.01)
    bw = copy_bandwidth(dev)
    wb = weight_bytes(model)
    print(f"{args.model}: weights {wb / 1e9:.2f} GB, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"floor {1e3 * wb / bw:.2f} ms per forward; fusion {os.environ.get('SPECDEC_FUSE', '1')}")
    ids = torch.randint(10, 8000, (args.batch, 128), device=dev)
    for K in [int(k) for k in args.K.split(",")]:
        sd = specdec.wrap(model, num_speculative_tokens=K, rollback=args.strategy, decode_path="cuda_graph")
        sd.generate(ids, max_new_tokens=16)
        dec = sd.decoder
        if dec.path != "cuda_graph":
            print(f"K={K}: no graph ({dec.capture_error})")
            continue
        fwd_ms = cuda_median_ms(dec._fwd_graph.replay, repeat=20)
        commit_ms = cuda_median_ms(dec._commit_graph.replay)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                dec._fwd_graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by = collections.defaultdict(lambda: [0, 0.0])
        for e in kernels:
            by[e.name][0] += 1
            by[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        n = len(kernels) / 3
        tot_ms = sum(v[1] for v in by.values()) / 3 / 1e3
        print(f"\nK={K} (T={K + 1}) batch {args.batch}: forward graph {fwd_ms:.3f} ms (floor {1e3 * wb / bw:.2f}), "
              f"commit graph {commit_ms:.3f} ms; {n:.0f} kernels per forward, "
              f"sum of kernel time {tot_ms:.3f} ms (gaps {fwd_ms - tot_ms:.3f} ms)")
        for name, (cnt, us) in sorted(by.items(), key=lambda x: -x[1][1])[: args.top]:
            print(f"  {us / 3 / 1e3:8.3f} ms  {cnt / 3:6.0f}x  {name[:110]}")
        del sd, dec
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
