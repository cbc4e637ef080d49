"""The n-gram drafter's Triton kernel (``specdec.kernels.ngram``) against the per-row reference
``propose_ngram_reference``, through Triton's interpreter at tiny sizes (``conftest`` sets
``TRITON_INTERPRET=1``); the drafter's choice of search; greedy exactness with the kernel.

Output buffers are poisoned before each launch, so a draft or count the kernel fails to write
shows up as a mismatch. ``SPECDEC_TEST_CUDA=1`` runs the comparisons on the GPU instead.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from markers import ON_CUDA, needs_cuda, needs_triton_interpreter

from specdec.drafters import NGramDrafter
from specdec.drafters.ngram import HOST_SEARCH_MAX_BATCH, SEARCHES, propose_ngram_reference
from specdec.kernels.ngram import NGRAM

DEVICE = "cuda" if ON_CUDA else "cpu"
POISON = -7  # never a token id nor a count


def kernel_propose(ids, lengths, K, lo, hi, block=None):
    """The kernel's proposal into poisoned output buffers."""
    from specdec.kernels.ngram.triton_ngram import ngram_propose_triton

    B = ids.shape[0]
    out = (torch.full((B, K), POISON, dtype=torch.long, device=ids.device),
           torch.full((B,), POISON, dtype=torch.long, device=ids.device))
    got = ngram_propose_triton(ids, lengths, K, lo, hi, out=out, block=block)
    assert got[0] is out[0] and got[1] is out[1]
    return got


