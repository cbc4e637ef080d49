"""Model adapters: how to run a Hugging Face hybrid family's steps with our cache and kernels.

An adapter wraps a loaded HF causal LM and never copies its weights. It provides

* :meth:`HybridAdapter.prefill`: the prompt through the model's own forward (transformers'
  chunked kernels, or flash-linear-attention / mamba_ssm when installed), its Mamba-2 mixers
  through our chunked scan (:data:`PROMPT_LAYERS`), then the final attention KV, conv and SSM
  states moved into a :class:`~specdec.cache.HybridCache`;
* :meth:`HybridAdapter.forward`: ``t`` step tokens through the model's own decoder layers with
  our cache: attention modules write into the static KV cache through ``cache.update``, and
  each SSM mixer runs through the family's ``mixer_forward``, which calls the shared op
  (``specdec.kernels``) through the rollback layer.

Subclasses set ``model_types`` and implement :meth:`ssm_layers` and :meth:`mixer_forward`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import DynamicCache

from ..cache import HybridCache, SSMLayerCache
from ..fusion import prompt_kernels_enabled
from ..kernels import backend, get_op
from ..kernels.mamba2.chunked import resolve_scan
from ..placement import (Placement, check_placement, materialized, offloads_weights, on_device,
                         routed_forward, spread_layers)
from ..prefix_cache import LayerState, PrefixBlock, PrefixCache, PrefixEntry, PrefixMatch
from ..quiet import quiet_transformers
from ..rollback import RollbackStrategy
from .common import cache_keyword, plain_norms, prompt_kernels, prompt_mlps
from .step_attention import grouped_attention_configs, grouped_step_attention_for, sdpa_without_cudnn

__all__ = ["HybridAdapter", "ADAPTERS", "PROMPT_LAYERS", "PROMPT_PATHS", "register", "adapter_for", "prefill_groups", "supported_families"]

ADAPTERS: dict[str, type["HybridAdapter"]] = {}

#: how :meth:`HybridAdapter.prefill` runs its prompt forwards (see there)
PROMPT_PATHS = ("eager", "static", "cuda_graph")

#: op name -> the layer class a family's ``mixer_forward`` runs against during prefill, built as
#: ``cls(mixer, cache_params, attention_mask, scan)`` (a :class:`specdec.models.prompt_layer.PromptLayer`:
#: :class:`specdec.models.mamba2.Mamba2PromptLayer`, :class:`specdec.models.gdn.GDNPromptLayer`,
#: :class:`specdec.models.kimi_linear.KDAPromptLayer`); the mixers of other ops (LFM2's short
#: convs) run transformers' own forward during prefill
PROMPT_LAYERS: dict[str, type] = {}


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``length`` entries (cut to its last
    ``length``; ``t`` itself when it has ``length``)."""
    n = t.shape[dim]
    if n == length:
        return t
    if n > length:
        return t.narrow(dim, n - length, length)
    shape = list(t.shape)
    shape[dim] = length - n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _drain(steps):
    """Run a generator of forwards (:meth:`HybridAdapter._chunk_forwards`,
    :meth:`HybridAdapter.prefill_cached_steps`) to its end; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def prefill_groups(mask: torch.Tensor, max_tokens: int | None) -> list[torch.Tensor] | None:
    """The forwards :meth:`HybridAdapter.prefill` splits a batch into: groups of the rows of
    ``mask [B, L]`` (left padding), by prompt length (so a group pads little), whose prompts,
    padded to the group's longest, hold at most ``max_tokens`` tokens together (a longer prompt
    alone): each an int64 tensor of row indices on ``mask``'s device; None when the whole batch
    fits or ``max_tokens`` is None."""
    B, L = mask.shape
    if max_tokens is None or B * L <= max_tokens:
        return None
    lengths = mask.sum(-1)
    order = torch.sort(lengths, stable=True).indices.tolist()
    sizes = lengths.tolist()
    groups, group = [], []
    for b in order:  # ascending lengths: the newest row is the group's longest
        if group and (len(group) + 1) * sizes[b] > max_tokens:
            groups.append(group)
            group = []
        group.append(b)
    groups.append(group)
    return [torch.tensor(g, dtype=torch.long, device=mask.device) for g in groups]


def _stack_rows(rows: list[dict[int, LayerState]]) -> dict[int, LayerState]:
    """One batch's layer states from each group of rows' (in order): keys / values left-padded
    with zeros to the longest group's, conv and recurrent states concatenated (one group: its
    states, not copied)."""
    if len(rows) == 1:
        return rows[0]
    out = {}
    for idx, first in rows[0].items():
        per = [r[idx] for r in rows]

        def cat(name, pad_dim=None):
            ts = [getattr(s, name) for s in per]
            if ts[0] is None:
                return None
            if pad_dim is not None:
                n = max(t.shape[pad_dim] for t in ts)
                ts = [_left_pad(t, n, pad_dim) for t in ts]
            return torch.cat(ts)

        out[idx] = LayerState(cat("keys", 2), cat("values", 2), cat("conv_state"), cat("recurrent_state"))
    return out


def _shared_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """How many leading full blocks of ``block_size`` tokens the prompts ``a`` and ``b`` share."""
    n = 0
    while (n + 1) * block_size <= min(len(a), len(b)) and a[n * block_size:(n + 1) * block_size] == \
            b[n * block_size:(n + 1) * block_size]:
        n += 1
    return n


def _stack_kv(new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[list[tuple[int, str]], torch.Tensor]]:
    """The keys / values of ``new_kv`` (layer index -> ``(keys, values)``, ``[B, H_kv, t, D]``)
    stacked, one tensor per group of them that share shape, dtype and device: ``(names, data)``, ``data
    [m, B, H_kv, t, D]`` holding ``names[i] = (layer index, "keys" or "values")`` at ``i``. So
    one slice of a group holds a block's columns of every layer (one copy per block, not per
    layer: :meth:`HybridAdapter._store_blocks`)."""
    groups: dict[tuple, list[tuple[int, str, torch.Tensor]]] = {}
    for idx, (k, v) in new_kv.items():
        for name, t in (("keys", k), ("values", v)):
            groups.setdefault((tuple(t.shape), t.dtype, t.device), []).append((idx, name, t))
    return [([(idx, name) for idx, name, _ in g], torch.stack([t for _, _, t in g])) for g in groups.values()]


def _right_aligned(prefix: list[int], new: list[int], P: int, T: int, device) -> tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]:
    """Index and padding tensors that gather, from the ``P + T`` columns (third axis) of a batched
    forward's keys / values (a prefix left-padded to ``P``, then ``T`` new columns left-padded),
    row b's real columns: its last ``prefix[b]`` prefix columns, then its last ``new[b]`` new
    ones, right-aligned in ``W = max(prefix[b] + new[b])`` columns: ``(index [B, 1, W, 1] int64,
    pad [B, 1, W, 1] bool or None when no row is shorter than W)``, built on the device without
    a per-column host list; ``(None, None)`` when every row's columns are the last ``W`` (no new
    padding or no prefix, equal rows: nothing to gather, :func:`_gather_columns` narrows)."""
    if len(set(prefix)) == 1 and len(set(new)) == 1 and (new[0] == T or prefix[0] == 0):
        return None, None
    p = torch.tensor(prefix, device=device)[:, None]
    n = torch.tensor(new, device=device)[:, None]
    W = int(max(a + b for a, b in zip(prefix, new)))
    k = torch.arange(W, device=device)[None, :] - (W - p - n)  # the position within the row's own columns
    index = torch.where(k < p, P - p + k, P + T - n + k - p).clamp(min=0)
    pad = (k < 0)[:, None, :, None] if any(a + b < W for a, b in zip(prefix, new)) else None
    return index[:, None, :, None], pad


def _gather_columns(t: torch.Tensor, index: torch.Tensor | None, pad: torch.Tensor | None, W: int) -> torch.Tensor:
    """``t [B, H, C, D]`` at :func:`_right_aligned`'s columns: ``[B, H, W, D]``, zeros at padding
    (``index`` None: ``t``'s last ``W`` columns, a view)."""
    if index is None:
        return _left_pad(t, W, 2)
    out = t.gather(2, index.expand(-1, t.shape[1], -1, t.shape[3]))
    return out if pad is None else out.masked_fill_(pad, 0)


@dataclasses.dataclass(eq=False)
class _CachedRow:
    """One prompt of a prefill with a prefix cache, between its forwards: ``tokens [L]`` (int64),
    its lookup ``found``, the ``chain`` of entries its next block is stored after, the position
    ``start`` its next forward starts at, the ``ends`` of the forwards left to run, its layer
    ``state`` at ``start`` (keys / values of every position so far, right-aligned: after a
    batched forward zero columns may precede them; empty before any), the final hidden states its
    forwards returned so far (``hidden``: cached blocks' first), and whether its blocks are still
    stored (``storing``: False once one was not); ``ids``: ``tokens`` as a list of ints."""

    tokens: torch.Tensor
    ids: list[int]
    found: PrefixMatch
    chain: list[PrefixEntry]
    start: int
    ends: list[int]
    state: dict[int, LayerState]
    hidden: list[torch.Tensor]
    storing: bool = True

    def result(self, all_hidden_states: bool) -> tuple[torch.Tensor, dict[int, LayerState]]:
        """What :meth:`HybridAdapter.prefill_cached` returns for it, once every forward ran."""
        hidden = torch.cat(self.hidden, dim=1) if all_hidden_states else self.hidden[-1][:, -1:]
        return hidden, self.state


def _prefix_state(blocks: list[PrefixBlock]) -> dict[int, LayerState]:
    """The layer states after ``blocks`` (a prompt's first blocks, in order, the last holding SSM
    state): every attention layer's keys / values of all their positions, every SSM layer's conv
    window and recurrent state of the last block (one :class:`LayerState` per layer; ``{}`` for
    no blocks)."""
    if not blocks:
        return {}
    out = {idx: LayerState(torch.cat([b.kv[idx].keys for b in blocks], dim=2),
                           torch.cat([b.kv[idx].values for b in blocks], dim=2)) for idx in blocks[-1].kv}
    for idx, state in blocks[-1].ssm_state.items():
        kv = out.get(idx, LayerState())
        out[idx] = dataclasses.replace(state, keys=kv.keys, values=kv.values)
    return out


def _row_state(state: LayerState, b: int) -> LayerState:
    """Row ``b`` of a batch's SSM layer ``state`` (batch dim kept): its conv and recurrent state."""
    def row(t):
        return None if t is None else t[b:b + 1]

    return LayerState(conv_state=row(state.conv_state), recurrent_state=row(state.recurrent_state))


class _KVRecordingCache(DynamicCache):
    """Hugging Face's ``DynamicCache`` that also keeps, in ``new_kv`` (layer index -> ``(keys,
    values)``, ``[1, H_kv, t, D]``), the keys / values each attention layer's last ``update`` got:
    those of every position of a forward, also where a sliding-window layer keeps fewer."""

    def __init__(self, config):
        super().__init__(config=config)
        self.new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new_kv[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def register(cls):
    for mt in cls.model_types:
        ADAPTERS[mt] = cls
    return cls


def supported_families() -> list[str]:
    """``model_type`` names of the supported families."""
    return sorted(ADAPTERS)


def _causal_lm_parts(model):
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"expected a Hugging Face causal LM (a PreTrainedModel with a config), got {type(model).__name__}"
        )
    body = getattr(model, "model", None) or getattr(model, "backbone", None)
    head = getattr(model, "lm_head", None)
    if body is None or head is None:
        raise TypeError(
            f"{type(model).__name__} is not a causal LM: it needs a decoder body (.model) and an LM head (.lm_head); "
            "load it with AutoModelForCausalLM"
        )
    if not hasattr(body, "layers"):  # e.g. a multimodal class: its text model is body.language_model
        raise TypeError(
            f"{type(model).__name__} is not a text causal LM: its body ({type(body).__name__}) has no decoder "
            "layers (.layers); load the checkpoint with AutoModelForCausalLM (its text model)"
        )
    return body, head


def adapter_for(model) -> "HybridAdapter":
    """The adapter for ``model``.

    Raises:
        TypeError: ``model`` is not a Hugging Face causal LM.
        ValueError: its family is not supported (the message lists the supported ones).
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"expected a Hugging Face causal LM (a PreTrainedModel with a config), got {type(model).__name__}"
        )
    mt = getattr(model.config, "model_type", None)
    cls = ADAPTERS.get(mt)
    if cls is None:
        raise ValueError(
            f"model family {mt!r} ({type(model).__name__}) is not supported by specdec; supported model_type "
            f"values: {', '.join(supported_families())}"
        )
    return cls(model)


class HybridAdapter:
    """Base adapter. ``model``: a loaded HF causal LM of the family."""

    model_types: tuple[str, ...] = ()

    def __init__(self, model):
        self.model = model
        self.body, self.lm_head = _causal_lm_parts(model)
        self.config = model.config
        self._ssm: dict | None = None
        self._grouped_attention = grouped_attention_configs(model)  # step attention without repeat_kv
        #: the most prompt tokens (left padding included) one prefill forward runs; more rows run
        #: in several forwards, a longer prompt in chunks (:meth:`prefill`); None: one forward
        self.max_prefill_tokens: int | None = None
        self._prompt_graphs = None
        #: the modules whose forward a Triton prompt forward may run through its own kernels: the
        #: RMSNorms and MLPs recognised at the first prompt (each prompt reads their form / plan anew,
        #: :func:`~specdec.models.common.prompt_kernels`)
        self._prompt_modules: tuple[list, list] | None = None
        self.vocab_size = int(self.lm_head.out_features if hasattr(self.lm_head, "out_features") else self.config.vocab_size)
        #: accelerate's hooks on some module (dispatched without a ``device_map`` attribute, e.g. by hand)
        self._hooked = any(hasattr(mod, "_hf_hook") for mod in model.modules())

    # --- family specifics ------------------------------------------------------------------
    #: the decoder-layer attribute that holds an SSM layer's mixer (None: no SSM layers), and the
    #: op it runs (a name in ``specdec.kernels.OPS``, or ``"conv"`` for a conv-only mixer)
    mixer_attr: str | None = None
    op_name: str = ""

    def mixer_of(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        """The SSM mixer of decoder ``layer``, or None for another kind of layer (default: its
        ``mixer_attr`` attribute when present)."""
        return getattr(layer, self.mixer_attr, None) if self.mixer_attr else None

    def ssm_layers(self) -> dict[int, tuple[torch.nn.Module, str]]:
        """``{layer_idx: (mixer module, op name)}`` for every SSM layer (none for attention-only
        models), found once with :meth:`mixer_of`."""
        if self._ssm is None:
            found = ((i, self.mixer_of(layer)) for i, layer in enumerate(self.body.layers))
            self._ssm = {i: (mixer, self.op_name) for i, mixer in found if mixer is not None}
        return self._ssm

    def conv_width(self, mixer) -> int:
        return int(mixer.conv1d.weight.shape[-1])

    def mixer_forward(self, mixer, hidden_states: torch.Tensor, layer: SSMLayerCache) -> torch.Tensor:
        """The family's SSM mixer on ``hidden_states [B, t, D]`` with our conv/SSM cache."""
        raise TypeError(f"{type(self).__name__} declares SSM layers but does not define mixer_forward()")

    def attention_mask_arg(self, mask: torch.Tensor):
        """What the HF body takes as ``attention_mask`` (the per-layer-type dict of precomputed masks)."""
        return {"full_attention": mask, "sliding_attention": mask, "linear_attention": None}

    # --- shared machinery ------------------------------------------------------------------
    @property
    def device(self):
        """The home device: where the LM head computes (for a model dispatched by accelerate,
        ``device_map``: :mod:`specdec.placement`, its execution device), where the decode loop's
        bookkeeping lives and where :meth:`forward` returns logits and hidden states. The decoder
        layers may compute on other devices (:attr:`placement`).

        Raises: ValueError for a dispatched model :func:`~specdec.placement.check_placement` refuses."""
        placed = self._placement()
        return self.lm_head.weight.device if placed is None else placed[0].home

    @property
    def placement(self) -> Placement:
        """Where the decoder layers and the LM head compute (:class:`~specdec.placement.Placement`):
        for a model dispatched by accelerate as its hooks say (checked once per device map), else
        from each layer's first weight, read at each call (the model may have been moved).

        Raises: ValueError as :attr:`device`, or for layers on several devices :class:`Placement` refuses."""
        placed = self._placement()
        if placed is not None:
            return placed[0]
        home = self.lm_head.weight.device
        return Placement(home, tuple(next((p.device for p in layer.parameters()), home) for layer in self.body.layers))

    @property
    def offloads_weights(self) -> bool:
        """Whether accelerate's hooks load some weights for each forward (:func:`specdec.placement.offloads_weights`)."""
        placed = self._placement()
        return placed is not None and placed[1]

    def check_backend(self) -> None:
        """Raise ValueError when the kernel backend (:func:`specdec.kernels.backend`) is Triton for
        a CPU device a decoder layer or the LM head of a model whose layers spread over several
        devices computes on (``SPECDEC_BACKEND=triton`` forced), naming them: Triton's kernels
        are compiled for GPUs, and on the CPU run only through its interpreter, which a process
        that compiles them for CUDA cannot use."""
        place = self.placement
        if not place.multi_device:
            return
        cpu = [f"layer {i}" for i, dev in enumerate(place.layers) if dev.type != "cuda" and backend(dev) == "triton"]
        if place.home.type != "cuda" and backend(place.home) == "triton":
            cpu.append("the LM head (with the decode loop's bookkeeping and the drafters)")
        if cpu:
            raise ValueError(f"SPECDEC_BACKEND=triton runs Triton kernels everywhere, but {', '.join(cpu)} of this "
                             f"model compute on the CPU ({place.layout()}), where Triton's kernels run only through "
                             "its interpreter, which a process compiling them for CUDA cannot use; unset "
                             "SPECDEC_BACKEND (each device then takes its own backend) or set it to 'torch'")

    @property
    def _scan_device(self) -> torch.device:
        """The device the prompt scan and the attention backends are chosen for: a CUDA device any
        layer or the LM head computes on (:attr:`Placement.cuda_device`; with the LM head on the
        CPU, CUDA layers still take flash-linear-attention's scan, its per-mixer fallback serving
        the CPU ones, and attention without cuDNN), else the home device."""
        place = self.placement
        return (place.cuda_device or place.home) if place.multi_device else self.device

    def _placement(self) -> tuple[Placement, bool] | None:
        """(placement, offloads weights) of a model dispatched by accelerate (``hf_device_map``, or
        hooks found when the adapter was made; checked once per device map), None for one that is
        not (it may still be moved: its device is read each time)."""
        device_map = getattr(self.model, "hf_device_map", None)
        if device_map is None and not self._hooked:
            return None
        kept = getattr(self, "_placed", None)
        if kept is None or kept[0] is not device_map:
            self._placed = kept = (device_map, check_placement(self.model, self.body.layers, self.lm_head),
                                   offloads_weights(self.model))
        return kept[1:]

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def new_cache(self, batch: int, max_len: int, max_step_tokens: int, strategy: RollbackStrategy,
                  static: bool = False) -> HybridCache:
        cache = self._new_hybrid_cache(batch, max_len, max_step_tokens, static)
        for idx, (_, op_name) in self.ssm_layers().items():
            dev = cache.layer_device(idx)
            cache.ssm[idx] = SSMLayerCache(get_op(op_name, dev or cache.device), strategy, batch, max_step_tokens, idx,
                                           device=dev)
        return cache

    def _new_hybrid_cache(self, batch: int, max_len: int, max_step_tokens: int, static: bool) -> HybridCache:
        """An empty :class:`HybridCache` on the home device, told each layer's device where the
        layers spread over several (:attr:`placement`)."""
        place = self.placement
        self.check_backend()
        return HybridCache(batch, max_len, max_step_tokens, self.dtype, place.home, static=static,
                           layer_devices=place.layers if place.multi_device else None)

    @contextlib.contextmanager
    def _routed(self, forwards: dict):
        """Replace SSM mixer ``idx``'s forward by ``forwards[idx](mixer, hidden_states,
        cache_params=None, attention_mask=None, **kw)`` for one call; HF's cache reaches it as
        ``cache_params`` whatever keyword the release passes it under (``cache_params``; ``cache``
        from transformers 5.24). Under accelerate's hooks (:mod:`specdec.placement`) the hook stays
        in front of it and every weight of the mixer's submodules is loaded while it runs."""
        mixers = self.ssm_layers()

        def route(fwd):
            def call(mod, hidden_states, cache_params=None, attention_mask=None, **kw):
                for name in ("cache", "past_key_values"):
                    other = kw.pop(name, None)
                    if cache_params is None:
                        cache_params = other
                with materialized(mod):
                    return fwd(mod, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kw)
            return call

        with contextlib.ExitStack() as stack:
            for idx, fwd in forwards.items():
                stack.enter_context(routed_forward(mixers[idx][0], route(fwd)))
            yield

    def _patched(self, cache: HybridCache):
        """Route each SSM mixer's forward to ``mixer_forward`` with its layer cache, for one call."""
        forwards = {}
        for idx in self.ssm_layers():
            def fwd(mod, hidden_states, cache_params=None, attention_mask=None, _layer=cache.ssm[idx], **kw):
                return self.mixer_forward(mod, hidden_states, _layer)

            forwards[idx] = fwd
        return self._routed(forwards)

    def _prompt_patched(self, scan: str):
        """For one prefill, route each SSM mixer whose op has a prompt layer (:data:`PROMPT_LAYERS`)
        that serves it to ``mixer_forward`` against that layer, its input padding masked as HF
        masks it; with ``scan == "hf"`` every mixer keeps transformers' forward."""
        forwards = {}
        place = self.placement
        spread = scan == "fla" and place.multi_device
        for idx, (mixer, op_name) in self.ssm_layers().items():
            make = PROMPT_LAYERS.get(op_name)
            # (flash-linear-attention runs on CUDA only: a mixer computing elsewhere takes the torch scan)
            mine = "torch" if spread and place.layers[idx].type != "cuda" else scan
            if make is None or scan == "hf" or not make.serves(mixer, mine):
                continue

            def fwd(mod, hidden_states, cache_params=None, attention_mask=None, _make=make, _scan=mine, **kw):
                layer = _make(mod, cache_params, attention_mask, _scan)
                return self.mixer_forward(mod, layer.mask_padding(hidden_states), layer)

            forwards[idx] = fwd
        return self._routed(forwards)

    #: keyword under which the decoder body takes its cache
    cache_arg = "past_key_values"
    #: whether the decoder body takes ``position_ids``
    uses_position_ids = True

    # --- family hooks -----------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on ``hidden [..., D]`` exactly as the family's ``ForCausalLM.forward`` applies it."""
        return self.lm_head(hidden)

    def step_attention_mask(self, cache: HybridCache, t: int):
        """What the body takes as ``attention_mask`` for ``t`` step tokens."""
        return self.attention_mask_arg(cache.attention_mask(t, self.dtype))

    def prompt_mask_arg(self, mask: torch.Tensor, padding: torch.Tensor):
        """What the body takes as ``attention_mask`` for a prompt forward given its additive
        attention mask ``mask [B, 1, L, L]`` and 2-D padding mask ``padding [B, L]`` (int64, 1 =
        token): :meth:`attention_mask_arg`'s dict, its SSM / conv layers given ``padding``."""
        return {k: padding if v is None else v for k, v in self.attention_mask_arg(mask).items()}

    def has_sliding_window(self) -> bool:
        """Whether an attention layer keeps a sliding window."""
        if not hasattr(self, "_sliding"):
            self._sliding = any(getattr(DynamicCache(config=self.config), "is_sliding", ()))
        return self._sliding

    @property
    def prompt_graphs(self):
        """This adapter's :class:`~specdec.models.prompt_graphs.PromptGraphs` (prompt forwards
        at bucketed shapes, captured as CUDA graphs on the ``"cuda_graph"`` prompt path)."""
        if self._prompt_graphs is None:
            from .prompt_graphs import PromptGraphs

            self._prompt_graphs = PromptGraphs(self)
        return self._prompt_graphs

    # --- body calls ---------------------------------------------------------------------------
    def _cache_keyword(self) -> str:
        """``cache_arg``, or ``cache`` where the body's forward takes that instead (transformers
        >= 5.24, where ``past_key_values`` / ``cache_params`` only warn)."""
        if not hasattr(self, "_cache_kw"):
            self._cache_kw = cache_keyword(self.body.forward, self.cache_arg)
        return self._cache_kw

    def _call_body(self, input_ids, attention_mask, position_ids, cache):
        kw = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": True, self._cache_keyword(): cache}
        if self.uses_position_ids:
            kw["position_ids"] = position_ids
        return self.body(**kw)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: HybridCache,
                all_hidden_states: bool = False, scan: str = "auto", prefix_cache: PrefixCache | None = None,
                max_tokens: int | None = None, prompt_path: str = "eager", rows=None):
        """Run the left-padded prompt ``[B, L]`` through the model's own forward and load ``cache``
        with every state each layer of HF's ``DynamicCache`` holds (attention KV, conv and
        recurrent state; a layer may hold both). With ``rows`` (``[B]`` distinct slots of
        ``cache``, host ints preferred: they are checked on the host) the prompts' states go
        into those rows of ``cache`` in place (:meth:`HybridCache.load_rows`: what a cache of
        their own then :meth:`HybridCache.reset_rows` would leave there; no step may be open)
        and its other rows keep theirs; without, ``cache`` holds the B prompts.

        Attention and short-conv layers run transformers' code; Mamba-2, Gated DeltaNet and
        Kimi Delta Attention mixers run their family's ``mixer_forward`` against a prompt layer
        (:data:`PROMPT_LAYERS`) whose scan ``scan`` picks: ``"auto"`` (flash-linear-attention for
        a bf16 / fp16 model on CUDA when installed, else ``"torch"``), ``"fla"``, ``"torch"``
        (:func:`specdec.kernels.mamba2.chunked.mamba2_chunk_scan`; for GDN / KDA transformers'
        torch reference of the chunked delta rule) or ``"hf"`` (transformers' own mixer forward).
        On a model whose layers spread over several devices, "on CUDA" means some layer or the LM head on CUDA,
        and a mixer computing on the CPU takes the torch scan where the others take fla's.

        Without ``prefix_cache``, a batch of more than ``max_tokens`` tokens (default
        :attr:`max_prefill_tokens`; rows x ``L``) runs in groups of rows of like lengths that fit
        it, each at its own width (its longest prompt), a single longer prompt in chunks of that
        many tokens; the states agree with one forward's up to the chunked scans' rounding (fp32:
        about 1e-6 relative).

        With ``prefix_cache`` (a :class:`specdec.prefix_cache.PrefixCache`) each prompt runs in
        one forward, or two where it makes a branch point (:meth:`prefill_cached`): its cached
        prefix is loaded instead of computed, its full blocks are stored, and the states of every
        row are then loaded into ``cache`` as a batched prefill leaves them (keys left-padded with
        zeros). Where :meth:`batches_cached_prefill` allows (Mamba-2, GDN and KDA families,
        attention-only models without sliding windows), the forwards of several prompts run together,
        left-padded, within ``max_tokens`` (:meth:`_prefill_cached_batch`); otherwise each prompt
        runs on its own (batch 1, no padding). The final state equals the uncached
        prefill's up to rounding (chunked scans with another chunking; fp32: about 1e-6
        relative); which rounding depends on where the forwards were cut, so on what the cache
        held (a hit loads bit for bit the state stored).

        ``prompt_path`` runs the forwards without ``prefix_cache`` (each group's, or the batch's)
        and, with it, the batched continued forwards (:meth:`_cached_forward`; a prompt continued
        on its own runs eagerly): ``"eager"`` at the prompts' own shape; ``"static"`` at a bucketed shape
        (:class:`~specdec.models.prompt_graphs.PromptGraphs`: rows and width rounded up, more left
        padding) where a bucket holds them; ``"cuda_graph"`` the same, each bucket captured as a
        CUDA graph from its second use (CUDA only; elsewhere, or when a capture fails, as
        ``"static"``). Forwards no bucket holds (too many rows or tokens, a long prompt's chunks,
        a family the buckets do not serve: :attr:`PromptGraphs.available`) run eagerly.

        Returns ``(logits [B, V] at the last position, last hidden state [B, D])``; with
        ``all_hidden_states`` the final hidden states of every position, ``[B, L, D]`` (zeros at
        padding with ``prefix_cache``).

        Raises:
            ValueError: ``scan`` is not one of the above, or ``"fla"`` without CUDA or fla;
                ``prompt_path`` is not one of :data:`PROMPT_PATHS`; ``rows`` as
                :meth:`HybridCache.load_rows` refuses them (checked before the forward).
        """
        slots = None
        if rows is not None:  # (before any work: a bad slot list wastes no forward)
            slots = cache.check_load_rows(rows)
            if len(slots) != input_ids.shape[0]:
                raise ValueError(f"prefill: {input_ids.shape[0]} prompts for {len(slots)} rows")
        if prompt_path not in PROMPT_PATHS:
            raise ValueError(f"prompt_path must be one of {PROMPT_PATHS}, got {prompt_path!r}")
        scan = resolve_scan(scan, self._scan_device, self.dtype)
        mask = attention_mask.to(torch.long)
        max_tokens = self.max_prefill_tokens if max_tokens is None else max_tokens
        groups = prefill_groups(mask, max_tokens) if prefix_cache is None else None
        if groups is not None:  # rows in groups within max_tokens
            rows = [self._prefill_rows(input_ids[g], mask[g], all_hidden_states, scan, max_tokens, prompt_path)
                    for g in groups]
            return self._load_rows(rows, mask, cache, all_hidden_states, torch.cat(groups), slots)
        if prefix_cache is None:
            bucketed = self._bucketed(input_ids, mask, scan, prompt_path, max_tokens)
            if bucketed is None:
                position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
                hf_cache = DynamicCache(config=self.config)
                hidden = self._prompt_forward(input_ids, mask, position_ids, hf_cache, scan)
                states = self._layer_states(hf_cache)
            else:  # views of the buckets' output buffers: loaded (copied) below, hidden states copied
                hidden, states = bucketed
                hidden = _left_pad(hidden, mask.shape[1], 1).clone() if all_hidden_states else hidden[:, -1:].clone()
        else:
            # the prompts' tokens on the host (the lookups' keys) in one transfer; a left-padded row's
            # prompt is its last columns (a row with other gaps: its masked tokens, indexed)
            L = mask.shape[1]
            host = torch.cat([input_ids, mask]).tolist()
            tokens, prompts = [], []
            for ids, m, row, row_mask in zip(host, host[len(input_ids):], input_ids, mask):
                n = sum(m)
                left = all(m[L - n:])
                tokens.append(ids[L - n:] if left else [t for t, keep in zip(ids, m) if keep])
                prompts.append(row[L - n:] if left else row[row_mask.bool()])
            if self.batches_cached_prefill(scan):
                rows = self._prefill_cached_batch(prompts, tokens, prefix_cache, all_hidden_states, scan, max_tokens,
                                                  prompt_path)
            else:
                rows = [self.prefill_cached(p, prefix_cache, all_hidden_states, scan) for p in prompts]
            return self._load_rows(rows, mask, cache, all_hidden_states, slots=slots)
        logits = self.logits(hidden[:, -1])
        self._load(cache, states, mask, slots)
        return logits, hidden if all_hidden_states else hidden[:, -1]

    def _bucketed(self, input_ids, mask, scan: str, prompt_path: str, max_tokens: int | None):
        """The prompt forward of ``input_ids [B, L]`` at its bucket's shape
        (:meth:`PromptGraphs.run`: views of shared buffers; the columns that are padding in
        every row left out, so hidden states and keys / values may be narrower than ``L``) on the
        ``"static"`` and ``"cuda_graph"`` prompt paths, or None (the eager path, or no bucket of
        at most ``max_tokens`` tokens holds it)."""
        if prompt_path == "eager":
            return None
        W = int(mask.sum(-1).max())  # columns of padding in every row are left out (left padding)
        if 0 < W < mask.shape[1]:
            input_ids, mask = input_ids[:, -W:], mask[:, -W:]
        out = self.prompt_graphs.run(input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), scan,
                                     graphs=prompt_path == "cuda_graph", max_tokens=max_tokens)
        return None if out is None else (out[0], out[2])

    def _prefill_rows(self, input_ids, mask, all_hidden_states: bool, scan: str, max_tokens: int,
                      prompt_path: str = "eager"):
        """One group of :meth:`prefill`'s rows (``[g, L]``, left-padded) in one forward at their own
        width (on ``prompt_path``, :meth:`prefill`), or, a single prompt longer than
        ``max_tokens``, in chunks (:meth:`_chunk_forwards`); returns ``(hidden, states)`` as
        :meth:`prefill_cached` does."""
        W = int(mask.sum(-1).max())
        input_ids, mask = input_ids[:, -W:], mask[:, -W:]  # (left padding: every token is in the last W columns)
        if input_ids.shape[0] == 1 and W > max_tokens:
            return _drain(self._chunk_forwards(input_ids[0], max_tokens, all_hidden_states, scan))
        bucketed = self._bucketed(input_ids, mask, scan, prompt_path, max_tokens)
        if bucketed is not None:  # copies: the next group's forward reuses the buffers
            hidden, states = bucketed
            names = ("keys", "values", "conv_state", "recurrent_state")
            states = {idx: LayerState(*(None if (t := getattr(st, n)) is None else t.clone() for n in names))
                      for idx, st in states.items()}
            return (hidden if all_hidden_states else hidden[:, -1:]).clone(), states
        hf_cache = DynamicCache(config=self.config)
        hidden = self._prompt_forward(input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), hf_cache, scan)
        return (hidden if all_hidden_states else hidden[:, -1:]), self._layer_states(hf_cache)

    def _load_rows(self, rows, mask: torch.Tensor, cache: HybridCache, all_hidden_states: bool,
                   order: torch.Tensor | None = None, slots=None):
        """Load ``cache`` with prompts prefilled in groups of rows: ``rows`` holds each group's
        ``(hidden, states)`` as :meth:`prefill_cached` returns them for one row, the groups
        holding the batch's rows ``order`` (int64 ``[B]``; default: in order), ``mask [B, L]``
        their left padding; ``slots``: the rows of ``cache`` they go to (:meth:`prefill`'s
        ``rows``; None: the whole cache). Returns :meth:`prefill`'s ``(logits, hidden)``."""
        hidden = torch.cat([_left_pad(h, mask.shape[1] if all_hidden_states else 1, 1) for h, _ in rows])
        states = _stack_rows([s for _, s in rows])
        if order is not None:  # back to the batch's order
            back = torch.empty_like(order)
            back[order] = torch.arange(order.numel(), device=order.device)
            back = back.to(hidden.device)
            hidden = hidden[back]
            names = ("keys", "values", "conv_state", "recurrent_state")
            states = {idx: LayerState(*(None if (t := getattr(st, n)) is None else t[back.to(t.device)] for n in names))
                      for idx, st in states.items()}
        self._load(cache, states, mask.to(torch.long), slots)
        return self.logits(hidden[:, -1]), hidden if all_hidden_states else hidden[:, -1]

    def prefill_chunked(self, tokens: torch.Tensor, cache: HybridCache, chunk_tokens: int,
                        all_hidden_states: bool = False, scan: str = "auto", prefix_cache: PrefixCache | None = None):
        """A generator that prefills one prompt ``tokens [L]`` (int64, no padding) in forwards of
        at most ``chunk_tokens`` tokens, each continuing HF's cache where the last one ended (as
        :meth:`prefill_cached` continues a cached prefix), so a caller can run other work between
        them (continuous batching: the decode steps of the other rows). It yields after every
        forward but the last; then it loads ``cache`` (batch 1) and returns :meth:`prefill`'s
        ``(logits [1, V], hidden)``. The final state equals one forward's up to the chunked
        scans' rounding (fp32: about 1e-6 relative), as with :meth:`prefill_cached`. With
        ``prefix_cache``, :meth:`prefill_cached_steps` runs it (its hit loaded, its forwards cut
        into chunks of whole blocks).

        Raises:
            ValueError: ``chunk_tokens`` < 1, an empty prompt, ``scan`` as :meth:`prefill`."""
        if chunk_tokens < 1 or tokens.dim() != 1 or tokens.shape[0] == 0:
            raise ValueError(f"prefill_chunked needs a non-empty 1-D prompt and chunk_tokens >= 1, got "
                             f"{tuple(tokens.shape)} and {chunk_tokens}")
        return self._prefill_chunks(tokens, cache, chunk_tokens, all_hidden_states,
                                    resolve_scan(scan, self._scan_device, self.dtype), prefix_cache)

    @torch.no_grad()
    def _prefill_chunks(self, tokens: torch.Tensor, cache: HybridCache, chunk_tokens: int, all_hidden_states: bool,
                        scan: str, prefix_cache: PrefixCache | None):
        """:meth:`prefill_chunked`'s generator, its arguments checked (raising at the call, not at
        the first ``next``)."""
        mask = torch.ones(1, tokens.shape[0], dtype=torch.long, device=tokens.device)
        if prefix_cache is not None:
            row = yield from self.prefill_cached_steps(tokens, prefix_cache, all_hidden_states, scan, chunk_tokens)
        else:
            row = yield from self._chunk_forwards(tokens, chunk_tokens, all_hidden_states, scan)
        return self._load_rows([row], mask, cache, all_hidden_states)

    def _chunk_forwards(self, tokens: torch.Tensor, chunk_tokens: int, all_hidden_states: bool, scan: str):
        """A generator: one prompt ``tokens [L]`` in forwards of at most ``chunk_tokens`` tokens,
        each continuing HF's cache; yields after every forward but the last and returns ``(hidden,
        states)`` as :meth:`prefill_cached` does."""
        L, dev = tokens.shape[0], tokens.device
        hf_cache = DynamicCache(config=self.config)
        hidden = []
        for start in range(0, L, chunk_tokens):
            end = min(L, start + chunk_tokens)
            out = self._prompt_forward(tokens[None, start:end], torch.ones(1, end, dtype=torch.long, device=dev),
                                       torch.arange(start, end, device=dev)[None], hf_cache, scan)
            if all_hidden_states or end == L:
                hidden.append(out)
            if end < L:
                yield
        hidden = torch.cat(hidden, dim=1) if all_hidden_states else hidden[-1][:, -1:]
        return hidden, self._layer_states(hf_cache)

    def prefill_cached(self, tokens: torch.Tensor, prefix_cache: PrefixCache, all_hidden_states: bool = False,
                       scan: str = "torch") -> tuple[torch.Tensor, dict[int, LayerState]]:
        """One prompt ``tokens [L]`` (int64, no padding) through the model with ``prefix_cache``:
        its hit (:meth:`PrefixCache.match`: the longest cached run of full blocks whose last block
        holds SSM state, at most ``L - 1`` tokens) is loaded into a fresh ``DynamicCache`` and the
        rest runs in the forwards the match plans (one; two when the cached blocks go past the hit:
        the first ends at a branch point). Every full block a forward runs is stored with its keys
        / values (and hidden states with ``all_hidden_states``), the block a forward ends on also
        with every SSM layer's state (:meth:`PrefixCache.insert`). ``scan`` as :meth:`prefill`
        takes it, resolved.

        Returns ``(hidden, states)``: the final hidden states ``[1, L, D]`` of every position with
        ``all_hidden_states`` (cached positions from the cache), else of the last one ``[1, 1,
        D]``; and each layer's state after the prompt, as :meth:`prefill` reads HF's cache.
        """
        return _drain(self.prefill_cached_steps(tokens, prefix_cache, all_hidden_states, scan))

    def prefill_cached_steps(self, tokens: torch.Tensor, prefix_cache: PrefixCache, all_hidden_states: bool = False,
                             scan: str = "torch", chunk_tokens: int | None = None):
        """:meth:`prefill_cached` as a generator that yields between its forwards and returns what
        it returns. With ``chunk_tokens``, each forward it plans is cut at block boundaries into
        forwards of at most ``max(block_size, chunk_tokens rounded down to whole blocks)``
        tokens; the cache stores what the uncut forwards store (SSM state at their ends)."""
        bs = prefix_cache.block_size
        row = self._cached_row(tokens, tokens.tolist(), prefix_cache, all_hidden_states)
        hf_cache = _KVRecordingCache(self.config)
        self._restore(hf_cache, [row.state], row.start)
        ends, cut = [], None if chunk_tokens is None else max(bs, chunk_tokens - chunk_tokens % bs)
        for planned in row.ends:
            from_ = ends[-1] if ends else row.start
            ends += ([] if cut is None else list(range(from_ + cut, planned, cut))) + [planned]
        for end in ends:
            if end != ends[0]:
                yield
            start, dev = row.start, tokens.device
            hf_cache.new_kv.clear()
            out = self._prompt_forward(tokens[None, start:end], torch.ones(1, end, dtype=torch.long, device=dev),
                                       torch.arange(start, end, device=dev)[None], hf_cache, scan)
            if all_hidden_states or end == tokens.shape[0]:
                row.hidden.append(out)
            self._store_blocks(prefix_cache, row, end, _stack_kv(hf_cache.new_kv), 0, out, 0,
                               lambda: self._layer_states(hf_cache, keys=False), all_hidden_states)
            row.start = end
        row.state = self._layer_states(hf_cache)
        return row.result(all_hidden_states)

    def _cached_row(self, tokens: torch.Tensor, ids: list[int], prefix_cache: PrefixCache,
                    all_hidden_states: bool) -> _CachedRow:
        """Look ``tokens [L]`` (``ids``: the same on the host) up in ``prefix_cache``
        (:meth:`PrefixCache.match`): the prompt's :class:`_CachedRow` at its hit, its state and
        hidden states those of the hit blocks."""
        found = prefix_cache.match(ids, all_hidden_states)
        chain = found.chain[:found.hit]
        hidden = [e.block.hidden_states for e in chain] if all_hidden_states else []
        return _CachedRow(tokens, ids, found, chain, found.hit * prefix_cache.block_size, list(found.forward_ends),
                          _prefix_state([e.block for e in chain]), hidden)

    def _store_blocks(self, prefix_cache: PrefixCache, row: _CachedRow, end: int, kv: list, b: int,
                      out: torch.Tensor, offset: int, end_state, all_hidden_states: bool) -> None:
        """Store in ``prefix_cache`` every full block of ``row`` that its forward from ``row.start``
        (a block boundary) to ``end`` ran, after ``row.chain`` (:meth:`PrefixCache.insert`):
        ``kv`` (:func:`_stack_kv` of the forward's keys / values, row ``b``) and ``out [1, t, D]``
        (the row's final hidden states) hold position ``row.start`` at column ``offset``;
        ``end_state()`` gives every SSM layer's state at ``end`` (:meth:`_layer_states` with
        ``keys=False``), which the block ending there holds when a planned forward ends there
        (``row.found.forward_ends``; a model without SSM layers: every block holds ``{}``). A new
        block's keys / values are copied once per group of :func:`_stack_kv` (each layer's a view
        of that copy); blocks the lookup found stored keep theirs, so theirs are not copied.
        Stops at the first block not stored (``row.storing``)."""
        bs = prefix_cache.block_size
        first, last = row.start // bs, end // bs
        if not row.storing or first == last:
            return
        every_block_state = {} if not self.ssm_layers() else None  # no SSM layer: every boundary is a state
        blocks = [(names, data[:, b:b + 1, :, offset:offset + (last - first) * bs].split(bs, dim=3)) for names, data in kv]
        for i, j in enumerate(range(first, last)):
            if not row.storing:
                break
            new = j >= len(row.found.chain)
            layers: dict[int, dict[str, torch.Tensor]] = {}
            for names, data in blocks:
                block_kv = data[i].clone(memory_format=torch.contiguous_format) if new else data[i]
                for (idx, name), t in zip(names, block_kv.unbind(0)):
                    layers.setdefault(idx, {})[name] = t
            state = end_state() if (j + 1) * bs == end and end in row.found.forward_ends else every_block_state
            lo = i * bs + offset  # the block's columns in this forward
            block = PrefixBlock({idx: LayerState(t["keys"], t["values"]) for idx, t in layers.items()}, state,
                                out[:, lo:lo + bs] if all_hidden_states else None)
            row.storing = prefix_cache.insert(row.chain, row.ids[j * bs:(j + 1) * bs], block, kv_copied=new) is not None

    def batches_cached_prefill(self, scan: str) -> bool:
        """Whether :meth:`prefill` with a prefix cache runs several prompts in one forward
        (left-padded, each continued from its own hit): every SSM layer runs a prompt layer
        whose left padding is state-neutral (``state_neutral_padding``, as
        :class:`~specdec.models.prompt_layer.PromptLayer`s; so not with ``scan == "hf"``) and no
        attention layer keeps a sliding window (padding inside a row would count in it).
        Short-conv layers (LFM2) run transformers' code, whose padding is not state-neutral:
        their prompts run one at a time (:meth:`prefill_cached`)."""
        ssm = self.ssm_layers()
        if ssm and (scan == "hf" or not all(getattr(PROMPT_LAYERS.get(op), "state_neutral_padding", False)
                                            and PROMPT_LAYERS[op].serves(mixer, scan) for mixer, op in ssm.values())):
            return False
        return not self.has_sliding_window()

    def _prefill_cached_batch(self, prompts: list[torch.Tensor], tokens: list[list[int]], prefix_cache: PrefixCache,
                              all_hidden_states: bool, scan: str, max_tokens: int | None,
                              prompt_path: str = "eager") -> list[tuple[torch.Tensor, dict[int, LayerState]]]:
        """:meth:`prefill_cached` of each of ``prompts`` (``[L_i]`` int64, no padding; ``tokens``:
        the same as host lists), with their forwards run together:
        returns what it returns for each, and (while nothing is evicted) the cache stores what it
        stores when run on them in order.

        Prompts run in rounds; a round looks its prompts up in order and runs in waves: wave k
        runs each prompt's k-th forward (:attr:`PrefixMatch.forward_ends`; a branch point makes
        two), left-padded, in groups of at most ``max_tokens`` tokens (rows x widest forward,
        :func:`prefill_groups`; None: one group), each group one forward
        (:meth:`_cached_forward`). A prompt waits for a later round when what the cache finds
        for it depends on what an earlier prompt of the batch stores: it shares more leading
        blocks with an earlier prompt of this round than that one hit (that one stores blocks or
        states it would find), or shares a block with a prompt already waiting. So each lookup
        finds what it finds after the earlier prompts' prefills, as one at a time. Under the
        cache's byte bound a round's lookups all precede its inserts, so an insert can evict a
        block a later prompt of the round already matched: that prompt still runs from the states
        it loaded (the result is the same), but what the cache holds and counts afterwards can
        differ from an in-order run's.

        The states equal :meth:`prefill_cached`'s up to the chunked scans' rounding (fp32: about
        1e-6 relative): padding is state-neutral (:meth:`batches_cached_prefill`)."""
        bs = prefix_cache.block_size
        results = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            rows, waiting = {}, []
            for k in pending:
                limit = (len(tokens[k]) - 1) // bs  # the most blocks a lookup of k finds
                if any(_shared_blocks(tokens[k], tokens[i], bs) for i in waiting) or any(
                        min(_shared_blocks(tokens[k], tokens[i], bs), limit) > row.found.hit for i, row in rows.items()):
                    waiting.append(k)
                else:
                    rows[k] = self._cached_row(prompts[k], tokens[k], prefix_cache, all_hidden_states)
            wave = list(rows.values())
            while wave:
                lengths = [row.ends[0] - row.start for row in wave]
                width = max(lengths)
                groups = None
                if max_tokens is not None and len(wave) * width > max_tokens:  # (else one group)
                    groups = [g.tolist() for g in prefill_groups(
                        torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None], max_tokens)]
                for group in (groups or [range(len(wave))]):
                    self._cached_forward([wave[i] for i in group], prefix_cache, all_hidden_states, scan,
                                         prompt_path, max_tokens)
                wave = [row for row in wave if row.ends]
            for k, row in rows.items():
                results[k] = row.result(all_hidden_states)
            pending = waiting
        return results

    def _cached_forward(self, rows: list[_CachedRow], prefix_cache: PrefixCache, all_hidden_states: bool,
                        scan: str, prompt_path: str = "eager", max_tokens: int | None = None) -> None:
        """The next forward of each of ``rows`` in one forward of the body: each row's state
        (``row.state``, at ``row.start``) loaded into a fresh HF cache, keys / values left-padded
        to the longest row's prefix ``P``; its tokens ``row.start .. row.ends[0]`` left-padded to
        the widest ``T``; the 2-D mask ``[B, P + T]`` zero at both paddings, position ids from
        each row's own start. Then, per row, as :meth:`prefill_cached_steps` after a forward: its
        full blocks stored (:meth:`_store_blocks`), its hidden states kept, ``row.state`` (keys /
        values of its real columns only), ``row.start`` and ``row.ends`` advanced. On the
        ``"static"`` / ``"cuda_graph"`` prompt paths (:meth:`prefill`) the forward runs at a
        bucketed shape (:meth:`PromptGraphs.run`, its prefix columns left-padded further) where a
        bucket of at most ``max_tokens`` tokens holds it."""
        dev = rows[0].tokens.device
        lengths = [row.ends[0] - row.start for row in rows]
        T = max(lengths)
        kv = any(st.keys is not None for row in rows for st in row.state.values())
        P = max(row.start for row in rows) if kv else 0  # attention columns before the forward's
        ids = torch.zeros(len(rows), T, dtype=torch.long, device=dev)
        mask = torch.zeros(len(rows), P + T, dtype=torch.long, device=dev)
        positions = torch.zeros(len(rows), T, dtype=torch.long, device=dev)
        for b, (row, n) in enumerate(zip(rows, lengths)):
            ids[b, T - n:] = row.tokens[row.start:row.start + n]
            mask[b, P - min(row.start, P):P] = 1  # (P = 0 for a model without attention layers)
            mask[b, P + T - n:] = 1
            positions[b, T - n:] = torch.arange(row.start, row.start + n, device=dev)
        got = None
        if prompt_path != "eager":  # copies: rows keep views of the states and hidden states
            got = self.prompt_graphs.run(ids, mask, positions, scan, graphs=prompt_path == "cuda_graph",
                                         max_tokens=max_tokens, restore=self._restored([row.state for row in rows], P),
                                         copy=True)
        if got is None:
            hf_cache = _KVRecordingCache(self.config)
            self._restore(hf_cache, [row.state for row in rows], P)
            out = self._prompt_forward(ids, mask, positions, hf_cache, scan)
            new_kv, final = hf_cache.new_kv, self._layer_states(hf_cache)
        else:
            out, new_kv, final = got
        kv_new = _stack_kv(new_kv)
        # each row's state, split once per tensor: keys / values at the row's real columns, right-aligned
        prefix = [min(row.start, P) for row in rows]
        W = max(a + n for a, n in zip(prefix, lengths))
        index, pad = _right_aligned(prefix, lengths, P, T, dev)

        where = {dev: (index, pad)}  # (the gather's index and padding on each layer's device, copied once)

        def split(t, name):
            if t is None:
                return (None,) * len(rows)
            if name in ("keys", "values"):
                if t.device not in where:
                    where[t.device] = tuple(None if x is None else x.to(t.device) for x in (index, pad))
                t = _gather_columns(t, *where[t.device], W)
            return t.split(1) if len(rows) > 1 else (t,)

        names = ("keys", "values", "conv_state", "recurrent_state")
        per_row = {idx: [split(getattr(st, name), name) for name in names] for idx, st in final.items()}
        at_end = {idx: st for idx, st in final.items() if st.conv_state is not None or st.recurrent_state is not None}

        def end_state(b):  # the SSM layers' states at the forward's end
            return {idx: _row_state(st, b) for idx, st in at_end.items()}

        for b, (row, n) in enumerate(zip(rows, lengths)):
            end, off = row.ends.pop(0), T - n
            if all_hidden_states or end == row.tokens.shape[0]:
                row.hidden.append(out[b:b + 1, off:])
            self._store_blocks(prefix_cache, row, end, kv_new, b, out[b:b + 1], off, lambda b=b: end_state(b),
                               all_hidden_states)
            row.state = {idx: LayerState(*(ts[b] for ts in parts)) for idx, parts in per_row.items()}
            row.start = end

    def _prompt_forward(self, input_ids, mask, position_ids, hf_cache, scan: str) -> torch.Tensor:
        """The body on prompt tokens ``input_ids [B, t]`` with HF's cache ``hf_cache`` (prompt
        layers routed as ``scan`` says; on the Triton backend, unless ``scan`` is ``"hf"`` or
        :func:`~specdec.fusion.prompt_kernels_enabled` says not, the decoder's RMSNorms and MLP
        activations in one launch each, :func:`~specdec.models.common.prompt_kernels`); returns the final hidden states ``[B, t, D]``."""
        place = self.placement
        use = scan != "hf" and any(backend(dev) == "triton" for dev in place.devices) and prompt_kernels_enabled()
        routes = self._prompt_routes() if use else ([], [])
        if use and place.multi_device:
            # only modules of decoder layers computing where the Triton backend serves: their layer's
            # device is current while they run (spread_layers), a module outside them (the final
            # norm) may compute on another device than the current one, and a CPU module keeps its
            # forward (the kernels are Triton's)
            served = {id(mod) for layer, dev in zip(self.body.layers, place.layers) if backend(dev) == "triton"
                      for mod in layer.modules()}
            routes = tuple([(mod, form) for mod, form in found if id(mod) in served] for found in routes)
        # quiet: on CPU, no notes about GPU-only kernel packages; no cuDNN attention (a plan per prompt shape)
        with (quiet_transformers(self.device), self._prompt_patched(scan), sdpa_without_cudnn(self._scan_device),
              prompt_kernels(*routes), spread_layers(self.body.layers, place)):
            hidden = self._call_body(input_ids, mask, position_ids, hf_cache).last_hidden_state
        return hidden.to(place.home) if place.multi_device else hidden

    def _prompt_routes(self) -> tuple[list, list]:
        """``(norms, mlps)`` for :func:`~specdec.models.common.prompt_kernels`: the modules found at
        the first prompt (every module of the model read once), their forms and plans read anew at
        each call (so an MLP whose projection was replaced or hooked since runs its own forward)."""
        if self._prompt_modules is None:
            self._prompt_modules = ([m for m, _ in plain_norms(self.model.modules())],
                                    [m for m, _ in prompt_mlps(self.model.modules())])
        norms, mlps = self._prompt_modules
        return plain_norms(norms), prompt_mlps(mlps)

    def _layer_states(self, hf_cache, keys: bool = True) -> dict[int, LayerState]:
        """Each layer's state in HF's cache (``{layer index: LayerState}``, layers holding nothing
        left out); with ``keys=False`` only the SSM layers' conv window and recurrent state."""
        states = {}
        for idx, layer in enumerate(hf_cache.layers):
            k = getattr(layer, "keys", None) if keys else None
            k = k if k is not None and k.numel() > 0 else None
            v = layer.values if k is not None else None
            conv = (getattr(layer, "conv_states", None) or {}).get(0)
            rec = (getattr(layer, "recurrent_states", None) or {}).get(0)
            if any(t is not None for t in (k, conv, rec)):
                states[idx] = LayerState(k, v, conv, rec)
        return states

    def _restore(self, hf_cache, states: list[dict[int, LayerState]], width: int) -> None:
        """Load into the fresh ``hf_cache`` the batch of rows whose layer states are ``states``
        (one dict per row, as :func:`_prefix_state` builds them; ``{}``: a row starting from
        nothing): every attention layer's keys / values left-padded with zeros to ``width``
        columns, every SSM layer's conv window and recurrent state (zeros for a row without);
        HF's layers then continue from it. Nothing is loaded when no row holds a state."""
        for idx, st in self._restored(states, width).items():
            if st.keys is not None:
                hf_cache.update(st.keys, st.values, idx)
            if st.conv_state is not None:
                hf_cache.update_conv_state(st.conv_state, idx, conv_kernel_size=st.conv_state.shape[-1])
            if st.recurrent_state is not None:
                hf_cache.update_recurrent_state(st.recurrent_state, idx)

    @staticmethod
    def _restored(states: list[dict[int, LayerState]], width: int) -> dict[int, LayerState]:
        """The batch :meth:`_restore` loads: per layer, the rows' keys / values left-padded with
        zeros to ``width`` columns (none when ``width`` is 0) and their conv windows and
        recurrent states, stacked (zeros for a row without; one row: its own tensors, no copy)."""
        shapes: dict[int, LayerState] = {}
        for st in states:
            for idx, layer in st.items():
                shapes.setdefault(idx, layer)
        out = {}
        for idx, ref in shapes.items():
            def stack(name, pad=False):
                if getattr(ref, name) is None or (pad and not width):
                    return None
                ts = [getattr(st[idx], name) if idx in st else torch.zeros_like(getattr(ref, name)) for st in states]
                ts = [_left_pad(t, width, 2) for t in ts] if pad else ts
                return torch.cat(ts) if len(ts) > 1 else ts[0]

            out[idx] = LayerState(stack("keys", True), stack("values", True), stack("conv_state"),
                                  stack("recurrent_state"))
        return out

    def _load(self, cache: HybridCache, states: dict[int, LayerState], mask: torch.Tensor, rows=None) -> None:
        """Load ``cache`` with the prefill's layer ``states`` (batched as HF's cache holds them) of
        the left-padded prompts whose mask is ``mask [B, L]``; with ``rows``, those rows of
        ``cache`` only (:meth:`HybridCache.load_rows`)."""
        L = mask.shape[1]
        ssm = self.ssm_layers()
        if rows is not None:
            cache.load_rows(rows, L, (L - mask.sum(-1)),
                            {idx: (_left_pad(st.keys, L, 2), _left_pad(st.values, L, 2))
                             for idx, st in states.items() if st.keys is not None},
                            {idx: (st.conv_state, st.recurrent_state, self.conv_width(ssm[idx][0]))
                             for idx, st in states.items() if idx in ssm})
            return
        cache.pad = (L - mask.sum(-1)).to(cache.device)
        cache.seq_len = torch.full_like(cache.pad, L)
        cache.refresh_mirrors()
        for idx, state in states.items():
            if idx in ssm:
                with on_device(cache.ssm[idx].device):  # (None unless the layers spread)
                    cache.ssm[idx].load(state.conv_state, state.recurrent_state, self.conv_width(ssm[idx][0]))
            if state.keys is not None:  # a sliding-window layer keeps only its last columns
                cache.load_kv(idx, _left_pad(state.keys, L, 2), _left_pad(state.values, L, 2))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: HybridCache):
        """Run ``t`` more step tokens ``input_ids [B, t]`` through the model's own decoder layers with
        ``cache``; returns ``(logits [B, t, V], hidden [B, t, D])``."""
        t = input_ids.shape[1]
        # a growing cache reads one more KV column each step: no cuDNN attention (a plan per shape)
        backends = contextlib.nullcontext() if cache.static else sdpa_without_cudnn(
            self.device if cache.layer_devices is None else self._scan_device)
        spread = spread_layers(self.body.layers, self.placement) if cache.layer_devices is not None \
            else contextlib.nullcontext()
        with self._patched(cache), grouped_step_attention_for(self._grouped_attention), backends, spread:
            out = self._call_body(input_ids, self.step_attention_mask(cache, t), cache.position_ids(t), cache)
        cache.advance(t)
        hidden = out.last_hidden_state
        if cache.layer_devices is not None:  # (the final norm may compute elsewhere)
            hidden = hidden.to(cache.device)
        return self.logits(hidden), hidden
