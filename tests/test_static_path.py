"""The static decode path: fixed shapes, device-side bookkeeping, one host sync per step, CUDA
graphs on CUDA. On CPU it runs the same static calls without graphs; it must give
exactly the eager path's / HF's greedy output. Also plain decoding (K = 0) and the
controlled-acceptance OracleDrafter the benchmarks use."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch._dynamo.config as dynamo_config
from helpers import (
    ALL_STRATEGIES, MAX_NEW, StreamRecorder, hf_greedy, hf_states, make_drafter, medusa_prompts, reference, rel_err,
)
from markers import needs_cuda, needs_triton_interpreter
from tiny_models import VOCAB, get_model
from tree_drafters import OracleTree, reference_rows

import specdec
from specdec.drafters import Drafter, OracleDrafter
from specdec.engine import MAX_SPECULATIVE_TOKENS
from specdec.fusion import fused
from specdec.graphs import CapturedProgram, _host_syncing_experts, capture, capture_blocker, gc_paused, graph_safe_experts
from specdec.rollback import STRATEGIES, InPlaceUpdate


@pytest.mark.parametrize("K", [0, 2, 4])
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_static_greedy_exact_vs_hf(family, strategy, K):
    ids, mask, eos, ref = reference(family)
    sd = specdec.wrap(get_model(family), drafter=make_drafter("perturbed", family), rollback=strategy,
                      num_speculative_tokens=K, decode_path="static")
    for _ in range(2):  # the second call reuses the bucket's buffers (copy_from)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), f"\n{out[:, ids.shape[1]:]}\n{ref[:, ids.shape[1]:]}"
        st = sd.last_stats
        assert st.decode_path == "static" and st.capture_error is None
        assert len(st.accept_histogram) == K + 1 and sum(st.accept_histogram) > 0
        assert 1.0 <= st.mean_accepted_tokens <= K + 1
        if K == 0:
            assert st.mean_accepted_tokens == 1.0 and st.proposed_tokens == 0
        gen = ref[:, ids.shape[1]:]
        expected = sum(int((r == eos).nonzero()[0, 0]) + 1 if bool((r == eos).any()) else r.numel() for r in gen)
        assert st.new_tokens == expected
    assert len(sd._static) == 1


def test_static_matches_eager_stats(family):
    """Same tokens and the same acceptance counts as the eager loop (the bookkeeping is the same
    computation, moved to the device)."""
    ids, mask, eos, _ = reference(family)
    got = {}
    for path in ("eager", "static"):
        sd = specdec.wrap(get_model(family), drafter=make_drafter("perturbed", family), rollback="ring",
                          num_speculative_tokens=3, decode_path=path)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        st = sd.last_stats
        got[path] = (out, st.accept_histogram, st.proposed_tokens, st.accepted_tokens, st.new_tokens)
    assert torch.equal(got["eager"][0], got["static"][0])
    assert got["eager"][2:] == got["static"][2:]
    assert got["static"][1][1:] == got["eager"][1][1:]  # zero-accept counts differ only by padded rows


def test_plain_decoding_eager_exact(family):
    ids, mask, eos, ref = reference(family)
    sd = specdec.wrap(get_model(family), drafter="ngram", num_speculative_tokens=0, decode_path="eager")
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)
    assert sd.last_stats.mean_accepted_tokens == 1.0 and sd.last_stats.accept_histogram[0] > 0


def test_static_bucket_reuse_with_other_prompts():
    """A second call with other prompts of the same bucket copies into the captured buffers."""
    model = get_model("qwen3_5")
    sd = specdec.wrap(model, drafter=make_drafter("perturbed", "qwen3_5"), rollback="replay",
                      num_speculative_tokens=3, decode_path="static")
    g = torch.Generator().manual_seed(5)
    for L in (7, 9, 7):
        ids = torch.randint(1, VOCAB, (3, L), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
        assert torch.equal(out, hf_greedy(model, ids, mask, max_new=12))
    assert len(sd._static) == 1


@pytest.mark.parametrize("path", ["eager", "static"])
def test_oracle_drafter_controls_acceptance(path):
    model = get_model("nemotron_h")
    ids, mask = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1)), None
    ref = hf_greedy(model, ids, torch.ones_like(ids), max_new=40)
    K = 4
    for a, lo, hi in ((1.0, K + 1 - 0.5, K + 1), (0.0, 1.0, 1.0), (0.7, 1.5, 3.6)):
        sd = specdec.wrap(model, drafter=OracleDrafter(ref, mask, acceptance=a, seed=3), rollback="replay",
                          num_speculative_tokens=K, decode_path=path)
        out = sd.generate(ids, max_new_tokens=40, pad_token_id=0)
        assert torch.equal(out, ref)
        st = sd.last_stats
        assert lo <= st.mean_accepted_tokens <= hi, (a, st.mean_accepted_tokens)
        if a == 0.0:
            assert st.accepted_tokens == 0 and st.proposed_tokens > 0


def test_oracle_drafter_errors():
    with pytest.raises(ValueError, match="acceptance"):
        OracleDrafter(torch.zeros(2, 5, dtype=torch.long), acceptance=1.5)
    with pytest.raises(ValueError, match="2-D"):
        OracleDrafter(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="does not fit"):
        OracleDrafter(torch.zeros(2, 5, dtype=torch.long), torch.ones(3, 4))
    model = get_model("qwen3_5")
    sd = specdec.wrap(model, drafter=OracleDrafter(torch.ones(2, 9, dtype=torch.long)), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="reference for 2 rows"):
        sd.generate(torch.ones(3, 4, dtype=torch.long), max_new_tokens=3)


class _BadDrafter(Drafter):
    def __init__(self, mode):
        self.mode = mode

    def propose(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        toks = torch.ones(B, K, dtype=torch.long)
        if self.mode == "oov":
            toks[0, 0] = VOCAB + 7
        counts = torch.full((B,), K + 1 if self.mode == "count" else K, dtype=torch.long)
        return toks, counts


@pytest.mark.parametrize("mode", ["oov", "count"])
def test_static_rejects_bad_drafter_output_then_recovers(mode):
    model = get_model("qwen3_5")
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(model, drafter=_BadDrafter(mode), num_speculative_tokens=2, decode_path="static")
    with pytest.raises(ValueError, match="vocabulary" if mode == "oov" else
                       r"num_draft_tokens outside \[0, 2\] \(its draft_tokens have 2 columns"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    sd.drafter = make_drafter("perturbed", "qwen3_5")
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


def test_static_sampling_reproducible_and_top1_is_greedy():
    model = get_model("kimi_linear")
    ids, mask, eos, ref = reference("kimi_linear")
    sd = specdec.wrap(model, drafter=make_drafter("perturbed", "kimi_linear"), rollback="replay",
                      num_speculative_tokens=3, decode_path="static")
    outs = [sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, top_k=20,
                        generator=torch.Generator().manual_seed(11), pad_token_id=0) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    top1 = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, top_k=1, eos_token_id=eos,
                       generator=torch.Generator().manual_seed(0), pad_token_id=0)
    assert torch.equal(top1, ref)


class _TwoSampledDrafts(Drafter):
    """Proposes 2 (< K) drafts per row, the reference continuation, with the distributions they
    were sampled from (``[B, 2, V]``: half the mass on the draft, the rest uniform)."""

    def __init__(self, out, ids, mask):
        self.rows = reference_rows(out, ids, mask)

    def propose(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        drafts = torch.zeros(B, 2, dtype=torch.long)
        for b in range(B):
            nxt = self.rows[b][int(lengths[b]):int(lengths[b]) + 2]
            drafts[b, :len(nxt)] = nxt
        self.probs = torch.full((B, 2, VOCAB), 0.5 / VOCAB).scatter_add_(2, drafts[..., None], torch.full((B, 2, 1), 0.5))
        return drafts, torch.full((B,), 2, dtype=torch.long)

    def draft_probs(self):
        return self.probs


@pytest.mark.parametrize("path", ["eager", "static"])
def test_sampling_drafter_with_fewer_drafts_than_K(path):
    """A drafter may return fewer than K drafts per row, with their distributions ``[B, w, V]``:
    both paths accept them (top-1 sampling equals greedy decoding)."""
    model = get_model("qwen3_5")
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(model, drafter=_TwoSampledDrafts(ref, ids, mask), num_speculative_tokens=4, decode_path=path)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, top_k=1, eos_token_id=eos,
                      generator=torch.Generator().manual_seed(0), pad_token_id=0)
    assert torch.equal(out, ref)
    assert sd.last_stats.accepted_tokens > 0


def test_decode_path_validation():
    model = get_model("qwen3_5")
    with pytest.raises(ValueError, match="decode_path must be one of"):
        specdec.wrap(model, decode_path="fast")
    with pytest.raises(ValueError, match="num_speculative_tokens must be in \\[0"):
        specdec.wrap(model, num_speculative_tokens=-1)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="needs a CUDA model"):
        specdec.wrap(model, decode_path="cuda_graph").generate(ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="does not support repetition_penalty"):
        specdec.wrap(model, decode_path="static").generate(ids, max_new_tokens=2, repetition_penalty=1.2)
    sd = specdec.wrap(model, decode_path="auto")  # auto on CPU: eager
    sd.generate(ids, max_new_tokens=2)
    assert sd.last_stats.decode_path == "eager"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("fam", ["qwen3_5", "nemotron_h", "kimi_linear"])
def test_cuda_graph_path_exact_vs_eager(fam, strategy):
    """On CUDA (fp32 tiny models): CUDA-graph decoding (fused norms) == the eager path, token for token."""
    model = get_model(fam).cuda()
    ids, mask, eos, _ = reference(fam)
    ids, mask = ids.cuda(), mask.cuda()
    outs = {}
    for path in ("eager", "cuda_graph"):
        draft = specdec.drafters.DraftModelDrafter(get_model(fam, "perturbed").cuda())
        sd = specdec.wrap(model, drafter=draft, rollback=strategy, num_speculative_tokens=3, decode_path=path)
        for _ in range(2):
            outs[path] = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert sd.last_stats.decode_path == path, sd.last_stats.capture_error
    assert torch.equal(outs["eager"], outs["cuda_graph"])
    get_model(fam).cpu()
    get_model(fam, "perturbed").cpu()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fam", ["qwen3_5", "nemotron_h", "kimi_linear"])
def test_cuda_graph_plain_decoding_exact_from_the_first_call(fam):
    """On CUDA (fp32 tiny models): plain decoding (K = 0, the in-place update) through CUDA graphs
    equals HF's greedy on a fresh wrapper's first call, whose prefill captures the step's graphs
    (the capture's warm-up runs the in-place update on placeholder tokens), and on the second."""
    model = get_model(fam).cuda()
    ids, mask, eos, ref = (t.cuda() if isinstance(t, torch.Tensor) else t for t in reference(fam))
    sd = specdec.wrap(model, num_speculative_tokens=0, decode_path="cuda_graph")
    for call in range(2):
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert sd.last_stats.decode_path == "cuda_graph", sd.last_stats.capture_error
        assert torch.equal(out, ref), call
    get_model(fam).cpu()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("fam", ["qwen3_5", "nemotron_h", "kimi_linear"])
def test_cuda_graph_tree_exact_vs_eager(fam, strategy):
    """On CUDA (fp32 tiny models): tree drafting through the captured tree forward and path commit
    == plain greedy and == the eager tree loop, with the same acceptance counts. The oracle drafter
    hides the reference on a random (often off-first-branch, often depth-4) path of a 67-node tree,
    and a row stops at EOS mid-step, so deep path commits run inside the graph."""
    model = get_model(fam).cuda()
    ids, mask = medusa_prompts()
    ids, mask = ids.cuda(), mask.cuda()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    eos = int(plain[1, ids.shape[1] + 9])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos)
    got = {}
    for path in ("eager", "cuda_graph"):
        drafter = OracleTree(reference_rows(ref, ids, mask), model.config.vocab_size, seed=0)
        sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=4, decode_path=path)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0, eos_token_id=eos)
        st = sd.last_stats
        assert st.decode_path == path, (path, st.capture_error)
        assert torch.equal(out, ref), path
        got[path] = (st.proposed_tokens, st.accepted_tokens, st.new_tokens, st.accept_histogram, drafter.off_chain)
    assert got["eager"] == got["cuda_graph"]
    assert got["cuda_graph"][3][4] > 0 and got["cuda_graph"][4] > 0  # depth-4 and off-first-branch paths accepted
    get_model(fam).cpu()


