"""An MLP's activation over a prompt's rows in one Triton launch: ``act(g) * u`` (a gated MLP) or
``act(u)``, with each intermediate rounded where the eager module's is (the skinny kernel's
epilogue, :func:`specdec.kernels.linear.triton_skinny._epilogue`). Eagerly a gated MLP's
activation and product are two element-wise launches over ``[rows, intermediate]`` tensors
(three passes of memory), a squared ReLU's two (``relu``, then ``square``); here one pass. No host
sync, no autotuning; the only allocation is the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..protocol import FLOAT_DTYPES
from ..triton_common import rows_of
from .triton_skinny import ACT_CODES, _epilogue

__all__ = ["mlp_activation_triton"]

#: columns per program
BLOCK_N = 1024


@triton.jit
def _mlp_activation_kernel(g, u, out, N, stride_gm, stride_um, ACT: tl.constexpr, GATED: tl.constexpr,
                           BLOCK: tl.constexpr):
    i_m, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    b_g = tl.load(g + i_m * stride_gm + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_u = b_g
    if GATED:
        b_u = tl.load(u + i_m * stride_um + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_o = _epilogue(b_g, b_u, out.dtype.element_ty, ACT, GATED)
    tl.store(out + i_m * N + o_n, b_o.to(out.dtype.element_ty), mask=m_n)


def mlp_activation_triton(g: torch.Tensor, u: torch.Tensor | None, activation: str) -> torch.Tensor:
    """:func:`specdec.kernels.linear.mlp_activation` (its arguments, returns and errors)."""
    if activation not in ACT_CODES or activation is None:
        raise ValueError(f"activation must be one of {tuple(a for a in ACT_CODES if a)}, got {activation!r}")
    if g.dtype not in FLOAT_DTYPES:
        raise ValueError(f"g must be fp32, bf16 or fp16, got {g.dtype}")
    if u is not None and (u.shape != g.shape or u.dtype != g.dtype or u.device != g.device):
        raise ValueError(f"u must be g's shape, dtype and device: {tuple(g.shape)} {g.dtype}, got {tuple(u.shape)} "
                         f"{u.dtype}")
    N = g.shape[-1]
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if g.numel() == 0:
        return out
    g2 = rows_of(g)
    u2 = g2 if u is None else rows_of(u)
    M = g2.shape[0]
    _mlp_activation_kernel[(M, triton.cdiv(N, BLOCK_N))](
        g2, u2, out, N, g2.stride(0), u2.stride(0), ACT=ACT_CODES[activation], GATED=u is not None, BLOCK=BLOCK_N,
        num_warps=4,
    )
    return out
