"""Prompt lookup (n-gram) drafting (Saxena 2023, "Prompt Lookup Decoding"; HF's
``prompt_lookup_num_tokens``): find the longest suffix n-gram of the text that occurred
earlier in the same row and propose the tokens that followed its most recent occurrence.

:class:`NGramDrafter` searches all rows at once with tensor ops on the text's own device (no
copy to the host, no per-row work, no host synchronisation: on CUDA the step keeps its one
sync) when the batch is larger than :data:`HOST_SEARCH_MAX_BATCH`; for smaller batches the
per-row host loop :func:`propose_ngram_reference` is faster, sync included (H200 and CPU,
``specdec-run experiment=ngram_proposal``: at batch 1 the loop takes 0.2-0.4 ms on CUDA where the ~25
small kernels of the batched search take ~1.2 ms; at batch 16 the batched search is 1.5-3x
faster, at batch 64 6-12x). Both propose the same tokens (property-tested).
"""

from __future__ import annotations

import torch

from .base import Drafter

__all__ = ["NGramDrafter", "propose_ngram_reference", "HOST_SEARCH_MAX_BATCH"]

#: batches up to this size use the per-row host loop, larger ones the batched device search
HOST_SEARCH_MAX_BATCH = 8


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

    Up to :data:`HOST_SEARCH_MAX_BATCH` rows: the per-row host loop. Above: each proposal
    compares the text, shifted by 0 .. max_ngram - 1 tokens, with the row's last
    tokens in one batched comparison (``[B, W, max_ngram]`` booleans for a ``[B, W]`` text); a
    running AND over the shifts (``&``) marks where each n-gram length matches, and the last such end
    before the suffix wins. About 10 + 3 * (max_ngram - min_ngram + 1) kernels on the text's
    device, O(B * W * max_ngram) work, no host synchronisation.

    Raises:
        ValueError: on invalid n-gram sizes.
    """

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, input_ids, lengths, num_speculative_tokens):
        if input_ids.shape[0] <= HOST_SEARCH_MAX_BATCH:
            return propose_ngram_reference(input_ids, lengths, num_speculative_tokens, self.min_ngram, self.max_ngram)
        return self.propose_batched(input_ids, lengths, num_speculative_tokens)

    def propose_batched(self, input_ids, lengths, num_speculative_tokens):
        """The batched device search (what :meth:`propose` runs above ``HOST_SEARCH_MAX_BATCH``
        rows); same arguments and result."""
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
