"""Gated DeltaNet families: Qwen3.5 (``Qwen3_5ForCausalLM``) and Qwen3-Next (``Qwen3NextForCausalLM``).

Both run the same GDN mixer (conv over q|k|v, per-head decay ``g = -exp(A_log) *
softplus(a + dt_bias)``, ``beta = sigmoid(b)``, L2-normalised q and k, gated RMSNorm on the
output); they differ only in how the input projection is laid out, which is all this module
keeps per family. The recurrence is :mod:`specdec.kernels.gdn`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import SSMLayerCache
from ..fusion import fusable
from .base import PROMPT_LAYERS, HybridAdapter, register
from .common import gated_norm, l2norm
from .prompt_layer import DeltaRulePromptLayer, PromptLayer

__all__ = ["GDNPromptLayer", "Qwen3NextAdapter", "Qwen35Adapter", "gdn_core"]


def _gdn_gates(b, a, A_log, dt_bias):
    """``(g, beta)``: the per-head log decay ``-exp(A_log) softplus(a + dt_bias)`` (fp32) and
    ``sigmoid(b)`` (in b's dtype) from the raw b / a projections, as transformers computes them."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


@fusable
def _gdn_inputs(q, k, v, b, a, A_log, dt_bias, rep: int):
    """The recurrence's fp32 inputs from the conv outputs and the raw b/a projections, as
    transformers computes them (element-wise; fused on the CUDA-graph path). The torch backend's
    path and the reference of :func:`specdec.kernels.gdn.triton_inputs.gdn_step_inputs`, which
    the Triton backend runs instead."""
    g, beta = _gdn_gates(b, a, A_log, dt_bias)
    if rep > 1:
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    q = l2norm(q.float()) * (q.shape[-1] ** -0.5)
    k = l2norm(k.float())
    return q, k, v.float(), g, beta.float()


def gdn_core(mixer, layer: SSMLayerCache, mixed_qkv, z, b, a) -> torch.Tensor:
    """Shared GDN mixer body after the family's projection.

    Args:
        mixer: the HF GatedDeltaNet module (its conv1d, A_log, dt_bias, norm, out_proj are used).
        mixed_qkv: ``[B, t, 2*key_dim + value_dim]`` conv inputs; z: ``[B, t, Hv, Dv]`` output gate;
        b, a: ``[B, t, Hv]`` raw beta and decay projections.

    Returns: ``[B, t, hidden]``.
    """
    B, t, _ = mixed_qkv.shape
    x = layer.conv(mixed_qkv, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation)
    q, k, v = torch.split(x, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q = q.reshape(B, t, -1, mixer.head_k_dim)
    k = k.reshape(B, t, -1, mixer.head_k_dim)
    v = v.reshape(B, t, -1, mixer.head_v_dim)
    raw_qk = getattr(layer, "takes_raw_qk", False)
    if raw_qk:  # a prompt through fla's rule, which normalises q / k per key head itself
        g, beta = _gdn_gates(b, a, mixer.A_log, mixer.dt_bias)
    elif not isinstance(layer, PromptLayer) and layer.op.backend == "triton" and not torch.compiler.is_compiling():
        # a step: one launch for the five outputs
        from ..kernels.gdn.triton_inputs import gdn_step_inputs

        q, k, v, g, beta = gdn_step_inputs(q, k, v, b, a, mixer.A_log, mixer.dt_bias)
    else:
        q, k, v, g, beta = _gdn_inputs(q, k, v, b, a, mixer.A_log, mixer.dt_bias,
                                       mixer.num_v_heads // mixer.num_k_heads)
    params = {"y_dtype": mixed_qkv.dtype}  # (no cast after)
    if raw_qk:
        params["raw_qk"] = True
    o = layer.ssm({"q": q, "k": k, "v": v, "g": g, "beta": beta}, params)
    o = o.reshape(-1, mixer.head_v_dim)
    o = gated_norm(mixer.norm, layer, o, z.reshape(-1, mixer.head_v_dim), steps=False).reshape(B, t, -1)
    return mixer.out_proj(o)


class GDNPromptLayer(DeltaRulePromptLayer):
    """The Gated DeltaNet prompt layer (:class:`~specdec.models.prompt_layer.DeltaRulePromptLayer`):
    flash-linear-attention's ``chunk_gated_delta_rule``, or transformers' torch reference
    ``torch_chunk_gated_delta_rule`` of the mixer's modeling module; a per-head decay ``g [B, L, H]``."""

    torch_rule = "torch_chunk_gated_delta_rule"
    fla_rule = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


PROMPT_LAYERS["gdn"] = GDNPromptLayer


class _GDNFamily(HybridAdapter):
    mixer_attr, op_name = "linear_attn", "gdn"


@register
class Qwen35Adapter(_GDNFamily):
    """Qwen3.5 text models (``Qwen3_5ForCausalLM``): GDN + gated full attention, 3:1."""

    model_types = ("qwen3_5_text", "qwen3_5")

    def mixer_forward(self, mixer, hidden_states, layer):
        B, t, _ = hidden_states.shape
        mixed_qkv = mixer.in_proj_qkv(hidden_states)
        z = mixer.in_proj_z(hidden_states).reshape(B, t, -1, mixer.head_v_dim)
        return gdn_core(mixer, layer, mixed_qkv, z, mixer.in_proj_b(hidden_states), mixer.in_proj_a(hidden_states))


@register
class Qwen3NextAdapter(_GDNFamily):
    """Qwen3-Next (``Qwen3NextForCausalLM``): GDN with an interleaved qkvz/ba projection, MoE MLPs."""

    model_types = ("qwen3_next",)

    def mixer_forward(self, mixer, hidden_states, layer):
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(hidden_states), mixer.in_proj_ba(hidden_states)
        )
        mixed_qkv = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
        return gdn_core(mixer, layer, mixed_qkv, z, b, a)
