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
import types

import torch
from transformers import DynamicCache

from ..cache import HybridCache, SSMLayerCache
from ..kernels import get_op
from ..kernels.mamba2.chunked import resolve_scan
from ..quiet import quiet_transformers
from ..rollback import RollbackStrategy

__all__ = ["HybridAdapter", "ADAPTERS", "PROMPT_LAYERS", "register", "adapter_for", "supported_families"]

ADAPTERS: dict[str, type["HybridAdapter"]] = {}

#: op name -> the layer class a family's ``mixer_forward`` runs against during prefill, built as
#: ``cls(mixer, cache_params, attention_mask, scan)`` (the Mamba-2 op:
#: :class:`specdec.models.mamba2.Mamba2PromptLayer`); the mixers of other ops run transformers'
#: own forward during prefill
PROMPT_LAYERS: dict[str, type] = {}


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
        self.vocab_size = int(self.lm_head.out_features if hasattr(self.lm_head, "out_features") else self.config.vocab_size)

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
        return self.lm_head.weight.device

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def new_cache(self, batch: int, max_len: int, max_step_tokens: int, strategy: RollbackStrategy,
                  static: bool = False) -> HybridCache:
        cache = HybridCache(batch, max_len, max_step_tokens, self.dtype, self.device, static=static)
        for idx, (_, op_name) in self.ssm_layers().items():
            cache.ssm[idx] = SSMLayerCache(get_op(op_name, self.device), strategy, batch, max_step_tokens, idx)
        return cache

    @contextlib.contextmanager
    def _routed(self, forwards: dict):
        """Replace SSM mixer ``idx``'s forward by ``forwards[idx](mixer, hidden_states,
        cache_params=None, attention_mask=None, **kw)`` for one call; HF's cache reaches it as
        ``cache_params`` whatever keyword the release passes it under (``cache_params``; ``cache``
        from transformers 5.24)."""
        mixers = self.ssm_layers()
        patched = []

        def route(fwd):
            def call(mod, hidden_states, cache_params=None, attention_mask=None, **kw):
                for name in ("cache", "past_key_values"):
                    other = kw.pop(name, None)
                    if cache_params is None:
                        cache_params = other
                return fwd(mod, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kw)
            return call

        try:
            for idx, fwd in forwards.items():
                mixer = mixers[idx][0]
                mixer.forward = types.MethodType(route(fwd), mixer)
                patched.append(mixer)
            yield
        finally:
            for mixer in patched:
                del mixer.forward

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
        to ``mixer_forward`` against that layer, its input padding masked as HF masks it; with
        ``scan == "hf"`` every mixer keeps transformers' forward."""
        forwards = {}
        for idx, (_, op_name) in self.ssm_layers().items():
            make = PROMPT_LAYERS.get(op_name)
            if make is None or scan == "hf":
                continue

            def fwd(mod, hidden_states, cache_params=None, attention_mask=None, _make=make, **kw):
                layer = _make(mod, cache_params, attention_mask, scan)
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

    # --- body calls ---------------------------------------------------------------------------
    def _cache_keyword(self) -> str:
        """``cache_arg``, or ``cache`` where the body's forward takes that instead (transformers
        >= 5.24, where ``past_key_values`` / ``cache_params`` only warn)."""
        if not hasattr(self, "_cache_kw"):
            import inspect

            params = inspect.signature(self.body.forward).parameters
            self._cache_kw = self.cache_arg if self.cache_arg in params or "cache" not in params else "cache"
        return self._cache_kw

    def _call_body(self, input_ids, attention_mask, position_ids, cache):
        kw = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": True, self._cache_keyword(): cache}
        if self.uses_position_ids:
            kw["position_ids"] = position_ids
        return self.body(**kw)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: HybridCache,
                all_hidden_states: bool = False, scan: str = "auto"):
        """Run the left-padded prompt ``[B, L]`` through the model's own forward and load ``cache``
        with every state each layer of HF's ``DynamicCache`` holds (attention KV, conv and
        recurrent state; a layer may hold both).

        Attention, GDN and KDA layers run transformers' code (its chunked kernels, or
        flash-linear-attention's when installed); Mamba-2 mixers run their family's
        ``mixer_forward`` against a prompt layer (:data:`PROMPT_LAYERS`) whose scan ``scan`` picks:
        ``"auto"`` (flash-linear-attention for a bf16 / fp16 model on CUDA when installed, else
        ``"torch"``), ``"fla"``, ``"torch"``
        (:func:`specdec.kernels.mamba2.chunked.mamba2_chunk_scan`) or ``"hf"`` (transformers' own
        mixer forward).

        Returns ``(logits [B, V] at the last position, last hidden state [B, D])``; with
        ``all_hidden_states`` the final hidden states of every position, ``[B, L, D]``.

        Raises:
            ValueError: ``scan`` is not one of the above, or ``"fla"`` without CUDA or fla.
        """
        scan = resolve_scan(scan, self.device, self.dtype)
        mask = attention_mask.to(torch.long)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        hf_cache = DynamicCache(config=self.config)
        # quiet: on CPU, no notes about GPU-only kernel packages
        with quiet_transformers(self.device), self._prompt_patched(scan):
            out = self._call_body(input_ids, mask, position_ids, hf_cache)
        hidden = out.last_hidden_state[:, -1]
        logits = self.logits(hidden)
        if all_hidden_states:
            hidden = out.last_hidden_state
        L = input_ids.shape[1]
        cache.pad = (L - mask.sum(-1)).to(cache.device)
        cache.seq_len = torch.full_like(cache.pad, L)
        ssm = self.ssm_layers()
        for idx, hf_layer in enumerate(hf_cache.layers):
            if idx in ssm:
                convs = getattr(hf_layer, "conv_states", None) or {}
                states = getattr(hf_layer, "recurrent_states", None) or {}
                cache.ssm[idx].load(convs.get(0), states.get(0), self.conv_width(ssm[idx][0]))
            keys = getattr(hf_layer, "keys", None)
            if keys is not None and keys.numel() > 0:
                values = hf_layer.values
                if keys.shape[2] < L:  # a sliding-window layer keeps only its last columns
                    keys = torch.cat([keys.new_zeros(*keys.shape[:2], L - keys.shape[2], keys.shape[3]), keys], 2)
                    values = torch.cat(
                        [values.new_zeros(*values.shape[:2], L - values.shape[2], values.shape[3]), values], 2
                    )
                cache.load_kv(idx, keys, values)
        return logits, hidden

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: HybridCache):
        """Run ``t`` more step tokens ``input_ids [B, t]`` through the model's own decoder layers with
        ``cache``; returns ``(logits [B, t, V], hidden [B, t, D])``."""
        t = input_ids.shape[1]
        with self._patched(cache):
            out = self._call_body(input_ids, self.step_attention_mask(cache, t), cache.position_ids(t), cache)
        cache.advance(t)
        hidden = out.last_hidden_state
        return self.logits(hidden), hidden
