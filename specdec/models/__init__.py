"""One adapter per Hugging Face hybrid family (see :mod:`specdec.models.base`)."""

from . import (  # noqa: F401  (registers the adapters)
    attention,
    falcon_h1,
    gdn,
    kimi_linear,
    lfm2,
    mamba2,
    nemotron_h,
    olmo_hybrid,
    qwen3_5_moe,
    zamba2,
)
from .base import ADAPTERS, HybridAdapter, adapter_for, supported_families

__all__ = ["ADAPTERS", "HybridAdapter", "adapter_for", "supported_families"]
