"""Sibling projections in one launch: :func:`specdec.kernels.linear.grouped_skinny_linear` against
the fp32 torch reference (through Triton's interpreter at tiny sizes; ``SPECDEC_TEST_CUDA=1``:
compiled, the ``gpu`` tests at the bench models' shapes), and
:func:`specdec.kernels.linear.merged_linears`, which routes a model's sibling ``nn.Linear``
modules through it.

Inputs are fresh random values; N and K are not multiples of the blocks; outputs are poisoned
with NaN first. Batch invariance is checked bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import built_for_hopper, hf_greedy, rel_err
from markers import ON_CUDA, needs_cuda, needs_triton_interpreter
from tiny_models import get_model, ragged_prompts

import specdec
import specdec.kernels.linear as linear_mod
from specdec.fusion import fused
from specdec.kernels.linear import (MAX_MEMBERS, MAX_ROWS, SINGLE_MAX_ROWS, SkinnyConfig, grouped_skinny_linear,
                                    linear_ref, merged_linears, sibling_groups, single_linears, skinny_linear)

DEVICE = "cuda" if ON_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def count_grouped_calls(monkeypatch, what) -> list:
    """Route grouped_skinny_linear through a recorder: ``what(x, weights)`` of every call, in order."""
    seen = []

    def counted(x, weights, *args, **kw):
        seen.append(what(x, weights))
        return grouped_skinny_linear(x, weights, *args, **kw)

    monkeypatch.setattr(linear_mod, "grouped_skinny_linear", counted)
    return seen


CASES = [
    pytest.param(torch.float32, (1,), (40, 7, 70), 100, True, None, id="fp32-M1-3w-bias"),
    pytest.param(torch.float32, (3,), (37, 16), 72, False, SkinnyConfig(block_n=16, block_k=32), id="fp32-M3-2w-kstep"),
    pytest.param(torch.bfloat16, (2, 8), (40, 1, 33, 64), 100, True, None, id="bf16-M16-4w-bias"),
    pytest.param(torch.bfloat16, (17,), (70, 5), 48, False, None, id="bf16-M17-2w"),
    pytest.param(torch.float16, (64,), (24, 24, 9), 100, True, SkinnyConfig(block_n=16, block_k=16), id="fp16-M64-3w"),
    pytest.param(torch.float32, (2,), (20,), 40, False, None, id="fp32-one-weight"),
]


@pytest.mark.parametrize("dtype, lead, Ns, K, with_bias, config", CASES)
def test_grouped_matches_the_fp32_reference(dtype, lead, Ns, K, with_bias, config):
    gen = torch.Generator().manual_seed(sum(Ns) * K)
    x = rand(*lead, K, dtype=dtype, gen=gen)
    ws = [rand(N, K, dtype=dtype, gen=gen) for N in Ns]
    bs = [rand(N, dtype=dtype, gen=gen) for N in Ns] if with_bias else None
    outs = [torch.full((*lead, N), float("nan"), device=DEVICE, dtype=dtype) for N in Ns]
    ys = grouped_skinny_linear(x, ws, bs, outs, config=config)
    assert len(ys) == len(Ns) and all(y is o for y, o in zip(ys, outs))
    for i, (y, w) in enumerate(zip(ys, ws)):
        assert y.shape == (*lead, w.shape[0]) and y.dtype == dtype
        assert torch.isfinite(y).all(), f"member {i} not fully written (NaN left)"
        assert rel_err(y, linear_ref(x, w, bs[i] if bs else None)) < TOL[dtype], f"member {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_is_batch_invariant(dtype):
    gen = torch.Generator().manual_seed(3)
    ws = [rand(N, 48, dtype=dtype, gen=gen) for N in (33, 8, 20)]
    x = rand(MAX_ROWS, 48, dtype=dtype, gen=gen)
    for M in (5, 17, MAX_ROWS):
        ys = grouped_skinny_linear(x[:M], ws)
        for i in sorted({0, M // 2, M - 1}):
            one = grouped_skinny_linear(x[i:i + 1], ws)
            for j, (a, b) in enumerate(zip(ys, one)):
                assert torch.equal(a[i], b[0]), f"M={M}: member {j}'s row {i} differs from its 1-row call"


def test_grouped_empty_dims():
    x = rand(2, 0)
    ws, bs = [rand(3, 0), rand(4, 0)], [rand(3), rand(4)]
    ys = grouped_skinny_linear(x, ws, bs)
    assert torch.equal(ys[0], bs[0].expand(2, 3)) and torch.equal(ys[1], bs[1].expand(2, 4))
    assert [tuple(y.shape) for y in grouped_skinny_linear(rand(0, 5), [rand(3, 5), rand(2, 5)])] == [(0, 3), (0, 2)]


@pytest.mark.parametrize("call, match", [
    (lambda x, w: grouped_skinny_linear(x, []), r"1 to 4 weights, got 0"),
    (lambda x, w: grouped_skinny_linear(x, [w] * (MAX_MEMBERS + 1)), r"1 to 4 weights, got 5"),
    (lambda x, w: grouped_skinny_linear(x, [w, w], [torch.randn(6, device=DEVICE)]), r"one tensor per weight \(2\)"),
    (lambda x, w: grouped_skinny_linear(x, [w, w], [torch.randn(6, device=DEVICE), None]), r"one tensor per weight"),
    (lambda x, w: grouped_skinny_linear(x, [w, w[:, :11]]), r"K = 11"),
    (lambda x, w: grouped_skinny_linear(x, [w, w.t().contiguous().t()]), r"weight 1, its bias and its out must be "
                                                                           r"contiguous"),
    (lambda x, w: grouped_skinny_linear(x, [w], outs=[]), r"outs must be None or one tensor per weight \(1\), got 0"),
    (lambda x, w: grouped_skinny_linear(x, [w, w], outs=[None, None]), r"outs\[0\] is None"),
    (lambda x, w: grouped_skinny_linear(x, [w, w.half()]), r"weight 1: weight is torch.float16 but x is torch.float32"),
    (lambda x, w: grouped_skinny_linear(torch.cat([x] * 17), [w]), r"M = 68 rows .* at most 64"),
])
def test_grouped_bad_input_is_named(call, match):
    x, w = rand(4, 12), rand(6, 12)
    with pytest.raises(ValueError, match=match):
        call(x, w)


class Block(torch.nn.Module):
    """q, k, v read x; ``side`` (same in_features) reads y; ``o`` reads the attention output."""

    def __init__(self, d=24, bias=False):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, n, bias=bias) for n in (20, 8, 8))
        self.side = torch.nn.Linear(d, 5, bias=bias)
        self.o = torch.nn.Linear(20, d, bias=bias)

    def forward(self, x, y):
        return self.o(self.q(x) + self.k(x).repeat(1, 1, 3)[..., :20] * self.v(x).sum(-1, keepdim=True)), self.side(y)


@needs_triton_interpreter
@pytest.mark.parametrize("bias", [False, True])
def test_merged_linears_merge_only_what_shares_an_input(monkeypatch, bias):
    """The first forward learns (all F.linear); then q, k, v run as one grouped call per forward,
    ``side`` (another input) and ``o`` (another width) by F.linear; results equal the unmerged
    module's within fp32 reassociation; a modified input is not mistaken for the merged one."""
    torch.manual_seed(0)
    block = Block(bias=bias).to(DEVICE).requires_grad_(False)
    x, y = rand(2, 3, 24), rand(2, 3, 24)
    want = block(x, y)
    groups = count_grouped_calls(monkeypatch, lambda x, ws: tuple(w.shape[0] for w in ws))
    with merged_linears(block, backend_name="triton") as n:
        assert n == 1 and "forward" in vars(block.q) and "forward" not in vars(block.o)
        first = block(x, y)
        assert groups == []  # learning
        for _ in range(2):
            got = block(x, y)
        assert groups == [(20, 8, 8)] * 2
        q = block.q(x)
        x.add_(1.0)  # modified in place: its k is not the merged one
        assert rel_err(block.k(x), F.linear(x, block.k.weight, block.k.bias)) < TOL[torch.float32]
        x.sub_(1.0)
        assert groups == [(20, 8, 8)] * 3  # k on the modified x: not handed q's merged k, and the group relearns
        block(x, y)  # relearns
        again = block(x, y)
        assert groups == [(20, 8, 8)] * 4
        assert rel_err(q, F.linear(x, block.q.weight, block.q.bias)) < TOL[torch.float32]
    assert all("forward" not in vars(m) for m in block.modules())
    for a, b in zip(first + got + again, want * 3):
        assert rel_err(a, b) < TOL[torch.float32]


