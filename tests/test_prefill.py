"""Prefill of the Mamba-2 families through the chunked SSD scan (:mod:`specdec.kernels.mamba2.chunked`),
and of the delta-rule (GDN, KDA) families through their prompt layer.

* The scan against the per-token recurrence (:func:`specdec.kernels.mamba2.naive.mamba2_verify`):
  prompts shorter than, equal to and longer than a chunk (not a multiple of it), one chunk per
  segment, an initial state.
* Every Mamba-2 family on a ragged left-padded batch of prompts longer than its chunk size: each
  layer's conv window and recurrent state after ``prefill`` against HF's own mixer run on the
  layer's input one token at a time (fp32), the logits against HF's forward, the
  ``time_step_limit`` clamp against HF's prefill, and speculative generation against
  ``generate(do_sample=False)``.
* Every Gated DeltaNet and Kimi Delta Attention family through its prompt layer
  (:class:`specdec.models.prompt_layer.DeltaRulePromptLayer`) on a ragged left-padded batch: each
  row's states and logits against transformers' prefill of the row alone (fp32); ``gpu``: fla's
  chunked rules against the torch reference.
* The prompt conv (:func:`specdec.kernels.conv1d.naive.causal_conv1d_prompt` and its Triton
  kernel, through the interpreter) against ``F.conv1d``, with and without a history, and a
  prefill with the Triton conv against the torch one; the head expansion of B and C against
  ``repeat_interleave``, bit for bit.
* With flash-linear-attention installed: the scan's mapping onto its simple GLA, through fla's
  torch reference, with fp32 and bf16 operands; ``gpu``: its kernel against the torch scan, the
  Triton prompt conv at a 4B model's width, and a CUDA prefill against HF's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_greedy, rel_err
from markers import ON_CUDA, needs_cuda, needs_triton_interpreter
from tiny_models import make_model, ragged_prompts
from transformers import DynamicCache

import specdec
from specdec.kernels import conv1d_op
from specdec.kernels.conv1d.naive import causal_conv1d_prompt
from specdec.kernels.mamba2.chunked import (SCANS, expand_groups, mamba2_chunk_scan, mamba2_chunk_scan_fla,
                                            resolve_scan)
from specdec.kernels.mamba2.naive import mamba2_verify
from specdec.models.common import cache_keyword
from specdec.models.prompt_layer import DeltaRulePromptLayer, PromptLayer
from specdec.models.mamba2 import Mamba2PromptLayer

MAMBA2_FAMILIES = ("nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "zamba2", "mamba2")
#: prompt lengths of the ragged batch: all longer than the tiny models' chunk of 16, none a multiple of it
LENGTHS = (40, 23, 33)
#: the prompt lengths of the tests that run every norm and MLP through Triton's interpreter, which runs
#: each norm and activation kernel once per token
SHORT_LENGTHS = (20, 11, 17)
TOL = 1e-5
#: where the Triton kernels run: compiled on CUDA in a CUDA test run, else the CPU interpreter
DEVICE = "cuda" if ON_CUDA else "cpu"


def scan_inputs(b, L, H, P, G, N, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, dt, B, C = r(b, L, H, P), torch.nn.functional.softplus(r(b, L, H)), r(b, L, G, N), r(b, L, G, N)
    A, D, h0 = -torch.rand(H, generator=g) * 2 - 0.05, r(H), r(b, H, P, N)
    return tuple(t.to(device) for t in (x, dt, A, B, C, D, h0))


@pytest.mark.parametrize("L,chunk,G,seg", [
    pytest.param(1, 16, 2, None, id="L1-l16"),
    pytest.param(16, 16, 2, None, id="L16-l16"),
    pytest.param(37, 16, 2, None, id="L37-l16"),
    pytest.param(37, 16, 1, 1, id="L37-l16-G1-segment1"),
    pytest.param(70, 8, 4, 3 * 4 * 4 * 8 * 8 * 2, id="L70-l8-G4-segment2"),
])
@pytest.mark.parametrize("initial", [False, True], ids=["h0=0", "h0"])
def test_chunk_scan_matches_recurrence(L, chunk, G, seg, initial):
    x, dt, A, B, C, D, h0 = scan_inputs(3, L, 4, 8, G, 6)
    y_ref, states, _ = mamba2_verify(h0 if initial else torch.zeros_like(h0), x, dt, A, B, C, D, return_states=True)
    kw = {"segment_bytes": seg} if seg is not None else {}
    y, h = mamba2_chunk_scan(x, dt, A, B, C, chunk, D, h0 if initial else None, **kw)
    assert y.dtype == h.dtype == torch.float32
    assert y.shape == x.shape and h.shape == states.shape[:1] + states.shape[2:]
    assert rel_err(y, y_ref) < TOL and rel_err(h, states[:, -1]) < TOL


def test_fla_older_than_the_kernels_specdec_calls_is_not_used(monkeypatch):
    """``auto`` takes fla only at FLA_MIN_VERSION or later, and ``scan="fla"`` with an older one
    says which version is installed and which is needed."""
    from specdec.kernels.mamba2 import chunked

    for found, usable in (("0.5.2", False), ("0.6.0", True), ("0.7.1.dev3", True), ("unknown", False)):
        monkeypatch.setattr(chunked, "fla_version", lambda found=found: found)
        assert chunked.fla_available() is usable
        assert resolve_scan("auto", "cuda") == ("fla" if usable else "torch")
        if not usable:
            with pytest.raises(ValueError, match=f">= {chunked.FLA_MIN_VERSION}.*{found} is installed"):
                resolve_scan("fla", "cuda")
    monkeypatch.setattr(chunked, "fla_version", lambda: None)
    with pytest.raises(ValueError, match="fla is not installed"):
        resolve_scan("fla", "cuda")


def test_scan_choice_errors():
    assert resolve_scan("auto", "cpu") == "torch" and resolve_scan("hf", "cpu") == "hf"
    with pytest.raises(ValueError, match="scan must be one of"):
        resolve_scan("triton", "cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_scan("fla", "cpu")
    x, dt, A, B, C, D, h0 = scan_inputs(1, 5, 4, 8, 2, 6)
    with pytest.raises(ValueError, match="shapes"):
        mamba2_chunk_scan(x, dt[:, :3], A, B, C, 4)
    with pytest.raises(ValueError, match="initial_state"):
        mamba2_chunk_scan(x, dt, A, B, C, 4, initial_state=h0[..., :3])
    with pytest.raises(ValueError, match="operand_dtype must be"):
        mamba2_chunk_scan_fla(x, dt, A, B, C, D, h0, operand_dtype=torch.int8)
    assert set(SCANS) == {"auto", "fla", "torch", "hf"}


# ------------------------------------------------------------------------------ prompt conv


def conv_reference(x, weight, bias, activation, history):
    """``F.conv1d`` (channels first, fp32) over the history (zeros without one) followed by ``x``."""
    B, L, C = x.shape
    W = weight.shape[1]
    past = history if history is not None else x.new_zeros(B, W - 1, C)
    u = torch.cat([past, x], dim=1).transpose(1, 2).double()
    out = F.conv1d(u, weight.double().unsqueeze(1), None if bias is None else bias.double(), groups=C)
    return (F.silu(out) if activation is not None else out).transpose(1, 2)


def conv_inputs(B, L, C, W, seed, device="cpu", dtype=torch.float32):
    """Fresh random conv inputs, in the layouts the prompt layer hands them: ``x`` a slice of a
    wider projection, the history a transposed view of a ``[B, C, W]`` conv state."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    x = r(B, L, C + 9)[:, :, 5 : 5 + C].to(dtype)
    history = r(B, C, W)[:, :, 1:].transpose(1, 2).to(dtype)
    return x, r(C, W), r(C), history


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "act=None"])
@pytest.mark.parametrize("with_history", [False, True], ids=["zeros", "history"])
def test_prompt_conv_matches_conv1d(W, activation, with_history):
    """The torch prompt conv (sum of W shifted products, fp32) against ``F.conv1d``; prompts
    shorter and longer than the kernel, with and without bias."""
    for seed, (B, L, C) in enumerate([(2, 11, 6), (3, 2, 5), (1, 1, 4)]):
        x, weight, bias, history = conv_inputs(B, L, C, W, seed)
        history = history if with_history else None
        for b in (bias, None):
            y = causal_conv1d_prompt(x, weight, b, activation, history)
            assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
            assert rel_err(y.double(), conv_reference(x, weight, b, activation, history)) < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("W", [1, 4])
