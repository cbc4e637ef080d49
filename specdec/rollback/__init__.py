"""Rollback strategies for SSM state: ``snapshot``, ``ring`` and ``replay`` behind one interface.

``STRATEGIES`` names them; :func:`make_strategy` turns a name (or an instance) into a strategy.

Fused kernels (the Triton backend) plug in per op as ``op.kernels``, an object with these
methods; all states fp32, all updates in place, no host synchronisation, no allocation of
state-sized buffers. ``offset`` = step tokens run by earlier calls of the same step; inputs
are ``[B, t, ...]`` as the op's ``verify`` takes them:

* ``snapshot_verify(live [B,*S], buf [B,T_max,*S], inputs, params, offset) -> y``: start from
  ``live`` (offset 0) or ``buf[:, offset-1]``; write s^(offset+1 .. offset+t) into
  ``buf[:, offset : offset+t]``.
* ``snapshot_commit(live, buf, num_tokens [B])``: ``live[b] = buf[b, n-1]`` where n > 0.
* ``ring_verify(ring [B,R,*S], head [B], inputs, params, offset) -> y``: start from slot
  ``(head+offset) % R``; write s^(offset+1+j) into slot ``(head+offset+1+j) % R``.
* ``ring_commit(head, num_tokens, R)`` (optional): ``head = (head + num_tokens) % R`` in one launch.
* ``replay_verify(ckpt [B,*S], hist {key: [B,L,...]}, hist_len [B], inputs, params, offset) -> y``:
  outputs from ``ckpt`` advanced by the first ``hist_len[b] + offset`` cached tokens; append this
  call's replay inputs (``op.replay_spec``) at positions ``hist_len[b] + offset + j``; ``ckpt``
  is not written.
* ``replay_fold(ckpt, hist, params, num_tokens [B])``: ``ckpt[b]`` advanced by the first
  ``num_tokens[b]`` cached tokens, in place.
* optional, eager replay with the fold fused into the next verify (``L = 2 T_max``):
  ``replay_verify(..., offset, fused=True)``: the step's first call (offset 0) folds the first
  ``hist_len[b]`` cached tokens into ``ckpt`` in place; outputs from ``ckpt`` advanced by the
  step's first ``offset`` tokens (positions ``T_max ..``); appends at ``T_max + offset + j``.
  ``replay_commit(hist, hist_len, num_tokens)``: move positions ``T_max .. T_max + n - 1`` to
  ``0 .. n - 1`` and set ``hist_len = num_tokens`` (no state traffic).
* tree steps (:mod:`specdec.tree`): the three ``*_verify`` with ``offset = 0`` and
  ``parents=`` (a tuple, ``parents[j] < j``, ``-1`` = the committed state): token j starts from
  token ``parents[j]``'s state and is written / appended at position j exactly as a chain's
  token j (``buf[:, j]``, ring slot ``head+1+j``, history ``pos0 + j``); the strategy's
  ``compact_path`` then moves the accepted path into chain order before the commit.
"""

from __future__ import annotations

from .base import STRATEGIES, LayerStore, RollbackStrategy
from .inplace import InPlaceUpdate
from .replay import ReplayRollback
from .ring import RingRollback
from .snapshot import SnapshotRollback

__all__ = [
    "STRATEGIES",
    "RollbackStrategy",
    "LayerStore",
    "SnapshotRollback",
    "RingRollback",
    "ReplayRollback",
    "InPlaceUpdate",
    "make_strategy",
]

_BY_NAME = {
    "snapshot": SnapshotRollback,
    "ring": RingRollback,
    "replay": ReplayRollback,
    "replay_deferred": lambda: ReplayRollback(deferred=True),
}


def make_strategy(rollback) -> RollbackStrategy:
    """A strategy from a name in ``STRATEGIES`` (or ``"replay_deferred"``) or an instance.

    Raises:
        ValueError: unknown name. TypeError: neither a string nor a RollbackStrategy.
    """
    if isinstance(rollback, RollbackStrategy):
        return rollback
    if isinstance(rollback, str):
        try:
            return _BY_NAME[rollback]()
        except KeyError:
            raise ValueError(
                f"unknown rollback strategy {rollback!r}; use one of {STRATEGIES} (or 'replay_deferred'), "
                "or pass a specdec.rollback.RollbackStrategy instance"
            ) from None
    raise TypeError(f"rollback must be a strategy name or a RollbackStrategy, got {type(rollback).__name__}")
