"""``specdec-run`` / ``python -m specdec``: the Hydra app for every experiment.

``experiment=`` picks what runs: ``acceptance`` (default), ``rollback`` (the rollback-strategy
comparison), ``bench`` (end-to-end decode speed; ``long_run`` its 2,048-token preset),
``adaptive`` (``num_speculative_tokens=auto``, ``rollback=auto`` against every fixed choice),
``serve`` (continuous batching of a mixed-length workload against fixed batches and plain decoding),
``kernels`` (the per-layer kernel table), ``tree_verify`` (tree vs chain verify cost),
``ngram_proposal`` (n-gram search timing), ``prefill`` (prefill time per Mamba-2 scan),
``skinny_linear`` (the skinny linear kernel vs cuBLAS on the bench models' weight shapes),
``checks`` (the GPU checks), ``train_zoo`` (the zoo recipe), ``train_medusa`` (the Medusa heads
recipe) or ``train_mtp`` (the MTP layers recipe);
every one runs as ``specdec-run experiment=<name>`` (or ``python -m specdec
experiment=<name>``); ``model=``, ``drafter=``, ``rollback=`` narrow the grid; outputs go to
Hydra's run folder. Every key is checked against the experiment's structured config
(:mod:`specdec.experiments.config`).

The command line (``specdec-run``, :mod:`.cli`) answers ``--help`` and checks the keys before
Hydra starts. Errors a user can fix (a bad override, a wrong value, an unsupported model) end the run with
one line on stderr, ``specdec-run: <what is wrong>``, and exit status 2; set
``HYDRA_FULL_ERROR=1`` for the traceback. Under ``accelerate launch`` / ``torchrun`` the
acceptance experiment splits its prompts across the processes (:mod:`.distributed`).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from .config import CONF_DIR, RECIPES, SCHEMAS, recipe_out_root, register_configs, schema_keys

EXPERIMENTS = tuple(SCHEMAS)
register_configs()  # schema/<experiment> in Hydra's ConfigStore, which conf/config.yaml merges first


def validate(cfg: DictConfig) -> None:
    """Checks the schema cannot express; raises ValueError saying what is wrong."""
    name = str(cfg.experiment.name)
    if name not in SCHEMAS:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}")
    unknown = sorted(set(cfg.keys()) - schema_keys(name) - {"hydra"})
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(schema_keys(name)), n=1)
        raise ValueError(f"unknown top-level key(s) {unknown} for experiment={name}"
                         + (f" (did you mean '{near[0]}'?)" if near else ""))
    if name in RECIPES:
        return
    if name == "kernels":
        _validate_kernels(cfg.experiment)
        return
    if name == "ngram_proposal":
        _validate_ngram_proposal(cfg)
        return
    if name == "skinny_linear":
        from .skinny_linear import validate as validate_skinny_linear

        validate_skinny_linear(cfg)
        return
    from specdec.engine import MAX_SPECULATIVE_TOKENS
    from specdec.rollback import STRATEGIES
    from specdec.tree import TREE_PRESETS

    K = cfg.num_speculative_tokens
    if K != "auto" and (isinstance(K, str) or isinstance(K, bool) or not isinstance(K, int)):
        raise ValueError(f"num_speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}] or auto, got {K!r}")
    if K != "auto" and not 0 <= int(K) <= MAX_SPECULATIVE_TOKENS:
        also = (f", or auto (K chosen per step) in experiment={'/'.join(AUTO_EXPERIMENTS)}"
                if name in AUTO_EXPERIMENTS else "")
        raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0 = plain decoding)"
                         f"{also}, got {K}")
    if int(cfg.repeats) < 1:
        raise ValueError(f"repeats must be >= 1, got {cfg.repeats}")
    strategies = STRATEGIES + ("replay_deferred",)
    auto = ("auto",) if name in AUTO_EXPERIMENTS else ()
    for s, allowed in [(str(s), strategies + auto) for s in cfg.rollback.strategies] + [
            (str(cfg.drafter.draft_rollback), strategies)]:
        if s == "auto" and s not in allowed:
            raise ValueError("rollback=auto (chosen per call from measured costs) runs in experiment="
                             f"{', '.join(AUTO_EXPERIMENTS)}, and not as drafter.draft_rollback")
        if s not in allowed:
            raise ValueError(f"unknown rollback strategy {s!r}; use one of {', '.join(allowed)}")
    if int(cfg.max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.prompts.limit is not None and int(cfg.prompts.limit) < 1:
        raise ValueError(f"prompts.limit must be >= 1 or null (all), got {cfg.prompts.limit}")
    from ..zoo import PROMPT_SETS

    if cfg.prompts.get("path") is not None and name != "acceptance":
        raise ValueError(f"prompts.path is read by experiment=acceptance; experiment={name} runs on the shipped "
                         "prompt sets (prompts.set)")
    if str(cfg.prompts.set) not in PROMPT_SETS + ("all", "1024", "4096"):
        raise ValueError(f"prompts.set must be one of {', '.join(PROMPT_SETS + ('all',))}; got {cfg.prompts.set!r}")
    if not cfg.model.targets:
        raise ValueError("model.targets is empty: pick a model, e.g. model=gdn-target")
    from omegaconf import OmegaConf

    for i, t in enumerate(cfg.model.targets):
        if OmegaConf.is_missing(t, "name"):
            raise ValueError(f"model.targets.{i}.name is not set: model=hf needs model.targets.{i}.name=<hub id or "
                             "local folder>")
    if not cfg.rollback.strategies:
        raise ValueError("rollback.strategies is empty")
    if not cfg.drafter.names:
        raise ValueError("drafter.names is empty")
    tree = cfg.drafter.get("tree")
    if tree is not None:
        if "medusa" not in [str(d) for d in cfg.drafter.names]:
            raise ValueError("drafter.tree is the Medusa draft tree; it needs drafter=medusa (or drafter.names with medusa)")
        if isinstance(tree, str) and tree not in TREE_PRESETS:
            raise ValueError(f"drafter.tree={tree!r}: use one of {', '.join(TREE_PRESETS)} or a list of paths such as "
                             "[[0],[0,0],[1]]")
    vocab = cfg.drafter.get("mtp_draft_vocab")
    if vocab is not None:
        if "mtp" not in [str(d) for d in cfg.drafter.names]:
            raise ValueError("drafter.mtp_draft_vocab is the MTP drafter's draft vocabulary; it needs drafter=mtp (or "
                             "drafter.names with mtp)")
        if int(vocab) < 1:
            raise ValueError(f"drafter.mtp_draft_vocab must be >= 1 (tokens drafted over) or null (all), got {vocab}")
    if cfg.drafter.get("mtp_compile") and "mtp" not in [str(d) for d in cfg.drafter.names]:
        raise ValueError("drafter.mtp_compile compiles the MTP drafter's proposals; it needs drafter=mtp (or "
                         "drafter.names with mtp)")
    if cfg.get("cpu_threads") is not None and int(cfg.cpu_threads) < 1:
        raise ValueError(f"cpu_threads must be >= 1 or null, got {cfg.cpu_threads}")
    drafters = [str(d) for d in cfg.drafter.names]
    if name in ("rollback", "bench", "long_run", "tree_verify", "checks", "adaptive"):
        _check_batches(cfg.experiment.batch_grid)
    if name in ("acceptance", "rollback") and "oracle" in drafters:
        raise ValueError(f"drafter=oracle proposes specdec plain's own output, for timing: it runs in experiment=bench, "
                         f"long_run and checks, not experiment={name}")
    if name == "rollback":
        if len(drafters) != 1:
            raise ValueError(f"experiment=rollback uses one drafter; got {drafters} (use drafter=ngram or "
                             "drafter=draft_model)")
        if drafters[0] in ("medusa", "mtp"):
            raise ValueError("experiment=rollback supports drafter=ngram or drafter=draft_model; Medusa heads and MTP "
                             "layers run in experiment=acceptance")
    if name in ("bench", "long_run"):
        _validate_bench(cfg, drafters)
    if name == "adaptive":
        _validate_adaptive(cfg, drafters)
    if name == "serve":
        _validate_serve(cfg, drafters)
    if name == "tree_verify":
        _validate_tree_verify(cfg)
    if name == "checks":
        _validate_checks(cfg)
    if name == "prefill":
        _validate_prefill(cfg.experiment)
    if name == "rollback":
        exp = cfg.experiment
        if not exp.k_grid or any(not 1 <= int(k) <= MAX_SPECULATIVE_TOKENS for k in exp.k_grid):
            raise ValueError(f"experiment.k_grid must list K in [1, {MAX_SPECULATIVE_TOKENS}] (the comparison needs "
                             f"drafts to roll back), got {list(exp.k_grid)}")
        if int(exp.kernel_steps) < 1 or int(exp.kernel_warmup) < 0:
            raise ValueError("experiment.kernel_steps must be >= 1 and experiment.kernel_warmup >= 0")
        if not 0.0 <= float(exp.kernel_accept_p) <= 1.0:
            raise ValueError(f"experiment.kernel_accept_p must be in [0, 1], got {exp.kernel_accept_p}")
        if exp.memory_budget_gib is not None and float(exp.memory_budget_gib) <= 0:
            raise ValueError(f"experiment.memory_budget_gib must be > 0, got {exp.memory_budget_gib}")
    if name == "acceptance":
        timed = cfg.experiment.timed_prompts
        if timed is not None and int(timed) < 1:
            raise ValueError(f"experiment.timed_prompts must be >= 1 or null (all), got {timed}")


#: the experiments whose runs take ``rollback=auto`` (and ``num_speculative_tokens=auto``: their schema allows it,
#: except ``adaptive``, which always compares auto with its K grid)
AUTO_EXPERIMENTS = ("bench", "long_run", "adaptive", "serve")


def _validate_adaptive(cfg, drafters: list[str]) -> None:
    """The comparison's drafter (the oracle), acceptances, K grid and fixed strategies."""
    from specdec.engine import MAX_SPECULATIVE_TOKENS

    exp = cfg.experiment
    if drafters != ["oracle"]:
        raise ValueError(f"experiment=adaptive runs the oracle drafter (known acceptance); got drafter.names="
                         f"{drafters}")
    rates = [float(a) for a in cfg.drafter.oracle_acceptance] + [float(a) for a in exp.acceptance_phases]
    if not cfg.drafter.oracle_acceptance and not exp.acceptance_phases:
        raise ValueError("experiment=adaptive needs a workload: drafter.oracle_acceptance or "
                         "experiment.acceptance_phases")
    if any(not 0.0 <= a <= 1.0 for a in rates):
        raise ValueError(f"drafter.oracle_acceptance and experiment.acceptance_phases must be in [0, 1], got {rates}")
    if not exp.k_grid or any(not 1 <= int(k) <= MAX_SPECULATIVE_TOKENS for k in exp.k_grid):
        raise ValueError(f"experiment.k_grid must list K in [1, {MAX_SPECULATIVE_TOKENS}] (auto chooses up to their "
                         f"maximum), got {list(exp.k_grid)}")
    if not [s for s in cfg.rollback.strategies if str(s) != "auto"]:
        raise ValueError("experiment=adaptive compares auto with fixed strategies: rollback.strategies must list at "
                         "least one of snapshot, ring, replay, replay_deferred")
    _check_positive(exp, "prompt_tokens")
    _check_decode_path(exp.decode_path)


