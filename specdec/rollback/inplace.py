"""No rollback: the state is updated in place during the forward (plain decoding, K = 0).

With no drafts there is nothing to roll back: each step runs one token per row and keeps it.
A strategy that writes the new state straight into the live state moves the state once in and
once out per step — what a plain decode step costs — where snapshot (verify + copy) and replay
(verify + fold) move it three times. The engine uses it for ``num_speculative_tokens=0``.

Committing 0 tokens does not restore the state: in the engine only a finished row commits 0,
and its state is never read again. Not one of ``STRATEGIES``: the engine picks it itself. Its
steps are :meth:`RollbackStrategy.plain_verify`, the plain steps that snapshot and replay also
run when a step speculates no tokens.
"""

from __future__ import annotations

import torch

from .base import LayerStore, RollbackStrategy, write_rows

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

    has_plain_steps = True

    def plain_state(self, store):
        return store.tensors["live"]

    def state(self, store, op, params):
        return store.tensors["live"]

    def verify(self, store, op, inputs, params):
        return self.plain_verify(store, op, inputs, params)

    def commit(self, store, op, params, num_tokens):
        self.plain_commit(store, op, params, num_tokens)
