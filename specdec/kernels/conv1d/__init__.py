"""Causal depthwise conv1d over a multi-token window: the op (:class:`Conv1dOp`), its torch
reference (:mod:`.naive`) and its Triton kernels (:mod:`.triton_conv`, imported on first use).

Every SSM layer here (Mamba-2, GDN, KDA, LFM2 short-conv) runs this conv before its
recurrence; a layer cache gets the op for its backend once (``conv1d_op`` in
:mod:`specdec.kernels`) and calls it for every step. A prefill's prompt layer calls
:meth:`Conv1dOp.prompt` over the whole prompt.
"""

from __future__ import annotations

import torch

from ..protocol import BackendOp, Conv1dKernels
from ..slots import gather_rows, scatter_rows
from .naive import causal_conv1d_prompt, conv1d_commit, conv1d_tree_verify, conv1d_update, conv1d_verify

__all__ = ["Conv1dOp", "CONV1D", "new_conv_window"]


class Conv1dOp(BackendOp):
    """The conv of one step (window layout: :mod:`specdec.kernels.conv1d.naive`).

    ``window``: ``[num_slots, C, W-1+T_max]`` (committed history at columns ``0 .. W-2``,
    step token j at ``W-1+j``), written in place, in any strides (the layer caches' is
    time-major, :func:`new_conv_window`); ``x``: ``[B, t, C]`` conv inputs; ``weight``:
    ``[C, W]`` depthwise kernel; ``bias``: ``[C]`` or None; ``activation``: ``"silu"`` /
    ``"swish"`` or None. ``state_indices``: ``[B]`` window slot of each row (negative: a
    padding row, its window untouched and its outputs unspecified); None = row b uses slot b
    (:mod:`specdec.kernels.slots`). With ``kernels`` set (Triton) every call is one launch;
    otherwise the torch reference runs.

    Example::

        op = conv1d_op(device)                          # specdec.kernels.conv1d_op
        y = op.verify(window, x, weight, bias, "silu", offset=0)
        op.commit(window, num_tokens, weight.shape[-1])
        y = op.update(window, x1, weight, bias, "silu")  # a plain step: verify + commit of 1 token
        y = op.prompt(x, weight, bias, "silu")          # a whole prompt, no window
    """

    name = "conv1d"
    #: the fused Triton kernels, or None for the torch reference
    kernels: Conv1dKernels | None = None

    def triton_kernels(self) -> Conv1dKernels:
        from .triton_conv import Conv1dTritonKernels  # lazy: the backend decides TRITON_INTERPRET first

        return Conv1dTritonKernels()

    def verify(self, window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None, offset: int, *, state_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``x`` (step tokens ``offset .. offset+t-1``) into the window and return the conv
        outputs ``[B, t, C]`` in ``x.dtype``.

        Raises:
            ValueError: the step would overflow the window, or an unknown activation.
        """
        if self.kernels is not None:
            return self.kernels.verify(window, x, weight, bias, activation, offset, state_indices=state_indices)
        return _on_rows(conv1d_verify, window, state_indices, x, weight, bias, activation, offset)

    def tree_verify(self, window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    activation: str | None, parents: tuple[int, ...], *,
                    state_indices: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`verify` for a tree of step tokens (the step's only call, offset 0): token j is
        written at column ``W-1+j`` and its conv runs over its W-1 nearest ancestors (then the
        committed history), ``parents[j] < j`` (``-1``: the history). Returns ``[B, N, C]``.

        Raises:
            ValueError: a tree that does not fit the window, or ``parents`` not a tree in topological order.
        """
        if self.kernels is not None:
            return self.kernels.tree_verify(window, x, weight, bias, activation, parents, state_indices=state_indices)
        return _on_rows(conv1d_tree_verify, window, state_indices, x, weight, bias, activation, parents)

    def commit(self, window: torch.Tensor, num_tokens: torch.Tensor, width: int, *,
               state_indices: torch.Tensor | None = None) -> None:
        """Commit ``num_tokens[b]`` (``[B]`` int64 in ``[0, T_max]``) step tokens of each row: the
        history becomes the W-1 conv inputs ending there (``width`` = W); 0 keeps the row's."""
        if self.kernels is not None:
            self.kernels.commit(window, num_tokens, width, state_indices=state_indices)
            return
        _on_rows(conv1d_commit, window, state_indices, num_tokens, width)

    def update(self, window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None, *, state_indices: torch.Tensor | None = None) -> torch.Tensor:
        """A plain decoding step's conv (one token per row, ``x [B, 1, C]``, kept by every row):
        :meth:`verify` at offset 0 and :meth:`commit` of that token in one call (one launch with
        ``kernels`` set). Returns ``[B, 1, C]`` in ``x.dtype``; the window's columns from ``W-1``
        on are stale afterwards, as after a commit.

        Raises:
            ValueError: ``x`` has more than one token, or as :meth:`verify`.
        """
        if self.kernels is not None:
            return self.kernels.update(window, x, weight, bias, activation, state_indices=state_indices)
        return _on_rows(conv1d_update, window, state_indices, x, weight, bias, activation)

    def prompt(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
               history: torch.Tensor | None = None) -> torch.Tensor:
        """The conv of a whole prompt ``x [B, L, C]`` in its own layout, from ``history [B, W-1, C]``
        (the inputs before it, oldest first) or zeros: ``[B, L, C]`` in ``x.dtype``, computed in
        fp32 (:func:`specdec.kernels.conv1d.naive.causal_conv1d_prompt`; with ``kernels`` set one
        Triton kernel). No window is read or written.

        Raises:
            ValueError: bad shapes or an unknown activation.
        """
        if self.kernels is not None:
            return self.kernels.prompt(x, weight, bias, activation, history)
        return causal_conv1d_prompt(x, weight, bias, activation, history)


def _on_rows(fn, window: torch.Tensor, state_indices: torch.Tensor | None, *args):
    """A reference function that updates a ``[B, ...]`` window in place, run on the rows' slots
    of a window pool: gather them, run, write them back (:mod:`specdec.kernels.slots`)."""
    rows = gather_rows(window, state_indices)
    out = fn(rows, *args)
    scatter_rows(window, state_indices, rows)
    return out


def new_conv_window(num_slots: int, channels: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """A zeroed conv window ``[num_slots, channels, columns]`` (dtype and device of ``like``),
    stored time-major: the view of a contiguous ``[num_slots, columns, channels]`` tensor.

    A step reads and writes a few of a window's columns for every channel (the W - 1 history
    columns, the step's tokens, the commit's shift); time-major, each such column is one
    contiguous run over the channels. Stored channel-major, consecutive channels lie
    ``columns`` elements apart, so every column access touches the memory of all the columns:
    a window sized for long drafts (``columns = W - 1 + K + 1``) then costs every step,
    a plain one included, about ``columns / (W - 1)`` times the bytes of its history."""
    return like.new_zeros(num_slots, columns, channels).transpose(1, 2)


#: the conv op, torch reference (``CONV1D.on("triton")`` binds the Triton kernels)
CONV1D = Conv1dOp()
