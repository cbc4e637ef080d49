"""The decode step's glue around the verify forward: the proposal's normalisation and checks
(:func:`specdec.drafters.base.chain_drafts`), acceptance, and the text bookkeeping
(``_Rows.append``) equal their plain per-element definitions on random inputs (out-of-range
counts and ids, EOS before / at / past the limit, several EOS ids, finished rows, spent budgets),
issue at most the device ops their expressions name (one kernel each on CUDA), and never read a
value back to the host."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from specdec.drafters import Drafter, DraftModelDrafter, NGramDrafter
from specdec.drafters.base import chain_drafts
from specdec.engine import _Rows
from specdec.verify import greedy_accept
from helpers import DeviceOps
from markers import needs_cuda, needs_triton_interpreter


def _no_sync(ops: DeviceOps):
    assert not {"_local_scalar_dense", "item", "is_nonzero", "nonzero"} & set(ops.ops), ops.ops


@pytest.mark.parametrize("seed", range(4))
def test_chain_drafts_is_the_per_element_definition(seed):
    g = torch.Generator().manual_seed(seed)
    B, w, V = 7, 5, 11
    drafts = torch.randint(-3, V + 3, (B, w), generator=g)
    counts = torch.randint(-2, w + 3, (B,), generator=g)
    budget = torch.randint(0, w + 2, (B,), generator=g)
    with DeviceOps() as ops:
        out, k, errors = chain_drafts(drafts, counts, budget, V)
    _no_sync(ops)
    # counts and ids clamped, the bound and the mask, two checks, stacked, the unused zeroed: 12 kernels
    assert ops.launches <= 12, ops.ops
    for b in range(B):
        want_k = min(max(0, min(int(counts[b]), w)), int(budget[b]))
        assert int(k[b]) == want_k
        for j in range(w):
            want = min(max(int(drafts[b, j]), 0), V - 1) if j < want_k else 0
            assert int(out[b, j]) == want
    assert bool(errors[0]) == any(not 0 <= int(c) <= w for c in counts)
    assert bool(errors[1]) == any(not 0 <= int(drafts[b, j]) < V for b in range(B) for j in range(int(k[b])))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_accept_is_the_leading_matches(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 6, 5, 4  # a small vocabulary: long runs of matches
    logits = torch.randn(B, T, V, generator=g)
    drafts = torch.randint(0, V, (B, T - 1), generator=g)
    k = torch.randint(0, T, (B,), generator=g)
    with DeviceOps() as ops:
        n, c = greedy_accept(logits, drafts, k)
    _no_sync(ops)
    pred = logits.argmax(-1)
    for b in range(B):
        want = 0
        while want < int(k[b]) and int(drafts[b, want]) == int(pred[b, want]):
            want += 1
        assert (int(n[b]), int(c[b])) == (want, int(pred[b, want]))


def _append_by_hand(text, lengths, n_gen, finished, max_new, eos, new, limit):
    """``_Rows.append`` one row and one token at a time (host lists; mutated in place)."""
    takes = []
    for b in range(len(text)):
        take = 0
        if not finished[b]:
            for j in range(int(limit[b])):
                if n_gen[b] >= max_new[b]:
                    break
                text[b][lengths[b]] = int(new[b, j])
                lengths[b] += 1
                n_gen[b] += 1
                take += 1
                if int(new[b, j]) in eos:
                    finished[b] = True
                    break
            finished[b] = finished[b] or n_gen[b] >= max_new[b]
        takes.append(take)
    return takes


@pytest.mark.parametrize("eos", [(), (2,), (2, 5)], ids=["no-eos", "one-eos", "two-eos"])
@pytest.mark.parametrize("seed", range(3))
def test_append_is_the_per_token_definition(eos, seed):
    g = torch.Generator().manual_seed(seed)
    B, L, W, V = 8, 4, 5, 7
    ids = torch.randint(3, V, (B, L), generator=g)
    budgets = torch.randint(1, 12, (B,), generator=g)
    rows = _Rows(ids, torch.ones_like(ids), L + 40, budgets, eos)
    text = [r.tolist() for r in rows.text]
    lengths, n_gen = rows.lengths.tolist(), rows.n_gen.tolist()
    finished, max_new = rows.finished.tolist(), budgets.tolist()
    for step in range(8):
        new = torch.randint(0, V, (B, W), generator=g)
        limit = torch.randint(0, W + 1, (B,), generator=g)
        with DeviceOps() as ops:
            take = rows.append(new, limit)
        _no_sync(ops)
        # EOS: compare(s), where + amin, cut; budget: sub, minimum, masked_fill; write: add, scatter;
        # counts: add; finished: ge, le, or, or
        assert ops.launches <= 14 + (1 if len(eos) > 1 else 0), ops.ops
        want = _append_by_hand(text, lengths, n_gen, finished, max_new, set(eos), new, limit)
        assert take.tolist() == want
        assert rows.lengths.tolist() == lengths and rows.n_gen.tolist() == n_gen
        assert rows.finished.tolist() == finished
        for b in range(B):
            assert rows.text[b, :lengths[b]].tolist() == text[b][:lengths[b]]


# ------------------------------------------------- the next proposal, made before the step's sync


class _Counting(NGramDrafter):
    """The n-gram drafter, counting its proposals; raises ``fail`` at proposal number ``fail_at``."""

    def __init__(self, fail_at=None, fail=None):
        super().__init__()
        self.calls, self.fail_at, self.fail = 0, fail_at, fail

    def propose(self, input_ids, lengths, num_speculative_tokens):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.fail
        return super().propose(input_ids, lengths, num_speculative_tokens)


class _Slow(_Counting):
    """:class:`_Counting`, sleeping ``nap`` seconds per proposal (long against the loop's glue, so
    the phases' counts of proposals do not depend on the machine's load)."""

    nap = 0.2

    def propose(self, input_ids, lengths, num_speculative_tokens):
        time.sleep(self.nap)
        return super().propose(input_ids, lengths, num_speculative_tokens)


def _overlap_run(monkeypatch, overlap: str, drafter, path, **kw):
    import specdec
    from helpers import reference
    from tiny_models import get_model

    monkeypatch.setenv("SPECDEC_OVERLAP", overlap)
    ids, mask, eos, _ = reference("nemotron_h")
    sd = specdec.wrap(get_model("nemotron_h"), drafter=drafter, num_speculative_tokens=3, decode_path=path)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos, **kw)
    return out, sd.last_stats


@pytest.mark.parametrize("path", ["eager", "static"])
def test_the_next_proposal_is_made_before_the_sync(monkeypatch, path):
    """With the overlap (default) a fixed batch proposes once more than it steps (the proposal
    for the step after the last, made before the last sync and dropped), without it once per
    step; greedy and sampled outputs (one generator) are the same either way: the proposals
    see the same text and draw in the same order. (With the step overlap, on by default and
    off here, a call that ends by its budget makes no proposal past its last step: see
    :func:`_check_step_overlap`.)"""
    from helpers import reference

    monkeypatch.setenv("SPECDEC_OVERLAP_STEPS", "0")
    expected = reference("nemotron_h")[3]
    runs = {}
    for overlap in ("1", "0"):
        greedy = _Counting()
        out, stats = _overlap_run(monkeypatch, overlap, greedy, path)
        assert torch.equal(out, expected)
        assert greedy.calls == stats.steps + (overlap == "1")
        sampled = _Counting()
        g = torch.Generator().manual_seed(3)
        runs[overlap] = _overlap_run(monkeypatch, overlap, sampled, path, do_sample=True, temperature=1.3,
                                     generator=g)[0]
        assert sampled.calls >= 1
    assert torch.equal(runs["1"], runs["0"])


def test_an_error_of_a_proposal_made_ahead_is_raised_when_its_step_runs(monkeypatch):
    """A drafter error in a proposal made before the sync is raised if its step runs (here the
    third proposal of a call that runs more steps), as it would be without the overlap."""
    failing = _Counting(fail_at=3, fail=ValueError("drafter broke at its third proposal"))
    with pytest.raises(ValueError, match="third proposal"):
        _overlap_run(monkeypatch, "1", failing, "static")
    assert failing.calls == 3


def test_the_dropped_proposal_leaves_the_random_state_as_without_the_overlap(monkeypatch):
    """A sampling draft model draws from the call's generator (or torch's global one): the
    proposal made before the last sync, dropped, has its draws put back, so the generator after
    the call, a second call with it, and torch's global stream afterwards are as without the
    overlap."""
    import specdec
    from helpers import reference
    from tiny_models import get_model

    from specdec.drafters import DraftModelDrafter

    ids, mask, _, _ = reference("qwen3_5")
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=1.3, pad_token_id=0)
    runs = {}
    for overlap in ("1", "0"):
        monkeypatch.setenv("SPECDEC_OVERLAP", overlap)
        sd = specdec.wrap(get_model("qwen3_5"), drafter=DraftModelDrafter(get_model("qwen3_5", "perturbed")),
                          num_speculative_tokens=3)
        g = torch.Generator().manual_seed(7)
        first = sd.generate(ids, generator=g, **kw)
        state = g.get_state().clone()
        second = sd.generate(ids, generator=g, **kw)
        torch.manual_seed(11)
        third, fourth = sd.generate(ids, **kw), sd.generate(ids, **kw)
        runs[overlap] = (first, state, second, third, fourth, torch.rand(3))
    for a, b in zip(runs["1"], runs["0"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("family, drafter", [("nemotron_h", None), ("qwen3_5", "ngram"), ("qwen3_5", "perturbed")])
def test_each_step_is_launched_before_the_last_steps_flags_are_read(monkeypatch, path, family, drafter):
    """See :func:`_check_step_overlap`."""
    _check_step_overlap(monkeypatch, path, family, drafter, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family, drafter", [("nemotron_h", None), ("qwen3_5", "perturbed")])
def test_each_step_is_launched_before_the_last_steps_flags_are_read_on_cuda_graphs(monkeypatch, family, drafter):
    """See :func:`_check_step_overlap`: on CUDA the flags come through a pinned copy and an event."""
    _check_step_overlap(monkeypatch, "cuda_graph", family, drafter, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_flag_reads_return_each_steps_values_while_later_steps_run():
    """The flags' host copies used in turn (two slots of pinned buffers and events): each read
    returns the values its step wrote, without waiting for a later step's work (a matmul chain
    and a sleep, still queued), and a changed size or dtype gets its own buffer; values are
    poisoned on the device after each start."""
    from specdec.engine import _FlagReads

    reads, handles = _FlagReads("cuda"), []
    a = torch.randn(2048, 2048, device="cuda")
    for step in range(6):
        flags = torch.arange(3 + step % 2, device="cuda") * (step + 1) - step
        if step % 3 == 2:
            flags = flags.double() / 4  # (flags with E(K) values: another dtype)
        handles.append((reads.start(flags), flags.tolist()))
        flags.fill_(-999)  # (after the copy, in stream order)
        for _ in range(20):
            a = a @ a / 2048 ** 0.5  # (queued after the copy)
        torch.cuda._sleep(20_000_000)  # (~10 ms of the device's time, queued after the copy)
        later = torch.cuda.Event()
        later.record()
        if step >= 1:  # the pipelined order: step n is read after step n + 1 started
            handle, expected = handles[step - 1]
            assert _FlagReads.read(handle) == expected
            assert not later.query(), "the read waited for work launched after its copy"
    assert _FlagReads.read(handles[-1][0]) == handles[-1][1]


def _ending_by_eos(model, max_new: int = 12):
    """``(ids, mask, eos, expected)``: the ragged prompts on the model's device, EOS ids with which
    every row ends by its 4th new token under greedy decoding, and HF greedy's output."""
    from helpers import hf_greedy, ragged_prompts

    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in ragged_prompts())
    L = ids.shape[1]
    plain = hf_greedy(model, ids, mask, max_new=max_new)
    eos = sorted({int(plain[b, L + 2 + b % 2]) for b in range(ids.shape[0])})
    expected = hf_greedy(model, ids, mask, max_new=max_new, eos=eos)
    assert expected.shape[1] < L + max_new, "every row must end before its budget"
    return ids, mask, eos, expected


