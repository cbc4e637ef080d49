"""Targets for the experiments: device/dtype resolution, model loading, SSM layer shapes.

A ``model.targets`` entry names its ``source``:

* ``zoo``: a shipped trained model (``specdec.zoo.load``), offline;
* ``hf``: ``AutoModelForCausalLM.from_pretrained(name)`` (a hub id or a local folder);
* ``random_shape``: ``model_class(config_class(**config))`` from transformers with random
  weights: the benchmark shapes of 4B-parameter hybrids (``qwen35-4b-shape``,
  ``nemotronh-4b-shape``) and their tiny stand-ins for CPU runs (``qwen35-tiny-shape``,
  ``nemotronh-tiny-shape``). Speed does not depend on the weights' values; the zoo tokenizer
  encodes the prompts (its 8192 ids fit any vocabulary of at least 8192). ``layers`` keeps the
  first N layers of the layer pattern; ``damp`` scales every block's output projection
  (:func:`damp_residual_branches`: wide greedy margins, so bf16 rounding rarely flips a token).

:func:`ssm_shape` reads the SSM layer shape from a transformers config without building the
model, so the kernel-level rollback timing can run at a 4B model's shapes on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["resolve_device", "load_app_model", "load_target", "load_draft", "load_hf", "hub_access", "check_tokenizer", "build_random_shape",
           "damp_residual_branches", "weight_bytes", "layer_counts", "SSMShape", "ssm_shape", "target_config"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg) -> tuple[torch.device, torch.dtype]:
    """``cfg.device`` (auto|cpu|cuda) and ``cfg.dtype`` (auto|float32|bfloat16|float16) to torch objects.

    ``auto`` dtype is fp32 on CPU and bf16 on CUDA. Under ``accelerate launch`` / ``torchrun``
    each process takes the GPU of its ``LOCAL_RANK``.

    Raises: ValueError for an unknown value or cuda without a GPU.
    """
    dev = str(cfg.device)
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {cfg.device!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available; use device=cpu")
    dt = str(cfg.dtype)
    if dt == "auto":
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    elif dt in _DTYPES:
        dtype = _DTYPES[dt]
    else:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}; got {cfg.dtype!r}")
    device = torch.device(dev)
    if dev == "cuda":
        import os

        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype


def _container(x):
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    return x


def _cut_layers(config: dict, layers: int, name: str) -> dict:
    """``config`` with its layer pattern (``layer_types`` or ``hybrid_override_pattern``) cut to the
    first ``layers`` layers."""
    n = int(config.get("num_hidden_layers", 0))
    if not 1 <= layers <= n:
        raise ValueError(f"model {name!r}: layers must be in [1, {n}] (its num_hidden_layers), got {layers}")
    out = dict(config, num_hidden_layers=layers)
    for key in ("layer_types", "hybrid_override_pattern", "mlp_layer_types"):
        if out.get(key) is not None:
            out[key] = out[key][:layers]
    return out


def target_config(spec):
    """The transformers config of a ``random_shape`` target (no weights built), its layer
    pattern cut to ``spec.layers`` when set.

    Raises: ValueError when ``config_class`` is missing or not a transformers class, or
    ``layers`` is outside [1, num_hidden_layers]."""
    import transformers

    if not spec.get("config_class"):
        raise ValueError(f"model {spec.name!r}: source random_shape needs config_class and model_class")
    cls = getattr(transformers, str(spec.config_class), None)
    if cls is None:
        raise ValueError(f"model {spec.name!r}: transformers has no config class {spec.config_class!r}")
    config = _container(spec.get("config") or {})
    if spec.get("layers") is not None:
        config = _cut_layers(config, int(spec.layers), str(spec.name))
    return cls(**config)


def layer_counts(config) -> tuple[int, int]:
    """``(SSM layers, attention layers)`` of a transformers config (``layer_types`` with
    ``linear_attention`` / ``full_attention``, or Nemotron-H's ``hybrid_override_pattern`` with
    ``M`` / ``*``)."""
    pattern = getattr(config, "hybrid_override_pattern", None)
    if pattern:
        return str(pattern).count("M"), str(pattern).count("*")
    types = list(getattr(config, "layer_types", None) or [])
    return types.count("linear_attention"), types.count("full_attention")


def damp_residual_branches(model, factor: float) -> int:
    """Scale the output projection of every block (attention ``o_proj``, SSM ``out_proj``, MLP
    ``down_proj``) by ``factor`` and give an untied LM head the input embedding's values; returns
    the number of projections scaled.

    With transformers' random init the top-2 logit gap is within bf16 rounding noise every few
    tokens, so a T-token verify and a 1-token step (different GEMM tilings) pick different
    argmaxes within a few tokens. With damped residual branches each greedy choice follows the
    (exact) embedding path, and with the LM head equal to the embedding each token's own row wins
    by a margin of about sqrt(hidden size): flips become rare. Speed does not depend on the values
    (an untied head keeps its own tensor: the same bytes are read)."""
    n = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("o_proj", "out_proj", "down_proj") and hasattr(mod, "weight"):
                mod.weight.mul_(factor)
                n += 1
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() != emb.weight.data_ptr():
            head.weight.copy_(emb.weight)
    return n


def plain_step_bytes(model, batch: int, prompt_tokens: int, new_tokens: int) -> int | None:
    """The bytes a plain decoding step must move at least: the weights once (:func:`weight_bytes`:
    of an untied embedding table, the ``batch`` rows looked up),
    and per row every SSM layer's state and conv window read and written
    (:func:`specdec.batching.bytes_per_sequence`, K = 0) and the attention keys and values read
    over the mean context of the run (``prompt_tokens + new_tokens / 2`` columns); divided by a
    copy bandwidth, the step's memory floor. None for a model specdec has no adapter for."""
    from specdec.batching import bytes_per_sequence
    from specdec.models import adapter_for
    from specdec.rollback import InPlaceUpdate

    try:
        adapter = adapter_for(model)
    except (TypeError, ValueError):  # not a family specdec supports
        return None
    row = bytes_per_sequence(adapter, InPlaceUpdate(), prompt_tokens + new_tokens, 0)
    kv_per_column = row.kv_bytes / row.kv_columns if row.kv_columns else 0.0
    return int(weight_bytes(model, batch) + batch * (2 * row.state_bytes + kv_per_column * (prompt_tokens + new_tokens / 2)))


