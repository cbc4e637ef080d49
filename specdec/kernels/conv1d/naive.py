"""Causal depthwise conv1d over a multi-token window, torch reference.

Every SSM layer here (Mamba-2, GDN, KDA, LFM2 short-conv) runs a causal depthwise conv of
width W before its recurrence. For speculative decoding each sequence keeps a window of its
last ``W - 1`` committed conv inputs followed by room for this step's tokens::

    window[b, :, 0 : W-1]            committed history (the conv state)
    window[b, :, W-1 : W-1+T]        this step's inputs, tokens 0..T-1

The output for step token j is the conv over columns ``j .. j+W-1``. Committing n tokens moves
the history by n columns (``conv1d_commit``); nothing is recomputed. A plain decoding step (one
token, always kept) does both at once (``conv1d_update``, as ``causal_conv1d_update`` of
Dao-AILab/causal-conv1d updates its conv state).

A whole prompt needs no window: :func:`causal_conv1d_prompt` convolves it in its own ``[B, L, C]``
layout, from the W-1 inputs before it (a continued prompt's conv state) or zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["conv1d_verify", "conv1d_tree_verify", "conv1d_commit", "conv1d_update", "causal_conv1d_prompt",
           "check_prompt_conv_args"]


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


def conv1d_update(window, x, weight, bias=None, activation=None):
    """A plain decoding step's conv: one token per row, committed as it runs. Equals
    :func:`conv1d_verify` at offset 0 followed by :func:`conv1d_commit` of one token for every row.

    Args:
        window: ``[B, C, W-1+T_max]``; its history (columns ``0 .. W-2``) becomes the W-1 inputs
            ending at this token, in place; columns from ``W-1`` on are stale afterwards.
        x: ``[B, 1, C]`` this step's conv inputs. weight, bias, activation: as :func:`conv1d_verify`.

    Returns:
        ``[B, 1, C]`` outputs in ``x.dtype``.

    Raises:
        ValueError: ``x`` has more than one token, or as :func:`conv1d_verify`.
    """
    if x.shape[1] != 1:
        raise ValueError(f"a conv update runs one token per row (a plain decoding step); got {x.shape[1]}")
    out = conv1d_verify(window, x, weight, bias, activation, 0)
    conv1d_commit(window, torch.ones(window.shape[0], dtype=torch.long, device=window.device), weight.shape[-1])
    return out


def check_prompt_conv_args(x, weight, bias=None, activation=None, history=None) -> None:
    """Check the arguments of :func:`causal_conv1d_prompt` (and of its Triton kernel).

    Raises:
        ValueError: ``x`` not ``[B, L, C]``, ``weight`` not ``[C, W]`` (W >= 1), ``bias`` not
            ``[C]``, ``history`` not ``[B, W-1, C]``, or an activation other than ``"silu"`` /
            ``"swish"`` / None.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; supported: 'silu', None")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(f"expected x [B, L, C] and weight [C, W] with W >= 1; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    B, _, C = x.shape
    W = weight.shape[1]
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias must be [C] = [{C}]; got {tuple(bias.shape)}")
    if history is not None and history.shape != (B, W - 1, C):
        raise ValueError(f"history must be [B, W-1, C] = {(B, W - 1, C)} (the W-1 conv inputs before x[:, 0], "
                         f"oldest first); got {tuple(history.shape)}")


def causal_conv1d_prompt(x, weight, bias=None, activation=None, history=None):
    """Causal depthwise conv1d of a whole prompt in its ``[B, L, C]`` layout, torch reference.

    ``out[b, t, c] = act(bias[c] + sum_k weight[c, k] * u[b, t + k - (W-1), c])`` where ``u`` is
    ``x`` preceded by the W-1 inputs of ``history`` (zeros without it): ``F.conv1d`` with W-1
    zeros of left padding and ``groups=C`` (the ``nn.Conv1d`` of every Mamba-2 mixer), as the
    sum of W shifted products. Products and sums, bias and activation in fp32 (as
    ``causal_conv1d_fn`` of Dao-AILab/causal-conv1d computes them); one rounding to ``x.dtype``.
    The Triton kernel :func:`specdec.kernels.conv1d.triton_conv.causal_conv1d_prompt_triton`
    computes the same in one pass over ``x``.

    Args:
        x: ``[B, L, C]`` conv inputs (any float dtype, any strides).
        weight: ``[C, W]`` depthwise kernel; bias: ``[C]`` or None (any float dtype).
        activation: ``"silu"`` / ``"swish"`` or None.
        history: ``[B, W-1, C]`` the conv inputs before ``x[:, 0]``, oldest first (any float
            dtype, any strides: e.g. ``conv_state[:, :, 1:].transpose(1, 2)`` of a ``[B, C, W]``
            conv state), or None for zeros.

    Returns:
        ``[B, L, C]`` outputs in ``x.dtype``, contiguous.

    Raises:
        ValueError: as :func:`check_prompt_conv_args`.

    Example::

        y = causal_conv1d_prompt(x, conv1d.weight.squeeze(1), conv1d.bias, "silu")
    """
    check_prompt_conv_args(x, weight, bias, activation, history)
    B, L, C = x.shape
    W = weight.shape[1]
    f32 = torch.float32
    past = history.to(f32) if history is not None else x.new_zeros(B, W - 1, C, dtype=f32)
    u = torch.cat([past, x.to(f32)], dim=1)  # [B, W-1+L, C]
    w = weight.to(f32)
    out = u[:, :L] * w[:, 0]
    for k in range(1, W):
        out += u[:, k : k + L] * w[:, k]
    if bias is not None:
        out += bias.to(f32)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)
