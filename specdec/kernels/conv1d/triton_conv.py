"""Causal depthwise conv1d over a multi-token window, in Triton (verify + commit by offset).

Same semantics as :mod:`specdec.kernels.conv1d.naive` (the layout follows ``causal_conv1d``'s
``causal_conv1d_update`` from Dao-AILab/causal-conv1d, extended to a multi-token window)::

    window[s, :, 0 : W-1]          committed history (the conv state)
    window[s, :, W-1 : W-1+T_max]  this step's inputs

Verify writes the call's inputs at columns ``W-1+offset ..`` and computes each token's output
from the W columns ending at it (a tree step, :func:`conv1d_tree_verify_triton`: from the
columns of its ancestor chain, read from a per-tree ``[T, W]`` column table); commit moves the
history by ``num_tokens`` columns. A plain decoding step does both in the verify's launch
(:func:`conv1d_update_triton`, as ``causal_conv1d_update`` shifts its state). One program owns one (row, block of BC channels); all T
tokens of a call are one ``[BT, BC]`` register block. Arithmetic in fp32 (the reference computes in the weight dtype; identical for fp32 weights).
No host sync, no allocation besides the output, no autotuning (both kernels write the window
in place): launch parameters are chosen by hand below.

A whole prompt (:func:`causal_conv1d_prompt_triton`) needs no window: its kernel reads the
prompt in its ``[B, L, C]`` layout (any strides: a slice of ``in_proj``'s output) and the W-1
inputs before it, and writes ``[B, L, C]``, one pass (the layout of ``causal_conv1d_fn``'s
channel-last path and of fla's ``causal_conv1d``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tree_index import check_parents, conv_tree_columns_i32
from ..triton_common import check_state_indices, load_slot, next_pow2
from .naive import check_prompt_conv_args

__all__ = ["conv1d_verify_triton", "conv1d_tree_verify_triton", "conv1d_commit_triton", "conv1d_update_triton",
           "causal_conv1d_prompt_triton", "Conv1dTritonKernels"]

# 128 channels x up to 16 tokens per program: at most 16 fp32 accumulators per thread with 4
# warps, and B * C / 128 programs (e.g. 64 x 8192 / 128 = 4096 at batch 64 for Mamba-2).
BLOCK_C = 128
NUM_WARPS = 4
# a prompt: [32 tokens, 128 channels] per program (32 fp32 accumulators per thread with 4 warps);
# each program reads its 32 + W-1 rows once from DRAM (the taps' overlapping rows hit the cache)
PROMPT_BLOCK_T = 32


@triton.jit
def _tap(weight, o_c, m_c, W: tl.constexpr, w: tl.constexpr):
    """Tap ``w`` of the depthwise ``weight [C, W]`` for channels ``o_c``, fp32 ``[BC]``."""
    return tl.load(weight + o_c * W + w, mask=m_c, other=0.0).to(tl.float32)


@triton.jit
def _bias_silu(b_acc, bias, o_c, m_c, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The conv's epilogue on the fp32 sums ``b_acc [BT, BC]``: ``+ bias[o_c]`` (HAS_BIAS), then SiLU."""
    if HAS_BIAS:
        b_acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    return b_acc


