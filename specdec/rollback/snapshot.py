"""Snapshot rollback: keep every intermediate state of the step, copy the accepted one back.

Verify writes s^(1..T) into a T-slot buffer; commit copies slot ``n - 1`` (the state after
``n`` step tokens) into the live state. Simple and always exact; costs T extra states per
layer and sequence and a state copy per step (vLLM's and SGLang's approach for Mamba layers).
"""

from __future__ import annotations

import torch

from ..kernels.slots import gather_rows, scatter_rows, to_slots
from .base import LayerStore, RollbackStrategy, check_finite, debug_enabled, write_rows

__all__ = ["SnapshotRollback"]


class SnapshotRollback(RollbackStrategy):
    """Per-token state snapshots in a ``[num_slots, T_max, *S]`` buffer; commit copies one back."""

    name = "snapshot"

    def _load(self, store: LayerStore, state: torch.Tensor) -> None:
        live = state.clone()
        store.tensors["live"] = live
        buf = store.tensors.get("buf")
        if buf is None or buf.shape[2:] != live.shape[1:] or buf.shape[0] != live.shape[0]:
            store.tensors["buf"] = live.new_empty(live.shape[0], store.max_step_tokens, *live.shape[1:])
        store.step_tokens = 0

    def _reset_in_place(self, store, rows, state):
        write_rows(store.tensors["live"], rows, state)

    has_plain_steps = True  # the committed state is always the live state: flush has nothing to do

    def plain_state(self, store):
        return store.tensors["live"]

    def state(self, store, op, params):
        return store.tensors["live"]

    def verify(self, store, op, inputs, params):
        t = next(iter(inputs.values())).shape[1]
        self._check_step(store, t)
        j = store.step_tokens
        live, buf, si = store.tensors["live"], store.tensors["buf"], store.state_indices
        if op.kernels is not None:
            y = op.kernels.snapshot_verify(live, buf, inputs, params, j, state_indices=si)
        else:
            s0 = gather_rows(live if j == 0 else buf[:, j - 1], si)
            y, states, _ = op.verify(s0, inputs, params, True)
            scatter_rows(buf[:, j : j + t], si, states)
        store.step_tokens = j + t
        return y

    def tree_verify(self, store, op, inputs, params, parents):
        t = next(iter(inputs.values())).shape[1]
        self._check_tree_step(store, t)
        live, buf, si = store.tensors["live"], store.tensors["buf"], store.state_indices
        if op.kernels is not None:  # Triton: one launch, slot j <- token j's state, each token from its parent's
            y = op.kernels.snapshot_verify(live, buf, inputs, params, 0, state_indices=si, parents=parents)
        else:
            y, states, _ = op.tree_verify(gather_rows(live, si), inputs, params, parents, True)
            scatter_rows(buf[:, :t], si, states)  # position j: the state after tree token j
        store.step_tokens = t
        return y

    def compact_path(self, store, op, params, path, num_tokens):
        # commit(n) copies position n-1: put the state of the path's n-th token there (one state per slot)
        buf, si = store.tensors["buf"], store.state_indices
        path, num_tokens = to_slots(path, si, buf.shape[0]), to_slots(num_tokens, si, buf.shape[0])
        slots = torch.arange(buf.shape[0], device=buf.device)
        last = (num_tokens - 1).clamp(min=0)
        buf[slots, last] = buf[slots, path.gather(1, last[:, None])[:, 0]]

    def commit(self, store, op, params, num_tokens):
        self._check_commit(store, num_tokens)
        live, buf, si = store.tensors["live"], store.tensors["buf"], store.state_indices
        if op.kernels is not None:
            op.kernels.snapshot_commit(live, buf, num_tokens, state_indices=si)
        else:
            n = to_slots(num_tokens, si, live.shape[0])  # slots no row uses commit 0: unchanged
            slots = torch.arange(live.shape[0], device=live.device)
            picked = buf[slots, (n - 1).clamp(min=0)]
            keep_old = (n == 0).view(-1, *([1] * (live.dim() - 1)))
            live.copy_(torch.where(keep_old, live, picked))
        store.step_tokens = 0
        if debug_enabled():
            check_finite(live, store)

    def extra_state_bytes(self, state_bytes, max_step_tokens, input_bytes_per_token):
        return max_step_tokens * state_bytes
