"""OLMo-hybrid (``OlmoHybridForCausalLM``): Gated DeltaNet layers and full attention.

Per family, kept here: separate q/k/v/a/b projections, the conv over q|k|v, ``beta`` doubled
when ``linear_allow_neg_eigval`` (eigenvalues in [-1, 1]), q/k L2-normalised and q divided by
sqrt(d_k) as transformers' recurrent step does, and a norm-*before*-gate RMSNorm with a
dedicated ``g_proj`` gate. The recurrence is the shared GDN op (:mod:`specdec.kernels.gdn`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import HybridAdapter, register
from .common import gated_norm, l2norm

__all__ = ["OlmoHybridAdapter"]


@register
class OlmoHybridAdapter(HybridAdapter):
    """OLMo-hybrid models."""

    model_types = ("olmo_hybrid",)

    mixer_attr, op_name = "linear_attn", "gdn"

    def mixer_forward(self, mixer, hidden_states, layer):
        B, t, _ = hidden_states.shape
        mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)], -1)
        mixed = layer.conv(mixed, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation)
        q, k, v = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        q = q.reshape(B, t, -1, mixer.head_k_dim)
        k = k.reshape(B, t, -1, mixer.head_k_dim)
        v = v.reshape(B, t, -1, mixer.head_v_dim)
        raw_qk = getattr(layer, "takes_raw_qk", False)  # (fla normalises them per key head)
        if mixer.num_v_heads > mixer.num_k_heads and not raw_qk:
            rep = mixer.num_v_heads // mixer.num_k_heads
            q = q.repeat_interleave(rep, dim=2)
            k = k.repeat_interleave(rep, dim=2)
        beta = mixer.b_proj(hidden_states).sigmoid()
        if mixer.allow_neg_eigval:
            beta = beta * 2.0
        g = -mixer.A_log.float().exp() * F.softplus(mixer.a_proj(hidden_states).float() + mixer.dt_bias)
        if not raw_qk:
            q = l2norm(q.float())
            k = l2norm(k.float())
            q = q / (q.shape[-1] ** 0.5)
            v = v.float()
        o = layer.ssm({"q": q, "k": k, "v": v, "g": g.float(), "beta": beta.float()},
                      {"raw_qk": True} if raw_qk else {})
        o = o.to(hidden_states.dtype).reshape(-1, mixer.head_v_dim)
        gate = mixer.g_proj(hidden_states).reshape(-1, mixer.head_v_dim)
        o = gated_norm(mixer.o_norm, layer, o, gate, steps=False).reshape(B, t, -1)
        return mixer.o_proj(o)
