"""num_speculative_tokens="auto" and rollback="auto" (specdec.adaptive): the output stays exact
(greedy == HF greedy for every family, drafter and strategy, on the eager and the static path;
sampling keeps the target's distribution), also through steps at K = 0 and back; the policy's
choices follow its formulas (recomputed here, not copied); costs are measured and refined; bad
settings fail with a clear error."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref

import pytest
import torch
from helpers import (MAX_NEW, ORDER, ScriptedCosts, assert_same_token_distribution, counting_forwards, hf_greedy,
                     make_drafter, reference)
from markers import needs_cuda, needs_triton_interpreter
from tiny_models import VOCAB, get_model, make_model, perturbed_copy, ragged_prompts

import specdec
from specdec.adaptive import (CATCH_UP_MIN_PLAIN_STEPS, MEASURED_STEPS, MEASURING_STEPS, OUTLIER_RATIO,
                              PLAIN_STEPS_PER_OBSERVATION, AcceptanceEstimator, CostKey, DrafterKey,
                              FixedCosts, MeasuredCosts, PolicySettings, SpeculationPolicy, choose_k, choose_strategy, costs_for,
                              expected_tokens, speculation_gain)
from specdec.drafters import Drafter, DraftModelDrafter, MedusaDrafter, MedusaHeads, MTPDrafter, NGramDrafter, OracleDrafter
from specdec.fusion import fusion_enabled
from specdec.graphs import CaptureFailure
from specdec.rollback import STRATEGIES, RollbackStrategy


def _generate(sd, family, **kw):
    ids, mask, eos, ref = reference(family)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0, **kw)
    return out, ref


def _check_stats(st, max_k: int):
    assert len(st.k_histogram) == max_k + 1 and sum(st.k_histogram) == st.steps == len(st.k_per_step)
    assert st.k_histogram == [st.k_per_step.count(K) for K in range(max_k + 1)]
    assert len(st.accept_histogram) == max_k + 1
    assert st.leave_s is not None and st.leave_s >= 0.0  # (the probes' spacing reads it)


# ------------------------------------------------------------------------------ exactness, greedy


@pytest.mark.parametrize("drafter", ["ngram", "perturbed", "small"])
def test_auto_greedy_exact_vs_hf(family, drafter):
    """Both choices measured (the default cost model): the output equals HF greedy's."""
    sd = specdec.wrap(get_model(family), drafter=make_drafter(drafter, family), rollback="auto",
                      num_speculative_tokens="auto")
    out, ref = _generate(sd, family)
    assert torch.equal(out, ref), f"\n{out}\n{ref}"
    st = sd.last_stats
    _check_stats(st, 8)
    assert st.rollback in STRATEGIES and st.rollback_reason.startswith(f"{st.rollback}: the best predicted goodput")
    assert all(name in st.rollback_reason for name in STRATEGIES)  # every candidate was measured and named
    assert st.predicted_tokens_per_s > 0 and st.measured_tokens_per_s > 0
    assert sd.strategy is not None and sd.strategy.name == st.rollback.replace("_deferred", "")


def test_rollback_auto_leaves_out_a_strategy_that_runs_out_of_memory(monkeypatch):
    """rollback="auto" whose measurement of one strategy runs out of device memory chooses among
    the others, and its reason names the one left out with what the allocator asked for, not the
    allocator's whole advice; the output stays exact."""
    from specdec.engine import SpeculativeGenerator
    family = "nemotron_h"
    advice = ("CUDA out of memory. Tried to allocate 4.38 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
              "3.36 GiB is free. Including non-PyTorch memory, this process has 136.44 GiB memory in use. If reserved "
              "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    real = SpeculativeGenerator._measure

    def measure(self, dec, key, widths):
        if key.strategy == "snapshot":
            raise torch.OutOfMemoryError(advice)
        return real(self, dec, key, widths)

    monkeypatch.setattr(SpeculativeGenerator, "_measure", measure)
    sd = specdec.wrap(get_model(family), drafter=make_drafter("perturbed", family), rollback="auto",
                      num_speculative_tokens="auto", cost_model=MeasuredCosts())  # (nothing measured yet)
    out, ref = _generate(sd, family)
    assert torch.equal(out, ref)
    reason = sd.last_stats.rollback_reason
    assert sd.last_stats.rollback != "snapshot"
    assert "snapshot left out: out of memory while measuring it (CUDA out of memory. Tried to allocate 4.38 GiB.)" \
        in reason, reason
    assert "total capacity" not in reason and "PYTORCH_CUDA_ALLOC_CONF" not in reason


@pytest.mark.parametrize("overlap_steps", ["1", "0"])
@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_auto_k_through_every_width_exact(family, strategy, path, overlap_steps, monkeypatch):
    """K forced through 0..8 in a scripted order (up, down, to 0 and back): exact on both decode
    paths (the static path runs each width as its own static shape); every K = 0 step is a plain
    step (the state updated in place) where the strategy has them (snapshot, replay), the one
    step launched past the call's end and dropped included (its K the script's next), with the
    step overlap and without it (``SPECDEC_OVERLAP_STEPS=0``: none dropped)."""
    monkeypatch.setenv("SPECDEC_OVERLAP_STEPS", overlap_steps)
    plain_steps = []
    real = RollbackStrategy.plain_verify
    monkeypatch.setattr(RollbackStrategy, "plain_verify",
                        lambda self, store, *a: plain_steps.append(store.layer) or real(self, store, *a))
    forwards = counting_forwards(monkeypatch)
    costs = ScriptedCosts(ORDER)
    sd = specdec.wrap(get_model(family), drafter=make_drafter("perturbed", family), rollback=strategy,
                      num_speculative_tokens="auto", decode_path=path, cost_model=costs)
    out, ref = _generate(sd, family)
    assert torch.equal(out, ref), f"\n{out}\n{ref}"
    st = sd.last_stats
    _check_stats(st, 8)
    assert st.k_per_step == ORDER[:st.steps]  # hysteresis never holds a K that costs 100x
    layers = sum(layer.has_recurrence for layer in sd.last_cache.ssm.values())
    dropped = len(forwards) - st.steps  # (a step launched before the last one's flags were read)
    assert dropped in ((0, 1) if overlap_steps == "1" else (0,))
    plain = st.k_per_step.count(0) + (dropped and ORDER[st.steps] == 0)
    assert len(plain_steps) == (plain * layers if strategy != "ring" else 0)
    assert st.decode_path == path and st.rollback == strategy and st.rollback_reason is None
    assert sd.cost_model is costs


@needs_triton_interpreter
def test_auto_k_fused_replay_folds_for_the_step_width(monkeypatch):
    """Fused replay on the Triton kernels (here through the interpreter), the static path, K
    scripted up and down: each verify narrower than the decoder folds only as many committed
    tokens as its own width (the decoder flushes first after a wider step; SPECDEC_DEBUG checks
    every row's history against it), and the output equals plain greedy, also in a second call on
    the kept decoder (Mamba-2 layers; the GDN and KDA kernels' fold_max against the reference in
    test_kernels_triton.py)."""
    fam = "nemotron_h"
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    from specdec.cache import HybridCache
    from specdec.kernels.gdn.triton_step import DeltaRuleKernels
    from specdec.kernels.mamba2.triton_step import Mamba2Kernels

    seen, flushes = [], []
    real_flush = HybridCache.flush
    monkeypatch.setattr(HybridCache, "flush", lambda self: flushes.append(len(seen)) or real_flush(self))
    for cls in (DeltaRuleKernels, Mamba2Kernels):
        def record(self, ckpt, hist, hist_len, inputs, params, offset, real=cls.replay_verify, **kw):
            seen.append((next(iter(inputs.values())).shape[1], kw.get("fold_max")))
            return real(self, ckpt, hist, hist_len, inputs, params, offset, **kw)
        monkeypatch.setattr(cls, "replay_verify", record)
    # the small model (one Mamba-2 and one attention layer), two ragged rows and drafts from the model's
    # own greedy output, 70 % of them right (partial acceptance): every kernel runs through the
    # interpreter, and one Mamba-2 layer shows each verify's fold
    model = get_model(fam, "small")
    ids, mask = ragged_prompts(batch=2)
    plain = hf_greedy(model, ids, mask)
    eos = int(plain[1, ids.shape[1] + 3])  # row 1 stops at its 4th new token (or earlier), as reference() does
    want = hf_greedy(model, ids, mask, eos=eos)
    assert want.shape[1] > ids.shape[1] + 4
    sd = specdec.wrap(model, drafter=OracleDrafter(want, mask, acceptance=0.7, seed=0), rollback="replay",
                      num_speculative_tokens="auto", decode_path="static", cost_model=ScriptedCosts(ORDER))

    def generate():
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        return out, want

    forwards = counting_forwards(monkeypatch)
    out, ref = generate()
    assert any(layer.has_recurrence for layer in sd.last_cache.ssm.values())
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values() if layer.has_recurrence)
    assert torch.equal(out, ref), f"\n{out}\n{ref}"
    ks = sd.last_stats.k_per_step
    assert ks == ORDER[:len(ks)] and max(ks) == 8
    dropped = len(forwards) - len(ks)  # the step launched past the call's end (its K the script's next), dropped
    assert dropped in (0, 1)
    launched = ORDER[:len(ks) + dropped]
    assert set(seen) == {(K + 1, K + 1 if K < 8 else None) for K in set(launched) if K > 0}, set(seen)
    # a flush before each speculative step narrower than the one before it (without it the debug
    # check fails), besides those entering plain steps
    narrower = [(a, b) for a, b in zip(ks, ks[1:]) if 0 < b < a]
    assert narrower and len(flushes) >= len(narrower)
    out, ref = generate()  # a second call on the kept decoder (its history and promise from the first)
    assert torch.equal(out, ref) and len(set(sd.last_stats.k_per_step)) > 3
    for bad in (10, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"fold_max must be None or an int in \[0, 9\]"):
            sd.last_cache.set_fold_max(bad)


@pytest.mark.parametrize("strategy", ["replay", "replay_deferred", "snapshot"])
def test_narrower_steps_flush_only_where_the_verify_sizes_its_fold(strategy, monkeypatch):
    """The static decoder flushes before a step narrower than the one committed before it only
    for eager replay (whose verify folds the history it meets, sized by fold_max); deferred
    replay keeps its deferral and snapshot holds no history. Every step at K = 0 flushes on
    entering plain mode, whatever the strategy."""
    from specdec.cache import HybridCache
    from specdec.rollback import ReplayRollback

    flushes = []
    real_flush = HybridCache.flush
    monkeypatch.setattr(HybridCache, "flush", lambda self: flushes.append(1) or real_flush(self))
    rollback = ReplayRollback(deferred=True) if strategy == "replay_deferred" else strategy
    sd = specdec.wrap(get_model("nemotron_h"), drafter=make_drafter("perturbed", "nemotron_h"), rollback=rollback,
                      num_speculative_tokens="auto", decode_path="static", cost_model=ScriptedCosts(ORDER))
    out, ref = _generate(sd, "nemotron_h")
    assert torch.equal(out, ref)
    ks = sd.last_stats.k_per_step
    entering_plain = sum(1 for i, K in enumerate(ks) if K == 0 and (i == 0 or ks[i - 1] > 0))
    narrower = sum(1 for a, b in zip(ks, ks[1:]) if 0 < b < a)
    assert narrower > 0 and entering_plain > 0
    assert len(flushes) == entering_plain + (narrower if strategy == "replay" else 0)


def _captured_flushes_on_the_static_path(monkeypatch) -> None:
    """The static path's decoder (no step graphs) flushes as the CUDA-graph path's does
    (``HybridCache.flush_graphs``, set as it adopts its cache)."""
    import specdec.decoding as decoding

    real_load = decoding.StaticDecoder.load

    def load(self, fresh):
        real_load(self, fresh)
        if self.cache is fresh:
            self.cache.flush_graphs = True

    monkeypatch.setattr(decoding.StaticDecoder, "load", load)


@needs_triton_interpreter
@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture_fails"])
def test_replay_flush_between_steps_replays_one_captured_program(fail, monkeypatch):
    """With CUDA graphs (here a stand-in that replays the captured function, on the Triton
    interpreter's fused replay), the flushes between steps (entering plain steps, narrowing K)
    run every layer's fold as one program: eagerly at the first flush, captured once at the
    second, replayed from then on, also in a second call on the kept decoder; made again when any
    buffer it reads changes, dropped when a step's capture fails (eager flushes from then on),
    and holding no reference cycle (``release()`` frees the cache with the collector off). The
    output equals plain greedy; a capture that fails warns once and flushes eagerly from then on
    (not tried again, also in the second call), with the same output."""
    import specdec.graphs as graphs
    from specdec.cache import HybridCache
    from specdec.kernels.mamba2.triton_step import Mamba2Kernels

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    captures, replaying, folds, flushes = [], [False], [], []

    class Replaying:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            replaying[0] = True
            try:
                self.fn()
            finally:
                replaying[0] = False

    def capture(fn, *, what, **kw):  # (a real capture runs nothing: CapturedProgram replays it at once)
        captures.append(what)
        if fail:
            raise CaptureFailure(what, RuntimeError("no graphs here"))
        return Replaying(fn), None

    monkeypatch.setattr(graphs, "capture", capture)
    real_fold, real_flush = Mamba2Kernels.replay_fold, HybridCache.flush
    _captured_flushes_on_the_static_path(monkeypatch)
    monkeypatch.setattr(Mamba2Kernels, "replay_fold",
                        lambda self, *a, **kw: folds.append(replaying[0]) or real_fold(self, *a, **kw))
    monkeypatch.setattr(HybridCache, "flush", lambda self: flushes.append(1) or real_flush(self))
    model = get_model("nemotron_h", "small")
    ids, mask = ragged_prompts(batch=2)
    want = hf_greedy(model, ids, mask)
    sd = specdec.wrap(model, drafter=OracleDrafter(want, mask, acceptance=0.7, seed=0), rollback="replay",
                      num_speculative_tokens="auto", decode_path="static", cost_model=ScriptedCosts(ORDER))
    layers = None
    for _ in range(2):
        with (pytest.warns(RuntimeWarning, match="the rollback flush") if fail and layers is None
              else contextlib.nullcontext()):
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
        assert torch.equal(out, want), f"\n{out}\n{want}"
        layers = sum(layer.has_recurrence for layer in sd.last_cache.ssm.values())
    folded = len(folds) // layers  # (a flush before the first verify has no history to fold)
    assert layers and folded >= 3 and len(flushes) >= folded and len(folds) == folded * layers
    assert captures == ["the rollback flush"]  # once, over both calls
    eager = layers * (folded if fail else 1)  # (the first flush is the capture's warm-up)
    assert folds == [False] * eager + [True] * (len(folds) - eager)
    if fail:
        return
    cache = sd.last_cache
    store = next(layer.store for layer in cache.ssm.values() if layer.has_recurrence)
    for name in ("hist_len", "ckpt", "hist"):  # each a buffer a captured flush would miss: a new program
        if name == "hist":
            first = next(iter(store.tensors["hist"]))
            store.tensors["hist"] = {**store.tensors["hist"], first: store.tensors["hist"][first].clone()}
        else:
            store.tensors[name] = store.tensors[name].clone()
        folds.clear()
        for _ in range(3):
            cache.flush()
        assert len(captures) == 1 + ("hist_len", "ckpt", "hist").index(name) + 1, name
        assert folds == [False] * layers + [True] * (2 * layers), name
    with pytest.warns(RuntimeWarning, match="no graphs"):  # a step's capture failed: flushes run eagerly
        sd.decoder._capture_failed_with(CaptureFailure("a step", RuntimeError("no graphs")))
    folds.clear()
    cache.flush()
    assert folds == [False] * layers and len(captures) == 4
    was_on = gc.isenabled()  # the captured flush holds no reference cycle through the cache
    gc.disable()
    try:
        cache.flush_graphs = True
        for _ in range(2):
            cache.flush()
        assert len(captures) == 5
        freed = weakref.ref(cache)
        del cache, store
        sd.release()
        assert freed() is None
    finally:
        if was_on:
            gc.enable()


def test_a_strategy_with_its_own_flush_runs_it(monkeypatch):
    """A user's strategy that overrides ``flush`` (not split into ``flush_host`` and
    ``flush_device``) has it called at every flush, also where the decoder would capture the
    flushes; the output equals plain greedy."""
    from specdec.rollback import ReplayRollback

    calls = []

    class Mine(ReplayRollback):
        def flush(self, store, op, params):
            calls.append(store.layer)
            super().flush(store, op, params)

    _captured_flushes_on_the_static_path(monkeypatch)
    sd = specdec.wrap(get_model("nemotron_h"), drafter=make_drafter("perturbed", "nemotron_h"), rollback=Mine(),
                      num_speculative_tokens="auto", decode_path="static", cost_model=ScriptedCosts(ORDER))
    out, ref = _generate(sd, "nemotron_h")
    assert torch.equal(out, ref)
    ks = sd.last_stats.k_per_step
    entering_plain = sum(1 for i, K in enumerate(ks) if K == 0 and (i == 0 or ks[i - 1] > 0))
    layers = sum(layer.has_recurrence for layer in sd.last_cache.ssm.values())
    assert entering_plain and len(calls) >= entering_plain * layers and len(calls) % layers == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strategy", [*STRATEGIES, "auto"])
