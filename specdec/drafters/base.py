"""The drafter interface: subclass :class:`Drafter` to plug in your own speculation scheme."""

from __future__ import annotations

import abc

import torch

from ..verify import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD

__all__ = ["Drafter", "chain_drafts", "check_draft_probs", "check_proposal", "check_tree_proposal",
           "proposal_errors", "draft_prob_errors"]


class Drafter(abc.ABC):
    """Proposes up to K draft tokens per row each step.

    Only :meth:`propose` is required. The engine calls :meth:`start` once per ``generate()``
    (before the first proposal) and, when sampling, reads :meth:`draft_probs` after the verify
    of each step that drafted (before the next proposal).

    Tree drafting (:mod:`specdec.tree`): a drafter whose ``tree`` attribute is a
    :class:`specdec.tree.TreeSpec` is asked instead for :meth:`propose_tree`, the tokens of the
    tree's nodes; the target verifies the whole tree in one forward (see :class:`MedusaDrafter`)
    and accepts a path as ``acceptance`` says.
    """

    #: the draft tree (a :class:`specdec.tree.TreeSpec`) for tree drafting, or None for chains
    tree = None
    #: how a tree's path is accepted (:func:`specdec.verify.accept_tree`): ``"exact"`` (greedy /
    #: lossless sampling) or ``"typical"`` (Medusa's typical acceptance, not distribution-preserving)
    acceptance: str = "exact"
    #: typical acceptance's epsilon and delta (threshold ``min(eps, delta * exp(-entropy))``)
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA
    #: True when each draft costs the drafter a forward of its own (a draft model, chained MTP
    #: layers), so a proposal's time grows with K; False when one pass proposes every draft (an
    #: n-gram lookup, Medusa heads). ``num_speculative_tokens="auto"`` extrapolates the proposal
    #: time of a K not yet run from one measured K by it (proportional to K, or the same).
    drafts_sequentially: bool = False
    #: the most drafts one chain proposal can hold (Medusa: one per head), or None: as many as
    #: asked. The decode loop asks for at most this many: a larger ``num_speculative_tokens``
    #: (or ``max_speculative_tokens`` under ``"auto"``) runs steps this wide, as an eager step
    #: of the drafts proposed would, not padded to the K asked for
    max_drafts: int | None = None
    #: how the last proposal ran, for a drafter with a program of its own (a draft model, MTP
    #: layers): ``"eager"``, ``"static"`` or ``"cuda_graph"``; None for one without (n-gram, Medusa)
    last_path: str | None = None
    #: why that program's CUDA-graph capture failed (it then ran without graphs), or None
    capture_error: str | None = None
    #: why compiling that program failed where compiling was asked for (it then ran uncompiled), or None
    compile_error: str | None = None

    def propose_tree(self, input_ids: torch.Tensor, lengths: torch.Tensor, tree) -> torch.Tensor:
        """With ``tree`` set: the tokens of the tree's nodes 1..N-1, ``[B, N-1]`` int64 (node 0 is
        the pending token), for ``tree`` depth-limited to K. ``input_ids`` / ``lengths`` as in
        :meth:`propose`."""
        raise TypeError(f"{type(self).__name__} sets a draft tree but does not define propose_tree()")

    @abc.abstractmethod
    def propose(self, input_ids: torch.Tensor, lengths: torch.Tensor, num_speculative_tokens: int):
        """Propose drafts.

        Args:
            input_ids: ``[B, L]`` int64. Row i's text is ``input_ids[i, :lengths[i]]``: its prompt
                without padding plus every generated token, including the last one, which the
                target has not run yet. Entries past ``lengths[i]`` are meaningless.
            lengths: ``[B]`` int64. (The engine passes copies of its buffers: writing into them
                changes nothing; except where a :meth:`graph_safe` drafter proposes inside the step's
                captured program: it gets the buffers themselves, ``input_ids`` at their full
                width.)
            num_speculative_tokens: K, the most tokens a row may propose.

        Returns:
            ``(draft_tokens [B, K] int64, num_draft_tokens [B] int64)`` with
            ``0 <= num_draft_tokens[i] <= K``; only the first ``num_draft_tokens[i]`` of row i
            are used. Zero drafts make that row's step a plain decode step.

        When it is called: in ``generate()`` (a fixed batch, with a fixed K or where
        ``num_speculative_tokens="auto"`` chose the next K before the sync: the CUDA-graph
        path; ``SPECDEC_OVERLAP=0`` turns this off) the proposal of a step is made right after
        the step before has committed and before that step's host sync, so that its launches
        overlap the device's work. At most once per call it is therefore made for a step that
        never runs (the call ended at that sync): its drafts are dropped, so is an error it
        raises (a drafter past the end of its reference text, say), and the engine puts back
        the random state it drew from (the call's ``generator`` and torch's default
        generators); state the drafter keeps itself has seen one more proposal, so reset it
        in :meth:`start`. Otherwise (continuous batching; ``"auto"`` off the CUDA-graph path)
        it proposes after each step's sync. The inputs are the same either way: the text
        every earlier step committed.
        """

    def start(self, *, target_vocab_size: int, batch_size: int, device, sampling=None, generator=None,
              max_length: int | None = None) -> None:
        """Called at the start of each ``generate()``; reset any per-sequence state here.

        ``sampling`` is a :class:`specdec.verify.SamplingConfig` when sampling, else None;
        ``max_length`` bounds the text length (prompt + new tokens + K + 1) of any row.
        """

    def set_speculation(self, max_speculative_tokens: int, adaptive: bool) -> None:
        """Called by the engine before :meth:`start` with the most drafts a step of the call asks
        for and whether K changes from step to step (``num_speculative_tokens="auto"``: each
        :meth:`propose` then gets its own K in ``[1, max_speculative_tokens]``, and steps that
        draft nothing do not call it). A drafter that sizes buffers for K sizes them for the
        maximum; the default ignores it."""

    def set_decode_path(self, path: str) -> None:
        """Called by the engine before :meth:`start` with the call's decode path (``"eager"``,
        ``"static"`` or ``"cuda_graph"``, see ``SpeculativeGenerator``). A drafter may switch to
        fixed-shape, graph-captured proposals on the latter two; the default ignores it."""

    def graph_safe(self, input_ids: torch.Tensor) -> bool:
        """Whether :meth:`propose` on texts like ``input_ids`` (``[B, W]``: its device and batch)
        may be captured in a CUDA graph and replayed: device work only (no host synchronisation,
        no host read of its arguments), no writes into its arguments, outputs whose shapes follow
        from the arguments' shapes and K, and nothing read but its arguments: the drafter must
        also set ``stateless = True`` and want no hidden states (the engine proposes outside where
        those say otherwise).

        Where it is (and ``SPECDEC_CAPTURED_PROPOSALS`` is on), a greedy fixed-batch step on the
        static / CUDA-graph path calls :meth:`propose` inside the step's own captured program, on
        the decode loop's buffers instead of copies (``input_ids`` at the buffer's full width:
        entries past ``lengths`` are stale; ``lengths`` as always). From the capture on its kernels
        are replayed and its Python no longer runs, so settings changed on the drafter object
        afterwards (an n-gram size, say) are not seen while that program is kept: until
        ``release()``, another drafter, a call that proposes outside, or a call of another shape
        bucket. Assign a new drafter to change them. The default, False, keeps every proposal a Python call on
        copies. The n-gram drafter is graph-safe with its Triton kernel and its batched search,
        not with its host loop (:meth:`NGramDrafter.search`)."""
        return False

    #: True when :meth:`propose` reads nothing but its arguments (no per-row state kept between
    #: calls, no hidden states): a row may then take a new sequence between two steps with nothing
    #: to reset (:meth:`admit` does nothing). The n-gram drafter is.
    stateless: bool = False

    @property
    def resets_rows(self) -> bool:
        """Whether a row may take a new sequence between two steps (continuous batching): the
        drafter is ``stateless`` or defines :meth:`admit`."""
        return self.stateless or type(self).admit is not Drafter.admit

    def admit(self, rows: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              hidden_states: torch.Tensor | None, requests: list) -> None:
        """Continuous batching (``SpeculativeGenerator.generate_batch``): between two steps, the
        rows ``rows`` (``[n]`` int64, on the device) drop their sequences and take new ones, whose
        prompts were just prefilled; reset every per-row state of those rows here, the other rows'
        untouched. The pool's first requests come the same way: :meth:`start` (which sizes the
        state for the pool's rows), then ``admit`` of every row that holds a request, in place of
        :meth:`observe_prompt` and the first :meth:`observe`. A row that holds none (a pool with
        more rows than requests, a manager's pool waiting for requests) is still in the batch
        :meth:`propose` gets: its proposals are never used, whatever they are.

        Args:
            rows: the pool rows that take the new sequences.
            input_ids: ``[n, L]`` int64, the new prompts left-padded (``attention_mask [n, L]``,
                0 = padding), row i of them going to ``rows[i]``.
            hidden_states: the target's final hidden states of the prompts as :meth:`observe_prompt`
                gets them (``[n, L, D]``) with ``wants_all_hidden_states``; as :meth:`observe` gets
                them (``[n, D]``) with ``wants_hidden_states``; else None.
            requests: the ``n`` :class:`specdec.batching.Request` s (``index``, ``prompt``,
                ``max_new_tokens``), e.g. to look a request's reference text up. Those of a
                manager's warm-up (``warmup`` set: random or sample prompts, indices counted from
                0 within the warm-up) belong to no caller: a drafter that looks requests up must
                let them decode without (``OracleDrafter`` gives them their prompt as reference).

        Raises:
            NotImplementedError: the default, for a drafter with per-row state that does not define
            it (``stateless`` drafters need nothing and pass).
        """
        if not self.stateless:
            raise NotImplementedError(f"{type(self).__name__} keeps per-row state and does not define admit(), "
                                      "which continuous batching needs to give a row a new sequence")

    #: set True to receive the target's last hidden states through :meth:`observe`
    wants_hidden_states: bool = False

    def observe(self, hidden_states: torch.Tensor) -> None:
        """With ``wants_hidden_states``: the target's final hidden state ``[B, D]`` at the position
        whose logits chose each row's pending token (after prefill and after every commit).
        Medusa-style heads draft from it."""

    #: set True to receive the target's hidden states of EVERY committed position through
    #: :meth:`observe_prompt` and :meth:`observe_tokens` (e.g. MTP layers, which keep their own
    #: cache over the sequence)
    wants_all_hidden_states: bool = False

    def observe_prompt(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """With ``wants_all_hidden_states``: after the prefill (and after :meth:`start`), the target's
        final hidden states of every prompt position, ``[B, L, D]`` in the target's dtype, laid out
        as the left-padded prompt (``attention_mask [B, L]``, 0 = padding); the last position's is
        the one whose logits chose each row's pending token."""

    def observe_tokens(self, hidden_states: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """With ``wants_all_hidden_states``: after every commit, the target's final hidden states
        of the step's committed positions, ``hidden_states [B, W, D]``, the first ``num_tokens[b]``
        (``[B]`` int64, on the device) of row b: the positions of the pending token and the
        accepted drafts (a tree step: of its accepted path), so the last one's logits chose the
        new pending token. Columns past ``num_tokens`` are meaningless; a finished row has 0."""

    def draft_probs(self) -> torch.Tensor | None:
        """``[B, w, V]`` floating distributions the last drafts (``draft_tokens [B, w]``) were sampled
        from, or None (deterministic). Sampling's rejection step reads them: the values of the
        drafts a step uses are checked on the device (finite, >= 0, > 0 at the drafted token), and
        the call raises ValueError at the step's sync otherwise."""
        return None

    @property
    def vocab_size(self) -> int | None:
        """The drafter's vocabulary size when it has one (checked against the target's)."""
        return None

    def check_target(self, model) -> None:
        """Raise ValueError when this drafter reads the weights of another model than ``model``,
        the target of the generator it is given to (the MTP drafter: its target's embedding and
        LM head; Medusa heads sharing an LM head: that head); a model compiled with ``torch.compile`` is
        the model it wraps. The default drafts for any target of its vocabulary."""


def unwrapped(model):
    """The module ``torch.compile(model)`` wraps (its ``_orig_mod``), else ``model``."""
    return getattr(model, "_orig_mod", model)


def check_proposal(out, batch: int, num_speculative_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :meth:`Drafter.propose` returned, checked on the host (types and shapes: no device sync).

    Returns ``(draft_tokens [B, w], num_draft_tokens [B])`` as given (``w <= K``); their values
    are checked on the device by :func:`proposal_errors`.

    Raises:
        TypeError: not a pair of tensors, or a tensor of a non-integer dtype.
        ValueError: a shape other than ``[B, <= K]`` / ``[B]``.
    """
    K = num_speculative_tokens
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError("Drafter.propose must return a pair (draft_tokens LongTensor [B, K], num_draft_tokens "
                        f"LongTensor [B]), got {type(out).__name__}")
    drafts, counts = out
    for name, t in (("draft_tokens", drafts), ("num_draft_tokens", counts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"Drafter.propose returned {name} of type {type(t).__name__}; expected an integer tensor")
        if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
            raise TypeError(f"Drafter.propose returned {name} of dtype {t.dtype}; expected an integer dtype (int64)")
    if drafts.dim() != 2 or drafts.shape[0] != batch:
        raise ValueError(f"drafter returned draft_tokens of shape {tuple(drafts.shape)}; expected [{batch}, {K}]")
    if drafts.shape[1] > K:
        raise ValueError(f"drafter returned {drafts.shape[1]} draft tokens per row; at most num_speculative_tokens={K}")
    if counts.shape != (batch,):
        raise ValueError(f"drafter returned num_draft_tokens of shape {tuple(counts.shape)}; expected [{batch}]")
    return drafts, counts


def check_draft_probs(probs, batch: int, width: int, vocab_size: int) -> torch.Tensor | None:
    """What :meth:`Drafter.draft_probs` returned, checked on the host (types and shapes: no device
    sync): None, or a floating tensor ``[batch, width, vocab_size]`` (``width``: the columns of the
    step's ``draft_tokens``), returned as given.

    Raises:
        TypeError: not a tensor, or a tensor of a non-floating dtype.
        ValueError: another shape.
    """
    if probs is None:
        return None
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"Drafter.draft_probs returned {type(probs).__name__}; expected None or a float tensor "
                        f"[{batch}, {width}, {vocab_size}]")
    if not probs.dtype.is_floating_point:
        raise TypeError(f"Drafter.draft_probs returned dtype {probs.dtype}; expected a floating dtype (probabilities)")
    if probs.shape != (batch, width, vocab_size):
        raise ValueError(f"Drafter.draft_probs returned shape {tuple(probs.shape)}; expected [{batch}, {width}, "
                         f"{vocab_size}] (batch, the proposal's draft_tokens columns, the target's vocabulary)")
    return probs


def draft_prob_errors(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Device-side value check of :meth:`Drafter.draft_probs` for the drafts a step uses, without
    a host sync: ``[1]`` bool, true when a used draft's distribution (``probs [B, w, V]``, drafts
    ``[B, w]`` and ``num_drafts [B]`` on the device) has an entry that is not finite or is
    negative, or gives its own draft token probability 0, so it cannot be what the draft was
    sampled from (rejection sampling would then keep neither distribution)."""
    w = drafts.shape[1]
    used = torch.arange(w, device=drafts.device)[None, :] < num_drafts[:, None]  # [B, w]
    q = probs[:, :w]
    low, high = torch.aminmax(q, dim=-1)  # one pass over the distributions (a NaN propagates to both)
    good = (low >= 0) & (high < float("inf")) & (q.gather(2, drafts[..., None])[..., 0] > 0)
    return (~good & used).any()[None]


def check_tree_proposal(nodes, batch: int, tree) -> torch.Tensor:
    """What :meth:`Drafter.propose_tree` returned, checked on the host (no device sync): an integer
    tensor ``[batch, N - 1]``; its values are checked on the device by :func:`proposal_errors`.

    Raises: ValueError for another type or shape; TypeError for a bool / float / complex dtype."""
    N = tree.num_nodes
    if not isinstance(nodes, torch.Tensor) or nodes.shape != (batch, N - 1):
        got = tuple(nodes.shape) if isinstance(nodes, torch.Tensor) else type(nodes).__name__
        raise ValueError(f"propose_tree must return node tokens [{batch}, {N - 1}], got {got}")
    if nodes.dtype == torch.bool or nodes.dtype.is_floating_point or nodes.dtype.is_complex:
        raise TypeError(f"propose_tree returned node tokens of dtype {nodes.dtype}; expected an integer dtype (int64)")
    return nodes


def proposal_errors(tokens: torch.Tensor, used: torch.Tensor | None, vocab_size: int,
                    counts: torch.Tensor | None = None, width: int = 0) -> torch.Tensor:
    """Device-side value checks of a proposal, without a host sync: ``[2]`` bool, (counts outside
    ``[0, width]``, a used token outside ``[0, vocab_size)``).

    Args: tokens ``[B, w]`` int64 on the device; used ``[B, w]`` bool, the entries the step uses
    (None: every entry); counts ``[B]`` (chains) or None (trees); width: the drafts' column count ``w``.
    """
    return _errors(tokens, tokens.clamp(0, vocab_size - 1), used, counts,
                   None if counts is None else counts.clamp(0, width))


def _errors(tokens, ids, used, counts, counts_in_range) -> torch.Tensor:
    """:func:`proposal_errors` of ``tokens`` whose ids clamped to the vocabulary are ``ids`` and
    whose ``counts`` clamped to ``[0, w]`` are ``counts_in_range`` (an entry differs iff it was out of range)."""
    bad_token = ids != tokens
    if used is not None:
        bad_token &= used
    if counts is None:
        return torch.stack([torch.zeros((), dtype=torch.bool, device=tokens.device), bad_token.any()])
    return torch.stack([(counts_in_range != counts).any(), bad_token.any()])


def chain_drafts(drafts: torch.Tensor, counts: torch.Tensor, budget: torch.Tensor,
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain proposal made safe to verify, and its value checks, on the device without a host
    sync (a few element-wise ops: no per-check kernels).

    Args:
        drafts: ``[B, w]`` int64 on the device, what :meth:`Drafter.propose` returned.
        counts: ``[B]`` int64 on the device, its ``num_draft_tokens``.
        budget: ``[B]`` int64, the most drafts each row may use (>= 0).

    Returns:
        ``(drafts [B, w], num_drafts [B], errors [2] bool)``: the drafts with the unused entries
        (past ``num_drafts``) 0 and ids clamped to ``[0, vocab_size)``; ``num_drafts =
        min(clamp(counts, 0, w), budget)``; :func:`proposal_errors` of the used entries.
    """
    w = drafts.shape[1]
    counts_in_range = counts.clamp(0, w)
    k = torch.minimum(counts_in_range, budget)
    used = torch.arange(w, device=drafts.device)[None, :] < k[:, None]
    ids = drafts.clamp(0, vocab_size - 1)
    errors = _errors(drafts, ids, used, counts, counts_in_range)
    return ids * used, k, errors