def weight_bytes(model, rows: int = 1) -> int:
    """Bytes of the parameters a forward over ``rows`` token rows reads: every parameter once (a
    tied tensor once), except the input embedding table when it is not the LM head's weight: a
    forward gathers ``rows`` of its rows, not the table (for a 248k-token vocabulary at width
    2,560 in bf16 the table is 1.27 GB, 15% of a 4B model)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if emb is not None and callable(get_head) else None
    table = getattr(emb, "weight", None)
    if isinstance(table, torch.Tensor) and table.dim() == 2 and (
            head is None or getattr(head, "weight", None) is None or head.weight.data_ptr() != table.data_ptr()):
        total -= max(table.shape[0] - rows, 0) * table.shape[1] * table.element_size()
    return total


def build_random_shape(spec, device, dtype, seed: int = 0):
    """``(model, tokenizer)`` for a ``random_shape`` target: random init (``spec.layers`` layers
    when set; residual branches damped by ``spec.damp`` when set), no EOS, eval mode, on
    ``device``; the zoo tokenizer."""
    import transformers

    from .. import zoo

    config = target_config(spec)
    model_cls = getattr(transformers, str(spec.model_class or ""), None)
    if model_cls is None:
        raise ValueError(f"model {spec.name!r}: transformers has no model class {spec.model_class!r}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype)
    if spec.get("damp") is not None:
        damp_residual_branches(model, float(spec.damp))
    model.generation_config.eos_token_id = None  # random weights: no natural end of text
    return model.eval(), zoo.load_tokenizer()


#: how long the Hub reachability probe waits (seconds)
HUB_TIMEOUT_S = 5.0
#: text every usable tokenizer encodes to at least one token
TOKENIZER_PROBE = "def fibonacci(n):\n    return n"


def hub_access(name: str) -> dict:
    """The ``from_pretrained`` keywords for ``name``, a hub id that is not a local folder:
    ``{"local_files_only": True}`` when the Hugging Face cache has it; ``{}`` when the Hub
    answers for it (probed once, :data:`HUB_TIMEOUT_S`).

    Raises:
        ValueError: one line saying what to do: ``HF_HUB_OFFLINE`` is set and the cache lacks
            it; the Hub has no such model (or it is gated / private); the Hub cannot be
            reached (pass a local folder, or connect).
    """
    import huggingface_hub
    from huggingface_hub import constants

    cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        return {"local_files_only": True}
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"model {name!r} is not a local folder and not in the Hugging Face cache, and HF_HUB_OFFLINE "
                         "is set: pass a local folder (model.targets.0.name=/path/to/model) or unset HF_HUB_OFFLINE")
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        huggingface_hub.HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ValueError(f"model {name!r} is gated on the Hugging Face Hub: accept its terms and log in "
                         "(`hf auth login`), or pass a local folder") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {name!r} is neither a local folder nor a model on the Hugging Face Hub (or it is "
                         "private: log in with `hf auth login`)") from None
    except Exception as err:  # noqa: BLE001 - any transport error: no network, DNS, proxy, timeout
        raise ValueError(f"cannot reach the Hugging Face Hub for model {name!r} ({type(err).__name__}); pass a local "
                         "folder (model.targets.0.name=/path/to/model), connect to the network, or set "
                         "HF_HUB_OFFLINE=1 to use the cache only") from None
    return {}


def check_tokenizer(tok, where: str) -> None:
    """Raise ValueError unless ``tok`` encodes :data:`TOKENIZER_PROBE` to at least one token
    (transformers can return a tokenizer without vocabulary for a folder that has none)."""
    ids = tok(TOKENIZER_PROBE).input_ids
    if not len(ids):
        raise ValueError(f"{where}: the tokenizer encodes text to no tokens (the folder has no usable tokenizer "
                         "files): add tokenizer.json / tokenizer_config.json to it, or set "
                         "model.targets.0.tokenizer=<folder or hub id>")


#: ``device_map`` strings accelerate places a model by (``from_pretrained(device_map=...)``)
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def placement_kwargs(spec) -> dict:
    """``from_pretrained`` keywords of an ``hf`` target's ``device_map``, ``max_memory`` and
    ``offload_folder`` ({} without a device_map): accelerate's big-model dispatch, layers on
    several devices or offloaded to the CPU / disk (:mod:`specdec.placement` says which layouts
    specdec decodes). ``max_memory`` keys that are digits become GPU indices.

    Raises: ValueError for a device_map string accelerate does not know, a max_memory that is not
        a map, or max_memory / offload_folder without a device_map."""
    device_map = spec.get("device_map")
    max_memory, offload = spec.get("max_memory"), spec.get("offload_folder")
    if device_map is None:
        if max_memory is not None or offload is not None:
            raise ValueError("model.targets.N.max_memory and offload_folder need model.targets.N.device_map "
                             f"(one of {', '.join(DEVICE_MAP_STRATEGIES)} or a {{module: device}} map)")
        return {}
    if hasattr(device_map, "items"):
        device_map = {str(k): v for k, v in dict(device_map).items()}
    elif device_map not in DEVICE_MAP_STRATEGIES:
        raise ValueError(f"model.targets.N.device_map must be one of {', '.join(DEVICE_MAP_STRATEGIES)} or a "
                         f"{{module: device}} map, got {device_map!r}")
    kw = {"device_map": device_map}
    if max_memory is not None:
        if not hasattr(max_memory, "items"):
            raise ValueError(f"model.targets.N.max_memory must be a map of device to memory (e.g. {{0: 70GiB, cpu: "
                             f"200GiB}}), got {max_memory!r}")
        kw["max_memory"] = {int(k) if str(k).isdigit() else str(k): str(v) for k, v in dict(max_memory).items()}
    if offload is not None:
        kw["offload_folder"] = str(offload)
    return kw


def load_hf(spec, device, dtype):
    """``(model, tokenizer)`` of an ``hf`` target: ``AutoModelForCausalLM`` and ``AutoTokenizer``
    from ``spec.name`` (a local folder or a hub id; the tokenizer from ``spec.tokenizer`` when
    set), eval mode, on ``device`` or placed by ``spec.device_map`` (:func:`placement_kwargs`),
    left padding (pad = eos when the tokenizer has no pad).

    Raises:
        ValueError: one line for a missing folder, an unreachable / unknown hub id
            (:func:`hub_access`), a model transformers cannot load, a bad placement
            (:func:`placement_kwargs`), or a missing or unusable tokenizer
            (:func:`check_tokenizer`).
    """
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    def access(name: str) -> dict:
        p = Path(name).expanduser()
        if p.is_dir():
            return {}
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise ValueError(f"model {name!r}: no such folder")
        return hub_access(name)

    name = str(spec.name)
    tok_name = str(spec.get("tokenizer") or name)
    placed = placement_kwargs(spec)
    kw = access(name)
    if placed.get("device_map") is not None and "offload_folder" not in placed:
        import atexit
        import shutil
        import tempfile

        placed["offload_folder"] = tempfile.mkdtemp(prefix="specdec_offload_")  # (removed when the process ends)
        atexit.register(shutil.rmtree, placed["offload_folder"], True)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kw, **placed)
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model {name!r} could not be loaded as a causal LM: {first}") from None
    model = (model if placed else model.to(device)).eval()
    where = f"model {name!r}" if tok_name == name else f"tokenizer {tok_name!r}"
    try:
        tok = AutoTokenizer.from_pretrained(tok_name, **(kw if tok_name == name else access(tok_name)))
    except (OSError, ValueError, TypeError, KeyError) as err:
        why = " ".join(ln.strip() for ln in str(err).splitlines() if ln.strip()) or type(err).__name__
        raise ValueError(f"{where}: no usable tokenizer ({why}); add the tokenizer files or set "
                         "model.targets.0.tokenizer=<folder or hub id>") from None
    check_tokenizer(tok, where)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def load_app_model(name: str, device: str = "cuda", seed: int = 0, overrides=()):
    """``(model, torch.device)``: the app's ``model=<name>`` (a ``conf/model`` entry: its first
    target, at the device's dtype as the app resolves it) with EOS switched off, for scripts
    that time a model outside the app; ``overrides``: more Hydra overrides of the app's config
    (e.g. ``model.targets.0.config.hidden_size=64``). Raises as :func:`load_target` does."""
    from hydra import compose, initialize_config_dir

    from .config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[f"model={name}", f"device={device}", *overrides])
    dev, dtype = resolve_device(cfg)
    model, _ = load_target(cfg.model.targets[0], dev, dtype, seed)
    model.generation_config.eos_token_id = None
    return model, dev


def load_target(spec, device, dtype, seed: int = 0):
    """``(model, tokenizer)`` for a ``model.targets`` entry (``source`` zoo, hf or random_shape).

    Raises: ValueError for an unknown source, a bad random_shape entry, or an hf target that
    cannot be loaded (:func:`load_hf`); the zoo loader's errors pass through."""
    source = str(spec.source)
    if source == "zoo":
        from .. import zoo

        return zoo.load(spec.name, device=device, dtype=dtype)
    if source == "hf":
        return load_hf(spec, device, dtype)
    if source == "random_shape":
        return build_random_shape(spec, device, dtype, seed)
    raise ValueError(f"model source must be zoo, hf or random_shape; got {spec.source!r}")