class _Streamer:
    """Records what a generate() streams: each ``put`` as a list of ids, and ``end``."""

    def __init__(self):
        self.seen = []

    def put(self, value):
        self.seen.append(value.tolist())

    def end(self):
        self.seen.append("end")


def _check_step_overlap(monkeypatch, path, family, drafter, device):
    """With the step overlap (default) a call whose rows all end by EOS before their budget runs
    one step past its end, on ended rows, and drops it; a plain call that ends by the budget runs
    none (the host counts its steps).
    Greedy output equals HF greedy's; greedy and sampled outputs, what a streamer gets, the
    statistics, the call's generator afterwards (also after a dropped step that drew), a second
    call with it and torch's global stream afterwards are as with ``SPECDEC_OVERLAP_STEPS=0``
    (every step's flags read before the next step starts)."""
    import specdec
    from helpers import counting_forwards, make_drafter
    from tiny_models import get_model

    model = get_model(family) if device == "cpu" else copy.deepcopy(get_model(family)).to(device)  # (shared: not moved)
    ids, mask, eos, expected = _ending_by_eos(model)
    L = ids.shape[1]
    K = 0 if drafter is None else 3
    runs, forwards = {}, counting_forwards(monkeypatch)
    for overlap in ("1", "0"):
        monkeypatch.setenv("SPECDEC_OVERLAP_STEPS", overlap)
        draft = None if drafter is None else make_drafter(drafter, family)
        if isinstance(draft, DraftModelDrafter) and device != "cpu":
            draft = DraftModelDrafter(copy.deepcopy(draft.model).to(device))
        sd = specdec.wrap(model, num_speculative_tokens=K, decode_path=path, **({} if draft is None else {"drafter": draft}))
        kw = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0)
        run = []
        for ending in ({"eos_token_id": eos}, {}):  # all rows end by EOS, then by the budget
            forwards.clear()
            out = sd.generate(ids, **kw, **ending)
            st = sd.last_stats
            run += [out, st.steps, st.new_tokens, st.accept_histogram, st.accepted_tokens, st.proposed_tokens,
                    st.mean_accepted_tokens, st.k_histogram, st.k_per_step]
            extra = len(forwards) - st.steps  # steps run past the call's end
            if overlap == "0":
                assert extra == 0
            elif ending:  # every row ended by EOS, before the step count the host knows
                assert extra == 1
            elif K == 0:  # a plain step keeps one token a row: the host's count ends the call
                assert extra == 0
            else:  # a speculative call may end by its budgets before that count
                assert extra in (0, 1)
            if ending:
                assert torch.equal(out, expected)
        g = torch.Generator(device).manual_seed(5)
        sampled = dict(kw, eos_token_id=eos, do_sample=True, temperature=1.3)
        run += [sd.generate(ids, generator=g, **sampled), g.get_state().clone(), sd.generate(ids, generator=g, **sampled)]
        torch.manual_seed(13)
        run += [sd.generate(ids, **sampled), torch.rand(3), torch.rand(3, device=device)]
        streamed = _Streamer()  # (a streamer takes one row; it ends by EOS: its tokens come a step late)
        run += [sd.generate(ids[:1], attention_mask=mask[:1], streamer=streamed, eos_token_id=eos, max_new_tokens=12,
                            pad_token_id=0), streamed.seen]
        forwards.clear()  # sampled rows that all end by EOS (top-1: greedy tokens): a dropped step that drew
        g = torch.Generator(device).manual_seed(6)
        cold = dict(sampled, top_k=1)  # (greedy tokens, random draws all the same)
        out = sd.generate(ids, generator=g, **cold)
        assert out.shape[1] < L + 12, "every sampled row must end by EOS"
        assert len(forwards) - sd.last_stats.steps == (overlap == "1")
        run += [out, g.get_state().clone(), sd.generate(ids, generator=g, **cold)]
        runs[overlap] = run
    for i, (a, b) in enumerate(zip(runs["1"], runs["0"])):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f"item {i} differs"


