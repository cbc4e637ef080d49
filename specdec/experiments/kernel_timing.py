"""Kernel-level timing of the rollback strategies on one SSM layer, on synthetic inputs.

Everything here drives the library's own objects: the strategies of :mod:`specdec.rollback`
on a :class:`~specdec.rollback.LayerStore`, with the op the engine would use on that device
(``specdec.kernels.get_op``: the torch reference on CPU, the Triton kernels on CUDA), on the
inputs of :func:`synthetic_inputs` at a model's SSM layer shape
(:class:`~specdec.experiments.models.SSMShape`). Two timings:

* :func:`time_strategy` (``experiment=rollback``): ``warmup + steps`` speculative steps of a
  batch B and K drafts (T = K + 1 step tokens), exactly as the engine runs them
  (``strategy.verify`` with the step's T tokens, then ``strategy.commit``), each phase timed
  on its own with a device synchronisation around it (eager launches, host overhead included,
  as users of ``generate()`` see it):

  - ``verify``: the strategy's verify (for snapshot / ring it writes the step's states);
  - ``commit``: the strategy's commit minus the fold (snapshot: the state copy; ring: the head
    move; replay: the history bookkeeping);
  - ``fold``: the replay fold inside commit (replay and replay_deferred only; deferred folds
    only when its history would overflow, so the time is amortised over the steps).

* :func:`time_in_graph` over :class:`LayerStep` objects (``experiment=kernels`` and the kernel
  scripts of ``benchmarks/``): device time only, from a CUDA graph of many steps over rotated
  copies of the buffers (no host launch overhead, no warm-cache flattery).

Committed counts (:func:`accepted_counts`): ``1 + a`` per row and step, ``a`` = leading
accepted drafts with per-draft acceptance ``accept_p``. After the steps the committed state is
compared with the fp32 reference (``naive.py``) run on the same inputs.

Bytes moved per step follow the strategies' cost model, per layer and sequence, with S = state
bytes, I = cached input bytes per token, T = K + 1, n = mean committed tokens, f = flush rate,
p = mean history length: snapshot (T+1)S + 2S, ring (T+1)S, replay 2S + (n+2T)I, deferred
replay S + fS + (p+2T)I.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ..graphs import gc_paused
from .models import SSMShape

__all__ = ["synthetic_inputs", "synthetic_params", "input_bytes_per_token", "design_bytes", "accepted_counts",
           "time_strategy", "BASELINE", "LayerStep", "time_in_graph", "copy_bandwidth"]


def synthetic_params(shape: SSMShape, device, gen: torch.Generator) -> dict:
    """The op's parameters as the adapters pass them (Mamba-2: ``A [H] < 0``, ``D [H]``; delta rule: none)."""
    if shape.op != "mamba2":
        return {}
    H = shape.heads
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    return {"A": A.to(device), "D": torch.randn(H, generator=gen).to(device)}


def synthetic_inputs(shape: SSMShape, B: int, T: int, device, gen: torch.Generator,
                     dtype: torch.dtype = torch.float32) -> dict:
    """One step's op inputs ``[B, T, ...]`` in ``dtype`` (drawn in fp32 on the CPU from ``gen``,
    then cast) with the value ranges the adapters produce.

    Mamba-2: ``x [B,T,H,P]``, ``dt = softplus(.) [B,T,H]``, ``B``/``C [B,T,G,N]``.
    GDN: ``q`` (l2-normalised, scaled by K^-1/2), ``k`` (l2-normalised) ``[B,T,H,K]``, ``v [B,T,H,V]``,
    ``g = -softplus(.)`` ``[B,T,H]`` (KDA: ``[B,T,H,K]``), ``beta`` in (0, 1) ``[B,T,H]``.
    """

    def r(*s):
        return torch.randn(*s, generator=gen)

    if shape.op == "mamba2":
        H, P, N, G = shape.heads, shape.head_dim, shape.state_size, shape.n_groups
        inp = {"x": r(B, T, H, P), "dt": F.softplus(r(B, T, H) - 1.0), "B": r(B, T, G, N), "C": r(B, T, G, N)}
    else:
        H, K, V = shape.heads, shape.key_dim, shape.value_dim
        gshape = (B, T, H, K) if shape.op == "kda" else (B, T, H)
        inp = {"q": F.normalize(r(B, T, H, K), dim=-1) * K**-0.5, "k": F.normalize(r(B, T, H, K), dim=-1),
               "v": r(B, T, H, V), "g": -F.softplus(r(*gshape)), "beta": torch.rand(B, T, H, generator=gen)}
    return {k: v.to(device=device, dtype=dtype) for k, v in inp.items()}


