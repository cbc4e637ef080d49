"""specdec: exact speculative decoding for hybrid (attention + SSM) language models.

Public API::

    import specdec
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=4)
    out = sd.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    sd.last_stats  # specdec.Stats
    sd = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens="auto")  # measured choices
    out = sd.generate_batch(list_of_prompts, max_new_tokens=64, max_batch_size="auto")  # continuous batching
    with sd.init_continuous_batching(max_length=512) as manager:  # specdec.ContinuousBatchingManager
        rid = manager.add_request(prompt_ids)
        result = manager.get_result(rid)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import adaptive, batching, drafters, models, rollback, serving, zoo
    from .engine import SpeculativeGenerator
    from .serving import ContinuousBatchingManager
    from .stats import Stats
    from .hf_integration import enable_hf_speculation

#: public names -> the submodule that defines them; imported on first use, so that
#: ``import specdec.experiments.cli`` (``specdec-run --help``) does not import torch
_LAZY = {
    "adaptive": None, "batching": None, "drafters": None, "models": None, "rollback": None, "serving": None,
    "zoo": None, "SpeculativeGenerator": "engine", "Stats": "stats", "enable_hf_speculation": "hf_integration",
    "ContinuousBatchingManager": "serving",
}

__all__ = [
    "wrap", "enable_hf_speculation", "Stats", "SpeculativeGenerator", "ContinuousBatchingManager", "adaptive",
    "batching", "drafters", "rollback", "models", "serving", "zoo",
    "__version__",
]
__version__ = "0.1.0"
version = __version__


def wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens: int | str = 4,
         decode_path: str = "auto", max_speculative_tokens: int = 8, cost_model=None,
         policy=None) -> SpeculativeGenerator:
    """Wrap a loaded Hugging Face hybrid causal LM for speculative decoding.

    Args:
        model: e.g. ``Qwen3_5ForCausalLM``, ``Qwen3NextForCausalLM``, ``NemotronHForCausalLM``,
            ``KimiLinearForCausalLM`` (weights are used in place, never copied).
        drafter: ``"ngram"``, ``"mtp"`` (the model's own multi-token-prediction layers, read from the
            checkpoint it was loaded from) or a :mod:`specdec.drafters` instance (``DraftModelDrafter(draft)``, ...).
        rollback: ``"snapshot"``, ``"ring"`` or ``"replay"`` (``specdec.rollback.STRATEGIES``), ``"replay_deferred"``
            (replay folding only when its history would overflow), an instance, or ``"auto"`` (per call,
            the strategy with the best measured cost that fits the memory budget; :mod:`specdec.adaptive`).
        num_speculative_tokens: K in ``[0, specdec.engine.MAX_SPECULATIVE_TOKENS]`` (0: plain decoding
            through the same engine, for baselines), or ``"auto"``: K chosen per step in
            ``[0, max_speculative_tokens]`` from measured costs and observed acceptance.
        decode_path: ``"auto"`` (CUDA graphs on CUDA when the call allows, else eager), ``"eager"``,
            ``"static"`` or ``"cuda_graph"`` (see :class:`SpeculativeGenerator`).
        max_speculative_tokens: the largest K ``"auto"`` may choose (>= 1).
        cost_model: a :class:`specdec.adaptive.CostModel` for the ``"auto"`` choices (default: measured
            on the device); policy: their :class:`specdec.adaptive.PolicySettings`.

    Returns:
        A :class:`SpeculativeGenerator` with ``.generate(...)`` and ``.last_stats``.

    On CPU (where the model computes: for a model dispatched by accelerate, its execution device,
    whatever device its offloaded weights are on), a model too small to gain from intra-op threads
    gets one torch thread unless you chose a count (``OMP_NUM_THREADS``, ``torch.set_num_threads``):
    see :func:`specdec.threads.configure_cpu_threads` (logged on the ``specdec.threads`` logger).

    Raises:
        TypeError, ValueError: see :class:`SpeculativeGenerator`.
    """
    from .engine import SpeculativeGenerator
    from .threads import configure_cpu_threads

    sd = SpeculativeGenerator(model, drafter=drafter, rollback=rollback, num_speculative_tokens=num_speculative_tokens,
                              decode_path=decode_path, max_speculative_tokens=max_speculative_tokens,
                              cost_model=cost_model, policy=policy)
    place = sd.adapter.placement  # (offloaded weights: on meta; layers computing on the CPU: CPU threads matter)
    configure_cpu_threads(model, device=next((d for d in place.devices if d.type == "cpu"), place.home))
    return sd


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
