"""Clear errors at the public boundary, raised before any work, and a wrapper that still works
(and stays exact) after a rejected call."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import hf_greedy
from tiny_models import VOCAB, get_model, make_model, ragged_prompts

import specdec
from specdec.drafters import DraftModelDrafter, Drafter


def test_unsupported_model_lists_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="not supported") as err:
        specdec.wrap(gpt2)
    msg = str(err.value)
    assert "gpt2" in msg and "qwen3_5_text" in msg and "nemotron_h" in msg


def test_unsupported_family_message_lists_supported():
    from transformers import OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=16, ffn_dim=32, num_attention_heads=2,
                                   vocab_size=VOCAB, word_embed_proj_dim=16))
    assert opt.config.model_type not in specdec.models.supported_families()
    with pytest.raises(ValueError, match="'opt'.*not supported.*qwen3_5_text"):
        specdec.wrap(opt)


def test_not_a_causal_lm():
    with pytest.raises(TypeError, match="causal LM"):
        specdec.wrap(torch.nn.Linear(2, 2))


def test_a_multimodal_class_of_a_supported_family_is_refused_at_wrap():
    """Qwen3.5 loaded as its image-text class (the model_type is a supported one): refused at wrap()
    with the class to load instead, not an AttributeError in generate()."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64, vocab_size=VOCAB, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                layer_types=["linear_attention", "full_attention"])
    cfg = AutoConfig.for_model("qwen3_5", text_config=text,
                               vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                                                  out_hidden_size=32))
    model = AutoModelForImageTextToText.from_config(cfg)
    with pytest.raises(TypeError, match="not a text causal LM.*AutoModelForCausalLM"):
        specdec.wrap(model)


@pytest.mark.parametrize("K", [-1, 65])  # 0 is plain decoding (tests/test_static_path.py)
def test_K_out_of_range(K):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        specdec.wrap(get_model("qwen3_5"), num_speculative_tokens=K)


def test_K_wrong_type():
    with pytest.raises(TypeError):
        specdec.wrap(get_model("qwen3_5"), num_speculative_tokens=2.0)


def test_unknown_strategy_and_drafter():
    with pytest.raises(ValueError, match="snapshot"):
        specdec.wrap(get_model("qwen3_5"), rollback="undo")
    with pytest.raises(ValueError, match="ngram"):
        specdec.wrap(get_model("qwen3_5"), drafter="eagle")
    with pytest.raises(TypeError, match="DraftModelDrafter"):
        specdec.wrap(get_model("qwen3_5"), drafter=get_model("qwen3_5", "small"))


@pytest.mark.parametrize("name, passes", [("draft_model", "DraftModelDrafter(draft_model)"),
                                          ("medusa", "MedusaDrafter(heads)")])
def test_cli_drafter_names_say_which_object_the_api_needs(name, passes):
    """The CLI's drafter names: the API builds ngram and mtp from a name; the others say what to pass."""
    with pytest.raises(ValueError, match=re.escape(passes)) as info:
        specdec.wrap(get_model("qwen3_5"), drafter=name)
    assert f"drafter={name!r} needs an object" in str(info.value)


def test_draft_vocabulary_mismatch():
    other = make_model("qwen3_5", small=True, vocab=VOCAB + 4)
    with pytest.raises(ValueError, match="vocabulary"):
        specdec.wrap(get_model("qwen3_5"), drafter=DraftModelDrafter(other))


@pytest.fixture
def sd():
    return specdec.wrap(get_model("kimi_linear"), drafter="ngram", rollback="replay", num_speculative_tokens=3)


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(input_ids=torch.ones(2, 3)), TypeError, "integer"),
        (dict(input_ids=torch.ones(1, 2, 3, dtype=torch.long)), ValueError, "2-D"),
        (dict(input_ids=torch.ones(1, 0, dtype=torch.long)), ValueError, "empty"),
        (dict(input_ids=torch.full((1, 3), VOCAB)), ValueError, "vocabulary"),
        (dict(input_ids=[[1, 2]]), TypeError, "LongTensor"),
        (dict(attention_mask=torch.ones(2, 5, dtype=torch.long)), ValueError, "same shape"),
        (dict(attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])), ValueError, "all padding"),
        (dict(attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])), ValueError, "left-padded"),
        (dict(input_ids=torch.tensor([[5, 6, 0, 0], [5, 6, 7, 8]])), ValueError, "left-pad the prompts"),
        (dict(input_ids=torch.tensor([[0, 0, 0, 0], [5, 6, 7, 8]])), ValueError, "only padding"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
        (dict(do_sample=True, top_k=-2), ValueError, "top_k"),
        (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
        (dict(num_beams=2), ValueError, "unsupported"),
        (dict(no_repeat_ngram_size=2), ValueError, "no_repeat_ngram_size"),
        (dict(eos_token_id="x"), ValueError, "eos_token_id"),
    ],
)
def test_bad_generate_arguments(sd, kwargs, exc, pattern):
    args = dict(input_ids=torch.randint(3, VOCAB, (2, 4)), max_new_tokens=4, pad_token_id=0)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        sd.generate(**args)
    # the wrapper still works, exactly, after the rejected call
    ids, mask = ragged_prompts()
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(out, hf_greedy(get_model("kimi_linear"), ids, mask, 8))


