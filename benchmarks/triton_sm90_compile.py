"""Compile every Triton kernel variant for an H100/H200 (sm_90) on a machine with no GPU.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute, not that they
compile: it accepts Python the compiler rejects. This script calls the public kernel functions
with CPU tensors at the benchmark's real shapes, intercepts each launch, and runs Triton's full
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas) for ``cuda:90``.
Must run WITHOUT ``TRITON_INTERPRET``. Prints one line per variant and ``COMPILED n`` last;
exits 1 on the first failure.

    python benchmarks/triton_sm90_compile.py          # every variant (a few minutes)
    python benchmarks/triton_sm90_compile.py --quick  # one variant per kernel (tests/test_kernels_triton.py)
    python benchmarks/triton_sm90_compile.py --quick --sass  # + each kernel's order of global loads (LDG),
                                                             # stores (STG) and barriers (BAR) in its SASS
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: this script compiles the kernels for sm_90")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specdec.kernels.conv1d import triton_conv  # noqa: E402
from specdec.kernels.norm import triton_norm  # noqa: E402
from specdec.kernels.linear import triton_skinny as sk  # noqa: E402
from specdec.kernels.linear import triton_activation  # noqa: E402
from specdec.kernels.attention import triton_attention as ta  # noqa: E402
from specdec.kernels.gdn import triton_step as dr  # noqa: E402
from specdec.kernels.mamba2 import triton_step as m2  # noqa: E402
from specdec.kernels.mamba2 import triton_heads  # noqa: E402
from specdec.kernels import triton_common  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32",
           torch.bool: "i1"}
_SEEN: set = set()
T_LONG = 5  # step tokens of the compiled variants (K = 4)
COMPILED = []
SASS = False


def _compile_launch(kernel, grid, args, kwargs):
    params = kernel.params
    names = [p.name for p in params]
    bound = dict(zip(names, args))
    num_warps = kwargs.pop("num_warps", 4)
    bound.update(kwargs)
    # the specialisation Triton's JIT applies at a launch: 16-byte aligned pointers and integers
    # divisible by 16 get a divisibility hint (it enables vector loads), integers equal to 1 become
    # constants -- without it the register counts printed below differ from the real kernels'
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(params):
        val = bound[p.name]
        if p.is_constexpr or val is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = val
        elif isinstance(val, torch.Tensor):
            signature[p.name] = "*" + _DTYPES[val.dtype]
            if val.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, bool):
            signature[p.name] = "i1"
        elif isinstance(val, int):
            if val == 1:
                signature[p.name] = "constexpr"
                constexprs[p.name] = 1
                continue
            signature[p.name] = "i64" if abs(val) >= 2**31 else "i32"
            if val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(val, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{p.name}: {type(val)}")
    key = (kernel.fn.__name__, tuple(sorted(signature.items())), tuple(sorted((k, str(v)) for k, v in constexprs.items())),
           tuple(sorted(attrs)), num_warps)
    if key in _SEEN:
        return
    _SEEN.add(key)
    t0 = time.time()
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    desc = ", ".join(f"{k}={v}" for k, v in constexprs.items() if v is not None and k.isupper())
    print(f"ok  {kernel.fn.__name__:28s} {desc}  warps={num_warps}  {_resource_usage(compiled)}  "
          f"{time.time() - t0:.1f}s", flush=True)
    if SASS:
        print(f"    sass: {_sass_summary(compiled)}", flush=True)
    COMPILED.append(key)


def cuobjdump(compiled, flag: str) -> str | None:
    """The bundled cuobjdump's output with ``flag`` (``-res-usage``, ``-sass``) for a compiled
    kernel's cubin, or None when Triton ships no cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def _resource_usage(compiled) -> str:
    """Registers / spills / shared memory of the cubin, from the bundled cuobjdump (or '')."""
    res = cuobjdump(compiled, "-res-usage")
    if res is None:
        return ""
    m = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", res)
    return f"regs={m.group(1)} smem={m.group(2)} local(spill)={m.group(3)}" if m else ""