@pytest.mark.parametrize("fam", ["qwen3_5", "nemotron_h", "kimi_linear"])
def test_auto_on_the_cuda_graph_path_exact(fam, strategy):
    """On CUDA (fp32 tiny models): K scripted through every width captures each width's graphs in
    the middle of the generation (its warm-up commits nothing), and the measured costs capture them
    while calibrating; both equal plain greedy, twice (the second call replays the kept graphs)."""
    model = get_model(fam).cuda()
    ids, mask, eos, ref = (t.cuda() if isinstance(t, torch.Tensor) else t for t in reference(fam))
    for costs in (ScriptedCosts(ORDER), None):
        draft = DraftModelDrafter(get_model(fam, "perturbed").cuda())
        sd = specdec.wrap(model, drafter=draft, rollback=strategy, num_speculative_tokens="auto",
                          decode_path="cuda_graph", cost_model=costs)
        for _ in range(2):
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
            assert sd.last_stats.decode_path == "cuda_graph", sd.last_stats.capture_error
            assert torch.equal(out, ref)
            assert costs is None or len(set(sd.last_stats.k_per_step)) > 2  # scripted: several widths
    get_model(fam).cpu()
    get_model(fam, "perturbed").cpu()


class _ReplayingGraph:
    """A stand-in for a captured CUDA graph on CPU: replay() runs the captured function again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        out = self.fn()
        self.out.copy_(out)


def _fake_capture(calls, fail=False):
    def capture(fn, **kw):
        calls.append(kw["what"])
        if fail:
            raise CaptureFailure(kw["what"], RuntimeError("no graphs here"))
        graph = _ReplayingGraph(fn)
        graph.out = fn().clone()  # (a real capture runs nothing; this run's updates are reset below)
        return graph, graph.out
    return capture


def test_policy_update_graphs_kept_held_and_bounded(monkeypatch):
    """The kept update graphs (CPU, a replaying stand-in for the capture): a policy that adopts one
    computes what an eager policy does from its own prior, its values read one step late (on CUDA
    the replay runs beside the next step); one made while another has not closed updates eagerly;
    a failed capture is tried once per shape; at most POLICY_GRAPHS_KEPT shapes."""
    import specdec.adaptive as adaptive

    calls = []
    monkeypatch.setattr(adaptive, "capture", _fake_capture(calls))
    costs, graphs, B, M = FixedCosts(lambda s, b, K: 1.0 + K), {}, 4, 3

    def policy(prior, batch=B, kept=graphs):
        return SpeculationPolicy(PolicySettings(), costs, CostKey("cuda_graph", "replay", batch), None, M, batch, 32,
                                 prior, "cpu", True, graphs=kept)

    first = policy(0.6)
    assert calls == ["the speculation policy's update"] and first._graph is not None
    first.acceptance.reset(0.6)  # (the stand-in ran the update once while "capturing")
    alongside = policy(0.3)  # the first has not closed: its estimator is not taken
    assert alongside._graph is None and alongside.acceptance is not first.acceptance
    first.close()
    later, eager = policy(0.3), policy(0.3, kept=None)
    assert later.acceptance is first.acceptance and len(calls) == 1  # adopted, not captured again
    g = torch.Generator().manual_seed(1)
    last = None  # the eager values of the step before
    for _ in range(4):
        asked = torch.randint(0, M + 1, (B,), generator=g)
        n = torch.minimum(torch.randint(0, M + 1, (B,), generator=g), asked)
        ran, budget = torch.ones(B, dtype=torch.bool), torch.randint(0, 30, (B,), generator=g)
        got, want = later.update(n, asked, ran, ran, budget), eager.update(n, asked, ran, ran, budget)
        assert got is None if last is None else got == last.tolist()  # (on the host already)
        assert torch.equal(later.acceptance.rates, eager.acceptance.rates)
        last = want.clone()
    assert later.pending() == last.tolist() and later.pending() is None  # read once

    class _Event:  # (a stand-in for the CUDA event after a replay: finished or not, counted waits)
        finished, waits = False, 0

        def query(self):
            return self.finished

        def synchronize(self):
            self.waits += 1

    # a step that skips its update reads a replay's values only once it has finished: it does not
    # wait for the device (on CUDA, a host sync in the middle of the loop's overlap)
    later.update(n, asked, ran, ran, budget)
    later._graph.done = event = _Event()
    assert later.pending(wait=False) is None and event.waits == 0 and later._pending  # (still pending)
    event.finished = True
    later.receive(None, 5)  # (the live rows the step of the replay left)
    later.k_per_step.append(0)  # read at the next step: computed for those live rows
    later.receive(later.pending(wait=False), 4)
    assert later.pending(wait=False) is None and later._live_estimated == 5
    later.update(n, asked, ran, ran, budget)
    later.k_per_step += [0, 0]  # read two steps after the replay's launch: not taken as the live rows' now
    later.receive(later.pending(wait=False), 3)
    assert later._live_estimated is None
    later._graph.done = None
    later.close()
    for batch in range(5, 5 + adaptive.POLICY_GRAPHS_KEPT):
        policy(0.5, batch=batch).close()
    assert len(graphs) == adaptive.POLICY_GRAPHS_KEPT and later._graph_key not in graphs  # the oldest went
    failing, failed = [], {}
    monkeypatch.setattr(adaptive, "capture", _fake_capture(failing, fail=True))
    monkeypatch.setattr(adaptive, "_FUSED_UPDATE_FAILED", [None])
    with pytest.warns(RuntimeWarning, match="updates without a graph"):
        policy(0.5, kept=failed).close()
    tried = len(failing)  # fused, then unfused (SPECDEC_FUSE on), or unfused only
    assert tried == (2 if fusion_enabled() else 1)
    assert (adaptive._FUSED_UPDATE_FAILED[0] is not None) == fusion_enabled()
    again = policy(0.5, kept=failed)
    assert len(failing) == tried and again._graph is None  # tried once for the shape
    with pytest.warns(RuntimeWarning, match="updates without a graph"):
        policy(0.5, batch=B + 1, kept=failed).close()
    assert len(failing) == tried + 1  # a new shape: unfused at once after a fused failure


def test_choice_before_the_sync_is_the_choice_after_it(monkeypatch):
    """With a kept update graph (CPU: a replaying stand-in) the engine calls before_sync before
    the step's blocking sync and after_sync after it: the next K chosen ahead, the costs fed
    and the values kept are those of the post-sync protocol (after_step, then next_k), step
    for step, over steps of random outcomes and laps, rows ending, probes and K = 0 included."""
    import specdec.adaptive as adaptive

    monkeypatch.setattr(adaptive, "capture", _fake_capture([]))
    B, M = 4, 4
    costs = [MeasuredCosts(weight=0.5) for _ in range(2)]
    key = CostKey("cuda_graph", "replay", B)
    for c in costs:
        for T in range(1, M + 2):
            c.record_width(key, T, verify_s=1.0 + 0.15 * T, commit_s=0.05)
    pols = [SpeculationPolicy(PolicySettings(probe_interval=3, probe_budget=1.0), c, key, DrafterKey(False), M, B, 60, 0.5, "cpu",
                              True, graphs={}) for c in costs]
    assert all(p.reads_ahead for p in pols)
    clocks = [_LapClock(), _LapClock()]
    g = torch.Generator().manual_seed(3)
    finished = torch.zeros(B, dtype=torch.bool)
    for step in range(40):
        firsts = [c.marks for c in clocks]
        ks = [p.next_k() for p in pols]
        assert ks[0] == ks[1], step
        K = ks[0]
        asked = torch.full((B,), K).masked_fill(finished, 0)
        drawn = torch.randint(0, K + 1, (B,), generator=g)  # every draft accepted, then none, then at random
        n = asked if step < 8 else torch.zeros_like(asked) if step < 20 else torch.minimum(drawn, asked)
        laps = [("draft", 0.1 * K + float(torch.rand(1, generator=g)) * 0.05), ("verify", 1.0 + 0.2 * K),
                ("rollback", 0.05), ("bookkeeping", 0.02)]
        if step in (11, 20):
            finished[step % B] = True
        live, budget = ~finished, torch.full((B,), 40 - step).masked_fill(finished, 0)
        for c in clocks:
            c.step(laps)
        old, new = pols
        values = [p.update(n, asked, ~finished, live, budget) if not p.skips_update else p.pending() for p in pols]
        assert values[0] == values[1]
        new.before_sync(values[1], clocks[1], firsts[1])  # (before the sync)
        old.after_step(values[0], clocks[0], firsts[0], int(live.sum()))  # (after it)
        new.after_sync(int(live.sum()))
    assert pols[0].k_per_step == pols[1].k_per_step and {0, 1, 2, 3} <= set(pols[0].k_per_step)
    assert costs[0].step_times(key, pols[0].drafter_key, M) == costs[1].step_times(key, pols[1].drafter_key, M)
    # and what Stats reports of the choices: the same predictions, margins and measured steps
    assert pols[0].gain_per_step == pols[1].gain_per_step and len(pols[0].gain_per_step) == 40
    assert pols[0].predicted_step_s() == pols[1].predicted_step_s()
    assert pols[0].measured_step_s() == pols[1].measured_step_s()
    pols[1].close()
    assert pols[1]._ahead is None


def test_work_after_the_sync_counts_in_the_next_window_not_the_draft(monkeypatch):
    """Choosing before the sync, a step's window of laps ends before its sync; the work after it
    (a second bookkeeping lap: waking, streaming, reading the flags) counts in the next step's
    window as the target's time, not as drafting and not in none; a pool's prefill laps between
    steps count in neither."""
    import specdec.adaptive as adaptive

    monkeypatch.setattr(adaptive, "capture", _fake_capture([]))
    monkeypatch.setattr(adaptive, "choose_k", lambda *a: 2)
    costs, key = MeasuredCosts(weight=0.5), CostKey("cuda_graph", "replay", 2)
    for T in (1, 2, 3):
        costs.record_width(key, T, verify_s=6.0, commit_s=0.0)
    policy = SpeculationPolicy(PolicySettings(), costs, key, DrafterKey(False), 2, 2, 100, 0.6, "cpu", True,
                               graphs={})
    clock = _LapClock()
    for step in range(5):
        if step == 3:
            clock.step([("prefill", 7.0)])  # (an admission between steps)
        first = clock.marks
        assert policy.next_k() == 2
        clock.step([("draft", 0.3), ("verify", 1.4), ("rollback", 0.2), ("bookkeeping", 0.1)])
        policy.before_sync(None, clock, first)
        clock.step([("bookkeeping", 5.0)])  # after the sync
        policy.after_sync(2)
    assert costs.draft_s(policy.drafter_key, key, 2) == pytest.approx(0.3)
    assert costs.target_s(key, 2) == pytest.approx(1.4 + 0.2 + 0.1 + 5.0)
    # steps 1-3 were taken (step 0: the first at K = 2; step 4: its window closes after the loop),
    # each with the work after the sync before it; predicted when choosing: the calibration (6 s) for
    # steps 0-2 (step 1 is taken in before_sync of step 2, which chooses step 3), then 7 s
    assert policy.measured_step_s() == [None, None, pytest.approx(0.3 + 1.4 + 0.2 + 0.1 + 5.0)]
    assert policy.predicted_step_s()[2] == pytest.approx((3 * 6.0 + 2 * 7.0) / 5)
    assert policy.calibrated_step_s() == [6.0, 6.0, 6.0]  # the widths alone, as recorded


@pytest.mark.parametrize("overlap_steps", ["1", "0"])
def test_engine_chooses_before_the_sync_with_a_kept_update(monkeypatch, overlap_steps):
    """The decode loop with a kept update graph (CPU: a replaying stand-in, the policy made as on
    the CUDA-graph path) chooses each K before the step's sync (with the step overlap: before it
    reads the last step's flags): the output stays exact, every step's K is counted once (the
    choice made for a step that never ran is dropped), and a second call adopts the kept graph."""
    import specdec.adaptive as adaptive
    import specdec.engine as engine

    monkeypatch.setenv("SPECDEC_OVERLAP_STEPS", overlap_steps)

    calls = []
    monkeypatch.setattr(adaptive, "capture", _fake_capture(calls))
    made = []

    class KeptPolicy(SpeculationPolicy):
        def __init__(self, *a, graphs=None, **kw):
            super().__init__(*a, graphs=kept, **kw)
            made.append(self)

    kept = {}
    monkeypatch.setattr(engine, "SpeculationPolicy", KeptPolicy)
    sd = specdec.wrap(get_model("qwen3_5"), drafter="ngram", num_speculative_tokens="auto",
                      max_speculative_tokens=4, cost_model=ScriptedCosts(ORDER))
    for _ in range(2):
        out, ref = _generate(sd, "qwen3_5")
        assert torch.equal(out, ref)
        _check_stats(sd.last_stats, 4)
        assert made[-1].reads_ahead and made[-1]._ahead is None
    assert len(calls) == 1 and len(made) == 2  # the second call adopted the kept graph


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("until_last", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_policy_update_graph_equals_eager(until_last, fuse, monkeypatch):
    """On CUDA: the captured policy update, replayed on its side stream, gives the eager update's
    E(K) (one step late) and rates over steps of random outcomes -- bit for bit unfused; fused
    (compiled kernels, another order of floating-point operations) to fp32 rounding -- and a
    later policy of the same shape replays the kept graph from its own prior."""
    import specdec.adaptive as adaptive

    monkeypatch.setenv("SPECDEC_FUSE", "1" if fuse else "0")
    monkeypatch.setattr(adaptive, "_FUSED_UPDATE_FAILED", [None])
    same = ((lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)) if fuse else
            (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)))
    B, M = 16, 6
    costs, graphs = FixedCosts(lambda s, b, K: 1.0 + K), {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for prior in (0.6, 0.3):
        pols = [SpeculationPolicy(PolicySettings(), costs, CostKey("cuda_graph", "replay", B), None, M, B, 64, prior,
                                  "cuda", until_last, graphs=kept) for kept in (graphs, None)]
        last = None
        for step in range(6):
            asked = torch.randint(0, M + 1, (B,), device="cuda", generator=g)
            n = torch.minimum((torch.rand(B, device="cuda", generator=g) * (asked + 1)).long(), asked)
            ran = torch.rand(B, device="cuda", generator=g) < 0.9
            budget = torch.randint(0, 60, (B,), device="cuda", generator=g)
            graphed, eager = (p.update(n, asked, ran, ran, budget) for p in pols)
            if last is None:
                assert graphed is None
            else:  # (host values, read after the replay that ran beside this step)
                same(torch.tensor(graphed, dtype=torch.float64, device="cuda"), last)
            pols[0].settle()
            same(pols[0].acceptance.rates, pols[1].acceptance.rates)
            last = eager.clone()
        same(torch.tensor(pols[0].pending(), dtype=torch.float64, device="cuda"), last)
        assert pols[0]._graph is not None and pols[1]._graph is None
        assert adaptive._FUSED_UPDATE_FAILED[0] is None  # (fused: compiled and captured, not fallen back)
        pols[0].close()  # (the next policy of the shape may take the kept graph)
    assert len(graphs) == 1


def test_auto_rollback_takes_the_cheapest_strategy(family):
    costs = ScriptedCosts(ORDER, strategy="ring")
    sd = specdec.wrap(get_model(family), drafter="ngram", rollback="auto", num_speculative_tokens="auto",
                      cost_model=costs)
    out, ref = _generate(sd, family)
    assert torch.equal(out, ref)
    assert sd.last_stats.rollback == "ring" and sd.last_stats.rollback_reason.startswith("ring: ")


@pytest.mark.parametrize("K", [2, 4])
def test_tree_drafter_with_auto_rollback_exact(K):
    """rollback="auto" with a tree drafter compares the strategies at the tree's width (every tree
    step runs all its nodes, whatever K), stays exact against HF greedy and picks a strategy."""
    from tree_drafters import SMALL_TREE

    model = get_model("qwen3_5")
    drafter = MedusaDrafter(MedusaHeads.from_target(model, num_heads=3), tree=SMALL_TREE)
    sd = specdec.wrap(model, drafter=drafter, rollback="auto", num_speculative_tokens=K)
    out, ref = _generate(sd, "qwen3_5")
    assert torch.equal(out, ref)
    assert sd.last_stats.rollback in STRATEGIES and sd.last_stats.rollback_reason


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_medusa_chain_auto_exact(strategy):
    model = get_model("qwen3_5")
    heads = MedusaHeads.from_target(model, num_heads=3)
    sd = specdec.wrap(model, drafter=MedusaDrafter(heads), rollback=strategy, num_speculative_tokens="auto",
                      max_speculative_tokens=5, cost_model=ScriptedCosts([0, 5, 2, 0, 0, 3, 1]))
    out, ref = _generate(sd, "qwen3_5")
    assert torch.equal(out, ref)
    st = sd.last_stats
    _check_stats(st, 3)  # 3 heads: K up to 3 (Drafter.max_drafts), not max_speculative_tokens = 5
    assert st.proposed_tokens <= 3 * sum(st.k_per_step)


def test_policy_goes_to_plain_decoding_and_speculates_again(family):
    """Observed acceptance drives K to 0 (the oracle's drafts are all wrong for the first new
    tokens), a probe sees the acceptance rise (every draft right afterwards), K grows again; the
    costs are given (a step at K costs 1 + 0.3 K), so the path is the policy's own rule."""
    ids, mask, eos, ref = reference(family)
    L = ids.shape[1]
    plain = get_model(family).generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
    drafter = OracleDrafter(plain, mask, acceptance=[0.0] * 10 + [1.0], seed=0)
    sd = specdec.wrap(get_model(family), drafter=drafter, rollback="replay", num_speculative_tokens="auto",
                      cost_model=FixedCosts(lambda strategy, batch, K: 1.0 + 0.3 * K),
                      policy=PolicySettings(acceptance_batch=1, probe_budget=1.0))  # the full weight at this
    # batch of 3, a probe every 8 steps at K = 0
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=48, pad_token_id=0)
    assert torch.equal(out, plain)
    ks = sd.last_stats.k_per_step
    first_zero = ks.index(0)
    assert 0 < first_zero and max(ks[:first_zero]) >= 1  # it speculated, then stopped
    zeros = ks[first_zero:first_zero + 7]
    assert zeros == [0] * 7 and ks[first_zero + 7] == 1  # plain steps, then the probe
    assert max(ks[first_zero + 8:]) >= 2  # and speculation resumed, with longer drafts than the probe's
    st = sd.last_stats
    assert st.accepted_tokens > 0 and out.shape[1] == L + 48
    # what the policy predicted behind its choices: the given costs, and per step its gain over K = 0
    assert st.predicted_step_s == pytest.approx([1.0 + 0.3 * K for K in range(9)])
    gains = st.speculation_gain_per_step
    assert len(gains) == st.steps and gains[0] > 1.02 and ks[0] > 0  # (min_gain 0.02: speculation started)
    assert gains[first_zero] <= 1.0  # speculating, it stopped: no K > 0 predicted faster than K = 0
    assert all(gain <= 1.02 for gain in gains[first_zero:first_zero + 7])  # plain steps: not worth starting
    # the steps' own times per K (measured on the host clock here), where the costs took any
    assert len(st.measured_step_s) == 9
    for K, (n, t) in enumerate(zip(st.k_histogram, st.measured_step_s)):
        assert (t is None) if n == 0 else (t is None or t > 0), (K, n, t)
    assert any(t is not None for t in st.measured_step_s)
    assert st.calibrated_step_s == [None] * 9  # given costs: nothing measured
    # E(K) behind the choices, averaged over the steps: one token at K = 0 per live row, and more
    # with drafts (the oracle's drafts all right after the first 10 tokens; counted until the
    # slowest row ends, E(K) need not grow with every further draft)
    assert len(st.expected_tokens) == 9 and 0 < st.expected_tokens[0] <= 3
    assert all(e > st.expected_tokens[0] for e in st.expected_tokens[1:])


