"""``wrap(...).generate()`` takes what HF's ``generate()`` takes for decoding, with HF's results:
streamers, stopping criteria, EOS lists, ``min_new_tokens`` / ``min_length``, ``repetition_penalty``
(applied per verify position with that position's own prefix), ``return_dict_in_generate`` with
``scores`` / ``logits``, a ``GenerationConfig``; unsupported settings raise ``ValueError``.

Streamers on the static decode path: the put()/end() calls (values, shapes, dtypes, order) equal
the eager path's and HF ``generate(streamer=...)``'s at the budget edges (max_new_tokens 1-3), with
EOS as the first generated token, EOS mid-step, an EOS list, for the n-gram drafter, a draft
model, an oracle Medusa-style tree and K = 0; sampling puts exactly the returned tokens and does
not change them; a failing put() leaves the wrapper usable; a drafter error stops the stream where
the eager path stops it; HF text streamers print HF's text."""

from __future__ import annotations

import contextlib
import functools
import io

import numpy as np
import pytest
import torch
from helpers import StreamRecorder, record_prompt_forwards, rel_err
from tiny_models import VOCAB, get_model, make_model, ragged_prompts, tiny_tokenizer
from transformers import (
    GenerationConfig, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer, TextStreamer,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria
from tree_drafters import OracleTree, reference_rows

import specdec
from specdec.drafters import Drafter, DraftModelDrafter
from specdec.rollback import ReplayRollback

FAMILY = "qwen3_5"
MAX_NEW = 12


def hf(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)


def drafter(kind):
    return "ngram" if kind == "ngram" else DraftModelDrafter(get_model(FAMILY, "perturbed"))


def wrap(kind="draft", strategy="replay"):
    return specdec.wrap(get_model(FAMILY), drafter=drafter(kind), rollback=strategy, num_speculative_tokens=3)


def eos_ids(ids, plain):
    """EOS ids that stop rows 0 and 1 early (at their 3rd and 2nd new token)."""
    L = ids.shape[1]
    return [int(plain[0, L + 2]), int(plain[1, L + 1])]


# ------------------------------------------------------------------------------------------------
# streamer


def test_streamer_ids_match_hf():
    model = get_model(FAMILY)
    ids, mask = ragged_prompts(batch=1)
    ours, theirs = StreamRecorder(), StreamRecorder()
    out = wrap().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, streamer=ours)
    ref = hf(model, ids, mask, streamer=theirs)
    assert torch.equal(out, ref)
    assert ours.ended and theirs.ended
    assert ours.puts[0] == ids[0].tolist()  # the prompt first, as HF does
    flat = [t for p in ours.puts[1:] for t in p]
    assert flat == out[0, ids.shape[1]:].tolist() == [t for p in theirs.puts[1:] for t in p]


def test_text_streamer_text_equals_decoded_output():
    tok = tiny_tokenizer()
    model = get_model(FAMILY)
    ids, mask = ragged_prompts(batch=1)
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = wrap("ngram").generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, streamer=streamer)
    text = "".join(streamer)
    assert text.strip() == tok.decode(out[0, ids.shape[1]:]).strip() != ""
    hf_streamer = TextIteratorStreamer(tok, skip_prompt=True)
    hf(model, ids, mask, streamer=hf_streamer)
    assert text == "".join(hf_streamer)


@pytest.mark.parametrize("kind", ["draft", "tree"])
def test_static_path_streams_what_the_eager_path_streams(kind):
    """On the static decode path (the CUDA-graph path minus the graphs) a streamer gets the prompt,
    then every committed token in its own put, then end(): the same calls as on the eager path and
    the same tokens as HF's streamer, also when EOS stops the row mid-step."""
    model = get_model(FAMILY)
    ids, mask = ragged_prompts(batch=1)
    plain = hf(model, ids, mask)
    eos = int(plain[0, ids.shape[1] + 7])
    theirs = StreamRecorder()
    ref = hf(model, ids, mask, eos_token_id=eos, streamer=theirs)
    got = {}
    for path in ("eager", "static"):
        d = OracleTree(reference_rows(ref, ids, mask), VOCAB) if kind == "tree" else drafter("draft")
        sd = specdec.wrap(model, drafter=d, rollback="ring", num_speculative_tokens=4, decode_path=path)
        ours = StreamRecorder()
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=eos,
                          streamer=ours)
        assert torch.equal(out, ref) and ours.ended and sd.last_stats.decode_path == path
        assert sd.last_stats.mean_accepted_tokens > 1.5  # multi-token steps were streamed
        got[path] = ours.puts
    assert got["static"] == got["eager"] == theirs.puts  # one token per put after the prompt, as HF


def test_streamer_needs_batch_one():
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match="batch size 1"):
        wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, streamer=StreamRecorder())


# ------------------------------------------------------------------------------------------------
# streamers on the static decode path: the same calls as on the eager path and in HF

#: drafters the static-path streamer tests run: n-gram, a draft model, an oracle tree, none (K = 0)
STREAM_DRAFTERS = ("ngram", "draft", "tree", "plain")


def one_prompt():
    return ragged_prompts(batch=1)


