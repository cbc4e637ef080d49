"""The Mamba-2 recurrence's inputs for one step, in one Triton launch.

Between its conv and its selective state update a Mamba-2 layer turns the conv's ``x`` / ``B`` /
``C`` and the raw ``dt`` projection into what the update takes (as transformers' decode step
computes them; :func:`specdec.models.mamba2._mamba2_inputs` is the torch reference)::

    dt = softplus(dt + dt_bias)       (fp32; softplus as torch's: x above 20, NaN kept)
    A  = -exp(A_log),  D = D          (fp32, per head)
    x, B, C                           (fp32 copies, heads / groups split out)

Element-wise work on a few kilobytes per token, several kernels when run as torch operations
(fused by Inductor, still one per output size); here one program owns one (token, head) and
writes its slice of every output (the programs of heads below the group count also the groups'
``B`` and ``C``, those of the first token ``A`` and ``D``). Nothing syncs with the host or
allocates inside the launch, so it is safe in CUDA-graph capture once compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import SOFTPLUS_THRESHOLD, has_libdevice, exp_f32, next_pow2, softplus

__all__ = ["mamba2_step_inputs"]


# T and the batch strides (T * width) change with the step's width: not specialised on, one compile serves all
@triton.jit(do_not_specialize=["T", "stride_xb", "stride_db", "stride_bb", "stride_cb"])
def _mamba2_inputs_kernel(
    x, dt, Bm, Cm, dt_bias, A_log, D,
    xo, dto, Bo, Co, Ao, Do,
    T, stride_xb, stride_xt, stride_db, stride_dt, stride_bb, stride_bt, stride_cb, stride_ct, threshold,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, ACCURATE: tl.constexpr,
):
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)  # token (row-major over [B, T]), head
    i_b, i_t = i_n // T, i_n % T  # (64-bit offsets throughout)
    o_p = tl.arange(0, BP)
    m_p = o_p < P
    b_x = tl.load(x + i_b * stride_xb + i_t * stride_xt + i_h * P + o_p, mask=m_p, other=0.0)
    tl.store(xo + (i_n * H + i_h) * P + o_p, b_x.to(tl.float32), mask=m_p)
    b_dt = tl.load(dt + i_b * stride_db + i_t * stride_dt + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    tl.store(dto + i_n * H + i_h, softplus(b_dt, threshold, ACCURATE))
    if i_h < G:
        o_s = tl.arange(0, BN)
        m_s = o_s < N
        b_B = tl.load(Bm + i_b * stride_bb + i_t * stride_bt + i_h * N + o_s, mask=m_s, other=0.0)
        b_C = tl.load(Cm + i_b * stride_cb + i_t * stride_ct + i_h * N + o_s, mask=m_s, other=0.0)
        tl.store(Bo + (i_n * G + i_h) * N + o_s, b_B.to(tl.float32), mask=m_s)
        tl.store(Co + (i_n * G + i_h) * N + o_s, b_C.to(tl.float32), mask=m_s)
    if i_n == 0:
        tl.store(Ao + i_h, -exp_f32(tl.load(A_log + i_h).to(tl.float32), ACCURATE))
        if HAS_D:
            tl.store(Do + i_h, tl.load(D + i_h).to(tl.float32))


def mamba2_step_inputs(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt_bias: torch.Tensor,
                       A_log: torch.Tensor, D: torch.Tensor | None, heads: int, groups: int):
    """The selective state update's inputs for one step of a Mamba-2 layer (see the module
    docstring), in one launch.

    Args:
        x: ``[Bt, T, heads * P]`` the conv's x, any dtype, its last dim contiguous (a view of the
            conv output is taken as it is). dt: ``[Bt, T, heads]`` the raw time-step projection,
            last dim contiguous. B, C: ``[Bt, T, groups * N]``, last dim contiguous. dt_bias,
            A_log: ``[heads]``; D: ``[heads]`` or None. ``heads`` a multiple of ``groups``.

    Returns:
        ``(x, dt, B, C, A, D)``: ``[Bt, T, heads, P]``, ``[Bt, T, heads]``, ``[Bt, T, groups, N]`` twice,
        ``[heads]``, ``[heads]`` (None without D), all fp32 and contiguous; ``dt >= 0``, ``A <= 0``
        (zero only where an exp underflows). Compiled for CUDA, the exps are libdevice's (as
        accurate as torch's); in Triton's interpreter numpy's.

    Raises:
        ValueError: shapes that do not fit each other or the head / group counts, a last dim that
            is not contiguous, or inputs on several devices.
    """
    if x.dim() != 3 or dt.dim() != 3 or B.dim() != 3 or C.shape != B.shape or not (
            x.shape[:2] == dt.shape[:2] == B.shape[:2]):
        raise ValueError(f"expected x [Bt, T, heads * P], dt [Bt, T, heads] and B, C [Bt, T, groups * N]; got "
                         f"{tuple(x.shape)}, {tuple(dt.shape)}, {tuple(B.shape)}, {tuple(C.shape)}")
    Bt, T = x.shape[:2]
    if heads < 1 or groups < 1 or heads % groups or dt.shape[2] != heads or x.shape[2] % heads or B.shape[2] % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups}) and fit dt {tuple(dt.shape)}, "
                         f"x {tuple(x.shape)}, B {tuple(B.shape)}")
    P, N = x.shape[2] // heads, B.shape[2] // groups
    params = {"dt_bias": dt_bias, "A_log": A_log, **({"D": D} if D is not None else {})}
    if any(p.shape != (heads,) for p in params.values()):
        raise ValueError(f"dt_bias, A_log, D must be [{heads}]; got { {n: tuple(p.shape) for n, p in params.items()} }")
    named = {"x": x, "dt": dt, "B": B, "C": C, **params}
    if any(t.device != x.device for t in named.values()):
        raise ValueError(f"inputs on several devices: { {n: str(t.device) for n, t in named.items()} }")
    if any(t.stride(-1) != 1 for t in (x, dt, B, C)):
        raise ValueError(f"x, dt, B and C need a contiguous last dim (strides {x.stride()}, {dt.stride()}, "
                         f"{B.stride()}, {C.stride()})")
    dt_bias, A_log = dt_bias.contiguous(), A_log.contiguous()
    D = D.contiguous() if D is not None else None
    f32 = dict(dtype=torch.float32, device=x.device)
    xo, dto = torch.empty(Bt, T, heads, P, **f32), torch.empty(Bt, T, heads, **f32)
    Bo, Co = torch.empty(Bt, T, groups, N, **f32), torch.empty(Bt, T, groups, N, **f32)
    Ao, Do = torch.empty(heads, **f32), (torch.empty(heads, **f32) if D is not None else None)
    if Bt * T:
        _mamba2_inputs_kernel[(Bt * T, heads)](
            x, dt, B, C, dt_bias, A_log, D if D is not None else A_log,
            xo, dto, Bo, Co, Ao, Do if Do is not None else Ao,
            T, *x.stride()[:2], *dt.stride()[:2], *B.stride()[:2], *C.stride()[:2], SOFTPLUS_THRESHOLD,
            H=heads, G=groups, P=P, N=N, BP=next_pow2(P), BN=next_pow2(N), HAS_D=D is not None,
            ACCURATE=has_libdevice(x.device), num_warps=1,
        )
    else:  # no token: A and D still describe the layer
        Ao.copy_(-torch.exp(A_log.float()))
        if D is not None:
            Do.copy_(D.float())
    return xo, dto, Bo, Co, Ao, Do
