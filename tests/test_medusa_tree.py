"""Medusa tree drafting and tree verification through attention and SSM state (specdec.tree):
tree parsing and validation; the reference ops and every rollback strategy on a tree equal the
chain run along each path; greedy output equals plain HF greedy decoding for chain and tree
drafting on GDN (Qwen3.5) and Mamba-2 (Nemotron-H) x every strategy, ragged left-padded batch,
with noisy heads, with an oracle tree drafter that accepts deep off-chain paths (also KDA,
sliding-window attention, EOS, repetition penalty, the Triton backend) and with the zoo's heads;
the committed state after tree steps equals the chain run's; lossless tree sampling keeps the
target's distribution; typical acceptance."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import needs_triton_interpreter
from scipy.stats import chi2_contingency
from tiny_models import EXTRA_FAMILIES, make_model, ragged_prompts
from tree_drafters import ORACLE_TREE, OracleTree  # noqa: F401 (ORACLE_TREE: also imported from here)
from tree_drafters import reference_rows as _rows

import specdec
from specdec import zoo
from specdec.drafters import MedusaDrafter, MedusaHeads
from specdec.experiments.train_medusa import (
    collect_hidden_states, fit_heads, medusa_targets, target_predictions,
)
from specdec.kernels import OPS  # noqa: E402
from specdec.kernels.conv1d.naive import conv1d_tree_verify, conv1d_verify  # noqa: E402
from specdec.rollback import make_strategy  # noqa: E402
from specdec.tree import MEDUSA_63, default_tree_paths, make_tree  # noqa: E402
from specdec.verify import accept_tree  # noqa: E402

FAMILIES = ("qwen3_5", "nemotron_h")
STRATEGIES = ("snapshot", "ring", "replay", "replay_deferred")
SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]
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


def _inputs(op, T, g, B=3):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "mamba2":
        H, P, N, G = 4, 8, 6, 2
        return ({"x": r(B, T, H, P), "dt": torch.nn.functional.softplus(r(B, T, H)), "B": r(B, T, G, N),
                 "C": r(B, T, G, N)}, {"A": -torch.rand(H, generator=g) - 0.1, "D": r(H)}, (H, P, N))
    H, K, V = 2, 8, 6
    g_shape = (B, T, H, K) if op == "kda" else (B, T, H)
    return ({"q": torch.nn.functional.normalize(r(B, T, H, K), dim=-1) * K**-0.5,
             "k": torch.nn.functional.normalize(r(B, T, H, K), dim=-1), "v": r(B, T, H, V),
             "g": -torch.nn.functional.softplus(r(*g_shape)), "beta": torch.rand(B, T, H, generator=g)}, {}, (H, K, V))


def _take(inputs, path):
    return {k: v[:, path] for k, v in inputs.items()}


@pytest.mark.parametrize("op_name", ["mamba2", "gdn", "kda"])
def test_ops_tree_equals_chain_along_every_path(op_name):
    op, g = OPS[op_name], torch.Generator().manual_seed(0)
    spec = make_tree(SMALL_TREE, num_heads=3)
    inputs, params, S = _inputs(op_name, spec.num_nodes, g)
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


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("op_name", ["mamba2", "gdn"])
def test_strategy_commits_the_accepted_path(op_name, strategy):
    """tree_verify, compact_path(path), commit(n): the committed state is the chain state after the
    path's first n tokens, step after step (deferred replay keeps its history across steps)."""
    op, g = OPS[op_name], torch.Generator().manual_seed(2)
    spec = make_tree(SMALL_TREE, num_heads=3)
    N, D = spec.num_nodes, spec.max_depth
    strat = make_strategy(strategy)
    store = strat.new_store(3, N)
    _, params, S = _inputs(op_name, 1, g)
    ref = torch.randn(3, *S, generator=g)
    strat.load(store, ref)
    path_of = spec.tensors("cpu")["path_of"]
    for step in range(6):
        inputs, _, _ = _inputs(op_name, N, g)
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
        strat.verify(store, op, _inputs(op_name, 1, g)[0], params)
        strat.tree_verify(store, op, _inputs(op_name, N, g)[0], params, spec.parents)


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


def _prompts():
    return ragged_prompts(batch=3, lengths=(12, 7, 10), seed=5)