@needs_triton_interpreter
def test_a_program_compiled_whole_traces_its_merged_linears(monkeypatch):
    """A forward traced by ``torch.compile`` (a program compiled whole, as ``compile_proposal=True``
    builds) inside the block runs each member as F.linear, traced in one graph: the group's
    bookkeeping (an input's version counter, ``is_inference``) cannot be traced, and failed there."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    block = Block().to(DEVICE).requires_grad_(False)
    x, y = rand(2, 3, 24), rand(2, 3, 24)
    want = block(x, y)
    groups = count_grouped_calls(monkeypatch, lambda x, ws: len(ws))
    with merged_linears(block, backend_name="triton"):
        block(x, y)
        block(x, y)  # learnt: q, k, v merge eagerly
        assert groups == [3]
        got = torch.compile(block, fullgraph=True, backend="eager")(x, y)
        assert groups == [3]  # the compiled forward ran no grouped launch
    for a, b in zip(got, want):
        assert rel_err(a, b) < TOL[torch.float32]


@needs_triton_interpreter
def test_a_capture_merges_only_what_ran_merged_before_it(monkeypatch):
    """Inside a (simulated) capture a group merges only with a tile count a run outside it merged
    with, so no kernel is first built while capturing; a failing kernel leaves the group unmerged
    with a warning and exact results."""
    torch.manual_seed(1)
    block = Block().to(DEVICE).requires_grad_(False)
    x, y = rand(2, 3, 24), rand(2, 3, 24)
    want = block(x, y)
    calls = count_grouped_calls(monkeypatch, lambda x, ws: x.numel() // x.shape[-1])
    capturing = [False]
    monkeypatch.setattr(linear_mod, "_capturing", lambda x: capturing[0])
    with merged_linears(block, backend_name="triton"):
        block(x, y)  # learns
        capturing[0] = True
        block(x, y)
        assert calls == []  # merged, but never outside a capture: F.linear
        capturing[0] = False
        block(x, y)
        capturing[0] = True
        got = block(x, y)
        assert calls == [6, 6]
        x17 = rand(17, 24)  # two 16-row tiles: a variant not run outside the capture
        block(x17, y)
        assert calls == [6, 6]

        def broken(*args, **kw):
            raise RuntimeError("no kernel for this device")

        # a group whose members were all seen together builds its launch at once: one warm-up suffices
        trio = torch.nn.ModuleDict({n: torch.nn.Linear(24, 6, bias=False) for n in "abc"}).requires_grad_(False)
        capturing[0] = False
        with merged_linears(trio, backend_name="triton"):
            for name in "abc":
                trio[name](x)
            assert calls == [6, 6, 6]  # the launch built right after the round that saw all three
            capturing[0] = True
            merged = [trio[name](x) for name in "abc"]
            assert calls == [6, 6, 6, 6]
        for name, y_ in zip("abc", merged):
            assert rel_err(y_, F.linear(x, trio[name].weight)) < TOL[torch.float32]
        capturing[0] = False
        monkeypatch.setattr(linear_mod, "grouped_skinny_linear", broken)
        with pytest.warns(RuntimeWarning, match="grouped kernel failed .* no kernel for this device"):
            failed = block(x, y)
        block(x, y)  # no second warning: the group runs unmerged now
    for a, b in zip(got + failed, want + want):
        assert rel_err(a, b) < TOL[torch.float32]


_BUILD_FOR_HOPPER = """
from specdec.kernels.linear import triton_skinny as ts