@triton.jit
def _conv1d_verify_kernel(
    window,  # [S, C, W-1+T_max]
    x,  # [B, T, C], channels contiguous (a slice of a projection's output: any batch / token strides)
    weight,  # [C, W]
    bias,  # [C] (HAS_BIAS)
    out,  # [B, T, C], contiguous
    state_indices,  # [B] (USE_STATE_INDICES)
    cols,  # [T, W] int32 window columns of each token's conv inputs, oldest first (TREE)
    offset,
    C,
    stride_x_b,
    stride_x_t,
    stride_win_n,
    stride_win_c,
    stride_win_t,
    T: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    TREE: tl.constexpr,  # the tokens are a tree (offset 0): token j's window is its ancestor chain
    COMMIT: tl.constexpr,  # a plain step (T = 1, offset 0): the token is committed as it runs
):
    i_c, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    o_c = i_c * BC + tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    m_c = o_c < C
    m_t = o_t < T
    m_tc = m_t[:, None] & m_c[None, :]
    start = W - 1 + offset  # window column of this call's first token
    p_win = window + i_n * stride_win_n + o_c[None, :] * stride_win_c  # [1, BC]
    p_x = x + i_b * stride_x_b + o_c[None, :]  # [1, BC]

    b_x = tl.load(p_x + o_t[:, None] * stride_x_t, mask=m_tc, other=0.0)
    if not COMMIT:
        tl.store(p_win + (start + o_t[:, None]) * stride_win_t, b_x.to(window.dtype.element_ty), mask=m_tc)

    # token j's output reads columns offset+j .. offset+j+W-1; the columns this call writes come
    # from x (registers would need a shift), older ones from the window: no read-after-write.
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    for w in tl.static_range(W):
        if TREE:  # the column of the token's w-th conv input: an ancestor's or the committed history's
            o_col = tl.load(cols + o_t * W + w, mask=m_t, other=0)
        else:
            o_col = offset + o_t + w
        m_old = o_col < start
        b_old = tl.load(p_win + o_col[:, None] * stride_win_t, mask=m_old[:, None] & m_tc, other=0.0)
        b_new = tl.load(p_x + (o_col - start)[:, None] * stride_x_t, mask=(~m_old)[:, None] & m_tc, other=0.0)
        b_new = b_new.to(window.dtype.element_ty)  # the value the window holds, as in the reference
        b_val = tl.where(m_old[:, None], b_old.to(tl.float32), b_new.to(tl.float32))
        b_acc += b_val * _tap(weight, o_c, m_c, W, w)[None, :]
    b_acc = _bias_silu(b_acc, bias, o_c, m_c, HAS_BIAS, SILU)
    tl.store(out + i_b * T * C + o_t[:, None] * C + o_c[None, :], b_acc.to(out.dtype.element_ty), mask=m_tc)
    if COMMIT:  # the history moves by one column, the token last: what the commit kernel would do
        tl.debug_barrier()  # every tap above has read the history
        for w in tl.static_range(1, W - 1):
            b_h = tl.load(p_win + w * stride_win_t, mask=m_tc)
            tl.store(p_win + (w - 1) * stride_win_t, b_h, mask=m_tc)
        if W > 1:
            tl.store(p_win + (W - 2) * stride_win_t, b_x.to(window.dtype.element_ty), mask=m_tc)


@triton.jit
def _conv1d_commit_kernel(
    window,
    num_tokens,  # [B]
    state_indices,
    C,
    stride_win_n,
    stride_win_c,
    stride_win_t,
    HIST: tl.constexpr,  # W - 1
    BH: tl.constexpr,
    BC: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
):
    i_c, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n = load_slot(state_indices, i_b, USE_STATE_INDICES)
    if USE_STATE_INDICES:
        if i_n < 0:  # a padding row
            return
    n = tl.load(num_tokens + i_b).to(tl.int64)
    if n <= 0:
        return
    o_c = i_c * BC + tl.arange(0, BC)
    o_h = tl.arange(0, BH)
    m = (o_h[:, None] < HIST) & (o_c[None, :] < C)
    p_win = window + i_n * stride_win_n + o_c[None, :] * stride_win_c + o_h[:, None] * stride_win_t
    b_hist = tl.load(p_win + n * stride_win_t, mask=m)
    tl.debug_barrier()  # source and destination columns overlap when n < W - 1: read all, then write
    tl.store(p_win, b_hist, mask=m)