def _validate_serve(cfg, drafters: list[str]) -> None:
    """The serving workload's sizes and lengths, its drafters and K."""
    from .serve import SERVE_DRAFTERS

    exp = cfg.experiment
    if any(d not in SERVE_DRAFTERS for d in drafters):
        raise ValueError(f"experiment=serve runs the drafters {', '.join(SERVE_DRAFTERS)}; got {drafters}")
    accs = [float(a) for a in cfg.drafter.oracle_acceptance]
    if "oracle" in drafters and (not accs or any(not 0.0 <= a <= 1.0 for a in accs)):
        raise ValueError(f"drafter.oracle_acceptance must list acceptances in [0, 1], got {accs}")
    if cfg.num_speculative_tokens != "auto" and int(cfg.num_speculative_tokens) < 1:
        raise ValueError("experiment=serve compares speculative runs with plain decoding (which it always runs): "
                         "num_speculative_tokens must be >= 1 or auto")
    rows = exp.max_batch_size
    if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"experiment.max_batch_size must be an int >= 1 or auto, got {rows!r}")
    if int(exp.requests) < 1 or int(exp.shared_prefix_tokens) < 0:
        raise ValueError(f"experiment.requests must be >= 1 and experiment.shared_prefix_tokens >= 0; got "
                         f"{exp.requests}, {exp.shared_prefix_tokens}")
    rate = exp.request_rate
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf):
        raise ValueError(f"experiment.request_rate must be a number of requests per second > 0, or null (every "
                         f"request at the start), got {rate!r}")
    if exp.memory_budget is not None:
        from ..batching import parse_bytes

        parse_bytes(str(exp.memory_budget))  # a bad string says what is accepted, before any work
    for key in ("prompt_tokens", "output_tokens"):
        pair = [int(v) for v in exp[key]]
        if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
            raise ValueError(f"experiment.{key} must be [min, max] with 1 <= min <= max, got {pair}")
    _check_decode_path(exp.decode_path)


