"""Review of Medusa trees on the static / CUDA-graph decode path (``decode_path="static"``: the
calls the CUDA-graph path captures, run without capture): the static tree loop must give the
eager tree loop's tokens (= plain greedy with exact acceptance), its acceptance counts and its
committed state, also when the budget cuts a path (max_new_tokens 1-3), when K exceeds the
tree's depth or the head count, with EOS stopping rows at different steps, with typical
acceptance and sampling, across bucket switches on one wrapped model and on more families; and
the captured regions (tree forward, path commit) must run no host sync and build no tensor from
host data (either would break or invalidate CUDA-graph capture)."""

from __future__ import annotations

import collections

import pytest
import torch
from conftest import needs_triton_interpreter
from test_medusa_tree import SMALL_TREE, OracleTree, _prompts, _rows
from tiny_models import make_model, ragged_prompts
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec.drafters import MedusaDrafter, MedusaHeads

_MODELS: dict = {}


def _model(family):
    if family not in _MODELS:
        _MODELS[family] = make_model(family, seed=0)
    return _MODELS[family]


def _counts(st):
    return (st.proposed_tokens, st.accepted_tokens, st.new_tokens, st.steps, round(st.mean_accepted_tokens, 9),
            round(st.acceptance_rate, 9))


def _same_stats(eager, static):
    """Same acceptance counts and the same histogram (K + 1 entries on both paths, also when K is
    beyond the tree's depth)."""
    assert _counts(eager) == _counts(static)
    assert eager.accept_histogram == static.accept_histogram


def _state(cache):
    """Committed state (as test_medusa_tree._state_of; conv-only layers have no recurrence)."""
    out = []
    for layer in cache.ssm.values():
        out += [t.clone() for t in (layer.ssm_state(), layer.conv_state()) if t is not None]
    for k, v in cache.kv.values():
        for b in range(cache.batch):
            cols = slice(int(cache.pad[b]), int(cache.seq_len[b]))
            out += [k[b, :, cols].clone(), v[b, :, cols].clone()]
    return out


def _same_state(a, b):
    assert torch.equal(a.seq_len, b.seq_len) and torch.equal(a.pad, b.pad)
    for x, y in zip(_state(a), _state(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _perturbed_heads(model, num_heads, seed, scale=0.05):
    """Heads from the target's LM head with seeded noise: partial, varied acceptance, built in ms."""
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads.from_target(model, num_heads=num_heads, vocab_bias=True)
    with torch.no_grad():
        for lin in heads.lm_heads:
            lin.weight.add_(torch.randn(lin.weight.shape, generator=g) * scale)
    return heads


@pytest.mark.parametrize("family,strategy,tree,num_heads,K", [
    ("qwen3_5", "snapshot", "default", 4, 2),        # default tree rebuilt at depth K < heads (a new TreeSpec per call)
    ("qwen3_5", "replay", SMALL_TREE, 3, 5),         # K beyond the tree's depth and the head count
    ("nemotron_h", "ring", "medusa-63", 4, 4),       # the 64-node tree
    ("nemotron_h", "replay_deferred", [[0], [1], [2], [3]], 1, 1),  # one level, wide
])
def test_static_tree_budget_cuts_and_depth_limits(family, strategy, tree, num_heads, K):
    """max_new_tokens 1, 2, 3 cut the accepted path (or leave no step at all), 7 runs several
    steps: static == plain greedy, == the eager tree loop's counts and committed state."""
    model = _model(family)
    ids, mask = _prompts()
    L = ids.shape[1]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    rows = _rows(ref, ids, mask)
    deep = 0
    for max_new in (1, 2, 3, 7):
        run = {}
        for path in ("eager", "static"):
            drafter = OracleTree(rows, model.config.vocab_size, tree=tree, num_heads=num_heads, seed=max_new)
            sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K, decode_path=path)
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=0)
            assert torch.equal(out, ref[:, : L + max_new]), (path, max_new)
            assert sd.last_stats.decode_path == path
            run[path] = sd
        _same_stats(run["eager"].last_stats, run["static"].last_stats)
        _same_state(run["eager"].last_cache, run["static"].last_cache)
        if max_new == 1:
            assert run["static"].last_stats.steps == 0
        deep = max(deep, max((i for i, v in enumerate(run["static"].last_stats.accept_histogram) if v), default=0))
    assert deep >= min(K, 2)  # paths deeper than one node were accepted (and compacted)


