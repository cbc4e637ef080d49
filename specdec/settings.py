"""Hugging Face ``generate()`` arguments, resolved once per call into :class:`GenerationSettings`.

:func:`resolve` checks every argument before any work (a bad one raises ``TypeError`` /
``ValueError`` naming what is wrong and what is accepted), merges the model's
``generation_config`` with the call's own settings as HF does, and returns one frozen object
that the decode loop reads. Nothing downstream sees an untyped option dict.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from dataclasses import dataclass

import torch

from .verify import SamplingConfig

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "GenerationSettings", "SUPPORTED_SETTINGS", "context_length", "default_budget",
           "resolve"]

#: a setting off at None that a config may also hold empty or zeroed: these leave it off too
_UNSET = (None, 0, 1.0, [], False)
#: a setting that acts at any value but None (a token id; ``top_h``, a guidance scale but 1)
_NONE = (None,)

#: generation settings this engine does not implement: attribute -> the values that leave it off
#: besides None (unset), its default first (a bool is only a bool: ``num_beams=True`` is not 1;
#: :func:`_is_off`)
_UNSUPPORTED = {
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "num_return_sequences": (1,),
    "penalty_alpha": _UNSET,
    "encoder_repetition_penalty": (1.0,),
    "encoder_no_repeat_ngram_size": (0, False),
    "no_repeat_ngram_size": (0, False),
    "bad_words_ids": _UNSET,
    "force_words_ids": _UNSET,
    "constraints": _UNSET,
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0, False),
    "eta_cutoff": (0.0, False),
    "min_p": (None, 0, False),  # (1.0 keeps the top token only)
    "top_h": _NONE,
    "diversity_penalty": (0.0, False),
    "forced_bos_token_id": _NONE,
    "forced_eos_token_id": _NONE,
    "suppress_tokens": _UNSET,
    "begin_suppress_tokens": _UNSET,
    "sequence_bias": _UNSET,
    "exponential_decay_length_penalty": _UNSET,
    "renormalize_logits": (False, 0),
    "remove_invalid_values": (False, 0),
    "guidance_scale": (None, 1),  # (transformers guides at any other scale, 0 included)
    "watermarking_config": _UNSET,
    "stop_strings": _UNSET,
    "token_healing": (False, 0),
    "dola_layers": _UNSET,
    "prefill_chunk_size": _UNSET,
    "assistant_model": _UNSET,
    "prompt_lookup_num_tokens": _UNSET,
    "output_attentions": (False, 0),
    "output_hidden_states": (False, 0),
}


def _is_off(value, offs: tuple) -> bool:
    """Whether an unsupported setting's ``value`` leaves it off: None (unset: transformers'
    default applies), or one of ``offs`` (:data:`_UNSUPPORTED`), a bool only where a bool is
    listed."""
    return value is None or any(isinstance(value, bool) == isinstance(o, bool) and value == o for o in offs)


#: the ``GenerationConfig`` settings ``generate()`` implements (for error messages and docs)
#: the GenerationConfig settings ``generate()`` takes, each with its name in ``generate_batch()``'s
#: list (None: refused there: it acts per token of a row, or per call)
_SETTINGS = (("max_new_tokens/max_length", "max_new_tokens"), ("min_new_tokens/min_length", None),
             ("do_sample", "do_sample"), ("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
             ("repetition_penalty", None), ("eos_token_id (int or list)", "eos_token_id (int or list)"),
             ("pad_token_id", "pad_token_id"), ("max_time", None), ("return_dict_in_generate", None),
             ("output_scores", None), ("output_logits", None))
SUPPORTED_SETTINGS = ", ".join(name for name, _ in _SETTINGS)


def _supported(batch: bool) -> str:
    """:data:`SUPPORTED_SETTINGS` as ``generate()`` (``batch`` False) or ``generate_batch()`` takes them."""
    return ", ".join(in_batch for _, in_batch in _SETTINGS if in_batch) if batch else SUPPORTED_SETTINGS


_ARGUMENTS = ("input_ids, attention_mask, max_new_tokens, max_length, do_sample, temperature, top_k, top_p, "
              "eos_token_id, pad_token_id, generator, generation_config, streamer, stopping_criteria")


@dataclass(frozen=True, eq=False)
class GenerationSettings:
    """One ``generate()`` call's settings, checked and resolved.

    Attributes:
        input_ids: ``[B, L]`` int64 left-padded prompts on the model's device.
        attention_mask: ``[B, L]`` int64, 0 = padding (left), 1 = token.
        max_new_tokens: new tokens per row (>= 0); with ``row_budgets``, the largest of them.
        row_budgets: each row's own budget ``(B,)`` when ``max_new_tokens`` was given per row
            (a row ends at its budget as at EOS), else None.
        sampling: the sampling settings, or None for greedy decoding.
        eos_token_ids: the EOS ids (empty: no EOS).
        pad_token_id: the id that fills rows that stopped early.
        generator: the ``torch.Generator`` for sampling, or None.
        streamer: an HF streamer (batch 1), or None.
        stopping_criteria: an HF ``StoppingCriteriaList`` (``max_time`` included), or None.
        repetition_penalty: HF's repetition penalty, None when off (1.0).
        min_new_tokens, min_length: HF's EOS suppression bounds (0 when off).
        return_dict: return HF's ``GenerateDecoderOnlyOutput``; output_scores / output_logits:
            with it, the processed / raw scores of every new token.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    sampling: SamplingConfig | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    row_budgets: tuple[int, ...] | None = None
    generator: torch.Generator | None = None
    streamer: object | None = None
    stopping_criteria: object | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int = 0
    min_length: int = 0
    return_dict: bool = False
    output_scores: bool = False
    output_logits: bool = False

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor changes the target's distribution (repetition penalty, or EOS
        suppressed by a minimum length)."""
        eos_rule = bool(self.eos_token_ids) and (self.min_new_tokens > 0 or self.min_length > 0)
        return self.repetition_penalty is not None or eos_rule

    @property
    def per_token_features(self) -> list[str]:
        """The settings that need the decode loop's per-step hook (host-side work after each
        step), by their user-facing names."""
        out = []
        if self.stopping_criteria is not None:
            out.append("stopping_criteria / max_time")
        if self.processes_logits:
            out.append("repetition_penalty / min_new_tokens / min_length")
        if self.output_scores or self.output_logits:
            out.append("output_scores / output_logits")
        return out


def _as_id_list(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    if isinstance(eos, numbers.Integral) and not isinstance(eos, bool):
        return (int(eos),)
    if isinstance(eos, (list, tuple)) and all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in eos):
        return tuple(int(e) for e in eos)
    raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


#: new tokens where no length is set anywhere (the call, its generation config, the model's), as
#: in transformers; shortened to what fits the context (:func:`default_budget`)
DEFAULT_MAX_NEW_TOKENS = 20


def default_budget(prompt_width: int, *limits: int | None, most: int | None = DEFAULT_MAX_NEW_TOKENS) -> int:
    """``most`` new tokens (default :data:`DEFAULT_MAX_NEW_TOKENS`; None: no bound of its own),
    shortened so that ``prompt_width`` + the new tokens fit every limit on a request's length
    given (prompt + new tokens, e.g. the model's context; None: no limit); at least 0."""
    room = [limit - prompt_width for limit in limits if limit is not None]
    return max(0, min(room + ([] if most is None else [most])))


def context_length(model) -> int | None:
    """The positions ``model`` (an HF model) was built for: ``config.max_position_embeddings``, or
    None when its config has none (no bound). ``generate()`` warns beyond it, ``generate_batch()``
    and a serving manager refuse a request that would pass it, and the acceptance, bench (and
    long_run), rollback, adaptive and checks experiments refuse a run that would, before any
    generation."""
    return getattr(model.config, "max_position_embeddings", None)


def warn_caller(message: str, category=UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside specdec and torch (whose
    ``no_grad`` wrappers add frames): the user's line that made the call."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def is_array(value) -> bool:
    """Whether ``value`` is a torch tensor or a NumPy array or scalar (without importing NumPy)."""
    return isinstance(value, torch.Tensor) or type(value).__module__ == "numpy"


def as_budgets(value):
    """``max_new_tokens`` as plain Python: a tensor or NumPy array of one or more budgets as a list
    of ints (a 0-d one, or a NumPy integer, as an int); anything else unchanged.

    Raises: ValueError for an array of more than one dimension."""
    if is_array(value):
        if getattr(value, "ndim", 0) > 1:
            raise ValueError(f"max_new_tokens must be one int or one per row / request, got an array of shape "
                             f"{tuple(value.shape)}")
        return value.tolist()
    return value


def _in_vocabulary(name: str, ids: tuple[int, ...], vocab_size: int, given: bool, why: str,
                   instead: str) -> tuple[int, ...]:
    """The ids of the token setting ``name`` (``eos_token_id``, ``pad_token_id``) a step or an
    output can use: those in ``[0, vocab_size)``. An id outside it (``why``: what it would do
    wrong) given on the call (or in its ``generation_config``) is an error; inherited from the
    model's ``generation_config`` it is dropped with a warning (``instead``: what is used then,
    where no id is left; else the warning names the ids kept; a model built from a larger config's defaults keeps such ids), also when a
    ``generation_config`` passed on the call repeats them.

    Raises: ValueError for a given id outside the vocabulary."""
    outside = [e for e in ids if not 0 <= e < vocab_size]
    if not outside:
        return ids
    what = f"{name} {outside[0] if len(outside) == 1 else outside} lies outside the vocabulary [0, {vocab_size})"
    if given:
        raise ValueError(f"{what}: {why}; give ids in that range, or None ({instead})")
    kept = tuple(e for e in ids if 0 <= e < vocab_size)
    after = f"the other {name} {list(kept)} still used" if kept else instead
    warn_caller(f"the model's generation_config {what}: {why}, so it is not used ({after})")
    return kept


def _count(gc, name: str) -> int:
    val = getattr(gc, name, None)
    if val is None:
        return 0
    if isinstance(val, bool) or not isinstance(val, int) or val < 0:
        raise ValueError(f"{name} must be an int >= 0, got {val!r}")
    return val


def _check_input_ids(input_ids, vocab_size: int, device) -> torch.Tensor:
    if isinstance(input_ids, list):
        raise TypeError("input_ids must be a torch.LongTensor [batch, length], got a list; use torch.tensor(...)")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor [batch, length], got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.is_meta:
        raise ValueError("input_ids is on the meta device (a shape without values); give the token ids on the CPU "
                         "or the model's device")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); give at least one prompt token")
    if bool(((input_ids < 0) | (input_ids >= vocab_size)).any()):
        raise ValueError(f"input_ids holds ids outside the vocabulary [0, {vocab_size})")
    return input_ids.to(device=device, dtype=torch.long)


def _check_mask(attention_mask, input_ids, pad, eos) -> torch.Tensor:
    if attention_mask is None:
        if not (pad is not None and pad not in eos and bool((input_ids == pad).any())):
            return torch.ones_like(input_ids)
        mask = (input_ids != pad).long()  # as HF: the mask a pad_token_id in the prompts implies
        if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask.sum(1) == 0).any()):
            row = int(((mask[:, 1:] < mask[:, :-1]).any(1) | (mask.sum(1) == 0)).nonzero()[0, 0])
            raise ValueError(f"row {row} of input_ids holds pad_token_id={pad} after a prompt token (right padding, "
                             "or the pad id inside the text) or only padding, and no attention_mask was given; "
                             "left-pad the prompts (padding_side='left') or pass their attention_mask")
        return mask
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of the same shape as input_ids {tuple(input_ids.shape)}, "
                         f"got {got}")
    mask = attention_mask.to(device=input_ids.device)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    mask = mask.long()
    if bool((mask.sum(1) == 0).any()):
        row = int((mask.sum(1) == 0).nonzero()[0, 0])
        raise ValueError(f"row {row} of the batch is all padding; every row needs at least one prompt token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask must be left-padded (zeros then ones in each row), as HF generate() "
                         "expects for decoder-only models")
    return mask