def test_capture_blocker_names_the_triton_interpreter(monkeypatch):
    """Under TRITON_INTERPRET=1 (Triton's spellings) no CUDA graph can be captured, and the reason
    names the variable; unset or "0", nothing blocks."""
    for value in ("1", "true", "ON"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert "TRITON_INTERPRET" in capture_blocker()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert capture_blocker() is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert capture_blocker() is None


def test_gc_paused_restores_the_collector():
    """gc_paused turns automatic collection off inside and back to what it was after, also when
    the block raises or the collector was off already."""
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    # two threads' blocks overlapping (A in, B in, A out, B out): off until the last one is out
    import threading

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def thread_b():
        a_in.wait()
        with gc_paused():
            b_in.set()
            a_out.wait()
            seen.append(gc.isenabled())

    b = threading.Thread(target=thread_b)
    b.start()
    with gc_paused():
        a_in.set()
        b_in.wait()
    a_out.set()
    b.join()
    assert seen == [False] and gc.isenabled()


class _Cycle:
    def __init__(self, obj):
        self.obj, self.me = obj, self


@pytest.mark.gpu
@needs_cuda
def test_capture_survives_a_collection_of_a_stray_graph():
    """A CUDA graph only a reference cycle holds (a generator dropped without being freed) is
    destroyed by the next automatic collection; one during a capture invalidated it, failing
    every later random op (PyTorch >= 2.9 no longer collects before capturing). capture() pauses
    the collector: the capture succeeds, its replay computes, random ops work after."""
    x = torch.randn(64, device="cuda")
    y = torch.empty_like(x)

    def fn():
        junk = [[i] for i in range(5000)]  # container allocations: past the collector's threshold
        y.copy_(x * 2.0)
        return len(junk)

    fn()  # (the warm-up, before the stray graph: the capture below is the first collection's chance)
    stray = torch.cuda.CUDAGraph()
    with torch.cuda.graph(stray):
        x.mul_(1.0)
    gc.collect()
    _Cycle(stray)
    del stray
    graph, _ = capture(fn, model=None, what="a test program", warmup=0, fuse=False)
    y.fill_(float("nan"))  # poisoned: the replay must write it
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0)
    assert torch.randn(4, device="cuda").isfinite().all()
    gc.collect()


