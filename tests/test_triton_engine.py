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
    [("qwen3_5", "replay"), pytest.param("qwen3_next", "snapshot", marks=pytest.mark.slow),  # (GDN: qwen3_5's op)
     ("nemotron_h", "ring"), ("kimi_linear", "snapshot"),
     ("nemotron_h", "replay_deferred"),
     # (Falcon-H1's mixer is the Mamba-2 core on the kernels nemotron_h's cases run; its parallel attention + SSM
     # layers stay exact by default on the torch backend: test_families.py::test_greedy_exact_vs_hf[falcon_h1-*])
     pytest.param("falcon_h1", "replay", marks=pytest.mark.slow)],
)
def test_triton_backend_exact(family, strategy, monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    # the small models (target and draft; one SSM and one attention layer, Falcon-H1's two layers of both
    # side by side): the interpreter is slow
    model = get_model(family, "small")
    ids, mask = ragged_prompts()
    sd = specdec.wrap(model, drafter=DraftModelDrafter(perturbed_copy(model)), rollback=strategy,
                      num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values())
    assert torch.equal(out, hf_greedy(model, ids, mask, 8))


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_triton_plain_steps_commit_the_conv_as_they_run(family, monkeypatch):
    """Plain decoding (K = 0) on the Triton backend equals HF generate, and in a plain step each
    SSM layer's conv is one launch (the verify's, committing the token as it runs): the conv's
    commit kernel never launches; a Mamba-2 layer's step is its conv, its recurrence (which forms
    its own inputs) and its gated norm, one launch each."""
    from helpers import DeviceOps

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    model = get_model(family, "small")
    ids, mask = ragged_prompts()
    sd = specdec.wrap(model, num_speculative_tokens=0)
    with DeviceOps() as ops:
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(out, hf_greedy(model, ids, mask, 6))
    layers = len(sd.last_cache.ssm)
    assert layers and all(layer.plain for layer in sd.last_cache.ssm.values())
    assert ops.triton["_conv1d_verify_kernel"] == 5 * layers, ops.triton  # the 5 steps after the prompt's token
    assert ops.triton["_conv1d_commit_kernel"] == 0, ops.triton
    if family == "nemotron_h":  # the gated norm: one launch a layer in each step, and in the prompt's forward,
        # where each plain RMSNorm of the model is one launch of the same kernel too
        from specdec.models.common import plain_norms

        assert ops.triton["_mamba2_step_kernel"] == 5 * layers, ops.triton
        assert ops.triton["_rms_norm_kernel"] == 6 * layers + len(plain_norms(model.modules())), ops.triton


def test_triton_steps_follow_weights_changed_in_place(monkeypatch):
    """A Mamba-2 step on the Triton backend reads the layer's A_log at every call: after it changes in
    place (as a loader's ``param.data.copy_`` does, which moves no version counter), the next
    call's committed states equal the torch backend's with the new weights, and its tokens HF's."""
    import copy

    model = copy.deepcopy(get_model("nemotron_h", "small"))
    ids, mask = ragged_prompts()
    mixers = [m for m in model.modules() if hasattr(m, "A_log")]
    assert mixers

    def run(backend):
        monkeypatch.setenv("SPECDEC_BACKEND", backend)
        sd = specdec.wrap(model, num_speculative_tokens=0, decode_path="eager")
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
        return out, [layer.ssm_state().clone() for layer in sd.last_cache.ssm.values()]

    for value in (-3.0, 3.0):
        with torch.no_grad():
            for m in mixers:
                m.A_log.data.copy_(torch.full_like(m.A_log, value))
        (out, states), (_, want) = run("triton"), run("torch")
        assert torch.equal(out, hf_greedy(model, ids, mask, 6)), value
        for s, w in zip(states, want):
            torch.testing.assert_close(s, w, rtol=1e-4, atol=1e-6)


def test_triton_steps_of_a_model_built_in_inference_mode(monkeypatch):
    """A model built under ``torch.inference_mode()`` (its parameters inference tensors, which keep
    no version counter), as servers load them, decodes on the Triton backend as HF generates."""
    from tiny_models import make_model

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    with torch.inference_mode():
        model = make_model("nemotron_h", seed=1, small=True)
    ids, mask = ragged_prompts()
    out = specdec.wrap(model, num_speculative_tokens=0).generate(ids, attention_mask=mask, max_new_tokens=6,
                                                                 pad_token_id=0)
    assert torch.equal(out, hf_greedy(model, ids, mask, 6))


def test_interpreter_asked_for_too_late_is_named():
    """Triton kernels for a CPU tensor need the interpreter, which only takes effect for kernels
    defined after it is on: once triton is imported without it (whether it is set later or not),
    binding an op's Triton kernels for the CPU, the KV write's included, says so (it used to fail
    later, inside the first kernel, on Triton's own helpers)."""
    import os
    import subprocess
    import sys

    for late in ("", "import os; os.environ['TRITON_INTERPRET'] = '1'\n"):  # not set, or set after the import
        code = ("import triton.language, pytest\n" + late +
                "from specdec.kernels import OPS\n"
                "from specdec.kernels.kv import write_kv\n"
                "import torch\n"
                "with pytest.raises(RuntimeError, match='set TRITON_INTERPRET=1 before importing torch'):\n"
                "    OPS['gdn'].on('triton', 'cpu')\n"
                "buf, kv = torch.zeros(1, 1, 4, 2), torch.ones(1, 1, 1, 2)\n"
                "with pytest.raises(RuntimeError, match='set TRITON_INTERPRET=1 before importing torch'):\n"
                "    write_kv(buf, buf.clone(), kv, kv, torch.zeros(1, dtype=torch.long), 0, backend_name='triton')\n"
                "print('refused')\n")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.strip().endswith("refused"), (late, run.stderr[-2000:])
