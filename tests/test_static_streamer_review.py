"""Review tests for streamers on the static decode path (commit ae7f8a4): the put()/end() calls
(values, shapes, dtypes, order) equal the eager path's and HF ``generate(streamer=...)``'s at the
budget edges (max_new_tokens 1-3), with EOS as the first generated token, EOS mid-step, an EOS
list, for the n-gram drafter, a draft model, an oracle Medusa-style tree and K = 0; sampling puts
exactly the returned tokens and does not change them; a failing put() leaves the wrapper usable;
a drafter error stops the stream where the eager path stops it; HF text streamers print HF's
text."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from conftest import get_model
from test_generate_args import tiny_tokenizer
from tiny_models import VOCAB, perturbed_copy, ragged_prompts
from transformers import TextIteratorStreamer, TextStreamer
from tree_drafters import OracleTree, reference_rows

import specdec
from specdec.drafters import Drafter, DraftModelDrafter

FAMILY = "qwen3_5"
KINDS = ("ngram", "draft", "tree", "plain")
_CACHE: dict = {}


class Calls:
    """Records every put() (shape, dtype, values) and end(), in order."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", tuple(value.shape), value.dtype, value.reshape(-1).tolist()))

    def end(self):
        self.calls.append(("end",))

    def new_tokens(self):
        assert all(c[1] == (1,) for c in self.calls[1:-1])  # one token per put after the prompt
        return [c[3][0] for c in self.calls[1:-1]]


def prompt():
    return ragged_prompts(batch=1)


def hf(max_new, **kw):
    ids, mask = prompt()
    rec = Calls()
    out = get_model(FAMILY).generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                                     max_new_tokens=max_new, streamer=rec, **kw)
    return out, rec.calls


def plain_tokens():
    if "plain" not in _CACHE:
        ids, _ = prompt()
        _CACHE["plain"] = hf(16)[0][0, ids.shape[1]:].tolist()
    return _CACHE["plain"]


def make(kind, path, ref=None, K=4, strategy="ring"):
    ids, mask = prompt()
    model = get_model(FAMILY)
    if kind == "draft":
        if "draft" not in _CACHE:
            _CACHE["draft"] = perturbed_copy(model)
        d = DraftModelDrafter(_CACHE["draft"])
    elif kind == "tree":
        d = OracleTree(reference_rows(ref, ids, mask), VOCAB)
    else:
        d = "ngram"
    return specdec.wrap(model, drafter=d, rollback=strategy, num_speculative_tokens=0 if kind == "plain" else K,
                        decode_path=path)


CASES = {  # name: (max_new_tokens, eos_token_id as positions in the plain continuation)
    "budget_1": (1, None),
    "budget_2": (2, None),
    "budget_3": (3, None),
    "eos_first_token": (12, [0]),
    "eos_second_token": (12, [1]),
    "eos_mid_step": (12, [6]),
    "eos_list": (12, [9, 5]),  # the earlier one (position 5) stops
    "eos_on_last_budget_token": (8, [7]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_static_puts_equal_eager_and_hf(case):
    max_new, eos_pos = CASES[case]
    p = plain_tokens()
    kw = {} if eos_pos is None else {"eos_token_id": [p[i] for i in eos_pos] if len(eos_pos) > 1 else p[eos_pos[0]]}
    ref, theirs = hf(max_new, **kw)
    ids, mask = prompt()
    assert theirs[0][3] == ids[0].tolist() and theirs[-1] == ("end",)
    multi = 0
    for kind in KINDS:
        for path in ("eager", "static"):
            sd = make(kind, path, ref)
            rec = Calls()
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=0, streamer=rec, **kw)
            assert sd.last_stats.decode_path == path
            assert torch.equal(out, ref), (kind, path)
            assert rec.calls == theirs, (kind, path)
            multi += path == "static" and sd.last_stats.mean_accepted_tokens > 1.5
    if max_new >= 8 and (eos_pos is None or min(eos_pos) >= 5):
        assert multi >= 1  # some static runs committed several tokens per step (and streamed them one by one)


@pytest.mark.parametrize("kind", ["ngram", "draft", "plain"])
def test_static_sampling_streams_the_returned_tokens_and_does_not_change_them(kind):
    ids, mask = prompt()
    L = ids.shape[1]
    kw = {"attention_mask": mask, "max_new_tokens": 14, "pad_token_id": 0, "do_sample": True, "temperature": 1.3,
          "top_k": 20, "eos_token_id": [5, 7]}
    for seed in range(2):
        sd = make(kind, "static", K=3)
        rec = Calls()
        out = sd.generate(ids, streamer=rec, generator=torch.Generator().manual_seed(seed), **kw)
        toks = rec.new_tokens()
        assert rec.calls[0][3] == ids[0].tolist() and rec.calls[-1] == ("end",)
        assert toks == out[0, L:L + len(toks)].tolist() and bool((out[0, L + len(toks):] == 0).all())
        same = sd.generate(ids, generator=torch.Generator().manual_seed(seed), **kw)
        assert torch.equal(out, same)  # the streamer does not change what is sampled
        if kind == "plain":  # one token per step: the static path samples as the eager one
            eager = Calls()
            make(kind, "eager").generate(ids, streamer=eager, generator=torch.Generator().manual_seed(seed), **kw)
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
    ids, mask = prompt()
    p = plain_tokens()
    ref, theirs = hf(12, eos_token_id=p[9])
    sd = make(kind, "static", ref)
    for at in (1, 2, 4):
        bad = FailingStreamer(at)
        with pytest.raises(Boom):
            sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=p[9], streamer=bad)
        assert bad.n == at and not bad.ended
        rec = Calls()
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
    ids, mask = prompt()
    got = {}
    for path in ("eager", "static"):
        rec = Calls()
        sd = specdec.wrap(get_model(FAMILY), drafter=BadDrafter(3, what), num_speculative_tokens=3, decode_path=path)
        with pytest.raises(ValueError, match="drafter"):
            sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, streamer=rec)
        got[path] = rec.calls
    assert got["static"] == got["eager"] and ("end",) not in got["static"] and len(got["static"]) >= 3


@pytest.mark.parametrize("skip_prompt", [True, False])
def test_text_streamers_on_the_static_path_give_hf_text(skip_prompt):
    tok = tiny_tokenizer()
    model = get_model(FAMILY)
    ids, mask = prompt()
    eos = plain_tokens()[9]
    kw = {"attention_mask": mask, "max_new_tokens": 16, "pad_token_id": 0, "eos_token_id": eos}
    theirs = TextIteratorStreamer(tok, skip_prompt=skip_prompt, timeout=10)
    model.generate(ids, do_sample=False, streamer=theirs, **kw)
    want = "".join(theirs)
    ours = TextIteratorStreamer(tok, skip_prompt=skip_prompt, timeout=10)
    make("ngram", "static").generate(ids, streamer=ours, **kw)
    assert "".join(ours) == want != ""
    printed = []
    for run in (lambda s: model.generate(ids, do_sample=False, streamer=s, **kw),
                lambda s: make("draft", "static").generate(ids, streamer=s, **kw)):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            run(TextStreamer(tok, skip_prompt=skip_prompt))
        printed.append(buf.getvalue())
    assert printed[0] == printed[1] != ""