def build(fn, pointers, constants):
    ptx = hopper_ptx(fn, constants, {n: "*bf16" for n in pointers}, divisible_ints=True).splitlines()
    return [sum(line.strip().startswith("cp.async.cg") for line in ptx), sum("ld.global" in line for line in ptx)]

tiles = dict(NUM_TILES=2, K_STEPS=20, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, HAS_BIAS=False, DOT_PRECISION="ieee",
             UPCAST=False, stride_xk=1)
print(json.dumps({
    "grouped": build(ts._grouped_skinny_kernel, {"x", "W0", "W1", "W2", "W3", "Y0", "Y1", "Y2", "Y3"},
                     {**tiles, **{f"B{i}": None for i in range(4)}}),
    "single": build(ts._skinny_linear_kernel, {"x", "w", "w_u", "y"},
                    {**tiles, "PARTIAL": False, "b": None, "b_u": None, "stride_wk": 1, "stride_yn": 1, "ACT": 0,
                     "GATED": False}),
    "gated": build(ts._skinny_linear_kernel, {"x", "w", "w_u", "y"},
                   {**tiles, "PARTIAL": False, "b": None, "b_u": None, "stride_wk": 1, "stride_yn": 1, "ACT": 1,
                    "GATED": True}),
}))
"""


def test_grouped_kernel_builds_for_hopper():
    """The grouped kernel compiles ahead of time for an H100/H200 (sm_90) with Triton's own ptxas,
    on a machine without a GPU, and streams its weight tiles with the same 16-byte asynchronous
    copies as the one-weight kernel (its members' pointers keep their alignment; no plain global
    loads), and so does the gated launch for both its weights. Compiled in a child process: this one runs Triton's interpreter."""
    counts = built_for_hopper(_BUILD_FOR_HOPPER)
    assert counts["grouped"][0] > 0 and counts["grouped"] == counts["single"], counts
    assert counts["gated"][0] > counts["single"][0] and counts["gated"][1] == 0, counts  # both weights streamed so