def _noisy_heads(model, scale: float = 1.5) -> MedusaHeads:
    """Heads initialised from the LM head and fitted (a fraction of a second) to the tiny model's
    own continuations, then perturbed: their top-1 is often wrong while the right token is often
    among the top few, so chain and tree acceptance are both partial and differ."""
    ids, mask = _prompts()
    seqs = torch.cat([model.generate(ids[i][mask[i].bool()][None], max_new_tokens=40, do_sample=False,
                                     pad_token_id=0)[:, -44:] for i in range(ids.shape[0])])
    hidden = collect_hidden_states(model, seqs, batch=16, progress=False)
    x, y = medusa_targets(hidden, target_predictions(model, hidden, seqs), 3)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(model, num_heads=3, num_layers=1, vocab_bias=True)
    fit_heads(heads, x, y, steps=60, batch_positions=256, lr=1e-2, warmup_steps=5, log_every=1000, progress=False,
              log=lambda m: None)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lin in heads.lm_heads:
            lin.weight.add_(torch.randn(lin.weight.shape, generator=g) * lin.weight.std() * scale)
    return heads


@pytest.fixture(scope="module")
def setups():
    out = {}
    for fam in FAMILIES:
        model = make_model(fam, seed=0)
        ids, mask = _prompts()
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        out[fam] = (model, _noisy_heads(model), ref)
    return out


def _state_of(cache):
    """Committed SSM / conv state and the committed KV columns of every row."""
    out = []
    for layer in cache.ssm.values():
        out += [layer.ssm_state().clone(), layer.conv_state().clone()]
    for k, v in cache.kv.values():
        for b in range(cache.batch):
            cols = slice(int(cache.pad[b]), int(cache.seq_len[b]))
            out += [k[b, :, cols].clone(), v[b, :, cols].clone()]
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_exact_chain_and_tree(setups, family, strategy):
    model, heads, ref = setups[family]
    ids, mask = _prompts()
    runs = {}
    for tree in (None, "default", SMALL_TREE):
        sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree=tree), rollback=strategy, num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
        assert torch.equal(out, ref), (family, strategy, tree)
        runs[str(tree)] = (sd.last_stats, _state_of(sd.last_cache))
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
    ids, mask = _prompts()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    eos = int(plain[1, ids.shape[1] + 9])  # row 1 stops at its 10th new token (or earlier), mid-step
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos)
    drafter = OracleTree(_rows(ref, ids, mask), model.config.vocab_size)
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
    ids, mask = _prompts()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    strategy = STRATEGIES[len(family) % len(STRATEGIES)]
    sd = specdec.wrap(model, drafter=OracleTree(_rows(ref, ids, mask), model.config.vocab_size), rollback=strategy,
                      num_speculative_tokens=4)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), ref), strategy
    assert sd.last_stats.mean_accepted_tokens > 2


def test_oracle_tree_with_repetition_penalty_and_min_length():
    model = make_model("qwen3_5", seed=0)
    ids, mask = _prompts()
    kw = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0, "repetition_penalty": 1.4,
          "min_new_tokens": 6, "eos_token_id": 5}
    ref = model.generate(ids, attention_mask=mask, **kw)
    sd = specdec.wrap(model, drafter=OracleTree(_rows(ref, ids, mask), 96), rollback="replay", num_speculative_tokens=4)
    assert torch.equal(sd.generate(ids, attention_mask=mask, **kw), ref)
    assert sd.last_stats.mean_accepted_tokens > 2


@needs_triton_interpreter
@pytest.mark.parametrize("family,strategy", [("qwen3_5", "replay"), ("nemotron_h", "snapshot"), ("kimi_linear", "ring")])
def test_oracle_tree_on_the_triton_backend(family, strategy, monkeypatch):
    """On the Triton backend (here its CPU interpreter) tree steps run the Triton tree kernels --
    the torch tree references raise if called -- and the output stays exact."""
    import specdec.kernels.conv1d as conv_reference  # where the conv op finds its torch reference
    from specdec.kernels import GDNOp, Mamba2Op

    def torch_tree_path(*args, **kwargs):
        raise AssertionError("a tree step on the Triton backend ran the torch tree reference")

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setattr(Mamba2Op, "tree_verify", torch_tree_path)
    monkeypatch.setattr(GDNOp, "tree_verify", torch_tree_path)  # KDA inherits it
    monkeypatch.setattr(conv_reference, "conv1d_tree_verify", torch_tree_path)
    model = make_model(family, seed=0)
    ids, mask = ragged_prompts(batch=2, lengths=(9, 6), seed=3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter=OracleTree(_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      rollback=strategy, num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values())
    assert torch.equal(out, ref)
    assert sd.last_stats.mean_accepted_tokens > 1.5  # tree steps ran (and accepted)


def test_sampling_tree_keeps_the_target_distribution():
    V, N, P = 8, 2500, 3
    target = make_model("qwen3_5", seed=3, vocab=V)
    heads = MedusaHeads.from_target(target, num_heads=2, vocab_bias=True)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]]).repeat(N, 1)
    kw = {"temperature": 0.8, "top_k": 6, "top_p": 0.95}
    hf = target.generate(prompt, max_new_tokens=P, do_sample=True, pad_token_id=0, **kw)
    sd = specdec.wrap(target, drafter=MedusaDrafter(heads, tree=[[0], [1], [2], [0, 0], [1, 0], [0, 1]]),
                      rollback="snapshot", num_speculative_tokens=2)
    out = sd.generate(prompt, max_new_tokens=P, do_sample=True, generator=torch.Generator().manual_seed(11),
                      pad_token_id=0, **kw)
    assert 0 < sd.last_stats.acceptance_rate < 1
    L = prompt.shape[1]
    for j in range(P):
        a = torch.bincount(hf[:, L + j], minlength=V)
        b = torch.bincount(out[:, L + j], minlength=V)
        table = torch.stack([a, b]).numpy()
        table = table[:, table.sum(0) > 0]
        p = chi2_contingency(table)[1] if table.shape[1] > 1 else 1.0
        assert p > 1e-3, f"position {j}: HF {a.tolist()} vs specdec {b.tolist()} (p={p:.2e})"