def test_a_dropped_error_keeps_nothing_alive(monkeypatch):
    """The error of the proposal for a step that never ran is dropped without a reference cycle
    through the decode loop: what its frame held is freed when generate() returns, no garbage
    collection needed (the proposal made before the last sync: without the step overlap, which
    makes no proposal past a call that ends by its budget)."""
    monkeypatch.setenv("SPECDEC_OVERLAP_STEPS", "0")
    import gc
    import weakref

    import specdec
    from helpers import reference
    from tiny_models import get_model

    class PastTheEnd(NGramDrafter):
        calls, held = 0, None

        def propose(self, input_ids, lengths, num_speculative_tokens):
            self.calls += 1
            if self.calls == self.stop:  # the proposal made before the last sync
                scratch = torch.ones(1024)
                self.held = weakref.ref(scratch)
                raise RuntimeError("past the end of the text")
            return super().propose(input_ids, lengths, num_speculative_tokens)

    ids, mask, eos, expected = reference("nemotron_h")
    kw = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos)
    probe = _Counting()
    sd = specdec.wrap(get_model("nemotron_h"), drafter=probe, num_speculative_tokens=3)
    sd.generate(ids, **kw)
    drafter = PastTheEnd()
    drafter.stop = probe.calls  # the last proposal of the same call
    sd = specdec.wrap(get_model("nemotron_h"), drafter=drafter, num_speculative_tokens=3)
    gc.disable()
    try:
        out = sd.generate(ids, **kw)
        assert torch.equal(out, expected) and drafter.calls == drafter.stop
        assert drafter.held is not None and drafter.held() is None
    finally:
        gc.enable()