def assert_matches_reference(ids, lengths, K, lo, hi, block=None):
    drafts, counts = kernel_propose(ids, lengths, K, lo, hi, block)
    ref_drafts, ref_counts = propose_ngram_reference(ids, lengths, K, lo, hi)
    assert torch.equal(counts.cpu(), ref_counts.cpu()), f"counts {counts.tolist()} != {ref_counts.tolist()}"
    assert torch.equal(drafts.cpu(), ref_drafts.cpu()), f"drafts {drafts.tolist()} != {ref_drafts.tolist()}"


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    B=st.integers(1, 17), W=st.integers(1, 40), K=st.integers(1, 8), vocab=st.integers(1, 5),
    ngrams=st.sampled_from([(1, 1), (1, 3), (2, 3), (2, 2), (3, 5), (1, 6)]), block=st.sampled_from([16, 32]),
    strided=st.booleans(), seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_per_row_reference(B, W, K, vocab, ngrams, block, strided, seed):
    """Random texts over tiny vocabularies (many repeats, matches anywhere, texts shorter than
    max_ngram), ragged lengths 0..W with 0, 1 and 2 always among them, K often past the text's
    end, blocks of 16 / 32 ends (W mostly not a multiple: several blocks and a partial one),
    entries past each row's end random tokens that must be ignored, and a text that is a slice
    of a wider buffer (row stride != W)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randint(0, vocab, (B, W + 5 * strided), generator=g)
    ids = wide[:, :W].to(DEVICE)
    lengths = torch.randint(0, W + 1, (B,), generator=g)
    lengths[: min(B, 3)] = torch.tensor([0, 1, 2])[: min(B, 3)].clamp(max=W)
    assert_matches_reference(ids, lengths.to(DEVICE), K, *ngrams, block=block)


#             text, length, K, (min, max): drafts, count (the reference's, spelled out)
EDGE_CASES = [
    pytest.param([4, 5, 6, 4, 5, 9, 4, 5], 8, 3, (1, 3), [9, 4, 5], 3, id="most-recent-2gram"),
    pytest.param([4, 5, 1, 2, 3, 4, 5], 7, 4, (2, 2), [1, 2, 3, 4], 4, id="match-at-the-very-start"),
    pytest.param([7, 7, 7, 7, 7], 5, 3, (1, 3), [7, 0, 0], 1, id="repeats-continuation-cut-at-end"),
    pytest.param([1, 2, 3, 1], 4, 8, (1, 3), [2, 3, 1, 0, 0, 0, 0, 0], 3, id="K-past-the-text"),
    pytest.param([1, 2, 1, 2], 4, 2, (3, 5), [0, 0], 0, id="shorter-than-min-ngram-run"),
    pytest.param([3, 3], 2, 2, (1, 3), [3, 0], 1, id="L2"),
    pytest.param([3, 9], 1, 2, (1, 3), [0, 0], 0, id="L1"),
    pytest.param([3, 9], 0, 2, (1, 3), [0, 0], 0, id="L0"),
    pytest.param([1, 2, 3, 9, 2, 3, 5, 3], 8, 2, (1, 2), [5, 3], 2, id="longest-n-falls-back-to-1"),
]


@pytest.mark.parametrize("text,length,K,ngrams,drafts,count", EDGE_CASES)
def test_kernel_edge_cases(text, length, K, ngrams, drafts, count):
    ids = torch.tensor([text], device=DEVICE)
    lengths = torch.tensor([length], device=DEVICE)
    ref = propose_ngram_reference(ids, lengths, K, *ngrams)
    assert ref[0].tolist() == [drafts] and ref[1].tolist() == [count]
    got = kernel_propose(ids, lengths, K, *ngrams, block=16)
    assert got[0].tolist() == [drafts] and got[1].tolist() == [count]


def test_kernel_walks_several_blocks_to_the_most_recent_longest_match():
    """A 3-gram early in a long text and a 2-gram of the suffix in a later block: the 3-gram wins;
    two occurrences of the 3-gram in different blocks: the later one."""
    g = torch.Generator().manual_seed(3)
    W = 150
    ids = torch.randint(10, 60, (2, W), generator=g)
    ids[:, -3:] = torch.tensor([1, 2, 3])
    ids[0, 5:9] = torch.tensor([1, 2, 3, 4])  # block 0
    ids[0, 100:103] = torch.tensor([2, 3, 5])  # block 6: a 2-gram only
    ids[1, 5:9] = torch.tensor([1, 2, 3, 4])
    ids[1, 70:74] = torch.tensor([1, 2, 3, 6])  # later 3-gram
    lengths = torch.tensor([W, W])
    drafts, counts = kernel_propose(ids.to(DEVICE), lengths.to(DEVICE), 2, 1, 3, block=16)
    assert counts.tolist() == [2, 2]
    assert drafts[:, 0].tolist() == [4, 6]
    assert_matches_reference(ids.to(DEVICE), lengths.to(DEVICE), 2, 1, 3, block=16)


def test_kernel_rejects_bad_arguments():
    from specdec.kernels.ngram.triton_ngram import ngram_propose_triton

    ids, lengths = torch.zeros(2, 5, dtype=torch.long, device=DEVICE), torch.full((2,), 5, device=DEVICE)
    with pytest.raises(ValueError, match=r"input_ids must be a \[B, W\] integer"):
        ngram_propose_triton(ids.float(), lengths, 2)
    with pytest.raises(ValueError, match=r"lengths must be a \[2\] integer"):
        ngram_propose_triton(ids, lengths[:1], 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ngram_propose_triton(ids, lengths, -1)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        ngram_propose_triton(ids, lengths, 2, 3, 2)
    with pytest.raises(ValueError, match=r"out drafts must be a contiguous int64 \[2, 2\]"):
        ngram_propose_triton(ids, lengths, 2, out=(torch.zeros(2, 3, dtype=torch.long, device=DEVICE),
                                                   torch.zeros(2, dtype=torch.long, device=DEVICE)))


# ----------------------------------------------------------------------------------------------
# the drafter's choice of search


@needs_triton_interpreter
@pytest.mark.parametrize("ngrams", [(True, 3), (1, 2.0), (0, 2), (3, 2)])
def test_the_drafter_refuses_ngram_lengths_that_are_not_ints_in_order(ngrams):
    """NGramDrafter takes two ints 1 <= min_ngram <= max_ngram; a bool, a float or an order
    outside that is refused naming them."""
    from specdec.drafters import NGramDrafter

    with pytest.raises(ValueError, match=r"need integers 1 <= min_ngram <= max_ngram, got "):
        NGramDrafter(*ngrams)


def test_propose_takes_the_kernel_on_the_triton_backend(monkeypatch):
    """SPECDEC_BACKEND=triton: the kernel at every batch size (the searches that are not chosen
    must not run); torch backend on the CPU: the loop up to HOST_SEARCH_MAX_BATCH rows, then the
    batched search. The same proposals every way."""
    ran = []
    for name in ("propose_kernel", "propose_batched"):
        orig = getattr(NGramDrafter, name)
        monkeypatch.setattr(NGramDrafter, name, lambda self, *a, _o=orig, _n=name: ran.append(_n) or _o(self, *a))
    drafter = NGramDrafter(1, 3)
    g = torch.Generator().manual_seed(1)
    for backend, expect in (("triton", ["kernel", "kernel"]), ("torch", ["loop", "batched"])):
        monkeypatch.setenv("SPECDEC_BACKEND", backend)
        for B, want in zip((1, HOST_SEARCH_MAX_BATCH + 1), expect):
            ids = torch.randint(0, 4, (B, 24), generator=g)
            lengths = torch.randint(0, 25, (B,), generator=g)
            ran.clear()
            assert drafter.search(ids) == want and want in SEARCHES
            drafts, counts = drafter.propose(ids, lengths, 3)
            assert ran == ({"kernel": ["propose_kernel"], "batched": ["propose_batched"], "loop": []}[want])
            ref = propose_ngram_reference(ids, lengths, 3)
            assert torch.equal(drafts, ref[0]) and torch.equal(counts, ref[1])
    assert NGRAM.kernels is None, "the shared torch-backend op must stay unbound"


@needs_triton_interpreter
def test_greedy_speculation_with_the_kernel_is_exact(monkeypatch):
    """Greedy speculative generation with the n-gram drafter on its Triton kernel (the model's own
    ops on the torch backend: interpreted, they take minutes) equals the model's greedy
    ``generate``, ragged batch, with drafts accepted and rejected along the way."""
    import specdec
    from helpers import counting_forwards, hf_greedy
    from tiny_models import get_model, ragged_prompts

    ran, forwards = [], counting_forwards(monkeypatch)
    orig = NGramDrafter.propose_kernel
    monkeypatch.setattr(NGramDrafter, "propose_kernel", lambda self, *a: ran.append(1) or orig(self, *a))
    monkeypatch.setattr(NGramDrafter, "search", lambda self, ids: "kernel")
    model = get_model("nemotron_h")
    ids, mask = ragged_prompts(3)
    ref = hf_greedy(model, ids, mask, 40)
    sd = specdec.wrap(model, drafter=NGramDrafter(1, 3), rollback="replay", num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    # every step drafted with the kernel, a step launched past the call's end (dropped) included
    # (generate()'s step overlap: one where the call ended before the step count the host knows)
    assert len(ran) == len(forwards) and len(forwards) - sd.last_stats.steps in (0, 1), \
        "a step drafted without the kernel"
    assert torch.equal(out, ref)
    assert 0 < sd.last_stats.accepted_tokens < sd.last_stats.proposed_tokens


@needs_triton_interpreter
def test_ngram_proposal_experiment_times_the_kernel(monkeypatch, tmp_path):
    """experiment=ngram_proposal on the Triton backend: a kernel column beside the loop and the
    batched search (all checked to propose the same first), the search propose takes, and with
    experiment.plain_step_ms that search's median as a fraction of the step; the kernel also timed
    back to back (on a CPU, wall time per call)."""
    from hydra import compose, initialize_config_dir

    from specdec.experiments.app import CONF_DIR, run_experiment

    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "experiment=ngram_proposal", "experiment.batch_grid=[1,3]", "experiment.widths=[24]", "repeats=2",
            "experiment.warmup=0", "experiment.plain_step_ms=2.5", "experiment.graph_calls=2", "device=cpu",
            "progress=false"])
    records = run_experiment(cfg, tmp_path)
    assert [(r["batch"], r["width"], r["search"]) for r in records] == [(1, 24, "kernel"), (3, 24, "kernel")]
    for r in records:
        assert r["same_proposals"] and 0 < r["kernel_ms_min"] <= r["kernel_ms"] <= r["kernel_ms_max"]
        assert r["propose_over_plain_step"] == pytest.approx(r["kernel_ms"] / 2.5)
        assert r["batched_over_kernel"] == pytest.approx(r["batched_ms"] / r["kernel_ms"])
        assert r["kernel_in_graph_ms"] > 0
        assert r["kernel_in_graph_over_plain_step"] == pytest.approx(r["kernel_in_graph_ms"] / 2.5)
    header = next(ln for ln in (tmp_path / "summary.md").read_text().splitlines() if ln.startswith("| batch |"))
    assert {"kernel ms", "batched ms", "per-row loop ms", "propose takes", "of a plain step", "kernel in a graph ms",
            "in a graph, of a plain step"} <= {
        c.strip() for c in header.split("|")}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("vocab", [64, 50_000])
def test_kernel_real_size(B, vocab):
    """The compiled kernel at a 4k prompt plus 512 new tokens (several default blocks), ragged
    rows, texts with many repeats (vocab 64) and with few: equal to the reference, and so is
    NGramDrafter.propose, which takes it on CUDA."""
    g = torch.Generator().manual_seed(B + vocab)
    W = 4096 + 512
    ids = torch.randint(0, vocab, (B, W), generator=g)
    ids[:, W - 40 :] = ids[:, 100:140]  # a long repeat: the longest n-gram matches early in the text
    lengths = torch.randint(W - 64, W + 1, (B,), generator=g)
    lengths[0] = W
    assert_matches_reference(ids.cuda(), lengths.cuda(), 8, 1, 3)
    drafter = NGramDrafter(2, 4)
    assert drafter.search(ids.cuda()) == "kernel"
    got = drafter.propose(ids.cuda(), lengths.cuda(), 8)
    ref = propose_ngram_reference(ids, lengths, 8, 2, 4)
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])


@pytest.mark.gpu
@needs_cuda
def test_greedy_speculation_on_cuda_is_exact():
    """On CUDA (every op and the n-gram search on their Triton kernels, no patching): greedy
    speculative generation equals the model's greedy ``generate``, ragged batch."""
    import specdec
    from helpers import hf_greedy
    from tiny_models import make_model, ragged_prompts

    model = make_model("nemotron_h").cuda()
    ids, mask = (t.cuda() for t in ragged_prompts(3))
    ref = hf_greedy(model, ids, mask, 40)
    drafter = NGramDrafter(1, 3)
    assert drafter.search(ids) == "kernel"
    sd = specdec.wrap(model, drafter=drafter, rollback="replay", num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref) and sd.last_stats.proposed_tokens > 0