def input_bytes_per_token(op, inputs: dict) -> int:
    """I: bytes replay caches per token and sequence (from the op's ``replay_spec``)."""
    total = 0
    for shape, dtype in op.replay_spec(inputs).values():
        total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return total


def design_bytes(strategy: str, S: int, I: int, T: int, n: float, f: float = 0.0, p: float = 0.0) -> float:
    """The cost model's bytes moved per layer, sequence and step (see the module docstring)."""
    if strategy == "snapshot":
        return (T + 1) * S + 2 * S
    if strategy == "ring":
        return (T + 1) * S
    if strategy == "replay":
        return 2 * S + (n + 2 * T) * I
    if strategy == "replay_deferred":
        return S + f * S + (p + 2 * T) * I
    raise ValueError(f"no cost formula for strategy {strategy!r}")


class _PhaseTimedOp:
    """Wraps an SSMOp (and its kernels) so the replay fold inside ``commit`` is timed apart."""

    def __init__(self, op, sync):
        self._op, self._sync = op, sync
        self.in_commit = False
        self.fold_s = 0.0
        self.kernels = _TimedKernels(op.kernels, self) if op.kernels is not None else None

    def __getattr__(self, name):
        return getattr(self._op, name)

    def _timed(self, fn, *args, **kwargs):
        if not self.in_commit:
            return fn(*args, **kwargs)
        self._sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self._sync()
        self.fold_s += time.perf_counter() - t0
        return out

    def verify(self, *args):
        return self._op.verify(*args)

    def fold(self, *args):
        return self._timed(self._op.fold, *args)

    def replay_spec(self, inputs):
        return self._op.replay_spec(inputs)


class _TimedKernels:
    def __init__(self, kernels, owner: _PhaseTimedOp):
        self._k, self._owner = kernels, owner

    def __getattr__(self, name):
        return getattr(self._k, name)

    def replay_fold(self, *args, **kwargs):
        return self._owner._timed(self._k.replay_fold, *args, **kwargs)


def accepted_counts(steps: int, batch: int, K: int, accept_p: float, gen: torch.Generator) -> torch.Tensor:
    """``[steps, batch]`` int64 (CPU) committed tokens per step and row: ``1 + a``, ``a`` the leading
    drafts accepted, each with probability ``accept_p`` (at most K)."""
    if K == 0:
        return torch.ones(steps, batch, dtype=torch.long)
    ok = torch.rand(steps, batch, K, generator=gen) < accept_p
    return 1 + torch.cumprod(ok.long(), dim=-1).sum(-1)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@torch.no_grad()
