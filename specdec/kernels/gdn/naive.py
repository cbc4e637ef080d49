"""Gated DeltaNet (and the shared delta rule), torch reference in fp32.

The gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025), written
as Hugging Face's ``torch_recurrent_gated_delta_rule`` and flash-linear-attention's
``fused_recurrent_gated_delta_rule`` compute it, one token at a time::

    S   <- S * exp(g_t)                       # decay (per head; per channel for KDA)
    u_t  = beta_t * (v_t - S^T k_t)           # delta-rule corrected value
    S   <- S + k_t u_t^T                      # rank-1 write
    o_t  = S^T q_t

State ``S`` has shape ``[B, H, K, V]`` (key dim first, as HF and fla store it). Given the
cached ``(k_t, g_t, u_t)`` the state update is linear, so replay (``gdn_fold``) is a decayed
sum of outer products and needs neither q, v nor beta.

All functions take fp32 or lower-precision inputs and compute in fp32; states are fp32.
"""

from __future__ import annotations

import torch

__all__ = ["delta_rule_verify", "delta_rule_fold", "gdn_verify", "gdn_fold"]


def _decay(g_t: torch.Tensor, per_channel: bool) -> torch.Tensor:
    # g_t: [B, H] -> [B, H, 1, 1]; or [B, H, K] -> [B, H, K, 1]
    return g_t.exp()[..., None] if per_channel else g_t.exp()[..., None, None]


def delta_rule_verify(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    return_states: bool = False,
    parents=None,
):
    """Run T tokens of the (gated) delta rule from ``state`` without modifying it.

    Args:
        state: ``[B, H, K, V]`` fp32, the state before the first token (s^(0)).
        q: ``[B, T, H, K]`` queries, already L2-normalised and scaled by ``K**-0.5``.
        k: ``[B, T, H, K]`` keys, already L2-normalised.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H]`` (GDN, per-head) or ``[B, T, H, K]`` (KDA, per-channel) log decay (<= 0).
        beta: ``[B, T, H]`` write strength in (0, 1).
        return_states: also return every intermediate state s^(1..T).
        parents: None (a chain) or a tree of the T tokens: token j starts from token
            ``parents[j]``'s state after it (``-1``: from ``state``), ``parents[j] < j``
            (:mod:`specdec.kernels.tree_index`); states and ``u`` are then per token of the tree.

    Returns:
        ``(o, states, u)``: outputs ``[B, T, H, V]`` fp32; ``[B, T, H, K, V]`` fp32 states
        (s^(j) at index j-1) or ``None``; corrected values ``u`` ``[B, T, H, V]`` fp32, the
        per-token input that replay caches.

    Raises:
        ValueError: ``parents`` that is not a tree in topological order.
    """
    per_channel = g.dim() == 4
    f32 = torch.float32
    q, k, v, g, beta = (t.to(f32) for t in (q, k, v, g, beta))
    S = state.to(f32)
    B, T, H, _ = k.shape
    o = q.new_empty(B, T, H, v.shape[-1])
    u = torch.empty_like(o)
    if parents is not None:
        return _delta_rule_tree(S, q, k, v, g, beta, per_channel, parents, o, u, return_states)
    states = S.new_empty(B, T, *S.shape[1:]) if return_states else None
    for t in range(T):
        S, o[:, t], u[:, t] = _delta_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], per_channel)
        if states is not None:
            states[:, t] = S
    return o, states, u


def _delta_step(S, q_t, k_t, v_t, g_t, beta_t, per_channel: bool):
    """One token of the delta rule for a batch of states ``S [N, H, K, V]``: ``(S', o_t, u_t)``."""
    S = S * _decay(g_t, per_channel)
    kv_mem = (S * k_t[:, :, :, None]).sum(dim=-2)
    u_t = (v_t - kv_mem) * beta_t[:, :, None]
    S = S + k_t[:, :, :, None] * u_t[:, :, None, :]
    return S, (S * q_t[:, :, :, None]).sum(dim=-2), u_t


def _level(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[:, idx]`` with the batch and token dims merged: ``[B, n, ...] -> [B * n, ...]``."""
    return x[:, idx].reshape(x.shape[0] * idx.numel(), *x.shape[2:])


def _delta_rule_tree(S0, q, k, v, g, beta, per_channel, parents, o, u, return_states):
    """Tree verify, one depth level at a time (every token of a level from its parent's state)."""
    from ..tree_index import tree_levels

    B, T = k.shape[:2]
    if len(parents) != T:
        raise ValueError(f"parents has {len(parents)} entries for {T} tokens")
    slots = S0.new_empty(B, T + 1, *S0.shape[1:])  # slot 0: s^(0); slot j + 1: token j's state
    slots[:, 0] = S0
    for idx, par in tree_levels(parents, S0.device):
        n = idx.numel()
        q_l, k_l, v_l, g_l, beta_l = (_level(x, idx) for x in (q, k, v, g, beta))
        S, o_l, u_l = _delta_step(_level(slots, par), q_l, k_l, v_l, g_l, beta_l, per_channel)
        slots[:, idx + 1] = S.reshape(B, n, *S0.shape[1:])
        o[:, idx] = o_l.reshape(B, n, *o.shape[2:])
        u[:, idx] = u_l.reshape(B, n, *u.shape[2:])
    return o, (slots[:, 1:] if return_states else None), u


def delta_rule_fold(
    state: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """Apply the first ``num_tokens[b]`` cached tokens of each row to ``state`` (replay).

    Args:
        state: ``[B, H, K, V]`` fp32 checkpoint.
        k: ``[B, L, H, K]`` cached keys; g: ``[B, L, H]`` or ``[B, L, H, K]`` cached log decay;
        u: ``[B, L, H, V]`` cached corrected values (from :func:`delta_rule_verify`).
        num_tokens: ``[B]`` int64, 0 <= num_tokens[b] <= L.

    Returns:
        New ``[B, H, K, V]`` fp32 state; ``state`` itself is not modified. The arithmetic is
        the same as in :func:`delta_rule_verify`, so the result equals the state verify saw.
    """
    per_channel = g.dim() == 4
    S = state.to(torch.float32)
    for t in range(int(num_tokens.max()) if num_tokens.numel() else 0):
        S_new = S * _decay(g[:, t].float(), per_channel) + k[:, t, :, :, None].float() * u[:, t, :, None, :].float()
        live = (num_tokens > t).view(-1, *([1] * (S.dim() - 1)))
        S = torch.where(live, S_new, S)
    return S


def gdn_verify(state, q, k, v, g, beta, return_states=False, parents=None):
    """Gated DeltaNet verify (per-head decay ``g [B, T, H]``); see :func:`delta_rule_verify`."""
    if g.dim() != 3:
        raise ValueError(f"GDN expects a per-head gate g of shape [B, T, H], got {tuple(g.shape)}")
    return delta_rule_verify(state, q, k, v, g, beta, return_states, parents)


def gdn_fold(state, k, g, u, num_tokens):
    """Gated DeltaNet replay of cached ``(k, g, u)``; see :func:`delta_rule_fold`."""
    return delta_rule_fold(state, k, g, u, num_tokens)