@pytest.mark.parametrize("with_history", [False, True], ids=["zeros", "history"])
def test_prompt_conv_triton_matches_reference(dtype, W, with_history):
    """The Triton prompt conv (``Conv1dOp.prompt`` on the triton backend; the interpreter on CPU)
    against the torch reference: two token blocks and two channel blocks (both partial), strided
    inputs; both compute in fp32 and round once, so bf16 agrees to its rounding."""
    op = conv1d_op(DEVICE, backend_name="triton")
    x, weight, bias, history = conv_inputs(2, 37, 136, W, seed=W, device=DEVICE, dtype=dtype)
    history = history if with_history else None
    for activation in ("silu", None):
        y = op.prompt(x, weight, bias, activation, history)
        ref = causal_conv1d_prompt(x, weight, bias, activation, history)
        assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous() and torch.isfinite(y).all()
        assert rel_err(y.double(), ref.double()) < (TOL if dtype == torch.float32 else 1e-2)
        assert rel_err(y.double(), conv_reference(x.float(), weight, bias, activation,
                                                  None if history is None else history.float())) < 1e-2
    # a strided bias (a view of every other element) and a strided weight, read by their strides
    strided_bias = torch.stack([bias, torch.full_like(bias, 1e3)], -1)[..., 0]
    strided_weight = torch.stack([weight, torch.full_like(weight, 1e3)], -1)[..., 0]
    assert not strided_bias.is_contiguous() and not strided_weight.is_contiguous()
    y = op.prompt(x, strided_weight, strided_bias, "silu", history)
    ref = causal_conv1d_prompt(x, weight, bias, "silu", history)
    assert rel_err(y.double(), ref.double()) < (TOL if dtype == torch.float32 else 1e-2)