def load_draft(spec, device, dtype):
    """The draft model named by a ``model.targets`` entry's ``draft``, from the target's source;
    a draft folder needs no tokenizer of its own: it reads the target's (``tokenizer``, else the
    target's folder), since a draft proposes token ids of the target's vocabulary."""
    from omegaconf import OmegaConf

    draft = {"name": spec.draft, "source": str(spec.source)}
    if str(spec.source) == "hf":
        draft["tokenizer"] = str(spec.get("tokenizer") or spec.name)
    try:
        model, _ = load_target(OmegaConf.create(draft), device, dtype)
    except (ValueError, KeyError, OSError) as err:  # (OSError: FileNotFoundError among them)
        raise ValueError(f"the draft model of {spec.name!r} (model.targets.N.draft): {err}") from None
    return model


# ------------------------------------------------------------------------------ SSM shapes


@dataclass(frozen=True)
class SSMShape:
    """The SSM layers of a model: op (``specdec.kernels.OPS`` key), count and per-layer shape.

    Mamba-2: ``heads`` x ``head_dim`` x ``state_size``, ``n_groups`` B/C groups.
    GDN / KDA: ``heads`` (value heads) x ``key_dim`` x ``value_dim``.
    """

    op: str
    num_layers: int
    heads: int
    head_dim: int = 0
    state_size: int = 0
    n_groups: int = 1
    key_dim: int = 0
    value_dim: int = 0

    @property
    def state_shape(self) -> tuple[int, ...]:
        if self.op == "mamba2":
            return (self.heads, self.head_dim, self.state_size)
        return (self.heads, self.key_dim, self.value_dim)

    @property
    def state_bytes(self) -> int:
        """S: fp32 bytes of one layer's state for one sequence (the strategies keep fp32)."""
        return 4 * math.prod(self.state_shape)

    def describe(self) -> str:
        if self.op == "mamba2":
            return (f"{self.num_layers} x mamba2 {self.heads}h x {self.head_dim} x {self.state_size}, "
                    f"{self.n_groups} groups")
        return f"{self.num_layers} x {self.op} {self.heads}h x {self.key_dim} x {self.value_dim}"


