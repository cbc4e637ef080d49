"""Rollback strategies for SSM state: ``snapshot``, ``ring`` and ``replay`` behind one interface.

``STRATEGIES`` names them; :func:`make_strategy` turns a name (or an instance) into a strategy.
Each strategy runs the torch reference ops (``op.verify`` / ``op.fold``) or, when the op has
fused kernels (``op.kernels``, the Triton backend), calls them through the contract
:class:`specdec.kernels.protocol.RollbackKernels` (signatures and semantics there).
A store may hold a pool of state slots with a row -> slot map (``state_indices``,
:class:`LayerStore`).
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
