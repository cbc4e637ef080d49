"""Gated DeltaNet families: Qwen3.5 (``Qwen3_5ForCausalLM``) and Qwen3-Next (``Qwen3NextForCausalLM``).

Both run the same GDN mixer (conv over q|k|v, per-head decay ``g = -exp(A_log) *
softplus(a + dt_bias)``, ``beta = sigmoid(b)``, L2-normalised q and k, gated RMSNorm on the
output); they differ only in how the input projection is laid out, which is all this module
keeps per family. The recurrence is :mod:`specdec.kernels.gdn`.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F

from ..cache import SSMLayerCache
from ..fusion import fusable
from .base import PROMPT_LAYERS, HybridAdapter, register
from .common import l2norm
from .prompt_layer import PromptLayer

__all__ = ["GDNPromptLayer", "Qwen3NextAdapter", "Qwen35Adapter", "gdn_core"]


@fusable
def _gdn_inputs(q, k, v, b, a, A_log, dt_bias, rep: int):
    """The recurrence's fp32 inputs from the conv outputs and the raw b/a projections, as
    transformers computes them (element-wise; fused on the CUDA-graph path). The torch backend's
    path and the reference of :func:`specdec.kernels.gdn.triton_inputs.gdn_step_inputs`, which
    the Triton backend runs instead."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
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
    if not isinstance(layer, PromptLayer) and layer.op.backend == "triton" and not torch.compiler.is_compiling():
        # a step: one launch for the five outputs
        from ..kernels.gdn.triton_inputs import gdn_step_inputs

        q, k, v, g, beta = gdn_step_inputs(q, k, v, b, a, mixer.A_log, mixer.dt_bias)
    else:
        q, k, v, g, beta = _gdn_inputs(q, k, v, b, a, mixer.A_log, mixer.dt_bias,
                                       mixer.num_v_heads // mixer.num_k_heads)
    o = layer.ssm({"q": q, "k": k, "v": v, "g": g, "beta": beta}, {"y_dtype": mixed_qkv.dtype})  # (no cast after)
    o = o.reshape(-1, mixer.head_v_dim)
    o = mixer.norm(o, z.reshape(-1, mixer.head_v_dim)).reshape(B, t, -1)
    return mixer.out_proj(o)


class GDNPromptLayer(PromptLayer):
    """What a Gated DeltaNet ``mixer_forward`` runs against during prefill, in place of its layer
    cache (:class:`~specdec.models.prompt_layer.PromptLayer`: the conv over q | k | v from HF's
    conv window or zeros): the chunked gated delta rule over the prompt from HF's recurrent
    state of a continued prompt, or zeros, the final state written into HF's cache layer.

    ``ssm`` takes the step's fp32 inputs (q and k L2-normalised, q scaled by ``1/sqrt(d_k)``, per
    value head) and runs flash-linear-attention's ``chunk_gated_delta_rule`` (``scan="fla"``:
    its operands in a bf16 / fp16 model's dtype, the decay in fp32) or transformers' torch
    reference of it, ``torch_chunk_gated_delta_rule`` of the mixer's own modeling module
    (``"torch"``; it scales q itself, so it is handed q times ``sqrt(d_k)``). transformers'
    prefill calls the same function (fla's when installed) on the same inputs, normalising q and
    k inside it; the conv here is computed in fp32 with one rounding to the model dtype (HF's
    torch conv rounds before its activation). In fp32 the two agree to rounding.

    Left padding is state-neutral (:attr:`state_neutral_padding`): padding positions get
    ``g = 0`` (no decay) and ``beta = 0`` (no write), so the recurrent state passes them
    unchanged, and the conv places each row's history right before its first token.
    transformers' prefill decays a continued state over the padding; from a zero state the two
    agree.

    Args: as :class:`~specdec.models.prompt_layer.PromptLayer`.

    Raises:
        RuntimeError: ``scan="torch"`` where the mixer's modeling module has no
            ``torch_chunk_gated_delta_rule`` (a transformers release this was not written for:
            prefill with ``scan="hf"`` instead).
    """

    def __init__(self, mixer, cache_params, attention_mask: torch.Tensor | None, scan: str):
        super().__init__(mixer, cache_params, attention_mask, scan)
        if scan == "fla":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            self._rule = chunk_gated_delta_rule
            dtype = mixer.conv1d.weight.dtype  # (not A_log's or dt_bias's: checkpoints may keep those in fp32)
            self._operand_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        else:
            module = sys.modules[type(mixer).__module__]
            rule = getattr(module, "torch_chunk_gated_delta_rule", None)
            if rule is None:
                raise RuntimeError(f"{module.__name__} has no torch_chunk_gated_delta_rule, which the torch prefill of "
                                   f"{type(mixer).__name__} calls; prefill with scan='hf' (transformers' own forward)")
            self._rule = inspect.unwrap(rule)  # the torch reference, not the kernel it dispatches to when fla is found

    def ssm(self, inputs: dict, params: dict) -> torch.Tensor:
        """The prompt's outputs ``o [B, L, H, V]`` from ``inputs`` q, k ``[B, L, H, K]``, v ``[B,
        L, H, V]``, g, beta ``[B, L, H]`` (fp32), in ``params["y_dtype"]`` (default: what the rule
        returns); the final state ``[B, H, K, V]`` fp32 goes to HF's cache."""
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        g, beta = self.at_tokens(inputs["g"]), self.at_tokens(inputs["beta"])  # padding: no decay, no write
        h0 = self.initial_state()
        h0 = None if h0 is None else h0.float()
        if self.scan == "fla":
            dt = self._operand_dtype
            o, state = self._rule(q.to(dt), k.to(dt), v.to(dt), g.float(), beta.to(dt), scale=1.0, initial_state=h0,
                                  output_final_state=True, use_qk_l2norm_in_kernel=False)
        else:
            o, state = self._rule(q * q.shape[-1] ** 0.5, k, v, g=g, beta=beta, initial_state=h0,
                                  output_final_state=True, use_qk_l2norm_in_kernel=False)
        self.cache_params.update_recurrent_state(state.float(), self.layer_idx)
        return o.to(params.get("y_dtype", o.dtype))


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