@triton.jit
def _causal_conv1d_prompt_kernel(
    x,  # [B, L, C], strided
    weight,  # [C, W]
    bias,  # [C] (HAS_BIAS)
    history,  # [B, W-1, C], strided (HAS_HISTORY)
    out,  # [B, L, C], contiguous
    L,
    C,
    stride_x_b,
    stride_x_t,
    stride_x_c,
    stride_h_b,
    stride_h_t,
    stride_h_c,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    SILU: tl.constexpr,
):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)  # time blocks first: any L
    o_c = i_c * BC + tl.arange(0, BC)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_c = o_c < C
    m_t = o_t < L
    p_x = x + i_b * stride_x_b + o_c[None, :] * stride_x_c  # [1, BC]
    p_h = history + i_b * stride_h_b + o_c[None, :] * stride_h_c  # [1, BC]

    # output t = sum over taps w of weight[:, w] * input t + w - (W-1): from x, or before it from the history
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    for w in tl.static_range(W):
        o_s = o_t + (w - (W - 1))
        m_x = (o_s >= 0) & m_t
        b_val = tl.load(p_x + o_s[:, None] * stride_x_t, mask=m_x[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        if HAS_HISTORY:
            m_h = (o_s < 0) & m_t
            b_val += tl.load(p_h + (o_s + (W - 1))[:, None] * stride_h_t, mask=m_h[:, None] & m_c[None, :],
                             other=0.0).to(tl.float32)
        b_acc += b_val * _tap(weight, o_c, m_c, W, w)[None, :]
    b_acc = _bias_silu(b_acc, bias, o_c, m_c, HAS_BIAS, SILU)
    p_out = out + i_b * L * C + o_t[:, None] * C + o_c[None, :]
    tl.store(p_out, b_acc.to(out.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


def conv1d_verify_triton(window, x, weight, bias=None, activation=None, offset: int = 0, state_indices=None,
                         *, out=None, _cols=None, _commit=False):
    """Write this call's conv inputs into the window and return the conv outputs (multi-token update).

    Args:
        window: ``[S, C, W-1+T_max]`` (any float dtype; S >= B slots), written in place at
            columns ``W-1+offset .. W-1+offset+T-1`` of each used slot.
        x: ``[B, T, C]`` conv inputs of step tokens ``offset .. offset+T-1`` (fp32/bf16/fp16; any
            batch and token strides, read in place when the channels are contiguous).
        weight: ``[C, W]`` depthwise kernel; bias: ``[C]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
        offset: step tokens already written by earlier calls of this step (a Python int).
        state_indices: ``[B]`` int32/int64 window slot per row; negative = padding (row skipped,
            its window and outputs untouched); None = ``arange(B)``.
        out: optional contiguous ``[B, T, C]`` output.

    Returns:
        ``[B, T, C]`` outputs in ``x.dtype`` (computed in fp32), contiguous.

    Raises:
        ValueError: when the step would overflow the window, on bad shapes or an unknown activation.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}; supported: 'silu', None")
    Bsz, T, C = x.shape
    W = weight.shape[-1]
    if weight.shape != (C, W) or window.dim() != 3 or window.shape[1] != C:
        raise ValueError(f"expected window [S, {C}, W-1+T_max] and weight [{C}, W]; got {tuple(window.shape)}, "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias must be [{C}], got {tuple(bias.shape)}")
    if offset < 0 or W - 1 + offset + T > window.shape[-1]:
        raise ValueError(f"conv window holds {window.shape[-1] - (W - 1)} step tokens; got offset {offset} + {T}")
    check_state_indices(state_indices, Bsz)
    if state_indices is None and window.shape[0] < Bsz:
        raise ValueError(f"the window holds {window.shape[0]} rows, inputs have {Bsz}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} tensor, got {tuple(out.shape)}")
    if Bsz == 0 or T == 0:
        return out
    if x.stride(-1) != 1:  # (a slice of a projection's output keeps its channels contiguous: no copy)
        x = x.contiguous()
    weight = weight.contiguous()
    cols = _cols  # a tree's column table (conv1d_tree_verify_triton) or None
    _conv1d_verify_kernel[(triton.cdiv(C, BLOCK_C), Bsz)](
        window, x, weight, bias, out, state_indices,
        cols, offset, C, x.stride(0), x.stride(1), window.stride(0), window.stride(1), window.stride(2),
        T=T, W=W, BT=next_pow2(T), BC=BLOCK_C, HAS_BIAS=bias is not None, SILU=activation is not None,
        USE_STATE_INDICES=state_indices is not None, TREE=cols is not None, COMMIT=_commit,
        num_warps=NUM_WARPS,
    )
    return out


def conv1d_tree_verify_triton(window, x, weight, bias=None, activation=None, parents=None, state_indices=None, *,
                              out=None):
    """:func:`conv1d_verify_triton` for a tree of step tokens (the step's only call, offset 0): token
    j is written at column ``W-1+j`` and its conv runs over its W-1 nearest ancestors (then the
    committed history) and itself, as :func:`specdec.kernels.conv1d.naive.conv1d_tree_verify`.

    Args:
        parents: ``[T]`` ints, token j's parent (``-1``: the committed history), ``parents[j] < j``.
            The per-token column table is built once per tree and cached on the device.
        window, x, weight, bias, activation, state_indices, out: as :func:`conv1d_verify_triton`.

    Raises:
        ValueError: as :func:`conv1d_verify_triton`, or ``parents`` not a tree of the T tokens.
    """
    if parents is None:
        raise ValueError("conv1d_tree_verify_triton needs parents")
    par = check_parents(parents, x.shape[1])
    cols = conv_tree_columns_i32(par, weight.shape[-1], x.device)
    return conv1d_verify_triton(window, x, weight, bias, activation, 0, state_indices, out=out, _cols=cols)


def conv1d_update_triton(window, x, weight, bias=None, activation=None, state_indices=None, *, out=None):
    """A plain decoding step's conv in one launch: :func:`conv1d_verify_triton` of one token at
    offset 0 and :func:`conv1d_commit_triton` of that token for every row
    (:func:`specdec.kernels.conv1d.naive.conv1d_update`). The token is never written to column
    ``W-1``: the history (columns ``0 .. W-2``) moves by one column with the token last, and
    columns from ``W-1`` on are left as they were (stale).

    Args:
        x: ``[B, 1, C]``. window, weight, bias, activation, state_indices, out: as
            :func:`conv1d_verify_triton`.

    Returns:
        ``[B, 1, C]`` outputs in ``x.dtype`` (computed in fp32), contiguous.

    Raises:
        ValueError: ``x`` has more than one token, or as :func:`conv1d_verify_triton`.
    """
    if x.dim() != 3 or x.shape[1] != 1:
        raise ValueError(f"a conv update runs one token per row (a plain decoding step); got x {tuple(x.shape)}")
    return conv1d_verify_triton(window, x, weight, bias, activation, 0, state_indices, out=out, _commit=True)


def conv1d_commit_triton(window: torch.Tensor, num_tokens: torch.Tensor, kernel_width: int,
                         state_indices: torch.Tensor | None = None) -> None:
    """Commit ``num_tokens[b]`` step tokens of each row: history := the W-1 inputs ending there.

    Args:
        window: ``[S, C, W-1+T_max]``, modified in place (columns past W-1 become stale).
        num_tokens: ``[B]`` int32/int64 in ``[0, T_max]``; 0 leaves the row unchanged.
        kernel_width: W.
        state_indices: ``[B]`` window slot per row; negative = padding (skipped); None = ``arange(B)``.

    Raises:
        ValueError: on bad shapes.
    """
    hist = kernel_width - 1
    Bsz = num_tokens.shape[0]
    check_state_indices(state_indices, Bsz)
    if state_indices is None and window.shape[0] < Bsz:
        raise ValueError(f"the window holds {window.shape[0]} rows, num_tokens has {Bsz}")
    if hist <= 0 or Bsz == 0:
        return
    C = window.shape[1]
    _conv1d_commit_kernel[(triton.cdiv(C, BLOCK_C), Bsz)](
        window, num_tokens, state_indices, C, window.stride(0), window.stride(1), window.stride(2),
        HIST=hist, BH=next_pow2(hist), BC=BLOCK_C, USE_STATE_INDICES=state_indices is not None,
        num_warps=NUM_WARPS,
    )


def causal_conv1d_prompt_triton(x, weight, bias=None, activation=None, history=None):
    """:func:`specdec.kernels.conv1d.naive.causal_conv1d_prompt` in one kernel: reads ``x`` once
    (and the history), writes the ``[B, L, C]`` outputs; fp32 arithmetic, one rounding to
    ``x.dtype``. No window, no transposes.

    Args:
        x: ``[B, L, C]`` conv inputs (fp32/bf16/fp16, any strides).
        weight: ``[C, W]`` depthwise kernel; bias: ``[C]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
        history: ``[B, W-1, C]`` the conv inputs before ``x[:, 0]``, oldest first (any strides), or
            None for zeros.

    Returns:
        ``[B, L, C]`` outputs in ``x.dtype``, contiguous.

    Raises:
        ValueError: as :func:`specdec.kernels.conv1d.naive.check_prompt_conv_args`.
    """
    check_prompt_conv_args(x, weight, bias, activation, history)
    Bsz, L, C = x.shape
    W = weight.shape[1]
    out = torch.empty(Bsz, L, C, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    has_history = history is not None and W > 1
    h = history if has_history else x  # an unread placeholder without history
    _causal_conv1d_prompt_kernel[(triton.cdiv(L, PROMPT_BLOCK_T), triton.cdiv(C, BLOCK_C), Bsz)](
        x, weight.contiguous(), None if bias is None else bias.contiguous(), h, out, L, C,
        x.stride(0), x.stride(1), x.stride(2), h.stride(0), h.stride(1), h.stride(2),
        W=W, BT=PROMPT_BLOCK_T, BC=BLOCK_C, HAS_BIAS=bias is not None, HAS_HISTORY=has_history,
        SILU=activation is not None, num_warps=NUM_WARPS,
    )
    return out


class Conv1dTritonKernels:
    """The ``kernels`` of :class:`specdec.kernels.conv1d.Conv1dOp` on the Triton backend
    (:class:`specdec.kernels.protocol.Conv1dKernels` over this module's entry points)."""

    def verify(self, window, x, weight, bias, activation, offset, *, state_indices=None, out=None):
        return conv1d_verify_triton(window, x, weight, bias, activation, offset, state_indices, out=out)

    def tree_verify(self, window, x, weight, bias, activation, parents, *, state_indices=None, out=None):
        return conv1d_tree_verify_triton(window, x, weight, bias, activation, parents, state_indices, out=out)

    def commit(self, window, num_tokens, width, *, state_indices=None):
        conv1d_commit_triton(window, num_tokens, width, state_indices)

    def update(self, window, x, weight, bias, activation, *, state_indices=None, out=None):
        return conv1d_update_triton(window, x, weight, bias, activation, state_indices, out=out)

    def prompt(self, x, weight, bias, activation, history=None):
        return causal_conv1d_prompt_triton(x, weight, bias, activation, history)
