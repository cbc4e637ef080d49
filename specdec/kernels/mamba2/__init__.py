"""Mamba-2 selective state update: the op (:class:`Mamba2Op`), its fp32 torch reference
(:mod:`.naive`) and its Triton kernels (:mod:`.triton_step`, imported on first use)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..protocol import SSMOp
from .naive import mamba2_fold, mamba2_verify

__all__ = ["Mamba2Op", "decay"]


def decay(params: dict) -> torch.Tensor:
    """The decay ``A [H]`` of a Mamba-2 op's ``params``: its ``A``, or ``-exp(A_log)`` in fp32 as
    transformers' decode step forms it from the layer's ``A_log``."""
    if params.get("A") is not None:
        return params["A"]
    return -torch.exp(params["A_log"].float())


class Mamba2Op(SSMOp):
    """Mamba-2: inputs ``x [B,T,H,P]``, ``dt [B,T,H]``, ``B``/``C [B,T,G,N]``; params ``A [H]`` (or
    ``A_log [H]``: the decay is then ``-exp(A_log)`` in fp32, :func:`decay`), ``D [H]`` (optional), ``dt_bias [H]`` (optional: then ``dt`` is the raw projection and the step is
    ``softplus(dt + dt_bias)`` in fp32, formed by the kernels themselves on the Triton backend) and
    ``y_dtype`` (optional, a ``torch.dtype``: y comes in it, rounded from fp32; default fp32);
    state ``[H, P, N]``; replay caches ``x, dt, B`` (dt softplus'ed)."""

    name = "mamba2"
    replay_keys = ("x", "dt", "B")

    def verify(self, state, inputs, params, return_states):
        return self._run(state, inputs, params, return_states, None)

    def tree_verify(self, state, inputs, params, parents, return_states):
        return self._run(state, inputs, params, return_states, parents)

    @staticmethod
    def _run(state, inputs, params, return_states, parents):
        dt = inputs["dt"]
        if params.get("dt_bias") is not None:  # the raw projection
            dt = F.softplus(dt.float() + params["dt_bias"].float())
        y, states, _ = mamba2_verify(
            state, inputs["x"], dt, decay(params), inputs["B"], inputs["C"], params.get("D"), return_states, parents,
        )
        if params.get("y_dtype") is not None:  # (the dtype the caller wants y in: the kernels write it so)
            y = y.to(params["y_dtype"])
        return y, states, {"x": inputs["x"], "dt": dt, "B": inputs["B"]}

    def fold(self, state, replay, params, num_tokens):
        return mamba2_fold(state, replay["x"], replay["dt"], decay(params), replay["B"], num_tokens)

    def triton_kernels(self):
        from .triton_step import Mamba2Kernels  # lazy: the backend decides TRITON_INTERPRET first

        return Mamba2Kernels()