def test_mask_inferred_from_left_padding(sd):
    """Left-padded prompts without an attention_mask: the mask the pad id implies, as in HF."""
    ids, mask = ragged_prompts()
    assert bool((mask == 0).any()) and bool((ids[mask == 0] == 0).all())  # padded with pad id 0
    out = sd.generate(ids, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(out, hf_greedy(get_model("kimi_linear"), ids, mask, 8))


class BadDrafter(Drafter):
    def __init__(self, what):
        self.what = what

    def propose(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        d = torch.full((B, K), 3, dtype=torch.long)
        c = torch.full((B,), K, dtype=torch.long)
        if self.what == "oov":
            d[0, 0] = VOCAB + 5
        elif self.what == "too_many":
            d = torch.full((B, K + 1), 3, dtype=torch.long)
        elif self.what == "count":
            c[0] = K + 1
        elif self.what == "batch":
            d = d[:1]
        return d, c


@pytest.mark.parametrize("what,pattern", [("oov", "vocabulary"), ("too_many", "at most"), ("count", "outside"),
                                          ("batch", "shape")])
def test_custom_drafter_bad_output(what, pattern):
    model = get_model("qwen3_5")
    sd = specdec.wrap(model, drafter=BadDrafter(what), num_speculative_tokens=2)
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match=pattern):
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    sd.drafter = specdec.drafters.NGramDrafter()
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0),
                       hf_greedy(model, ids, mask, 6))


class BadProbsDrafter(Drafter):
    """Proposes K drafts per row and returns draft distributions of the wrong kind (``what``)."""

    def __init__(self, what):
        self.what = what

    def propose(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        self.shape = {"vocab": (B, K, VOCAB + 1), "width": (B, K + 1, VOCAB), "batch": (B + 1, K, VOCAB)}.get(
            self.what, (B, K, VOCAB))
        return torch.full((B, K), 3, dtype=torch.long), torch.full((B,), K, dtype=torch.long)

    def draft_probs(self):
        if self.what == "list":
            return [[1.0]]
        q = torch.full(self.shape, 1.0 / self.shape[-1], dtype=torch.long if self.what == "dtype" else torch.float32)
        if self.what == "zero_at_draft":  # the drafts (token 3) could not have been sampled from q
            q[:, :, 3] = 0.0
        elif self.what == "nan":
            q[0, 0, 0] = float("nan")
        elif self.what == "logits":  # scores, not probabilities: negative entries
            q = torch.randn(self.shape, generator=torch.Generator().manual_seed(0))
        return q


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("what,exc", [("vocab", ValueError), ("width", ValueError), ("batch", ValueError),
                                      ("dtype", TypeError), ("list", TypeError), ("zero_at_draft", ValueError),
                                      ("nan", ValueError), ("logits", ValueError)])
def test_custom_drafter_bad_draft_probs(what, exc, path):
    model = get_model("qwen3_5")
    sd = specdec.wrap(model, drafter=BadProbsDrafter(what), num_speculative_tokens=2, decode_path=path)
    ids, mask = ragged_prompts()
    with pytest.raises(exc, match="draft_probs"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, do_sample=True)
    sd.drafter = specdec.drafters.NGramDrafter()
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0),
                       hf_greedy(model, ids, mask, 6))


def test_generation_config_and_eos_list():
    from transformers import GenerationConfig

    model = get_model("qwen3_next")
    ids, mask = ragged_prompts()
    plain = hf_greedy(model, ids, mask, 12)
    L = ids.shape[1]
    eos = [int(plain[0, L + 2]), int(plain[2, L + 6])]
    ref = model.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=12, do_sample=False,
                         eos_token_id=eos, pad_token_id=1))
    sd = specdec.wrap(model, drafter=DraftModelDrafter(get_model("qwen3_next", "perturbed")), rollback="ring",
                      num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=12, do_sample=False,
                      eos_token_id=eos, pad_token_id=1))
    assert torch.equal(out, ref)


def test_max_new_tokens_zero_and_one():
    model = get_model("nemotron_h")
    ids, mask = ragged_prompts()
    sd = specdec.wrap(model)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=0), ids)
    assert sd.last_stats.steps == 0 and sd.last_stats.rollback == "none"  # (no step: no rollback ran)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=1, pad_token_id=0),
                       hf_greedy(model, ids, mask, 1))


def test_default_length_matches_hf():
    model = get_model("qwen3_5")
    ids, mask = ragged_prompts()
    ref = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0)
    out = specdec.wrap(model).generate(ids, attention_mask=mask, pad_token_id=0)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="max_length"):
        specdec.wrap(model).generate(ids, attention_mask=mask, max_length=3)


def test_generate_without_input_ids_says_what_it_needs():
    sd = specdec.wrap(get_model("qwen3_5"))
    with pytest.raises(ValueError, match="needs input_ids.*inputs_embeds is not supported"):
        sd.generate(inputs_embeds=torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match=r"needs input_ids \(token ids"):
        sd.generate(max_new_tokens=2)
