"""Mamba-2 selective state update, torch reference in fp32.

The SSD recurrence (Dao & Gu, "Transformers are SSMs", ICML 2024) in its per-token form, as
``mamba_ssm.selective_state_update`` and Hugging Face's ``mamba2_selective_state_update``
compute it::

    h_t = exp(dt_t * A) * h_{t-1} + (dt_t * B_t) x_t^T      # h: [H, P, N]
    y_t = h_t C_t + D * x_t

``dt`` is already discretised (softplus(dt_raw + dt_bias)). B and C have G groups shared by
H / G heads each. Replay caches ``(x, B, dt)`` per token; C and D only shape outputs.
State: ``[B, H, P, N]`` fp32 (head_dim P, state size N).
"""

from __future__ import annotations

import torch

__all__ = ["mamba2_verify", "mamba2_fold"]


def _expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    # [B, G, N] -> [B, H, N]
    return t.repeat_interleave(num_heads // t.shape[1], dim=1)


def _update(h, x_t, dt_t, A, B_t):
    num_heads = x_t.shape[1]
    dA = torch.exp(dt_t * A)[:, :, None, None]                       # [B, H, 1, 1]
    dB = dt_t[:, :, None] * _expand_groups(B_t, num_heads)           # [B, H, N]
    return h * dA + dB[:, :, None, :] * x_t[:, :, :, None]


def mamba2_verify(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    return_states: bool = False,
    parents=None,
):
    """Run T tokens of Mamba-2 from ``state`` without modifying it.

    Args:
        state: ``[B, H, P, N]`` fp32, s^(0).
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` discretised step (> 0); A: ``[H]`` (< 0);
        B, C: ``[B, T, G, N]``; D: ``[H]`` skip weight or None.
        return_states: also return s^(1..T).
        parents: None (a chain) or a tree of the T tokens: token j starts from token
            ``parents[j]``'s state after it (``-1``: from ``state``), ``parents[j] < j``
            (:mod:`specdec.kernels.tree_index`); states are then per token of the tree.

    Returns:
        ``(y, states, None)``: ``y [B, T, H, P]`` fp32, ``states [B, T, H, P, N]`` or None.
        (The third slot matches the delta-rule ops; Mamba-2 replays its raw inputs.)

    Raises:
        ValueError: ``parents`` that is not a tree in topological order.
    """
    f32 = torch.float32
    x, dt, A, B, C = (t.to(f32) for t in (x, dt, A, B, C))
    D = D.to(f32) if D is not None else None
    h = state.to(f32)
    Bsz, T, H, P = x.shape
    y = x.new_empty(Bsz, T, H, P)
    if parents is not None:
        return _mamba2_tree(h, x, dt, A, B, C, D, parents, y, return_states)
    states = h.new_empty(Bsz, T, *h.shape[1:]) if return_states else None
    for t in range(T):
        h, y[:, t] = _step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        if states is not None:
            states[:, t] = h
    return y, states, None


def _step(h, x_t, dt_t, A, B_t, C_t, D):
    """One token for a batch of states ``h [N, H, P, N_state]``: ``(h', y_t)``."""
    H = x_t.shape[1]
    h = _update(h, x_t, dt_t, A, B_t)
    y_t = (h * _expand_groups(C_t, H)[:, :, None, :]).sum(-1)
    if D is not None:
        y_t = y_t + x_t * D[None, :, None]
    return h, y_t


def _level(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[:, idx]`` with the batch and token dims merged: ``[B, n, ...] -> [B * n, ...]``."""
    return x[:, idx].reshape(x.shape[0] * idx.numel(), *x.shape[2:])


def _mamba2_tree(h0, x, dt, A, B, C, D, parents, y, return_states):
    """Tree verify, one depth level at a time (every token of a level from its parent's state)."""
    from ..tree_index import tree_levels

    Bsz, T = x.shape[:2]
    if len(parents) != T:
        raise ValueError(f"parents has {len(parents)} entries for {T} tokens")
    slots = h0.new_empty(Bsz, T + 1, *h0.shape[1:])  # slot 0: s^(0); slot j + 1: token j's state
    slots[:, 0] = h0
    for idx, par in tree_levels(parents, h0.device):
        n = idx.numel()
        h, y_l = _step(_level(slots, par), _level(x, idx), _level(dt, idx), A, _level(B, idx), _level(C, idx), D)
        slots[:, idx + 1] = h.reshape(Bsz, n, *h0.shape[1:])
        y[:, idx] = y_l.reshape(Bsz, n, *y.shape[2:])
    return y, (slots[:, 1:] if return_states else None), None


def mamba2_fold(state, x, dt, A, B, num_tokens):
    """Apply the first ``num_tokens[b]`` cached tokens ``(x, dt, B)`` of each row to ``state``.

    Args:
        state: ``[B, H, P, N]`` fp32 checkpoint; x: ``[B, L, H, P]``; dt: ``[B, L, H]``;
        A: ``[H]``; B: ``[B, L, G, N]``; num_tokens: ``[B]`` int64 in [0, L].

    Returns:
        New ``[B, H, P, N]`` fp32 state (same arithmetic as :func:`mamba2_verify`).
    """
    f32 = torch.float32
    h = state.to(f32)
    A = A.to(f32)
    for t in range(int(num_tokens.max()) if num_tokens.numel() else 0):
        h_new = _update(h, x[:, t].to(f32), dt[:, t].to(f32), A, B[:, t].to(f32))
        h = torch.where((num_tokens > t).view(-1, 1, 1, 1), h_new, h)
    return h
