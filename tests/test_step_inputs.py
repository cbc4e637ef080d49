"""The SSM steps' input preparation on the Triton backend against the torch backend's paths
(``specdec.models.gdn._gdn_inputs``, ``specdec.models.mamba2._mamba2_inputs``): a Gated DeltaNet
step's in one launch (:func:`specdec.kernels.gdn.triton_inputs.gdn_step_inputs`), a Mamba-2
step's inside the step kernels themselves (``dt_bias`` of
:func:`specdec.kernels.mamba2.triton_step.mamba2_update` and the strategies' verifies); through
Triton's interpreter at tiny sizes (compiled with ``SPECDEC_TEST_CUDA=1``).

Inputs are fresh random values and views of one conv output as the layers pass them, outputs are
poisoned with NaN first or checked fully written, and the inputs are checked unchanged bit for bit.
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
    """A NaN in ``a + dt_bias`` stays NaN in the decay, as torch's softplus keeps it, and no other
    element changes."""
    q, k, v, b, a, A_log, dt_bias = layer_inputs(1, 2, 2, 2, 16, 16, torch.float32, seed=11)
    a[0, 1, 0] = float("nan")
    g = gdn_step_inputs(q, k, v, b, a, A_log, dt_bias)[3]
    want = _gdn_inputs(q, k, v, b, a, A_log, dt_bias, 1)[3]
    assert torch.equal(g.isnan(), want.isnan()) and g.isnan().sum() == 1
    assert rel_err(g.nan_to_num(), want.nan_to_num()) < 1e-6


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


def _mamba2_run(mode, raw, x, dt, Bm, Cm, A, D, dt_bias, H, G, S_shape, gen):
    """One call of the step kernel of ``mode`` from fresh random stores, on the layer's views (``raw``:
    dt the raw projection with ``dt_bias``, ``A`` the layer's A_log) or on ``_mamba2_inputs``'s
    prepared fp32 tensors; returns ``(y, every store tensor the call may write)``. The stores come
    from ``gen``."""
    from specdec.kernels.mamba2 import triton_step as m2

    Bt, T = x.shape[:2]
    P, N = x.shape[-1] // H, Bm.shape[-1] // G
    x4, B4, C4 = x.view(Bt, T, H, P), Bm.view(Bt, T, G, N), Cm.view(Bt, T, G, N)
    kw = dict(dt_bias=dt_bias, A_log=A) if raw else {}
    A = None if raw else A
    y = torch.full((Bt, T, H, P), float("nan"), device=DEVICE)
    state = torch.randn(Bt, *S_shape, generator=gen).to(DEVICE)
    parents = (-1, 0, 0, 1, 2)[:T] if mode.endswith("tree") else None
    if mode == "update":
        m2.mamba2_update(state, x4, dt, A, B4, C4, D, out=y, **kw)
        return y, (state,)
    if mode.startswith("snapshot"):
        buf = torch.randn(Bt, T, *S_shape, generator=gen).to(DEVICE)
        m2.mamba2_snapshot_verify(state, buf, x4, dt, A, B4, C4, D, parents=parents, out=y, **kw)
        return y, (state, buf)
    if mode == "ring":
        ring = torch.randn(Bt, T + 2, *S_shape, generator=gen).to(DEVICE)
        head = torch.randint(0, T + 2, (Bt,), generator=gen).to(DEVICE)
        m2.mamba2_ring_verify(ring, head, x4, dt, A, B4, C4, D, out=y, **kw)
        return y, (ring,)
    fused = mode.startswith("replay_fused")
    L = 2 * (T + 1) if fused else 2 * T + 3
    hist = (torch.randn(Bt, L, H, P, generator=gen).to(DEVICE), torch.rand(Bt, L, H, generator=gen).to(DEVICE),
            torch.randn(Bt, L, G, N, generator=gen).to(DEVICE))
    hist_len = torch.randint(0, T + 1, (Bt,), generator=gen).to(DEVICE)
    m2.mamba2_replay_verify(state, *hist, hist_len, x4, dt, A, B4, C4, D, fused=fused, parents=parents, out=y, **kw)
    return y, (state, *hist)


@pytest.mark.parametrize("mode", ["update", "snapshot", "ring", "replay_fused", "replay_deferred", "snapshot_tree",
                                  "replay_fused_tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_step_kernels_form_their_inputs(mode, dtype):
    """Given the layer's views of its conv output, raw ``dt`` with ``dt_bias`` and ``A_log``, every
    step kernel (each strategy's, chains and trees) computes what it computes from
    ``_mamba2_inputs``'s prepared fp32 inputs (the torch backend's path): outputs and every store it
    writes (replay's cached dt is the softplus'ed step), within the rounding of the two softplus
    and exp implementations; the inputs are read in place and left untouched bit for bit."""
    Bt, T, H, G, P, N = 3, 5 if mode.endswith("tree") else 4, 4, 2, 8, 16
    inputs = mamba2_inputs(Bt, T, H, G, P, N, dtype, seed=7)
    x, dt, Bm, Cm, dt_bias, A_log, D = inputs
    before = [t.clone() for t in inputs]
    prepared = _mamba2_inputs(x, dt, Bm, Cm, dt_bias, A_log, D, H, P, G, N, torch.float32)
    want = _mamba2_run(mode, False, *(t.reshape(Bt, T, -1) for t in prepared[:4]), prepared[4], prepared[5], None, H,
                       G, (H, P, N), torch.Generator().manual_seed(1))
    got = _mamba2_run(mode, True, x, dt, Bm, Cm, A_log, D, dt_bias, H, G, (H, P, N), torch.Generator().manual_seed(1))
    for i, (g, w) in enumerate(zip((got[0], *got[1]), (want[0], *want[1]))):
        assert not g.isnan().any(), f"{mode}: output {i} not fully written"
        assert rel_err(g, w) < 1e-6, (mode, i, rel_err(g, w))
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))


def test_mamba2_softplus_keeps_nan():
    """A NaN in ``dt + dt_bias`` stays NaN in that head's step (as torch's softplus keeps it) and
    in its outputs; no other head's output changes."""
    from specdec.kernels.mamba2 import triton_step as m2

    x, dt, Bm, Cm, dt_bias, A_log, D = mamba2_inputs(1, 2, 4, 2, 8, 16, torch.float32, seed=12)
    args = lambda: (torch.zeros(1, 4, 8, 16, device=DEVICE), x.view(1, 2, 4, 8), dt, None, Bm.view(1, 2, 2, 16),
                    Cm.view(1, 2, 2, 16), D)
    clean = m2.mamba2_update(*args(), dt_bias=dt_bias, A_log=A_log)
    dt[0, 0, 3] = float("nan")
    got = m2.mamba2_update(*args(), dt_bias=dt_bias, A_log=A_log)
    assert got[0, :, 3].isnan().all() and not got[0, :, :3].isnan().any()
    assert torch.equal(got[0, :, :3], clean[0, :, :3])


