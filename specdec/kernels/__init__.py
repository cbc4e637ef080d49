"""The ops behind the rollback strategies and the layer caches, and the backend that runs them.

One folder per op (``mamba2/``, ``gdn/``, ``kda/``, ``conv1d/``): ``naive.py``, the fp32 torch
reference that is also the CPU path, the Triton kernels next to it, and in ``__init__.py`` the
op class with its lazy Triton binding. ``ngram/`` holds the n-gram drafter's search kernel
(:data:`NGRAM`; its torch searches are the drafter's, :mod:`specdec.drafters.ngram`). The
contracts (:class:`SSMOp`, the fused kernels' :class:`RollbackKernels`, :class:`Conv1dKernels`)
are in :mod:`specdec.kernels.protocol`; Triton plumbing shared by the kernels in
:mod:`specdec.kernels.triton_common`.

:func:`get_op` / :func:`conv1d_op` give an op for a device: the torch reference on CPU, the
Triton kernels on CUDA; ``SPECDEC_BACKEND=torch|triton`` forces one (:func:`backend`).

:mod:`specdec.kernels.linear` holds the skinny linear layer (``y = x @ W.T + b`` for at most 64
rows, the weight read once): :func:`skinny_linear`, and :func:`skinny_linears` to route a model's
``nn.Linear`` forwards through it; and its grouped form for sibling projections
(:func:`~specdec.kernels.linear.grouped_skinny_linear`, routed by
:func:`~specdec.kernels.linear.merged_linears`). The CUDA-graph decode path enters
:func:`~specdec.kernels.linear.merged_linears` and, for the other linears at most 16 rows,
:func:`~specdec.kernels.linear.single_linears` while it captures.

Example::

    op = get_op("gdn", "cuda")            # op.kernels: the Triton kernel set
    y = op.kernels.snapshot_verify(live, buf, inputs, {}, 0)
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .conv1d import CONV1D, Conv1dOp
from .gdn import GDNOp
from .kda import KDAOp
from .linear import SkinnyLinear, skinny_linear, skinny_linears
from .mamba2 import Mamba2Op
from .ngram import NGRAM, NGramOp
from .protocol import BACKENDS, Conv1dKernels, LaunchConfig, RollbackKernels, SSMOp

__all__ = ["SSMOp", "OPS", "get_op", "conv1d_op", "backend", "BACKENDS", "RollbackKernels", "Conv1dKernels",
           "LaunchConfig", "Mamba2Op", "GDNOp", "KDAOp", "Conv1dOp", "NGramOp", "NGRAM", "skinny_linear",
           "skinny_linears", "SkinnyLinear"]


#: whether triton can be imported (looked up once: :func:`backend` runs inside programs that
#: ``torch.compile`` traces, which cannot trace the lookup)
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def backend(device: torch.device | str | None = None) -> str:
    """The kernel backend for ``device``: ``$SPECDEC_BACKEND`` if set, else triton on CUDA (torch
    when triton is not installed), torch on CPU.

    Raises:
        ValueError: if ``SPECDEC_BACKEND`` is set to something other than ``torch`` or ``triton``.
        ImportError: ``SPECDEC_BACKEND=triton`` without triton installed.
    """
    forced = os.environ.get("SPECDEC_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"SPECDEC_BACKEND={forced!r} is not a backend; use one of {BACKENDS}")
        if forced == "triton" and not TRITON_INSTALLED:
            raise ImportError("SPECDEC_BACKEND=triton but triton is not installed: pip install 'specdec[triton]' "
                              "(CUDA builds of torch bring it), or use SPECDEC_BACKEND=torch")
        return forced
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not TRITON_INSTALLED:
        return "torch"  # the Triton kernels need triton; the torch reference ops run anywhere
    return "triton" if dev.type == "cuda" else "torch"


#: the SSM ops by name, each the torch reference (``kernels`` None)
OPS: dict[str, SSMOp] = {op.name: op for op in (Mamba2Op(), GDNOp(), KDAOp())}


def get_op(name: str, device: torch.device | str | None = None) -> SSMOp:
    """The SSM op called ``name`` (one of ``OPS``) for the backend :func:`backend` picks for ``device``.

    The torch backend returns the reference op ``OPS[name]``; the triton backend returns the
    same op with ``kernels`` set to its Triton kernel set (on a device other than CUDA through
    Triton's interpreter; ``device=None`` means the CPU). See :meth:`SSMOp.on`.

    Raises:
        ValueError: unknown op name or backend.
    """
    if name not in OPS:
        raise ValueError(f"unknown SSM op {name!r}; known: {sorted(OPS)}")
    return OPS[name].on(backend(device), device if device is not None else "cpu")


def conv1d_op(device: torch.device | str | None = None, *, backend_name: str | None = None) -> Conv1dOp:
    """The causal conv op for ``device`` (as :func:`get_op`), or for an explicit ``backend_name``
    (``"torch"`` | ``"triton"``; e.g. an SSM op's ``op.backend``, so a layer's conv runs on the
    backend its recurrence runs on, the interpreter setting included).

    Raises:
        ValueError: unknown backend.
    """
    if backend_name is not None:
        return CONV1D.on(backend_name, device)
    return CONV1D.on(backend(device), device if device is not None else "cpu")
