"""Shared machinery for the adapters beyond the core four (:mod:`specdec.models.base`).

:class:`FamilyAdapter` generalises :class:`~specdec.models.base.HybridAdapter` along the axes in
which the Hugging Face families differ *outside* their SSM mixer:

* how the decoder body is called (``cache_arg``: ``past_key_values`` or Mamba2's
  ``cache_params``; ``uses_position_ids``; :meth:`step_attention_mask` for what the body takes as
  ``attention_mask`` during a step: a per-layer-type dict, a single 4-D mask, or None);
* layers that hold *both* an attention KV cache and SSM state (Falcon-H1's parallel blocks,
  Zamba2's hybrid layers with the shared attention block): prefill loads every state a layer
  of HF's ``DynamicCache`` holds, not one or the other;
* the LM head (:meth:`logits`: Falcon-H1's ``lm_head_multiplier``, Granite's ``logits_scaling``);
* sliding-window attention layers (:meth:`sliding_mask`).

The mixers themselves stay in the family modules and call the shared ops through
``layer.conv`` / ``layer.ssm``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..cache import HybridCache
from .base import HybridAdapter

__all__ = ["FamilyAdapter", "layer_types_of"]


def layer_types_of(config) -> list[str]:
    """Per-layer attention type as transformers' ``DynamicCache`` infers it (``layer_types``, else
    ``sliding_attention`` everywhere when ``sliding_window`` is set, else ``full_attention``)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    n = config.num_hidden_layers
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


class FamilyAdapter(HybridAdapter):
    """Base of the extra family adapters (see the module docstring)."""

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

    def sliding_mask(self, cache: HybridCache, t: int, window: int) -> torch.Tensor:
        """Additive ``[B, 1, t, end]`` mask of a sliding-window layer: as the causal mask, and a step
        token at column ``q`` sees only columns ``c > q - window`` (transformers' sliding overlay)."""
        mask = cache.attention_mask(t, self.dtype)
        end = mask.shape[-1]
        cols = torch.arange(end, device=cache.device)[None, None, :]
        q = (cache.seq_len[:, None] + cache.step_tokens + torch.arange(t, device=cache.device)[None, :])[:, :, None]
        too_old = cols <= q - window
        return mask.masked_fill(too_old[:, None], torch.finfo(self.dtype).min)

    # --- body calls ---------------------------------------------------------------------------
    def _cache_keyword(self) -> str:
        """``cache_arg``, or ``cache`` where the body's forward takes that instead (transformers 5.24
        renamed ``past_key_values`` / ``cache_params`` to ``cache``; the old names only warn there)."""
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
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: HybridCache):
        """As :meth:`HybridAdapter.prefill`, loading every state each HF cache layer holds."""
        mask = attention_mask.to(torch.long)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        hf_cache = DynamicCache(config=self.config)
        out = self._call_body(input_ids, mask, position_ids, hf_cache)
        hidden = out.last_hidden_state[:, -1]
        logits = self.logits(hidden)
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
        t = input_ids.shape[1]
        with self._patched(cache):
            out = self._call_body(input_ids, self.step_attention_mask(cache, t), cache.position_ids(t), cache)
        cache.advance(t)
        hidden = out.last_hidden_state
        return self.logits(hidden), hidden
