"""Structured configs (dataclasses) for ``specdec-run``, registered with Hydra's ConfigStore by
:func:`register_configs` (which :mod:`.app` calls on import; this module imports no Hydra, so
``specdec-run --help`` reads the field docs without it).

Each experiment has a root schema (``schema/<experiment>``) that ``conf/config.yaml`` merges
first (``- schema@_global_: ${experiment}``), so every YAML file and every command-line
override is checked against it when Hydra composes the config: an unknown key, a value of the
wrong type (``num_speculative_tokens=abc``) or a value outside a choice (``device=tpu``)
fails at start with a message, before any model is loaded. ``schema`` is internal: users pick
``experiment=``, which picks the schema.

Every user-facing field carries a one-line ``help`` in its metadata (:func:`field_help`):
``specdec-run --help`` prints them. Choices are :class:`enum.StrEnum` members: they compare
equal to, print as and serialise to their plain string values, so ``cfg.device == "cpu"`` and
``json.dumps`` work unchanged. Rollback strategy names are checked against
``specdec.rollback`` when the run starts (``app.validate``), not copied here, as is
``num_speculative_tokens=auto``, which the benchmark's schema types ``Any`` for it (every other
experiment keeps an ``int``: ``num_speculative_tokens=abc`` fails when Hydra composes).
"""

from __future__ import annotations

from dataclasses import MISSING as _NO_DEFAULT
from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

__all__ = [
    "Device", "DType", "DrafterName", "Source", "RecommendBy",
    "TargetConfig", "ModelConfig", "DrafterConfig", "RollbackConfig", "PromptsConfig",
    "AcceptanceConfig", "RollbackExperimentConfig", "BenchConfig", "AdaptiveConfig", "ServeConfig", "TrainZooConfig",
    "TrainMedusaConfig", "TrainMtpConfig",
    "KernelsConfig", "TreeVerifyConfig", "NgramProposalConfig", "PrefillConfig", "ChecksConfig", "SkinnyLinearConfig",
    "SCHEMAS", "RECIPES", "recipe_out_root", "GROUPS", "CONF_DIR", "register_configs", "schema_keys", "field_help",
]

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_ROOT_CONF = _PACKAGE_DIR.parent / "conf"
#: the Hydra config folder: ``conf/`` of the checkout (or the one installed inside the package)
CONF_DIR = str(_ROOT_CONF if _ROOT_CONF.is_dir() else _PACKAGE_DIR / "conf")


