"""The step attention that folds grouped query heads into the query length
(:mod:`specdec.models.step_attention`): the same attention as transformers' ``sdpa`` with
``repeat_kv`` on fresh random inputs, the route it takes during a step, and the configs it
restores."""

from __future__ import annotations

import types

import pytest
import torch
from tiny_models import get_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import specdec
from specdec.models.step_attention import (grouped_attention_configs, grouped_step_attention,
                                           grouped_step_attention_for)


def _inputs(B, H, Hkv, t, L, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, H, D, generator=g, dtype=dtype).transpose(1, 2)  # as the layers hand it over
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, L, D, generator=g, dtype=dtype)
    visible = torch.rand(B, 1, t, L, generator=g) < 0.7
    visible[..., 0] = True  # every query sees at least one key
    mask = torch.zeros(B, 1, t, L, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return q, k, v, mask


@pytest.mark.parametrize("B, H, Hkv, t, L", [(3, 8, 2, 5, 37), (2, 4, 1, 1, 64), (1, 6, 3, 9, 20)])
def test_same_attention_as_repeat_kv(B, H, Hkv, t, L):
    q, k, v, mask = _inputs(B, H, Hkv, t, L, 16, seed=B * 100 + t)
    module = types.SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True)
    out, weights = grouped_step_attention(module, q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == ref.shape == (B, t, H, 16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_falls_back_to_sdpa_without_a_mask_or_groups():
    """No mask (transformers then uses enable_gqa) or one KV head per query head: transformers'
    sdpa unchanged, bit for bit."""
    q, k, v, mask = _inputs(2, 4, 4, 3, 10, 8, seed=7)
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    assert torch.equal(grouped_step_attention(module, q, k, v, mask)[0], sdpa_attention_forward(module, q, k, v, mask)[0])
    q, k, v, _ = _inputs(2, 4, 2, 3, 3, 8, seed=8)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    assert torch.equal(grouped_step_attention(module, q, k, v, None)[0], sdpa_attention_forward(module, q, k, v, None)[0])


def test_step_routes_grouped_layers_and_restores_sdpa(monkeypatch):
    """A step of a model with grouped-query attention (``sdpa``) calls the folded attention, its
    configs read ``sdpa`` throughout and transformers' ``sdpa`` entry is back after it; an
    ``eager`` model keeps its implementation."""
    import specdec.models.step_attention as step_attention

    model = get_model("qwen3_5")
    configs = grouped_attention_configs(model)
    assert configs and all(c._attn_implementation == "sdpa" for c in configs)
    calls = []
    real = step_attention.grouped_step_attention

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    from transformers import AttentionInterface
    monkeypatch.setattr(step_attention, "grouped_step_attention", counting)
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=2)
    sd.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4)
    assert calls, "the step's attention did not go through the grouped step attention"
    assert all(c._attn_implementation == "sdpa" for c in configs)
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward  # the router is gone again
    def mine(*args, **kwargs):
        return sdpa_attention_forward(*args, **kwargs)

    with grouped_step_attention_for(configs):  # a user's "sdpa" registered meanwhile stays registered
        AttentionInterface.register("sdpa", mine)
    try:
        assert AttentionInterface._global_mapping["sdpa"] is mine
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    eager = types.SimpleNamespace(_attn_implementation_internal="eager")
    with grouped_step_attention_for([eager]):
        assert eager._attn_implementation_internal == "eager"
        assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward  # nothing routed


