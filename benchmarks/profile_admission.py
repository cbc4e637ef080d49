"""Where an admission's time goes: prompts prefilled through ``generate_batch`` with and without
the prefix cache, host time against GPU time (a diagnostic: ``torch.profiler`` tables, not a
speed claim; the serving experiment measures speed).

    python benchmarks/profile_admission.py --model nemotronh-4b-shape --batch 8 --prefix 1024

Each call admits ``--batch`` prompts of a ``--prefix``-token shared prefix followed by their own
``--suffix`` random tokens (one new token each, one row per prompt) into a fresh
``generate_batch`` call: without the cache, then with it (``prefix_block_size=--block``; each call
has its own cache, so its first prompts store the prefix and the rest hit it). After
``--warmup`` untimed calls of each kind, it prints the wall time of ``--repeats`` calls of each,
then one profiled call of each: kernel launches, aten ops, GPU busy time and the ops with the
most host time and the most GPU time. The models are the app's (``model=`` names of
``conf/model``). ``--device cpu --tiny`` is a smoke test on the zoo's tiny target.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

#: the profiler's names for a kernel launch from the host
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nemotronh-4b-shape")
    ap.add_argument("--batch", type=int, default=8, help="prompts per call (and rows)")
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    ap.add_argument("--suffix", default="300,800", help="own tokens per prompt: min,max (uniform)")
    ap.add_argument("--block", type=int, default=64, help="prefix_block_size")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=30, help="rows of each profiler table")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the zoo's tiny target (smoke test)")
    args = ap.parse_args(argv)
    import specdec
    from specdec.experiments.models import load_app_model

    name = "gdn-target" if args.tiny else args.model
    model, dev = load_app_model(name, args.device)
    lo, hi = (int(x) for x in args.suffix.split(","))
    V = model.config.vocab_size
    shared = torch.randint(0, V, (args.prefix,), generator=torch.Generator().manual_seed(0)).tolist()

    def prompts(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [shared + torch.randint(0, V, (int(n),), generator=g).tolist()
                for n in torch.randint(lo, hi + 1, (args.batch,), generator=g)]

    sd = specdec.wrap(model, num_speculative_tokens=0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def admit(ps, cache: bool) -> float:
        kw = {"prefix_caching": True, "prefix_block_size": args.block} if cache else {}
        sync()
        t0 = time.perf_counter()
        sd.generate_batch(ps, max_batch_size=args.batch, max_new_tokens=1, **kw)
        sync()
        return time.perf_counter() - t0

    print(f"{name}, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, {args.batch} prompts of "
          f"{args.prefix} shared + {lo}-{hi} own tokens, blocks of {args.block}", flush=True)
    for i in range(args.warmup):
        admit(prompts(100 + i), False)
        admit(prompts(200 + i), True)
    for cache in (False, True):
        ms = [admit(prompts(300 + 10 * cache + i), cache) * 1e3 for i in range(args.repeats)]
        print(f"prefix cache {'on' if cache else 'off'}: wall ms per call {', '.join(f'{m:.1f}' for m in ms)}",
              flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for cache in (False, True):
        ps = prompts(999 + cache)
        with torch.profiler.profile(activities=activities) as prof:
            wall = admit(ps, cache)
        ev = prof.key_averages()
        ops = sum(e.count for e in ev if e.key.startswith("aten::"))
        launches = sum(e.count for e in ev if e.key in _LAUNCHES)
        gpu_ms = sum(e.self_device_time_total for e in ev) / 1e3
        print(f"\n=== prefix cache {'on' if cache else 'off'}: {wall * 1e3:.1f} ms profiled, {ops} aten ops, "
              f"{launches} kernel launches, GPU busy {gpu_ms:.1f} ms")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if dev.type == "cuda":
            print(ev.table(sort_by="self_device_time_total", row_limit=args.rows // 2, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
