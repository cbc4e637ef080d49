"""Where an off-by-one in a commit or a rollback would show: rows of one batch with different
draft counts, placeholder drafts past a row's count, every K up to 16, every drafter, a partial
commit followed by one-token steps, hundreds of random commit counts (debug mode), long prompts
(128 / 1k / 4k tokens), EOS inside accepted drafts, a finished row's slot given to a new prompt
(by hand, and through continuous batching with a draft model), a hybrid draft model's own rollback. Expected values come from plain autoregressive decoding
(HF generate) or from HF's own per-token decode of the accepted tokens."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from helpers import ALL_STRATEGIES, GrowingHFStates, fit_medusa_heads, hf_greedy, hf_states, perturb_heads, rel_err
from tiny_models import FAMILIES, VOCAB, get_model, ragged_prompts

import specdec
from specdec.drafters import DraftModelDrafter, Drafter, MedusaDrafter, MedusaHeads
from specdec.rollback import STRATEGIES, make_strategy
from specdec.verify import greedy_accept


class Ragged(Drafter):
    """Per-row draft counts from a schedule; tokens past the count are junk (placeholders)."""

    def __init__(self, inner, schedule):
        self.inner = specdec.drafters.make_drafter(inner)
        self.schedule = schedule  # fn(call, row, K) -> count
        self.calls = 0

    vocab_size = property(lambda self: self.inner.vocab_size)

    def start(self, **kw):
        self.calls = 0
        self.inner.start(**kw)

    def propose(self, input_ids, lengths, K):
        d, c = self.inner.propose(input_ids, lengths, K)
        want = torch.tensor([self.schedule(self.calls, i, K) for i in range(d.shape[0])])
        c = torch.minimum(c, want)
        junk = torch.randint(0, VOCAB, d.shape)
        d = torch.where(torch.arange(K)[None, :] < c[:, None], d, junk)
        self.calls += 1
        return d, c


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mixed_draft_counts_rows_equal_rows_alone(family, strategy):
    model = get_model(family)
    ids, mask = ragged_prompts(lengths=(12, 5, 9))
    ref = hf_greedy(model, ids, mask)
    # row 0 never drafts, row 1 drafts K, row 2 cycles 0..K
    sched = lambda call, row, K: [0, K, call % (K + 1)][row]  # noqa: E731
    sd = specdec.wrap(model, drafter=Ragged(DraftModelDrafter(get_model(family, "perturbed")), sched),
                      rollback=strategy, num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(out, ref)
    assert sd.last_stats.accept_histogram[0] > 0
    for i in range(3):
        row = ids[i : i + 1, mask[i].bool()]
        alone = specdec.wrap(model, drafter=DraftModelDrafter(get_model(family, "perturbed")), rollback=strategy,
                             num_speculative_tokens=3).generate(row, max_new_tokens=16, pad_token_id=0)
        assert torch.equal(alone[0, row.shape[1]:], out[i, ids.shape[1]:])


class StateCheckAfterCommit(Drafter):
    """Compares every SSM layer's committed state with HF's decode of the committed tokens."""

    def __init__(self, inner, model, prompt_lens):
        self.inner, self.model, self.prompt_lens = inner, model, prompt_lens
        self.sd = None
        self.checks = 0
        self.reference = None

    vocab_size = property(lambda self: self.inner.vocab_size)

    def start(self, **kw):
        self.inner.start(**kw)

    def propose(self, input_ids, lengths, K):
        texts = [input_ids[i, : int(lengths[i]) - 1].tolist() for i in range(input_ids.shape[0])]
        if self.reference is None:  # (HF's decode of each row's committed text, extended call after call)
            self.reference = GrowingHFStates(self.model, self.sd.adapter, self.prompt_lens)
        ref = self.reference(texts)
        for idx, (state, _) in ref.items():
            assert rel_err(self.sd.last_cache.ssm[idx].ssm_state(), state) < 1e-5
        self.checks += 1
        return self.inner.propose(input_ids, lengths, K)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_placeholders_never_reach_committed_state(strategy):
    family = "qwen3_5"
    model = get_model(family)
    ids, mask = ragged_prompts()
    sched = lambda call, row, K: (call + row) % (K + 1)  # noqa: E731  rows padded with junk placeholders
    inner = Ragged(DraftModelDrafter(get_model(family, "perturbed")), sched)
    checker = StateCheckAfterCommit(inner, model, mask.sum(1).tolist())
    sd = specdec.wrap(model, drafter=checker, rollback=strategy, num_speculative_tokens=4)
    checker.sd = sd
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=14, pad_token_id=0), hf_greedy(model, ids, mask, 14))
    assert checker.checks >= 3


@pytest.mark.parametrize("K", range(1, 17))
def test_every_K_up_to_16_exact_with_conv_window_sized_for_it(family, K):
    model = get_model(family)
    ids, mask = ragged_prompts(seed=5)
    ref = hf_greedy(model, ids, mask, max_new=10)
    strategy = STRATEGIES[K % len(STRATEGIES)]
    sd = specdec.wrap(model, drafter=DraftModelDrafter(model), rollback=strategy, num_speculative_tokens=K)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(out, ref)
    cache = sd.last_cache
    for layer in cache.ssm.values():  # every place that sizes the conv window agrees on W-1+K+1
        assert layer.conv_window.shape[-1] == layer.conv_width - 1 + K + 1 == layer.conv_width + K


_HEADS: dict = {}
#: per family, a ragged_prompts seed on which the n-gram drafter finds matches the tiny random
#: target accepts (random models rarely repeat themselves: most seeds give no n-gram acceptance)
NGRAM_SEED = {"qwen3_5": 5, "nemotron_h": 7}


def noisy_medusa_heads(family: str) -> MedusaHeads:
    """3 Medusa heads for the tiny target, fitted to its own greedy continuations of the
    :data:`NGRAM_SEED` prompts and then perturbed, so that a step accepts none, some or all of its
    drafts."""
    if family not in _HEADS:
        model = get_model(family)
        _HEADS[family] = perturb_heads(fit_medusa_heads(model, *ragged_prompts(seed=NGRAM_SEED[family])))
    return _HEADS[family]


def drafter_of_kind(kind: str, family: str):
    if kind == "ngram":
        return "ngram"
    if kind == "draft_model":
        return DraftModelDrafter(get_model(family, "perturbed"))
    return MedusaDrafter(noisy_medusa_heads(family), tree="default" if kind == "medusa_tree" else None)


def assert_committed_state_is_texts(model, cache, texts, prompt_lens, tol=1e-5):
    """``cache`` covers exactly ``texts`` (token lists, no padding) and every SSM layer's committed
    state (recurrent and conv) == HF's per-token decode of them after its prefill of the prompt."""
    assert (cache.seq_len - cache.pad).tolist() == [len(t) for t in texts]
    for idx, (state, conv) in hf_states(model, specdec.models.adapter_for(model), texts, prompt_lens).items():
        layer = cache.ssm[idx]
        W = layer.conv_width
        e1, e2 = rel_err(layer.ssm_state(), state), rel_err(layer.conv_state(), conv[:, :, conv.shape[-1] - (W - 1):])
        assert e1 < tol and e2 < tol, f"layer {idx}: state rel err {e1:.2e}, conv {e2:.2e}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "medusa_chain", "medusa_tree"])