def hf_streamed(max_new, **kw):
    """HF greedy decoding of :func:`one_prompt` with a streamer: ``(output, the streamer's calls)``."""
    ids, mask = one_prompt()
    rec = StreamRecorder()
    out = get_model(FAMILY).generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                                     max_new_tokens=max_new, streamer=rec, **kw)
    return out, rec.calls


@functools.cache
def plain_tokens():
    """HF greedy's first 16 new tokens for :func:`one_prompt`."""
    ids, _ = one_prompt()
    return hf_streamed(16)[0][0, ids.shape[1]:].tolist()


def wrap_on_path(kind, path, ref=None, K=4, strategy="ring"):
    """The target wrapped on the decode path ``path`` with the drafter ``kind`` (one of
    :data:`STREAM_DRAFTERS`; ``"tree"``: an oracle tree hiding ``ref``, ``"plain"``: K = 0)."""
    ids, mask = one_prompt()
    model = get_model(FAMILY)
    if kind == "draft":
        d = drafter("draft")
    elif kind == "tree":
        d = OracleTree(reference_rows(ref, ids, mask), VOCAB)
    else:
        d = "ngram"
    return specdec.wrap(model, drafter=d, rollback=strategy, num_speculative_tokens=0 if kind == "plain" else K,
                        decode_path=path)


STREAM_SETTINGS = {  # name: (max_new_tokens, eos_token_id as positions in the plain continuation)
    "budget_1": (1, None),
    "budget_2": (2, None),
    "budget_3": (3, None),
    "eos_first_token": (12, [0]),
    "eos_second_token": (12, [1]),
    "eos_mid_step": (12, [6]),
    "eos_list": (12, [9, 5]),  # the earlier one (position 5) stops
    "eos_on_last_budget_token": (8, [7]),
}


@pytest.mark.parametrize("setting", list(STREAM_SETTINGS))
def test_static_puts_equal_eager_and_hf(setting):
    max_new, eos_pos = STREAM_SETTINGS[setting]
    p = plain_tokens()
    kw = {} if eos_pos is None else {"eos_token_id": [p[i] for i in eos_pos] if len(eos_pos) > 1 else p[eos_pos[0]]}
    ref, theirs = hf_streamed(max_new, **kw)
    ids, mask = one_prompt()
    assert theirs[0][3] == ids[0].tolist() and theirs[-1] == ("end",)
    multi = 0
    for kind in STREAM_DRAFTERS:
        for path in ("eager", "static"):
            sd = wrap_on_path(kind, path, ref)
            rec = StreamRecorder()
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=0, streamer=rec, **kw)
            assert sd.last_stats.decode_path == path
            assert torch.equal(out, ref), (kind, path)
            assert rec.calls == theirs, (kind, path)
            multi += path == "static" and sd.last_stats.mean_accepted_tokens > 1.5
    if max_new >= 8 and (eos_pos is None or min(eos_pos) >= 5):
        assert multi >= 1  # some static runs committed several tokens per step (and streamed them one by one)


@pytest.mark.parametrize("kind", ["ngram", "draft", "plain"])
def test_static_sampling_streams_the_returned_tokens_and_does_not_change_them(kind):
    ids, mask = one_prompt()
    L = ids.shape[1]
    kw = {"attention_mask": mask, "max_new_tokens": 14, "pad_token_id": 0, "do_sample": True, "temperature": 1.3,
          "top_k": 20, "eos_token_id": [5, 7]}
    for seed in range(2):
        sd = wrap_on_path(kind, "static", K=3)
        rec = StreamRecorder()
        out = sd.generate(ids, streamer=rec, generator=torch.Generator().manual_seed(seed), **kw)
        toks = rec.new_tokens()
        assert rec.calls[0][3] == ids[0].tolist() and rec.calls[-1] == ("end",)
        assert toks == out[0, L:L + len(toks)].tolist() and bool((out[0, L + len(toks):] == 0).all())
        same = sd.generate(ids, generator=torch.Generator().manual_seed(seed), **kw)
        assert torch.equal(out, same)  # the streamer does not change what is sampled
        if kind == "plain":  # one token per step: the static path samples as the eager one
            eager = StreamRecorder()
            wrap_on_path(kind, "eager").generate(ids, streamer=eager, generator=torch.Generator().manual_seed(seed), **kw)
            assert eager.calls == rec.calls


class Boom(Exception):
    pass


class FailingStreamer:
    def __init__(self, at):
        self.at, self.n, self.ended = at, 0, False

    def put(self, value):
        self.n += 1
        if self.n == self.at:
            raise Boom

    def end(self):
        self.ended = True


@pytest.mark.parametrize("kind", ["draft", "tree"])
def test_a_failing_put_leaves_the_wrapper_usable(kind):
    """put() raising (the prompt, the first token, a step's token) propagates with no end() call,
    as on the eager path and in HF; the next generate() on the same wrapper is exact and streams."""
    ids, mask = one_prompt()
    p = plain_tokens()
    ref, theirs = hf_streamed(12, eos_token_id=p[9])
    sd = wrap_on_path(kind, "static", ref)
    for at in (1, 2, 4):
        bad = FailingStreamer(at)
        with pytest.raises(Boom):
            sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=p[9], streamer=bad)
        assert bad.n == at and not bad.ended
        rec = StreamRecorder()
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=p[9], streamer=rec)
        assert torch.equal(out, ref) and rec.calls == theirs and sd.last_stats.decode_path == "static"


