"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention layers and MLA attention (NoPE).

The KDA mixer (separate q/k/v projections, causal conv over q|k|v, per-channel forget gate,
``beta = sigmoid(b_proj)``, L2-normalised q and k, sigmoid-gated RMSNorm, o_proj) follows
transformers' ``KimiLinearDeltaAttention``; the recurrence is :mod:`specdec.kernels.kda`.
"""

from __future__ import annotations

import torch

from ..kernels.gdn import L2NORM_EPS
from .base import PROMPT_LAYERS, HybridAdapter, register
from .common import gated_norm
from .prompt_layer import DeltaRulePromptLayer

__all__ = ["KDAPromptLayer", "KimiLinearAdapter"]


def _l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    # Kimi's variant: x / sqrt(sum(x^2) + eps), as transformers and fla compute it
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class KDAPromptLayer(DeltaRulePromptLayer):
    """The Kimi Delta Attention prompt layer (:class:`~specdec.models.prompt_layer.DeltaRulePromptLayer`):
    flash-linear-attention's ``chunk_kda``, or transformers' torch reference
    ``chunk_kimi_delta_attention``; a per-channel decay ``g [B, L, H, K]``."""

    torch_rule = "chunk_kimi_delta_attention"
    fla_rule = ("fla.ops.kda", "chunk_kda")


PROMPT_LAYERS["kda"] = KDAPromptLayer


@register
class KimiLinearAdapter(HybridAdapter):
    """Kimi-Linear hybrids."""

    model_types = ("kimi_linear",)

    op_name = "kda"

    def mixer_of(self, layer):
        return layer.self_attn if getattr(layer, "block_type", None) == "linear_attention" else None

    def mixer_forward(self, mixer, hidden_states, layer):
        B, t, _ = hidden_states.shape
        shape = (B, t, -1, mixer.head_dim)
        mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)], -1)
        mixed = layer.conv(mixed, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation)
        q, k, v = (x.reshape(shape) for x in torch.split(mixed, [mixer.qkv_dim] * 3, dim=-1))
        raw_qk = getattr(layer, "takes_raw_qk", False)  # (fla normalises them in its kernel)
        if not raw_qk:
            q = _l2norm(q.float()) * (mixer.head_dim**-0.5)
            k = _l2norm(k.float())
            v = v.float()
        g = mixer.forget_gate(hidden_states)
        beta = torch.sigmoid(mixer.b_proj(hidden_states)).float()
        params = {"y_dtype": hidden_states.dtype}  # (y in the model's dtype: no cast after)
        if raw_qk:
            params["raw_qk"] = True
        o = layer.ssm({"q": q, "k": k, "v": v, "g": g.float(), "beta": beta}, params)
        gate = mixer.g_b_proj(mixer.g_a_proj(hidden_states)).view(shape)
        o = gated_norm(mixer.o_norm, layer, o, gate, steps=False).reshape(B, t, -1)  # (one launch in prompts)
        return mixer.o_proj(o)
