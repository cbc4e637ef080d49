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

During prefill the same ``mixer_forward`` runs against a :class:`Mamba2PromptLayer` instead of a
layer cache: the causal conv over the whole left-padded prompt and the chunked scan
(:mod:`specdec.kernels.mamba2.chunked`), with transformers' prefill semantics (padding masked
before ``in_proj`` and after the conv, ``dt`` clamped to ``time_step_limit``), leaving in HF's
cache layer the conv window and recurrent state its own prefill leaves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fusion import fusable
from ..kernels.mamba2.chunked import mamba2_prompt_scan
from .base import PROMPT_LAYERS, HybridAdapter, register
from .common import gated_norm
from .prompt_layer import PromptLayer

__all__ = ["BambaAdapter", "GraniteMoeHybridAdapter", "Mamba2Adapter", "Mamba2PromptLayer", "gated_mamba2_mixer",
           "mamba2_core"]


@fusable
def _mamba2_inputs(x, dt, Bm, Cm, dt_bias, A_log, D, heads: int, head_dim: int, groups: int, state: int,
                   dtype: torch.dtype):
    """The recurrence's inputs, as transformers' decode step computes them (element-wise; fused on
    the CUDA-graph path): ``x``, ``B``, ``C`` in ``dtype`` (fp32 for a layer cache), ``dt``, ``A``,
    ``D`` in fp32. The prompt's and the torch backend's path; a step on the Triton backend hands
    the step kernels the raw views and ``dt_bias`` instead (they form the same inputs)."""
    B, t = x.shape[:2]
    dt = F.softplus(dt.float() + dt_bias.float())
    return (x.reshape(B, t, heads, head_dim).to(dtype), dt, Bm.reshape(B, t, groups, state).to(dtype),
            Cm.reshape(B, t, groups, state).to(dtype), -torch.exp(A_log.float()), D.float())


def mamba2_core(mixer, layer, projected: torch.Tensor):
    """Mamba-2 mixer body from ``projected = in_proj(h)`` ``[B, t, I + conv_dim + H]``.

    Returns ``(y [B, t, I] in projected.dtype (before the gate/norm), gate [B, t, I])``. The scan's
    ``x``, ``B``, ``C`` are fp32, except for a :class:`Mamba2PromptLayer`, which names their dtype
    (``input_dtype``).
    """
    B, t, _ = projected.shape
    gate, xBC, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    xBC = layer.conv(xBC, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.activation)
    x, Bm, Cm = torch.split(
        xBC, [mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size, mixer.n_groups * mixer.ssm_state_size], dim=-1
    )
    prompt = isinstance(layer, Mamba2PromptLayer)
    if not prompt and layer.op.backend == "triton" and not torch.compiler.is_compiling():
        # a step: the step kernel reads x, B and C where the conv wrote them, forms dt = softplus(dt +
        # dt_bias) and A = -exp(A_log) itself and writes y in the model's dtype (params' dt_bias, A_log
        # and y_dtype: specdec.kernels.mamba2.Mamba2Op), so neither the inputs nor y's cast need a launch
        H, G = mixer.num_heads, mixer.n_groups
        inputs = {"x": x.view(B, t, H, -1), "dt": dt, "B": Bm.view(B, t, G, -1), "C": Cm.view(B, t, G, -1)}
        params = {"A_log": mixer.A_log, "D": mixer.D, "dt_bias": mixer.dt_bias, "y_dtype": projected.dtype}
    else:
        x, dt, Bm, Cm, A, D = _mamba2_inputs(x, dt, Bm, Cm, mixer.dt_bias, mixer.A_log, mixer.D, mixer.num_heads,
                                             mixer.head_dim, mixer.n_groups, mixer.ssm_state_size,
                                             layer.input_dtype if prompt else torch.float32)
        inputs, params = {"x": x, "dt": dt, "B": Bm, "C": Cm}, {"A": A, "D": D}
    y = layer.ssm(inputs, params)
    return y.reshape(B, t, -1).to(projected.dtype), gate


