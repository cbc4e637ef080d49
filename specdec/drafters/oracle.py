"""A drafter with a known, controlled acceptance rate, for benchmarks.

Real drafters make acceptance depend on the model and the text; to measure what speculation
costs and gains at a given acceptance (controlled-acceptance benchmarks),
:class:`OracleDrafter` proposes the target's own expected continuation -- e.g. its
plain greedy output, computed once -- with each draft token independently replaced by another
token with probability ``1 - acceptance``. Under greedy verification a draft is then accepted
with probability ``acceptance`` given that the ones before it were, so the number of accepted
drafts per step is a truncated geometric variable with mean ``sum_{j=1..K} a^j``.

The acceptance may also change along the generation (a schedule: one rate per new-token
position), e.g. rows that switch from copy-heavy text to free text half way, the workload on
which a fixed speculation length loses (``specdec-run experiment=adaptive``).
"""

from __future__ import annotations

import numbers

import torch

from .base import Drafter

__all__ = ["OracleDrafter"]


class OracleDrafter(Drafter):
    """Propose a known continuation, corrupted at a controlled per-token rate.

    Args:
        reference: ``[B, Lp + G]`` int64, laid out as ``generate()`` returns it: the left-padded
            prompts, then G expected new tokens per row (e.g. plain greedy output of the target).
        prompt_attention_mask: ``[B, Lp]`` 0/1 mask of the prompts (left padding = 0), or None.
        acceptance: probability in [0, 1] that each draft token is the reference token; or a
            schedule, a sequence of such probabilities, one per new-token position (the draft of
            a row's new token p uses ``acceptance[min(p, len - 1)]``; needs
            ``prompt_attention_mask`` to know where each row's new tokens start).
        seed: seed of the corruption's random stream (a ``torch.Generator`` on the reference's device).

    Raises:
        ValueError: an ``acceptance`` outside [0, 1] (or an empty schedule, or a schedule without
        ``prompt_attention_mask``), shapes that do not fit, a batch size or device at generation
        time that differs from the reference's.
    """

    def __init__(self, reference: torch.Tensor, prompt_attention_mask: torch.Tensor | None = None,
                 acceptance: float = 0.8, seed: int = 0):
        if not isinstance(reference, torch.Tensor) or reference.dim() != 2:
            raise ValueError("reference must be a 2-D LongTensor [batch, prompt + new tokens]")
        schedule = torch.as_tensor(acceptance, dtype=torch.float32, device=reference.device).reshape(-1)
        if schedule.numel() == 0 or not bool(((schedule >= 0) & (schedule <= 1)).all()):
            raise ValueError(f"acceptance must be in [0, 1] (or a non-empty sequence of such, one per new-token "
                             f"position), got {acceptance!r}")
        if not isinstance(acceptance, numbers.Real) and prompt_attention_mask is None:
            raise ValueError("an acceptance schedule needs prompt_attention_mask (where each row's new tokens start)")
        B, W = reference.shape
        if prompt_attention_mask is None:
            pads = torch.zeros(B, dtype=torch.long, device=reference.device)
        else:
            if prompt_attention_mask.dim() != 2 or prompt_attention_mask.shape[0] != B \
                    or prompt_attention_mask.shape[1] > W:
                raise ValueError(f"prompt_attention_mask of shape {tuple(prompt_attention_mask.shape)} does not fit "
                                 f"reference {tuple(reference.shape)}")
            m = prompt_attention_mask.to(reference.device).long()
            pads = m.shape[1] - m.sum(1)
        cols = torch.arange(W, device=reference.device)[None, :]
        src = (cols + pads[:, None]).clamp(max=W - 1)
        self.reference = reference.long().gather(1, src)  # left-aligned: row text starts at column 0
        self.ref_len = W - pads
        #: the prompt's length in each row's left-aligned text (where its new tokens start)
        self.prompt_len = (prompt_attention_mask.shape[1] if prompt_attention_mask is not None else 0) - pads
        self.acceptance = float(acceptance) if isinstance(acceptance, numbers.Real) else tuple(schedule.tolist())
        self._schedule = schedule
        self.seed = int(seed)
        self._vocab = None
        self._gen = None

    def start(self, *, target_vocab_size, batch_size, device, sampling=None, generator=None, max_length=None):
        if batch_size != self.reference.shape[0]:
            raise ValueError(f"OracleDrafter holds a reference for {self.reference.shape[0]} rows, generate() got {batch_size}")
        if torch.device(device) != self.reference.device:
            self.reference = self.reference.to(device)
            self.ref_len = self.ref_len.to(device)
            self.prompt_len = self.prompt_len.to(device)
            self._schedule = self._schedule.to(device)
        self._vocab = int(target_vocab_size)
        self._gen = torch.Generator(device=self.reference.device)
        self._gen.manual_seed(self.seed)

    @torch.no_grad()
    def propose(self, input_ids, lengths, num_speculative_tokens):
        if self._gen is None:
            raise RuntimeError("OracleDrafter.propose() before start()")
        K = int(num_speculative_tokens)
        ref = self.reference
        idx = lengths.to(ref.device)[:, None] + torch.arange(K, device=ref.device)[None, :]
        tok = ref.gather(1, idx.clamp(max=ref.shape[1] - 1))
        u = torch.rand(tok.shape, device=ref.device, generator=self._gen)
        shift = torch.randint(1, max(self._vocab, 2), tok.shape, device=ref.device, generator=self._gen)
        rate = self._schedule[(idx - self.prompt_len[:, None]).clamp(0, self._schedule.numel() - 1)]
        tok = torch.where(u >= rate, (tok + shift) % self._vocab, tok)
        counts = (idx < self.ref_len[:, None]).sum(1)
        return tok, counts

    def __repr__(self):
        return f"OracleDrafter(acceptance={self.acceptance}, rows={self.reference.shape[0]})"
