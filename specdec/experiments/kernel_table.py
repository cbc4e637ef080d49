"""The kernel table (``experiment=kernels``): device time per SSM layer and step of each rollback strategy.

For each SSM op at its bench shape (:data:`SHAPES`: Mamba-2 like Nemotron-H, 128 heads x 64 x
128 with 8 groups; GDN like Qwen3.5 / Qwen3-Next, 32 value heads x 128 x 128; KDA like
Kimi-Linear, 32 heads x 128 x 128 with a per-channel decay), inputs in ``dtype`` (bf16 on CUDA)
and fp32 state, per batch B and K (T = K + 1 step tokens), it times one layer's step through
the library (:class:`~specdec.experiments.kernel_timing.LayerStep`: the strategy's verify and
commit on the op the engine uses on that device) for ``baseline`` (a plain multi-token update
that overwrites the state, no rollback: the floor) and each strategy of ``rollback.strategies``.

Timing: a CUDA graph of ``experiment.rounds`` consecutive steps over independent copies of the
layer's store and inputs, rotated until the working set is >= 256 MiB (an H200's L2 is 50 MiB),
median over ``experiment.reps`` replays, per step. Committed counts per row and step: ``1 + a``,
``a`` the leading drafts accepted with probability ``experiment.accept_p``
(:func:`~specdec.experiments.kernel_timing.accepted_counts`). Bytes: what the kernels read and
write (states, history, inputs, outputs; :func:`traffic`) and the cost model's formula
(:func:`~specdec.experiments.kernel_timing.design_bytes`); bandwidth against a measured
device-to-device copy. Memory: extra bytes per sequence over all SSM layers of the bench model
(``strategy.extra_state_bytes``) and the largest batch whose SSM state fits
``experiment.memory_budget_gib``. Before timing, every strategy is checked against the fp32
reference (``naive.py``) over a few steps (``experiment.check``). If flash-linear-attention is
importable, its ``fused_recurrent_gated_delta_rule`` is timed on the same GDN decode work
(eager calls, final state only).

    specdec-run experiment=kernels                                       # CUDA: the full grid
    specdec-run experiment=kernels experiment.batch_grid=[1,64] experiment.k_grid=[4]
    specdec-run experiment=kernels device=cpu experiment.shapes=tiny     # smoke test (torch reference)

Outputs: ``results.jsonl`` (one record per op, batch, K and strategy, appended as each op, batch
and K is measured) and ``summary.md`` (the table, then the targets).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .kernel_timing import (
    BASELINE,
    LayerStep,
    accepted_counts,
    copy_bandwidth,
    design_bytes,
    input_bytes_per_token,
    synthetic_inputs,
    synthetic_params,
    time_in_graph,
)
from .models import SSMShape, resolve_device

__all__ = ["SHAPES", "LAUNCHES", "io_bytes_per_token", "traffic", "step_traffic", "bench_point", "check_point",
           "launch_picks", "targets", "run"]

#: the ops' layer shapes and SSM layer counts: Nemotron-H-4B 24 Mamba-2 layers, Qwen3.5-4B 24 GDN
#: layers, KDA 20 layers (approx., a Kimi-Linear-like 3:1 hybrid); ``tiny`` for CPU smoke tests
SHAPES = {
    "bench": {
        "mamba2": SSMShape("mamba2", 24, heads=128, head_dim=64, state_size=128, n_groups=8),
        "gdn": SSMShape("gdn", 24, heads=32, key_dim=128, value_dim=128),
        "kda": SSMShape("kda", 20, heads=32, key_dim=128, value_dim=128),
    },
    "tiny": {
        "mamba2": SSMShape("mamba2", 24, heads=4, head_dim=16, state_size=16, n_groups=2),
        "gdn": SSMShape("gdn", 24, heads=4, key_dim=16, value_dim=16),
        "kda": SSMShape("kda", 20, heads=2, key_dim=16, value_dim=16),
    },
}
#: kernel launches per layer and step on the Triton backend
LAUNCHES = {BASELINE: 1, "snapshot": 2, "ring": 2, "replay": 2, "replay_deferred": 3}
#: rotate buffer copies until the working set is at least this many bytes (H200 L2: 50 MiB)
ROT_BYTES = 256 << 20


def io_bytes_per_token(shape: SSMShape, inputs: dict) -> int:
    """Inputs read (in their dtype) and fp32 outputs written per token and row."""
    read = sum(t[0, 0].numel() * t.element_size() for t in inputs.values())
    return read + 4 * shape.heads * (shape.head_dim if shape.op == "mamba2" else shape.value_dim)


def traffic(shape: SSMShape, strategy: str, T: int, n_seq: torch.Tensor, I: int, io: int, L: int = 0) -> dict:
    """Bytes per row and step the kernels move (``kernel_bytes``) and the cost model's
    (``design_bytes``), for the committed counts ``n_seq [rounds, B]``.

    Args:
        I: replay's cached bytes per token (``op.replay_spec``). io: input + output bytes per
            token. L: deferred replay's history length.
    """
    S = shape.state_bytes
    n_mean = n_seq.float().mean().item()
    extra = {}
    if strategy == BASELINE:
        k = d = 2 * S
    elif strategy == "snapshot":
        k = S + T * S + 2 * S * (n_seq > 0).float().mean().item()
        d = design_bytes(strategy, S, I, T, n_mean)
    elif strategy == "ring":
        k = S + T * S
        d = design_bytes(strategy, S, I, T, n_mean)
    elif strategy == "replay":  # fused: the verify reads S and writes it back (absorbing the last commit),
        # reads the T_max-position committed half of the history, appends T; the commit moves n positions
        k = 2 * S + 2 * T * I + 2 * n_mean * I
        d = design_bytes(strategy, S, I, T, n_mean)
    else:  # deferred: simulate the history lengths the steps go through
        rounds, B = n_seq.shape
        hist_len = torch.zeros(B, dtype=torch.long)
        tot = flushes = p_sum = 0.0
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
        d = design_bytes(strategy, S, I, T, n_mean, f, p)
        extra = dict(flush_rate=f, mean_history=p)
    return dict(kernel_bytes=k + io * T, design_bytes=d, mean_committed_tokens=n_mean, **extra)


def step_traffic(step: LayerStep, shape: SSMShape, n_seq: torch.Tensor) -> dict:
    """:func:`traffic` of a layer step (its strategy, tokens, inputs and replay history)."""
    hist = step.store.tensors.get("hist") if step.store is not None else None
    L = next(iter(hist.values())).shape[1] if hist else 0
    return traffic(shape, step.name, step.T, n_seq, input_bytes_per_token(step.op, step.inputs),
                   io_bytes_per_token(shape, step.inputs), L)


def bench_point(op, shape: SSMShape, strategy: str, batch: int, K: int, device, *, params: dict, gen,
                dtype=torch.bfloat16, rounds: int = 16, reps: int = 10, accept_p: float = 0.7) -> dict:
    """Time one (strategy, batch, K) point; returns ``us_per_step`` (device time per layer and step),
    ``rotations``, the :func:`traffic` fields, ``kernel_MB`` / ``design_MB`` (all rows) and
    ``GBps`` (kernel bytes over time), ``extra_bytes_per_layer`` (the strategy's extra memory per
    sequence) and ``state_bytes``."""
    from specdec.rollback import make_strategy

    dev = torch.device(device)
    T = K + 1
    n_seq = accepted_counts(rounds if dev.type == "cuda" else 2, batch, K, accept_p, gen)
    first = LayerStep(op, shape, strategy, batch, T, params, dev, gen, dtype=dtype)
    n_rot = max(1, min(8, math.ceil(ROT_BYTES / max(1, first.nbytes())))) if dev.type == "cuda" else 1
    sets = [first] + [LayerStep(op, shape, strategy, batch, T, params, dev, gen, dtype=dtype) for _ in range(n_rot - 1)]
    n_dev = n_seq.to(dev)

    def run():
        for r in range(n_dev.shape[0]):
            for st in sets:
                st.step(n_dev[r])

    sec = time_in_graph(run, n_dev.shape[0] * len(sets), dev, reps)
    tr = step_traffic(first, shape, n_seq)
    I = input_bytes_per_token(op, first.inputs)
    del sets, first
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    S = shape.state_bytes
    extra = 0 if strategy == BASELINE else int(make_strategy(strategy).extra_state_bytes(S, T, I))
    return dict(us_per_step=sec * 1e6, rotations=n_rot, **tr, kernel_MB=tr["kernel_bytes"] * batch / 1e6,
                design_MB=tr["design_bytes"] * batch / 1e6, GBps=tr["kernel_bytes"] * batch / sec / 1e9,
                state_bytes=S, extra_bytes_per_layer=extra)


def _rel(a: torch.Tensor, r: torch.Tensor) -> float:
    a, r = a.double(), r.double()
    return ((a - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def check_point(op, ref_op, shape: SSMShape, strategy: str, batch: int, K: int, device, *, params: dict, gen,
                dtype=torch.bfloat16, steps: int = 3, accept_p: float = 0.7, tol: float = 1e-4) -> dict:
    """One strategy on ``op`` against the fp32 reference ``ref_op`` over ``steps`` steps (so fused
    replay absorbs a commit and deferred replay carries history): the worst relative RMS errors of
    the outputs (``err_y``) and committed states (``err_state``) and ``exact`` (both finite and
    below ``tol``)."""
    T = K + 1
    st = LayerStep(op, shape, strategy, batch, T, params, device, gen, dtype=dtype)
    ref = st.committed().clone()
    rows = torch.arange(batch, device=device)
    n_all = accepted_counts(steps, batch, K, accept_p, gen).to(device)
    e_y = e_s = 0.0
    finite = True
    for step in range(steps):
        n = n_all[step]
        y_ref, states_ref, _ = ref_op.verify(ref, {k: v.float() for k, v in st.inputs.items()}, params, True)
        ref = states_ref[rows, (T - 1 if strategy == BASELINE else n - 1)]
        y = st.verify()
        st.commit(n)
        finite &= bool(torch.isfinite(y).all())
        e_y, e_s = max(e_y, _rel(y, y_ref)), max(e_s, _rel(st.committed(), ref))
    ok = finite and e_y < tol and e_s < tol
    return dict(err_y=e_y, err_state=e_s, exact=ok)


def launch_picks(path: str | None) -> dict:
    """``{(op, batch, strategy): (us, (block, num_warps, prefetch))}``: the fastest launch setting per
    point of a ``benchmarks/sweep_rollback_configs.py`` JSON (None: empty)."""
    picks: dict = {}
    if not path:
        return picks
    with open(path) as fh:
        for r in json.load(fh):
            key = (r["op"], r["batch"], r["rollback"])
            if key not in picks or r["us_per_step"] < picks[key][0]:
                picks[key] = (r["us_per_step"], tuple(r["launch"]))
    return picks


def _launch_for(picks: dict, op: str, batch: int, strategy: str):
    from specdec.kernels import LaunchConfig

    cands = [(abs(math.log2(batch) - math.log2(k[1])), k) for k in picks if k[0] == op and k[2] == strategy]
    if not cands:
        return LaunchConfig()
    block, warps, prefetch = picks[min(cands)[1]][1]
    return LaunchConfig(block=block, num_warps=warps, prefetch=prefetch)


def _launch_text(launch) -> str:
    parts = [f"{k}={v}" for k, v in (("block", launch.block), ("warps", launch.num_warps),
                                     ("prefetch", launch.prefetch)) if v is not None]
    return " ".join(parts) or "default"


def _fla_point(shape: SSMShape, batch: int, K: int, device, gen, dtype) -> dict | None:
    """flash-linear-attention's fused recurrent GDN on the same decode work (CUDA and fla only)."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001 - an optional peer
        return None
    import triton

    T = K + 1
    inp = synthetic_inputs(shape, batch, T, device, gen, dtype=dtype)
    h0 = (torch.randn(batch, *shape.state_shape, generator=gen) * 0.1).to(device)

    def call():
        # by keyword: fla 0.6 put per-key and per-value gates (gk, gv) between g and beta
        return fused_recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], g=inp["g"], beta=inp["beta"], scale=1.0,
                                                initial_state=h0, output_final_state=True)

    ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
    kb = 2 * shape.state_bytes + io_bytes_per_token(shape, inp) * T
    return dict(us_per_step=ms * 1e3, kernel_MB=kb * batch / 1e6, GBps=kb * batch / (ms / 1e3) / 1e9)


