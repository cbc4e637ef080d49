"""Time of one n-gram (prompt lookup) proposal (``experiment=ngram_proposal``): the batched device
search (:meth:`specdec.drafters.NGramDrafter.propose_batched`) against the per-row host loop
(:func:`specdec.drafters.ngram.propose_ngram_reference`), side by side.

``NGramDrafter.propose`` takes the loop up to ``HOST_SEARCH_MAX_BATCH`` rows and the batched
search above; these figures are what that threshold rests on. For each batch B in
``experiment.batch_grid`` and text width W in ``experiment.widths``: random texts over an
``experiment.vocab_size``-token vocabulary (repeats are common, so most rows find a match),
ragged lengths in [W/2, W], K = ``num_speculative_tokens`` drafts, n-grams
``drafter.ngram.min_ngram`` .. ``max_ngram``. Both must propose the same tokens and counts
(checked at every point: ``same_proposals``); then ``repeats`` rounds each call both once, side
by side after ``experiment.warmup`` untimed rounds, with a device sync around each call (on CUDA
the loop's host copy and per-row writes are what it costs): median and min-max (:mod:`.timing`).

Records are appended to ``results.jsonl`` as measured; ``summary.md`` at the end.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .common import RunRecords, provenance
from .models import resolve_device
from .timing import overlaps, time_side_by_side

__all__ = ["run"]


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the comparison; returns the records (also in ``out_dir``).

    Raises: RuntimeError when the two searches propose differently at a point (a bug)."""
    from specdec.drafters import NGramDrafter
    from specdec.drafters.ngram import propose_ngram_reference

    from .report import write_report

    exp = cfg.experiment
    device, _ = resolve_device(cfg)
    if device.type == "cpu" and cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    K = int(cfg.num_speculative_tokens)
    lo, hi = int(cfg.drafter.ngram.min_ngram), int(cfg.drafter.ngram.max_ngram)
    drafter = NGramDrafter(min_ngram=lo, max_ngram=hi)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    log = RunRecords(out_dir)
    common = {"experiment": "ngram_proposal", "device": str(device), **provenance(device),
              "num_speculative_tokens": K, "min_ngram": lo, "max_ngram": hi, "vocab_size": int(exp.vocab_size),
              "repeats": int(cfg.repeats), "seed": int(cfg.seed), "config": OmegaConf.to_container(cfg, resolve=True)}
    for B in (int(b) for b in exp.batch_grid):
        for W in (int(w) for w in exp.widths):
            ids = torch.randint(0, int(exp.vocab_size), (B, W), generator=gen).to(device)
            lengths = torch.randint(W // 2, W + 1, (B,), generator=gen).to(device)
            batched = drafter.propose_batched(ids, lengths, K)
            loop = propose_ngram_reference(ids, lengths, K, lo, hi)
            same = torch.equal(batched[0], loop[0]) and torch.equal(batched[1], loop[1])
            if not same:
                raise RuntimeError(f"the batched n-gram search proposes differently from the per-row loop at batch {B}, "
                                 f"width {W}")
            t = time_side_by_side({"loop": lambda: propose_ngram_reference(ids, lengths, K, lo, hi),
                                   "batched": lambda: drafter.propose_batched(ids, lengths, K)},
                                  int(cfg.repeats), device, warmup=int(exp.warmup))
            (loop_t, _), (batched_t, _) = t["loop"], t["batched"]
            rec = {**common, "batch": B, "width": W, **loop_t.scaled(1e3).fields("loop_ms"),
                   **batched_t.scaled(1e3).fields("batched_ms"),
                   "loop_over_batched": loop_t.median / batched_t.median if batched_t.median > 0 else None,
                   "within_noise": overlaps(loop_t, batched_t), "same_proposals": same,
                   "rows_with_drafts": int((batched[1] > 0).sum())}
            log.add(rec, f"B={B} W={W}: loop {rec['loop_ms']:.3f} ms, batched {rec['batched_ms']:.3f} ms")
    write_report(log.records, log.out_dir, f"n-gram proposal: batched search vs per-row loop, {device}, K={K}")
    return log.records
