"""Prompt lookup (n-gram) drafting (Saxena 2023, "Prompt Lookup Decoding"; HF's
``prompt_lookup_num_tokens``): find the longest suffix n-gram of the text that occurred
earlier in the same row and propose the tokens that followed its most recent occurrence.

:meth:`NGramDrafter.propose` runs one of three searches, all proposing the same tokens
(property-tested); :meth:`NGramDrafter.search` says which, by the kernel backend of the text's
device (:func:`specdec.kernels.backend`) and the batch size:

- ``"kernel"``, on the Triton backend (CUDA with triton installed; ``SPECDEC_BACKEND=triton``
  elsewhere, where it runs through Triton's interpreter, for tests): one Triton launch for all
  rows at any batch size (:mod:`specdec.kernels.ngram.triton_ngram`), no host synchronisation.
  On an H200 it took 0.08-0.13 ms per proposal (synchronised) at batches 1-64 and texts of
  256-4,096 tokens, 7-9x the batched search (``specdec-run experiment=ngram_proposal`` times it
  beside the other two; BENCH.md, "n-gram proposal").
- ``"loop"``, on the torch backend (CPU; CUDA without triton) up to
  :data:`HOST_SEARCH_MAX_BATCH` rows: the per-row host loop :func:`propose_ngram_reference`.
- ``"batched"``, on the torch backend above that: :meth:`NGramDrafter.propose_batched`, about
  25 small tensor ops on the text's device, no host synchronisation.

What the threshold rests on (H200 and CPU, ``specdec-run experiment=ngram_proposal``): at batch
1 the loop takes 0.2-0.4 ms on CUDA, sync included, where the batched search's small kernels
take ~1.2 ms at any batch (launch-bound); at batch 16 the batched search is 1.5-3x faster, at
batch 64 6-12x. On one CPU thread (two shared cores) the loop takes 0.17-0.30 ms at batch 1
where the batched search takes 0.45-0.65 ms (widths 256-4096); at batch 16 and 64 the batched
search is faster or within the noise.
"""

from __future__ import annotations

import torch

from ..kernels import backend
from ..kernels.ngram import NGRAM
from .base import Drafter

__all__ = ["NGramDrafter", "propose_ngram_reference", "HOST_SEARCH_MAX_BATCH", "SEARCHES"]

#: on the torch backend, batches up to this size use the per-row host loop, larger ones the
#: batched device search (the Triton backend uses its kernel at every batch size)
HOST_SEARCH_MAX_BATCH = 8
#: the searches :meth:`NGramDrafter.propose` chooses from (:meth:`NGramDrafter.search`)
SEARCHES = ("kernel", "loop", "batched")


