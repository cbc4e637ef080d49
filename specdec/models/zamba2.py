"""Zamba2 (``Zamba2ForCausalLM``): Mamba-2 layers, some of which ("hybrid" layers) first run a
*shared* attention block (weights tied across hybrid layers, with per-layer LoRA adapters) on
``concat(hidden, embeddings)`` and add its projected output to the Mamba input.

The shared block runs in HF's own code; each hybrid layer has its own KV cache slot (HF's
``"hybrid"`` cache layer: KV + conv/SSM state), both loaded after prefill by
:class:`~specdec.models.base.HybridAdapter`. The mixer is the standard Mamba-2 one with a
grouped gated RMSNorm (:func:`specdec.models.mamba2.gated_mamba2_mixer`).
"""

from __future__ import annotations

from .base import HybridAdapter, register
from .mamba2 import gated_mamba2_mixer

__all__ = ["Zamba2Adapter"]


@register
class Zamba2Adapter(HybridAdapter):
    """Zamba2 hybrids (Mamba-2 + shared attention blocks)."""

    model_types = ("zamba2",)

    op_name = "mamba2"

    def mixer_of(self, layer):
        return getattr(layer, "mamba_decoder", layer).mamba  # Zamba2HybridLayer wraps its Mamba layer

    def mixer_forward(self, mixer, hidden_states, layer):
        return gated_mamba2_mixer(mixer, hidden_states, layer)
