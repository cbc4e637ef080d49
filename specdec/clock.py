"""Named phase times without host syncs: :class:`StepClock`.

The decode loop laps it after each phase of a step (``draft``, ``verify``, ``rollback``,
``bookkeeping``); :mod:`specdec.adaptive` times its calibration with it and reads each step's
laps once the step's own host sync has made them final.
"""

from __future__ import annotations

import time

import torch

__all__ = ["StepClock"]


class StepClock:
    """Named phase times without host syncs: CUDA events on CUDA (recorded on the stream current
    when the clock is made; each lap read once, when it is asked for), else
    ``time.perf_counter``. ``lap(phase)`` ends the running phase; :meth:`totals` sums each phase's
    laps in seconds; :meth:`laps` gives the laps between two marks."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        # (CUDA) marks are recorded on the stream current now, fetched once: each
        # torch.cuda.current_stream() call costs microseconds of host time, and a step laps 5-7 times
        self.stream = torch.cuda.current_stream(device) if self.cuda else None  #: (CUDA) where marks go
        self._marks: list = []
        self._phases: list = []
        self._ms: list[float | None] = []  # (CUDA) per mark, the milliseconds of the lap it ends, once read
        self.lap(None)

    def lap(self, phase) -> None:
        """End the running phase as ``phase`` (any hashable name) and start the next one."""
        if self.cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(self.stream)
            self._ms.append(None)
        else:
            mark = time.perf_counter()
        self._marks.append(mark)
        self._phases.append(phase)

    def relabel(self, mark: int, phase) -> None:
        """Count the lap that ended at mark ``mark`` (``marks - 1`` right after its :meth:`lap`)
        as ``phase`` instead."""
        self._phases[mark] = phase

    @property
    def marks(self) -> int:
        """Marks so far (the first is the clock's start); a lap adds one."""
        return len(self._marks)

    def laps(self, start: int = 0, end: int | None = None) -> list[tuple[object, float]]:
        """``[(phase, seconds)]`` of the laps ending at marks ``start + 1 .. end - 1`` (default:
        all). On CUDA every event of the range must have completed (e.g. after a host sync that
        followed the last of them): an event still queued raises instead of waiting."""
        end = len(self._marks) if end is None else end
        if self.cuda:  # (each lap read once: the windows of consecutive steps share their ends, totals all;
            ms, marks = self._ms, self._marks  # each lap on its own, as an offset from the first mark would lose
            for i in range(start + 1, end):    # microseconds in a float32 millisecond count after a minute)
                if ms[i] is None:
                    ms[i] = marks[i - 1].elapsed_time(marks[i])
            spans = [t / 1e3 for t in ms[start + 1:end]]
        else:
            marks = self._marks[start:end]
            spans = [b - a for a, b in zip(marks, marks[1:])]
        return list(zip(self._phases[start + 1:end], spans))

    def totals(self) -> dict:
        """``{phase: seconds}`` and ``"wall"`` (first mark to last); syncs the device first."""
        if self.cuda:
            torch.cuda.synchronize()
        laps = self.laps()
        out = {"wall": sum(span for _, span in laps)}
        for phase, span in laps:
            out[phase] = out.get(phase, 0.0) + span
        return out
