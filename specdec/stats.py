"""What one ``generate()`` call measured: :class:`Stats` (``SpeculativeGenerator.last_stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Stats"]


@dataclass
class Stats:
    """What one ``generate()`` did. Names as Spec-Bench uses them; times in seconds.

    mean_accepted_tokens: tokens committed per target forward per sequence, including the
        bonus/correction token (plain decoding = 1.00). acceptance_rate: accepted drafts /
        proposed drafts (0 when nothing was proposed). accept_histogram[n]: row-steps that
        accepted n drafts. proposed_tokens / accepted_tokens: drafts verified / accepted over
        all row-steps (a tree step proposes its depth limit). steps: target verify forwards.
        new_tokens: tokens generated (all rows, up to and including EOS). draft_s / verify_s /
        rollback_s: time proposing (with K chosen per step, a stateless drafter's shadow proposals
        at plain steps too), in the target forward + acceptance, and committing state;
        prefill_s: the prompt's forward and cache setup (``generate_batch``: every admission's);
        wall_s: the whole call.
        decode_path: how the steps ran: ``"eager"`` (dynamic shapes), ``"static"`` (fixed shapes,
        one host sync per step) or ``"cuda_graph"`` (static, with the verify forward and the
        commit replayed as CUDA graphs).
        capture_error: why CUDA graphs were asked for (``decode_path="auto"`` on CUDA, or
        ``"cuda_graph"``) but the steps ran without them: the capture's error; None otherwise.
        path_reason: why the call took its decode path, e.g. ``"auto: layers on several devices
        (cuda:0, cpu), not all CUDA: the eager path"``, ``"decode_path='static' asked for"``; None
        for a call that decoded nothing.
        devices: where the decoder layers and the LM head computed
        (:meth:`specdec.placement.Placement.layout`, e.g. ``"cuda:0: layers 0-1, lm_head; cpu:
        layers 2-3"``); None for a call that decoded nothing.
        draft_path: how the drafter's last proposal ran, for a drafter with a program of its own (a
        draft model, MTP layers; :attr:`specdec.drafters.Drafter.last_path`) or one proposing
        inside the step programs (:meth:`specdec.drafters.Drafter.graph_safe`, e.g. the n-gram
        kernel): ``"eager"``, ``"static"`` or ``"cuda_graph"``; None for plain decoding and
        drafters without either.
        draft_error: why that program ran without the CUDA graph or the compile it was asked for
        (the drafter's ``capture_error`` / ``compile_error``, or the step programs' capture error,
        after which the drafter proposed outside them); None otherwise.
        k_histogram[K]: steps that asked for K drafts (``num_speculative_tokens="auto"`` chooses
        K per step, up to ``max_speculative_tokens``; a fixed K puts every step at K).
        k_per_step: the K of every step, in order. rollback: the rollback strategy the call ran
        (``"none"``: plain decoding, the state updated in place, or a call that decoded nothing:
        ``max_new_tokens=0``, or a pool whose requests all ended or failed before its loop). rollback_reason: with
        ``rollback="auto"``, why that strategy (the candidates' predicted tokens/s or step times,
        and any left out); None otherwise. calibration_s: time measuring step costs
        (``"auto"``'s first call per batch size; part of wall_s). predicted_tokens_per_s /
        measured_tokens_per_s: with ``"auto"``, the goodput the policy predicted for the steps it
        chose (sum of expected tokens / sum of predicted step times) and the one measured
        (tokens the steps committed / the steps' time); None with a fixed K.
        predicted_step_s / measured_step_s: with ``"auto"``, per K = 0..``max_speculative_tokens``,
        the mean over the call's steps of the seconds a step at K was predicted to take when each
        step's K was chosen, and the mean of the call's own steps at K that the cost model took
        (None where none did: a K's first step in a call, the first plain step after speculative
        ones, a step narrower than the one before, of a run of plain steps all but one in 8, and
        the call's last step are not counted): how far the predictions behind the choices
        were from what the steps took. calibrated_step_s: with ``"auto"``, per K, the measured
        verify + commit of width K + 1 alone, which the prediction for a K not run refines (None:
        not measured, e.g. with ``FixedCosts``). expected_tokens: with ``"auto"``, per K, the mean
        over the call's steps of the tokens a step at K was expected to commit when each step's
        K was chosen (a fixed batch: per step until its slowest row ends). leave_s: with ``"auto"``,
        the cost model's extra seconds of the first plain step after speculative ones at the
        call's end (:meth:`specdec.adaptive.CostModel.leave_s`), which spaces the probes at K = 0
        with the probe step's own extra time (None with a fixed K). catch_up_s: with ``"auto"``
        and a drafter that catches up (draft model, MTP layers), the cost model's seconds per
        plain step that its next proposal first spends running the plain steps' text
        (:meth:`specdec.adaptive.CostModel.catch_up_s`), which spaces the probes too (0.0 for
        other drafters; None with a fixed K). speculation_gain_per_step: with ``"auto"``, per step, the
        predicted goodput of the best K > 0 over plain decoding's when the step's K was chosen
        (:func:`specdec.adaptive.speculation_gain`, which says where speculation starts and stops).
        Empty lists with a fixed K.
        max_batch_size: continuous batching (``generate_batch``, a manager's run): the pool's rows;
        None for ``generate()``. batch_size_reason: with ``max_batch_size="auto"``, how the rows
        were chosen (a row's bytes by part, the memory budget); None otherwise.
        prefix_cache: with ``generate_batch(prefix_caching=True)``, the prefix cache's counters
        for the call (:class:`specdec.prefix_cache.PrefixCacheStats` as a dict: lookups, hit
        blocks / tokens / bytes, prefilled tokens, prefill forwards (one per prompt, two where it
        makes a branch point), inserted / evicted / stored blocks and bytes); None otherwise.
    """

    steps: int = 0
    new_tokens: int = 0
    mean_accepted_tokens: float = 0.0
    acceptance_rate: float = 0.0
    accept_histogram: list = field(default_factory=list)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    decode_path: str = "eager"
    capture_error: str | None = None
    path_reason: str | None = None
    devices: str | None = None
    draft_path: str | None = None
    draft_error: str | None = None
    k_histogram: list = field(default_factory=list)
    k_per_step: list = field(default_factory=list)
    rollback: str = "none"
    rollback_reason: str | None = None
    calibration_s: float = 0.0
    predicted_tokens_per_s: float | None = None
    measured_tokens_per_s: float | None = None
    predicted_step_s: list = field(default_factory=list)
    measured_step_s: list = field(default_factory=list)
    calibrated_step_s: list = field(default_factory=list)
    expected_tokens: list = field(default_factory=list)
    leave_s: float | None = None
    catch_up_s: float | None = None
    speculation_gain_per_step: list = field(default_factory=list)
    max_batch_size: int | None = None
    batch_size_reason: str | None = None
    prefix_cache: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)
