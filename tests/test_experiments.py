"""The experiments app (specdec-run): every experiment config composed with hydra.compose and
shrunk to a tiny CPU run on the shipped zoo, its outputs checked (the summary's numbers are
what the JSONL records give); a --multirun sweep ending in one combined summary; a 2-process
accelerate run giving the same records as one process; one-line errors for bad overrides."""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from markers import needs_triton_interpreter
from omegaconf import OmegaConf

from specdec.experiments.app import CONF_DIR, one_line, run_experiment
from specdec.experiments.config import SCHEMAS
from specdec.experiments.report import recommend

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"tokens_per_s", "plain_tokens_per_s", "hf_tokens_per_s", "speedup", "hf_speedup", "within_noise",
          "draft_s", "verify_s", "rollback_s", "wall_s", "process", "timed_prompts"}
TIMING |= {f"{k}_{s}" for k in ("tokens_per_s", "plain_tokens_per_s", "hf_tokens_per_s", "speedup", "hf_speedup") for s in ("min", "max")}
TIMING |= {"command", "date"}  # where and when: a run under specdec-run has a command line, a composed config none
CPU = ["device=cpu", "progress=false"]


def _cfg(overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _table(summary: str, first_header: str = "model") -> tuple[list[str], list[list[str]]]:
    """The first Markdown table of ``summary`` whose header starts with ``first_header``."""
    lines = summary.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_header} |"))
    head = [c.strip() for c in lines[i].strip("|").split("|")]
    rows = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return head, rows


def _check_summary_matches(summary: str, records: list[dict], columns: dict[str, str], keys: list[str]):
    """Every (title -> record field, format) cell in the summary equals the mean over the
    records of its configuration (recomputed here from the JSONL records, not with report code)."""
    head, rows = _table(summary)
    assert len(rows) == len({tuple(r[k] for k in keys) for r in records})
    titles = {"num_speculative_tokens": "K"}
    for row in rows:
        cell = dict(zip(head, row))
        group = [r for r in records if all(str(r[k]) == cell[titles.get(k, k)] for k in keys)]
        assert group, cell
        for title, (field, fmt) in columns.items():
            vals = [r[field] for r in group if r.get(field) is not None]
            if fmt is None:
                n = sum(map(bool, vals))
                want = "yes" if n == len(vals) else "no" if n == 0 else f"{n}/{len(vals)}"
            else:
                want = fmt.format(sum(vals) / len(vals))
                if " (" in cell[title]:  # a spread column: "median (min-max)" of the repeats
                    lo = sum(r[f"{field}_min"] for r in group) / len(group)
                    hi = sum(r[f"{field}_max"] for r in group) / len(group)
                    want += f" ({fmt.format(lo)}-{fmt.format(hi)})"
            assert cell[title] == want, (title, cell[title], want)


# ------------------------------------------------------------------------------ composition


def test_default_config_composes():
    cfg = _cfg([])
    assert cfg.experiment.name == "acceptance"
    assert OmegaConf.get_type(cfg) is SCHEMAS["acceptance"]
    assert [t.name for t in cfg.model.targets] == ["gdn-target", "mamba2-target", "kda-target"]
    assert list(cfg.rollback.strategies) == ["snapshot", "ring", "replay"]
    assert list(cfg.drafter.names) == ["ngram", "draft_model", "medusa", "mtp"]
    assert [t.get("medusa") for t in cfg.model.targets] == ["gdn-medusa", None, None]


@pytest.mark.parametrize("experiment", sorted(SCHEMAS))
def test_each_experiment_composes_with_its_schema(experiment):
    cfg = _cfg([f"experiment={experiment}", "device=cpu", "seed=3", "prompts.limit=2", "num_speculative_tokens=3",
                "max_new_tokens=5"])
    assert cfg.experiment.name == experiment
    assert OmegaConf.get_type(cfg) is SCHEMAS[experiment]
    assert (cfg.device, cfg.seed, cfg.prompts.limit, cfg.num_speculative_tokens) == ("cpu", 3, 2, 3)
    if experiment == "train_zoo":  # the zoo recipe's own keys are typed too
        assert cfg.steps_scale == 1.0 and "gdn-target" in cfg.models
    if experiment in ("rollback", "bench"):
        assert [t.name for t in cfg.model.targets] == ["gdn-target"]
        assert list(cfg.rollback.strategies) == ["snapshot", "ring", "replay", "replay_deferred"]


def test_benchmark_shapes_compose():
    q = _cfg(["model=qwen35-4b-shape"]).model.targets[0]
    n = _cfg(["model=nemotronh-4b-shape"]).model.targets[0]
    assert (q.source, q.config.layer_types.count("linear_attention"), q.config.linear_num_value_heads) == (
        "random_shape", 24, 32)
    assert (n.source, n.config.hybrid_override_pattern.count("M"), n.config.mamba_num_heads) == ("random_shape", 24, 112)


@pytest.mark.parametrize("override, match", [
    ("rollback=undo", "rollback"),
    ("num_speculative_tokens=abc", "num_speculative_tokens"),
    ("device=tpu", "tpu"),
    ("experiment.kernel_steps=3", "kernel_steps"),  # a rollback-experiment key under acceptance
    ("drafter=eagle", "eagle"),  # not in the group
])
def test_bad_override_fails_at_compose(override, match):
    with pytest.raises(Exception, match=match) as info:
        _cfg([override])
    assert "\n" not in one_line(info.value)


# ------------------------------------------------------------------------------ tiny runs


def test_acceptance_tiny_run(tmp_path: Path, capsys):
    cfg = _cfg(["model=gdn-target", "rollback=all", "prompts.limit=1", "max_new_tokens=12", "num_speculative_tokens=3",
                "experiment.warmup=false", "repeats=2"] + CPU)
    records = run_experiment(cfg, tmp_path)
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines()) <= 100, printed  # the terminal gets the key columns
    assert "speedup vs plain" in printed and "mean accepted tokens:" in printed  # the table and its legend
    for r in records:  # speed: medians of 2 repeats, vs specdec plain (K=0) and HF, in one process
        for k in ("tokens_per_s", "plain_tokens_per_s", "hf_tokens_per_s"):
            assert r[f"{k}_min"] <= r[k] <= r[f"{k}_max"] and r[k] > 0
        for k, base in (("speedup", "plain_tokens_per_s"), ("hf_speedup", "hf_tokens_per_s")):
            # the per-round ratios lie within what any pairing of the two figures' runs allows
            assert r[f"{k}_min"] <= r[k] <= r[f"{k}_max"]
            assert r[f"{k}_min"] >= r["tokens_per_s_min"] / r[f"{base}_max"] * (1 - 1e-9)
            assert r[f"{k}_max"] <= r["tokens_per_s_max"] / r[f"{base}_min"] * (1 + 1e-9)
        assert r["within_noise"] == (r["speedup_min"] <= 1.0 <= r["speedup_max"])
        assert r["repeats"] == 2 and r["timed_prompts"] == 1
    assert len(records) == 4 * 3  # 4 drafters (ngram, draft_model, medusa, mtp) x 3 strategies x 1 prompt
    assert all(r["exact"] and r["experiment"] == "acceptance" for r in records)
    assert all(r["decode_path"] == "eager" for r in records)  # the CPU default (auto: graphs on CUDA only)
    assert records[0]["config"]["num_speculative_tokens"] == 3
    lines = _records(tmp_path / "results.jsonl")
    assert [x["rollback"] for x in lines] == [r["rollback"] for r in records]
    assert (tmp_path / "accept_hist.png").stat().st_size > 1000
    _check_summary_matches((tmp_path / "summary.md").read_text(), lines,
                           {"mean accepted tokens": ("mean_accepted_tokens", "{:.2f}"),
                            "acceptance rate": ("acceptance_rate", "{:.3f}"), "exact": ("exact", None)},
                           ["model", "drafter", "rollback", "num_speculative_tokens"])
    assert all(r["mean_accepted_tokens"] >= 1.0 for r in records if r["drafter"] == "draft_model")
    summary = (tmp_path / "summary.md").read_text()
    assert "Columns:" in summary and "bonus/correction token included" in summary  # the legend
    assert "1 + K x acceptance rate" in summary and "BENCH.md" in summary  # what a CPU shows


def test_plain_decoding_K0_runs(tmp_path: Path):
    """num_speculative_tokens=0: specdec's plain decoding through the CLI's acceptance experiment."""
    cfg = _cfg(["model=gdn-target", "drafter=ngram", "rollback=replay", "prompts.limit=2", "max_new_tokens=8",
                "num_speculative_tokens=0", "repeats=1"] + CPU)
    records = run_experiment(cfg, tmp_path)
    assert len(records) == 2
    for r in records:
        assert r["exact"] and r["num_speculative_tokens"] == 0 and r["mean_accepted_tokens"] == 1.0
        assert r["acceptance_rate"] is None and r["steps"] == r["new_tokens"] - 1  # no drafts: no rate; the prefill gives the first


def test_acceptance_on_a_user_prompt_file(tmp_path: Path):
    """prompts.path: a .jsonl of text prompts and token-id prompts; records name the file's prompts."""
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n\n"
                 + json.dumps({"id": "ids", "input_ids": [1, 100, 200, 300, 100, 200]}) + "\n")
    cfg = _cfg(["model=gdn-target", "drafter=ngram", "rollback=snapshot", f"prompts.path={f}", "max_new_tokens=6",
                "repeats=1"] + CPU)
    records = run_experiment(cfg, tmp_path / "out")
    assert [(r["prompt_id"], r["prompt_set"]) for r in records] == [("file-1", "file"), ("ids", "file")]
    assert records[1]["prompt_tokens"] == 6 and all(r["exact"] for r in records)
    assert f"prompts {f}" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.parametrize("content, match", [
    (None, "no such file"),
    ('{"prompt": "x"}\nnot json\n', "line 2: not valid JSON"),
    ('{"prompt": "x"}\n{"text": "x"}\n', 'line 2: needs a non-empty "prompt"'),
    ('{"input_ids": [1, -3]}\n', 'line 1: "input_ids" must be'),
    ("\n", "holds no prompts"),
])
def test_prompt_file_errors_name_the_line(tmp_path: Path, content, match):
    from specdec.experiments.prompts import load_prompt_file

    f = tmp_path / "p.jsonl"
    if content is not None:
        f.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_prompt_file(f)
    if content is None:  # the CLI: one line, exit status 2
        res = _run([sys.executable, "-m", "specdec", "model=gdn-target", "drafter=ngram", f"prompts.path={f}",
                    f"hydra.run.dir={tmp_path / 'out'}"] + CPU)
        assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "no such file" in res.stderr