def test_assigned_drafter_keeps_the_decoder_and_starts_from_the_prior():
    """A generator given a new drafter (experiment=adaptive runs one per cell on every workload)
    keeps its static decoder and its rollback="auto" choice, and its policy starts from the prior
    acceptance, not from the last drafter's (the same drafter's next call starts from its own): after a call whose drafts were all wrong, the next
    drafter's call chooses the K of every step as a new generator does; both exact."""
    family = "qwen3_5"
    ids, mask, _, _ = reference(family)
    model = get_model(family)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    kw = dict(attention_mask=mask, max_new_tokens=24, pad_token_id=0)
    costs = FixedCosts(lambda strategy, batch, K: (1.0 if strategy == "ring" else 2.0) + 0.3 * K)
    policy = PolicySettings(acceptance_batch=1)  # the full weight at this batch of 3: the estimates move fast

    def wrap(acceptance):
        return specdec.wrap(model, drafter=OracleDrafter(plain, mask, acceptance=acceptance, seed=0),
                            rollback="auto", num_speculative_tokens="auto", max_speculative_tokens=4,
                            decode_path="static", cost_model=costs, policy=policy)

    sd = wrap(0.0)
    assert torch.equal(sd.generate(ids, **kw), plain)
    assert sd.last_stats.k_per_step[-1] <= 1  # plain steps (or a probe): every draft was wrong
    decoder = sd.decoder
    sd.drafter = OracleDrafter(plain, mask, acceptance=1.0, seed=0)
    assert torch.equal(sd.generate(ids, **kw), plain)
    fresh = wrap(1.0)
    assert torch.equal(fresh.generate(ids, **kw), plain)
    assert sd.decoder is decoder and sd.last_stats.rollback == fresh.last_stats.rollback == "ring"
    assert sd.last_stats.k_per_step == fresh.last_stats.k_per_step
    assert fresh.last_stats.k_per_step[0] > 0  # (from the prior: a new call speculates at once)
    # the same drafter's next call starts from the acceptance its last call ended with: all wrong,
    # so it starts at K = 0 (its first step there a probe), where a new drafter's first call (above)
    # speculates at once
    sd.drafter = OracleDrafter(plain, mask, acceptance=0.0, seed=0)
    assert torch.equal(sd.generate(ids, **kw), plain) and sd.last_stats.k_per_step[0] > 0
    assert torch.equal(sd.generate(ids, **kw), plain)
    assert sd.last_stats.k_per_step[:2] == [1, 0]


class _Switchable(Drafter):
    """One drafter whose drafts are all right or all wrong, switched between calls."""

    def __init__(self, reference, mask):
        self.right, self.wrong = (OracleDrafter(reference, mask, acceptance=a, seed=0) for a in (1.0, 0.0))
        self.now = self.wrong

    def start(self, **kw):
        self.right.start(**kw)
        self.wrong.start(**kw)

    def propose(self, input_ids, lengths, K):
        return self.now.propose(input_ids, lengths, K)


def test_short_calls_look_again_at_a_drafter_that_did_badly():
    """A drafter whose last call accepted nothing: each later call starts at K = 0 from that
    estimate, and probes at its first plain step, so calls shorter than the probe spacing see
    that the drafts are now right and speculate again within a few calls (before, every such call
    ran plain steps only and handed the old estimate on unchanged); exact throughout."""
    family = "qwen3_5"
    ids, mask, _, _ = reference(family)
    model = get_model(family)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    drafter = _Switchable(plain, mask)
    sd = specdec.wrap(model, drafter=drafter, rollback="replay", num_speculative_tokens="auto",
                      cost_model=FixedCosts(lambda strategy, batch, K: 1.0 + 0.3 * K))
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=0), plain)
    ks = sd.last_stats.k_per_step
    probes = [i for i, k in enumerate(ks) if i > 3 and k > 0]  # (after the first steps, at the prior)
    # spaced further as the estimate falls (a probe's cost is what it loses against the plain steps
    # that would commit its expected tokens); at the end, further apart than the calls below
    assert len(probes) >= 2 and probes[-1] - probes[-2] > 16, ks
    drafter.now = drafter.right
    short = plain[:, :ids.shape[1] + 16]
    runs = []
    for _ in range(4):
        assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0), short)
        runs.append(sd.last_stats.k_per_step)
    assert runs[0][:2] == [1, 0], runs  # the first plain step probes
    assert max(runs[-1]) > 1, runs  # ... and the calls speculate again


# ------------------------------------------------------------------------------ exactness, sampling

V, N, POSITIONS = 8, 3000, 4


@pytest.fixture(scope="module")
def tiny_vocab_models():
    # the small model (one Gated DeltaNet and one attention layer): every case prefills its N identical rows
    target = make_model("qwen3_5", seed=3, vocab=V, small=True)
    return target, perturbed_copy(target, scale=0.3, seed=4)


@pytest.fixture(scope="module")
def hf_samples(tiny_vocab_models):
    """HF sampling's ``N`` continuations of the prompt the sampling tests share (drawn once for them)."""
    target, _ = tiny_vocab_models
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]]).repeat(N, 1)
    return target.generate(ids, max_new_tokens=POSITIONS, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)


# (the n-gram drafter's sampling stays checked by default in test_sampling.py::test_marginals_match_hf_sampling
# [ngram-T1]; K per step and the chosen strategy under sampling by the draft model's case here)
@pytest.mark.parametrize("drafter", [pytest.param("ngram", marks=pytest.mark.slow), "draft"])
def test_auto_sampling_keeps_the_target_distribution(tiny_vocab_models, hf_samples, drafter):
    """Sampling with K changing every step (0 included) and the strategy chosen by the costs:
    the marginals of the first new tokens equal HF sampling's (two-sample chi-square)."""
    target, draft = tiny_vocab_models
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    ids = prompt.repeat(N, 1)
    hf = hf_samples
    dr = "ngram" if drafter == "ngram" else DraftModelDrafter(draft)
    sd = specdec.wrap(target, drafter=dr, rollback="auto", num_speculative_tokens="auto", max_speculative_tokens=3,
                      cost_model=ScriptedCosts([0, 3, 0, 2], strategy="snapshot"))
    out = sd.generate(ids, max_new_tokens=POSITIONS, do_sample=True, temperature=1.0, top_k=0, pad_token_id=0,
                      generator=torch.Generator().manual_seed(1234))
    st = sd.last_stats
    assert st.rollback == "snapshot" and 0 in st.k_per_step and max(st.k_per_step) >= 2
    assert st.proposed_tokens > N // 4
    assert 0 < st.acceptance_rate < 1
    assert_same_token_distribution(hf, out, prompt.shape[1], POSITIONS, V)


# ------------------------------------------------------------------------------ the policy's rules


def test_expected_tokens_formula():
    g = torch.Generator().manual_seed(0)
    B, M = 5, 6
    rates = torch.rand(B, M, generator=g)
    budget = torch.tensor([0, 2, 6, 9, 3])
    active = torch.tensor([True, True, False, True, True])
    got = expected_tokens(rates, budget, active)
    for K in range(M + 1):
        want = 0.0
        for r in range(B):
            if not active[r]:
                continue
            want += 1.0 + sum(math.prod(float(rates[r, i]) for i in range(j)) for j in range(1, min(K, budget[r]) + 1))
        assert float(got[K]) == pytest.approx(want, rel=1e-9), K


def _steps_to_finish(acceptance, left, done, K, runs, g):
    """Mean steps until every row has committed ``left`` tokens from ``done``, drafts accepted
    i.i.d. with per-row ``acceptance`` until the first rejection (a simulation)."""
    total = 0
    for _ in range(runs):
        d, steps = done.clone(), 0
        while bool((d < left).any()):
            if K:
                hit = torch.rand(d.shape[0], K, generator=g) < acceptance[:, None]
                n = torch.where(~hit, torch.arange(K)[None, :], K).min(1).values
            else:
                n = torch.zeros_like(d)
            n = torch.minimum(n, (left - d - 1).clamp(min=0))
            d, steps = (d + (n + 1) * (d < left)).clamp(max=left), steps + 1
        total += steps
    return total / runs


@pytest.mark.parametrize("until_last", [False, True])
def test_expected_tokens_of_identical_rows_from_one(until_last):
    # a batch whose rows all start alike (the policy's first step): one row with copies=B is the batch's E(K)
    gen = torch.Generator().manual_seed(3)
    for B in (1, 5, 64):
        rates = torch.rand(1, 6, generator=gen)
        budget = torch.randint(0, 40, (1,), generator=gen)
        for weight in (None, 0.2):
            batch = expected_tokens(rates.expand(B, -1), budget.expand(B), torch.ones(B, dtype=torch.bool),
                                    until_last, weight)
            one = expected_tokens(rates, budget, torch.ones(1, dtype=torch.bool), until_last, weight, copies=B)
            torch.testing.assert_close(one, batch, rtol=1e-10, atol=1e-10)


def test_expected_tokens_until_the_last_row():
    """until_last: tokens left over the steps the batch needs until its slowest row ends, within 4%
    of a simulation at the start of a call, mid-call with rows apart, with rows of different
    acceptance and at batch 1; at K = 0, tokens left over the most left; below the per-step E(K)."""
    g = torch.Generator().manual_seed(3)
    budget = torch.tensor([9, 30, 5, 100])
    active = torch.tensor([True, True, True, False])
    got = expected_tokens(torch.rand(4, 6, generator=g), budget, active, until_last=True)
    assert float(got[0]) == pytest.approx((10 + 31 + 6) / 31)
    M, left = 4, 120
    cases = [torch.full((64,), 0.7), torch.linspace(0.5, 0.9, 64), torch.full((1,), 0.7)]
    starts = [torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long), torch.zeros(1, dtype=torch.long)]
    apart = torch.zeros(64, dtype=torch.long)  # rows apart after 40 steps at K = 2
    for _ in range(40):
        hit = torch.rand(64, 2, generator=g) < 0.7
        apart = apart + 1 + torch.where(~hit, torch.arange(2)[None, :], 2).min(1).values
    cases.append(torch.full((64,), 0.7))
    starts.append(apart)
    for acceptance, done in zip(cases, starts):
        B = acceptance.shape[0]
        rates = acceptance[:, None].expand(B, M).clone()
        budget, live = (left - done - 1).clamp(min=0), done < left
        got = expected_tokens(rates, budget, live, until_last=True)
        per_step = expected_tokens(rates, budget, live)
        for K in (1, 2, 4):
            simulated = float((left - done).sum()) / _steps_to_finish(acceptance, left, done, K, 60, g)
            assert float(got[K]) == pytest.approx(simulated, rel=0.04), (B, K)
            assert float(got[K]) < float(per_step[K])


def test_until_last_shrinks_noisy_row_estimates():
    """The largest of 64 noisy per-row estimates always finds a row that looks slow: the raw
    estimates' until_last E(K) is > 10% low against the true rates; shrunk towards the mean by
    the estimate's own noise (the estimator's weight) it is within 7%, for equal and for
    different true acceptance, in this draw (seed 0). Over other draws the shrink holds for
    equal acceptance (within 5.2% in 20 seeds) but overshoots for different acceptance, by up to
    28% at K = 4: rows that truly differ are pulled towards a mean they are not noise around."""
    g = torch.Generator().manual_seed(0)
    B, M = 64, 8
    for acceptance in (torch.full((B,), 0.7), torch.linspace(0.5, 0.9, B)):
        est = AcceptanceEstimator(B, M, 0.6, 0.25, "cpu")
        for _ in range(40):
            hit = torch.rand(B, 4, generator=g) < acceptance[:, None]
            est.update(torch.where(~hit, torch.arange(4)[None, :], 4).min(1).values, torch.full((B,), 4),
                       torch.ones(B, dtype=torch.bool))
        budget, live = torch.full((B,), 99), torch.ones(B, dtype=torch.bool)
        true = expected_tokens(acceptance[:, None].expand(B, M).clone(), budget, live, until_last=True)
        raw = expected_tokens(est.rates, budget, live, until_last=True)
        shrunk = est.expected_tokens(budget, live, until_last=True)
        for K in (1, 2, 4):
            assert float(raw[K]) < 0.9 * float(true[K])
            assert float(shrunk[K]) == pytest.approx(float(true[K]), rel=0.07)


def test_speculation_gain_is_the_margin_choose_k_starts_on():
    """speculation_gain: the best K > 0's goodput over K = 0's (a worked case), and choose_k starts
    speculating (from no current K) exactly when it exceeds 1 + min_gain."""
    assert speculation_gain([10.0, 13.0, 14.0], [1.0, 1.2, 1.5]) == pytest.approx((13.0 / 1.2) / 10.0)
    assert speculation_gain([10.0], [1.0]) == 1.0
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        M = int(torch.randint(1, 9, (), generator=g))
        expected = (1 + torch.rand(M + 1, generator=g).cumsum(0) * 0.3).tolist()
        times = (1 + torch.rand(M + 1, generator=g) * torch.arange(M + 1) * 0.2).tolist()
        for min_gain in (0.0, 0.05, 0.2):
            gain = speculation_gain(expected, times)
            starts = choose_k(expected, times, None, 0.05, min_gain) > 0
            assert starts == (gain > 1 + min_gain), (expected, times, min_gain)
            for hysteresis in (0.0, 0.1):  # from plain steps the hysteresis holds K = 0 as well
                starts = choose_k(expected, times, 0, hysteresis, min_gain) > 0
                assert starts == (gain > 1 + max(min_gain, hysteresis)), (expected, times, min_gain, hysteresis)
    assert speculation_gain([0.0, 0.0], [1.0, 1.2]) == 1.0  # no live rows: no margin either way


