"""Prefill time (``experiment=prefill``): :meth:`HybridAdapter.prefill <specdec.models.base.HybridAdapter.prefill>`
per model, (batch, prompt length) and Mamba-2 scan.

For each target (default ``nemotronh-4b-shape``: Nemotron-H 4B shapes, random bf16 weights on
CUDA; ``model=nemotronh-tiny-shape`` for CPU runs), each ``[batch, prompt tokens]`` pair of
``experiment.grid`` and each scan of ``experiment.scans`` (``auto``, ``fla``, ``torch``, ``hf``:
:data:`specdec.kernels.mamba2.chunked.SCANS`; a scan that resolves to one already measured at
the point is skipped; one this machine cannot run, or that runs out of device memory, is
skipped and listed), it prefills random prompt ids into one cache: ``experiment.warmup`` untimed
runs, then ``repeats`` timed runs, each between device syncs: median and min-max (:mod:`.timing`), tokens/s, peak memory on CUDA.

The roof is the time of the dense matmuls at the device's dense bf16 peak
(:data:`BF16_PEAK_FLOPS`): ``2 x parameters x tokens / peak``, where the parameters are the
decoder body's without the input embedding (a lookup; the LM head runs at one position per
row). Attention's ``L^2`` term and the scan are not in it, so it is a floor. Each scan's logits
are compared with the ``hf`` scan's at the same point when both ran (``logits_rel_err_vs_hf``).

Each point also runs on each prompt path of ``experiment.prompt_paths`` (default ``[eager]``;
``static``, ``cuda_graph``: :meth:`HybridAdapter.prefill <specdec.models.base.HybridAdapter.prefill>`'s
``prompt_path``, the prompts at a bucketed shape, captured as a CUDA graph; at least two
untimed runs first, so the bucket is captured), its logits compared with the eager path's
(``logits_rel_err_vs_eager``), its bucket and any capture error recorded.

``experiment.switches`` (environment settings, e.g. ``SPECDEC_PROMPT_KERNELS=0``:
:func:`.e2e.parse_switches`) times each point's prefill under each setting too, round by round
with the default's (:func:`.timing.time_side_by_side`): one record per setting (``switch``, None
for the default), with its median over the default's (``vs_default``) and its logits against the
default's (``logits_rel_err_vs_default``). Not with the ``cuda_graph`` prompt path: a bucket is
captured once, under whichever setting met it first.

``experiment.profile`` adds one prefill per point and scan under ``torch.profiler``
(:mod:`.profiling`): its kernels, GPU busy time and host time in the record, and ``profile.md``
with the top ops by GPU time (by host time on a CPU), to see where a prefill's time goes.

Records are appended to ``results.jsonl`` as measured; ``summary.md`` at the end.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from .common import RunRecords, apply_cpu_threads, common_fields, progress_bar
from .e2e import parse_switches
from .models import load_target, resolve_device
from .timing import time_side_by_side

__all__ = ["run", "BF16_PEAK_FLOPS", "bf16_peak_flops", "matmul_parameters"]

#: dense (no sparsity) bf16 tensor-core peak, FLOP/s, by a name in ``torch.cuda.get_device_name``
#: (vendor data sheets: H100/H200 SXM 989.4 TFLOP/s, A100 312 TFLOP/s)
BF16_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def bf16_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` in FLOP/s (:data:`BF16_PEAK_FLOPS`), None for a CPU or a
    GPU not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_FLOPS.items() if key in name), None)


def matmul_parameters(adapter) -> int:
    """Parameters of the decoder body that multiply every prompt token: all of the body's, the
    input embedding (a lookup) left out; a tensor shared between modules counted once."""
    emb = adapter.model.get_input_embeddings().weight
    seen, total = {emb.data_ptr()}, 0
    for p in adapter.body.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total


def _scans(scans, device, dtype, skipped: list[str]) -> list[tuple[str, str]]:
    """``(scan, resolved path)`` for each distinct path of ``scans`` on ``device`` for a model of
    ``dtype``, ``hf`` first
    (the others' logits are compared with its); a scan this machine cannot run is added to
    ``skipped`` with the reason."""
    from specdec.kernels.mamba2.chunked import resolve_scan

    out, seen = [], set()
    for scan in map(str, scans):
        try:
            path = resolve_scan(scan, device, dtype)
        except ValueError as err:
            skipped.append(f"scan={scan}: {err}")
            continue
        if path not in seen:
            seen.add(path)
            out.append((scan, path))
    return sorted(out, key=lambda sp: sp[1] != "hf")


def _prompt_paths(paths) -> list[str]:
    """``experiment.prompt_paths`` checked, ``"eager"`` first (the others' logits are compared with
    its). Raises ValueError for a name not in :data:`specdec.models.base.PROMPT_PATHS`."""
    from specdec.models.base import PROMPT_PATHS

    out = list(dict.fromkeys(map(str, paths)))
    bad = [p for p in out if p not in PROMPT_PATHS]
    if bad or not out:
        raise ValueError(f"experiment.prompt_paths must be a non-empty list of {PROMPT_PATHS}, got {list(paths)}")
    return sorted(out, key=lambda p: p != "eager")


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the timing grid; returns the records (also in ``out_dir``).

    Raises: ValueError for an unknown scan name (:func:`specdec.kernels.mamba2.chunked.resolve_scan`),
    a bad switch (:func:`.e2e.parse_switches`), or switches with the ``cuda_graph`` prompt path."""
    import contextlib
    import os
    from unittest import mock

    from specdec.models import adapter_for
    from specdec.rollback import make_strategy

    from .report import write_report

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    cuda = device.type == "cuda"
    points = [(int(b), int(L)) for b, L in exp.grid]
    peak = bf16_peak_flops(device)
    log = RunRecords(out_dir)
    skipped: list[str] = []
    scans = _scans(exp.scans, device, dtype, skipped)
    prompt_paths = _prompt_paths(exp.prompt_paths)
    switches = parse_switches(exp.get("switches") or [])
    if switches and "cuda_graph" in prompt_paths:
        raise ValueError("experiment.switches time the eager and static prompt paths: a cuda_graph bucket is captured "
                         "once, under whichever setting met it first; drop cuda_graph from experiment.prompt_paths")
    profiles: list[str] = []
    for spec in cfg.model.targets:
        model, _ = load_target(spec, device, dtype, int(cfg.seed))
        apply_cpu_threads(cfg, model, device)
        adapter = adapter_for(model)
        params = matmul_parameters(adapter)
        log.bar = progress_bar(cfg, len(points) * len(scans) * len(prompt_paths), "prefill")
        for B, L in points:
            gen = torch.Generator().manual_seed(int(cfg.seed) + B * L)
            ids = torch.randint(0, 8192, (B, L), generator=gen).to(device)
            mask = torch.ones_like(ids)
            cache = adapter.new_cache(B, L + 8, 1, make_strategy("snapshot"))
            hf_logits = eager_logits = None
            for (scan, path), prompt_path in [(sp, pp) for sp in scans for pp in prompt_paths]:
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)

                def once(scan_path=path, prompt_path=prompt_path, env=None):
                    with mock.patch.dict(os.environ, env) if env else contextlib.nullcontext():
                        return adapter.prefill(ids, mask, cache, scan=scan_path, prompt_path=prompt_path)

                fns = {None: once, **{label: (lambda env=env: once(env=env)) for label, env in switches.items()}}
                # a bucket runs eagerly first, is captured at its second use
                warmup = max(int(exp.warmup), 2 if prompt_path == "cuda_graph" else 0)
                try:
                    timed = time_side_by_side(fns, int(cfg.repeats), device, warmup=warmup)
                except torch.OutOfMemoryError:
                    skipped.append(f"{spec.name} B={B} L={L} scan={scan} prompt_path={prompt_path}: "
                                   "out of device memory")
                    torch.cuda.empty_cache()
                    continue
                t, (logits, _) = timed[None]
                logits = logits.float()
                prof = None
                if exp.profile:
                    from .profiling import profile_call

                    prof, _ = profile_call(once, device, top=30)
                    profiles.append(f"## {spec.name}, batch {B} x {L} prompt tokens, scan {path}, "
                                    f"prompt path {prompt_path}\n\n```\n{prof.table}\n```\n")
                    (log.out_dir / "profile.md").write_text(  # as they come: a later failure keeps them
                        "# torch.profiler: one prefill per point and scan\n\n" + "\n".join(profiles))
                if path == "hf" and prompt_path == "eager":
                    hf_logits = logits
                if prompt_path == "eager":
                    eager_logits = logits
                graphs = adapter.prompt_graphs
                flop = 2.0 * params * B * L
                roof_ms = 1e3 * flop / peak if peak else None
                rec = {**common_fields(cfg, "prefill", spec, device, dtype), "batch": B, "prompt_tokens": L,
                       "scan": scan, "scan_path": path, "prompt_path": prompt_path,
                       "prompt_bucket": (list(graphs.bucket(B, L) or []) or None) if prompt_path != "eager" else None,
                       "prompt_graph_error": graphs.error if prompt_path == "cuda_graph" else None,
                       **t.scaled(1e3).fields("prefill_ms"),
                       **t.rate(B * L).fields("tokens_per_s"), "matmul_params": params, "flop": flop,
                       "roof_ms": roof_ms, "x_roof": t.median * 1e3 / roof_ms if roof_ms else None,
                       "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                       "logits_rel_err_vs_hf": (float((logits - hf_logits).norm() / hf_logits.norm().clamp(min=1e-30))
                                                if hf_logits is not None and path != "hf" else None),
                       "logits_rel_err_vs_eager": (float((logits - eager_logits).norm()
                                                         / eager_logits.norm().clamp(min=1e-30))
                                                   if prompt_path != "eager" and eager_logits is not None else None),
                       **({f"profile_{k}": v for k, v in prof.fields().items()} if prof is not None else {})}
                if switches:
                    rec.update(switch=None, vs_default=1.0, logits_rel_err_vs_default=0.0)
                log.add(rec, f"{spec.name} B={B} L={L} {path} {prompt_path}: {rec['prefill_ms']:.1f} ms, "
                             f"{rec['tokens_per_s']:.0f} tokens/s"
                             + (f", {rec['x_roof']:.1f}x roof" if roof_ms else ""))
                for label in switches:  # (no profile, no comparison with hf or eager: against the default's)
                    ts, (logits_s, _) = timed[label]
                    logits_s = logits_s.float()
                    srec = {**{k: v for k, v in rec.items() if not k.startswith(("profile_", "logits_rel_err"))},
                            **ts.scaled(1e3).fields("prefill_ms"), **ts.rate(B * L).fields("tokens_per_s"),
                            "x_roof": ts.median * 1e3 / roof_ms if roof_ms else None, "switch": label,
                            "peak_gib": None,  # (the default's record holds the peak over every setting's runs)
                            "vs_default": ts.median / t.median,
                            "logits_rel_err_vs_default": float((logits_s - logits).norm()
                                                               / logits.norm().clamp(min=1e-30))}
                    log.add(srec, f"{spec.name} B={B} L={L} {path} {prompt_path} {label}: {srec['prefill_ms']:.1f} ms "
                                  f"({srec['vs_default']:.3f}x the default)")
            del cache
            if cuda:
                torch.cuda.empty_cache()
        log.close()
        del model, adapter
    title = (f"Prefill: {', '.join(t.name for t in cfg.model.targets)}, {str(dtype).replace('torch.', '')}, "
             f"{device}" + (f" (dense bf16 peak {peak / 1e12:.0f} TFLOP/s)" if peak else ""))
    text = write_report(log.records, log.out_dir, title)
    if skipped:
        text += "\nSkipped: " + "; ".join(skipped) + "\n"
        (log.out_dir / "summary.md").write_text(text)
    return log.records
