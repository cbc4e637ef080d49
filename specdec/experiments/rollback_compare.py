"""The rollback comparison (``experiment=rollback``): each strategy over a batch x K grid.

For one model (default the zoo's gdn-target; ``model=qwen35-4b-shape`` / ``nemotronh-4b-shape``
with ``experiment.end_to_end=false`` for the kernel-level figures at a 4B model's shapes), per
strategy, batch B and K, one record with:

* end to end (``experiment.end_to_end``): ``specdec.wrap(...).generate`` on B prompts with the
  configured drafter, ``repeats`` times (:func:`.e2e.speculative_point`); ``e2e_verify_ms`` /
  ``e2e_commit_ms`` per verify step from :class:`specdec.Stats` (``verify_s``: target forward
  + acceptance; ``rollback_s``: commit, the replay fold included), ``speedup`` over specdec's
  own plain decoding (``num_speculative_tokens=0``) on the same batch, timed side by side with
  HF's greedy ``generate()`` (``hf_speedup``), ``within_noise``, ``exact`` (output == HF
  greedy, token for token; where not, each row's first divergence and margin) and ``state_exact`` (every SSM layer's committed state == HF's
  state after the same tokens, relative error < 1e-5 in fp32);
* kernel level (``experiment.kernel_level``): one SSM layer's strategy verify / commit / fold
  on synthetic inputs at the model's SSM shape (:mod:`.kernel_timing`), ``repeats`` times;
  times per layer and step (medians), ``ssm_ms_per_step`` = their sum x the SSM layer count
  (median, min-max of the repeats);
* bytes moved per step (the cost model of :mod:`.kernel_timing`, all SSM layers x batch),
  extra memory per sequence (``strategy.extra_state_bytes`` x layers) and ``max_batch``: the
  largest batch whose SSM state (live + extra, all layers) fits the memory budget:
  ``experiment.memory_budget_gib`` when set, else this device's memory (a GPU's total, a CPU
  machine's available memory), recorded as ``memory_budget_gib`` / ``memory_budget_source``.

Medians and spreads come from :mod:`.timing`, like every experiment's.

The summary recommends the fastest exact strategy per grid point (``experiment.recommend_by``:
kernel-level SSM time, or end-to-end verify + commit time). Outputs: ``results.jsonl``,
``summary.md``, ``rollback_time_vs_batch.png``, ``speedup_vs_batch.png``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig

from .common import apply_cpu_threads, check_context, common_fields, make_drafter, progress_bar, write_outputs
from .models import load_draft, load_target, resolve_device, ssm_shape, target_config
from .timing import Timing

__all__ = ["run", "memory_budget"]

_GIB = 1 << 30


def memory_budget(cfg, device: torch.device) -> tuple[float, str]:
    """``(bytes, source)`` of the SSM-state budget behind ``max_batch``: ``experiment.memory_budget_gib``
    when set (source ``"config"``), else the device's memory: a GPU's total memory, or on CPU
    the machine's available memory (``MemAvailable`` of ``/proc/meminfo``, else free pages)."""
    gib = cfg.experiment.memory_budget_gib
    if gib is not None:
        return float(gib) * _GIB, "config"
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), "this GPU's total memory"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return float(int(info["MemAvailable"].split()[0]) * 1024), "this machine's available memory"
    except (OSError, KeyError, ValueError):
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "this machine's free memory"


def _kernel_point(shape, strategy, B, K, device, exp, repeats: int, seed: int) -> dict:
    """:func:`.kernel_timing.time_strategy` ``repeats`` times; the per-layer times are medians,
    ``kernel_step_us`` also gets its min-max; the other figures are the first run's (the same
    synthetic inputs every run)."""
    from .kernel_timing import time_strategy

    runs = [time_strategy(shape, strategy, B, K, device, steps=int(exp.kernel_steps), warmup=int(exp.kernel_warmup),
                          accept_p=float(exp.kernel_accept_p), seed=seed) for _ in range(repeats)]
    out = dict(runs[0])
    for key in ("kernel_verify_us", "kernel_commit_us", "kernel_fold_us"):
        out[key] = Timing(tuple(r[key] for r in runs)).median
    out.update(Timing(tuple(r["kernel_step_us"] for r in runs)).fields("kernel_step_us"))
    return out