@pytest.mark.parametrize("family", sorted(NGRAM_SEED))
def test_every_drafter_commits_the_state_of_its_accepted_text(family, drafter, strategy):
    """The same ragged prompts through each drafter: output == HF greedy, and the committed state
    after generation == HF's per-token decode of each row's committed text."""
    model = get_model(family)
    ids, mask = ragged_prompts(seed=NGRAM_SEED[family])
    L, new = ids.shape[1], 16
    ref = hf_greedy(model, ids, mask, max_new=new)
    sd = specdec.wrap(model, drafter=drafter_of_kind(drafter, family), rollback=strategy, num_speculative_tokens=3)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
    assert torch.equal(out, ref), f"\n{out[:, L:]}\n{ref[:, L:]}"
    st = sd.last_stats
    assert st.accepted_tokens > 0, f"{drafter}: nothing accepted, the commit of n > 0 drafts is not exercised"
    assert st.accept_histogram[0] > 0 or drafter == "ngram", st.accept_histogram  # rejections too
    # the cache covers each row's text minus its last (pending) token
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
    texts = [p + out[i, L : L + new - 1].tolist() for i, p in enumerate(prompts)]
    assert_committed_state_is_texts(model, sd.last_cache, texts, [len(p) for p in prompts])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_partial_commit_then_one_token_steps_give_hf_logits(family, strategy):
    """Verify T tokens, commit some, then feed the rest one token per step: logits equal HF's."""
    model = get_model(family)
    ad = specdec.models.adapter_for(model)
    ids, mask = ragged_prompts(seed=2)
    L = ids.shape[1]
    extra = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(3))
    full_ids = torch.cat([ids, extra], 1)
    full_mask = torch.cat([mask, torch.ones_like(extra)], 1)
    with torch.no_grad():
        ref = model(full_ids, attention_mask=full_mask).logits
    cache = ad.new_cache(3, L + 20, 5, make_strategy(strategy))
    ad.prefill(ids, mask, cache)
    ad.forward(torch.cat([extra[:, :4]], 1), cache)  # verify 4 tokens
    cache.commit(torch.tensor([2, 2, 2]))  # restore to s^(2)
    for t in range(2, 6):  # decode the remaining tokens again one by one
        logits, _ = ad.forward(extra[:, t : t + 1], cache)
        cache.commit(torch.ones(3, dtype=torch.long))
        assert rel_err(logits[:, 0], ref[:, L + t]) < 1e-4


# every family x strategy with -m slow; the default run keeps every strategy on qwen3_5 (GDN) and
# nemotron_h (Mamba-2), and KDA (kimi_linear) with replay
@pytest.mark.parametrize("family, strategy", [
    pytest.param(f, st, marks=[pytest.mark.slow] if f == "qwen3_next" or (f == "kimi_linear" and st != "replay") else [])
    for f in FAMILIES for st in ALL_STRATEGIES])
