"""Triton kernels of a decode / verify step's attention (:func:`specdec.kernels.attention.step_attention`):
split-KV attention for a few query rows per KV head ("Flash-Decoding": T. Dao, D. Haziza, F. Massa,
G. Sizov, "Flash-Decoding for long-context inference", 2023; the online softmax of T. Dao et al.,
"FlashAttention", 2022).

Layout: the ``R = H / H_kv`` query heads of KV head j and the step's ``t`` tokens form ``R t``
query rows (row ``r t + i``: head ``j R + r``, token i), taken 16 at a time. A program owns one
(row, KV head) pair's 16-row tile and one split of the KV columns; it walks its columns in
``BLOCK_L`` tiles (scores ``q k^T`` on tensor cores in fp32, the additive mask of each row's
token added, an online softmax in fp32, the probabilities rounded to the values' dtype before
``p v`` as FlashAttention does), and writes its running max, denominator and unnormalised output
(fp32) for its split. A second kernel combines the splits of each row (a fixed reduction tree:
deterministic) and writes the output in ``[B, t, H, Dv]``, the layout transformers' attention
functions return.

Each row's result is computed by the same instructions whatever the number of rows (the tile
shape is fixed, the splits depend on the batch, the KV heads and the columns, never on t), so
over the same columns -- a static cache's span, as the static and CUDA-graph paths read -- a
verify step's rows equal a one-token step's bit for bit. (A growing cache's verify step reads
more columns than a one-token step at the same position; where that crosses a split boundary
the rounding may differ.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import next_pow2

__all__ = ["ROW_TILE", "BLOCK_L", "chunk_for", "step_attention_triton", "StepAttentionKernels"]

#: query rows per program (the smallest dot dimension Triton accepts)
ROW_TILE = 16
#: KV columns per inner step
BLOCK_L = 32
#: at most this many splits are aimed for (the combine kernel holds a row's splits in registers)
MAX_SPLITS = 64


@triton.jit(do_not_specialize=["L", "T", "SPLITS"])
def _step_attention_kernel(q, k, v, mask, part, stat, L, T, SPLITS, scale,
                           s_qb, s_qh, s_qt, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_mb, s_mt, s_ml,
                           HKV: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_L: tl.constexpr,
                           CHUNK: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr):
    i_bj, i_s, i_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_j = (i_bj // HKV).to(tl.int64), i_bj % HKV
    rows = i_r * 16 + tl.arange(0, 16)
    m_row = rows < R * T
    i_h = i_j * R + rows // T
    i_t = rows % T
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    b_q = tl.load(q + i_b * s_qb + i_h[:, None] * s_qh + i_t[:, None] * s_qt + o_d[None, :],
                  mask=m_row[:, None] & (o_d < D)[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([16], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([16], dtype=tl.float32)
    b_o = tl.zeros([16, BLOCK_DV], dtype=tl.float32)
    lo = i_s * CHUNK
    hi = tl.minimum(L, lo + CHUNK)
    p_k = k + i_b * s_kb + i_j * s_kh
    p_v = v + i_b * s_vb + i_j * s_vh
    for i_c in range(CHUNK // BLOCK_L):  # (the last split's tail masked)
        cols = lo + i_c * BLOCK_L + tl.arange(0, BLOCK_L)
        m_col = cols < hi
        b_k = tl.load(p_k + cols[:, None] * s_kl + o_d[None, :], mask=m_col[:, None] & (o_d < D)[None, :], other=0.0)
        if UPCAST:
            b_k = b_k.to(tl.float32)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale
        if MASK == 1:  # additive
            b_s += tl.load(mask + i_b * s_mb + i_t[:, None] * s_mt + cols[None, :] * s_ml,
                           mask=m_row[:, None] & m_col[None, :], other=0.0).to(tl.float32)
        if MASK == 2:  # boolean: True attends
            b_keep = tl.load(mask + i_b * s_mb + i_t[:, None] * s_mt + cols[None, :] * s_ml,
                             mask=m_row[:, None] & m_col[None, :], other=0)
            b_s = tl.where(b_keep != 0, b_s, float("-inf"))
        b_s = tl.where(m_col[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # no column yet: nothing to rescale
        b_alpha = tl.exp(b_m - b_m_safe)
        b_p = tl.exp(b_s - b_m_safe[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_v + cols[:, None] * s_vl + o_dv[None, :], mask=m_col[:, None] & (o_dv < DV)[None, :],
                      other=0.0)
        if UPCAST:
            b_o = b_o * b_alpha[:, None] + tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            b_o = b_o * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision="ieee")
        b_m = b_m_new
    # partials: part [B * HKV, SPLITS, R * T padded to 16s, BLOCK_DV]; stat [..., 2] (max, denominator)
    n_rows = tl.num_programs(2) * 16
    base = (i_bj.to(tl.int64) * SPLITS + i_s) * n_rows + rows
    tl.store(part + base[:, None] * BLOCK_DV + o_dv[None, :], b_o)
    tl.store(stat + base * 2, b_m)
    tl.store(stat + base * 2 + 1, b_l)


@triton.jit(do_not_specialize=["T", "SPLITS"])
def _combine_kernel(part, stat, out, T, SPLITS, s_ob, s_ot, s_oh,
                    HKV: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    i_bj, row = tl.program_id(0), tl.program_id(1)
    i_b, i_j = (i_bj // HKV).to(tl.int64), i_bj % HKV
    i_h = i_j * R + row // T
    i_t = row % T
    n_rows = tl.num_programs(1)
    n_rows = ((n_rows + 15) // 16) * 16
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < SPLITS
    base = (i_bj.to(tl.int64) * SPLITS + o_s) * n_rows + row
    b_m = tl.load(stat + base * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(stat + base * 2 + 1, mask=m_s, other=0.0)
    b_max = tl.max(b_m, 0)
    b_w = tl.where(b_m == float("-inf"), 0.0, tl.exp(b_m - tl.where(b_max == float("-inf"), 0.0, b_max)))
    o_dv = tl.arange(0, BLOCK_DV)
    b_o = tl.load(part + base[:, None] * BLOCK_DV + o_dv[None, :], mask=m_s[:, None], other=0.0)
    b_num = tl.sum(b_o * b_w[:, None], 0)
    b_den = tl.sum(b_l * b_w, 0)
    b_y = tl.where(b_den > 0.0, b_num / tl.where(b_den > 0.0, b_den, 1.0), 0.0)
    tl.store(out + i_b * s_ob + i_t * s_ot + i_h * s_oh + o_dv, b_y.to(out.dtype.element_ty), mask=o_dv < DV)


def chunk_for(batch: int, kv_heads: int, columns: int, sms: int) -> int:
    """KV columns per split: a power of two of at least ``BLOCK_L`` (a compile-time trip count, so
    few variants over all cache lengths), small enough that (batch x KV head) x split programs
    fill two waves of ``sms`` SMs. It never depends on the step's token count."""
    want = min(MAX_SPLITS, -(-2 * sms // max(1, batch * kv_heads)))  # splits
    return max(BLOCK_L, next_pow2(-(-columns // want)))


def step_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                          scale: float, out: torch.Tensor, sms: int) -> None:
    """:func:`specdec.kernels.attention.step_attention` for checked arguments: ``query [B, H, t, D]``,
    ``key [B, Hkv, L, D]``, ``value [B, Hkv, L, Dv]`` (last dims contiguous), ``mask`` additive
    ``[B, 1 or absent, t, L]`` as strides (or None), ``out [B, t, H, Dv]`` (last dim contiguous),
    written."""
    B, H, T, D = query.shape
    Hkv, L, Dv = key.shape[1], key.shape[2], value.shape[3]
    R = H // Hkv
    tiles = -(-(R * T) // ROW_TILE)
    chunk = chunk_for(B, Hkv, L, sms)
    splits = -(-L // chunk)  # every split non-empty
    block_dv = next_pow2(Dv)
    part = torch.empty(B * Hkv * splits * tiles * ROW_TILE * block_dv, device=query.device, dtype=torch.float32)
    stat = torch.empty(B * Hkv * splits * tiles * ROW_TILE * 2, device=query.device, dtype=torch.float32)
    kind = 0 if mask is None else 2 if mask.dtype == torch.bool else 1
    ms = (mask.stride(0), mask.stride(2), mask.stride(3)) if mask is not None else (0, 0, 0)
    upcast = query.device.type != "cuda" and query.dtype == torch.bfloat16
    _step_attention_kernel[(B * Hkv, splits, tiles)](
        query, key, value, mask if mask is not None else query, part, stat, L, T, splits, float(scale),
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *ms,
        HKV=Hkv, R=R, D=D, DV=Dv, BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=block_dv, BLOCK_L=BLOCK_L,
        CHUNK=chunk, MASK=kind, UPCAST=upcast or query.dtype == torch.float32, num_warps=4,
    )
    _combine_kernel[(B * Hkv, R * T)](
        part, stat, out, T, splits, out.stride(0), out.stride(1), out.stride(2),
        HKV=Hkv, R=R, DV=Dv, BLOCK_DV=block_dv, BLOCK_S=max(2, next_pow2(splits)),
        num_warps=4,
    )


class StepAttentionKernels:
    """The Triton kernel set of :data:`specdec.kernels.attention.STEP_ATTENTION` (``attend``:
    :func:`step_attention_triton` on the device's SM count)."""

    @staticmethod
    def attend(query, key, value, mask, scale, out):
        from ..linear import num_sms

        step_attention_triton(query, key, value, mask, scale, out, num_sms(query.device))
