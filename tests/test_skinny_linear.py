"""The skinny linear kernel (:func:`specdec.kernels.linear.skinny_linear`) against the fp32 torch
reference, through Triton's interpreter at tiny sizes (``SPECDEC_TEST_CUDA=1``: compiled on the
GPU, the ``gpu`` test at the bench models' shapes).

Inputs are fresh random values (never zeros); N and K are not multiples of the blocks; outputs
are poisoned with NaN first. Batch invariance is checked bit for bit: row i of an M-row call
equals the 1-row call on x[i]. Routing a model's ``nn.Linear`` forwards through the kernel
(:func:`specdec.kernels.linear.skinny_linears`) leaves greedy generation unchanged.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy
from markers import ON_CUDA, needs_cuda, needs_triton_interpreter
from tiny_models import get_model, ragged_prompts

import specdec
import specdec.kernels.linear as linear_mod
from specdec.kernels.linear import (MAX_ROWS, SkinnyConfig, SkinnyLinear, activation_ref, gated_linear_ref,
                                    gated_skinny_linear, linear_ref, skinny_config, skinny_linear, skinny_linears)

DEVICE = "cuda" if ON_CUDA else "cpu"
#: relative RMS error against the fp32 reference: fp32 sums in another order; bf16 / fp16 round the result
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
#: a launch with several K steps and split K at test sizes (the default takes one step there)
SMALL = SkinnyConfig(block_n=16, block_k=32, split_k=3)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


CASES = [
    pytest.param(torch.float32, (1,), 40, 100, True, None, id="fp32-M1-N40-K100-bias"),
    pytest.param(torch.float32, (3,), 37, 72, False, SMALL, id="fp32-M3-N37-K72-split"),
    pytest.param(torch.bfloat16, (2, 8), 40, 100, True, SMALL, id="bf16-M16-N40-K100-bias-split"),
    pytest.param(torch.bfloat16, (1,), 70, 48, False, None, id="bf16-M1-N70-K48"),
    pytest.param(torch.float16, (3,), 24, 100, True, None, id="fp16-M3-N24-K100-bias"),
    pytest.param(torch.float32, (4, 16), 20, 40, True, SkinnyConfig(block_n=16, block_k=16, split_k=2),
                 id="fp32-M64-N20-K40-bias-split"),
    pytest.param(torch.bfloat16, (64,), 33, 24, False, None, id="bf16-M64-N33-K24"),
]


@pytest.mark.parametrize("dtype, lead, N, K, with_bias, config", CASES)
def test_matches_the_fp32_reference(dtype, lead, N, K, with_bias, config):
    gen = torch.Generator().manual_seed(N * K)
    x, w = rand(*lead, K, dtype=dtype, gen=gen), rand(N, K, dtype=dtype, gen=gen)
    b = rand(N, dtype=dtype, gen=gen) if with_bias else None
    out = torch.full((*lead, N), float("nan"), device=DEVICE, dtype=dtype)
    y = skinny_linear(x, w, b, out=out, config=config)
    assert y is out and y.dtype == dtype and y.shape == (*lead, N)
    assert torch.isfinite(y).all(), "not fully written (NaN left)"
    err = rel_err(y, linear_ref(x, w, b))
    assert err < TOL[dtype], f"relative RMS error {err:.2e} >= {TOL[dtype]:.0e}"
    fresh = skinny_linear(x, w, b, config=config)  # a new output tensor: the same values
    assert torch.equal(fresh, y)


def test_strided_inputs_and_output():
    """x a non-contiguous view, out a non-contiguous view: the values land in out's elements."""
    gen = torch.Generator().manual_seed(1)
    x = rand(5, 2 * 50, gen=gen)[:, ::2]
    w = rand(30, 50, gen=gen)
    big = torch.full((5, 60), float("nan"), device=DEVICE)
    out = big[:, ::2]
    skinny_linear(x, w, out=out, config=SMALL)
    assert rel_err(out, linear_ref(x, w)) < TOL[torch.float32]
    assert torch.isnan(big[:, 1::2]).all(), "wrote outside out"


def test_empty_dims():
    """No rows: an empty result; K = 0: the bias (or zeros) in every row."""
    w, b = rand(6, 0), rand(6)
    assert skinny_linear(rand(0, 12), rand(6, 12)).shape == (0, 6)
    assert torch.equal(skinny_linear(rand(2, 3, 0), w, b), b.expand(2, 3, 6))
    assert torch.equal(skinny_linear(rand(2, 0), w), torch.zeros(2, 6, device=DEVICE))