class BadDrafter(Drafter):
    """Proposes ones, then at call ``at`` an out-of-vocabulary token or too many drafts."""

    def __init__(self, at, what):
        self.at, self.what, self.n = at, what, 0

    def propose(self, input_ids, lengths, num_speculative_tokens):
        self.n += 1
        B, K = input_ids.shape[0], num_speculative_tokens
        drafts, counts = torch.ones(B, K, dtype=torch.long), torch.full((B,), K)
        if self.n == self.at:
            if self.what == "token":
                drafts[:, 0] = VOCAB + 5
            else:
                counts[:] = K + 3
        return drafts, counts


@pytest.mark.parametrize("what", ["token", "count"])
def test_a_drafter_error_stops_the_stream_where_the_eager_path_stops_it(what):
    ids, mask = one_prompt()
    got = {}
    for path in ("eager", "static"):
        rec = StreamRecorder()
        sd = specdec.wrap(get_model(FAMILY), drafter=BadDrafter(3, what), num_speculative_tokens=3, decode_path=path)
        with pytest.raises(ValueError, match="drafter"):
            sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, streamer=rec)
        got[path] = rec.calls
    assert got["static"] == got["eager"] and ("end",) not in got["static"] and len(got["static"]) >= 3


@pytest.mark.parametrize("skip_prompt", [True, False])
def test_text_streamers_on_the_static_path_give_hf_text(skip_prompt):
    tok = tiny_tokenizer()
    model = get_model(FAMILY)
    ids, mask = one_prompt()
    eos = plain_tokens()[9]
    kw = {"attention_mask": mask, "max_new_tokens": 16, "pad_token_id": 0, "eos_token_id": eos}
    theirs = TextIteratorStreamer(tok, skip_prompt=skip_prompt, timeout=10)
    model.generate(ids, do_sample=False, streamer=theirs, **kw)
    want = "".join(theirs)
    ours = TextIteratorStreamer(tok, skip_prompt=skip_prompt, timeout=10)
    wrap_on_path("ngram", "static").generate(ids, streamer=ours, **kw)
    assert "".join(ours) == want != ""
    printed = []
    for run in (lambda s: model.generate(ids, do_sample=False, streamer=s, **kw),
                lambda s: wrap_on_path("draft", "static").generate(ids, streamer=s, **kw)):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            run(TextStreamer(tok, skip_prompt=skip_prompt))
        printed.append(buf.getvalue())
    assert printed[0] == printed[1] != ""


# ------------------------------------------------------------------------------------------------
# stopping criteria, EOS lists