def test_fused_patches_and_restores_the_model():
    """specdec.fusion.fused swaps norm/MLP forwards only inside the block (no compile happens
    unless they are called) and restores dynamo's recompile limit."""
    model = get_model("qwen3_5")
    norms = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    assert norms
    before = dynamo_config.recompile_limit
    with fused(model):
        assert all("forward" in vars(m) for m in norms)
        assert dynamo_config.recompile_limit >= 64
    assert not any("forward" in vars(m) for m in norms)
    assert dynamo_config.recompile_limit == before


def test_fused_routes_the_rotary_function_inside_its_blocks_only(monkeypatch):
    """fused() routes ``apply_rotary_pos_emb`` of the module defining the model's attention class
    to its compiled version for the threads inside a block (nested blocks keep it routed, the
    last one out restores the function); a forward inside the block calls it compiled, one in
    another thread as it was; without a block nothing changes."""
    import sys
    import threading

    from specdec import fusion

    model = get_model("qwen3_5")
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    where = sys.modules[type(attn).__module__]
    original = where.apply_rotary_pos_emb
    compiled = []
    monkeypatch.setattr(fusion, "_compiled", lambda key, fn, options=None: (compiled.append(key), fn)[1])
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        want = model(ids).logits
        with fused(model):
            assert where.apply_rotary_pos_emb is not original
            with fused(model):
                pass
            assert where.apply_rotary_pos_emb is not original  # the outer block still holds it
            got = model(ids).logits
            layers = sum(type(m).__name__.endswith("Attention") for m in model.modules())
            assert compiled.count(original) == layers, (compiled, layers)
            seen = []
            other = threading.Thread(target=lambda: seen.append(model(ids).logits))
            other.start()
            other.join(60)
            assert compiled.count(original) == layers and torch.equal(seen[0], want)  # another thread: eager
        assert where.apply_rotary_pos_emb is original
        assert torch.equal(got, want)
        model(ids)
    assert compiled.count(original) == layers


