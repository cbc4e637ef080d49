"""Verify cost of a draft tree against a chain of the same depth (``experiment=tree_verify``).

On one model (default ``qwen35-4b-shape``: Qwen3.5-4B shapes, random bf16 weights on CUDA;
``model.targets.0.layers`` keeps its first layers; ``model=qwen35-tiny-shape`` for CPU runs), for
each rollback strategy, batch size, tree and kernel choice, it times one speculative step
through the engine's own decoder (:class:`specdec.decoding.EagerDecoder`, or the fixed-shape
bucket :class:`specdec.decoding.StaticDecoder` for ``experiment.decode_path=static`` /
``cuda_graph``, the latter with the verify forward and the commit replayed as CUDA graphs):

* the verify forward of the step: ``chain`` = K + 1 tokens, or a draft tree of depth K from
  ``specdec.tree.TREE_PRESETS`` (``default``: 16 nodes at K = 4; ``medusa-63``: Medusa's 64-node
  ``mc_sim_7b_63``) with its tree mask and each node's SSM state from its parent's
  (docs/design.md, "Trees");
* the commit of a depth-K path (a tree: path compaction, then the strategy's commit).

Kernels (``experiment.kernels``): ``default`` (the device's backend: Triton on CUDA), ``torch``
(the torch reference ops, ``SPECDEC_BACKEND=torch``; skipped where that is the default, as on
CPU) or ``loop`` (Triton, every tree walking its nodes in the runtime loop the kernels use above
``triton_common.TREE_UNROLL_MAX`` nodes; trees on the Triton backend only). Each configuration prefills a fresh cache
with ``experiment.prompt_tokens`` random tokens, then times ``experiment.steps`` steps after
``experiment.warmup``, each phase between device syncs: median and min-max (:mod:`.timing`).
``experiment.max_seconds`` skips what is left after that wall time, loading the models left out
(listed in the summary).
``experiment.profile`` adds one verify under ``torch.profiler`` per configuration
(:mod:`.profiling`: host ops, host ms, GPU kernels, GPU busy ms; ``profile.md`` with the top
host ops): a verify whose wall time is far above its GPU busy time is host-bound.

Records are appended to ``results.jsonl`` as measured; ``summary.md`` at the end.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from .common import RunRecords, apply_cpu_threads, common_fields, progress_bar
from .models import load_target, resolve_device
from .timing import Timing, sync

__all__ = ["run", "CHAIN"]

#: the ``experiment.trees`` entry of a chain step (the others are ``specdec.tree.TREE_PRESETS``)
CHAIN = "chain"


@contextlib.contextmanager
def _kernels(kind: str):
    """The kernel choice while a configuration's decoder is built and stepped: ``torch`` forces the
    torch backend (``SPECDEC_BACKEND``, read when the cache binds its ops); ``loop`` sets
    ``triton_common.TREE_UNROLL_MAX`` to 0 (the Triton kernels read it at each launch), so every
    tree walks its nodes in the runtime loop. Both are restored afterwards."""
    from specdec.kernels import triton_common

    saved_env, saved_max = os.environ.get("SPECDEC_BACKEND"), triton_common.TREE_UNROLL_MAX
    if kind == "torch":
        os.environ["SPECDEC_BACKEND"] = "torch"
    elif kind == "loop":
        triton_common.TREE_UNROLL_MAX = 0
    try:
        yield
    finally:
        triton_common.TREE_UNROLL_MAX = saved_max
        if saved_env is None:
            os.environ.pop("SPECDEC_BACKEND", None)
        else:
            os.environ["SPECDEC_BACKEND"] = saved_env


def _points(trees: list[str], kernels: list[str], backend: str) -> list[tuple[str, str]]:
    """The (tree, kernels) pairs that are distinct measurements on this device's ``backend``, the
    chain first (the other verify times are divided by its)."""
    out = []
    for tree in sorted(trees, key=lambda t: t != CHAIN):
        for kind in kernels:
            if kind == "torch" and backend == "torch":
                continue  # the default already is the torch backend (CPU)
            if kind == "loop" and (tree == CHAIN or backend != "triton"):
                continue  # a chain has no nodes to loop over; the loop is the Triton kernels' own
            out.append((tree, kind))
    return out


def _measure(adapter, strategy: str, batch: int, K: int, spec, exp, ids, mask, device, gen) -> dict:
    """Time one configuration's verify and commit; returns the record fields (and ``_profile``,
    the profiled verify's table, when ``experiment.profile``)."""
    from specdec.decoding import EagerDecoder, StaticDecoder
    from specdec.graphs import bucket_length
    from specdec.rollback import make_strategy

    T = spec.num_nodes if spec is not None else K + 1
    steps, warmup = int(exp.steps), int(exp.warmup)
    max_len = ids.shape[1] + (warmup + steps + 1) * (K + 1) + T + 8
    path = str(exp.decode_path)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if path == "eager":
        dec = EagerDecoder(adapter, make_strategy(strategy), batch, T, max_len, tree=spec)
    else:
        dec = StaticDecoder(adapter, make_strategy(strategy), batch, T, bucket_length(max_len), path == "cuda_graph",
                            tree=spec)
    dec.prefill(ids, mask)  # captures the graphs on the cuda_graph path
    if path == "cuda_graph" and dec.path != "cuda_graph":
        raise RuntimeError(f"experiment.decode_path=cuda_graph, but the capture failed: {dec.capture_error}")
    accepted = torch.full((batch,), K + 1, dtype=torch.long, device=device)
    commit_path = None
    if spec is not None:  # the top-1 chain's path, root to depth K (node indices in breadth-first order)
        index = {p: i + 1 for i, p in enumerate(spec.paths)}
        commit_path = torch.tensor([0] + [index[(0,) * d] for d in range(1, K + 1)], device=device).repeat(batch, 1)
    verify, commit = [], []
    for i in range(warmup + steps):
        toks = torch.randint(0, 8192, (batch, T), generator=gen).to(device)
        sync(device)
        t0 = time.perf_counter()
        dec.forward(toks)
        sync(device)
        t1 = time.perf_counter()
        dec.commit(accepted, commit_path)
        sync(device)
        if i >= warmup:
            verify.append(t1 - t0)
            commit.append(time.perf_counter() - t1)
    out = {"nodes": T, "decode_path": dec.path, **Timing(tuple(verify)).scaled(1e3).fields("verify_ms"),
           **Timing(tuple(commit)).scaled(1e3).fields("commit_ms"),
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
    if exp.profile:  # after the timed steps, so the profiler's overhead touches none of them
        from .profiling import profile_call

        toks = torch.randint(0, 8192, (batch, T), generator=gen).to(device)
        prof, _ = profile_call(lambda: dec.forward(toks), device)
        out.update(prof.fields())
        out["_profile"] = prof.table
    del dec
    if cuda:
        torch.cuda.empty_cache()
    return out


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the comparison; returns the records (also in ``out_dir``)."""
    from specdec.kernels import backend
    from specdec.models import adapter_for
    from specdec.tree import make_tree

    from .report import write_report

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    cuda = device.type == "cuda"
    if str(exp.decode_path) == "cuda_graph" and not cuda:
        raise ValueError("experiment.decode_path=cuda_graph needs CUDA; use static (the same bucket without graphs) "
                         "on the CPU")
    K = int(cfg.num_speculative_tokens)
    trees = {name: None if name == CHAIN else make_tree(name, num_heads=K) for name in map(str, exp.trees)}
    points = _points(list(trees), [str(k) for k in exp.kernels], backend(device))
    if not points:
        raise ValueError(f"experiment.kernels={[str(k) for k in exp.kernels]} measures nothing on {device} with "
                         f"the {backend(device)} backend: 'torch' is another measurement only where the default "
                         "backend is Triton (CUDA), 'loop' only on Triton and for trees; add 'default'")
    strategies = [str(s) for s in cfg.rollback.strategies]
    batches = [int(b) for b in exp.batch_grid]
    log = RunRecords(out_dir)
    start = time.perf_counter()
    skipped, profiles = [], []
    for spec in cfg.model.targets:
        loading = time.perf_counter()
        model, _ = load_target(spec, device, dtype, int(cfg.seed))
        start += time.perf_counter() - loading  # (building a model does not count against max_seconds)
        apply_cpu_threads(cfg, model, device)
        adapter = adapter_for(model)
        log.bar = progress_bar(cfg, len(strategies) * len(batches) * len(points), "tree_verify")
        for strategy in strategies:
            for B in batches:
                gen = torch.Generator().manual_seed(int(cfg.seed) + B)
                ids = torch.randint(0, 8192, (B, int(exp.prompt_tokens)), generator=gen).to(device)
                mask = torch.ones_like(ids)
                chain = None
                for tree, kind in points:
                    label = f"{strategy} B={B} {tree} ({kind} kernels)"
                    if exp.max_seconds is not None and time.perf_counter() - start > float(exp.max_seconds):
                        skipped.append(label)
                        continue
                    with _kernels(kind):
                        m = _measure(adapter, strategy, B, K, trees[tree], exp, ids, mask, device, gen)
                    if "_profile" in m:
                        profiles.append(f"## {label}\n\n```\n{m.pop('_profile')}\n```\n")
                    if tree == CHAIN and kind == "default":
                        chain = m["verify_ms"]
                    rec = {**common_fields(cfg, "tree_verify", spec, device, dtype), "rollback": strategy, "batch": B,
                           "num_speculative_tokens": K, "tree": tree, "kernels": kind,
                           "variant": tree if kind == "default" else f"{tree}, {kind} kernels", **m,
                           "vs_chain": m["verify_ms"] / chain if chain else None}
                    log.add(rec, f"{label}: {rec['nodes']} tokens, verify {rec['verify_ms']:.2f} ms, commit "
                                 f"{rec['commit_ms']:.3f} ms ({time.perf_counter() - start:.0f} s)")
        log.close()
        del model, adapter
    if profiles:
        (log.out_dir / "profile.md").write_text("# Top host ops per configuration (torch.profiler, one verify each)\n\n"
                                            + "\n".join(profiles))
    title = (f"Tree vs chain verify step: {', '.join(t.name for t in cfg.model.targets)}, "
             f"{str(dtype).replace('torch.', '')}, {device}, {exp.decode_path} path, depth K={K}, "
             f"{exp.prompt_tokens}-token prompt, {exp.steps} timed steps")
    text = write_report(log.records, log.out_dir, title)
    if skipped:
        text += f"\nSkipped after experiment.max_seconds={exp.max_seconds}: {'; '.join(skipped)}\n"
        (log.out_dir / "summary.md").write_text(text)
    return log.records
