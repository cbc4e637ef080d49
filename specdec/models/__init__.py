"""One adapter per Hugging Face hybrid family (see :mod:`specdec.models.base`)."""

from . import gdn, kimi_linear, nemotron_h  # noqa: F401  (registers the adapters)
from .base import ADAPTERS, HybridAdapter, adapter_for, supported_families

__all__ = ["ADAPTERS", "HybridAdapter", "adapter_for", "supported_families"]