def _sass_summary(compiled) -> str:
    """The kernel's global loads / stores and barriers in program order, runs collapsed (LDGx5 = 5 loads)."""
    sass = cuobjdump(compiled, "-sass")
    if sass is None:
        return "(no cuobjdump)"
    runs = []
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        op = next((k for k in ("LDG", "STG", "BAR") if m and m.group(2).startswith(k)), None)
        if op is None:
            continue
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(f"{a}x{b}" if b > 1 else a for a, b in runs)


def _intercept(kernel):
    def run(*args, grid, warmup, **kwargs):
        if kwargs.get("UPCAST"):  # (chosen for the CPU tensors here; a GPU's launch multiplies bf16 directly)
            kwargs["UPCAST"] = False
        _compile_launch(kernel, grid, args, kwargs)

    kernel.run = run


for _k in (dr._delta_rule_step_kernel, dr._delta_rule_fold_kernel, m2._mamba2_step_kernel, m2._mamba2_fold_kernel,
           triton_conv._conv1d_verify_kernel, triton_conv._conv1d_commit_kernel, triton_common._state_copy_commit_kernel,
           triton_common._ring_commit_kernel, triton_common._replay_commit_history_kernel,
           triton_norm._rms_norm_kernel, triton_heads._heads_kernel, triton_activation._mlp_activation_kernel, sk._skinny_linear_kernel, sk._split_k_reduce_kernel,
           sk._grouped_skinny_kernel, ta._step_attention_kernel, ta._combine_kernel):
    _intercept(_k)


def delta_rule_variants(quick: bool):
    B, T, H, K, V = 2, T_LONG, 32, 128, 128
    L = 2 * T  # a fused replay history (the unfused calls accept any L)
    dt = torch.bfloat16
    for per_channel in ([False] if quick else [False, True]):
        q = F.normalize(torch.randn(B, T, H, K), dim=-1).to(dt)
        k, v = q.clone(), torch.randn(B, T, H, V, dtype=dt)
        g = -torch.rand(B, T, H, K if per_channel else 1).squeeze(-1).to(dt) if per_channel else -torch.rand(B, T, H).to(dt)
        beta = torch.rand(B, T, H, dtype=dt)
        s = torch.zeros(B, H, K, V)
        buf = torch.zeros(B, T, H, K, V)
        ring = torch.zeros(B, T + 1, H, K, V)
        head = torch.zeros(B, dtype=torch.long)
        hk, hg, hu = torch.zeros(B, L, H, K), torch.zeros(B, L, *g.shape[2:]), torch.zeros(B, L, H, V)
        hl = torch.zeros(B, dtype=torch.long)
        for si in ([None] if quick else [None, torch.arange(B)]):
            # the hand-picked launches of _launch_config: value block 16 / 2 warps (chains' plain
            # update and replay), 32 / 4 (KDA snapshot/ring, trees, the fold), 64 / 4 (GDN
            # snapshot, ring and deferred replay at large batch)
            for bv, nw in ([(None, None)] if quick else [(16, 2), (16, 4), (32, 4), (64, 4)]):
                tune = dict(block_v=bv, num_warps=nw)
                dr.delta_rule_update(s, q, k, v, g, beta, si, **tune)
                dr.delta_rule_snapshot_verify(s, buf, q, k, v, g, beta, 0, si, **tune)
                dr.delta_rule_ring_verify(ring, head, q, k, v, g, beta, 0, si, **tune)
                dr.delta_rule_replay_verify(s, hk, hg, hu, hl, q, k, v, g, beta, 0, si, **tune)
                dr.delta_rule_replay_verify(s, hk, hg, hu, hl, q, k, v, g, beta, 0, si, fused=True, **tune)
                dr.delta_rule_replay_verify(s, hk, hg, hu, hl, q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], 1,
                                            si, fused=True, **tune)  # a later call of a step
                dr.delta_rule_replay_fold(s, hk, hg, hu, hl, si, **tune)
                dr.delta_rule_replay_commit(hk, hg, hu, hl, hl, si)
                dr.delta_rule_replay_commit(hk, hg, hu, hl, hl.clamp(max=1), si, max_tokens=1)  # a narrower step
        if not quick:  # no lookahead: each token's loads after the previous token's barriers
            dr.delta_rule_update(s, q, k, v, g, beta, prefetch=0)
        triton_common.state_copy_commit(s, buf, hl)
        triton_common.ring_commit(head, hl, T + 1)