def test_prompt_ids_outside_the_vocabulary(tmp_path: Path):
    """Token ids the target's vocabulary lacks: one line naming the prompt and the ids, exit status
    2, and no run folder left behind (the file alone cannot tell: the vocabulary is the target's)."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "far", "input_ids": [5, 99999, 6]}) + "\n")
    out = tmp_path / "out"
    res = _run([sys.executable, "-m", "specdec", "model=gdn-target", "drafter=ngram", "rollback=replay",
                f"prompts.path={f}", "repeats=1", f"hydra.run.dir={out}"] + CPU)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr[-2000:]
    assert "prompt 'far': input_ids outside the target's vocabulary [0, " in res.stderr and "[99999]" in res.stderr
    assert not out.exists()


@pytest.mark.parametrize("experiment", ["acceptance", "rollback", "adaptive", "bench", "checks"])
def test_new_tokens_past_the_models_context_are_refused(tmp_path: Path, experiment: str, monkeypatch):
    """max_new_tokens that take the longest prompt past the target's context (as generate_batch
    refuses a request) stop every generating experiment before any generation, naming the key,
    the target and the most it may be."""
    import specdec
    from specdec.experiments import e2e

    def no_generation(*args, **kwargs):
        raise AssertionError("generation ran before the context check")

    monkeypatch.setattr(e2e, "plain_reference", no_generation)  # (acceptance generates without it)
    monkeypatch.setattr(specdec.SpeculativeGenerator, "generate", no_generation)
    drafter = "oracle" if experiment == "adaptive" else "ngram"  # (adaptive runs the oracle drafter)
    cfg = _cfg([f"experiment={experiment}", "model=gdn-target", f"drafter={drafter}", "rollback=replay", "prompts.limit=1",
                "max_new_tokens=100000", "repeats=1"] + CPU)
    with pytest.raises(ValueError, match=r"max_new_tokens=100000: .*gdn-target's context \(max_position_embeddings="
                                         r"\d+\); at most \d+ new tokens"):
        run_experiment(cfg, tmp_path)


def test_rollback_tiny_run(tmp_path: Path):
    cfg = _cfg(["experiment=rollback", "prompts.limit=2", "max_new_tokens=8", "experiment.batch_grid=[1,2]",
                "experiment.k_grid=[2]", "experiment.kernel_steps=2", "experiment.kernel_warmup=1",
                "experiment.warmup=false", "experiment.memory_budget_gib=1", "repeats=2"] + CPU)
    records = run_experiment(cfg, tmp_path)
    strategies = ["snapshot", "ring", "replay", "replay_deferred"]
    assert [(r["batch"], r["rollback"]) for r in records] == [(b, s) for b in (1, 2) for s in strategies]
    for name in ("results.jsonl", "summary.md", "rollback_time_vs_batch.png", "speedup_vs_batch.png"):
        assert (tmp_path / name).stat().st_size > 100, name
    lines = _records(tmp_path / "results.jsonl")
    for r in lines:
        # exact: output == HF greedy, committed SSM state == HF's, kernel-level state == the reference
        assert r["exact"] and r["state_exact"] and r["state_rows"] == r["batch"] and r["kernel_state_exact"]
        assert r["ssm_op"] == "gdn" and r["ssm_layers"] == 6 and r["steps"] > 0
        S, I, T, L, B = r["state_bytes"], r["input_bytes_per_token"], 3, r["ssm_layers"], r["batch"]
        assert S == 8 * 32 * 32 * 4  # gdn-target: 8 value heads x 32 x 32, fp32
        per_layer = {"snapshot": (T + 1) * S + 2 * S, "ring": (T + 1) * S,
                     "replay": 2 * S + (r["mean_committed_tokens"] + 2 * T) * I,
                     "replay_deferred": S + r["flush_rate"] * S + (r["mean_history"] + 2 * T) * I}[r["rollback"]]
        assert r["bytes_per_step_MB"] == pytest.approx(per_layer * L * B / 1e6)
        extra = {"snapshot": T * S, "ring": T * S, "replay": 2 * T * I, "replay_deferred": 16 * I}[r["rollback"]]
        assert r["extra_MiB_per_seq"] == pytest.approx(extra * L / 2**20)
        assert r["max_batch"] == (1 << 30) // (L * (S + extra))
        assert (r["memory_budget_gib"], r["memory_budget_source"]) == (1.0, "config")
        assert r["ssm_ms_per_step_min"] <= r["ssm_ms_per_step"] <= r["ssm_ms_per_step_max"]
        assert r["e2e_verify_ms_min"] <= r["e2e_verify_ms"] <= r["e2e_verify_ms_max"]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])  # vs specdec plain
        parts = r["kernel_verify_us"] + r["kernel_commit_us"] + r["kernel_fold_us"]
        assert r["ssm_ms_per_step"] == pytest.approx(parts * L / 1e3)
        folds = r["rollback"] == "replay" or (r["rollback"] == "replay_deferred" and r["flush_rate"] > 0)
        assert (r["kernel_fold_us"] > 0) == folds  # deferred replay folds only when its history would overflow
    summary = (tmp_path / "summary.md").read_text()
    assert "1.0 GiB (experiment.memory_budget_gib: a budget you set, not this machine's memory)" in summary
    _check_summary_matches(summary, lines, {
        "verify ms/step": ("e2e_verify_ms", "{:.2f}"), "commit ms/step": ("e2e_commit_ms", "{:.3f}"),
        "layer fold us": ("kernel_fold_us", "{:.1f}"), "SSM ms/step": ("ssm_ms_per_step", "{:.3f}"),
        "MB moved/step": ("bytes_per_step_MB", "{:.3f}"), "max batch in budget": ("max_batch", "{:.0f}"),
        "exact state": ("state_exact", None)}, ["model", "rollback", "batch", "num_speculative_tokens"])
    # the recommendation: the strategy with the least SSM time per step, per grid point
    head, rows = _table(summary.split("## Recommendation")[1])
    assert len(rows) == 2
    for row in rows:
        cell = dict(zip(head, row))
        pts = [r for r in lines if str(r["batch"]) == cell["batch"]]
        assert cell["fastest"] == min(pts, key=lambda r: r["ssm_ms_per_step"])["rollback"]
    assert recommend(lines)[0][0]["fastest"] == rows[0][head.index("fastest")]


def test_rollback_kernel_level_at_a_4b_shape(tmp_path: Path):
    """The Qwen3.5-4B-shaped config gives the kernel-level figures without building the model."""
    cfg = _cfg(["experiment=rollback", "model=qwen35-4b-shape", "experiment.end_to_end=false",
                "experiment.batch_grid=[1]", "experiment.k_grid=[2]", "experiment.kernel_steps=1",
                "experiment.kernel_warmup=0", "rollback=all"] + CPU)
    records = run_experiment(cfg, tmp_path)
    assert [r["rollback"] for r in records] == ["snapshot", "ring", "replay"]
    for r in records:
        assert r["ssm_shape"] == "24 x gdn 32h x 128 x 128" and r["state_bytes"] == 2 << 20
        assert r["kernel_state_exact"] and "exact" not in r
    assert (tmp_path / "speedup_vs_batch.png").stat().st_size > 1000
    assert "## Recommendation" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_table_tiny(tmp_path: Path, backend, monkeypatch):
    """experiment=kernels at the tiny shapes, on the torch reference and on the Triton kernels
    (interpreter): one record per (op, batch, K, strategy) with the baseline first, every strategy
    checked exact against the reference, ratios against snapshot / baseline from the records'
    own times, and the summary's table and targets."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    ops = "[gdn,mamba2]" if backend == "torch" else "[kda]"
    cfg = _cfg(["experiment=kernels", "experiment.shapes=tiny", f"experiment.ops={ops}", "experiment.batch_grid=[1,2]",
                "experiment.k_grid=[2]", "experiment.reps=1"] + CPU)
    records = run_experiment(cfg, tmp_path)
    strategies = ["baseline", "snapshot", "ring", "replay", "replay_deferred"]
    grid = [(op, b, s) for op in ops.strip("[]").split(",") for b in (1, 2) for s in strategies]
    assert [(r["op"], r["batch"], r["rollback"]) for r in records] == grid
    for r in records:
        assert r["experiment"] == "kernels" and r["backend"] == backend and r["num_speculative_tokens"] == 2
        assert r["exact"] and r["err_state"] < 1e-4 and r["us_per_step"] > 0 and r["kernel_MB"] > 0
        group = {g["rollback"]: g for g in records if (g["op"], g["batch"]) == (r["op"], r["batch"])}
        assert r["vs_snapshot"] == pytest.approx(r["us_per_step"] / group["snapshot"]["us_per_step"])
        assert r["vs_baseline"] == pytest.approx(r["us_per_step"] / group["baseline"]["us_per_step"])
        assert (r["extra_MiB_per_seq"] > 0) == (r["rollback"] != "baseline")
    summary = (tmp_path / "summary.md").read_text()
    head, rows = _table(summary, "op")
    assert head[:5] == ["op", "batch", "K", "rollback", "launch"] and len(rows) == len(records)
    assert "## Targets" in summary


