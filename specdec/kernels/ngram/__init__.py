"""Prompt-lookup (n-gram) search on the device: the op (:class:`NGramOp`) binding its Triton
kernel (:mod:`.triton_ngram`, imported on first use).

The search's semantics, its per-row reference and its batched torch form are the drafter's
(:mod:`specdec.drafters.ngram`); the drafter takes this op's kernel where the backend is
Triton (``NGRAM.on(backend(device), device).kernels``, None on the torch backend).
"""

from __future__ import annotations

from ..protocol import BackendOp

__all__ = ["NGramOp", "NGRAM"]


class NGramOp(BackendOp):
    """The n-gram search. ``kernels`` (Triton backend): an object whose ``propose(input_ids,
    lengths, num_speculative_tokens, min_ngram, max_ngram, *, out=None)`` returns what
    :func:`specdec.drafters.ngram.propose_ngram_reference` returns, in one launch; None on the
    torch backend.

    Example::

        op = NGRAM.on(backend(ids.device), ids.device)    # specdec.kernels.backend
        if op.kernels is not None:
            drafts, counts = op.kernels.propose(ids, lengths, 4, 1, 3)
    """

    name = "ngram"

    def triton_kernels(self):
        from .triton_ngram import NGramTritonKernels  # lazy: the backend decides TRITON_INTERPRET first

        return NGramTritonKernels()


#: the n-gram op, torch backend (``NGRAM.on("triton")`` binds the Triton kernel)
NGRAM = NGramOp()
