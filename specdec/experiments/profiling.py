"""Where a call's time goes: one call under ``torch.profiler`` (the ``profile`` option of
``experiment=bench`` and ``experiment=tree_verify``).

A call whose wall time is far above its GPU busy time (the summed kernel durations) is
host-bound; on the CUDA-graph path the two are close and the table names the kernels that
dominate. The device's timeline says where the rest goes (:func:`device_timeline`): the time
between the first kernel's start and the last one's end in which no kernel ran, split into
gaps of at least :data:`LONG_GAP_US` (the device waiting for the host: a sync, Python between
two launches) and the short ones between kernels of one launch sequence or graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .timing import sync

__all__ = ["Profile", "profile_call", "device_timeline", "LONG_GAP_US"]

#: idle gaps of the device at least this long (microseconds) count as waiting for the host: inside
#: a CUDA graph or a queue of launches, kernels follow each other within a few microseconds
LONG_GAP_US = 20.0


@dataclass(frozen=True)
class Profile:
    """One profiled call: ``host_ops`` (top-level ``aten::`` ops dispatched), ``host_ms`` (summed
    host self time, the profiler's overhead included), ``kernels`` (GPU kernels launched, torch's
    and Triton's), ``device_ms`` (summed kernel durations; None on CPU) and ``table`` (the top
    entries by GPU time on CUDA, by host time on CPU, as torch.profiler prints them);
    ``timeline``: :func:`device_timeline` of the kernels (None on CPU)."""

    host_ops: int
    host_ms: float
    kernels: int
    device_ms: float | None
    table: str
    timeline: dict | None = None

    def fields(self, per: int = 1) -> dict:
        """The counts for a record, divided by ``per`` (e.g. decode steps); the timeline's
        ``long_gaps`` / ``*_ms`` likewise (``idle_ms``: ``span_ms - busy_ms``)."""
        per = max(1, per)
        out = {"host_ops": self.host_ops / per, "host_ms": self.host_ms / per, "gpu_kernels": self.kernels / per,
               "device_ms": None if self.device_ms is None else self.device_ms / per}
        if self.timeline is not None:
            out.update({k: v / per for k, v in self.timeline.items()})
        return out


def device_timeline(intervals, long_gap_us: float = LONG_GAP_US) -> dict:
    """Where a device's time went between its first kernel's start and its last one's end.

    Args:
        intervals: ``(start, end)`` of each kernel in microseconds, any order (overlapping ones,
            e.g. on two streams, count once).
        long_gap_us: the shortest idle gap counted as waiting for the host.

    Returns:
        ``{"span_ms", "busy_ms" (the union of the intervals), "idle_ms" (span - busy),
        "long_gaps" (idle gaps of at least long_gap_us), "long_gap_ms" (their total)}``; all 0
        for no intervals (empty ones are dropped). Under ``torch.profiler`` with host activity
        recorded (:func:`profile_call`) the host runs slower than without, so its waits, the long
        gaps, come out longer than in an unprofiled run.

    Raises:
        ValueError: an interval that ends before it starts, or a negative ``long_gap_us``.
    """
    if long_gap_us < 0:
        raise ValueError(f"long_gap_us must be >= 0, got {long_gap_us}")
    spans = sorted((float(a), float(b)) for a, b in intervals)
    for a, b in spans:
        if not b >= a:  # (NaN fails too)
            raise ValueError(f"a kernel interval must end at or after its start, got ({a}, {b})")
    spans = [(a, b) for a, b in spans if b > a]  # (an empty interval does not split an idle gap)
    busy = idle_long = 0.0
    long_gaps = 0
    if spans:
        cur_a, cur_b = spans[0]
        for a, b in spans[1:]:
            if a > cur_b:  # an idle gap
                busy += cur_b - cur_a
                if a - cur_b >= long_gap_us:
                    long_gaps, idle_long = long_gaps + 1, idle_long + (a - cur_b)
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        busy += cur_b - cur_a
        span = max(b for _, b in spans) - spans[0][0]
    else:
        span = 0.0
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "long_gaps": long_gaps,
            "long_gap_ms": idle_long / 1e3}


def profile_call(fn: Callable[[], Any], device, top: int = 15) -> tuple[Profile, Any]:
    """Run ``fn()`` once under ``torch.profiler`` (CPU, and CUDA activity on a CUDA device),
    between two device syncs. Returns ``(Profile, fn's result)``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=acts) as prof:
        out = fn()
        sync(device)
    events = prof.events()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None
            and e.name.startswith("aten::")]
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    return Profile(
        host_ops=len(host),
        host_ms=sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU) / 1e3,
        kernels=len(gpu),
        device_ms=sum(e.time_range.elapsed_us() for e in gpu) / 1e3 if cuda else None,
        table=prof.key_averages().table(sort_by=sort, row_limit=top),
        timeline=device_timeline((e.time_range.start, e.time_range.end) for e in gpu) if cuda else None,
    ), out
