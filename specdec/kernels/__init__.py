"""SSM ops behind one small interface, so rollback strategies do not care which recurrence runs.

Each op folder (``mamba2/``, ``gdn/``, ``kda/``, ``conv1d/``) holds ``naive.py``, the fp32
torch reference that is also the CPU path. An :class:`SSMOp` bundles, for one recurrence:

* ``verify(state, inputs, params, return_states)`` -> ``(y, states, replay_inputs)``: run the
  step's T tokens from ``state`` (never modified); ``states`` is ``[B, T, *state_shape]`` when
  asked for; ``replay_inputs`` is the dict of per-token tensors replay caches
  (``replay_keys``), each ``[B, T, ...]``.
* ``fold(state, replay_inputs, params, num_tokens)`` -> new state: apply the first
  ``num_tokens[b]`` cached tokens of each row (the replay / deferred-fold primitive).

``inputs`` and ``params`` are plain dicts so that adapters of different families (which
project and gate differently) hand the same op the same names.
"""

from __future__ import annotations

import abc
import importlib.util
import os

import torch

from .gdn.naive import gdn_fold, gdn_verify
from .kda.naive import kda_fold, kda_verify
from .mamba2.naive import mamba2_fold, mamba2_verify

__all__ = ["SSMOp", "OPS", "get_op", "backend"]

BACKENDS = ("torch", "triton")


def backend(device: torch.device | str | None = None) -> str:
    """The kernel backend for ``device``: ``$SPECDEC_BACKEND`` if set, else triton on CUDA (torch
    when triton is not installed), torch on CPU.

    Raises:
        ValueError: if ``SPECDEC_BACKEND`` is set to something other than ``torch`` or ``triton``.
        ImportError: ``SPECDEC_BACKEND=triton`` without triton installed.
    """
    forced = os.environ.get("SPECDEC_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"SPECDEC_BACKEND={forced!r} is not a backend; use one of {BACKENDS}")
        if forced == "triton" and importlib.util.find_spec("triton") is None:
            raise ImportError("SPECDEC_BACKEND=triton but triton is not installed: pip install 'specdec[triton]' "
                              "(CUDA builds of torch bring it), or use SPECDEC_BACKEND=torch")
        return forced
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch"  # the Triton kernels need triton; the torch reference ops run anywhere
    return "triton" if dev.type == "cuda" else "torch"


class SSMOp(abc.ABC):
    """One recurrence type. Subclasses set ``name``, ``replay_keys`` and the two methods."""

    name: str = ""
    replay_keys: tuple[str, ...] = ()
    #: fused per-strategy kernels (Triton) or None for the torch reference. When set, the
    #: rollback strategies call ``kernels.snapshot_verify / snapshot_commit / ring_verify /
    #: replay_verify / replay_fold`` (signatures in :mod:`specdec.rollback`) instead of
    #: composing ``verify`` and ``fold``; tree steps call the same ``*_verify`` with ``parents=``.
    kernels = None

    def replay_spec(self, inputs: dict) -> dict:
        """``{key: (per-token shape, dtype)}`` of the inputs replay caches, from a step's ``inputs``."""
        return {k: (tuple(inputs[k].shape[2:]), torch.float32) for k in self.replay_keys}

    @abc.abstractmethod
    def verify(self, state, inputs: dict, params: dict, return_states: bool):
        """``(y [B,T,...], states [B,T,*S] | None, replay_inputs dict)``; ``state`` is not modified."""

    @abc.abstractmethod
    def fold(self, state, replay: dict, params: dict, num_tokens: torch.Tensor):
        """The state after applying the first ``num_tokens[b]`` cached tokens of each row."""

    def tree_verify(self, state, inputs: dict, params: dict, parents, return_states: bool):
        """:meth:`verify` for a tree of step tokens (the torch reference; with ``kernels`` set the
        rollback strategies call the kernels' ``*_verify(..., parents=)`` instead): token j
        starts from token ``parents[j]``'s state (``-1``: ``state``), ``parents[j] < j``; states
        and replay inputs are per token of the tree. See :mod:`specdec.kernels.tree_index`."""
        raise NotImplementedError(f"SSM op {self.name!r} has no tree verify")


class Mamba2Op(SSMOp):
    """Mamba-2: inputs ``x [B,T,H,P]``, ``dt [B,T,H]``, ``B``/``C [B,T,G,N]``; params ``A [H]``, ``D [H]``."""

    name = "mamba2"
    replay_keys = ("x", "dt", "B")

    def verify(self, state, inputs, params, return_states):
        y, states, _ = mamba2_verify(
            state, inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], params.get("D"), return_states
        )
        replay = {"x": inputs["x"], "dt": inputs["dt"], "B": inputs["B"]}
        return y, states, replay

    def tree_verify(self, state, inputs, params, parents, return_states):
        y, states, _ = mamba2_verify(
            state, inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], params.get("D"), return_states,
            parents,
        )
        return y, states, {"x": inputs["x"], "dt": inputs["dt"], "B": inputs["B"]}

    def fold(self, state, replay, params, num_tokens):
        return mamba2_fold(state, replay["x"], replay["dt"], params["A"], replay["B"], num_tokens)


class GDNOp(SSMOp):
    """Gated DeltaNet: inputs ``q, k [B,T,H,K]`` (normalised), ``v [B,T,H,V]``, ``g, beta [B,T,H]``."""

    name = "gdn"
    replay_keys = ("k", "g", "u")
    _verify = staticmethod(gdn_verify)
    _fold = staticmethod(gdn_fold)

    def verify(self, state, inputs, params, return_states):
        y, states, u = self._verify(
            state, inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], return_states
        )
        return y, states, {"k": inputs["k"], "g": inputs["g"], "u": u}

    def tree_verify(self, state, inputs, params, parents, return_states):
        y, states, u = self._verify(
            state, inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], return_states, parents
        )
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


class KDAOp(GDNOp):
    """Kimi Delta Attention: as GDN but ``g [B,T,H,K]`` per channel."""

    name = "kda"
    _verify = staticmethod(kda_verify)
    _fold = staticmethod(kda_fold)


OPS: dict[str, SSMOp] = {op.name: op for op in (Mamba2Op(), GDNOp(), KDAOp())}


def get_op(name: str, device: torch.device | str | None = None) -> SSMOp:
    """The op called ``name`` (one of ``OPS``) for the backend :func:`backend` picks for ``device``.

    The torch backend returns the reference op; the triton backend returns the same op with
    ``kernels`` set to the fused Triton kernels (on CPU through Triton's interpreter).

    Raises:
        ValueError: unknown op name or backend.
    """
    if name not in OPS:
        raise ValueError(f"unknown SSM op {name!r}; known: {sorted(OPS)}")
    if backend(device) == "torch":
        return OPS[name]
    from .triton_backend import triton_op  # lazy: sets TRITON_INTERPRET on CPU before importing triton kernels

    return triton_op(name, device)
