"""Rollback-kernel benchmark: time per layer and step of each rollback strategy's Triton kernels.

For Mamba-2 (Nemotron-H shape: 128 heads x head dim 64 x state 128, 8 groups), GDN (Qwen3.5 /
Qwen3-Next shape: 32 value heads, 16 key heads expanded to 32 before the op, 128 x 128) and KDA
(Kimi-Linear shape: 32 heads, 128 x 128, per-channel decay), bf16 inputs and fp32 state, for
batch in {1, 8, 64, 256} and K in {1, 4, 8} (T = K + 1 step tokens), it measures one layer's
verify + commit (+ fold for replay; amortised over the steps for deferred replay) for

* ``baseline``: a plain multi-token update that overwrites the state (no rollback: the floor);
* ``snapshot``: verify writes T states into a buffer, commit copies slot n - 1 back;
* ``ring``: verify writes T states into a ring of R = T + 1 slots, commit moves the head;
* ``replay``: eager replay with the fold fused into the next verify (L = 2T): the verify folds
  the last commit's accepted tokens into the checkpoint in place (the step's one state read +
  write), runs T tokens from it writing no step state and appends (x, dt, B) / (k, g, u) to the
  history; the commit moves the accepted prefix of the history (one launch, no state traffic);
* ``replay_deferred``: verify folds the history in registers (checkpoint read only), commit =
  bookkeeping + a fold kernel that runs only when the next step could overflow the history
  (L = next pow2 >= 3T).

Accepted counts: each row keeps 1 + a tokens, a = number of leading accepted drafts with
per-token acceptance 0.7 (capped at K), drawn per step. Timing: each measured unit is a CUDA
graph of ``ROUNDS`` consecutive steps over ``n_rot`` independent copies of the state/inputs
(rotated so the working set exceeds L2: no host launch overhead, no warm-cache flattery);
median over replays, divided by the steps. Bytes: what the kernels read and write (states,
history, inputs, outputs) from the same accepted-count sequence, and DESIGN.md's cost formulas;
bandwidth against a measured device-to-device copy. Memory: extra bytes per sequence over all
SSM layers of the bench model and the largest batch whose SSM state (live + the strategy's
extra) fits a fixed budget (``--budget-gib``, default 40 GiB: roughly what is left of an H200's
141 GiB after bf16 weights of a 4B-8B model, the attention KV cache and activations; layer
counts: Nemotron-H-4B 24 Mamba-2 layers, Qwen3.5-4B 24 GDN layers, KDA 20 layers (approx.,
a Kimi-Linear-like 3:1 hybrid)).

Before timing, every kernel is checked against ``naive.py`` at one real size (prints PASS/FAIL).
If flash-linear-attention is importable, its ``fused_recurrent_gated_delta_rule`` is timed on the
same GDN decode work (final state only, eager calls, so host overhead included as users see it).

    python benchmarks/rollback_kernels.py --out BENCH_rollback.md           # H200, ~4-6 min
    python benchmarks/rollback_kernels.py --quick --out /tmp/quick.md       # batch {1, 64}, K = 4
    python benchmarks/rollback_kernels.py --batches 1,64,256 --ks 4 --out /tmp/k4.md
    python benchmarks/rollback_kernels.py --device cpu --quick --tiny       # interpreter smoke test

Output: a Markdown table printed last and written to ``--out`` (and JSON next to it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def _early_device(argv) -> str:
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return "cuda"


if __name__ == "__main__" and _early_device(sys.argv[1:]) == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined; testing only

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specdec.kernels import OPS  # noqa: E402
from specdec.kernels.gdn import triton_step as dr  # noqa: E402
from specdec.kernels.mamba2 import triton_step as m2  # noqa: E402
from specdec.kernels.triton_common import (  # noqa: E402
    next_pow2,
    replay_commit_lengths,
    ring_commit,
    state_copy_commit,
)

STRATEGIES = ("baseline", "snapshot", "ring", "replay", "replay_deferred")
ACCEPT_P = 0.7
ROUNDS = 16  # steps per timed graph
ROT_BYTES = 256 << 20  # rotate state copies until the working set is >= 256 MiB (H200 L2: 50 MiB)
BF16 = torch.bfloat16

SHAPES = {
    "mamba2": dict(H=128, P=64, N=128, G=8),
    "gdn": dict(H=32, HK=16, K=128, V=128),
    "kda": dict(H=32, HK=32, K=128, V=128),
}
TINY_SHAPES = {
    "mamba2": dict(H=4, P=16, N=16, G=2),
    "gdn": dict(H=4, HK=2, K=16, V=16),
    "kda": dict(H=2, HK=2, K=16, V=16),
}
NUM_LAYERS = {"mamba2": 24, "gdn": 24, "kda": 20}


# ----------------------------------------------------------------------------------------------
# per-op adapters over the kernel-level functions


class Mamba2Bench:
    name = "mamba2"

    def __init__(self, shape, device):
        self.tune = {}  # launch-parameter overrides (benchmarks/sweep_rollback_configs.py); {} = the defaults
        self.H, self.P, self.N, self.G = shape["H"], shape["P"], shape["N"], shape["G"]
        self.device = device
        self.state_shape = (self.H, self.P, self.N)
        self.params = dict(A=-torch.exp(torch.randn(self.H, device=device) * 0.5), D=torch.randn(self.H, device=device))
        # raw inputs are cached in their own dtype (bf16 -> exact), as DESIGN.md's I ~ 18.5 KiB assumes
        self.hist_spec = {"x": ((self.H, self.P), BF16), "dt": ((self.H,), BF16), "B": ((self.G, self.N), BF16)}

    def inputs(self, B, T):
        H, P, N, G, d = self.H, self.P, self.N, self.G, self.device
        return dict(x=torch.randn(B, T, H, P, device=d).to(BF16), dt=F.softplus(torch.randn(B, T, H, device=d) - 1).to(BF16),
                    B=torch.randn(B, T, G, N, device=d).to(BF16), C=torch.randn(B, T, G, N, device=d).to(BF16))

    def io_bytes_per_token(self):  # inputs read (bf16) + outputs written (fp32)
        return 2 * (self.H * self.P + self.H + 2 * self.G * self.N) + 4 * self.H * self.P

    def out(self, B, T):
        return torch.empty(B, T, self.H, self.P, device=self.device)

    def _a(self, inp):
        return inp["x"], inp["dt"], self.params["A"], inp["B"], inp["C"], self.params["D"]

    def update(self, state, inp, out):
        m2.mamba2_update(state, *self._a(inp), out=out, **self.tune)

    def snapshot_verify(self, live, buf, inp, out):
        m2.mamba2_snapshot_verify(live, buf, *self._a(inp), 0, out=out, **self.tune)

    def ring_verify(self, ring, head, inp, out):
        m2.mamba2_ring_verify(ring, head, *self._a(inp), 0, out=out, **self.tune)

    def replay_verify(self, ckpt, hist, hist_len, inp, out, fused=False):
        m2.mamba2_replay_verify(ckpt, hist["x"], hist["dt"], hist["B"], hist_len, *self._a(inp), 0, fused=fused,
                                out=out, **self.tune)

    def replay_commit(self, hist, hist_len, n):
        m2.mamba2_replay_commit(hist["x"], hist["dt"], hist["B"], hist_len, n)

    def fold(self, ckpt, hist, n):
        m2.mamba2_replay_fold(ckpt, hist["x"], hist["dt"], hist["B"], self.params["A"], n)


class DeltaBench:
    def __init__(self, name, shape, device):
        self.tune = {}  # launch-parameter overrides (benchmarks/sweep_rollback_configs.py); {} = the defaults
        self.name = name
        self.per_channel = name == "kda"
        self.H, self.HK, self.K, self.V = shape["H"], shape["HK"], shape["K"], shape["V"]
        self.device = device
        self.state_shape = (self.H, self.K, self.V)
        self.params = {}
        gshape = (self.H, self.K) if self.per_channel else (self.H,)
        self.hist_spec = {"k": ((self.H, self.K), BF16), "g": (gshape, BF16), "u": ((self.H, self.V), torch.float32)}

    def inputs(self, B, T):
        H, HK, K, V, d = self.H, self.HK, self.K, self.V, self.device
        # q, k come with HK key heads and are expanded to the H value heads before the op
        q = (F.normalize(torch.randn(B, T, HK, K, device=d), dim=-1) * K**-0.5).repeat_interleave(H // HK, dim=2)
        k = F.normalize(torch.randn(B, T, HK, K, device=d), dim=-1).repeat_interleave(H // HK, dim=2)
        g = -F.softplus(torch.randn(B, T, H, K, device=d) if self.per_channel else torch.randn(B, T, H, device=d))
        return {key: t.to(BF16).contiguous() for key, t in
                dict(q=q, k=k, v=torch.randn(B, T, H, V, device=d), g=g, beta=torch.rand(B, T, H, device=d)).items()}

    def io_bytes_per_token(self):
        g = self.H * self.K if self.per_channel else self.H
        return 2 * (2 * self.H * self.K + self.H * self.V + g + self.H) + 4 * self.H * self.V

    def out(self, B, T):
        return torch.empty(B, T, self.H, self.V, device=self.device)

    @staticmethod
    def _a(inp):
        return inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]

    def update(self, state, inp, out):
        dr.delta_rule_update(state, *self._a(inp), out=out, **self.tune)

    def snapshot_verify(self, live, buf, inp, out):
        dr.delta_rule_snapshot_verify(live, buf, *self._a(inp), 0, out=out, **self.tune)

    def ring_verify(self, ring, head, inp, out):
        dr.delta_rule_ring_verify(ring, head, *self._a(inp), 0, out=out, **self.tune)

    def replay_verify(self, ckpt, hist, hist_len, inp, out, fused=False):
        dr.delta_rule_replay_verify(ckpt, hist["k"], hist["g"], hist["u"], hist_len, *self._a(inp), 0, fused=fused,
                                    out=out, **self.tune)

    def replay_commit(self, hist, hist_len, n):
        dr.delta_rule_replay_commit(hist["k"], hist["g"], hist["u"], hist_len, n)

    def fold(self, ckpt, hist, n):
        dr.delta_rule_replay_fold(ckpt, hist["k"], hist["g"], hist["u"], n)


def make_bench(op, tiny, device):
    shape = (TINY_SHAPES if tiny else SHAPES)[op]
    return Mamba2Bench(shape, device) if op == "mamba2" else DeltaBench(op, shape, device)


def state_bytes(b) -> int:
    return 4 * math.prod(b.state_shape)


def hist_bytes_per_token(b) -> int:
    return sum(math.prod(shape) * torch.tensor([], dtype=dt).element_size() for shape, dt in b.hist_spec.values())


def history_length(strategy, T) -> int:
    return next_pow2(3 * T) if strategy == "replay_deferred" else 2 * T


LAUNCHES = {"baseline": 1, "snapshot": 2, "ring": 2, "replay": 2, "replay_deferred": 3}  # per layer and step


# ----------------------------------------------------------------------------------------------
# one strategy's per-layer step over a set of buffers


class StepSet:
    """The buffers of one strategy for one layer (one rotation copy) and its step function."""

    def __init__(self, b, strategy, B, T, device):
        self.b, self.strategy, self.T = b, strategy, T
        S = b.state_shape
        self.inp = b.inputs(B, T)
        self.out = b.out(B, T)
        s0 = torch.randn(B, *S, device=device) * 0.1
        if strategy == "baseline":
            self.state = s0
        elif strategy == "snapshot":
            self.live, self.buf = s0, torch.zeros(B, T, *S, device=device)
        elif strategy == "ring":
            self.R = T + 1
            self.ring = torch.zeros(B, self.R, *S, device=device)
            self.ring[:, 0] = s0
            self.head = torch.zeros(B, dtype=torch.long, device=device)
        else:
            self.L = history_length(strategy, T)
            self.ckpt = s0
            self.hist = {k: torch.zeros(B, self.L, *shape, dtype=dt, device=device) for k, (shape, dt) in b.hist_spec.items()}
            self.hist_len = torch.zeros(B, dtype=torch.long, device=device)
            self.fold_n = torch.zeros(B, dtype=torch.long, device=device)

    def step(self, n):
        b, s = self.b, self.strategy
        if s == "baseline":
            b.update(self.state, self.inp, self.out)
        elif s == "snapshot":
            b.snapshot_verify(self.live, self.buf, self.inp, self.out)
            state_copy_commit(self.live, self.buf, n)
        elif s == "ring":
            b.ring_verify(self.ring, self.head, self.inp, self.out)
            ring_commit(self.head, n, self.R)
        elif s == "replay":  # fused: the verify folds the last commit into the checkpoint
            b.replay_verify(self.ckpt, self.hist, self.hist_len, self.inp, self.out, fused=True)
            b.replay_commit(self.hist, self.hist_len, n)
        else:
            b.replay_verify(self.ckpt, self.hist, self.hist_len, self.inp, self.out)
            replay_commit_lengths(self.hist_len, n, self.fold_n, self.T, self.L)
            b.fold(self.ckpt, self.hist, self.fold_n)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self))


def _tensors(obj):
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            yield from (t for t in v.values() if isinstance(t, torch.Tensor))


def accepted_counts(rounds, B, K, gen) -> torch.Tensor:
    """``[rounds, B]`` step tokens kept: 1 + leading accepted drafts (each accepted w.p. ACCEPT_P, <= K)."""
    ok = torch.rand(rounds, B, K, generator=gen) < ACCEPT_P
    lead = torch.cumprod(ok.long(), dim=-1).sum(-1) if K else torch.zeros(rounds, B, dtype=torch.long)
    return 1 + lead


def traffic(b, strategy, T, n_seq) -> dict:
    """Bytes per row and step the kernels move, and DESIGN.md's formula, from the accepted counts ``n_seq``."""
    S, I, io = state_bytes(b), hist_bytes_per_token(b), b.io_bytes_per_token() * T
    rounds, B = n_seq.shape
    n_mean = n_seq.float().mean().item()
    if strategy == "baseline":
        k, d = 2 * S, 2 * S
        extra = dict()
    elif strategy == "snapshot":
        k = S + T * S + 2 * S * (n_seq > 0).float().mean().item()
        d = (T + 1) * S + 2 * S
        extra = dict()
    elif strategy == "ring":
        k = S + T * S
        d = (T + 1) * S
        extra = dict()
    elif strategy == "replay":  # fused: verify reads S, writes S back (absorbing the last commit), reads the
        # T_max-position committed half of the history, appends T; commit moves n positions (read + write)
        k = 2 * S + 2 * T * I + 2 * n_mean * I
        d = 2 * S + (n_mean + 2 * T) * I
        extra = dict()
    else:  # simulate the history lengths the graph goes through
        L = history_length(strategy, T)
        hist_len = torch.zeros(B, dtype=torch.long)
        tot, flushes, p_sum = 0.0, 0.0, 0.0
        for r in range(rounds):
            tot += S + hist_len.float().mean().item() * I + T * I  # verify: state + folded history + append
            p_sum += hist_len.float().mean().item()
            new = hist_len + n_seq[r]
            flush = new + T > L
            tot += (flush.float() * (2 * S + new.float() * I)).mean().item()  # fold
            flushes += flush.float().mean().item()
            hist_len = torch.where(flush, torch.zeros_like(new), new)
        k = tot / rounds
        f, p = flushes / rounds, p_sum / rounds
        d = S + f * S + (p + 2 * T) * I
        extra = dict(flush_rate=f, mean_hist=p)
    return dict(kernel_bytes=k + io, design_bytes=d, mean_tokens=n_mean, **extra)


