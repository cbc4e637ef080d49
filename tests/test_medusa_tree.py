"""Medusa tree drafting and tree verification through attention and SSM state (specdec.tree):
tree parsing and validation; the reference ops and every rollback strategy on a tree equal the
chain run along each path; greedy output equals plain HF greedy decoding for chain and tree
drafting on GDN (Qwen3.5) and Mamba-2 (Nemotron-H) x every strategy, ragged left-padded batch,
with noisy heads, with an oracle tree drafter that accepts deep off-chain paths (also KDA,
sliding-window attention, EOS, repetition penalty, the Triton backend) and with the zoo's heads;
the committed state after tree steps equals the chain run's; lossless tree sampling keeps the
target's distribution; typical acceptance.

On the static decode path (``decode_path="static"``: the calls the CUDA-graph path captures, run
without capture) the tree loop gives the eager tree loop's tokens (= plain greedy with exact
acceptance), its acceptance counts and its committed state, also when the budget cuts a path
(max_new_tokens 1-3), when K exceeds the tree's depth or the head count, with EOS stopping rows at
different steps, with typical acceptance and sampling, across bucket switches on one wrapped model
and on more families; and the captured regions (tree forward, path commit) run no host sync and
build no tensor from host data (either would break or invalidate CUDA-graph capture)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from helpers import (
    ALL_STRATEGIES, assert_same_token_distribution, fit_medusa_heads, medusa_prompts, perturb_heads, random_inputs,
)
from hydra import compose, initialize_config_dir
from markers import needs_triton_interpreter
from tiny_models import EXTRA_FAMILIES, get_model, make_model, ragged_prompts
from torch.utils._python_dispatch import TorchDispatchMode
from tree_drafters import SMALL_TREE, OracleTree, reference_rows

import specdec
import specdec.kernels.conv1d as conv_reference  # where the conv op finds its torch reference
from specdec import engine, zoo
from specdec.decoding import StaticDecoder
from specdec.drafters import MedusaDrafter, MedusaHeads
from specdec.experiments.app import CONF_DIR, run_experiment
from specdec.kernels import OPS, GDNOp, Mamba2Op, tree_index
from specdec.kernels.conv1d.naive import conv1d_tree_verify, conv1d_verify
from specdec.rollback import make_strategy
from specdec.tree import MEDUSA_63, default_tree_paths, make_tree
from specdec.verify import accept_tree

FAMILIES = ("qwen3_5", "nemotron_h")
MAX_NEW = 20


# ---------------------------------------------------------------------------- tree spec


def test_tree_spec_layout():
    t = make_tree([[1], [0, 1], [0], [0, 0], [1, 0]], num_heads=3)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))  # BFS: by depth, then rank (Medusa's order)
    assert t.parents == (-1, 0, 0, 1, 1, 2) and t.depth == (0, 1, 1, 2, 2, 2)
    assert (t.num_nodes, t.max_depth, t.max_rank) == (6, 2, 1)
    tt = t.tensors("cpu")
    assert tt["path_of"][5].tolist() == [0, 2, 5]
    assert tt["ancestors"][4].nonzero()[:, 0].tolist() == [0, 1, 4]
    assert sorted(p.tolist() for p in tt["leaves"]) == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert t.for_depth(1).paths == ((0,), (1,)) and t.for_depth(5) is t
    # every prefix of Medusa's list is a tree (it was built greedily), so the default tree is one
    for n in range(1, len(MEDUSA_63) + 1):
        make_tree([list(p) for p in MEDUSA_63[:n]], num_heads=4)
    assert make_tree("medusa-63", num_heads=4).num_nodes == 64
    assert make_tree("medusa-63", num_heads=2).max_depth == 2
    for depth in (1, 2, 3, 4):
        paths = default_tree_paths(depth)
        assert len(paths) + 1 <= 16 and max(map(len, paths)) == depth
        assert all((0,) * d in paths for d in range(1, depth + 1))  # contains the top-1 chain
        make_tree([list(p) for p in paths], num_heads=depth)
    d = make_tree("default", num_heads=4)
    assert d.num_nodes == 16 and d.max_depth == 4
    assert d.for_depth(2).num_nodes == 16 and d.for_depth(2).max_depth == 2  # rebuilt at the depth limit


@pytest.mark.parametrize("tree,match", [
    ([], "empty"),
    ([[0], []], "non-empty"),
    ([[0], [0, 1], [1, 1]], r"missing its prefix \[1\]"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "depth 4 but there are only 3 Medusa heads"),
    ([[0], [96]], "rank 96, out of range for a vocabulary of 96"),
    ([[0], [-1]], "negative rank"),
    ([[0], [0]], "listed twice"),
    ([[0], [0.5]], "must hold ints"),
    ("bushy", "unknown draft tree"),
])
def test_tree_validation_errors(tree, match):
    with pytest.raises(ValueError, match=match):
        MedusaDrafter(MedusaHeads(48, 96, num_heads=3), tree=tree)


def test_drafter_option_errors():
    heads = MedusaHeads(48, 96, num_heads=3)
    with pytest.raises(TypeError, match="list of paths"):
        MedusaDrafter(heads, tree=7)
    with pytest.raises(ValueError, match="acceptance must be one of"):
        MedusaDrafter(heads, acceptance="lenient")
    with pytest.raises(ValueError, match="posterior_alpha"):
        MedusaDrafter(heads, acceptance="typical", posterior_alpha=1.5)
    with pytest.raises(ValueError, match="posterior_threshold"):
        MedusaDrafter(heads, acceptance="typical", posterior_threshold=0)
    assert MedusaDrafter(heads).tree is None
    assert MedusaDrafter(heads, acceptance="typical").tree.paths == ((0,), (0, 0), (0, 0, 0))  # chain as a tree
    assert "not distribution-preserving" in MedusaDrafter.__doc__.replace("\n", " ").replace("  ", " ").lower()


# ------------------------------------------------------------------ ops and strategies


def _take(inputs, path):
    return {k: v[:, path] for k, v in inputs.items()}


@pytest.mark.parametrize("op_name", ["mamba2", "gdn", "kda"])
def test_ops_tree_equals_chain_along_every_path(op_name):
    op, g = OPS[op_name], torch.Generator().manual_seed(0)
    spec = make_tree(SMALL_TREE, num_heads=3)
    inputs, params, S = random_inputs(op_name, spec.num_nodes, g)
    s0 = torch.randn(3, *S, generator=g)
    y, states, replay = op.tree_verify(s0, inputs, params, spec.parents, True)
    for path in spec.tensors("cpu")["leaves"]:
        y_c, states_c, replay_c = op.verify(s0, _take(inputs, path), params, True)
        torch.testing.assert_close(y[:, path], y_c, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(states[:, path], states_c, rtol=1e-6, atol=1e-6)
        for key in replay:
            torch.testing.assert_close(replay[key][:, path], replay_c[key], rtol=1e-6, atol=1e-6)
    # a chain given as a tree is the chain
    chain = list(range(-1, spec.num_nodes - 1))
    y_t, st_t, _ = op.tree_verify(s0, inputs, params, chain, True)
    y_c, st_c, _ = op.verify(s0, inputs, params, True)
    torch.testing.assert_close(y_t, y_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st_t, st_c, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="earlier token"):
        op.tree_verify(s0, inputs, params, [-1, 2] + chain[2:], False)


def test_conv_tree_equals_chain_along_every_path():
    g = torch.Generator().manual_seed(1)
    spec = make_tree(SMALL_TREE, num_heads=3)
    B, C, W, N = 2, 5, 4, spec.num_nodes
    hist = torch.randn(B, C, W - 1, generator=g)
    x = torch.randn(B, N, C, generator=g)
    w, b = torch.randn(C, W, generator=g), torch.randn(C, generator=g)
    win = torch.zeros(B, C, W - 1 + N)
    win[:, :, : W - 1] = hist
    y = conv1d_tree_verify(win, x, w, b, "silu", spec.parents)
    for path in spec.tensors("cpu")["leaves"]:
        ref_win = torch.zeros(B, C, W - 1 + N)
        ref_win[:, :, : W - 1] = hist
        torch.testing.assert_close(y[:, path], conv1d_verify(ref_win, x[:, path], w, b, "silu"), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("op_name", ["mamba2", "gdn"])
def test_strategy_commits_the_accepted_path(op_name, strategy):
    """tree_verify, compact_path(path), commit(n): the committed state is the chain state after the
    path's first n tokens, step after step (deferred replay keeps its history across steps)."""
    op, g = OPS[op_name], torch.Generator().manual_seed(2)
    spec = make_tree(SMALL_TREE, num_heads=3)
    N, D = spec.num_nodes, spec.max_depth
    strat = make_strategy(strategy)
    store = strat.new_store(3, N)
    _, params, S = random_inputs(op_name, 1, g)
    ref = torch.randn(3, *S, generator=g)
    strat.load(store, ref)
    path_of = spec.tensors("cpu")["path_of"]
    for step in range(6):
        inputs, _, _ = random_inputs(op_name, N, g)
        inputs_params = params
        y = strat.tree_verify(store, op, inputs, inputs_params, spec.parents)
        y_ref, _, _ = op.tree_verify(ref, inputs, params, spec.parents, False)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        best = torch.randint(0, N, (3,), generator=g)
        n = torch.tensor(spec.depth)[best] + 1  # tokens of the path root..best
        n[step % 3] = torch.randint(0, int(n[step % 3]) + 1, (1,), generator=g)  # and a shorter commit
        path = torch.where(path_of[best] >= 0, path_of[best], torch.arange(D + 1))
        strat.compact_path(store, op, params, path, n)
        strat.commit(store, op, params, n)
        for b in range(3):
            k = int(n[b])
            if k:
                _, st, _ = op.verify(ref[b : b + 1], _take({kk: v[b : b + 1] for kk, v in inputs.items()}, path[b, :k]),
                                     params, True)
                ref[b] = st[0, -1]
        torch.testing.assert_close(strat.state(store, op, params), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="only forward"):
        strat.verify(store, op, random_inputs(op_name, 1, g)[0], params)
        strat.tree_verify(store, op, random_inputs(op_name, N, g)[0], params, spec.parents)


