"""Structured configs (dataclasses) for ``specdec-run``, registered with Hydra's ConfigStore.

Each experiment has a root schema (``schema/<experiment>``) that ``conf/config.yaml`` merges
first (``- schema@_global_: ${experiment}``), so every YAML file and every command-line
override is checked against it when Hydra composes the config: an unknown key, a value of the
wrong type (``num_speculative_tokens=abc``) or a value outside a choice (``device=tpu``,
``rollback=undo``) fails at start with a message, before any model is loaded.

Choices are :class:`enum.StrEnum` members: they compare equal to, print as and serialise to
their plain string values, so ``cfg.device == "cpu"`` and ``json.dumps`` work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

__all__ = [
    "Device", "DType", "Strategy", "DrafterName", "Source", "RecommendBy",
    "TargetConfig", "ModelConfig", "DrafterConfig", "RollbackConfig", "PromptsConfig",
    "AcceptanceConfig", "RollbackExperimentConfig", "BenchConfig", "TrainZooConfig",
    "SCHEMAS", "register_configs", "schema_keys",
]


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Strategy(StrEnum):
    snapshot = "snapshot"
    ring = "ring"
    replay = "replay"
    replay_deferred = "replay_deferred"


class DrafterName(StrEnum):
    ngram = "ngram"
    draft_model = "draft_model"


class Source(StrEnum):
    zoo = "zoo"  # specdec.zoo.load(name)
    hf = "hf"  # AutoModelForCausalLM.from_pretrained(name): a hub id or a local folder
    random_shape = "random_shape"  # transformers config class + random init (benchmark shapes)


class RecommendBy(StrEnum):
    kernel = "kernel"  # SSM time per step from the kernel-level timing (all SSM layers)
    end_to_end = "end_to_end"  # verify + commit time per step of the real generate() runs


# ------------------------------------------------------------------------------- groups


@dataclass
class TargetConfig:
    """One target model. ``draft``: the draft model's name (same source) for ``drafter=draft_model``.

    ``source: random_shape`` builds ``model_class(config_class(**config))`` with random weights;
    the zoo tokenizer encodes the prompts (its ids fit any larger vocabulary)."""

    name: str = MISSING
    source: Source = Source.zoo
    draft: Optional[str] = None
    model_class: Optional[str] = None
    config_class: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    targets: List[TargetConfig] = field(default_factory=list)


@dataclass
class NGramConfig:
    min_ngram: int = 1
    max_ngram: int = 3


@dataclass
class DrafterConfig:
    names: List[DrafterName] = field(default_factory=lambda: [DrafterName.ngram])
    ngram: NGramConfig = field(default_factory=NGramConfig)
    draft_rollback: Strategy = Strategy.snapshot  # rollback of a hybrid draft model's own SSM state


@dataclass
class RollbackConfig:
    strategies: List[Strategy] = field(default_factory=lambda: [Strategy.snapshot, Strategy.ring, Strategy.replay])


@dataclass
class PromptsConfig:
    set: str = "128"  # "128" | "1k" | "4k" | "all"
    limit: Optional[int] = 8  # prompts per set (null = all)


# --------------------------------------------------------------------------- experiments


@dataclass
class AcceptanceExperiment:
    name: str = "acceptance"
    warmup: bool = True  # one untimed generate per configuration first


@dataclass
class RollbackExperiment:
    name: str = "rollback"
    batch_grid: List[int] = field(default_factory=lambda: [1, 4])
    k_grid: List[int] = field(default_factory=lambda: [2, 4])  # num_speculative_tokens=K narrows it to [K]
    end_to_end: bool = True  # real generate() runs: verify/commit time, speedup, exactness
    kernel_level: bool = True  # per-layer strategy verify/commit/fold on synthetic inputs
    kernel_steps: int = 16  # timed steps per grid point (after kernel_warmup)
    kernel_warmup: int = 2
    kernel_accept_p: float = 0.7  # per-draft acceptance of the synthetic accepted counts
    memory_budget_gib: float = 40.0  # SSM state budget for the largest admitted batch
    recommend_by: RecommendBy = RecommendBy.kernel
    warmup: bool = True  # one untimed generate per grid point first


@dataclass
class BenchExperiment:
    name: str = "bench"
    batch_grid: List[int] = field(default_factory=lambda: [1, 4])
    repeats: int = 1  # timed runs per point (median)
    warmup: bool = True


@dataclass
class TrainZooExperiment:
    name: str = "train_zoo"


# ------------------------------------------------------------------------------ roots


@dataclass
class BaseConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    num_speculative_tokens: int = 4
    max_new_tokens: int = 64
    seed: int = 0
    device: Device = Device.auto
    dtype: DType = DType.auto
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    progress: bool = True
    cpu_threads: Optional[int] = 1  # torch intra-op threads on CPU (null: torch's default)


@dataclass
class AcceptanceConfig(BaseConfig):
    experiment: AcceptanceExperiment = field(default_factory=AcceptanceExperiment)


@dataclass
class RollbackExperimentConfig(BaseConfig):
    experiment: RollbackExperiment = field(default_factory=RollbackExperiment)


@dataclass
class BenchConfig(BaseConfig):
    experiment: BenchExperiment = field(default_factory=BenchExperiment)


@dataclass
class ZooPromptsConfig(PromptsConfig):
    continuation_tokens: int = 256
    min_fill: float = 0.75
    sets: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainZooConfig(BaseConfig):
    """The zoo recipe's keys (specdec.experiments.train_zoo reads them at the top level)."""

    experiment: TrainZooExperiment = field(default_factory=TrainZooExperiment)
    prompts: ZooPromptsConfig = field(default_factory=ZooPromptsConfig)
    steps_scale: float = 1.0
    batch_scale: float = 1.0
    corpus_scale: float = 1.0
    out_dir: Optional[str] = None
    work_dir: Optional[str] = None
    log_dir: Optional[str] = None
    parallel: Any = "auto"  # auto | true | false
    threads_per_worker: int = 4
    reuse_tokenizer: bool = False
    models_to_train: List[str] = field(default_factory=list)
    corpus: Dict[str, Any] = field(default_factory=dict)
    tokenizer: Dict[str, Any] = field(default_factory=dict)
    heldout: Dict[str, Any] = field(default_factory=dict)
    train: Dict[str, Any] = field(default_factory=dict)
    models: Dict[str, Any] = field(default_factory=dict)


#: experiment name -> root schema
SCHEMAS = {
    "acceptance": AcceptanceConfig,
    "rollback": RollbackExperimentConfig,
    "bench": BenchConfig,
    "train_zoo": TrainZooConfig,
}


def schema_keys(experiment: str) -> set[str]:
    """Top-level keys the schema of ``experiment`` allows."""
    return {f.name for f in fields(SCHEMAS[experiment])}


def register_configs() -> None:
    """Store every root schema as ``schema/<experiment>`` (idempotent)."""
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(group="schema", name=name, node=node)


register_configs()