def test_compile_whole_falls_back_when_the_trace_fails():
    """CapturedProgram(compile_whole=True) on a program dynamo cannot trace as one graph (a branch on
    a tensor's value, read on the host): the warm-up call runs it uncompiled, exactly once, with the
    reason in ``compile_error`` and a warning; later calls run it too (here uncaptured: no CUDA)."""
    x = torch.arange(1.0, 5.0)
    out = torch.full((4,), -1.0)  # poisoned: the program writes it
    runs = []

    def program():
        runs.append(len(runs))
        out.copy_(x * 2 if float(x.sum()) > 0 else x)

    prog = CapturedProgram(program, model=torch.nn.Linear(2, 2), what="a test program", graphs=True,
                           compile_whole=True)
    with pytest.warns(RuntimeWarning, match="torch.compile of a test program failed"):
        assert prog() == "static"
    assert runs == [0] and torch.equal(out, x * 2)
    # "Type: message" of dynamo's refusal (its type differs between torch versions)
    assert prog.compile_error is not None and prog.compile_error.split(":")[0].isidentifier(), prog.compile_error
    out.fill_(-1.0)
    with pytest.warns(RuntimeWarning):  # the capture, refused on a CPU test run, falls back too
        prog()
    assert runs == [0, 1] and torch.equal(out, x * 2)