@needs_triton_interpreter
def test_what_a_group_learnt_outlives_its_block_and_inference_tensors_run_unmerged(monkeypatch):
    """A later block (a capture after its warm-up's block) merges at once with what an earlier
    block learnt and ran; inputs made under torch.inference_mode (no version counter) run
    F.linear; members that stop sharing their input make the group learn again."""
    trio = torch.nn.ModuleDict({n: torch.nn.Linear(24, 6) for n in "abc"}).requires_grad_(False)
    x = rand(4, 24)
    calls = count_grouped_calls(monkeypatch, lambda x, ws: len(ws))
    capturing = [False]
    monkeypatch.setattr(linear_mod, "_capturing", lambda x: capturing[0])
    with merged_linears(trio, backend_name="triton"):
        for name in "abc":
            trio[name](x)
    assert calls == [3]  # learnt, and its launch run once
    capturing[0] = True
    with merged_linears(trio, backend_name="triton"):
        got = [trio[name](x) for name in "abc"]
    assert calls == [3, 3]
    capturing[0] = False
    with torch.inference_mode(), merged_linears(trio, backend_name="triton"):
        xi = x.clone()
        inf = [trio[name](xi) for name in "abc"]
    assert calls == [3, 3]
    with merged_linears(trio, backend_name="triton"):
        apart = [trio["a"](x), trio["b"](x + 1), trio["c"](x + 2)]  # a merged launch, then b and c do not take theirs
        again = [trio[name](x) for name in "abc"]  # relearnt: all three read one input
    assert calls == [3, 3, 3, 3]
    for name, ys in zip("abc", zip(got, inf, again)):
        for y_ in ys:
            assert rel_err(y_, F.linear(x, trio[name].weight, trio[name].bias)) < TOL[torch.float32]
    for y_, (name, shift) in zip(apart, zip("abc", (0, 1, 2))):
        assert rel_err(y_, F.linear(x + shift, trio[name].weight, trio[name].bias)) < TOL[torch.float32]


@needs_triton_interpreter
def test_what_a_group_keeps_does_not_keep_the_model_alive():
    import gc
    import weakref

    trio = torch.nn.ModuleDict({n: torch.nn.Linear(24, 6) for n in "abc"}).requires_grad_(False)
    x = rand(2, 24)
    with merged_linears(trio, backend_name="triton"):
        for _ in range(2):
            for name in "abc":
                trio[name](x)
    alive = weakref.ref(trio["a"])
    del trio
    gc.collect()
    assert alive() is None


