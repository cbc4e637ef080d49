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

It drafts for ``generate()`` (one reference row per batch row) and for continuous batching
(``generate_batch``: one reference per request, :meth:`OracleDrafter.for_requests`; a pool row
takes its request's reference when the request is admitted, :meth:`OracleDrafter.admit`).
"""

from __future__ import annotations

import numbers

import torch

from .base import Drafter

__all__ = ["OracleDrafter"]


class OracleDrafter(Drafter):
    """Propose a known continuation, corrupted at a controlled per-token rate.

    Args:
        reference: ``[N, Lp + G]`` int64, laid out as ``generate()`` returns it: the left-padded
            prompts, then G expected new tokens per row (e.g. plain greedy output of the target).
            Row i is the reference of batch row i in ``generate()``, and of request ``req_i`` in
            ``generate_batch``.
        prompt_attention_mask: ``[N, Lp]`` 0/1 mask of the prompts (left padding = 0), or None.
        acceptance: probability in [0, 1] that each draft token is the reference token; or a
            schedule, a sequence of such probabilities, one per new-token position (the draft of
            a row's new token p uses ``acceptance[min(p, len - 1)]``; needs
            ``prompt_attention_mask`` to know where each row's new tokens start).
        seed: seed of the corruption's random stream (a ``torch.Generator`` on the reference's device).

    Raises:
        ValueError: an ``acceptance`` outside [0, 1] (or an empty schedule, or a schedule without
        ``prompt_attention_mask``), shapes that do not fit; at generation time, a ``generate()``
        batch of another size than the reference's rows, a request index without a reference, a
        reference that does not start with its request's prompt.
    """

    def __init__(self, reference: torch.Tensor, prompt_attention_mask: torch.Tensor | None = None,
                 acceptance: float = 0.8, seed: int = 0):
        if not isinstance(reference, torch.Tensor) or reference.dim() != 2:
            raise ValueError("reference must be a 2-D LongTensor [batch, prompt + new tokens]")
        rates = _rates(acceptance, reference.device)
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
        prompt_lengths = (prompt_attention_mask.shape[1] - pads) if prompt_attention_mask is not None else None
        self._init(reference.long().gather(1, src), W - pads, prompt_lengths, acceptance, rates, seed)

    @classmethod
    def for_requests(cls, references, acceptance: float | list[float] = 0.8, seed: int = 0) -> "OracleDrafter":
        """An oracle for continuous batching: one reference per request of ``generate_batch``.

        Args:
            references: a list of N token-id lists (or 1-D tensors), reference i for request
                ``req_i``: its prompt, then its expected new tokens (e.g. the request's plain greedy
                output). Each must start with its request's prompt (checked when it is admitted).
            acceptance, seed: as in the constructor; a schedule's positions count from each
                request's prompt end (its length comes with the request).

        In ``generate()`` (no admissions) batch row i drafts reference i, for a batch of N rows
        and a scalar ``acceptance``.

        Raises:
            ValueError: an empty list or reference, an ``acceptance`` outside [0, 1].
            TypeError: a reference that is not a list of int token ids.
        """
        rates = _rates(acceptance, torch.device("cpu"))
        if not isinstance(references, (list, tuple)) or not references:
            raise ValueError("references must be a non-empty list of token-id lists (prompt + expected continuation, "
                             "one per request)")
        texts = []
        for i, ref in enumerate(references):
            ids = ref.reshape(-1).tolist() if isinstance(ref, torch.Tensor) else ref
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
                raise TypeError(f"references[{i}] must be a list of int token ids, got {type(ref).__name__}")
            if not ids:
                raise ValueError(f"references[{i}] is empty; give the request's prompt + expected continuation")
            texts.append([int(t) for t in ids])
        lengths = torch.tensor([len(t) for t in texts], dtype=torch.long)
        table = torch.zeros(len(texts), int(lengths.max()), dtype=torch.long)
        for i, t in enumerate(texts):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        self = cls.__new__(cls)
        self._init(table, lengths, None, acceptance, rates, seed, texts)
        return self

    def _init(self, table: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor | None, acceptance,
              rates: torch.Tensor, seed: int, texts: list[list[int]] | None = None) -> None:
        """The per-request references (left-aligned ``table [N, W]``, ``lengths [N]``, prompt
        lengths ``[N]`` or None when unknown) and the corruption's settings (``rates``: :func:`_rates`)."""
        self._schedule = rates
        self.acceptance = float(acceptance) if isinstance(acceptance, numbers.Real) else tuple(self._schedule.tolist())
        self.seed = int(seed)
        #: every request's text, left-aligned ``[N, W]`` (row text starts at column 0), its length ``[N]``
        #: and its prompt's length ``[N]`` (None: known when the request is admitted)
        self.references, self.reference_lengths, self.prompt_lengths = table, lengths, prompt_lengths
        self._texts = texts  # host copies for the prompt check at admission (built on first use)
        # the rows' texts (the references of the requests they hold), lengths and prompt lengths
        self.reference, self.ref_len, self.prompt_len = table, lengths, prompt_lengths
        self._assigned = True  # whether every row holds a reference
        self._rows = table.shape[0]
        self._vocab = None
        self._gen = None

    def start(self, *, target_vocab_size, batch_size, device, sampling=None, generator=None, max_length=None):
        dev = torch.device(device)
        if dev != self.references.device:
            self.references = self.references.to(dev)
            self.reference_lengths = self.reference_lengths.to(dev)
            if self.prompt_lengths is not None:
                self.prompt_lengths = self.prompt_lengths.to(dev)
            self._schedule = self._schedule.to(dev)
        N = self.references.shape[0]
        self._rows = batch_size
        self._assigned = batch_size == N  # generate(): row i drafts reference i; else admit() assigns rows
        if self._assigned:
            if self.prompt_lengths is None and self._schedule.numel() > 1:
                raise ValueError("an acceptance schedule with OracleDrafter.for_requests runs in generate_batch "
                                 "(each request's prompt length comes with it); in generate() use "
                                 "OracleDrafter(reference, prompt_attention_mask, acceptance=schedule)")
            self.reference, self.ref_len = self.references, self.reference_lengths
            self.prompt_len = (self.prompt_lengths if self.prompt_lengths is not None
                               else torch.zeros(N, dtype=torch.long, device=dev))
        else:
            self.reference = torch.zeros(batch_size, self.references.shape[1], dtype=torch.long, device=dev)
            self.ref_len = torch.zeros(batch_size, dtype=torch.long, device=dev)
            self.prompt_len = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self._vocab = int(target_vocab_size)
        self._gen = torch.Generator(device=dev)
        self._gen.manual_seed(self.seed)

    def admit(self, rows, input_ids, attention_mask, hidden_states, requests) -> None:
        """Give each row of ``rows`` the reference of its request (``requests[i].index``). A
        warm-up request (:attr:`~specdec.batching.Request.warmup`, a manager's
        :meth:`~specdec.serving.ContinuousBatchingManager.warmup`) has none: its row gets its own
        prompt as reference (``ref_len`` = the prompt's length), so it proposes nothing and
        decodes in plain steps.

        Raises:
            ValueError: a request (not a warm-up one) whose index has no reference, or whose
            reference does not start with its prompt."""
        if self._gen is None:
            raise RuntimeError("OracleDrafter.admit() before start()")
        N = self.references.shape[0]
        if self._texts is None:  # host copies, once (the prompt check below)
            self._texts = [t[:n] for t, n in zip(self.references.tolist(), self.reference_lengths.tolist())]
        for req in requests:
            if req.warmup:
                continue
            if not 0 <= req.index < N:
                raise ValueError(f"OracleDrafter holds references for {N} requests (req_0 .. req_{N - 1}); "
                                 f"generate_batch admitted {req.request_id}")
            p = len(req.prompt)
            if self._texts[req.index][:p] != list(req.prompt):
                raise ValueError(f"OracleDrafter: the reference of {req.request_id} does not start with its prompt "
                                 f"({p} tokens); give each request's prompt + expected continuation")
        if self.reference is self.references:  # rows become their own buffers (reference i stays request i's)
            self.reference, self.ref_len = self.reference.clone(), self.ref_len.clone()
            self.prompt_len = self.prompt_len.clone()
        dev = self.reference.device
        rows = rows.to(dev)
        idx = torch.tensor([0 if r.warmup else r.index for r in requests], dtype=torch.long, device=dev)
        self.reference[rows] = self.references[idx]
        self.ref_len[rows] = self.reference_lengths[idx]
        self.prompt_len[rows] = torch.tensor([len(r.prompt) for r in requests], dtype=torch.long, device=dev)
        if any(r.warmup for r in requests):  # warm-up rows: their prompts (as much as the width holds)
            for row, req in zip(rows.tolist(), requests):
                if req.warmup:
                    n = min(len(req.prompt), self.reference.shape[1])
                    self.reference[row] = 0
                    self.reference[row, :n] = torch.tensor(req.prompt[:n], dtype=torch.long, device=dev)
                    self.ref_len[row] = len(req.prompt)
        self._assigned = True

    @torch.no_grad()
    def propose(self, input_ids, lengths, num_speculative_tokens):
        if self._gen is None:
            raise RuntimeError("OracleDrafter.propose() before start()")
        if not self._assigned:
            raise ValueError(f"OracleDrafter holds a reference for {self.references.shape[0]} rows, generate() got "
                             f"{self._rows} (one batch row per reference; generate_batch gives rows their requests)")
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
        return f"OracleDrafter(acceptance={self.acceptance}, references={self.references.shape[0]})"


def _rates(acceptance, device) -> torch.Tensor:
    """``acceptance`` (a probability or a schedule of them) as a float32 tensor ``[n]`` on ``device``.

    Raises: ValueError for an empty schedule or a value outside [0, 1]."""
    schedule = torch.as_tensor(acceptance, dtype=torch.float32, device=device).reshape(-1)
    if schedule.numel() == 0 or not bool(((schedule >= 0) & (schedule <= 1)).all()):
        raise ValueError(f"acceptance must be in [0, 1] (or a non-empty sequence of such, one per new-token "
                         f"position), got {acceptance!r}")
    return schedule
