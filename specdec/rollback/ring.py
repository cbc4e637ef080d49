"""Ring rollback: states live in a per-sequence ring; commit only moves the head.

Ring position ``head`` holds the committed state s^(0); verify writes s^(j) into position
``(head + j) mod R``; commit of n tokens sets ``head := (head + n) mod R``. No state is copied
at commit. With ``R = T_max + 1`` (the default) s^(0) is never overwritten during a step, so
committing 0 tokens and running a step in several calls (a draft model's one-token steps)
stay exact.
"""

from __future__ import annotations

import torch

from ..kernels.slots import gather_rows, scatter_rows, to_slots
from .base import LayerStore, RollbackStrategy, check_finite, check_index_bounds, debug_enabled, write_rows

__all__ = ["RingRollback"]


class RingRollback(RollbackStrategy):
    """Ring of ``R`` states per slot (``R >= T_max + 1``)."""

    name = "ring"

    def __init__(self, ring_size: int | None = None):
        if ring_size is not None and ring_size < 2:
            raise ValueError(f"ring_size must be >= 2, got {ring_size}")
        self.ring_size = ring_size

    def _size(self, store: LayerStore) -> int:
        need = store.max_step_tokens + 1
        if self.ring_size is None:
            return need
        if self.ring_size < need:
            raise ValueError(f"ring_size {self.ring_size} < num_speculative_tokens + 2 = {need}")
        return self.ring_size

    def _load(self, store, state):
        R = self._size(store)
        ring = state.new_zeros(state.shape[0], R, *state.shape[1:])
        ring[:, 0] = state
        store.tensors.update(ring=ring, head=torch.zeros(state.shape[0], dtype=torch.long, device=state.device))
        store.step_tokens = 0

    def _reset_in_place(self, store, rows, state):
        ring, head = store.tensors["ring"], store.tensors["head"]
        head[rows] = 0
        write_rows(ring[:, 0], rows, state)

    def state(self, store, op, params):
        ring, head = store.tensors["ring"], store.tensors["head"]
        return ring[torch.arange(ring.shape[0], device=ring.device), head]

    def verify(self, store, op, inputs, params):
        t = next(iter(inputs.values())).shape[1]
        self._check_step(store, t)
        ring, head, si = store.tensors["ring"], store.tensors["head"], store.state_indices
        R = ring.shape[1]
        j = store.step_tokens
        if debug_enabled():
            check_index_bounds("ring head", head, R, store)
        if op.kernels is not None:
            y = op.kernels.ring_verify(ring, head, inputs, params, j, state_indices=si)
        else:
            rows_ring, rows_head = gather_rows(ring, si), gather_rows(head, si)
            rows = torch.arange(rows_ring.shape[0], device=ring.device)
            y, states, _ = op.verify(rows_ring[rows, (rows_head + j) % R], inputs, params, True)
            slots = (rows_head[:, None] + j + 1 + torch.arange(t, device=ring.device)[None, :]) % R  # [B, t]
            if debug_enabled():
                check_index_bounds("ring slot", slots, R, store)
            rows_ring[rows[:, None], slots] = states
            scatter_rows(ring, si, rows_ring)
        store.step_tokens = j + t
        return y

    def tree_verify(self, store, op, inputs, params, parents):
        t = next(iter(inputs.values())).shape[1]
        self._check_tree_step(store, t)
        ring, head, si = store.tensors["ring"], store.tensors["head"], store.state_indices
        R = ring.shape[1]
        if op.kernels is not None:  # Triton: one launch, tree token j -> ring position head+1+j
            y = op.kernels.ring_verify(ring, head, inputs, params, 0, state_indices=si, parents=parents)
        else:
            rows_ring, rows_head = gather_rows(ring, si), gather_rows(head, si)
            rows = torch.arange(rows_ring.shape[0], device=ring.device)
            y, states, _ = op.tree_verify(rows_ring[rows, rows_head], inputs, params, parents, True)
            slots = (rows_head[:, None] + 1 + torch.arange(t, device=ring.device)[None, :]) % R  # token j -> head+1+j
            rows_ring[rows[:, None], slots] = states
            scatter_rows(ring, si, rows_ring)
        store.step_tokens = t
        return y

    def compact_path(self, store, op, params, path, num_tokens):
        # commit(n) moves head to head+n: put the state of the path's n-th token there (one state
        # per slot; a chain-shaped path needs no copy, the positions already match)
        ring, head, si = store.tensors["ring"], store.tensors["head"], store.state_indices
        R = ring.shape[1]
        path, num_tokens = to_slots(path, si, ring.shape[0]), to_slots(num_tokens, si, ring.shape[0])
        slots = torch.arange(ring.shape[0], device=ring.device)
        last = path.gather(1, (num_tokens - 1).clamp(min=0)[:, None])[:, 0]
        dst = (head + num_tokens) % R
        src = torch.where(num_tokens > 0, (head + 1 + last) % R, dst)
        ring[slots, dst] = ring[slots, src]

    def commit(self, store, op, params, num_tokens):
        self._check_commit(store, num_tokens)
        head, si = store.tensors["head"], store.state_indices
        R = store.tensors["ring"].shape[1]
        if op.kernels is not None:
            op.kernels.ring_commit(head, num_tokens, R, state_indices=si)  # one launch
        else:
            head.copy_((head + to_slots(num_tokens, si, head.shape[0])) % R)
        store.step_tokens = 0
        if debug_enabled():
            check_finite(self.state(store, op, params), store)

    def extra_state_bytes(self, state_bytes, max_step_tokens, input_bytes_per_token):
        return (max(self.ring_size or 0, max_step_tokens + 1) - 1) * state_bytes