@needs_triton_interpreter
def test_threads_outside_a_block_and_hooked_linears_run_their_own_forward(monkeypatch):
    """Only a thread inside a block merges (another thread calling the routed linears meanwhile
    runs F.linear); linears with forward hooks (pruning rebuilds the weight per call) are not
    grouped; a merged result whose member's weight changed since is not handed out."""
    import threading

    trio = torch.nn.ModuleDict({n: torch.nn.Linear(24, 6) for n in "abc"}).requires_grad_(False)
    x = rand(2, 24)
    calls = count_grouped_calls(monkeypatch, lambda x, ws: len(ws))
    with merged_linears(trio, backend_name="triton"):
        for name in "abc":
            trio[name](x)
        assert calls == [3]
        seen = {}
        worker = threading.Thread(target=lambda: seen.update({n: trio[n](x) for n in "abc"}))
        worker.start()
        worker.join()
        assert calls == [3]  # the other thread ran F.linear
        for n, y_ in seen.items():
            assert torch.equal(y_, F.linear(x, trio[n].weight, trio[n].bias))
        ya = trio["a"](x)  # merged: b and c wait for their calls
        trio["b"].weight.add_(1.0)  # changed after the merged call
        yb = trio["b"](x)
    assert calls == [3, 3]
    assert rel_err(yb, F.linear(x, trio["b"].weight, trio["b"].bias)) < TOL[torch.float32]
    assert rel_err(ya, F.linear(x, trio["a"].weight, trio["a"].bias)) < TOL[torch.float32]
    import torch.nn.utils.prune as prune

    prune.l1_unstructured(trio["a"], "weight", amount=0.5)
    assert [len(g) for g in sibling_groups(trio)] == [2]  # b and c; the pruned a has a pre-hook
    with pytest.raises(ValueError, match="one group only"):
        with merged_linears(trio, groups=[[trio["b"], trio["c"]], [trio["c"], trio["b"]]]):
            pass


def test_nested_fusion_blocks_leave_the_compiled_modules_alone(monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setenv("SPECDEC_SKINNY_LINEARS", "0")  # (the merged groups alone; the singles: below)
    model = get_model("qwen3_5")
    mlp_linears = {id(m) for mod in model.modules() if type(mod).__name__.endswith("MLP") for m in mod.children()}
    with fused(model), fused(model):
        routed = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" in vars(m)]
    assert routed and not any(id(m) in mlp_linears for m in routed)
    assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)


def test_sibling_groups_respect_skip_and_the_member_limit():
    wide = torch.nn.Module()
    for i in range(6):
        setattr(wide, f"p{i}", torch.nn.Linear(8, 4))
    wide.nobias = torch.nn.Linear(8, 4, bias=False)
    wide.block = Block()
    groups = sibling_groups(wide)
    sizes = sorted(len(g) for g in groups)
    assert sizes == [2, 4, 4]  # p0..p3, p4..p5 (the bias-free one alone is no group), q/k/v/side
    assert sibling_groups(wide, skip=lambda m: m is wide.block) == [g for g in groups if wide.block.q not in g]
    with pytest.raises(ValueError, match=r"groups of at most 4 linears, got sizes \[5\]"):
        with merged_linears(wide, groups=[[getattr(wide, f"p{i}") for i in range(5)]]):
            pass
    with pytest.raises(ValueError, match="backend_name"):
        with merged_linears(wide, backend_name="cuda"):
            pass
    with pytest.raises(ValueError, match="share input width, dtype, device and having a bias"):
        with merged_linears(wide, groups=[[wide.p0, wide.nobias]]):
            pass
    with merged_linears(wide, groups=[[wide.p0, wide.p1]], backend_name="triton") as n:
        assert n == 1 and "forward" in vars(wide.p0) and "forward" not in vars(wide.p2)
    with merged_linears(wide, groups=[[wide.p0, wide.p1]], backend_name="torch") as n:
        assert n == 1 and "forward" not in vars(wide.p0)  # no kernel on this backend: nothing routed


