"""One Triton launch writing a step's keys and values into a static KV cache
(:func:`specdec.kernels.kv.write_kv`): a program per (row, step token, head) copies that head's
key and value vectors to column ``seq_len[row] + offset + token`` of its buffers. A plain copy in
the buffers' dtype; the column is read on the device (no host sync), so a CUDA graph replays it
for whatever ``seq_len`` holds then.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import next_pow2

__all__ = ["write_kv_triton", "KVWriteKernels"]


# the offset and the step width vary between forwards: not specialised on, one compile serves them
@triton.jit(do_not_specialize=["offset", "T"])
def _write_kv_kernel(kbuf, vbuf, keys, values, seq_len, offset, T,
                     s_kb_b, s_kb_h, s_kb_l, s_vb_b, s_vb_h, s_vb_l,
                     s_k_b, s_k_h, s_k_t, s_v_b, s_v_h, s_v_t,
                     H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_bt, i_h = tl.program_id(0), tl.program_id(1)
    i_b, i_t = (i_bt // T).to(tl.int64), i_bt % T  # (64-bit offsets: a row of a long cache passes 2**31 elements)
    col = tl.load(seq_len + i_b) + offset + i_t
    o_k = tl.arange(0, BK)
    b_k = tl.load(keys + i_b * s_k_b + i_h * s_k_h + i_t * s_k_t + o_k, mask=o_k < DK)
    tl.store(kbuf + i_b * s_kb_b + i_h * s_kb_h + col * s_kb_l + o_k, b_k, mask=o_k < DK)
    o_v = tl.arange(0, BV)
    b_v = tl.load(values + i_b * s_v_b + i_h * s_v_h + i_t * s_v_t + o_v, mask=o_v < DV)
    tl.store(vbuf + i_b * s_vb_b + i_h * s_vb_h + col * s_vb_l + o_v, b_v, mask=o_v < DV)


def write_kv_triton(kbuf: torch.Tensor, vbuf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    seq_len: torch.Tensor, offset: int) -> None:
    """:func:`specdec.kernels.kv.write_kv` in one launch, for arguments it checked (dtypes equal to
    the buffers', last dims contiguous, ``seq_len`` int64)."""
    B, H, T, Dk = keys.shape
    Dv = values.shape[3]
    if B * T * H == 0:
        return
    _write_kv_kernel[(B * T, H)](
        kbuf, vbuf, keys, values, seq_len, int(offset), T,
        *kbuf.stride()[:3], *vbuf.stride()[:3], *keys.stride()[:3], *values.stride()[:3],
        H=H, DK=Dk, DV=Dv, BK=next_pow2(Dk), BV=next_pow2(Dv), num_warps=1,
    )


class KVWriteKernels:
    """The Triton kernel set of :data:`specdec.kernels.kv.KV_WRITE` (``write``: :func:`write_kv_triton`)."""

    write = staticmethod(write_kv_triton)
