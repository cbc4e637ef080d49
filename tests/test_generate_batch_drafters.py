"""Continuous batching (``SpeculativeGenerator.generate_batch``) with drafters that keep per-row
state (``Drafter.admit``): the draft-model, MTP and Medusa drafters, chains and trees. With more
requests than rows (different prompt lengths and budgets, EOS inside a step), every request's
tokens equal HF greedy ``generate`` on its prompt alone (fp32); and every proposal a live row
makes equals the first proposal of ``generate()`` on that row's text alone, so the drafter's rows
were reset to each new request and the other rows kept theirs (a drafter whose state went wrong
stays exact but proposes other tokens). Eager path for every family x strategy, the static path
for a few; sampling."""

from __future__ import annotations

import pytest
import torch
from helpers import fit_mtp_layers, perturb_heads, rel_err
from markers import needs_cuda, needs_triton_interpreter
from test_generate_batch import ROWS, SHAPES, _alone, _check, _prompts, _reference
from test_mtp import MTP_FIELDS
from tiny_models import FAMILIES, VOCAB, get_model, make_model
from tree_drafters import SMALL_TREE, OracleTree

import specdec
from specdec.drafters import DraftModelDrafter, Drafter, MedusaDrafter, MedusaHeads, MTPDrafter
from specdec.drafters.mtp import mtp_layers_for
from specdec.rollback import STRATEGIES, SnapshotRollback

K = 3
#: families whose config has an MTP layout (Kimi Linear ships none)
MTP_FAMILIES = tuple(f for f in FAMILIES if f != "kimi_linear")

_MTP: dict = {}


def mtp_target(family, device: str = "cpu"):
    """``(target, layers)``: a copy of ``family``'s tiny target (same weights as ``get_model``) on
    ``device`` whose config declares one MTP layer (``test_mtp.MTP_FIELDS``), and MTP layers fitted
    there to the target's own greedy continuations of the test prompts, so that steps accept none,
    some or all drafts. (Off the CPU, those continuations are the copy's own: transformers runs
    a CPU model's Gated DeltaNet through flash-linear-attention's GPU kernels where both are
    installed, which fails.)"""
    if (family, device) not in _MTP:
        target = make_model(family).to(device)
        for k, v in MTP_FIELDS[family].items():
            setattr(target.config, k, v)
        full = (_reference(family)[4] if device == "cpu"
                else [p + _alone(target, p, b, None) for p, (_, b) in zip(_prompts(), SHAPES)])
        width = max(len(f) for f in full)
        torch.manual_seed(0)
        layers = mtp_layers_for(target)
        layers.init_weights(target)
        fit_mtp_layers(target, layers, torch.tensor([f + f[-1:] * (width - len(f)) for f in full]), 40)
        _MTP[family, device] = (target, layers)
    return _MTP[family, device]


def setup(kind, family, strategy="snapshot"):
    """``(target, make)``: the target and a factory of fresh, equal drafters of ``kind``:
    ``"draft_model"`` (a noisy copy of the target with its own rollback ``strategy``), ``"mtp"`` /
    ``"mtp_tree"`` (:func:`mtp_target`), ``"medusa"`` / ``"medusa_tree"`` (unfitted heads from the
    target's LM head, perturbed) or ``"oracle_tree"`` (:class:`TextOracleTree`)."""
    if kind == "draft_model":
        return get_model(family), lambda: DraftModelDrafter(get_model(family, "perturbed"), rollback=strategy)
    if kind in ("mtp", "mtp_tree"):
        target, layers = mtp_target(family)
        return target, lambda: LoggingMTP(target, layers, tree=SMALL_TREE if kind == "mtp_tree" else None)
    model = get_model(family)
    if kind in ("medusa", "medusa_tree"):
        heads = perturb_heads(MedusaHeads.from_target(model, num_heads=3), scale=1.0)
        return model, lambda: MedusaDrafter(heads, tree=SMALL_TREE if kind == "medusa_tree" else None)
    return model, lambda: TextOracleTree(_reference(family)[4])


class LoggingMTP(MTPDrafter):
    """An MTP drafter that keeps the logits of each proposal's first drafting step (``first_logits
    [B, V]``): they depend on nothing but the row's MTP cache, hidden state and pending token, so
    they show a state that went wrong where the drafted tokens happen to stay the same."""

    first_logits = None

    def _propose(self, *args, **kwargs):
        self.first_logits = None
        return super()._propose(*args, **kwargs)

    def draft_logits(self, hidden):
        logits = super().draft_logits(hidden)
        if self.first_logits is None:
            self.first_logits = logits.clone()
        return logits