@needs_triton_interpreter
def test_greedy_generation_through_merged_linears_is_unchanged(monkeypatch):
    """fp32 tiny Qwen3.5: the engine's greedy output with the GDN layers' qkv / z / b / a, the
    attention layers' q / k / v and the MLPs' gate / up merged (decode and verify rows <= 64)
    equals HF greedy; the grouped kernel ran for every kind of group."""
    model = get_model("qwen3_5")
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask, 8)
    calls = count_grouped_calls(monkeypatch, lambda x, ws: len(ws))
    with merged_linears(model, backend_name="triton") as n:
        assert n > 0
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(out, want)
    assert set(calls) == {2, 3, 4}, set(calls)  # the MLPs' gate / up, q / k / v, the GDN's four input projections
    assert all("forward" not in vars(m) for m in model.modules())


def test_fusion_routes_siblings_outside_the_compiled_modules(monkeypatch):
    """fused() merges sibling projections on the Triton backend, not the linears inside the MLPs it
    compiles (nothing runs here: entering the block only routes forwards); SPECDEC_MERGE_LINEARS=0
    leaves them."""
    model = get_model("qwen3_5")
    mlp_linears = {id(m) for mod in model.modules() if type(mod).__name__.endswith("MLP") for m in mod.children()}
    monkeypatch.setenv("SPECDEC_SKINNY_LINEARS", "0")  # (the merged groups alone; the singles: below)
    with fused(model):  # the CPU's backend (torch) has no kernel to merge with: nothing routed
        assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    with fused(model):
        routed = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" in vars(m)]
    assert routed and not any(id(m) in mlp_linears for m in routed)
    monkeypatch.setenv("SPECDEC_MERGE_LINEARS", "0")
    with fused(model):
        assert not any(type(m) is torch.nn.Linear and "forward" in vars(m) for m in model.modules())
    assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("Ns, K", [((8192, 4096, 32, 32), 2560), ((8192, 1024, 1024), 2560),
                                   ((4096, 1024, 1024), 3072)])