def _row_budgets(max_new_tokens, batch: int):
    """``max_new_tokens`` given per row (a list / tuple of ints, or a 1-D integer tensor) as a tuple
    of ``batch`` budgets; None for anything else (an int or None: checked with the config).

    Raises: ValueError / TypeError for a per-row budget of another length, a negative or a
        non-integer entry."""
    dtype = getattr(max_new_tokens, "dtype", None)
    if is_array(max_new_tokens) and str(dtype).split(".")[-1].startswith(("float", "bool")):
        raise TypeError(f"max_new_tokens per row must hold integers, got {dtype} values")
    max_new_tokens = as_budgets(max_new_tokens)
    if not isinstance(max_new_tokens, (list, tuple)):
        return None
    if len(max_new_tokens) != batch:
        raise ValueError(f"max_new_tokens per row needs one budget per row: got {len(max_new_tokens)} for a batch of "
                         f"{batch}")
    for b, n in enumerate(max_new_tokens):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"max_new_tokens[{b}] must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"max_new_tokens[{b}] must be >= 0, got {n}")
    return tuple(int(n) for n in max_new_tokens)


#: the settings whose library-wide default HF's generate() applies when neither the call nor the
#: model's generation_config sets them, and which change what specdec computes
_SAMPLING_DEFAULTS = ("temperature", "top_k", "top_p")