class TextOracleTree(OracleTree):
    """:class:`OracleTree` that finds each row's reference among known sequences by the row's text,
    so it needs no per-row state (``stateless``): a random path of the tree holds the reference
    tokens, off the first branch too (the accepted path is compacted)."""

    stateless = True

    def __init__(self, sequences):
        super().__init__([], VOCAB, tree=SMALL_TREE, num_heads=3)
        self.sequences = [torch.tensor(s) for s in sequences]

    def propose_tree(self, input_ids, lengths, spec):
        texts = [input_ids[b, :L] for b, L in enumerate(lengths.tolist())]
        self.ref = [next(s for s in self.sequences if torch.equal(s[:len(t)], t)) for t in texts]
        return super().propose_tree(input_ids, lengths, spec)


class Recorded(Drafter):
    """Runs ``inner`` and records every proposal: the rows' texts, what they proposed (chain
    drafts ``[B, K]`` or tree node tokens ``[B, N-1]``) and, from a :class:`LoggingMTP`, its
    first step's logits; and which requests :meth:`admit` gave to which rows."""

    def __init__(self, inner):
        self.inner = inner
        self.proposals = []  # (texts: list of token lists, proposal [B, w], first-step logits [B, V] or None)
        self.admitted = []  # (rows, request indices) of each admit()
        for name in ("tree", "acceptance", "posterior_threshold", "posterior_alpha", "stateless",
                     "wants_hidden_states", "wants_all_hidden_states"):
            setattr(self, name, getattr(inner, name))

    vocab_size = property(lambda self: self.inner.vocab_size)

    def start(self, **kw):
        self.inner.start(**kw)

    def set_speculation(self, max_speculative_tokens, adaptive):
        self.inner.set_speculation(max_speculative_tokens, adaptive)

    def set_decode_path(self, path):
        self.inner.set_decode_path(path)

    def admit(self, rows, input_ids, attention_mask, hidden_states, requests):
        self.admitted.append((rows.tolist(), [r.index for r in requests]))
        self.inner.admit(rows, input_ids, attention_mask, hidden_states, requests)

    def observe(self, hidden_states):
        self.inner.observe(hidden_states)

    def observe_prompt(self, hidden_states, attention_mask):
        self.inner.observe_prompt(hidden_states, attention_mask)

    def observe_tokens(self, hidden_states, num_tokens):
        self.inner.observe_tokens(hidden_states, num_tokens)

    def draft_probs(self):
        return self.inner.draft_probs()

    def _record(self, input_ids, lengths, proposal):
        logits = getattr(self.inner, "first_logits", None)
        self.proposals.append(([input_ids[b, :L].tolist() for b, L in enumerate(lengths.tolist())],
                               proposal.clone().cpu(), None if logits is None else logits.cpu()))

    def propose(self, input_ids, lengths, num_speculative_tokens):
        drafts, counts = self.inner.propose(input_ids, lengths, num_speculative_tokens)
        self._record(input_ids, lengths, drafts)
        return drafts, counts

    def propose_tree(self, input_ids, lengths, tree):
        nodes = self.inner.propose_tree(input_ids, lengths, tree)
        self._record(input_ids, lengths, nodes)
        return nodes


def first_proposal_alone(target, drafter, text):
    """``(proposal, first-step logits or None)`` of ``drafter``'s first proposal in ``generate()`` of
    ``text[:-1]`` alone (greedy: its first new token is ``text[-1]``, so it proposes on ``text``)."""
    rec = Recorded(drafter)
    sd = specdec.wrap(target, drafter=rec, rollback="replay", num_speculative_tokens=K, decode_path="eager")
    ids = torch.tensor([text[:-1]])
    sd.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, pad_token_id=0)
    texts, proposal, logits = rec.proposals[0]
    assert texts == [text]
    return proposal[0], None if logits is None else logits[0]


def live_rows(texts, family) -> list[int]:
    """The rows whose text is not a finished request's (a finished row's proposals are never used)."""
    prompts, _, _, expected, _ = _reference(family)
    finished = {tuple(p + e) for p, e in zip(prompts, expected)}
    return [row for row, text in enumerate(texts) if tuple(text) not in finished]


def check_proposals(target, make, rec, family) -> int:
    """Every proposal of a live row equals the first proposal of ``generate()`` on the row's text
    alone (an MTP drafter's first-step logits too, to fp32 rounding); returns how many were compared."""
    alone = make()
    checked = 0
    for call, (texts, proposal, logits) in enumerate(rec.proposals):
        for row in live_rows(texts, family):
            want, want_logits = first_proposal_alone(target, alone, texts[row])
            assert torch.equal(proposal[row], want), f"call {call}, row {row}: {proposal[row].tolist()} != " \
                                                     f"{want.tolist()} alone"
            if logits is not None:
                assert rel_err(logits[row], want_logits) < 1e-4, f"call {call}, row {row}"
            checked += 1
    return checked