def test_accept_tree_greedy_and_typical():
    spec = make_tree([[0], [1], [0, 0], [1, 0]], num_heads=2)
    V = 5
    logits = torch.full((2, 5, V), -4.0)
    logits[:, 0, 2], logits[:, 0, 3] = 3.0, 2.6  # root: argmax 2, a close second 3
    logits[:, 2, 4] = 3.0  # node 2 (token 3) predicts 4
    logits[:, 4, 1] = 3.0
    tokens = torch.tensor([[0, 2, 3, 1, 4], [0, 2, 3, 1, 4]])
    limit = torch.tensor([2, 1])
    best, n, c = accept_tree(logits, tokens, spec, limit)
    assert best.tolist() == [1, 1] and n.tolist() == [1, 1]  # node 1 (token 2 = argmax); node 3 (1) != argmax 4
    assert c.tolist() == [logits[0, 1].argmax().item()] * 2
    best, n, c = accept_tree(logits, tokens, spec, limit, acceptance="typical")
    # row 0: the plausible branch 3 -> 4; row 1 (depth 1): both children pass, the likelier one wins
    assert best.tolist() == [4, 1] and n.tolist() == [2, 1]
    assert c.tolist() == [logits[0, 4].argmax().item(), logits[1, 1].argmax().item()]
    # typical acceptance accepts at least what greedy accepts (the argmax always passes its threshold)
    g = torch.Generator().manual_seed(0)
    big = make_tree("medusa-63", num_heads=4)
    for _ in range(20):
        lg = torch.randn(4, big.num_nodes, 12, generator=g) * 3
        tok = torch.randint(0, 12, (4, big.num_nodes), generator=g)
        tok[:, 1:] = torch.where(torch.rand(4, big.num_nodes - 1, generator=g) < 0.5,
                                 lg.argmax(-1)[:, torch.tensor(big.parents[1:])], tok[:, 1:])
        lim = torch.full((4,), 4)
        assert bool((accept_tree(lg, tok, big, lim, acceptance="typical")[1] >= accept_tree(lg, tok, big, lim)[1]).all())


