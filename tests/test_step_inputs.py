"""The SSM steps' input preparation in one launch
(:func:`specdec.kernels.gdn.triton_inputs.gdn_step_inputs`,
:func:`specdec.kernels.mamba2.triton_inputs.mamba2_step_inputs`) against their torch references,
the torch backend's paths (``specdec.models.gdn._gdn_inputs``, ``specdec.models.mamba2._mamba2_inputs``):
through Triton's interpreter at tiny sizes (compiled with ``SPECDEC_TEST_CUDA=1``).

Inputs are fresh random values and views of one conv output as the layers pass them, outputs are
poisoned with NaN first (GDN: its ``out=``) or checked fully written, and the inputs are checked
unchanged bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from helpers import built_for_hopper, rel_err
from markers import ON_CUDA, needs_triton_interpreter

from specdec.models.gdn import _gdn_inputs
from specdec.models.mamba2 import _mamba2_inputs

DEVICE = "cuda" if ON_CUDA else "cpu"

pytestmark = needs_triton_interpreter if not ON_CUDA else []


def gdn_step_inputs(*args, **kwargs):
    from specdec.kernels.gdn.triton_inputs import gdn_step_inputs as kernel  # (imported once the interpreter is on)

    return kernel(*args, **kwargs)


def mamba2_step_inputs(*args, **kwargs):
    from specdec.kernels.mamba2.triton_inputs import mamba2_step_inputs as kernel

    return kernel(*args, **kwargs)


def layer_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed, a_scale=3.0):
    """q, k, v as the layer's views of one conv output ``[B, T, 2*Hk*Dk + Hv*Dv]``; b, a as the
    projections give them; A_log, dt_bias in the model's dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 2 * Hk * Dk + Hv * Dv, generator=gen).to(DEVICE, dtype)
    q, k, v = torch.split(x, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv)
    b = torch.randn(B, T, Hv, generator=gen).mul(3).to(DEVICE, dtype)
    a = torch.randn(B, T, Hv, generator=gen).mul(a_scale).to(DEVICE, dtype)
    A_log = torch.randn(Hv, generator=gen).to(DEVICE, dtype)
    dt_bias = torch.randn(Hv, generator=gen).to(DEVICE, dtype)
    return q, k, v, b, a, A_log, dt_bias


