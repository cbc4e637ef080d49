"""Mamba-2 selective state update: the op (:class:`Mamba2Op`), its fp32 torch reference
(:mod:`.naive`) and its Triton kernels (:mod:`.triton_step`, imported on first use)."""

from __future__ import annotations

from ..protocol import SSMOp
from .naive import mamba2_fold, mamba2_verify

__all__ = ["Mamba2Op"]


class Mamba2Op(SSMOp):
    """Mamba-2: inputs ``x [B,T,H,P]``, ``dt [B,T,H]``, ``B``/``C [B,T,G,N]``; params ``A [H]``, ``D [H]``
    (optional); state ``[H, P, N]``; replay caches ``x, dt, B``."""

    name = "mamba2"
    replay_keys = ("x", "dt", "B")

    def verify(self, state, inputs, params, return_states):
        return self._run(state, inputs, params, return_states, None)

    def tree_verify(self, state, inputs, params, parents, return_states):
        return self._run(state, inputs, params, return_states, parents)

    @staticmethod
    def _run(state, inputs, params, return_states, parents):
        y, states, _ = mamba2_verify(
            state, inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], params.get("D"), return_states,
            parents,
        )
        return y, states, {"x": inputs["x"], "dt": inputs["dt"], "B": inputs["B"]}

    def fold(self, state, replay, params, num_tokens):
        return mamba2_fold(state, replay["x"], replay["dt"], params["A"], replay["B"], num_tokens)

    def triton_kernels(self):
        from .triton_step import Mamba2Kernels  # lazy: the backend decides TRITON_INTERPRET first

        return Mamba2Kernels()