def test_kernels_table_keeps_the_groups_measured_before_a_failure(tmp_path: Path, monkeypatch):
    """A run that fails part way (e.g. a device error) leaves the groups it finished in results.jsonl."""
    import specdec.experiments.kernel_table as kt

    real, calls = kt.bench_point, []

    def bench_point(*args, **kwargs):
        calls.append(args[2])  # the strategy
        if len(calls) > 5:  # the second (op, batch, K) group
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*args, **kwargs)

    monkeypatch.setattr(kt, "bench_point", bench_point)
    cfg = _cfg(["experiment=kernels", "experiment.shapes=tiny", "experiment.ops=[gdn]", "experiment.batch_grid=[1,2]",
                "experiment.k_grid=[2]", "experiment.reps=1", "experiment.check=false"] + CPU)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_experiment(cfg, tmp_path)
    kept = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["batch"], r["rollback"]) for r in kept] == [(1, s) for s in calls[:5]]
    assert all(r["vs_baseline"] > 0 for r in kept)


def test_kernels_table_calls_fla_by_its_argument_names(monkeypatch):
    """flash-linear-attention 0.6 put ``gk`` and ``gv`` between ``g`` and ``beta``: the fla row passes
    the gates by name, so each tensor lands where fla reads it (positionally, beta was read as gk)."""
    import types

    import triton.testing

    import specdec.experiments.kernel_table as kt

    seen = {}

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False, **kwargs):
        seen.update(q=q, v=v, g=g, gk=gk, gv=gv, beta=beta, h0=initial_state)
        return v, initial_state

    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    gdr = types.ModuleType("fla.ops.gated_delta_rule")
    gdr.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", gdr)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.01)[1])
    shape = kt.SHAPES["tiny"]["gdn"]
    point = kt._fla_point(shape, 2, 3, torch.device("cpu"), torch.Generator().manual_seed(0), torch.float32)
    B, T, H = 2, 4, shape.heads
    assert seen["gk"] is None and seen["gv"] is None
    assert seen["g"].shape == (B, T, H) and seen["beta"].shape == (B, T, H) and (seen["beta"] > 0).all()
    assert seen["v"].shape == (B, T, H, shape.value_dim) and seen["h0"].shape == (B, *shape.state_shape)
    assert point["us_per_step"] == pytest.approx(10.0)


def test_kernels_table_rejects_a_bad_grid():
    cfg = _cfg(["experiment=kernels", "experiment.k_grid=[0]"] + CPU)
    with pytest.raises(ValueError, match="k_grid"):
        run_experiment(cfg, Path("/nonexistent"))


def test_plain_step_floor_bytes():
    """A plain step's memory floor: the weights once, then per row the SSM state and conv window
    read and written and the keys and values of the mean context: linear in the batch, growing
    with the context; None for a model without an adapter."""
    from tiny_models import get_model

    from specdec.batching import bytes_per_sequence
    from specdec.experiments.models import plain_step_bytes, weight_bytes
    from specdec.rollback import InPlaceUpdate

    model = get_model("qwen3_5")
    one, two, three = (plain_step_bytes(model, b, 16, 32) for b in (1, 2, 3))
    per_row = two - one
    assert abs((three - two) - per_row) <= 1
    assert one - weight_bytes(model, 1) == pytest.approx(per_row - (weight_bytes(model, 2) - weight_bytes(model, 1)), abs=1)
    row = bytes_per_sequence(model, InPlaceUpdate(), 48, 0)
    assert per_row > 2 * row.state_bytes > 0  # and some keys and values
    assert plain_step_bytes(model, 1, 160, 32) > one
    assert plain_step_bytes(torch.nn.Linear(4, 4), 1, 16, 32) is None


def test_weight_bytes_count_the_rows_of_an_untied_embedding_table_a_forward_reads():
    """Every parameter once; of an input embedding table that is not the LM head's weight, only the
    rows looked up (a tied table is the LM head's read, counted whole)."""
    from tiny_models import make_model

    from specdec.experiments.models import weight_bytes

    model = make_model("qwen3_5", seed=0)
    table, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    assert head.weight.data_ptr() != table.data_ptr()  # the tiny model's head is untied

    def every():
        return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())

    row = table.shape[1] * table.element_size()
    assert weight_bytes(model, 3) == every() - (table.shape[0] - 3) * row
    assert weight_bytes(model, 4) - weight_bytes(model, 3) == row
    head.weight = table  # tied: the table is the LM head's read
    assert weight_bytes(model, 3) == weight_bytes(model, 4) == every()
    assert weight_bytes(torch.nn.Linear(4, 4)) == 4 * 4 * 4 + 4 * 4


def test_bench_tiny_run_on_a_random_shape_model(tmp_path: Path):
    """experiment=bench on the qwen35-4b-shape entry shrunk to a tiny config (random init)."""
    tiny = {"hidden_size": 64, "num_hidden_layers": 4, "layer_types": "[linear_attention,linear_attention,"
            "linear_attention,full_attention]", "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "intermediate_size": 128, "vocab_size": 8192}
    cfg = _cfg(["experiment=bench", "model=qwen35-4b-shape", "rollback=ring", "prompts.limit=2", "max_new_tokens=8",
                "experiment.batch_grid=[1,2]", "experiment.warmup=false"] + CPU
               + [f"model.targets.0.config.{k}={v}" for k, v in tiny.items()])
    records = run_experiment(cfg, tmp_path)
    assert [(r["batch"], r["rollback"], r["exact"]) for r in records] == [(1, "ring", True), (2, "ring", True)]
    assert (tmp_path / "speedup_vs_batch.png").stat().st_size > 1000
    lines = _records(tmp_path / "results.jsonl")
    _check_summary_matches((tmp_path / "summary.md").read_text(), lines, {
        "tokens/s": ("tokens_per_s", "{:.1f}"), "speedup vs plain": ("speedup", "{:.2f}x"),
        "ms/step": ("ms_per_step", "{:.2f}"), "exact": ("exact", None)}, ["model", "rollback", "batch"])


TINY_SHAPE = ["model=qwen35-tiny-shape", "experiment.prompt_tokens=16"]


def test_bench_mtp_on_a_shape_without_mtp_weights(tmp_path: Path, capsys):
    """drafter=mtp in the benchmark: a random-weight shape gets random MTP layers (said on the
    console and in the records), also over a reduced draft vocabulary; outputs stay exact."""
    base = ["experiment=bench", "drafter=mtp", "rollback=replay", "max_new_tokens=12", "experiment.batch_grid=[1]",
            "experiment.hf=false", "repeats=1"] + TINY_SHAPE + CPU
    records = run_experiment(_cfg(base), tmp_path / "full")
    records += run_experiment(_cfg(base + ["drafter.mtp_draft_vocab=512"]), tmp_path / "reduced")
    assert "qwen35-tiny-shape has no MTP weights: drafter=mtp runs MTPDrafter.random layers" in capsys.readouterr().out
    assert [(r["drafter"], r["mtp_layers"], r["mtp_draft_vocab"], r["mtp_compile"]) for r in records] == [
        ("mtp", "random", None, False), ("mtp-vocab:512", "random", 512, False)]
    assert all(r["exact"] and r["diverged_rows"] == 0 for r in records)
    # the proposal's bytes: the layers' weights once, K reads of the head rows drafted over (fp32 here);
    # no floor in ms without a measured copy bandwidth (CPU)
    K, V, D = 4, 8192, 64
    assert records[0]["draft_bytes"] - records[1]["draft_bytes"] == K * (V - 512) * D * 4
    assert records[1]["draft_bytes"] > K * 512 * D * 4
    assert all(r["draft_floor_ms"] is None and "draft_vs_floor" not in r for r in records)
    for bad in ("drafter.mtp_draft_vocab=8", "drafter.mtp_compile=true"):
        with pytest.raises(ValueError, match="needs drafter=mtp"):
            run_experiment(_cfg(["experiment=bench", "drafter=ngram", bad] + TINY_SHAPE + CPU), tmp_path / "bad")


def test_bench_oracle_acceptance_and_records_as_measured(tmp_path: Path, monkeypatch):
    """experiment=bench with the oracle drafter on a tiny random-shape model: acceptance 1 commits
    K + 1 tokens per step and acceptance 0 one; every row equals specdec plain's output (fp32);
    decode and end-to-end speed with their spreads; the records are appended as measured, so a
    run cut short keeps what it finished and `python -m specdec.experiments.report` summarises it."""
    cfg = _cfg(["experiment=bench", "drafter=oracle", "drafter.oracle_acceptance=[1.0,0.0]", "rollback=replay",
                "max_new_tokens=11", "experiment.batch_grid=[2]", "experiment.hf=false", "repeats=2"]
               + TINY_SHAPE + CPU)
    records = run_experiment(cfg, tmp_path)
    assert [(r["drafter"], r["acceptance"], r["batch"]) for r in records] == [("oracle", 1.0, 2), ("oracle", 0.0, 2)]
    full, none = records
    assert full["mean_accepted_tokens"] == pytest.approx(5.0, abs=0.5) and none["mean_accepted_tokens"] == 1.0
    for r in records:
        assert r["exact"] and r["diverged_rows"] == 0 and r["near_tie"] is None and r["prompt_tokens"] == 16
        for k in ("decode_tokens_per_s", "plain_decode_tokens_per_s", "tokens_per_s", "plain_tokens_per_s"):
            assert r[f"{k}_min"] <= r[k] <= r[f"{k}_max"] and r[k] > 0
        assert r["decode_speedup"] == pytest.approx(r["decode_tokens_per_s"] / r["plain_decode_tokens_per_s"])
        assert r["hf_speedup"] is None and "hf_tokens_per_s" not in r
        assert r["draft_share"] + r["verify_share"] + r["rollback_share"] == pytest.approx(1.0)
        assert r["date"] and r["device_name"].startswith("CPU")
    assert _records(tmp_path / "results.jsonl") == json.loads(json.dumps(records))
    summary = (tmp_path / "summary.md").read_text()
    assert summary.splitlines()[2].startswith("Device: CPU")
    _check_summary_matches(summary, _records(tmp_path / "results.jsonl"), {
        "decode tokens/s": ("decode_tokens_per_s", "{:.1f}"), "decode speedup": ("decode_speedup", "{:.2f}x"),
        "mean accepted tokens": ("mean_accepted_tokens", "{:.2f}"), "diverged rows": ("diverged_rows", "{:.0f}"),
        "exact": ("exact", None)}, ["model", "drafter", "acceptance", "rollback", "batch"])

    import specdec.experiments.e2e as e2e

    calls = []
    measure = e2e.speculative_point

    def cut_short(*args, **kw):  # the second point "crashes": the first stays in results.jsonl
        if calls:
            raise RuntimeError("cut short")
        calls.append(1)
        return measure(*args, **kw)

    monkeypatch.setattr(e2e, "speculative_point", cut_short)
    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="cut short"):
        run_experiment(cfg, cut)
    kept = _records(cut / "results.jsonl")
    assert [(r["acceptance"], r["exact"]) for r in kept] == [(1.0, True)]
    res = _run([sys.executable, "-m", "specdec.experiments.report", str(cut)])
    assert res.returncode == 0, res.stderr
    assert len(_table((cut / "summary.md").read_text())[1]) == 1


