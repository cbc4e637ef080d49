"""The end-to-end exactness tests also hold on the Triton backend (here through Triton's CPU
interpreter, tiny sizes): greedy output equals HF generate with every SSM op's fused kernels
and the fused conv in the loop."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy
from markers import needs_triton_interpreter
from tiny_models import get_model, perturbed_copy, ragged_prompts

import specdec
from specdec.drafters import DraftModelDrafter

pytestmark = needs_triton_interpreter


@pytest.mark.parametrize(
    "family,strategy",
    [("qwen3_5", "replay"), ("qwen3_next", "snapshot"), ("nemotron_h", "ring"), ("kimi_linear", "snapshot"),
     ("nemotron_h", "replay_deferred")],
)
def test_triton_backend_exact(family, strategy, monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    model = get_model(family, "small")  # one SSM and one attention layer (target and draft): the interpreter is slow
    ids, mask = ragged_prompts()
    sd = specdec.wrap(model, drafter=DraftModelDrafter(perturbed_copy(model)), rollback=strategy,
                      num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values())
    assert torch.equal(out, hf_greedy(model, ids, mask, 8))
