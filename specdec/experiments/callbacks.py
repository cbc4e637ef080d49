"""Hydra callbacks: one combined summary at the end of a ``--multirun`` sweep.

``conf/config.yaml`` registers :class:`CombinedSummary` under ``hydra.callbacks``. When a sweep
ends, it reads every job's ``results.jsonl`` under the sweep folder, tags each record with its
job (``job``: the job's sub-folder, ``overrides``: the job's command-line overrides), and writes
``<sweep dir>/results.jsonl`` and ``<sweep dir>/summary.md`` (+ the plots) over all of them,
with the same report code a single run uses, so configurations from different jobs sit in one
table (and the rollback recommendation compares strategies that ran in different jobs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

__all__ = ["CombinedSummary", "combine_sweep"]


def _job_key(path: Path, root: Path):
    rel = path.parent.relative_to(root)
    return tuple(int(p) if p.isdigit() else p for p in rel.parts)


def combine_sweep(sweep_dir: str | Path, console: bool = True) -> list[dict]:
    """Combine the jobs' ``results.jsonl`` under ``sweep_dir``; returns the records (empty when
    no job wrote any: then nothing is written)."""
    from .common import write_jsonl
    from .report import write_report

    root = Path(sweep_dir)
    files = sorted((p for p in root.rglob("results.jsonl") if p.parent != root), key=lambda p: _job_key(p, root))
    records: list[dict] = []
    jobs = []
    for f in files:
        job = "/".join(str(x) for x in _job_key(f, root))
        ov_file = f.parent / ".hydra" / "overrides.yaml"
        overrides = []
        if ov_file.is_file():
            from omegaconf import OmegaConf

            overrides = [str(o) for o in OmegaConf.load(ov_file)]
        jobs.append((job, overrides))
        with open(f) as fh:
            for line in fh:
                if line.strip():
                    records.append({**json.loads(line), "job": job, "overrides": overrides})
    if not records:
        return []
    write_jsonl(records, root / "results.jsonl")
    title = f"Sweep: {len(jobs)} jobs, {len(records)} records"
    text = write_report(records, root, title, console=console)
    job_lines = ["", "## Jobs", ""] + [f"- {job}: {' '.join(ov) or '(no overrides)'}" for job, ov in jobs]
    (root / "summary.md").write_text(text + "\n".join(job_lines) + "\n")
    return records


class CombinedSummary(Callback):
    """Hydra callback: :func:`combine_sweep` on the sweep folder when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        records = combine_sweep(config.hydra.sweep.dir)
        if records:
            print(f"combined summary of the sweep: {Path(config.hydra.sweep.dir) / 'summary.md'}")
