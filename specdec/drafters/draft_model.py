"""A (smaller) causal LM as the drafter, itself possibly a hybrid with SSM state.

The draft model keeps its own :class:`~specdec.cache.HybridCache`, rolled back by the same
rollback layer as the target. Each proposal is one *step* of the draft's cache:

1. commit the tokens of the previous proposal that the target kept (the longest common prefix
   of the drafts the draft model ran and the text that came back), exactly like the target's
   commit, so the draft's SSM state is s^(m) for the accepted m;
2. catch up on the text it has not seen (the target's correction token, and on full acceptance
   also the last draft) in one forward, committed at once;
3. run K - 1 single-token forwards inside one open step to propose d_2..d_K (gpt-fast's loop).

So after a rejection the draft's proposals equal those of a fresh draft run on the accepted
text (case C12).
"""

from __future__ import annotations

import torch

from ..models import adapter_for
from ..rollback import make_strategy
from ..verify import process_logits
from .base import Drafter

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter(Drafter):
    """Draft with ``draft_model``, any supported HF causal LM sharing the target's vocabulary.

    Args:
        draft_model: a loaded HF causal LM (on the target's device).
        rollback: the draft's own rollback strategy (name or instance; default "snapshot").

    Raises:
        TypeError / ValueError: if the model is not a supported causal LM.
    """

    def __init__(self, draft_model, rollback="snapshot"):
        self.adapter = adapter_for(draft_model)
        self.strategy = make_strategy(rollback)
        self.model = draft_model
        self._reset()

    def _reset(self):
        self.cache = None
        self._probs = None
        self._open = None  # [B, K-1] tokens run in the open step
        self.consumed = None
        self.sampling = None
        self.generator = None
        self.max_length = None

    @property
    def vocab_size(self):
        return self.adapter.vocab_size

    def start(self, *, target_vocab_size, batch_size, device, sampling=None, generator=None, max_length=None):
        self._reset()
        self.sampling = sampling
        self.generator = generator
        self.max_length = max_length
        if torch.device(device) != self.adapter.device:
            raise ValueError(
                f"draft model is on {self.adapter.device} but the target is on {torch.device(device)}; "
                "move it with draft_model.to(device)"
            )

    def draft_probs(self):
        return self._probs

    def _pick(self, logits: torch.Tensor):
        """Next draft token from ``[B, V]`` logits (greedy, or sampled with its distribution)."""
        if self.sampling is None:
            return logits.argmax(-1), None
        probs = process_logits(logits, self.sampling)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0], probs

    def _prefill(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        Lmax = int(lengths.max())
        cols = torch.arange(Lmax, device=input_ids.device)[None, :]
        src = (cols - (Lmax - lengths)[:, None]).clamp(min=0)
        padded = input_ids.gather(1, src)
        mask = (cols >= (Lmax - lengths)[:, None]).long()
        padded = padded * mask
        total = max(self.max_length or 0, Lmax) + 4 * (K + 1)
        self.cache = self.adapter.new_cache(B, total, K + 1, self.strategy)
        logits, _ = self.adapter.prefill(padded, mask, self.cache)
        self.consumed = lengths.clone()
        return logits

    def _catch_up(self, input_ids, lengths):
        """Commit what the target kept of the open step, then run the unseen text; logits at its end."""
        B = input_ids.shape[0]
        rows = torch.arange(B, device=input_ids.device)
        remaining = (lengths - self.consumed).clamp(min=0)
        if self._open is not None:
            n_open = self._open.shape[1]
            idx = (self.consumed[:, None] + torch.arange(n_open, device=input_ids.device)[None, :]).clamp(
                max=input_ids.shape[1] - 1
            )
            same = (input_ids.gather(1, idx) == self._open) & (
                torch.arange(n_open, device=input_ids.device)[None, :] < remaining[:, None]
            )
            m = same.long().cumprod(1).sum(1)
            m = torch.minimum(m, (remaining - 1).clamp(min=0))
        else:
            m = torch.zeros_like(lengths)
        self.cache.commit(m)
        self.consumed += m
        self._open = None
        last_logits = torch.zeros(B, self.adapter.vocab_size, device=input_ids.device)
        cap = self.cache.max_step_tokens
        while True:
            r = (lengths - self.consumed).clamp(min=0, max=cap)
            T = int(r.max())
            if T == 0:
                break
            idx = (self.consumed[:, None] + torch.arange(T, device=input_ids.device)[None, :]).clamp(
                max=input_ids.shape[1] - 1
            )
            logits, _ = self.adapter.forward(input_ids.gather(1, idx), self.cache)
            got = r > 0
            last_logits[got] = logits[rows, (r - 1).clamp(min=0)][got].float()
            self.cache.commit(r)
            self.consumed += r
        return last_logits

    @torch.no_grad()
    def propose(self, input_ids, lengths, num_speculative_tokens):
        K = num_speculative_tokens
        if self.cache is not None and self.cache.max_step_tokens < K + 1:
            raise ValueError("num_speculative_tokens grew during one generate(); call start() again")
        if self.cache is None:
            logits = self._prefill(input_ids, lengths, K)
        else:
            logits = self._catch_up(input_ids, lengths)
        B = input_ids.shape[0]
        drafts = torch.zeros(B, K, dtype=torch.long, device=input_ids.device)
        probs = [] if self.sampling is not None else None
        tok, p = self._pick(logits.float())
        drafts[:, 0] = tok
        if probs is not None:
            probs.append(p)
        for j in range(1, K):
            logits, _ = self.adapter.forward(drafts[:, j - 1 : j], self.cache)
            tok, p = self._pick(logits[:, 0].float())
            drafts[:, j] = tok
            if probs is not None:
                probs.append(p)
        self._open = drafts[:, : K - 1] if K > 1 else None
        if self._open is None:
            self.cache.commit(torch.zeros(B, dtype=torch.long, device=input_ids.device))
        self._probs = torch.stack(probs, dim=1) if probs is not None else None
        return drafts, torch.full((B,), K, dtype=torch.long, device=input_ids.device)

    def __repr__(self):
        return f"DraftModelDrafter({type(self.model).__name__}, rollback={self.strategy.name!r})"