def mamba2_variants(quick: bool):
    B, T, H, P, G, N = 2, T_LONG, 128, 64, 8, 128
    L = 2 * T  # a fused replay history (the unfused calls accept any L)
    dt_ = torch.bfloat16
    x = torch.randn(B, T, H, P, dtype=dt_)
    dt = torch.rand(B, T, H, dtype=dt_)
    A, D = -torch.rand(H), torch.randn(H)
    Bm, Cm = torch.randn(B, T, G, N, dtype=dt_), torch.randn(B, T, G, N, dtype=dt_)
    s = torch.zeros(B, H, P, N)
    buf = torch.zeros(B, T, H, P, N)
    ring = torch.zeros(B, T + 1, H, P, N)
    head = torch.zeros(B, dtype=torch.long)
    hx, hdt, hB = torch.zeros(B, L, H, P, dtype=dt_), torch.zeros(B, L, H, dtype=dt_), torch.zeros(B, L, G, N, dtype=dt_)
    hl = torch.zeros(B, dtype=torch.long)
    for si in ([None] if quick else [None, torch.arange(B)]):
        # the hand-picked launch configs (_launch_config): small batch (BP 16, 4 warps, all tokens
        # prefetched), large batch snapshot / ring / trees (BP 32, 8 warps, 3-token lookahead),
        # large batch plain update / deferred replay (BP 32, 4 warps, no lookahead) and large batch
        # fused replay (BP 8, 1 warp, 3-token lookahead)
        small, large = dict(block_p=16, num_warps=4, prefetch=5), dict(block_p=32, num_warps=8, prefetch=3)
        lean, one_warp = dict(block_p=32, num_warps=4, prefetch=0), dict(block_p=8, num_warps=1, prefetch=3)
        for d, tune in ([(D, {})] if quick else [(D, small), (D, large), (None, large), (D, lean), (D, one_warp)]):
            m2.mamba2_update(s, x, dt, A, Bm, Cm, d, si, **tune)
            m2.mamba2_snapshot_verify(s, buf, x, dt, A, Bm, Cm, d, 0, si, **tune)
            m2.mamba2_ring_verify(ring, head, x, dt, A, Bm, Cm, d, 0, si, **tune)
            m2.mamba2_replay_verify(s, hx, hdt, hB, hl, x, dt, A, Bm, Cm, d, 0, si, **tune)
            m2.mamba2_replay_verify(s, hx, hdt, hB, hl, x, dt, A, Bm, Cm, d, 0, si, fused=True, **tune)
            m2.mamba2_replay_verify(s, hx, hdt, hB, hl, x[:, :1], dt[:, :1], A, Bm[:, :1], Cm[:, :1], d, 1, si,
                                    fused=True, **tune)  # a later call of a step
            m2.mamba2_replay_fold(s, hx, hdt, hB, A, hl, si, block_p=tune.get("block_p"), num_warps=tune.get("num_warps"))
            m2.mamba2_replay_commit(hx, hdt, hB, hl, hl, si)
            m2.mamba2_replay_commit(hx, hdt, hB, hl, hl.clamp(max=1), si, max_tokens=1)  # a narrower step
    # a step as the layers run it: x, B, C slices of the conv output, dt the raw projection (dt_bias)
    xBC = torch.randn(B, T, H * P + 2 * G * N, dtype=dt_)
    xr, Br, Cr = (t.view(B, T, -1, w) for t, w in zip(torch.split(xBC, [H * P, G * N, G * N], -1), (P, N, N)))
    dtr = torch.randn(B, T, H + 7, dtype=dt_)[..., 7:]
    dt_bias = torch.randn(H, dtype=dt_)
    has_libdevice, m2.has_libdevice = m2.has_libdevice, lambda device: True  # as on a GPU: libdevice's exp
    try:
        m2.mamba2_update(s, xr, dtr, None, Br, Cr, D, dt_bias=dt_bias, A_log=A)
        m2.mamba2_replay_verify(s, hx, hdt, hB, hl, xr, dtr, None, Br, Cr, D, 0, fused=True, dt_bias=dt_bias, A_log=A)
    finally:
        m2.has_libdevice = has_libdevice
    if not quick:  # no lookahead: each token's loads after the previous token's barriers
        m2.mamba2_update(s, x, dt, A, Bm, Cm, D, block_p=32, num_warps=4, prefetch=0)

    # the prompt scan's per-head passes around fla's scan, at Nemotron-H-4B's 112 heads of 64 (x a
    # slice of the conv output): dt x into bf16, and the skip y += x D
    conv = torch.randn(B, T, 112 * 64 + 2 * G * N, dtype=dt_)
    xs = conv[..., : 112 * 64].view(B, T, 112, 64)
    triton_heads.discretized_input_triton(xs, torch.rand(B, T, 112), dt_)
    triton_heads.add_skip_triton_(torch.randn(B, T, 112, 64, dtype=dt_), xs, torch.randn(112))