def test_choose_k_maximises_goodput_with_hysteresis():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        M = 8
        expected = (1 + torch.rand(M + 1, generator=g).cumsum(0)).tolist()
        times = (1 + torch.rand(M + 1, generator=g) * torch.arange(M + 1)).tolist()
        rates = [e / t for e, t in zip(expected, times)]
        best = rates.index(max(rates))
        assert choose_k(expected, times, None, 0.05) == best
        for current in range(M + 1):
            want = current if rates[best] <= 1.05 * rates[current] else best
            assert choose_k(expected, times, current, 0.05) == want
        # min_gain: speculation starts only beating K = 0 by more than the margin; a speculating K
        # moves by the hysteresis alone, to K = 0 as to any other K
        for gain in (0.1, 0.5):
            for current in [None] + list(range(M + 1)):
                def worth(K):
                    return K == 0 or bool(current) or rates[K] > (1 + gain) * rates[0]
                top = best if worth(best) else 0
                want = (current if current is not None and worth(current) and rates[top] <= 1.05 * rates[current]
                        else top)
                assert choose_k(expected, times, current, 0.05, gain) == want, (current, gain)


def test_hysteresis_sum_moves_a_k_held_by_a_steady_small_gain():
    """A K the hysteresis holds gives way once the best K's predicted gains over it, summed over
    consecutive steps, pass ``hysteresis_sum``: a steady 3% gain (inside the 5% band) moves K = 1
    to K = 2 at the 7th step (0.2 / 0.03); a gain that comes and goes (K = 1 the best every other
    step) never adds up, nor gains towards different K; with ``math.inf`` the band holds for good."""
    def run(settings, expected_at, current=1):
        M = len(expected_at(0)) - 1
        policy = SpeculationPolicy(settings, FixedCosts(lambda s, b, K: 1.0), CostKey("eager", "replay", 1), None,
                                   M, 1, 1000, 0.6, "cpu")
        policy.current = current  # settled on it
        ks = []
        for step in range(10):
            policy.expected = expected_at(step)  # E(K), K = 0..2, as an update would leave them
            ks.append(policy.next_k())
        return ks

    steady = [1.0, 1.2, 1.2 * 1.03]
    assert run(PolicySettings(), lambda step: steady) == [1] * 6 + [2] * 4
    assert run(PolicySettings(), lambda step: steady if step % 2 else [1.0, 1.2, 1.1]) == [1] * 10
    assert run(PolicySettings(hysteresis_sum=math.inf), lambda step: steady) == [1] * 10
    assert run(PolicySettings(hysteresis_sum=0.0), lambda step: steady) == [2] * 10  # no band at all
    # gains towards different K do not add up: K = 3 and K = 1 better by 4% and 3% by turns never
    # leave K = 2 (one sum over both would pass 0.2 at the 6th step)
    assert run(PolicySettings(), lambda step: [1.0, 1.1, 1.2, 1.248] if step % 2 else [1.0, 1.236, 1.2, 1.1],
               current=2) == [2] * 10
    # K = 0 is one more K: predicted 2% faster (inside the band) it stops speculation at the 10th
    # step (0.2 / 0.0204), 10% faster at once
    assert run(PolicySettings(), lambda step: [1.0, 0.98, 0.9]) == [1] * 9 + [0]
    assert run(PolicySettings(), lambda step: [1.0, 0.9, 0.8])[0] == 0


def test_a_calibrated_neighbour_within_the_band_runs_until_measured():
    """A width next to the current K whose cost is only calibrated runs in its place while its
    predicted goodput is within the hysteresis of K's (3% below here), until MEASURED_STEPS real
    steps have measured it (for at most MEASURING_STEPS steps a call); one predicted 10% below
    does not, nor any with measure_neighbours off."""
    def policy_at(expected_2, **settings):
        costs, key, dk = MeasuredCosts(), CostKey("eager", "replay", 1), DrafterKey(False)
        for T in (1, 2, 3):
            costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
        for _ in range(MEASURED_STEPS):  # K = 1 ran: measured (and no gap to its calibration)
            costs.observe(key, dk, 1, 0.0, 1.0)
        policy = SpeculationPolicy(PolicySettings(**settings), costs, key, dk, 2, 1, 1000, 0.6, "cpu")
        policy.current, policy.expected = 1, [1.0, 1.5, 1.5 * expected_2]
        return policy, costs, key, dk

    policy, costs, key, dk = policy_at(0.97)
    assert policy.step_times() == pytest.approx([1.0, 1.0, 1.0])
    assert not costs.measured(key, 2) and costs.measured(key, 1)
    assert [policy.next_k(), policy.next_k()] == [2, 2] and policy.current == 1  # measuring, not settled
    for _ in range(MEASURED_STEPS - 1):  # (what the policy's step windows feed in a real loop)
        costs.observe(key, dk, 2, 0.0, 1.0)
    assert not costs.measured(key, 2)  # one step may be far off: a few before it counts as measured
    costs.observe(key, dk, 2, 0.0, 1.0)
    assert costs.measured(key, 2) and policy.next_k() == 1
    # in a decode loop (the step windows of a lap clock fed after each step, and, reading ahead,
    # before the sync): the neighbour's first step in the call is not counted (a switch), the
    # next are, at most MEASURING_STEPS steps a call, call after call while K = 2 stays within
    # the band (its steps measured at K = 1's 1.0 s), until MEASURED_STEPS were counted
    for ahead in (False, True):
        policy, costs, key, dk = policy_at(0.97)
        calls = []
        while not costs.measured(key, 2):
            policy = SpeculationPolicy(policy.settings, costs, key, dk, 2, 1, 1000, 0.6, "cpu")
            policy.current, policy.expected = 1, [1.0, 1.5, 1.5 * 0.97]
            clock, ks = _LapClock(), []
            for step in range(6):
                first = clock.marks
                ks.append(policy.next_k())
                clock.step([("draft", 0.1), ("verify", 0.9), ("rollback", 0.0)])
                if ahead:
                    policy.before_sync(None, clock, first)
                    policy.after_sync(1)
                else:
                    policy.after_step(None, clock, first, 1)
            calls.append(ks)
            assert ks == [2] * MEASURING_STEPS + [1] * (6 - MEASURING_STEPS), (ahead, ks)
            assert costs.target_s(key, 2) == pytest.approx(0.9)  # (its real steps count from the first)
        assert len(calls) == -(-MEASURED_STEPS // (MEASURING_STEPS - 1)), calls
    # a cost model that never takes the steps in: the call measures for at most MEASURING_STEPS steps
    policy = policy_at(0.97)[0]
    assert [policy.next_k() for _ in range(6)] == [2] * MEASURING_STEPS + [1] * (6 - MEASURING_STEPS)
    assert policy_at(0.90)[0].next_k() == 1
    assert policy_at(0.97, measure_neighbours=False)[0].next_k() == 1


def _scripted_steps(ks, laps, sequential: bool):
    """Steps at the Ks ``ks`` with the laps ``laps(K, K before or None)`` through a policy whose
    costs hold a calibrated 1.0 s for widths 1-3: ``(policy, costs, key, drafter key, Ks run)``."""
    costs, key, dk = MeasuredCosts(weight=0.5), CostKey("eager", "replay", 1), DrafterKey(sequential)
    for T in (1, 2, 3):
        costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
    policy = SpeculationPolicy(PolicySettings(), costs, key, dk, 2, 1, 1000, 0.6, "cpu")
    clock, seen = _LapClock(), []
    for K in ks:
        first = clock.marks
        policy._ahead = (K, K, 0, None, policy.step_times(), 1.0)  # (this step's K, as the policy would choose it)
        seen.append(policy.next_k())
        clock.step(laps(K, seen[-2] if len(seen) > 1 else None))
        policy.after_step(None, clock, first, 1)
    return policy, costs, key, dk, seen


def test_a_step_right_after_a_switch_of_k_is_not_a_measure_of_its_width():
    # a narrower step first folds the wider one's replay history: its time is the switch's, and
    # counted, it would make the narrower width look slower for the steps after it
    def laps(K, before):
        switched = before is not None and before != K
        return [("draft", 0.1), ("verify", 0.9 + 0.2 * K + (0.5 if switched else 0.0)), ("rollback", 0.0)]

    policy, costs, key, _, seen = _scripted_steps((1, 1, 2, 2, 1, 1, 1), laps, sequential=False)
    assert seen == [1, 1, 2, 2, 1, 1, 1]
    assert costs.target_s(key, 1) == pytest.approx(1.1)  # the steps after each switch left out
    assert costs.target_s(key, 2) == pytest.approx(1.3)
    assert policy.measured_step_s()[1] == pytest.approx(1.2)  # (draft included)


def test_the_first_speculative_step_after_plain_ones_is_not_a_measure_of_its_width():
    # a drafter with state of its own (a draft model, MTP layers) first catches up on the text of
    # the plain steps: counted, a long run of plain steps would make its next proposal look slow,
    # and the plain steps' probes would then be spaced further apart
    def laps(K, before):
        catch_up = 5.0 if K and before == 0 else 0.0  # after 3 plain steps
        return [("draft", 0.1 + catch_up if K else 0.01), ("verify", 1.0 + 0.2 * K), ("rollback", 0.0)]

    ks = (1, 0, 0, 0, 1, 1, 1)  # (a K's first step in the call is not measured either)
    policy, costs, key, dk, seen = _scripted_steps(ks, laps, sequential=True)
    assert seen == list(ks)
    assert costs.draft_s(dk, key, 1) == pytest.approx(0.1)  # its draft lap left out
    assert costs.target_s(key, 1) == pytest.approx(1.2)  # (its target part taken: 2 steps of 1.2)
    assert costs._n[("target", key, 1)] == 2 and policy.measured_step_s()[1] == pytest.approx(1.3)
    # a drafter without state of its own (n-gram): a probe from K = 0 measures its width whole
    policy, costs, key, dk, _ = _scripted_steps(ks, lambda K, before: [("draft", 0.1 if K else 0.01),
                                                                      ("verify", 1.0 + 0.2 * K),
                                                                      ("rollback", 0.0)], sequential=False)
    assert costs._n[("draft", dk, key.path, key.batch, 1)] == 2 and costs.draft_s(dk, key, 1) == pytest.approx(0.1)


def test_min_gain_shrinks_with_the_batch():
    """The start margin is min_gain up to acceptance_batch rows and shrinks as 1 / sqrt(B) above
    (the noise of the batch's E(K)): a 1.5% predicted gain starts speculation at 64 rows, not at 8."""
    st = PolicySettings()
    assert st.min_gain_for(1) == st.min_gain_for(8) == 0.02
    assert st.min_gain_for(64) == pytest.approx(0.02 / math.sqrt(8))
    for B, starts in ((8, False), (64, True)):
        policy = SpeculationPolicy(st, FixedCosts(lambda s, b, K: 1.0), CostKey("eager", "replay", B), None,
                                   1, B, 1000, 0.6, "cpu")
        policy.expected = [1.0, 1.015]  # E(K), K = 0, 1 (every step costs the same)
        assert (policy.next_k() == 1) == starts, B


def test_speculation_starts_above_the_margin_and_stops_beyond_the_hysteresis():
    """A rate 3% above plain neither starts (min_gain 5%) nor stops speculation; 1% below plain
    does not stop it either (inside the 5% hysteresis), 6% below does."""
    times = [1.0, 1.0]
    assert choose_k([1.0, 1.03], times, 0, 0.05, 0.05) == 0  # not started: 3% < 5%
    assert choose_k([1.0, 1.03], times, None, 0.05, 0.05) == 0
    assert choose_k([1.0, 1.06], times, 0, 0.05, 0.05) == 1  # started
    assert choose_k([1.0, 1.03], times, 1, 0.05, 0.05) == 1  # kept
    assert choose_k([1.0, 0.99], times, 1, 0.05, 0.05) == 1  # kept: inside the band
    assert choose_k([1.0, 0.94], times, 1, 0.05, 0.05) == 0  # stopped: K = 0 faster by more than 5%
    assert choose_k([1.0, 0.94], times, 1, 0.10, 0.05) == 1  # (a wider band keeps it)


def test_strategies_are_compared_by_their_calibrations():
    """rollback="auto" compares every strategy by its calibrated step (plus the shared draft time):
    the online refinement, which only the strategy that ran gets (its acceptance, bookkeeping and
    host gaps), must not make a never-run strategy look faster."""
    costs = MeasuredCosts()
    run, other = CostKey("cuda_graph", "replay", 64), CostKey("cuda_graph", "ring", 64)
    for T in range(1, 4):
        costs.record_width(run, T, 0.010 + 0.001 * T, 0.001)
        costs.record_width(other, T, 0.011 + 0.001 * T, 0.001)
    for _ in range(20):  # real steps of the strategy that ran: 30% above its calibration
        costs.observe(run, "d", 2, 0.002, 1.3 * costs.calibrated_s(run, 2))
    assert costs.step_s(run, "d", 2) > costs.step_s(other, "d", 2)  # refined vs calibrated: not comparable
    assert costs.comparable_step_s(run, "d", 2) == pytest.approx(costs.draft_s("d", run, 2) + 0.013 + 0.001)
    assert costs.comparable_step_s(run, "d", 2) < costs.comparable_step_s(other, "d", 2)
    fixed = FixedCosts(lambda strategy, batch, K: 1.0 + K)
    assert fixed.comparable_step_s(run, None, 3) == fixed.step_s(run, None, 3) == 4.0


def test_overall_acceptance_counts_every_observation():
    """overall(): per position, accepted / observed over every update, pulled by `strength`
    pseudo-observations towards the prior (the first position) or the position before's overall
    value (the others: a position seldom observed follows the one before it); with nothing
    observed, the prior."""
    est = AcceptanceEstimator(3, 3, 0.6, 0.25, "cpu")
    est.update(torch.tensor([2, 0, 1]), torch.tensor([3, 3, 1]), torch.tensor([True, True, True]))
    est.update(torch.tensor([1, 0, 0]), torch.tensor([1, 2, 2]), torch.tensor([True, False, True]))
    # step 1: row 0 accepts drafts 1, 2 and rejects 3; row 1 rejects 1; row 2 accepts the one it was
    # asked (draft 2 not observed). Step 2: row 0 accepts its one; row 1 did not run; row 2 rejects 1
    observed = torch.tensor([3.0 + 2.0, 1.0, 1.0])
    accepted = torch.tensor([2.0 + 1.0, 1.0, 0.0])
    assert torch.equal(est.observed, observed) and torch.equal(est.accepted, accepted)
    first = (3.0 + 4.0 * 0.6) / (5.0 + 4.0)  # 0.6
    second = (1.0 + 4.0 * first) / (1.0 + 4.0)  # 0.68
    third = (0.0 + 4.0 * second) / (1.0 + 4.0)  # 0.544
    assert torch.allclose(est.overall(0.6, strength=4.0), torch.tensor([first, second, third]))
    fresh = AcceptanceEstimator(2, 3, 0.6, 0.25, "cpu")
    assert torch.allclose(fresh.overall(0.6), torch.full((3,), 0.6))  # nothing observed: the prior
    # a position never observed takes the one before's value, not the prior
    low = AcceptanceEstimator(1, 3, 0.6, 0.25, "cpu")
    for _ in range(20):
        low.update(torch.tensor([0]), torch.tensor([1]), torch.tensor([True]))  # draft 1 always rejected
    out = low.overall(0.6)
    assert out[0] == pytest.approx(2.4 / 24.0) and out[1] == out[2] == out[0]


def test_plain_steps_of_a_fixed_batch_leave_the_estimate():
    """until_last: after a step at K = 0, while the live rows are those of the values held,
    update() returns None and changes nothing; once a row has ended (told one step late) it
    computes again; after a probe it returns E(K) for the choice and the per-step E(K), and the
    prediction counts the latter."""
    costs = FixedCosts(lambda strategy, batch, K: 1.0 + 0.9 * K)  # speculation never pays: K = 0
    B, M = 4, 3
    policy = SpeculationPolicy(PolicySettings(probe_interval=4, probe_budget=1.0), costs,
                               CostKey("eager", "replay", B), None, M, B, 50, 0.6, "cpu", until_last=True)
    assert policy.read_size == 2 * (M + 1)
    n, asked, every = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), torch.ones(B, dtype=torch.bool)
    left = torch.full((B,), 40)
    assert policy.next_k() == 0
    first = policy.update(n, asked, every, every, left)  # (nothing known of the live rows yet)
    assert first is not None
    policy.receive(first.tolist(), B)
    assert policy.next_k() == 0
    before = policy.acceptance.rates.clone()
    assert policy.skips_update  # (the engine then builds no arguments for it)
    assert policy.update(n, asked, every, every, left) is None
    assert torch.equal(policy.acceptance.rates, before)
    policy.receive(None, B - 1)  # a row ended in that step
    assert policy.next_k() == 0
    some = torch.tensor([True, True, True, False])
    again = policy.update(n, asked, every, some, left)
    assert again is not None and float(again[0]) == pytest.approx(3.0)  # three rows, one token a step
    policy.receive(again.tolist(), B - 1)
    assert policy.next_k() == 1  # the probe
    values = policy.update(n, torch.ones(B, dtype=torch.long), some, some, left)
    assert values.shape == (policy.read_size,)
    assert not torch.equal(policy.acceptance.rates, before)
    policy.receive(values.tolist(), B - 1)
    assert policy.expected == values[:M + 1].tolist()
    assert policy.step_expected == expected_tokens(policy.acceptance.rates, left, some).tolist()
    policy.receive(None, B - 1)  # kept
    assert policy.expected == values[:M + 1].tolist()


