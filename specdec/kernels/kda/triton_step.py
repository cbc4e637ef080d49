"""Kimi Delta Attention in Triton: the gated delta-rule kernels with a per-channel gate.

KDA is the delta rule of :mod:`specdec.kernels.gdn.triton_step` with ``g [B, T, H, K]``; the
same kernel compiles a per-channel variant (``PER_CHANNEL``), chosen from the gate's shape. This
module only names the KDA entry points; see the GDN module for shapes, errors and the algorithm.
"""

from __future__ import annotations

from ..gdn.triton_step import (
    DeltaRuleKernels,
    delta_rule_replay_commit,
    delta_rule_replay_fold,
    delta_rule_replay_verify,
    delta_rule_ring_verify,
    delta_rule_snapshot_verify,
    delta_rule_update,
)
from ..protocol import LaunchConfig

__all__ = [
    "KDAKernels",
    "kda_update",
    "kda_snapshot_verify",
    "kda_ring_verify",
    "kda_replay_verify",
    "kda_replay_fold",
    "kda_replay_commit",
]

kda_update = delta_rule_update
kda_snapshot_verify = delta_rule_snapshot_verify
kda_ring_verify = delta_rule_ring_verify
kda_replay_verify = delta_rule_replay_verify
kda_replay_fold = delta_rule_replay_fold
kda_replay_commit = delta_rule_replay_commit


class KDAKernels(DeltaRuleKernels):
    """The ``op.kernels`` of the KDA op (gate ``g [B, T, H, K]``; others raise ValueError)."""

    def __init__(self, launch: LaunchConfig = LaunchConfig()):
        super().__init__(per_channel=True, launch=launch)
