"""specdec: exact speculative decoding for hybrid (attention + SSM) language models.

Public API::

    import specdec
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=4)
    out = sd.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    sd.last_stats  # specdec.Stats
"""

from __future__ import annotations

from . import drafters, models, rollback
from .engine import SpeculativeGenerator, Stats
from .hf_integration import enable_hf_speculation

__all__ = [
    "wrap", "enable_hf_speculation", "Stats", "SpeculativeGenerator", "drafters", "rollback", "models", "zoo",
    "__version__",
]
__version__ = "0.1.0"
version = __version__


def wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens: int = 4,
         decode_path: str = "auto") -> SpeculativeGenerator:
    """Wrap a loaded Hugging Face hybrid causal LM for speculative decoding.

    Args:
        model: e.g. ``Qwen3_5ForCausalLM``, ``Qwen3NextForCausalLM``, ``NemotronHForCausalLM``,
            ``KimiLinearForCausalLM`` (weights are used in place, never copied).
        drafter: ``"ngram"``, ``"mtp"`` (the model's own multi-token-prediction layers, read from the
            checkpoint it was loaded from) or a :mod:`specdec.drafters` instance (``DraftModelDrafter(draft)``, ...).
        rollback: ``"snapshot"``, ``"ring"`` or ``"replay"`` (``specdec.rollback.STRATEGIES``), ``"replay_deferred"``
            (replay folding only when its history would overflow), or an instance.
        num_speculative_tokens: K in ``[0, specdec.engine.MAX_SPECULATIVE_TOKENS]`` (0: plain decoding
            through the same engine, for baselines).
        decode_path: ``"auto"`` (CUDA graphs on CUDA when the call allows, else eager), ``"eager"``,
            ``"static"`` or ``"cuda_graph"`` (see :class:`SpeculativeGenerator`).

    Returns:
        A :class:`SpeculativeGenerator` with ``.generate(...)`` and ``.last_stats``.

    Raises:
        TypeError, ValueError: see :class:`SpeculativeGenerator`.
    """
    return SpeculativeGenerator(model, drafter=drafter, rollback=rollback, num_speculative_tokens=num_speculative_tokens,
                                decode_path=decode_path)


def __getattr__(name):
    if name == "zoo":  # lazy: loading the zoo module needs no weights, but keep import light
        import importlib

        return importlib.import_module(".zoo", __name__)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