@needs_triton_interpreter  # (which refuses every capture; on a GPU machine these CPU ops would be "captured")
def test_a_compiled_program_that_does_not_capture_is_captured_uncompiled(monkeypatch):
    """CapturedProgram(compile_whole=True) whose compiled program traces but does not capture: that
    call runs the uncompiled program (its warm-up), with the reason in ``compile_error`` and a
    warning, and the next call captures the uncompiled program (here refused too: eagerly from
    then on, the reason in ``error``); every call does the program's work once."""
    from helpers import compile_with_aot_eager

    compile_with_aot_eager(monkeypatch)
    x = torch.arange(1.0, 5.0)
    out = torch.full((4,), -1.0)
    runs = []

    def program():
        runs.append(torch.compiler.is_compiling())
        out.add_(x)

    prog = CapturedProgram(program, model=None, what="a test program", graphs=True, compile_whole=True, fuse=False)
    torch._dynamo.reset()
    assert prog() == "static" and prog._compiled is not None and prog.compile_error is None  # the compiled warm-up
    assert runs == [True] and torch.equal(out, x - 1)
    with pytest.warns(RuntimeWarning, match="a test program runs uncompiled from now on"):
        assert prog() == "static"
    assert prog.compile_error.startswith("capture of the compiled program: ") and prog.error is None
    assert runs == [True, False] and torch.equal(out, 2 * x - 1)
    with pytest.warns(RuntimeWarning, match="a test program runs the static path eagerly"):
        assert prog() == "static"
    assert prog.error is not None and runs == [True, False, False] and torch.equal(out, 3 * x - 1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_static_draft_model_proposals_equal_eager(family, strategy):
    """The draft model's fixed-shape proposal program (what the CUDA graph holds) proposes exactly
    what its eager loop proposes: same output, same acceptance counts; its cache is reused by a
    second generate() of the same bucket."""
    ids, mask, eos, ref = reference(family)
    got = {}
    for path in ("eager", "static"):
        draft = specdec.drafters.DraftModelDrafter(get_model(family, "perturbed"), rollback=strategy)
        sd = specdec.wrap(get_model(family), drafter=draft, rollback="replay", num_speculative_tokens=3,
                          decode_path=path)
        for _ in range(2):
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
            assert torch.equal(out, ref)
            st = sd.last_stats
            got.setdefault(path, []).append((st.proposed_tokens, st.accepted_tokens, st.accept_histogram[1:]))
        assert draft.last_path == path
    assert got["eager"] == got["static"]
    assert got["static"][0][1] > 0  # drafts were accepted: the commit of kept prefixes ran


@pytest.mark.parametrize("K", [1, 2, 5])
def test_static_draft_model_every_K(K):
    ids, mask, eos, ref = reference("nemotron_h")
    draft = specdec.drafters.DraftModelDrafter(get_model("nemotron_h", "perturbed"), rollback="ring")
    sd = specdec.wrap(get_model("nemotron_h"), drafter=draft, rollback="snapshot", num_speculative_tokens=K,
                      decode_path="static")
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)
    assert draft.last_path == "static"


