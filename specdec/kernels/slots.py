"""``state_indices`` on the torch reference path: rows of a batch over a pool of state slots.

A kernel call (and a rollback store) may keep its committed state in a pool of ``num_slots``
slots and run a batch of B rows over it, as vLLM does for its Mamba cache: row b uses slot
``state_indices[b]``; a negative id (``PAD_SLOT_ID = -1``) marks a padding row, which reads and
writes no state. ``state_indices=None`` means row b uses slot b. Per-row tensors (a step's
inputs and outputs, ``num_tokens``, a tree's accepted ``path``) are indexed by row; every tensor
a store keeps (states, buffers, ring heads, replay histories, conv windows) is indexed by slot.

The Triton kernels take ``state_indices`` directly; the functions here give the torch
reference the same semantics without a host synchronisation: gather the rows' slots, compute
on rows, write the rows back to their slots. Slots no row maps to keep their contents bit for
bit; the outputs of padding rows are unspecified (the kernels leave them unwritten).
"""

from __future__ import annotations

import torch

__all__ = ["PAD_SLOT_ID", "check_state_indices", "gather_rows", "scatter_rows", "to_slots", "slot_rows"]

#: the ``state_indices`` value of a padding row: the kernels skip it (vLLM's PAD_SLOT_ID).
PAD_SLOT_ID = -1


def check_state_indices(state_indices: torch.Tensor | None, batch: int) -> None:
    """Raise ValueError unless ``state_indices`` is None or an integer ``[batch]`` tensor.

    The slots must be distinct (except ``PAD_SLOT_ID`` rows) and below the pool size: two rows
    on one slot would race in every in-place kernel. Not checked here (that needs the values on
    the host); ``SPECDEC_DEBUG=1`` checks them in the rollback stores.
    """
    if state_indices is None:
        return
    if state_indices.dtype not in (torch.int32, torch.int64) or tuple(state_indices.shape) != (batch,):
        raise ValueError(
            f"state_indices must be an int32/int64 tensor of shape [{batch}], got "
            f"{state_indices.dtype} {tuple(state_indices.shape)}"
        )


def slot_rows(state_indices: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``[num_slots]`` int64: the row that uses each slot, ``-1`` for a slot no row uses."""
    rows = torch.arange(state_indices.shape[0], device=state_indices.device)
    src = torch.full((num_slots,), -1, dtype=torch.long, device=state_indices.device)
    idx = state_indices.long()
    # a padding row contributes -1 (to slot 0, which it cannot claim: amax keeps the real row)
    return src.scatter_reduce_(0, idx.clamp(min=0), torch.where(idx >= 0, rows, -1), reduce="amax")


def gather_rows(pool: torch.Tensor, state_indices: torch.Tensor | None) -> torch.Tensor:
    """``[B, ...]``: each row's slot of ``pool [num_slots, ...]`` (``pool`` itself when
    ``state_indices`` is None; a copy otherwise, in which padding rows hold slot 0's values)."""
    return pool if state_indices is None else pool[state_indices.long().clamp(min=0)]


def scatter_rows(pool: torch.Tensor, state_indices: torch.Tensor | None, rows: torch.Tensor) -> None:
    """``pool[state_indices[b]] = rows[b]`` for every non-padding row b, in place (``pool`` may be
    a view); slots no row uses keep their values bit for bit. ``state_indices=None``:
    ``pool.copy_(rows)`` (nothing when ``rows`` is ``pool``, as :func:`gather_rows` returns it)."""
    if state_indices is None:
        if rows is not pool:
            pool.copy_(rows)
        return
    src = slot_rows(state_indices, pool.shape[0])
    used = (src >= 0).view(-1, *([1] * (pool.dim() - 1)))
    pool.copy_(torch.where(used, rows[src.clamp(min=0)].to(pool.dtype), pool))


def to_slots(values: torch.Tensor, state_indices: torch.Tensor | None, num_slots: int, fill=0) -> torch.Tensor:
    """Per-row ``values [B, ...]`` as per-slot ``[num_slots, ...]``: slot ``state_indices[b]``
    gets ``values[b]``, slots no row uses get ``fill`` (``values`` itself when ``state_indices``
    is None)."""
    if state_indices is None:
        return values
    out = torch.full((num_slots, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    scatter_rows(out, state_indices, values)
    return out