def test_probes_are_spaced_by_their_cost():
    """At K = 0 the probe interval is probe_interval, or (t(1) - t(0)) / t(0) / probe_budget steps
    when probing costs more than that budget."""
    for t1, budget, want in ((1.05, 0.01, 8), (1.3, 0.01, 30), (2.0, 0.05, 20), (0.9, 0.01, None)):
        settings = PolicySettings(probe_interval=8, probe_budget=budget)
        policy = SpeculationPolicy(settings, FixedCosts(lambda s, b, K: 1.0 if K == 0 else t1 + 0.1 * (K - 1)),
                                   CostKey("eager", "replay", 2), None, 3, 2, 500, 0.0, "cpu")
        if want is None:  # K = 1 costs less than K = 0: probing costs nothing, the minimum interval holds
            assert policy.probe_every(policy.step_times()) == 8
            continue
        assert policy.probe_every(policy.step_times()) == want
        ks = [policy.next_k() for _ in range(2 * want)]
        assert [i for i, K in enumerate(ks) if K] == [want - 1, 2 * want - 1]

def test_probes_keep_their_spacing_while_the_predicted_costs_move():
    """The spacing counts the plain steps since the last probe: with measured costs it moves from
    step to step (here between 20 and 21 steps), and a probe whenever the count is a multiple of
    the spacing then came once in hundreds of steps (one per 256-step call on an H100)."""
    calls = [0]

    def step_s(strategy, batch, K):
        if K == 0:
            calls[0] += 1
            return 1.0
        return 1.2 if calls[0] % 2 else 1.205  # probe_every alternates 20 and 21

    settings = PolicySettings(probe_interval=8, probe_budget=0.01)
    policy = SpeculationPolicy(settings, FixedCosts(step_s), CostKey("eager", "replay", 2), None, 3, 2, 1000, 0.0, "cpu")
    ks = [policy.next_k() for _ in range(210)]
    probes = [i for i, K in enumerate(ks) if K]
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert len(probes) >= 9 and all(20 <= g <= 22 for g in gaps), (probes, gaps)



def test_acceptance_estimator_rule():
    w, prior = 0.25, [0.6, 0.5, 0.8, 0.3]  # (unequal: a move towards the position before shows)
    est = AcceptanceEstimator(5, 4, torch.tensor(prior), w, "cpu")
    n = torch.tensor([2, 0, 3, 1, 0])
    asked = torch.tensor([3, 2, 3, 0, 0])  # row 2 accepted all it was asked; rows 3 and 4 asked nothing
    ran = torch.tensor([True, True, True, False, True])  # (row 4: a plain step of a pool's row)
    est.update(n, asked, ran)
    want = [list(prior) for _ in range(5)]
    for r in (0, 1, 2, 4):
        seen = list(want[r])  # the observed positions updated first
        for i in range(4):
            if i < n[r]:
                seen[i] = (1 - w) * want[r][i] + w  # accepted
            elif i == n[r] and n[r] < asked[r]:
                seen[i] = (1 - w) * want[r][i]  # the first rejection
        for i in range(4):  # censored positions keep their rates; those not asked move towards the one before
            want[r][i] = (1 - w) * seen[i] + w * seen[i - 1] if i >= max(asked[r], 1) else seen[i]
    assert torch.allclose(est.rates, torch.tensor(want), atol=1e-6), (est.rates, want)


def test_later_drafts_accepted_more_often_than_the_first_keep_their_rates():
    """An n-gram drafter's later drafts are accepted far more often than its first (once a match
    is found it continues): steps that reject the first draft say nothing of the later ones, so
    their rates follow only the steps that reached them. (Pulled towards the first position's
    rate on every such step, they halved E(4) on the zoo model, where the policy then stayed at
    K = 0 although K = 4 ran 1.5 times as fast as plain decoding.)"""
    est = AcceptanceEstimator(1, 4, 0.6, 0.25, "cpu")
    asked, ran = torch.tensor([4]), torch.tensor([True])
    for step in range(40):  # the first draft rejected at every other step, every draft accepted at the others
        est.update(torch.tensor([4 * (step % 2)]), asked, ran)
    first, later = est.rates[0, 0].item(), est.rates[0, 1:]
    assert 0.3 < first < 0.7 and bool((later > 0.99).all()), est.rates
    E = expected_tokens(est.rates, torch.tensor([8]), torch.tensor([True]))
    assert E[4].item() == pytest.approx(1 + first * (1 + later[0] + later[0] * later[1] + later[:3].prod()).item())


def test_a_probe_runs_the_speculative_k_of_the_best_predicted_goodput():
    """At K = 0 a probe runs the K > 0 whose predicted goodput is best (here K = 3: the longer
    drafts cost almost nothing more than one), not K = 1: a probe at K = 1 observes only the first
    draft, and a drafter whose later drafts are accepted more often than its first (n-gram) then
    looks worse than it is. Its spacing counts that K's cost beyond the plain steps that would
    commit the tokens it is expected to commit."""
    times = {0: 1.0, 1: 1.2, 2: 1.201, 3: 1.202, 4: 1.25}
    settings = PolicySettings(probe_interval=8, probe_budget=1.0)
    policy = SpeculationPolicy(settings, FixedCosts(lambda strategy, batch, K: times[K]), CostKey("eager", "replay", 2),
                               None, 4, 2, 100, 0.1, "cpu")  # acceptance 0.1: no K beats plain decoding
    assert SpeculationPolicy.probe_k(policy.expected, policy.step_times()) == 3
    assert [policy.next_k() for _ in range(16)] == ([0] * 7 + [3]) * 2
    assert policy.probe_every([1.0, 1.1, 1.2, 3.0], 3) == 8 and policy.probe_every([1.0, 1.1, 1.2, 3.0], 1) == 8
    tight = SpeculationPolicy(PolicySettings(probe_interval=8, probe_budget=0.1), FixedCosts(lambda s, b, K: times[K]),
                              CostKey("eager", "replay", 2), None, 4, 2, 100, 0.1, "cpu")
    assert tight.probe_every([1.0, 1.1, 1.2, 3.0], 3) == 20 and tight.probe_every([1.0, 1.1, 1.2, 3.0], 1) == 8
    # counted beyond the plain steps that would commit its expected tokens: 3.0 - 1.0 * 1.5 = 1.5
    assert tight.probe_every([1.0, 1.1, 1.2, 3.0], 3, [2.0, 2.4, 2.8, 3.0]) == 15


def test_a_fixed_batch_of_several_rows_counts_a_probes_whole_extra_time(monkeypatch):
    """Per step (continuous batching) a probe's cost for the spacing is its time beyond the plain
    steps that would commit its expected tokens; a fixed batch of several rows ends with its
    slowest row, which one probe seldom moves, so there the whole extra time counts."""
    monkeypatch.setattr(specdec.adaptive, "choose_k", lambda *a: 0)  # plain steps, whatever is predicted
    costs = FixedCosts(lambda strategy, batch, K: 1.0 + 0.3 * K)
    settings = PolicySettings(probe_interval=2, probe_budget=0.05)
    first_probe = {}
    for until_last in (False, True):
        policy = SpeculationPolicy(settings, costs, CostKey("eager", "replay", 4), None, 4, 4, 1000, 0.6, "cpu",
                                   until_last=until_last)
        times, expected = policy.step_times(), policy.expected
        K = SpeculationPolicy.probe_k(expected, times)
        want = policy.probe_every(times, K) if until_last else policy.probe_every(times, K, expected)
        ks = [policy.next_k() for _ in range(want + 1)]
        first_probe[until_last] = ks.index(K) + 1
        assert first_probe[until_last] == want and ks[:want - 1] == [0] * (want - 1), (until_last, ks)
    assert first_probe[True] > first_probe[False]


def test_policy_probes_at_k0_and_counts_what_it_predicted():
    """K = 0 is best for constant acceptance 0: every 8th step at K = 0 is a K = 1 probe."""
    costs = FixedCosts(lambda strategy, batch, K: 1.0 + K)
    settings = PolicySettings(probe_interval=8, probe_budget=1.0)  # a probe's cost does not space them further
    policy = SpeculationPolicy(settings, costs, CostKey("eager", "replay", 2), None, 4, 2, 100, 0.0, "cpu")
    ks = [policy.next_k() for _ in range(24)]
    assert ks == ([0] * 7 + [1]) * 3
    assert policy.k_histogram() == [21, 3, 0, 0, 0]
    # prior 0: every K commits 1 token per row, so the predicted goodput is 2 rows / the mean step time
    assert policy.predicted_tokens_per_s == pytest.approx(2 * 24 / (21 * 1.0 + 3 * 2.0))


def test_a_dip_of_the_estimate_does_not_stop_speculation_and_a_drop_does():
    """Speculating, the policy leaves for K = 0 by the hysteresis, as for any K: three steps in
    which 2 of 16 rows accept (the estimate falls from 0.3 to 0.2, K = 1 predicted 3% slower
    than plain) keep K = 1, which gains 5% at the true 0.3; acceptance 0 from then on stops it
    within two steps (predicted 5% slower). At K = 0 only the probes would observe, so a stop
    on the dip would have held plain decoding (the old rule: stop at any predicted loss)."""
    B = 16
    settings = PolicySettings(prior_acceptance=0.3, measure_neighbours=False)
    policy = SpeculationPolicy(settings, FixedCosts(lambda s, b, K: 1.0 + 0.24 * K), CostKey("eager", "replay", B),
                               None, 2, B, 1000, 0.3, "cpu")

    def step(accepting: int) -> int:
        K = policy.next_k()
        n = torch.zeros(B, dtype=torch.long)
        n[:accepting] = min(K, 1)
        live = torch.ones(B, dtype=torch.bool)
        values = policy.update(n, torch.full((B,), K), live, live, torch.full((B,), 500))
        policy.receive(None if values is None else values.tolist(), B)
        return K

    assert step(5) == 1  # (E(1) / t(1) = 1.3 / 1.24 at the prior: 4.8% over plain)
    dip = [step(2) for _ in range(3)]
    back = [step(5) for _ in range(12)]  # the estimate back near 0.3
    assert dip + back == [1] * 15 and min(policy.gain_per_step) < 0.98  # predicted slower, kept
    drop = [step(0) for _ in range(4)]
    assert drop[-1] == 0 and drop.index(0) <= 2, drop


def test_small_batches_average_acceptance_more_slowly():
    """A batch of B < acceptance_batch rows weighs a new observation by w * sqrt(B / acceptance_batch);
    larger batches by w. The policy's estimator takes that weight."""
    settings = PolicySettings(acceptance_weight=0.2, acceptance_batch=16)
    for B, want in ((1, 0.2 * 0.25), (4, 0.2 * 0.5), (16, 0.2), (64, 0.2)):
        assert settings.acceptance_weight_for(B) == pytest.approx(want)
        policy = SpeculationPolicy(settings, FixedCosts(lambda s, b, K: 1.0 + K), CostKey("eager", "replay", B), None,
                                   3, B, 50, 0.5, "cpu")
        assert policy.acceptance.weight == pytest.approx(want)


def test_measured_costs_calibration_online_and_draft_line():
    costs = MeasuredCosts(weight=0.5)
    key = CostKey("eager", "replay", 4)
    assert costs.needs_widths(key, [1, 2, 3]) == [1, 2, 3]
    for T in (1, 2, 3):
        costs.record_width(key, T, verify_s=0.010 * T, commit_s=0.001)
    assert costs.needs_widths(key, [1, 2, 3]) == []
    assert costs.step_s(key, "d", 1) == pytest.approx(0.021)  # calibrated, no draft time known yet
    costs.observe(key, "d", 1, draft_s=0.004, target_s=0.025)  # a real step at K = 1
    assert costs.target_s(key, 1) == pytest.approx(0.025)
    gap = 0.025 - 0.021
    assert costs.target_s(key, 2) == pytest.approx(0.021 + 0.010 + gap)  # calibrated + the mean real gap
    assert costs.draft_s("d", key, 2) == pytest.approx(0.008)  # one measured K: proportional
    costs.observe(key, "d", 1, draft_s=0.006, target_s=0.027)  # (the proposal: 1.25 x its mean at most)
    assert costs.target_s(key, 1) == pytest.approx(0.5 * 0.025 + 0.5 * 0.027)  # weighted mean
    assert costs.draft_s("d", key, 1) == pytest.approx(0.5 * 0.004 + 0.5 * 0.005)
    costs.observe(key, "d", 2, draft_s=0.007, target_s=0.040)
    k, v = [1, 2], [0.0045, 0.007]  # a line through the measured K: draft(K) = 0.002 + 0.0025 K
    assert costs.draft_s("d", key, 4) == pytest.approx(v[0] + (v[1] - v[0]) / (k[1] - k[0]) * (4 - k[0]))
    assert costs.draft_s("d", key, 0) == 0.0 and costs.draft_s("other", key, 3) == 0.0
    with pytest.raises(KeyError, match="calibrate"):
        costs.target_s(CostKey("eager", "ring", 4), 1)
    # plain steps keep their own gap: the speculative steps' one is not theirs (0 until one ran)
    assert costs.target_s(key, 0) == pytest.approx(0.011)
    costs.observe(key, "d", 0, draft_s=0.0, target_s=0.0115)
    assert costs.target_s(key, 0) == pytest.approx(0.0115)
    costs.record_width(key, 4, verify_s=0.040, commit_s=0.001)  # K = 3, not run: the largest K run's gap
    gap2 = 0.040 - 0.031  # per K: (1, 0.005), (2, 0.009)
    assert costs.target_s(key, 3) == pytest.approx(0.041 + gap2)  # (not carried on a line through K = 1, 2)
    costs.observe(key, "d", 2, draft_s=0.007, target_s=0.031 - 0.010)  # gap(2) := 0.5 (0.009 - 0.010)
    assert costs.target_s(key, 3) == pytest.approx(0.041 - 0.0005)
    for d in ("d", DrafterKey(True), DrafterKey(False)):  # every K at once (one fit per line) is step_s at each K
        assert costs.step_times(key, d, 3) == [costs.step_s(key, d, K) for K in range(4)]
    with pytest.raises(KeyError, match="calibrate"):
        costs.step_times(key, "d", 4)  # width 5 was never measured


def test_gap_of_a_k_not_run_leans_fast():
    # long drafts ran (their gap includes their own replay and bookkeeping); K = 1 never did: its
    # gap lies on the line from the plain steps' gap to the smallest K's, not at the long drafts'
    costs = MeasuredCosts(weight=1.0)
    key = CostKey("cuda_graph", "replay", 16)
    for T in range(1, 10):
        costs.record_width(key, T, verify_s=0.004 + 0.0002 * T, commit_s=0.0)
    assert costs.target_s(key, 1) == pytest.approx(0.0044)  # nothing run: the calibration
    # plain steps: 0.1 ms of glue (a K > 0 counts it in draft(K)) and a gap of 0.2 ms
    costs.observe(key, "d", 0, draft_s=0.0001, target_s=0.0042 + 0.0002)
    assert costs.target_s(key, 0) == pytest.approx(0.0042 + 0.0003)  # the whole plain step
    assert costs.target_s(key, 3) == pytest.approx(0.0048 + 0.0002)  # no K > 0 run: the plain gap
    costs.observe(key, "d", 5, draft_s=0.0, target_s=0.0052 + 0.0008)  # gap 0.8 ms at K = 5
    costs.observe(key, "d", 6, draft_s=0.0, target_s=0.0054 + 0.0007)  # 0.7 ms at K = 6
    for K in range(1, 5):
        assert costs.target_s(key, K) == pytest.approx(0.004 + 0.0002 * (K + 1) + 0.0002 + 0.0006 * K / 5)
    for K in (7, 8):  # above the largest K run: its gap (a falling or rising line is not carried on)
        assert costs.target_s(key, K) == pytest.approx(0.004 + 0.0002 * (K + 1) + 0.0007)
    costs.observe(key, "d", 1, draft_s=0.0, target_s=0.0044 + 0.0007)  # once K = 1 ran: between the K run
    assert costs.target_s(key, 3) == pytest.approx(0.0048 + 0.0007 + (0.0008 - 0.0007) * 2 / 4)
    assert costs.target_s(key, 0) == pytest.approx(0.0045) and costs.target_s(key, 5) == pytest.approx(0.006)


