"""Causal depthwise conv1d over a multi-token window, torch reference.

Every SSM layer here (Mamba-2, GDN, KDA, LFM2 short-conv) runs a causal depthwise conv of
width W before its recurrence. For speculative decoding each sequence keeps a window of its
last ``W - 1`` committed conv inputs followed by room for this step's tokens::

    window[b, :, 0 : W-1]            committed history (the conv state)
    window[b, :, W-1 : W-1+T]        this step's inputs, tokens 0..T-1

The output for step token j is the conv over columns ``j .. j+W-1``. Committing n tokens moves
the history by n columns (``conv1d_commit``); nothing is recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["conv1d_verify", "conv1d_tree_verify", "conv1d_commit"]


def conv1d_verify(window, x, weight, bias=None, activation=None, offset: int = 0):
    """Write this step's conv inputs into the window and return the conv outputs.

    Args:
        window: ``[B, C, W-1+T_max]`` (any float dtype), modified in place at columns
            ``W-1+offset .. W-1+offset+T-1``.
        x: ``[B, T, C]`` conv inputs of step tokens ``offset .. offset+T-1``.
        weight: ``[C, W]`` depthwise kernel; bias: ``[C]`` or None.
        activation: ``"silu"``/``"swish"`` or None.
        offset: how many tokens of the current step were already written.

    Returns:
        ``[B, T, C]`` outputs in ``x.dtype``.

    Raises:
        ValueError: when the step would overflow the window.
    """
    W = weight.shape[-1]
    T = x.shape[1]
    start = W - 1 + offset
    if start + T > window.shape[-1]:
        raise ValueError(f"conv window holds {window.shape[-1] - (W - 1)} step tokens; got offset {offset} + {T}")
    window[:, :, start : start + T] = x.transpose(1, 2).to(window.dtype)
    seg = window[:, :, offset : start + T].to(weight.dtype)
    out = F.conv1d(seg, weight.unsqueeze(1), bias, groups=weight.shape[0])  # [B, C, T]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}; supported: 'silu', None")
    return out.transpose(1, 2).to(x.dtype)


def conv1d_tree_verify(window, x, weight, bias=None, activation=None, parents=None):
    """:func:`conv1d_verify` for a tree of step tokens: each token's conv runs over its W-1
    ancestors (then the committed history) and itself, not over the W-1 tokens before it.

    Args:
        window: ``[B, C, W-1+T_max]``, modified in place at columns ``W-1 .. W-1+T-1`` (token j
            at column ``W-1+j``; a tree step is the step's only forward, offset 0).
        x: ``[B, T, C]`` conv inputs of the tree's tokens in topological order.
        weight, bias, activation: as :func:`conv1d_verify`.
        parents: ``[T]`` ints, token j's parent (``-1``: the committed history), ``parents[j] < j``
            (:mod:`specdec.kernels.tree_index`). A chain gives the outputs of :func:`conv1d_verify`.

    Returns:
        ``[B, T, C]`` outputs in ``x.dtype``.

    Raises:
        ValueError: a tree that does not fit the window, or ``parents`` not a tree in topological order.
    """
    from ..tree_index import conv_tree_columns

    W = weight.shape[-1]
    B, T, C = x.shape
    if parents is None or len(parents) != T:
        raise ValueError(f"conv1d_tree_verify needs parents for each of the {T} tokens")
    if W - 1 + T > window.shape[-1]:
        raise ValueError(f"conv window holds {window.shape[-1] - (W - 1)} step tokens; got a tree of {T}")
    window[:, :, W - 1 : W - 1 + T] = x.transpose(1, 2).to(window.dtype)
    cols = conv_tree_columns(parents, W, window.device)  # [T, W]
    seg = window[:, :, cols].permute(0, 2, 1, 3).reshape(B * T, C, W).to(weight.dtype)
    out = F.conv1d(seg, weight.unsqueeze(1), bias, groups=weight.shape[0])  # [B*T, C, 1]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}; supported: 'silu', None")
    return out.reshape(B, T, C).to(x.dtype)


def conv1d_commit(window: torch.Tensor, num_tokens: torch.Tensor, kernel_width: int) -> None:
    """Commit ``num_tokens[b]`` step tokens of each row: history := the W-1 inputs ending there.

    Args:
        window: ``[B, C, W-1+T_max]``, modified in place (columns past W-1 become stale).
        num_tokens: ``[B]`` int64 in ``[0, T_max]``.
        kernel_width: W.
    """
    hist = kernel_width - 1
    if hist == 0:
        return
    idx = num_tokens.view(-1, 1, 1) + torch.arange(hist, device=window.device).view(1, 1, -1)
    new_hist = window.gather(2, idx.expand(window.shape[0], window.shape[1], hist))
    window[:, :, :hist] = new_hist
