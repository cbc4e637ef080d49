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
text.

With ``num_speculative_tokens="auto"`` (:meth:`Drafter.set_speculation`) K changes from step to
step and steps at K = 0 skip the proposal: the cache is sized for the largest K and every
proposal runs the steps above (the catch-up then covers any unseen text).

On the engine's static / CUDA-graph decode path (greedy) with a fixed K, each proposal after the first is two
fixed-shape programs: commit the kept prefix; then a 2-token catch-up forward committed per row
(the engine's step semantics bound the unseen text to 1 or 2 tokens: the correction token, and
on full acceptance the last draft too) and the K - 1 one-token forwards; on CUDA each is
captured as a CUDA graph at the third proposal (the second runs them eagerly as the warm-up;
:class:`specdec.graphs.CapturedProgram`) and replayed from then on, with the draft cache kept
for the next ``generate()`` of the same shape bucket.

The draft model may compute on another device than the target's LM head (a second GPU, the
CPU, or a GPU beside a target on the CPU): its cache, programs and captures live on its own
device, which is made current while it proposes (:func:`specdec.placement.on_device`); the text
comes over once per proposal and the drafts (and their probabilities) go back to the LM head's
device, two small copies a step. A draft model spread over several devices is refused.

Continuous batching (:meth:`DraftModelDrafter.admit`): a row that takes a new request gets the
new prompt prefilled into a fresh cache of the draft's shape; the next proposal, once the open
step is committed (between the two programs on the static path, where no step is open), moves it
into the row (:meth:`HybridCache.reset_rows`, in place, so the captured programs stay valid) and
catches up on the row's first new token.
"""

from __future__ import annotations

import torch

from ..graphs import CapturedProgram, bucket_length
from ..kernels import backend
from ..models import adapter_for
from ..placement import on_device
from ..rollback import make_strategy
from ..verify import process_logits
from .base import Drafter

__all__ = ["DraftModelDrafter"]


class DraftModelDrafter(Drafter):
    """Draft with ``draft_model``, any supported HF causal LM sharing the target's vocabulary.

    Args:
        draft_model: a loaded HF causal LM, on one device: the target's LM head's, or another
            (see the module's notes).
        rollback: the draft's own rollback strategy (name or instance; default "snapshot").

    Raises:
        TypeError / ValueError: if the model is not a supported causal LM, or its layers and LM
            head compute on several devices.
    """

    drafts_sequentially = True  # one draft-model forward per draft

    def __init__(self, draft_model, rollback="snapshot"):
        self.adapter = adapter_for(draft_model)
        if self.adapter.placement.multi_device:
            raise ValueError(f"a draft model must compute on one device; this one is spread over several "
                             f"({self.adapter.placement.layout()}): place it whole, e.g. draft_model.to('cuda:1')")
        self.strategy = make_strategy(rollback)
        self.model = draft_model
        self._path = "eager"
        self._max_k = 0  # the largest K of the call (set_speculation); the cache holds steps of it
        self._adaptive = False  # K changes per step: the fixed-K static program does not apply
        self._static = None  # _StaticDraft of the current shape bucket (static / CUDA-graph path)
        #: how the last proposal ran: "eager", "static" or "cuda_graph"
        self.last_path = "eager"
        #: why the proposal's CUDA-graph capture failed (its error), or None
        self.capture_error: str | None = None
        self._reset()

    def set_decode_path(self, path: str) -> None:
        self._path = path

    def set_speculation(self, max_speculative_tokens: int, adaptive: bool) -> None:
        self._max_k = int(max_speculative_tokens)
        self._adaptive = bool(adaptive)

    def _reset(self):
        self.cache = None
        self._calls = 0
        self._probs = None
        self._open = None  # [B, K-1] tokens run in the open step
        self.consumed = None  # [B] text tokens the draft cache holds, committed or in the open step's kept prefix
        self._admitted = []  # (rows, prefilled cache) of admit(), moved into the rows by the next proposal
        self.sampling = None
        self.generator = None
        self.max_length = None
        self.home = self.adapter.device

    @property
    def vocab_size(self):
        return self.adapter.vocab_size

    def start(self, *, target_vocab_size, batch_size, device, sampling=None, generator=None, max_length=None):
        self._reset()
        self.sampling = sampling
        self.generator = generator
        self.max_length = max_length
        self.home = torch.device(device)  # the target's LM head's: where the proposals go
        dev = self.adapter.device
        if self.home.type == "cuda" and dev.type != "cuda" and backend(dev) == "triton":
            raise ValueError(f"SPECDEC_BACKEND=triton runs Triton kernels everywhere, but the draft model computes on "
                             f"{dev}, where Triton's kernels run only through its interpreter, which a process "
                             "compiling them for CUDA cannot use; unset SPECDEC_BACKEND (each device then takes its "
                             "own backend) or set it to 'torch'")

    def draft_probs(self):
        return self._probs

    @property
    def _static_proposals(self) -> bool:
        """Whether proposals run the fixed-shape programs (static path, greedy, fixed K)."""
        return self._path != "eager" and self.sampling is None and not self._adaptive

    @torch.no_grad()
    def admit(self, rows, input_ids, attention_mask, hidden_states, requests) -> None:
        """Rows ``rows`` take the prompts ``input_ids [n, L]`` (left-padded, ``attention_mask``;
        see :meth:`Drafter.admit`). Before the first proposal nothing is kept (it prefills every
        row's text). After it, the prompts are prefilled into a fresh draft cache of ``n`` rows
        and the draft's own shape, which the next proposal moves into the rows once the open step
        is committed (:meth:`HybridCache.reset_rows`); it then catches up on each row's first new
        token. The other rows are untouched.

        Raises: ValueError on the static path when the draft's rollback strategy does not reset
            rows in place (``RollbackStrategy.resets_in_place``), which the captured programs need.
        """
        if self._static_proposals and not self.strategy.resets_in_place:
            raise ValueError(f"the draft model's rollback strategy {self.strategy.name!r} does not reset rows in "
                             "place (resets_in_place=False), which its static proposal programs need across "
                             "admissions; use decode_path='eager' or a built-in strategy for the draft")
        if self.cache is None:  # no proposal yet: the first one prefills every row's text
            return
        c = self.cache
        fresh = self.adapter.new_cache(rows.numel(), c.max_len, c.max_step_tokens, self.strategy, static=c.static)
        dev = self.adapter.device
        rows = rows.to(dev)
        with on_device(dev):
            self.adapter.prefill(input_ids.to(dev), attention_mask.to(dev), fresh)
        self._admitted.append((rows, fresh))
        self.consumed[rows] = attention_mask.sum(1).to(dev)  # so the open step keeps none of theirs

    def _reset_admitted(self) -> None:
        """Move the prompts :meth:`admit` prefilled into their rows (the step is closed)."""
        for rows, fresh in self._admitted:
            self.cache.reset_rows(rows, fresh)
        self._admitted.clear()

    def _pick(self, logits: torch.Tensor):
        """Next draft token from ``[B, V]`` logits (greedy, or sampled with its distribution)."""
        if self.sampling is None:
            return logits.argmax(-1), None
        probs = process_logits(logits, self.sampling)
        # drawn where the call's generator is, else on the LM head's device: generators the decode loop
        # saves and restores (a dropped proposal's draws undone), the same as a draft on that device
        where = self.generator.device if self.generator is not None else self.home
        if where != probs.device:
            return torch.multinomial(probs.to(where), 1, generator=self.generator)[:, 0].to(probs.device), probs
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0], probs

    def _prefill(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        Lmax = int(lengths.max())
        cols = torch.arange(Lmax, device=input_ids.device)[None, :]
        src = (cols - (Lmax - lengths)[:, None]).clamp(min=0)
        padded = input_ids.gather(1, src)
        mask = (cols >= (Lmax - lengths)[:, None]).long()
        padded = padded * mask
        K = max(K, self._max_k)
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
        self._reset_admitted()
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
        dev, home = self.adapter.device, self.home
        if dev == home:
            return self._propose(input_ids, lengths, num_speculative_tokens)
        with on_device(dev):
            drafts, counts = self._propose(input_ids.to(dev), lengths.to(dev), num_speculative_tokens)
            if self._probs is not None:
                self._probs = self._probs.to(home)
            return drafts.to(home), counts.to(home)

    def _propose(self, input_ids, lengths, num_speculative_tokens):
        """:meth:`propose` on the draft model's device (``input_ids`` and ``lengths`` there)."""
        K = num_speculative_tokens
        if self._static_proposals:
            return self._propose_static(input_ids, lengths, K)
        self.last_path, self.capture_error = "eager", None  # (no program ran)
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

    # --- static / CUDA-graph path -----------------------------------------------------------
    def _propose_static(self, input_ids, lengths, K):
        B, W = input_ids.shape
        dev = input_ids.device
        width = bucket_length(max(self.max_length or 0, W))
        key = (B, K, width, self._path, dev)  # (a draft model moved since: new buffers, new graphs)
        st = self._static
        if self._calls == 0:
            if st is None or st.key != key:
                st = self._static = _StaticDraft(key, B, K, width, dev)
                graphs = self._path == "cuda_graph" and dev.type == "cuda"  # (a draft on the CPU: static)
                if K > 1:  # (a capture's host-side step counts are reset to the program's start on failure)
                    st.commit_open = CapturedProgram(lambda: self._commit_open(st), model=self.model,
                                                     what="the draft model's commit", graphs=graphs,
                                                     on_failure=lambda: st.cache.set_step_tokens(K - 1))
                st.program = CapturedProgram(lambda: self._body(st, K), model=self.model,
                                             what="the draft model's proposal", graphs=graphs,
                                             on_failure=lambda: st.cache.set_step_tokens(0))
            # prefill (dynamic shapes, HF's own forward) into a fresh static cache, then into st's buffers
            lmax = int(lengths.max())
            cols = torch.arange(lmax, device=dev)[None, :]
            src = (cols - (lmax - lengths)[:, None]).clamp(min=0)
            mask = (cols >= (lmax - lengths)[:, None]).long()
            fresh = self.adapter.new_cache(B, width + 4 * (K + 1), max(K - 1, 2), self.strategy, static=True)
            logits, _ = self.adapter.prefill(input_ids.gather(1, src) * mask, mask, fresh)
            if st.cache is None:
                st.cache = fresh
            else:
                st.cache.copy_from(fresh)
            del fresh
            self.cache, self.consumed = st.cache, st.consumed
            st.consumed.copy_(lengths)
            st.drafts[:, 0] = logits.argmax(-1)
            self._chain(st, K)
            self.last_path = "static"
        else:
            st.text[:, :W].copy_(input_ids)
            st.lengths.copy_(lengths)
            # each program: the second call is the graph's warm-up, the third captures it; a replay
            # leaves the host's step counts as the capture left them, so they are set after each
            if st.commit_open is not None:
                st.commit_open()
                st.cache.set_step_tokens(0)
            self._reset_admitted()  # (rows given new requests: no step is open here)
            self.last_path = st.program()
            st.cache.set_step_tokens(max(K - 1, 0))  # the chain's open step
            self.capture_error = st.program.error or (st.commit_open.error if st.commit_open is not None else None)
        self._calls += 1
        return st.drafts.clone(), torch.full((B,), K, dtype=torch.long, device=dev)

    def _chain(self, st, K):
        """d_2..d_K: K - 1 one-token forwards in one open step (left open for the next commit)."""
        for j in range(1, K):
            logits, _ = self.adapter.forward(st.drafts[:, j - 1 : j], st.cache)
            st.drafts[:, j] = logits[:, 0].argmax(-1)
        if K > 1:
            st.open.copy_(st.drafts[:, : K - 1])

    def _commit_open(self, st):
        """Commit the kept prefix of the open step (K - 1 drafts run) on ``st``'s buffers, fixed
        shapes (the first captured program): the drafts the text has, all but each row's last
        unseen token at most."""
        c, text, lengths, consumed = st.cache, st.text, st.lengths, st.consumed
        remaining = (lengths - consumed).clamp(min=0)
        idx = (consumed[:, None] + st.j_open).clamp(max=text.shape[1] - 1)
        same = (text.gather(1, idx) == st.open) & (st.j_open < remaining[:, None])
        m = torch.minimum(same.long().cumprod(1).sum(1), (remaining - 1).clamp(min=0))
        c.commit(m)
        consumed += m

    def _body(self, st, K):
        """The rest of a fixed-shape proposal on ``st``'s buffers, no step open (the second captured
        program): the catch-up, then the chain."""
        c, text, lengths, consumed = st.cache, st.text, st.lengths, st.consumed
        # catch up on the unseen text (1 or 2 tokens; 0 for a finished row) in one 2-token forward
        r = (lengths - consumed).clamp(min=0, max=2)
        idx = (consumed[:, None] + st.j_two).clamp(max=text.shape[1] - 1)
        logits, _ = self.adapter.forward(text.gather(1, idx), c)
        c.commit(r)
        consumed += r
        st.drafts[:, 0] = logits[st.rows, (r - 1).clamp(min=0)].argmax(-1)
        self._chain(st, K)

    def __repr__(self):
        return f"DraftModelDrafter({type(self.model).__name__}, rollback={self.strategy.name!r})"


class _StaticDraft:
    """Buffers of the static draft path for one shape bucket (kept across ``generate()`` calls so a
    captured graph stays valid)."""

    def __init__(self, key, B, K, width, dev):
        self.key = key
        self.cache = None
        self.commit_open = None  # the commit of the open step's kept prefix as a CapturedProgram (K > 1)
        self.program = None  # the rest of the proposal as a CapturedProgram (its graph, once captured)
        self.text = torch.zeros(B, width, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(B, dtype=torch.long, device=dev)
        self.consumed = torch.zeros(B, dtype=torch.long, device=dev)
        self.drafts = torch.zeros(B, K, dtype=torch.long, device=dev)
        self.open = torch.zeros(B, max(K - 1, 0), dtype=torch.long, device=dev)
        self.rows = torch.arange(B, device=dev)
        self.j_open = torch.arange(max(K - 1, 0), device=dev)[None, :]
        self.j_two = torch.arange(2, device=dev)[None, :]