def test_fuzz_random_accept_counts_debug_mode(family, strategy, monkeypatch):
    """Hundreds of steps with random per-row commit counts in [0, T] (including 0 and all)."""
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    model = get_model(family)
    ad = specdec.models.adapter_for(model)
    rng = random.Random(zlib.crc32(f"{family}/{strategy}".encode()))  # str hash() is salted per process
    ids, mask = ragged_prompts(seed=4)
    B, K = 3, 4
    steps = 150
    cache = ad.new_cache(B, ids.shape[1] + steps * (K + 1) + 8, K + 1, make_strategy(strategy))
    ad.prefill(ids, mask, cache)
    texts = [ids[i][mask[i].bool()].tolist() for i in range(B)]
    prompt_lens = [len(t) for t in texts]
    for step in range(steps):
        T = rng.randint(1, K + 1)
        toks = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(step))
        if rng.random() < 0.3:  # a step run in two calls (as a draft model does)
            ad.forward(toks[:, :1], cache)
            if T > 1:
                ad.forward(toks[:, 1:], cache)
        else:
            ad.forward(toks, cache)
        n = [rng.choice([0, T, rng.randint(0, T)]) for _ in range(B)]
        cache.commit(torch.tensor(n))
        for i in range(B):
            texts[i] += toks[i, : n[i]].tolist()
    ref = hf_states(model, ad, texts, prompt_lens)
    for idx, (state, conv) in ref.items():
        assert rel_err(cache.ssm[idx].ssm_state(), state) < 1e-4
        W = cache.ssm[idx].conv_width
        # conv inputs are projections of the layer's input, which carries fp32 rounding from the
        # layers below: the exactness bound for states (rel. err. < 1e-5) applies, not bit-equality
        assert rel_err(cache.ssm[idx].conv_state(), conv[:, :, -(W - 1):]) < 1e-5


def test_debug_mode_catches_out_of_range_commit(monkeypatch):
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    ad = specdec.models.adapter_for(get_model("qwen3_5"))
    ids, mask = ragged_prompts()
    cache = ad.new_cache(3, 40, 3, make_strategy("ring"))
    ad.prefill(ids, mask, cache)
    ad.forward(ids[:, :2], cache)
    with pytest.raises(ValueError, match="num_tokens must be in"):
        cache.commit(torch.tensor([0, 3, 1]))
    with pytest.raises(IndexError, match="row 1, layer 0, step"):
        layer = next(iter(cache.ssm.values()))
        layer.strategy.commit(layer.store, layer.op, layer.params, torch.tensor([0, 3, 1]))


def committed_texts(out, ids, mask, eos=None):
    """Per row, the tokens its cache covers after generate(): the prompt without padding and the
    new tokens up to the row's end (its EOS, or the budget), minus the last, pending one."""
    L = ids.shape[1]
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    texts = []
    for i in range(ids.shape[0]):
        gen = out[i, L:].tolist()
        ends = [j for j, t in enumerate(gen) if t in eos]
        gen = gen[: ends[0] + 1] if ends else gen
        texts.append(ids[i][mask[i].bool()].tolist() + gen[:-1])
    return texts


#: the long-prompt sets, the fewest tokens their prompts have, and the strategy whose committed state
#: is checked at that length
LONG_PROMPTS = {"128": (100, "snapshot"), "1k": (900, "ring"), "4k": (3800, "replay")}


@pytest.mark.parametrize("key", ["128", "1k", pytest.param("4k", marks=pytest.mark.slow)])
def test_long_prompts_128_1k_4k_exact_acceptance_per_length(key):
    """The zoo's gdn-target (fp32) on two held-out prompts of one length set (128, 1k, 4k tokens
    with -m slow; ragged, left-padded), n-gram drafter, K = 4: output == HF greedy for every
    strategy; acceptance is recorded per length; the committed state == HF's per-token decode
    (one strategy per length)."""
    from specdec import zoo

    model, tok = zoo.load("gdn-target")
    eos = model.generation_config.eos_token_id
    new = 24
    min_len, checked = LONG_PROMPTS[key]
    enc = tok([p["prompt"] for p in zoo.prompts(key, limit=2)], return_tensors="pt", padding=True)
    ids, mask = enc.input_ids, enc.attention_mask
    assert tok.padding_side == "left" and mask.sum(1).min() > min_len
    ref = hf_greedy(model, ids, mask, max_new=new)
    stats = {}
    for strategy in STRATEGIES:
        sd = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=4)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
        assert torch.equal(out, ref), (key, strategy)
        stats[strategy] = sd.last_stats
        if strategy == checked:
            texts = committed_texts(out, ids, mask, eos)
            assert_committed_state_is_texts(model, sd.last_cache, texts, mask.sum(1).tolist())
    # acceptance depends on the tokens alone, so every strategy reports the same numbers
    assert len({(s.mean_accepted_tokens, tuple(s.accept_histogram)) for s in stats.values()}) == 1
    st = stats["replay"]
    print(f"gdn-target {key:>4} prompts: mean_accepted_tokens {st.mean_accepted_tokens:.3f}, "
          f"acceptance_rate {st.acceptance_rate:.3f}, accept_histogram {st.accept_histogram}")
    assert st.steps > 0 and st.mean_accepted_tokens >= 1.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_row_finishes_at_eos_inside_accepted_drafts(strategy):
    """EOS lands among accepted drafts of one row while the others go on."""
    family = "nemotron_h"
    model = get_model(family)
    ids, mask = ragged_prompts()
    plain = hf_greedy(model, ids, mask, max_new=18)
    L = ids.shape[1]
    eos = int(plain[0, L + 5])
    ref = hf_greedy(model, ids, mask, max_new=18, eos=eos)
    sd = specdec.wrap(model, drafter=DraftModelDrafter(model), rollback=strategy, num_speculative_tokens=6)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=18, eos_token_id=[eos, VOCAB - 1], pad_token_id=0)
    assert torch.equal(out, ref)
    # the finished row's cache stops exactly at its text (EOS is its last, pending token)
    row_len = int((out[0, L:] == eos).nonzero()[0, 0]) + 1
    assert int(sd.last_cache.seq_len[0]) == L + row_len - 1


