"""The end-to-end benchmark (``experiment=bench``; ``experiment=long_run`` is its long-generation
preset): decode speed and exactness of ``generate()`` per drafter, rollback strategy and batch.

For each target, batch size in ``experiment.batch_grid`` and drafter of ``drafter.names`` that
applies (``draft_model`` where the target has a draft model; ``oracle`` once per value of
``drafter.oracle_acceptance``; ``mtp`` where the target's checkpoint has MTP layers
(``model.targets[*].mtp``) and on random-weight shapes, which get
:meth:`specdec.drafters.MTPDrafter.random` layers, said on the console and in the record's
``mtp_layers``; ``drafter.mtp_draft_vocab=N`` drafts over N tokens), on the same batch:

1. specdec's plain decoding (``num_speculative_tokens=0``, same engine and decode path) and,
   with ``experiment.hf``, HF's greedy ``generate()``, timed side by side
   (:func:`.e2e.plain_reference`); the plain output is the reference of every speculative row
   and the text the :class:`specdec.drafters.OracleDrafter` proposes (each token corrupted with
   probability 1 - a, so the acceptance is known);
2. ``specdec.wrap(...).generate()`` with each rollback strategy (:func:`.e2e.speculative_point`),
   once per value of ``experiment.overlap`` (default ``[true]``; ``[true, false]`` also times
   each point with every proposal made after the step's sync, ``SPECDEC_OVERLAP=0``, the
   record's ``overlap``), side by side against the same plain run.

``experiment.plain_switches`` (e.g. ``"experiment.plain_switches=['SPECDEC_SKINNY_LINEARS=0']"``,
quoted for Hydra's override grammar) also times specdec's plain
decoding under each of those environment settings, round by round with the default's in the same
process (a kernel switch's A/B without two processes' spread): the record's ``plain_switches``
holds per setting the decode ms per step (median, min-max), its ratio to the default's round by
round (``vs_default``, with ``within_noise`` when that ratio's range includes 1), whether the
output equals the default's and the default run's values of the names set (``default_env``);
``summary.md`` lists them in a table of its own. A name specdec does not read during a call
(:data:`.e2e.CALL_SWITCHES`), or a setting equal to the environment already, is warned about.

Every run takes ``experiment.decode_path`` (``auto``: CUDA graphs on CUDA). Every timing is
``repeats`` calls after one untimed call of the same shape (it compiles the kernels and
captures the CUDA graphs), median and min-max (:mod:`.timing`), end to end and of
the decode loop alone (new tokens / (wall - prefill)); phase shares from :class:`specdec.Stats`;
peak memory on CUDA. Exactness: every row against specdec plain's output, each diverging row's
first divergence with plain decoding's top-2 logit margin there (in bf16 a divergence is
allowed only at a near-tie, margin < 0.25: docs/design.md, "One speculative step").

Prompts: ``experiment.prompt_tokens`` random token ids per row (speed does not depend on the
text: the bench shapes), or the prompt set ``prompts.set`` cycled over the batch. Random-shape
targets (``model=qwen35-4b-shape`` / ``nemotronh-4b-shape``) are damped
(``model.targets.0.damp``) so bf16 rounding rarely flips a greedy choice.

One record per speculative point is appended to ``results.jsonl`` as it is measured (a run cut
short keeps what it finished); at the end ``summary.md`` (the table, the first divergences) and
``speedup_vs_batch.png``. Each record also sets specdec plain's step against its memory floor
(``plain_floor_ms``: :func:`.models.plain_step_bytes` at the run's measured copy bandwidth;
``plain_at_floor``: that floor / the plain step's time). ``experiment.profile`` adds one profiled ``generate()`` per point
(:mod:`.profiling`): kernels and GPU busy time per decode step, the device's idle time between
its kernels (``profile_long_gap_ms_per_step``: gaps of at least 20 µs, the device waiting for the
host), and ``profile.md`` with the top kernels.
"""

from __future__ import annotations

import os
from unittest import mock
from pathlib import Path

import torch
from omegaconf import DictConfig