def _check_batches(batch_grid) -> None:
    if not batch_grid or any(int(b) < 1 for b in batch_grid):
        raise ValueError(f"experiment.batch_grid must list batch sizes >= 1, got {list(batch_grid)}")


def _check_positive(exp, *keys: str) -> None:
    for key in keys:
        if exp[key] is not None and float(exp[key]) <= 0:
            raise ValueError(f"experiment.{key} must be > 0, got {exp[key]}")


def _check_decode_path(path) -> None:
    from specdec.engine import DECODE_PATHS

    if str(path) not in DECODE_PATHS:
        raise ValueError(f"experiment.decode_path must be one of {', '.join(DECODE_PATHS)}, got {path!r}")


def _validate_bench(cfg, drafters: list[str]) -> None:
    """The benchmark's drafters, oracle acceptances and lengths."""
    from .bench import BENCH_DRAFTERS

    if any(d not in BENCH_DRAFTERS for d in drafters):
        raise ValueError(f"experiment={cfg.experiment.name} runs the drafters {', '.join(BENCH_DRAFTERS)}; got "
                         f"{drafters} (Medusa heads run in experiment=acceptance)")
    accs = [float(a) for a in cfg.drafter.oracle_acceptance]
    if "oracle" in drafters and (not accs or any(not 0.0 <= a <= 1.0 for a in accs)):
        raise ValueError(f"drafter.oracle_acceptance must list acceptances in [0, 1], got {accs}")
    _check_positive(cfg.experiment, "prompt_tokens", "hf_max_new_tokens")
    _check_decode_path(cfg.experiment.decode_path)