_ALONE: dict = {}


def hf_greedy_alone(model, prompt: list, max_new: int) -> list:
    """HF greedy decoding of one prompt alone: prompt + ``max_new`` new tokens (a token list)."""
    key = (id(model), tuple(prompt), max_new)
    if key not in _ALONE:
        _ALONE[key] = hf_greedy(model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                                max_new=max_new)[0].tolist()
    return _ALONE[key]


def committed_rows(cache, rows):
    """Bit-level copy of everything ``rows`` of ``cache`` hold between steps: pad, seq_len, every
    KV column, each SSM layer's committed state and conv window."""
    rows = torch.as_tensor(rows, dtype=torch.long)  # (none: the pool's first admission resets every row)
    out = [cache.pad[rows].clone(), cache.seq_len[rows].clone()]
    for k, v in cache.kv.values():
        out += [k[rows].clone(), v[rows].clone()]
    for layer in cache.ssm.values():
        out += [layer.ssm_state()[rows].clone(), layer.conv_window[rows].clone()]
    return out


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_finished_slot_given_to_new_prompt(family, strategy, monkeypatch):
    """Batch serving: slot 1 finishes (its budget) while rows 0 and 2 go on; some steps later
    ``HybridCache.reset_rows`` gives it a new prompt prefilled alone into a 1-row cache. Drafts
    are each row's HF-greedy continuation corrupted at random (accepted counts from 0 to K, some
    steps run in two calls); at the end every row's text == HF greedy of its own prompt alone, and
    every committed SSM / conv state == HF's per-token decode of the row's text. A row whose text
    reaches EOS (the model's default, as in HF's reference) finishes there, as in the engine."""
    monkeypatch.setenv("SPECDEC_DEBUG", "1")  # bounds checks on every slot index
    model = get_model(family)
    eos = model.generation_config.eos_token_id
    eos = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
    ad = specdec.models.adapter_for(model)
    rng = random.Random(zlib.crc32(f"slot reuse/{family}/{strategy}".encode()))
    ids, mask = ragged_prompts(seed=3)
    new_ids, _ = ragged_prompts(batch=1, lengths=(9,), seed=8)
    B, K, before, after, budget1 = 3, 4, 12, 14, 7
    steps = before + after
    max_len = ids.shape[1] + steps * (K + 1) + K + 2
    texts = [ids[i][mask[i].bool()].tolist() for i in range(B)]
    prompt_lens = [len(t) for t in texts]
    refs = [hf_greedy_alone(model, t, steps * (K + 1) + 1) for t in texts]
    new_prompt = new_ids[0].tolist()
    new_ref = hf_greedy_alone(model, new_prompt, after * (K + 1) + 1)

    cache = ad.new_cache(B, max_len, K + 1, make_strategy(strategy))
    logits, _ = ad.prefill(ids, mask, cache)
    for i in range(B):
        texts[i].append(int(logits[i].argmax()))  # pending
    live = [True] * B
    seen = set()

    def step():
        drafts = torch.zeros(B, K, dtype=torch.long)
        k = torch.zeros(B, dtype=torch.long)
        want = [0] * B
        for i in range(B):
            if not live[i]:
                continue
            L = len(texts[i])
            d = refs[i][L : L + K]  # shorter where the reference ends at EOS
            k[i] = min(rng.choice([K, K, rng.randint(0, K)]), len(d))
            bad = rng.choice([0, K, rng.randint(0, K)])  # first wrong draft (K: none)
            if bad < len(d):
                d[bad] = 3 + (d[bad] - 3 + rng.randint(1, VOCAB - 4)) % (VOCAB - 3)
            drafts[i, : len(d)], want[i] = torch.tensor(d, dtype=torch.long), min(bad, int(k[i]))
        T = 1 + int(k.max())
        tokens = torch.cat([torch.tensor([t[-1] for t in texts])[:, None], drafts[:, : T - 1]], 1)
        if T > 1 and rng.random() < 0.3:  # a step run in two calls (as a draft model runs it)
            cut = rng.randint(1, T - 1)
            logits = torch.cat([ad.forward(tokens[:, :cut], cache)[0], ad.forward(tokens[:, cut:], cache)[0]], 1)
        else:
            logits, _ = ad.forward(tokens, cache)
        n, c = greedy_accept(logits, drafts, k)
        take = torch.zeros(B, dtype=torch.long)
        for i in range(B):
            if live[i]:
                assert int(n[i]) == want[i], f"row {i}: accepted {int(n[i])} of the reference's drafts, not {want[i]}"
                new = drafts[i, : int(n[i])].tolist() + [int(c[i])]
                stop = [j for j, t in enumerate(new) if t in eos]
                if stop:  # the row ends at EOS: its pending EOS is never run
                    new, live[i] = new[: stop[0] + 1], False
                texts[i] += new
                take[i] = len(new)
                seen.add(int(n[i]))
        cache.commit(take)  # finished rows commit nothing (their forward is discarded)

    for _ in range(before):
        step()
        gen1 = len(texts[1]) - prompt_lens[1]
        # slot 1 finishes (max_new_tokens) once past budget1 at a length where the default ring
        # (K + 2 slots) has its head away from slot 0 (its gen1 - 1 committed tokens moved it)
        if live[1] and gen1 >= budget1 and (gen1 - 1) % (K + 2):
            live[1] = False  # rows 0 and 2 go on
    assert not live[1] and live[0] and live[2]
    assert texts[1] == refs[1][: len(texts[1])]

    # slot 1 -> the new prompt, prefilled alone into a 1-row cache of the same max_len
    src = ad.new_cache(1, max_len, K + 1, make_strategy(strategy))
    new_logits, _ = ad.prefill(new_ids, torch.ones_like(new_ids), src)
    ad.forward(new_ids[:, :2].repeat(B, 1), cache)  # an open step: refused
    with pytest.raises(ValueError, match="no open step"):
        cache.reset_rows([1], src)
    cache.commit(torch.zeros(B, dtype=torch.long))
    keep = [0, 2]
    kept = committed_rows(cache, keep)
    for layer in cache.ssm.values():  # the slot's cursors are away from their reset values, so a
        store = layer.store.tensors   # reset that missed them would show
        for cursor in ("head", "hist_len"):
            if cursor in store and strategy != "replay":  # (eager replay's history is empty between steps)
                assert int(store[cursor][1]) != 0, f"{cursor} of slot 1 is already 0: pick another schedule"
    cache.reset_rows(torch.tensor([1]), src, torch.tensor([0]))
    for a, b in zip(committed_rows(cache, keep), kept, strict=True):
        assert torch.equal(a, b)  # rows not reset: bit for bit
    for a, b in zip(committed_rows(cache, [1]), committed_rows(src, [0]), strict=True):
        assert torch.equal(a, b.to(a.dtype))  # the slot holds exactly the new prompt's prefill
    for layer in cache.ssm.values():  # cursors of the slot are reset
        store = layer.store.tensors
        if "head" in store:
            assert int(store["head"][1]) == 0
        if "hist_len" in store:
            assert int(store["hist_len"][1]) == 0
    texts[1], prompt_lens[1], refs[1], live[1] = new_prompt + [int(new_logits[0].argmax())], len(new_prompt), new_ref, True

    for _ in range(after):
        step()
    assert {0, K} <= seen and len(seen) >= 3, seen
    for i in range(B):
        assert texts[i] == refs[i][: len(texts[i])], f"row {i}"
    assert len(texts[1]) > len(new_prompt) + after
    assert_committed_state_is_texts(model, cache, [t[:-1] for t in texts], prompt_lens)