def test_static_tree_eos_rows_finish_at_different_times():
    """Row 0 ends at its first token (the prefill's: it never takes part in a step), row 2 a few
    tokens later, mid-path; the other row runs to the budget."""
    model = _model("nemotron_h")
    ids, mask = _prompts()
    L = ids.shape[1]
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    eos = [int(plain[0, L]), int(plain[2, L + 5])]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0,
                         eos_token_id=eos)
    gen = ref[:, L:]
    stops = [int(torch.isin(r, torch.tensor(eos)).long().argmax()) + 1 if bool(torch.isin(r, torch.tensor(eos)).any())
             else r.numel() for r in gen]
    assert stops[0] == 1 and len(set(stops)) == 3, stops  # the setting this test is about
    run = {}
    for path in ("eager", "static"):
        drafter = OracleTree(_rows(ref, ids, mask), model.config.vocab_size, seed=4)
        sd = specdec.wrap(model, drafter=drafter, rollback="ring", num_speculative_tokens=4, decode_path=path)
        assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos),
                           ref), path
        run[path] = sd
    _same_stats(run["eager"].last_stats, run["static"].last_stats)
    _same_state(run["eager"].last_cache, run["static"].last_cache)
    assert run["static"].last_stats.new_tokens == sum(stops)


@pytest.mark.parametrize("tree,acceptance,K,sample", [
    ("default", "typical", 4, False),
    ("default", "typical", 4, True),
    (None, "typical", 2, True),           # the chain as a one-branch tree, K below the head count
    ("medusa-63", "exact", 5, True),      # lossless tree sampling, K beyond the head count
])
def test_static_tree_typical_and_sampling_match_eager(tree, acceptance, K, sample):
    """Typical acceptance (greedy and sampled) and exact tree sampling draw the same tokens from
    the same generator on both paths, with the same counts."""
    model = _model("qwen3_5")
    heads = _perturbed_heads(model, num_heads=3, seed=1)
    ids, mask = _prompts()
    kw = {"do_sample": True, "temperature": 0.8, "top_k": 40} if sample else {}
    run, outs = {}, {}
    for path in ("eager", "static"):
        sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree=tree, acceptance=acceptance),
                          rollback="replay_deferred", num_speculative_tokens=K, decode_path=path)
        gen = torch.Generator().manual_seed(3) if sample else None
        outs[path] = sd.generate(ids, attention_mask=mask, max_new_tokens=14, pad_token_id=0, eos_token_id=[7, 11],
                                 generator=gen, **kw)
        run[path] = sd
    assert torch.equal(outs["eager"], outs["static"])
    _same_stats(run["eager"].last_stats, run["static"].last_stats)
    assert run["static"].last_stats.accepted_tokens > 0


def test_static_tree_bucket_switching_on_one_wrapper():
    """One wrapped model, one static bucket at a time: batch, tree, K and the drafter change
    between calls (chain drafting in between); every call equals a fresh eager run (no stale
    cache, drafter or tree state)."""
    model = _model("nemotron_h")
    heads = _perturbed_heads(model, num_heads=3, seed=2)
    ids, mask = _prompts()
    sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree="default"), rollback="replay_deferred",
                      num_speculative_tokens=3, decode_path="static")
    calls = [("default", 3, slice(0, 3)), ("default", 3, slice(1, 2)), ("default", 3, slice(0, 3)),
             (SMALL_TREE, 3, slice(0, 3)), (SMALL_TREE, 2, slice(0, 2)), (None, 3, slice(0, 3)),
             ("medusa-63", 3, slice(0, 3)), ("default", 1, slice(0, 3)), ("default", 3, slice(0, 3))]
    accepted = 0
    for tree, K, rows in calls:
        if K != sd.num_speculative_tokens:
            sd.num_speculative_tokens = K
        sd.drafter = MedusaDrafter(heads, tree=tree)
        out = sd.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=12, pad_token_id=0)
        ref = specdec.wrap(model, drafter=MedusaDrafter(heads, tree=tree), rollback="replay_deferred",
                           num_speculative_tokens=K, decode_path="eager")
        assert torch.equal(out, ref.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=12, pad_token_id=0))
        _same_stats(ref.last_stats, sd.last_stats)
        accepted += sd.last_stats.accepted_tokens
        assert len(sd._static) == 1
        (B, T, _, graphs, spec), = sd._static
        assert (B, graphs) == (rows.stop - rows.start, False)
        assert T == (spec.num_nodes if tree is not None else K + 1)
    assert accepted > 0


