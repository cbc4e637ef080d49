"""Nemotron-H (``NemotronHForCausalLM``): Mamba-2 layers, attention without RoPE, MLP/MoE blocks.

The mixer (in_proj -> gate | xBC | dt; causal conv over xBC; SSD recurrence; gated RMSNorm
by groups; out_proj) follows transformers' ``NemotronHMamba2Mixer``; the recurrence is
:mod:`specdec.kernels.mamba2`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import HybridAdapter, register

__all__ = ["NemotronHAdapter", "mamba2_core"]


def mamba2_core(mixer, layer, projected: torch.Tensor) -> torch.Tensor:
    """Mamba-2 mixer body from ``projected = in_proj(h)`` ``[B, t, I + conv_dim + H]`` to ``[B, t, I]``
    (before the gated norm), shared by the Mamba-2 families."""
    B, t, _ = projected.shape
    gate, xBC, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    xBC = layer.conv(xBC, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation)
    x, Bm, Cm = torch.split(
        xBC, [mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.n_groups * mixer.ssm_state_size], dim=-1
    )
    dt = F.softplus(dt.float() + mixer.dt_bias.float())
    A = -torch.exp(mixer.A_log.float())
    y = layer.ssm(
        {
            "x": x.reshape(B, t, mixer.num_heads, mixer.head_dim).float(),
            "dt": dt,
            "B": Bm.reshape(B, t, mixer.n_groups, mixer.ssm_state_size).float(),
            "C": Cm.reshape(B, t, mixer.n_groups, mixer.ssm_state_size).float(),
        },
        {"A": A, "D": mixer.D.float()},
    )
    return y.reshape(B, t, -1).to(projected.dtype), gate


@register
class NemotronHAdapter(HybridAdapter):
    """Nemotron-H / Nemotron 3 hybrids."""

    model_types = ("nemotron_h",)

    def ssm_layers(self):
        if not hasattr(self, "_ssm"):
            self._ssm = {
                i: (layer.mixer, "mamba2")
                for i, layer in enumerate(self.body.layers)
                if getattr(layer, "block_type", None) in ("mamba", "linear_attention")
            }
        return self._ssm

    def mixer_forward(self, mixer, hidden_states, layer):
        y, gate = mamba2_core(mixer, layer, mixer.in_proj(hidden_states))
        y = mixer.norm(y, gate)
        return mixer.out_proj(y.to(hidden_states.dtype))
