"""The gated RMSNorm after a Mamba-2 mixer's recurrence, in one Triton launch for a decode step.

Every Mamba-2 family normalises the recurrence's output ``y`` gated by ``silu(gate)`` before its
output projection, by groups of ``group_size`` channels (one group: Mamba-2, Bamba, Granite-4;
``n_groups`` groups: Nemotron-H / Zamba2), as transformers' ``MambaRMSNormGated`` and
``Zamba2RMSNormGated`` compute it::

    h   = y * silu(gate)                                    (fp32)
    h   = h * rsqrt(mean(h^2 over each group) + eps)        (fp32)
    out = weight * round(h to y's dtype)                    (the product in the weight's / y's dtype)

Compiled by Inductor as part of the captured step, the module is two kernels (the groups'
variance, then the scaling); here one program owns one (token, group) and does both, reading
``gate`` where the input projection wrote it. flash-linear-attention's fused gated norm gates
after the norm (Gated DeltaNet's order) and mamba_ssm's ``RMSNormGated`` is not installed here,
hence a kernel of our own. :func:`gated_rms_norm_reference` is the torch form (the modules'
arithmetic, line by line); :func:`gated_norm_groups` says which modules it computes.
"""

from __future__ import annotations

import torch

__all__ = ["gated_norm_groups", "gated_rms_norm", "gated_rms_norm_reference"]

#: the transformers classes whose forward is the arithmetic above with one group of every channel
_ONE_GROUP = ("MambaRMSNormGated", "BambaRMSNormGated", "GraniteMoeHybridRMSNormGated")
#: ... and with ``group_size`` channels per group
_GROUPED = ("Zamba2RMSNormGated",)


def gated_norm_groups(norm: torch.nn.Module, channels: int) -> int | None:
    """The group size ``norm`` normalises ``channels`` channels by, when its class's forward is the
    arithmetic of this module (a class of transformers' own modeling code named in ``_ONE_GROUP``
    -- without a ``group_size`` of its own -- or ``_GROUPED``, group size dividing ``channels``);
    else None (the caller runs the module itself). A forward set on the
    instance is taken to compute its class's (specdec's compiled routing and accelerate's hooks
    do; tests/test_gated_norm.py checks each class against the formula)."""
    cls = type(norm)
    if cls.__name__ not in _ONE_GROUP + _GROUPED or not cls.__module__.startswith("transformers.models."):
        return None  # (e.g. a checkpoint's own modeling code of the same class name, grouped otherwise)
    if cls.__name__ in _ONE_GROUP:
        return channels if not hasattr(norm, "group_size") else None
    size = int(getattr(norm, "group_size", 0))
    return size if size > 0 and channels % size == 0 else None


def gated_rms_norm_reference(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             group_size: int) -> torch.Tensor:
    """The gated RMSNorm of ``y [..., D]`` by ``gate [..., D]`` over groups of ``group_size``
    channels, as transformers' ``MambaRMSNormGated`` / ``Zamba2RMSNormGated`` compute it (the
    formula of the module docstring). Returns ``[..., D]`` in the dtype of ``weight * y``."""
    h = y.float() * torch.nn.functional.silu(gate.float())
    g = h.view(*h.shape[:-1], h.shape[-1] // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(h.shape).to(y.dtype)


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gated_rms_norm_reference` in one Triton launch.

    Args:
        y: ``[..., D]`` (fp32 / bf16 / fp16). gate: ``[..., D]``, any dtype. Read in place when
            their rows are contiguous in D at any row stride (e.g. the gate a slice of the input
            projection's output), else copied.
        weight: ``[D]``, y's dtype. eps: the module's ``variance_epsilon``.
        group_size: channels per group, dividing D.
        out: optional contiguous ``[..., D]`` output in y's dtype.

    Returns:
        ``[..., D]`` in y's dtype, contiguous.

    Raises:
        ValueError: shapes or dtypes that do not fit, or a group size not dividing D.
    """
    from .triton_norm import gated_rms_norm_triton  # lazy: the backend decides TRITON_INTERPRET first

    return gated_rms_norm_triton(y, gate, weight, eps, group_size, out=out)