class StopAfter(StoppingCriteria):
    """Stops a row once its last token is in ``tokens`` (per row, on its own sequence)."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


@pytest.mark.parametrize("with_eos", [True, False])
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_stopping_criteria_match_hf(kind, with_eos):
    """Rows stop at different steps. With an EOS set HF pads a stopped row at once; without one it
    runs every row on until all have stopped (then all end at that step): both as HF does."""
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    plain = hf(model, ids, mask)
    L = ids.shape[1]
    stops = eos_ids(ids, plain) + [int(plain[2, L + 5])]  # rows stop at their 3rd, 2nd, (at most) 6th token
    unused = next(t for t in range(3, VOCAB) if t not in plain[:, L:].tolist()[0] + plain[:, L:].tolist()[1]
                  + plain[:, L:].tolist()[2])
    extra = dict(eos_token_id=unused) if with_eos else {}
    crit = StoppingCriteriaList([StopAfter(stops)])
    ref = hf(model, ids, mask, stopping_criteria=crit, **extra)
    assert ref.shape[1] < plain.shape[1]
    if with_eos:
        assert (ref[:2, L + 4:] == 0).all()
    out = wrap(kind).generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, stopping_criteria=crit,
                              **extra)
    assert torch.equal(out, ref), f"\n{out[:, L:]}\n{ref[:, L:]}"
    # a plain list of criteria is accepted too
    out = wrap(kind).generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0,
                              stopping_criteria=[StopAfter(stops)], **extra)
    assert torch.equal(out, ref)


class RowZeroReference(Drafter):
    """Row 0 proposes its reference continuation (all accepted), the other rows propose nothing:
    row 0 runs ahead of the rest."""

    def __init__(self, reference, prompt_len):
        self.reference, self.prompt_len = reference, prompt_len

    def propose(self, input_ids, lengths, num_speculative_tokens):
        K = num_speculative_tokens
        drafts = torch.zeros(input_ids.shape[0], K, dtype=torch.long)
        counts = torch.zeros(input_ids.shape[0], dtype=torch.long)
        done = int(lengths[0]) - self.prompt_len
        drafts[0] = self.reference[done:done + K]
        counts[0] = K
        return drafts, counts


def test_criteria_without_eos_count_only_the_returned_tokens():
    """Without an EOS id a row whose criteria held runs on until every row's criteria have held,
    then all rows end at that step (HF): a row that ran ahead of that step is cut back, and
    ``new_tokens`` counts the tokens returned, not the ones cut."""
    model = get_model(FAMILY)
    ids, mask = ragged_prompts(batch=2, lengths=(12, 7))
    plain = hf(model, ids, mask)
    L = ids.shape[1]
    crit = StoppingCriteriaList([StopAfter([int(plain[0, L + 1]), int(plain[1, L + 3])])])
    ref = hf(model, ids, mask, stopping_criteria=crit)
    assert ref.shape[1] == L + 4  # every row's criteria held at the 4th new token
    sd = specdec.wrap(model, drafter=RowZeroReference(plain[0, L:], int(mask[0].sum())), num_speculative_tokens=4)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, stopping_criteria=crit)
    assert torch.equal(out, ref)
    st = sd.last_stats
    assert st.accepted_tokens >= 4  # row 0 committed more tokens than were returned
    assert st.new_tokens == 2 * 4


def test_an_eos_criterion_among_the_stopping_criteria_pads_stopped_rows():
    """HF pads every row stopped by a criterion when any criterion has an ``eos_token_id`` (an
    ``EosTokenCriteria`` given in ``stopping_criteria``, with no ``eos_token_id`` setting): rows
    do not run on."""
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    plain = hf(model, ids, mask)
    L = ids.shape[1]
    crit = StoppingCriteriaList([EosTokenCriteria(eos_token_id=int(plain[1, L + 2]))])
    ref = hf(model, ids, mask, stopping_criteria=crit)
    assert (ref[1, L + 3:] == 0).all() and ref.shape[1] == plain.shape[1]  # row 1 padded, the others ran on
    out = wrap().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, stopping_criteria=crit)
    assert torch.equal(out, ref)


def test_eos_list_matches_hf():
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    eos = eos_ids(ids, hf(model, ids, mask))
    ref = hf(model, ids, mask, eos_token_id=eos)
    assert torch.equal(wrap().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=eos), ref)


# ------------------------------------------------------------------------------------------------
# logits processors: min_new_tokens / min_length, repetition_penalty


@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("setting", ["min_new_tokens", "min_length"])
def test_min_tokens_match_hf(kind, setting):
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    plain = hf(model, ids, mask)
    eos = eos_ids(ids, plain)
    value = 6 if setting == "min_new_tokens" else ids.shape[1] + 6
    ref = hf(model, ids, mask, eos_token_id=eos, **{setting: value})
    early = hf(model, ids, mask, eos_token_id=eos)
    assert not torch.equal(ref, early)  # EOS suppression changed the output
    out = wrap(kind).generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=eos,
                              **{setting: value})
    assert torch.equal(out, ref)


@pytest.mark.parametrize("strategy", ["snapshot", "replay"])
@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_hf(penalty, kind, strategy):
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    ref = hf(model, ids, mask, repetition_penalty=penalty)
    assert not torch.equal(ref, hf(model, ids, mask))
    sd = wrap(kind, strategy)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, repetition_penalty=penalty)
    assert torch.equal(out, ref)
    if kind == "draft":
        assert sd.last_stats.accepted_tokens > 0  # positions after accepted drafts were penalised too


def test_penalty_and_min_new_tokens_together():
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    eos = eos_ids(ids, hf(model, ids, mask))
    kw = dict(eos_token_id=eos, repetition_penalty=1.3, min_new_tokens=4)
    ref = hf(model, ids, mask, **kw)
    assert torch.equal(wrap().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, **kw), ref)


# ------------------------------------------------------------------------------------------------
# return_dict_in_generate, scores, logits; GenerationConfig


def check_scores(ours, theirs, sequences, L, eos):
    """Scores agree (1e-4) at every position a row was still generating; -inf in the same places."""
    assert len(ours) == len(theirs)
    gen = sequences[:, L:]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and a.dtype == torch.float32
        for row in range(a.shape[0]):
            if any(int(t) in eos for t in gen[row, :i]):
                continue  # the row had stopped: HF keeps running it on padding, specdec does not
            fin = torch.isfinite(b[row])
            assert torch.equal(torch.isfinite(a[row]), fin)
            torch.testing.assert_close(a[row][fin], b[row][fin], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_return_dict_scores_and_logits_match_hf(kind):
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    eos = eos_ids(ids, hf(model, ids, mask))
    kw = dict(eos_token_id=eos, repetition_penalty=1.2, min_new_tokens=2, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    ref = hf(model, ids, mask, **kw)
    out = wrap(kind).generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    L = ids.shape[1]
    check_scores(out.scores, ref.scores, ref.sequences, L, eos)
    check_scores(out.logits, ref.logits, ref.sequences, L, eos)
    # the chosen token is the argmax of its processed scores
    for i, s in enumerate(out.scores):
        live = [r for r in range(3) if not any(int(t) in eos for t in out.sequences[r, L:L + i])]
        assert torch.equal(s[live].argmax(-1), out.sequences[live, L + i])


def test_return_dict_sequences_only():
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    out = wrap().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, hf(model, ids, mask)) and out.scores is None and out.logits is None
    zero = wrap().generate(ids, attention_mask=mask, max_new_tokens=0, pad_token_id=0, return_dict_in_generate=True)
    assert torch.equal(zero.sequences, ids)


def test_sampled_scores_are_warped():
    ids, mask = ragged_prompts()
    g = torch.Generator().manual_seed(0)
    out = wrap().generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=True, top_k=5,
                          temperature=0.7, generator=g, return_dict_in_generate=True, output_scores=True)
    L = ids.shape[1]
    for i, s in enumerate(out.scores):
        assert (torch.isfinite(s).sum(-1) <= 5).all()  # top-k applied, as HF's returned scores are
        assert torch.isfinite(s[torch.arange(3), out.sequences[:, L + i]]).all()


@pytest.mark.parametrize("sample", [False, True])
def test_bf16_model_returns_fp32_scores_from_its_logits(sample):
    """A bf16 target: scores and logits are fp32, as HF returns them, and the scores are the
    (warped, when sampling) fp32 logits."""
    model = make_model(FAMILY).to(torch.bfloat16)
    ids, mask = ragged_prompts()
    kw = dict(do_sample=True, temperature=0.7, top_k=20, generator=torch.Generator().manual_seed(0)) if sample else {}
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, return_dict_in_generate=True,
                      output_scores=True, output_logits=True, **kw)
    assert len(out.scores) == len(out.logits) == 6
    for s, raw in zip(out.scores, out.logits):
        assert s.dtype == raw.dtype == torch.float32
        warped = TopKLogitsWarper(20)(None, TemperatureLogitsWarper(0.7)(None, raw)) if sample else raw
        torch.testing.assert_close(s, warped, rtol=0, atol=0)


def test_generation_config_object():
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    eos = eos_ids(ids, hf(model, ids, mask))
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=0,
                          repetition_penalty=1.4, min_new_tokens=3)
    ref = model.generate(ids, attention_mask=mask, generation_config=gc)
    assert torch.equal(wrap().generate(ids, attention_mask=mask, generation_config=gc), ref)


def test_a_given_generation_config_is_filled_from_the_models():
    """As in HF, a ``generation_config`` passed to the call takes what it leaves unset from the
    model's own: here its EOS ids (the rows stop where HF's stop), in ``generate`` and
    ``generate_batch``; and the sampling settings left unset anywhere get transformers' defaults
    (``top_k=50``), so sampling draws what HF's would (the same seeded draws as an explicit 50)."""
    from specdec.settings import resolve

    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    eos = eos_ids(ids, hf(model, ids, mask))
    saved = model.generation_config.to_dict()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 0
    try:
        gc = GenerationConfig(max_new_tokens=MAX_NEW)
        ref = model.generate(ids, attention_mask=mask, generation_config=gc)
        assert torch.equal(wrap().generate(ids, attention_mask=mask, generation_config=gc), ref)
        batch = wrap().generate_batch([ids[0].tolist()], generation_config=gc)["req_0"].generated_tokens
        assert batch == ref[0, ids.shape[1]:ids.shape[1] + len(batch)].tolist() and batch[-1] in eos
        model.generation_config.top_k = 5
        s = resolve(model, VOCAB, ids.device, ids, mask, GenerationConfig(do_sample=True), overrides={})
        assert s.sampling.top_k == 5  # the model's own setting
    finally:
        model.generation_config = GenerationConfig.from_dict(saved)
    s = resolve(model, VOCAB, ids.device, ids, mask, overrides={"do_sample": True})
    assert s.sampling.top_k == GenerationConfig._get_default_generation_params()["top_k"] == 50
    draws = [wrap("ngram").generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, pad_token_id=0,
                                    generator=torch.Generator().manual_seed(3), **kw) for kw in ({}, {"top_k": 50})]
    assert torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("key, kept, given", [("temperature", 0.6, 0.7), ("top_k", 20, 5), ("top_p", 0.8, 0.5)])