def _validate_tree_verify(cfg) -> None:
    """The trees, the step counts and K (a chain of K + 1 tokens; trees of depth K)."""
    from specdec.tree import TREE_PRESETS

    from .tree_verify import CHAIN

    exp = cfg.experiment
    known = (CHAIN,) + TREE_PRESETS
    bad = [str(t) for t in exp.trees if str(t) not in known]
    if not exp.trees or bad:
        raise ValueError(f"experiment.trees must list {', '.join(known)}; got {list(map(str, exp.trees))}")
    if not exp.kernels:
        raise ValueError("experiment.kernels is empty: list default, torch or loop")
    if int(cfg.num_speculative_tokens) < 1:
        raise ValueError("experiment=tree_verify needs num_speculative_tokens >= 1 (the depth of the chain and trees)")
    if int(exp.steps) < 1 or int(exp.warmup) < 0:
        raise ValueError(f"experiment.steps must be >= 1 and experiment.warmup >= 0, got {exp.steps}, {exp.warmup}")
    _check_positive(exp, "prompt_tokens", "max_seconds")


def _validate_checks(cfg) -> None:
    """The checks' acceptance, lengths, budget and decode path."""
    exp = cfg.experiment
    if not 0.0 <= float(exp.acceptance) <= 1.0:
        raise ValueError(f"experiment.acceptance must be in [0, 1], got {exp.acceptance}")
    if int(cfg.num_speculative_tokens) < 1:
        raise ValueError("experiment=checks needs num_speculative_tokens >= 1 (the checks roll drafts back)")
    short = [int(n) for n in exp.transfer_new_tokens]
    if len(short) != 2 or not 1 <= short[0] < short[1]:
        raise ValueError(f"experiment.transfer_new_tokens must be [short, long] with 1 <= short < long, got {short}")
    _check_decode_path(exp.decode_path)
    if not exp.checks:
        raise ValueError("experiment.checks is empty")
    _check_positive(exp, "prompt_tokens", "memory_budget_gib", "context_tokens", "max_dtoh_per_step")


