"""Time of one n-gram (prompt lookup) proposal (``experiment=ngram_proposal``): the searches
:meth:`specdec.drafters.NGramDrafter.propose` chooses from, side by side -- the per-row host
loop (:func:`specdec.drafters.ngram.propose_ngram_reference`), the batched torch search
(:meth:`~specdec.drafters.NGramDrafter.propose_batched`) and, on the Triton backend
(:func:`specdec.kernels.backend`: CUDA with triton installed, or ``SPECDEC_BACKEND=triton``),
the one-launch Triton kernel (:meth:`~specdec.drafters.NGramDrafter.propose_kernel`).

These figures are what :meth:`~specdec.drafters.NGramDrafter.search`'s choice rests on. For
each batch B in ``experiment.batch_grid`` and text width W in ``experiment.widths``: random
texts over an ``experiment.vocab_size``-token vocabulary (repeats are common, so most rows find
a match), ragged lengths in [W/2, W], K = ``num_speculative_tokens`` drafts, n-grams
``drafter.ngram.min_ngram`` .. ``max_ngram``. All searches must propose the same tokens and
counts (checked at every point: ``same_proposals``); then ``repeats`` rounds each call every
search once, side by side after ``experiment.warmup`` untimed rounds, with a device sync around
each call (on CUDA the loop's host copy and per-row writes are what it costs): median and
min-max (:mod:`.timing`). ``search`` is the one ``propose`` takes there; with
``experiment.plain_step_ms`` (a plain decode step of the model the drafter serves, measured
elsewhere) its median is also given as a fraction of that step (``propose_over_plain_step``).

A synchronised call is mostly launch and sync on a GPU, while the decode loop's CUDA-graph path
replays the kernel inside its step programs. So on the Triton backend the kernel is also timed
back to back (``kernel_in_graph_ms``: ``experiment.graph_calls`` calls captured in one CUDA graph
and replayed, device time per call from CUDA events, median of ``repeats`` replays;
:func:`~.kernel_timing.time_in_graph`, which on a CPU times the calls' wall time instead), and
with ``plain_step_ms`` as a fraction of the step (``kernel_in_graph_over_plain_step``).

Records are appended to ``results.jsonl`` as measured; ``summary.md`` at the end.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .common import RunRecords, provenance
from .kernel_timing import time_in_graph
from .models import resolve_device
from .timing import overlaps, time_side_by_side

__all__ = ["run"]


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the comparison; returns the records (also in ``out_dir``).

    Raises: RuntimeError when the searches propose differently at a point (a bug); ValueError
    for ``experiment.graph_calls < 1``."""
    from specdec.drafters import NGramDrafter
    from specdec.drafters.ngram import propose_ngram_reference
    from specdec.kernels import backend

    from .report import write_report

    exp = cfg.experiment
    device, _ = resolve_device(cfg)
    if device.type == "cpu" and cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    K = int(cfg.num_speculative_tokens)
    lo, hi = int(cfg.drafter.ngram.min_ngram), int(cfg.drafter.ngram.max_ngram)
    plain_ms = float(exp.plain_step_ms) if exp.get("plain_step_ms") is not None else None
    if int(exp.graph_calls) < 1:
        raise ValueError(f"experiment.graph_calls must be >= 1 (kernel calls captured in one graph), got {exp.graph_calls}")
    drafter = NGramDrafter(min_ngram=lo, max_ngram=hi)
    on_triton = backend(device) == "triton"
    gen = torch.Generator().manual_seed(int(cfg.seed))
    log = RunRecords(out_dir)
    common = {"experiment": "ngram_proposal", "device": str(device), **provenance(device),
              "num_speculative_tokens": K, "min_ngram": lo, "max_ngram": hi, "vocab_size": int(exp.vocab_size),
              "repeats": int(cfg.repeats), "seed": int(cfg.seed), "plain_step_ms": plain_ms,
              "config": OmegaConf.to_container(cfg, resolve=True)}
    for B in (int(b) for b in exp.batch_grid):
        for W in (int(w) for w in exp.widths):
            ids = torch.randint(0, int(exp.vocab_size), (B, W), generator=gen).to(device)
            lengths = torch.randint(W // 2, W + 1, (B,), generator=gen).to(device)
            fns = {"loop": lambda: propose_ngram_reference(ids, lengths, K, lo, hi),
                   "batched": lambda: drafter.propose_batched(ids, lengths, K)}
            if on_triton:
                fns["kernel"] = lambda: drafter.propose_kernel(ids, lengths, K)
            proposals = {name: fn() for name, fn in fns.items()}
            ref = proposals["loop"]
            for name, (drafts, counts) in proposals.items():
                if not (torch.equal(drafts, ref[0]) and torch.equal(counts, ref[1])):
                    raise RuntimeError(f"the {name} n-gram search proposes differently from the per-row loop at "
                                       f"batch {B}, width {W}")
            t = {name: timing.scaled(1e3) for name, (timing, _) in
                 time_side_by_side(fns, int(cfg.repeats), device, warmup=int(exp.warmup)).items()}
            search = drafter.search(ids)
            rec = {**common, "batch": B, "width": W, "search": search, **t["loop"].fields("loop_ms"),
                   **t["batched"].fields("batched_ms"),
                   "loop_over_batched": t["loop"].median / t["batched"].median if t["batched"].median > 0 else None,
                   "within_noise": overlaps(t["loop"], t["batched"]), "same_proposals": True,
                   "rows_with_drafts": int((ref[1] > 0).sum())}
            if on_triton:
                rec.update(t["kernel"].fields("kernel_ms"))
                kernel_ms = t["kernel"].median
                rec["batched_over_kernel"] = t["batched"].median / kernel_ms if kernel_ms > 0 else None
                calls = int(exp.graph_calls)

                def back_to_back():
                    for _ in range(calls):
                        drafter.propose_kernel(ids, lengths, K)

                rec["kernel_in_graph_ms"] = 1e3 * time_in_graph(back_to_back, calls, device, int(cfg.repeats))
                if plain_ms:
                    rec["kernel_in_graph_over_plain_step"] = rec["kernel_in_graph_ms"] / plain_ms
            if plain_ms:
                rec["propose_over_plain_step"] = t[search].median / plain_ms
            line = ", ".join(f"{name} {t[name].median:.3f} ms" for name in fns)
            if on_triton:
                line += f", kernel in a graph {rec['kernel_in_graph_ms']:.4f} ms"
            log.add(rec, f"B={B} W={W}: {line}; propose takes {search}")
    write_report(log.records, log.out_dir, f"n-gram proposal: the searches side by side, {device}, K={K}")
    return log.records
