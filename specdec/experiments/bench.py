"""The end-to-end benchmark (``experiment=bench``): tokens/s and speedup per strategy and batch.

For each target, batch size in ``experiment.batch_grid`` and rollback strategy, with the
configured drafter and ``num_speculative_tokens``: specdec's own plain decoding
(``num_speculative_tokens=0``, the baseline) and HF's greedy ``generate()`` on the batch, side
by side, then ``specdec.wrap(...).generate()`` on the same batch; each ``repeats`` times,
median and min-max (:mod:`.timing`). One record per (target, strategy, batch):
``tokens_per_s``, ``plain_tokens_per_s``, ``hf_tokens_per_s`` (each with ``_min`` / ``_max``),
``speedup`` (vs specdec plain), ``hf_speedup``, ``within_noise``, ``ms_per_step`` (wall time
per verify step), ``mean_accepted_tokens``, ``exact`` (output == HF greedy). Outputs:
``results.jsonl``, ``summary.md``, ``speedup_vs_batch.png``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .common import apply_cpu_threads, common_fields, make_drafter, progress_bar, write_outputs
from .models import load_target, resolve_device

__all__ = ["run"]


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the benchmark; returns the records (also written to ``out_dir``)."""
    from .. import zoo
    from .e2e import batch_encoding, plain_reference, speculative_point

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    torch.manual_seed(int(cfg.seed))
    K = int(cfg.num_speculative_tokens)
    max_new = int(cfg.max_new_tokens)
    repeats = int(cfg.repeats)
    batches = [int(b) for b in exp.batch_grid]
    strategies = [str(s) for s in cfg.rollback.strategies]
    drafter_name = str(cfg.drafter.names[0])
    prompts = zoo.prompts(str(cfg.prompts.set), limit=cfg.prompts.limit)
    records: list[dict] = []
    bar = None
    for spec in cfg.model.targets:
        model, tok = load_target(spec, device, dtype, int(cfg.seed))
        if bar is None:  # the thread line, then the one bar
            apply_cpu_threads(cfg, model, device)
            bar = progress_bar(cfg, len(cfg.model.targets) * len(batches) * len(strategies), "bench") or False
        draft = None
        if drafter_name == "draft_model":
            if not spec.get("draft"):
                raise ValueError(f"drafter=draft_model but model {spec.name!r} has no draft model")
            draft, _ = load_target(OmegaConf.create({"name": spec.draft, "source": str(spec.source)}), device, dtype)
        for B in batches:
            enc = batch_encoding(tok, prompts, B, device)
            plain = plain_reference(model, enc, max_new, tok.pad_token_id, device, repeats=repeats,
                                    warmup=bool(exp.warmup))
            for strategy in strategies:
                e = speculative_point(model, enc, drafter=make_drafter(cfg, drafter_name, draft), strategy=strategy,
                                      K=K, max_new=max_new, pad=tok.pad_token_id, device=device, dtype=dtype,
                                      plain=plain, repeats=repeats, warmup=bool(exp.warmup), check_state=False)
                records.append({**common_fields(cfg, "bench", spec, device, dtype), "drafter": drafter_name,
                                "rollback": strategy, "batch": B, "num_speculative_tokens": K, "repeats": repeats,
                                **e})
                if bar:
                    bar.update(1)
        del model, draft
    if bar:
        bar.close()
    title = (f"Benchmark: {', '.join(t.name for t in cfg.model.targets)}, drafter {drafter_name}, K={K}, "
             f"{max_new} new tokens, {device}, {str(dtype).replace('torch.', '')}, {repeats} repeats")
    write_outputs(records, out_dir, title)
    return records