def run(kind, family, strategy, path="eager", **kw):
    """``generate_batch`` of the test requests through a recorded drafter of ``kind``; checks every
    request against HF greedy alone; returns ``(sd, recorder, target, make)``."""
    prompts, budgets, eos, expected, _ = _reference(family)
    target, make = setup(kind, family, strategy)
    rec = Recorded(make())
    sd = specdec.wrap(target, drafter=rec, rollback=strategy, num_speculative_tokens=K, decode_path=path)
    out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS, **kw)
    _check(out, expected, prompts)
    assert sd.last_stats.decode_path == path
    assert sorted(i for _, idx in rec.admitted for i in idx) == list(range(len(prompts)))
    return sd, rec, target, make


CASES = [(f, kind) for f in FAMILIES for kind in ("draft_model", "mtp") if kind == "draft_model" or f in MTP_FAMILIES]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family, kind", CASES)
def test_exact_across_admissions(family, kind, strategy):
    """Eager path, the draft model with the target's strategy as its own: every request exact,
    drafts accepted and rejected, and (one strategy per drafter) every live row's proposal equals
    its text's first proposal alone."""
    sd, rec, target, make = run(kind, family, strategy)
    hist = sd.last_stats.accept_histogram
    assert hist[0] > 0 and sum(hist[1:]) > 0, hist
    if strategy == "replay":
        assert check_proposals(target, make, rec, family) >= 10


@pytest.mark.parametrize("family, kind, strategy", [("qwen3_5", "draft_model", "snapshot"),
                                                    ("nemotron_h", "mtp", "ring"),
                                                    ("kimi_linear", "draft_model", "replay"),
                                                    ("qwen3_next", "mtp_tree", "replay_deferred")])
def test_static_path(family, kind, strategy):
    """The static path (fixed shapes, the drafters' proposal programs) across admissions, chains
    and a tree: exact, every live row's proposal equal to the eager path's (the rows were reset in
    the programs' own buffers), and a second call runs on the kept buckets."""
    eager = run(kind, family, strategy)[1]
    for _ in range(2):
        sd, rec, target, make = run(kind, family, strategy, path="static")
        assert rec.inner.last_path == "static"
        for (texts, got, _), (texts_eager, want, _) in zip(rec.proposals, eager.proposals, strict=True):
            rows = live_rows(texts, family)
            assert texts == texts_eager and torch.equal(got[rows], want[rows])
    assert len(sd._static) == 1


@pytest.mark.parametrize("family, kind, strategy", [("qwen3_5", "oracle_tree", "ring"),
                                                    ("kimi_linear", "oracle_tree", "snapshot"),
                                                    ("nemotron_h", "medusa_tree", "replay"),
                                                    ("qwen3_next", "mtp_tree", "snapshot"),
                                                    ("qwen3_5", "medusa", "replay_deferred")])
def test_trees_and_medusa(family, kind, strategy):
    """Draft trees through the pool: a stateless tree drafter whose accepted paths leave the first
    branch, Medusa heads and MTP layers drafting trees; and Medusa heads drafting chains. Exact,
    and the stateful drafters' proposals equal their texts' first proposals alone."""
    sd, rec, target, make = run(kind, family, strategy)
    if kind == "oracle_tree":
        assert rec.inner.off_chain > 0 and sum(sd.last_stats.accept_histogram[2:]) > 0
    else:
        assert check_proposals(target, make, rec, family) >= 10


@pytest.mark.parametrize("kind", ["draft_model", "mtp"])
def test_sampling(kind):
    """Sampling through the pool: with top_k=1 the drafters' distributions are one-hot and the
    output is greedy decoding's; at temperature 1 every request keeps its budget, stops at EOS and
    draws ids from the vocabulary, and drafts are accepted and rejected."""
    family = "qwen3_5"
    run(kind, family, "ring", do_sample=True, top_k=1)
    prompts, budgets, eos, _, _ = _reference(family)
    target, make = setup(kind, family)
    sd = specdec.wrap(target, drafter=make(), rollback="replay", num_speculative_tokens=K)
    torch.manual_seed(0)
    out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS, do_sample=True,
                            temperature=1.0)
    for i, budget in enumerate(budgets):
        gen = out[f"req_{i}"].generated_tokens
        assert 1 <= len(gen) <= budget and all(0 <= t < VOCAB for t in gen)
        assert eos not in gen[:-1] and (len(gen) == budget or gen[-1] == eos)
    assert 0 < sd.last_stats.accepted_tokens < sd.last_stats.proposed_tokens