@pytest.mark.parametrize("family, implementation, grouped", [
    ("mistral", "sdpa", True),  # a sliding window shorter than prompt + new tokens
    ("qwen3_5", "eager", False),  # loaded with eager attention: it keeps it
    ("kimi_linear", "sdpa", False),  # one KV head per query head: transformers' sdpa as it is
])
def test_models_route_and_stay_exact(family, implementation, grouped, monkeypatch):
    """A step runs the folded attention only for grouped-query layers under ``sdpa``: a model set
    to ``eager`` runs eager attention in every step (its configs never switched), one without
    grouped heads keeps ``sdpa``; every output equals HF greedy ``generate`` with the model's own
    attention, on the eager and static paths."""
    from helpers import hf_greedy
    from tiny_models import make_model, ragged_prompts

    import specdec.models.step_attention as step_attention

    model = make_model(family)
    if implementation == "eager":
        model.set_attn_implementation("eager")
    ids, mask = ragged_prompts()
    ref = hf_greedy(model, ids, mask, 12)
    seen, calls = [], []
    real = step_attention.grouped_step_attention

    def counting(module, *args, **kwargs):
        calls.append(module)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(step_attention, "grouped_step_attention", counting)
    for path in ("eager", "static"):
        sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path=path)
        step = sd.adapter.forward

        def forward(input_ids, cache):
            seen.extend(m.config._attn_implementation for m in model.modules()
                        if hasattr(m, "num_key_value_groups"))
            return step(input_ids, cache)

        sd.adapter.forward = forward
        assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), ref), path
    assert bool(calls) == grouped
    assert set(seen) == {implementation}  # (the configs are never switched)


def test_sdpa_without_cudnn_leaves_out_cudnn_and_restores():
    """On CUDA, attention in the block may use every SDPA backend but cuDNN's (its per-shape plans);
    the flags come back as they were, after an error too; on a CPU nothing changes."""
    from specdec.models.step_attention import sdpa_without_cudnn

    cuda = torch.backends.cuda
    flags = (cuda.cudnn_sdp_enabled, cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.math_sdp_enabled)
    before = [f() for f in flags]
    with sdpa_without_cudnn("cuda"):
        assert [f() for f in flags] == [False, True, True, True]
    assert [f() for f in flags] == before
    with pytest.raises(RuntimeError, match="inside"):
        with sdpa_without_cudnn(torch.device("cuda", 0)):
            raise RuntimeError("inside")
    assert [f() for f in flags] == before
    with sdpa_without_cudnn("cpu"):
        assert [f() for f in flags] == before


def test_sdpa_without_cudnn_overlapping_blocks_restore_the_flags():
    """Blocks of two threads that overlap (the first opened closes first) leave the flags as
    they were before both, and cuDNN stays out until the last one closes."""
    from specdec.models.step_attention import sdpa_without_cudnn

    cudnn = torch.backends.cuda.cudnn_sdp_enabled
    before = cudnn()
    a, b = sdpa_without_cudnn("cuda"), sdpa_without_cudnn("cuda")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert not cudnn()  # b is still open
    b.__exit__(None, None, None)
    assert cudnn() == before


@pytest.mark.parametrize("path", ["eager", "static"])
def test_prompts_and_growing_cache_steps_run_without_cudnn(monkeypatch, path):
    """Every prompt forward (one uncached, then those through a prefix cache) enters
    :func:`sdpa_without_cudnn` with the model's device, and so does every step of the eager path
    (its KV cache grows a column a step); a static cache's steps (one shape per bucket) do not."""
    import contextlib

    import specdec.models.base as base

    entered = []

    @contextlib.contextmanager
    def spy(device):
        entered.append(torch.device(device))
        yield

    monkeypatch.setattr(base, "sdpa_without_cudnn", spy)
    model = get_model("qwen3_5")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, model.config.vocab_size, (8,), generator=g).tolist()
    prompts = [shared + torch.randint(1, model.config.vocab_size, (3,), generator=g).tolist() for _ in range(2)]
    sd = specdec.wrap(model, num_speculative_tokens=0, decode_path=path)
    sd.generate(torch.tensor([prompts[0]]), max_new_tokens=4)
    steps = sd.last_stats.steps
    assert steps == 3 and entered == [torch.device("cpu")] * (1 + (steps if path == "eager" else 0))
    entered.clear()
    sd.generate_batch(prompts, max_new_tokens=2, prefix_caching=True, prefix_block_size=4)
    assert len(entered) >= 3 and set(entered) == {torch.device("cpu")}