@pytest.mark.parametrize("family", ["lfm2", "falcon_h1", "zamba2", "granitemoehybrid"])
def test_static_tree_more_families(family):
    """Conv-only layers (LFM2), parallel attention + SSM (Falcon-H1), shared attention (Zamba2)
    and MoE (GraniteMoeHybrid): deep off-chain paths + EOS on the static path == plain greedy,
    with the eager loop's counts and committed state."""
    model = _model(family)
    ids, mask = _prompts()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(plain[1, ids.shape[1] + 5])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
    run = {}
    for path in ("eager", "static"):
        sd = specdec.wrap(model, drafter=OracleTree(_rows(ref, ids, mask), model.config.vocab_size, seed=1),
                          rollback=("snapshot", "ring", "replay", "replay_deferred")[len(family) % 4],
                          num_speculative_tokens=4, decode_path=path)
        assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos),
                           ref), path
        run[path] = sd
    _same_stats(run["eager"].last_stats, run["static"].last_stats)
    _same_state(run["eager"].last_cache, run["static"].last_cache)
    assert run["static"].last_stats.mean_accepted_tokens > 2


# ------------------------------------------------------------------------- capture safety

#: ops that sync with the host (a CUDA graph cannot capture them) or build a tensor from host
#: data (``torch.tensor(...)``: a host-to-device copy, not capturable)
_HOST_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
             "aten._unique2.default", "aten.unique_consecutive.default", "aten.lift_fresh.default"}


class _HostOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.hits = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in _HOST_OPS or (name == "aten.index.Tensor"
                                 and any(i is not None and i.dtype == torch.bool for i in args[1])):
            self.hits[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family,strategy,backend", [
    pytest.param("nemotron_h", "replay", "triton", marks=needs_triton_interpreter),
    pytest.param("qwen3_5", "snapshot", "triton", marks=needs_triton_interpreter),
    ("qwen3_5", "ring", "torch"), ("nemotron_h", "snapshot", "torch")])
def test_static_tree_captured_regions_run_no_host_ops(family, strategy, backend, monkeypatch):
    """On the Triton backend (the CUDA default; here its interpreter) and on the torch backend
    (snapshot / ring: torch replay's fold syncs by design) every tree forward and path
    commit after the bucket's first (what the CUDA-graph path captures, after its warm-up) runs
    no host sync and no host-to-device tensor construction (its tree tables are cached on the
    device); the per-step tree acceptance does not sync either."""
    from specdec import engine
    from specdec.decoding import StaticDecoder

    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    model = make_model(family, seed=0)
    ids, mask = ragged_prompts(batch=2, lengths=(9, 6), seed=3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    seen = collections.Counter()
    recorded = {"forward": _HostOps(), "commit": _HostOps(), "step": _HostOps()}

    def watch(name, fn, skip_first):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            if skip_first and seen[name] == 1:
                return fn(*args, **kwargs)
            with recorded["step" if name == "accept" else name]:
                return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(StaticDecoder, "forward", watch("forward", StaticDecoder.forward, True))
    monkeypatch.setattr(StaticDecoder, "commit", watch("commit", StaticDecoder.commit, True))
    monkeypatch.setattr(engine, "accept_tree", watch("accept", engine.accept_tree, False))
    sd = specdec.wrap(model, drafter=OracleTree(_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      rollback=strategy, num_speculative_tokens=3, decode_path="static")
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0), ref)
    assert all((layer.op.kernels is not None) == (backend == "triton") for layer in sd.last_cache.ssm.values())
    assert seen["forward"] >= 2 and seen["commit"] >= 2 and seen["accept"] >= 2
    assert not recorded["forward"].hits, dict(recorded["forward"].hits)
    assert not recorded["commit"].hits, dict(recorded["commit"].hits)
    step = {k: v for k, v in recorded["step"].hits.items() if k != "aten.lift_fresh.default"}  # ok[:, 0] = True
    assert not step, step