def test_bench_groups_on_gpu(Ns, K):
    """bf16 at the bench models' sibling groups: every M of 1..64 within bf16 rounding of the
    reference and batch-invariant bit for bit; a CUDA-graph replay equals the eager call."""
    gen = torch.Generator().manual_seed(0)
    ws = [rand(N, K, dtype=torch.bfloat16, gen=gen) for N in Ns]
    x = rand(MAX_ROWS, K, dtype=torch.bfloat16, gen=gen)
    rows = {i: grouped_skinny_linear(x[i:i + 1], ws) for i in (0, 15, 16, 63)}
    for M in (1, 4, 16, 17, 64):
        ys = grouped_skinny_linear(x[:M], ws)
        for j, (y, w) in enumerate(zip(ys, ws)):
            assert rel_err(y, linear_ref(x[:M], w)) < TOL[torch.bfloat16]
            for i, one in rows.items():
                if i < M:
                    assert torch.equal(one[j][0], y[i]), f"member {j}: row {i} of M={M} differs from its 1-row call"
    xs = x[:5].clone()
    outs = [torch.empty(5, N, device=DEVICE, dtype=torch.bfloat16) for N in Ns]
    grouped_skinny_linear(xs, ws, outs=outs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_skinny_linear(xs, ws, outs=outs)
    xs.copy_(rand(5, K, dtype=torch.bfloat16, gen=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, grouped_skinny_linear(xs, ws)))


def count_single_calls(monkeypatch) -> list:
    """Route the singles' skinny_linear through a recorder: the rows of every call, in order."""
    seen = []

    def counted(x, weight, *args, **kw):
        seen.append(x.numel() // x.shape[-1])
        return skinny_linear(x, weight, *args, **kw)

    monkeypatch.setattr(linear_mod, "skinny_linear", counted)
    return seen


@needs_triton_interpreter
def test_single_linears_take_the_kernel_up_to_their_rows(monkeypatch):
    """At most ``max_rows`` rows run the kernel (within the fp32 tolerance of F.linear), more rows,
    another thread, a gradient (of the input, the weight or the bias) and a linear off the Triton
    backend run F.linear bit for bit; a capture runs only launch variants that ran before it; a
    failing kernel warns once and leaves F.linear; the modules' forward is theirs again afterwards."""
    import threading

    monkeypatch.setattr(linear_mod, "_SINGLE_VARIANTS", linear_mod._Variants())
    torch.manual_seed(2)
    a, b = torch.nn.Linear(24, 10).to(DEVICE), torch.nn.Linear(24, 7, bias=False).to(DEVICE)
    calls = count_single_calls(monkeypatch)
    capturing = [False]
    monkeypatch.setattr(linear_mod, "_capturing", lambda x: capturing[0])
    x3, x5 = rand(3, 24), rand(5, 24)
    with torch.no_grad(), single_linears([a, b, a], max_rows=4, backend_name="triton") as n:
        assert n == 2  # (a linear given twice is routed once)
        for lin in (a, b):
            assert rel_err(lin(x3), F.linear(x3, lin.weight, lin.bias)) < TOL[torch.float32]
            assert torch.equal(lin(x5), F.linear(x5, lin.weight, lin.bias))  # 5 rows > 4
        assert calls == [3, 3]
        seen = {}
        worker = threading.Thread(target=lambda: seen.update(y=a(x3)))
        worker.start()
        worker.join()
        assert torch.equal(seen["y"], F.linear(x3, a.weight, a.bias)) and calls == [3, 3]
        capturing[0] = True
        a(x3)  # ran before, outside a capture
        assert calls == [3, 3, 3]
        a(rand(2, 24))  # a variant not run outside the capture: F.linear
        a(rand(3, 48)[:, :24])  # three rows again, but another variant (its strides): F.linear
        assert calls == [3, 3, 3]
        capturing[0] = False

        def broken(*args, **kw):
            raise RuntimeError("no kernel for this device")

        monkeypatch.setattr(linear_mod, "skinny_linear", broken)
        x1 = rand(1, 24)
        with pytest.warns(RuntimeWarning, match="skinny linears: the kernel failed .* no kernel for this device"):
            y1 = b(x1)
        assert torch.equal(y1, F.linear(x1, b.weight)) and torch.equal(b(x1), y1)  # (no second warning)
    a.weight.requires_grad_(False)
    with torch.enable_grad(), single_linears([a], max_rows=4, backend_name="triton"):
        y = a(x3)  # only the bias wants a gradient: F.linear, and the gradient reaches it
        assert torch.equal(y, F.linear(x3, a.weight, a.bias))
        y.sum().backward()
        assert torch.equal(a.bias.grad, torch.full_like(a.bias, 3.0))
    with single_linears([a], backend_name="torch") as n:
        assert n == 0 and "forward" not in vars(a)
    assert "forward" not in vars(a) and "forward" not in vars(b)


def test_single_linears_refuse_what_they_cannot_take():
    a = torch.nn.Linear(4, 4)

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    for rows in (MAX_ROWS + 1, 0, 2.5, True, None):
        with pytest.raises(ValueError, match=rf"max_rows must be an int in 1..64, got {rows}"):
            with single_linears([a], max_rows=rows):
                pass
    with pytest.raises(ValueError, match=r"exactly that class: a subclass's own forward would be bypassed\), got "
                                         r"\['Conv1d', 'Scaled'\]"):
        with single_linears([torch.nn.Conv1d(2, 2, 1), Scaled(4, 4)]):
            pass
    with pytest.raises(ValueError, match="takes an iterable of nn.Linear modules, got one Linear"):
        with single_linears(a):
            pass
    with pytest.raises(ValueError, match="backend_name"):
        with single_linears([a], backend_name="cuda"):
            pass


@needs_triton_interpreter
def test_single_linears_inside_a_compiled_module_check_their_guards_when_they_run(monkeypatch):
    """Traced by torch.compile, a routed linear is one op whose guards run with it: the kernel on the
    block's thread, F.linear on another thread and after a failure (with one warning); a sibling
    group's member that runs on its own takes the kernel too."""
    import threading

    monkeypatch.setattr(linear_mod, "_SINGLE_VARIANTS", linear_mod._Variants())
    torch.manual_seed(3)
    mlp = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.SiLU(), torch.nn.Linear(16, 24)).requires_grad_(False)
    compiled = torch.compile(mlp.forward, fullgraph=True)
    x = rand(2, 24)
    want = mlp(x)
    calls = count_single_calls(monkeypatch)
    with single_linears([mlp[0], mlp[2]], backend_name="triton"):
        assert rel_err(compiled(x), want) < TOL[torch.float32] and calls == [2, 2]
        seen = {}
        worker = threading.Thread(target=lambda: seen.update(y=compiled(x)))
        worker.start()
        worker.join()
        assert calls == [2, 2] and rel_err(seen["y"], want) < TOL[torch.float32]

        def broken(*args, **kw):
            raise RuntimeError("no kernel for this device")

        monkeypatch.setattr(linear_mod, "skinny_linear", broken)
        monkeypatch.setattr(linear_mod, "_SINGLE_VARIANTS", linear_mod._Variants())
        x9 = rand(9, 24)
        with pytest.warns(RuntimeWarning, match="the kernel failed"):
            y9 = compiled(x9)
        assert rel_err(y9, mlp(x9)) < TOL[torch.float32]
    calls = count_single_calls(monkeypatch)
    block = Block().to(DEVICE).requires_grad_(False)  # q / k / v merge; side reads another input: on its own
    xb, yb = rand(2, 3, 24), rand(2, 3, 24)
    want_b = block(xb, yb)
    with merged_linears(block, backend_name="triton"), single_linears([block.o], backend_name="triton"):
        block(xb, yb)  # the group learns
        calls.clear()
        got = block(xb, yb)
    assert calls == [6, 6]  # side (on its own) and o, through the kernel
    for g, w in zip(got, want_b):
        assert rel_err(g, w) < TOL[torch.float32]


@needs_triton_interpreter
def test_greedy_generation_through_single_linears_is_unchanged(monkeypatch):
    """fp32 tiny Qwen3.5: the engine's greedy output with every linear through the kernel (decode
    and verify rows <= 16; a verify of more rows runs F.linear) equals HF greedy."""
    model = get_model("qwen3_5", "small")  # (every kind of linear of the family, through the interpreter)
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask, 8)
    calls = count_single_calls(monkeypatch)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with single_linears(linears, backend_name="triton") as n:
        assert n == len(linears)
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(out, want)
    assert calls and max(calls) <= SINGLE_MAX_ROWS
    assert all("forward" not in vars(m) for m in model.modules())