def test_a_first_step_far_off_weighs_as_one_of_the_first_steps():
    # the online means are plain means of their first 1 / weight values, and a step counts at most
    # OUTLIER_RATIO times the estimate it updates (the first: its calibration): one slow first step
    # (a host hiccup) does not hold a width's cost high for the steps after it
    costs, key = MeasuredCosts(weight=0.2), CostKey("cuda_graph", "replay", 16)
    costs.record_width(key, 3, verify_s=1.0, commit_s=0.0)
    for x in (1.8, 1.2, 1.2, 1.2):
        costs.observe(key, "d", 2, draft_s=0.0, target_s=x)
    assert costs.target_s(key, 2) == pytest.approx((OUTLIER_RATIO * 1.0 + 3 * 1.2) / 4)
    assert costs.measured(key, 2) == (MEASURED_STEPS <= 4)
    for _ in range(30):  # then a weighted mean: the old values fade
        costs.observe(key, "d", 2, draft_s=0.0, target_s=1.3)
    assert costs.target_s(key, 2) == pytest.approx(1.3, abs=1e-3)


def test_one_step_held_up_moves_a_cost_by_a_bounded_amount():
    """A plain step held up by the host (30x its time) counts as OUTLIER_RATIO times the mean it
    updates, first step or not; so does a proposal's time; a real rise of the costs is still
    followed within a few dozen steps. (Unbounded, one such plain step made K = 0 look slower
    than K = 1 for good, and a call kept speculating at acceptance 0: only a width that runs is
    measured again.)"""
    costs, key, d = MeasuredCosts(weight=0.2), CostKey("eager", "replay", 1), DrafterKey(False)
    for T in (1, 2):
        costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
    costs.observe(key, d, 0, draft_s=0.0, target_s=30.0)  # the very first plain step
    assert costs.target_s(key, 0) == pytest.approx(OUTLIER_RATIO * 1.0)
    costs, w = MeasuredCosts(weight=0.2), 0.2
    for T in (1, 2):
        costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
    for _ in range(10):
        costs.observe(key, d, 0, draft_s=0.0, target_s=1.0)
        costs.observe(key, d, 1, draft_s=0.1, target_s=1.02)
    costs.observe(key, d, 0, draft_s=0.0, target_s=30.0)
    costs.observe(key, d, 1, draft_s=3.0, target_s=1.02)
    assert costs.target_s(key, 0) == pytest.approx(1.0 + w * (OUTLIER_RATIO - 1.0))
    assert costs.draft_s(d, key, 1) == pytest.approx(0.1 + w * (OUTLIER_RATIO - 1.0) * 0.1)
    assert costs.step_s(key, d, 0) < costs.step_s(key, d, 1)  # plain decoding still the faster step
    for _ in range(40):  # the costs really doubled
        costs.observe(key, d, 0, draft_s=0.0, target_s=2.0)
    assert costs.target_s(key, 0) == pytest.approx(2.0, rel=0.01)


def test_a_plain_step_s_glue_and_target_are_capped_apart():
    """A plain step's time is its target part (its gap: where a never-run K > 0's gap starts) plus
    the loop's glue: each is capped against its own mean, so a stall in the glue moves neither the
    gap nor any step time below zero (capping their sum and taking the glue back out did), and a
    glue lap larger than the calibration's margin leaves the gap as it is."""
    key, d = CostKey("eager", "replay", 1), DrafterKey(False)
    costs = MeasuredCosts(weight=0.2)
    for T in (1, 2, 3):
        costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
    for _ in range(10):
        costs.observe(key, d, 0, draft_s=0.1, target_s=1.1)
    costs.observe(key, d, 0, draft_s=10.0, target_s=1.1)  # the host stalls in the glue lap
    assert costs._gap[key][0] == pytest.approx(0.1)
    assert costs.target_s(key, 0) == pytest.approx(1.2 + 0.2 * (OUTLIER_RATIO - 1.0) * 0.1)
    assert min(costs.step_times(key, d, 2)) > 0
    fresh = MeasuredCosts(weight=0.2)
    for T in (1, 2, 3):
        fresh.record_width(key, T, verify_s=1.0, commit_s=0.0)
    fresh.observe(key, d, 0, draft_s=0.6, target_s=1.0)  # a first plain step with a long glue lap
    assert fresh._gap[key][0] == pytest.approx(0.0) and fresh.target_s(key, 0) == pytest.approx(1.6)


def test_draft_time_of_a_drafter_that_does_not_draft_sequentially_is_flat():
    costs = MeasuredCosts(weight=1.0)
    key = CostKey("cuda_graph", "replay", 16)
    flat, seq = DrafterKey(False), DrafterKey(True)
    for d in (flat, seq):
        costs.observe(key, d, 1, draft_s=0.0002, target_s=0.005)
        costs.observe(key, d, 2, draft_s=0.0004, target_s=0.005)  # noise, for a drafter whose time is flat
    assert [costs.draft_s(flat, key, K) for K in (0, 1, 2, 8)] == pytest.approx([0.0, 0.0002, 0.0004, 0.0003])
    assert costs.draft_s(seq, key, 8) == pytest.approx(0.0016)  # one more forward per draft: the line


def test_step_clock_reads_each_cuda_lap_once_and_on_its_own(monkeypatch):
    """On CUDA the clock's marks are events: each lap is read once (``elapsed_time`` between the
    two events around it; overlapping windows and the totals reuse it), never as an offset from
    the first mark, whose float32 milliseconds would lose microseconds after a minute."""
    from specdec.clock import StepClock

    reads = []

    class Event:  # a stand-in for torch.cuda.Event: a recorded time in ms
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = 60_000.0 + 0.25 * len(reads_made)  # (a minute after the device's epoch)
            reads_made.append(self)

        def elapsed_time(self, other):
            reads.append((self, other))
            return other.at - self.at

    reads_made = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    clock = StepClock("cuda")
    for phase in ("draft", "verify", "rollback", "draft", "verify"):
        clock.lap(phase)
    assert clock.laps(1, 4) == [("verify", 0.25e-3), ("rollback", 0.25e-3)]
    assert clock.laps(3, 6) == [("draft", 0.25e-3), ("verify", 0.25e-3)]
    assert clock.totals() == {"wall": 1.25e-3, "draft": 0.5e-3, "verify": 0.5e-3, "rollback": 0.25e-3}
    assert len(reads) == 5 and all(b is reads_made[reads_made.index(a) + 1] for a, b in reads)  # one per lap


class _LapClock:
    """A :class:`specdec.clock.StepClock` stand-in whose laps are given: ``step(laps)`` adds one
    step's ``[(phase, seconds)]``."""

    def __init__(self):
        self.spans: list = []

    @property
    def marks(self) -> int:
        return len(self.spans) + 1

    def laps(self, start, end):
        return self.spans[start:end - 1]

    def step(self, laps):
        self.spans += laps


def _scripted_policy_run(keep_choices: bool, steps: int = 60):
    """A policy (M = 2, batch 1, measured costs) fed scripted laps (noisy: every observation moves
    the costs) and, every 7th step, new E(K) that make speculating worth it (one time in four) or not;
    ``keep_choices=False`` drops the kept choice before every step. Returns the K per step, the
    step times each choice rested on, and how often the costs were asked for them."""
    costs = MeasuredCosts(weight=0.5)
    key = CostKey("eager", "replay", 1)
    for T in (1, 2, 3):
        costs.record_width(key, T, verify_s=1.0 + 0.4 * (T - 1), commit_s=0.0)
    policy = SpeculationPolicy(PolicySettings(probe_interval=12, probe_budget=0.5), costs, key, DrafterKey(False),
                               2, 1, 500, 0.3, "cpu")
    asked, times_of = [0], policy.step_times

    def step_times():
        asked[0] += 1
        return times_of()
    policy.step_times = step_times
    clock, noise = _LapClock(), iter(torch.rand(steps, generator=torch.Generator().manual_seed(0)).tolist())
    for step in range(steps):
        if not keep_choices:
            policy._choice = None
        first = clock.marks
        K = policy.next_k()
        clock.step([("draft", 0.05 * K), ("verify", 1.0 + 0.4 * K + 0.05 * next(noise)), ("rollback", 0.0),
                    ("bookkeeping", 0.0)])
        values = None if step % 7 else ([1.0, 1.9, 2.7] if step % 28 == 7 else [1.0, 1.05, 1.08])
        policy.after_step(values, clock, first, 1)
    return policy.k_per_step, policy._predicted, asked[0]


def test_kept_choice_changes_no_decision():
    """While the values, the costs' version, the K settled on and the live rows stay as they were,
    the policy keeps its last choice's step times instead of asking the costs again: every K and
    every prediction is the one a fresh choice at each step makes, with fewer questions."""
    ks, predicted, asked = _scripted_policy_run(keep_choices=True)
    fresh_ks, fresh_predicted, fresh_asked = _scripted_policy_run(keep_choices=False)
    assert ks == fresh_ks and predicted == fresh_predicted
    assert 0 in ks and max(ks) > 0 and ks.count(0) >= 10  # (speculating, plain steps and probes between them)
    assert fresh_asked == len(ks) and asked < len(ks) * 0.7


def test_a_run_of_plain_steps_feeds_the_costs_one_step_in_so_many():
    """Of plain steps after plain ones, the first and then one in PLAIN_STEPS_PER_OBSERVATION are
    taken in (a plain step's time is steady; reading and refitting after each is host work); a
    step at K > 0 starts a new run."""
    costs = MeasuredCosts(weight=0.5)
    key = CostKey("eager", "replay", 1)
    for T in (1, 2):
        costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
    policy = SpeculationPolicy(PolicySettings(probe_interval=1000), costs, key, DrafterKey(False), 1, 1, 500, 0.0,
                               "cpu")
    script = iter([0] * 30 + [1, 1] + [0] * 12)
    policy._decide = lambda: (k := next(script), k, 0, None, policy.step_times(), 1.0)
    clock, seen = _LapClock(), []
    for step in range(44):
        first = clock.marks
        policy.next_k()
        clock.step([("draft", 0.0), ("verify", 1.0 + step), ("rollback", 0.0), ("bookkeeping", 0.0)])
        n = costs._n.get(("target", key, 0), 0)
        policy.after_step(None, clock, first, 1)  # takes in the step before
        if costs._n.get(("target", key, 0), 0) > n:
            seen.append(step - 1)
    every = PLAIN_STEPS_PER_OBSERVATION
    # step 0: the call's first (not measured); 30, 31: K = 1; 32: the switch back (leave_s); step 43: not taken in yet
    assert seen == list(range(1, 30, every)) + list(range(33, 43, every))
    assert policy.measured_step_s()[0] == pytest.approx(sum(1.0 + s for s in seen) / len(seen))


def _run_catching_up(policy, steps: int) -> None:
    """Run ``policy`` for ``steps`` steps on scripted laps of a drafter that catches up: a
    proposal takes 0.2 s and, first, 0.05 s per plain step right before it; the target 1 + 0.1 K."""
    clock = _LapClock()
    for _ in range(steps):
        first = clock.marks
        K = policy.next_k()
        caught_up = policy._plain_steps_before(len(policy.k_per_step) - 1) if K else 0
        clock.step([("draft", 0.2 + 0.05 * caught_up if K else 0.0), ("verify", 1.0 + 0.1 * K), ("rollback", 0.0),
                    ("bookkeeping", 0.0)])
        policy.after_step(None, clock, first, 1)


def test_a_drafter_that_catches_up_spaces_its_probes_by_its_catch_up():
    """A drafter that catches up (draft model, MTP layers) first runs the text of the plain steps
    since its last proposal: a probe after them measures that per plain step, beyond the
    proposal's own time at its K (once that was measured), and the probes are spaced so that the
    fixed part of a probe fits in what the catch-up leaves of ``probe_budget``, or in a quarter of
    the budget where the catch-up takes more: probes still come."""
    costs = MeasuredCosts(weight=1.0)
    key = CostKey("eager", "replay", 1)
    for T in (1, 2, 3):
        costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
    drafter = DrafterKey(True)
    policy = SpeculationPolicy(PolicySettings(probe_interval=2, probe_budget=0.1), costs, key, drafter, 2, 1, 500,
                               0.0, "cpu")
    # 5 plain steps before the probe at step 17: CATCH_UP_MIN_PLAIN_STEPS or more; 3 before step 21: fewer
    script = iter([0] * 10 + [2, 2] + [0] * 5 + [2] + [0] * 3 + [2, 0])
    policy._decide = lambda: (next(script), 0, 0, None, policy.step_times(), 1.0)
    _run_catching_up(policy, 23)
    # step 11 measured the proposal at K = 2 (0.2 s); the probe at step 17 ran 5 plain steps' text
    # first; the one at step 21, after 3, is not taken in (its figure per step would be mostly noise)
    assert 3 < CATCH_UP_MIN_PLAIN_STEPS <= 5
    assert costs.draft_s(drafter, key, 2) == pytest.approx(0.2)
    assert costs.catch_up_s(key, drafter) == pytest.approx(0.05) and costs._n[("catch_up", drafter, "eager", 1)] == 1
    assert costs.catch_up_s(key, DrafterKey(True)) == 0.0  # (per drafter)
    times = policy.step_times()
    assert times[0] == pytest.approx(1.0) and times[2] == pytest.approx(1.4) and costs.leave_s(key) == 0.0
    assert policy.probe_every(times, 2) == math.ceil(0.4 / (0.1 - 0.05))  # 8; 4 without the catch-up
    costs.observe_catch_up(key, drafter, 2, 0.2 + 0.2 * 4, 4)  # 0.2 a plain step: capped against the mean
    assert costs.catch_up_s(key, drafter) == pytest.approx(OUTLIER_RATIO * 0.05)
    for _ in range(3):
        costs.observe_catch_up(key, drafter, 2, 0.2 + 0.2 * 4, 4)
    assert costs.catch_up_s(key, drafter) > 0.075  # more than three quarters of the budget: a quarter is kept
    assert policy.probe_every(times, 2) == math.ceil(0.4 / 0.025)
    costs.observe_catch_up(key, DrafterKey(True), 1, 5.0, 4)  # a drafter whose proposal was never
    assert costs.catch_up_s(key, DrafterKey(True)) == 0.0     # measured alone: nothing taken in


def test_a_probe_of_a_drafter_that_catches_up_runs_twice_until_its_proposal_is_measured():
    """The first step of a probe of a drafter that catches up pays the catch-up on the plain
    steps' text in its proposal, so it cannot measure the proposal at its K alone: while the
    costs have not, the probe runs a second step at that K, which measures it; later probes run
    one step, and measure the catch-up."""
    costs = MeasuredCosts(weight=1.0)
    key = CostKey("eager", "replay", 1)
    for T in (1, 2, 3):
        costs.record_width(key, T, verify_s=1.0 + 0.1 * (T - 1), commit_s=0.0)
    policy = SpeculationPolicy(PolicySettings(probe_interval=5, probe_budget=1.0), costs, key, DrafterKey(True), 2, 1,
                               500, 0.0, "cpu")  # (acceptance 0: only probes speculate)
    _run_catching_up(policy, 40)
    ks = policy.k_per_step
    runs = [(i, k) for i, k in enumerate(ks) if k and (i == 0 or not ks[i - 1])]  # (start, K) of each probe
    lengths = [next(j for j in range(i, len(ks)) if not ks[j]) - i if 0 in ks[i:] else len(ks) - i for i, _ in runs]
    assert len(runs) >= 4 and lengths[0] == 2 and set(lengths[1:-1]) == {1}, (ks, lengths)
    assert costs.draft_measured(policy.drafter_key, key)
    assert costs.catch_up_s(key, policy.drafter_key) == pytest.approx(0.05)