def test_stats_say_how_the_drafters_program_ran():
    """Stats.draft_path / draft_error: the drafter's ``last_path``, and why its program ran without
    the CUDA graph or the compile it was asked for; for a graph-safe drafter, how the step
    programs it proposed inside ran; None for plain decoding and for a drafter without a program
    of its own (n-gram's host loop)."""
    ids, mask, eos, ref = reference("nemotron_h")

    class Batched(specdec.drafters.NGramDrafter):  # (graph-safe on a CPU too)
        def search(self, input_ids):
            return "batched"

    class Refused(specdec.drafters.DraftModelDrafter):
        def propose(self, *args, **kwargs):
            out = super().propose(*args, **kwargs)
            self.capture_error, self.compile_error = "CaptureFailure: no graphs", "Unsupported: a branch"
            return out

    for drafter, K, path, error in (
            ("ngram", 2, None, None),
            (Batched(), 2, "static", None),
            (specdec.drafters.DraftModelDrafter(get_model("nemotron_h", "perturbed")), 2, "static", None),
            (Refused(get_model("nemotron_h", "perturbed")), 2, "static",
             "capture: CaptureFailure: no graphs; compile: Unsupported: a branch"),
            (specdec.drafters.DraftModelDrafter(get_model("nemotron_h", "perturbed")), 0, None, None)):
        sd = specdec.wrap(get_model("nemotron_h"), drafter=drafter, num_speculative_tokens=K, decode_path="static")
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref)
        assert (sd.last_stats.draft_path, sd.last_stats.draft_error) == (path, error), (drafter, K)


@pytest.mark.parametrize("path", ["eager", "static"])
def test_plain_decoding_in_place_state_exact(family, path):
    """K = 0 runs the in-place update (no rollback buffers) and its committed state equals HF's
    own per-token decode of the text (every row runs to the budget: no finished row)."""
    model = get_model(family)
    ids, mask, _, _ = reference(family)
    sd = specdec.wrap(model, num_speculative_tokens=0, decode_path=path)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(out, hf_greedy(model, ids, mask, max_new=8))
    cache = sd.last_cache
    assert all(isinstance(layer.strategy, InPlaceUpdate) for layer in cache.ssm.values())
    L = ids.shape[1]
    # the cache holds each row's text but its last (pending) token
    texts = [ids[i][mask[i].bool()].tolist() + out[i, L:-1].tolist() for i in range(ids.shape[0])]
    ref = hf_states(model, sd.adapter, texts, mask.sum(1).tolist())
    for idx, (state, _) in ref.items():
        assert rel_err(cache.ssm[idx].ssm_state(), state) < 1e-4


def test_in_place_strategy_rejects_multi_token_steps():
    ad = specdec.models.adapter_for(get_model("qwen3_5"))
    ids, mask, _, _ = reference("qwen3_5")
    with pytest.raises(ValueError, match="steps of 1 token"):
        ad.prefill(ids, mask, ad.new_cache(ids.shape[0], 64, 3, InPlaceUpdate()))