def test_the_dropped_proposal_is_not_counted_as_drafting(monkeypatch):
    """The time of the proposal made for a step that never ran stays in the wall time but not in
    the steps' drafting: with a drafter that sleeps per proposal (long against the glue, so the
    count does not depend on the machine's load), ``draft_s`` counts one sleep per step, as
    without the overlap."""
    nap = _Slow.nap

    monkeypatch.setenv("SPECDEC_OVERLAP_STEPS", "0")  # (the step overlap's own: below)
    for overlap in ("1", "0"):
        drafter = _Slow()
        _, stats = _overlap_run(monkeypatch, overlap, drafter, "static")
        assert drafter.calls == stats.steps + (overlap == "1")
        assert round(stats.draft_s / nap) == stats.steps
        assert stats.wall_s >= nap * drafter.calls


def test_a_dropped_step_is_not_counted_in_the_steps_phases(monkeypatch):
    """With the step overlap, a call whose rows all end by EOS launches one step past its end:
    that step's proposal (one, made for it before the last flags were read) and its laps stay in
    the wall time but not in the steps' phases: ``draft_s`` counts one sleep per step."""
    import specdec
    from tiny_models import get_model

    nap = _Slow.nap

    model = get_model("nemotron_h")
    ids, mask, eos, expected = _ending_by_eos(model)
    for overlap in ("1", "0"):
        monkeypatch.setenv("SPECDEC_OVERLAP_STEPS", overlap)
        drafter = _Slow()
        sd = specdec.wrap(model, drafter=drafter, num_speculative_tokens=3, decode_path="static")
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
        stats = sd.last_stats
        assert torch.equal(out, expected)
        assert drafter.calls == stats.steps + 1  # (the proposal for the step after the last, dropped)
        assert round(stats.draft_s / nap) == stats.steps
        assert stats.wall_s >= nap * drafter.calls


