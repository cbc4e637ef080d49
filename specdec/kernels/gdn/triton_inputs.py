"""The Gated DeltaNet recurrence's inputs for one step, in one Triton launch.

Between its conv and its recurrence a GDN layer turns the conv's q / k / v and the raw ``b`` /
``a`` projections into what the delta rule takes (as transformers' Qwen3.5 / Qwen3-Next decode
step computes them, :func:`specdec.models.gdn._gdn_inputs` being the torch reference)::

    beta = sigmoid(b)                                  (in b's dtype, then fp32)
    g    = -exp(A_log) * softplus(a + dt_bias)         (fp32; softplus as torch's: x above 20, NaN kept)
    q    = l2norm(q) * Dk**-0.5,  k = l2norm(k)        (fp32; l2norm(x) = x * rsqrt(sum x^2 + 1e-6))
    v    = v                                           (fp32)

with the key heads repeated to the value heads (value head h reads key head ``h // (Hv / Hk)``).
Element-wise work on a few kilobytes per token: as separate kernels (even fused by Inductor, five
per layer) each costs a launch, which dominates at decode sizes. Here one program owns one
(token, value head) and writes all five outputs. Nothing syncs with the host or allocates inside
the launch, so it is safe in CUDA-graph capture once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import SOFTPLUS_THRESHOLD, has_libdevice, exp_f32, next_pow2, softplus
from . import L2NORM_EPS

__all__ = ["gdn_step_inputs"]


# T and the batch strides (T * width) change with the step's width: not specialised on, one compile serves all
@triton.jit(do_not_specialize=["T", "stride_qb", "stride_kb", "stride_vb", "stride_bb", "stride_ab"])
def _gdn_inputs_kernel(
    q, k, v, b, a, A_log, dt_bias,
    qo, ko, vo, go, bo,
    T, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bb, stride_bt, stride_bh, stride_ab, stride_at, stride_ah,
    scale, eps, threshold,
    HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, ACCURATE: tl.constexpr,
):
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)  # token (row-major over [B, T]), value head
    i_b, i_t = i_n // T, i_n % T  # (64-bit offsets throughout)
    i_hk = i_h // REP
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    o_v = tl.arange(0, BV)
    m_v = o_v < DV
    b_q = tl.load(q + i_b * stride_qb + i_t * stride_qt + i_hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_b * stride_kb + i_t * stride_kt + i_hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_b * stride_vb + i_t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + eps) * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + eps)
    out = i_n * HV + i_h
    tl.store(qo + out * DK + o_k, b_q, mask=m_k)
    tl.store(ko + out * DK + o_k, b_k, mask=m_k)
    tl.store(vo + out * DV + o_v, b_v, mask=m_v)
    # beta = sigmoid(b), rounded to b's dtype (to nearest, as torch's b.sigmoid(); Triton's interpreter
    # truncates instead, so there a bf16 beta may be one unit lower)
    b_b = tl.load(b + i_b * stride_bb + i_t * stride_bt + i_h * stride_bh)
    tl.store(bo + out, tl.sigmoid(b_b.to(tl.float32)).to(b_b.dtype, fp_downcast_rounding="rtne").to(tl.float32))
    # g = -exp(A_log) * softplus(a + dt_bias)
    x = tl.load(a + i_b * stride_ab + i_t * stride_at + i_h * stride_ah).to(tl.float32) \
        + tl.load(dt_bias + i_h).to(tl.float32)
    b_A = -exp_f32(tl.load(A_log + i_h).to(tl.float32), ACCURATE)
    tl.store(go + out, b_A * softplus(x, threshold, ACCURATE))


def gdn_step_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, *, out=None):
    """The delta rule's inputs for one step of a GDN layer (see the module docstring), in one launch.

    Args:
        q, k: ``[B, T, Hk, Dk]`` the conv's query and key heads, any dtype; the last dim contiguous
            (views of the conv output are taken as they are).
        v: ``[B, T, Hv, Dv]``, last dim contiguous. b, a: ``[B, T, Hv]`` the raw beta and decay
            projections. A_log, dt_bias: ``[Hv]`` the layer's parameters. ``Hv`` a multiple of ``Hk``.
        out: None, or the five outputs to write, shaped and typed as returned (contiguous).

    Returns:
        ``(q, k, v, g, beta)``: ``[B, T, Hv, Dk]``, ``[B, T, Hv, Dk]``, ``[B, T, Hv, Dv]``,
        ``[B, T, Hv]``, ``[B, T, Hv]``, all fp32 and contiguous; q L2-normalised and scaled by
        ``Dk**-0.5``, k L2-normalised, ``g <= 0`` the log decay, ``beta`` in [0, 1]. Compiled for
        CUDA, the exps are libdevice's (as accurate as torch's); in Triton's interpreter numpy's.

    Raises:
        ValueError: shapes that do not fit each other, a last dim that is not contiguous, devices
            that differ, or ``out`` of another shape, dtype or layout.
    """
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [B, T, Hk, Dk] and v [B, T, Hv, Dv]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if b.shape != (B, T, Hv) or a.shape != (B, T, Hv) or A_log.shape != (Hv,) or dt_bias.shape != (Hv,):
        raise ValueError(f"expected b, a [B, T, Hv] = {[B, T, Hv]} and A_log, dt_bias [Hv]; got {tuple(b.shape)}, "
                         f"{tuple(a.shape)}, {tuple(A_log.shape)}, {tuple(dt_bias.shape)}")
    named = {"q": q, "k": k, "v": v, "b": b, "a": a, "A_log": A_log, "dt_bias": dt_bias}
    if any(t.device != q.device for t in named.values()):
        raise ValueError(f"inputs on several devices: { {n: str(t.device) for n, t in named.items()} }")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k and v need a contiguous last dim (strides "
                         f"{q.stride()}, {k.stride()}, {v.stride()})")
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    shapes = ((B, T, Hv, Dk), (B, T, Hv, Dk), (B, T, Hv, Dv), (B, T, Hv), (B, T, Hv))
    if out is None:
        out = tuple(torch.empty(s, dtype=torch.float32, device=q.device) for s in shapes)
    elif len(out) != 5 or any(o.shape != s or o.dtype != torch.float32 or not o.is_contiguous() or o.device != q.device
                              for o, s in zip(out, shapes)):
        raise ValueError(f"out must be five contiguous fp32 tensors on {q.device} shaped {[list(s) for s in shapes]}")
    if B * T and Hv:
        _gdn_inputs_kernel[(B * T, Hv)](
            q, k, v, b, a, A_log, dt_bias, *out,
            T, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *b.stride(), *a.stride(),
            Dk ** -0.5, L2NORM_EPS, SOFTPLUS_THRESHOLD,
            HV=Hv, REP=Hv // Hk, DK=Dk, DV=Dv, BK=next_pow2(Dk), BV=next_pow2(Dv), ACCURATE=has_libdevice(q.device),
            num_warps=1,
        )
    return out