@pytest.mark.parametrize("dtype, M, config", [
    pytest.param(torch.bfloat16, 20, SMALL, id="bf16-M20-split"),
    pytest.param(torch.float32, 20, None, id="fp32-M20"),
    pytest.param(torch.bfloat16, 64, None, id="bf16-M64"),
])
def test_batch_invariant(dtype, M, config):
    """Row i of an M-row call equals the 1-row call on x[i] bit for bit (rows in every 16-row tile)."""
    gen = torch.Generator().manual_seed(M)
    N, K = 40, 100
    x, w, b = rand(M, K, dtype=dtype, gen=gen), rand(N, K, dtype=dtype, gen=gen), rand(N, dtype=dtype, gen=gen)
    y = skinny_linear(x, w, b, config=config)
    for i in sorted({0, 5, 15, 16, M // 2, M - 1}):
        one = skinny_linear(x[i:i + 1], w, b, config=config)
        assert torch.equal(one[0], y[i]), f"row {i} of the {M}-row call differs from its 1-row call"


def test_launch_does_not_depend_on_M():
    """The launch is a function of (N, K, dtype, SMs): split K fills one wave of 132 SMs."""
    assert skinny_config(2560, 9216, torch.bfloat16) == SkinnyConfig(block_n=64, block_k=128, split_k=3)
    assert skinny_config(248320, 2560, torch.bfloat16).split_k == 1
    assert skinny_config(32, 2560, torch.bfloat16).block_n == 32
    assert skinny_config(40, 100, torch.float32).block_k == 64


@pytest.mark.parametrize("call, match", [
    (lambda x, w: skinny_linear(torch.cat([x] * 17), w), r"M = 68 rows .* at most 64"),
    (lambda x, w: skinny_linear(x[:, :-1], w), r"K = 12 .* got shape \(4, 11\)"),
    (lambda x, w: skinny_linear(x, w.to(torch.float16)), r"weight is torch.float16 but x is torch.float32"),
    (lambda x, w: skinny_linear(x.long(), w.long()), r"x is torch.int64; skinny_linear takes bfloat16, float16"),
    (lambda x, w: skinny_linear(x, w, torch.randn(5, device=DEVICE)), r"bias must be \[N\] = \[6\]"),
    (lambda x, w: skinny_linear(x, w, out=torch.empty(4, 7, device=DEVICE)), r"out must be .* \(4, 6\)"),
    (lambda x, w: skinny_linear(x, w[0]), r"weight must be \[N, K\]"),
    (lambda x, w: SkinnyConfig(block_n=48), r"power of two"),
])
def test_bad_input_is_named(call, match):
    x, w = rand(4, 12), rand(6, 12)
    with pytest.raises(ValueError, match=match):
        call(x, w)


def test_devices_are_checked(monkeypatch):
    x, w = rand(4, 12), rand(6, 12)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match=r"x is on cpu; skinny_linear runs on CUDA"):
            skinny_linear(x, w)
    else:
        with pytest.raises(ValueError, match=r"weight is on cpu but x is on cuda"):
            skinny_linear(x, w.cpu())


def test_module_falls_back_where_the_kernel_does_not_apply():
    """SkinnyLinear runs F.linear past MAX_ROWS, for dtypes the kernel does not take and when a
    gradient is needed (never an error where F.linear works)."""
    lin = torch.nn.Linear(12, 6).to(DEVICE)
    lin64 = torch.nn.Linear(12, 6).to(DEVICE).double()
    for layer, x, grad in ((lin, rand(MAX_ROWS + 1, 12), False), (lin64, rand(3, 12).double(), False),
                           (lin, rand(3, 12), True)):
        mod = SkinnyLinear.of(layer, "triton")
        assert mod.weight is layer.weight and mod.use_kernel
        with torch.set_grad_enabled(grad):
            assert torch.equal(mod(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    with pytest.raises(ValueError, match="backend_name"):
        SkinnyLinear.of(lin, "cuda")


def test_module_compiles_without_a_graph_break():
    """torch.compile(fullgraph=True) of a module around SkinnyLinear: the kernel is one op, and the
    compiled result equals the eager one."""
    mlp = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 24, bias=False)).to(DEVICE)
    with skinny_linears(mlp, backend_name="triton") as n:
        assert n == 2
        x = rand(3, 24)
        with torch.no_grad():
            eager = mlp(x)
            compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled, eager)
    assert rel_err(eager, mlp(x)) < TOL[torch.float32]


