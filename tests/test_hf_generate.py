"""HF's own ``generate(assistant_model=...)`` and ``generate(prompt_lookup_num_tokens=...)`` on hybrid
models after ``specdec.enable_hf_speculation``: exact (== HF's plain greedy output), with the
rollback behind the cache's ``crop``; and without it transformers before 5.25 refuses stateful
models."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model, perturbed_copy, ragged_prompts
from transformers.cache_utils import Cache

import specdec
from specdec.hf_integration import SpeculativeCache, _cache_key, disable_hf_speculation
from specdec.rollback import STRATEGIES

FAMILIES = ("qwen3_5", "nemotron_h", "kimi_linear")
MAX_NEW = 16
_CACHE: dict = {}


def setup(family):
    """(target, draft, ids, mask, HF plain greedy reference); batch 1 (HF's assisted path)."""
    if family not in _CACHE:
        model = make_model(family)
        ids, mask = ragged_prompts(batch=1)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        draft = perturbed_copy(model, scale=0.3)
        cfg = draft.generation_config
        # several short assistant rounds, none cut short by the assistant's confidence
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold = 3, "constant", 0.0
        _CACHE[family] = (model, draft, ids, mask, ref)
    return _CACHE[family]


def generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, **kw)


#: transformers from 5.25 runs assisted generation on stateful models itself (its caches record
#: recurrent states to crop): there is no refusal to check
HF_SPECULATES_ON_STATEFUL = hasattr(Cache, "get_recurrent_states_to_keep")


@pytest.mark.skipif(HF_SPECULATES_ON_STATEFUL, reason="this transformers runs assisted generation on stateful "
                                                        "models itself")
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_refuses_stateful_models_without_it(family):
    model, draft, ids, mask, _ = setup(family)
    disable_hf_speculation(model)
    with pytest.raises(ValueError, match="stateful"):
        generate(model, ids, mask, assistant_model=draft)
    with pytest.raises(ValueError, match="stateful"):
        generate(model, ids, mask, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_assistant_model_exact(family, strategy):
    model, draft, ids, mask, ref = setup(family)
    specdec.enable_hf_speculation(model, rollback=strategy)
    disable_hf_speculation(draft)  # a hybrid draft gets enabled by the target's generate()
    out = generate(model, ids, mask, assistant_model=draft)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values if "past_key_values" in out else out.cache
    assert isinstance(cache, SpeculativeCache)
    assert getattr(draft, "_specdec_hf", None) is not None
    stats = cache.crop_stats
    assert stats["crops"] >= 3 and stats["kept_tokens"] == MAX_NEW - 1
    assert stats["rolled_back_tokens"] > 0 or family == "nemotron_h"  # its perturbed draft may never miss


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_exact(family, strategy):
    model, _, ids, mask, ref = setup(family)
    specdec.enable_hf_speculation(model, rollback=strategy)
    out = generate(model, ids, mask, prompt_lookup_num_tokens=3)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values if "past_key_values" in out else out.cache
    assert cache.crop_stats["rolled_back_tokens"] > 0  # rejected lookups were rolled back


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_generate_unchanged(family):
    """Without speculation HF keeps its own cache and output."""
    model, _, ids, mask, ref = setup(family)
    specdec.enable_hf_speculation(model)
    out = generate(model, ids, mask)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values if "past_key_values" in out else out.cache
    assert not isinstance(cache, SpeculativeCache)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_draft_rollback_gives_fresh_candidates(family):
    """The assistant's cache, cropped as HF's candidate generator crops it, proposes what a fresh run
    on the same text proposes (its SSM state after the crop is that of the kept tokens)."""
    from transformers import GenerationConfig

    _, draft, ids, mask, ref = setup(family)
    disable_hf_speculation(draft)
    specdec.enable_hf_speculation(draft, rollback="replay")
    gc = GenerationConfig(do_sample=False, pad_token_id=0, is_assistant=True, return_dict_in_generate=True,
                          num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    L = ids.shape[1]
    text, cache = ids, None
    for accept in (1, 0, 3, 2):  # how many of the 3 candidates the "target" keeps each round
        kw = {_cache_key(): cache} if cache is not None else {}  # (generate() takes it as cache in 5.25)
        if cache is not None:  # HF's _update_past_and_masks: keep all but the last 2 tokens of the text
            cache.crop(-(cache.get_seq_length() - (text.shape[1] - 2)))
        out = draft.generate(text, max_new_tokens=3, generation_config=gc, **kw)
        cache = out.past_key_values if "past_key_values" in out else out.cache
        fresh = draft.generate(text, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(out.sequences, fresh)
        # the next text: the kept candidates, then a "correction" from the reference continuation
        nxt = ref[:, text.shape[1]: text.shape[1] + 1]
        text = torch.cat([out.sequences[:, : text.shape[1] + accept], nxt if nxt.numel() else ref[:, -1:]], dim=1)
    assert cache.crop_stats["rolled_back_tokens"] > 0 and text.shape[1] > L + 4


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_one_token_prompts_with_a_hybrid_assistant(family):
    """A one-token prompt: the assistant's cache holds its prefilled token and nothing it could roll
    back when HF crops it to nothing to re-feed the text; the crop starts it again from no tokens,
    and the output is HF's plain greedy one. (The assistant is a hybrid: the target enables it.)"""
    model, draft, _, _, _ = setup(family)
    specdec.enable_hf_speculation(model)
    for token in (17, 40, 77):
        ids = torch.tensor([[token]])
        ref = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)  # (no assistant: HF's)
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, assistant_model=draft,
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), token


def test_pure_mamba2_is_refused():
    model = make_model("mamba2")
    with pytest.raises(ValueError, match="specdec.wrap"):
        specdec.enable_hf_speculation(model)


def test_sampling_runs():
    model, draft, ids, mask, _ = setup("qwen3_5")
    specdec.enable_hf_speculation(model)
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, pad_token_id=0,
                         assistant_model=draft)
    assert out.shape == (1, ids.shape[1] + 8)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_a_cache_of_the_callers_with_an_assistant_is_refused(family):
    """Assisted generation with a past_key_values of the caller's (HF's own cache, which cannot roll
    an SSM state back) is refused with a clear error before anything runs; the model then runs
    assisted generation exactly."""
    from transformers import DynamicCache

    model, draft, ids, mask, ref = setup(family)
    specdec.enable_hf_speculation(model)
    refusal = f"{_cache_key()} given to assisted generation"  # (past_key_values; transformers >= 5.25: cache)
    with pytest.raises(ValueError, match=refusal):
        generate(model, ids, mask, assistant_model=draft, past_key_values=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match=refusal):
        generate(model, ids, mask, prompt_lookup_num_tokens=3, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(generate(model, ids, mask, assistant_model=draft).sequences, ref)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_early_exit_self_speculation_is_refused(family):
    """HF's assistant_early_exit (the model's first layers as its own draft, on its own cache) is
    refused up front on an enabled model, leaving its config as it was; plain and assisted
    generation stay exact afterwards."""
    model, draft, ids, mask, ref = setup(family)
    specdec.enable_hf_speculation(model)
    layers = model.config.num_hidden_layers
    with pytest.raises(ValueError, match="assistant_early_exit"):
        generate(model, ids, mask, assistant_early_exit=1)
    assert model.config.num_hidden_layers == layers
    assert torch.equal(generate(model, ids, mask).sequences, ref)
    assert torch.equal(generate(model, ids, mask, prompt_lookup_num_tokens=3).sequences, ref)
