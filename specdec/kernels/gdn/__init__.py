"""Gated DeltaNet: the op (:class:`GDNOp`), its fp32 torch reference (:mod:`.naive`, which also
holds the delta rule KDA shares) and its Triton kernels (:mod:`.triton_step`, imported on first use)."""

from __future__ import annotations

import torch

from ..protocol import SSMOp
from .naive import gdn_fold, gdn_verify

__all__ = ["GDNOp", "L2NORM_EPS"]

#: the epsilon of the L2 norm of the delta-rule mixers' q and k (GDN, KDA, OLMo-hybrid), as
#: transformers and flash-linear-attention use it
L2NORM_EPS = 1e-6


class GDNOp(SSMOp):
    """Gated DeltaNet: inputs ``q, k [B,T,H,K]`` (normalised; q scaled), ``v [B,T,H,V]``,
    ``g, beta [B,T,H]``; params: optional ``y_dtype`` (a ``torch.dtype``: y comes in it, rounded
    from fp32; default fp32); state ``[H, K, V]``; replay caches ``k, g`` and the corrected value
    ``u [B,T,H,V]``."""

    name = "gdn"
    replay_keys = ("k", "g", "u")
    _verify = staticmethod(gdn_verify)
    _fold = staticmethod(gdn_fold)

    def verify(self, state, inputs, params, return_states):
        return self._run(state, inputs, params, return_states, None)

    def tree_verify(self, state, inputs, params, parents, return_states):
        return self._run(state, inputs, params, return_states, parents)

    def _run(self, state, inputs, params, return_states, parents):
        y, states, u = self._verify(
            state, inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], return_states, parents
        )
        if params.get("y_dtype") is not None:  # (the dtype the caller wants y in: the kernels write it so)
            y = y.to(params["y_dtype"])
        return y, states, {"k": inputs["k"], "g": inputs["g"], "u": u}

    def fold(self, state, replay, params, num_tokens):
        return self._fold(state, replay["k"], replay["g"], replay["u"], num_tokens)

    def replay_spec(self, inputs):
        f32 = torch.float32
        return {
            "k": (tuple(inputs["k"].shape[2:]), f32),
            "g": (tuple(inputs["g"].shape[2:]), f32),
            "u": (tuple(inputs["v"].shape[2:]), f32),
        }

    def triton_kernels(self):
        from .triton_step import DeltaRuleKernels  # lazy: the backend decides TRITON_INTERPRET first

        return DeltaRuleKernels(per_channel=False)