def test_a_plain_greedy_step_issues_few_device_ops_around_its_forward(monkeypatch):
    """A plain greedy step (K = 0, fixed batch, no policy) issues only what it uses around its
    forward and commit: the pending tokens' gather, the argmax, the append's bookkeeping, the
    statistics and the flags -- no draft budget, no concatenation with empty drafts (counted per
    step as the difference of a long and a short call, on the static path; the forward's own ops
    are not counted). Every such op is a kernel launch a step pays on the device."""
    from torch.utils._python_dispatch import _disable_current_modes

    import specdec
    import specdec.decoding as decoding
    from tiny_models import get_model, ragged_prompts

    for name in ("forward", "commit"):
        real = getattr(decoding.StaticDecoder, name)

        def uncounted(self, *a, _real=real, **k):
            with _disable_current_modes():
                return _real(self, *a, **k)

        monkeypatch.setattr(decoding.StaticDecoder, name, uncounted)
    model = get_model("nemotron_h")
    ids, mask = ragged_prompts()
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=0, decode_path="static")
    counts = []
    for n in (6, 16):
        with DeviceOps() as ops:
            sd.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=0)
        counts.append((sum(ops.ops.values()), sd.last_stats.steps, ops.ops))
    (short, s1, a), (long, s2, b) = counts
    assert s2 - s1 == 10
    per = {k: (b[k] - a[k]) / (s2 - s1) for k in b if b[k] != a[k]}
    assert "clamp" not in per and per.get("cat", 0) <= 1, per  # no draft budget; one cat: the flags
    assert sum(per.values()) <= 27, sorted(per.items())  # (33 before the budget and the empty drafts were left out)


class _Narrowing(NGramDrafter):
    """The n-gram drafter, returning one column fewer than asked at every other proposal (with
    its counts cut to them): those steps cannot use the step programs' fixed K-column buffers."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def graph_safe(self, input_ids):
        return False  # (it keeps a count between calls)

    def propose(self, input_ids, lengths, num_speculative_tokens):
        self.calls += 1
        drafts, counts = super().propose(input_ids, lengths, num_speculative_tokens)
        if self.calls % 2:
            return drafts, counts
        return drafts[:, :-1].clone(), counts.clamp(max=drafts.shape[1] - 1)


class _BatchedSearch(NGramDrafter):
    """The n-gram drafter's batched device search at every batch size: graph-safe on a CPU too,
    so the step programs run its proposals inside their proposal program there (eagerly)."""

    def search(self, input_ids):
        return "batched"


def _check_step_programs(monkeypatch, path, family, drafter, device, auto=False):
    """A greedy chain step's device work around the forward runs as the step programs (captured
    where the forward is) or op by op (``SPECDEC_STEP_GRAPHS=0``): the outputs (rows ending by EOS
    mid-step, and by their budgets), and every statistic are the same, and equal HF greedy's; a
    drafter whose proposals are narrower than K at some steps mixes both kinds of step. A
    graph-safe drafter proposes inside the programs, and outside them with
    ``SPECDEC_CAPTURED_PROPOSALS=0``, with the same results. ``auto``: K chosen per step by the
    speculation policy, on given costs (``FixedCosts``: the choices depend on the acceptance
    alone, so both runs choose alike), each K's steps on its own programs."""
    import specdec
    from helpers import make_drafter
    from specdec.adaptive import FixedCosts
    from tiny_models import get_model

    model = get_model(family) if device == "cpu" else copy.deepcopy(get_model(family)).to(device)
    ids, mask, eos, expected = _ending_by_eos(model)
    K = 0 if drafter is None else 3
    policy = {"cost_model": FixedCosts(lambda strategy, batch, k: 1.0 + 0.4 * k)} if auto else {}
    runs = {}
    # (the policy's probes, not shadow proposals, which on these tiny models' text see too little to
    # speculate: the calls mix plain and speculative steps; tests/test_adaptive.py has the shadows)
    monkeypatch.setenv("SPECDEC_SHADOW_PROPOSALS", "0")
    # (compiled whole: only where the programs are captured)
    for programs in ("1", "0", "outside") + (("compiled",) if device == "cuda" else ()):
        monkeypatch.setenv("SPECDEC_STEP_GRAPHS", "0" if programs == "0" else "1")
        monkeypatch.setenv("SPECDEC_CAPTURED_PROPOSALS", "0" if programs == "outside" else "1")
        monkeypatch.setenv("SPECDEC_COMPILED_STEPS", "1" if programs == "compiled" else "0")
        if drafter == "narrowing":
            draft = _Narrowing()
        elif drafter == "batched":
            draft = _BatchedSearch()
        else:
            draft = None if drafter is None else make_drafter(drafter, family)
        if isinstance(draft, DraftModelDrafter) and device != "cpu":
            draft = DraftModelDrafter(copy.deepcopy(draft.model).to(device))
        sd = specdec.wrap(model, num_speculative_tokens="auto" if auto else K, decode_path=path, **policy,
                          **({} if draft is None else {"drafter": draft}))
        in_program = draft is not None and sd.drafter.graph_safe(ids.to(device))
        if programs == "outside" and not in_program:
            continue
        run, kept, chosen = [], [], set()
        # by EOS, by the budget, by EOS again, then the rows in reverse order: one shape, so the bucket's
        # kept rows and programs (replayed) serve it
        for ending, flip in (({"eos_token_id": eos}, False), ({}, False), ({"eos_token_id": eos}, False),
                             ({"eos_token_id": eos}, True)):
            rows = torch.arange(ids.shape[0] - 1, -1, -1) if flip else torch.arange(ids.shape[0])
            out = sd.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=12, pad_token_id=0, **ending)
            st = sd.last_stats
            want = ("cuda_graph" if device == "cuda" else "static") if programs != "0" else None
            assert sd._step_programs_path == want
            kept.append(sd.decoder.loop_state)
            if K and programs != "0":  # which program made the steps' inputs (a policy's K = 0 steps: none proposed)
                inside = "proposal" if in_program and programs in ("1", "compiled") else "inputs"
                sources = kept[-1]._source
                assert sources == {K: inside} if not auto else (
                    set(sources) <= set(range(len(st.k_histogram)))
                    and all(v == (inside if k else "inputs") for k, v in sources.items()))
            chosen |= {k for k, c in enumerate(st.k_histogram) if c}
            if programs == "compiled":  # (each compiled and captured)
                assert all(p._compiled is not None and p.compile_error is None and p.error is None
                           for p in kept[-1]._programs.values())
            if in_program and programs in ("1", "compiled"):  # (reported where the call used a draft)
                assert st.draft_path in (None, want) and (st.draft_path is None) == (st.proposed_tokens == 0)
                assert st.draft_error is None
            elif not isinstance(draft, DraftModelDrafter):
                assert st.draft_path is None
            if ending:
                assert torch.equal(out, expected[rows.to(device)])
            run += [out, st.steps, st.new_tokens, st.accept_histogram, st.accepted_tokens, st.proposed_tokens,
                    st.mean_accepted_tokens, st.k_histogram]
        if auto:  # (the policy's calls ran plain steps and speculative ones)
            assert 0 in chosen and len(chosen) > 1, chosen
        if programs != "0":  # (the last two calls share one shape: the second reuses the first's state)
            assert kept[3] is kept[2] and kept[2] is not kept[1]
        else:
            assert kept == [None] * 4
        runs[programs] = run
    for other in [r for r in runs if r != "0"]:
        for i, (a, b) in enumerate(zip(runs[other], runs["0"])):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f"item {i} differs ({other})"


