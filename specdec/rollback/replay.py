"""Replay rollback: keep a checkpoint and the per-token inputs, recompute the accepted prefix.

Verify computes the step's outputs from the current state and writes no state; it appends the
step's per-token replay inputs (Mamba-2: x, dt, B; GDN/KDA: k, g and the corrected value u) to
a per-sequence input history of length L. Commit of n tokens extends the committed history by
n; the checkpoint absorbs the history ("fold") either at once (``deferred=False``: L = 2 T_max)
or only when the next step could overflow the history (``deferred=True``: L >= 3 T_max, a power
of two), as ReplaySSM (dao-lab.ai, 2026) and FlashInfer's ``checkpointing_ssu`` do.

Between steps the committed state is always ``fold(ckpt, hist[:, :hist_len])``. In this torch
reference it is materialised before each verify; the Triton kernels fold in registers instead.
With fused kernels (``op.kernels``), eager replay runs the fold *inside the next verify*: the step's first verify call folds the committed history into the checkpoint in place
(one state read + one write per step, as a plain update) and appends the step's inputs at
positions ``T_max ..``; the commit then only moves the accepted prefix to positions ``0 ..``
(one launch, no state traffic). A forward of such a step must be closed by a commit (commit
zero tokens to discard it): the checkpoint already holds the step's starting state.
"""

from __future__ import annotations

import torch

from ..kernels.slots import gather_rows, scatter_rows, to_slots
from .base import (LayerStore, RollbackStrategy, _where, check_finite, check_index_bounds, debug_enabled,
                   write_rows)