def extra_bytes_per_seq(b, strategy, T) -> int:
    """Bytes one sequence needs per layer beyond its live state (DESIGN.md's table)."""
    S, I = state_bytes(b), hist_bytes_per_token(b)
    return {"baseline": 0, "snapshot": T * S, "ring": T * S}.get(strategy, history_length(strategy, T) * I)


# ----------------------------------------------------------------------------------------------
# timing


def time_sets(sets, n_seq, device, reps) -> float:
    """Median seconds per step: CUDA graph of ROUNDS steps over all rotation sets."""
    n_dev = n_seq.to(device)

    def run_all():
        for r in range(n_dev.shape[0]):
            for st in sets:
                st.step(n_dev[r])

    steps = n_dev.shape[0] * len(sets)
    if device != "cuda":
        run_all()  # compile / warm
        t0 = time.perf_counter()
        run_all()
        return (time.perf_counter() - t0) / steps
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_all()  # compile every variant outside the capture
        run_all()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / steps


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    a = torch.empty(n // 4, device=device)
    b = torch.empty_like(a)
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        return 2 * n * 5 / (time.perf_counter() - t0)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n / statistics.median(times)


def bench_config(b, strategy, B, K, device, gen, reps):
    T = K + 1
    n_seq = accepted_counts(ROUNDS if device == "cuda" else 2, B, K, gen)
    first = StepSet(b, strategy, B, T, device)
    n_rot = max(1, min(8, math.ceil(ROT_BYTES / max(1, first.nbytes())))) if device == "cuda" else 1
    sets = [first] + [StepSet(b, strategy, B, T, device) for _ in range(n_rot - 1)]
    sec = time_sets(sets, n_seq, device, reps)
    del sets, first
    if device == "cuda":
        torch.cuda.empty_cache()
    tr = traffic(b, strategy, T, n_seq)
    return dict(op=b.name, batch=B, K=K, T=T, strategy=strategy, us=sec * 1e6, rotations=n_rot, **tr,
                kernel_MB=tr["kernel_bytes"] * B / 1e6, design_MB=tr["design_bytes"] * B / 1e6,
                GBps=tr["kernel_bytes"] * B / sec / 1e9)


# ----------------------------------------------------------------------------------------------
# correctness at one real size


def check_correctness(op, batch=4, K=4, device="cuda", tiny=False, seed=0, steps=3):
    """Each strategy's kernels vs the torch reference (fp32) on bf16 inputs over ``steps`` steps (so
    fused replay absorbs a commit and deferred replay carries history); list of result dicts with
    the worst relative error over the steps."""
    torch.manual_seed(seed)
    b = make_bench(op, tiny, device)
    T = K + 1
    ref_op = OPS[op]
    gen = torch.Generator().manual_seed(seed)
    n_all = accepted_counts(steps, batch, K, gen).to(device)
    rows = torch.arange(batch, device=device)
    results = []

    def rel(a, r):
        a, r = a.double(), r.double()
        return ((a - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()

    for strategy in STRATEGIES:
        st = StepSet(b, strategy, batch, T, device)

        def committed(st=st, strategy=strategy):
            if strategy == "baseline":
                return st.state
            if strategy == "snapshot":
                return st.live
            if strategy == "ring":
                return st.ring[rows, st.head]
            return ref_op.fold(st.ckpt, {k: v.float() for k, v in st.hist.items()}, b.params, st.hist_len)

        ref = committed().clone()
        e_y = e_s = 0.0
        finite = True
        for step in range(steps):
            n = n_all[step]
            y_ref, states_ref, _ = ref_op.verify(ref, {k: v.float() for k, v in st.inp.items()}, b.params, True)
            ref = states_ref[rows, (T - 1 if strategy == "baseline" else n - 1)]
            st.out.fill_(float("nan"))
            st.step(n)
            finite &= bool(torch.isfinite(st.out).all())
            e_y, e_s = max(e_y, rel(st.out, y_ref)), max(e_s, rel(committed(), ref))
        ok = finite and e_y < 1e-4 and e_s < 1e-4
        results.append(dict(op=op, strategy=strategy, batch=batch, K=K, err_y=e_y, err_state=e_s, ok=ok, **{"pass": ok}))
    return results


# ----------------------------------------------------------------------------------------------
# flash-linear-attention peer


def bench_fla(b, B, K, device):
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - optional peer
        return dict(error=f"fla not importable ({type(exc).__name__})")
    if device != "cuda":
        return dict(error="cuda only")
    import triton

    T = K + 1
    inp = b.inputs(B, T)
    h0 = torch.randn(B, *b.state_shape, device=device) * 0.1

    def call():
        return fused_recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=1.0,
                                                initial_state=h0, output_final_state=True)

    try:
        ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    except Exception as exc:  # noqa: BLE001
        return dict(error=f"{type(exc).__name__}: {exc}"[:200])
    kb = 2 * state_bytes(b) + b.io_bytes_per_token() * T
    return dict(op="gdn", batch=B, K=K, T=T, strategy="fla_fused_recurrent (eager)", us=ms * 1e3,
                kernel_MB=kb * B / 1e6, GBps=kb * B / (ms / 1e3) / 1e9)


# ----------------------------------------------------------------------------------------------
# report


def _cfg_text(tune) -> str:
    if not tune:
        return "default"
    return " ".join(f"{k.replace('block_p', 'block').replace('block_v', 'block')}={v}" for k, v in tune.items())


def markdown(rows, meta, checks, fla_rows, targets) -> str:
    bw = meta["copy_GBps"]
    out = [f"# Rollback kernels ({meta['device']})", "",
           f"- date: {meta['date']}; command: `{meta['command']}`",
           f"- torch {meta['torch']}, triton {meta['triton']}; bf16 inputs, fp32 state; per-token acceptance {ACCEPT_P}",
           f"- measured device-to-device copy bandwidth: {bw:.0f} GB/s (read + write)",
           f"- memory budget for SSM state: {meta['budget_gib']} GiB over {meta['layers']} SSM layers (see the script docstring)",
           "- time: median per layer and step of verify + commit (+ fold, amortised), CUDA graph of "
           f"{ROUNDS} steps with rotated buffers; `x floor` = time / (kernel bytes / copy bandwidth)"]
    if meta.get("tune_from"):
        out.append(f"- launch configs: the fastest of `{meta['tune_from']}` per (op, batch, strategy), column `config`")
    out += ["", "## Correctness (vs naive.py, one real size)", ""]
    out += [f"- {'PASS' if c['pass'] else 'FAIL'} {c['op']} {c['strategy']} B={c['batch']} K={c['K']}: "
            f"rel err y {c['err_y']:.1e}, state {c['err_state']:.1e}" for c in checks]
    out += ["", "## Targets (batch 64, K = 4; batch 1 for the last)", ""] + [f"- {t}" for t in targets]
    if fla_rows:
        out += ["", "## flash-linear-attention peer (GDN, no rollback, final state only)", ""]
        for f in fla_rows:
            if "error" in f:
                out.append(f"- unavailable: {f['error']}")
            else:
                out.append(f"- B={f['batch']} T={f['T']}: {f['us']:.1f} us, {f['GBps']:.0f} GB/s "
                           f"({100 * f['GBps'] / bw:.0f}% of copy)")
    out += ["", "## Results", "",
            "| op | batch | K | strategy | launches | us/step | vs snapshot | vs baseline | kernel MB | design MB | GB/s "
            "| % copy BW | x floor | extra MiB/seq | max batch | config |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['op']} | {r['batch']} | {r['K']} | {r['strategy']} | {LAUNCHES[r['strategy']]} | {r['us']:.1f} "
                   f"| {r['vs_snapshot']:.2f} "
                   f"| {r['vs_baseline']:.2f} | {r['kernel_MB']:.1f} | {r['design_MB']:.1f} | {r['GBps']:.0f} "
                   f"| {100 * r['GBps'] / bw:.0f}% | {r['x_floor']:.2f} | {r['extra_MiB_per_seq']:.1f} | {r['max_batch']} "
                   f"| {_cfg_text(r.get('tune'))} |")
    return "\n".join(out) + "\n"


def evaluate_targets(rows, fla_rows=(), copy_GBps=1.0):
    """The issue's targets, each line 'met' / 'MISSED' with the measured ratio."""
    by = {(r["op"], r["batch"], r["K"], r["strategy"]): r for r in rows}
    lines = []
    for op in ("mamba2", "gdn", "kda"):
        snap = by.get((op, 64, 4, "snapshot"))
        if snap is None:
            continue
        for strat, limit in (("replay", 0.5), ("replay_deferred", 0.5), ("ring", 0.8)):
            r = by.get((op, 64, 4, strat))
            if r:
                ratio = r["us"] / snap["us"]
                lines.append(f"{'met' if ratio <= limit else 'MISSED'}: {op} {strat} / snapshot = {ratio:.2f} (target <= {limit})")
        for strat in ("replay", "replay_deferred"):
            r = by.get((op, 64, 4, strat))
            if r:
                lines.append(f"{'met' if r['x_floor'] <= 1.5 else 'MISSED'}: {op} {strat} = {r['x_floor']:.2f} x its "
                             "bytes/bandwidth floor (target <= 1.5)")
    for op, K in sorted({(r["op"], r["K"]) for r in rows if r["batch"] == 1}):
        base = by.get((op, 1, K, "baseline"))
        worst = max((by[(op, 1, K, s)] for s in STRATEGIES if (op, 1, K, s) in by), key=lambda r: r["us"])
        ratio = worst["us"] / base["us"]
        lines.append(f"{'met' if ratio <= 1.3 else 'MISSED'}: batch 1 K={K} {op}: slowest ({worst['strategy']}) = "
                     f"{ratio:.2f} x baseline (target <= 1.3)")
    for f in fla_rows:
        if "error" in f or f["T"] != 5 or f["batch"] not in (64, 256):
            continue
        for strat in ("replay", "replay_deferred"):
            r = by.get(("gdn", f["batch"], 4, strat))
            if r:
                ours, theirs = r["GBps"] / copy_GBps, f["GBps"] / copy_GBps
                lines.append(f"{'met' if ours > theirs else 'MISSED'}: gdn {strat} B={f['batch']} K=4 reaches "
                             f"{100 * ours:.0f}% of copy bandwidth vs fla fused recurrent T=5 {100 * theirs:.0f}%")
    return lines or ["(no target point in this grid: targets are at batch 64 and 1, K = 4)"]


def bytes_table(args) -> int:
    """``--bytes-only``: the kernels' bytes per step from :func:`traffic` (the same model the timed run
    reports), at the real shapes, K = 4 unless ``--ks``, batches of ``--batches`` (default 1, 64)."""
    gen = torch.Generator().manual_seed(args.seed)
    batches = [int(x) for x in (args.batches or "1,64").split(",")]
    Ks = [int(x) for x in (args.ks or "4").split(",")]
    print("| op | batch | K | strategy | launches | kernel MB | design MB | vs snapshot (bytes) |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for op in args.ops.split(","):
        b = make_bench(op, args.tiny, "cpu")
        for B in batches:
            for K in Ks:
                n_seq = accepted_counts(ROUNDS, B, K, gen)
                tr = {s: traffic(b, s, K + 1, n_seq) for s in STRATEGIES}
                snap = tr["snapshot"]["kernel_bytes"]
                for s in STRATEGIES:
                    print(f"| {op} | {B} | {K} | {s} | {LAUNCHES[s]} | {tr[s]['kernel_bytes'] * B / 1e6:.1f} "
                          f"| {tr[s]['design_bytes'] * B / 1e6:.1f} | {tr[s]['kernel_bytes'] / snap:.2f} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Rollback-kernel benchmark (see the module docstring).")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="batch {1, 64}, K = 4")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (with --device cpu: interpreter smoke test)")
    ap.add_argument("--ops", default="mamba2,gdn,kda")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1,8,64,256; --quick: 1,64)")
    ap.add_argument("--ks", default=None, help="comma-separated K values (default: 1,4,8; --quick: 4)")
    ap.add_argument("--no-fla", action="store_true", help="skip the flash-linear-attention peer")
    ap.add_argument("--bytes-only", action="store_true",
                    help="print the traffic model (bytes per layer and step the kernels move) and exit; no device")
    ap.add_argument("--tune-from", default=None,
                    help="JSON of benchmarks/sweep_rollback_configs.py: time each (op, batch, strategy) with the "
                         "launch config that was fastest there (nearest batch) instead of the defaults")
    ap.add_argument("--out", default="rollback_kernels.md", help="Markdown output; JSON goes next to it")
    ap.add_argument("--budget-gib", type=float, default=40.0)
    ap.add_argument("--reps", type=int, default=10, help="graph replays per configuration (median)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.bytes_only:
        return bytes_table(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device; use --device cpu --quick --tiny for a smoke test")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu needs TRITON_INTERPRET=1 set before triton is imported (run this file as a script)")
    ops = [o for o in args.ops.split(",") if o]
    batches = [1, 2] if args.tiny else ([1, 64] if args.quick else [1, 8, 64, 256])
    Ks = ([2] if args.quick else [1, 2]) if args.tiny else ([4] if args.quick else [1, 4, 8])
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.ks:
        Ks = [int(x) for x in args.ks.split(",")]
    t_start = time.time()
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    import triton

    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or 'cpu'}), Triton interpreter"
    meta = dict(device=dev_name, date=datetime.datetime.now().isoformat(timespec="seconds"),
                command="python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
                torch=torch.__version__, triton=triton.__version__, budget_gib=args.budget_gib,
                layers=", ".join(f"{op} {NUM_LAYERS[op]}" for op in ops))
    meta["copy_GBps"] = copy_bandwidth(args.device) / 1e9
    print(f"device: {dev_name}; copy bandwidth {meta['copy_GBps']:.0f} GB/s", flush=True)

    checks = []
    for op in ops:
        for c in check_correctness(op, batch=2 if args.tiny else 4, K=Ks[-1], device=args.device, tiny=args.tiny):
            print(f"{'PASS' if c['pass'] else 'FAIL'} {op} {c['strategy']}: rel err y {c['err_y']:.1e}, "
                  f"state {c['err_state']:.1e}", flush=True)
            checks.append(c)

    picks = {}
    if args.tune_from:
        with open(args.tune_from) as fh:
            for r in json.load(fh):
                key = (r["op"], r["batch"], r["strategy"])
                if key not in picks or r["us"] < picks[key][0]:
                    picks[key] = (r["us"], tuple(r["cfg"]))
        meta["tune_from"] = args.tune_from

    def tune_for(op, B, strategy):
        cands = [(abs(math.log2(B) - math.log2(k[1])), k) for k in picks if k[0] == op and k[2] == strategy]
        if not cands:
            return {}
        block, warps, pf = picks[min(cands)[1]][1]
        d = {"block_p" if op == "mamba2" else "block_v": block, "num_warps": warps, "prefetch": pf}
        return {k: v for k, v in d.items() if v is not None}

    rows = []
    budget = args.budget_gib * (1 << 30)
    for op in ops:
        b = make_bench(op, args.tiny, args.device)
        S = state_bytes(b)
        for B in batches:
            for K in Ks:
                group = []
                for strategy in STRATEGIES:
                    b.tune = tune_for(op, B, strategy)
                    r = bench_config(b, strategy, B, K, args.device, gen, args.reps)
                    r["tune"] = dict(b.tune)
                    extra = extra_bytes_per_seq(b, strategy, K + 1)
                    r["extra_MiB_per_seq"] = NUM_LAYERS[op] * extra / (1 << 20)
                    r["max_batch"] = int(budget // (NUM_LAYERS[op] * (S + extra)))
                    r["x_floor"] = r["us"] / 1e6 / (r["kernel_MB"] * 1e6 / (meta["copy_GBps"] * 1e9))
                    group.append(r)
                    print(f"{op:6s} B={B:<3d} K={K} {strategy:15s} {r['us']:9.1f} us  {r['GBps']:7.0f} GB/s  "
                          f"x floor {r['x_floor']:.2f}  {r['tune'] or ''} ({time.time() - t_start:.0f}s)", flush=True)
                snap = next(r for r in group if r["strategy"] == "snapshot")["us"]
                base = next(r for r in group if r["strategy"] == "baseline")["us"]
                for r in group:
                    r["vs_snapshot"], r["vs_baseline"] = r["us"] / snap, r["us"] / base
                rows += group

    fla_rows = []
    if "gdn" in ops and not args.no_fla:
        b = make_bench("gdn", args.tiny, args.device)
        for B in batches:
            for K in sorted({0, 4} if not args.tiny else {Ks[-1]}):
                f = bench_fla(b, B, K, args.device)
                fla_rows.append(f)
                if "error" in f:
                    print(f"fla peer: {f['error']}")
                    break
        fla_rows = fla_rows if any("error" not in f for f in fla_rows) else fla_rows[:1]

    targets = evaluate_targets(rows, fla_rows, meta["copy_GBps"])
    md = markdown(rows, meta, checks, fla_rows, targets)
    with open(args.out, "w") as fh:
        fh.write(md)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
        json.dump(dict(meta=meta, checks=checks, rows=rows, fla=fla_rows, targets=targets), fh, indent=1)
    print(f"\n(total {time.time() - t_start:.0f}s; written {args.out} and .json)\n")
    print(md)
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