class Mamba2PromptLayer(PromptLayer):
    """What a Mamba-2 ``mixer_forward`` runs against during prefill, in place of its layer cache:
    the prompt's conv and scan as transformers' chunked prefill computes them (its
    ``Mamba2Mixer.forward`` and the families' copies), the final conv window and recurrent state
    written into HF's cache layer ``mixer.layer_idx``, continued from the state that layer holds
    (:class:`~specdec.models.prompt_layer.PromptLayer`).

    Differences from HF's torch fallback, none in fp32 but rounding: ``dt + dt_bias`` and its
    softplus are taken in fp32 (as mamba_ssm's kernels and this module's decode step do; HF's
    fallback uses the input dtype), the conv in fp32 with one rounding to the model dtype (as
    ``causal_conv1d_fn`` computes it; HF rounds the conv before its activation), and the scan
    output is rounded to the model dtype before the gated norm (as mamba_ssm's
    ``mamba_chunk_scan_combined`` returns it).

    With fla's scan a bf16 / fp16 model's scan inputs stay in its dtype (``input_dtype``; fla
    takes its matmul operands in it and returns ``y`` in it); the torch scan takes them in fp32.

    Left padding is state-neutral (:attr:`state_neutral_padding`): each row's conv sees the
    inputs before its first token (its conv window, or zeros) right before that token, not before
    column 0 of the padded prompt; padding positions get ``dt = 0`` (``exp(dt * A) = 1`` and no
    input: the recurrent state passes them unchanged, in either scan). So a left-padded row
    continued from a state ends in the state it ends in alone, and the rows of a batch may
    continue from different states (:meth:`specdec.models.HybridAdapter.prefill` with a prefix
    cache runs them together). Without a state this is HF's padded prefill whenever ``in_proj``
    has no bias (zero inputs at padding either way).

    Args:
        mixer: the HF Mamba-2 mixer (``layer_idx``, ``time_step_limit``, ``chunk_size``).
        cache_params: HF's cache for this prefill (a ``DynamicCache`` with linear-attention layers).
        attention_mask: the 2-D left-padding mask ``[B, L]`` (1 = token) of the prompt's columns,
            or None (no padding).
        scan: ``"fla"`` or ``"torch"`` (:func:`specdec.kernels.mamba2.chunked.resolve_scan`).
    """

    def __init__(self, mixer, cache_params, attention_mask: torch.Tensor | None, scan: str):
        super().__init__(mixer, cache_params, attention_mask, scan)
        self.dt_limit = tuple(mixer.time_step_limit)
        self.chunk_size = int(mixer.chunk_size)
        dtype = mixer.in_proj.weight.dtype
        self.operand_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        #: the dtype of the scan's x, B, C (:func:`mamba2_core` casts them to it)
        self.input_dtype = self.operand_dtype if scan == "fla" else torch.float32

    def ssm(self, inputs: dict, params: dict) -> torch.Tensor:
        """The scan over the prompt from HF's recurrent state (a continued prompt) or a zero
        state: ``inputs`` x ``[B, L, H, P]``, B, C ``[B, L, G, N]`` (in ``input_dtype``), dt
        ``[B, L, H]`` (softplus'd, fp32; set to 0 at padding); ``params`` A, D ``[H]`` (fp32).
        Returns ``y [B, L, H, P]`` (D skip included) in ``input_dtype``; the final state ``[B, H,
        P, N]`` fp32 goes to HF's cache. fla's matmul operands are in a bf16 / fp16 model's dtype
        (its ``in_proj`` weight's), else fp32."""
        dt = self.at_tokens(inputs["dt"].clamp(*self.dt_limit))  # padding: no decay, no input
        h0 = self.initial_state()
        y, state = mamba2_prompt_scan(self.scan, inputs["x"], dt, params["A"], inputs["B"], inputs["C"],
                                      self.chunk_size, params["D"], h0, self.operand_dtype)
        self.store_state(state)
        return y


PROMPT_LAYERS["mamba2"] = Mamba2PromptLayer


def gated_mamba2_mixer(mixer, hidden_states, layer):
    """The standard Mamba-2 mixer: core, gated RMSNorm ``norm(y, gate)``, ``out_proj``."""
    y, gate = mamba2_core(mixer, layer, mixer.in_proj(hidden_states))
    return mixer.out_proj(gated_norm(mixer.norm, layer, y, gate).to(hidden_states.dtype))


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
