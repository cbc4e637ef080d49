"""Quiet model loading and decoding on CPU: transformers' notes about GPU-only fast paths and
its weight-loading progress bars, switched off locally.

On CPU, transformers' hybrid models note once per kernel that ``causal_conv1d``,
``flash-linear-attention`` or ``mamba_ssm`` is not installed and the torch reference runs
instead. Those packages are CUDA kernels: a CPU user cannot act on the note. Inside
:func:`quiet_transformers` on a CPU device exactly those records are dropped (a filter on the
one transformers logger that emits them, removed on exit; transformers emits each note once
per process, so a note dropped here stays unshown) and transformers' progress bars are off, so
the caller's own bar is the only one.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager

import torch

__all__ = ["quiet_transformers", "GPU_ONLY_PACKAGES", "FALLBACK_LOGGER"]

#: CUDA kernel packages whose absence transformers notes; irrelevant on CPU
GPU_ONLY_PACKAGES = ("causal_conv1d", "causal-conv1d", "flash-linear-attention", "fla", "mamba_ssm", "mamba-ssm")
#: the transformers logger that emits the fallback notes
FALLBACK_LOGGER = "transformers.integrations.hub_kernels"

#: the note, as transformers 5.17 ("... `pkg` is not installed") and 5.25 ("... `pkg` is either not
#: installed or doesn't support the device of the inputs") word it
_NOTE = re.compile(r"falling back to its reference PyTorch implementation because `(?P<pkg>[^`]+)` is (either )?not "
                   r"installed")


class _GPUOnlyFallbackFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        m = _NOTE.search(record.getMessage())
        return not (m and m.group("pkg") in GPU_ONLY_PACKAGES)


@contextmanager
def quiet_transformers(device: torch.device | str | None = "cpu"):
    """Within the block: on a CPU ``device`` (None counts as CPU), transformers' notes that a
    GPU-only kernel package is missing are dropped; on any device, transformers' progress bars
    (``Loading weights``) are off. Both are restored on exit; other log records pass."""
    from transformers.utils import logging as hf_logging

    cpu = device is None or torch.device(device).type == "cpu"
    note_logger = logging.getLogger(FALLBACK_LOGGER)
    filt = _GPUOnlyFallbackFilter()
    bars = hf_logging.is_progress_bar_enabled()
    if cpu:
        note_logger.addFilter(filt)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if cpu:
            note_logger.removeFilter(filt)
        if bars:
            hf_logging.enable_progress_bar()