def test_switch_to_plain_steps_is_counted_apart(monkeypatch):
    """The policy feeds the costs with each step's laps: a step at K = 0 counts whole (its draft
    lap is the loop's own work), the first step at each K is not counted (compiles), and the first
    plain step after speculative ones (replay: it first folds the input history) is the switch's
    extra time, not a plain step's: counted there, each probe would make plain decoding look
    slower for the steps after it. Probes are spaced by their cost with that switch included."""
    costs = MeasuredCosts(weight=0.5)
    key = CostKey("eager", "replay", 2)
    costs.record_width(key, 1, verify_s=1.0, commit_s=0.0)
    costs.record_width(key, 2, verify_s=1.5, commit_s=0.1)
    costs.record_width(key, 3, verify_s=2.0, commit_s=0.1)
    order = [0, 0, 1, 1, 0, 0, 0]
    script = iter(order)
    policy = SpeculationPolicy(PolicySettings(probe_interval=2, probe_budget=0.1, hysteresis_sum=math.inf),
                               costs, key, DrafterKey(False), 2, 2, 100, 0.0, "cpu")  # (acceptance 0: a probe
    # is expected to commit what a plain step does, so its whole extra time counts)
    monkeypatch.setattr(policy, "_decide", lambda: (k := next(script), k, 0, None, policy.step_times(), 1.0))
    plain = [("draft", 0.2), ("verify", 1.0), ("rollback", 0.0), ("bookkeeping", 0.0)]
    spec = [("draft", 0.3), ("verify", 1.4), ("rollback", 0.2), ("bookkeeping", 0.0)]
    flush = [("draft", 0.2), ("verify", 3.2), ("rollback", 0.0), ("bookkeeping", 0.0)]
    clock = _LapClock()
    for laps in (plain, plain, spec, spec, flush, plain, plain):
        first = clock.marks
        policy.next_k()
        clock.step(laps)
        policy.after_step(None, clock, first, 2)  # counts the step before
    assert policy.k_per_step == order
    assert costs.target_s(key, 0) == pytest.approx(1.2)  # two plain steps, the flush's not among them
    assert costs.leave_s(key) == pytest.approx(3.4 - 1.2)
    assert costs.draft_s(policy.drafter_key, key, 1) == pytest.approx(0.3)
    assert costs.target_s(key, 1) == pytest.approx(1.6)
    times = policy.step_times()
    assert times[:2] == pytest.approx([1.2, 1.9])
    assert policy.probe_every(times) == math.ceil((1.9 - 1.2 + 2.2) / 1.2 / 0.1)  # 25, not 6
    assert FixedCosts(lambda s, b, K: 1.0).leave_s(key) == 0.0  # given costs: no switch cost


def test_a_step_that_warms_up_a_program_measures_nothing(monkeypatch):
    """A step during which a program warmed up or was captured (the loop calls
    ``policy.unmeasured()``) feeds no cost: its laps would give the capture's time, not the
    width's. Here the second plain step (a capture, 10 s) is left out and plain steps cost what
    the others took."""
    costs = MeasuredCosts(weight=0.5)
    key = CostKey("eager", "replay", 2)
    for T in (1, 2):
        costs.record_width(key, T, verify_s=1.0, commit_s=0.0)
    script = iter([0] * 5)
    monkeypatch.setattr(specdec.adaptive, "choose_k", lambda *a: next(script))
    policy = SpeculationPolicy(PolicySettings(probe_interval=100, hysteresis_sum=math.inf), costs, key,
                               DrafterKey(False), 1, 2, 100, 0.6, "cpu")
    clock = _LapClock()
    for i in range(5):
        first = clock.marks
        policy.next_k()
        clock.step([("draft", 0.1), ("verify", 10.0 if i == 1 else 1.0)])
        if i == 1:
            policy.unmeasured()
        policy.after_step(None, clock, first, 2)
    assert costs.target_s(key, 0) == pytest.approx(1.1)  # steps 3 and 4 (the first is a warm-up, the last pending)
    assert policy.measured_step_s()[0] == pytest.approx(1.1)


def test_warmups_run_counts_a_programs_warm_up_and_capture_only():
    """:func:`specdec.graphs.warmups_run` grows by one for each call of a capturing program that is
    not a replay (its eager warm-up, its capture attempt), and not for a program that never
    captures (the static path) or whose capture failed (eager from then on); and by one for every
    other capture (:func:`specdec.graphs.capture`: a decoder's widths, prompt buckets)."""
    from specdec.graphs import CaptureFailure, CapturedProgram, capture, warmups_run

    before = warmups_run()
    static = CapturedProgram(lambda: None, model=None, what="a static program", graphs=False)
    for _ in range(3):
        static()
    assert warmups_run() == before
    capturing = CapturedProgram(lambda: None, model=None, what="a capturing program", graphs=True)
    capturing()  # the warm-up
    assert warmups_run() == before + 1
    with pytest.warns(RuntimeWarning):
        capturing()  # the capture: refused on a CPU, so eager from now on
    assert warmups_run() == before + 2 and capturing.error is not None
    capturing()
    assert warmups_run() == before + 2
    with pytest.raises(CaptureFailure):  # (refused on a CPU)
        capture(lambda: None, model=None, what="a decoder's width")
    assert warmups_run() == before + 3


def test_one_measured_k_extrapolates_by_how_the_drafter_drafts():
    """From one measured K, a sequential drafter's proposal time grows in proportion to K; a
    one-pass drafter's (n-gram, Medusa, oracle) stays the same, as the engine's keys say."""
    costs = MeasuredCosts()
    key = CostKey("eager", "replay", 4)
    for sequential in (True, False):
        d = DrafterKey(sequential)
        costs.observe(key, d, 1, draft_s=0.002, target_s=0.02)
        assert costs.draft_s(d, key, 4) == pytest.approx(0.008 if sequential else 0.002)
    assert DraftModelDrafter.drafts_sequentially and MTPDrafter.drafts_sequentially
    assert not (NGramDrafter.drafts_sequentially or MedusaDrafter.drafts_sequentially
                or OracleDrafter.drafts_sequentially)
    sd = specdec.wrap(get_model("qwen3_5"), drafter="ngram", num_speculative_tokens="auto")
    assert sd._drafter_key.sequential is False
    sd.drafter = make_drafter("perturbed", "qwen3_5")
    assert sd._drafter_key.sequential is True


def test_choose_strategy_rules():
    expected = [1.0, 1.6, 2.0]
    times = {"snapshot": {0: 1.0, 1: 1.1, 2: 1.2}, "ring": {0: 1.0, 1: 1.3, 2: 1.1}, "replay": {0: 1.0, 1: 1.2,
                                                                                                 2: 1.5}}
    best = max(times, key=lambda n: max(expected[k] / t for k, t in times[n].items()))
    choice = choose_strategy(times, expected, None, {}, None)
    assert choice.name == best == "ring" and choice.K == 2 and "best predicted goodput" in choice.reason
    fixed = choose_strategy(times, expected, 1, {}, None)
    assert fixed.name == min(times, key=lambda n: times[n][1]) and "lowest measured step time at K=1" in fixed.reason
    sizes = {"snapshot": 300 * 2**20, "ring": 500 * 2**20, "replay": 100 * 2**20}
    fit = choose_strategy(times, expected, None, sizes, 400 * 2**20, {"extra": "out of memory while measuring it"})
    assert fit.name == "snapshot" and "ring left out" in fit.reason and "over the budget of 400.0 MiB" in fit.reason
    assert "extra left out: out of memory" in fit.reason
    with pytest.raises(ValueError, match="no rollback strategy could be measured within the memory budget"):
        choose_strategy(times, expected, None, sizes, 2**20)


def test_rollback_bytes_are_per_step_width():
    """Rollback buffers grow with the tokens a step takes (snapshot keeps a state per draft): a
    budget that every strategy fits at K = 1 still lets rollback="auto" choose at K = 1 after a
    generator of the same model sized for K = 8 ran (the bytes it measured are not K = 1's)."""
    model = make_model("qwen3_next", seed=11)  # a model of its own: its costs start empty
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    small = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens="auto", max_speculative_tokens=1)
    small.generate(ids, max_new_tokens=4, pad_token_id=0)
    costs = small.cost_model
    at_1 = {n: costs.rollback_bytes(CostKey("eager", n, 2), 2) for n in STRATEGIES}
    wide = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens="auto", max_speculative_tokens=8)
    wide.generate(ids, max_new_tokens=4, pad_token_id=0)
    at_8 = {n: costs.rollback_bytes(CostKey("eager", n, 2), 9) for n in STRATEGIES}
    assert at_8["snapshot"] > at_1["snapshot"] == costs.rollback_bytes(CostKey("eager", "snapshot", 2), 2)
    again = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens="auto",
                         max_speculative_tokens=1, policy=PolicySettings(memory_budget_bytes=max(at_1.values())))
    assert torch.equal(again.generate(ids, max_new_tokens=4, pad_token_id=0), ref)
    assert "over the budget" not in again.last_stats.rollback_reason
    # the other order: K = 8 first, then a K = 1 call under a budget measures its own width's bytes
    # on a decoder that stepped (a prefill alone leaves replay's input history unallocated)
    other = make_model("qwen3_next", seed=13)
    specdec.wrap(other, drafter="ngram", rollback="auto", num_speculative_tokens="auto",
                 max_speculative_tokens=8).generate(ids, max_new_tokens=4, pad_token_id=0)
    narrow = specdec.wrap(other, drafter="ngram", rollback="auto", num_speculative_tokens="auto",
                          max_speculative_tokens=1, policy=PolicySettings(memory_budget_bytes=2**30))
    narrow.generate(ids, max_new_tokens=4, pad_token_id=0)
    assert {n: narrow.cost_model.rollback_bytes(CostKey("eager", n, 2), 2) for n in STRATEGIES} == at_1


def test_a_call_without_draft_steps_does_not_fix_the_strategy():
    """rollback="auto" decides once per shape; a call of one new token (a warm-up) has no step that
    can use a draft, so it compares plain steps only and its choice is not kept for the shape."""
    model = make_model("qwen3_next", seed=12)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    prefer = {"snapshot": 1.0, "ring": 1.01, "replay": 1.02}  # at K = 0 snapshot; with drafts ring

    def cost(strategy, batch, K):
        return prefer[strategy] + (0.1 if strategy == "ring" else 0.5) * K

    sd = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens="auto",
                      max_speculative_tokens=3, cost_model=FixedCosts(cost))
    sd.generate(ids, max_new_tokens=1, pad_token_id=0)
    sd.generate(ids, max_new_tokens=12, pad_token_id=0)
    assert sd.last_stats.rollback == "ring", sd.last_stats.rollback_reason


# ------------------------------------------------------------------------------ measuring


def test_measured_costs_are_kept_per_model_and_batch():
    """The first call measures every step width (and every strategy for rollback="auto"); a second
    call of the same batch size measures nothing; another batch size measures again."""
    model = make_model("nemotron_h", seed=7)  # a model of its own: no other test measured it
    costs = costs_for(model, "cpu", torch.float32)
    assert costs is costs_for(model, "cpu", torch.float32)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    sd = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens="auto",
                      max_speculative_tokens=3)
    sd.generate(ids, max_new_tokens=6, pad_token_id=0)
    assert sd.last_stats.calibration_s > 0
    for name in STRATEGIES:
        key = CostKey("eager", name, 2)
        assert costs.needs_widths(key, [1, 2, 3, 4]) == [] and costs.rollback_bytes(key, 4) > 0
    assert costs.needs_widths(CostKey("eager", "replay", 1), [1]) == [1]
    # a fixed K with rollback="auto" compares the strategies at that K
    sd = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens=2)
    sd.generate(ids, max_new_tokens=6, pad_token_id=0)
    assert "lowest measured step time at K=2" in sd.last_stats.rollback_reason
    assert sd.last_stats.k_histogram == [0, 0, sd.last_stats.steps]




def test_auto_strategy_and_decoder_are_kept_for_later_calls(monkeypatch):
    """rollback="auto" decides once per shape: later calls keep the strategy and the static
    decoder (with its graphs on CUDA), even when the observed step costs would now rank the
    strategies otherwise; every step width 1..K+1 is prepared (captured, on CUDA) before the
    first decode step, so no capture falls inside a step."""
    import specdec.decoding as decoding

    events = []
    real_prepare, real_forward = decoding.StaticDecoder.prepare, decoding.StaticDecoder.forward
    monkeypatch.setattr(decoding.StaticDecoder, "prepare",
                        lambda self, widths: events.append(("prepare", self, list(widths))) or
                        real_prepare(self, widths))
    monkeypatch.setattr(decoding.StaticDecoder, "forward",
                        lambda self, tokens, plain=False: events.append(("forward", self, tokens.shape[1])) or
                        real_forward(self, tokens, plain))
    model = make_model("qwen3_5", seed=11)  # a model of its own: no other test measured it
    ids, mask, eos, _ = reference("qwen3_5")
    kw = dict(attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    ref = model.generate(ids, do_sample=False, **kw)
    sd = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens="auto",
                      max_speculative_tokens=3, decode_path="static")
    out = sd.generate(ids, **kw)
    assert torch.equal(out, ref)
    decoder, strategy = sd.decoder, sd.strategy
    mine = [e for e in events if e[1] is decoder]  # (a decoder measured for the choice may be kept)
    at = mine.index(("prepare", decoder, [1, 2, 3, 4]))
    assert all(kind == "forward" for kind, _, _ in mine[at + 1:])
    assert len(mine) - at - 1 == sd.last_stats.steps  # every step came after it
    # the costs the next call would see: the strategy that ran is now far slower than the others
    for K in range(4):
        sd.cost_model.observe(CostKey("static", strategy.name, ids.shape[0]), object(), K, 0.0, 1e3)
    events.clear()
    assert torch.equal(sd.generate(ids, **kw), ref)
    assert sd.decoder is decoder and sd.strategy is strategy
    assert [e for e in events if e[1] is not decoder] == []  # nothing measured or built again


def test_static_decoder_prepare_captures_only_missing_widths(monkeypatch):
    """StaticDecoder.prepare captures each width it lacks once (a width of one token as the plain
    step where the strategy has plain steps), and nothing without CUDA graphs or after a failed
    capture."""
    import specdec.decoding as decoding

    adapter = specdec.wrap(get_model("qwen3_5"), num_speculative_tokens=0).adapter
    captured = []

    def fake_capture(self, t, plain):
        captured.append((t, plain))
        self._graphs[t, plain] = object()

    monkeypatch.setattr(decoding.StaticDecoder, "_capture", fake_capture)
    for name, plain in (("ring", False), ("replay", True), ("snapshot", True)):
        strategy = specdec.rollback.make_strategy(name)
        dec = decoding.StaticDecoder(adapter, strategy, 2, 4, 64, cuda_graphs=True)
        dec._graphs[4, False] = object()
        captured.clear()
        dec.prepare([1, 2, 3, 4])
        dec.prepare([2, 3])
        assert captured == [(1, plain), (2, False), (3, False)], name
    for flag in ("cuda_graphs", "_capture_failed"):
        other = decoding.StaticDecoder(adapter, strategy, 2, 4, 64, cuda_graphs=flag != "cuda_graphs")
        other._capture_failed = flag == "_capture_failed"
        captured.clear()
        other.prepare([1, 2])
        assert captured == []

@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton_interpreter)])
@pytest.mark.parametrize("strategy", ["snapshot", "replay"])
def test_calibration_leaves_states_and_conv_histories_as_they_were(strategy, backend, monkeypatch):
    """Calibrating runs steps of placeholder tokens on the call's own prefilled cache, the plain
    step included (which commits its SSM state and conv history as it runs): afterwards every SSM
    layer's committed state and conv history are the prefill's, bit for bit."""
    from specdec import decoding
    from specdec.adaptive import calibrate

    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    model = get_model("nemotron_h", "small")
    adapter = specdec.wrap(model, num_speculative_tokens=0).adapter
    dec = decoding.EagerDecoder(adapter, specdec.rollback.make_strategy(strategy), 2, 3, 40)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    dec.prefill(ids, torch.ones_like(ids))
    layers = [layer for layer in dec.cache.ssm.values() if layer.conv_window is not None]
    assert layers and all(layer.has_recurrence for layer in layers)
    before = [(layer.ssm_state().clone(), layer.conv_state().clone()) for layer in layers]
    calibrate(dec, [1, 2, 3], repeats=1)
    for layer, (state, conv) in zip(layers, before):
        assert torch.equal(layer.ssm_state(), state), f"layer {layer.layer}: state moved"
        assert torch.equal(layer.conv_state(), conv), f"layer {layer.layer}: conv history moved"


def test_memory_budget_leaves_strategies_out():
    model = make_model("qwen3_next", seed=7)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    sd = specdec.wrap(model, drafter="ngram", rollback="auto", num_speculative_tokens=3)
    sd.generate(ids, max_new_tokens=4, pad_token_id=0)
    costs = sd.cost_model
    sizes = {n: costs.rollback_bytes(CostKey("eager", n, 2), 4) for n in STRATEGIES}  # (K = 3: 4 tokens a step)
    smallest = min(sizes, key=sizes.get)
    sd.policy = PolicySettings(memory_budget_bytes=sizes[smallest])
    out = sd.generate(ids, max_new_tokens=4, pad_token_id=0)
    assert sd.last_stats.rollback == smallest, sizes
    assert sum("over the budget" in part for part in sd.last_stats.rollback_reason.split("; ")) == sum(
        size > sizes[smallest] for size in sizes.values())
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))


# ------------------------------------------------------------------------------ bad settings


