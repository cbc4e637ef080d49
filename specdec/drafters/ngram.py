"""Prompt lookup (n-gram) drafting (Saxena 2023, "Prompt Lookup Decoding"; HF's
``prompt_lookup_num_tokens``): find the longest suffix n-gram of the text that occurred
earlier in the same row and propose the tokens that followed its most recent occurrence."""

from __future__ import annotations

import torch

from .base import Drafter

__all__ = ["NGramDrafter"]


class NGramDrafter(Drafter):
    """N-gram / prompt-lookup drafter.

    Args:
        min_ngram, max_ngram: suffix lengths tried, longest first (1 <= min <= max).

    Raises:
        ValueError: on invalid n-gram sizes.
    """

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def _propose_row(self, text: torch.Tensor, K: int) -> torch.Tensor:
        L = text.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = text[L - n :]
            windows = text[: L - 1].unfold(0, n, 1)  # start positions 0 .. L-1-n (excludes the suffix itself)
            hits = (windows == suffix).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1, 0]) + n
                return text[start : start + K]
        return text[:0]

    def propose(self, input_ids, lengths, num_speculative_tokens):
        B = input_ids.shape[0]
        K = num_speculative_tokens
        drafts = torch.zeros(B, K, dtype=torch.long, device=input_ids.device)
        counts = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        ids = input_ids.cpu()
        for i, L in enumerate(lengths.tolist()):
            got = self._propose_row(ids[i, :L], K)
            drafts[i, : got.numel()] = got.to(drafts.device)
            counts[i] = got.numel()
        return drafts, counts

    def __repr__(self):
        return f"NGramDrafter(min_ngram={self.min_ngram}, max_ngram={self.max_ngram})"