from .common import RunRecords, apply_cpu_threads, check_context, common_fields, make_drafter, progress_bar
from .models import load_draft, load_target, plain_step_bytes, resolve_device, weight_bytes

__all__ = ["run", "drafter_runs"]

#: drafters the benchmark runs (Medusa heads run in experiment=acceptance)
BENCH_DRAFTERS = ("ngram", "draft_model", "oracle", "mtp")


def _overlapping(on: bool):
    """``SPECDEC_OVERLAP`` set to ``on`` inside the block (the engine reads it per call), then restored."""
    return mock.patch.dict(os.environ, {"SPECDEC_OVERLAP": "1" if on else "0"})


def drafter_runs(cfg, spec) -> list[tuple[str, float | None]]:
    """``(drafter, oracle acceptance or None)`` for every drafter of ``drafter.names`` that applies
    to the target ``spec``."""
    out = []
    for name in (str(d) for d in cfg.drafter.names):
        if name == "draft_model" and not spec.get("draft"):
            continue
        if name == "mtp" and not (spec.get("mtp") or _random_mtp(spec)):
            continue
        if name == "oracle":
            out += [(name, float(a)) for a in cfg.drafter.oracle_acceptance]
        else:
            out.append((name, None))
    return out


def _random_mtp(spec) -> bool:
    """Whether drafter=mtp runs random MTP layers on ``spec``: a random-weight shape (no checkpoint)."""
    return str(spec.source) == "random_shape" and not spec.get("mtp")


