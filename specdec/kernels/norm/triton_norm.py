"""The RMSNorms of :mod:`specdec.kernels.norm` in Triton: one program per (token, group), a gated
norm's, or per token, a plain one's.

Nothing syncs with the host or autotunes; the only allocation is the output (safe in CUDA-graph
capture once compiled). Arithmetic in fp32, rounded where the modules round (``rounded``): the
normalised value to y's dtype, then its product with the weight; a zero-centred weight
(``offset``) scales by ``1 + weight`` in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..protocol import FLOAT_DTYPES
from ..triton_common import next_pow2, num_warps_for, rows_of
from . import check_activation

__all__ = ["gated_rms_norm_triton", "rms_norm_triton"]


@triton.jit
def _rms_norm_kernel(y, gate, weight, out, D, stride_ym, stride_gm, eps, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, SIGMOID: tl.constexpr,
                     ROUNDED: tl.constexpr, OFFSET: tl.constexpr):
    i_m, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_g * GROUP + tl.arange(0, BLOCK)
    m_c = tl.arange(0, BLOCK) < GROUP
    b_y = tl.load(y + i_m * stride_ym + o_c, mask=m_c, other=0.0)
    b_h = b_y.to(tl.float32)
    if HAS_GATE:
        b_z = tl.load(gate + i_m * stride_gm + o_c, mask=m_c, other=0.0).to(tl.float32)
        if SIGMOID:
            b_act = tl.sigmoid(b_z)
        else:
            b_act = b_z * tl.sigmoid(b_z)
        if not GATE_AFTER:
            b_h = b_h * b_act
    b_h = b_h * tl.rsqrt(tl.sum(b_h * b_h, axis=0) / GROUP + eps)
    if ROUNDED:  # the modules round the normalised value to y's dtype first
        b_h = b_h.to(b_y.dtype).to(tl.float32)
    b_w = tl.load(weight + o_c, mask=m_c, other=0.0).to(tl.float32)
    if OFFSET:  # a zero-centred weight: the scale is 1 + weight, in fp32
        b_w = b_w + 1.0
    b_o = b_w * b_h
    if HAS_GATE:
        if GATE_AFTER:  # gated in fp32 (rounded: after the product with the weight in y's dtype)
            if ROUNDED:
                b_o = b_o.to(b_y.dtype).to(tl.float32)
            b_o = b_o * b_act
    tl.store(out + i_m * D + o_c, b_o.to(out.dtype.element_ty), mask=m_c)


def _output(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if out.shape != y.shape or out.dtype != y.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(y.shape)} {y.dtype} tensor")
    return out


def gated_rms_norm_triton(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                          gate_after: bool = False, activation: str = "silu", rounded: bool = True, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`specdec.kernels.norm.gated_rms_norm` (its arguments, returns and errors)."""
    check_activation(activation)
    D = y.shape[-1]
    if gate.shape != y.shape or weight.shape != (D,):
        raise ValueError(f"expected y and gate [..., D] and weight [D]; got {tuple(y.shape)}, {tuple(gate.shape)}, "
                         f"{tuple(weight.shape)}")
    if group_size < 1 or D % group_size:
        raise ValueError(f"group size {group_size} does not divide the {D} channels")
    if weight.dtype != y.dtype:
        raise ValueError(f"weight must be in y's dtype {y.dtype}, got {weight.dtype}")
    y2, g2 = rows_of(y), rows_of(gate)  # (views where the rows are strided, as slices are)
    out = _output(y, out)
    M = y2.shape[0]
    if M == 0:
        return out
    block = next_pow2(group_size)
    _rms_norm_kernel[(M, D // group_size)](
        y2, g2, weight.contiguous(), out, D, y2.stride(0), g2.stride(0), float(eps),
        GROUP=group_size, BLOCK=block, HAS_GATE=True, GATE_AFTER=bool(gate_after), SIGMOID=activation == "sigmoid",
        ROUNDED=bool(rounded), OFFSET=False, num_warps=num_warps_for(block, 8),
    )
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False, rounded: bool = True, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`specdec.kernels.norm.rms_norm` (its arguments, returns and errors)."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"expected x [..., D] and weight [D]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must be in x's dtype {x.dtype}, got {weight.dtype}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    x2 = rows_of(x)
    out = _output(x, out)
    M = x2.shape[0]
    if M == 0:
        return out
    block = next_pow2(D)
    _rms_norm_kernel[(M, 1)](
        x2, x2, weight.contiguous(), out, D, x2.stride(0), 0, float(eps),
        GROUP=D, BLOCK=block, HAS_GATE=False, GATE_AFTER=False, SIGMOID=False, ROUNDED=bool(rounded),
        OFFSET=bool(offset), num_warps=num_warps_for(block, 8),
    )
    return out