def ssm_shape(config) -> SSMShape:
    """The SSM layer shape of a transformers config (Qwen3.5 / Qwen3-Next GDN, Nemotron-H
    Mamba-2, Kimi-Linear KDA; a text config nested as ``text_config`` is used).

    Raises: ValueError for another model type (the kernel-level timing then needs
    ``experiment.kernel_level=false``)."""
    config = getattr(config, "text_config", None) or config
    mt = str(getattr(config, "model_type", ""))
    layer_types = list(getattr(config, "layer_types", None) or [])
    if mt.startswith("qwen3_5") or mt.startswith("qwen3_next"):
        return SSMShape(op="gdn", num_layers=layer_types.count("linear_attention"),
                        heads=config.linear_num_value_heads, key_dim=config.linear_key_head_dim,
                        value_dim=config.linear_value_head_dim)
    if mt == "kimi_linear":
        return SSMShape(op="kda", num_layers=layer_types.count("linear_attention"),
                        heads=config.linear_num_heads, key_dim=config.linear_head_dim,
                        value_dim=config.linear_head_dim)
    if mt == "nemotron_h":
        blocks = list(getattr(config, "layers_block_type", None) or [])
        n = sum(b in ("mamba", "linear_attention") for b in blocks)
        if not n:
            n = str(getattr(config, "hybrid_override_pattern", "")).count("M")
        return SSMShape(op="mamba2", num_layers=n, heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
                        state_size=config.ssm_state_size, n_groups=config.n_groups)
    raise ValueError(f"kernel-level shapes are known for qwen3_5 / qwen3_next (GDN), nemotron_h (Mamba-2) and "
                     f"kimi_linear (KDA) configs, not {mt!r}; set experiment.kernel_level=false")
