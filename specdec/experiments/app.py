"""``specdec-run`` / ``python -m specdec``: the Hydra app for every experiment.

``experiment=`` picks what runs (``acceptance`` by default; ``train_zoo`` trains the zoo);
``model=``, ``drafter=``, ``rollback=`` narrow the grid; outputs go to Hydra's run folder.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

PACKAGE_DIR = Path(__file__).resolve().parents[1]
_ROOT_CONF = PACKAGE_DIR.parent / "conf"
CONF_DIR = str(_ROOT_CONF if _ROOT_CONF.is_dir() else PACKAGE_DIR / "conf")

EXPERIMENTS = ("acceptance", "train_zoo")


def run_experiment(cfg: DictConfig, out_dir: Path):
    """Dispatch on ``cfg.experiment.name``. Raises ValueError for an unknown experiment."""
    name = cfg.experiment.name if "experiment" in cfg and "name" in cfg.experiment else "train_zoo"
    if name == "acceptance":
        from .acceptance import run

        return run(cfg, out_dir)
    if name == "train_zoo":
        from .train_zoo import run

        return run(cfg)
    raise ValueError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_experiment(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
