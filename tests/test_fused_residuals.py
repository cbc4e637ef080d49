"""Residual adds deferred into the norms that read them (:mod:`specdec.residual`, inside
:func:`specdec.fusion.fused`): every family's forward and greedy output unchanged, the adds of
the standard pre-norm layers all taken by a norm, a pending sum computed before any other use,
and the compiled add-then-norm rounding as the eager add and norm do (Inductor on the CPU).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from helpers import hf_greedy
from markers import needs_cuda
from tiny_models import EXTRA_FAMILIES, FAMILIES, get_model, ragged_prompts

import specdec
import specdec.residual as residual
from specdec import fusion
from specdec.residual import DeferredResidual, is_pending


def norm_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def counted(monkeypatch) -> dict:
    """Route the module's deferrals, norm consumptions and eager computations through counters."""
    seen = {"deferred": 0, "consumed": 0, "computed": 0}
    defer, consume, plain = residual._defer, residual.consume, residual.plain

    def deferring(*a):
        r = defer(*a)
        seen["deferred"] += r is not None
        return r

    def consuming(*a):
        seen["consumed"] += 1
        return consume(*a)

    def computing(t, compute=True):
        seen["computed"] += bool(compute and is_pending(t))
        return plain(t, compute)

    monkeypatch.setattr(residual, "_defer", deferring)
    monkeypatch.setattr(residual, "consume", consuming)
    monkeypatch.setattr(residual, "plain", computing)
    return seen


#: adds a step's forward defers, and how many of them a norm takes, per family's tiny model: the
#: standard pre-norm layers all (two a layer; Nemotron-H's blocks one); Zamba2's shared block reads
#: one sum otherwise (computed eagerly); Granite-4 scales its branches (no add of a branch as it is)
EXPECTED = {"qwen3_5": (8, 8), "qwen3_next": (8, 8), "nemotron_h": (5, 5), "kimi_linear": (8, 8),
            "qwen3_5_moe": (8, 8), "bamba": (8, 8), "falcon_h1": (3, 3), "granitemoehybrid": (0, 0),
            "zamba2": (3, 2), "mamba2": (None, None), "olmo_hybrid": (None, None), "lfm2": (8, 8)}


@pytest.mark.parametrize("family", FAMILIES + EXTRA_FAMILIES + ("llama", "phi3"))
def test_forward_and_greedy_output_are_unchanged(family, monkeypatch):
    """fp32 tiny models: inside fused() (compiling replaced by the eager forwards: what is checked
    is the deferral) a forward's logits equal the model's bit for bit, the norms take the adds
    listed in EXPECTED, and the engine's greedy output equals HF greedy; nothing stays routed or
    hooked afterwards."""
    monkeypatch.setattr(fusion, "_compiled", lambda key, fn, options=None: fn)
    model = get_model(family)
    ids, mask = ragged_prompts()
    with torch.no_grad():
        want_logits = model(ids[:, -2:]).logits
        seen = counted(monkeypatch)
        with fusion.fused(model):
            got = model(ids[:, -2:]).logits
    assert type(got) is torch.Tensor and torch.equal(got, want_logits)
    deferred, consumed = EXPECTED.get(family, (None, None))
    if deferred is not None:
        assert (seen["deferred"], seen["consumed"]) == (deferred, consumed), seen
    else:
        assert seen["deferred"] == seen["consumed"] + seen["computed"], seen
    want = hf_greedy(model, ids, mask, 5)
    with fusion.fused(model):
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(out, want)
    assert all("forward" not in vars(m) and not m._forward_hooks for m in model.modules())


def test_a_pending_sum_is_computed_before_any_other_use():
    """branch + plain is pending (nothing written); any op on it -- a product, ``data_ptr``, a
    ``.to()`` that converts -- computes the sum first; a ``.to()`` that would return the tensor
    itself returns the pending sum; adds that do not qualify run at once; a branch in any other op
    is its plain value; results are plain tensors."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    for make in (lambda br: a + br, lambda br: br + a, lambda br: torch.add(a, br), lambda br: a.add(br)):
        s = make(DeferredResidual.of(b, "branch"))
        assert is_pending(s)
        assert s.to(torch.float32) is s and s.to("cpu") is s
        y = s * 2
        assert type(y) is torch.Tensor and not is_pending(s) and torch.equal(y, (a + b) * 2)
    s = a + DeferredResidual.of(b, "branch")
    s.data_ptr()
    assert s.kind == "done" and torch.equal(s.as_subclass(torch.Tensor), a + b)
    s = a + DeferredResidual.of(b, "branch")
    assert torch.equal(s.to(torch.float64), (a + b).double()) and s.kind == "done"
    done = s  # a written sum is a residual like any other: the next branch's add is deferred again
    t = done + DeferredResidual.of(b, "branch")
    assert is_pending(t)
    written = residual.consume(t, lambda x, y, out: torch.add(x, y, out=out).sum())
    assert torch.equal(written, (a + b + b).sum()) and torch.equal(t.as_subclass(torch.Tensor), a + b + b)
    br = DeferredResidual.of(b, "branch")
    for r in (br + a[:, :1], br.double() + a.double(), br + a.clone().requires_grad_()):  # (broadcast, dtype, grad)
        assert type(r) is torch.Tensor  # added at once
    assert type(DeferredResidual.of(b, "branch") * 3) is torch.Tensor


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_the_compiled_add_then_norm_rounds_as_the_eager_add_and_norm(family):
    """bf16, compiled by Inductor (on the CPU here): the sum written equals ``a + b`` and the norm
    of it equals the module's eager norm of the eagerly rounded sum, bit for bit."""
    check_add_then_norm(family, "cpu")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_the_compiled_add_then_norm_rounds_as_eager_on_gpu(family):
    """The same with Inductor's Triton kernels on the GPU, at a bench model's width."""
    check_add_then_norm(family, "cuda", width=2560)