def poisoned(B, T, Hv, Dk, Dv):
    shapes = ((B, T, Hv, Dk), (B, T, Hv, Dk), (B, T, Hv, Dv), (B, T, Hv), (B, T, Hv))
    return tuple(torch.full(s, float("nan"), device=DEVICE) for s in shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, Hk, Hv, Dk, Dv", [(1, 1, 2, 2, 16, 16), (3, 5, 2, 4, 16, 32), (2, 3, 1, 3, 24, 40)])
def test_gdn_matches_the_torch_reference(dtype, B, T, Hk, Hv, Dk, Dv):
    """Every output within fp32 rounding of the reference (beta, rounded to a bf16 input's dtype
    by both, within one unit of it: Triton's interpreter rounds toward zero); every element
    written; the inputs untouched."""
    inputs = layer_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=B * 100 + T * 10 + Hv)
    before = [t.clone() for t in inputs]
    want = _gdn_inputs(*inputs, Hv // Hk)
    out = poisoned(B, T, Hv, Dk, Dv)
    got = gdn_step_inputs(*inputs, out=out)
    assert all(g is o for g, o in zip(got, out))
    for name, g, w in zip(("q", "k", "v", "g", "beta"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape and not g.isnan().any(), name
        if name == "beta" and dtype != torch.float32:  # both rounded to bf16: within one unit of it
            assert torch.allclose(g, w.float(), rtol=2.0 ** -7, atol=0), (g, w)
        else:
            assert rel_err(g, w.float()) < 1e-6, (name, rel_err(g, w.float()))
    assert torch.equal(got[2], want[2])  # v: a cast, exact
    assert all(torch.equal(x, y) for x, y in zip(inputs, before))


def test_gdn_softplus_tails():
    """a + dt_bias far below and above torch's softplus threshold (20): the decay is accurate
    where 1 + exp(x) rounds to 1 (down to exp(x) near fp32's smallest normal) and follows x
    above the threshold."""
    q, k, v, b, a, A_log, dt_bias = layer_inputs(2, 4, 2, 2, 16, 16, torch.float32, seed=7)
    a = torch.tensor([-60.0, -30.0, -17.0, -1e-3, 0.0, 19.9, 20.0, 20.5, 45.0, 88.0, -80.0, 5.0, 2.0, -5.0, 1.0, 3.0],
                     device=DEVICE).reshape(2, 4, 2)
    dt_bias = torch.zeros(2, device=DEVICE)
    want = _gdn_inputs(q, k, v, b, a, A_log, dt_bias, 1)[3]
    got = gdn_step_inputs(q, k, v, b, a, A_log, dt_bias)[3]
    assert (got < 0).all()
    assert rel_err(got, want) < 1e-6
    # elementwise within a few units of fp32 (both exps within 2 ulp of exact)
    assert torch.allclose(got, want, rtol=1e-6, atol=0), ((got - want) / want).abs().max()


def test_softplus_keeps_nan():
    """A NaN in ``a + dt_bias`` (GDN) or ``dt + dt_bias`` (Mamba-2) stays NaN in the decay / step,
    as torch's softplus keeps it, and no other element changes."""
    q, k, v, b, a, A_log, dt_bias = layer_inputs(1, 2, 2, 2, 16, 16, torch.float32, seed=11)
    a[0, 1, 0] = float("nan")
    g = gdn_step_inputs(q, k, v, b, a, A_log, dt_bias)[3]
    want = _gdn_inputs(q, k, v, b, a, A_log, dt_bias, 1)[3]
    assert torch.equal(g.isnan(), want.isnan()) and g.isnan().sum() == 1
    assert rel_err(g.nan_to_num(), want.nan_to_num()) < 1e-6
    x, dt, Bm, Cm, dt_bias, A_log, D = mamba2_inputs(1, 2, 4, 2, 8, 16, torch.float32, seed=12)
    dt[0, 0, 3] = float("nan")
    got = mamba2_step_inputs(x, dt, Bm, Cm, dt_bias, A_log, D, 4, 2)[1]
    assert got.isnan().sum() == 1 and got[0, 0, 3].isnan()


@pytest.mark.parametrize("change, match", [
    (lambda i: {**i, "k": i["k"][:, :, :1]}, "expected q, k"),
    (lambda i: {**i, "v": i["v"][:, :, :3]}, "multiple of key heads"),
    (lambda i: {**i, "b": i["b"][:, :1]}, "expected b, a"),
    (lambda i: {**i, "A_log": i["A_log"][:1]}, "expected b, a"),
    (lambda i: {**i, "q": i["q"].transpose(2, 3)}, "expected q, k|contiguous last dim"),
    (lambda i: {**i, "q": i["q"][..., ::2], "k": i["k"][..., ::2]}, "contiguous last dim"),
    (lambda i: {**i, "out": poisoned(2, 3, 4, 16, 8)[:4]}, "five contiguous fp32"),
    (lambda i: {**i, "out": tuple(o.double() for o in poisoned(2, 3, 4, 16, 8))}, "five contiguous fp32"),
])
def test_gdn_bad_input_is_named(change, match):
    q, k, v, b, a, A_log, dt_bias = layer_inputs(2, 3, 2, 4, 16, 8, torch.float32, seed=3)
    args = change({"q": q, "k": k, "v": v, "b": b, "a": a, "A_log": A_log, "dt_bias": dt_bias})
    with pytest.raises(ValueError, match=match):
        gdn_step_inputs(**args)


def test_gdn_empty_batch():
    inputs = layer_inputs(0, 1, 2, 2, 16, 16, torch.float32, seed=1)
    got = gdn_step_inputs(*inputs)
    assert [tuple(t.shape) for t in got] == [(0, 1, 2, 16), (0, 1, 2, 16), (0, 1, 2, 16), (0, 1, 2), (0, 1, 2)]


def mamba2_inputs(Bt, T, H, G, P, N, dtype, seed):
    """x, B, C as the layer's views of one conv output ``[Bt, T, H*P + 2*G*N]``; dt a view of the
    projection's last ``H`` columns; dt_bias, A_log, D in the model's dtype."""
    gen = torch.Generator().manual_seed(seed)
    xBC = torch.randn(Bt, T, H * P + 2 * G * N, generator=gen).to(DEVICE, dtype)
    x, Bm, Cm = torch.split(xBC, [H * P, G * N, G * N], dim=-1)
    proj = torch.randn(Bt, T, 5 + H, generator=gen).mul(4).to(DEVICE, dtype)
    dt = proj[..., 5:]
    dt_bias = torch.randn(H, generator=gen).to(DEVICE, dtype)
    A_log = torch.randn(H, generator=gen).to(DEVICE, dtype)
    D = torch.randn(H, generator=gen).to(DEVICE, dtype)
    return x, dt, Bm, Cm, dt_bias, A_log, D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Bt, T, H, G, P, N", [(1, 1, 4, 1, 8, 16), (3, 5, 6, 2, 8, 16), (2, 3, 4, 4, 12, 20)])
def test_mamba2_matches_the_torch_reference(dtype, Bt, T, H, G, P, N):
    """x, B, C and D exactly the reference's (casts), dt and A within fp32 rounding, every element
    written (no NaN of the empty outputs), the inputs untouched; without D, D is None."""
    inputs = mamba2_inputs(Bt, T, H, G, P, N, dtype, seed=Bt * 100 + T * 10 + H)
    x, dt, Bm, Cm, dt_bias, A_log, D = inputs
    before = [t.clone() for t in inputs]
    want = _mamba2_inputs(x, dt, Bm, Cm, dt_bias, A_log, D, H, P, G, N, torch.float32)
    got = mamba2_step_inputs(x, dt, Bm, Cm, dt_bias, A_log, D, H, G)
    for name, g, w in zip(("x", "dt", "B", "C", "A", "D"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape and g.is_contiguous() and not g.isnan().any(), name
        if name in ("x", "B", "C", "D"):
            assert torch.equal(g, w), name
        else:
            assert rel_err(g, w) < 1e-6, (name, rel_err(g, w))
    assert (got[1] > 0).all() and (got[4] < 0).all()
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))
    assert mamba2_step_inputs(x, dt, Bm, Cm, dt_bias, A_log, None, H, G)[5] is None


@pytest.mark.parametrize("change, match", [
    (lambda i: {**i, "dt": i["dt"][:, :1]}, "expected x"),
    (lambda i: {**i, "heads": 3}, "multiple of groups"),
    (lambda i: {**i, "groups": 3}, "multiple of groups"),
    (lambda i: {**i, "A_log": i["A_log"][:2]}, "must be \\[4\\]"),
    (lambda i: {**i, "x": i["x"].repeat(1, 1, 2)[..., ::2]}, "contiguous last dim"),
    (lambda i: {**i, "C": i["C"][:, :, :16]}, "expected x"),
    (lambda i: {**i, "D": i["D"].to("meta")}, "several devices"),
])
def test_mamba2_bad_input_is_named(change, match):
    x, dt, Bm, Cm, dt_bias, A_log, D = mamba2_inputs(2, 3, 4, 2, 8, 16, torch.float32, seed=5)
    args = change({"x": x, "dt": dt, "B": Bm, "C": Cm, "dt_bias": dt_bias, "A_log": A_log, "D": D, "heads": 4,
                   "groups": 2})
    with pytest.raises(ValueError, match=match):
        mamba2_step_inputs(**args)


_BUILD_FOR_HOPPER = """
from specdec.kernels.gdn import triton_inputs as gdn
from specdec.kernels.mamba2 import triton_inputs as mamba2

def build(fn, consts, inputs, outputs, floats):
    types = {**{n: "*bf16" for n in inputs}, **{n: "*fp32" for n in outputs}, **{n: "fp32" for n in floats}}
    return sorted(set(re.findall(r"cvt\\.[a-z0-9.]*bf16[a-z0-9.]*", hopper_ptx(fn, consts, types))))

print(json.dumps({
    "gdn": build(gdn._gdn_inputs_kernel, dict(HV=32, REP=2, DK=128, DV=128, BK=128, BV=128, ACCURATE=True),
                 {"q", "k", "v", "b", "a", "A_log", "dt_bias"}, {"qo", "ko", "vo", "go", "bo"},
                 {"scale", "eps", "threshold"}),
    "mamba2": build(mamba2._mamba2_inputs_kernel, dict(H=128, G=8, P=64, N=128, BP=64, BN=128, HAS_D=True,
                                                       ACCURATE=True),
                    {"x", "dt", "Bm", "Cm", "dt_bias", "A_log", "D"}, {"xo", "dto", "Bo", "Co", "Ao", "Do"},
                    {"threshold"}),
}))
"""


def test_kernels_build_for_hopper_and_round_beta_to_nearest():
    """Both kernels compile ahead of time for an H100/H200 (sm_90) with bf16 inputs and
    libdevice's exp, using Triton's own ptxas, on a machine without a GPU; GDN's bf16 beta is rounded to nearest
    (``cvt.rn``), as torch rounds ``b.sigmoid()``. Compiled in a child process: this one runs
    Triton's interpreter."""
    casts = built_for_hopper(_BUILD_FOR_HOPPER)
    assert "cvt.rn.bf16.f32" in casts["gdn"] and not any(".rz." in c for c in casts["gdn"]), casts
    assert casts["mamba2"] == ["cvt.f32.bf16"], casts  # loads widened; nothing rounded to bf16
