"""The drafter interface: subclass :class:`Drafter` to plug in your own speculation scheme."""

from __future__ import annotations

import abc

import torch

__all__ = ["Drafter"]


class Drafter(abc.ABC):
    """Proposes up to K draft tokens per row each step.

    Only :meth:`propose` is required. The engine calls :meth:`start` once per ``generate()``
    (before the first proposal) and reads :meth:`draft_probs` after each proposal when sampling.

    Tree drafting (:mod:`specdec.tree`): a drafter whose ``tree`` attribute is a
    :class:`specdec.tree.TreeSpec` is asked instead for ``propose_tree(input_ids, lengths, tree)
    -> [B, N-1]`` int64, the tokens of the tree's nodes 1..N-1 (``tree`` depth-limited to K);
    the target verifies the whole tree in one forward (see :class:`MedusaDrafter`).
    """

    @abc.abstractmethod
    def propose(self, input_ids: torch.Tensor, lengths: torch.Tensor, num_speculative_tokens: int):
        """Propose drafts.

        Args:
            input_ids: ``[B, L]`` int64. Row i's text is ``input_ids[i, :lengths[i]]``: its prompt
                without padding plus every generated token, including the last one, which the
                target has not run yet. Entries past ``lengths[i]`` are meaningless.
            lengths: ``[B]`` int64. (The engine passes copies of its buffers: writing into them
                changes nothing.)
            num_speculative_tokens: K, the most tokens a row may propose.

        Returns:
            ``(draft_tokens [B, K] int64, num_draft_tokens [B] int64)`` with
            ``0 <= num_draft_tokens[i] <= K``; only the first ``num_draft_tokens[i]`` of row i
            are used. Zero drafts make that row's step a plain decode step.
        """

    def start(self, *, target_vocab_size: int, batch_size: int, device, sampling=None, generator=None,
              max_length: int | None = None) -> None:
        """Called at the start of each ``generate()``; reset any per-sequence state here.

        ``sampling`` is a :class:`specdec.verify.SamplingConfig` when sampling, else None;
        ``max_length`` bounds the text length (prompt + new tokens + K + 1) of any row.
        """

    def set_decode_path(self, path: str) -> None:
        """Called by the engine before :meth:`start` with the call's decode path (``"eager"``,
        ``"static"`` or ``"cuda_graph"``, see ``SpeculativeGenerator``). A drafter may switch to
        fixed-shape, graph-captured proposals on the latter two; the default ignores it."""

    #: set True to receive the target's last hidden states through :meth:`observe`
    wants_hidden_states: bool = False

    def observe(self, hidden_states: torch.Tensor) -> None:
        """With ``wants_hidden_states``: the target's final hidden state ``[B, D]`` at the position
        whose logits chose each row's pending token (after prefill and after every commit).
        Medusa-style heads draft from it."""

    def draft_probs(self) -> torch.Tensor | None:
        """``[B, K, V]`` distributions the last drafts were sampled from, or None (deterministic)."""
        return None

    @property
    def vocab_size(self) -> int | None:
        """The drafter's vocabulary size when it has one (checked against the target's)."""
        return None