class AdmitLog(DraftModelDrafter):
    """A draft model that records which request each row holds (``held``: row -> request index, as
    admit() gives them) and, at its last proposal, the rows' texts and their requests."""

    def start(self, **kw):
        super().start(**kw)
        self.held, self.last = {}, None

    def admit(self, rows, input_ids, attention_mask, hidden_states, requests):
        self.held.update(zip(rows.tolist(), (r.index for r in requests)))
        super().admit(rows, input_ids, attention_mask, hidden_states, requests)

    def propose(self, input_ids, lengths, K):
        self.last = ([input_ids[b, :L].tolist() for b, L in enumerate(lengths.tolist())], dict(self.held))
        return super().propose(input_ids, lengths, K)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_finished_slot_given_to_new_prompt_through_generate_batch(family, strategy, monkeypatch):
    """The scenario above through ``SpeculativeGenerator.generate_batch``, with a draft model that
    keeps its own cache (rolled back by the same strategy): 6 requests through 3 rows, budgets that
    end rows at commit counts where the ring (K + 2 slots) has its head away from slot 0, so slots
    are reset (the target's prefilled straight into them, ``HybridCache.load_rows``; the draft's
    moved in, ``HybridCache.reset_rows``; both checked as they run) with cursors away from their
    reset values: the other rows keep their committed state bit for bit, the slot holds exactly the
    new prompt's prefill, its cursors restart. Every request == HF greedy of its prompt alone (a row
    whose text reaches the model's default EOS finishes there); at the end every row's committed
    state == HF's per-token decode of the text it holds, in the target's cache and in the draft's."""
    monkeypatch.setenv("SPECDEC_DEBUG", "1")  # bounds checks on every slot index
    model, draft = get_model(family), get_model(family, "perturbed")
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids, mask = ragged_prompts(batch=6, lengths=(12, 7, 10, 9, 5, 11), seed=3)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
    K, budgets = 4, [8, 9, 10, 11, 8, 9]  # (budget - 1) % (K + 2) != 0: a ring head away from 0
    expected = []
    for p, b in zip(prompts, budgets):
        new = hf_greedy_alone(model, p, b)[len(p):]
        stop = [j for j, t in enumerate(new) if t in eos]
        expected.append(new[: stop[0] + 1] if stop else new)
    drafter = AdmitLog(draft, rollback=strategy)
    sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K)
    resets = []  # (the target's cache?, the slots' cursors before the reset)
    original = specdec.cache.HybridCache.reset_rows

    original_load = specdec.cache.HybridCache.load_rows

    def checked(cache, rows, reset, expected):
        """Run ``reset()`` on ``rows`` of ``cache``, checking the other rows, what the slots then
        hold (``expected()``: committed_rows' tensors) and their cursors."""
        rows_list = torch.as_tensor(rows).tolist()
        keep = [b for b in range(cache.batch) if b not in rows_list]
        kept = committed_rows(cache, keep)
        cursors = [int(v) for layer in cache.ssm.values() for name in ("head", "hist_len")
                   if name in layer.store.tensors for v in layer.store.tensors[name][rows_list]]
        resets.append((cache is sd.last_cache, cursors))
        reset()
        for a, b in zip(committed_rows(cache, keep), kept, strict=True):
            assert torch.equal(a, b)  # rows not reset: bit for bit
        for a, b in zip(committed_rows(cache, rows_list), expected(), strict=True):
            assert torch.equal(a, b.to(a.dtype))  # the slots hold exactly the new prompts' prefill
        for layer in cache.ssm.values():  # their cursors restart
            for name in ("head", "hist_len"):
                if name in layer.store.tensors:
                    assert layer.store.tensors[name][rows_list].eq(0).all()

    def checked_reset(cache, rows, source, source_rows=None):
        src = range(len(torch.as_tensor(rows).tolist())) if source_rows is None else torch.as_tensor(source_rows).tolist()
        checked(cache, rows, lambda: original(cache, rows, source, source_rows), lambda: committed_rows(source, list(src)))

    def checked_load(cache, rows, length, pad, keys_values, ssm_states):
        def expected():  # (committed_rows' order: pad, seq_len, every KV layer's, every SSM layer's)
            n = len(torch.as_tensor(rows).tolist())
            out = [pad, torch.full((n,), length)]
            for idx, (k, v) in cache.kv.items():
                for buf, new in zip((k, v), keys_values[idx]):
                    out.append(torch.cat([new.to(buf.dtype), buf.new_zeros(n, buf.shape[1], buf.shape[2] - length,
                                                                           buf.shape[3])], dim=2))
            for idx, layer in cache.ssm.items():
                conv, state, width = ssm_states[idx]
                window = layer.conv_window.new_zeros(n, *layer.conv_window.shape[1:])
                window[:, :, :width - 1] = conv[:, :, conv.shape[-1] - (width - 1):]
                out += [state, window]
            return out
        checked(cache, rows, lambda: original_load(cache, rows, length, pad, keys_values, ssm_states), expected)

    monkeypatch.setattr(specdec.cache.HybridCache, "reset_rows", checked_reset)
    monkeypatch.setattr(specdec.cache.HybridCache, "load_rows", checked_load)
    out = sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos or None, max_batch_size=3)
    for i, e in enumerate(expected):
        assert out[f"req_{i}"].generated_tokens == e, f"req_{i}"
    target_resets = [c for on_target, c in resets if on_target]
    assert len(target_resets) >= 3 and any(resets[i][0] is False for i in range(len(resets)))
    if strategy in ("ring", "replay_deferred"):
        assert any(any(c) for c in target_resets), "every reset slot had its cursors at 0: pick other budgets"
    # the target's rows: the last request each holds, its prompt and new tokens minus the last (pending) one
    held = [drafter.held[b] for b in range(3)]
    texts = [prompts[r] + out[f"req_{r}"].generated_tokens[:-1] for r in held]
    assert_committed_state_is_texts(model, sd.last_cache, texts, [len(prompts[r]) for r in held])
    # the draft's rows: the texts of its last proposal, which it caught up on in full
    texts, held = drafter.last
    assert_committed_state_is_texts(draft, drafter.cache, texts, [len(prompts[held[b]]) for b in range(3)])