def conv_variants(quick: bool):
    B, C, W, T = 2, 8192, 4, 5
    window = torch.zeros(B, C, W - 1 + T, dtype=torch.bfloat16)
    x = torch.randn(B, T, C, dtype=torch.bfloat16)
    wt, bias = torch.randn(C, W, dtype=torch.bfloat16), torch.randn(C, dtype=torch.bfloat16)
    for si in ([None] if quick else [None, torch.arange(B)]):
        triton_conv.conv1d_verify_triton(window, x, wt, bias, "silu", 0, si)
        triton_conv.conv1d_commit_triton(window, torch.ones(B, dtype=torch.long), W, si)
        triton_conv.conv1d_update_triton(window, x[:, :1], wt, bias, "silu", si)  # a plain step's
    # a slice of a projection's output whose token stride and start are not 16-byte multiples (another variant)
    xs = torch.randn(B, T, C + 8, dtype=torch.bfloat16)[..., 4 : 4 + C]
    triton_conv.conv1d_verify_triton(window, xs, wt, bias, "silu", 0)
    if not quick:
        triton_conv.conv1d_verify_triton(window, x, wt, None, None, 0)


def norm_variants(quick: bool):
    """The SSM mixers' gated RMSNorms (bf16, the gate a slice of the input projection): Nemotron-H-4B's
    8 groups of 896 channels, a Gated DeltaNet head's 128 gated after the norm and a KDA head's 128
    gated after it by a sigmoid, unrounded; unless quick, one group of 8,192 channels too. And the
    decoder's plain norms in their three forms."""
    forms = [(7168, 896, False, "silu", True), (128, 128, True, "silu", True), (128, 128, True, "sigmoid", False)]
    for D, group, after, activation, rounded in forms + ([] if quick else [(8192, 8192, False, "silu", True)]):
        y = torch.randn(2, 1, D, dtype=torch.bfloat16)
        gate = torch.randn(2, 1, D + 40, dtype=torch.bfloat16)[..., 8 : 8 + D]
        triton_norm.gated_rms_norm_triton(y, gate, torch.randn(D, dtype=torch.bfloat16), 1e-5, group, after,
                                          activation, rounded)
    # the decoder's plain norms: Nemotron-H's 3,072 channels rounded before the weight, Qwen3.5's 2,560
    # zero-centred, OLMo-hybrid's form at a head's 128; unless quick, 8,192 channels
    for D, offset, rounded in [(3072, False, True), (2560, True, False), (128, False, False)] + ([] if quick else [(8192, False, True)]):
        triton_norm.rms_norm_triton(torch.randn(4, D, dtype=torch.bfloat16), torch.randn(D, dtype=torch.bfloat16),
                                    1e-5, offset, rounded)


