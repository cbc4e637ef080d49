"""Kimi Delta Attention: the op (:class:`KDAOp`), the delta rule of :mod:`specdec.kernels.gdn`
with a per-channel gate; its reference (:mod:`.naive`) and Triton entry points
(:mod:`.triton_step`) specialise GDN's."""

from __future__ import annotations

from ..gdn import GDNOp
from .naive import kda_fold, kda_verify

__all__ = ["KDAOp"]


class KDAOp(GDNOp):
    """Kimi Delta Attention: as GDN but ``g [B,T,H,K]`` per channel."""

    name = "kda"
    _verify = staticmethod(kda_verify)
    _fold = staticmethod(kda_fold)

    def triton_kernels(self):
        from .triton_step import KDAKernels  # lazy: the backend decides TRITON_INTERPRET first

        return KDAKernels()