@pytest.mark.parametrize("family, drafter", [("nemotron_h", None), ("qwen3_5", "ngram"), ("qwen3_5", "perturbed"),
                                             ("nemotron_h", "narrowing"), ("qwen3_5", "batched")])
def test_the_step_programs_give_the_op_by_op_steps_results(monkeypatch, family, drafter):
    """See :func:`_check_step_programs` (the static path on the CPU runs the programs eagerly)."""
    _check_step_programs(monkeypatch, "static", family, drafter, "cpu")


@pytest.mark.parametrize("family, drafter", [("qwen3_5", "ngram"), ("nemotron_h", "perturbed"), ("qwen3_5", "batched")])
def test_the_step_programs_serve_k_chosen_per_step(monkeypatch, family, drafter):
    """See :func:`_check_step_programs` with ``auto``: a policy's steps, plain ones included, run
    as the step programs with the same results as op by op."""
    _check_step_programs(monkeypatch, "static", family, drafter, "cpu", auto=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family, drafter", [("nemotron_h", None), ("qwen3_5", "ngram"), ("qwen3_5", "perturbed"),
                                             ("nemotron_h", "narrowing")])
def test_the_step_programs_give_the_op_by_op_steps_results_on_cuda_graphs(monkeypatch, family, drafter):
    """See :func:`_check_step_programs`: on CUDA the programs are captured and replayed."""
    _check_step_programs(monkeypatch, "cuda_graph", family, drafter, "cuda")