def test_reset_rows_argument_errors():
    ad = specdec.models.adapter_for(get_model("nemotron_h"))
    ids, mask = ragged_prompts()
    cache = ad.new_cache(3, 40, 3, make_strategy("ring"))
    ad.prefill(ids, mask, cache)
    src = ad.new_cache(2, 40, 3, make_strategy("replay"))  # any batch size, any strategy
    ad.prefill(ids[1:], mask[1:], src)
    for rows, src_rows, match in (([3], None, r"rows must be in \[0, 3\)"), ([0, 0], None, "distinct"),
                                  ([0], [2], r"source_rows must be in \[0, 2\)"), ([0, 1], [1], "same length")):
        with pytest.raises(ValueError, match=match):
            cache.reset_rows(rows, src, src_rows)
    for other in (ad.new_cache(1, 41, 3, make_strategy("ring")), ad.new_cache(1, 40, 4, make_strategy("ring"))):
        ad.prefill(ids[:1], mask[:1], other)
        with pytest.raises(ValueError, match="same max_len and max_step_tokens"):
            cache.reset_rows([0], other)
    ad.forward(ids[1:, :1], src)
    with pytest.raises(ValueError, match="source has 1 step tokens"):
        cache.reset_rows([0], src)
    src.commit(torch.zeros(2, dtype=torch.long))
    cache.reset_rows([2, 0], src, [0, 1])  # rows 0 and 2 swap in the source's rows 1 and 0
    assert cache.seq_len.tolist() == [12, 12, 12] and cache.pad.tolist() == [2, 5, 5]
    for idx, layer in cache.ssm.items():
        assert torch.equal(layer.ssm_state()[[2, 0]], src.ssm[idx].ssm_state())


