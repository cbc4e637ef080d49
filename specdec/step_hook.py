"""The decode loop's optional per-step hook: Hugging Face features that work token by token.

Most ``generate()`` calls need nothing per token beyond what the loop does on the device
(acceptance, EOS, the budget). A few HF settings do, and :class:`StepHook` holds them all, so
the loop stays one loop:

* logits processors that change the *target's* distribution (:class:`TargetLogitsProcessor`:
  repetition penalty, min length / min new tokens), applied to every verified position with
  that position's own prefix (so acceptance sees what HF's token-by-token decoding sees);
* ``stopping_criteria`` (and ``max_time``), checked after every committed token on that row's
  own sequence;
* ``output_scores`` / ``output_logits``: the processed (and sampling-warped) and the raw scores
  of every new token.

The hook works on the host (it syncs); a call without these settings has no hook.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["StepHook", "TargetLogitsProcessor"]


def _hf_penalises_padding() -> bool:
    """Whether the installed transformers counts left-padding ids in ``repetition_penalty``: 5.17 does
    (the processor sees the whole padded row); newer releases (5.24) pass the padding lengths as
    ``prompt_ignore_length`` and skip them."""
    from transformers.generation.utils import GenerationMixin

    try:
        return "padding_lengths" not in inspect.getsource(GenerationMixin._get_logits_processor)
    except (OSError, TypeError):
        return True


class TargetLogitsProcessor:
    """The logits processors of HF ``generate()`` that change the target's distribution:

    * ``RepetitionPenaltyLogitsProcessor``: scores of tokens present in the prefix (the padded
      prompt row as HF holds it, the generated tokens, and the step's drafts before the position)
      are divided (positive) or multiplied (negative) by the penalty (left padding counts as
      the installed transformers counts it, see :func:`_hf_penalises_padding`);
    * ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor``: EOS scores are -inf
      while the prefix is shorter than ``min_length`` / has fewer than ``min_new_tokens`` new tokens.

    Both are element-wise on the logits, so they commute (HF applies the penalty first).

    Args:
        penalty: the repetition penalty, or None. min_new_tokens, min_length: EOS bounds (0 = off).
        eos: EOS ids. input_ids, mask: the prompts ``[B, L]`` as given. vocab_size: V.
    """

    def __init__(self, penalty, min_new_tokens, min_length, eos, input_ids, mask, vocab_size):
        self.penalty = penalty
        eos_rule = bool(eos) and (min_new_tokens > 0 or min_length > 0)
        self.min_new_tokens = int(min_new_tokens) if eos_rule else 0
        self.min_length = int(min_length) if eos_rule else 0
        self.eos = torch.tensor(eos, dtype=torch.long, device=input_ids.device) if eos_rule else None
        self.prompt_width = input_ids.shape[1]
        self.seen = None
        if penalty is not None:
            B = input_ids.shape[0]
            seen = torch.zeros(B, vocab_size + 1, dtype=torch.bool, device=input_ids.device)
            ids = input_ids if _hf_penalises_padding() else input_ids.masked_fill(mask == 0, vocab_size)
            self.seen = seen.scatter_(1, ids, True)[:, :vocab_size].contiguous()

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record tokens appended to ``rows`` (for the repetition penalty)."""
        if self.seen is not None:
            self.seen[rows, tokens] = True

    def __call__(self, logits: torch.Tensor, step_tokens: torch.Tensor | None, n_gen: torch.Tensor) -> torch.Tensor:
        """Process ``logits [B, T, V]`` of step positions 0..T-1; fp32 copy.

        ``step_tokens [B, T]``: the step's tokens (the pending one, then the drafts), or None for
        the logits after the prompt (T = 1). ``n_gen [B]``: tokens generated before the step's
        first prediction (the pending token included).
        """
        out = logits.float().clone()
        B, T, V = out.shape
        if self.seen is not None:
            seen = self.seen[:, None, :].expand(B, T, V).clone()
            if step_tokens is not None and T > 1:
                drafts = torch.nn.functional.one_hot(step_tokens[:, 1:T], V).cumsum(1) > 0  # [B, T-1, V]
                seen[:, 1:] |= drafts
            p = self.penalty
            out = torch.where(seen, torch.where(out < 0, out * p, out / p), out)
        if self.eos is not None:
            new = n_gen[:, None] + torch.arange(T, device=out.device)[None, :]  # new tokens before the prediction
            block = (new < self.min_new_tokens) | (self.prompt_width + new < self.min_length)
            eos_cols = torch.zeros(V, dtype=torch.bool, device=out.device)
            eos_cols[self.eos[self.eos < V]] = True
            out = out.masked_fill(block[:, :, None] & eos_cols, float("-inf"))
        return out

    def process_tree(self, logits: torch.Tensor, tokens: torch.Tensor, n_gen: torch.Tensor, tree) -> torch.Tensor:
        """:meth:`__call__` on a tree's nodes ``logits [B, N, V]`` / ``tokens [B, N]``: each node is
        processed with its own prefix (its ancestors' tokens), by running along every root-to-leaf
        path (a node's result depends on its ancestors only, so shared nodes agree)."""
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for path in tree.tensors(logits.device)["leaves"]:
            out[:, path] = self(logits[:, path], tokens[:, path], n_gen)
        return out


class StepHook:
    """Per-step host work of one ``generate()`` call (see the module docstring).

    Args:
        settings: the call's :class:`~specdec.settings.GenerationSettings`.
        vocab_size: V.

    Use :meth:`make`, which returns None when the call needs no hook.
    """

    def __init__(self, settings, vocab_size: int):
        s = settings
        ids = s.input_ids
        B, dev = ids.shape[0], ids.device
        self.settings = s
        self.processor = (TargetLogitsProcessor(s.repetition_penalty, s.min_new_tokens, s.min_length,
                                                s.eos_token_ids, ids, s.attention_mask, vocab_size)
                          if s.processes_logits else None)
        self.criteria = s.stopping_criteria
        self.max_new = s.max_new_tokens
        self.scores = torch.zeros(B, s.max_new_tokens, vocab_size, device=dev) if s.output_scores else None
        self.raw_logits = torch.zeros(B, s.max_new_tokens, vocab_size, device=dev) if s.output_logits else None
        # HF pads a row stopped by stopping_criteria only when some criterion has an eos_token_id (its EOS
        # criterion, or a user's EosTokenCriteria); without one the row runs on until every row has stopped,
        # and all rows end at that step (crit_step: the new-token count at which each row's criteria first
        # held; max_new + 1 = not yet)
        self.run_on = (self.criteria is not None and not s.eos_token_ids
                       and not any(hasattr(c, "eos_token_id") for c in self.criteria))
        self.crit_step = torch.full((B,), s.max_new_tokens + 1, dtype=torch.long, device=dev)

    @classmethod
    def make(cls, settings, vocab_size: int) -> StepHook | None:
        """The hook of ``settings``, or None when no setting needs one."""
        return cls(settings, vocab_size) if settings.per_token_features else None

    def process(self, logits: torch.Tensor, tokens: torch.Tensor | None, n_gen: torch.Tensor, tree=None):
        """The target's logits ``[B, T, V]`` as acceptance must see them (fp32)."""
        if self.processor is None:
            return logits
        if tree is not None:
            return self.processor.process_tree(logits, tokens, n_gen, tree)
        return self.processor(logits, tokens, n_gen)

    def _warped(self, scores: torch.Tensor) -> torch.Tensor:
        """HF's returned scores: fp32 (whatever the model's dtype), with the sampling warpers."""
        scores = scores.float()
        sampling = self.settings.sampling
        if sampling is None:
            return scores
        flat = scores.reshape(-1, scores.shape[-1])
        for w in sampling.warpers():
            flat = w(None, flat)
        return flat.reshape(scores.shape)

    def after_append(self, rows, new: torch.Tensor, take: torch.Tensor, before: torch.Tensor,
                     finished_before: torch.Tensor, processed: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """After the loop appended ``take [B]`` of ``new [B, W]`` to each row (EOS and the budget
        applied; ``before`` / ``finished_before``: the rows' new-token counts and finished flags
        before): cut rows where the stopping criteria hold after a token (HF checks after every
        token), record the kept tokens for the repetition penalty and their scores.
        ``processed`` / ``raw`` ``[B, W, V]``: the processed / raw scores new token j was chosen from.

        Returns the rows' kept counts (``<= take``); ``rows`` (text, lengths, n_gen, finished) is
        updated in place."""
        if self.criteria is not None:
            take = self._apply_criteria(rows, take, before, finished_before)
        B, W = new.shape
        j = torch.arange(W, device=new.device)[None, :]
        r, c = (j < take[:, None]).nonzero(as_tuple=True)
        if self.processor is not None:
            self.processor.add(r, new[r, c])
        if self.scores is not None:
            self.scores[r, before[r] + c] = self._warped(processed)[r, c]
        if self.raw_logits is not None:
            self.raw_logits[r, before[r] + c] = raw[r, c].float()
        return take

    def _apply_criteria(self, rows, take, before, finished_before):
        take = take.clone()
        stopped = torch.zeros_like(finished_before)
        for j in range(int(take.max())):
            live = ~finished_before & ~stopped & (j < take)
            if not bool(live.any()):
                break
            n_now = before + j + 1
            hit = self._criteria_per_row(rows, n_now, live)
            if self.run_on:
                newly = hit & (self.crit_step > self.max_new)
                self.crit_step[newly] = n_now[newly]
                stop = live & (n_now >= self.crit_step.max()) if bool((self.crit_step <= self.max_new).all()) \
                    else torch.zeros_like(live)
            else:
                stop = live & hit
            take = torch.where(stop, torch.full_like(take, j + 1), take)
            stopped |= stop
        cut = rows.n_gen - before - take  # tokens appended past a criteria stop
        rows.lengths -= cut
        rows.n_gen -= cut
        rows.finished |= stopped
        return take

    def _criteria_per_row(self, rows, n_gen, live):
        """Stopping criteria on each live row's own sequence (its prompt row as given, then its new
        tokens): HF checks them in lockstep on ``[B, L + s]``; here rows have their own lengths, so
        rows are checked in groups of equal length."""
        ids = self.settings.input_ids
        done = torch.zeros_like(live)
        for s in n_gen[live].unique().tolist():
            grp = (live & (n_gen == s)).nonzero()[:, 0]
            idx = rows.prompt_len[grp, None] + torch.arange(s, device=ids.device)[None, :]
            seqs = torch.cat([ids[grp], rows.text[grp[:, None], idx]], dim=1)
            done[grp] = torch.as_tensor(self.criteria(seqs, None), device=done.device).bool().reshape(-1)
        return done

    def final_counts(self, n_gen: torch.Tensor) -> torch.Tensor:
        """The rows' new-token counts as HF returns them: without an EOS criterion, rows that ran
        ahead end where HF's batch stopped."""
        if self.run_on and bool((self.crit_step <= self.max_new).all()):
            return n_gen.clamp(max=int(self.crit_step.max()))
        return n_gen
