"""Greedy exactness for the families beyond the core four: speculative output == HF greedy
``generate()`` token for token (fp32) on a ragged left-padded batch, with n-gram and a draft
model (a perturbed copy of the target), under each rollback strategy."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ATTENTION_FAMILIES, EXTRA_FAMILIES, make_model, perturbed_copy, ragged_prompts

import specdec
from specdec.drafters import DraftModelDrafter
from specdec.rollback import STRATEGIES

MAX_NEW = 12
K = 3
_CACHE: dict = {}


def setup(family):
    """(target, perturbed draft, ids, mask, HF greedy reference), built once per family."""
    if family not in _CACHE:
        model = make_model(family)
        ids, mask = ragged_prompts()
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        _CACHE[family] = (model, perturbed_copy(model), ids, mask, ref)
    return _CACHE[family]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("family", EXTRA_FAMILIES + ATTENTION_FAMILIES)
def test_greedy_exact_vs_hf(family, drafter, strategy):
    model, draft, ids, mask, ref = setup(family)
    d = "ngram" if drafter == "ngram" else DraftModelDrafter(draft, rollback=strategy)
    sd = specdec.wrap(model, drafter=d, rollback=strategy, num_speculative_tokens=K)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert out.shape == ref.shape
    assert torch.equal(out, ref), f"\n{out[:, ids.shape[1]:]}\n{ref[:, ids.shape[1]:]}"
    st = sd.last_stats
    assert st.steps > 0 and 1.0 <= st.mean_accepted_tokens <= K + 1
    if drafter == "draft_model":
        assert st.accepted_tokens > 0  # drafts were accepted, so multi-token steps were committed


@pytest.mark.parametrize("family", EXTRA_FAMILIES)
def test_family_has_ssm_layers_on_shared_ops(family):
    """Each hybrid family routes its mixers through a shared op (or the conv path alone, LFM2)."""
    model = setup(family)[0]
    ad = specdec.models.adapter_for(model)
    ops = {op for _, op in ad.ssm_layers().values()}
    assert ops and ops <= {"mamba2", "gdn", "kda", "conv"}


def test_falcon_h1_rms_norm_variant_batch1():
    """Falcon-H1 with ``mamba_rms_norm=True`` (grouped gated norm instead of the z gate). HF's decode
    step squeezes the length-1 sequence in that norm, which only broadcasts right at batch 1 (its
    batched generate() fails with a shape error), so the comparison is at batch 1."""
    import transformers as tf
    from tiny_models import _config

    torch.manual_seed(0)
    cfg = _config("falcon_h1")
    cfg.mamba_rms_norm = True
    model = tf.FalconH1ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    ids, mask = ragged_prompts(batch=1)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter=DraftModelDrafter(perturbed_copy(model)), rollback="replay", num_speculative_tokens=K)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0), ref)


def test_unsupported_family_lists_supported():
    import transformers as tf

    cfg = tf.OPTConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                       word_embed_proj_dim=16)
    with pytest.raises(ValueError, match="not supported") as err:
        specdec.wrap(tf.OPTForCausalLM(cfg).eval())
    for fam in ("bamba", "falcon_h1", "granitemoehybrid", "zamba2", "lfm2", "mamba2", "olmo_hybrid",
                "qwen3_5_moe_text", "llama", "mistral", "qwen3"):
        assert fam in str(err.value)