def test_the_models_own_sampling_settings_do_not_warn_on_greedy_calls(key, kept, given):
    """A checkpoint's generation_config often carries sampling settings: a greedy call is not
    warned about them (as HF is not); a value the call gives is."""
    import warnings

    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    saved = getattr(model.generation_config, key)
    setattr(model.generation_config, key, kept)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            wrap().generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
        with pytest.warns(UserWarning, match=f"{key}={given} has no effect"):
            wrap().generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **{key: given})
    finally:
        setattr(model.generation_config, key, saved)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
        (dict(output_attentions=True), "output_attentions"),
        (dict(stop_strings=["w3"]), "stop_strings"),
        (dict(logits_processor=[]), "logits_processor"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(min_new_tokens=-2), "min_new_tokens"),
    ],
)
def test_unsupported_settings_raise(kwargs, pattern):
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match=pattern):
        wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(do_sample="no"), TypeError, "do_sample must be True or False, got 'no'"),
    (dict(do_sample=1), TypeError, "do_sample must be True or False"),
    (dict(eos_token_id=-1), ValueError, r"eos_token_id -1 lies outside the vocabulary \[0, 96\)"),
    (dict(eos_token_id=[5, VOCAB]), ValueError, rf"eos_token_id {VOCAB} lies outside the vocabulary"),
])
def test_bad_values_raise(kwargs, error, pattern):
    ids, mask = ragged_prompts()
    with pytest.raises(error, match=pattern):
        wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kwargs)


def test_meta_input_ids_are_refused_by_name():
    """input_ids on the meta device (a shape without values) are refused naming the argument and
    what is accepted, not with a torch error from the first read of their values."""
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match=r"input_ids is on the meta device .* on the CPU or the model's device"):
        wrap().generate(ids.to("meta"), attention_mask=mask, max_new_tokens=4, pad_token_id=0)