def test_prompt_conv_errors():
    """Bad prompt-conv input gets a ValueError naming what is accepted, on both backends."""
    x, weight, bias, history = conv_inputs(2, 5, 6, 4, seed=0, device=DEVICE)
    for prompt in (causal_conv1d_prompt, conv1d_op(DEVICE, backend_name="triton").prompt):
        with pytest.raises(ValueError, match="unsupported conv activation 'relu'; supported: 'silu', None"):
            prompt(x, weight, bias, "relu")
        with pytest.raises(ValueError, match=r"history must be \[B, W-1, C\] = \(2, 3, 6\)"):
            prompt(x, weight, bias, "silu", history[:, 1:])
        with pytest.raises(ValueError, match=r"history must be \[B, W-1, C\]"):
            prompt(x, weight, bias, "silu", history.transpose(1, 2))  # the conv state's [B, C, W-1] layout
        with pytest.raises(ValueError, match=r"expected x \[B, L, C\] and weight \[C, W\]"):
            prompt(x, weight[:5], bias, "silu")
        with pytest.raises(ValueError, match=r"bias must be \[C\] = \[6\]"):
            prompt(x, weight, bias[:4], "silu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_expand_groups_is_repeat_interleave(dtype):
    """The head expansion of B / C equals ``repeat_interleave`` bit for bit: contiguous, a slice of
    a projection whose rows are whole 8-byte words, one whose rows are not (odd offset), one group
    per head."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 5, 32, generator=g).to(dtype)
    cases = [(wide[..., :24].contiguous().view(2, 5, 3, 8), 12),  # contiguous, 4 heads per group
             (wide[..., 4:28].view(2, 5, 3, 8), 6),               # aligned slice (offset 4), 2 heads per group
             (wide[..., 1:25].view(2, 5, 3, 8), 6),               # unaligned slice (offset 1)
             (wide[..., 4:28].view(2, 5, 3, 8), 3)]               # one head per group
    assert cases[1][0].view(torch.int64).shape[-1] == 8 * cases[1][0].element_size() // 8  # rows of whole words
    for t, heads in cases:
        got, want = expand_groups(t, heads), t.repeat_interleave(heads // 3, dim=2)
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))


# ------------------------------------------------------------------------------ model level

_MODELS: dict = {}


def model_of(family, dt_limit=(0.0, float("inf"))):
    """The tiny ``family`` model with every mixer's ``time_step_limit`` set to ``dt_limit``
    (default: no clamp, so HF's prefill and decode step agree), every other head decaying slowly
    (``A = -0.01``) and random conv biases, so that padding not masked as HF masks it would show
    in the state; built once per setting."""
    key = (family, dt_limit)
    if key not in _MODELS:
        model = make_model(family)
        ad = specdec.models.adapter_for(model)
        for mixer, _ in ad.ssm_layers().values():
            mixer.time_step_limit = dt_limit
            with torch.no_grad():
                mixer.A_log[::2] = math.log(0.01)
                mixer.conv1d.bias.normal_()  # HF initialises it to zeros, which hides padding the conv sees
        _MODELS[key] = (model, ad)
    return _MODELS[key]


def prefill(ad, ids, mask, scan, max_tokens=None):
    cache = ad.new_cache(ids.shape[0], ids.shape[1] + 8, 4, specdec.rollback.make_strategy("snapshot"))
    logits, _ = ad.prefill(ids, mask, cache, scan=scan, max_tokens=max_tokens)
    return logits, {idx: (layer.ssm_state().clone(), layer.conv_state().clone()) for idx, layer in cache.ssm.items()}


@torch.no_grad()
def token_by_token(mixer, config, hidden):
    """HF's own ``mixer`` over ``hidden [1, n, D]`` one token at a time from an empty cache (the
    first token through its prefill path, the rest through its decode step): ``(recurrent state
    [1, H, P, N], conv window [1, C, W])`` fp32."""
    cache = DynamicCache(config=config)
    for t in range(hidden.shape[1]):
        mixer(hidden[:, t : t + 1], attention_mask=None, **{cache_keyword(mixer.forward, "cache_params"): cache})
    layer = cache.layers[mixer.layer_idx]
    return layer.recurrent_states[0].float(), layer.conv_states[0].float()


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_prefill_states_match_token_by_token(family):
    """Ragged left-padded prompts of 23-40 tokens (chunk 16): each Mamba-2 layer's recurrent state
    and conv window after prefill equal HF's own mixer run on that layer's input one token at a
    time (fp32, each row without its padding); the logits equal HF's forward's."""
    model, ad = model_of(family)
    assert all(op == "mamba2" for _, op in ad.ssm_layers().values())
    ids, mask = ragged_prompts(lengths=LENGTHS)
    inputs, hooks = {}, []
    for idx, (mixer, _) in ad.ssm_layers().items():
        def record(mod, args, kw, idx=idx):
            inputs[idx] = kw["hidden_states"] if "hidden_states" in kw else args[0]

        hooks.append(mixer.register_forward_pre_hook(record, with_kwargs=True))
    try:
        logits, states = prefill(ad, ids, mask, "torch")
    finally:
        for h in hooks:
            h.remove()
    assert sorted(inputs) == sorted(states)
    for idx, (ssm_state, conv_state) in states.items():
        mixer = ad.ssm_layers()[idx][0]
        for b in range(ids.shape[0]):
            ref_state, ref_conv = token_by_token(mixer, model.config, inputs[idx][b : b + 1, mask[b].bool()])
            W1 = conv_state.shape[-1]
            assert rel_err(ssm_state[b], ref_state[0]) < TOL, f"layer {idx} row {b}: recurrent state"
            assert rel_err(conv_state[b].float(), ref_conv[0, :, -W1:]) < TOL, f"layer {idx} row {b}: conv window"
    with torch.no_grad():
        hf_logits = model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    assert rel_err(logits.float(), hf_logits) < TOL


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_prefill_clamps_dt_as_hf_prefill(family):
    """With a ``time_step_limit`` that clamps many steps (a bound on each side), the states and
    logits equal HF's own prefill (which clamps; its decode step does not)."""
    model, ad = model_of(family, dt_limit=(0.3, 1.5))
    ids, mask = ragged_prompts(lengths=LENGTHS)
    logits, states = prefill(ad, ids, mask, "torch")
    hf_logits, hf = prefill(ad, ids, mask, "hf")
    assert rel_err(logits, hf_logits) < TOL
    for idx, (ssm_state, conv_state) in states.items():
        assert rel_err(ssm_state, hf[idx][0]) < TOL and rel_err(conv_state, hf[idx][1]) < TOL
    unclamped = prefill(model_of(family)[1], ids, mask, "torch")[1]
    assert max(rel_err(states[i][0], unclamped[i][0]) for i in states) > 1e-2  # the clamp mattered


def test_prompt_layer_is_used(monkeypatch):
    """The Mamba-2 mixers run the prompt layer's scan during prefill (``scan="hf"``: HF's own)."""
    _, ad = model_of("nemotron_h")
    calls = []
    original = Mamba2PromptLayer.ssm
    monkeypatch.setattr(Mamba2PromptLayer, "ssm", lambda self, *a: calls.append(self.layer_idx) or original(self, *a))
    ids, mask = ragged_prompts(lengths=LENGTHS)
    prefill(ad, ids, mask, "auto")
    assert sorted(calls) == sorted(ad.ssm_layers())
    calls.clear()
    prefill(ad, ids, mask, "hf")
    assert calls == []


def test_prompt_state_left_in_hf_cache_without_copies():
    """A prompt from scratch leaves its final state in HF's cache layer as the scan returned it (no
    zeros allocated and copied into); a view into a larger buffer is copied out (the buffer not kept
    alive); a layer already holding a state (a continued prompt) gets the new one copied into it."""
    model, ad = model_of("nemotron_h")
    mixer = next(iter(ad.ssm_layers().values()))[0]
    cache = DynamicCache(config=model.config)
    layer = Mamba2PromptLayer(mixer, cache, None, "torch")
    hf_layer = cache.layers[mixer.layer_idx]
    state = torch.randn(2, 3, 4, 5)
    layer.store_state(state)
    assert hf_layer.recurrent_states[0] is state

    for rows in (2, 1):  # the torch scan's final state: a view of its per-chunk states (contiguous at batch 1)
        cache = DynamicCache(config=model.config)
        buffer = torch.randn(rows, 7, 3, 4, 5)
        Mamba2PromptLayer(mixer, cache, None, "torch").store_state(buffer[:, -1])
        held = cache.layers[mixer.layer_idx].recurrent_states[0]
        assert torch.equal(held, buffer[:, -1]) and held.is_contiguous()
        assert held.untyped_storage().nbytes() == held.numel() * held.element_size()

    cache = DynamicCache(config=model.config)  # continued: HF's layer already holds a state
    cache.update_recurrent_state(torch.randn(2, 3, 4, 5), mixer.layer_idx)
    held = cache.layers[mixer.layer_idx].recurrent_states[0]
    new = torch.randn(2, 3, 4, 5)
    Mamba2PromptLayer(mixer, cache, None, "torch").store_state(new)
    assert cache.layers[mixer.layer_idx].recurrent_states[0] is held and torch.equal(held, new)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_prompt_states_in_hf_cache_equal_hf_update(family, monkeypatch):
    """A ragged prefill (torch scans) leaves in HF's cache the same recurrent states, bit for bit,
    as when each is written through HF's ``update_recurrent_state``, each in its own storage."""
    model = make_model(family)
    ad = specdec.models.adapter_for(model)
    ids, mask = ragged_prompts(lengths=LENGTHS)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    held = []
    for through_hf in (False, True):
        if through_hf:
            monkeypatch.setattr(PromptLayer, "store_state",
                                lambda self, s: self.cache_params.update_recurrent_state(s, self.layer_idx))
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            ad._prompt_forward(ids, mask, positions, cache, "torch")
        held.append({i: cache.layers[i].recurrent_states[0] for i in ad.ssm_layers()})
    assert held[0].keys() == held[1].keys() and held[0]
    for i, state in held[0].items():
        assert state.dtype == held[1][i].dtype and torch.equal(state, held[1][i]), f"layer {i}"
        assert state.untyped_storage().nbytes() == state.numel() * state.element_size()


DELTA_RULE_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "olmo_hybrid", "kimi_linear")


