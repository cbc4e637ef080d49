"""The acceptance experiment: targets x drafters x rollback strategies over a prompt set.

Drafters: ``ngram``, ``draft_model`` (targets with ``draft``), ``medusa`` (the target's zoo Medusa
heads, targets with ``medusa``: chain drafting, or tree drafting with ``drafter.tree=default`` /
``medusa-63`` / a list of paths, reported as ``medusa-tree:<tree>``), ``mtp`` (the MTP layers of
the target's own checkpoint, targets with ``mtp: true``).

For every configuration and prompt it records mean accepted tokens (Spec-Bench's tokens per
target forward, bonus included), acceptance rate, the accepted-length histogram, tokens/s,
the speedup over plain greedy decoding of the same model on the same prompt in the same run
(transformers' ``generate()``), and whether the output equals that plain greedy output token
for token; where it does not, the first differing position, the plain run's own top-2 logit
margin there (``divergence_margin``, from its ``output_logits``) and whether that is a near-tie
(``near_tie``: margin < 0.25 in bf16/fp16, the only divergence DESIGN.md allows; never in fp32).
Results go to ``results.jsonl`` (one record per prompt and configuration),
``summary.md`` (the table, means over prompts) and ``accept_hist.png`` in the run folder.

Several processes (``accelerate launch --multi_gpu --num_processes N -m specdec ...``): each runs
its contiguous share of the prompts (``split``), the records are gathered on the main process
(``records_sink``), put back in the one-process order, and written once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .common import common_fields, make_drafter, progress_bar, write_outputs
from .models import load_target, resolve_device

__all__ = ["run", "load_target", "resolve_device"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


#: DESIGN.md: in bf16 a divergence from plain greedy output is allowed only where the plain run's
#: top-2 logit margin is below this (a genuine near-tie)
NEAR_TIE_MARGIN = 0.25
HALF_DTYPES = (torch.bfloat16, torch.float16)


def first_divergence(out: torch.Tensor, ref: torch.Tensor) -> int | None:
    """Index of the first position where ``out [1, L1]`` and ``ref [1, L2]`` differ (a shorter
    one ending early counts as differing where it ends); None when they are equal."""
    n = min(out.shape[1], ref.shape[1])
    diff = (out[0, :n] != ref[0, :n]).nonzero()
    if diff.numel():
        return int(diff[0, 0])
    return None if out.shape[1] == ref.shape[1] else n


def divergence_fields(out: torch.Tensor, ref: torch.Tensor, ref_margins: torch.Tensor, prompt_tokens: int,
                      dtype: torch.dtype) -> dict:
    """The exactness fields of a record: ``exact``; where ``out [1, L1]`` differs from the plain
    output ``ref [1, L2]`` (both with the prompt), ``divergence_position`` (0 = first new token),
    ``divergence_margin`` (``ref_margins [L2 - prompt_tokens]``, the plain run's top-2 logit
    margin per new token, at that position; None where one output had already ended) and
    ``near_tie`` (margin < :data:`NEAR_TIE_MARGIN` in bf16/fp16; DESIGN.md allows no divergence
    in fp32, so there it is always False)."""
    pos = first_divergence(out, ref)
    if pos is None:
        return {"exact": True, "divergence_position": None, "divergence_margin": None, "near_tie": None}
    margin = None
    if pos < min(out.shape[1], ref.shape[1]):  # both runs chose a token there
        margin = float(ref_margins[pos - prompt_tokens])
    near_tie = margin is not None and margin < NEAR_TIE_MARGIN and dtype in HALF_DTYPES
    return {"exact": False, "divergence_position": pos - prompt_tokens, "divergence_margin": margin,
            "near_tie": near_tie}


def _configs(cfg, target_spec):
    for drafter in cfg.drafter.names:
        if str(drafter) == "draft_model" and not target_spec.get("draft"):
            continue
        if str(drafter) == "medusa" and not target_spec.get("medusa"):
            continue
        if str(drafter) == "mtp" and not target_spec.get("mtp"):
            continue
        for strategy in cfg.rollback.strategies:
            yield str(drafter), str(strategy)


def run(cfg: DictConfig, out_dir: Path, records_sink=None, split=None, show_progress: bool = True) -> list[dict]:
    """Run the experiment; returns the records (also written to ``out_dir``).

    ``split``: optional callable(list) -> list, this process's share of the prompts
    (multi-process runs). ``records_sink``: optional callable(list[dict]) -> list[dict] | None
    that gathers records across processes; outputs are written only where it returns a list
    (the main process), and an empty list is returned elsewhere. ``show_progress``: False on
    the processes other than the main one (one progress bar per launch).

    Raises: ValueError when no selected target has what the drafters need (``drafter=draft_model``:
    a draft model; ``drafter=medusa``: Medusa heads, ``model.targets[*].medusa``; ``drafter=mtp``:
    MTP layers in its checkpoint, ``model.targets[*].mtp``).
    """
    import specdec

    from .. import zoo

    device, dtype = resolve_device(cfg)
    if device.type == "cpu" and cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    torch.manual_seed(int(cfg.seed))
    all_prompts = zoo.prompts(str(cfg.prompts.set), limit=cfg.prompts.limit)
    order = {p["id"]: i for i, p in enumerate(all_prompts)}
    prompts = split(all_prompts) if split is not None else all_prompts
    K = int(cfg.num_speculative_tokens)
    max_new = int(cfg.max_new_tokens)
    records: list[dict] = []
    plan = [(spec, d, s) for spec in cfg.model.targets for d, s in _configs(cfg, spec)]
    if not plan:
        raise ValueError(f"drafter={','.join(map(str, cfg.drafter.names))} but no selected model has a draft model "
                         "(model.targets[*].draft), Medusa heads (model.targets[*].medusa) or MTP layers "
                         "(model.targets[*].mtp); use drafter=ngram or model=gdn-target")
    planned = {str(s.name) for s, _, _ in plan}  # targets with at least one configuration (others are skipped)
    total = len(plan) * len(prompts) + len(planned) * len(prompts)
    bar = progress_bar(cfg, total, "acceptance", enabled=show_progress)
    for spec in cfg.model.targets:
        if str(spec.name) not in planned:
            continue
        model, tok = load_target(spec, device, dtype, int(cfg.seed))
        draft = None
        if spec.get("draft") and "draft_model" in [str(d) for d in cfg.drafter.names]:
            draft, _ = load_target(OmegaConf.create({"name": spec.draft, "source": str(spec.source)}), device, dtype)
        heads = None
        if spec.get("medusa") and "medusa" in [str(d) for d in cfg.drafter.names]:
            heads = zoo.load_medusa(str(spec.medusa), target=model)  # bound to this target's LM head
        # plain greedy decoding of the same model: the baseline and the exactness reference
        plain = {}
        for p in prompts:
            enc = tok(p["prompt"], return_tensors="pt").to(device)
            if cfg.experiment.warmup and not plain:
                model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
            _sync(device)
            t0 = time.perf_counter()
            gen = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id,
                                 output_logits=True, return_dict_in_generate=True)
            _sync(device)
            dt = time.perf_counter() - t0
            # the plain run's own top-2 logit margin at each new token (the near-tie test's input)
            top2 = torch.stack(gen.logits, 1)[0].float().topk(2, dim=-1).values
            plain[p["id"]] = (gen.sequences, dt, (top2[:, 0] - top2[:, 1]).cpu())
            if bar:
                bar.update(1)
        for plan_index, (s, drafter_name, strategy) in enumerate(plan):
            if s.name != spec.name:
                continue
            label = drafter_name
            if drafter_name == "medusa":
                from ..drafters import MedusaDrafter

                tree = cfg.drafter.get("tree")
                tree = OmegaConf.to_container(tree) if OmegaConf.is_config(tree) else tree
                drafter = MedusaDrafter(heads, tree=tree)
                if tree is not None:  # its own row in the summary
                    label = f"medusa-tree:{tree}" if isinstance(tree, str) else f"medusa-tree:{drafter.tree.num_nodes}"
            elif drafter_name == "mtp":  # the MTP layers of the target's own checkpoint
                drafter = "mtp"
            else:
                drafter = make_drafter(cfg, drafter_name, draft)
            sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K)
            warmed = not cfg.experiment.warmup
            for p in prompts:
                enc = tok(p["prompt"], return_tensors="pt").to(device)
                if not warmed:
                    sd.generate(**enc, max_new_tokens=4, pad_token_id=tok.pad_token_id)
                    warmed = True
                _sync(device)
                t0 = time.perf_counter()
                out = sd.generate(**enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
                _sync(device)
                dt = time.perf_counter() - t0
                ref, ref_s, ref_margins = plain[p["id"]]
                st = sd.last_stats
                prompt_tokens = int(enc["input_ids"].shape[1])
                new = out.shape[1] - prompt_tokens
                div = divergence_fields(out, ref, ref_margins, prompt_tokens, dtype)
                records.append(
                    {
                        **common_fields(cfg, "acceptance", spec, device, dtype),
                        "drafter": label,
                        "rollback": strategy,
                        "num_speculative_tokens": K,
                        "prompt_id": p["id"],
                        "prompt_set": p.get("set", str(cfg.prompts.set)),
                        "prompt_tokens": int(enc["input_ids"].shape[1]),
                        "new_tokens": int(new),
                        "mean_accepted_tokens": st.mean_accepted_tokens,
                        "acceptance_rate": st.acceptance_rate,
                        "accept_histogram": list(st.accept_histogram),
                        "steps": st.steps,
                        "decode_path": st.decode_path,  # eager / static / cuda_graph: which loop the timing is of
                        "tokens_per_s": new / dt if dt > 0 else 0.0,
                        "plain_tokens_per_s": (ref.shape[1] - enc["input_ids"].shape[1]) / ref_s if ref_s > 0 else 0.0,
                        "speedup": ref_s / dt if dt > 0 else 0.0,
                        **div,
                        "draft_s": st.draft_s,
                        "verify_s": st.verify_s,
                        "rollback_s": st.rollback_s,
                        "wall_s": dt,
                        "process": int(os.environ.get("RANK", "0")),  # which process ran it (multi-process runs)
                        "_order": (plan_index, order[p["id"]]),
                    }
                )
                if bar:
                    bar.update(1)
        del model, draft, heads
    if bar:
        bar.close()
    if records_sink is not None:
        records = records_sink(records)
        if records is None:
            return []
    records.sort(key=lambda r: tuple(r["_order"]))  # gathered records in the one-process order
    for r in records:
        del r["_order"]
    title = (f"Acceptance: K={K}, {max_new} new tokens, prompt set {cfg.prompts.set} ({len(all_prompts)} prompts), "
             f"{device}")
    write_outputs(records, out_dir, title)
    return records