def test_k_chosen_per_step_reports_the_path_of_the_proposals_it_ran():
    """With K chosen per step a graph-safe drafter proposes inside the programs of each K the
    policy picks, not the largest K's: ``Stats.draft_path`` is that program's path wherever the
    call proposed (here K = 1 of at most 3)."""
    import specdec
    from specdec.adaptive import FixedCosts
    from tiny_models import get_model, ragged_prompts

    ids, mask = ragged_prompts()
    sd = specdec.wrap(get_model("qwen3_5"), num_speculative_tokens="auto", decode_path="static",
                      drafter=_BatchedSearch(), max_speculative_tokens=3,
                      cost_model=FixedCosts(lambda strategy, batch, k: 1.0 + 0.4 * k))
    sd.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=0)
    st = sd.last_stats
    assert st.proposed_tokens > 0 and st.k_histogram[3] == 0, st.k_histogram
    assert (st.draft_path, st.draft_error) == ("static", None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family, drafter", [("qwen3_5", "ngram"), ("nemotron_h", "perturbed")])
def test_the_step_programs_serve_k_chosen_per_step_on_cuda_graphs(monkeypatch, family, drafter):
    """See :func:`_check_step_programs` with ``auto``: on CUDA each K's programs are captured."""
    _check_step_programs(monkeypatch, "cuda_graph", family, drafter, "cuda", auto=True)


@needs_triton_interpreter  # (which refuses every capture; on a GPU machine these CPU ops would be "captured")
def test_the_step_programs_compiled_whole_trace_as_one_graph(monkeypatch):
    """``SPECDEC_COMPILED_STEPS=1``: each step program (a graph-safe drafter's proposal inside it
    included) is compiled whole with ``fullgraph=True``: dynamo must trace every one of them, more
    programs than dynamo's recompile limit (8) among them, and the steps must give HF greedy's
    output. On a CPU with the ``aot_eager`` backend, capture forced on: refused there, so each
    program's first run (the warm-up) is its compiled one, each compiled once, and later runs
    are uncompiled."""
    from torch._dynamo.utils import counters

    import specdec
    import specdec.engine as engine
    from helpers import compile_with_aot_eager, hf_greedy
    from tiny_models import get_model, ragged_prompts

    monkeypatch.setenv("SPECDEC_COMPILED_STEPS", "1")
    compile_with_aot_eager(monkeypatch)
    init = engine._StepPrograms.__init__
    monkeypatch.setattr(engine._StepPrograms, "__init__", lambda self, state, capture: init(self, state, True))
    model = get_model("qwen3_5")
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask, max_new=10)
    sd = specdec.wrap(model, drafter=_BatchedSearch(), decode_path="static")
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    programs = {}
    with pytest.warns(RuntimeWarning, match="runs the static path eagerly"):  # (the refused captures)
        for K in (1, 2, 3, 4, 5):
            sd.num_speculative_tokens = K
            assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0), want), K
            programs.update(sd.decoder.loop_state._programs)
    # per K: the proposal program (its capture refused: the drafter then proposes outside, and the
    # settle program after it is freed), the inputs program and the settle program after that
    assert len(programs) == 15 and {kind for kind, _ in programs} == {"proposal", "inputs", "settle"}
    for key, program in programs.items():  # traced (a refused capture of the compiled program is no trace failure)
        assert program._compiled is not None, key
        assert program.compile_error is None or program.compile_error.startswith("capture of the compiled"), key
    # one graph per program compiled: the 15 kept, and the settle programs after the 5 proposal
    # programs, freed when those fell back outside
    assert counters["stats"]["unique_graphs"] - graphs == 20


class _Constant(Drafter):
    """Graph-safe: proposes token 5 K times for every row (device work only)."""

    stateless = True

    def graph_safe(self, input_ids):
        return True

    def propose(self, input_ids, lengths, num_speculative_tokens):
        B = input_ids.shape[0]
        drafts = torch.full((B, num_speculative_tokens), 5, dtype=torch.long, device=input_ids.device)
        return drafts, torch.full((B,), num_speculative_tokens, dtype=torch.long, device=input_ids.device)


def test_the_proposal_programs_belong_to_their_drafter():
    """A bucket's kept step programs across calls: a graph-safe drafter proposes in programs of
    its own (another drafter's are dropped, so switching back runs them anew), a drafter proposing
    outside frees them, and one whose proposal program failed to capture proposes outside from
    then on; every call's output equals HF greedy."""
    import specdec
    from helpers import hf_greedy
    from tiny_models import get_model, ragged_prompts

    model = get_model("qwen3_5")
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask, max_new=12)
    a, b = _BatchedSearch(), _BatchedSearch(max_ngram=2)
    sd = specdec.wrap(model, drafter=a, num_speculative_tokens=3, decode_path="static")

    def call():
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
        assert torch.equal(out, want)
        return sd.decoder.loop_state

    programs = call()
    first = programs._programs["proposal", 3]
    assert programs._proposer is a and programs._source == {3: "proposal"}
    sd.drafter = b
    assert call() is programs and programs._proposer is b and programs._programs["proposal", 3] is not first
    sd.drafter = NGramDrafter()  # (its host loop on the CPU: it proposes outside)
    assert call() is programs and programs._proposer is None and programs._source == {3: "inputs"}
    assert not [key for key in programs._programs if key[0] != "inputs" and key[0] != "settle"]
    sd.drafter = a
    call()
    assert programs._source == {3: "proposal"}
    programs._programs["proposal", 3].error = "RuntimeError: a capture that failed"
    call()
    assert programs._proposer is a and programs._source == {3: "inputs"}
    assert (sd.last_stats.draft_path, sd.last_stats.draft_error) == ("static", "RuntimeError: a capture that failed")


@pytest.mark.gpu
@needs_cuda
def test_a_captured_proposal_is_captured_anew_for_another_drafter(monkeypatch):
    """The kept step programs replay the proposal kernels they captured: after the generator's
    drafter is replaced by another graph-safe one, its proposals are captured anew, so the
    outputs and statistics equal that drafter's proposing outside the programs."""
    import specdec
    from tiny_models import get_model, ragged_prompts

    model = copy.deepcopy(get_model("qwen3_5")).to("cuda")
    ids, mask = (t.to("cuda") for t in ragged_prompts())

    def calls(sd):
        out = []
        for _ in range(3):
            o = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
            st = sd.last_stats
            out.append((o.tolist(), st.steps, st.accept_histogram, st.accepted_tokens, st.proposed_tokens))
        return out

    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path="cuda_graph")
    calls(sd)
    programs = sd.decoder.loop_state
    assert programs._programs["proposal", 3].graph is not None
    sd.drafter = _Constant()
    got = calls(sd)
    assert sd.decoder.loop_state is programs and programs._proposer is sd.drafter
    assert programs._programs["proposal", 3].graph is not None
    monkeypatch.setenv("SPECDEC_CAPTURED_PROPOSALS", "0")
    want = calls(specdec.wrap(model, drafter=_Constant(), num_speculative_tokens=3, decode_path="cuda_graph"))
    assert got == want