def test_long_run_tiny_cpu(tmp_path: Path):
    """experiment=long_run (the bench's long-generation preset) at a CPU size: the oracle drafter
    over specdec plain's output, every strategy; in fp32 no row may diverge from plain decoding."""
    cfg = _cfg(["experiment=long_run", "max_new_tokens=24", "experiment.batch_grid=[2]"] + CPU)
    records = run_experiment(cfg, tmp_path)
    assert [r["rollback"] for r in records] == ["snapshot", "ring", "replay", "replay_deferred"]
    for r in records:  # fp32: speculative == plain, token for token, for the whole length
        assert (r["drafter"], r["acceptance"], r["batch"], r["new_tokens"]) == ("oracle", 0.8, 2, 48)
        assert r["diverged_rows"] == 0 and r["exact"] and r["first_divergence"] == []
        assert r["config"]["experiment"]["ignore_eos"] and r["mean_accepted_tokens"] > 1.0
    head, rows = _table((tmp_path / "summary.md").read_text())
    cells = [dict(zip(head, row)) for row in rows]
    assert [(c["diverged rows"], c["exact"]) for c in cells] == [("0", "yes")] * 4


def test_adaptive_tiny_cpu(tmp_path: Path):
    """experiment=adaptive on a tiny random-shape model: every cell (fixed K x strategy, then auto)
    equals specdec plain's output (fp32); auto's record compares it with the fixed cells of its
    workload (recomputed here from the records), says which strategy it ran and why and the K of
    every step; the changing workload (every draft right, then every draft wrong) is recorded
    with its schedule; the summary and both plots are written."""
    cfg = _cfg(["experiment=adaptive", "rollback=replay", "experiment.k_grid=[1,4]", "drafter.oracle_acceptance=[0.5]",
                "experiment.acceptance_phases=[1.0,0.0]", "max_new_tokens=24", "experiment.batch_grid=[2]", "repeats=1"]
               + TINY_SHAPE + CPU)
    records = run_experiment(cfg, tmp_path)
    cells = [(r["acceptance"], r["num_speculative_tokens"], r["rollback"]) for r in records]
    assert cells == [(a, K, s) for a in (0.5, "1->0") for K, s in ((1, "replay"), (4, "replay"), ("auto", "auto"))]
    for r in records:
        assert r["exact"] and r["diverged_rows"] == 0 and r["batch"] == 2 and r["new_tokens"] == 48
        assert sum(r["k_histogram"]) == r["steps"] and r["mean_k"] == pytest.approx(
            sum(k * n for k, n in enumerate(r["k_histogram"])) / r["steps"])
        for phase in ("draft", "verify", "commit"):  # the plain steps' phases, beside the decode time
            assert 0 < r[f"plain_{phase}_ms_min"] <= r[f"plain_{phase}_ms"] <= r[f"plain_{phase}_ms_max"]
        assert r["plain_draft_ms"] + r["plain_verify_ms"] + r["plain_commit_ms"] <= r["plain_decode_ms_per_step_max"]
    for a in (0.5, "1->0"):
        auto = next(r for r in records if r["acceptance"] == a and r["rollback"] == "auto")
        fixed = [r for r in records if r["acceptance"] == a and r["rollback"] != "auto"]
        best = max(fixed, key=lambda r: r["decode_tokens_per_s"])
        assert auto["vs_best_fixed"] == pytest.approx(auto["decode_tokens_per_s"] / best["decode_tokens_per_s"])
        assert auto["best_fixed"] == f"K={best['num_speculative_tokens']} replay"
        worst = min(fixed, key=lambda r: r["decode_tokens_per_s"])  # one strategy: the worst fixed K's cell
        assert auto["vs_worst_fixed_k"] == pytest.approx(auto["decode_tokens_per_s"] / worst["decode_tokens_per_s"])
        assert auto["rollback_used"] in ("snapshot", "ring", "replay")
        assert auto["rollback_reason"].startswith(f"{auto['rollback_used']}: the best predicted goodput")
        assert len(auto["k_per_step"]) == auto["steps"] and max(auto["k_per_step"]) <= 4
        assert auto["predicted_tokens_per_s"] > 0 and auto["measured_tokens_per_s"] > 0
        # what the policy predicted per K against the steps it ran, and its margin over plain steps
        assert len(auto["predicted_step_ms"]) == len(auto["measured_step_ms"]) == 5
        assert all(t > 0 for t in auto["predicted_step_ms"])
        assert all(t is None or t > 0 for t in auto["measured_step_ms"])
        assert len(auto["calibrated_step_ms"]) == len(auto["expected_tokens"]) == 5
        assert all(t is not None and t > 0 for t in auto["calibrated_step_ms"])  # every width was measured
        assert auto["expected_tokens"][0] > 0 and auto["leave_ms"] >= 0.0
        assert len(auto["speculation_gain_per_step"]) == auto["steps"]
        assert auto["speculation_gain"] == pytest.approx(statistics.median(auto["speculation_gain_per_step"]))
    changing = next(r for r in records if r["acceptance"] == "1->0" and r["rollback"] == "auto")
    assert changing["acceptance_schedule"] == [1.0] * 12 + [0.0] * 12
    # (which K auto chooses here follows this CPU's measured step times, which other processes
    # disturb: the policy's choices on such a workload are tested with fixed costs in
    # tests/test_adaptive.py and tests/test_bench_scripts.py's simulation)
    assert (tmp_path / "k_over_time.png").stat().st_size > 1000 and (tmp_path / "speedup_vs_batch.png").exists()
    _check_summary_matches((tmp_path / "summary.md").read_text(), _records(tmp_path / "results.jsonl"), {
        "decode tokens/s": ("decode_tokens_per_s", "{:.1f}"), "mean K": ("mean_k", "{:.2f}"),
        "exact": ("exact", None)},
        ["model", "acceptance", "batch", "rollback", "num_speculative_tokens"])