def _doc(default=_NO_DEFAULT, help: str = "", *, factory=None):
    """A dataclass field with a one-line ``help`` (what ``specdec-run --help`` prints)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class DrafterName(StrEnum):
    """The drafter names of the CLI; ``specdec.drafters.make_drafter`` builds ``ngram`` from the
    name alone, the others from an object (``DraftModelDrafter(model)``, ``MedusaDrafter(heads)``)."""

    ngram = "ngram"
    draft_model = "draft_model"
    medusa = "medusa"  # Medusa heads (chain), for targets with model.targets[*].medusa
    mtp = "mtp"  # the target's own MTP layers (checkpoint mtp.*), for targets with model.targets[*].mtp
    oracle = "oracle"  # OracleDrafter: specdec plain's own output, corrupted at rate 1 - acceptance (timing only)


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

    name: str = _doc(MISSING, "zoo name, hub id or local folder of the target")
    source: Source = _doc(Source.zoo, "zoo | hf | random_shape")
    draft: Optional[str] = _doc(None, "the draft model (same source) for drafter=draft_model")
    medusa: Optional[str] = _doc(None, "zoo name of the target's Medusa heads for drafter=medusa")
    mtp: bool = _doc(False, "its checkpoint ships MTP layers (mtp.*) for drafter=mtp")
    tokenizer: Optional[str] = _doc(None, "source hf: a hub id or folder to take the tokenizer from (default: name)")
    device_map: Optional[Any] = _doc(None, "source hf: accelerate's device_map for from_pretrained (auto, balanced, "
                                           "balanced_low_0, sequential, or {module: device}); null: all on the "
                                           "run's device")
    max_memory: Optional[Any] = _doc(None, "source hf, with device_map: the most memory per device, e.g. "
                                                      "{0: 70GiB, cpu: 200GiB} (GPU index, cpu or disk)")
    offload_folder: Optional[str] = _doc(None, "source hf, with device_map: where weights mapped to disk go "
                                               "(default: a folder in the run's temporary directory)")
    model_class: Optional[str] = None
    config_class: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)
    layers: Optional[int] = _doc(None, "source random_shape: keep the first N layers of its pattern (null: all)")
    damp: Optional[float] = _doc(None, "source random_shape: scale of every block's output projection (wide greedy "
                                       "margins in bf16; null: transformers' init)")


@dataclass
class ModelConfig:
    targets: List[TargetConfig] = _doc(help="the target models (model=<option> fills it)", factory=list)


@dataclass
class NGramConfig:
    min_ngram: int = _doc(1, "shortest n-gram the prompt-lookup drafter matches")
    max_ngram: int = _doc(3, "longest n-gram the prompt-lookup drafter matches")


@dataclass
class DrafterConfig:
    names: List[DrafterName] = _doc(help="drafters to run (drafter=<option> fills it)",
                                    factory=lambda: [DrafterName.ngram])
    ngram: NGramConfig = field(default_factory=NGramConfig)
    draft_rollback: str = _doc("snapshot", "rollback strategy of a hybrid draft model's own SSM state")
    tree: Any = _doc(None, "Medusa draft tree: null (chain), default, medusa-63 or a list of paths [[0],[0,0],[1]]")
    oracle_acceptance: List[float] = _doc(help="drafter oracle: per-token acceptance, one run each (bench)",
                                          factory=lambda: [0.8])
    mtp_draft_vocab: Optional[int] = _doc(None, "drafter mtp: draft over the N most frequent tokens of the zoo's "
                                                "training corpus (null: the whole vocabulary)")
    mtp_compile: bool = _doc(False, "drafter mtp: torch.compile each captured proposal whole (CUDA-graph path; "
                                    "about a minute of compiling per shape)")


@dataclass
class RollbackConfig:
    strategies: List[str] = _doc(help="rollback strategies to run (rollback=<option> fills it)",
                                 factory=lambda: ["snapshot", "ring", "replay"])


@dataclass
class PromptsConfig:
    set: str = _doc("128", "shipped prompt set: 128 | 1k | 4k | all")
    limit: Optional[int] = _doc(8, "prompts per set (null = all)")
    path: Optional[str] = _doc(None, "your own prompts: a .jsonl file, one {\"prompt\": text} or "
                                     "{\"input_ids\": [...]} per line (acceptance only; replaces prompts.set)")


# --------------------------------------------------------------------------- experiments


@dataclass
class AcceptanceExperiment:
    name: str = "acceptance"
    warmup: bool = _doc(True, "one untimed generate per configuration first")
    timed_prompts: Optional[int] = _doc(1, "prompts the speed columns are timed on, from the start of the set "
                                           "(null = all)")


@dataclass
class RollbackExperiment:
    name: str = "rollback"
    batch_grid: List[int] = _doc(help="batch sizes", factory=lambda: [1, 4])
    k_grid: List[int] = _doc(help="K values (num_speculative_tokens=K on the command line narrows it to [K])",
                             factory=lambda: [2, 4])
    end_to_end: bool = _doc(True, "real generate() runs: verify/commit time, speedup, exactness")
    kernel_level: bool = _doc(True, "per-layer strategy verify/commit/fold on synthetic inputs at the model's shape")
    kernel_steps: int = _doc(16, "timed steps per kernel-level run (after kernel_warmup)")
    kernel_warmup: int = _doc(2, "untimed steps first")
    kernel_accept_p: float = _doc(0.7, "per-draft acceptance of the kernel level's synthetic accepted counts")
    memory_budget_gib: Optional[float] = _doc(None, "SSM-state memory budget in GiB for the 'max batch in budget' "
                                                    "column (null: this device's memory)")
    recommend_by: RecommendBy = _doc(RecommendBy.kernel, "kernel | end_to_end: the time the recommendation ranks by")
    warmup: bool = _doc(True, "one untimed generate per grid point first")


@dataclass
class BenchExperiment:
    name: str = "bench"
    batch_grid: List[int] = _doc(help="batch sizes", factory=lambda: [1, 4])
    warmup: bool = _doc(True, "one untimed generate of the same shape per point first (compiles, captures)")
    prompt_tokens: Optional[int] = _doc(None, "prompts of this many random token ids per row (speed does not depend "
                                              "on the text); null: the prompt set")
    hf: bool = _doc(True, "time HF generate() on the same batch too")
    hf_max_new_tokens: Optional[int] = _doc(None, "new tokens of the HF runs (null: max_new_tokens)")
    ignore_eos: bool = _doc(False, "clear the target's EOS token: every row runs max_new_tokens")
    profile: bool = _doc(False, "one more generate() per point under torch.profiler (profile.md)")
    profile_rows: int = _doc(15, "entries (>= 1) of each profile.md table, most GPU time first (on a CPU: host time)")
    decode_path: str = _doc("auto", "auto (CUDA graphs on CUDA) | eager | static | cuda_graph")
    overlap: List[bool] = _doc(help="per point, the next proposal made before the step's sync (true) and/or after "
                                    "it (false: SPECDEC_OVERLAP=0), timed side by side", factory=lambda: [True])
    plain_switches: List[str] = _doc(help="environment settings (NAME=VALUE, several joined by ',') under which "
                                          "specdec's plain decoding is timed too, round by round with the "
                                          "default's, e.g. \"experiment.plain_switches="
                                          "['SPECDEC_SKINNY_LINEARS=0']\"", factory=list)


@dataclass
class AdaptiveExperiment:
    name: str = "adaptive"
    batch_grid: List[int] = _doc(help="batch sizes", factory=lambda: [1, 4])
    k_grid: List[int] = _doc(help="the fixed K values auto is compared with (auto's largest K: their maximum)",
                             factory=lambda: [1, 2, 4, 8])
    acceptance_phases: List[float] = _doc(help="the changing workload: the oracle's acceptance over equal shares of "
                                               "max_new_tokens ([]: none)", factory=lambda: [0.9, 0.1])
    warmup: bool = _doc(True, "one untimed generate per cell first (compiles, captures, measures auto's costs)")
    prompt_tokens: Optional[int] = _doc(None, "prompts of this many random token ids per row; null: the prompt set")
    ignore_eos: bool = _doc(True, "clear the target's EOS token: every row runs max_new_tokens")
    decode_path: str = _doc("auto", "auto (CUDA graphs on CUDA) | eager | static | cuda_graph")


class PromptSource(StrEnum):
    zoo = "zoo"  # the zoo's held-out code prompts, cut to the drawn lengths
    random = "random"  # random token ids (speed does not depend on the text)


@dataclass
class ServeExperiment:
    name: str = "serve"
    requests: int = _doc(8, "requests in the workload (with requests_file: its first N lines)")
    max_batch_size: Any = _doc(4, "B: the continuous pool's rows, and the size of each fixed batch; or auto: the rows "
                                  "generate_batch sizes from memory_budget per strategy (fixed batches of the rows "
                                  "the same drafter and strategy's continuous run chose)")
    memory_budget: Optional[str] = _doc(None, "generate_batch's memory_budget, e.g. 40GiB (null: free device memory)")
    prompt_tokens: List[int] = _doc(help="[min, max] prompt tokens per request, drawn log-uniform",
                                    factory=lambda: [64, 2048])
    output_tokens: List[int] = _doc(help="[min, max] max_new_tokens per request, drawn log-uniform",
                                    factory=lambda: [32, 512])
    prompt_source: PromptSource = _doc(PromptSource.zoo, "zoo (the shipped code prompts, cut to length) | random "
                                                         "(token ids)")
    requests_file: Optional[str] = _doc(None, "your own workload: a .jsonl file, one {\"prompt_ids\": [...]} or "
                                              "{\"prompt\": text} per line, optionally with \"max_new_tokens\" "
                                              "(else drawn)")
    shared_prefix_tokens: int = _doc(0, "one prefix of this many tokens before every request's prompt (0: none)")
    prefix_caching: bool = _doc(False, "also run every continuous run with generate_batch(prefix_caching=True), side by side")
    prefix_block_size: int = _doc(64, "generate_batch's prefix_block_size with prefix_caching (tokens per cached block)")
    max_batch_tokens: int = _doc(16384, "generate_batch's max_batch_tokens: the most prompt tokens of one prefill "
                                        "forward, padding included")
    fixed_batches: bool = _doc(True, "also run generate() on fixed batches of max_batch_size requests, in order")
    request_rate: Optional[float] = _doc(None, "requests per second arriving at Poisson times (seeded; the first at "
                                               "0), each continuous run served by init_continuous_batching and TTFT "
                                               "measured from each request's arrival; null: every request at the start")
    warmup: bool = _doc(True, "one short untimed call per configuration first (compiles the kernels)")
    rehearse: bool = _doc(False, "untimed passes over the whole workload per continuous run first, again while a "
                                 "pass met a prompt-forward bucket it left uncaptured, at most serve.MAX_REHEARSALS "
                                 "(a server in its steady state: the buckets the workload meets are captured)")
    manager_warmup: bool = _doc(False, "with request_rate: each pass's manager runs manager.warmup() before start(), "
                                       "untimed (the grid of prompt buckets; with prefix_caching also the workload's "
                                       "first prompts, as a server warms with its system prompt)")
    ignore_eos: bool = _doc(True, "clear the target's EOS token: every request runs its own max_new_tokens")
    decode_path: str = _doc("auto", "auto (CUDA graphs on CUDA) | eager | static | cuda_graph")


class TreeKernels(StrEnum):
    default = "default"  # the device's backend (Triton on CUDA)
    torch = "torch"  # the torch reference ops
    loop = "loop"  # Triton, every tree walking its nodes in the runtime loop


class DecodePath(StrEnum):
    eager = "eager"
    static = "static"
    cuda_graph = "cuda_graph"


@dataclass
class TreeVerifyExperiment:
    name: str = "tree_verify"
    trees: List[str] = _doc(help="chain or a specdec.tree preset (default: 16 nodes, medusa-63: 64 nodes at K=4)",
                            factory=lambda: ["chain", "default"])
    kernels: List[TreeKernels] = _doc(help="default (Triton on CUDA) | torch (reference ops, CUDA only) | loop "
                                           "(runtime node loop)",
                                      factory=lambda: [TreeKernels.default, TreeKernels.torch])
    batch_grid: List[int] = _doc(help="batch sizes", factory=lambda: [1, 16])
    decode_path: DecodePath = _doc(DecodePath.eager, "eager | static | cuda_graph: the decoder the step runs on")
    steps: int = _doc(8, "timed steps per configuration")
    warmup: int = _doc(2, "untimed steps first")
    prompt_tokens: int = _doc(128, "random prompt tokens prefilled before the steps")
    max_seconds: Optional[float] = _doc(50.0, "skip the remaining configurations after this wall time (null: none)")
    profile: bool = _doc(False, "one more verify per configuration under torch.profiler (profile.md)")


@dataclass
class NgramProposalExperiment:
    name: str = "ngram_proposal"
    batch_grid: List[int] = _doc(help="batch sizes", factory=lambda: [1, 16, 64])
    widths: List[int] = _doc(help="text widths W (row lengths in [W/2, W])", factory=lambda: [256, 1024, 4096])
    vocab_size: int = _doc(64, "vocabulary of the random texts (small: most rows find a match)")
    warmup: int = _doc(3, "untimed rounds first")
    plain_step_ms: Optional[float] = _doc(None, "a plain decode step's median ms of the model the drafter serves "
                                                "(e.g. checks' step_cost plain_step_ms): the proposal is also "
                                                "reported as a fraction of it (null: not)")
    graph_calls: int = _doc(50, "Triton backend: the kernel's calls captured back to back in one CUDA graph "
                                "(kernel_in_graph_ms: device time per call)")


@dataclass
class PrefillExperiment:
    name: str = "prefill"
    grid: List[List[int]] = _doc(help="[batch, prompt tokens] pairs", factory=lambda: [[64, 128], [1, 4096], [1, 128]])
    scans: List[str] = _doc(help="Mamba-2 prompt scans: auto (fla for bf16 / fp16 on CUDA when installed, else torch) "
                                 "| fla | torch | hf (transformers' own mixer forward)",
                            factory=lambda: ["auto", "torch", "hf"])
    prompt_paths: List[str] = _doc(help="how prompt forwards run: eager | static (a bucketed shape) | cuda_graph "
                                        "(the bucket captured as a CUDA graph; two untimed runs first)",
                                   factory=lambda: ["eager"])
    warmup: int = _doc(1, "untimed prefills per point and scan first")
    profile: bool = _doc(False, "one prefill per point and scan under torch.profiler: profile.md and profile_* fields")
    switches: List[str] = _doc(help="environment settings (NAME=VALUE, several joined by ',') under which each point's "
                                    "prefill is timed too, round by round with the default's, e.g. "
                                    "\"experiment.switches=['SPECDEC_PROMPT_KERNELS=0']\" (eager and static prompt "
                                    "paths)", factory=list)


class CheckName(StrEnum):
    rollback_on_device = "rollback_on_device"
    step_cost = "step_cost"
    memory_budget = "memory_budget"
    fp32_state = "fp32_state"


@dataclass
class ChecksExperiment:
    name: str = "checks"
    checks: List[CheckName] = _doc(help="the checks to run (see the experiment's description)",
                                   factory=lambda: list(CheckName))
    acceptance: float = _doc(0.8, "per-token acceptance of the oracle drafter")
    batch_grid: List[int] = _doc(help="step_cost: batch sizes", factory=lambda: [1, 4, 16])
    prompt_tokens: int = _doc(128, "random prompt tokens per row (ragged rows left-padded)")
    transfer_new_tokens: List[int] = _doc(help="rollback_on_device: new tokens of the short and the long profiled run",
                                          factory=lambda: [8, 40])
    max_dtoh_per_step: float = _doc(1.25, "rollback_on_device: device-to-host copies allowed per decode step")
    memory_budget_gib: float = _doc(40.0, "memory_budget: GiB for SSM state, conv windows and KV cache")
    context_tokens: int = _doc(4096, "memory_budget: tokens per sequence for the KV cache")
    decode_path: str = _doc("auto", "auto (cuda_graph on CUDA, static on CPU) | eager | static | cuda_graph")


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
    ops: List[SSMOpName] = _doc(help="SSM ops to time: mamba2, gdn, kda",
                                factory=lambda: [SSMOpName.mamba2, SSMOpName.gdn, SSMOpName.kda])
    shapes: ShapePreset = _doc(ShapePreset.bench, "bench (the ops' layer shapes in 4B hybrids) | tiny (CPU smoke runs)")
    batch_grid: List[int] = _doc(help="batch sizes", factory=lambda: [1, 8, 64, 256])
    k_grid: List[int] = _doc(help="K values", factory=lambda: [1, 4, 8])
    rounds: int = _doc(16, "steps per CUDA graph")
    reps: int = _doc(10, "graph replays per point (median)")
    accept_p: float = _doc(0.7, "per-draft acceptance of the committed counts")
    memory_budget_gib: float = _doc(40.0, "SSM-state budget in GiB for the largest admitted batch")
    check: bool = _doc(True, "every strategy against the fp32 reference first")
    fla: bool = _doc(True, "time flash-linear-attention's fused recurrent GDN when importable (CUDA)")
    launch_from: Optional[str] = _doc(None, "a benchmarks/sweep_rollback_configs.py JSON: time its fastest launches")


@dataclass
class SkinnyLinearExperiment:
    name: str = "skinny_linear"
    models: List[str] = _doc(help="conf/model options (random_shape) whose distinct nn.Linear weight shapes are timed",
                             factory=lambda: ["qwen35-4b-shape", "nemotronh-4b-shape"])
    rows: List[int] = _doc(help="M, rows of x (1..64)", factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    reps: int = _doc(20, "CUDA-graph replays per point (median)")
    min_calls: int = _doc(10, "calls per CUDA graph at least (weights rotated over copies of >= 256 MiB)")
    check: bool = _doc(True, "the kernel against the fp32 reference and 1-row calls (batch invariance) first")
    sweep: bool = _doc(False, "also time a small set of launch settings per point and report the fastest (slow)")
    groups: bool = _doc(True, "also time the sibling groups the CUDA-graph path merges (q/k/v, ...): F.linear per "
                              "member against one grouped launch")
    max_weight_mib: Optional[float] = _doc(None, "time only weights of at most this many MiB (null: all; CPU smoke "
                                                 "runs leave out the LM head)")


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
    num_speculative_tokens: int = _doc(4, "K, drafts per verify step (0 = plain decoding through the same engine)")
    max_new_tokens: int = _doc(64, "tokens generated per prompt")
    seed: int = _doc(0, "random seed")
    device: Device = _doc(Device.auto, "auto | cpu | cuda")
    dtype: DType = _doc(DType.auto, "auto (fp32 on cpu, bf16 on cuda) | float32 | bfloat16 | float16")
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    repeats: int = _doc(3, "timed runs per speed figure: median and min-max of the repeats")
    progress: bool = _doc(True, "show a progress bar")
    cpu_threads: Optional[int] = _doc(None, "torch threads on CPU (null: chosen by specdec.threads, 1 for small "
                                            "models)")


@dataclass
class AcceptanceConfig(BaseConfig):
    experiment: AcceptanceExperiment = field(default_factory=AcceptanceExperiment)


@dataclass
class RollbackExperimentConfig(BaseConfig):
    experiment: RollbackExperiment = field(default_factory=RollbackExperiment)


@dataclass
class BenchConfig(BaseConfig):
    num_speculative_tokens: Any = _doc(4, "K, drafts per verify step (0 = plain decoding), or auto: chosen per step "
                                          "(specdec.adaptive)")
    experiment: BenchExperiment = field(default_factory=BenchExperiment)


@dataclass
class AdaptiveConfig(BaseConfig):
    experiment: AdaptiveExperiment = field(default_factory=AdaptiveExperiment)


@dataclass
class ServeConfig(BaseConfig):
    num_speculative_tokens: Any = _doc(4, "K, drafts per verify step of the speculative runs, or auto: chosen per "
                                          "step (specdec.adaptive)")
    experiment: ServeExperiment = field(default_factory=ServeExperiment)


@dataclass
class TreeVerifyConfig(BaseConfig):
    experiment: TreeVerifyExperiment = field(default_factory=TreeVerifyExperiment)


@dataclass
class NgramProposalConfig(BaseConfig):
    experiment: NgramProposalExperiment = field(default_factory=NgramProposalExperiment)


@dataclass
class PrefillConfig(BaseConfig):
    experiment: PrefillExperiment = field(default_factory=PrefillExperiment)


@dataclass
class ChecksConfig(BaseConfig):
    experiment: ChecksExperiment = field(default_factory=ChecksExperiment)


@dataclass
class KernelsConfig(BaseConfig):
    experiment: KernelsExperiment = field(default_factory=KernelsExperiment)


@dataclass
class SkinnyLinearConfig(BaseConfig):
    experiment: SkinnyLinearExperiment = field(default_factory=SkinnyLinearExperiment)


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
    steps_scale: float = _doc(1.0, "every model's training steps times this (e.g. 0.01 for a smoke run)")
    batch_scale: float = _doc(1.0, "every model's batch times this")
    corpus_scale: float = _doc(1.0, "the training corpus's size times this")
    out_dir: Optional[str] = _doc(None, "where the models and MANIFEST.json go (<out_dir>/zoo/); null: into the installed package, over the shipped zoo")
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
    tokens: int = _doc(300_000, "training tokens whose hidden states are computed (once)")
    seq_len: int = _doc(512, "tokens per training window")
    batch_windows: int = 8  # windows per target forward
    pool_factor: float = 4.0  # windows are drawn from this many times more packed tokens


@dataclass
class MedusaHeadsConfig:
    num_heads: int = _doc(4, "Medusa heads (head k predicts token t+2+k)")
    num_layers: int = _doc(2, "residual blocks per head")
    shared_lm_head: bool = True
    vocab_bias: bool = True
    lm_head_rank: int = 0
    storage_dtype: DType = DType.float32


@dataclass
class MedusaTrainConfig:
    labels: LabelSource = _doc(LabelSource.target, "target (self-distillation: the target's greedy tokens) | corpus")
    steps: int = _doc(360, "optimizer steps")
    batch_positions: int = _doc(1024, "positions per step")
    lr: float = _doc(1.0e-2, "peak learning rate (AdamW, warm-up then cosine)")
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 20
    time_budget_s: Optional[float] = _doc(None, "stop training after this many seconds (null: run every step)")


@dataclass
class TrainMedusaConfig(BaseConfig):
    """The Medusa recipe's keys (specdec.experiments.train_medusa)."""

    experiment: TrainMedusaExperiment = field(default_factory=TrainMedusaExperiment)
    name: str = _doc("gdn-medusa", "the heads' zoo name")
    target: str = _doc("gdn-target", "the zoo target the heads draft for (frozen)")
    out_dir: Optional[str] = _doc(None, "where the models and MANIFEST.json go (<out_dir>/zoo/); null: into the installed package, over the shipped zoo")
    corpus: MedusaCorpusConfig = field(default_factory=MedusaCorpusConfig)
    data: MedusaDataConfig = field(default_factory=MedusaDataConfig)
    heads: MedusaHeadsConfig = field(default_factory=MedusaHeadsConfig)
    train: MedusaTrainConfig = field(default_factory=MedusaTrainConfig)


