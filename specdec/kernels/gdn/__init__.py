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
    ``u [B,T,H,V]``.

    The Triton kernels (:class:`~specdec.kernels.gdn.triton_step.DeltaRuleKernels`) also take a
    layer's raw inputs, forming the above themselves (one launch for a GDN step): with params
    ``A_log, dt_bias [H]``, inputs ``q, k [B,T,Hk,K]`` as the conv wrote them (``H`` a multiple of
    ``Hk``), ``v``, and the projections ``a, b [B,T,H]`` in place of ``g, beta``
    (:mod:`specdec.kernels.gdn.triton_inputs`; the torch reference takes the formed inputs,
    :func:`specdec.models.gdn._gdn_inputs` forms them)."""

    name = "gdn"
    replay_keys = ("k", "g", "u")
    _verify = staticmethod(gdn_verify)
    _fold = staticmethod(gdn_fold)

    def verify(self, state, inputs, params, return_states):
        return self._run(state, inputs, params, return_states, None)

    def tree_verify(self, state, inputs, params, parents, return_states):
        return self._run(state, inputs, params, return_states, parents)

    def _run(self, state, inputs, params, return_states, parents):
        if params.get("A_log") is not None:
            raise ValueError(f"the {self.name} op's torch reference takes the formed inputs q, k, v, g, beta; the "
                             "raw ones (A_log, dt_bias, a, b) are for its Triton kernels")
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
        H, K = inputs["v"].shape[2], inputs["k"].shape[3]  # (the raw form's k has the key heads)
        return {
            "k": ((H, K), f32),
            "g": (tuple(inputs["g"].shape[2:]) if "g" in inputs else (H,), f32),
            "u": (tuple(inputs["v"].shape[2:]), f32),
        }

    def triton_kernels(self):
        from .triton_step import DeltaRuleKernels  # lazy: the backend decides TRITON_INTERPRET first

        return DeltaRuleKernels(per_channel=False)
