"""The rollback comparison (``experiment=rollback``): each strategy over a batch x K grid.

For one model (default the zoo's gdn-target; ``model=qwen35-4b-shape`` / ``nemotronh-4b-shape``
with ``experiment.end_to_end=false`` for the kernel-level figures at a 4B model's shapes), per
strategy, batch B and K, one record with:

* end to end (``experiment.end_to_end``): ``specdec.wrap(...).generate`` on B prompts with the
  configured drafter; ``e2e_verify_ms`` / ``e2e_commit_ms`` per verify step from
  :class:`specdec.Stats` (``verify_s``: target forward + acceptance; ``rollback_s``: commit,
  the replay fold included), ``speedup`` over HF's plain greedy ``generate()`` on the same
  batch, ``exact`` (output == HF greedy, token for token) and ``state_exact`` (every SSM
  layer's committed state == HF's state after the same tokens, relative error < 1e-5 in fp32);
* kernel level (``experiment.kernel_level``): one SSM layer's strategy verify / commit / fold
  on synthetic inputs at the model's SSM shape (:mod:`.kernel_timing`), times per layer and
  step, ``ssm_ms_per_step`` = their sum x the SSM layer count;
* bytes moved per step (DESIGN.md cost model, all SSM layers x batch), extra memory per
  sequence (``strategy.extra_state_bytes`` x layers) and ``max_batch``: the largest batch whose
  SSM state (live + extra, all layers) fits ``experiment.memory_budget_gib``.

The summary recommends the fastest exact strategy per grid point (``experiment.recommend_by``:
kernel-level SSM time, or end-to-end verify + commit time). Outputs: ``results.jsonl``,
``summary.md``, ``rollback_time_vs_batch.png``, ``speedup_vs_batch.png``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .common import common_fields, make_drafter, progress_bar, write_outputs
from .models import load_target, resolve_device, ssm_shape, target_config

__all__ = ["run"]


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
    from .kernel_timing import time_strategy

    exp = cfg.experiment
    if not (exp.end_to_end or exp.kernel_level):
        raise ValueError("experiment.end_to_end and experiment.kernel_level are both false: nothing to measure")
    device, dtype = resolve_device(cfg)
    if device.type == "cpu" and cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    torch.manual_seed(int(cfg.seed))
    batches = [int(b) for b in exp.batch_grid]
    Ks = [int(k) for k in exp.k_grid]
    strategies = [str(s) for s in cfg.rollback.strategies]
    drafter_name = str(cfg.drafter.names[0])
    prompts = zoo.prompts(str(cfg.prompts.set), limit=cfg.prompts.limit) if exp.end_to_end else []
    budget = float(exp.memory_budget_gib) * (1 << 30)
    records: list[dict] = []
    n_points = len(cfg.model.targets) * len(batches) * len(Ks) * len(strategies)
    bar = progress_bar(cfg, n_points, "rollback")
    for spec in cfg.model.targets:
        model = tok = draft = None
        if exp.end_to_end:
            model, tok = load_target(spec, device, dtype, int(cfg.seed))
            if drafter_name == "draft_model":
                if not spec.get("draft"):
                    raise ValueError(f"drafter=draft_model but model {spec.name!r} has no draft model")
                draft, _ = load_target(OmegaConf.create({"name": spec.draft, "source": str(spec.source)}), device, dtype)
        shape = _shape_of(spec, model) if exp.kernel_level else None
        for B in batches:
            enc = plain = None
            if exp.end_to_end:
                enc = batch_encoding(tok, prompts, B, device)
                plain = plain_reference(model, enc, int(cfg.max_new_tokens), tok.pad_token_id, device,
                                        warmup=bool(exp.warmup))
            for K in Ks:
                for strategy in strategies:
                    rec = {**common_fields(cfg, "rollback", spec, device, dtype), "drafter": drafter_name,
                           "rollback": strategy, "batch": B, "num_speculative_tokens": K,
                           "recommend_by": str(exp.recommend_by)}
                    if shape is not None:
                        rec.update(ssm_op=shape.op, ssm_layers=shape.num_layers, ssm_shape=shape.describe())
                    if exp.end_to_end:
                        drafter = make_drafter(cfg, drafter_name, draft)
                        e = speculative_point(model, enc, drafter=drafter, strategy=strategy, K=K,
                                              max_new=int(cfg.max_new_tokens), pad=tok.pad_token_id, device=device,
                                              dtype=dtype, plain=plain, warmup=bool(exp.warmup))
                        rec.update({("e2e_" + k if k in ("verify_ms", "commit_ms", "draft_ms", "step_ms", "wall_s",
                                                          "ms_per_step") else k): v for k, v in e.items()})
                    if exp.kernel_level and shape is not None:
                        kt = time_strategy(shape, strategy, B, K, device, steps=int(exp.kernel_steps),
                                           warmup=int(exp.kernel_warmup), accept_p=float(exp.kernel_accept_p),
                                           seed=int(cfg.seed))
                        rec.update(kt)
                        L = shape.num_layers
                        rec["ssm_ms_per_step"] = kt["kernel_step_us"] * L / 1e3
                        rec["rollback_ms_per_step"] = (kt["kernel_commit_us"] + kt["kernel_fold_us"]) * L / 1e3
                        rec["bytes_per_step_MB"] = kt["design_bytes_per_layer"] * L * B / 1e6
                        rec["extra_MiB_per_seq"] = kt["extra_bytes_per_layer"] * L / (1 << 20)
                        rec["max_batch"] = int(budget // (L * (kt["state_bytes"] + kt["extra_bytes_per_layer"])))
                        rec["kernel_state_exact"] = bool(kt["kernel_state_rel_err"] < 1e-5)
                    records.append(rec)
                    if bar:
                        bar.update(1)
        del model, draft
    if bar:
        bar.close()
    title = (f"Rollback comparison: {', '.join(t.name for t in cfg.model.targets)}, drafter {drafter_name}, "
             f"{cfg.max_new_tokens} new tokens, {device}, {str(dtype).replace('torch.', '')}")
    write_outputs(records, out_dir, title)
    return records