FLA = "fla_fused_recurrent"


def targets(records: list[dict]) -> list[str]:
    """The table's targets, each line ``met`` / ``MISSED`` with the measured ratio: at batch 64 and
    K = 4 replay and deferred replay at most 0.5x snapshot and ring at most 0.8x, replay within
    1.5x of its bytes / bandwidth floor; at batch 1 the slowest strategy within 1.3x of the
    baseline; GDN replay above flash-linear-attention's share of copy bandwidth."""
    by = {(r["op"], r["batch"], r["num_speculative_tokens"], r["rollback"]): r for r in records}
    lines = []
    for op in ("mamba2", "gdn", "kda"):
        snap = by.get((op, 64, 4, "snapshot"))
        if snap is None:
            continue
        for strat, limit in (("replay", 0.5), ("replay_deferred", 0.5), ("ring", 0.8)):
            r = by.get((op, 64, 4, strat))
            if r:
                ratio = r["us_per_step"] / snap["us_per_step"]
                lines.append(f"{'met' if ratio <= limit else 'MISSED'}: {op} {strat} / snapshot = {ratio:.2f} "
                             f"(target <= {limit})")
        for strat in ("replay", "replay_deferred"):
            r = by.get((op, 64, 4, strat))
            if r:
                lines.append(f"{'met' if r['x_floor'] <= 1.5 else 'MISSED'}: {op} {strat} = {r['x_floor']:.2f} x its "
                             "bytes/bandwidth floor (target <= 1.5)")
    for op, K in sorted({(r["op"], r["num_speculative_tokens"]) for r in records if r["batch"] == 1}):
        base = by.get((op, 1, K, BASELINE))
        timed = [r for (o, b, k, s), r in by.items() if (o, b, k) == (op, 1, K) and s not in (BASELINE, FLA)]
        if base and timed:
            worst = max(timed, key=lambda r: r["us_per_step"])
            ratio = worst["us_per_step"] / base["us_per_step"]
            lines.append(f"{'met' if ratio <= 1.3 else 'MISSED'}: batch 1 K={K} {op}: slowest ({worst['rollback']}) "
                         f"= {ratio:.2f} x baseline (target <= 1.3)")
    for f in (r for r in records if r["rollback"] == FLA and r["num_speculative_tokens"] == 4):
        for strat in ("replay", "replay_deferred"):
            r = by.get(("gdn", f["batch"], 4, strat))
            if r:
                ours, theirs = r["pct_copy_bw"], f["pct_copy_bw"]
                lines.append(f"{'met' if ours > theirs else 'MISSED'}: gdn {strat} B={f['batch']} K=4 reaches "
                             f"{ours:.0f}% of copy bandwidth vs fla fused recurrent {theirs:.0f}%")
    return lines or ["(no target point in this grid: targets are at batch 64 and 1, K = 4)"]