def linear_variants(quick: bool):
    """The skinny linear kernels at the bench models' MLP shapes, batch 1 (bf16): Qwen3.5-4B's gated
    SiLU gate / up (one launch) and down projection (split K), Nemotron-H-4B's squared-ReLU up
    projection; unless quick, 16 rows, the epilogues in the split-K reduction (a gated launch and
    a squared ReLU of few weight rows), and a sibling group. (The launches are called directly:
    the public functions refuse CPU tensors without the interpreter.)"""
    from specdec.kernels.linear import skinny_config

    dt = torch.bfloat16

    def launch(M, N, K, act=None, gated=False, bias=False):
        w, y = torch.randn(N, K, dtype=dt), torch.empty(M, N, dtype=dt)
        b = torch.randn(N, dtype=dt) if bias else None
        sk.skinny_launch(torch.randn(M, K, dtype=dt), w, b, y, skinny_config(N, K, dt), sk.ACT_CODES[act],
                         torch.randn(N, K, dtype=dt) if gated else None, b if gated else None)

    for M in [1] if quick else [1, 16]:
        launch(M, 9216, 2560, "silu", gated=True)
        launch(M, 2560, 9216)
        launch(M, 12288, 3072, "relu2")
    if not quick:
        launch(4, 1024, 2560, "silu", gated=True, bias=True)
        launch(4, 1024, 2560, "relu2")
        ws = [torch.randn(n, 2560, dtype=dt) for n in (4096, 1024, 1024)]
        sk.grouped_launch(torch.randn(4, 2560, dtype=dt), ws, None, [torch.empty(4, w.shape[0], dtype=dt) for w in ws],
                          skinny_config(6144, 2560, dt))
    # a prompt's MLP activation between cuBLAS projections: Qwen3.5-4B's gated SiLU (9,216 wide),
    # Nemotron-H-4B's squared ReLU (12,288), a fused gate-up projection's strided halves
    g = torch.randn(4, 9216, dtype=torch.bfloat16)
    triton_activation.mlp_activation_triton(g, torch.randn(4, 9216, dtype=torch.bfloat16), "silu")
    triton_activation.mlp_activation_triton(torch.randn(4, 12288, dtype=torch.bfloat16), None, "relu2")
    halves = torch.randn(4, 2 * 9216, dtype=torch.bfloat16)
    triton_activation.mlp_activation_triton(halves[:, :9216], halves[:, 9216:], "silu")


def attention_variants(quick: bool):
    """The step attention at the bench models' attention shapes (bf16, additive mask): Qwen3.5-4B's
    16 query heads over 4 KV heads of width 256, a one-token step and a K = 4 verify; unless quick,
    Nemotron-H-4B's 32 over 8 of width 128 and a boolean mask."""
    dt = torch.bfloat16
    shapes = [(16, 4, 256, 1), (16, 4, 256, 5)] + ([] if quick else [(32, 8, 128, 5)])
    for H, Hkv, D, t in shapes:
        B, L = 1, 512
        q, k, v = torch.randn(B, H, t, D, dtype=dt), torch.randn(B, Hkv, L, D, dtype=dt), torch.randn(B, Hkv, L, D, dtype=dt)
        masks = [torch.zeros(B, 1, t, L, dtype=dt)] + ([] if quick else [torch.ones(B, 1, t, L, dtype=torch.bool)])
        for mask in masks:
            ta.step_attention_triton(q, k, v, mask, D ** -0.5, torch.empty(B, t, H, D, dtype=dt), 132)
    if not quick:  # a long cache at batch 1: the most splits (the combine kernel's widest load)
        H, Hkv, D, t, L = 16, 4, 256, 1, 32768
        q, k, v = torch.randn(1, H, t, D, dtype=dt), torch.randn(1, Hkv, L, D, dtype=dt), torch.randn(1, Hkv, L, D, dtype=dt)
        ta.step_attention_triton(q, k, v, None, D ** -0.5, torch.empty(1, t, H, D, dtype=dt), 132)


def tree_variants(quick: bool):
    """Tree steps (parents=): Medusa's 16-node "default" tree (nodes unrolled) and, unless quick, its
    64-node tree (a runtime node loop) at the benchmark's head shapes."""
    from specdec.tree import make_tree

    for name in ["default"] if quick else ["default", "medusa-63"]:
        t0 = time.time()
        _tree_variants(quick, make_tree(name, num_heads=4).parents)
        print(f"tree {name!r}: compiled in {time.time() - t0:.0f}s")


