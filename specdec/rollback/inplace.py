"""No rollback: the state is updated in place during the forward (plain decoding, K = 0).

With no drafts there is nothing to roll back: each step runs one token per row and keeps it.
A strategy that writes the new state straight into the live state moves the state once in and
once out per step — what a plain decode step costs — where snapshot (verify + copy) and replay
(verify + fold) move it three times. The engine uses it for ``num_speculative_tokens=0``.

Committing 0 tokens does not restore the state: in the engine only a finished row commits 0,
and its state is never read again. Not one of ``STRATEGIES``: the engine picks it itself.
"""

from __future__ import annotations

import torch

from ..kernels.slots import gather_rows, scatter_rows
from .base import LayerStore, RollbackStrategy, check_finite, debug_enabled, write_rows

__all__ = ["InPlaceUpdate"]


class InPlaceUpdate(RollbackStrategy):
    """The recurrence overwrites the live state (steps of exactly one token; no rollback)."""

    name = "none"

    def _load(self, store: LayerStore, state: torch.Tensor) -> None:
        if store.max_step_tokens != 1:
            raise ValueError(f"the in-place (no rollback) strategy takes steps of 1 token (plain decoding); this "
                             f"cache takes {store.max_step_tokens}")
        store.tensors["live"] = state.clone()
        store.step_tokens = 0

    def _reset_in_place(self, store, rows, state):
        write_rows(store.tensors["live"], rows, state)

    def state(self, store, op, params):
        return store.tensors["live"]

    def verify(self, store, op, inputs, params):
        t = next(iter(inputs.values())).shape[1]
        self._check_step(store, t)
        live, si = store.tensors["live"], store.state_indices
        if op.kernels is not None:
            y = op.kernels.update(live, inputs, params, state_indices=si)
        else:
            y, states, _ = op.verify(gather_rows(live, si), inputs, params, True)
            scatter_rows(live, si, states[:, -1])
        store.step_tokens += t
        return y

    def commit(self, store, op, params, num_tokens):
        self._check_commit(store, num_tokens)
        store.step_tokens = 0
        if debug_enabled():
            check_finite(store.tensors["live"], store)