def run(cfg, out_dir: Path) -> list[dict]:
    """Run the table; returns the records (also written to ``out_dir``)."""
    from omegaconf import OmegaConf

    from specdec.kernels import OPS, backend, get_op

    from .common import RunRecords, progress_bar, write_outputs

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    if device.type == "cpu" and cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    shapes = SHAPES[str(exp.shapes)]
    if device.type == "cpu" and str(exp.shapes) == "bench":
        print("specdec-run: the bench shapes' layers on a CPU take minutes per batch size (the torch reference "
              "ops); experiment.shapes=tiny runs here in seconds", flush=True)
    ops = [str(o) for o in exp.ops]
    strategies = [BASELINE] + [str(s) for s in cfg.rollback.strategies]
    batches, Ks = [int(b) for b in exp.batch_grid], [int(k) for k in exp.k_grid]
    gen = torch.Generator().manual_seed(int(cfg.seed))
    torch.manual_seed(int(cfg.seed))
    copy_GBps = copy_bandwidth(device) / 1e9
    picks = launch_picks(exp.launch_from)
    budget = float(exp.memory_budget_gib) * (1 << 30)
    common = dict(experiment="kernels", device=str(device), dtype=str(dtype).replace("torch.", ""),
                  backend=backend(device), seed=int(cfg.seed), copy_GBps=copy_GBps,
                  config=OmegaConf.to_container(cfg, resolve=True))
    log = RunRecords(out_dir)  # each (op, batch, K) group appended as measured: a run cut short keeps it
    records = log.records
    bar = progress_bar(cfg, len(ops) * len(batches) * len(Ks) * len(strategies), "kernels")
    t0 = time.time()
    for name in ops:
        shape = shapes[name]
        op = get_op(name, device)
        params = synthetic_params(shape, device, gen)
        checks = {}
        if exp.check:
            for strategy in strategies:
                checks[strategy] = check_point(op, OPS[name], shape, strategy, min(4, max(batches)), max(Ks), device,
                                               params=params, gen=gen, dtype=dtype, accept_p=float(exp.accept_p))
        for B in batches:
            for K in Ks:
                group = []
                for strategy in strategies:
                    launch = _launch_for(picks, name, B, strategy)
                    r = bench_point(op.with_launch(launch), shape, strategy, B, K, device, params=params, gen=gen,
                                    dtype=dtype, rounds=int(exp.rounds), reps=int(exp.reps),
                                    accept_p=float(exp.accept_p))
                    extra = r.pop("extra_bytes_per_layer")
                    rec = {**common, "op": name, "ssm_shape": shape.describe(), "batch": B, "num_speculative_tokens": K,
                           "rollback": strategy, "launches": LAUNCHES.get(strategy), "launch": _launch_text(launch), **r,
                           "pct_copy_bw": 100 * r["GBps"] / copy_GBps,
                           "x_floor": r["us_per_step"] / 1e6 / (r["kernel_MB"] * 1e6 / (copy_GBps * 1e9)),
                           "extra_MiB_per_seq": shape.num_layers * extra / (1 << 20),
                           "max_batch": int(budget // (shape.num_layers * (shape.state_bytes + extra))),
                           **checks.get(strategy, {})}
                    group.append(rec)
                    if bar:
                        bar.update(1)
                    else:
                        print(f"{name:6s} B={B:<3d} K={K} {strategy:15s} {rec['us_per_step']:9.1f} us "
                              f"{rec['GBps']:7.0f} GB/s  x floor {rec['x_floor']:.2f} ({time.time() - t0:.0f}s)",
                              flush=True)
                snap = next((g["us_per_step"] for g in group if g["rollback"] == "snapshot"), None)
                base = next(g["us_per_step"] for g in group if g["rollback"] == BASELINE)
                for g in group:
                    g["vs_snapshot"] = g["us_per_step"] / snap if snap else None
                    g["vs_baseline"] = g["us_per_step"] / base
                    log.add(g)
        if name == "gdn" and exp.fla and device.type == "cuda":
            for B in batches:
                for K in sorted(set(Ks) | {4}):
                    f = _fla_point(shape, B, K, device, gen, dtype)
                    if f is None:
                        break
                    log.add({**common, "op": name, "ssm_shape": shape.describe(), "batch": B,
                             "num_speculative_tokens": K, "rollback": FLA, **f,
                             "pct_copy_bw": 100 * f["GBps"] / copy_GBps})
    if bar:
        bar.close()
    title = (f"Rollback kernels per SSM layer and step: {device}, backend {backend(device)}, "
             f"{str(dtype).replace('torch.', '')} inputs, fp32 state, copy bandwidth {copy_GBps:.0f} GB/s")
    write_outputs(records, out_dir, title)
    summary = Path(out_dir) / "summary.md"
    notes = ["", "## Targets (batch 64, K = 4; batch 1 for the slowest strategy)", ""]
    notes += [f"- {t}" for t in targets(records)]
    with open(summary, "a") as fh:
        fh.write("\n".join(notes) + "\n")
    return records