# ----------------------------------------------------------------------- end to end


def _noisy_heads(model) -> MedusaHeads:
    """Heads fitted to the tiny model's own continuations, then perturbed: their top-1 is often
    wrong while the right token is often among the top few, so chain and tree acceptance are both
    partial and differ."""
    return perturb_heads(fit_medusa_heads(model, *medusa_prompts()))


@pytest.fixture(scope="module")
def setups():
    out = {}
    for fam in FAMILIES:
        model = make_model(fam, seed=0)
        ids, mask = medusa_prompts()
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        out[fam] = (model, _noisy_heads(model), ref)
    return out


def committed_state(cache):
    """Committed SSM / conv state (conv-only layers have no recurrent state) and the committed KV
    columns of every row."""
    out = []
    for layer in cache.ssm.values():
        out += [t.clone() for t in (layer.ssm_state(), layer.conv_state()) if t is not None]
    for k, v in cache.kv.values():
        for b in range(cache.batch):
            cols = slice(int(cache.pad[b]), int(cache.seq_len[b]))
            out += [k[b, :, cols].clone(), v[b, :, cols].clone()]
    return out


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_exact_chain_and_tree(setups, family, strategy):
    model, heads, ref = setups[family]
    ids, mask = medusa_prompts()
    runs = {}
    for tree in (None, "default", SMALL_TREE):
        sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree=tree), rollback=strategy, num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
        assert torch.equal(out, ref), (family, strategy, tree)
        runs[str(tree)] = (sd.last_stats, committed_state(sd.last_cache))
    chain, _ = runs["None"]
    tree_stats, _ = runs["default"]
    h = tree_stats.accept_histogram
    assert h[0] > 0 and sum(h[1:]) > 0, h  # partial acceptance
    assert tree_stats.mean_accepted_tokens > chain.mean_accepted_tokens  # the tree finds more than the top-1 chain
    # the committed state (SSM, conv, KV columns) after tree steps equals the chain run's
    for key in ("default", str(SMALL_TREE)):
        for a, b in zip(runs[key][1], runs["None"][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,strategy", [
    ("qwen3_5", "snapshot"), ("qwen3_5", "ring"), ("nemotron_h", "replay"), ("nemotron_h", "replay_deferred"),
    ("kimi_linear", "ring"), ("mistral", "replay"),  # KDA; sliding-window attention (window 8 < text)
])
def test_oracle_tree_deep_paths_exact(family, strategy):
    model = make_model(family, seed=0)
    ids, mask = medusa_prompts()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    eos = int(plain[1, ids.shape[1] + 9])  # row 1 stops at its 10th new token (or earlier), mid-step
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos)
    drafter = OracleTree(reference_rows(ref, ids, mask), model.config.vocab_size)
    sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=4)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(out, ref)
    st = sd.last_stats
    assert st.accept_histogram[4] > 0 and st.mean_accepted_tokens > 2.5 and drafter.off_chain > 0, st