def _shape_of(spec, model):
    if model is not None:
        return ssm_shape(model.config)
    if str(spec.source) == "random_shape":
        return ssm_shape(target_config(spec))
    if str(spec.source) == "zoo":
        import transformers

        from .. import zoo

        return ssm_shape(transformers.AutoConfig.from_pretrained(zoo.path(spec.name)))
    import transformers

    return ssm_shape(transformers.AutoConfig.from_pretrained(spec.name))


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the comparison; returns the records (also written to ``out_dir``)."""
    from .. import zoo
    from .e2e import batch_encoding, plain_reference, speculative_point

    exp = cfg.experiment
    if not (exp.end_to_end or exp.kernel_level):
        raise ValueError("experiment.end_to_end and experiment.kernel_level are both false: nothing to measure")
    device, dtype = resolve_device(cfg)
    torch.manual_seed(int(cfg.seed))
    batches = [int(b) for b in exp.batch_grid]
    Ks = [int(k) for k in exp.k_grid]
    repeats = int(cfg.repeats)
    strategies = [str(s) for s in cfg.rollback.strategies]
    drafter_name = str(cfg.drafter.names[0])
    prompts = zoo.prompts(str(cfg.prompts.set), limit=cfg.prompts.limit) if exp.end_to_end else []
    budget, budget_source = memory_budget(cfg, device)
    records: list[dict] = []
    n_points = len(cfg.model.targets) * len(batches) * len(Ks) * len(strategies)
    bar = None
    for spec in cfg.model.targets:
        model = tok = draft = None
        if exp.end_to_end:
            model, tok = load_target(spec, device, dtype, int(cfg.seed))
            if drafter_name == "draft_model":
                if not spec.get("draft"):
                    raise ValueError(f"drafter=draft_model but model {spec.name!r} has no draft model")
                draft = load_draft(spec, device, dtype)
        if bar is None:  # the thread line, then the one bar
            apply_cpu_threads(cfg, model, device)
            bar = progress_bar(cfg, n_points, "rollback") or False
        shape = _shape_of(spec, model) if exp.kernel_level else None
        if exp.end_to_end:  # (the largest batch pads widest)
            check_context(str(spec.name), model, batch_encoding(tok, prompts, max(batches), device)["input_ids"].shape[1],
                          int(cfg.max_new_tokens))
        for B in batches:
            enc = plain = None
            if exp.end_to_end:
                enc = batch_encoding(tok, prompts, B, device)
                plain = plain_reference(model, enc, int(cfg.max_new_tokens), tok.pad_token_id, device,
                                        repeats=repeats, warmup=bool(exp.warmup))
            for K in Ks:
                for strategy in strategies:
                    rec = {**common_fields(cfg, "rollback", spec, device, dtype), "drafter": drafter_name,
                           "rollback": strategy, "batch": B, "num_speculative_tokens": K,
                           "recommend_by": str(exp.recommend_by), "repeats": repeats}
                    if shape is not None:
                        rec.update(ssm_op=shape.op, ssm_layers=shape.num_layers, ssm_shape=shape.describe())
                    if exp.end_to_end:
                        drafter = make_drafter(cfg, drafter_name, draft)
                        e = speculative_point(model, enc, drafter=drafter, strategy=strategy, K=K,
                                              max_new=int(cfg.max_new_tokens), pad=tok.pad_token_id, device=device,
                                              dtype=dtype, plain=plain, reference=plain.hf_out, repeats=repeats,
                                              warmup=bool(exp.warmup))
                        rec.update({_e2e_name(k): v for k, v in e.items()})
                    if exp.kernel_level and shape is not None:
                        kt = _kernel_point(shape, strategy, B, K, device, exp, repeats, int(cfg.seed))
                        rec.update(kt)
                        L = shape.num_layers
                        rec["ssm_ms_per_step"] = kt["kernel_step_us"] * L / 1e3
                        rec["ssm_ms_per_step_min"] = kt["kernel_step_us_min"] * L / 1e3
                        rec["ssm_ms_per_step_max"] = kt["kernel_step_us_max"] * L / 1e3
                        rec["rollback_ms_per_step"] = (kt["kernel_commit_us"] + kt["kernel_fold_us"]) * L / 1e3
                        rec["bytes_per_step_MB"] = kt["design_bytes_per_layer"] * L * B / 1e6
                        rec["extra_MiB_per_seq"] = kt["extra_bytes_per_layer"] * L / (1 << 20)
                        rec["max_batch"] = int(budget // (L * (kt["state_bytes"] + kt["extra_bytes_per_layer"])))
                        rec["memory_budget_gib"] = budget / _GIB
                        rec["memory_budget_source"] = budget_source
                        rec["kernel_state_exact"] = bool(kt["kernel_state_rel_err"] < 1e-5)
                    records.append(rec)
                    if bar:
                        bar.update(1)
        del model, draft
    if bar:
        bar.close()
    title = (f"Rollback comparison: {', '.join(t.name for t in cfg.model.targets)}, drafter {drafter_name}, "
             f"{cfg.max_new_tokens} new tokens, {device}, {str(dtype).replace('torch.', '')}, {repeats} repeats")
    write_outputs(records, out_dir, title)
    return records


#: end-to-end fields that get the ``e2e_`` prefix in rollback records (with their _min / _max)
_E2E = ("verify_ms", "commit_ms", "draft_ms", "step_ms", "wall_s", "ms_per_step")


def _e2e_name(key: str) -> str:
    base = key[:-4] if key.endswith(("_min", "_max")) else key
    return f"e2e_{key}" if base in _E2E else key
