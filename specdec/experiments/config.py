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
    "AcceptanceConfig", "RollbackExperimentConfig", "BenchConfig", "TrainZooConfig", "TrainMedusaConfig",
    "TrainMtpConfig", "KernelsConfig",
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
    medusa = "medusa"  # Medusa heads (chain), for targets with model.targets[*].medusa
    mtp = "mtp"  # the target's own MTP layers (checkpoint mtp.*), for targets with model.targets[*].mtp


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
    """One target model. ``draft``: the draft model's name (same source) for ``drafter=draft_model``;
    ``medusa``: the zoo name of its Medusa heads (``specdec.zoo.load_medusa``) for ``drafter=medusa``.

    ``source: random_shape`` builds ``model_class(config_class(**config))`` with random weights;
    the zoo tokenizer encodes the prompts (its ids fit any larger vocabulary)."""

    name: str = MISSING
    source: Source = Source.zoo
    draft: Optional[str] = None
    medusa: Optional[str] = None
    mtp: bool = False  # its checkpoint ships MTP layers (drafter=mtp)
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
    # Medusa draft tree: null = chain drafting; a preset ("default", "medusa-63") or a list of paths
    # in Medusa's format, e.g. [[0],[0,0],[1]] (specdec.tree.make_tree)
    tree: Any = None


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


class SSMOpName(StrEnum):
    mamba2 = "mamba2"
    gdn = "gdn"
    kda = "kda"


class ShapePreset(StrEnum):
    bench = "bench"  # the ops' layer shapes in 4B hybrids (specdec.experiments.kernel_table.SHAPES)
    tiny = "tiny"  # CPU smoke tests


@dataclass
class KernelsExperiment:
    name: str = "kernels"
    ops: List[SSMOpName] = field(default_factory=lambda: [SSMOpName.mamba2, SSMOpName.gdn, SSMOpName.kda])
    shapes: ShapePreset = ShapePreset.bench
    batch_grid: List[int] = field(default_factory=lambda: [1, 8, 64, 256])
    k_grid: List[int] = field(default_factory=lambda: [1, 4, 8])
    rounds: int = 16  # steps per CUDA graph
    reps: int = 10  # graph replays per point (median)
    accept_p: float = 0.7  # per-draft acceptance of the committed counts
    memory_budget_gib: float = 40.0  # SSM state budget for the largest admitted batch
    check: bool = True  # every strategy against the fp32 reference first
    fla: bool = True  # time flash-linear-attention's fused recurrent GDN when importable (CUDA)
    launch_from: Optional[str] = None  # a benchmarks/sweep_rollback_configs.py JSON: its fastest launches


@dataclass
class TrainZooExperiment:
    name: str = "train_zoo"


@dataclass
class TrainMedusaExperiment:
    name: str = "train_medusa"


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
class KernelsConfig(BaseConfig):
    experiment: KernelsExperiment = field(default_factory=KernelsExperiment)


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


class LabelSource(StrEnum):
    corpus = "corpus"  # head k at t learns the corpus token t+2+k
    target = "target"  # self-distillation: the target's greedy token t+2+k after the corpus prefix


@dataclass
class MedusaCorpusConfig:
    stdlib: Optional[str] = None
    exclude_dirs: List[str] = field(default_factory=lambda: ["site-packages", "__pycache__", "test", "tests", "idle_test"])
    max_file_bytes: int = 262144
    heldout_mod: int = 10


@dataclass
class MedusaDataConfig:
    tokens: int = 300_000  # training tokens whose hidden states are computed (once)
    seq_len: int = 512
    batch_windows: int = 8  # windows per target forward
    pool_factor: float = 4.0  # windows are drawn from this many times more packed tokens


@dataclass
class MedusaHeadsConfig:
    num_heads: int = 4
    num_layers: int = 2
    shared_lm_head: bool = True
    vocab_bias: bool = True
    lm_head_rank: int = 0
    storage_dtype: DType = DType.float32


@dataclass
class MedusaTrainConfig:
    labels: LabelSource = LabelSource.target
    steps: int = 360
    batch_positions: int = 1024
    lr: float = 1.0e-2
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 20
    time_budget_s: Optional[float] = None


@dataclass
class TrainMedusaConfig(BaseConfig):
    """The Medusa recipe's keys (specdec.experiments.train_medusa)."""

    experiment: TrainMedusaExperiment = field(default_factory=TrainMedusaExperiment)
    name: str = "gdn-medusa"
    target: str = "gdn-target"
    out_dir: Optional[str] = None
    corpus: MedusaCorpusConfig = field(default_factory=MedusaCorpusConfig)
    data: MedusaDataConfig = field(default_factory=MedusaDataConfig)
    heads: MedusaHeadsConfig = field(default_factory=MedusaHeadsConfig)
    train: MedusaTrainConfig = field(default_factory=MedusaTrainConfig)


@dataclass
class TrainMtpExperiment:
    name: str = "train_mtp"


@dataclass
class MtpLayersConfig:
    num_layers: int = 1  # mtp_num_hidden_layers / num_nextn_predict_layers
    # per target: config fields the MTP layers are built with, as a checkpoint of the family sets them
    config: Dict[str, Any] = field(default_factory=dict)
    init_from_target: bool = True  # start each MTP layer from the target's last layer of its kind (when shapes fit)
    storage_dtype: DType = DType.bfloat16


@dataclass
class MtpTrainConfig(MedusaTrainConfig):
    chain_steps: int = 3  # drafting steps trained (1 = predict token t+2 only)
    soft_labels: bool = False  # with labels=target: the target's distributions, not only its greedy tokens
    batch_windows: int = 4
    steps: int = 400
    batch_positions: int = 1024  # per drafting step
    lr: float = 3.0e-3


@dataclass
class TrainMtpConfig(BaseConfig):
    """The MTP recipe's keys (specdec.experiments.train_mtp)."""

    experiment: TrainMtpExperiment = field(default_factory=TrainMtpExperiment)
    target: str = "gdn-target"
    out_dir: Optional[str] = None
    corpus: MedusaCorpusConfig = field(default_factory=MedusaCorpusConfig)
    data: MedusaDataConfig = field(default_factory=MedusaDataConfig)
    mtp: MtpLayersConfig = field(default_factory=MtpLayersConfig)
    train: MtpTrainConfig = field(default_factory=MtpTrainConfig)


#: experiment name -> root schema
SCHEMAS = {
    "acceptance": AcceptanceConfig,
    "rollback": RollbackExperimentConfig,
    "bench": BenchConfig,
    "kernels": KernelsConfig,
    "train_zoo": TrainZooConfig,
    "train_medusa": TrainMedusaConfig,
    "train_mtp": TrainMtpConfig,
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
