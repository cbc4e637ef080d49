"""The Mamba-2 prompt scan's two per-head element-wise passes in Triton, one launch each.

Around flash-linear-attention's chunked scan (:func:`specdec.kernels.mamba2.chunked.mamba2_chunk_scan_fla`)
a Mamba-2 prompt forms the discretised input ``v = dt x`` and adds the skip ``y + D x``. ``x`` is a
slice of the conv's output (``[B, L, H, P]`` with the conv's channel count as its token stride) and
``dt`` / ``D`` are fp32 per token and head / per head, so PyTorch runs both through its strided,
mixed-dtype element-wise kernel, which moves one element per thread step (on an H200, ~280 and
~370 us per Nemotron-H-4B layer at 64 x 128 prompt tokens, 4-5x their bytes at copy bandwidth).
Here one program owns one token and a block of heads, reads ``x`` in place and does the same
arithmetic: the product in fp32 rounded once to the output's dtype, the skip's multiply-add in
fp32 rounded once (as ``torch.mul(..., out=)`` and ``Tensor.addcmul_`` compute them). No host
sync, no autotuning; the only allocation is ``v``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..protocol import FLOAT_DTYPES
from ..triton_common import next_pow2

__all__ = ["discretized_input_triton", "add_skip_triton_"]

#: heads per program (x BLOCK_P head channels: 16 x 64 = 1,024 elements at Mamba-2's head size)
BLOCK_H = 16


@triton.jit
def _heads_kernel(x, s, y, out, H, P, stride_xm, stride_xh, stride_sm, stride_ym, stride_om,
                  SKIP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    i_m, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_p = tl.arange(0, BLOCK_P)
    m_h = o_h < H
    m = m_h[:, None] & (o_p < P)[None, :]
    b_x = tl.load(x + i_m * stride_xm + o_h[:, None] * stride_xh + o_p[None, :], mask=m, other=0.0).to(tl.float32)
    if SKIP:  # y + x D, D per head
        b_d = tl.load(s + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_y = tl.load(y + i_m * stride_ym + o_h[:, None] * P + o_p[None, :], mask=m, other=0.0).to(tl.float32)
        b_o = b_y + b_x * b_d[:, None]
    else:  # dt x, dt per token and head
        b_s = tl.load(s + i_m * stride_sm + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_o = b_x * b_s[:, None]
    tl.store(out + i_m * stride_om + o_h[:, None] * P + o_p[None, :], b_o.to(out.dtype.element_ty), mask=m)


def _token_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """``(token stride, head stride)`` of ``t [B, L, H, P]`` when its ``B * L`` tokens are evenly
    strided rows of heads whose ``P`` channels are contiguous (e.g. a slice of a wider ``[B, L,
    C]`` tensor), else None. The strides of dims of size 1 do not count."""
    B, L, H, P = t.shape
    if P > 1 and t.stride(3) != 1:
        return None
    if B > 1 and L > 1 and t.stride(0) != L * t.stride(1):
        return None
    return t.stride(1) if L > 1 else t.stride(0), t.stride(2) if H > 1 else P


def _launch(x, s, y, out, skip: bool, stride_sm: int) -> None:
    B, L, H, P = x.shape
    sx = _token_rows(x)
    if sx is None:
        x = x.clone(memory_format=torch.contiguous_format)
        sx = (H * P, P)
    M = B * L
    if M == 0:
        return
    block_p = next_pow2(P)
    block_h = min(BLOCK_H, next_pow2(H))
    _heads_kernel[(M, triton.cdiv(H, block_h))](
        x, s, y, out, H, P, sx[0], sx[1], stride_sm, H * P, H * P,
        SKIP=skip, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=4 if block_h * block_p >= 512 else 1,
    )


def discretized_input_triton(x: torch.Tensor, dt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v = dt x`` (:func:`specdec.kernels.mamba2.chunked.discretized_input`: arguments, returns, errors)."""
    B, L, H, P = x.shape
    if dt.shape != (B, L, H):
        raise ValueError(f"expected x [B, L, H, P] and dt [B, L, H]; got {tuple(x.shape)} and {tuple(dt.shape)}")
    if x.dtype not in FLOAT_DTYPES or dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and the output must be fp32, bf16 or fp16; got {x.dtype} and {dtype}")
    dt = dt.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _launch(x, dt, out, out, False, H)
    return out


def add_skip_triton_(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``y += x D`` in place (:func:`specdec.kernels.mamba2.chunked.add_skip_`: arguments, returns, errors)."""
    B, L, H, P = x.shape
    if y.shape != x.shape or D.shape != (H,) or not y.is_contiguous():
        raise ValueError(f"expected y [B, L, H, P] contiguous, x of its shape and D [H]; got {tuple(y.shape)}, "
                         f"{tuple(x.shape)}, {tuple(D.shape)}{'' if y.is_contiguous() else ' (y not contiguous)'}")
    if x.dtype not in FLOAT_DTYPES or y.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and y must be fp32, bf16 or fp16; got {x.dtype} and {y.dtype}")
    _launch(x, D.to(torch.float32).contiguous(), y, y, True, 0)
    return y
