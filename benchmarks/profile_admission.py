"""Where an admission's time goes: prompts prefilled through ``generate_batch`` with and without
the prefix cache, per region of the prefill, host time against GPU time (a diagnostic, not a
speed claim; the serving experiment measures speed).

    python benchmarks/profile_admission.py --model nemotronh-4b-shape --prompts 8 --rows 8   # GPU
    python benchmarks/profile_admission.py --device cpu --prompts 32 --rows 8 --prefix 64 --block 4 \\
        --suffix 24,40 --override model.targets.0.config.hidden_size=64 \\
        model.targets.0.config.intermediate_size=128 model.targets.0.config.num_attention_heads=4 \\
        model.targets.0.config.num_key_value_heads=2 model.targets.0.config.head_dim=16 \\
        model.targets.0.config.mamba_num_heads=8 model.targets.0.config.mamba_head_dim=16 \\
        model.targets.0.config.ssm_state_size=16 model.targets.0.config.n_groups=2 \\
        model.targets.0.config.vocab_size=512                                                    # CPU

The second form keeps the Nemotron-H-4B shape's 52 layers in their order with tiny widths:
a forward's CPU time is then mostly per-op overhead, the host cost the same forward pays on a
GPU. ``--prompts`` prompts share a prefix of ``--prefix`` random tokens and have their own
``--suffix`` tokens (min,max, uniform); they run through the library's
``generate_batch(max_new_tokens=1, max_batch_size=--rows)`` with ``prefix_caching`` off, then on
(``prefix_block_size=--block``; each call has its own cache, so its first prompts store the prefix
and the rest hit it): ``--warmup`` untimed calls of each, ``--repeats`` timed calls, then one under
``torch.profiler``, with the adapter's prefill and the cache's steps wrapped (:data:`REGIONS`: a
wall clock in the timed calls, a ``record_function`` in the profiled one). Both modes' timed calls
run before the first profiled call, so no prompt bucket is captured (on its second use) after a
profiler session.

Prints per mode: the wall time of each timed call; per region (nested regions count in their
parents too) its calls, aten ops per prompt (the ``aten::`` calls made from Python, not those an
op makes inside) and host milliseconds per prompt (median of the timed calls); the cache's
counters; kernel launches and GPU busy time; with ``--top N`` the N ops with the most host time
(and GPU time); with ``--syncs N``, from one more call, the calls that on a GPU wait for the device
(:func:`counting_syncs`) per prompt, and the N call sites with the most; then whether the first
tokens agree with the cache on and off. ``--decode-path static`` on a CPU runs the prompt forwards
at the bucketed shapes the GPU's default (``cuda_graph``) path replays, uncaptured. The models are the
app's (``model=`` names of ``conf/model``, ``--override``: more Hydra overrides).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

import specdec  # noqa: E402
from specdec import cache as cache_module  # noqa: E402
from specdec import prefix_cache as prefix_cache_module  # noqa: E402
from specdec.models import base as base_module  # noqa: E402

#: the regions marked: (label, owner, attribute); nested regions count in their parents too
REGIONS = (
    ("prefill", base_module.HybridAdapter, "prefill"),
    ("forward", base_module.HybridAdapter, "_prompt_forward"),
    ("lookup", base_module.HybridAdapter, "_cached_row"),
    ("restore", base_module.HybridAdapter, "_restore"),
    ("store", base_module.HybridAdapter, "_store_blocks"),
    ("insert", prefix_cache_module.PrefixCache, "insert"),
    ("load rows", base_module.HybridAdapter, "_load_rows"),
    ("load states", base_module.HybridAdapter, "_load"),
    ("move into pool", cache_module.HybridCache, "reset_rows"),
)
#: the profiler's names for a kernel launch from the host
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
#: the cache counters printed
COUNTERS = ("lookups", "hit_tokens", "prefilled_tokens", "prefill_forwards", "inserted_blocks", "stored_bytes")
#: the tensor methods that read a device tensor on the host (on a GPU each waits for the stream):
#: (owner, attribute)
READS = tuple((torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__",
                                          "__float__", "__index__")) + ((torch, "equal"), (torch, "nonzero"))
#: the directories whose frames a call site skips (torch's own Python code)
_TORCH_DIR = os.path.dirname(torch.__file__)
_SPECDEC_DIR = os.path.dirname(specdec.__file__)


def _site() -> str:
    """The call site of a host read: the innermost frame outside torch (``file:line``), and, where
    that is not specdec's, the innermost specdec frame too."""
    f, first, ours = sys._getframe(2), None, None
    while f is not None and ours is None:
        path = f.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and path != __file__:
            root = os.path.dirname(_SPECDEC_DIR) if path.startswith(_SPECDEC_DIR) else os.path.dirname(_TORCH_DIR)
            here = f"{os.path.relpath(path, root)}:{f.f_lineno}"
            first = first or here
            if path.startswith(_SPECDEC_DIR):
                ours = here
        f = f.f_back
    return first if ours in (None, first) else f"{first} <- {ours}"