def test_mamba2_bad_dt_bias_is_named():
    from specdec.kernels.mamba2 import triton_step as m2

    x, dt, Bm, Cm, dt_bias, A_log, D = mamba2_inputs(2, 3, 4, 2, 8, 16, torch.float32, seed=5)
    with pytest.raises(ValueError, match="dt_bias must be"):
        m2.mamba2_update(torch.zeros(2, 4, 8, 16, device=DEVICE), x.view(2, 3, 4, 8), dt, -A_log.exp(),
                         Bm.view(2, 3, 2, 16), Cm.view(2, 3, 2, 16), D, dt_bias=dt_bias[:2])


def test_mamba2_decay_given_once():
    """The decay comes as ``A`` or as ``A_log``, exactly one of them."""
    from specdec.kernels.mamba2 import triton_step as m2

    x, dt, Bm, Cm, dt_bias, A_log, D = mamba2_inputs(2, 3, 4, 2, 8, 16, torch.float32, seed=6)
    args = (torch.zeros(2, 4, 8, 16, device=DEVICE), x.view(2, 3, 4, 8), dt)
    for A, log in ((None, None), (-A_log.exp(), A_log)):
        with pytest.raises(ValueError, match="A or as A_log"):
            m2.mamba2_update(*args, A, Bm.view(2, 3, 2, 16), Cm.view(2, 3, 2, 16), D, dt_bias=dt_bias, A_log=log)


_BUILD_FOR_HOPPER = """
from specdec.kernels.gdn import triton_inputs as gdn

def build(fn, consts, inputs, outputs, floats):
    types = {**{n: "*bf16" for n in inputs}, **{n: "*fp32" for n in outputs}, **{n: "fp32" for n in floats}}
    return sorted(set(re.findall(r"cvt\\.[a-z0-9.]*bf16[a-z0-9.]*", hopper_ptx(fn, consts, types))))

print(json.dumps({
    "gdn": build(gdn._gdn_inputs_kernel, dict(HV=32, REP=2, DK=128, DV=128, BK=128, BV=128, ACCURATE=True),
                 {"q", "k", "v", "b", "a", "A_log", "dt_bias"}, {"qo", "ko", "vo", "go", "bo"},
                 {"scale", "eps", "threshold"}),
}))
"""


def test_kernels_build_for_hopper_and_round_beta_to_nearest():
    """The GDN kernel compiles ahead of time for an H100/H200 (sm_90) with bf16 inputs and
    libdevice's exp, using Triton's own ptxas, on a machine without a GPU; GDN's bf16 beta is rounded to nearest
    (``cvt.rn``), as torch rounds ``b.sigmoid()``. Compiled in a child process: this one runs
    Triton's interpreter."""
    casts = built_for_hopper(_BUILD_FOR_HOPPER)
    assert "cvt.rn.bf16.f32" in casts["gdn"] and not any(".rz." in c for c in casts["gdn"]), casts