def _merged_config(given, model_config):
    """The call's settings as HF's ``generate()`` forms them: ``given`` (a ``GenerationConfig``, or
    None: a fresh one), each of its unset (None) fields taken from the model's
    ``generation_config``, then the sampling settings still unset from transformers' library-wide
    defaults (``top_k=50``: HF samples from the 50 most likely tokens unless told otherwise)."""
    from transformers import GenerationConfig

    gc = GenerationConfig.from_dict(given.to_dict()) if given is not None else GenerationConfig()
    if model_config is not None:
        for key, value in model_config.to_dict().items():
            if value is not None and hasattr(gc, key) and getattr(gc, key) is None:
                setattr(gc, key, value)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    # (transformers 5.17's; the values HF has applied since 4.x where a release does not say)
    defaults = defaults() if defaults is not None else {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    for key in _SAMPLING_DEFAULTS:
        if getattr(gc, key, None) is None and defaults.get(key) is not None:
            setattr(gc, key, defaults[key])
    return gc


def _max_new_tokens(gc, model, prompt_width: int) -> int:
    max_new = gc.max_new_tokens
    if max_new is None and gc.max_length is not None:
        if gc.max_length < prompt_width:
            raise ValueError(f"max_length={gc.max_length} is shorter than the prompt ({prompt_width} tokens); "
                             "set max_new_tokens instead")
        max_new = gc.max_length - prompt_width
    elif max_new is None:  # as HF: with no length set anywhere, 20 new tokens (fitting the context)
        max_new = default_budget(prompt_width, context_length(model))
    if isinstance(max_new, bool) or not isinstance(max_new, int):
        shape = f" of shape {tuple(max_new.shape)}" if isinstance(max_new, torch.Tensor) else ""
        raise TypeError(f"max_new_tokens must be an int, or one per row (a list of ints or a 1-D integer tensor), "
                        f"got {type(max_new).__name__}{shape}")
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")
    return max_new


def _stopping_criteria(criteria, max_time):
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    if criteria is None:
        out = StoppingCriteriaList()
    elif isinstance(criteria, StoppingCriteriaList) or (
        isinstance(criteria, (list, tuple)) and all(callable(c) for c in criteria)
    ):
        out = StoppingCriteriaList(list(criteria))
    elif callable(criteria):
        out = StoppingCriteriaList([criteria])
    else:
        raise TypeError(
            f"stopping_criteria must be a transformers.StoppingCriteriaList (or a list of criteria), "
            f"got {type(criteria).__name__}"
        )
    if max_time is not None:
        out.append(MaxTimeCriteria(max_time=max_time))
    return out if len(out) else None


def resolve(model, vocab_size: int, device, input_ids, attention_mask=None, generation_config=None, *,
            overrides: dict, streamer=None, stopping_criteria=None, generator=None,
            batch: bool = False, caller: str | None = None) -> GenerationSettings:
    """Check and resolve one ``generate()`` call's arguments.

    Args:
        model: the target HF model (its ``generation_config`` is the base, as in HF).
        vocab_size: the target's vocabulary size. device: the model's device.
        input_ids, attention_mask, generation_config, streamer, stopping_criteria, generator: as
            ``SpeculativeGenerator.generate`` takes them.
        overrides: the call's explicit settings and ``**kwargs`` (``GenerationConfig`` fields);
            None values mean "not given".
        batch: the call is ``generate_batch()``'s (its errors name it and list what it takes; it
            refuses the per-token settings after this).
        caller: the name errors give the call (default ``generate_batch()`` / ``generate()``), e.g.
            ``init_continuous_batching()``, which takes ``generate_batch()``'s settings.

    Returns: the :class:`GenerationSettings`.

    Raises:
        TypeError / ValueError: a bad argument or an unsupported setting (the message names it and
            what is supported).
    """
    from transformers import GenerationConfig

    config_fields = set(GenerationConfig().to_dict())
    known = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id",
             "max_length"}
    unknown = sorted(k for k in overrides if k not in known and (k not in config_fields or k.startswith("_")))
    caller = caller or ("generate_batch()" if batch else "generate()")
    if unknown:
        own = f"{caller}'s own parameters (generator= among them)" if batch else _ARGUMENTS
        raise ValueError(f"unsupported {caller} argument(s): {unknown}; supported: {own}, and the "
                         f"GenerationConfig settings {_supported(batch)}")
    input_ids = _check_input_ids(input_ids, vocab_size, device)

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers.GenerationConfig, got "
                        f"{type(generation_config).__name__}")
    gc = _merged_config(generation_config, getattr(model, "generation_config", None))
    row_budgets = _row_budgets(overrides.get("max_new_tokens"), input_ids.shape[0])
    if row_budgets is not None:
        overrides["max_new_tokens"] = max(row_budgets)
    elif overrides.get("max_new_tokens") is not None:  # one budget: a NumPy or 0-d tensor one as an int
        overrides["max_new_tokens"] = as_budgets(overrides["max_new_tokens"])
    for key, val in overrides.items():
        if val is not None:
            setattr(gc, key, val)
    for key, offs in _UNSUPPORTED.items():
        off, val = offs[0], getattr(gc, key, offs[0])
        if not _is_off(val, offs):
            source = ("the call's arguments" if overrides.get(key) is not None
                      else "the generation_config passed" if generation_config is not None
                      and getattr(generation_config, key, off) == val
                      else f"the model's generation_config: clear it there, model.generation_config.{key} = {off!r}")
            raise ValueError(f"unsupported generation setting {key}={val!r} (from {source}): specdec's {caller} "
                             "supports " + _supported(batch))
    if getattr(gc, "use_cache", True) in (False, 0):  # HF decodes without a cache then: same tokens, slower
        warn_caller("use_cache=False has no effect: specdec always decodes with its own cache (same output)")

    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = _in_vocabulary("eos_token_id", _as_id_list(gc.eos_token_id), vocab_size,
                         given=overrides.get("eos_token_id") is not None or (
                             generation_config is not None and _as_id_list(gc.eos_token_id) != _as_id_list(own)),
                         why="no step can produce it", instead="no EOS stops rows")
    pad = gc.pad_token_id
    if isinstance(pad, torch.Tensor) and pad.numel() == 1:
        pad = pad.item()
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, numbers.Integral)):
        raise ValueError(f"pad_token_id must be an int token id or None, got {pad!r}")
    if pad is not None:
        own_pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        pad = next(iter(_in_vocabulary(
            "pad_token_id", (int(pad),), vocab_size,
            given=overrides.get("pad_token_id") is not None or (generation_config is not None and pad != own_pad),
            why="it would fill the rows that stopped early, where a tokenizer cannot decode it",
            instead="the first EOS id, else 0, pads")), None)
    mask = _check_mask(attention_mask, input_ids, pad, eos)
    max_new = _max_new_tokens(gc, model, input_ids.shape[1])
    if row_budgets is not None and len(set(row_budgets)) > 1 and pad is None and not eos:
        raise ValueError(f"max_new_tokens per row {list(row_budgets)}: rows that reach a smaller budget are padded "
                         "up to the longest row, and no pad_token_id or eos_token_id is set (on the call or the "
                         "model's generation_config) to pad with; give pad_token_id")

    if type(gc.do_sample).__module__ == "numpy" and type(gc.do_sample).__name__ == "bool":  # NumPy's bool
        gc.do_sample = bool(gc.do_sample)
    if gc.do_sample is not None and not isinstance(gc.do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {gc.do_sample!r}")
    sampling = None
    if gc.do_sample:
        sampling = SamplingConfig(temperature=gc.temperature if gc.temperature is not None else 1.0,
                                  top_k=gc.top_k if gc.top_k else None, top_p=gc.top_p)
    elif gc.temperature is not None and gc.temperature != 1.0 and (
            overrides.get("temperature") is not None
            or getattr(generation_config, "temperature", None) not in (None, 1.0)):
        # as HF: sampling settings have no effect on greedy decoding; say so (for the call's own
        # setting: a checkpoint's generation_config often carries a temperature, and HF is silent then)
        warn_caller(f"temperature={gc.temperature!r} has no effect with do_sample=False (greedy)")
    if overrides.get("max_new_tokens") is not None and overrides.get("max_length") is not None:
        warn_caller(f"max_new_tokens={overrides['max_new_tokens']!r} and max_length={overrides['max_length']!r} both "
                    "given: max_new_tokens takes precedence (as in HF's generate())")
    if sampling is None:  # (the call's own top_k / top_p alone: a generation_config often carries them)
        given = [f"{k}={overrides[k]!r}" for k in ("top_k", "top_p") if overrides.get(k) is not None]
        if given:
            warn_caller(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with do_sample=False "
                        "(greedy)")

    min_new, min_len = _count(gc, "min_new_tokens"), _count(gc, "min_length")
    penalty = gc.repetition_penalty
    if penalty is not None:
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {penalty!r}")
        penalty = None if float(penalty) == 1.0 else float(penalty)
    max_time = gc.max_time
    if max_time is not None and (isinstance(max_time, bool) or not isinstance(max_time, (int, float)) or max_time <= 0):
        raise ValueError(f"max_time must be a number of seconds > 0, got {max_time!r}")

    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer= supports batch size 1 only, as in HF generate()")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator is not None and sampling is None:
        warn_caller("generator= has no effect with do_sample=False (greedy draws no random numbers)")
    criteria = _stopping_criteria(stopping_criteria, max_time)
    return_dict = bool(gc.return_dict_in_generate)
    return GenerationSettings(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new, row_budgets=row_budgets,
        sampling=sampling, eos_token_ids=eos,
        pad_token_id=int(pad if pad is not None else (eos[0] if eos else 0)), generator=generator, streamer=streamer,
        stopping_criteria=criteria, repetition_penalty=penalty, min_new_tokens=min_new, min_length=min_len,
        return_dict=return_dict, output_scores=bool(gc.output_scores) and return_dict,
        output_logits=bool(gc.output_logits) and return_dict,
    )