@pytest.mark.parametrize("family", ["qwen3_next", *EXTRA_FAMILIES, "llama"])
def test_oracle_tree_every_family(family):
    """Every other supported family (conv-only LFM2, parallel Falcon-H1, Zamba2's shared attention,
    pure Mamba-2, MoE variants, an attention-only model) verifies trees exactly."""
    model = make_model(family, seed=0)
    ids, mask = medusa_prompts()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    strategy = ALL_STRATEGIES[len(family) % len(ALL_STRATEGIES)]
    sd = specdec.wrap(model, drafter=OracleTree(reference_rows(ref, ids, mask), model.config.vocab_size),
                      rollback=strategy, num_speculative_tokens=4)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), ref), strategy
    assert sd.last_stats.mean_accepted_tokens > 2


def test_oracle_tree_with_repetition_penalty_and_min_length():
    model = make_model("qwen3_5", seed=0)
    ids, mask = medusa_prompts()
    kw = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0, "repetition_penalty": 1.4,
          "min_new_tokens": 6, "eos_token_id": 5}
    ref = model.generate(ids, attention_mask=mask, **kw)
    sd = specdec.wrap(model, drafter=OracleTree(reference_rows(ref, ids, mask), 96), rollback="replay",
                      num_speculative_tokens=4)
    assert torch.equal(sd.generate(ids, attention_mask=mask, **kw), ref)
    assert sd.last_stats.mean_accepted_tokens > 2


