"""A decode step's MLP in two launches: which MLPs qualify (:func:`specdec.models.mlp.mlp_plan`),
the launch before the down projection (:func:`specdec.kernels.linear.mlp_hidden`), and
:func:`specdec.fusion.fused` routing them.

The plans are checked against the modules themselves (the plan's reading of a module computes
the module's own output bit for bit, so gate and up cannot be swapped unseen); the kernel
through Triton's interpreter against the eager chain; greedy generation through the routed MLPs
against HF greedy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import hf_greedy, within_ulp
from markers import needs_triton_interpreter
from tiny_models import ATTENTION_FAMILIES, EXTRA_FAMILIES, FAMILIES, get_model, ragged_prompts

import specdec
import specdec.kernels.linear as linear_mod
from specdec import fusion
from specdec.kernels.linear import activation_ref, single_linears
from specdec.models.mlp import MLPPlan, mlp_plan

#: families whose tiny model's MLPs (every one of them) a plan covers; the others' forwards differ
#: (Zamba2's adapters, Falcon-H1's multipliers) or they have none outside their experts
PLANNED = {"qwen3_5", "qwen3_next", "nemotron_h", "kimi_linear", "qwen3_5_moe", "bamba", "granitemoehybrid",
           "olmo_hybrid", "lfm2", "llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "phi3", "olmo2", "granite"}


def mlps(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("MLP")]


def hidden_eager(plan: MLPPlan, x: torch.Tensor) -> torch.Tensor:
    """The down projection's input as the plan reads the module, with the module's own linears."""
    if plan.halves:
        g, u = plan.up(x).chunk(2, dim=-1)
    elif plan.gate is not None:
        g, u = plan.gate(x), plan.up(x)
    else:
        g, u = plan.up(x), None
    a = activation_ref(g, plan.activation).to(g.dtype)
    return a if u is None else a * u


@pytest.mark.parametrize("family", FAMILIES + EXTRA_FAMILIES + ATTENTION_FAMILIES)
def test_a_plan_computes_what_its_module_computes(family):
    """Every MLP a plan covers: the plan's reading (gate, up, halves, activation), run with the
    module's own linears, equals the module's forward bit for bit (fp32 and bf16)."""
    model = get_model(family)
    found = [(m, mlp_plan(m)) for m in mlps(model)]
    planned = [(m, p) for m, p in found if p is not None]
    assert bool(planned) == (family in PLANNED), [(type(m).__name__, p) for m, p in found]
    assert all(p is not None for _, p in found) or family not in PLANNED
    gen = torch.Generator().manual_seed(3)
    for mod, plan in planned[:2]:
        for dtype in (torch.float32, torch.bfloat16):
            m = copy.deepcopy(mod).to(dtype)
            p = mlp_plan(m)
            x = torch.randn(3, 2, p.up.in_features, generator=gen).to(dtype)
            with torch.no_grad():
                assert torch.equal(p.down(hidden_eager(p, x)), m(x)), (family, type(mod).__name__, dtype)


def test_plans_name_the_activation_and_layout():
    """Qwen3.5: a gated SiLU MLP; Nemotron-H: squared ReLU on one projection; Phi-3 and Granite-4
    hybrids: the gate and up as the halves of one projection."""
    q = mlp_plan(mlps(get_model("qwen3_5"))[0])
    assert (q.activation, q.halves, q.gate is not None) == ("silu", False, True)
    n = mlp_plan(mlps(get_model("nemotron_h"))[0])
    assert (n.activation, n.halves, n.gate) == ("relu2", False, None)
    for family in ("phi3", "granitemoehybrid"):
        p = mlp_plan(mlps(get_model(family))[0])
        assert p.halves and p.gate is None and p.activation == "silu"


def test_what_a_plan_refuses():
    """No plan for: another forward (a subclass's), a forward set on the instance, hooks on the
    module or a projection, an activation the kernel does not compute, a projection that is not a
    plain nn.Linear, gate and up that differ in having a bias, a fused gate-up of odd width."""
    base = mlps(get_model("qwen3_5"))[0]
    assert mlp_plan(base) is not None

    class Scaled(type(base)):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = copy.deepcopy(base)
    scaled.__class__ = Scaled
    variants = {"a subclass's forward": scaled}
    m = copy.deepcopy(base)
    m.forward = lambda x: x
    variants["an instance forward"] = m
    m = copy.deepcopy(base)
    m.register_forward_hook(lambda *a: None)
    variants["a module hook"] = m
    m = copy.deepcopy(base)
    m.up_proj.register_forward_pre_hook(lambda *a: None)
    variants["a projection hook"] = m
    m = copy.deepcopy(base)
    m.act_fn = torch.nn.GELU()
    variants["GELU"] = m
    m = copy.deepcopy(base)
    m.gate_proj = torch.nn.Linear(m.gate_proj.in_features, m.gate_proj.out_features, bias=True)
    variants["a gate with a bias"] = m
    m = copy.deepcopy(base)

    class Wrapped(torch.nn.Linear):
        pass

    m.down_proj = Wrapped(m.down_proj.in_features, m.down_proj.out_features, bias=False)
    variants["a Linear subclass"] = m
    m = copy.deepcopy(base)
    m.act_fn.register_forward_pre_hook(lambda mod, args: (args[0].clamp(max=0),))
    variants["an activation hook"] = m
    m = copy.deepcopy(base)
    m.act_fn.forward = torch.nn.functional.gelu
    variants["an activation forward on the instance"] = m
    m = copy.deepcopy(base)
    m.gate_proj = torch.nn.Linear(m.gate_proj.in_features, 1, bias=False)
    variants["a gate of another width"] = m
    phi = copy.deepcopy(mlps(get_model("phi3"))[0])
    phi.gate_up_proj = torch.nn.Linear(phi.gate_up_proj.in_features, 2 * phi.down_proj.in_features + 1, bias=False)
    variants["odd halves"] = phi
    planned = [name for name, mod in variants.items() if mlp_plan(mod) is not None]
    assert planned == []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert mlp_plan(base) is None  # a global hook would not see the projections the launch replaces
    finally:
        handle.remove()
    assert mlp_plan(base) is not None


def test_a_forward_replaced_on_the_class_is_read_again(monkeypatch):
    """A class whose forward is replaced after a plan was made (here by a wrapper keeping the
    original's name and source through functools.wraps) gets no plan; the original gets its plan
    back."""
    import functools

    base = mlps(get_model("qwen3_5"))[0]
    cls, original = type(base), type(base).forward
    assert mlp_plan(base) is not None
    monkeypatch.setattr(cls, "forward", functools.wraps(original)(lambda self, x: 0.5 * original(self, x)))
    assert mlp_plan(base) is None
    monkeypatch.setattr(cls, "forward", original)
    assert mlp_plan(base) is not None


@needs_triton_interpreter
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "phi3"])
def test_mlp_hidden_runs_one_launch_inside_single_linears_only(family, monkeypatch):
    """Inside a single_linears block, at most its rows: one launch (gated or with the activation)
    within fp32 rounding of the eager chain; outside a block, more rows, or a launch variant not
    yet run outside a capture (while capturing): None. A failing kernel warns once, then None."""
    monkeypatch.setattr(linear_mod, "_MLP_VARIANTS", linear_mod._Variants())
    mod = mlps(get_model(family))[0]
    plan = mlp_plan(mod)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, plan.up.in_features, generator=gen)
    launches = []
    for name in ("skinny_linear", "gated_skinny_linear"):
        real = getattr(linear_mod, name)
        monkeypatch.setattr(linear_mod, name, lambda *a, _r=real, _n=name, **k: (launches.append(_n), _r(*a, **k))[1])
    with torch.no_grad():
        want = hidden_eager(plan, x)
        assert linear_mod.mlp_hidden(x, plan) is None  # no block
        capturing = [True]
        monkeypatch.setattr(linear_mod, "_capturing", lambda t: capturing[0])
        with single_linears([], max_rows=8):
            assert linear_mod.mlp_hidden(x, plan) is None  # not warm: never first built in a capture
            capturing[0] = False
            got = linear_mod.mlp_hidden(x, plan)
            capturing[0] = True
            again = linear_mod.mlp_hidden(x, plan)  # warm now
            assert linear_mod.mlp_hidden(torch.randn(9, plan.up.in_features), plan) is None  # 9 rows > 8
    assert launches == ["skinny_linear" if plan.gate is None and not plan.halves else "gated_skinny_linear"] * 2
    assert torch.equal(got, again)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-6, err

    def broken(*a, **k):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(linear_mod, "_MLP_VARIANTS", linear_mod._Variants())
    monkeypatch.setattr(linear_mod, "skinny_linear", broken)
    monkeypatch.setattr(linear_mod, "gated_skinny_linear", broken)
    capturing[0] = False
    with single_linears([], max_rows=8), torch.no_grad():
        with pytest.warns(RuntimeWarning, match="fused MLP: the kernel failed .* no kernel for this device"):
            assert linear_mod.mlp_hidden(x, plan) is None
        assert linear_mod.mlp_hidden(x, plan) is None  # no second warning: that variant runs the module's forward


@needs_triton_interpreter
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_fused_runs_the_mlps_in_two_launches_and_greedy_is_unchanged(family, monkeypatch):
    """On the Triton backend, inside fused(): each MLP of a step (at most 16 rows) runs
    mlp_hidden then its down projection, and the engine's greedy output equals HF greedy;
    SPECDEC_FUSED_MLPS=0 (or SPECDEC_SKINNY_LINEARS=0) leaves the MLPs' own forward; the modules
    are as they were afterwards. (Compiling is replaced by the eager forward here: what is
    checked is the routing and the kernel.)"""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setattr(fusion, "_compiled", lambda key, fn, options=None: fn)
    # Qwen3.5's small model (an MLP after each of its GDN and attention layers: the interpreter runs every
    # layer); Nemotron-H's full one (its small one has no MLP layer)
    model = get_model(family, "small" if family == "qwen3_5" else "target")
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask, 6)
    hidden = []
    real = linear_mod.mlp_hidden

    def recorded(x, plan):
        h = real(x, plan)
        hidden.append((x.shape[:-1].numel(), h is not None))
        return h

    monkeypatch.setattr(linear_mod, "mlp_hidden", recorded)
    with fused(model):
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(out, want)
    rows = {r for r, ran in hidden if ran}
    assert 3 in rows and all(ran for r, ran in hidden if r <= 16)  # the kernel ran for every step of <= 16 rows
    if sd.last_stats.proposed_tokens:
        assert max(rows) > 3  # verifies of several tokens a row too
    assert all("forward" not in vars(m) for m in model.modules())
    for switch in ("SPECDEC_FUSED_MLPS", "SPECDEC_SKINNY_LINEARS"):
        monkeypatch.setenv(switch, "0")
        hidden.clear()
        with fused(model), torch.no_grad():
            model(ids[:, -1:])
        assert hidden == []
        monkeypatch.delenv(switch)


fused = fusion.fused


@needs_triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_prompt_activation_is_the_eager_chain(activation, gated, dtype):
    """A prompt's MLP activation in one launch (:func:`specdec.kernels.linear.mlp_activation`):
    the reference is the activation module's output times ``u`` bit for bit; the kernel equals it
    within fp32 rounding, the squared ReLU in fp16 bit for bit (under the interpreter), otherwise
    within one unit in the last place per rounding (the SiLU's fp32 exp may differ from torch's in
    its last bit; the interpreter truncates bf16 conversions where the GPU rounds);
    g and u are strided halves of a wider projection (rows of 2N + 3), left untouched."""
    from transformers.activations import ReLUSquaredActivation

    from specdec.kernels.linear import mlp_activation, mlp_activation_reference

    N = 200
    proj = torch.randn(3, 5, 2 * N + 3, generator=torch.Generator().manual_seed(9)).mul(3).to(dtype)
    before = proj.clone()
    g, u = proj[..., :N], (proj[..., N:2 * N] if gated else None)
    module = torch.nn.SiLU() if activation == "silu" else ReLUSquaredActivation()
    want = mlp_activation_reference(g, u, activation)
    assert want.dtype == dtype and torch.equal(want, module(g) * u if gated else module(g))
    got = mlp_activation(g, u, activation)
    assert got.dtype == dtype and got.shape == g.shape and got.is_contiguous()
    if dtype == torch.float32:
        assert ((got - want).abs() <= want.abs() * 1e-6 + 1e-6).all()
    elif dtype == torch.float16 and activation == "relu2":
        assert torch.equal(got, want)
    elif dtype == torch.float16:  # the SiLU's last fp32 bit moves a rounding now and then (a rounding
        # left out moves ~25% of the outputs)
        assert within_ulp(got, want, moved=0.02)
    else:
        assert within_ulp(got, want, 2 if gated else 1)
    assert torch.equal(proj, before)
    with pytest.raises(ValueError, match="activation must be"):
        mlp_activation(g, u, "gelu")
    with pytest.raises(ValueError, match="u must be"):
        mlp_activation(g, g[:1], activation)
    assert mlp_activation(g[:0], None if u is None else u[:0], activation).shape == (0, 5, N)
    assert mlp_activation(g[..., :0], None if u is None else u[..., :0], activation).shape == (3, 5, 0)


@needs_triton_interpreter
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "granitemoehybrid"])
def test_prompt_mlps_compute_their_modules_output(family, monkeypatch):
    """Inside :func:`specdec.models.common.prompt_kernels`, each MLP :func:`prompt_mlps` finds
    (a gated SiLU, a squared ReLU on one projection, a fused gate-up projection's halves) gives its
    module's output, with one activation launch a call, in fp32 (within rounding) and fp16 (the
    squared ReLU bit for bit under the interpreter, the SiLU within its last bit's effect); a call
    with a keyword argument runs the module's own forward; the modules' forwards are their own
    afterwards."""
    import inspect

    from specdec.kernels.linear import triton_activation
    from specdec.models.common import prompt_kernels, prompt_mlps

    calls = []
    kernel = triton_activation.mlp_activation_triton
    monkeypatch.setattr(triton_activation, "mlp_activation_triton", lambda g, *a: calls.append(g.shape) or kernel(g, *a))
    for dtype in (torch.float32, torch.float16):
        model = copy.deepcopy(get_model(family)).to(dtype)
        found = prompt_mlps(model.modules())
        assert found and [m for m, _ in found] == [m for m in mlps(model)]
        x = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype)
        with torch.no_grad():
            want = [mod(x) for mod, _ in found]
            calls.clear()
            with prompt_kernels([], found):
                got = [mod(x) for mod, _ in found]
                assert len(calls) == len(found)
                kw = [mod(**{list(inspect.signature(type(mod).forward).parameters)[1]: x}) for mod, _ in found]
                assert len(calls) == len(found)
        for g, w, k in zip(got, want, kw):
            assert torch.equal(k, w)
            if dtype == torch.float16 and family == "nemotron_h":
                assert torch.equal(g, w)
            else:
                assert ((g.float() - w.float()).abs() <= w.float().abs().max() * (1e-5 if dtype == torch.float32 else 2e-3)).all()
        assert all("forward" not in vars(mod) for mod, _ in found)