@pytest.mark.parametrize("family", DELTA_RULE_FAMILIES)
def test_delta_rule_prefill_matches_hf_prefill(family, monkeypatch):
    """Every Gated DeltaNet and Kimi Delta Attention family on a ragged left-padded batch, with
    random conv biases (HF's padded prefill then writes its padding into the state; its mixers
    have no conv bias by default): through the delta-rule prompt layer (its conv, the chunked
    rule of transformers' torch reference) each row's recurrent state, conv window and logits
    equal transformers' own prefill of that row alone (fp32); the prompt layer ran for every
    such mixer, and not with ``scan="hf"``."""
    model = make_model(family)
    ad = specdec.models.adapter_for(model)
    with torch.no_grad():
        for mixer, _ in ad.ssm_layers().values():
            mixer.conv1d.bias = torch.nn.Parameter(torch.randn(mixer.conv1d.weight.shape[0]))
    calls = []
    original = DeltaRulePromptLayer.ssm
    monkeypatch.setattr(DeltaRulePromptLayer, "ssm", lambda self, *a: calls.append(self.layer_idx) or original(self, *a))
    ids, mask = ragged_prompts(lengths=LENGTHS)
    logits, states = prefill(ad, ids, mask, "auto")
    assert sorted(calls) == sorted(ad.ssm_layers()) == sorted(states)
    calls.clear()
    for b in range(ids.shape[0]):
        row = ids[b : b + 1, mask[b].bool()]
        hf_logits, hf = prefill(ad, row, torch.ones_like(row), "hf")
        assert rel_err(logits[b], hf_logits[0]) < TOL, b
        for idx, (ssm_state, conv_state) in states.items():
            assert rel_err(ssm_state[b], hf[idx][0][0]) < TOL and rel_err(conv_state[b], hf[idx][1][0]) < TOL, (b, idx)
    assert calls == []