@dataclass
class TrainMtpExperiment:
    name: str = "train_mtp"


@dataclass
class MtpLayersConfig:
    num_layers: int = _doc(1, "MTP layers (the config's mtp_num_hidden_layers / num_nextn_predict_layers)")
    # per target: config fields the MTP layers are built with, as a checkpoint of the family sets them
    config: Dict[str, Any] = field(default_factory=dict)
    init_from_target: bool = True  # start each MTP layer from the target's last layer of its kind (when shapes fit)
    storage_dtype: DType = DType.bfloat16


@dataclass
class MtpTrainConfig(MedusaTrainConfig):
    chain_steps: int = _doc(4, "drafting steps trained (1 = predict token t+2 only)")
    soft_labels: bool = _doc(False, "with labels=target: the target's distributions, not only its greedy tokens")
    batch_windows: int = 4
    steps: int = _doc(1600, "optimizer steps")
    batch_positions: int = _doc(1024, "positions per step, per drafting step")
    lr: float = _doc(6.0e-3, "peak learning rate (AdamW, warm-up then cosine)")


@dataclass
class MtpDataConfig(MedusaDataConfig):
    tokens: int = _doc(600_000, "training tokens whose hidden states are computed (once)")


@dataclass
class TrainMtpConfig(BaseConfig):
    """The MTP recipe's keys (specdec.experiments.train_mtp)."""

    experiment: TrainMtpExperiment = field(default_factory=TrainMtpExperiment)
    target: str = _doc("gdn-target", "the zoo target whose checkpoint gets the MTP layers (frozen)")
    out_dir: Optional[str] = _doc(None, "where the models and MANIFEST.json go (<out_dir>/zoo/); null: into the installed package, over the shipped zoo")
    corpus: MedusaCorpusConfig = field(default_factory=MedusaCorpusConfig)
    data: MtpDataConfig = field(default_factory=MtpDataConfig)
    mtp: MtpLayersConfig = field(default_factory=MtpLayersConfig)
    train: MtpTrainConfig = field(default_factory=MtpTrainConfig)


