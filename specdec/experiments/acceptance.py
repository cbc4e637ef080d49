"""The acceptance experiment: targets x drafters x rollback strategies over a prompt set.

Drafters: ``ngram``, ``draft_model`` (targets with ``draft``), ``medusa`` (the target's zoo Medusa
heads, targets with ``medusa``: chain drafting, or tree drafting with ``drafter.tree=default`` /
``medusa-63`` / a list of paths, reported as ``medusa-tree:<tree>``), ``mtp`` (the MTP layers of
the target's own checkpoint, targets with ``mtp: true``; over a reduced vocabulary with
``drafter.mtp_draft_vocab=N``, reported as ``mtp-vocab:<N>``). Prompts: the shipped set
(``prompts.set``) or the user's file (``prompts.path``, :mod:`.prompts`).

For every configuration and prompt it records mean accepted tokens (Spec-Bench's tokens per
target forward, bonus included), acceptance rate, the accepted-length histogram, and whether
the output equals transformers' greedy ``generate()`` output token for token; where it does
not, the first differing position, the plain run's own top-2 logit margin there
(``divergence_margin``, from its ``output_logits``) and whether that is a near-tie
(``near_tie``: margin < 0.25 in bf16/fp16, the only divergence the exactness contract allows;
never in fp32).

Speed (:mod:`.timing`): on the first ``experiment.timed_prompts`` prompts, per target,
``repeats`` rounds each run specdec's own plain decoding (``num_speculative_tokens=0``, same
engine), HF ``generate()`` and every configuration once, side by side, so a slow phase of a
shared machine hits them alike; each figure is the median of its rounds with their min-max.
The first round's runs also give those prompts' acceptance records. ``speedup`` is
speculative / specdec plain tokens/s (``hf_speedup``: / HF), the median of the per-round ratios
with their min-max (``speedup_min`` / ``speedup_max``: :func:`.timing.paired_ratio`);
``within_noise`` says whether that range includes 1. These fields are per configuration,
repeated on each of its records.

Results go to ``results.jsonl`` (one record per prompt and configuration), ``summary.md`` (the
table, means over prompts, with its column legend) and ``accept_hist.png`` in the run folder.

Several processes (``accelerate launch --multi_gpu --num_processes N -m specdec ...``): each runs
its contiguous share of the prompts (``split``), the records are gathered on the main process
(``records_sink``), put back in the one-process order, and written once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .common import apply_cpu_threads, check_context, common_fields, make_drafter, progress_bar, write_outputs
from .models import load_draft, load_target, resolve_device
from .prompts import experiment_prompts
from .timing import paired_ratio, spans_one, time_side_by_side

__all__ = ["run", "load_target", "resolve_device"]


#: in bf16 a divergence from plain greedy output is allowed only where the plain run's top-2
#: logit margin is below this (a genuine near-tie)
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
    ``near_tie`` (margin < :data:`NEAR_TIE_MARGIN` in bf16/fp16; no divergence is allowed in
    fp32, so there it is always False)."""
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