@needs_triton_interpreter
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5", "olmo_hybrid", "kimi_linear"])
def test_prefill_triton_conv_matches_torch(family, monkeypatch):
    """The prompt conv, the gated norm, the decoder's plain RMSNorms and the MLPs' activations on
    the triton backend (``SPECDEC_BACKEND=triton``; the interpreter on CPU) leave the states and
    logits the torch conv and HF's modules leave (Mamba-2's gated norm gates first, Gated DeltaNet's
    and KDA's after; the plain norms of Nemotron-H and Kimi-Linear round before the weight,
    OLMo-hybrid's do not, Qwen3.5's are zero-centred; Nemotron-H's MLPs square a ReLU, the others
    gate a SiLU): a ragged left-padded batch, and a prompt continued in forwards of 3 tokens (fewer
    than the conv's 4, so its history spans forwards). Every plain norm of the model ran the
    kernel, every MLP the activation kernel, and the modules' forwards are their own afterwards."""
    from specdec.kernels.conv1d.triton_conv import Conv1dTritonKernels
    from specdec.kernels.linear import triton_activation
    from specdec.kernels.norm import triton_norm

    # the small models (one SSM and one attention layer, an MLP after each: every norm form and MLP kind of the
    # family) but Nemotron-H's, whose small model has no MLP layer
    ad = model_of(family)[1] if family == "nemotron_h" else specdec.models.adapter_for(make_model(family, small=True))
    # half the other tests' prompt lengths (the longest still past Nemotron-H's 16-token scan chunk): the
    # interpreter runs each norm and activation kernel once per token
    ids, mask = ragged_prompts(lengths=SHORT_LENGTHS)
    calls, norms = [], []
    original = Conv1dTritonKernels.prompt
    monkeypatch.setattr(Conv1dTritonKernels, "prompt",
                        lambda self, *a: calls.append(a[-1] is not None) or original(self, *a))  # a[-1]: history
    norm_kernel, plain_kernel, plain = triton_norm.gated_rms_norm_triton, triton_norm.rms_norm_triton, []
    monkeypatch.setattr(triton_norm, "gated_rms_norm_triton",
                        lambda y, *a, **k: norms.append(y.shape[:-1]) or norm_kernel(y, *a, **k))
    monkeypatch.setattr(triton_norm, "rms_norm_triton", lambda x, w, *a, **k: plain.append(w) or plain_kernel(x, w, *a, **k))
    act_kernel, acts = triton_activation.mlp_activation_triton, []
    monkeypatch.setattr(triton_activation, "mlp_activation_triton", lambda g, u, a: acts.append(a) or act_kernel(g, u, a))
    forwards = [mod.__dict__.get("forward") for mod in ad.model.modules()]
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SPECDEC_BACKEND", backend)
        before, before_plain, before_acts = len(norms), len(plain), len(acts)
        runs[backend] = [prefill(ad, ids, mask, "torch"), prefill(ad, ids[:1], mask[:1], "torch", max_tokens=3)]
        assert ((len(norms) > before) == (len(plain) > before_plain) == (len(acts) > before_acts)
                == (backend == "triton")), backend
    ran = {id(w) for w in plain}
    routed_norms, routed_mlps = ad._prompt_routes()
    assert routed_norms and all(id(mod.weight) in ran for mod, _ in routed_norms)
    assert {form[1:] for _, form in routed_norms} == {
        "nemotron_h": {(False, True)}, "kimi_linear": {(False, True)}, "olmo_hybrid": {(False, False)},
        "qwen3_5": {(True, False)}}[family]
    activation = "relu2" if family == "nemotron_h" else "silu"
    assert routed_mlps and {plan.activation for _, plan in routed_mlps} == set(acts) == {activation}
    assert len(acts) % len(routed_mlps) == 0 and len(acts) > len(routed_mlps)  # every MLP in every forward
    assert [mod.__dict__.get("forward") for mod in ad.model.modules()] == forwards
    before_plain, before_acts = len(plain), len(acts)
    prefill(ad, ids, mask, "hf")  # transformers' own forward, norms and MLPs included
    assert len(plain) == before_plain and len(acts) == before_acts
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setenv("SPECDEC_PROMPT_KERNELS", "0")  # the A/B switch: transformers' modules
    off = prefill(ad, ids, mask, "torch")
    assert len(plain) == before_plain and len(acts) == before_acts and rel_err(off[0], runs["torch"][0][0]) < TOL
    assert False in calls and True in calls  # the kernel ran, from zeros and from a history
    for (logits, states), (logits_t, states_t) in zip(runs["torch"], runs["triton"]):
        assert rel_err(logits_t, logits) < TOL
        for idx, (ssm_state, conv_state) in states.items():
            assert rel_err(states_t[idx][0], ssm_state) < TOL and rel_err(states_t[idx][1], conv_state) < TOL