def _refuse_torch_tree_references(monkeypatch):
    """Make the torch tree references (the ops' and the conv's) raise if a tree step calls them."""
    def torch_tree_path(*args, **kwargs):
        raise AssertionError("a tree step on the Triton backend ran the torch tree reference")

    monkeypatch.setattr(Mamba2Op, "tree_verify", torch_tree_path)
    monkeypatch.setattr(GDNOp, "tree_verify", torch_tree_path)  # KDA inherits it
    monkeypatch.setattr(conv_reference, "conv1d_tree_verify", torch_tree_path)


@needs_triton_interpreter
@pytest.mark.parametrize("family,strategy", [("qwen3_5", "replay"), ("nemotron_h", "snapshot"), ("kimi_linear", "ring")])
def test_oracle_tree_on_the_triton_backend(family, strategy, monkeypatch):
    """On the Triton backend (here its CPU interpreter) tree steps run the Triton tree kernels --
    the torch tree references raise if called -- and the output stays exact."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    _refuse_torch_tree_references(monkeypatch)
    model = make_model(family, seed=0, small=True)  # one SSM and one attention layer: the interpreter is slow
    ids, mask = ragged_prompts(batch=2, lengths=(9, 6), seed=3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter=OracleTree(reference_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      rollback=strategy, num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values())
    assert torch.equal(out, ref)
    assert sd.last_stats.mean_accepted_tokens > 1.5  # tree steps ran (and accepted)


def test_sampling_tree_keeps_the_target_distribution():
    V, N, P = 8, 2500, 3
    target = make_model("qwen3_5", seed=3, vocab=V, small=True)  # (small: N rows prefilled, twice)
    heads = MedusaHeads.from_target(target, num_heads=2, vocab_bias=True)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]]).repeat(N, 1)
    kw = {"temperature": 0.8, "top_k": 6, "top_p": 0.95}
    hf = target.generate(prompt, max_new_tokens=P, do_sample=True, pad_token_id=0, **kw)
    sd = specdec.wrap(target, drafter=MedusaDrafter(heads, tree=[[0], [1], [2], [0, 0], [1, 0], [0, 1]]),
                      rollback="snapshot", num_speculative_tokens=2)
    out = sd.generate(prompt, max_new_tokens=P, do_sample=True, generator=torch.Generator().manual_seed(11),
                      pad_token_id=0, **kw)
    assert 0 < sd.last_stats.acceptance_rate < 1
    assert_same_token_distribution(hf, out, prompt.shape[1], P, V)


def test_typical_acceptance_runs(setups):
    model, heads, ref = setups["qwen3_5"]
    ids, mask = medusa_prompts()
    greedy = specdec.wrap(model, drafter=MedusaDrafter(heads, tree="default"), rollback="ring", num_speculative_tokens=3)
    greedy.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    for tree in (None, "default"):
        sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree=tree, acceptance="typical", posterior_threshold=0.2,
                                                       posterior_alpha=0.5), rollback="ring", num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
        assert out.shape == ref.shape and torch.equal(out[:, : ids.shape[1]], ids)
        assert sd.last_stats.mean_accepted_tokens >= 1.0
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, do_sample=True,
                          temperature=0.7, generator=torch.Generator().manual_seed(0))
        assert out.shape == ref.shape and int(out.max()) < 96
    sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree="default", acceptance="typical"), rollback="ring",
                      num_speculative_tokens=3)
    sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert sd.last_stats.acceptance_rate >= greedy.last_stats.acceptance_rate


def test_zoo_heads_tree_exact_and_accepting_more():
    model, tok = zoo.load("gdn-target")
    heads = zoo.load_medusa("gdn-medusa", target=model)
    texts = [p["prompt"] for p in zoo.prompts("128", limit=3)]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert bool((enc.attention_mask == 0).any())  # ragged, left-padded
    ref = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    mean = {}
    for tree, strategy in ((None, "replay"), ("default", "replay"), ("default", "snapshot")):
        sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree=tree), rollback=strategy, num_speculative_tokens=4)
        out = sd.generate(**enc, max_new_tokens=24, pad_token_id=tok.pad_token_id)
        assert torch.equal(out, ref), (tree, strategy)
        mean[tree] = sd.last_stats.mean_accepted_tokens
    assert mean["default"] > mean[None] > 1.0


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_static_path_tree_exact_and_same_stats_as_eager(setups, family, strategy):
    """Tree drafting on the static decode path (fixed shapes, device-side acceptance and path
    commit: what the CUDA-graph path captures) gives plain greedy's output and the eager tree
    loop's acceptance counts; a second call reuses the bucket."""
    model, heads, ref = setups[family]
    ids, mask = medusa_prompts()
    got = {}
    for path in ("eager", "static"):
        sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree="default"), rollback=strategy,
                          num_speculative_tokens=3, decode_path=path)
        for _ in range(2 if path == "static" else 1):
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
            assert torch.equal(out, ref), (family, strategy, path)
        st = sd.last_stats
        assert st.decode_path == path
        got[path] = (st.proposed_tokens, st.accepted_tokens, st.new_tokens, st.accept_histogram[1:], st.steps)
    assert got["static"] == got["eager"]
    assert sum(got["static"][3]) > 0  # some steps accepted drafts
    assert len(sd._static) == 1 and next(iter(sd._static.values())).tree.num_nodes == 16