def test_adaptive_skips_a_cell_that_runs_out_of_memory(tmp_path: Path, monkeypatch):
    """A cell that runs out of device memory (snapshot at a large K and batch) is skipped and listed
    in summary.md; the other cells run, and auto is compared with those."""
    from specdec.experiments import e2e

    real_point = e2e.speculative_point

    def point(*args, **kwargs):
        if kwargs["K"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 896.00 MiB.")
        return real_point(*args, **kwargs)

    monkeypatch.setattr(e2e, "speculative_point", point)
    cfg = _cfg(["experiment=adaptive", "rollback=replay", "experiment.k_grid=[1,2]", "drafter.oracle_acceptance=[0.9]",
                "experiment.acceptance_phases=[]", "max_new_tokens=8", "experiment.batch_grid=[2]", "repeats=1"]
               + TINY_SHAPE + CPU)
    records = run_experiment(cfg, tmp_path)
    assert [r["num_speculative_tokens"] for r in records] == [1, "auto"]
    assert records[1]["best_fixed"] == "K=1 replay" and all(r["exact"] for r in records)
    summary = (tmp_path / "summary.md").read_text()
    assert "Skipped:" in summary and "K=2 replay: out of device memory" in summary


def test_adaptive_reuses_one_generator_per_cell(tmp_path: Path, monkeypatch):
    """experiment=adaptive builds, per batch, one generator for each (K, strategy) and one for auto,
    and runs it on every workload: a fixed cell's static decoder (on CUDA, its graphs) serves
    every workload, and so does auto's while its strategy stays; a fixed cell warms up on its
    first workload only, auto on each; every output equals plain decoding's (fp32)."""
    from specdec.engine import SpeculativeGenerator
    from specdec.experiments import e2e

    built, points = [], []
    real_init, real_point = SpeculativeGenerator.__init__, e2e.speculative_point

    def counting_init(self, *args, **kwargs):
        built.append(kwargs.get("num_speculative_tokens"))
        real_init(self, *args, **kwargs)

    def point(*args, sd, warmup, **kwargs):
        rec = real_point(*args, sd=sd, warmup=warmup, **kwargs)
        points.append(((kwargs["K"], kwargs["strategy"]), sd, warmup, sd.decoder))
        return rec

    monkeypatch.setattr(SpeculativeGenerator, "__init__", counting_init)
    monkeypatch.setattr(e2e, "speculative_point", point)
    cfg = _cfg(["experiment=adaptive", "rollback=replay", "experiment.k_grid=[1,2]",
                "drafter.oracle_acceptance=[0.4,0.9]", "experiment.acceptance_phases=[1.0,0.0]", "max_new_tokens=12",
                "experiment.batch_grid=[2]", "repeats=1", "experiment.decode_path=static"] + TINY_SHAPE + CPU)
    records = run_experiment(cfg, tmp_path)
    cells, loads = [(1, "replay"), (2, "replay"), ("auto", "auto")], [0.4, 0.9, "1->0"]
    assert [cell for cell, *_ in points] == [c for c in cells for _ in loads]  # cells outer, workloads inner
    assert built == [0, 1, 2, "auto"]  # plain decoding's, then one per cell (not one per cell and workload)
    for c in cells:
        mine = [p for p in points if p[0] == c]
        assert len({id(sd) for _, sd, _, _ in mine}) == 1
        assert [warm for _, _, warm, _ in mine] == ([True] * 3 if c[0] == "auto" else [True, False, False])
        if c[0] != "auto":
            assert len({id(dec) for *_, dec in mine}) == 1
    # the records in the order the report and the caller see them: per workload, the cells in order
    assert [(r["acceptance"], r["num_speculative_tokens"]) for r in records] == [(a, K) for a in loads
                                                                                for K, _ in cells]
    assert all(r["exact"] and r["diverged_rows"] == 0 and r["decode_path"] == "static" for r in records)
    auto = [r for r in records if r["num_speculative_tokens"] == "auto"]
    decoders = [dec for cell, *_, dec in points if cell == ("auto", "auto")]
    for i in range(1, len(auto)):  # a strategy chosen again keeps its decoder
        if auto[i]["rollback_used"] == auto[i - 1]["rollback_used"]:
            assert decoders[i] is decoders[i - 1]
    for r in auto:  # compared with the fixed cells of its own workload
        best = max((f for f in records if f["acceptance"] == r["acceptance"] and f["rollback"] != "auto"),
                   key=lambda f: f["decode_tokens_per_s"])
        assert r["vs_best_fixed"] == pytest.approx(r["decode_tokens_per_s"] / best["decode_tokens_per_s"])


def test_bench_takes_auto_choices(tmp_path: Path):
    """num_speculative_tokens=auto and rollback=auto through experiment=bench: exact, and the record
    names the strategy that ran; both are refused where they do not apply."""
    cfg = _cfg(["experiment=bench", "drafter=oracle", "rollback=auto", "num_speculative_tokens=auto",
                "max_new_tokens=8", "experiment.batch_grid=[2]", "experiment.hf=false", "repeats=1",
                "experiment.warmup=false"] + TINY_SHAPE + CPU)
    (r,) = run_experiment(cfg, tmp_path)
    assert r["exact"] and r["num_speculative_tokens"] == "auto" and r["rollback"] == "auto"
    assert r["rollback_used"] in ("snapshot", "ring", "replay") and r["rollback_reason"] and r["k_per_step"]
    with pytest.raises(ValueError, match="rollback=auto .* runs in experiment=bench, long_run, adaptive"):
        run_experiment(_cfg(["experiment=rollback", "rollback=auto"] + CPU), tmp_path / "x")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int in \\[0, 64\\] or auto, got 'abc'"):
        run_experiment(_cfg(["experiment=bench", "num_speculative_tokens=abc"] + CPU), tmp_path / "y")
    with pytest.raises(Exception) as info:  # experiment=acceptance: its schema keeps an int
        _cfg(["num_speculative_tokens=auto"])
    assert "could not be converted to Integer" in one_line(info.value)


def test_checks_tiny_cpu(tmp_path: Path, capsys):
    """experiment=checks on a tiny model: the CUDA-only checks say SKIP and still measure (rollback
    timed apart, step times), the memory budget and fp32 checks pass on the CPU."""
    cfg = _cfg(["experiment=checks", "max_new_tokens=12", "experiment.batch_grid=[1,4]", "repeats=1"]
               + TINY_SHAPE + CPU)
    records = run_experiment(cfg, tmp_path)
    lines = capsys.readouterr().out.splitlines()

    def verdict(check):
        hits = [x for x in lines if x.startswith(f"{check}: ")]
        assert len(hits) == 1, lines[-40:]
        return hits[0]

    assert verdict("rollback_on_device").startswith("rollback_on_device: SKIP (needs CUDA)")
    assert "rollback time reported apart: yes" in verdict("rollback_on_device")
    assert verdict("step_cost").startswith("step_cost: SKIP (needs CUDA)") and "ms/step" in verdict("step_cost")
    memory = verdict("memory_budget")
    assert memory.startswith("memory_budget: PASS"), memory
    for s in ("snapshot", "ring", "replay", "replay_deferred"):
        assert f"{s}: +" in memory
    assert verdict("fp32_state").startswith("fp32_state: PASS")
    by = {}
    for r in records:
        by.setdefault(r["experiment"], []).append(r)
    assert all(r["off_device"] == 0 and r["rollback_apart"] for r in by["checks.rollback_on_device"])
    assert [(r["batch"], r["decode_path"]) for r in by["checks.step_cost"]][::4] == [(1, "static"), (4, "static")]
    assert all(r["ratio"] == pytest.approx(r["step_ms"] / r["plain_step_ms"]) for r in by["checks.step_cost"])
    budget = {r["rollback"]: r for r in by["checks.memory_budget"]}
    assert budget["replay"]["extra_MiB"] < min(budget["snapshot"]["extra_MiB"], budget["ring"]["extra_MiB"])
    md = (tmp_path / "summary.md").read_text()
    for text in ("- rollback_on_device: SKIP", "- step_cost: SKIP", "- memory_budget: PASS", "- fp32_state: PASS",
                 "## checks.rollback_on_device", "## checks.step_cost", "## checks.memory_budget"):
        assert text in md


def test_tree_verify_profile_tiny_cpu(tmp_path: Path):
    """experiment=tree_verify times chain and tree steps and, with experiment.profile, adds one
    profiled verify per configuration: host ops / host ms / kernels columns and a top-ops table each."""
    cfg = _cfg(["experiment=tree_verify", "model=qwen35-tiny-shape", "experiment.batch_grid=[2]",
                "rollback.strategies=[snapshot,replay]", "experiment.steps=1", "experiment.warmup=0",
                "experiment.prompt_tokens=16", "experiment.profile=true"] + CPU)
    records = run_experiment(cfg, tmp_path)
    assert [(r["rollback"], r["tree"], r["nodes"]) for r in records] == [
        ("snapshot", "chain", 5), ("snapshot", "default", 16), ("replay", "chain", 5), ("replay", "default", 16)]
    for r in records:  # CPU: the torch kernels are the default, so no "torch" row; no GPU kernels
        assert r["kernels"] == "default" and r["host_ops"] > 50 and r["host_ms"] > 0
        assert r["gpu_kernels"] == 0 and r["device_ms"] is None
        assert r["vs_chain"] == pytest.approx(r["verify_ms"] / next(
            c["verify_ms"] for c in records if c["rollback"] == r["rollback"] and c["tree"] == "chain"))
    text = (tmp_path / "profile.md").read_text()
    assert text.count("\n## ") == 4 and text.count("Self CPU time total") == 4


def test_tree_verify_static_path_tiny_cpu(tmp_path: Path):
    """experiment.decode_path=static times the engine's fixed-shape bucket (StaticDecoder: tree forward
    + path commit), the CUDA-graph path without the graphs; cuda_graph on the CPU is refused."""
    base = ["experiment=tree_verify", "model=qwen35-tiny-shape", "experiment.batch_grid=[2]", "rollback=ring",
            "experiment.steps=1", "experiment.warmup=1", "experiment.prompt_tokens=16"] + CPU
    records = run_experiment(_cfg(base + ["experiment.decode_path=static"]), tmp_path)
    assert [(r["tree"], r["nodes"], r["decode_path"]) for r in records] == [("chain", 5, "static"),
                                                                          ("default", 16, "static")]
    assert all(r["verify_ms"] > 0 and r["commit_ms"] > 0 for r in records)
    assert "static path" in (tmp_path / "summary.md").read_text()
    with pytest.raises(ValueError, match="cuda_graph needs CUDA"):
        run_experiment(_cfg(base + ["experiment.decode_path=cuda_graph"]), tmp_path / "graph")
    # kernel variants that are no measurement of their own on a CPU: refused, not an empty table
    with pytest.raises(ValueError, match=r"experiment.kernels=\['torch', 'loop'\] measures nothing on cpu"):
        run_experiment(_cfg(base + ["experiment.kernels=[torch,loop]"]), tmp_path / "none")


def test_ngram_proposal_tiny_cpu(tmp_path: Path):
    """experiment=ngram_proposal checks that both searches propose the same before timing and
    records one row per (batch, width)."""
    cfg = _cfg(["experiment=ngram_proposal", "experiment.batch_grid=[1,3]", "experiment.widths=[32,96]",
                "repeats=2"] + CPU)
    records = run_experiment(cfg, tmp_path)
    assert [(r["batch"], r["width"]) for r in records] == [(1, 32), (1, 96), (3, 32), (3, 96)]
    for r in records:
        assert r["same_proposals"] and r["loop_ms_min"] <= r["loop_ms"] <= r["loop_ms_max"]
        assert r["loop_over_batched"] == pytest.approx(r["loop_ms"] / r["batched_ms"])
    head, rows = _table((tmp_path / "summary.md").read_text(), "batch")
    assert [tuple(row[:2]) for row in rows] == [("1", "32"), ("1", "96"), ("3", "32"), ("3", "96")]


@needs_triton_interpreter
def test_skinny_linear_tiny_cpu(tmp_path: Path):
    """experiment=skinny_linear on the tiny Qwen3.5 shape (the kernel through the interpreter):
    one record per distinct nn.Linear weight shape of the model config and M, then per sibling
    group the decode path merges (the GDN's four input projections, the attention's q / k / v),
    the kernel checked against the fp32 reference and batch-invariant, ratios and bandwidth from
    the records' own times; experiment.max_weight_mib leaves the LM head out; rows above 64 are
    refused."""
    from specdec.experiments.skinny_linear import linear_shapes, model_spec, sibling_shapes

    cfg = _cfg(["experiment=skinny_linear", "experiment.models=[qwen35-tiny-shape]", "experiment.rows=[1,3]",
                "experiment.min_calls=1", "experiment.max_weight_mib=1"] + CPU)
    records = run_experiment(cfg, tmp_path)
    shapes = linear_shapes(model_spec("qwen35-tiny-shape"))
    groups = sibling_shapes(model_spec("qwen35-tiny-shape"))
    assert sorted(len(g.members) for g in groups) == [3, 4] and all(g.N == sum(g.members) for g in groups)
    timed = [s for s in shapes if s.N * s.K * 4 <= 1 << 20]
    assert {(s.N, s.K) for s in shapes} - {(s.N, s.K) for s in timed} == {(8192, 64)}  # the LM head
    assert [(r["N"], r["K"], r["rows"]) for r in records] == [(s.N, s.K, m) for s in timed + groups for m in (1, 3)]
    singles = [r for r in records if "group" not in r]
    assert sum(r["layers"] for r in singles if r["rows"] == 1) == sum(len(s.names) for s in timed)
    assert [r["group"] for r in records if "group" in r and r["rows"] == 1] == ["+".join(map(str, g.members))
                                                                               for g in groups]
    assert all(r["members_kernel_us"] > 0 for r in records if "group" in r)
    for r in records:
        assert r["rel_err"] < 1e-5 and r["batch_invariant"] and r["torch_us"] > 0 and r["kernel_us"] > 0
        assert r["speedup"] == pytest.approx(r["torch_us"] / r["kernel_us"])
        assert r["kernel_GBps"] == pytest.approx(r["bytes"] / r["kernel_us"] / 1e3)
    summary = (tmp_path / "summary.md").read_text()
    head, rows = _table(summary)
    assert head[:3] == ["model", "weight", "rows"] and len(rows) == len(records)
    assert "## Linear time of one forward" in summary and "## Sibling groups of one forward" in summary
    with pytest.raises(ValueError, match=r"experiment.rows must list M in \[1, 64\]"):
        run_experiment(_cfg(["experiment=skinny_linear", "experiment.rows=[65]"] + CPU), tmp_path / "bad")


def test_prefill_tiny_cpu(tmp_path: Path):
    """experiment=prefill times each distinct scan path per (batch, prompt tokens), HF's first
    (auto is the torch scan on CPU, so it runs once), its logits equal to HF's; no roof on a CPU;
    a scan this machine cannot run (fla) is skipped and listed; a bad grid is refused."""
    base = ["experiment=prefill", "model=nemotronh-tiny-shape", "repeats=2", "experiment.warmup=0"] + CPU
    cfg = _cfg(base + ["experiment.grid=[[2,40],[1,24]]", "experiment.scans=[auto,torch,fla,hf]"])
    records = run_experiment(cfg, tmp_path)
    assert [(r["batch"], r["prompt_tokens"], r["scan"], r["scan_path"]) for r in records] == [
        (2, 40, "hf", "hf"), (2, 40, "auto", "torch"), (1, 24, "hf", "hf"), (1, 24, "auto", "torch")]
    for r in records:
        assert r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
        tokens = r["batch"] * r["prompt_tokens"]
        assert r["tokens_per_s_min"] == pytest.approx(tokens / (r["prefill_ms_max"] / 1e3))
        assert r["tokens_per_s_max"] == pytest.approx(tokens / (r["prefill_ms_min"] / 1e3))
        assert r["flop"] == 2 * r["matmul_params"] * r["batch"] * r["prompt_tokens"] and r["roof_ms"] is None
        assert (r["logits_rel_err_vs_hf"] is None) == (r["scan_path"] == "hf")
        assert r["scan_path"] == "hf" or r["logits_rel_err_vs_hf"] < 1e-5
    summary = (tmp_path / "summary.md").read_text()
    assert "Skipped: scan=fla: scan='fla' needs CUDA tensors" in summary
    head, rows = _table(summary)
    assert [tuple(row[1:4]) for row in rows] == [("2", "40", "hf"), ("2", "40", "auto"), ("1", "24", "hf"),
                                                ("1", "24", "auto")]
    assert not (tmp_path / "profile.md").exists() and "profile_host_ops" not in records[0]
    # experiment.profile: one profiled prefill per point and scan, its counts in the record
    prof = run_experiment(_cfg(base + ["experiment.grid=[[2,40]]", "experiment.scans=[auto]",
                                       "experiment.profile=true"]), tmp_path / "prof")
    assert len(prof) == 1 and prof[0]["profile_host_ops"] > 50 and prof[0]["profile_host_ms"] > 0
    assert prof[0]["profile_gpu_kernels"] == 0 and prof[0]["profile_device_ms"] is None
    text = (tmp_path / "prof" / "profile.md").read_text()
    assert text.count("\n## ") == 1 and "batch 2 x 40 prompt tokens, scan torch" in text and "Self CPU" in text
    # experiment.switches: each setting timed round by round with the default, a record each
    sw = run_experiment(_cfg(base + ["experiment.grid=[[2,40]]", "experiment.scans=[auto]",
                                     "experiment.switches=['SPECDEC_PROMPT_KERNELS=0']"]), tmp_path / "sw")
    assert [(r["switch"], r["scan_path"]) for r in sw] == [(None, "torch"), ("SPECDEC_PROMPT_KERNELS=0", "torch")]
    assert sw[0]["vs_default"] == 1.0 and sw[1]["vs_default"] == pytest.approx(sw[1]["prefill_ms"] / sw[0]["prefill_ms"])
    assert sw[1]["logits_rel_err_vs_default"] == 0.0  # (on a CPU the switch changes nothing: the torch backend)
    head, rows = _table((tmp_path / "sw" / "summary.md").read_text())
    assert "switch" in head and "x default" in head and len(rows) == 2
    with pytest.raises(ValueError, match="experiment.switches time the eager and static"):
        run_experiment(_cfg(base + ["experiment.switches=['SPECDEC_PROMPT_KERNELS=0']",
                                    "experiment.prompt_paths=[eager,cuda_graph]"]), tmp_path / "bad_sw")
    with pytest.raises(ValueError, match="a switch must be NAME=VALUE"):
        run_experiment(_cfg(base + ["experiment.switches=[SPECDEC_PROMPT_KERNELS]"]), tmp_path / "bad_sw2")
    with pytest.raises(ValueError, match="experiment.grid must list"):
        run_experiment(_cfg(base + ["experiment.grid=[[2]]"]), tmp_path / "bad")
    with pytest.raises(ValueError, match="experiment.scans must list"):
        run_experiment(_cfg(base + ["experiment.scans=[triton]"]), tmp_path / "bad2")


def test_e2e_divergence_margins():
    """Each diverged row's first divergence and plain decoding's top-2 margin there (teacher-forced
    over the reference): one per diverged row, none otherwise, equal to the model's own logits."""
    import specdec
    from specdec import zoo
    from specdec.experiments.e2e import batch_encoding, divergence_margins, row_divergences

    model, tok = zoo.load("gdn-target", device="cpu", dtype=torch.float32)
    enc = batch_encoding(tok, zoo.prompts("128", limit=2), 2, "cpu")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    ref = specdec.wrap(model).generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    P = ids.shape[1]
    assert row_divergences(ref.clone(), ref, P) == ([], [])
    out = ref.clone()
    out[1, P + 2] = (out[1, P + 2] + 1) % model.config.vocab_size
    assert row_divergences(out, ref, P) == ([1], [2])
    margins = divergence_margins(model, ref, mask, [1], [2], P)
    with torch.no_grad():
        logits = model(input_ids=ref[1:2, :P + 2], attention_mask=torch.cat([mask[1:2], mask.new_ones(1, 2)], 1)).logits
    top = torch.topk(logits[0, -1].float(), 2).values
    assert len(margins) == 1 and abs(margins[0] - float(top[0] - top[1])) < 1e-3 and margins[0] >= 0
    assert divergence_margins(model, ref, mask, [0], [ref.shape[1] - P], P) == [None]  # the reference had ended


# ------------------------------------------------------------------------------ processes


def _run(args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kw)


def test_multirun_ends_with_one_combined_summary(tmp_path: Path):
    sweep = tmp_path / "sweep"
    res = _run([sys.executable, "-m", "specdec", "-m", "rollback=snapshot,replay", "model=gdn-target", "drafter=ngram",
                "prompts.limit=1", "max_new_tokens=6", "experiment.warmup=false", f"hydra.sweep.dir={sweep}"] + CPU)
    assert res.returncode == 0, res.stderr[-2000:]
    jobs = [_records(sweep / j / "results.jsonl") for j in ("0", "1")]
    combined = _records(sweep / "results.jsonl")
    assert [r["rollback"] for r in combined] == ["snapshot", "replay"]
    assert [r["job"] for r in combined] == ["0", "1"] and "rollback=replay" in combined[1]["overrides"]
    assert [{k: v for k, v in r.items() if k not in ("job", "overrides")} for r in combined] == jobs[0] + jobs[1]
    summary = (sweep / "summary.md").read_text()
    assert summary.startswith("# Sweep: 2 jobs, 2 records")
    _check_summary_matches(summary, combined, {"tokens/s": ("tokens_per_s", "{:.1f}"), "exact": ("exact", None),
                                               "mean accepted tokens": ("mean_accepted_tokens", "{:.2f}")},
                           ["model", "drafter", "rollback"])
    assert (sweep / "accept_hist.png").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_serve_consecutive_experiments(tmp_path: Path):
    """Under a 2-process launch, experiments one after another in one process (a Hydra --multirun
    sweep) each split and gather through the same process group, and the launch exits cleanly."""
    script = tmp_path / "jobs.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from specdec.experiments.distributed import Processes\n"
        "for job in range(3):\n"
        "    with Processes('cpu') as p:\n"
        "        got = p.gather([(p.index, job, p.split(list(range(5))))])\n"
        "        if p.is_main:\n"
        "            print('JOB', job, got, flush=True)\n"
    )
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()), str(script)])
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = [x for x in res.stdout.splitlines() if x.startswith("JOB")]
    assert jobs == [f"JOB {j} [(0, {j}, [0, 1, 2]), (1, {j}, [3, 4])]" for j in range(3)]