def test_settings_are_validated_after_construction():
    """Changing a wrapper's settings goes through the same checks as wrap()."""
    model = get_model("qwen3_5")
    sd = specdec.wrap(model)
    with pytest.raises(ValueError, match="decode_path must be one of"):
        sd.decode_path = "bogus"
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        sd.num_speculative_tokens = MAX_SPECULATIVE_TOKENS + 1
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        sd.num_speculative_tokens = -2
    with pytest.raises(ValueError, match="unknown rollback strategy"):
        sd.strategy = "undo"
    with pytest.raises(ValueError, match="unknown rollback strategy"):
        sd.rollback = "undo"  # (wrap()'s argument's name for the same setting)
    sd.rollback = "ring"
    assert sd.strategy.name == sd.rollback.name == "ring"
    with pytest.raises(ValueError, match="unknown drafter"):
        sd.drafter = "medusa?"
    sd.drafter = "ngram"  # a name works, as in wrap()
    sd.num_speculative_tokens = np.int64(3)
    assert sd.num_speculative_tokens == 3 and type(sd.num_speculative_tokens) is int
    ids, mask, eos, ref = reference("qwen3_5")
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref) and sd.last_stats.rollback == "ring"


class _Mutating(Drafter):
    """Writes into the buffers it is given, and returns the wrong types when asked to."""

    def __init__(self, mode="mutate"):
        self.mode = mode

    def propose(self, input_ids, lengths, K):
        B = input_ids.shape[0]
        input_ids.zero_()
        lengths -= 1
        if self.mode == "float":
            return torch.full((B, K), 5.7), torch.full((B,), K)
        if self.mode == "none":
            return None
        return torch.full((B, K), 5, dtype=torch.long), torch.full((B,), K, dtype=torch.long)


@pytest.mark.parametrize("path", ["eager", "static"])
def test_drafter_cannot_corrupt_the_engine_buffers(path):
    ids, mask, eos, ref = reference("nemotron_h")
    sd = specdec.wrap(get_model("nemotron_h"), drafter=_Mutating(), num_speculative_tokens=2, decode_path=path)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode, match", [("float", "dtype torch.float32"), ("none", "must return a pair")])
@pytest.mark.parametrize("path", ["eager", "static"])
def test_drafter_output_types_are_checked(path, mode, match):
    ids, mask, eos, _ = reference("nemotron_h")
    sd = specdec.wrap(get_model("nemotron_h"), drafter=_Mutating(mode), num_speculative_tokens=2, decode_path=path)
    with pytest.raises(TypeError, match=match):
        sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)


def test_streamer_gets_nothing_from_a_rejected_call():
    ids = torch.ones(1, 4, dtype=torch.long)
    rec = StreamRecorder()
    with pytest.raises(ValueError, match="does not support repetition_penalty"):
        specdec.wrap(get_model("qwen3_5"), decode_path="static").generate(ids, max_new_tokens=3, streamer=rec,
                                                                          repetition_penalty=1.2)
    assert rec.calls == []
    specdec.wrap(get_model("qwen3_5")).generate(ids, max_new_tokens=0, streamer=rec)
    assert [c[0] for c in rec.calls] == ["put", "end"]


def test_pad_token_id_must_be_an_int():
    with pytest.raises(ValueError, match="pad_token_id must be an int"):
        specdec.wrap(get_model("qwen3_5")).generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2,
                                                    pad_token_id="p")


def test_use_cache_false_warns_and_changes_nothing():
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(get_model("qwen3_5"))
    with pytest.warns(UserWarning, match="use_cache=False has no effect"):
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0,
                          use_cache=False)
    assert torch.equal(out, ref)


