"""``wrap(...).generate()`` takes what HF's ``generate()`` takes for decoding, with HF's results:
streamers, stopping criteria, EOS lists, ``min_new_tokens`` / ``min_length``, ``repetition_penalty``
(applied per verify position with that position's own prefix), ``return_dict_in_generate`` with
``scores`` / ``logits``, a ``GenerationConfig``; unsupported settings raise ``ValueError``."""

from __future__ import annotations

import pytest
import torch
from conftest import get_model
from tiny_models import VOCAB, perturbed_copy, ragged_prompts
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import specdec
from specdec.drafters import DraftModelDrafter

FAMILY = "qwen3_5"
MAX_NEW = 12


def hf(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)


_DRAFTS: dict = {}


def drafter(kind):
    if kind == "ngram":
        return "ngram"
    if "d" not in _DRAFTS:
        _DRAFTS["d"] = perturbed_copy(get_model(FAMILY))
    return DraftModelDrafter(_DRAFTS["d"])


def wrap(kind="draft", strategy="replay"):
    return specdec.wrap(get_model(FAMILY), drafter=drafter(kind), rollback=strategy, num_speculative_tokens=3)


def eos_ids(ids, plain):
    """EOS ids that stop rows 0 and 1 early (at their 3rd and 2nd new token)."""
    L = ids.shape[1]
    return [int(plain[0, L + 2]), int(plain[1, L + 1])]


# ------------------------------------------------------------------------------------------------
# streamer


class Collect:
    """A fake streamer: records every put() and the end()."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="w0", eos_token="w2")


def test_streamer_ids_match_hf():
    model = get_model(FAMILY)
    ids, mask = ragged_prompts(batch=1)
    ours, theirs = Collect(), Collect()
    out = wrap().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, streamer=ours)
    ref = hf(model, ids, mask, streamer=theirs)
    assert torch.equal(out, ref)
    assert ours.ended and theirs.ended
    assert ours.puts[0] == ids[0].tolist()  # the prompt first, as HF does
    flat = [t for p in ours.puts[1:] for t in p]
    assert flat == out[0, ids.shape[1]:].tolist() == [t for p in theirs.puts[1:] for t in p]


def test_text_streamer_text_equals_decoded_output():
    from transformers import TextIteratorStreamer

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
    from tree_drafters import OracleTree, reference_rows

    model = get_model(FAMILY)
    ids, mask = ragged_prompts(batch=1)
    plain = hf(model, ids, mask)
    eos = int(plain[0, ids.shape[1] + 7])
    theirs = Collect()
    ref = hf(model, ids, mask, eos_token_id=eos, streamer=theirs)
    got = {}
    for path in ("eager", "static"):
        d = OracleTree(reference_rows(ref, ids, mask), VOCAB) if kind == "tree" else drafter("draft")
        sd = specdec.wrap(model, drafter=d, rollback="ring", num_speculative_tokens=4, decode_path=path)
        ours = Collect()
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0, eos_token_id=eos,
                          streamer=ours)
        assert torch.equal(out, ref) and ours.ended and sd.last_stats.decode_path == path
        assert sd.last_stats.mean_accepted_tokens > 1.5  # multi-token steps were streamed
        got[path] = ours.puts
    assert got["static"] == got["eager"] == theirs.puts  # one token per put after the prompt, as HF


def test_streamer_needs_batch_one():
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match="batch size 1"):
        wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, streamer=Collect())


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


def test_generation_config_object():
    model = get_model(FAMILY)
    ids, mask = ragged_prompts()
    eos = eos_ids(ids, hf(model, ids, mask))
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=0,
                          repetition_penalty=1.4, min_new_tokens=3)
    ref = model.generate(ids, attention_mask=mask, generation_config=gc)
    assert torch.equal(wrap().generate(ids, attention_mask=mask, generation_config=gc), ref)


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


def test_bad_stopping_criteria_type():
    ids, mask = ragged_prompts()
    with pytest.raises(TypeError, match="stopping_criteria"):
        wrap().generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, stopping_criteria=3)