def _validate_prefill(exp) -> None:
    """The prefill grid, scans and warm-up runs."""
    from specdec.kernels.mamba2.chunked import SCANS

    if not exp.grid or any(len(p) != 2 or int(p[0]) < 1 or int(p[1]) < 1 for p in exp.grid):
        raise ValueError("experiment.grid must list [batch, prompt tokens] pairs of ints >= 1, e.g. "
                         f"[[64,128],[1,4096]]; got {[list(p) for p in exp.grid]}")
    bad = [str(s) for s in exp.scans if str(s) not in SCANS]
    if not exp.scans or bad:
        raise ValueError(f"experiment.scans must list scans of {', '.join(SCANS)}; got {[str(s) for s in exp.scans]}")
    if int(exp.warmup) < 0:
        raise ValueError(f"experiment.warmup must be >= 0, got {exp.warmup}")


def _validate_ngram_proposal(cfg) -> None:
    """The n-gram grid (no model: the common checks do not apply)."""
    from specdec.engine import MAX_SPECULATIVE_TOKENS

    exp = cfg.experiment
    _check_batches(exp.batch_grid)
    if not exp.widths or any(int(w) < 2 for w in exp.widths):
        raise ValueError(f"experiment.widths must list text widths >= 2, got {list(exp.widths)}")
    if not 1 <= int(cfg.num_speculative_tokens) <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] (drafts to propose), got "
                         f"{cfg.num_speculative_tokens}")
    if int(exp.vocab_size) < 2 or int(exp.warmup) < 0 or int(cfg.repeats) < 1:
        raise ValueError("experiment.vocab_size must be >= 2, experiment.warmup >= 0 and repeats >= 1")
    lo, hi = int(cfg.drafter.ngram.min_ngram), int(cfg.drafter.ngram.max_ngram)
    if not 1 <= lo <= hi:
        raise ValueError(f"drafter.ngram needs 1 <= min_ngram <= max_ngram, got {lo}, {hi}")


def _validate_kernels(exp) -> None:
    """The kernel table's grid and settings."""
    from specdec.engine import MAX_SPECULATIVE_TOKENS

    if not exp.ops:
        raise ValueError("experiment.ops is empty: list SSM ops, e.g. [mamba2, gdn, kda]")
    if not exp.batch_grid or any(int(b) < 1 for b in exp.batch_grid):
        raise ValueError(f"experiment.batch_grid must list batch sizes >= 1, got {list(exp.batch_grid)}")
    if not exp.k_grid or any(not 1 <= int(k) <= MAX_SPECULATIVE_TOKENS for k in exp.k_grid):
        raise ValueError(f"experiment.k_grid must list K in [1, {MAX_SPECULATIVE_TOKENS}], got {list(exp.k_grid)}")
    if int(exp.rounds) < 1 or int(exp.reps) < 1:
        raise ValueError(f"experiment.rounds and experiment.reps must be >= 1, got {exp.rounds}, {exp.reps}")
    if not 0.0 <= float(exp.accept_p) <= 1.0:
        raise ValueError(f"experiment.accept_p must be in [0, 1], got {exp.accept_p}")
    if float(exp.memory_budget_gib) <= 0:
        raise ValueError(f"experiment.memory_budget_gib must be > 0, got {exp.memory_budget_gib}")