@pytest.mark.parametrize("family,strategy", [("qwen3_5", "replay"), ("nemotron_h", "ring"), ("kimi_linear", "snapshot"),
                                             ("mistral", "replay_deferred")])
def test_static_path_oracle_tree_deep_paths_and_eos(family, strategy):
    """Deep off-chain paths of a 67-node tree, a row stopping at EOS mid-step and the budget cut:
    the static path's device-side path commit equals plain greedy decoding."""
    model = make_model(family, seed=0)
    ids, mask = medusa_prompts()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    eos = int(plain[1, ids.shape[1] + 9])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos)
    drafter = OracleTree(reference_rows(ref, ids, mask), model.config.vocab_size)
    sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=4, decode_path="static")
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(out, ref)
    st = sd.last_stats
    assert st.decode_path == "static" and len(st.accept_histogram) == 5
    assert st.accept_histogram[4] > 0 and st.mean_accepted_tokens > 2.5 and drafter.off_chain > 0, st


def test_static_path_tree_sampling_matches_eager():
    """Lossless tree sampling on the static path draws exactly what the eager loop draws from the
    same generator (the same acceptance computation, moved to fixed shapes)."""
    model = make_model("qwen3_5", seed=0)
    ids, mask = medusa_prompts()
    heads = MedusaHeads.from_target(model, num_heads=3)
    outs = []
    for path in ("eager", "static"):
        sd = specdec.wrap(model, drafter=MedusaDrafter(copy.deepcopy(heads), tree=SMALL_TREE), rollback="ring",
                          num_speculative_tokens=3, decode_path=path)
        outs.append(sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, do_sample=True,
                                temperature=0.8, generator=torch.Generator().manual_seed(7)))
        assert sd.last_stats.decode_path == path
    assert torch.equal(outs[0], outs[1])


