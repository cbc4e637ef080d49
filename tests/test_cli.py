"""The specdec-run command line: --help (fast: no torch, no transformers), key checks with the
nearest valid key, the internal schema group refused, the run folder and thread count printed,
quiet model loading, one-line errors for HF targets without a usable tokenizer or Hub."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.experiments.cli import UsageError, check_overrides, group_options, help_text

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          **kw)


def test_help_lists_groups_and_keys_without_heavy_imports():
    code = ("import sys; from specdec.experiments.cli import main; main(['--help']); "
            "heavy = [m for m in ('torch', 'transformers', 'hydra') if m in sys.modules]; "
            "print('HEAVY', heavy)")
    res = _run(["-c", code])
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.rstrip().endswith("HEAVY []")  # answered before torch / transformers / Hydra load
    for group in ("experiment=", "model=", "drafter=", "rollback="):
        assert f"  {group}" in out
    for option in ("acceptance", "rollback", "bench", "gdn-target", "hf", "draft_model", "medusa", "replay_deferred"):
        assert f"    {option} " in out, option
    for key in ("num_speculative_tokens", "max_new_tokens", "prompts.path", "repeats", "cpu_threads",
                "experiment.timed_prompts"):
        assert f"  {key} " in out, key
    assert "schema" not in out
    assert max(len(line) for line in out.splitlines()[:-1]) <= 100


def test_help_of_another_experiment_lists_its_keys():
    text = help_text("rollback")
    assert "experiment.memory_budget_gib" in text and "experiment.k_grid" in text
    assert "experiment.timed_prompts" not in text
    assert "max_new_tokens " in text and "[32]" in text.split("max_new_tokens", 1)[1].splitlines()[0]  # rollback.yaml


@pytest.mark.parametrize("recipe, keys", [
    ("train_mtp", ("out_dir", "target", "data.tokens", "train.steps", "train.chain_steps", "mtp.num_layers")),
    ("train_medusa", ("out_dir", "name", "target", "data.tokens", "train.steps", "heads.num_heads")),
    ("train_zoo", ("out_dir", "steps_scale")),
])
def test_help_of_a_recipe_lists_its_keys(recipe, keys):
    """A recipe's help names its own keys (out_dir above all: unset, it writes over the shipped zoo)."""
    text = help_text(recipe)
    for key in keys:
        assert f"\n  {key} " in text, key
    entry = re.search(r"\n  out_dir .*?(?=\n  \S)", text, re.S).group(0)
    assert "over the shipped zoo" in " ".join(entry.split())
    for key in ("num_speculative_tokens", "prompts.limit", "drafter.tree"):  # nothing a recipe reads
        assert f"\n  {key} " not in text, key
    assert "is a training recipe: it writes models and MANIFEST.json into <out_dir>/zoo/" in " ".join(text.split())
    assert "\n  drafter=" not in text and "\n  experiment=" in text


def test_version_names_specdec_and_its_hydra():
    """``--version`` prints specdec's version (and the Hydra that runs it), not only Hydra's,
    before any heavy import."""
    import specdec

    code = ("import sys; from specdec.experiments.cli import main; main(['--version']); "
            "print('HEAVY', [m for m in ('torch', 'transformers', 'hydra') if m in sys.modules])")
    res = _run(["-c", code])
    assert res.returncode == 0, res.stderr
    first, heavy = res.stdout.strip().splitlines()
    assert re.fullmatch(rf"specdec-run {re.escape(specdec.__version__)} \(Hydra [\d.]+\)", first) and heavy == "HEAVY []"


def test_python_m_specdec_help_exits_0():
    res = _run(["-m", "specdec", "--help"])
    assert res.returncode == 0 and res.stdout.startswith("usage: specdec-run") and not res.stderr


@pytest.mark.parametrize("args, message", [
    (["drafterr=ngram"], "unknown key 'drafterr' (did you mean 'drafter'?)"),
    (["prompts.limt=2"], "unknown key 'prompts.limt' (did you mean 'prompts.limit'?)"),
    (["num_speculative_token=2"], "did you mean 'num_speculative_tokens'?"),
    (["experiment=rollback", "experiment.kernel_stepz=3"], "did you mean 'experiment.kernel_steps'?"),
    (["experiment.kernel_steps=3"], "'experiment.kernel_steps' is a key of experiment=rollback, not of "
                                    "experiment=acceptance; use experiment=rollback"),  # a rollback key under acceptance
    (["experiment.requests=8"], "'experiment.requests' is a key of experiment=serve, not of experiment=acceptance"),
    (["experiment=serve", "experiment.bogus=1"], "unknown key 'experiment.bogus'; `specdec-run --help`"),
    (["experiment=serve", "experiment.reqests=1"], "(did you mean 'experiment.requests'?)"),
    (["experiment=train_mtp", "train.stpes=3"], "unknown key 'train.stpes' (did you mean 'train.steps'?)"),
    (["rollback=snapshott"], "rollback=snapshott: no such option (did you mean 'snapshot'?)"),
    (["-m", "rollback=ring,undo"], "rollback=undo: no such option"),
    (["experiment=acceptence"], "unknown experiment 'acceptence' (did you mean 'acceptance'?)"),
    (["schema=bench"], "'schema' is internal"),
    (["schema@_global_=bench"], "'schema' is internal"),
    (["num_speculative_tokens=auto"], "num_speculative_tokens=auto: experiment=acceptance takes an int K; auto (K "
                                      "chosen per step) is taken by experiment=bench"),
    (["-m", "experiment=bench,rollback", "num_speculative_tokens=auto"], "experiment=rollback takes an int K"),
])
def test_bad_keys_name_the_nearest_valid_one(args, message):
    with pytest.raises(UsageError) as info:
        check_overrides(args)
    text = str(info.value)
    assert message in text and "\n" not in text and "+" not in text, text