def _cache_tensors(cache) -> dict:
    """Every tensor a cache holds for its rows, by name (KV, pad / seq_len, conv windows, stores)."""
    out = {"pad": cache.pad, "seq_len": cache.seq_len}
    for idx, (k, v) in cache.kv.items():
        out[f"kv{idx}.k"], out[f"kv{idx}.v"] = k, v
    for idx, layer in cache.ssm.items():
        if layer.conv_window is not None:
            out[f"ssm{idx}.conv"] = layer.conv_window
        for name, t in layer.store.tensors.items():
            for key, part in (t.items() if isinstance(t, dict) else [("", t)]):
                if isinstance(part, torch.Tensor):
                    out[f"ssm{idx}.{name}{key}"] = part
    return out


@pytest.mark.parametrize("rows", [[3, 1], [1, 2]], ids=["apart", "side-by-side"])
@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5", "lfm2"])
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_prefill_into_rows_leaves_what_reset_rows_from_their_own_cache_leaves(family, strategy, rows):
    """prefill(..., rows=) writes the prompts' states straight into those rows of a cache that
    has decoded (HybridCache.load_rows): every tensor of the cache, other rows included, equals
    bit for bit what a cache of their own, prefilled and moved in by reset_rows, leaves; the
    logits are the same; the tensors are the same objects (captured graphs stay valid). Rows
    side by side are written through views (a slice), rows apart through an index."""
    ad = specdec.models.adapter_for(get_model(family))
    ids, mask = ragged_prompts(4, lengths=(12, 7, 10, 9), seed=1)
    new_ids, new_mask = ragged_prompts(2, lengths=(5, 11), seed=2)
    caches = []
    for _ in range(2):
        cache = ad.new_cache(4, 40, 3, make_strategy(strategy))
        ad.prefill(ids, mask, cache)
        ad.forward(ids[:, -3:], cache)  # a step, partly kept: cursors and histories off their start
        cache.commit(torch.tensor([3, 1, 2, 0]))
        caches.append(cache)
    moved, direct = caches
    fresh = ad.new_cache(2, 40, 3, make_strategy(strategy))
    want = ad.prefill(new_ids, new_mask, fresh)
    moved.reset_rows(rows, fresh)
    objects = {name: t for name, t in _cache_tensors(direct).items()}
    got = ad.prefill(new_ids, new_mask, direct, rows=rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    want_t, got_t = _cache_tensors(moved), _cache_tensors(direct)
    assert want_t.keys() == got_t.keys() and len(got_t) > 4
    for name, t in got_t.items():
        assert t is objects[name], name
        assert t.dtype == want_t[name].dtype and torch.equal(t, want_t[name]), name
    # both go on decoding alike
    step = torch.randint(3, VOCAB, (4, 2), generator=torch.Generator().manual_seed(3))
    assert torch.equal(ad.forward(step, direct)[0], ad.forward(step, moved)[0])


def test_prefill_into_rows_argument_errors():
    """Bad rows are refused before the forward, naming what was wrong."""
    ad = specdec.models.adapter_for(get_model("nemotron_h"))
    ids, mask = ragged_prompts()
    cache = ad.new_cache(3, 40, 3, make_strategy("replay"))
    ad.prefill(ids, mask, cache)
    for rows, match in (([3], r"rows must be in \[0, 3\)"), ([0, 0], "distinct"), ([0, 1], "1 prompts for 2 rows")):
        with pytest.raises(ValueError, match=match):
            ad.prefill(ids[:1], mask[:1], cache, rows=rows)
    ad.forward(ids[:, :1], cache)
    with pytest.raises(ValueError, match="needs no open step"):
        ad.prefill(ids[:1], mask[:1], cache, rows=[0])
    cache.commit(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="states of every layer"):
        cache.load_rows([0], 4, torch.zeros(1, dtype=torch.long), {}, {})
    with pytest.raises(ValueError, match="do not fit this cache's 40"):
        cache.load_rows([0], 41, torch.zeros(1, dtype=torch.long), dict.fromkeys(cache.kv), dict.fromkeys(cache.ssm))
    with pytest.raises(ValueError, match="must be integer slot indices, got torch.bool"):
        ad.prefill(ids[:2], mask[:2], cache, rows=torch.tensor([True, False]))
    # states of the wrong shape are refused before anything is written: the cache is as it was
    before = {name: t.clone() for name, t in _cache_tensors(cache).items()}
    L = 5
    kv = {idx: (k[:1, :, :L].clone(), v[:1, :, :L].clone()) for idx, (k, v) in cache.kv.items()}
    ssm = {idx: (layer.conv_window[:1].clone(), layer.ssm_state()[:1].clone(), layer.conv_width)
           for idx, layer in cache.ssm.items()}
    last = max(ssm)
    for bad, match in (({**ssm, last: (ssm[last][0][:, :1], *ssm[last][1:])}, r"conv state of shape .* expected \[1, "),
                       ({**ssm, last: (ssm[last][0], ssm[last][1].expand(2, *ssm[last][1].shape[1:]), ssm[last][2])},
                        r"recurrent state of shape \(2, .* for 1 rows"),
                       ({**ssm, last: (*ssm[last][:2], ssm[last][2] + 1)}, "conv window / recurrence differs")):
        with pytest.raises(ValueError, match=match):
            cache.load_rows([2], L, torch.zeros(1, dtype=torch.long), kv, bad)
    with pytest.raises(ValueError, match=r"pad of shape \(2,\) for 1 rows"):
        cache.load_rows([2], L, torch.zeros(2, dtype=torch.long), kv, ssm)
    assert all(torch.equal(t, before[name]) for name, t in _cache_tensors(cache).items())
    cache.load_rows([2], L, torch.zeros(1, dtype=torch.long), kv, ssm)  # (the same states, well formed: taken)
    assert cache.seq_len[2] == L
    fresh = ad.new_cache(3, 40, 3, make_strategy("replay"))
    with pytest.raises(ValueError, match="this cache holds nothing yet"):
        ad.prefill(ids[:1], mask[:1], fresh, rows=[0])


class ProposalRecorder(Drafter):
    def __init__(self, inner):
        self.inner = inner
        self.log = []

    vocab_size = property(lambda self: self.inner.vocab_size)

    def start(self, **kw):
        self.kw = kw
        self.inner.start(**kw)

    def propose(self, input_ids, lengths, K):
        d, c = self.inner.propose(input_ids, lengths, K)
        self.log.append(([input_ids[i, : int(lengths[i])].tolist() for i in range(input_ids.shape[0])], d.clone()))
        return d, c


@pytest.mark.parametrize("draft_family", ["qwen3_5", "nemotron_h", "kimi_linear"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hybrid_draft_state_rolled_back(draft_family, strategy):
    """The draft's proposals after rejections equal a fresh draft's proposals on the accepted text."""
    target = get_model(draft_family)
    draft = get_model(draft_family, "perturbed")
    rec = ProposalRecorder(DraftModelDrafter(draft, rollback=strategy))
    ids, mask = ragged_prompts()
    sd = specdec.wrap(target, drafter=rec, rollback="replay", num_speculative_tokens=4)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(out, hf_greedy(target, ids, mask))
    assert sd.last_stats.accept_histogram[0] + sum(sd.last_stats.accept_histogram[1:4]) > 0, "need rejections"
    checked = 0
    for (prev, _), (texts, drafts) in zip(rec.log, rec.log[1:]):
        live = [len(t) > len(p) for t, p in zip(texts, prev)]  # finished rows stop growing: skip them
        fresh = DraftModelDrafter(draft, rollback="snapshot")
        fresh.start(**rec.kw)
        L = max(len(t) for t in texts)
        ids2 = torch.zeros(len(texts), L, dtype=torch.long)
        for i, t in enumerate(texts):
            ids2[i, : len(t)] = torch.tensor(t)
        d2, _ = fresh.propose(ids2, torch.tensor([len(t) for t in texts]), 4)
        for i in range(len(texts)):
            if live[i]:
                assert torch.equal(d2[i], drafts[i]), f"row {i}: {d2[i].tolist()} vs {drafts[i].tolist()}"
                checked += 1
    assert checked >= 6