def test_two_processes_give_the_records_of_one(tmp_path: Path):
    """accelerate launch with 2 CPU processes: the prompts are split, the records gathered and
    written once; without the timing fields they equal a one-process run's."""
    args = ["experiment=acceptance", "model=gdn-target", "drafter=ngram", "rollback=replay", "prompts.limit=3",
            "max_new_tokens=8"] + CPU
    one = run_experiment(_cfg(args), tmp_path / "one")
    res = _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(_free_port()), "-m", "specdec"] + args + [f"hydra.run.dir={tmp_path / 'two'}"])
    assert res.returncode == 0, res.stderr[-3000:]
    two = _records(tmp_path / "two" / "results.jsonl")
    assert sorted({r["process"] for r in two}) == [0, 1]  # both processes ran prompts

    def strip(rs):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rs]

    assert strip(two) == strip(json.loads(json.dumps(one)))
    assert len(_table((tmp_path / "two" / "summary.md").read_text())[1]) == 1


@pytest.mark.parametrize("override, message", [
    ("device=tpu", "Invalid value 'tpu', expected one of [auto, cpu, cuda]"),
    pytest.param("num_speculative_tokens=-1", "num_speculative_tokens must be in [0, 64] (0 = plain decoding), got -1",
                 marks=pytest.mark.slow),  # (the K check of experiment=bench below runs by default)
    ("experiment=bench num_speculative_tokens=65", "num_speculative_tokens must be in [0, 64] (0 = plain decoding), "
     "or auto (K chosen per step) in experiment=bench/long_run/adaptive/serve, got 65"),
    ("drafterr=ngram", "unknown key 'drafterr' (did you mean 'drafter'?)"),
    ("schema=bench", "'schema' is internal"),
    pytest.param("experiment=rollback num_speculative_tokens=0", "need drafts to roll back", marks=pytest.mark.slow),
])
def test_bad_value_gives_a_one_line_error(tmp_path: Path, override, message):
    res = _run([sys.executable, "-m", "specdec", *override.split(), f"hydra.run.dir={tmp_path}"])
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdec-run: ") and message in lines[0], res.stderr
    assert "+" not in lines[0].split("specdec-run: ", 1)[1].split("=")[0]  # never suggests +key=value


