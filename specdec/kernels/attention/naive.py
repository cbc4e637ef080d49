"""Attention of a step's query tokens over a KV cache with grouped-query heads, the fp32 torch
reference of :func:`specdec.kernels.attention.step_attention`."""

from __future__ import annotations

import torch

__all__ = ["step_attention_reference"]


def step_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T scale + mask) v`` per query head over its KV head's columns, in fp32; returns
    ``[B, t, H, Dv]`` in ``query.dtype`` (the layout :func:`step_attention` writes). A row whose
    columns are all masked gives zeros. Shapes as :func:`step_attention`."""
    B, H, t, D = query.shape
    Hkv = key.shape[1]
    scale = D ** -0.5 if scale is None else scale
    k = key.float().repeat_interleave(H // Hkv, dim=1)
    v = value.float().repeat_interleave(H // Hkv, dim=1)
    s = query.float() @ k.transpose(-1, -2) * scale  # [B, H, t, L]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows: 0
    return (p @ v).transpose(1, 2).to(query.dtype)