def test_graph_safe_experts_switches_syncing_moe_and_restores():
    """Kimi-Linear's MoE experts (transformers' grouped_mm on fp32 weights: its fallback copies
    the offsets to the host, which a CUDA graph cannot capture) run as batched_mm inside
    graph_safe_experts, with the same logits; the model's setting comes back afterwards."""
    model = get_model("kimi_linear")
    impl = model.config._experts_implementation
    assert len(_host_syncing_experts(model)) == 1
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
        ctx = graph_safe_experts(model)
        with pytest.warns(RuntimeWarning, match="batched_mm"):
            ctx.__enter__()
        try:
            assert model.config._experts_implementation == "batched_mm"
            out = model(ids).logits
        finally:
            ctx.__exit__(None, None, None)
    assert model.config._experts_implementation == impl
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert not _host_syncing_experts(get_model("qwen3_5"))  # no MoE: nothing to switch


def test_fusable_is_compiled_only_inside_this_threads_fused_blocks(monkeypatch):
    """A :func:`specdec.fusion.fusable` function runs compiled only while the calling thread is
    inside a ``fused`` block (blocks nest: leaving an inner one keeps the outer active); another
    thread's block leaves this thread's calls eager."""
    import threading

    from specdec import fusion

    compiled = []
    monkeypatch.setattr(fusion, "_compiled", lambda key, fn, options=None: (compiled.append(key), fn)[1])
    add_one = fusion.fusable(lambda x: x + 1)
    inside, release = threading.Event(), threading.Event()

    def other_thread():
        with fusion.fused(None):
            inside.set()
            release.wait(30)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        assert inside.wait(30)
        assert add_one(1) == 2 and compiled == []  # the other thread's block is not this thread's
        with fusion.fused(None):
            with fusion.fused(None):
                assert add_one(2) == 3 and len(compiled) == 1
            assert add_one(3) == 4 and len(compiled) == 2  # still inside the outer block
        assert add_one(4) == 5 and len(compiled) == 2
        with fusion.fused(None, enabled=False):
            assert add_one(5) == 6 and len(compiled) == 2
    finally:
        release.set()
        t.join()


def test_step_mask_and_positions_compiled_equal_eager():
    """A chain step's attention mask and positions (one fused kernel on the CUDA-graph path) equal
    the eager ones, for rows with padding and committed lengths that differ, a later call of a
    step (offset > 0) and several widths; compiled inside a ``fused`` block (Inductor on the CPU
    here)."""
    from specdec import fusion
    from specdec.cache import _chain_mask, _chain_positions

    gen = torch.Generator().manual_seed(4)
    pad = torch.randint(0, 4, (3,), generator=gen)
    seq_len = pad + torch.randint(1, 9, (3,), generator=gen)
    for offset, t, end, dtype in ((0, 1, 16, torch.float32), (2, 3, 20, torch.bfloat16), (0, 5, 16, torch.float32)):
        want = (_chain_mask(seq_len, pad, offset, t, end, dtype), _chain_positions(seq_len, pad, offset, t))
        cols = torch.arange(end)[None, None, :]
        last = (seq_len[:, None, None] + offset + torch.arange(t)[None, :, None])
        visible = (cols >= pad[:, None, None]) & (cols <= last)
        assert torch.equal(want[0][:, 0] == 0, visible) and want[0].dtype == dtype
        assert torch.equal(want[1], (seq_len - pad)[:, None] + offset + torch.arange(t)[None, :])
        with fusion.fused(None):
            got = (_chain_mask(seq_len, pad, offset, t, end, dtype), _chain_positions(seq_len, pad, offset, t))
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_fused_rotary_embedding_equals_eager():
    """Inside ``fused`` the model's rotary-embedding module runs its class's compiled forward (its
    cos / sin: one fused kernel on a GPU instead of ~10) with the eager values, for two position
    shapes; outside, its own forward again."""
    model = get_model("qwen3_5")
    rotary = next(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    x = torch.randn(2, 3, 8)
    for pos in (torch.arange(3)[None].expand(2, 3), torch.tensor([[4, 5, 6], [1, 2, 3]])):
        pos = pos[None].expand(3, 2, 3)  # (Qwen3.5's multimodal rotary takes a position per grid axis)
        want = rotary(x, pos)
        with fused(model):
            assert "forward" in vars(rotary)
            got = rotary(x, pos)
        assert "forward" not in vars(rotary)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
