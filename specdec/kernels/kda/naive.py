"""Kimi Delta Attention, torch reference in fp32.

KDA (Kimi Team, "Kimi Linear", 2025) is the gated delta rule with a per-channel decay: the
gate ``g`` has one value per key channel, ``[B, T, H, K]``, instead of one per head. Everything
else (the corrected value u, the rank-1 write, replay from cached ``(k, g, u)``) is the delta
rule of :mod:`specdec.kernels.gdn.naive`, which this module specialises.

State: ``[B, H, K, V]`` fp32.
"""

from __future__ import annotations

from ..gdn.naive import delta_rule_fold, delta_rule_verify

__all__ = ["kda_verify", "kda_fold"]


def kda_verify(state, q, k, v, g, beta, return_states=False, parents=None):
    """KDA verify of T tokens from ``state`` (not modified).

    Args:
        state: ``[B, H, K, V]`` fp32; q, k: ``[B, T, H, K]`` (normalised; q scaled);
        v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` per-channel log decay; beta: ``[B, T, H]``.
        parents: None (a chain) or a tree of the T tokens (see :func:`~specdec.kernels.gdn.naive.delta_rule_verify`).

    Returns:
        ``(o [B, T, H, V], states [B, T, H, K, V] | None, u [B, T, H, V])``, all fp32.

    Raises:
        ValueError: if ``g`` is not per-channel.
    """
    if g.dim() != 4:
        raise ValueError(f"KDA expects a per-channel gate g of shape [B, T, H, K], got {tuple(g.shape)}")
    return delta_rule_verify(state, q, k, v, g, beta, return_states, parents)


def kda_fold(state, k, g, u, num_tokens):
    """KDA replay: apply the first ``num_tokens[b]`` cached ``(k, g, u)`` to ``state``."""
    return delta_rule_fold(state, k, g, u, num_tokens)