@pytest.mark.parametrize("pad", [-5, VOCAB, 10**6])
def test_a_pad_token_id_outside_the_vocabulary_raises(pad):
    """pad_token_id fills rows that stopped early in the output, where a tokenizer could not
    decode an id outside the vocabulary: given on the call, or in a generation_config passed, it
    is refused, as eos_token_id is."""
    from transformers import GenerationConfig

    ids, mask = ragged_prompts()
    match = rf"pad_token_id {pad} lies outside the vocabulary \[0, {VOCAB}\)"
    with pytest.raises(ValueError, match=match):
        wrap().generate(ids, attention_mask=mask, max_new_tokens=[2, 6, 4], pad_token_id=pad)
    with pytest.raises(ValueError, match=match):
        wrap().generate(ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=4, pad_token_id=pad))


def test_an_inherited_pad_token_id_outside_the_vocabulary_is_dropped_with_a_warning(monkeypatch):
    """A pad_token_id the model's generation_config carries outside the vocabulary is not used to
    fill rows (a tokenizer could not decode it): a warning, and the first EOS id pads instead."""
    sd = wrap()
    ids, mask = ragged_prompts()
    monkeypatch.setattr(sd.model.generation_config, "pad_token_id", VOCAB + 7)
    plain = sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    eos = eos_ids(ids, plain)
    with pytest.warns(UserWarning, match=rf"generation_config pad_token_id {VOCAB + 7} lies outside the vocabulary"):
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos)
    assert int(out.max()) < VOCAB and bool((out[:, ids.shape[1]:] == eos[0]).any())


def test_an_inherited_eos_list_drops_only_its_ids_outside_the_vocabulary(monkeypatch):
    """Of the EOS ids the model's generation_config carries, one outside the vocabulary is dropped
    with a warning that names the ids still used; those still stop rows. With none left, the
    warning says that no EOS stops rows."""
    sd = wrap()
    ids, mask = ragged_prompts()
    plain = sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    eos = eos_ids(ids, plain)
    monkeypatch.setattr(sd.model.generation_config, "eos_token_id", [eos[0], VOCAB + 3])
    with pytest.warns(UserWarning, match=rf"eos_token_id {VOCAB + 3} lies outside .*not used \(the other "
                                         rf"eos_token_id \[{eos[0]}\] still used\)"):
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert torch.equal(out, sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, eos_token_id=eos[0]))
    assert not torch.equal(out, plain)  # (row 0 stopped at its 3rd new token)
    monkeypatch.setattr(sd.model.generation_config, "eos_token_id", [VOCAB + 3])
    with pytest.warns(UserWarning, match=r"not used \(no EOS stops rows\)"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)


def test_beyond_the_models_context_warns(monkeypatch):
    """A prompt + budget beyond config.max_position_embeddings runs, as in HF's generate(), with a
    warning that says so; within it, none."""
    import warnings

    sd = wrap()
    ids, mask = ragged_prompts()  # 12 columns
    monkeypatch.setattr(sd.model.config, "max_position_embeddings", 16)
    with pytest.warns(UserWarning, match=r"reach 20 positions, beyond the model's context \(config.max_position_embeddings=16\)"):
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=[2, 8, 4], pad_token_id=0)
    assert out.shape == (3, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)


def test_a_budget_whose_caches_cannot_fit_memory_is_refused():
    """A budget far beyond the model's context whose caches could not fit the device's memory is
    refused before any work, with the bytes needed and free, where the allocator failed."""
    sd = wrap()
    ids, mask = ragged_prompts()
    with pytest.warns(UserWarning, match="beyond the model's context"):
        with pytest.raises(ValueError, match=r"max_new_tokens=1000000000: the caches of 3 rows .* need [\d.]+ [KMGTP]?i?B, "
                                             r"more than the [\d.]+ [KMGTP]?i?B free"):
            sd.generate(ids, attention_mask=mask, max_new_tokens=10**9, pad_token_id=0)
    assert sd.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0).shape == (3, 14)


def test_inherited_eos_outside_the_vocabulary_is_dropped_with_a_warning():
    """A model built from a larger config's defaults may keep an EOS id its vocabulary lacks: it
    is dropped with a warning (it could never end a row, and min_new_tokens would index the logits
    with it), the ids in the vocabulary still count, and the output is HF's with those alone."""
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    eos = eos_ids(ids, hf(model, ids, mask))
    ref = hf(model, ids, mask, eos_token_id=eos, min_new_tokens=2)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [*eos, VOCAB + 7]
    try:
        with pytest.warns(UserWarning, match=rf"generation_config eos_token_id {VOCAB + 7} lies outside"):
            out = wrap().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, min_new_tokens=2)
    finally:
        model.generation_config.eos_token_id = saved
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kwargs, named", [(dict(top_k=5), "top_k=5"), (dict(top_p=0.5), "top_p=0.5"),
                                           (dict(top_k=5, top_p=0.5), "top_k=5, top_p=0.5")])
