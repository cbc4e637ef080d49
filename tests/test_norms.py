"""The RMSNorms of :mod:`specdec.kernels.norm`: the gated norms of the Mamba-2, Gated DeltaNet and KDA
families' mixers and the decoder layers' plain norms. Each torch form against each transformers class it stands for, the Triton kernel against that form (Triton's
interpreter at tiny sizes; compiled with ``SPECDEC_TEST_CUDA=1``), on fresh random inputs with
the gate a slice of a wider projection as the layers pass it, outputs poisoned first and the
inputs checked untouched; classes it does not stand for are left to their own forward."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import rel_err, within_ulp
from markers import ON_CUDA, needs_triton_interpreter

from specdec.kernels.norm import (gated_norm_form, gated_rms_norm, gated_rms_norm_reference, rms_norm, rms_norm_form,
                                  rms_norm_reference)

DEVICE = "cuda" if ON_CUDA else "cpu"

pytestmark = needs_triton_interpreter if not ON_CUDA else []

#: (transformers module, class, constructor keywords besides the width, the group size it normalises by
#: (None: every channel), whether it gates after the norm, its gate's activation, whether it rounds
#: between its steps)
CLASSES = [
    ("mamba2", "MambaRMSNormGated", {}, None, False, "silu", True),
    ("bamba", "BambaRMSNormGated", {}, None, False, "silu", True),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", {}, None, False, "silu", True),
    ("zamba2", "Zamba2RMSNormGated", {"group_size": 12}, 12, False, "silu", True),
    ("qwen3_next", "Qwen3NextRMSNormGated", {}, None, True, "silu", True),
    ("qwen3_5", "Qwen3_5RMSNormGated", {}, None, True, "silu", True),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated", {}, None, True, "silu", True),
    ("olmo_hybrid", "OlmoHybridRMSNormGated", {}, None, True, "silu", True),
    ("kimi_linear", "KimiLinearRMSNormGated", {}, None, True, "sigmoid", False),
]


def _norm(module, cls, kwargs, D, dtype, seed):
    norm = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(D, **kwargs)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=torch.Generator().manual_seed(seed)))
    return norm.to(DEVICE, dtype)


def _inputs(B, t, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(B, t, D, generator=gen).to(DEVICE, dtype)
    proj = torch.randn(B, t, D + 9, generator=gen).mul(2).to(DEVICE, dtype)
    return y, proj[..., 5 : 5 + D]  # the gate: a slice of the input projection's output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module, cls, kwargs, group, after, activation, rounded", CLASSES, ids=[c[1] for c in CLASSES])
def test_kernel_and_reference_are_the_module(module, cls, kwargs, group, after, activation, rounded, dtype):
    """The torch form equals the module's forward bit for bit; the kernel equals it within fp32
    rounding, in fp16 under Triton's interpreter bit for bit (so its roundings are the module's:
    left out, they change outputs here; KDA's, which rounds once, in all but a few outputs, by one
    unit in the last place: a rounding too many changes ~30%), otherwise within one unit in the last place of the output
    per rounding (the interpreter truncates bf16 conversions where the GPU rounds; on the GPU the
    fp32 sigmoid may differ from torch's in its last bit); the group size, the order, the gate's
    activation and the roundings are the class's."""
    D, B, t = 48, 3, 2
    norm = _norm(module, cls, kwargs, D, dtype, seed=1)
    y, gate = _inputs(B, t, D, dtype, seed=2)
    before = (y.clone(), gate.clone())
    form = gated_norm_form(norm, D)
    assert form == (group or D, after, activation, rounded)
    with torch.no_grad():
        want = norm(y, gate)
    ref = gated_rms_norm_reference(y, gate, norm.weight, norm.variance_epsilon, *form)
    assert ref.dtype == want.dtype and torch.equal(ref, want)
    out = torch.full_like(y, float("nan"))
    got = gated_rms_norm(y, gate, norm.weight, norm.variance_epsilon, *form, out=out)
    assert got is out and not got.isnan().any()
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    elif dtype == torch.float16 and not ON_CUDA and rounded:
        assert torch.equal(got, want)
    elif dtype == torch.float16 and not ON_CUDA:  # one rounding, of fp32 values that may differ in their last bit:
        assert within_ulp(got, want, moved=0.02)  # within one unit, and rarely (a rounding too many: ~30%)
    else:  # two roundings (the normalised value, then the product), three with the gate after; KDA's one
        assert within_ulp(got, want, (3 if after else 2) if rounded else 1)
    assert torch.equal(y, before[0]) and torch.equal(gate, before[1])


def test_rows_of_any_layout():
    """Inputs whose rows are not contiguous are read from a copy: the same outputs."""
    y, gate = _inputs(3, 2, 48, torch.float32, seed=5)
    w = torch.randn(48, device=DEVICE)
    for after, activation, rounded in ((False, "silu", True), (True, "silu", True), (True, "sigmoid", False)):
        want = gated_rms_norm(y, gate, w, 1e-6, 12, after, activation, rounded)
        y_t = y.transpose(1, 2).contiguous().transpose(1, 2)  # same values, channels 2 apart
        assert torch.equal(gated_rms_norm(y_t, gate[..., :].contiguous(), w, 1e-6, 12, after, activation, rounded),
                           want)


def test_other_norms_are_left_to_their_forward():
    """A gated norm of another arithmetic (Falcon-H1's, whose gate may come after the norm; a
    Gated DeltaNet or KDA norm given the other's gate activation), a class
    of the same name defined outside transformers (a checkpoint's own modeling code, e.g. a grouped
    ``MambaRMSNormGated``), any other module, and a group size that does not divide the channels
    give None."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

    assert gated_norm_form(FalconH1RMSNormGated(48, n_groups=2), 48) is None
    silu = KimiLinearRMSNormGated(48)
    silu.activation = "silu"  # (its fp32 arithmetic with another gate: none of the kernel's)
    assert gated_norm_form(silu, 48) is None
    sigmoid = _norm("qwen3_5", "Qwen3_5RMSNormGated", {}, 48, torch.float32, 3)
    sigmoid.activation = "sigmoid"
    assert gated_norm_form(sigmoid, 48) is None
    assert gated_norm_form(torch.nn.LayerNorm(48), 48) is None
    remote = type("MambaRMSNormGated", (torch.nn.Module,), {"__module__": "transformers_modules.nvidia.modeling"})()
    remote.group_size = 8
    assert gated_norm_form(remote, 48) is None
    grouped = _norm("mamba2", "MambaRMSNormGated", {}, 48, torch.float32, 3)
    grouped.group_size = 8  # (a one-group class given a group size: not this arithmetic any more)
    assert gated_norm_form(grouped, 48) is None
    assert gated_norm_form(_norm("zamba2", "Zamba2RMSNormGated", {"group_size": 12}, 48, torch.float32, 3), 50) is None


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "gate": a["gate"][:, :1]}, "expected y and gate"),
    (lambda a: {**a, "weight": a["weight"][:4]}, "expected y and gate"),
    (lambda a: {**a, "group_size": 7}, "does not divide"),
    (lambda a: {**a, "weight": a["weight"].double()}, "weight must be"),
    (lambda a: {**a, "out": torch.empty(3, 2, 48, dtype=torch.float64, device=DEVICE)}, "out must be"),
    (lambda a: {**a, "activation": "relu"}, "activation must be"),
])
def test_bad_input_is_named(change, match):
    y, gate = _inputs(3, 2, 48, torch.float32, seed=4)
    args = change({"y": y, "gate": gate, "weight": torch.randn(48, device=DEVICE), "eps": 1e-6, "group_size": 12})
    with pytest.raises(ValueError, match=match):
        gated_rms_norm(**args)


#: (transformers module, class, the zero-centred weight, the rounding before the weight's product)
PLAIN = [
    ("mamba", "MambaRMSNorm", False, True),
    ("mamba2", "Mamba2RMSNorm", False, True),
    ("bamba", "BambaRMSNorm", False, True),
    ("granitemoehybrid", "GraniteMoeHybridRMSNorm", False, True),
    ("nemotron_h", "NemotronHRMSNorm", False, True),
    ("zamba2", "Zamba2RMSNorm", False, True),
    ("falcon_h1", "FalconH1RMSNorm", False, True),
    ("lfm2", "Lfm2RMSNorm", False, True),
    ("kimi_linear", "KimiLinearRMSNorm", False, True),
    ("llama", "LlamaRMSNorm", False, True),
    ("mistral", "MistralRMSNorm", False, True),
    ("mixtral", "MixtralRMSNorm", False, True),
    ("qwen2", "Qwen2RMSNorm", False, True),
    ("qwen2_moe", "Qwen2MoeRMSNorm", False, True),
    ("qwen3", "Qwen3RMSNorm", False, True),
    ("qwen3_moe", "Qwen3MoeRMSNorm", False, True),
    ("phi3", "Phi3RMSNorm", False, True),
    ("granite", "GraniteRMSNorm", False, True),
    ("olmo_hybrid", "OlmoHybridRMSNorm", False, False),
    ("olmo2", "Olmo2RMSNorm", False, False),
    ("qwen3_next", "Qwen3NextRMSNorm", True, False),
    ("qwen3_5", "Qwen3_5RMSNorm", True, False),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNorm", True, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module, cls, offset, rounded", PLAIN, ids=[c[1] for c in PLAIN])
def test_plain_kernel_and_reference_are_the_module(module, cls, offset, rounded, dtype):
    """The torch form equals each plain RMSNorm class's forward bit for bit; the kernel equals it
    within fp32 rounding, in fp16 under Triton's interpreter bit for bit where the class rounds twice
    and within one unit in the last place, rarely, where it rounds once (a rounding too many, or the
    weight's offset left out, changes far more); otherwise within one unit per rounding. The rows are
    strided (a slice of a wider tensor, as a layer's q / k heads come), eps is the class's."""
    D, B, t = 40, 3, 5
    norm = _norm(module, cls, {"eps": 1e-5}, D, dtype, seed=11)
    wide = torch.randn(B, t, D + 7, generator=torch.Generator().manual_seed(12)).mul(3).to(DEVICE, dtype)
    x = wide[..., 3:3 + D]
    before = wide.clone()
    form = rms_norm_form(norm)
    assert form == (1e-5, offset, rounded)
    with torch.no_grad():
        want = norm(x)
    ref = rms_norm_reference(x, norm.weight, *form)
    assert ref.dtype == want.dtype == dtype and torch.equal(ref, want)
    out = torch.full_like(x, float("nan"))
    got = rms_norm(x, norm.weight, *form, out=out)
    assert got is out and not got.isnan().any()
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    elif dtype == torch.float16 and not ON_CUDA and rounded:
        assert torch.equal(got, want)
    elif dtype == torch.float16 and not ON_CUDA:
        assert within_ulp(got, want, moved=0.02)
    else:
        assert within_ulp(got, want, 2 if rounded else 1)
    assert torch.equal(wide, before)


def test_plain_forms_are_told_apart():
    """Each arithmetic's kernel differs from the others' on the same inputs (so the tests above
    would see a class given another's form), and rows of any layout give the same outputs."""
    x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(13)).to(DEVICE, torch.float16)
    w = torch.randn(64, generator=torch.Generator().manual_seed(14)).to(DEVICE, torch.float16)
    outs = [rms_norm(x, w, 1e-6, offset, rounded) for offset, rounded in ((False, True), (False, False), (True, False))]
    assert (outs[0] != outs[1]).float().mean() > 0.1 and (outs[2] - outs[1]).abs().max() > 0.5
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)  # rows of D at another stride order: copied
    assert torch.equal(rms_norm(x_t, w, 1e-6, False, True), outs[0])
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 3, 64)


def test_other_plain_norms_are_left_to_their_forward():
    """Norms of other arithmetics (LayerNorm; Gemma's zero-centred norm, not listed), a class of a
    listed name defined outside transformers, and a listed class without its epsilon give None."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    assert rms_norm_form(torch.nn.LayerNorm(48)) is None
    assert rms_norm_form(torch.nn.RMSNorm(48)) is None
    assert rms_norm_form(GemmaRMSNorm(48)) is None
    remote = type("NemotronHRMSNorm", (torch.nn.Module,), {"__module__": "transformers_modules.nvidia.modeling"})()
    remote.weight, remote.variance_epsilon = torch.nn.Parameter(torch.ones(48)), 1e-6
    assert rms_norm_form(remote) is None
    norm = _norm("nemotron_h", "NemotronHRMSNorm", {}, 48, torch.float32, 3)
    del norm.variance_epsilon
    assert rms_norm_form(norm) is None


def test_routed_norms_leave_other_calls_to_their_forward(monkeypatch):
    """Inside :func:`~specdec.models.common.prompt_kernels` a routed norm runs the kernel only for one
    positional input in its weight's dtype (fp32 / bf16 / fp16) and device; a keyword call, extra
    arguments, an input in another dtype than the weight's, an fp64 module and a call inside a
    ``torch.compile`` trace run the class's forward with the class's result; afterwards the modules'
    forwards are their own."""
    from specdec.kernels.norm import triton_norm
    from specdec.models.common import plain_norms, prompt_kernels

    calls = []
    kernel = triton_norm.rms_norm_triton
    monkeypatch.setattr(triton_norm, "rms_norm_triton", lambda x, *a, **k: calls.append(x.dtype) or kernel(x, *a, **k))
    body = torch.nn.Sequential(_norm("nemotron_h", "NemotronHRMSNorm", {}, 32, torch.float16, 5),
                               _norm("qwen3_5", "Qwen3_5RMSNorm", {}, 32, torch.float64, 6))
    mixed = _norm("llama", "LlamaRMSNorm", {}, 32, torch.float32, 7)  # fp32 weight, fp16 input
    body.append(mixed)
    norms = plain_norms(body.modules())
    assert [mod for mod, _ in norms] == list(body)
    half, double = (torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE, dt)
                    for dt in (torch.float16, torch.float64))
    with torch.no_grad():
        want = [type(body[0]).forward(body[0], half), type(body[1]).forward(body[1], double),
                type(mixed).forward(mixed, half)]
        with prompt_kernels(norms):
            got = [body[0](hidden_states=half), body[1](double), mixed(half)]
            assert calls == []
            routed = body[0](half)
            assert calls == [torch.float16]
            with pytest.raises(TypeError):  # extra arguments reach the class's forward, which takes none
                body[0](half, 1.0)
            compiled = torch.compile(lambda t: body[0](t), backend="eager")(half)
            assert calls == [torch.float16]
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(compiled, want[0]) and rel_err(routed.float(), want[0].float()) < 1e-3
    assert all("forward" not in mod.__dict__ for mod in body)


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "x": a["x"].double(), "weight": a["weight"].double()}, "x must be"),
    (lambda a: {**a, "weight": a["weight"][:4]}, "expected x"),
    (lambda a: {**a, "weight": a["weight"].double()}, "weight must be"),
    (lambda a: {**a, "out": torch.empty(3, 2, 48, dtype=torch.float64, device=DEVICE)}, "out must be"),
    (lambda a: {**a, "out": torch.empty(3, 48, 2, device=DEVICE).transpose(1, 2)}, "out must be"),
])
def test_plain_bad_input_is_named(change, match):
    x = torch.randn(3, 2, 48, device=DEVICE)
    args = change({"x": x, "weight": torch.randn(48, device=DEVICE), "eps": 1e-6})
    with pytest.raises(ValueError, match=match):
        rms_norm(**args)
