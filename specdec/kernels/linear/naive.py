"""Linear layer ``y = x @ weight.T + bias``, fp32 torch reference.

The reference computes in fp32 whatever the inputs' dtype (the skinny kernel accumulates in
fp32 too): ``x.float() @ weight.float().T + bias.float()``.
"""

from __future__ import annotations

import torch

__all__ = ["linear_ref"]


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in fp32.

    Args:
        x: ``[..., K]`` any float dtype. weight: ``[N, K]``. bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` fp32.
    """
    y = x.float() @ weight.float().T
    return y + bias.float() if bias is not None else y
