"""Falcon-H1 (``FalconH1ForCausalLM``): every decoder layer runs a Mamba-2 mixer and an attention
block *in parallel* on the same normed input, with muP multipliers throughout.

Per family, kept here: the mixer scales its input by ``ssm_in_multiplier`` and the projection
by the per-channel ``mup_vector`` before the shared Mamba-2 core
(:func:`specdec.models.mamba2.mamba2_core`); after it either the grouped gated RMSNorm
(``mamba_rms_norm``) or the plain z gate ``y * silu(gate)`` (what transformers' decode step
computes inside ``selective_state_update``). The head multiplies by ``lm_head_multiplier``.
The decoder layer's own multipliers (attention in/out, ssm out, MLP) run in HF's code.

Every layer holds both an attention KV cache and SSM state (HF's ``"hybrid"`` cache layers);
:class:`~specdec.models.base.HybridAdapter` loads both after prefill.
"""

from __future__ import annotations

import torch.nn.functional as F

from .base import HybridAdapter, register
from .mamba2 import mamba2_core

__all__ = ["FalconH1Adapter"]


@register
class FalconH1Adapter(HybridAdapter):
    """Falcon-H1 hybrids (parallel attention + Mamba-2 in every layer)."""

    model_types = ("falcon_h1",)

    mixer_attr, op_name = "mamba", "mamba2"

    def logits(self, hidden):
        return self.lm_head(hidden) * self.body.lm_head_multiplier

    def mixer_forward(self, mixer, hidden_states, layer):
        B, t, _ = hidden_states.shape
        projected = mixer.in_proj(hidden_states * mixer.ssm_in_multiplier) * mixer.mup_vector
        y, gate = mamba2_core(mixer, layer, projected)
        if mixer.mamba_rms_norm:
            # (HF's norm squeezes a length-1 sequence; keep [B, t, I])
            y = mixer.norm(y, gate).reshape(B, t, -1)
        else:
            y = y * F.silu(gate)
        return mixer.out_proj(y.to(hidden_states.dtype))