@pytest.mark.parametrize("args", [
    ["model=hf", "model.targets.0.name=/x", "model.targets.0.tokenizer=/y"],
    ["model.targets.0.config.hidden_size=64", "drafter.ngram.max_ngram=4", "drafter.tree=[[0],[0,0]]"],
    ["experiment=rollback", "experiment.batch_grid=[1,2]", "repeats=5", "hydra.run.dir=/tmp/x"],
    ["-m", "rollback=snapshot,ring", "num_speculative_tokens=0,2", "--cfg", "job"],
    ["experiment=bench", "num_speculative_tokens=auto"],
    ["experiment=train_zoo", "steps_scale=0.01", "models.gdn-target.train.steps=3"],
    ["+extra=1", "~seed", "prompts.path=p.jsonl"],
])
def test_valid_overrides_pass(args):
    check_overrides(args)


def test_group_options_come_from_conf():
    assert set(group_options("rollback")) == {"all", "compare", "snapshot", "ring", "replay", "replay_deferred", "auto"}
    assert all(group_options("model").values())  # every option has a one-line description


def test_a_run_prints_its_folder_and_threads_quietly(tmp_path: Path):
    out = tmp_path / "run"
    res = _run(["-m", "specdec", "model=gdn-target", "drafter=ngram", "rollback=replay", "prompts.limit=1",
                "max_new_tokens=4", "repeats=1", "device=cpu", "progress=false", f"hydra.run.dir={out}"])
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0] == f"specdec-run: experiment=acceptance, writing to {out}"
    assert lines[-1] == f"specdec-run: results in {out} (summary.md, results.jsonl, plots)"
    assert any(ln.startswith("specdec-run: CPU threads: 1 (OMP_NUM_THREADS") for ln in lines)  # set by _run
    assert "falling back to its reference PyTorch implementation" not in res.stdout + res.stderr
    assert "Loading weights" not in res.stdout + res.stderr
    assert max(len(ln) for ln in lines if not ln.startswith("specdec-run:")) <= 100  # tables and legend
    assert (out / "summary.md").is_file() and not (out / "app.log").exists()


@pytest.mark.parametrize("reason", ["is not installed", "is either not installed or doesn't support the device of "
                                              "the inputs"])
def test_cpu_drops_the_fallback_note_in_every_wording(reason):
    """transformers 5.17 and 5.25 word the note differently; both are dropped on a CPU, for GPU-only
    packages only, and only inside the block."""
    import logging

    from specdec.quiet import FALLBACK_LOGGER, quiet_transformers

    logger, seen = logging.getLogger(FALLBACK_LOGGER), []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def note(pkg):
        return f"`f` is falling back to its reference PyTorch implementation because `{pkg}` {reason}."

    handler = Keep()
    logger.addHandler(handler)
    try:
        with quiet_transformers("cpu"):
            logger.warning(note("flash-linear-attention"))
            logger.warning(note("some_cpu_package"))
        logger.warning(note("mamba_ssm"))
    finally:
        logger.removeHandler(handler)
    assert seen == [note("some_cpu_package"), note("mamba_ssm")]


def test_a_refused_run_leaves_no_empty_folder(tmp_path: Path):
    out = tmp_path / "run"
    res = _run(["-m", "specdec", "model=gdn-target", "drafter=ngram", "num_speculative_tokens=-1", "device=cpu",
                "progress=false", f"hydra.run.dir={out}"])
    assert res.returncode == 2
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "num_speculative_tokens" in err[0] and "nothing was written" in err[0], res.stderr
    assert not out.exists()


# ------------------------------------------------------------------------------ HF targets