def time_strategy(shape: SSMShape, strategy: str, batch: int, K: int, device: torch.device, *, steps: int = 8,
                  warmup: int = 2, accept_p: float = 0.7, seed: int = 0) -> dict:
    """Time one strategy on one SSM layer; returns a dict of per-step, per-layer figures.

    Keys: ``kernel_verify_us``, ``kernel_commit_us``, ``kernel_fold_us`` (microseconds per layer
    and step, means over ``steps``), ``kernel_step_us`` (their sum), ``state_bytes`` (S),
    ``input_bytes_per_token`` (I), ``extra_bytes_per_layer`` (the strategy's extra memory per
    layer and sequence), ``mean_committed_tokens`` (n), ``flush_rate`` (f, deferred replay),
    ``mean_history`` (p, deferred replay), ``design_bytes_per_layer`` (bytes per layer, sequence
    and step), ``kernel_state_rel_err`` (committed state vs the fp32 reference).

    Raises: ValueError for an unknown strategy, ``steps < 1`` or ``K < 1``.
    """
    from specdec.kernels import OPS, get_op
    from specdec.rollback import make_strategy

    if steps < 1 or K < 1 or batch < 1:
        raise ValueError(f"steps, K and batch must be >= 1; got steps={steps}, K={K}, batch={batch}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    T = K + 1
    op = _PhaseTimedOp(get_op(shape.op, device), sync)
    ref_op = OPS[shape.op]
    strat = make_strategy(strategy)
    params = synthetic_params(shape, device, gen)
    store = strat.new_store(batch, T, layer=0)
    s0 = (torch.randn(batch, *shape.state_shape, generator=gen) * 0.1).to(device)
    strat.load(store, s0)
    ref = s0.clone()
    total = warmup + steps
    n_all = accepted_counts(total, batch, K, accept_p, gen).to(device)
    t_verify = t_commit = 0.0
    fold_before = 0.0
    hist_sum = flushes = 0.0
    I = None
    for step in range(total):
        inputs = synthetic_inputs(shape, batch, T, device, gen)
        if I is None:
            I = input_bytes_per_token(op, inputs)
        n = n_all[step]
        timed = step >= warmup
        if timed and strategy == "replay_deferred":
            hist_sum += float(store.tensors["hist_len"].float().mean())
        if step == warmup:
            fold_before = op.fold_s
        sync()
        t0 = time.perf_counter()
        strat.verify(store, op, inputs, params)
        sync()
        t1 = time.perf_counter()
        op.in_commit = True
        strat.commit(store, op, params, n)
        op.in_commit = False
        sync()
        t2 = time.perf_counter()
        if timed:
            t_verify += t1 - t0
            t_commit += t2 - t1
            if strategy == "replay_deferred":
                flushes += float((store.tensors["hist_len"] == 0).float().mean())
        _, states, _ = ref_op.verify(ref, inputs, params, True)
        ref = states[torch.arange(batch, device=device), n - 1]
    fold = op.fold_s - fold_before
    S = shape.state_bytes
    n_mean = float(n_all[warmup:].float().mean())
    f = flushes / steps if strategy == "replay_deferred" else (1.0 if strategy == "replay" else 0.0)
    p = hist_sum / steps if strategy == "replay_deferred" else 0.0
    verify_us = 1e6 * t_verify / steps
    fold_us = 1e6 * fold / steps
    commit_us = max(0.0, 1e6 * t_commit / steps - fold_us)
    return {
        "kernel_verify_us": verify_us,
        "kernel_commit_us": commit_us,
        "kernel_fold_us": fold_us,
        "kernel_step_us": verify_us + commit_us + fold_us,
        "state_bytes": S,
        "input_bytes_per_token": I,
        "extra_bytes_per_layer": int(strat.extra_state_bytes(S, T, I)),
        "mean_committed_tokens": n_mean,
        "flush_rate": f,
        "mean_history": p,
        "design_bytes_per_layer": design_bytes(strategy, S, I, T, n_mean, f, p),
        "kernel_state_rel_err": _rel_err(strat.state(store, op, params), ref),
    }


# ------------------------------------------------------------------ device time in CUDA graphs

#: the floor of every strategy in the kernel table: a plain multi-token update that overwrites the
#: state (no rollback; the op kernels' ``update``, or the torch op's verify and a copy)
BASELINE = "baseline"


class LayerStep:
    """One SSM layer's store, inputs and step for one strategy, through the library's objects.

    A step is the strategy's ``verify`` of the T step tokens (``tree_verify`` when ``parents``
    is given: a tree of T = ``len(parents)`` nodes) followed by ``commit(n)``; ``strategy`` is a
    name :func:`specdec.rollback.make_strategy` takes, or :data:`BASELINE`. The store is loaded
    with a random state and primed with one step that commits ``prime`` tokens (replay then has
    a committed history to fold), so every buffer exists before a CUDA graph is captured.

    Args:
        op: the op (``specdec.kernels.get_op``; its ``kernels`` may carry launch overrides).
        shape: the layer's shape. strategy: as above. batch: B. T: step tokens (chains).
        params: the op's params (:func:`synthetic_params`). device, gen: where and from what.
        dtype: of the step's inputs. parents: a tree step instead of a chain.
        prime: tokens the priming step commits (<= T).
    """

    def __init__(self, op, shape: SSMShape, strategy: str, batch: int, T: int, params: dict, device, gen, *,
                 dtype: torch.dtype = torch.float32, parents=None, prime: int = 1):
        from specdec.rollback import make_strategy

        self.op, self.params, self.parents, self.name = op, params, parents, strategy
        self.T = len(parents) if parents is not None else T
        self.inputs = synthetic_inputs(shape, batch, self.T, device, gen, dtype=dtype)
        state = (torch.randn(batch, *shape.state_shape, generator=gen) * 0.1).to(device)
        if strategy == BASELINE:
            self.strategy, self.store, self.state = None, None, state
            return
        self.strategy = make_strategy(strategy)
        self.store = self.strategy.new_store(batch, self.T, layer=0)
        self.strategy.load(self.store, state)
        chain = synthetic_inputs(shape, batch, self.T, device, gen, dtype=dtype)
        self.strategy.verify(self.store, op, chain, params)
        self.strategy.commit(self.store, op, params, torch.full((batch,), prime, dtype=torch.long, device=device))

    def verify(self) -> torch.Tensor:
        """The step's verify (its outputs)."""
        if self.strategy is None:
            if self.op.kernels is not None:
                return self.op.kernels.update(self.state, self.inputs, self.params)
            y, states, _ = self.op.verify(self.state, self.inputs, self.params, True)
            self.state.copy_(states[:, -1])
            return y
        if self.parents is not None:
            return self.strategy.tree_verify(self.store, self.op, self.inputs, self.params, self.parents)
        return self.strategy.verify(self.store, self.op, self.inputs, self.params)

    def commit(self, num_tokens: torch.Tensor) -> None:
        """Commit ``num_tokens [B]`` of the open step (nothing for the baseline)."""
        if self.strategy is not None:
            self.strategy.commit(self.store, self.op, self.params, num_tokens)

    def discard(self) -> None:
        """Close the open step without committing, as ``HybridCache.set_step_tokens(0)`` does (for
        timing a verify alone: fused replay's checkpoint keeps the fold the verify made)."""
        if self.store is not None:
            self.store.step_tokens = 0

    def step(self, num_tokens: torch.Tensor) -> None:
        """One step: verify, then commit ``num_tokens``."""
        self.verify()
        self.commit(num_tokens)

    def committed(self) -> torch.Tensor:
        """The committed state ``[B, *S]``."""
        if self.strategy is None:
            return self.state
        return self.strategy.state(self.store, self.op, self.params)

    def nbytes(self) -> int:
        """Bytes of the step's inputs and store (what one rotation copy adds to the working set)."""
        tensors = list(self.inputs.values())
        if self.strategy is None:
            tensors.append(self.state)
        else:
            for v in self.store.tensors.values():
                tensors += list(v.values()) if isinstance(v, dict) else [v] if isinstance(v, torch.Tensor) else []
        return sum(t.numel() * t.element_size() for t in tensors)


def time_in_graph(run: Callable[[], None], calls: int, device, reps: int) -> float:
    """Median seconds per call: ``run()`` makes ``calls`` calls (e.g. steps over rotated copies of
    the buffers); on CUDA it is captured once in a CUDA graph (after two warm-up runs on a side
    stream: compiles, allocates lazy buffers) and the graph is replayed ``reps`` times, device
    time from CUDA events; elsewhere one warm-up run, then one timed run of wall time."""
    dev = torch.device(device)
    if dev.type != "cuda":
        run()
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        run()
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
    return statistics.median(times) / calls


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted): 1 GiB on CUDA (median of
    20 copies), 16 MiB elsewhere (mean of 5)."""
    dev = torch.device(device)
    n = (1 << 30) if dev.type == "cuda" else (1 << 24)
    a = torch.empty(n // 4, device=dev)
    b = torch.empty_like(a)
    if dev.type != "cuda":
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