def test_a_bad_proposal_is_refused_through_the_step_programs(monkeypatch):
    """The drafter-output checks run inside the step programs: counts past the drafts' columns
    and ids outside the vocabulary are refused as op by op."""
    import specdec
    from tiny_models import get_model

    class Bad(NGramDrafter):
        def __init__(self, what):
            super().__init__()
            self.what, self.calls = what, 0

        def graph_safe(self, input_ids):
            return False  # (it keeps a count between calls)

        def propose(self, input_ids, lengths, num_speculative_tokens):
            self.calls += 1
            drafts, counts = super().propose(input_ids, lengths, num_speculative_tokens)
            if self.calls == 3:  # (after the programs' first, eager, run and their capture)
                if self.what == "counts":
                    counts = torch.full_like(counts, drafts.shape[1] + 1)
                else:
                    drafts = torch.full_like(drafts, 10**6)
                    counts = torch.full_like(counts, drafts.shape[1])
            return drafts, counts

    from tiny_models import ragged_prompts

    ids, mask = ragged_prompts()
    for what, match in (("counts", "num_draft_tokens outside"), ("ids", "outside the target's vocabulary")):
        sd = specdec.wrap(get_model("nemotron_h"), drafter=Bad(what), num_speculative_tokens=3, decode_path="static")
        with pytest.raises(ValueError, match=match):
            sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)


@pytest.mark.parametrize("what, error, match", [
    ("counts", ValueError, r"num_draft_tokens outside \[0, 3\] \(its draft_tokens have 3 columns; a count may not "
                           r"exceed them\)$"),
    ("ids", ValueError, "outside the target's vocabulary"),
    ("wide", ValueError, "returned 4 draft tokens per row; at most num_speculative_tokens=3"),
    ("float", TypeError, "num_draft_tokens of dtype torch.float32"),
    ("pair", TypeError, "must return a pair"),
])
def test_a_graph_safe_drafters_bad_proposal_is_refused_inside_the_step_programs(what, error, match):
    """A graph-safe drafter's proposal, made inside the step programs, is checked there as any
    other: bad values at the step's sync (the counts' values are not quoted: the next proposal
    reuses their buffer), bad types and shapes at once."""
    import specdec
    from tiny_models import get_model, ragged_prompts

    class Bad(_BatchedSearch):
        def propose(self, input_ids, lengths, num_speculative_tokens):
            drafts, counts = super().propose(input_ids, lengths, num_speculative_tokens)
            if what == "counts":
                return drafts, counts + drafts.shape[1] + 1
            if what == "ids":
                return drafts + 10**6, torch.full_like(counts, drafts.shape[1])
            if what == "wide":
                return torch.cat([drafts, drafts[:, :1]], 1), counts
            if what == "float":
                return drafts, counts.float()
            return [drafts]

    ids, mask = ragged_prompts()
    sd = specdec.wrap(get_model("nemotron_h"), drafter=Bad(), num_speculative_tokens=3, decode_path="static")
    with pytest.raises(error, match=match):
        sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert sd.decoder.loop_state._source == {3: "proposal"}


def test_the_kept_step_state_serves_its_bucket_and_is_freed_without_a_collection():
    """Calls of one static bucket with other budgets share one kept state (its rows are as wide
    as the bucket allows); the kept state holds no reference cycle, so ``release()`` (and a call
    of another bucket) frees the decoder, its cache and the programs at once, with Python's
    collector off."""
    import gc
    import weakref

    import specdec
    from helpers import hf_greedy
    from tiny_models import get_model, ragged_prompts

    model = get_model("nemotron_h")
    ids, mask = ragged_prompts()
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path="static")
    kept = set()
    for new in (10, 13, 17):
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
        assert torch.equal(out, hf_greedy(model, ids, mask, max_new=new))
        kept.add(id(sd.decoder.loop_state))
    assert len(kept) == 1
    was_on = gc.isenabled()
    gc.disable()
    try:
        dec, cache, programs = (weakref.ref(x) for x in (sd.decoder, sd.decoder.cache, sd.decoder.loop_state))
        sd.release()
        assert dec() is None and cache() is None and programs() is None
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
        dec, programs = weakref.ref(sd.decoder), weakref.ref(sd.decoder.loop_state)
        sd.generate(ids, attention_mask=mask, max_new_tokens=400, pad_token_id=0)  # (another bucket)
        assert dec() is None and programs() is None
    finally:
        if was_on:
            gc.enable()
