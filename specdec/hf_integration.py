"""Speculative decoding through Hugging Face's own ``generate()`` on hybrid models.

transformers refuses assisted generation (``assistant_model=`` / ``prompt_lookup_num_tokens=``)
on models with SSM layers ("assisted generation is not supported with stateful models"): its
assisted loop runs the target on ``[text, candidates]`` and then *crops* the cache back to the
accepted tokens, and an SSM state cannot be cropped. :func:`enable_hf_speculation` makes the
crop exact by putting specdec's cache behind it::

    specdec.enable_hf_speculation(model)
    model.generate(ids, assistant_model=draft, do_sample=False)   # a hybrid draft is enabled too
    model.generate(ids, prompt_lookup_num_tokens=4)

What it changes, on this model instance only:

* ``_is_stateful = False``, so HF's check passes;
* ``generate``: a hybrid ``assistant_model`` (one with SSM layers) not yet enabled is enabled
  with the same rollback (HF's own cache cannot crop it; transformers 5.17 fails there);
* ``_prepare_cache_for_generation``: in assisted generation (and when the model is itself the
  assistant) the cache is a :class:`SpeculativeCache`; plain ``generate()`` keeps HF's cache;
* ``forward``: with a :class:`SpeculativeCache`, the first call prefills the prompt through the
  model's own forward (HF's chunked path, as plain ``generate()`` does) and runs any further
  tokens of that call (the first candidates) as a speculative step; later calls are steps
  through the family adapter (:mod:`specdec.models`) with the rollback strategy;
  ``crop(-r)`` commits all but the last ``r`` tokens run since the previous crop.

So HF's assisted greedy output equals HF's plain greedy output token for token, as it does for
attention-only models. HF's assisted path is batch 1; :func:`specdec.wrap` is the batched one.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache

from .cache import HybridCache
from .models import adapter_for
from .models.base import HybridAdapter
from .placement import on_device
from .rollback import make_strategy

__all__ = ["enable_hf_speculation", "disable_hf_speculation", "SpeculativeCache"]


class SpeculativeCache(Cache):
    """An HF ``Cache`` backed by a :class:`~specdec.cache.HybridCache`; ``crop`` rolls SSM state back.

    Tokens run since the last ``crop`` form one open speculative step (possibly over several
    forwards, as a draft model decodes its candidates one by one); ``crop(-r)`` commits all but
    the last ``r`` of them. Created by the model's ``_prepare_cache_for_generation`` after
    :func:`enable_hf_speculation`; not meant to be built by hand.

    Args:
        adapter: the model's family adapter. strategy: the rollback strategy.
        prompt_len: columns of the prompt (prefilled through HF's own forward).
        max_cache_len: the most tokens this generation will hold (grows when exceeded).
        assistant: the model drafts for another one (HF rolls its cache back one token further,
            to re-feed the last one: the last prompt token is run as a step, not prefilled).
    """

    is_compileable = False

    def __init__(self, adapter, strategy, prompt_len: int | None, max_cache_len: int, assistant: bool):
        super().__init__(layers=[])
        self.adapter = adapter
        self.strategy = strategy
        self.prompt_len = prompt_len
        self._capacity = int(max_cache_len)
        self.assistant = assistant
        self.hybrid: HybridCache | None = None
        self.open = 0  # tokens run since the last crop (the open step)
        self.reserve_tokens = 1  # step room the next call should have (assistant: its whole call)
        #: what the crops did: how many, tokens kept (committed) and tokens rolled back
        self.crop_stats = {"crops": 0, "kept_tokens": 0, "rolled_back_tokens": 0}

    # --- HF Cache API -------------------------------------------------------------------------
    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.hybrid is not None

    @property
    def is_linear(self) -> list[bool]:
        # the cache tracks a sequence length (HF slices the already-cached inputs off by it)
        return [False]

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def batch_size(self) -> int:
        return -1 if self.hybrid is None else self.hybrid.batch

    def __len__(self):
        return len(self.adapter.body.layers) if self.hybrid is not None else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.hybrid is None:
            return 0
        return int(self.hybrid.seq_len.max()) + self.hybrid.step_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def activate_past_recording(self, **kwargs):
        """Nothing to do: every token since the last crop can be rolled back (transformers'
        ``recurrent_states_to_keep`` and other options do not apply)."""

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: the rollback store keeps what a crop needs; transformers' layers record no states."""
        return 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a positive value is the absolute length
        to keep, as ``DynamicCache.crop`` takes it) and commit the rest of the open step."""
        if self.hybrid is None:
            return
        if tokens_to_remove > 0:
            remove = max(self.get_seq_length() - int(tokens_to_remove), 0)
        else:
            remove = -int(tokens_to_remove)
        if remove > self.open and remove == self.get_seq_length():  # back to no tokens at all: HF re-feeds a
            # one-token prompt whose token was prefilled (it is not in the open step); start again from nothing
            self.crop_stats["crops"] += 1
            self.crop_stats["rolled_back_tokens"] += remove
            self.reset()
            return
        if remove > self.open:
            raise RuntimeError(
                f"cannot roll the cache back by {remove} tokens: only the {self.open} tokens run since the "
                "previous crop can be rolled back"
            )
        keep = self.open - remove
        self.crop_stats["crops"] += 1
        self.crop_stats["kept_tokens"] += keep
        self.crop_stats["rolled_back_tokens"] += remove
        with on_device(self.hybrid.device):
            self.hybrid.commit(torch.full((self.hybrid.batch,), keep, dtype=torch.long, device=self.hybrid.device))
        self.open = 0

    def reset(self):
        self.hybrid = None
        self.open = 0

    def reorder_cache(self, beam_idx):
        raise ValueError(
            "specdec's SpeculativeCache supports greedy and sampled assisted decoding, not beam search (num_beams > 1)"
        )

    def batch_repeat_interleave(self, repeats: int):
        if repeats != 1:
            raise ValueError("specdec's SpeculativeCache supports num_return_sequences=1 only")

    def batch_select_indices(self, indices):
        raise ValueError("specdec's SpeculativeCache does not select batch rows (HF's assisted decoding is batch 1)")

    # --- capacity -----------------------------------------------------------------------------
    def reserve(self, max_cache_len: int) -> None:
        """Make room for a generation holding up to ``max_cache_len`` tokens, whose calls may run
        all its new tokens before the next crop (a draft model's ``generate()`` call)."""
        self._capacity = max(self._capacity, int(max_cache_len))
        self.reserve_tokens = max(1, self._capacity - self.get_seq_length() + 1)

    def _ensure(self, step_tokens: int) -> None:
        """Room for ``step_tokens`` more tokens: step slots (grown only while no step is open, since
        growing rebuilds the SSM stores from the committed state) and KV columns (any time)."""
        h = self.hybrid
        need_T = self.open + step_tokens
        if need_T > h.max_step_tokens:
            if self.open:
                raise RuntimeError(
                    f"the open speculative step would hold {need_T} tokens, more than the {h.max_step_tokens} "
                    "reserved for it; HF ran more tokens before cropping than the generation length announced"
                )
            _grow_steps(h, max(need_T, self.reserve_tokens))
        need_cols = self.get_seq_length() + step_tokens + h.max_step_tokens + 1
        if need_cols > h.max_len:
            _grow_columns(h, max(need_cols, self._capacity + h.max_step_tokens + 2))

    # --- forward --------------------------------------------------------------------------------
    def run(self, input_ids, attention_mask):
        """Logits ``[B, n, V]`` of the last ``n`` positions of this call (n = tokens stepped + 1 on
        the first call, tokens stepped afterwards), computed with the model's device current
        (:func:`specdec.placement.on_device`)."""
        with on_device(self.adapter.device):
            return self._run(input_ids, attention_mask)

    def _run(self, input_ids, attention_mask):
        ad = self.adapter
        outs = []
        if self.hybrid is None:
            B, N = input_ids.shape
            P = N if self.prompt_len is None else min(self.prompt_len, N)
            if self.assistant and P > 1:
                P -= 1  # HF re-feeds the draft's last token: keep it in the open step
            rest = N - P
            T = max(rest, self.reserve_tokens if self.assistant else 1, 1)
            if self.assistant:
                T = max(T, self._capacity - P + 1)
            self.hybrid = ad.new_cache(B, max(self._capacity, N) + 2 * T + 2, T, self.strategy)
            mask = attention_mask[:, :P] if attention_mask is not None else torch.ones_like(input_ids[:, :P])
            logits, _ = ad.prefill(input_ids[:, :P], mask.to(input_ids.device), self.hybrid)
            outs.append(logits[:, None])
            step = input_ids[:, P:]
        else:
            step = input_ids
        if step.shape[1]:
            self._ensure(step.shape[1])
            logits, _ = ad.forward(step, self.hybrid)
            self.open += step.shape[1]
            outs.append(logits)
        return torch.cat(outs, dim=1)


def _grow_steps(cache: HybridCache, T: int) -> None:
    """Rebuild ``cache``'s SSM layer caches (no open step) for steps of up to ``T`` tokens, each on
    its device with its row -> slot map."""
    if cache.step_tokens:
        raise RuntimeError("cannot grow the step room while a step is open")
    for idx, layer in list(cache.ssm.items()):
        fresh = type(layer)(layer.op, layer.strategy, cache.batch, T, idx, state_indices=layer.state_indices,
                            device=layer.device)
        with on_device(layer.device):  # (the layer's own device where the layers spread; else None)
            fresh.load(layer.conv_state(), layer.ssm_state(), layer.conv_width)
        fresh.params = layer.params
        cache.ssm[idx] = fresh
    cache.max_step_tokens = T


def _grow_columns(cache: HybridCache, max_len: int) -> None:
    """Give ``cache``'s KV buffers ``max_len`` columns (contents kept; safe with an open step)."""
    for idx, (k, v) in list(cache.kv.items()):
        kb = k.new_zeros(k.shape[0], k.shape[1], max_len, k.shape[3])
        vb = v.new_zeros(v.shape[0], v.shape[1], max_len, v.shape[3])
        kb[:, :, : k.shape[2]] = k
        vb[:, :, : v.shape[2]] = v
        cache.kv[idx] = (kb, vb)
    cache.max_len = max_len


def _cache_key() -> str:
    """The keyword under which ``generate()`` hands the cache to ``forward`` and reads it back from the
    output: ``past_key_values`` in transformers 5.17, ``cache`` in newer releases (5.24)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _cache_name(model) -> str:
    # transformers 5.17's GenerationMixin._prepare_cache_for_generation names Mamba caches cache_params
    if _cache_key() == "past_key_values" and "mamba" in type(model).__name__.lower():
        return "cache_params"
    return _cache_key()


def _prompt_length(generation_config, model_kwargs) -> int | None:
    """Columns of the prompt ``generate()`` is about to run (before the first forward)."""
    mask = model_kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return int(mask.shape[-1])
    length = getattr(generation_config, "_mask_length", None)  # newer releases drop an all-ones mask
    if isinstance(length, int) and length > 0:
        return length
    pos = model_kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        return int(pos.shape[-1])
    return None


def _has_ssm_state(model) -> bool:
    try:
        return bool(adapter_for(model).ssm_layers())
    except (TypeError, ValueError):
        return False


def enable_hf_speculation(model, rollback="replay"):
    """Make HF's own assisted generation and prompt lookup run exactly on a hybrid ``model``.

    Args:
        model: a loaded HF causal LM of a supported family (``specdec.models.supported_families()``).
        rollback: ``"snapshot"``, ``"ring"``, ``"replay"`` (or an instance): how ``crop`` reaches
            the accepted state.

    Returns:
        ``model`` itself (patched in place; :func:`disable_hf_speculation` undoes it).

    Raises:
        TypeError / ValueError: not a supported causal LM, unknown strategy, or a model whose
            generate() takes no ``past_key_values`` cache (pure Mamba-2: HF's assisted loop
            needs one; use :func:`specdec.wrap` instead).
    """
    from transformers.generation.configuration_utils import GenerationMode
    from transformers.modeling_outputs import CausalLMOutputWithPast

    adapter = adapter_for(model)
    strategy = make_strategy(rollback)
    key = _cache_key()
    if _cache_name(model) != key or (isinstance(adapter, HybridAdapter) and adapter.cache_arg != "past_key_values"):
        raise ValueError(
            f"{type(model).__name__} takes its cache as cache_params, and transformers' assisted decoding "
            "needs a past_key_values cache; use specdec.wrap(model, ...).generate() for speculative decoding"
        )
    if getattr(model, "_specdec_hf", None) is not None:
        disable_hf_speculation(model)

    original_forward = model.forward
    original_prepare = model._prepare_cache_for_generation

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        cache = kwargs.get(key)
        if not isinstance(cache, SpeculativeCache):
            return original_forward(*args, **kwargs)
        if args:
            raise TypeError("pass model inputs as keyword arguments when the cache is a SpeculativeCache")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("specdec's SpeculativeCache needs input_ids, not inputs_embeds")
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.get(flag):
                raise ValueError(f"{flag}=True is not supported with specdec's SpeculativeCache")
        logits = cache.run(kwargs["input_ids"], kwargs.get("attention_mask"))
        keep = kwargs.get("logits_to_keep") or 0
        if isinstance(keep, int) and 0 < keep < logits.shape[1]:
            logits = logits[:, -keep:]
        return CausalLMOutputWithPast(logits=logits, **{key: cache})

    def _prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        existing = model_kwargs.get(key)
        if isinstance(existing, SpeculativeCache):  # a draft model's next call: room for all of it
            existing.reserve(max_cache_length)
            existing._is_user_defined = True
            return None
        assisted = generation_mode == GenerationMode.ASSISTED_GENERATION
        if assisted and getattr(generation_config, "assistant_early_exit", None) is not None:
            raise ValueError(
                f"assistant_early_exit={generation_config.assistant_early_exit} (the model's first layers as its "
                "own draft, on the model's own cache) is not supported on a model enabled by "
                "specdec.enable_hf_speculation: its draft passes would advance the SSM states the verify step "
                "rolls back; use assistant_model= or prompt_lookup_num_tokens=, or specdec.wrap(model, ...)"
            )
        if existing is not None and (assisted or generation_config.is_assistant):
            raise ValueError(
                f"{key} given to assisted generation on a model enabled by specdec.enable_hf_speculation: the "
                f"cache given ({type(existing).__name__}) cannot roll SSM state back to the accepted tokens; "
                f"leave {key} out (generate() makes specdec's cache), or call without assistant_model= / "
                "prompt_lookup_num_tokens="
            )
        if existing is not None or generation_config.use_cache is False or not (assisted or generation_config.is_assistant):
            return original_prepare(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        if generation_config.cache_implementation is not None:
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} cannot be combined with "
                "specdec's speculative cache; leave it unset"
            )
        prompt_len = _prompt_length(generation_config, model_kwargs)
        cache = SpeculativeCache(
            adapter, strategy, prompt_len, max_cache_length, assistant=bool(generation_config.is_assistant)
        )
        model_kwargs[key] = cache
        return None

    original_generate = model.generate

    @functools.wraps(original_generate)
    def generate(*args, **kwargs):
        draft = kwargs.get("assistant_model")
        if draft is not None and getattr(draft, "_specdec_hf", None) is None and _has_ssm_state(draft):
            # HF's own cache cannot roll a hybrid assistant back (5.17 fails in its crop): give it ours
            enable_hf_speculation(draft, rollback=strategy)
        return original_generate(*args, **kwargs)

    # what the instance held before (e.g. accelerate's hooked forward on a dispatched model), put back by disable
    before = {name: model.__dict__[name] for name in _PATCHED if name in model.__dict__}
    model.forward = forward
    model.generate = generate
    model._prepare_cache_for_generation = _prepare_cache_for_generation
    model._is_stateful = False
    model._specdec_hf = {"adapter": adapter, "strategy": strategy, "before": before}
    return model


def disable_hf_speculation(model):
    """Undo :func:`enable_hf_speculation` on ``model`` (HF's behaviour returns)."""
    if getattr(model, "_specdec_hf", None) is None:
        return model
    before = model._specdec_hf.get("before", {})
    for name in (*_PATCHED, "_specdec_hf"):
        model.__dict__.pop(name, None)
    model.__dict__.update(before)
    return model


#: the instance attributes enable_hf_speculation sets (disable_hf_speculation puts back what they were)
_PATCHED = ("forward", "generate", "_prepare_cache_for_generation", "_is_stateful")
