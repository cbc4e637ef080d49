"""Prompt-lookup (n-gram) search in one Triton launch for all rows.

Computes exactly :func:`specdec.drafters.ngram.propose_ngram_reference` (Saxena 2023, "Prompt
Lookup Decoding"): for row b with text ``t = input_ids[b, :L]``, the longest n in
``[min_ngram, max_ngram]`` whose suffix n-gram ``t[L-n:]`` also ends at some position
``e <= L - 2``; of those ends the last one; the K tokens ``t[e+1 : e+1+K]`` (cut at the text's
end) are the drafts, the rest of the row zeros.

One program per row walks the candidate ends ``e = 0 .. L-2`` in blocks of ``BLOCK``. For each
end it counts the run ``r(e)``: how many of the tokens ``t[e], t[e-1], ..`` equal the suffix's
``t[L-1], t[L-2], ..`` in a row (at most ``max_ngram``; the text's start ends a run), from
``max_ngram`` shifted loads of the block. An n-gram of length n ends at e exactly when
``r(e) >= n``, so the longest matching n is ``M = max_e r(e)`` (a match if ``M >= min_ngram``)
and its most recent end is the largest e with ``r(e) = M``: both are the maximum of the key
``r(e) * 2**32 + e``, kept per lane across blocks and reduced once at the end. The drafts are
then one masked load of K tokens.

O(L * max_ngram) loads per row, all from the row's own text (cache hits after the first); no
host synchronisation, no allocation besides the outputs (none with ``out``), no autotuning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import next_pow2, num_warps_for

__all__ = ["ngram_propose_triton", "NGramTritonKernels", "BLOCK"]

#: candidate ends per block: the text's width rounded up to this many ends is walked in
#: ceil((L - 1) / BLOCK) iterations (5 for a 4k prompt plus 512 new tokens). Fixed, not a power
#: of two of the width, so a growing text does not recompile the kernel at each doubling.
BLOCK = 1024
#: the drafts' register block holds at least this many tokens: one compiled kernel for every K
#: up to it (adaptive speculation changes K from step to step)
BLOCK_K_MIN = 16


@triton.jit(do_not_specialize=["W", "K", "min_ngram", "stride_t_b", "stride_t_w", "stride_d_b"])
def _ngram_propose_kernel(
    input_ids,  # [B, W] integer token ids
    lengths,  # [B] integer text lengths
    drafts,  # [B, K] int64, written
    counts,  # [B] int64, written
    W,
    K,
    min_ngram,
    stride_t_b,
    stride_t_w,
    stride_d_b,
    MAX_NGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    p_t = input_ids + i_b * stride_t_b
    L = tl.minimum(tl.maximum(tl.load(lengths + i_b).to(tl.int64), 0), W)  # lengths outside [0, W]: clamped
    suffix = ()  # the suffix tokens t[L-1], t[L-2], .. (t[L-1-i] for i < MAX_NGRAM; 0 before the start)
    for i in tl.static_range(MAX_NGRAM):
        suffix = suffix + (tl.load(p_t + (L - 1 - i) * stride_t_w, mask=L - 1 - i >= 0, other=0),)
    o_k = tl.arange(0, BLOCK)
    # per lane, the largest key r(e) * 2**32 + e seen; -1: no end yet
    b_best = tl.full([BLOCK], -1, tl.int64)
    start = L * 0
    while start < L - 1:  # a while loop: a range over a loaded bound fails in Triton's interpreter
        o_e = start + o_k  # candidate ends of this block
        m_e = o_e <= L - 2  # the suffix itself (ending at L - 1) is no candidate
        b_run = m_e
        b_r = tl.zeros([BLOCK], tl.int64)
        for i in tl.static_range(MAX_NGRAM):
            # t[e-i] against t[L-1-i]; the loads' masks do not depend on earlier compares, so
            # all MAX_NGRAM loads of a block are in flight at once
            m_i = m_e & (o_e - i >= 0)
            b_tok = tl.load(p_t + (o_e - i) * stride_t_w, mask=m_i, other=0)
            b_run = b_run & m_i & (b_tok == suffix[i])
            b_r += b_run.to(tl.int64)
        b_best = tl.maximum(b_best, tl.where(m_e, (b_r << 32) + o_e, -1))
        start += BLOCK
    best = tl.max(b_best, axis=0)
    n = best >> 32  # the longest matching n-gram (-1 for a text with no candidate end)
    cont = best - (n << 32) + 1  # where the continuation of its most recent occurrence starts
    count = tl.where(n >= min_ngram, tl.minimum(L - cont, K), 0)
    o_j = tl.arange(0, BLOCK_K)
    b_d = tl.load(p_t + (cont + o_j) * stride_t_w, mask=o_j < count, other=0)
    tl.store(drafts + i_b * stride_d_b + o_j, b_d.to(tl.int64), mask=o_j < K)
    tl.store(counts + i_b, count.to(tl.int64))


def ngram_propose_triton(input_ids: torch.Tensor, lengths: torch.Tensor, num_speculative_tokens: int,
                         min_ngram: int = 1, max_ngram: int = 3, *,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None,
                         block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafts of every row in one launch (semantics: this module's docstring).

    Args:
        input_ids: ``[B, W]`` integer token ids (any strides); row b's text is
            ``input_ids[b, :lengths[b]]``, entries past it are ignored.
        lengths: ``[B]`` integer, on the device of ``input_ids``; values in ``[0, W]`` (not
            checked on the device: a value outside is clamped to it).
        num_speculative_tokens: K >= 0, the most drafts per row.
        min_ngram, max_ngram: the n-gram lengths tried, ``1 <= min_ngram <= max_ngram``
            (``max_ngram`` is compiled into the kernel).
        out: optional ``(drafts [B, K], counts [B])`` contiguous int64 tensors on the same
            device, fully written; None allocates them.
        block: candidate ends per block (rounded up to a power of two, at least 16); None:
            :data:`BLOCK`. For tests.

    Returns:
        ``(drafts [B, K] int64, counts [B] int64)``: row b's first ``counts[b]`` drafts, then
        zeros; ``counts[b] = 0`` where no n-gram matched.

    Raises:
        ValueError: on wrong shapes, dtypes, devices or n-gram sizes.
    """
    K = num_speculative_tokens
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be a [B, W] integer tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
    B, W = input_ids.shape
    if tuple(lengths.shape) != (B,) or lengths.dtype.is_floating_point or lengths.device != input_ids.device:
        raise ValueError(f"lengths must be a [{B}] integer tensor on {input_ids.device}, got {lengths.dtype} "
                         f"{tuple(lengths.shape)} on {lengths.device}")
    if not (isinstance(K, int) and K >= 0):
        raise ValueError(f"num_speculative_tokens must be an int >= 0, got {K!r}")
    if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
        raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if out is None:
        drafts = torch.empty(B, K, dtype=torch.long, device=input_ids.device)
        counts = torch.empty(B, dtype=torch.long, device=input_ids.device)
    else:
        drafts, counts = out
        for name, t, shape in (("drafts", drafts, (B, K)), ("counts", counts, (B,))):
            if (tuple(t.shape) != shape or t.dtype != torch.long or t.device != input_ids.device
                    or not t.is_contiguous()):
                raise ValueError(f"out {name} must be a contiguous int64 {list(shape)} tensor on {input_ids.device}, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if B == 0:
        return drafts, counts
    blk = BLOCK if block is None else max(16, next_pow2(block))
    _ngram_propose_kernel[(B,)](
        input_ids, lengths, drafts, counts, W, K, min_ngram,
        input_ids.stride(0), input_ids.stride(1), max(K, 1),
        MAX_NGRAM=max_ngram, BLOCK=blk, BLOCK_K=max(BLOCK_K_MIN, next_pow2(K)),
        num_warps=num_warps_for(blk),
    )
    return drafts, counts


class NGramTritonKernels:
    """The ``kernels`` of :class:`specdec.kernels.ngram.NGramOp` on the Triton backend."""

    def propose(self, input_ids, lengths, num_speculative_tokens, min_ngram=1, max_ngram=3, *, out=None):
        return ngram_propose_triton(input_ids, lengths, num_speculative_tokens, min_ngram, max_ngram, out=out)
