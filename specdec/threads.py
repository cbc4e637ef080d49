"""CPU thread count for decoding: a sensible torch intra-op thread count for a model on CPU.

Decoding a small model on CPU runs many tiny matrix products per token; each one wakes every
torch (OpenMP) thread, and when a core is busy with another process the threads wait for each
other at every op. On a 2-core machine with one core busy, the zoo's 4.4M-parameter
``gdn-target`` generated 128 tokens in 28.7 s with torch's default 2 threads and in 0.94 s with
one. :func:`configure_cpu_threads` picks the count for such models and never overrides a count
the user chose.

Example::

    from specdec.threads import configure_cpu_threads
    choice = configure_cpu_threads(model)   # ThreadChoice(threads=1, source="chosen", ...)
    print(choice.describe())
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch

from .placement import execution_device

__all__ = ["ThreadChoice", "configure_cpu_threads", "available_cpus", "free_cpus", "SMALL_MODEL_PARAMETERS",
           "THREAD_ENV_VARS"]

logger = logging.getLogger(__name__)

#: below this many parameters a model decodes fastest on one CPU thread (per-op thread
#: synchronisation costs more than the split work saves)
SMALL_MODEL_PARAMETERS = 100_000_000
#: environment variables through which a user sets the thread count torch starts with
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_set_by_us: int | None = None


@dataclass(frozen=True)
class ThreadChoice:
    """What :func:`configure_cpu_threads` did.

    threads: torch's intra-op thread count in effect afterwards. source: ``"argument"`` (the
    ``threads`` argument), ``"OMP_NUM_THREADS"`` / ``"MKL_NUM_THREADS"`` (set in the
    environment), ``"torch.set_num_threads"`` (the user set a count in this process), ``"chosen"``
    (this function set it), ``"default"`` (torch's default kept) or ``"not on CPU"``.
    reason: one phrase saying why.
    """

    threads: int
    source: str
    reason: str

    def describe(self) -> str:
        """One line, e.g. ``CPU threads: 1 (chosen: 4.4M parameters, small model)``."""
        return f"CPU threads: {self.threads} ({self.source}: {self.reason})"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_cpus() -> int:
    """CPUs not busy with other work: available CPUs minus the 1-minute load average, at least 1
    (the load average counts runnable processes machine-wide; where it is unknown, all CPUs)."""
    n = available_cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return n
    return max(1, min(n, int(n - load + 0.5)))


def _parameters(model) -> int | None:
    if model is None:
        return None
    try:
        return sum(p.numel() for p in model.parameters())
    except (AttributeError, TypeError):
        return None


def _device_type(model, device) -> str:
    if device is not None:
        return torch.device(device).type
    if isinstance(model, torch.nn.Module):
        dev = execution_device(model)  # (not the first parameter's: on meta when accelerate offloads it)
        if dev is not None:
            return dev.type
    return "cpu"


def _user_source() -> str | None:
    """Where the user set the count, if they did: an environment variable, or a count set with
    ``torch.set_num_threads`` (torch's count differs from what this module set, or, before it
    set any, from torch's default: the available CPUs)."""
    for var in THREAD_ENV_VARS:
        if os.environ.get(var, "").strip():
            return var
    current = torch.get_num_threads()
    if _set_by_us is not None:  # changed since this module set it: the user's
        return None if current == _set_by_us else "torch.set_num_threads"
    return "torch.set_num_threads" if current != available_cpus() else None


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def configure_cpu_threads(model=None, threads: int | None = None, *, device=None,
                          num_parameters: int | None = None) -> ThreadChoice:
    """Pick torch's intra-op thread count for decoding ``model`` on CPU, unless the user chose one.

    Rules, in order:

    1. Not on CPU (``device``, else where the model computes: its accelerate hook's execution
       device, else its first weight not on ``meta``; :func:`specdec.placement.execution_device`):
       nothing changes.
    2. ``threads`` given: ``torch.set_num_threads(threads)`` (the caller's explicit choice).
    3. The user chose a count: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` set, or
       ``torch.set_num_threads`` called with a count other than torch's default (the CPUs
       available to the process): kept. If the model is small (below
       :data:`SMALL_MODEL_PARAMETERS`) and the count exceeds the free CPUs (:func:`free_cpus`),
       a ``UserWarning`` says it is likely slow.
    4. Otherwise a small model gets 1 thread; a larger one ``min(torch's count, free CPUs)``.

    Args:
        model: a torch module (its parameters give the size and the device), or None.
        threads: an explicit count (>= 1), or None to choose.
        device: the device decoding runs on; default the model's (as in rule 1).
        num_parameters: the model size when no model is given (default: counted from ``model``;
            unknown counts as small).

    Returns:
        :class:`ThreadChoice`; its :meth:`~ThreadChoice.describe` line is also logged (INFO) on
        the ``specdec.threads`` logger.

    Raises:
        ValueError: ``threads`` < 1.
    """
    global _set_by_us
    if threads is not None and int(threads) < 1:
        raise ValueError(f"threads must be >= 1 or None, got {threads}")
    if _device_type(model, device) != "cpu":
        choice = ThreadChoice(torch.get_num_threads(), "not on CPU", "torch threads left as they are")
        logger.info(choice.describe())
        return choice
    n_params = num_parameters if num_parameters is not None else _parameters(model)
    small = n_params is None or n_params < SMALL_MODEL_PARAMETERS
    size = "size unknown" if n_params is None else f"{_fmt_params(n_params)} parameters"
    free = free_cpus()
    if threads is not None:
        torch.set_num_threads(int(threads))
        _set_by_us = int(threads)
        choice = ThreadChoice(int(threads), "argument", "set as asked")
    elif (source := _user_source()) is not None:
        current = torch.get_num_threads()
        choice = ThreadChoice(current, source, "the user's count, kept")
        if small and current > free:
            warnings.warn(f"torch uses {current} CPU threads ({source}) for a small model ({size}) with {free} free "
                          f"CPU(s): decoding is likely slow; 1 thread is usually fastest for such models "
                          "(OMP_NUM_THREADS=1 or torch.set_num_threads(1))", UserWarning, stacklevel=2)
    else:
        want = 1 if small else max(1, min(torch.get_num_threads(), free))
        if want == torch.get_num_threads() and want == available_cpus():
            choice = ThreadChoice(want, "default", f"{size}, {free} free of {available_cpus()} CPUs")
        else:
            torch.set_num_threads(want)
            _set_by_us = want
            why = "small model" if small else f"{free} free of {available_cpus()} CPUs"
            choice = ThreadChoice(want, "chosen", f"{size}, {why}")
    logger.info(choice.describe())
    return choice
