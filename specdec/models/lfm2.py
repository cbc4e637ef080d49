"""LFM2 (``Lfm2ForCausalLM``): gated short-convolution layers and full attention.

A short-conv layer has a conv state and *no* recurrent state: ``B, C, x = in_proj(h)``,
``y = C * conv(B * x)``, ``out_proj(y)``. Its rollback is the conv window's offset commit alone,
so its layer cache is :class:`ConvOnlyLayerCache`: the :class:`~specdec.cache.SSMLayerCache`
interface (``conv``, ``advance``, ``commit``, ``conv_state``) without a recurrence or a rollback
strategy store.
"""

from __future__ import annotations


from ..cache import SSMLayerCache
from ..kernels import get_op
from .base import HybridAdapter, register

__all__ = ["Lfm2Adapter", "ConvOnlyLayerCache"]


class ConvOnlyLayerCache(SSMLayerCache):
    """Layer cache of a conv-only layer: :class:`~specdec.cache.SSMLayerCache` loaded without a
    recurrent state (its conv window, committed by offset; ``op`` only picks the conv backend).
    """

    def load(self, conv_state, ssm_state, conv_width):
        if ssm_state is not None:
            raise ValueError(f"layer {self.layer} is conv-only but a recurrent state was given")
        if conv_state is None:
            raise ValueError(f"layer {self.layer} is conv-only but has no conv state")
        super().load(conv_state, None, conv_width)


@register
class Lfm2Adapter(HybridAdapter):
    """LFM2 hybrids (short-conv + attention)."""

    model_types = ("lfm2",)

    mixer_attr, op_name = "conv", "conv"

    def conv_width(self, mixer):
        return int(mixer.conv.weight.shape[-1])

    def attention_mask_arg(self, mask):
        return {"full_attention": mask, "conv": None}

    def new_cache(self, batch, max_len, max_step_tokens, strategy, static=False):
        cache = self._new_hybrid_cache(batch, max_len, max_step_tokens, static)
        for idx in self.ssm_layers():
            dev = cache.layer_device(idx)  # (the op only picks the conv backend)
            cache.ssm[idx] = ConvOnlyLayerCache(get_op("mamba2", dev or cache.device), strategy, batch,
                                                max_step_tokens, idx, device=dev)
        return cache

    def mixer_forward(self, mixer, hidden_states, layer):
        Bg, Cg, x = mixer.in_proj(hidden_states).chunk(3, dim=-1)
        y = layer.conv(Bg * x, mixer.conv.weight.squeeze(1), mixer.conv.bias, None)
        return mixer.out_proj(Cg * y)