def run_experiment(cfg: DictConfig, out_dir: Path, overrides: tuple[str, ...] = ()):
    """Validate ``cfg`` and run its experiment, writing into ``out_dir``; returns its records
    (the zoo manifest for train_zoo, the manifest entry for train_medusa and train_mtp).

    ``overrides``: the command line's overrides; for ``experiment=rollback`` an explicit
    ``num_speculative_tokens=K`` (without ``experiment.k_grid=``) narrows the K grid to [K].
    On CPU, transformers' notes about GPU-only kernel packages and its loading bars are off
    (:func:`specdec.quiet.quiet_transformers`).

    Raises: ValueError for an invalid configuration (see :func:`validate`).
    """
    validate(cfg)
    name = str(cfg.experiment.name)
    if name in RECIPES:
        return _dispatch(name, cfg, out_dir, overrides)
    from ..quiet import quiet_transformers
    from .models import resolve_device

    with quiet_transformers(resolve_device(cfg)[0]):
        return _dispatch(name, cfg, out_dir, overrides)


def _dispatch(name: str, cfg: DictConfig, out_dir: Path, overrides: tuple[str, ...]):
    """Run experiment ``name`` (validated) into ``out_dir``."""
    if name == "acceptance":
        from .acceptance import run
        from .distributed import Processes, world_size

        if world_size() > 1:
            with Processes(str(cfg.device)) as procs:
                return run(cfg, out_dir, records_sink=procs.gather, split=procs.split, show_progress=procs.is_main)
        return run(cfg, out_dir)
    if name == "rollback":
        from omegaconf import open_dict

        from .rollback_compare import run

        names = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
        if "num_speculative_tokens" in names and "experiment.k_grid" not in names:
            if int(cfg.num_speculative_tokens) == 0:
                raise ValueError("experiment=rollback compares rollback strategies, which need drafts to roll back: "
                                 "num_speculative_tokens must be >= 1 here (0, plain decoding, runs in "
                                 "experiment=acceptance and experiment=bench)")
            with open_dict(cfg):
                cfg.experiment.k_grid = [int(cfg.num_speculative_tokens)]
        return run(cfg, out_dir)
    if name in ("bench", "long_run"):
        from .bench import run

        return run(cfg, out_dir)
    if name == "adaptive":
        from .adaptive import run

        return run(cfg, out_dir)
    if name == "serve":
        from .serve import run

        return run(cfg, out_dir)
    if name == "kernels":
        from .kernel_table import run

        return run(cfg, out_dir)
    if name == "tree_verify":
        from .tree_verify import run

        return run(cfg, out_dir)
    if name == "ngram_proposal":
        from .ngram_proposal import run

        return run(cfg, out_dir)
    if name == "prefill":
        from .prefill import run

        return run(cfg, out_dir)
    if name == "checks":
        from .checks import run

        return run(cfg, out_dir)
    if name == "skinny_linear":
        from .skinny_linear import run

        return run(cfg, out_dir)
    if name == "train_medusa":
        from .train_medusa import run

        return run(cfg)
    if name == "train_mtp":
        from .train_mtp import run

        return run(cfg)
    from .train_zoo import run

    return run(cfg)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    print(f"specdec-run: experiment={cfg.experiment.name}, writing to {out_dir}", flush=True)
    try:
        run_experiment(cfg, out_dir, tuple(hc.overrides.task))
        print(_results_line(cfg, out_dir), flush=True)
    except Exception as err:  # noqa: BLE001 - exits here so Hydra adds no "Error executing job" line
        if "HYDRA_FULL_ERROR" in os.environ and not _ours() or not _user_error(err):
            raise
        _exit(err, f" (nothing was written: {out_dir} removed)" if _drop_if_empty(out_dir) else "")


def _results_line(cfg: DictConfig, out_dir: Path) -> str:
    """The run's last line: where its results are (a recipe writes models and a manifest into
    ``out_dir``'s ``zoo/``, or the installed package's when ``out_dir`` is unset; an experiment
    writes its tables and plots into the run folder)."""
    if str(cfg.experiment.name) in RECIPES:
        zoo_dir = recipe_out_root(cfg) / "zoo"
        return f"specdec-run: trained; models and manifest in {zoo_dir} (MANIFEST.json)"
    plots = ", plots" if any(Path(out_dir).glob("*.png")) else ""
    return f"specdec-run: results in {out_dir} (summary.md, results.jsonl{plots})"


