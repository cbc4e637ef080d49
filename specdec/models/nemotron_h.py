"""Nemotron-H (``NemotronHForCausalLM``): Mamba-2 layers, attention without RoPE, MLP/MoE blocks.

The mixer (in_proj -> gate | xBC | dt; causal conv over xBC; SSD recurrence; gated RMSNorm
by groups; out_proj) follows transformers' ``NemotronHMamba2Mixer``; the recurrence is
:mod:`specdec.kernels.mamba2`, through the Mamba-2 core shared by every Mamba-2 family
(:func:`specdec.models.mamba2.mamba2_core`).
"""

from __future__ import annotations

from .base import HybridAdapter, register
from .mamba2 import gated_mamba2_mixer, mamba2_core

__all__ = ["NemotronHAdapter", "mamba2_core"]


@register
class NemotronHAdapter(HybridAdapter):
    """Nemotron-H / Nemotron 3 hybrids."""

    model_types = ("nemotron_h",)

    op_name = "mamba2"

    def mixer_of(self, layer):
        return layer.mixer if getattr(layer, "block_type", None) in ("mamba", "linear_attention") else None

    def mixer_forward(self, mixer, hidden_states, layer):
        return gated_mamba2_mixer(mixer, hidden_states, layer)
