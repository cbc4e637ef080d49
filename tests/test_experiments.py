"""The acceptance experiment (the README's main job), composed with hydra.compose and shrunk to
a tiny CPU run on the shipped zoo: it writes results.jsonl, summary.md and the histogram plot,
the summary's numbers equal what the JSONL records give, and every output is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.experiments.app import CONF_DIR, run_experiment
from specdec.experiments.report import summarize


def _cfg(overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_default_config_composes():
    cfg = _cfg([])
    assert cfg.experiment.name == "acceptance"
    assert [t.name for t in cfg.model.targets] == ["gdn-target", "mamba2-target", "kda-target"]
    assert list(cfg.rollback.strategies) == ["snapshot", "ring", "replay"]
    assert list(cfg.drafter.names) == ["ngram", "draft_model"]


def test_acceptance_tiny_run(tmp_path: Path):
    cfg = _cfg(["model=gdn-target", "rollback=all", "prompts.limit=1", "max_new_tokens=12", "device=cpu",
                "num_speculative_tokens=3", "progress=false", "experiment.warmup=false"])
    records = run_experiment(cfg, tmp_path)
    assert len(records) == 2 * 3  # 2 drafters x 3 strategies x 1 prompt
    assert all(r["exact"] for r in records)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(x)["rollback"] for x in lines] == [r["rollback"] for r in records]
    assert (tmp_path / "accept_hist.png").stat().st_size > 1000
    summary = (tmp_path / "summary.md").read_text()
    for row in summarize([json.loads(x) for x in lines]):
        line = next(x for x in summary.splitlines() if f"| {row['drafter']} | {row['rollback']} |" in x)
        assert f"{row['mean_accepted_tokens']:.2f}" in line and f"{row['acceptance_rate']:.3f}" in line
    draft_rows = [r for r in records if r["drafter"] == "draft_model"]
    assert all(r["mean_accepted_tokens"] >= 1.0 for r in draft_rows)


def test_bad_override_fails_cleanly():
    with pytest.raises(Exception, match="rollback"):
        _cfg(["rollback=undo"])