def _tree_variants(quick: bool, parents):
    B, T = 2, len(parents)
    dt_ = torch.bfloat16
    hl = torch.zeros(B, dtype=torch.long)
    head = torch.zeros(B, dtype=torch.long)
    # GDN / KDA at H = 32, K = V = 128
    H, K, V = 32, 128, 128
    for per_channel in ([False] if quick else [False, True]):
        q = F.normalize(torch.randn(B, T, H, K), dim=-1).to(dt_)
        k, v = q.clone(), torch.randn(B, T, H, V, dtype=dt_)
        g = -torch.rand(B, T, H, K).to(dt_) if per_channel else -torch.rand(B, T, H).to(dt_)
        beta = torch.rand(B, T, H, dtype=dt_)
        s = torch.zeros(B, H, K, V)
        hk, hg, hu = torch.zeros(B, 2 * T, H, K), torch.zeros(B, 2 * T, *g.shape[2:]), torch.zeros(B, 2 * T, H, V)
        dr.delta_rule_snapshot_verify(s, torch.zeros(B, T, H, K, V), q, k, v, g, beta, 0, parents=parents)
        dr.delta_rule_replay_verify(s, hk, hg, hu, hl, q, k, v, g, beta, 0, fused=True, parents=parents)
        if not quick:
            dr.delta_rule_ring_verify(torch.zeros(B, T + 1, H, K, V), head, q, k, v, g, beta, 0, parents=parents)
            dr.delta_rule_replay_verify(s, hk, hg, hu, hl, q, k, v, g, beta, 0, parents=parents)
    # Mamba-2 at H = 128, P = 64, G = 8, N = 128
    H, P, G, N = 128, 64, 8, 128
    x, dt = torch.randn(B, T, H, P, dtype=dt_), torch.rand(B, T, H, dtype=dt_)
    A, D = -torch.rand(H), torch.randn(H)
    Bm, Cm = torch.randn(B, T, G, N, dtype=dt_), torch.randn(B, T, G, N, dtype=dt_)
    s = torch.zeros(B, H, P, N)
    hx, hdt, hB = (torch.zeros(B, 2 * T, H, P, dtype=dt_), torch.zeros(B, 2 * T, H, dtype=dt_),
                   torch.zeros(B, 2 * T, G, N, dtype=dt_))
    m2.mamba2_ring_verify(torch.zeros(B, T + 1, H, P, N), head, x, dt, A, Bm, Cm, D, 0, parents=parents)
    m2.mamba2_replay_verify(s, hx, hdt, hB, hl, x, dt, A, Bm, Cm, D, 0, fused=True, parents=parents)
    if not quick:
        m2.mamba2_snapshot_verify(s, torch.zeros(B, T, H, P, N), x, dt, A, Bm, Cm, D, 0, parents=parents)
        m2.mamba2_replay_verify(s, hx, hdt, hB, hl, x, dt, A, Bm, Cm, D, 0, parents=parents)
    C, W = 8192, 4
    triton_conv.conv1d_tree_verify_triton(torch.zeros(B, C, W - 1 + T, dtype=dt_), torch.randn(B, T, C, dtype=dt_),
                                          torch.randn(C, W, dtype=dt_), torch.randn(C, dtype=dt_), "silu", parents)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one variant per kernel")
    ap.add_argument("--sass", action="store_true", help="print each kernel's LDG / STG / BAR order")
    args = ap.parse_args(argv)
    global SASS
    SASS = args.sass
    t0 = time.time()
    for fn in (delta_rule_variants, mamba2_variants, conv_variants, norm_variants, linear_variants, attention_variants,
               tree_variants):
        fn(args.quick)
    if not args.quick:  # the longest step (K = 8): unrolled T = 9 must not spill
        global T_LONG
        T_LONG = 9
        delta_rule_variants(True)
        mamba2_variants(True)
    print(f"COMPILED {len(COMPILED)} kernel variants for sm_90 in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
