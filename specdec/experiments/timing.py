"""Wall-clock timing for every experiment and benchmark: repeat, sync the device, median + spread.

A figure is reported as the median over ``repeats`` timed runs with its spread, the minimum
and maximum of the runs (:class:`Timing`). Two figures whose min-max ranges overlap are not
told apart by the measurement (:func:`overlaps`): the reports flag such differences as within
the noise instead of calling one faster.

Example::

    from specdec.experiments.timing import time_runs
    t, out = time_runs(lambda: sd.generate(**enc, max_new_tokens=64), repeats=3, device=device)
    t.median, t.low, t.high          # seconds
    t.rate(64)                       # tokens/s: a Timing of units per second (median, low, high)

A speedup measured side by side (:func:`time_side_by_side`: every round runs each way once) is
the ratio of two figures round by round (:func:`paired_ratio`): a slow phase of a shared
machine slows both runs of a round, so the per-round ratios scatter less than the figures
themselves, and their min-max is the speedup's spread (:func:`spans_one`: does it include 1?).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Timing", "sync", "time_runs", "time_side_by_side", "overlaps", "paired_ratio", "spans_one", "SPREAD"]

#: how every report states the spread of a figure
SPREAD = "median of the repeats (min-max)"


def sync(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one figure: ``samples`` (in run order), their ``median``, and the
    spread ``low`` = min, ``high`` = max. Units are the caller's (seconds for :func:`time_runs`)."""

    samples: tuple[float, ...]

    def __post_init__(self):
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))

    @property
    def low(self) -> float:
        return float(min(self.samples))

    @property
    def high(self) -> float:
        return float(max(self.samples))

    @property
    def repeats(self) -> int:
        return len(self.samples)

    def scaled(self, factor: float) -> "Timing":
        """Every sample times ``factor`` (e.g. milliseconds from seconds: ``scaled(1e3)``)."""
        return Timing(tuple(factor * s for s in self.samples))

    def rate(self, units: float) -> "Timing":
        """``units`` per sample (e.g. tokens per second from seconds); a zero time gives 0."""
        return Timing(tuple(units / s if s > 0 else 0.0 for s in self.samples))

    def fields(self, name: str) -> dict:
        """``{name: median, name_min: low, name_max: high}`` for a record."""
        return {name: self.median, f"{name}_min": self.low, f"{name}_max": self.high}


def overlaps(a: Timing, b: Timing) -> bool | None:
    """True when the min-max ranges of ``a`` and ``b`` overlap: their difference is within the
    noise of the measurement; None when either has a single sample (no spread to judge by)."""
    if a.repeats < 2 or b.repeats < 2:
        return None
    return a.low <= b.high and b.low <= a.high


def paired_ratio(a: Timing, b: Timing) -> Timing:
    """``a / b`` round by round (``a.samples[i] / b.samples[i]``; 0 where ``b``'s sample is 0), for
    figures measured side by side in the same rounds (:func:`time_side_by_side`): e.g. speedup =
    ``paired_ratio(tokens_per_s, plain_tokens_per_s)``.

    Raises: ValueError when ``a`` and ``b`` have different numbers of samples.
    """
    if a.repeats != b.repeats:
        raise ValueError(f"a paired ratio needs the same rounds; got {a.repeats} and {b.repeats} samples")
    return Timing(tuple(x / y if y else 0.0 for x, y in zip(a.samples, b.samples)))


def spans_one(ratio: Timing) -> bool | None:
    """True when the min-max range of a ratio includes 1: the two ways measured are not told apart
    (within the noise); None for a single sample (no spread to judge by)."""
    if ratio.repeats < 2:
        return None
    return ratio.low <= 1.0 <= ratio.high


def time_runs(fn: Callable[[], Any], repeats: int, device: torch.device | str | None = None,
              warmup: int = 0) -> tuple[Timing, Any]:
    """Run ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed, each timed run
    between two device syncs (:func:`sync`). Returns ``(Timing of seconds, last result)``.

    Raises: ValueError for ``repeats < 1`` or ``warmup < 0``.
    """
    return time_side_by_side({"": fn}, repeats, device, warmup)[""]


def time_side_by_side(fns: dict[str, Callable[[], Any]], repeats: int, device: torch.device | str | None = None,
                      warmup: int = 0) -> dict[str, tuple[Timing, Any]]:
    """Time several ways of doing one thing side by side: each of ``repeats`` rounds runs every
    function once, so a slow phase of a shared machine hits them all alike; round r starts at the
    r-th function (the order rotates), so no function always runs first, right after the host's
    work between rounds. ``warmup`` untimed rounds first, in the given order. Returns
    ``{name: (Timing of seconds, the result of its last timed call)}``.

    Raises: ValueError for ``repeats < 1``, ``warmup < 0`` or no functions.
    """
    if repeats < 1 or warmup < 0 or not fns:
        raise ValueError(f"repeats must be >= 1, warmup >= 0 and fns not empty; got repeats={repeats}, "
                         f"warmup={warmup}, {len(fns)} functions")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    last: dict[str, Any] = {}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            sync(device)
            t0 = time.perf_counter()
            last[name] = fn()
            sync(device)
            samples[name].append(time.perf_counter() - t0)
    return {name: (Timing(tuple(samples[name])), last[name]) for name in fns}
