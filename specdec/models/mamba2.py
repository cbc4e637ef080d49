"""Mamba-2 families: the shared mixer body, pure Mamba-2 (``Mamba2ForCausalLM``), Bamba
(``BambaForCausalLM``) and Granite-4 hybrids (``GraniteMoeHybridForCausalLM``).

Every Mamba-2 mixer in transformers (Mamba2, Bamba, GraniteMoeHybrid, Nemotron-H, Zamba2,
Falcon-H1) projects ``in_proj(h) -> gate | xBC | dt``, runs the causal conv over xBC, the SSD
recurrence (:mod:`specdec.kernels.mamba2`) and a gated RMSNorm before ``out_proj``;
:func:`mamba2_core` is that middle part. What differs per family (multipliers on the
projection, grouped vs. plain gated norm, the z gate without norm, the LM-head scaling) stays
in the family's adapter.

The decode path transformers takes (seq_len == 1 with a cache) uses ``dt = softplus(dt +
dt_bias)`` without the ``time_step_limit`` clamp of its chunked prefill; so does this module,
since speculative output must equal HF's token-by-token decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fusion import fusable
from .base import HybridAdapter, register

__all__ = ["BambaAdapter", "GraniteMoeHybridAdapter", "Mamba2Adapter", "mamba2_core"]


@fusable
def _mamba2_inputs(x, dt, Bm, Cm, dt_bias, A_log, D, heads: int, head_dim: int, groups: int, state: int):
    """The recurrence's fp32 inputs, as transformers' decode step computes them (element-wise;
    fused on the CUDA-graph path)."""
    B, t = x.shape[:2]
    dt = F.softplus(dt.float() + dt_bias.float())
    return (x.reshape(B, t, heads, head_dim).float(), dt, Bm.reshape(B, t, groups, state).float(),
            Cm.reshape(B, t, groups, state).float(), -torch.exp(A_log.float()), D.float())


def mamba2_core(mixer, layer, projected: torch.Tensor):
    """Mamba-2 mixer body from ``projected = in_proj(h)`` ``[B, t, I + conv_dim + H]``.

    Returns ``(y [B, t, I] in projected.dtype (before the gate/norm), gate [B, t, I])``.
    """
    B, t, _ = projected.shape
    gate, xBC, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    xBC = layer.conv(xBC, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation)
    x, Bm, Cm = torch.split(
        xBC, [mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.n_groups * mixer.ssm_state_size], dim=-1
    )
    x, dt, Bm, Cm, A, D = _mamba2_inputs(x, dt, Bm, Cm, mixer.dt_bias, mixer.A_log, mixer.D, mixer.num_heads,
                                         mixer.head_dim, mixer.n_groups, mixer.ssm_state_size)
    y = layer.ssm({"x": x, "dt": dt, "B": Bm, "C": Cm}, {"A": A, "D": D})
    return y.reshape(B, t, -1).to(projected.dtype), gate


def gated_mamba2_mixer(mixer, hidden_states, layer):
    """The standard Mamba-2 mixer: core, gated RMSNorm ``norm(y, gate)``, ``out_proj``."""
    y, gate = mamba2_core(mixer, layer, mixer.in_proj(hidden_states))
    y = mixer.norm(y, gate)
    return mixer.out_proj(y.to(hidden_states.dtype))


@register
class Mamba2Adapter(HybridAdapter):
    """Pure Mamba-2 (``Mamba2ForCausalLM``): every layer a Mamba-2 block, no attention.

    Its body (``.backbone``) takes the cache as ``cache_params``, no ``position_ids``, and a 2-D
    padding mask only (None during steps: a step never contains padding).
    """

    model_types = ("mamba2",)
    cache_arg = "cache_params"
    uses_position_ids = False

    mixer_attr, op_name = "mixer", "mamba2"

    def step_attention_mask(self, cache, t):
        return None

    def logits(self, hidden):
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()

    def mixer_forward(self, mixer, hidden_states, layer):
        return gated_mamba2_mixer(mixer, hidden_states, layer)


@register
class BambaAdapter(HybridAdapter):
    """Bamba (``BambaForCausalLM``): Mamba-2 blocks with a few RoPE attention layers."""

    model_types = ("bamba",)

    mixer_attr, op_name = "mamba", "mamba2"

    def mixer_forward(self, mixer, hidden_states, layer):
        return gated_mamba2_mixer(mixer, hidden_states, layer)


@register
class GraniteMoeHybridAdapter(BambaAdapter):
    """Granite-4 hybrids (``GraniteMoeHybridForCausalLM``): Bamba's mixer, MoE MLPs, muP-style
    multipliers (the body applies embedding/residual multipliers; the head divides by
    ``logits_scaling``)."""

    model_types = ("granitemoehybrid",)

    def logits(self, hidden):
        return self.lm_head(hidden) / self.config.logits_scaling