#: the training recipes (their configs have no drafter / rollback / prompt keys to check)
RECIPES = ("train_zoo", "train_medusa", "train_mtp")


def recipe_out_root(cfg) -> Path:
    """Where a recipe writes: ``out_dir`` (resolved), or the installed package (over the shipped
    zoo) when it is unset; the models and ``MANIFEST.json`` go into its ``zoo/``."""
    out_dir = cfg.get("out_dir")
    return Path(str(out_dir)).resolve() if out_dir else _PACKAGE_DIR

#: experiment name -> root schema
SCHEMAS = {
    "acceptance": AcceptanceConfig,
    "rollback": RollbackExperimentConfig,
    "bench": BenchConfig,
    "long_run": BenchConfig,
    "adaptive": AdaptiveConfig,
    "serve": ServeConfig,
    "kernels": KernelsConfig,
    "tree_verify": TreeVerifyConfig,
    "ngram_proposal": NgramProposalConfig,
    "prefill": PrefillConfig,
    "checks": ChecksConfig,
    "skinny_linear": SkinnyLinearConfig,
    "train_zoo": TrainZooConfig,
    "train_medusa": TrainMedusaConfig,
    "train_mtp": TrainMtpConfig,
}


def schema_keys(experiment: str) -> set[str]:
    """Top-level keys the schema of ``experiment`` allows."""
    return {f.name for f in fields(SCHEMAS[experiment])}


#: the config groups a user picks an option of (``conf/<group>/<option>.yaml``); ``schema`` is internal
GROUPS = ("experiment", "model", "drafter", "rollback")


def field_help(cls) -> dict[str, str]:
    """``{dotted key: help}`` of a config dataclass, nested dataclasses flattened (``prompts.set``);
    fields without help are left out."""
    out: dict[str, str] = {}
    for f in fields(cls):
        typ = f.default_factory() if f.default_factory is not _NO_DEFAULT else None
        if is_dataclass(typ):
            out.update({f"{f.name}.{k}": v for k, v in field_help(type(typ)).items()})
        elif f.metadata.get("help"):
            out[f.name] = f.metadata["help"]
    return out


def register_configs() -> None:
    """Store every root schema as ``schema/<experiment>`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(group="schema", name=name, node=node)
