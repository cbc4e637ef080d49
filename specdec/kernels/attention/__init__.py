"""Attention of a decode / verify step: a few query tokens per row against the row's KV cache.

A step of ``t`` tokens (1 for plain decoding, K + 1 or a tree's nodes for a verify) attends over
``L`` cached columns under an additive (or boolean) mask ``[B, 1, t, L]``. With grouped-query
heads the ``R = H / H_kv`` query heads of a KV head read the same keys, so the step is ``R t``
query rows per KV head: too few for a prompt-attention kernel to fill the device (cuDNN's SDPA
took 17 µs per layer call for 4 rows over a few hundred columns on an H200). :func:`step_attention`
splits the columns over programs instead and combines the splits (Flash-Decoding,
:mod:`.triton_attention`) on the Triton backend; :func:`step_attention_reference` (:mod:`.naive`) is
the fp32 torch form it is tested against.
"""

from __future__ import annotations

import torch

from ..protocol import BackendOp
from .naive import step_attention_reference

__all__ = ["MAX_HEAD_DIM", "MAX_ROWS", "StepAttentionOp", "STEP_ATTENTION", "step_attention", "step_attention_reference", "step_attention_fits"]

#: the query / key head widths the kernel takes (its tiles are powers of two of at most this)
MAX_HEAD_DIM = 256
#: query rows per KV head the kernel takes (the combine kernel's second grid dimension)
MAX_ROWS = 65535


class StepAttentionOp(BackendOp):
    """The step's attention; on the Triton backend ``kernels.attend`` is the split-KV kernel pair
    (:func:`.triton_attention.step_attention_triton`), bound as the SSM ops' kernels are (Triton's
    interpreter for a device that is not CUDA)."""

    name = "step_attention"

    def triton_kernels(self):
        from .triton_attention import StepAttentionKernels  # lazy: the backend decides TRITON_INTERPRET first

        return StepAttentionKernels()


#: the step attention, torch backend (``STEP_ATTENTION.on("triton", device)`` binds the kernels)
STEP_ATTENTION = StepAttentionOp()


def step_attention_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`step_attention` takes these tensors on the Triton backend: float16 / bfloat16
    / float32 of one dtype on one device, last dims contiguous, head widths of at most
    :data:`MAX_HEAD_DIM`, ``H`` a multiple of ``H_kv``, and a mask (if any) that is boolean or of
    a float dtype, ``[B, 1, t, L]`` up to broadcasting of its first three dims; at most
    :data:`MAX_ROWS` query rows per KV head (``H / H_kv * t``)."""
    B, H, t, D = query.shape
    if key.dim() != 4 or value.dim() != 4 or key.shape[0] != B or value.shape[:3] != key.shape[:3]:
        return False
    Hkv, L = key.shape[1], key.shape[2]
    if (key.shape[3] != D or Hkv == 0 or H % Hkv or max(D, value.shape[3]) > MAX_HEAD_DIM or H // Hkv * t > MAX_ROWS
            or query.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or key.dtype != query.dtype or value.dtype != query.dtype
            or any(x.stride(-1) != 1 for x in (query, key, value))
            or len({x.device for x in (query, key, value)}) != 1):
        return False
    if mask is None:
        return True
    return (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[3] == L and mask.shape[0] in (1, B)
            and mask.shape[2] in (1, t) and mask.device == query.device
            and (mask.dtype == torch.bool or mask.dtype.is_floating_point))


def step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None = None, *, backend_name: str | None = None) -> torch.Tensor:
    """Attention of ``t`` step tokens over a KV cache with grouped-query heads.

    Args:
        query: ``[B, H, t, D]``. key: ``[B, H_kv, L, D]``. value: ``[B, H_kv, L, Dv]``; ``H`` a
            multiple of ``H_kv`` (query head h reads KV head ``h // (H / H_kv)``, as
            transformers' ``repeat_kv``). float16 / bfloat16 / float32.
        mask: additive (added to the scaled scores) or boolean (True attends), ``[B, 1, t, L]``
            (a size-1 batch or token dim broadcasts), or None.
        scale: the scores' factor; None: ``D ** -0.5``.
        backend_name: ``"torch"`` / ``"triton"``; default :func:`specdec.kernels.backend` of the
            query's device.

    Returns:
        ``[B, t, H, Dv]`` in ``query.dtype``: softmax over the columns in fp32; on the Triton
        backend on CUDA the probabilities are rounded to the values' dtype before they multiply
        the values (as FlashAttention does; Triton's interpreter keeps them fp32 for bf16), and
        for the same columns each row's result does not depend on ``t``. A row whose columns are
        all masked gives zeros.

    Raises:
        ValueError: tensors :func:`step_attention_fits` refuses, on the Triton backend (the torch
            backend runs :func:`step_attention_reference` on any shapes it can broadcast).
    """
    if backend_name is None:
        from .. import backend

        backend_name = backend(query.device)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend_name != "triton":
        return step_attention_reference(query, key, value, mask, scale)
    if not step_attention_fits(query, key, value, mask):
        raise ValueError(
            "step_attention: expected query [B, H, t, D], key [B, H_kv, L, D], value [B, H_kv, L, Dv] of one float "
            f"dtype and device, last dims contiguous, H a multiple of H_kv, D and Dv <= {MAX_HEAD_DIM}, "
            f"H / H_kv * t <= {MAX_ROWS}, mask "
            f"[B, 1, t, L] (bool or float) or None; got query {tuple(query.shape)} {query.dtype}, key "
            f"{tuple(key.shape)} {key.dtype}, value {tuple(value.shape)} {value.dtype}, mask "
            f"{None if mask is None else (tuple(mask.shape), mask.dtype)}")
    if mask is not None:
        mask = mask.expand(query.shape[0], 1, query.shape[2], key.shape[2])
    B, H, t, _ = query.shape
    out = torch.empty(B, t, H, value.shape[3], device=query.device, dtype=query.dtype)
    if out.numel():
        STEP_ATTENTION.on("triton", query.device).kernels.attend(query, key, value, mask, scale, out)
    return out

