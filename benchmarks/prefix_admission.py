"""Host work of continuous batching's admissions with and without the prefix cache, on the CPU.

    python benchmarks/prefix_admission.py [--prompts 32 --rows 8 --block 4 --shared-blocks 16]

A Nemotron-H-4B-shaped model (its 52 layers: 24 Mamba-2, 24 MLP, 4 attention, in its order)
with tiny dims (hidden 64, fp32): a forward's CPU time is then mostly per-op overhead, so it
models the host cost of the same forward on a GPU. ``--prompts`` prompts share a prefix of
``--shared-blocks`` blocks of ``--block`` tokens and have their own suffixes (about half as long
as the prefix, +-25%: the shape of a 1,024-token shared system prompt with ~500-token requests).
They run through the library's ``generate_batch(max_new_tokens=1, max_batch_size=--rows)`` with
``prefix_caching`` off, then on: ``--repeats`` timed calls, then one under ``torch.profiler``
(CPU, shapes not recorded); the adapter's prefill and the cache's steps are wrapped for the runs
(:data:`REGIONS`: a wall clock in the timed calls, a ``record_function`` in the profiled one).

Prints, per mode and per region (nested regions count in their parents too): calls, aten ops
per prompt (the ``aten::`` calls made from Python, not those an op makes inside), host
milliseconds per prompt (median of the timed calls), and the prefix cache's counters; then
whether the first tokens agree.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

import specdec  # noqa: E402
from specdec import prefix_cache as pc_mod  # noqa: E402
from specdec.models import base as base_mod  # noqa: E402

#: conf/model/nemotronh-4b-shape.yaml's layer pattern
PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
VOCAB = 512

#: the regions marked: (label, owner, attribute); nested regions count in their parents too
REGIONS = (
    ("prefill", base_mod.HybridAdapter, "prefill"),
    ("forward", base_mod.HybridAdapter, "_prompt_forward"),
    ("lookup", base_mod.HybridAdapter, "_cached_row"),
    ("restore", base_mod.HybridAdapter, "_restore"),
    ("store", base_mod.HybridAdapter, "_store_blocks"),
    ("insert", pc_mod.PrefixCache, "insert"),
    ("load rows", base_mod.HybridAdapter, "_load_rows"),
)


def tiny_nemotron_h():
    config = tf.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(PATTERN),
        hybrid_override_pattern=PATTERN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=64,
        max_position_embeddings=8192)
    torch.manual_seed(0)
    return tf.NemotronHForCausalLM(config).eval()


def workload(n: int, block: int, shared_blocks: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared_len = block * shared_blocks
    shared = torch.randint(0, VOCAB, (shared_len,), generator=g).tolist()
    out = []
    for _ in range(n):
        own = int(shared_len / 2 * (0.75 + 0.5 * torch.rand((), generator=g).item()))
        out.append(shared + torch.randint(0, VOCAB, (own,), generator=g).tolist())
    return out


@contextlib.contextmanager
def marked(seconds: dict | None = None):
    """Each of :data:`REGIONS` wrapped, for the block, in a ``record_function`` of its label, or,
    with ``seconds``, in a wall clock that adds its calls' seconds to ``seconds[label]``."""
    saved = []
    for label, owner, name in REGIONS:
        fn = owner.__dict__[name]

        def wrap(*a, _fn=fn, _label=label, **kw):
            if seconds is None:
                with torch.profiler.record_function(f"## {_label}"):
                    return _fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                seconds[_label] = seconds.get(_label, 0.0) + time.perf_counter() - t0

        saved.append((owner, name, fn))
        setattr(owner, name, wrap)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run(sd, prompts, rows, block, cached, repeats):
    """``(outputs, {label: (calls, aten ops, median seconds)}, prefix cache counters)`` of
    ``generate_batch`` on ``prompts``: ops from one profiled call, seconds the median of
    ``repeats`` timed calls (regions timed by :func:`marked`, no profiler)."""
    kw = dict(max_new_tokens=1, max_batch_size=rows, prefix_caching=cached, prefix_block_size=block)
    timed = []
    for _ in range(repeats):
        seconds = {}
        with marked(seconds):
            t0 = time.perf_counter()
            out = sd.generate_batch(prompts, **kw)
            seconds["generate_batch"] = time.perf_counter() - t0
        timed.append(seconds)
    with marked(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False) as prof:
        with torch.profiler.record_function("## generate_batch"):
            sd.generate_batch(prompts, **kw)
    events = prof.events()
    labels = ["generate_batch"] + [r[0] for r in REGIONS]
    aten = [e.time_range.start for e in events if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    regions = {}
    for lab in labels:
        spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == f"## {lab}"]
        ops = sum(1 for t in aten if any(s <= t < e for s, e in spans))
        regions[lab] = (len(spans), ops, statistics.median(s.get(lab, 0.0) for s in timed))
    return out, regions, sd.last_stats.prefix_cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--shared-blocks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_nemotron_h()
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=0, decode_path="eager")
    prompts = workload(args.prompts, args.block, args.shared_blocks)
    n = len(prompts)
    print(f"{n} prompts, mean {sum(map(len, prompts)) / n:.0f} tokens, shared prefix "
          f"{args.shared_blocks} x {args.block} tokens; {args.rows} rows; 52 layers, hidden 64, fp32, 1 thread")
    sd.generate_batch(prompts[:2], max_new_tokens=1, max_batch_size=args.rows)  # warm-up
    outs = {}
    for cached in (False, True):
        outs[cached], regions, stats = run(sd, prompts, args.rows, args.block, cached, args.repeats)
        print(f"\nprefix cache {'on' if cached else 'off'} (ms: median of {args.repeats} calls without the profiler)")
        print(f"  {'region':<16}{'calls':>7}{'aten ops/prompt':>17}{'ms/prompt':>11}")
        for lab, (calls, ops, sec) in regions.items():
            if calls:
                print(f"  {lab:<16}{calls:>7}{ops / n:>17.0f}{sec * 1e3 / n:>11.2f}")
        if stats:
            print("  counters:", {k: v for k, v in stats.items() if k in (
                "lookups", "hit_tokens", "prefilled_tokens", "prefill_forwards", "inserted_blocks", "stored_bytes")})
    same = [o.generated_tokens for o in outs[False].values()] == [o.generated_tokens for o in outs[True].values()]
    print(f"\nfirst tokens identical cache on / off: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