@needs_triton_interpreter
# (the static path's tree steps on the Triton tree kernels, the torch references refused, stay checked by
# default in test_static_tree_captured_regions_run_no_host_ops[*-triton]: Qwen3.5's small model and Nemotron-H)
@pytest.mark.slow
def test_static_path_tree_on_the_triton_backend(monkeypatch):
    """The static path's tree steps run the Triton tree kernels (interpreter here), exactly."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    _refuse_torch_tree_references(monkeypatch)
    model = make_model("qwen3_5", seed=0, small=True)  # one SSM and one attention layer: the interpreter is slow
    ids, mask = ragged_prompts(batch=2, lengths=(9, 6), seed=3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter=OracleTree(reference_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      rollback="replay", num_speculative_tokens=3, decode_path="static")
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0), ref)
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values())
    assert sd.last_stats.decode_path == "static" and sd.last_stats.mean_accepted_tokens > 1.5


# ------------------------------------------- static path: the eager tree loop's tokens, counts, state


def _counts(st):
    return (st.proposed_tokens, st.accepted_tokens, st.new_tokens, st.steps, round(st.mean_accepted_tokens, 9),
            round(st.acceptance_rate, 9))


def _same_stats(eager, static):
    """Same acceptance counts and the same histogram (K + 1 entries on both paths, also when K is
    beyond the tree's depth)."""
    assert _counts(eager) == _counts(static)
    assert eager.accept_histogram == static.accept_histogram


def _same_state(a, b):
    assert torch.equal(a.seq_len, b.seq_len) and torch.equal(a.pad, b.pad)
    for x, y in zip(committed_state(a), committed_state(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _perturbed_heads(model, num_heads, seed):
    """Heads from the target's LM head with seeded noise: partial, varied acceptance, built in ms."""
    heads = MedusaHeads.from_target(model, num_heads=num_heads, vocab_bias=True)
    return perturb_heads(heads, scale=0.05, seed=seed, relative=False)


@pytest.mark.parametrize("family,strategy,tree,num_heads,K", [
    ("qwen3_5", "snapshot", "default", 4, 2),        # default tree rebuilt at depth K < heads (a new TreeSpec per call)
    ("qwen3_5", "replay", SMALL_TREE, 3, 5),         # K beyond the tree's depth and the head count
    ("nemotron_h", "ring", "medusa-63", 4, 4),       # the 64-node tree
    ("nemotron_h", "replay_deferred", [[0], [1], [2], [3]], 1, 1),  # one level, wide
])
def test_static_tree_budget_cuts_and_depth_limits(family, strategy, tree, num_heads, K):
    """max_new_tokens 1, 2, 3 cut the accepted path (or leave no step at all), 7 runs several
    steps: static == plain greedy, == the eager tree loop's counts and committed state."""
    model = get_model(family)
    ids, mask = medusa_prompts()
    L = ids.shape[1]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    rows = reference_rows(ref, ids, mask)
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
    model = get_model("nemotron_h")
    ids, mask = medusa_prompts()
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
        drafter = OracleTree(reference_rows(ref, ids, mask), model.config.vocab_size, seed=4)
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
    model = get_model("qwen3_5")
    heads = _perturbed_heads(model, num_heads=3, seed=1)
    ids, mask = medusa_prompts()
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
    model = get_model("nemotron_h")
    heads = _perturbed_heads(model, num_heads=3, seed=2)
    ids, mask = medusa_prompts()
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
    model = get_model(family)
    ids, mask = medusa_prompts()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(plain[1, ids.shape[1] + 5])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
    run = {}
    for path in ("eager", "static"):
        sd = specdec.wrap(model, drafter=OracleTree(reference_rows(ref, ids, mask), model.config.vocab_size, seed=1),
                          rollback=ALL_STRATEGIES[len(family) % len(ALL_STRATEGIES)],
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
    device); the per-step tree acceptance does not sync either. On the Triton backend the tree
    steps run the Triton tree kernels: the torch tree references raise if called."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    if backend == "triton":
        _refuse_torch_tree_references(monkeypatch)
    # Qwen3.5 on the Triton backend: its small model (one GDN and one attention layer, an MLP after each),
    # as every layer runs through the interpreter; Nemotron-H's full one (its MLP layers of their own)
    model = make_model(family, seed=0, small=family == "qwen3_5" and backend == "triton")
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
    sd = specdec.wrap(model, drafter=OracleTree(reference_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      rollback=strategy, num_speculative_tokens=3, decode_path="static")
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0), ref)
    assert all((layer.op.kernels is not None) == (backend == "triton") for layer in sd.last_cache.ssm.values())
    assert seen["forward"] >= 2 and seen["commit"] >= 2 and seen["accept"] >= 2
    assert not recorded["forward"].hits, dict(recorded["forward"].hits)
    assert not recorded["commit"].hits, dict(recorded["commit"].hits)
    step = {k: v for k, v in recorded["step"].hits.items() if k != "aten.lift_fresh.default"}  # ok[:, 0] = True
    assert not step, step


def test_tree_tables_are_cached_and_can_be_held():
    """The tree index tables are made once per (tree, device) -- no host-to-device copy in a
    captured step -- and a holder of cached_tensors() keeps them past the caches' eviction (the
    static decoder holds the ones its CUDA graphs read)."""
    par = (-1, 0, 0, 1)
    cols = tree_index.conv_tree_columns(par, 4, "cpu")
    assert cols is tree_index.conv_tree_columns(par, 4, "cpu") and cols.dtype == torch.long
    assert torch.equal(cols, tree_index.conv_tree_columns_i32(par, 4, "cpu").long())
    meta = tree_index.tree_meta(par, "cpu")
    held = tree_index.cached_tensors()
    assert any(t is cols for t in held) and any(t is meta for t in held)
    for n in range(tree_index._CACHE_LIMIT + 1):  # other trees push the cache past its limit
        tree_index.tree_meta((-1,) + (0,) * (n + 1), "cpu")
    assert not any(t is meta for t in tree_index.cached_tensors())
    again = tree_index.tree_meta(par, "cpu")
    assert again is not meta and torch.equal(again, meta)  # rebuilt; the held one is intact


def test_static_path_tree_refusals():
    """What the static path cannot do with a tree it refuses by name (the logits processor runs
    on the eager path only); a drafter returning the wrong node count is named."""
    model = make_model("qwen3_5", seed=0)
    heads = MedusaHeads.from_target(model, num_heads=2)
    ids, mask = medusa_prompts()
    sd = specdec.wrap(model, drafter=MedusaDrafter(copy.deepcopy(heads), tree="default"), num_speculative_tokens=2,
                      decode_path="static")
    with pytest.raises(ValueError, match="repetition_penalty"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, repetition_penalty=1.3)

    class Short(OracleTree):
        def propose_tree(self, input_ids, lengths, spec):
            return super().propose_tree(input_ids, lengths, spec)[:, :-1]

    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter=Short(reference_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      num_speculative_tokens=3, decode_path="static")
    with pytest.raises(ValueError, match=r"propose_tree must return node tokens \[3, 10\], got \(3, 9\)"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)

    class OutOfVocab(OracleTree):
        def propose_tree(self, input_ids, lengths, spec):
            return super().propose_tree(input_ids, lengths, spec) + 1000

    sd = specdec.wrap(model, drafter=OutOfVocab(reference_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      num_speculative_tokens=3, decode_path="static")
    with pytest.raises(ValueError, match=r"token ids outside the target's vocabulary \[0, 96\)"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)

    class FloatNodes(OracleTree):
        def propose_tree(self, input_ids, lengths, spec):
            return super().propose_tree(input_ids, lengths, spec).float()

    for path in ("eager", "static"):  # one check (specdec.tree.check_tree_nodes) on both loops
        sd = specdec.wrap(model, drafter=FloatNodes(reference_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                          num_speculative_tokens=3, decode_path=path)
        with pytest.raises(TypeError, match=r"dtype torch.float32; expected an integer dtype"):
            sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)


def test_acceptance_experiment_with_a_tree(tmp_path):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=gdn-target", "drafter=medusa", "drafter.tree=default", "rollback=snapshot", "prompts.limit=1",
            "max_new_tokens=8", "experiment.warmup=false", "device=cpu", "progress=false"])
        bad = compose(config_name="config", overrides=["model=gdn-target", "drafter=ngram", "drafter.tree=default"])
    records = run_experiment(cfg, tmp_path)
    assert [r["drafter"] for r in records] == ["medusa-tree:default"]
    assert records[0]["exact"] and records[0]["mean_accepted_tokens"] >= 1.0
    assert "| gdn-target | medusa-tree:default | snapshot |" in (tmp_path / "summary.md").read_text()
    with pytest.raises(ValueError, match="needs drafter=medusa"):
        run_experiment(bad, tmp_path / "bad")