def check_add_then_norm(family: str, device: str, width: int | None = None):
    norm = copy.deepcopy(next(m for m in norm_modules(get_model(family))))
    if width is not None:  # (a bench model's hidden size: the same class, a wider weight)
        norm.weight = torch.nn.Parameter(torch.randn(width) * 0.1)
    norm = norm.to(device=device, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(3, 2, norm.weight.shape[0], generator=gen).bfloat16().to(device) for _ in range(2))
    out = torch.full_like(a, float("nan"))
    with torch.no_grad():
        got = fusion._add_then(type(norm))(norm, a, b, out)
        want = norm(a + b)
    assert torch.equal(out, a + b) and torch.equal(got, want)


def test_another_thread_and_the_mlp_plans_see_no_change(monkeypatch):
    """A forward on another thread while a block is open returns plain tensors and defers nothing;
    the MLPs keep their two-launch plan with the block's hooks on them."""
    from specdec.models.mlp import mlp_plan

    monkeypatch.setattr(fusion, "_compiled", lambda key, fn, options=None: fn)
    model = get_model("qwen3_5")
    ids = torch.tensor([[3, 5, 7]])
    seen = counted(monkeypatch)
    mlp = next(m for m in model.modules() if type(m).__name__.endswith("MLP"))
    with residual.deferred_residuals(model, lambda: True):
        assert mlp._forward_hooks and mlp_plan(mlp) is not None
    with torch.no_grad(), fusion.fused(model):
        got = []
        t = threading.Thread(target=lambda: got.append(model(ids).logits))
        t.start()
        t.join(60)
    assert seen["deferred"] == 0 and type(got[0]) is torch.Tensor
    monkeypatch.setenv("SPECDEC_FUSED_RESIDUALS", "0")
    with fusion.fused(model):
        assert not mlp._forward_hooks


def test_tensors_of_the_residual_stream_trace_through_torch_compile():
    """What a DeferredResidual hands on -- its plain tensor, a pending sum, the addends of a
    consumed one -- traces through torch.compile (an alias made from the subclass would name the
    subclass as its base: a cycle dynamo recursed on), with the eager values."""
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    br = DeferredResidual.of(b, "branch")
    assert torch.equal(f(residual.plain(br)), b * 2 + 1)
    assert torch.equal(f(a + DeferredResidual.of(b, "branch")), (a + b) * 2 + 1)
    norm = copy.deepcopy(norm_modules(get_model("llama"))[0])
    a, b = (torch.randn(2, 1, norm.weight.shape[0], generator=gen) for _ in range(2))
    s = a + DeferredResidual.of(b, "branch")
    with torch.no_grad():
        got = residual.consume(s, lambda x, y, out: fusion._add_then(type(norm))(norm, x, y, out))
        assert torch.equal(got, norm(a + b))


def test_one_forward_inside_fused_with_torch_compile_equals_eager():
    """fp32 tiny Llama, one forward inside fused() with the real compiles (the norms, MLPs and
    rotary embedding, the add-then-norm): the logits equal the forward without deferred adds."""
    model = get_model("llama")
    ids = torch.tensor([[3, 5, 7, 9]])
    outs = {}
    with torch.no_grad():
        for switch in ("0", "1"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SPECDEC_FUSED_RESIDUALS", switch)
                with fusion.fused(model):
                    outs[switch] = model(ids).logits
    assert type(outs["1"]) is torch.Tensor
    torch.testing.assert_close(outs["1"], outs["0"], rtol=1e-5, atol=1e-6)


def test_gradients_flow_through_a_fused_block(monkeypatch):
    """With gradients on, branch outputs are not deferred (a subclass made of them would carry no
    history): every parameter gets the gradient it gets without the block."""
    monkeypatch.setattr(fusion, "_compiled", lambda key, fn, options=None: fn)
    model = copy.deepcopy(get_model("llama"))
    ids = torch.tensor([[3, 5, 7, 9]])
    grads = []
    for block in (False, True):
        model.zero_grad()
        with fusion.fused(model, enabled=block):
            model(ids).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_an_addend_written_before_the_sum_is_read_raises():
    """A pending sum is computed when read: an addend written in place in between (its version
    moved) raises instead of giving another sum."""
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    s = a + DeferredResidual.of(b, "branch")
    a.add_(1.0)
    with pytest.raises(RuntimeError, match="written in place before the sum was read"):
        s * 2


def test_the_residual_hooks_leave_the_skinny_linears_their_candidates(monkeypatch):
    """The linears routed through the skinny kernel inside fused() are the same with and without
    deferred adds (a layer's direct nn.Linear child, as Zamba2's, carries the residual hook)."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    model = get_model("zamba2")
    routed = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("SPECDEC_FUSED_RESIDUALS", switch)
        with fusion.fused(model):
            routed[switch] = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear and "forward" in vars(m)}
    assert routed["0"] and routed["1"] == routed["0"]