def test_one_line_error_texts():
    for override, want in (("rollback=undo", r"Could not find 'rollback/undo'.*Available options in 'rollback': all, "),
                           ("foo=1", r"Could not override 'foo'"),
                           ("num_speculative_tokens=abc", r"could not be converted to Integer")):
        with pytest.raises(Exception) as info:
            _cfg([override])
        text = one_line(info.value)
        assert "\n" not in text and re.search(want, text), text
    with pytest.raises(ValueError, match="unknown top-level key"):
        run_experiment(_cfg(["+foo=1"]), Path("/nonexistent"))
    with pytest.raises(ValueError, match="model=hf needs model.targets.0.name"):
        run_experiment(_cfg(["model=hf", "device=cpu"]), Path("/nonexistent"))


def test_divergence_position_and_margin_of_a_near_tie():
    """acceptance's exactness fields: the first differing position (also where one output ends
    early), the plain run's own margin there, near-tie only below 0.25 and only in half precision."""
    import torch

    from specdec.experiments.acceptance import divergence_fields, first_divergence

    ref = torch.tensor([[1, 2, 5, 6, 7, 8, 9]])  # 2 prompt tokens, 5 new
    margins = torch.tensor([1.0, 0.1, 0.0625, 2.0, 3.0])
    assert first_divergence(ref.clone(), ref) is None
    assert first_divergence(torch.tensor([[1, 2, 5, 6, 1, 8, 9]]), ref) == 4
    assert first_divergence(torch.tensor([[1, 2, 5, 6]]), ref) == 4
    assert divergence_fields(ref.clone(), ref, margins, 2, torch.bfloat16) == {
        "exact": True, "divergence_position": None, "divergence_margin": None, "near_tie": None}
    out = torch.tensor([[1, 2, 5, 6, 1, 8, 9]])
    assert divergence_fields(out, ref, margins, 2, torch.bfloat16) == {
        "exact": False, "divergence_position": 2, "divergence_margin": 0.0625, "near_tie": True}
    assert divergence_fields(out, ref, margins, 2, torch.float32)["near_tie"] is False  # fp32: never allowed
    wide = divergence_fields(torch.tensor([[1, 2, 5, 6, 7, 1, 9]]), ref, margins, 2, torch.float16)
    assert wide["divergence_margin"] == 2.0 and wide["near_tie"] is False
    short = divergence_fields(torch.tensor([[1, 2, 5, 6]]), ref, margins, 2, torch.bfloat16)  # stopped early
    assert short == {"exact": False, "divergence_position": 2, "divergence_margin": None, "near_tie": False}


def test_summary_groups_the_gpus_of_one_run_and_counts_near_ties():
    """Records of a 2-GPU run (device cuda:0 / cuda:1) share one summary row; the near-tie
    column counts the divergences at near-ties among the inexact records."""
    from specdec.experiments.report import summarize

    base = {"experiment": "acceptance", "model": "m", "drafter": "ngram", "rollback": "replay",
            "num_speculative_tokens": 4, "mean_accepted_tokens": 2.0}
    recs = [{**base, "device": "cuda:0", "exact": True, "near_tie": None},
            {**base, "device": "cuda:1", "exact": False, "near_tie": True},
            {**base, "device": "cuda:1", "exact": False, "near_tie": False}]
    (row,) = summarize(recs)
    assert row["prompts"] == 3 and row["exact"] == "1/3" and row["near_tie"] == "1/2"
    (cpu,) = summarize([{**base, "device": "cpu", "exact": True, "near_tie": None}])
    assert cpu["exact"] == "yes" and cpu["near_tie"] is None
    assert len(summarize(recs + [{**base, "device": "cpu", "exact": True}])) == 2  # a device sweep keeps its rows


def test_bench_times_each_point_with_and_without_the_overlap(tmp_path: Path):
    """experiment.overlap=[true,false]: each point twice against one plain run, the proposals made
    before and after the step's sync (the same outputs), a summary row for each; a bad value is
    refused before anything runs."""
    cfg = _cfg(["experiment=bench", "drafter=oracle", "drafter.oracle_acceptance=[0.8]", "rollback=replay",
                "max_new_tokens=9", "experiment.batch_grid=[2]", "experiment.hf=false", "repeats=1",
                "experiment.overlap=[true,false]"] + TINY_SHAPE + CPU)
    records = run_experiment(cfg, tmp_path)
    assert [(r["rollback"], r["overlap"], r["exact"]) for r in records] == [("replay", True, True),
                                                                            ("replay", False, True)]
    assert records[0]["plain_decode_tokens_per_s"] == records[1]["plain_decode_tokens_per_s"]  # one plain run
    header, rows = _table((tmp_path / "summary.md").read_text())
    assert "overlap" in header and len(rows) == 2
    with pytest.raises(ValueError, match="experiment.overlap"):
        run_experiment(_cfg(["experiment=bench", "experiment.overlap=[]"] + TINY_SHAPE + CPU), tmp_path / "bad")


def test_bench_times_plain_decoding_under_switches_round_by_round(tmp_path: Path, monkeypatch):
    """experiment.plain_switches: specdec plain also runs under each setting (every call of it, the
    untimed first one included, sees the setting; the default's calls do not), round by round with
    the default's; the record has its step time, the paired ratio, the output check and the
    default's values, summary.md its table (rebuilt from results.jsonl too); names specdec does not
    read during a call are warned about; a bad entry is refused before anything runs."""
    from specdec.engine import SpeculativeGenerator
    from specdec.experiments.report import main as rebuild

    seen = []
    generate = SpeculativeGenerator.generate

    def spy(self, *args, **kwargs):
        if self.num_speculative_tokens == 0:
            seen.append((os.environ.get("SPECDEC_PROBE"), os.environ.get("SPECDEC_DEBUG")))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spy)
    monkeypatch.delenv("SPECDEC_PROBE", raising=False)
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    cfg = _cfg(["experiment=bench", "drafter=oracle", "drafter.oracle_acceptance=[0.8]", "rollback=replay",
                "max_new_tokens=6", "experiment.batch_grid=[2]", "experiment.hf=false", "repeats=2",
                "experiment.plain_switches=[' SPECDEC_PROBE = 1 ','SPECDEC_PROBE=2,SPECDEC_DEBUG=1']"]
               + TINY_SHAPE + CPU)
    with pytest.warns(UserWarning, match="specdec does not read SPECDEC_PROBE during a call"):
        (rec,) = run_experiment(cfg, tmp_path)
    default, first, second = (None, None), ("1", None), ("2", "1")
    assert seen == [default, first, second] * 2 + [first, second, default]  # the untimed round, then 2 timed ones
    assert "SPECDEC_PROBE" not in os.environ and "SPECDEC_DEBUG" not in os.environ
    switched = rec["plain_switches"]
    assert list(switched) == ["SPECDEC_PROBE=1", "SPECDEC_PROBE=2,SPECDEC_DEBUG=1"]  # (spaces dropped)
    for f in switched.values():
        assert f["same_output"] is True and f["within_noise"] in (True, False)
        assert f["decode_ms_per_step_min"] <= f["decode_ms_per_step"] <= f["decode_ms_per_step_max"]
        assert f["vs_default_min"] <= f["vs_default"] <= f["vs_default_max"] and f["vs_default"] > 0
    assert switched["SPECDEC_PROBE=2,SPECDEC_DEBUG=1"]["default_env"] == {"SPECDEC_PROBE": None, "SPECDEC_DEBUG": None}
    text = (tmp_path / "summary.md").read_text()
    assert "## specdec plain under environment switches" in text
    assert "| `SPECDEC_PROBE=2,SPECDEC_DEBUG=1` |" in text
    (tmp_path / "summary.md").unlink()
    rebuild([str(tmp_path)])
    assert "| `SPECDEC_PROBE=2,SPECDEC_DEBUG=1` |" in (tmp_path / "summary.md").read_text()
    for bad in ("SPECDEC_PROBE", "=1", "1X=2", "A=1,"):
        with pytest.raises(ValueError, match=r"a switch must be NAME=VALUE .* got"):
            run_experiment(_cfg(["experiment=bench", f"experiment.plain_switches=['{bad}']"] + TINY_SHAPE + CPU),
                           tmp_path / "bad")
    with pytest.raises(ValueError, match="sets A twice"):
        run_experiment(_cfg(["experiment=bench", "experiment.plain_switches=['A=1,A=2']"] + TINY_SHAPE + CPU),
                       tmp_path / "bad2")
    with pytest.raises(ValueError, match="'A=1,B=2' and 'B=2, A=1' are the same settings"):
        run_experiment(_cfg(["experiment=bench", "experiment.plain_switches=['A=1,B=2','B=2, A=1']"] + TINY_SHAPE
                            + CPU), tmp_path / "bad3")
    monkeypatch.setenv("SPECDEC_FUSE", "0")
    from specdec.experiments.e2e import parse_switches

    with pytest.warns(UserWarning, match="equals the current environment"):
        assert parse_switches(["SPECDEC_FUSE=0"]) == {"SPECDEC_FUSE=0": {"SPECDEC_FUSE": "0"}}