@needs_triton_interpreter
def test_prompt_kernels_follow_modules_changed_after_the_first_prompt(monkeypatch):
    """The Triton prompt path reads each MLP's plan anew at every prompt: after a first prefill,
    projections replaced by another module (an adapter's, a quantised linear's) run, so the logits
    and states equal the torch backend's on the changed model, not the first prompt's."""
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    # the small model (an MLP after each of its two layers) and short prompts: the interpreter runs every
    # norm and activation kernel once per token
    ad = specdec.models.adapter_for(make_model("qwen3_5", small=True))
    ids, mask = ragged_prompts(lengths=SHORT_LENGTHS)
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    first = prefill(ad, ids, mask, "torch")
    for mod in ad.model.modules():
        if type(mod).__name__.endswith("MLP"):
            old = mod.up_proj
            mod.up_proj = Doubled(old.in_features, old.out_features, bias=False)
            mod.up_proj.load_state_dict(old.state_dict())
    got = prefill(ad, ids, mask, "torch")
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")
    want = prefill(ad, ids, mask, "torch")
    assert rel_err(got[0], want[0]) < TOL and rel_err(first[0], want[0]) > 1e-2
    for idx in want[1]:
        assert rel_err(got[1][idx][0], want[1][idx][0]) < TOL


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_speculative_exact_with_long_prompts(family):
    """Speculative greedy output equals HF's ``generate`` with prompts longer than the chunk."""
    model = make_model(family)
    ids, mask = ragged_prompts(lengths=LENGTHS)
    ref = hf_greedy(model, ids, mask, max_new=10)
    sd = specdec.wrap(model, drafter="ngram", rollback="snapshot", num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(out, ref), f"\n{out[:, ids.shape[1]:]}\n{ref[:, ids.shape[1]:]}"


@pytest.fixture
def fla_reference(monkeypatch):
    """fla's own torch reference of ``chunk_simple_gla`` in place of the kernel, so the fla scan
    runs on any device (skipped without flash-linear-attention)."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    import fla.ops.simple_gla

    def reference(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                  **kw):
        # fla's reference keeps the state [K, V]; state_v_first asks for [V, K] in and out
        flip = (lambda s: s.transpose(-1, -2)) if state_v_first else (lambda s: s)
        y, h = naive.naive_recurrent_simple_gla(q, k, v, g, scale=scale,
                                                initial_state=None if initial_state is None else flip(initial_state),
                                                output_final_state=output_final_state)
        return y, flip(h)

    monkeypatch.setattr(fla.ops.simple_gla, "chunk_simple_gla", reference)


def test_fla_arguments_against_fla_reference(fla_reference):
    """The scan's mapping onto fla's simple GLA (q = C, k = B per head, v = dt x, g = dt A, scale
    1, the state V-first), through fla's reference; P != N, so a state in the wrong layout shows."""
    x, dt, A, B, C, D, h0 = scan_inputs(2, 37, 4, 12, 2, 20)
    y, h = mamba2_chunk_scan(x, dt, A, B, C, 16, D, h0)
    y_fla, h_fla = mamba2_chunk_scan_fla(x, dt, A, B, C, D, h0)
    assert y_fla.dtype == h_fla.dtype == torch.float32
    assert rel_err(y_fla, y) < TOL and rel_err(h_fla, h) < TOL


def test_fla_bf16_operands_against_fla_reference(fla_reference):
    """bf16 operands (a bf16 model's prefill): ``y`` comes back in bf16, the state in fp32; x, B, C
    handed in bf16 give bit for bit what their fp32 copies give (v = dt x and y + D x are formed in
    fp32 and rounded once either way), and the scan agrees with the fp32 torch scan to bf16's
    rounding."""
    x, dt, A, B, C, D, h0 = scan_inputs(2, 37, 4, 12, 2, 20)
    x16, B16, C16 = (t.bfloat16() for t in (x, B, C))
    y16, h16 = mamba2_chunk_scan_fla(x16, dt, A, B16, C16, D, h0, operand_dtype=torch.bfloat16)
    y32, h32 = mamba2_chunk_scan_fla(x16.float(), dt, A, B16.float(), C16.float(), D, h0,
                                     operand_dtype=torch.bfloat16)
    assert y16.dtype == y32.dtype == torch.bfloat16 and h16.dtype == torch.float32
    assert torch.equal(y16, y32) and torch.equal(h16, h32)
    y, h = mamba2_chunk_scan(x16, dt, A, B16, C16, 16, D, h0)
    assert rel_err(y16.float(), y) < 2e-2 and rel_err(h16, h) < 2e-2


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("b,L", [(2, 1000), (16, 128)], ids=["B2-T1000", "B16-T128"])
def test_fla_scan_matches_torch_scan(b, L):
    """fla's ``chunk_simple_gla`` against the fp32 torch scan at a 4B model's head shape
    (H 16 of 64 x 128, 2 groups); TF32 matmuls bound the agreement at ~1e-3. The torch scan on
    CUDA against the per-token recurrence, fp32."""
    pytest.importorskip("fla.ops.simple_gla")
    x, dt, A, B, C, D, h0 = scan_inputs(b, L, 16, 64, 2, 128, device="cuda")
    dt = dt * 0.1
    y, h = mamba2_chunk_scan(x, dt, A, B, C, 128, D, h0)
    y_fla, h_fla = mamba2_chunk_scan_fla(x, dt, A, B, C, D, h0)
    assert h_fla.shape == h.shape and y_fla.shape == y.shape
    assert rel_err(y_fla, y) < 5e-3 and rel_err(h_fla, h) < 5e-3
    # bf16 operands (a bf16 model's prefill): bf16 rounding of q, k, v bounds the agreement
    y16, h16 = mamba2_chunk_scan_fla(x, dt, A, B, C, D, h0, operand_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    assert rel_err(y16.float(), y) < 2e-2 and rel_err(h16, h) < 2e-2
    y_ref, states, _ = mamba2_verify(h0, x[:, :200], dt[:, :200], A, B[:, :200], C[:, :200], D, return_states=True)
    y200, h200 = mamba2_chunk_scan(x[:, :200], dt[:, :200], A, B[:, :200], C[:, :200], 128, D, h0)
    assert rel_err(y200, y_ref) < TOL and rel_err(h200, states[:, -1]) < TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_conv_on_cuda(dtype):
    """The Triton prompt conv at a 4B Mamba-2 model's conv width (9216 channels, W 4), a strided
    prompt of 1000 tokens and a history, against the torch reference."""
    op = conv1d_op("cuda")
    assert op.backend == "triton"
    x, weight, bias, history = conv_inputs(3, 1000, 9216, 4, seed=5, device="cuda", dtype=dtype)
    for h in (None, history):
        y, ref = op.prompt(x, weight, bias, "silu", h), causal_conv1d_prompt(x, weight, bias, "silu", h)
        assert y.dtype == dtype and rel_err(y.double(), ref.double()) < (TOL if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_cuda
def test_fla_prefill_on_cuda():
    """On CUDA: a Nemotron-H prefill with fla's scan against HF's own (its torch fallback), fp32
    (TF32 bounds the agreement); ``auto`` picks fla for a bf16 model (the torch scan for fp32),
    and speculative output with that prefill equals plain decoding's through the same engine."""
    pytest.importorskip("fla.ops.simple_gla")
    model = make_model("nemotron_h").cuda()
    ad = specdec.models.adapter_for(model)
    ids, mask = (t.cuda() for t in ragged_prompts(lengths=LENGTHS))
    logits, states = prefill(ad, ids, mask, "fla")
    hf_logits, hf = prefill(ad, ids, mask, "hf")
    assert rel_err(logits, hf_logits) < 5e-3
    for idx in states:
        assert rel_err(states[idx][0], hf[idx][0]) < 5e-3 and rel_err(states[idx][1], hf[idx][1]) < 5e-3
    assert resolve_scan("auto", "cuda", torch.float32) == "torch" and resolve_scan("auto", "cuda") == "fla"
    model = model.bfloat16()
    kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    plain = specdec.wrap(model, num_speculative_tokens=0).generate(ids, **kw)
    sd = specdec.wrap(model, drafter="ngram", rollback="snapshot", num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, **kw), plain)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_5", "olmo_hybrid", "kimi_linear"])
def test_delta_rule_fla_prefill_on_cuda(family):
    """On CUDA: a delta-rule prefill through the prompt layer with fla's chunked rule
    (``chunk_gated_delta_rule``, ``chunk_kda``) against the torch reference path, fp32 (TF32
    bounds the agreement) and bf16 (its rounding bounds it), on a ragged left-padded batch;
    speculative output with that prefill equals plain decoding's through the same engine."""
    pytest.importorskip("fla.ops.kda" if family == "kimi_linear" else "fla.ops.gated_delta_rule")
    model = make_model(family).cuda()
    ad = specdec.models.adapter_for(model)
    ids, mask = (t.cuda() for t in ragged_prompts(lengths=LENGTHS))
    # whole-model bounds on these tiny models (errors grow layer by layer): fp32 with TF32 matmuls,
    # bf16 operands (rounding them alone moves OLMo-hybrid's last state ~4e-2); a wrong scale, layout
    # or gate would be off by O(1)
    for dtype, tol in ((torch.float32, 1e-2), (torch.bfloat16, 1e-1)):
        model.to(dtype)
        logits, states = prefill(ad, ids, mask, "fla")
        ref_logits, ref = prefill(ad, ids, mask, "torch")
        assert rel_err(logits, ref_logits) < tol, dtype
        for idx in states:
            assert rel_err(states[idx][0], ref[idx][0]) < tol and rel_err(states[idx][1], ref[idx][1]) < tol, (dtype, idx)
    kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    plain = specdec.wrap(model, num_speculative_tokens=0).generate(ids, **kw)
    sd = specdec.wrap(model, drafter="ngram", rollback="snapshot", num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, **kw), plain)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "olmo_hybrid", "kimi_linear"])