def test_the_calls_own_top_k_or_top_p_with_greedy_warns(kwargs, named):
    """As temperature: the call's own top_k / top_p have no effect on greedy decoding, said once at
    the caller's line; the output is greedy's."""
    ids, mask = ragged_prompts()
    ref = wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    with pytest.warns(UserWarning, match=rf"{named} ha(s|ve) no effect with do_sample=False") as seen:
        out = wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, **kwargs)
    assert torch.equal(out, ref) and seen[0].filename == __file__


def test_max_length_beside_max_new_tokens_warns_that_max_new_tokens_wins():
    ids, mask = ragged_prompts()  # 12 columns
    with pytest.warns(UserWarning, match=r"max_new_tokens=6 and max_length=14 both given: max_new_tokens takes") as seen:
        out = wrap().generate(ids, attention_mask=mask, max_new_tokens=6, max_length=14, pad_token_id=0)
    assert out.shape == (3, 18) and seen[0].filename == __file__


def test_generator_with_greedy_warns_at_the_callers_line():
    ids, mask = ragged_prompts()
    with pytest.warns(UserWarning, match="generator= has no effect with do_sample=False") as seen:
        wrap().generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, generator=torch.Generator())
    assert seen[0].filename == __file__  # not a line inside specdec or torch's no_grad wrapper


def test_the_models_own_generation_config_keeps_its_eos_warning():
    """Passing the model's generation_config (or a copy) is not giving its EOS ids anew: an id
    outside the vocabulary there still warns and is dropped, as when it is inherited."""
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [VOCAB + 7]
    try:
        for gc in (model.generation_config, GenerationConfig.from_dict(model.generation_config.to_dict())):
            with pytest.warns(UserWarning, match="lies outside"):
                wrap().generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, generation_config=gc)
    finally:
        model.generation_config.eos_token_id = saved


def test_numpy_values_are_taken_as_their_python_ones():
    """A NumPy bool for do_sample, NumPy / 0-d tensor budgets: as their Python values, in generate()
    as in generate_batch()."""
    ids, mask = ragged_prompts()
    want = wrap().generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    for budget in (np.int64(3), torch.tensor(3), np.array([3, 3, 3])):
        got = wrap().generate(ids, attention_mask=mask, max_new_tokens=budget, pad_token_id=0,
                              do_sample=np.bool_(False))
        assert torch.equal(got, want), type(budget)


def test_bad_stopping_criteria_type():
    ids, mask = ragged_prompts()
    with pytest.raises(TypeError, match="stopping_criteria"):
        wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, stopping_criteria=3)


@pytest.mark.parametrize("path", ["eager", "static"])
def test_max_new_tokens_per_row(path):
    """max_new_tokens given per row: each row equals HF greedy with its own budget (ended as at
    EOS, then padded), under speculation (the n-gram drafter, K = 3) on a ragged batch with an
    EOS that stops row 1 early; a budget of 0 gives the prompt alone."""
    model = get_model("qwen3_5")
    ids, mask = ragged_prompts()
    budgets = [7, 12, 0][:ids.shape[0]] + [5] * max(0, ids.shape[0] - 3)
    full = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(full[1, ids.shape[1] + 3])
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path=path)
    for given in (budgets, torch.tensor(budgets)):
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=given, eos_token_id=eos, pad_token_id=0)
        assert out.shape[0] == ids.shape[0] and out.shape[1] <= ids.shape[1] + max(budgets)
        for b, n in enumerate(budgets):
            alone = model.generate(ids[b:b + 1], attention_mask=mask[b:b + 1], max_new_tokens=max(n, 1),
                                   do_sample=False, pad_token_id=0, eos_token_id=eos)[0, ids.shape[1]:].tolist()
            alone = alone[:n]
            row = out[b, ids.shape[1]:].tolist()
            assert row[:len(alone)] == alone and all(t == 0 for t in row[len(alone):]), (b, row, alone)


@pytest.mark.parametrize("given, error, match", [
    ([4, 4], ValueError, "one budget per row: got 2 for a batch of 3"),
    ([4, -1, 4], ValueError, r"max_new_tokens\[1\] must be >= 0"),
    ([4, 2.5, 4], TypeError, r"max_new_tokens\[1\] must be an int"),
    (torch.tensor([1.0, 2.0, 3.0]), TypeError, "must hold integers"),
])
def test_max_new_tokens_per_row_errors(given, error, match):
    ids, mask = ragged_prompts()
    assert ids.shape[0] == 3
    sd = specdec.wrap(get_model("qwen3_5"), num_speculative_tokens=2)
    with pytest.raises(error, match=match):
        sd.generate(ids, attention_mask=mask, max_new_tokens=given, pad_token_id=0)


def test_max_new_tokens_per_row_needs_a_pad_id():
    """Unequal per-row budgets pad the shorter rows: with no pad_token_id and no eos_token_id
    anywhere, the call says so instead of padding with an arbitrary id; equal budgets need none."""
    from transformers import GenerationConfig

    ids, mask = ragged_prompts()
    sd = specdec.wrap(get_model("qwen3_5"), num_speculative_tokens=2)
    gc = GenerationConfig(do_sample=False)
    assert gc.pad_token_id is None and gc.eos_token_id is None
    with pytest.raises(ValueError, match=r"max_new_tokens per row \[4, 2, 4\].*no pad_token_id or eos_token_id"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=[4, 2, 4], generation_config=gc)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=[3, 3, 3], generation_config=gc)
    assert out.shape == (ids.shape[0], ids.shape[1] + 3)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "kimi_linear", "qwen3_next"])