def test_call_switches_are_the_environment_switches_specdec_reads():
    """CALL_SWITCHES (what plain_switches may change) lists every SPECDEC_* variable the package
    reads, so a new switch cannot be missed by the warning."""
    from specdec.experiments.e2e import CALL_SWITCHES

    import specdec

    root = Path(specdec.__file__).parent
    read = set()
    for path in root.rglob("*.py"):
        read |= set(re.findall(r"(?:environ\.get\(|environ\[|_switch\()\s*\"(SPECDEC_[A-Z_]+)\"", path.read_text()))
    assert read == set(CALL_SWITCHES)


def test_device_timeline_splits_idle_time_into_host_waits_and_short_gaps():
    """The union of kernel intervals is the busy time (overlaps on two streams count once); idle
    gaps of at least the threshold are counted apart; bad intervals are refused."""
    from specdec.experiments.profiling import device_timeline

    kernels = [(100.0, 110.0), (105.0, 120.0), (121.0, 130.0), (200.0, 210.0), (0.0, 5.0), (240.0, 241.0)]
    t = device_timeline(kernels, long_gap_us=20.0)
    # busy: [0,5] + [100,120] + [121,130] + [200,210] + [240,241] = 5 + 20 + 9 + 10 + 1 = 45 us of a 241 us span
    assert t == pytest.approx({"span_ms": 0.241, "busy_ms": 0.045, "idle_ms": 0.196, "long_gaps": 3,
                               "long_gap_ms": (95 + 70 + 30) / 1e3})
    assert device_timeline([]) == {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "long_gaps": 0,
                                   "long_gap_ms": 0.0}
    assert device_timeline([(0, 10), (50, 50), (100, 110)])["long_gaps"] == 1  # (an empty interval splits nothing)
    with pytest.raises(ValueError, match="must end at or after its start"):
        device_timeline([(0.0, float("nan"))])
    with pytest.raises(ValueError, match=r"must end at or after its start, got \(5.0, 1.0\)"):
        device_timeline([(5.0, 1.0)])
    with pytest.raises(ValueError, match="long_gap_us must be >= 0"):
        device_timeline([], long_gap_us=-1)


def test_bench_profile_lists_profile_rows_entries(tmp_path: Path):
    """experiment.profile=true adds a profiled generate() per configuration (plain, then each point),
    each profile.md table holding experiment.profile_rows entries; fewer than one is refused before
    anything runs."""
    base = ["experiment=bench", "drafter=oracle", "drafter.oracle_acceptance=[0.8]", "rollback=replay",
            "max_new_tokens=6", "experiment.batch_grid=[2]", "experiment.hf=false", "repeats=1",
            "experiment.profile=true"] + TINY_SHAPE + CPU
    records = run_experiment(_cfg(base + ["experiment.profile_rows=4"]), tmp_path)
    assert len(records) == 1 and records[0]["profile_host_ops_per_step"] > 0
    sections = (tmp_path / "profile.md").read_text().split("\n## ")[1:]
    assert len(sections) == 2 and "specdec plain" in sections[0]
    for section in sections:
        table = section.split("```")[1].strip().splitlines()
        names = [line for line in table[3:] if line.strip() and not line.startswith(("-", "Self "))]
        assert len(names) == 4, table
    with pytest.raises(ValueError, match="experiment.profile_rows must be an int >= 1"):
        run_experiment(_cfg(base + ["experiment.profile_rows=0"]), tmp_path / "bad")


def test_oracle_points_draw_per_call_and_alike_across_points(monkeypatch):
    """speculative_point gives an OracleDrafter the seed ``seed + i`` in its i-th timed call (the
    warm-up's as the first), so the repeats sample the acceptance's draws and two points' i-th
    calls draw alike; the drafter's seed is put back afterwards, and the output stays exact."""
    from tiny_models import get_model, ragged_prompts

    import specdec.experiments.e2e as e2e
    from specdec.drafters import OracleDrafter

    model = get_model("qwen3_5")
    ids, mask = ragged_prompts()
    enc = {"input_ids": ids, "attention_mask": mask}
    plain = e2e.plain_reference(model, enc, 12, 0, "cpu", hf=False)
    drafter = OracleDrafter(plain.plain_out, mask, acceptance=0.6, seed=5)
    seeds = []
    real_start = OracleDrafter.start

    def start(self, **kw):
        seeds.append(self.seed)
        return real_start(self, **kw)

    monkeypatch.setattr(OracleDrafter, "start", start)
    for K in (2, 3):
        rec = e2e.speculative_point(model, enc, drafter=drafter, strategy="replay", K=K, max_new=12, pad=0,
                                    device="cpu", dtype=torch.float32, plain=plain, reference=plain.plain_out,
                                    repeats=3, warmup=True, check_state=False)
        assert rec["exact"]
    assert seeds == [5, 5, 6, 7] * 2 and drafter.seed == 5


def test_terminal_table_leaves_out_columns_rather_than_cut_numbers(capsys):
    """A table wider than the terminal's 100 columns even without spreads shows the first metric
    columns whole and names the ones left out (summary.md has them), instead of cutting every
    number short ("1452…")."""
    from specdec.experiments.report import _print_rows

    metrics = [f"metric number {j}" for j in range(13)] + ["exact"]
    rows = [((f"row{i}",), [f"{1000.5 + j:.1f} (999.1-1002.3)" for j in range(13)] + ["yes"],
             [f"{1000.5 + j:.1f}" for j in range(13)] + ["yes"]) for i in range(3)]
    shown = _print_rows("wide", ["key"], metrics, rows)
    out = capsys.readouterr().out
    assert "…" not in out and "1000.5" in out
    assert "(not shown at this width, in summary.md: " in out and "metric number 12" in out.splitlines()[-1]
    assert shown[-1] == "exact" and "metric number 12" not in shown and shown[0] == "metric number 0"


def test_cpu_note_names_the_noise_column_only_where_the_table_has_it():
    from specdec.experiments.report import COLUMNS, CPU_NOTE, NOISE_NOTE, cpu_note

    with_noise = [c for c in COLUMNS if c.key == "within_noise"]
    assert with_noise and cpu_note(with_noise) == CPU_NOTE + NOISE_NOTE
    assert cpu_note([c for c in COLUMNS if c.key != "within_noise"]) == CPU_NOTE


def test_file_errors_say_what_is_wrong_once(tmp_path: Path):
    """A prompts file line that is not JSON names the file, line and position once (the parser's
    message is not repeated); a file that is not UTF-8 text names the file."""
    from specdec.experiments.prompts import load_prompt_file

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "a\x01b"}\n')
    with pytest.raises(ValueError) as info:
        load_prompt_file(bad)
    text = one_line(info.value)
    assert "line 2: not valid JSON" in text and text.count("Invalid control character") == 1, text
    assert "(Invalid control character at column 14)" in text and "line 1" not in text, text  # (the file's line, not the parser's)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"prompt": "ok"}\n' * 300 + b"\xff\xfe{}\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(binary))}, line 301: not UTF-8 text"):
        load_prompt_file(binary)


def test_a_missing_draft_folder_says_it_is_the_draft():
    import torch
    from omegaconf import OmegaConf

    from specdec.experiments.models import load_draft

    spec = OmegaConf.create({"name": "/nonexistent/target", "source": "hf", "draft": "/nonexistent/draft"})
    with pytest.raises(ValueError, match=r"the draft model of '/nonexistent/target' \(model.targets.N.draft\): "
                                         r"model '/nonexistent/draft': no such folder"):
        load_draft(spec, torch.device("cpu"), torch.float32)


def test_out_of_memory_is_one_line_with_what_to_do(tmp_path: Path, capsys):
    """An allocation the machine cannot make is a user's error: one line, status 2, with the
    smaller models named; a run folder holding only empty files is removed."""
    from specdec.experiments import app

    err = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 60129542144 bytes. Error code 12 (Cannot allocate memory)")
    assert app._user_error(err) and not app._user_error(RuntimeError("something else"))
    out = tmp_path / "run"
    (out / ".hydra").mkdir(parents=True)
    (out / "results.jsonl").write_text("")
    with pytest.raises(SystemExit) as stop:
        app._exit(err, f" (nothing was written: {out} removed)" if app._drop_if_empty(out) else "")
    assert stop.value.code == 2 and not out.exists()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "can't allocate memory" in lines[0] and "model=nemotronh-tiny-shape" in lines[0]
    assert "nothing was written" in lines[0]
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "results.jsonl").write_text('{"a": 1}\n')
    assert not app._drop_if_empty(kept) and kept.exists()
    users = tmp_path / "users"  # hydra.run.dir pointed at a folder of the user's: its empty files stay
    (users / ".hydra").mkdir(parents=True)
    (users / ".gitkeep").write_text("")
    assert not app._drop_if_empty(users) and (users / ".gitkeep").exists()


def test_the_last_line_names_plots_only_where_the_run_wrote_some(tmp_path: Path):
    from specdec.experiments import app

    cfg = _cfg(["experiment=kernels"])
    assert app._results_line(cfg, tmp_path) == f"specdec-run: results in {tmp_path} (summary.md, results.jsonl)"
    (tmp_path / "a.png").write_bytes(b"png")
    assert app._results_line(cfg, tmp_path).endswith("(summary.md, results.jsonl, plots)")