def test_fusion_routes_every_other_linear_through_the_kernel(monkeypatch):
    """On the Triton backend fused() routes the linears it does not merge -- the MLPs' (inside their
    compiled forward), output projections, the LM head -- through single_linears, and the merged
    groups' members not; SPECDEC_SKINNY_LINEARS=0 leaves them."""
    from specdec.fusion import merge_candidates, single_candidates

    model = get_model("qwen3_5")
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    groups = merge_candidates(model)
    singles = single_candidates(model, groups)
    grouped = {id(m) for g in groups for m in g}
    mlp_linears = {id(m) for mod in model.modules() if type(mod).__name__.endswith("MLP") for m in mod.children()
                   if type(m) is torch.nn.Linear}
    assert mlp_linears and mlp_linears <= {id(m) for m in singles} and model.lm_head in singles
    assert not grouped & {id(m) for m in singles}
    assert len(singles) + len(grouped) == sum(type(m) is torch.nn.Linear for m in model.modules())
    with fused(model):
        routed = {id(m) for m in model.modules() if type(m) is torch.nn.Linear and "forward" in vars(m)}
    assert routed == grouped | {id(m) for m in singles}
    monkeypatch.setenv("SPECDEC_SKINNY_LINEARS", "0")
    with fused(model):
        routed = {id(m) for m in model.modules() if type(m) is torch.nn.Linear and "forward" in vars(m)}
    assert routed == grouped
    assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)


@needs_triton_interpreter
def test_a_model_built_in_inference_mode_merges_and_decodes():
    """Weights made under torch.inference_mode() have no version counter: a group's merged
    results are still handed out (read the version of such a weight, the merged call raised), and
    the engine's greedy output inside merged_linears equals HF greedy."""
    from tiny_models import make_model

    with torch.inference_mode():
        model = make_model("qwen3_5", small=True)  # (the small model: every launch runs through the interpreter)
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask, 5)
    calls = count_grouped_calls(monkeypatch_free := pytest.MonkeyPatch(), lambda x, ws: len(ws))
    try:
        with merged_linears(model, backend_name="triton"):
            sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
    finally:
        monkeypatch_free.undo()
    assert torch.equal(out, want)
    assert calls  # merged launches ran on the inference-mode weights
