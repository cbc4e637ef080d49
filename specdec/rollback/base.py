"""The rollback interface: how one SSM layer reaches s^(n+1) after a speculative step.

A *step* runs tokens ``[x_L, d_1 .. d_k]`` through the layer, possibly in several calls
(``offset`` = how many step tokens earlier calls already ran; a draft model runs its drafts one
at a time inside one step). ``commit(num_tokens)`` then makes, per row,
``state := s^(num_tokens[b])`` (0 keeps the old state) and closes the step.

Strategies (see docs/design.md, "One speculative step"):

=========  ===========================================  ===========================  ================
strategy   during verify                                commit                       extra memory
=========  ===========================================  ===========================  ================
snapshot   every s^(j) into a T-slot buffer             copy slot n into the state   T states
ring       s^(j) into slot (head + j) mod R             move ``head``                R states
replay     outputs from s^(0) + cached inputs, no state fold n cached inputs         L token inputs
=========  ===========================================  ===========================  ================

A step of one token that every row keeps (K = 0) needs no rollback: strategies with
``has_plain_steps`` run it as a *plain step* (:meth:`RollbackStrategy.plain_verify`), which
updates the committed state in place after :meth:`RollbackStrategy.flush`.

Stores are per layer; a strategy object is stateless and can be shared by all layers. A store
keeps one committed state per *slot*; by default row b of the batch is slot b, and a store made
with ``state_indices`` runs its B rows over a pool of slots (see :class:`LayerStore`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from ..fusion import env_switch
from ..kernels import SSMOp
from ..kernels.slots import check_state_indices, gather_rows, scatter_rows

__all__ = ["STRATEGIES", "RollbackStrategy", "LayerStore", "debug_enabled", "check_index_bounds", "check_finite",
           "check_slot_map", "write_rows"]

#: the built-in strategies' names (each also verifies trees); ``"replay_deferred"`` is replay
#: that folds only when its history would overflow
STRATEGIES = ("snapshot", "ring", "replay")


def debug_enabled() -> bool:
    """True when ``SPECDEC_DEBUG=1``: bounds checks on every slot index and NaN/Inf checks on commits."""
    return env_switch("SPECDEC_DEBUG", default=False)


def _where(store) -> str:
    return f"layer {store.layer}, step {store.steps}" if store is not None else "layer ?, step ?"


def check_index_bounds(name: str, idx: torch.Tensor, size: int, store: "LayerStore | None" = None) -> None:
    """Raise IndexError naming the row, layer and step when any ``idx`` is outside ``[0, size)``.

    ``idx`` is ``[B]`` or ``[B, ...]`` (one row per sequence).
    """
    bad = (idx < 0) | (idx >= size)
    if bool(bad.any()):
        flat = bad.reshape(bad.shape[0], -1) if bad.dim() else bad.reshape(1, 1)
        row = int(flat.any(dim=1).nonzero()[0, 0])
        vals = idx.reshape(flat.shape)[row][flat[row]].tolist()
        raise IndexError(f"{name} index {vals} outside a buffer of {size} slots (row {row}, {_where(store)})")


def check_finite(state: torch.Tensor, store: "LayerStore | None" = None, what: str = "committed state") -> None:
    """Raise FloatingPointError naming the row, layer and step when ``state [B, ...]`` holds NaN or Inf."""
    bad = ~torch.isfinite(state.reshape(state.shape[0], -1)).all(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise FloatingPointError(f"{what} holds NaN or Inf (row {row}, {_where(store)})")


def check_slot_map(state_indices: torch.Tensor, num_slots: int, store: "LayerStore | None" = None) -> None:
    """Raise IndexError unless every non-padding slot id is below ``num_slots``, ValueError when two
    rows share a slot (debug mode: needs the values on the host)."""
    used = state_indices[state_indices >= 0]
    if bool((used >= num_slots).any()):
        raise IndexError(f"state_indices {state_indices.tolist()} name a slot outside the {num_slots} slots of the "
                         f"store ({_where(store)})")
    if used.unique().numel() != used.numel():
        raise ValueError(f"state_indices {state_indices.tolist()} give two rows one slot ({_where(store)})")


def write_rows(buf: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None) -> None:
    """``buf[rows] = state`` (zeros when None) in place, cast to ``buf``'s dtype (``buf [slots, *S]``,
    ``rows [n]`` int64 or a slice of n slots, ``state [n, *S]``); ``buf`` may be a view (a ring's position 0)."""
    # (a slice writes through a view, whose copy casts; an index write needs the dtype matched first)
    buf[rows] = 0 if state is None else state if isinstance(rows, slice) else state.to(buf)


@dataclass
class LayerStore:
    """What one strategy keeps for one SSM layer. ``tensors`` are strategy-specific.

    Every tensor of ``tensors`` has one entry per state slot (committed states, the snapshot
    buffer, the ring and its heads, the replay checkpoint, history and lengths, so a row's step
    scratch stays with its slot); a step's inputs, outputs and ``num_tokens`` have one per row.
    ``state_indices``: ``[batch]`` int32/int64 on the store's device, row b's slot (negative: a
    padding row, which changes no slot and whose outputs are unspecified); None: row b is slot b.
    With a map, the states :meth:`RollbackStrategy.load` takes and :meth:`RollbackStrategy.state`
    returns are the whole pool ``[num_slots, *S]``, and slots no row maps to stay bit for bit.
    """

    batch: int
    max_step_tokens: int
    layer: int | None = None
    tensors: dict = field(default_factory=dict)
    step_tokens: int = 0  # tokens of the open step already run (uniform over rows)
    steps: int = 0  # commits so far (reported by debug-mode errors)
    state_indices: torch.Tensor | None = None
    #: the most committed tokens any row's rollback history holds before the next step's first
    #: forward, when its caller guarantees one (:meth:`specdec.cache.HybridCache.set_fold_max`):
    #: fused replay sizes the fold inside its verify for that many instead of ``max_step_tokens``
    fold_max: int | None = None


class RollbackStrategy(abc.ABC):
    """Interface of a rollback strategy (see the module docstring for the semantics)."""

    name: str = ""

    def new_store(self, batch: int, max_step_tokens: int, layer: int | None = None,
                  state_indices: torch.Tensor | None = None) -> LayerStore:
        """A store for one layer; tensors are allocated by :meth:`load`.

        Args:
            batch: B, the rows of each step. max_step_tokens: T_max. layer: for error messages.
            state_indices: ``[batch]`` int32/int64 slot of each row (see :class:`LayerStore`),
                or None (row b is slot b).

        Raises:
            ValueError: ``max_step_tokens < 1`` or ``state_indices`` not an integer ``[batch]`` tensor.
        """
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        check_state_indices(state_indices, batch)
        return LayerStore(batch=batch, max_step_tokens=max_step_tokens, layer=layer, state_indices=state_indices)

    def load(self, store: LayerStore, state: torch.Tensor, state_indices: torch.Tensor | None = None) -> None:
        """Set the committed state of every slot and clear the step.

        Args:
            state: ``[num_slots, *S]`` (stored fp32); without a slot map ``num_slots = B``.
            state_indices: a new ``[batch]`` row -> slot map for the store from now on (as
                :meth:`new_store` takes it); None keeps the store's.

        Raises:
            ValueError: a bad ``state_indices`` (or, in debug mode, IndexError: a slot outside the pool).
        """
        if state_indices is not None:
            check_state_indices(state_indices, store.batch)
            store.state_indices = state_indices
        self._load(store, state.detach().to(torch.float32))
        if debug_enabled() and store.state_indices is not None:
            check_slot_map(store.state_indices, state.shape[0], store)

    @abc.abstractmethod
    def _load(self, store: LayerStore, state: torch.Tensor) -> None:
        """:meth:`load`'s strategy part: allocate ``store.tensors`` for the fp32 pool ``state``."""

    @abc.abstractmethod
    def state(self, store: LayerStore, op: SSMOp, params: dict) -> torch.Tensor:
        """The committed state of every slot ``[num_slots, *S]`` fp32 (a fresh tensor or a view; do not modify)."""

    @abc.abstractmethod
    def verify(self, store: LayerStore, op: SSMOp, inputs: dict, params: dict) -> torch.Tensor:
        """Run ``t`` more step tokens (inputs ``[B, t, ...]``) and return their outputs."""

    @abc.abstractmethod
    def commit(self, store: LayerStore, op: SSMOp, params: dict, num_tokens: torch.Tensor) -> None:
        """``state := s^(num_tokens[b])`` per row; closes the step. ``num_tokens``: ``[B]`` int64."""

    # tree steps (specdec.tree): a tree of step tokens in one verify, then the accepted path ------
    def tree_verify(self, store: LayerStore, op: SSMOp, inputs: dict, params: dict, parents) -> torch.Tensor:
        """Run a tree of ``T`` step tokens (inputs ``[B, T, ...]``, topological order) as the step's
        only forward: token j starts from token ``parents[j]``'s state (``-1``: the committed
        state). Keeps what :meth:`compact_path` and :meth:`commit` need; returns the outputs.

        Raises: ValueError when the strategy has no tree support or the step is already open."""
        raise ValueError(f"rollback strategy {self.name!r} does not support tree verification; "
                         f"use one of {STRATEGIES} or 'replay_deferred'")

    def compact_path(self, store: LayerStore, op: SSMOp, params: dict, path: torch.Tensor,
                     num_tokens: torch.Tensor) -> None:
        """After :meth:`tree_verify`: rearrange the step so that a following
        ``commit(num_tokens)`` commits the accepted path, as if its tokens had been the step's
        first ones. ``path [B, P]`` int64: the tree indices of row b's accepted tokens in order
        (``path[b, 0] = 0``, the root; entries at ``i >= num_tokens[b]`` are ignored)."""
        raise ValueError(f"rollback strategy {self.name!r} does not support tree verification")

    def _check_tree_step(self, store: LayerStore, t: int) -> None:
        if store.step_tokens:
            raise ValueError("a tree step must be the step's only forward (this step already ran "
                             f"{store.step_tokens} tokens)")
        self._check_step(store, t)

    def reset_rows(self, store: LayerStore, op: SSMOp, params: dict, rows: torch.Tensor,
                   state: torch.Tensor | None = None) -> None:
        """Give ``rows`` (``[n]`` int64 slots, with a slot map; or a slice of n slots) to new
        sequences: their committed state becomes ``state`` (``[n, *S]``, any float dtype; stored
        fp32) or zeros.

        Other slots keep their committed state exactly. A strategy that defines
        ``_reset_in_place(store, rows, state)`` (every built-in one: it writes the slots' committed
        state and resets their cursors into the existing tensors) keeps the tensors a captured CUDA
        graph reads valid, and needs a closed step. For one that does not, this discards any open
        step and reloads the store, which may allocate new tensors (``resets_in_place`` is False: a
        captured graph would read stale ones).

        Raises: ValueError when a strategy that resets in place has an open step (commit it first).
        """
        if self.resets_in_place:
            if store.step_tokens:
                raise ValueError(f"reset_rows needs no open step, but {store.step_tokens} step tokens were run and "
                                 "not committed: commit the step first (commit zeros to discard it)")
            self._reset_in_place(store, rows, state)
            return
        full = self.state(store, op, params).clone()
        full[rows] = 0 if state is None else state.to(full)
        self.load(store, full)

    @property
    def resets_in_place(self) -> bool:
        """Whether :meth:`reset_rows` writes into the store's tensors in place: the strategy defines
        ``_reset_in_place`` (every built-in strategy does)."""
        return callable(getattr(self, "_reset_in_place", None))

    # plain steps: one token per row, always kept (K = 0 chosen for a step) ------------------------
    #: whether the strategy runs plain steps in place (:meth:`plain_verify`); without them a
    #: one-token step runs as a one-token :meth:`verify` and :meth:`commit`
    has_plain_steps: bool = False

    #: whether a verify folds the committed history it meets, sized by
    #: :attr:`LayerStore.fold_max` (fused replay): a decoder that narrows its steps flushes
    #: (:meth:`flush`) after a wider one only for such strategies
    sizes_fold: bool = False

    def plain_state(self, store: LayerStore) -> torch.Tensor:
        """The ``[num_slots, *S]`` fp32 tensor that plain steps update in place; it holds the
        committed state after :meth:`flush` (and until the next :meth:`verify`).

        Raises: ValueError when the strategy has no plain steps."""
        raise ValueError(f"rollback strategy {self.name!r} has no plain steps (has_plain_steps is False)")

    def flush(self, store: LayerStore, op: SSMOp, params: dict) -> None:
        """Make :meth:`plain_state` hold the batch's committed states (replay: fold each row's
        input history into the checkpoint); other slots keep what they hold. Needs no open step.
        Runs :meth:`flush_host`, then :meth:`flush_device`.

        Raises: ValueError when a step is open."""
        self.flush_host(store)
        self.flush_device(store, op, params)

    def flush_host(self, store: LayerStore) -> None:
        """The host part of :meth:`flush`: its checks and the store's Python bookkeeping, to run
        at every flush, also where the device part replays as a CUDA graph.

        Raises: ValueError when a step is open."""
        if store.step_tokens:
            raise ValueError(f"flush needs no open step, but {store.step_tokens} step tokens were run and not "
                             "committed: commit the step first")

    def flush_device(self, store: LayerStore, op: SSMOp, params: dict) -> None:
        """The device part of :meth:`flush`: kernel launches only (no host reads, no Python state
        that changes between flushes), so that it may be captured once and replayed while
        :meth:`flush_key` stays the same. Nothing here: the store holds no pending rollback data."""

    def flush_key(self, store: LayerStore, op: SSMOp, params: dict) -> tuple | None:
        """What a captured :meth:`flush_device` depends on: ``()`` when it launches nothing, a
        tuple naming the buffers it reads and writes (address, shape, dtype) while a
        replay of its capture stays valid, or None when it cannot be captured. Here: ``()`` where
        :meth:`flush_device` is this class's, else None (a strategy whose device part may be
        captured says how by overriding this too)."""
        return () if type(self).flush_device is RollbackStrategy.flush_device else None

    def plain_verify(self, store: LayerStore, op: SSMOp, inputs: dict, params: dict) -> torch.Tensor:
        """A plain decoding step: one token per row (inputs ``[B, 1, ...]``) advances
        :meth:`plain_state` in place (one state read and one write, no rollback data) and returns
        its outputs. The step's token is committed as it runs: :meth:`plain_commit` of 0 tokens
        does not undo it (for rows whose state is never read again, e.g. finished ones).
        :meth:`flush` must have run since the last :meth:`verify`.

        Raises: ValueError when the step has more than one token or one is already open."""
        t = next(iter(inputs.values())).shape[1]
        if t != 1 or store.step_tokens:
            raise ValueError(f"a plain step runs exactly 1 token per row as the step's only call; got {t} "
                             f"after {store.step_tokens}")
        live, si = self.plain_state(store), store.state_indices
        if op.kernels is not None:
            y = op.kernels.update(live, inputs, params, state_indices=si)
        else:
            y, states, _ = op.verify(gather_rows(live, si), inputs, params, True)
            scatter_rows(live, si, states[:, -1])
        store.step_tokens = 1
        return y

    def plain_commit(self, store: LayerStore, op: SSMOp, params: dict, num_tokens: torch.Tensor) -> None:
        """Close a plain step (``num_tokens [B]`` int64: 1 for every row whose state is read again)."""
        self._check_commit(store, num_tokens)
        store.step_tokens = 0
        if debug_enabled():
            check_finite(self.plain_state(store), store)

    def extra_state_bytes(self, state_bytes: int, max_step_tokens: int, input_bytes_per_token: int) -> int:
        """Bytes this strategy keeps per layer and sequence beyond the live state (the ``extra
        memory`` column above; see docs/design.md, "The rollback cost model")."""
        return 0

    # shared helpers -------------------------------------------------------------------------
    @staticmethod
    def _check_step(store: LayerStore, t: int) -> None:
        if store.step_tokens + t > store.max_step_tokens:
            raise ValueError(
                f"step of {store.step_tokens + t} tokens exceeds this cache's {store.max_step_tokens} "
                "(num_speculative_tokens + 1)"
            )

    @staticmethod
    def _check_commit(store: LayerStore, num_tokens: torch.Tensor) -> None:
        store.steps += 1
        if debug_enabled():
            check_index_bounds("commit num_tokens", num_tokens, store.step_tokens + 1, store)