def test_bad_adaptive_settings_fail_clearly():
    model = get_model("qwen3_5")
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match=r"max_speculative_tokens must be in \[1, 64\]"):
            specdec.wrap(model, num_speculative_tokens="auto", max_speculative_tokens=bad)
    with pytest.raises(TypeError, match="max_speculative_tokens must be an int"):
        specdec.wrap(model, num_speculative_tokens="auto", max_speculative_tokens=2.0)
    with pytest.raises(ValueError, match="an int in \\[0, 64\\] or 'auto', got 'fast'"):
        specdec.wrap(model, num_speculative_tokens="fast")
    with pytest.raises(ValueError, match="unknown rollback strategy 'fastest'"):
        specdec.wrap(model, rollback="fastest")
    with pytest.raises(TypeError, match="cost_model must be a specdec.adaptive.CostModel"):
        specdec.wrap(model, num_speculative_tokens="auto", cost_model={"K": 1})
    with pytest.raises(TypeError, match="policy must be a specdec.adaptive.PolicySettings"):
        specdec.wrap(model, num_speculative_tokens="auto", policy={"hysteresis": 0.1})
    for field, value in (("hysteresis", -0.1), ("hysteresis_sum", -0.5), ("min_gain", -0.01), ("probe_budget", 0.0),
                         ("probe_interval", 0), ("acceptance_weight", 0.0), ("measure_neighbours", 1),
                         ("prior_acceptance", 1.5), ("memory_budget_bytes", -1), ("acceptance_batch", 0),
                         ("probe_budget", "0.5"), ("hysteresis", "0.1"), ("prior_acceptance", "0.6"),
                         ("min_gain", "0.05"), ("acceptance_weight", True)):  # (numbers as strings, as float() takes)
        with pytest.raises(ValueError, match=f"PolicySettings.{field} must be"):
            PolicySettings(**{field: value})
    tree = MedusaDrafter(MedusaHeads.from_target(model, num_heads=2), tree="default")
    with pytest.raises(ValueError, match="chooses a chain length per step.*drafts a tree"):
        specdec.wrap(model, drafter=tree, num_speculative_tokens="auto")
    sd = specdec.wrap(model, drafter=tree, num_speculative_tokens=2)  # a fixed K is fine, then "auto" is refused
    with pytest.raises(ValueError, match="drafts a tree"):
        sd.num_speculative_tokens = "auto"
    sd = specdec.wrap(model, num_speculative_tokens="auto", cost_model=FixedCosts(lambda s, b, K: 0.0))
    ids, mask, _, _ = reference("qwen3_5")
    with pytest.raises(ValueError, match="FixedCosts: step time at K=0 .* must be a finite number > 0"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    for bad in ("x", None, 10 ** 400):  # not a (float) number: the same error, naming what came back
        sd.cost_model = FixedCosts(lambda s, b, K, bad=bad: bad)
        with pytest.raises(ValueError, match=f"FixedCosts: step time at K=0 .* must be a finite number > 0 .*got {type(bad).__name__}"):
            sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="acceptance schedule needs prompt_attention_mask"):
        OracleDrafter(ids, acceptance=[0.5, 0.9])
    with pytest.raises(ValueError, match="acceptance must be in"):
        OracleDrafter(ids, mask, acceptance=[0.5, 1.2])


@pytest.mark.parametrize("path", ["static", pytest.param("cuda_graph", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_auto_mtp_on_the_static_path_exact(family, path):
    """MTP layers with K chosen per step on the static decode path: each K proposed runs its own
    fixed-shape program on one MTP cache, and the entries of plain steps are run first (more of
    them than a program takes: by the catch-up program). Each width in ORDER, up to the most
    drafts, after a first step at a smaller one; then, at most 2 drafts, runs of 6 and 7 plain
    steps. The output equals plain greedy decoding's (on CUDA: the programs captured and replayed)."""
    from test_generate_batch_drafters import mtp_target
    from tiny_models import ragged_prompts

    dev = "cuda" if path == "cuda_graph" else "cpu"
    target, layers = mtp_target(family, dev)
    ids, mask = (t.to(dev) for t in ragged_prompts(batch=2))
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    for max_k, order in ((8, ORDER), (2, [0] * 6 + [2] + [0] * 7 + [1, 2])):
        drafter = MTPDrafter(target, layers)
        sd = specdec.wrap(target, drafter=drafter, num_speculative_tokens="auto", max_speculative_tokens=max_k,
                          decode_path=path, cost_model=ScriptedCosts(order))
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0)
        assert torch.equal(out, ref), max_k
        ks = sd.last_stats.k_per_step
        assert len({K for K in ks if K}) >= min(3, max_k) and drafter.last_path == path, (max_k, ks)
        st = drafter._static
        assert sorted(st.programs) == sorted({K for K in ks if K}) and all(p.calls for p in st.programs.values())
        if max_k == 2:
            assert ks[:8] == [0] * 6 + [2, 0] and st.catch_up is not None and st.catch_up.calls >= 4, ks
            if path == "cuda_graph":
                assert st.catch_up.graph is not None and st.catch_up.error is None


def test_no_live_row_keeps_the_current_k():
    """E(K) is 0 at every K when no row is live (a pool whose rows all ended, about to refill):
    nothing to choose by, so the current K stands (a tie would otherwise pick K = 0)."""
    times = [1.0, 1.3, 1.6]
    assert choose_k([0.0, 0.0, 0.0], times, 2, 0.05) == 2
    assert choose_k([0.0, 0.0, 0.0], times, None, 0.05) == 0
    assert choose_k([4.0, 8.0, 12.0], times, 0, 0.05) == 2  # (with live rows, the best)


def test_refilled_rows_start_from_what_the_drafter_showed():
    """Continuous batching with auto: a row that takes a new request starts from the mean of the
    rows' estimates (the drafter's acceptance on this workload), not from the prior again, so
    with every draft right a second call runs the widest K although each request lives a few
    steps (from the prior of 0.6 it stayed at K = 1); with every draft wrong it runs plain steps."""
    model = get_model("nemotron_h")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (24,), generator=g)]
    full = [p + model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    hist = {}
    for acceptance in (0.0, 1.0):
        sd = specdec.wrap(model, drafter=OracleDrafter.for_requests(full, acceptance=acceptance),
                          num_speculative_tokens="auto", rollback="replay", max_speculative_tokens=4,
                          cost_model=FixedCosts(lambda strategy, batch, K: 1.0 + 0.3 * K))
        for _ in range(2):  # (the second call starts from what the first showed)
            out = sd.generate_batch(prompts, max_new_tokens=12, max_batch_size=4)
            assert all(out[f"req_{i}"].generated_tokens == full[i][len(prompts[i]):] for i in range(len(prompts)))
        hist[acceptance] = sd.last_stats.k_histogram
    assert hist[1.0][4] > sum(hist[1.0][1:4]), hist
    assert hist[0.0][0] > 2 * sum(hist[0.0][1:]), hist
    policy = SpeculationPolicy(PolicySettings(), FixedCosts(lambda s, b, K: 1.0 + K), CostKey("eager", "replay", 3),
                               None, 2, 3, 10, 0.6, "cpu")
    policy.acceptance.rates.copy_(torch.tensor([[0.9, 0.8], [0.7, 0.6], [0.2, 0.1]]))
    policy.restart_rows(torch.tensor([2]))
    assert policy.acceptance.rates[2].tolist() == pytest.approx([0.6, 0.5])


class _ScriptedDrafts(Drafter):
    """A stateless drafter proposing given ``drafts [B, K]`` / ``counts [B]`` whatever the text."""

    stateless = True

    def __init__(self, drafts, counts):
        self.drafts, self.counts = drafts, counts

    def propose(self, input_ids, lengths, num_speculative_tokens):
        return self.drafts[:, :num_speculative_tokens].clone(), self.counts.clone()


def test_shadow_proposals_observe_the_drafts_a_step_would_have_accepted():
    """A run of plain steps makes a shadow proposal at its step SHADOW_OFFSET and at every
    SHADOW_EVERY-th after; the next one observes, per row, the longest prefix of its drafts that
    the plain steps between committed, within the drafter's counts and the row's draft budget,
    and only for rows that committed every position it checks. A speculative step drops the
    shadow pending. No shadow falls on a run's first step (the switch's cost) or right before a
    step whose time the costs take."""
    from specdec.adaptive import PLAIN_STEPS_PER_OBSERVATION
    from specdec.engine import SHADOW_EVERY, SHADOW_OFFSET, _ShadowProposals
    E = SHADOW_EVERY
    assert E >= 3

    def first_shadow(shadows):  # a run's plain steps up to its first shadow
        for _ in range(SHADOW_OFFSET):
            assert not shadows.due(0)
        assert shadows.due(0)

    probe = _ShadowProposals(_ScriptedDrafts(torch.zeros(1, E, dtype=torch.long), torch.ones(1, dtype=torch.long)),
                             1, "cpu", depth=E)
    made = [probe.due(0) for _ in range(8 * PLAIN_STEPS_PER_OBSERVATION)]
    sampled = [i for i in range(1, len(made)) if (i - 1) % PLAIN_STEPS_PER_OBSERVATION == 0]
    assert not made[0] and sum(made) == len(made) // E and not any(made[i - 1] for i in sampled), made
    g = torch.Generator().manual_seed(0)
    B, W, L = 6, 32, 10
    text = torch.randint(5, 50, (B, W), generator=g)
    lengths = torch.full((B,), L)
    committed = torch.randint(5, 50, (B, E), generator=g)  # what the next E plain steps commit
    drafts = committed.clone()
    drafts[1, 2] = committed[1, 2] + 1  # row 1: the first two drafts hold, the third not
    drafts[2] = committed[2] + 1  # row 2: none holds
    counts = torch.tensor([E, E, E, 1, E, E])  # row 3: one draft only (its second would hold)
    budget = torch.tensor([9, 9, 9, 9, 2, 9])  # row 4: two drafts left in its budget
    shadows = _ShadowProposals(_ScriptedDrafts(drafts, counts), B, "cpu", depth=8)
    assert shadows.depth == E  # (asked for at most the drafts the plain steps between commit)
    first_shadow(shadows)
    assert shadows.make(text, W, lengths, budget) is None  # (nothing pending yet)
    for i in range(E):  # the shadow's own step and the E - 1 after it commit one token each; row 5 ends at once
        assert i == 0 or not shadows.due(0)
        live = torch.arange(B) != 5 if i else torch.ones(B, dtype=torch.bool)
        text[live, lengths[live]] = committed[live, i]
        lengths = lengths + live.long()
    assert shadows.due(0)
    n, asked, ran = shadows.make(text, W, lengths, budget)
    assert asked.tolist() == [E, E, E, E, 2, E]
    assert ran.tolist() == [True] * 5 + [False]
    assert n[:5].tolist() == [E, 2, 0, 1, 2]
    assert (n <= asked).all()
    # a speculative step ends the run: the shadow made above is dropped, the next run starts afresh
    assert not shadows.due(3)
    first_shadow(shadows)
    assert shadows.make(text, W, lengths, budget) is None
    assert _ShadowProposals(_ScriptedDrafts(drafts, counts), B, "cpu", depth=2).depth == 2  # (the policy's K)

    class _Narrow(_ScriptedDrafts):  # one column whatever is asked, and it writes into what it is given
        def propose(self, input_ids, lengths, num_speculative_tokens):
            input_ids.zero_()
            lengths -= 1
            return self.drafts[:, :1].clone(), self.counts.clamp(max=1)

    shadows = _ShadowProposals(_Narrow(committed, counts), B, "cpu", depth=E)
    kept_text, kept_lengths = text.clone(), lengths.clone()
    first_shadow(shadows)
    assert shadows.make(text, W, lengths, budget) is None
    assert torch.equal(text, kept_text) and torch.equal(lengths, kept_lengths)  # (it was given copies)
    for i in range(E):
        assert i == 0 or not shadows.due(0)
        text[torch.arange(B), lengths] = committed[:, i]
        lengths = lengths + 1
    assert shadows.due(0)
    n, asked, ran = shadows.make(text, W, lengths, budget)
    # the positions past its one column were not proposed: observed as a rejection, as a step would
    assert n.tolist() == [1] * B and asked.tolist() == [E, E, E, E, 2, E] and ran.all()


def test_shadow_steps_and_the_steps_after_them_feed_no_cost(monkeypatch):
    """A step that makes a shadow proposal, and the step after it (where the host work the shadow
    left after its last lap lands), are unmeasured (:meth:`SpeculationPolicy.unmeasured`): the
    costs' samples of plain steps move past them. No shadow falls on a run's first plain step,
    the switch's cost. On the zoo model's first prompt, whose greedy text starts repeating."""
    from specdec import zoo
    from specdec.engine import SHADOW_OFFSET, _ShadowProposals

    assert SHADOW_OFFSET >= 1
    events = []
    due, unmeasured = _ShadowProposals.due, SpeculationPolicy.unmeasured
    policies = []

    def spy_due(self, K):
        made = due(self, K)
        events.append(("step", K, made))
        return made

    def spy_unmeasured(self):
        policies.append(self)
        events.append(("unmeasured",))
        return unmeasured(self)

    monkeypatch.setattr(_ShadowProposals, "due", spy_due)
    monkeypatch.setattr(SpeculationPolicy, "unmeasured", spy_unmeasured)
    monkeypatch.setenv("SPECDEC_SHADOW_PROPOSALS", "1")
    model, tok = zoo.load("gdn-target")
    enc = tok([zoo.prompts(limit=1)[0]["prompt"]], return_tensors="pt")
    costs_ms = [0.265, 0.344, 0.377, 0.407, 0.367, 0.402, 0.417, 0.415, 0.419]  # (as the test below)
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens="auto", rollback="replay", decode_path="eager",
                      max_speculative_tokens=8, cost_model=FixedCosts(lambda s, b, K: costs_ms[K] * 1e-3))
    sd.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=96, do_sample=False)
    steps, marked = [], set()
    for e in events:
        if e[0] == "step":
            steps.append(e[1:])
        else:
            marked.add(len(steps) - 1)
    shadows = [i for i, (K, made) in enumerate(steps) if made]
    assert shadows and {i + d for i in shadows for d in (0, 1) if i + d < len(steps)} <= marked
    assert not any(K == 0 and i > 0 and steps[i - 1][0] > 0 for i, (K, _) in enumerate(steps) if i in shadows)
    ran = sd.last_stats.k_per_step  # (a step launched past the call's end is dropped)
    assert [K for K, _ in steps][:len(ran)] == ran and len(steps) - len(ran) in (0, 1)


@pytest.mark.parametrize("path", ["eager", "static"])
def test_shadow_proposals_resume_speculation_when_the_text_starts_repeating(monkeypatch, path):
    """The zoo model's first prompt: its greedy text finds no n-gram match for its first ~35
    tokens and then repeats. K chosen per step (at an H100's step costs) starts at the prior,
    stops speculating in the first part, and with shadow proposals at plain steps resumes where
    the repetition starts, where without them it waits for probes: fewer plain steps and steps in
    all, the same tokens (HF greedy's), on both paths."""
    from specdec import zoo
    model, tok = zoo.load("gdn-target")
    enc = tok([zoo.prompts(limit=1)[0]["prompt"]], return_tensors="pt")
    want = model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=128, do_sample=False)
    costs_ms = [0.265, 0.344, 0.377, 0.407, 0.367, 0.402, 0.417, 0.415, 0.419]  # (H100, the zoo's bench record)
    stats = {}
    for shadows in ("1", "0"):
        monkeypatch.setenv("SPECDEC_SHADOW_PROPOSALS", shadows)
        sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens="auto", rollback="replay", decode_path=path,
                          max_speculative_tokens=8, cost_model=FixedCosts(lambda s, b, K: costs_ms[K] * 1e-3))
        out = sd.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=128, do_sample=False)
        assert torch.equal(out, want)
        stats[shadows] = sd.last_stats
    on, off = stats["1"], stats["0"]
    assert on.k_histogram[0] < off.k_histogram[0] and on.steps < off.steps, (on.k_per_step, off.k_per_step)


def test_shadowed_plain_steps_run_no_probe_and_measure_no_neighbour():
    """With shadow proposals (:attr:`SpeculationPolicy.shadowed`) a policy settled on K = 0 runs
    plain steps only: no probes, and no width next to K = 0 to measure (whose cost, not measured,
    would otherwise make every step a step at K = 1); unshadowed, the same policy probes."""
    class _Unmeasured(FixedCosts):
        def measured(self, key, K):
            return K == 0

    for shadowed in (True, False):
        policy = SpeculationPolicy(PolicySettings(), _Unmeasured(lambda s, b, K: 1.0 + 0.3 * K),
                                   CostKey("eager", "replay", 1), None, 3, 1, 1000, 0.6, "cpu")
        policy.shadowed = shadowed
        policy.expected = [1.0, 1.27, 1.3, 1.35]  # (K = 1 within the hysteresis of K = 0's goodput: 0.98 of it)
        ks = [policy.next_k() for _ in range(3 * PolicySettings().probe_interval)]
        assert (set(ks) == {0}) == shadowed, ks
