"""Pieces every experiment shares: the record's common fields, drafters, CPU threads, progress
bars, outputs."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

__all__ = ["common_fields", "make_drafter", "apply_cpu_threads", "progress_bar", "write_outputs", "write_jsonl"]


def common_fields(cfg, experiment: str, spec, device, dtype) -> dict:
    """Fields every record starts with, the resolved config included (``config``)."""
    return {
        "experiment": experiment,
        "model": str(spec.name),
        "max_new_tokens": int(cfg.max_new_tokens),
        "prompt_set": str(cfg.prompts.set),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "seed": int(cfg.seed),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def make_drafter(cfg, name: str, draft_model=None):
    """A fresh drafter for ``name`` (``ngram`` | ``draft_model``) from ``cfg.drafter``."""
    from specdec.drafters import DraftModelDrafter, NGramDrafter

    if str(name) == "ngram":
        return NGramDrafter(min_ngram=int(cfg.drafter.ngram.min_ngram), max_ngram=int(cfg.drafter.ngram.max_ngram))
    if str(name) == "draft_model":
        if draft_model is None:
            raise ValueError("drafter draft_model needs a target with a draft model (model.targets[*].draft)")
        return DraftModelDrafter(draft_model, rollback=str(cfg.drafter.draft_rollback))
    raise ValueError(f"unknown drafter {name!r}; available: ngram, draft_model")


def apply_cpu_threads(cfg, model, device, show: bool = True):
    """Torch's CPU thread count for ``model`` (:func:`specdec.threads.configure_cpu_threads`: the
    ``cpu_threads`` key when set, else chosen, never overriding ``OMP_NUM_THREADS`` or a count the
    user set); prints what it set as one line when ``show``. Returns the ThreadChoice (None,
    changing nothing, without a model and without ``cpu_threads``)."""
    from ..threads import configure_cpu_threads

    threads = cfg.get("cpu_threads")
    if model is None and threads is None:  # nothing to size the choice by: torch's default stays
        return None
    choice = configure_cpu_threads(model, threads=None if threads is None else int(threads), device=device)
    if show and choice.source != "not on CPU":
        print(f"specdec-run: {choice.describe()}", flush=True)
    return choice


def progress_bar(cfg, total: int, desc: str, enabled: bool = True):
    """A tqdm bar over ``total`` units (None when ``progress=false``)."""
    if not (cfg.progress and enabled):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True)


def write_jsonl(records: list[dict], path: Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_outputs(records: list[dict], out_dir: Path, title: str, console: bool = True) -> str:
    """``results.jsonl``, ``summary.md`` and the plots into ``out_dir``; returns the summary."""
    from .report import write_report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(records, out_dir / "results.jsonl")
    return write_report(records, out_dir, title, console=console)