@needs_triton_interpreter
@pytest.mark.slow
def test_triton_backend_fused_replay(monkeypatch):
    """Target and draft model on the Triton kernels (here through Triton's CPU interpreter), both with
    eager replay, whose committed history is folded inside the next verify: a draft step is open
    when its rows are admitted, and the reset waits for its commit."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    family = "nemotron_h"
    prompts, budgets, eos, expected, _ = _reference(family)
    drafter = DraftModelDrafter(get_model(family, "perturbed"), rollback="replay")
    sd = specdec.wrap(get_model(family), drafter=drafter, rollback="replay", num_speculative_tokens=K,
                      decode_path="eager")
    _check(sd.generate_batch(prompts[:5], max_new_tokens=budgets[:5], eos_token_id=eos, max_batch_size=2),
           expected[:5], prompts[:5])
    assert all(layer.op.kernels is not None for layer in drafter.cache.ssm.values())


def test_draft_strategy_must_reset_in_place_on_the_static_path():
    """A draft model whose own strategy reloads its store on reset (new tensors, which a captured
    proposal would not read) is refused on the static path, and runs on the eager path."""
    class Reloading(SnapshotRollback):
        _reset_in_place = None  # reset_rows reloads the store

    family = "qwen3_5"
    prompts, budgets, eos, expected, _ = _reference(family)
    for path in ("static", "eager"):
        sd = specdec.wrap(get_model(family), drafter=DraftModelDrafter(get_model(family, "perturbed"),
                                                                       rollback=Reloading()),
                          num_speculative_tokens=K, decode_path=path)
        if path == "static":
            with pytest.raises(ValueError, match="does not reset rows in place"):
                sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS)
        else:
            _check(sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS),
                   expected, prompts)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family, kind, strategy", [("qwen3_5", "draft_model", "snapshot"),
                                                    ("kimi_linear", "draft_model", "replay"),
                                                    ("nemotron_h", "mtp", "ring"),
                                                    ("qwen3_5", "mtp_tree", "replay")])
def test_cuda_graph_path_across_admissions(family, kind, strategy):
    """On CUDA (fp32 tiny models): generate_batch with the captured verify and proposal programs
    (the draft model's two, the MTP layers') across admissions gives every request the eager
    path's tokens on the same device. Everything runs on CUDA, the references too (with
    flash-linear-attention installed, transformers runs its kernels on CPU tensors as well)."""
    moved = [get_model(family), get_model(family, "perturbed")]
    for m in moved:
        m.cuda()
    try:
        prompts, budgets, eos, _, _ = _reference(family)
        if kind.startswith("mtp"):
            target, layers = mtp_target(family, "cuda")
            def make():
                return MTPDrafter(target, layers, tree=SMALL_TREE if kind == "mtp_tree" else None)
        else:
            target = moved[0]
            def make():
                return DraftModelDrafter(moved[1], rollback=strategy)
        outs = {}
        for path in ("eager", "cuda_graph"):
            drafter = make()
            sd = specdec.wrap(target, drafter=drafter, rollback=strategy, num_speculative_tokens=K, decode_path=path)
            out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS)
            assert sd.last_stats.decode_path == path, sd.last_stats.capture_error
            assert getattr(drafter, "last_path", path) == path
            outs[path] = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
            sd.release()
        assert outs["eager"] == outs["cuda_graph"]
    finally:
        for m in moved:
            m.cpu()


@pytest.mark.parametrize("family, kind, strategy", [("qwen3_5", "draft_model", "ring"), ("qwen3_5", "mtp", "replay"),
                                                    ("nemotron_h", "mtp", "snapshot"),
                                                    ("nemotron_h", "draft_model", "replay")])
def test_prefix_caching_with_drafters(family, kind, strategy):
    """Prefix caching with a drafter that keeps per-row state (the draft model prefills its own
    cache; MTP layers get every prompt position's hidden state, cached with the blocks): prompts
    sharing a prefix of several blocks give every request HF greedy's tokens alone, the same as
    without the cache, and the prefix is served from it."""
    prompts, budgets, eos, _, _ = _reference(family)
    shared = prompts[0][:6] + prompts[2][:6]  # three blocks of 4
    prompts = [shared + p for p in prompts]
    target, make = setup(kind, family, strategy)
    expected = [_alone(target, p, b, eos) for p, b in zip(prompts, budgets)]
    for caching in (False, True):
        sd = specdec.wrap(target, drafter=make(), rollback=strategy, num_speculative_tokens=K, decode_path="eager")
        out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS,
                                prefix_caching=caching, prefix_block_size=4)
        _check(out, expected, prompts)
    # the first prompt stores the blocks' keys / values, the second their SSM state (a branch
    # point), every later one loads the shared blocks
    assert sd.last_stats.prefix_cache["hit_tokens"] >= (len(prompts) - 2) * 12
