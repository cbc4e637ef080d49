"""Attention-only causal LMs (Llama, Mistral, Qwen2/Qwen3, ...): no SSM layer, so rollback is the
KV length alone (the static KV cache masks and later overwrites rejected columns).

The body is called with one 4-D mask when all layers share an attention type (what
``create_causal_mask`` / ``create_sliding_window_causal_mask`` return unchanged), or with the
per-type dict for models that mix full and sliding-window layers.
"""

from __future__ import annotations

from .base import HybridAdapter, register
from .common import layer_types_of

__all__ = ["AttentionOnlyAdapter", "ATTENTION_MODEL_TYPES"]

#: model types whose ForCausalLM is ``lm_head(model(...))`` over a plain attention decoder
ATTENTION_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2", "granite",
)
_SUPPORTED_KINDS = ("full_attention", "sliding_attention")


@register
class AttentionOnlyAdapter(HybridAdapter):
    """Attention-only decoders: no SSM layer; sliding-window layers get a sliding mask."""

    model_types = ATTENTION_MODEL_TYPES

    def __init__(self, model):
        super().__init__(model)
        self._types = layer_types_of(self.config)
        bad = sorted(set(self._types) - set(_SUPPORTED_KINDS))
        if bad:
            raise ValueError(
                f"{type(model).__name__} has attention layer types {bad}; specdec supports {list(_SUPPORTED_KINDS)}"
            )
        self._window = getattr(self.config, "sliding_window", None)

    def mixer_forward(self, mixer, hidden_states, layer):  # pragma: no cover - no SSM layers
        raise RuntimeError("attention-only models have no SSM mixer")

    def logits(self, hidden):
        logits = self.lm_head(hidden)
        if self.config.model_type == "granite":
            logits = logits / self.config.logits_scaling
        return logits

    def step_attention_mask(self, cache, t):
        masks = {}
        if "full_attention" in self._types:
            masks["full_attention"] = cache.attention_mask(t, self.dtype)
        if "sliding_attention" in self._types:
            masks["sliding_attention"] = cache.sliding_mask(t, int(self._window), self.dtype)
        if len(masks) == 1:
            return next(iter(masks.values()))
        return masks