def test_fla_rule_takes_the_conv_q_and_k(family, monkeypatch):
    """Through fla's chunked rule, a delta-rule prompt hands it q and k as the conv leaves them,
    one per key head (the Gated DeltaNet families' 2 value heads each here), to L2-normalise in its
    kernel with scale ``1/sqrt(d_k)``, as transformers' prefill has fla do; the states and logits
    are the torch reference path's. fla's rule is stood in for by its documented semantics (``HV``
    value heads reading key head ``i // (HV / H)``, q / k normalised as ``x / sqrt(sum(x^2) +
    1e-6)`` in fp32 when asked) over transformers' torch rule, so this runs without fla or a GPU;
    ``test_delta_rule_fla_prefill_on_cuda`` runs fla's own kernels."""
    import importlib
    import sys
    import types

    import specdec.models.base as base

    model = make_model(family)
    ad = specdec.models.adapter_for(model)
    prompt_layer = base.PROMPT_LAYERS[ad.op_name]
    mixer = next(iter(ad.ssm_layers().values()))[0]
    torch_rule = getattr(importlib.import_module(type(mixer).__module__), prompt_layer.torch_rule)
    calls = []

    def rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kw):
        calls.append((q.shape[2], v.shape[2], use_qk_l2norm_in_kernel))
        q, k, K = q.float(), k.float(), q.shape[-1]
        if use_qk_l2norm_in_kernel:  # fla's l2norm_fwd
            q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
        scale = K**-0.5 if scale is None else scale
        return torch_rule(q * (scale * K**0.5), k, v.float(), g=g, beta=beta.float(), initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=False)

    module, name = prompt_layer.fla_rule
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{name: rule}))
    monkeypatch.setattr(base, "resolve_scan", lambda scan, *a: scan)  # "fla" on the CPU
    gva = family != "kimi_linear"
    ids, mask = ragged_prompts(lengths=LENGTHS)
    monkeypatch.setenv("SPECDEC_PROMPT_KERNELS", "0")  # the A/B switch: q and k normalised per value head, as before
    prefill(ad, ids, mask, "fla")
    assert calls and not any(raw for _, _, raw in calls) and all(hq == hv for hq, hv, _ in calls)
    calls.clear()
    monkeypatch.delenv("SPECDEC_PROMPT_KERNELS")
    for max_tokens in (None, 3):  # also continued in forwards of 3 tokens, from a state
        rows = slice(None) if max_tokens is None else slice(0, 1)
        logits, states = prefill(ad, ids[rows], mask[rows], "fla", max_tokens=max_tokens)
        assert calls and all(raw and (hq < hv if gva else hq == hv) for hq, hv, raw in calls), calls
        calls.clear()
        ref_logits, ref = prefill(ad, ids[rows], mask[rows], "torch", max_tokens=max_tokens)
        assert not calls
        assert rel_err(logits, ref_logits) < TOL
        for idx in ref:
            assert rel_err(states[idx][0], ref[idx][0]) < TOL and rel_err(states[idx][1], ref[idx][1]) < TOL, idx


def test_a_mixer_without_transformers_torch_rule_keeps_transformers_forward(monkeypatch):
    """A delta-rule mixer whose modeling module lacks the torch reference the prompt layer calls
    (remote code, another release) is not routed with ``scan="torch"``: it runs transformers' own
    prefill, with the same result, and its prompts continued from a prefix cache are not batched
    (its padding is not state-neutral there)."""
    from specdec.models.gdn import GDNPromptLayer

    model = make_model("qwen3_5")
    ad = specdec.models.adapter_for(model)
    ids, mask = ragged_prompts(lengths=LENGTHS)
    want = prefill(ad, ids, mask, "hf")
    assert ad.batches_cached_prefill("torch")
    monkeypatch.setattr(GDNPromptLayer, "torch_rule", "no_such_function")
    calls = []
    monkeypatch.setattr(DeltaRulePromptLayer, "ssm", lambda self, *a: calls.append(self))
    got = prefill(ad, ids, mask, "torch")
    assert calls == [] and not ad.batches_cached_prefill("torch")
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][i][0], want[1][i][0]) for i in want[1])
