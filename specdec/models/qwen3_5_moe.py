"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``): Qwen3.5's GDN + gated attention layers with MoE MLPs.

Its GDN mixer is Qwen3.5's (same projections, same decode step), so the adapter is Qwen3.5's
(:class:`specdec.models.gdn.Qwen35Adapter`); only the registered ``model_type`` differs.
"""

from __future__ import annotations

from .base import register
from .gdn import Qwen35Adapter

__all__ = ["Qwen35MoeAdapter"]


@register
class Qwen35MoeAdapter(Qwen35Adapter):
    """Qwen3.5-MoE text models."""

    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