@needs_triton_interpreter
def test_greedy_generation_through_skinny_linears_is_unchanged(monkeypatch):
    """fp32 tiny Qwen3.5: the engine's greedy output with every nn.Linear on the kernel (prefill,
    verify and decode rows all <= 64) equals HF greedy without it; logits agree to 1e-5; the
    modules are back afterwards."""
    # the small model (one Gated DeltaNet and one attention layer, an MLP after each: every kind of linear
    # the family has): every routed linear runs through Triton's interpreter
    model = get_model("qwen3_5", "small")
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask, 8)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    calls = []

    def counted(x, w, b=None, **kw):
        calls.append(x.numel() // x.shape[-1])
        return skinny_linear(x, w, b, **kw)

    monkeypatch.setattr(linear_mod, "skinny_linear", counted)
    before = dict(model.named_modules())
    with skinny_linears(model, backend_name="triton") as n:
        assert n == sum(type(m) is torch.nn.Linear for m in before.values())
        with torch.no_grad():
            routed = model(ids, attention_mask=mask).logits
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert rel_err(routed, logits) < 1e-5
    assert torch.equal(out, want)
    assert max(calls) > 3 and 3 in calls  # verify steps (B x T rows) and 3-row decode steps ran the kernel
    assert dict(model.named_modules()) == before


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(2560, 9216), (248320, 2560), (16496, 3072), (32, 2560)])
def test_bench_shapes_on_gpu(N, K):
    """bf16 at the bench models' shapes: every M of 1..64 within bf16 rounding of the reference and
    batch-invariant bit for bit on the hardware's tensor cores."""
    gen = torch.Generator().manual_seed(0)
    w, b = rand(N, K, dtype=torch.bfloat16, gen=gen), rand(N, dtype=torch.bfloat16, gen=gen)
    x = rand(MAX_ROWS, K, dtype=torch.bfloat16, gen=gen)
    rows = {i: skinny_linear(x[i:i + 1], w, b)[0] for i in (0, 7, 15, 16, 33, 63)}
    for M in (1, 2, 4, 8, 16, 17, 32, 64):
        y = skinny_linear(x[:M], w, b)
        assert rel_err(y, linear_ref(x[:M], w, b)) < TOL[torch.bfloat16]
        for i, one in rows.items():
            if i < M:
                assert torch.equal(one, y[i]), f"N={N} K={K}: row {i} of M={M} differs from its 1-row call"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(2560, 9216), (4096, 2560)])