@contextlib.contextmanager
def counting_syncs(counts: collections.Counter):
    """For the block, count in ``counts[(kind, call site)]`` each call that on a GPU waits for the
    device: a read of a tensor on the host (:data:`READS`; on a CPU run every tensor counts, also
    those a GPU run holds on the host), an index with a bool mask (a ``nonzero``), and a host-to-device
    copy (``torch.tensor`` / ``as_tensor`` given a device, ``.to`` / ``.cuda`` given one: PyTorch
    copies pageable host memory synchronously; a CPU run cannot tell a host tensor's ``.to(device)`` from
    a device tensor's, which copies nothing). Nested calls count once (the outermost)."""
    state = threading.local()
    saved = []

    def wrap(owner, name, counted):
        fn = getattr(owner, name)

        def call(*a, **kw):
            if getattr(state, "inside", False):
                return fn(*a, **kw)
            kind = counted(a, kw)
            if kind:
                counts[(kind, _site())] += 1
            state.inside = True
            try:
                return fn(*a, **kw)
            finally:
                state.inside = False

        saved.append((owner, name, fn))
        setattr(owner, name, call)

    def bool_index(a, kw):
        index = a[1] if isinstance(a[1], tuple) else (a[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)

    def device_arg(a, kw):
        return "device" in kw or any(isinstance(x, (str, torch.device)) for x in a[1:])

    for owner, name in READS:
        wrap(owner, name, lambda a, kw, _n=name: _n)
    wrap(torch.Tensor, "__getitem__", lambda a, kw: "bool index" if bool_index(a, kw) else None)
    wrap(torch.Tensor, "__setitem__", lambda a, kw: "bool index" if bool_index(a, kw) else None)
    for name in ("tensor", "as_tensor"):
        wrap(torch, name, lambda a, kw, _n=name: f"{_n}(device=)" if kw.get("device") is not None and not (
            isinstance(a[0], (list, tuple)) and not a[0]) else None)  # (an empty tensor copies nothing)
    wrap(torch.Tensor, "to", lambda a, kw: "to(device)" if device_arg(a, kw) else None)
    wrap(torch.Tensor, "cuda", lambda a, kw: "cuda")
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


@contextlib.contextmanager
def marked(seconds: dict | None = None, sync=lambda: None):
    """Each of :data:`REGIONS` wrapped, for the block, in a ``record_function`` of its label, or,
    with ``seconds``, in a wall clock (``sync`` before each reading) that adds its calls' seconds
    to ``seconds[label]``."""
    saved = []
    for label, owner, name in REGIONS:
        fn = owner.__dict__[name]

        def wrap(*a, _fn=fn, _label=label, **kw):
            if seconds is None:
                with torch.profiler.record_function(f"## {_label}"):
                    return _fn(*a, **kw)
            sync()
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                sync()
                seconds[_label] = seconds.get(_label, 0.0) + time.perf_counter() - t0

        saved.append((owner, name, fn))
        setattr(owner, name, wrap)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def workload(n: int, prefix: int, suffix: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts: one shared prefix of ``prefix`` random ids, then each one's own
    ``suffix[0]..suffix[1]`` random ids (seeded)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prefix,), generator=g).tolist()
    return [shared + torch.randint(0, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(suffix[0], suffix[1] + 1, (n,), generator=g)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nemotronh-4b-shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--override", nargs="*", default=[], help="more Hydra overrides of the app's config")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8, help="max_batch_size")
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    ap.add_argument("--suffix", default="300,800", help="own tokens per prompt: min,max")
    ap.add_argument("--block", type=int, default=64, help="prefix_block_size")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=0, help="rows of the top-ops tables (0: none)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--decode-path", default="auto", help="the generator's decode_path (static: on a CPU, the "
                    "bucketed prompt forwards a GPU's cuda_graph path runs, uncaptured)")
    ap.add_argument("--syncs", type=int, default=0, help="rows of the host-sync table (0: none)")
    args = ap.parse_args(argv)
    from specdec.experiments.models import load_app_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, dev = load_app_model(args.model, args.device, overrides=args.override)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lo, hi = (int(x) for x in args.suffix.split(","))
    vocab = model.config.vocab_size
    sd = specdec.wrap(model, num_speculative_tokens=0)
    sd.decode_path = args.decode_path
    n = args.prompts
    print(f"{args.model} ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
          f"{next(model.parameters()).dtype}), {torch.cuda.get_device_name() if cuda else 'cpu'}: {n} prompts of "
          f"{args.prefix} shared + {lo}-{hi} own tokens, {args.rows} rows, blocks of {args.block}", flush=True)

    def call(prompts, cached: bool):
        kw = {"prefix_caching": True, "prefix_block_size": args.block} if cached else {}
        return sd.generate_batch(prompts, max_new_tokens=1, max_batch_size=args.rows, **kw)

    for i in range(args.warmup):
        for cached in (False, True):
            call(workload(n, args.prefix, (lo, hi), vocab, 100 + 2 * i + cached), cached)
    prompts = workload(n, args.prefix, (lo, hi), vocab, 0)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    firsts, times, stats = {}, {}, {}
    for cached in (False, True):  # every timed call before the first profiled one (see the module docstring)
        timed = times[cached] = []
        for _ in range(args.repeats):
            seconds: dict = {}
            with marked(seconds, sync):
                sync()
                t0 = time.perf_counter()
                out = call(prompts, cached)
                sync()
                seconds["generate_batch"] = time.perf_counter() - t0
            timed.append(seconds)
        firsts[cached] = [o.generated_tokens for o in out.values()]
        stats[cached] = sd.last_stats.prefix_cache
    for cached in (False, True):
        timed, counters = times[cached], stats[cached]
        with marked(), torch.profiler.profile(activities=activities, record_shapes=False) as prof:
            with torch.profiler.record_function("## generate_batch"):
                call(prompts, cached)
        events = prof.events()
        aten = [e.time_range.start for e in events if e.name.startswith("aten::")
                and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
        state = "on" if cached else "off"
        walls = ", ".join(f"{t['generate_batch'] * 1e3:.1f}" for t in timed)
        print(f"\nprefix cache {state}: wall ms per call {walls}")
        print(f"  {'region':<16}{'calls':>7}{'aten ops/prompt':>17}{'ms/prompt':>11}")
        for label in ["generate_batch"] + [r[0] for r in REGIONS]:
            spans = [(e.time_range.start, e.time_range.end) for e in events
                     if e.name == f"## {label}" and e.device_type == DeviceType.CPU]  # (not its GPU-side copy)
            if spans:
                ops = sum(1 for t in aten if any(s <= t < e for s, e in spans))
                ms = statistics.median(t.get(label, 0.0) for t in timed) * 1e3
                print(f"  {label:<16}{len(spans):>7}{ops / n:>17.0f}{ms / n:>11.2f}")
        if counters:
            print("  counters:", {k: v for k, v in counters.items() if k in COUNTERS})
        if args.syncs:
            syncs: collections.Counter = collections.Counter()
            with counting_syncs(syncs):
                call(prompts, cached)
            kinds = collections.Counter()
            for (kind, _), c in syncs.items():
                kinds[kind] += c
            print(f"  host syncs per prompt {sum(syncs.values()) / n:.1f} (one untimed call): "
                  + ", ".join(f"{k} {c / n:.1f}" for k, c in kinds.most_common()))
            for (kind, site), c in syncs.most_common(args.syncs):
                print(f"    {c / n:>6.2f}  {kind:<16}{site}")
        ev = prof.key_averages()
        launches = sum(e.count for e in ev if e.key in LAUNCHES)
        # the device's own events (kernels, copies): each once (a CPU op's device time repeats them; the
        # regions' GPU-side spans cover them)
        busy = sum(e.time_range.elapsed_us() for e in events
                   if e.device_type == DeviceType.CUDA and not e.name.startswith("## ")) / 1e3
        print(f"  profiled call: {len(aten)} aten ops, {launches} kernel launches, GPU busy {busy:.1f} ms")
        if args.top:
            print(ev.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
            if cuda:
                print(ev.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
    same = firsts[False] == firsts[True]
    print(f"\nfirst tokens identical with the cache on and off: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