def test_typical_acceptance_runs(setups):
    model, heads, ref = setups["qwen3_5"]
    ids, mask = _prompts()
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


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_static_path_tree_exact_and_same_stats_as_eager(setups, family, strategy):
    """Tree drafting on the static decode path (fixed shapes, device-side acceptance and path
    commit: what the CUDA-graph path captures) gives plain greedy's output and the eager tree
    loop's acceptance counts; a second call reuses the bucket."""
    model, heads, ref = setups[family]
    ids, mask = _prompts()
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
    ids, mask = _prompts()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    eos = int(plain[1, ids.shape[1] + 9])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos)
    drafter = OracleTree(_rows(ref, ids, mask), model.config.vocab_size)
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
    ids, mask = _prompts()
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
def test_static_path_tree_on_the_triton_backend(monkeypatch):
    """The static path's tree steps run the Triton tree kernels (interpreter here), exactly."""
    import specdec.kernels.conv1d as conv_reference  # where the conv op finds its torch reference
    from specdec.kernels import GDNOp

    def torch_tree_path(*args, **kwargs):
        raise AssertionError("a tree step on the Triton backend ran the torch tree reference")

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setattr(GDNOp, "tree_verify", torch_tree_path)
    monkeypatch.setattr(conv_reference, "conv1d_tree_verify", torch_tree_path)
    model = make_model("qwen3_5", seed=0)
    ids, mask = ragged_prompts(batch=2, lengths=(9, 6), seed=3)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter=OracleTree(_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      rollback="replay", num_speculative_tokens=3, decode_path="static")
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0), ref)
    assert all(layer.op.kernels is not None for layer in sd.last_cache.ssm.values())
    assert sd.last_stats.decode_path == "static" and sd.last_stats.mean_accepted_tokens > 1.5


def test_tree_tables_are_cached_and_can_be_held():
    """The tree index tables are made once per (tree, device) -- no host-to-device copy in a
    captured step -- and a holder of cached_tensors() keeps them past the caches' eviction (the
    static decoder holds the ones its CUDA graphs read)."""
    from specdec.kernels import tree_index

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
    ids, mask = _prompts()
    sd = specdec.wrap(model, drafter=MedusaDrafter(copy.deepcopy(heads), tree="default"), num_speculative_tokens=2,
                      decode_path="static")
    with pytest.raises(ValueError, match="repetition_penalty"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, repetition_penalty=1.3)

    class Short(OracleTree):
        def propose_tree(self, input_ids, lengths, spec):
            return super().propose_tree(input_ids, lengths, spec)[:, :-1]

    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter=Short(_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      num_speculative_tokens=3, decode_path="static")
    with pytest.raises(ValueError, match=r"propose_tree must return node tokens \[3, 10\], got \(3, 9\)"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)

    class OutOfVocab(OracleTree):
        def propose_tree(self, input_ids, lengths, spec):
            return super().propose_tree(input_ids, lengths, spec) + 1000

    sd = specdec.wrap(model, drafter=OutOfVocab(_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                      num_speculative_tokens=3, decode_path="static")
    with pytest.raises(ValueError, match=r"token ids outside the target's vocabulary \[0, 96\)"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)

    class FloatNodes(OracleTree):
        def propose_tree(self, input_ids, lengths, spec):
            return super().propose_tree(input_ids, lengths, spec).float()

    for path in ("eager", "static"):  # one check (specdec.tree.check_tree_nodes) on both loops
        sd = specdec.wrap(model, drafter=FloatNodes(_rows(ref, ids, mask), 96, tree=SMALL_TREE, num_heads=3),
                          num_speculative_tokens=3, decode_path=path)
        with pytest.raises(TypeError, match=r"dtype torch.float32; expected an integer dtype"):
            sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)


def test_acceptance_experiment_with_a_tree(tmp_path):
    from hydra import compose, initialize_config_dir

    from specdec.experiments.app import CONF_DIR, run_experiment

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