def propose_ngram_reference(input_ids: torch.Tensor, lengths: torch.Tensor, K: int, min_ngram: int = 1,
                            max_ngram: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row reference of :meth:`NGramDrafter.propose` (host loop; same arguments and result).

    For row i with text ``t = input_ids[i, :lengths[i]]`` (length L): for n = max_ngram down to
    min_ngram (n <= L - 1), the last start s with ``t[s:s+n] == t[L-n:]`` and ``s + n <= L - 1``
    (the suffix itself excluded); the first n with a match proposes ``t[s+n : s+n+K]``.
    """
    B = input_ids.shape[0]
    drafts = torch.zeros(B, K, dtype=torch.long)
    counts = torch.zeros(B, dtype=torch.long)
    ids = input_ids.cpu()
    for i, L in enumerate(lengths.tolist()):
        text = ids[i, :L]
        for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
            windows = text[: L - 1].unfold(0, n, 1)  # start positions 0 .. L-1-n
            hits = (windows == text[L - n :]).all(dim=1).nonzero()
            if hits.numel():
                got = text[int(hits[-1, 0]) + n :][:K]
                drafts[i, : got.numel()] = got
                counts[i] = got.numel()
                break
    return drafts.to(input_ids.device), counts.to(input_ids.device)


class NGramDrafter(Drafter):
    """N-gram / prompt-lookup drafter.

    Args:
        min_ngram, max_ngram: suffix lengths tried, longest first (1 <= min <= max).

    :meth:`propose` takes the Triton kernel on the Triton backend, else the per-row host loop
    up to :data:`HOST_SEARCH_MAX_BATCH` rows and the batched search above (:meth:`search`;
    the module docstring says why). The batched search compares the text, shifted by
    0 .. max_ngram - 1 tokens, with the row's last tokens in one batched comparison
    (``[B, W, max_ngram]`` booleans for a ``[B, W]`` text); a running AND over the shifts (``&``)
    marks where each n-gram length matches, and the last such end before the suffix wins. About
    10 + 3 * (max_ngram - min_ngram + 1) kernels on the text's device, O(B * W * max_ngram) work,
    no host synchronisation. The kernel does the same per row in one program
    (:mod:`specdec.kernels.ngram.triton_ngram`).

    Raises:
        ValueError: on invalid n-gram sizes.
    """

    stateless = True  # proposals read only the text

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not (all(isinstance(n, int) and not isinstance(n, bool) for n in (min_ngram, max_ngram))
                and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got {min_ngram!r}, {max_ngram!r}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def search(self, input_ids: torch.Tensor) -> str:
        """The search :meth:`propose` runs for ``input_ids`` (``[B, W]``), one of :data:`SEARCHES`:
        ``"kernel"`` where :func:`specdec.kernels.backend` of its device is Triton, else
        ``"loop"`` up to :data:`HOST_SEARCH_MAX_BATCH` rows and ``"batched"`` above."""
        if backend(input_ids.device) == "triton":
            return "kernel"
        return "loop" if input_ids.shape[0] <= HOST_SEARCH_MAX_BATCH else "batched"

    def graph_safe(self, input_ids) -> bool:
        """Whether the search for ``input_ids`` is device work a CUDA graph may replay
        (:meth:`Drafter.graph_safe`): the kernel's and the batched search's are, the host loop's is not.
        For the kernel it binds the Triton op here, outside the program (binding loads the kernel
        module, which a ``torch.compile`` trace of the program cannot)."""
        search = self.search(input_ids)
        if search == "kernel":
            NGRAM.on("triton", input_ids.device)
        return search != "loop"

    def propose(self, input_ids, lengths, num_speculative_tokens):
        search = self.search(input_ids)
        if search == "kernel":
            return self.propose_kernel(input_ids, lengths, num_speculative_tokens)
        if search == "loop":
            return propose_ngram_reference(input_ids, lengths, num_speculative_tokens, self.min_ngram, self.max_ngram)
        return self.propose_batched(input_ids, lengths, num_speculative_tokens)

    def propose_kernel(self, input_ids, lengths, num_speculative_tokens):
        """The Triton kernel's search (what :meth:`propose` runs on the Triton backend): one
        launch for all rows, on CUDA compiled, elsewhere through Triton's interpreter; same
        arguments and result (:func:`specdec.kernels.ngram.triton_ngram.ngram_propose_triton`).

        Raises:
            ImportError: triton is not installed.
        """
        kernels = NGRAM.on("triton", input_ids.device).kernels
        return kernels.propose(input_ids, lengths.to(device=input_ids.device), num_speculative_tokens,
                               self.min_ngram, self.max_ngram)

    def propose_batched(self, input_ids, lengths, num_speculative_tokens):
        """The batched device search (what :meth:`propose` runs on the torch backend above
        :data:`HOST_SEARCH_MAX_BATCH` rows); same arguments and result."""
        B, W = input_ids.shape
        K = num_speculative_tokens
        dev = input_ids.device
        L = lengths.to(device=dev, dtype=torch.long)
        counts = torch.zeros(B, dtype=torch.long, device=dev)
        nmax = min(self.max_ngram, W - 1)
        if nmax < self.min_ngram:
            return torch.zeros(B, K, dtype=torch.long, device=dev), counts
        i = torch.arange(nmax, device=dev)
        suffix = input_ids.gather(1, (L[:, None] - 1 - i).clamp(0, W - 1))  # [B, nmax]: t[L-1-i]
        # back[b, e, i] = t[e - i] (-1 before the text's start: token ids are >= 0, so it never matches)
        back = torch.nn.functional.pad(input_ids, (nmax - 1, 0), value=-1).unfold(1, nmax, 1).flip(-1)
        eq = back == suffix[:, None, :]  # [B, W, nmax]
        ends = torch.arange(W, device=dev)
        before_suffix = ends[None, :] <= L[:, None] - 2  # the window ends before the suffix's last token
        cont = torch.full((B,), -1, dtype=torch.long, device=dev)  # where the proposed continuation starts
        found = torch.zeros(B, dtype=torch.bool, device=dev)
        runs = [eq[:, :, 0]]  # runs[n - 1][b, e]: the n tokens ending at e equal the row's last n tokens
        for k in range(1, nmax):
            runs.append(runs[-1] & eq[:, :, k])
        for n in range(nmax, self.min_ngram - 1, -1):
            last = torch.where(runs[n - 1] & before_suffix, ends[None, :], -1).amax(1)
            new = (last >= 0) & ~found
            cont = torch.where(new, last + 1, cont)
            found |= new
        counts = torch.where(found, (L - cont).clamp(max=K), 0)
        j = torch.arange(K, device=dev)
        tokens = input_ids.gather(1, (cont.clamp(min=0)[:, None] + j).clamp(max=W - 1))
        drafts = torch.where(j[None, :] < counts[:, None], tokens, 0)
        return drafts, counts

    def __repr__(self):
        return f"NGramDrafter(min_ngram={self.min_ngram}, max_ngram={self.max_ngram})"
