"""Adaptive speculation against every fixed choice (``experiment=adaptive``): does
``num_speculative_tokens="auto"``, ``rollback="auto"`` (:mod:`specdec.adaptive`) keep up with the
best fixed (K, strategy) of each workload, and beat every fixed K where the acceptance changes?

For each target and batch size of ``experiment.batch_grid``, on one batch:

1. specdec's plain decoding (``num_speculative_tokens=0``, same engine and decode path): the
   baseline and the reference output (:func:`.e2e.plain_reference`);
2. the workloads: the oracle drafter (:class:`specdec.drafters.OracleDrafter`, proposing the plain
   output, each draft corrupted with probability 1 - a) at each ``drafter.oracle_acceptance``,
   and the changing workload, whose acceptance follows ``experiment.acceptance_phases`` over
   equal shares of the ``max_new_tokens`` new tokens (e.g. ``[0.9, 0.1]``: rows that switch from
   copy-heavy text to free text half way);
3. every fixed K of ``experiment.k_grid`` with every strategy of ``rollback.strategies``, then
   auto (both choices, K up to the largest of ``k_grid``), each run on every workload by one
   generator (:func:`.e2e.speculative_generator`; each workload assigns it a new drafter, which
   keeps its static decoder, so its CUDA graphs are captured once per cell and batch) and timed by
   :func:`.e2e.speculative_point`: one untimed call first when ``experiment.warmup``, on the
   first workload (it compiles, captures and measures auto's step costs) and, for auto, on every
   workload (its policy measures the new drafter's proposal times there and ``rollback="auto"``
   chooses the strategy again, so the timed calls start as on a new generator); then ``repeats``
   timed calls, median and min-max. One generator is alive at a time (each holds a batch's
   caches), freed after its cell.

The auto record also holds ``vs_best_fixed`` (its decode tokens/s over the best fixed cell's of the
same workload and batch), ``best_fixed`` (that cell), ``vs_worst_fixed_k`` (over the best
strategy of the worst fixed K: where every fixed K loses, auto must beat each of them), the K it
chose at each step (``k_per_step``), the strategy it ran and why, and its predicted and measured
tokens/s. A cell (or a batch's plain decoding) that runs out of device memory is skipped and
listed at the end of ``summary.md``; the others run. Records are appended to ``results.jsonl`` as
measured (cell by cell); the returned
records, like ``summary.md``'s table, are per target, batch and workload, the cells in the order
above. ``summary.md`` has the table, ``speedup_vs_batch.png`` the decode speedup of every cell and
``k_over_time.png`` auto's K per step on each workload with the workload's acceptance.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from .common import RunRecords, apply_cpu_threads, check_context, common_fields, make_drafter, progress_bar
from .models import load_target, resolve_device

__all__ = ["run", "schedule", "workloads"]


def schedule(phases: list[float], max_new: int) -> list[float]:
    """One acceptance per new-token position: ``phases`` over equal shares of ``max_new`` (the
    last phase takes the remainder)."""
    share = max(1, max_new // len(phases))
    return [phases[min(p // share, len(phases) - 1)] for p in range(max_new)]


def workloads(cfg) -> list[tuple[str | float, float | list[float]]]:
    """``(label, acceptance)`` of every workload: each ``drafter.oracle_acceptance`` (label: the
    rate), then the changing one (label ``"0.9->0.1"``, acceptance: :func:`schedule`)."""
    out: list = [(float(a), float(a)) for a in cfg.drafter.oracle_acceptance]
    phases = [float(a) for a in cfg.experiment.acceptance_phases]
    if phases:
        out.append(("->".join(f"{a:g}" for a in phases), schedule(phases, int(cfg.max_new_tokens))))
    return out


def _compare(auto: dict, fixed: list[dict]) -> dict:
    """auto's decode tokens/s against the fixed cells of its workload and batch (none: no comparison)."""
    if not fixed:
        return {}
    best = max(fixed, key=lambda r: r["decode_tokens_per_s"])
    per_k: dict = {}
    for r in fixed:
        K = r["num_speculative_tokens"]
        per_k[K] = max(per_k.get(K, 0.0), r["decode_tokens_per_s"])
    worst_k = min(per_k, key=per_k.get)
    rate = auto["decode_tokens_per_s"]
    return {"vs_best_fixed": rate / best["decode_tokens_per_s"] if best["decode_tokens_per_s"] > 0 else None,
            "best_fixed": f"K={best['num_speculative_tokens']} {best['rollback']}",
            "vs_worst_fixed_k": rate / per_k[worst_k] if per_k[worst_k] > 0 else None}


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the comparison; returns the records (also in ``out_dir``)."""
    from .. import zoo
    from .e2e import plain_reference, release, speculative_generator, speculative_point, timing_batch
    from .report import write_report

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    torch.manual_seed(int(cfg.seed))
    max_new, repeats, path = int(cfg.max_new_tokens), int(cfg.repeats), str(exp.decode_path)
    batches = [int(b) for b in exp.batch_grid]
    k_grid = [int(k) for k in exp.k_grid]
    strategies = [str(s) for s in cfg.rollback.strategies if str(s) != "auto"]
    cells = [(K, s) for K in k_grid for s in strategies] + [("auto", "auto")]  # auto last: it compares
    loads = workloads(cfg)
    prompts = [] if exp.prompt_tokens is not None else zoo.prompts(str(cfg.prompts.set), limit=cfg.prompts.limit)
    log = RunRecords(out_dir)
    skipped: list[str] = []  # cells that ran out of device memory
    records: list[dict] = []  # per target, batch and workload, the cells in order
    total = len(cfg.model.targets) * len(batches) * len(loads) * len(cells)
    bar = None
    for spec in cfg.model.targets:
        model, tok = load_target(spec, device, dtype, int(cfg.seed))
        if exp.ignore_eos:
            model.generation_config.eos_token_id = None
        if bar is None:
            apply_cpu_threads(cfg, model, device)
            bar = log.bar = progress_bar(cfg, total, str(exp.name)) or False
        widest = timing_batch(max(batches), exp.prompt_tokens, prompts, tok, model.config.vocab_size, device,
                              int(cfg.seed))[0]["input_ids"].shape[1]  # (the largest batch pads widest)
        check_context(str(spec.name), model, widest, max_new)
        for B in batches:
            enc, pad = timing_batch(B, exp.prompt_tokens, prompts, tok, model.config.vocab_size, device,
                                    int(cfg.seed))
            try:
                plain = plain_reference(model, enc, max_new, pad, device, repeats=repeats, warmup=bool(exp.warmup),
                                        hf=False, decode_path=path)
            except torch.OutOfMemoryError as err:  # not even plain decoding fits: the next batch
                skipped.append(f"{spec.name} B={B}: plain decoding ran out of device memory "
                               f"({str(err).splitlines()[0][:120]})")
                release(device)
                continue
            measured: dict[tuple[int, int], dict] = {}  # (workload, cell) -> record
            for c, (K, strategy) in enumerate(cells):
                sd = None
                try:
                    for w, (label, acceptance) in enumerate(loads):
                        drafter = make_drafter(cfg, "oracle", reference=plain.plain_out,
                                               attention_mask=enc["attention_mask"], acceptance=acceptance)
                        if sd is None:
                            sd = speculative_generator(model, drafter=drafter, strategy=strategy, K=K,
                                                       decode_path=path, max_speculative_tokens=max(k_grid))
                        e = speculative_point(model, enc, drafter=drafter, strategy=strategy, K=K, max_new=max_new,
                                              pad=pad, device=device, dtype=dtype, plain=plain,
                                              reference=plain.plain_out, repeats=repeats,
                                              warmup=bool(exp.warmup) and (w == 0 or K == "auto"), check_state=False,
                                              decode_path=path, max_speculative_tokens=max(k_grid), sd=sd)
                        rec = {**common_fields(cfg, "adaptive", spec, device, dtype), "drafter": "oracle",
                               "acceptance": label, "rollback": strategy, "batch": B, "num_speculative_tokens": K,
                               "repeats": repeats, "prompt_tokens": int(enc["input_ids"].shape[1]), **e,
                               "mean_k": sum(k * n for k, n in enumerate(e["k_histogram"])) / max(1, e["steps"])}
                        if K == "auto":
                            rec.update(_compare(rec, [measured[w, f] for f in range(c) if (w, f) in measured]))
                            if not isinstance(acceptance, float):
                                rec["acceptance_schedule"] = acceptance
                        measured[w, c] = rec
                        log.add(rec, f"{spec.name} B={B} a={label} K={K} {strategy}: decode "
                                     f"{e['decode_tokens_per_s']:.1f} tokens/s ({e['decode_speedup']:.2f}x plain)")
                except torch.OutOfMemoryError as err:  # the cell does not fit this batch: the grid goes on
                    skipped.append(f"{spec.name} B={B} K={K} {strategy}: out of device memory "
                                   f"({str(err).splitlines()[0][:120]})")
                if sd is not None:
                    sd.release()  # its static buffers and graphs, before the next cell's
                del sd
                release(device)
            records += [measured[w, c] for w in range(len(loads)) for c in range(len(cells)) if (w, c) in measured]
        del model
        release(device)
    log.close()
    title = (f"Adaptive speculation vs fixed (K, strategy): {', '.join(t.name for t in cfg.model.targets)}, "
             f"K in {k_grid}, {max_new} new tokens, {device}, {str(dtype).replace('torch.', '')}, {repeats} repeats")
    text = write_report(records, log.out_dir, title)
    if skipped:
        text += "\nSkipped: " + "; ".join(skipped) + "\n"
        (log.out_dir / "summary.md").write_text(text)
        print("Skipped: " + "; ".join(skipped))
    return records
