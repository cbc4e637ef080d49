"""Writing a step's attention keys and values into a static KV cache at each row's own columns.

A step of ``t`` tokens writes row ``b``'s keys ``[H, t, D]`` at columns ``seq_len[b] + offset +
j`` of its ``[H, L, D]`` buffer (``offset``: the step's tokens already written,
:class:`specdec.cache.HybridCache`'s ``step_tokens``), and its values likewise. As torch
operations that is a column index per row and two advanced-index writes: five or six small
kernels per attention layer and step. :func:`write_kv` runs :func:`write_kv_reference` on the
torch backend and one Triton launch (:mod:`.triton_kv`, imported on first use) for keys and
values together on the Triton backend (:func:`specdec.kernels.backend`).
"""

from __future__ import annotations

import torch

from ..protocol import BackendOp

__all__ = ["KVWriteOp", "KV_WRITE", "write_kv", "write_kv_reference"]


def write_kv_reference(kbuf: torch.Tensor, vbuf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       seq_len: torch.Tensor, offset: int) -> None:
    """``kbuf[b, :, seq_len[b] + offset + j] = keys[b, :, j]`` for every row b and step token j
    (and ``vbuf`` from ``values``), cast to the buffers' dtype; torch operations."""
    B, t = keys.shape[0], keys.shape[2]
    cols = seq_len[:, None] + offset + torch.arange(t, device=keys.device)[None, :]  # [B, t]
    rows = torch.arange(B, device=keys.device)[:, None]
    kbuf.permute(0, 2, 1, 3)[rows, cols] = keys.permute(0, 2, 1, 3).to(kbuf.dtype)
    vbuf.permute(0, 2, 1, 3)[rows, cols] = values.permute(0, 2, 1, 3).to(vbuf.dtype)


class KVWriteOp(BackendOp):
    """The step's key / value write; on the Triton backend ``kernels.write`` is the one-launch
    kernel (:func:`.triton_kv.write_kv_triton`), bound as the SSM ops' kernels are (Triton's
    interpreter for a device that is not CUDA)."""

    name = "kv_write"

    def triton_kernels(self):
        from .triton_kv import KVWriteKernels  # lazy: the backend decides TRITON_INTERPRET first

        return KVWriteKernels()


#: the key / value write, torch backend (``KV_WRITE.on("triton", device)`` binds the kernel)
KV_WRITE = KVWriteOp()


def write_kv(kbuf: torch.Tensor, vbuf: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             seq_len: torch.Tensor, offset: int, *, backend_name: str | None = None) -> None:
    """Write a step's ``keys [B, H, t, Dk]`` and ``values [B, H, t, Dv]`` into ``kbuf [B, H, L,
    Dk]`` / ``vbuf [B, H, L, Dv]`` at columns ``seq_len[b] + offset + j`` of row b (``seq_len``:
    ``[B]`` int64 on the buffers' device, read on the device: no host sync). The columns must lie
    below ``L`` (the caller sizes the buffers; not checked here, which would need a sync).

    On the Triton backend (``backend_name``: ``"torch"`` / ``"triton"``, default
    :func:`specdec.kernels.backend` of the buffers' device) with keys and values already in the buffers' dtypes and the last dims
    contiguous, one launch; otherwise :func:`write_kv_reference`. Either way a plain copy: the
    buffers end bit for bit the same.

    Raises:
        ValueError: shapes that do not fit each other (checked on the host).
        RuntimeError: the Triton backend for a CPU device when Triton's interpreter can no longer
            take effect (:meth:`specdec.kernels.protocol.BackendOp.on`).
    """
    B, H, t, Dk = keys.shape
    if (values.shape[0] != B or values.shape[2] != t or kbuf.shape[:2] != (B, H) or kbuf.shape[3] != Dk
            or vbuf.shape[:2] != values.shape[:2] or vbuf.shape[3] != values.shape[3]
            or kbuf.shape[2] != vbuf.shape[2] or seq_len.shape != (B,)):
        raise ValueError(f"write_kv: expected keys [B, Hk, t, Dk], values [B, Hv, t, Dv], buffers [B, Hk, L, Dk] / "
                         f"[B, Hv, L, Dv] and seq_len [B]; got keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}, kbuf {tuple(kbuf.shape)}, vbuf {tuple(vbuf.shape)}, seq_len "
                         f"{tuple(seq_len.shape)}")
    if backend_name is None:
        from .. import backend

        backend_name = backend(kbuf.device)
    # (inside a whole-program torch.compile the torch form is traced, and fused with its neighbours)
    fits = (backend_name == "triton" and not torch.compiler.is_compiling()
            and values.shape[1] == H and keys.dtype == kbuf.dtype and values.dtype == vbuf.dtype
            and all(x.stride(-1) == 1 for x in (kbuf, vbuf, keys, values))
            and seq_len.dtype == torch.long and seq_len.is_contiguous() and seq_len.device == kbuf.device)
    if not fits:
        write_kv_reference(kbuf, vbuf, keys, values, seq_len, offset)
        return
    KV_WRITE.on("triton", kbuf.device).kernels.write(kbuf, vbuf, keys, values, seq_len, offset)