def test_cuda_graph_replay_on_gpu(N, K):
    """A call captured in a CUDA graph (split K: its partial buffer from the graph's pool) replays
    to the eager result on new inputs written into the captured x."""
    gen = torch.Generator().manual_seed(1)
    w, b = rand(N, K, dtype=torch.bfloat16, gen=gen), rand(N, dtype=torch.bfloat16, gen=gen)
    x = rand(5, K, dtype=torch.bfloat16, gen=gen)
    out = torch.empty(5, N, device=DEVICE, dtype=torch.bfloat16)
    skinny_linear(x, w, b, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, b, out=out)
    x.copy_(rand(5, K, dtype=torch.bfloat16, gen=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_linear(x, w, b))


def assert_rounds_as_eager(y: torch.Tensor, eager: torch.Tensor, activation: str):
    """``y`` equals the eager chain's result where it is rounded the same way: squared ReLU bit for
    bit; SiLU within 1e-6 in fp32 (its exp may differ from torch's in the last bits) and in at
    least 98% of elements in fp16 / bf16, whose rounding hides that. bf16 only on CUDA: Triton's
    interpreter truncates fp32 to bf16 where the GPU rounds to nearest even, so there bf16 is
    checked within two bf16 steps (one truncation per rounding) only."""
    if y.dtype == torch.bfloat16 and not ON_CUDA:
        assert rel_err(y, eager) < 2 ** -6
        return
    if y.dtype == torch.float32 and activation == "silu":
        assert rel_err(y, eager) < 1e-6
        return
    mismatched = (y != eager).float().mean().item()
    assert mismatched <= (0 if activation == "relu2" else 0.02), f"{mismatched:.1%} of elements differ"


ACT_CASES = [
    pytest.param(torch.float32, (3,), 37, 72, True, SMALL, id="fp32-M3-split-bias"),
    pytest.param(torch.float32, (2, 9), 40, 100, False, None, id="fp32-M18"),
    pytest.param(torch.bfloat16, (5,), 70, 48, True, None, id="bf16-M5-bias"),
    pytest.param(torch.bfloat16, (1,), 33, 100, False, SMALL, id="bf16-M1-split"),
    pytest.param(torch.float16, (4,), 24, 64, False, None, id="fp16-M4"),
]


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("dtype, lead, N, K, with_bias, config", ACT_CASES)
def test_activation_epilogue_matches_the_reference(activation, dtype, lead, N, K, with_bias, config):
    """``activation(x @ w.T + b)`` in the kernel's epilogue (or the split-K reduction's) against the
    fp32 reference, into a NaN-poisoned output."""
    gen = torch.Generator().manual_seed(N + K)
    x, w = rand(*lead, K, dtype=dtype, gen=gen), rand(N, K, dtype=dtype, gen=gen)
    b = rand(N, dtype=dtype, gen=gen) if with_bias else None
    out = torch.full((*lead, N), float("nan"), device=DEVICE, dtype=dtype)
    y = skinny_linear(x, w, b, out=out, activation=activation, config=config)
    assert y is out and torch.isfinite(y).all(), "not fully written (NaN left)"
    assert rel_err(y, linear_ref(x, w, b, activation)) < 2 * TOL[dtype]  # (squaring doubles the relative error)
    # the activation of the rounded linear, as the eager module computes it
    eager = activation_ref(skinny_linear(x, w, b, config=config), activation).to(dtype)
    assert_rounds_as_eager(y, eager, activation)


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("dtype, lead, N, K, with_bias, config", ACT_CASES)
def test_gated_matches_the_reference(activation, dtype, lead, N, K, with_bias, config):
    """``act(x @ g.T + b_g) * (x @ u.T + b_u)`` in one launch against the fp32 reference, into a
    NaN-poisoned output; and against the eager chain over the kernel's own projections (rounded
    where the eager module rounds)."""
    gen = torch.Generator().manual_seed(3 * N + K)
    x = rand(*lead, K, dtype=dtype, gen=gen)
    wg, wu = rand(N, K, dtype=dtype, gen=gen), rand(N, K, dtype=dtype, gen=gen)
    bg, bu = (rand(N, dtype=dtype, gen=gen), rand(N, dtype=dtype, gen=gen)) if with_bias else (None, None)
    out = torch.full((*lead, N), float("nan"), device=DEVICE, dtype=dtype)
    y = gated_skinny_linear(x, wg, wu, bg, bu, out=out, activation=activation, config=config)
    assert y is out and torch.isfinite(y).all(), "not fully written (NaN left)"
    assert rel_err(y, gated_linear_ref(x, wg, wu, bg, bu, activation)) < 2 * TOL[dtype]
    g = skinny_linear(x, wg, bg, config=config)
    u = skinny_linear(x, wu, bu, config=config)
    eager = (activation_ref(g, activation).to(dtype).float() * u.float()).to(dtype)
    assert_rounds_as_eager(y, eager, activation)


def test_strided_biases_are_read_as_they_lie():
    """Biases that are strided views (every other element of a longer tensor) give the result of
    their values, with and without the activation, and in the gated launch."""
    gen = torch.Generator().manual_seed(9)
    x, wg, wu = rand(3, 24, gen=gen), rand(8, 24, gen=gen), rand(8, 24, gen=gen)
    bg, bu = rand(16, gen=gen)[::2], rand(16, gen=gen)[::2]
    assert rel_err(skinny_linear(x, wg, bg, activation="relu2"), linear_ref(x, wg, bg, "relu2")) < 2 * TOL[torch.float32]
    assert rel_err(skinny_linear(x, wg, bg), linear_ref(x, wg, bg)) < TOL[torch.float32]
    assert rel_err(gated_skinny_linear(x, wg, wu, bg, bu), gated_linear_ref(x, wg, wu, bg, bu)) < 2 * TOL[torch.float32]


def test_gated_takes_the_row_halves_of_one_weight_and_strided_x():
    """Gate and up as the two row halves of one ``[2N, K]`` weight (a fused gate-up projection),
    x a strided view, out a strided view: the values land in out's elements only."""
    gen = torch.Generator().manual_seed(7)
    N, K = 20, 40
    w = rand(2 * N, K, gen=gen)
    x = rand(3, 2 * K, gen=gen)[:, ::2]
    big = torch.full((3, 2 * N), float("nan"), device=DEVICE)
    gated_skinny_linear(x, w[:N], w[N:], out=big[:, ::2], config=SkinnyConfig(block_n=16, block_k=16, split_k=2))
    assert rel_err(big[:, ::2], gated_linear_ref(x, w[:N], w[N:])) < TOL[torch.float32]
    assert torch.isnan(big[:, 1::2]).all(), "wrote outside out"


@pytest.mark.parametrize("config", [None, SMALL], ids=["one-split", "split"])
def test_gated_is_batch_invariant(config):
    """Row i of a 40-row gated call equals the 1-row call on x[i] bit for bit."""
    gen = torch.Generator().manual_seed(11)
    N, K, M = 40, 100, 40
    x = rand(M, K, dtype=torch.bfloat16, gen=gen)
    wg, wu = rand(N, K, dtype=torch.bfloat16, gen=gen), rand(N, K, dtype=torch.bfloat16, gen=gen)
    y = gated_skinny_linear(x, wg, wu, config=config)
    for i in (0, 15, 16, 39):
        assert torch.equal(gated_skinny_linear(x[i:i + 1], wg, wu, config=config)[0], y[i]), f"row {i}"


def test_activation_edge_cases():
    """K = 0: the activation of the bias (or of zeros); no rows: an empty result."""
    w0, b = rand(6, 0), rand(6)
    assert torch.equal(skinny_linear(rand(2, 0), w0, b, activation="relu2"), torch.relu(b).square().expand(2, 6))
    assert torch.equal(gated_skinny_linear(rand(2, 0), w0, w0, b, b, activation="relu2"),
                       (torch.relu(b).square() * b).expand(2, 6))
    assert gated_skinny_linear(rand(0, 12), rand(6, 12), rand(6, 12)).shape == (0, 6)


@pytest.mark.parametrize("call, match", [
    (lambda x, w: skinny_linear(x, w, activation="gelu"), r"activation must be one of \('silu', 'relu2'\) or None, got 'gelu'"),
    (lambda x, w: gated_skinny_linear(x, w, w, activation=None), r"activation must be one of \('silu', 'relu2'\), got None"),
    (lambda x, w: gated_skinny_linear(x, w, w[:5]), r"share shape and strides, got \(6, 12\) / \(5, 12\)"),
    (lambda x, w: gated_skinny_linear(x, w, w.t().contiguous().t()), r"share shape and strides"),
    (lambda x, w: gated_skinny_linear(x, w, w, torch.randn(6, device=DEVICE)), r"both be given or both be None"),
    (lambda x, w: gated_skinny_linear(x, w, w.double()), r"up_weight: weight is torch.float64 but x is torch.float32"),
    (lambda x, w: gated_skinny_linear(torch.cat([x] * 17), w, w), r"M = 68 rows"),
])
def test_bad_gated_or_activation_input_is_named(call, match):
    x, w = rand(4, 12), rand(6, 12)
    with pytest.raises(ValueError, match=match):
        call(x, w)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("N, K, activation, gated", [(9216, 2560, "silu", True), (12288, 3072, "relu2", False),
                                                     (1024, 2560, "silu", True)])
def test_mlp_launches_on_gpu(N, K, activation, gated):
    """bf16 at the bench models' MLP shapes (and a split-K gated launch): rows 1..16 rounded as the
    eager chain over the kernel's own projections (squared ReLU bit for bit; SiLU in >= 98% of
    elements), batch-invariant, and a CUDA-graph replay equal to the eager call."""
    gen = torch.Generator().manual_seed(2)
    dt = torch.bfloat16
    wg, wu = rand(N, K, dtype=dt, gen=gen) * K**-0.5, rand(N, K, dtype=dt, gen=gen) * K**-0.5
    x = rand(16, K, dtype=dt, gen=gen)

    def call(xs):
        if gated:
            return gated_skinny_linear(xs, wg, wu, activation=activation)
        return skinny_linear(xs, wg, activation=activation)

    y = call(x)
    g = skinny_linear(x, wg)
    eager = activation_ref(g, activation).to(dt)
    if gated:
        eager = (eager.float() * skinny_linear(x, wu).float()).to(dt)
    assert_rounds_as_eager(y, eager, activation)
    for i in (0, 7, 15):
        assert torch.equal(call(x[i:i + 1])[0], y[i]), f"row {i}"
    xs, out = x[:3].clone(), torch.empty(3, N, device=DEVICE, dtype=dt)
    out.copy_(call(xs))  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(call(xs))
    xs.copy_(rand(3, K, dtype=dt, gen=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call(xs))