__all__ = ["ReplayRollback"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class ReplayRollback(RollbackStrategy):
    """Checkpoint + input history; eager or deferred fold.

    Args:
        deferred: fold only when the history would overflow (default False: fold every commit).
        history: history length L in tokens for deferred mode (default: the next power of two
            >= 3 T_max); must be >= 2 T_max.
    """

    name = "replay"

    def __init__(self, deferred: bool = False, history: int | None = None):
        if history is not None and not deferred:
            raise ValueError("history= only applies to deferred replay; pass deferred=True")
        self.deferred = bool(deferred)
        self.history = history

    @property
    def sizes_fold(self) -> bool:
        return not self.deferred  # (eager replay: fused on the Triton kernels, where fold_max applies)

    def _fused(self, op) -> bool:
        """Eager replay on fused kernels: the commit's fold runs inside the next verify."""
        return not self.deferred and op.kernels is not None

    def _check_tree_step(self, store, t):
        store.replay_fused_step = False  # set again by tree_verify when it runs the fused protocol
        super()._check_tree_step(store, t)

    def _length(self, store: LayerStore) -> int:
        T = store.max_step_tokens
        if not self.deferred:
            return 2 * T  # fused kernels append the step at positions T_max .. (the committed prefix stays in place)
        L = self.history or _next_pow2(3 * T)
        if L < 2 * T:
            raise ValueError(f"deferred replay history {L} must be >= 2 * (num_speculative_tokens + 1) = {2 * T}")
        return L

    def _load(self, store, state):
        ckpt = state.clone()
        store.tensors["ckpt"] = ckpt
        store.tensors["hist_len"] = torch.zeros(ckpt.shape[0], dtype=torch.long, device=ckpt.device)
        store.tensors["hist"] = None  # allocated on first verify, when the input shapes are known
        store.step_tokens = 0
        store.replay_fused_step = False

    def _reset_in_place(self, store, rows, state):
        # the slots restart from a checkpoint with an empty history; the others keep both as they are
        write_rows(store.tensors["ckpt"], rows, state)
        store.tensors["hist_len"][rows] = 0

    def _hist(self, store, op, inputs: dict):
        hist = store.tensors["hist"]
        if hist is None:
            L = self._length(store)
            slots = store.tensors["ckpt"].shape[0]
            device = next(iter(inputs.values())).device
            hist = {
                key: torch.zeros(slots, L, *shape, dtype=dtype, device=device)
                for key, (shape, dtype) in op.replay_spec(inputs).items()
            }
            store.tensors["hist"] = hist
        return hist

    has_plain_steps = True

    def plain_state(self, store):
        return store.tensors["ckpt"]

    def flush_host(self, store):
        super().flush_host(store)
        store.replay_fused_step = False

    def flush_device(self, store, op, params):
        if store.tensors["hist"] is not None:
            self._fold(store, op, params, self._batch_slots(store))

    def flush_key(self, store, op, params):
        hist = store.tensors["hist"]
        if hist is None:
            return ()
        if op.kernels is None or type(self).flush_device is not ReplayRollback.flush_device:
            return None  # (the torch fold allocates, and deferred replay's reads its mask on the host; a
            #             subclass's own device part may read the host too)
        tensors = [store.tensors["ckpt"], store.tensors["hist_len"], *hist.values(), store.state_indices,
                   *(v for v in params.values() if isinstance(v, torch.Tensor))]
        return id(op.kernels), *(None if t is None else (t.data_ptr(), t.shape, t.dtype)
                                 for t in tensors)

    def _batch_slots(self, store) -> torch.Tensor | None:
        """``[num_slots]`` bool: the slots of the batch's rows; None without a slot map (every slot
        is the batch's: no mask to build)."""
        hist_len, si = store.tensors["hist_len"], store.state_indices
        return None if si is None else to_slots(torch.ones_like(si, dtype=torch.bool), si, hist_len.shape[0],
                                                fill=False)

    def _fold(self, store, op, params, flush: torch.Tensor | None) -> None:
        """Fold the committed history of the slots ``flush`` (``[num_slots]`` bool; None: every
        slot, in two launches, the fold and the reset, where a mask would take five) into the
        checkpoint and empty it; the other slots keep their history in place."""
        hist, hist_len, si = store.tensors["hist"], store.tensors["hist_len"], store.state_indices
        n = hist_len if flush is None else torch.where(flush, hist_len, torch.zeros_like(hist_len))
        if op.kernels is not None:
            op.kernels.replay_fold(store.tensors["ckpt"], hist, params, gather_rows(n, si), state_indices=si)
        elif flush is None or not self.deferred or bool(flush.any()):
            store.tensors["ckpt"].copy_(op.fold(store.tensors["ckpt"], hist, params, n))
        if flush is None:
            hist_len.zero_()
        else:
            hist_len.masked_fill_(flush, 0)

    def state(self, store, op, params):
        hist = store.tensors["hist"]
        if hist is None or (store.step_tokens and getattr(store, "replay_fused_step", False)):
            return store.tensors["ckpt"]  # (an open fused step: its first verify folded the history in)
        return op.fold(store.tensors["ckpt"], hist, params, store.tensors["hist_len"])

    def _positions(self, store, hist, offset: int, t: int):
        """``(start [B], pos [B, t])``: each row's first history position of the call (unfused
        protocol) and its tokens' positions, bounds-checked in debug mode."""
        start = gather_rows(store.tensors["hist_len"], store.state_indices) + offset
        pos = start[:, None] + torch.arange(t, device=start.device)[None, :]
        if debug_enabled():
            check_index_bounds("replay history slot", pos, next(iter(hist.values())).shape[1], store)
        return start, pos

    def _torch_verify(self, store, op, inputs, params, hist, start, pos, parents):
        """The torch reference of a verify call: outputs from the checkpoint advanced by the first
        ``start[b]`` cached tokens; the call's replay inputs appended at ``pos``."""
        si = store.state_indices
        rows_hist = {key: gather_rows(buf, si) for key, buf in hist.items()}
        s0 = op.fold(gather_rows(store.tensors["ckpt"], si), rows_hist, params, start)
        if parents is None:
            y, _, replay = op.verify(s0, inputs, params, False)
        else:
            y, _, replay = op.tree_verify(s0, inputs, params, parents, False)
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None]
        for key, val in replay.items():
            rows_hist[key][rows, pos] = val.to(rows_hist[key].dtype)
            scatter_rows(hist[key], si, rows_hist[key])
        return y

    def verify(self, store, op, inputs, params):
        t = next(iter(inputs.values())).shape[1]
        self._check_step(store, t)
        j = store.step_tokens
        hist_len, ckpt, si = store.tensors["hist_len"], store.tensors["ckpt"], store.state_indices
        hist = self._hist(store, op, inputs)
        if op.kernels is not None:
            if debug_enabled():  # (the kernels compute their positions themselves: here a bounds check only)
                self._positions(store, hist, j, t)
            fused = self._fused(op)
            fold_max = store.fold_max if fused and j == 0 else None
            if fold_max is not None and debug_enabled():
                self._check_fold_max(store, fold_max)
            y = op.kernels.replay_verify(ckpt, hist, hist_len, inputs, params, j, fused=fused, state_indices=si,
                                         fold_max=fold_max)
            if fused:
                store.replay_fused_step = True
        else:
            start, pos = self._positions(store, hist, j, t)
            y = self._torch_verify(store, op, inputs, params, hist, start, pos, None)
        store.step_tokens = j + t
        return y

    @staticmethod
    def _check_fold_max(store, fold_max: int) -> None:
        """Raise ValueError when a row's committed history is longer than ``store.fold_max`` (the
        fold would skip its last tokens)."""
        si = store.state_indices
        n = gather_rows(store.tensors["hist_len"], si)
        if si is not None:
            n = n * (si >= 0)
        if bool((n > fold_max).any()):
            row = int((n > fold_max).nonzero()[0, 0])
            raise ValueError(f"replay: row {row}'s committed history holds {int(n[row])} tokens, more than the "
                             f"fold_max {fold_max} set for this step ({_where(store)}): flush the cache first "
                             "(HybridCache.flush) or leave fold_max None")

    def tree_verify(self, store, op, inputs, params, parents):
        t = next(iter(inputs.values())).shape[1]
        self._check_tree_step(store, t)
        hist_len, ckpt, si = store.tensors["hist_len"], store.tensors["ckpt"], store.state_indices
        hist = self._hist(store, op, inputs)
        if self._fused(op):
            # the fused protocol, as a chain step: the kernel folds the committed history into the
            # checkpoint and appends tree token j's inputs at T_max + j; compact_path and the
            # commit then move the accepted path's inputs (no state traffic)
            y = op.kernels.replay_verify(ckpt, hist, hist_len, inputs, params, 0, fused=True, state_indices=si,
                                         parents=parents)
            store.replay_fused_step = True
        elif op.kernels is not None:  # deferred replay on Triton: folds in registers, appends at hist_len + j
            if debug_enabled():
                self._positions(store, hist, 0, t)
            y = op.kernels.replay_verify(ckpt, hist, hist_len, inputs, params, 0, state_indices=si, parents=parents)
        else:
            start, pos = self._positions(store, hist, 0, t)  # tree token j -> hist_len + j
            y = self._torch_verify(store, op, inputs, params, hist, start, pos, parents)
        store.step_tokens = t
        return y

    def compact_path(self, store, op, params, path, num_tokens):
        # the path's cached inputs to history positions hist_len + 0, 1, ...: commit(n) then replays
        # exactly the accepted tokens (path[i] >= i, gathered before any write)
        hist = store.tensors["hist"]
        if hist is None:
            return
        hist_len, si = store.tensors["hist_len"], store.state_indices
        path, num_tokens = to_slots(path, si, hist_len.shape[0]), to_slots(num_tokens, si, hist_len.shape[0])
        if store.step_tokens and getattr(store, "replay_fused_step", False):
            base = (next(iter(hist.values())).shape[1] // 2) * torch.ones_like(hist_len)  # the fused step's T_max ..
        else:
            base = hist_len
        i = torch.arange(path.shape[1], device=path.device)[None, :]
        keep = i < num_tokens[:, None]
        dst = base[:, None] + i
        src = base[:, None] + torch.where(keep, path, i)
        slots = torch.arange(path.shape[0], device=path.device)[:, None]
        for buf in hist.values():
            buf[slots, dst] = buf[slots, src]

    def commit(self, store, op, params, num_tokens):
        self._check_commit(store, num_tokens)
        hist_len, si = store.tensors["hist_len"], store.state_indices
        if store.step_tokens and getattr(store, "replay_fused_step", False):
            # the step's verify already folded the committed history into the checkpoint: keep the
            # accepted prefix of the step's inputs as the new committed history (one launch)
            op.kernels.replay_commit(store.tensors["hist"], hist_len, num_tokens, state_indices=si,
                                     max_tokens=store.step_tokens)
            store.step_tokens = 0
            if debug_enabled():
                check_finite(self.state(store, op, params), store)
            return
        hist_len += to_slots(num_tokens, si, hist_len.shape[0])
        hist = store.tensors["hist"]
        if hist is not None:
            # only the batch's slots fold (the others keep their history as it is); slots that keep
            # their history keep it in place (positions [0, hist_len)), slots that fold restart at 0.
            # Eager replay folds every slot every commit (no host sync needed).
            flush = self._batch_slots(store)
            if self.deferred:
                full = hist_len + store.max_step_tokens > next(iter(hist.values())).shape[1]
                flush = full if flush is None else flush & full
            self._fold(store, op, params, flush)
        store.step_tokens = 0
        if debug_enabled():
            check_finite(self.state(store, op, params), store)

    def extra_state_bytes(self, state_bytes, max_step_tokens, input_bytes_per_token):
        L = (self.history or _next_pow2(3 * max_step_tokens)) if self.deferred else 2 * max_step_tokens
        return L * input_bytes_per_token