def _profiled(sd, enc, max_new: int, pad: int, device, title: str, rows: int) -> tuple[dict, str]:
    """One warm-up and one profiled ``generate()`` of ``sd`` (then its buffers freed): the
    per-decode-step fields for the record and a ``profile.md`` section with the table of the
    ``rows`` entries with the most GPU time (on a CPU: host time)."""
    from .e2e import release
    from .profiling import profile_call

    sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad)  # compiles, captures
    prof, _ = profile_call(lambda: sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad), device, top=rows)
    fields = {f"profile_{k}_per_step": v for k, v in prof.fields(per=sd.last_stats.steps).items()}
    sd.release()
    release(device)
    return fields, f"## {title}\n\nper decode step: {fields}\n\n```\n{prof.table}\n```\n"


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the benchmark; returns the records (also in ``out_dir``).

    Raises: ValueError when no drafter of ``drafter.names`` applies to any target, or for an
    ``experiment.overlap`` / ``experiment.profile_rows`` / ``experiment.plain_switches`` it cannot
    take."""
    import specdec

    from .. import zoo
    from .e2e import plain_reference, release, speculative_point, timing_batch
    from .kernel_timing import copy_bandwidth
    from .report import write_report

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    torch.manual_seed(int(cfg.seed))
    K = cfg.num_speculative_tokens if cfg.num_speculative_tokens == "auto" else int(cfg.num_speculative_tokens)
    max_new, repeats = int(cfg.max_new_tokens), int(cfg.repeats)
    path = str(exp.decode_path)
    batches = [int(b) for b in exp.batch_grid]
    strategies = [str(s) for s in cfg.rollback.strategies]
    overlaps = list(exp.get("overlap", [True]))
    if not overlaps or any(not isinstance(o, bool) for o in overlaps):
        raise ValueError(f"experiment.overlap must be a non-empty list of true / false, got {overlaps}")
    if exp.profile and (isinstance(exp.profile_rows, bool) or int(exp.profile_rows) < 1):
        raise ValueError(f"experiment.profile_rows must be an int >= 1 (entries of each profile.md table), "
                         f"got {exp.profile_rows!r}")
    from .e2e import parse_switches

    switches = parse_switches(exp.get("plain_switches") or [])
    plan = {str(spec.name): drafter_runs(cfg, spec) for spec in cfg.model.targets}
    if not any(plan.values()):
        raise ValueError(f"drafter={','.join(map(str, cfg.drafter.names))}: no selected model has a draft model "
                         "(model.targets[*].draft) or MTP layers (model.targets[*].mtp, or a random-weight shape); "
                         "use drafter=ngram or drafter=oracle")
    prompts = [] if exp.prompt_tokens is not None else zoo.prompts(str(cfg.prompts.set), limit=cfg.prompts.limit)
    log = RunRecords(out_dir)
    copy_GBps = copy_bandwidth(device) / 1e9 if device.type == "cuda" else None
    profiles: list[str] = []
    total = sum(len(p) for p in plan.values()) * len(batches) * len(strategies) * len(overlaps)
    bar = None
    for spec in cfg.model.targets:
        runs = plan[str(spec.name)]
        if not runs:
            continue
        model, tok = load_target(spec, device, dtype, int(cfg.seed))
        if exp.ignore_eos:
            model.generation_config.eos_token_id = None
        mtp_layers = None
        if any(d == "mtp" for d, _ in runs):
            mtp_layers = "random" if _random_mtp(spec) else "checkpoint"
            if mtp_layers == "random":
                print(f"specdec-run: {spec.name} has no MTP weights: drafter=mtp runs MTPDrafter.random layers "
                      f"(seed {int(cfg.seed)}; timing only, its drafts are rarely accepted)", flush=True)
        if bar is None:  # the thread line, then the one bar
            apply_cpu_threads(cfg, model, device)
            bar = log.bar = progress_bar(cfg, total, str(exp.name)) or False
        draft = None
        if any(d == "draft_model" for d, _ in runs):
            draft = load_draft(spec, device, dtype)
        wb = weight_bytes(model)
        widest = timing_batch(max(batches), exp.prompt_tokens, prompts, tok, model.config.vocab_size, device,
                              int(cfg.seed))[0]["input_ids"].shape[1]  # (the largest batch pads widest)
        check_context(str(spec.name), model, widest, max_new)
        if exp.hf and exp.hf_max_new_tokens:
            check_context(str(spec.name), model, widest, int(exp.hf_max_new_tokens), "experiment.hf_max_new_tokens")
        for B in batches:
            enc, pad = timing_batch(B, exp.prompt_tokens, prompts, tok, model.config.vocab_size, device,
                                    int(cfg.seed))
            plain = plain_reference(model, enc, max_new, pad, device, repeats=repeats, warmup=bool(exp.warmup),
                                    hf=bool(exp.hf), hf_max_new=exp.hf_max_new_tokens, decode_path=path,
                                    switches=switches)
            switch_fields = _switch_fields(plain, switches)
            floor_bytes = plain_step_bytes(model, B, int(enc["input_ids"].shape[1]), max_new)
            floor_fields = ({"plain_floor_bytes": floor_bytes, "plain_floor_ms": 1e3 * floor_bytes / (copy_GBps * 1e9)}
                            if floor_bytes and copy_GBps else {})
            if exp.profile:
                sd0 = specdec.wrap(model, drafter="ngram", num_speculative_tokens=0, decode_path=path)
                profiles.append(_profiled(sd0, enc, max_new, pad, device, f"{spec.name}, batch {B}, specdec plain",
                                          int(exp.profile_rows))[1])
            for drafter_name, acceptance in runs:
                drafter_args = dict(reference=plain.plain_out, attention_mask=enc["attention_mask"],
                                    acceptance=acceptance, target=model, tokenizer=tok,
                                    random_mtp=mtp_layers == "random")
                mtp_fields, shown = {}, drafter_name
                if drafter_name == "mtp":
                    vocab = cfg.drafter.get("mtp_draft_vocab")
                    mtp_fields = {"mtp_layers": mtp_layers, "mtp_draft_vocab": vocab,
                                  "mtp_compile": bool(cfg.drafter.get("mtp_compile", False))}
                    shown = "mtp" if vocab is None else f"mtp-vocab:{vocab}"  # as experiment=acceptance names it
                for strategy, overlap in ((st, o) for st in strategies for o in overlaps):
                    drafter = make_drafter(cfg, drafter_name, draft, **drafter_args)
                    if hasattr(drafter, "proposal_bytes") and K != "auto":  # the MTP drafter: its proposal's floor
                        nbytes = drafter.proposal_bytes(K)
                        mtp_fields.update(draft_bytes=nbytes,
                                          draft_floor_ms=1e3 * nbytes / (copy_GBps * 1e9) if copy_GBps else None)
                    with _overlapping(overlap):
                        e = speculative_point(model, enc, drafter=drafter,
                                              strategy=strategy, K=K, max_new=max_new,
                                              pad=pad, device=device, dtype=dtype, plain=plain,
                                              reference=plain.plain_out, repeats=repeats, warmup=bool(exp.warmup),
                                              check_state=False, decode_path=path)
                    rec = {**common_fields(cfg, "bench", spec, device, dtype), "drafter": shown,
                           "acceptance": acceptance, "rollback": strategy, "overlap": overlap, "batch": B,
                           "num_speculative_tokens": K,
                           "repeats": repeats, "prompt_tokens": int(enc["input_ids"].shape[1]), "weight_bytes": wb,
                           "copy_GBps": copy_GBps,
                           "weight_floor_ms": 1e3 * wb / (copy_GBps * 1e9) if copy_GBps else None, **mtp_fields,
                           **floor_fields, **switch_fields, **e}
                    if rec.get("draft_floor_ms") and rec.get("draft_ms") is not None:
                        rec["draft_vs_floor"] = rec["draft_ms"] / rec["draft_floor_ms"]
                    if rec.get("plain_floor_ms") and rec.get("plain_decode_ms_per_step"):
                        rec["plain_at_floor"] = rec["plain_floor_ms"] / rec["plain_decode_ms_per_step"]
                    if exp.profile:
                        sd = specdec.wrap(model, drafter=make_drafter(cfg, drafter_name, draft, **drafter_args),
                                          rollback=strategy, num_speculative_tokens=K, decode_path=path)
                        label = shown if acceptance is None else f"{shown} a={acceptance}"
                        with _overlapping(overlap):
                            fields, section = _profiled(sd, enc, max_new, pad, device,
                                                        f"{spec.name}, batch {B}, {label}, {strategy}"
                                                        + ("" if overlap else ", proposals after the sync"),
                                                        int(exp.profile_rows))
                        rec.update(fields)
                        profiles.append(section)
                    log.add(rec, f"{spec.name} B={B} {shown}{'' if acceptance is None else f' a={acceptance}'} "
                                 f"{strategy}{'' if overlap else ' (proposals after the sync)'}: decode {e['decode_tokens_per_s']:.1f} tokens/s "
                                 f"({e['decode_speedup']:.2f}x plain), {e['diverged_rows']} diverged rows")
        del model, draft
        release(device)
    log.close()
    if profiles:
        (log.out_dir / "profile.md").write_text("# torch.profiler: one generate() per configuration\n\n"
                                            + "\n".join(profiles))
    title = (f"{'Long run' if str(exp.name) == 'long_run' else 'End-to-end decode'}: "
             f"{', '.join(t.name for t in cfg.model.targets)}, K={K}, {max_new} new tokens, {device}, "
             f"{str(dtype).replace('torch.', '')}, {repeats} repeats")
    write_report(log.records, log.out_dir, title)
    return log.records


def _switch_fields(plain, switches: dict[str, dict[str, str]]) -> dict:
    """The record's ``plain_switches`` (see the module docstring) from a :class:`.e2e.PlainRun`
    timed under ``switches`` (:func:`.e2e.parse_switches`)."""
    from .timing import paired_ratio, spans_one

    if not plain.switched:
        return {}
    _, base = plain.decode()
    out = {}
    for label, run in plain.switched.items():
        _, ms = run.decode()
        ratio = paired_ratio(ms, base)
        out[label] = {**ms.fields("decode_ms_per_step"), **ratio.fields("vs_default"),
                      "within_noise": spans_one(ratio),
                      "same_output": bool(torch.equal(run.plain_out, plain.plain_out)),
                      "default_env": {name: os.environ.get(name) for name in switches[label]}}
    return {"plain_switches": out}