@pytest.fixture(scope="module")
def folder_without_tokenizer(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_model

    path = tmp_path_factory.mktemp("hf_no_tokenizer")
    make_model("qwen3_5", vocab=8192).save_pretrained(path)  # the zoo tokenizer's vocabulary
    return path


def test_hf_target_without_tokenizer_is_one_clear_error(folder_without_tokenizer, tmp_path: Path):
    """A ValueError on one line (in-process: specdec-run prints such an error as its one line with exit
    status 2, as test_a_refused_run_leaves_no_empty_folder checks through a subprocess)."""
    from specdec.experiments.app import one_line, run_experiment
    from test_experiments import _cfg

    cfg = _cfg(["model=hf", f"model.targets.0.name={folder_without_tokenizer}", "drafter=ngram", "device=cpu"])
    with pytest.raises(ValueError) as info:
        run_experiment(cfg, tmp_path)
    err = one_line(info.value)
    assert "\n" not in err and "tokenizer encodes text to no tokens" in err, err
    assert "model.targets.0.tokenizer=" in err


def test_hf_target_with_a_tokenizer_from_elsewhere_runs(folder_without_tokenizer, tmp_path: Path):
    """model.targets.0.tokenizer: the zoo tokenizer for a tiny model of a larger vocabulary."""
    import specdec.zoo
    from specdec.experiments.app import run_experiment
    from test_experiments import _cfg

    cfg = _cfg(["model=hf", f"model.targets.0.name={folder_without_tokenizer}",
                f"model.targets.0.tokenizer={specdec.zoo.path('tokenizer')}", "drafter=ngram", "rollback=replay",
                "prompts.limit=1", "max_new_tokens=4", "repeats=1", "device=cpu", "progress=false"])
    records = run_experiment(cfg, tmp_path)
    assert len(records) == 1 and records[0]["exact"]


def test_an_hf_draft_folder_reads_the_targets_tokenizer(folder_without_tokenizer, tmp_path: Path):
    """A draft checkpoint saved without tokenizer files (weights and config only, as drafts often
    are) runs with the target's tokenizer: the draft proposes ids of the target's vocabulary."""
    import specdec.zoo
    from specdec.experiments.app import run_experiment
    from test_experiments import _cfg

    cfg = _cfg(["model=hf", f"model.targets.0.name={folder_without_tokenizer}",
                f"model.targets.0.tokenizer={specdec.zoo.path('tokenizer')}",
                f"model.targets.0.draft={folder_without_tokenizer}", "drafter=draft_model", "rollback=replay",
                "prompts.limit=1", "max_new_tokens=4", "repeats=1", "device=cpu", "progress=false"])
    records = run_experiment(cfg, tmp_path)
    assert len(records) == 1 and records[0]["exact"] and records[0]["drafter"] == "draft_model"


def test_unreachable_hub_id_fails_fast_in_one_line(monkeypatch):
    import time

    import torch
    from huggingface_hub import constants
    from omegaconf import OmegaConf

    from specdec.experiments.models import load_hf

    spec = OmegaConf.create({"name": "no-such-org/no-such-model-x7", "source": "hf"})
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as info:  # no network here: cannot reach; with network: no such model
        load_hf(spec, torch.device("cpu"), torch.float32)
    assert time.perf_counter() - t0 < 30
    assert "\n" not in str(info.value) and ("cannot reach the Hugging Face Hub" in str(info.value)
                                            or "neither a local folder nor a model" in str(info.value))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set: pass a local folder"):
        load_hf(spec, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="no such folder"):
        load_hf(OmegaConf.create({"name": "./missing/model", "source": "hf"}), torch.device("cpu"), torch.float32)


def test_a_target_index_past_the_models_targets_is_one_clear_error():
    """model.targets.N past the chosen model config's targets (an explicit model=, else the
    experiment's default model) is refused before Hydra runs, naming how many there are."""
    with pytest.raises(UsageError, match=r"model.targets.5.name: no target 5 \(model=hf has 1 \(model.targets.0\)\)"):
        check_overrides(["model=hf", "model.targets.5.name=x"])
    with pytest.raises(UsageError, match=r"model=zoo has 3 \(model.targets.0 to 2\)"):
        check_overrides(["model.targets.3.draft=null"])  # the default experiment's model: the zoo
    with pytest.raises(UsageError, match=r"model=gdn-target has 1"):
        check_overrides(["experiment=bench", "model.targets.1.name=x"])  # bench's default model
    check_overrides(["model.targets.2.draft=null"])  # the zoo's third target: fine
    check_overrides(["model=zoo,hf", "model.targets.2.draft=null"])  # a sweep where one model has it


def test_help_lists_the_keys_of_a_target():
    """--help lists model.targets.N's keys (the unknown-key error sends users there), not for a recipe."""
    text = help_text()
    for key in ("name", "draft", "tokenizer", "mtp", "device_map", "max_memory"):
        assert f"  model.targets.0.{key} " in text
    assert "model.targets.0." not in help_text("train_zoo")
    assert max(len(ln) for ln in text.splitlines()) <= 100