def _encode(tok, p: dict, device, vocab_size: int):
    """``{"input_ids": [1, L], "attention_mask": [1, L]}`` of a prompt (text or token ids).

    Raises: ValueError for text the tokenizer encodes to no tokens, or ids outside the target's
    vocabulary ``[0, vocab_size)``."""
    if "input_ids" in p:
        outside = sorted({i for i in p["input_ids"] if not 0 <= i < vocab_size})
        if outside:
            raise ValueError(f"prompt {p['id']!r}: input_ids outside the target's vocabulary [0, {vocab_size}): "
                             f"{outside[:8]}{' ...' if len(outside) > 8 else ''}")
        ids = torch.tensor([p["input_ids"]], dtype=torch.long, device=device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    enc = tok(p["prompt"], return_tensors="pt").to(device)
    if enc["input_ids"].shape[1] == 0:
        raise ValueError(f"prompt {p['id']!r} encodes to no tokens with this tokenizer")
    return dict(enc)


def _new_tokens(outs, encs) -> int:
    return sum(int(o.shape[1] - e["input_ids"].shape[1]) for o, e in zip(outs, encs))


def run(cfg: DictConfig, out_dir: Path, records_sink=None, split=None, show_progress: bool = True) -> list[dict]:
    """Run the experiment; returns the records (also written to ``out_dir``).

    ``split``: optional callable(list) -> list, this process's share of the prompts
    (multi-process runs). ``records_sink``: optional callable(list[dict]) -> list[dict] | None
    that gathers records across processes; outputs are written only where it returns a list
    (the main process), and an empty list is returned elsewhere. ``show_progress``: False on
    the processes other than the main one (one progress bar, one thread line per launch).

    Raises: ValueError when no selected target has what the drafters need (``drafter=draft_model``:
    a draft model; ``drafter=medusa``: Medusa heads, ``model.targets[*].medusa``; ``drafter=mtp``:
    MTP layers in its checkpoint, ``model.targets[*].mtp``); the prompt file's errors
    (:func:`.prompts.load_prompt_file`).
    """
    import specdec

    from .. import zoo

    device, dtype = resolve_device(cfg)
    torch.manual_seed(int(cfg.seed))
    all_prompts = experiment_prompts(cfg)
    order = {p["id"]: i for i, p in enumerate(all_prompts)}
    prompts = split(all_prompts) if split is not None else all_prompts
    K = int(cfg.num_speculative_tokens)
    max_new = int(cfg.max_new_tokens)
    repeats = int(cfg.repeats)
    n_timed = cfg.experiment.timed_prompts
    timed = prompts if n_timed is None else prompts[:int(n_timed)]
    records: list[dict] = []
    plan = [(spec, d, s) for spec in cfg.model.targets for d, s in _configs(cfg, spec)]
    if not plan:
        raise ValueError(f"drafter={','.join(map(str, cfg.drafter.names))} but no selected model has a draft model "
                         "(model.targets[*].draft), Medusa heads (model.targets[*].medusa) or MTP layers "
                         "(model.targets[*].mtp); give one (e.g. model.targets.0.draft=<folder or hub id>, or "
                         "model.targets.0.mtp=true for a checkpoint that ships MTP layers), or use drafter=ngram "
                         "or model=gdn-target")
    planned = {str(s.name) for s, _, _ in plan}  # targets with at least one configuration (others are skipped)
    total = len(plan) * len(prompts) + len(planned) * len(prompts)
    bar = None
    for spec in cfg.model.targets:
        if str(spec.name) not in planned:
            continue
        model, tok = load_target(spec, device, dtype, int(cfg.seed))
        if bar is None:  # the thread line first, then the one bar
            apply_cpu_threads(cfg, model, device, show=show_progress)
            bar = progress_bar(cfg, total, "acceptance", enabled=show_progress) or False
        draft = None
        if spec.get("draft") and "draft_model" in [str(d) for d in cfg.drafter.names]:
            draft = load_draft(spec, device, dtype)
        heads = None
        if spec.get("medusa") and "medusa" in [str(d) for d in cfg.drafter.names]:
            heads = zoo.load_medusa(str(spec.medusa), target=model)  # bound to this target's LM head
        pad = tok.pad_token_id
        vocab = model.get_input_embeddings().num_embeddings
        encs = {p["id"]: _encode(tok, p, device, vocab) for p in prompts}
        check_context(str(spec.name), model, max((e["input_ids"].shape[1] for e in encs.values()), default=0), max_new)
        timed_encs = [encs[p["id"]] for p in timed]

        def hf_generate(enc, n=max_new, **kw):
            return model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=pad, **kw)

        # plain greedy decoding with HF: the exactness reference, with its own top-2 logit margins
        plain = {}
        for p in prompts:
            enc = encs[p["id"]]
            if cfg.experiment.warmup and not plain:
                hf_generate(enc, 4)
            gen = hf_generate(enc, output_logits=True, return_dict_in_generate=True)
            top2 = torch.stack(gen.logits, 1)[0].float().topk(2, dim=-1).values
            plain[p["id"]] = (gen.sequences, (top2[:, 0] - top2[:, 1]).cpu())
            if bar:
                bar.update(1)
        sd_plain = specdec.wrap(model, drafter="ngram", rollback=str(cfg.rollback.strategies[0]),
                                num_speculative_tokens=0)  # specdec's own plain decoding: the baseline
        configs = []  # (plan index, row label, strategy, wrapped model)
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
                drafter = make_drafter(cfg, "mtp", target=model, tokenizer=tok)
                if drafter.draft_vocab is not None:  # its own row in the summary
                    label = f"mtp-vocab:{drafter.draft_vocab.numel()}"
            else:
                drafter = make_drafter(cfg, drafter_name, draft)
            configs.append((plan_index, label, strategy,
                            specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K)))
        if cfg.experiment.warmup:
            for sd in [sd_plain] + [c[3] for c in configs]:
                sd.generate(**timed_encs[0], max_new_tokens=4, pad_token_id=pad)
        first: dict = {}  # (plan index, prompt id) -> (output, stats) of the first timed round

        def timed_run(key, sd):
            def run():
                outs = []
                for p, e in zip(timed, timed_encs):
                    outs.append(sd.generate(**e, max_new_tokens=max_new, pad_token_id=pad))
                    first.setdefault((key, p["id"]), (outs[-1], sd.last_stats))
                return outs
            return run

        # speed, side by side: each round runs specdec plain, HF and every configuration once
        timings = time_side_by_side({"plain": timed_run("plain", sd_plain), "hf": lambda: [hf_generate(e) for e in
                                                                                         timed_encs],
                                     **{c[0]: timed_run(c[0], c[3]) for c in configs}}, repeats, device)
        rates = {k: t.rate(_new_tokens(outs, timed_encs)) for k, (t, outs) in timings.items()}
        plain_rate, hf_rate = rates["plain"], rates["hf"]
        for plan_index, label, strategy, sd in configs:
            rate = rates[plan_index]
            speed = {**rate.fields("tokens_per_s"), **plain_rate.fields("plain_tokens_per_s"),
                     **hf_rate.fields("hf_tokens_per_s"),
                     **paired_ratio(rate, plain_rate).fields("speedup"),
                     **paired_ratio(rate, hf_rate).fields("hf_speedup"),
                     "within_noise": spans_one(paired_ratio(rate, plain_rate)), "repeats": repeats,
                     "timed_prompts": len(timed)}
            for p in prompts:  # the acceptance records (the timed prompts' from the first timed round)
                enc = encs[p["id"]]
                if (plan_index, p["id"]) in first:
                    out, st = first[(plan_index, p["id"])]
                else:
                    out = sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad)
                    st = sd.last_stats
                ref, ref_margins = plain[p["id"]]
                prompt_tokens = int(enc["input_ids"].shape[1])
                records.append({
                    **common_fields(cfg, "acceptance", spec, device, dtype),
                    "drafter": label,
                    "rollback": strategy,
                    "num_speculative_tokens": K,
                    "prompt_id": p["id"],
                    "prompt_set": p.get("set", str(cfg.prompts.set)),
                    "prompt_tokens": prompt_tokens,
                    "new_tokens": int(out.shape[1] - prompt_tokens),
                    "mean_accepted_tokens": st.mean_accepted_tokens,
                    "acceptance_rate": st.acceptance_rate if sd.num_speculative_tokens else None,  # K=0: none
                    "accept_histogram": list(st.accept_histogram),
                    "steps": st.steps,
                    "decode_path": st.decode_path,  # eager / static / cuda_graph: which loop the timing is of
                    **divergence_fields(out, ref, ref_margins, prompt_tokens, dtype),
                    "draft_s": st.draft_s,
                    "verify_s": st.verify_s,
                    "rollback_s": st.rollback_s,
                    "wall_s": st.wall_s,
                    "process": int(os.environ.get("RANK", "0")),  # which process ran it (multi-process runs)
                    "_order": (plan_index, order[p["id"]]),
                    **speed,
                })
                if bar:
                    bar.update(1)
        del model, draft, heads, sd_plain, configs
    if bar:
        bar.close()
    if records_sink is not None:
        records = records_sink(records)
        if records is None:
            return []
    records.sort(key=lambda r: tuple(r["_order"]))  # gathered records in the one-process order
    for r in records:
        del r["_order"]
    source = f"prompts {cfg.prompts.path}" if cfg.prompts.get("path") else f"prompt set {cfg.prompts.set}"
    title = (f"Acceptance: {max_new} new tokens, {source} ({len(all_prompts)} prompts), {device}; speed: "
             f"{len(timed)} prompt(s) x {repeats} repeats")
    write_outputs(records, out_dir, title)
    return records