#: the files a run writes into its folder first (empty until it measures something)
RUN_FILES = ("results.jsonl", "summary.md")


def _drop_if_empty(out_dir: Path) -> bool:
    """Remove a run folder that holds nothing but Hydra's own files (``.hydra/``, logs) and an empty
    ``results.jsonl`` or ``summary.md`` (opened before the run failed), so a run refused before it
    measured anything leaves no empty folder behind; True when removed."""
    if out_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log"
                                or (p.name in RUN_FILES and p.is_file() and p.stat().st_size == 0)
                                for p in out_dir.iterdir()):
        shutil.rmtree(out_dir, ignore_errors=True)
        return True
    return False


_NOISE = re.compile(r"^(full_key:|object_type=|reference_type=|Set the environment variable HYDRA_FULL_ERROR"
                    r"|To append to your config use \+)")  # specdec-run --help lists the keys instead
_END = re.compile(r"^Config search path")


def one_line(err: BaseException) -> str:
    """The messages of ``err`` and its causes on one line, without OmegaConf's key/type trailers."""
    parts: list[str] = []
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        lines = [ln.strip() for ln in str(e).splitlines()]
        cut = next((i for i, ln in enumerate(lines) if _END.match(ln)), len(lines))
        lines = [ln for ln in lines[:cut] if ln and not _NOISE.match(ln)]
        text, listing = (lines[0] if lines else ""), False
        for ln in lines[1:]:  # "Available options in 'rollback':" then one option per line
            if text.endswith(":"):
                text, listing = f"{text} {ln}", True
            elif listing and " " not in ln:
                text += f", {ln}"
            else:
                text, listing = f"{text.rstrip('.')}. {ln}", False
        if text and not re.search(r"\$[A-Z_]+", text) and not any(text in p for p in parts):
            parts.append(text)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)  # ("raise ... from None": not shown)
    return ": ".join(parts) if parts else type(err).__name__


def _user_error(err: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (isinstance(err, (ValueError, HydraException, OmegaConfBaseException, FileNotFoundError))
            or _out_of_memory(err))


def _out_of_memory(err: BaseException) -> bool:
    """A device or host allocation that failed (a model, batch or grid too large for the machine)."""
    import torch

    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError)
                                                       and "can't allocate memory" in str(err))


#: what an out-of-memory error's line adds
OUT_OF_MEMORY_HINT = ("; the run needs more memory than the device has: choose a smaller model (on a CPU the bench "
                      "shapes' tiny configs, model=qwen35-tiny-shape or model=nemotronh-tiny-shape), batch or grid")


_OURS = "_SPECDEC_SET_HYDRA_FULL_ERROR"


def _ours() -> bool:
    return os.environ.get(_OURS) == "1"


def _exit(err: BaseException, note: str = ""):
    hint = OUT_OF_MEMORY_HINT if _out_of_memory(err) else ""
    print(f"specdec-run: {one_line(err)}{hint}{note}", file=sys.stderr)
    sys.exit(2)


def run_app(args: list[str]) -> None:
    """The Hydra app over ``args`` (the command line without the program name), with one-line
    errors for what a user can fix (exit status 2). :func:`specdec.experiments.cli.main` checks
    ``--help`` and the keys first."""
    own = "HYDRA_FULL_ERROR" in os.environ and not _ours()
    if not own:  # Hydra then re-raises composition errors instead of printing them; we print one line
        os.environ["HYDRA_FULL_ERROR"] = "1"
        os.environ[_OURS] = "1"
    argv = sys.argv
    sys.argv = [argv[0] if argv else "specdec-run"] + list(args)
    try:
        hydra_main()
    except Exception as err:  # noqa: BLE001
        if own or not _user_error(err):
            raise
        _exit(err)
    finally:
        sys.argv = argv
        if not own:
            os.environ.pop("HYDRA_FULL_ERROR", None)
            os.environ.pop(_OURS, None)