def test_prefill_in_groups_of_rows_and_chunks(family):
    """With a small max_batch_tokens, generate() prefills its rows in groups (each at its own
    width) and a long prompt in chunks: every forward within the bound, the output HF greedy's."""
    model = get_model(family)
    ids, mask = ragged_prompts()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path="eager")
    shapes = record_prompt_forwards(sd)
    bound = int(mask.sum(-1).max()) - 2  # below the longest prompt: it runs in chunks
    sd.max_batch_tokens = bound
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0), ref)
    assert len(shapes) > ids.shape[0] and max(r * t for r, t in shapes) <= bound
    long = ids[:1, -int(mask[0].sum()):]  # one prompt alone
    shapes.clear()
    alone = model.generate(long, attention_mask=torch.ones_like(long), max_new_tokens=8, do_sample=False)
    sd.max_batch_tokens = 3
    assert torch.equal(sd.generate(long, attention_mask=torch.ones_like(long), max_new_tokens=8), alone)
    assert len(shapes) >= -(-long.shape[1] // 3) and max(r * t for r, t in shapes) <= 3
    for bad, err in ((0, ValueError), (2.5, TypeError)):
        with pytest.raises(err, match="max_batch_tokens"):
            sd.max_batch_tokens = bad


def test_prefill_groups_rows_by_length():
    """Grouped prefill takes rows of like lengths together (less padding) and gives every row its
    own state back in the batch's order: outputs as HF greedy on a batch whose short and long
    prompts alternate, with the n-gram and a draft-model drafter."""
    from specdec.models.base import prefill_groups

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1]])
    assert [g.tolist() for g in prefill_groups(mask, 6)] == [[2, 0], [3], [1]]  # 2 x 2; 3 alone: 2 x 3 > 6
    assert prefill_groups(mask, 16) is None
    model = get_model("nemotron_h")
    g = torch.Generator().manual_seed(11)
    lengths = [3, 14, 4, 13, 5, 12]
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, L - n:] = torch.randint(3, VOCAB, (n,), generator=g)
    mask = (ids != 0).long()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for drafter in ("ngram", DraftModelDrafter(get_model("nemotron_h", "perturbed"))):
        sd = specdec.wrap(model, drafter=drafter, num_speculative_tokens=3, decode_path="eager")
        sd.max_batch_tokens = 28  # groups: [3, 4, 5] x 5, [12, 13] x 13; 14 alone
        assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0), ref)


@pytest.mark.parametrize("family", ["falcon_h1", "mistral"])
def test_prefill_in_groups_gives_each_row_its_own_state(family):
    """Grouped and chunked prefill (rows of like lengths together, out of the batch's order) gives
    every row the state one forward gives it: its logits, every position's hidden state (what an
    MTP drafter reads) and the cache a verify step runs on, on layers holding both KV and SSM
    state (Falcon-H1) and sliding-window attention layers (Mistral, window 8), with columns of
    padding every row shares and rows of equal lengths."""
    sd = specdec.wrap(get_model(family), drafter="ngram", num_speculative_tokens=2, decode_path="eager")
    g = torch.Generator().manual_seed(3)
    lengths = [5, 14, 3, 13, 5, 12]
    ids = torch.zeros(len(lengths), max(lengths) + 2, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, ids.shape[1] - n:] = torch.randint(3, VOCAB, (n,), generator=g)
    mask = (ids != 0).long()
    step = torch.randint(3, VOCAB, (len(lengths), 3), generator=g)
    outs = {}
    for bound in (None, 13, 1):  # one forward; [3, 5] x 5, [5], [12], [13], 14 in chunks; all in 1-token chunks
        sd.adapter.max_prefill_tokens = bound
        cache = sd.adapter.new_cache(len(lengths), ids.shape[1] + 8, 4, ReplayRollback())
        logits, hidden = sd.adapter.prefill(ids, mask, cache, all_hidden_states=True, scan="torch")
        outs[bound] = (logits, hidden * mask[..., None], sd.adapter.forward(step, cache)[0])
    for bound in (13, 1):
        for got, want in zip(outs[bound], outs[None]):
            assert got.shape == want.shape and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("start", ["auto", "snapshot"])
def test_a_refused_rollback_changes_nothing(start):
    """A rollback strategy the setter refuses leaves the generator's strategy as it was: "auto"
    still measures per call (its reason says so) and a fixed one still runs; outputs stay exact."""
    model = get_model("nemotron_h")
    ids, mask = ragged_prompts(batch=2)
    ref = hf(model, ids, mask)
    sd = specdec.wrap(model, drafter="ngram", rollback=start, num_speculative_tokens=3)
    for bad in ("snapshots", 3):
        with pytest.raises((ValueError, TypeError)):
            sd.rollback = bad
    assert (sd.rollback is None) if start == "auto" else sd.rollback.name == start
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert torch.equal(out, ref)
    if start == "auto":
        assert sd.last_stats.rollback_reason is not None and sd.last_stats.rollback in ("snapshot", "ring", "replay")
    else:
        assert sd.last_stats.rollback == start
