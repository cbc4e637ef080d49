"""The Triton backend: the reference ops with ``kernels`` set to the fused Triton kernels.

:func:`specdec.kernels.get_op` calls :func:`triton_op` when the backend is ``triton`` (the
default on CUDA; ``SPECDEC_BACKEND=triton`` forces it elsewhere). On a CPU device the kernels
run through Triton's interpreter (``TRITON_INTERPRET=1``), which this module sets before it
imports any kernel module. The interpreter is for testing only: it is exact but orders of
magnitude slower than the torch reference. (It only takes effect if no Triton kernel was
defined earlier in the process; set ``TRITON_INTERPRET=1`` yourself before importing
``specdec`` to be sure.)
"""

from __future__ import annotations

import copy
import os

import torch

__all__ = ["triton_op"]


def _kernels_for(name: str):
    if name == "mamba2":
        from .mamba2.triton_step import Mamba2Kernels

        return Mamba2Kernels()
    if name == "gdn":
        from .gdn.triton_step import DeltaRuleKernels

        return DeltaRuleKernels(per_channel=False)
    if name == "kda":
        from .kda.triton_step import KDAKernels

        return KDAKernels()
    raise ValueError(f"no Triton kernels for SSM op {name!r}; known: ['gdn', 'kda', 'mamba2']")


_CACHE: dict[str, object] = {}


def triton_op(name: str, device: torch.device | str | None = None):
    """The op ``name`` (a key of :data:`specdec.kernels.OPS`) with ``kernels`` set to the Triton kernels.

    Returns an instance of the same class as ``OPS[name]`` (so ``verify`` / ``fold`` stay the
    torch reference); the shared ``OPS[name]`` object itself is not modified.

    Raises:
        ValueError: unknown op name.
    """
    from . import OPS

    if name not in OPS:
        raise ValueError(f"unknown SSM op {name!r}; known: {sorted(OPS)}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules define their kernels
    op = _CACHE.get(name)
    if op is None:
        op = copy.copy(OPS[name])
        op.kernels = _kernels_for(name)
        _CACHE[name] = op
    return op
