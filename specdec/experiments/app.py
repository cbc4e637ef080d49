"""``specdec-run`` / ``python -m specdec``: the Hydra app for every experiment.

``experiment=`` picks what runs: ``acceptance`` (default), ``rollback`` (the rollback-strategy
comparison), ``bench`` (end-to-end speed), ``kernels`` (the per-layer kernel table),
``train_zoo`` (the zoo recipe), ``train_medusa`` (the Medusa heads recipe) or ``train_mtp`` (the
MTP layers recipe); ``model=``, ``drafter=``, ``rollback=`` narrow the grid; outputs go to Hydra's
run folder. Every key is checked against the experiment's structured config
(:mod:`specdec.experiments.config`).

Errors a user can fix (a bad override, a wrong value, an unsupported model) end the run with
one line on stderr, ``specdec-run: <what is wrong>``, and exit status 2; set
``HYDRA_FULL_ERROR=1`` for the traceback. Under ``accelerate launch`` / ``torchrun`` the
acceptance experiment splits its prompts across the processes (:mod:`.distributed`).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from . import config as _config  # noqa: F401  (registers the structured configs)
from .config import SCHEMAS, schema_keys

PACKAGE_DIR = Path(__file__).resolve().parents[1]
_ROOT_CONF = PACKAGE_DIR.parent / "conf"
CONF_DIR = str(_ROOT_CONF if _ROOT_CONF.is_dir() else PACKAGE_DIR / "conf")

EXPERIMENTS = tuple(SCHEMAS)
MAX_SPECULATIVE_TOKENS = 64


def validate(cfg: DictConfig) -> None:
    """Checks the schema cannot express; raises ValueError saying what is wrong."""
    name = str(cfg.experiment.name)
    if name not in SCHEMAS:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}")
    unknown = sorted(set(cfg.keys()) - schema_keys(name) - {"hydra"})
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown} for experiment={name}")
    if name in ("train_zoo", "train_medusa", "train_mtp"):
        return
    if name == "kernels":
        _validate_kernels(cfg.experiment)
        return
    if not 1 <= int(cfg.num_speculative_tokens) <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {cfg.num_speculative_tokens}")
    if int(cfg.max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.prompts.limit is not None and int(cfg.prompts.limit) < 1:
        raise ValueError(f"prompts.limit must be >= 1 or null (all), got {cfg.prompts.limit}")
    from ..zoo import PROMPT_SETS

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
        if isinstance(tree, str) and tree not in ("default", "medusa-63", "mc_sim_7b_63"):
            raise ValueError(f"drafter.tree={tree!r}: use default, medusa-63 or a list of paths such as [[0],[0,0],[1]]")
    if cfg.get("cpu_threads") is not None and int(cfg.cpu_threads) < 1:
        raise ValueError(f"cpu_threads must be >= 1 or null, got {cfg.cpu_threads}")
    if name in ("rollback", "bench"):
        exp = cfg.experiment
        if len(cfg.drafter.names) != 1:
            raise ValueError(f"experiment={name} uses one drafter; got {list(map(str, cfg.drafter.names))} "
                             "(use drafter=ngram or drafter=draft_model)")
        if str(cfg.drafter.names[0]) in ("medusa", "mtp"):
            raise ValueError(f"experiment={name} supports drafter=ngram or drafter=draft_model; Medusa heads and MTP "
                             "layers run in experiment=acceptance")
        if not exp.batch_grid or any(int(b) < 1 for b in exp.batch_grid):
            raise ValueError(f"experiment.batch_grid must list batch sizes >= 1, got {list(exp.batch_grid)}")
        if name == "bench" and int(exp.repeats) < 1:
            raise ValueError(f"experiment.repeats must be >= 1, got {exp.repeats}")
    if name == "rollback":
        exp = cfg.experiment
        if not exp.k_grid or any(not 1 <= int(k) <= MAX_SPECULATIVE_TOKENS for k in exp.k_grid):
            raise ValueError(f"experiment.k_grid must list K in [1, {MAX_SPECULATIVE_TOKENS}], got {list(exp.k_grid)}")
        if int(exp.kernel_steps) < 1 or int(exp.kernel_warmup) < 0:
            raise ValueError("experiment.kernel_steps must be >= 1 and experiment.kernel_warmup >= 0")
        if not 0.0 <= float(exp.kernel_accept_p) <= 1.0:
            raise ValueError(f"experiment.kernel_accept_p must be in [0, 1], got {exp.kernel_accept_p}")
        if float(exp.memory_budget_gib) <= 0:
            raise ValueError(f"experiment.memory_budget_gib must be > 0, got {exp.memory_budget_gib}")


def _validate_kernels(exp) -> None:
    """The kernel table's grid and settings."""
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

    Raises: ValueError for an invalid configuration (see :func:`validate`).
    """
    validate(cfg)
    name = str(cfg.experiment.name)
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
            with open_dict(cfg):
                cfg.experiment.k_grid = [int(cfg.num_speculative_tokens)]
        return run(cfg, out_dir)
    if name == "bench":
        from .bench import run

        return run(cfg, out_dir)
    if name == "kernels":
        from .kernel_table import run

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
    try:
        run_experiment(cfg, Path(hc.runtime.output_dir), tuple(hc.overrides.task))
    except Exception as err:  # noqa: BLE001 - exits here so Hydra adds no "Error executing job" line
        if "HYDRA_FULL_ERROR" in os.environ and not _ours() or not _user_error(err):
            raise
        _exit(err)


_NOISE = re.compile(r"^(full_key:|object_type=|reference_type=|Set the environment variable HYDRA_FULL_ERROR)")
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
        e = e.__cause__ or e.__context__
    return ": ".join(parts) if parts else type(err).__name__


def _user_error(err: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(err, (ValueError, HydraException, OmegaConfBaseException, FileNotFoundError))


_OURS = "_SPECDEC_SET_HYDRA_FULL_ERROR"


def _ours() -> bool:
    return os.environ.get(_OURS) == "1"


def _exit(err: BaseException):
    print(f"specdec-run: {one_line(err)}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    """Console entry point: the Hydra app, with one-line errors for what a user can fix."""
    own = "HYDRA_FULL_ERROR" in os.environ and not _ours()
    if not own:  # Hydra then re-raises composition errors instead of printing them; we print one line
        os.environ["HYDRA_FULL_ERROR"] = "1"
        os.environ[_OURS] = "1"
    try:
        hydra_main()
    except Exception as err:  # noqa: BLE001
        if own or not _user_error(err):
            raise
        _exit(err)
    finally:
        if not own:
            os.environ.pop("HYDRA_FULL_ERROR", None)
            os.environ.pop(_OURS, None)


if __name__ == "__main__":
    main()
