"""Where a call's time goes: one call under ``torch.profiler`` (the ``profile`` option of
``experiment=bench`` and ``experiment=tree_verify``).

A call whose wall time is far above its GPU busy time (the summed kernel durations) is
host-bound; on the CUDA-graph path the two are close and the table names the kernels that
dominate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .timing import sync

__all__ = ["Profile", "profile_call"]


@dataclass(frozen=True)
class Profile:
    """One profiled call: ``host_ops`` (top-level ``aten::`` ops dispatched), ``host_ms`` (summed
    host self time, the profiler's overhead included), ``kernels`` (GPU kernels launched, torch's
    and Triton's), ``device_ms`` (summed kernel durations; None on CPU) and ``table`` (the top
    entries by GPU time on CUDA, by host time on CPU, as torch.profiler prints them)."""

    host_ops: int
    host_ms: float
    kernels: int
    device_ms: float | None
    table: str

    def fields(self, per: int = 1) -> dict:
        """The counts for a record, divided by ``per`` (e.g. decode steps)."""
        per = max(1, per)
        return {"host_ops": self.host_ops / per, "host_ms": self.host_ms / per, "gpu_kernels": self.kernels / per,
                "device_ms": None if self.device_ms is None else self.device_ms / per}


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
    ), out
