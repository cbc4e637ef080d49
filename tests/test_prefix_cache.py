"""Prefix caching (``generate_batch(prefix_caching=True)``, :mod:`specdec.prefix_cache`): requests
that share a long prompt prefix reuse its attention KV and SSM state block by block; every
request's tokens still equal HF greedy on its prompt alone (fp32) and the uncached call's; the
state a cached prefill leaves equals the uncached prefill's; hit counters match a count made here
from the prompts alone; eviction under a tiny byte bound and hash collisions change no output."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, rel_err
from tiny_models import EXTRA_FAMILIES, FAMILIES, VOCAB, get_model

import specdec
from specdec import prefix_cache as pc_mod
from specdec.drafters import Drafter
from specdec.models import adapter_for
from specdec.prefix_cache import LayerState, PrefixBlock, PrefixCache
from specdec.rollback import STRATEGIES, make_strategy

#: tokens per block on the tiny models: the shared prefix spans several blocks
BS = 4
ROWS = 3
EOS = VOCAB - 1


def _prompts() -> list[list[int]]:
    """Seven prompts (ids >= 3): five share a 14-token prefix (3 full blocks and 2 tokens) or part
    of it, one continues another, one repeats another, two are unrelated."""
    g = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()

    shared, a, b, c, d = rand(14), rand(5), rand(2), rand(6), rand(3)
    return [shared + a,            # 19 tokens: 4 full blocks
            shared + b,            # 16: 4 full blocks, the last one its own
            rand(9),               # unrelated
            shared[:8] + c,        # shares 2 blocks
            shared + a + d,        # continues request 0: its 4 blocks, then one more
            shared + b,            # repeats request 1: a hit stops one block short (its last token is run)
            rand(3)]               # shorter than a block


BUDGETS = [6, 5, 7, 4, 6, 5, 3]
_REF: dict = {}


def _expected(family) -> list[list[int]]:
    """HF greedy new tokens of each prompt alone, up to and including the first EOS."""
    if family not in _REF:
        model, out = get_model(family), []
        for p, n in zip(_prompts(), BUDGETS):
            new = hf_greedy(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), n,
                            eos=EOS)[0, len(p):].tolist()
            out.append(new[:new.index(EOS) + 1] if EOS in new else new)
        _REF[family] = out
    return _REF[family]


def _counters(prompts, bs=BS) -> dict:
    """The counters of an unbounded prefix cache, computed from the prompts alone: each prompt
    (in order) hits its longest run of leading full blocks some earlier prompt stored, at most
    ``(len - 1) // bs`` of them, then stores every full block of its own."""
    stored, hits, inserted = set(), 0, 0
    for p in prompts:
        n = 0
        while n < (len(p) - 1) // bs and tuple(p[:(n + 1) * bs]) in stored:
            n += 1
        hits += n
        for j in range(len(p) // bs):
            inserted += tuple(p[:(j + 1) * bs]) not in stored
            stored.add(tuple(p[:(j + 1) * bs]))
    return dict(lookups=len(prompts), hit_blocks=hits, hit_tokens=hits * bs,
                prefilled_tokens=sum(map(len, prompts)) - hits * bs, inserted_blocks=inserted, evicted_blocks=0)


def _check(out, expected, prompts):
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    for i, e in enumerate(expected):
        assert out[f"req_{i}"].prompt_ids == prompts[i]
        assert out[f"req_{i}"].generated_tokens == e, f"req_{i}: {out[f'req_{i}'].generated_tokens} != {e}"


def _run(sd, prompts, **kw):
    return sd.generate_batch(prompts, max_new_tokens=BUDGETS, eos_token_id=EOS, max_batch_size=ROWS, **kw)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_uncached_and_hf(family, strategy):
    """n-gram drafts (K = 3) and plain decoding (K = 0), more requests than rows: with prefix
    caching every request equals HF greedy alone and the uncached call; the counters equal those
    computed from the prompts."""
    prompts, expected = _prompts(), _expected(family)
    want = _counters(prompts)
    assert want["hit_blocks"] >= 10 and want["inserted_blocks"] >= 8  # the setting exercises the cache
    model = get_model(family)
    for K in (3, 0) if strategy == "replay" else (3,):
        sd = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=K, decode_path="eager")
        uncached = _run(sd, prompts)
        assert sd.last_stats.prefix_cache is None
        cached = _run(sd, prompts, prefix_caching=True, prefix_block_size=BS)
        _check(cached, expected, prompts)
        assert [o.generated_tokens for o in cached.values()] == [o.generated_tokens for o in uncached.values()]
        got = sd.last_stats.prefix_cache
        assert {k: got[k] for k in want} == want
        assert got["stored_blocks"] == want["inserted_blocks"] and 0 < got["hit_bytes"]
        assert got["stored_bytes"] == got["inserted_bytes"] > 0


def _ragged(prompts):
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    return ids, (ids != 0).long()


def _cache_tensors(cache) -> dict:
    """Every tensor of a HybridCache by name: KV buffers, pad / seq_len, each SSM layer's conv
    window and its strategy's store tensors (nested dicts flattened), except snapshot's step
    scratch ``buf`` (allocated uninitialised; a step writes it before reading)."""
    out = {"pad": cache.pad, "seq_len": cache.seq_len}
    for idx, (k, v) in cache.kv.items():
        out[f"k{idx}"], out[f"v{idx}"] = k, v
    for idx, layer in cache.ssm.items():
        out[f"conv{idx}"] = layer.conv_window

        def walk(prefix, d):
            for key, val in d.items():
                if isinstance(val, dict):
                    walk(f"{prefix}.{key}", val)
                elif val is not None and key != "buf":
                    out[f"{prefix}.{key}"] = val

        walk(f"store{idx}", layer.store.tensors)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_prefill_states(family):
    """adapter.prefill with a prefix cache: cold (the prompts share blocks among themselves) and
    warm (every prompt hits), against the uncached batched prefill: logits, every position's
    hidden state, and every tensor of the cache each rollback strategy keeps after the rows are
    moved into a pool (reset_rows), within 1e-5 relative (KV compared at real columns); warm
    equals cold bit for bit."""
    adapter = adapter_for(get_model(family))
    prompts = [p for p in _prompts()][:5]
    ids, mask = _ragged(prompts)
    L = ids.shape[1]
    pc = PrefixCache(BS)
    for strategy in map(make_strategy, STRATEGIES):
        runs = []
        for prefix_cache in (None, pc, pc):  # uncached, then cold, then warm (pc filled by the first strategy)
            fresh = adapter.new_cache(len(prompts), L + 8, 3, strategy)
            logits, hidden = adapter.prefill(ids, mask, fresh, True, prefix_cache=prefix_cache)
            pool = adapter.new_cache(len(prompts) + 1, L + 8, 3, strategy)
            adapter.prefill(torch.full((len(prompts) + 1, 2), 5), torch.ones(len(prompts) + 1, 2), pool)
            rows = torch.arange(1, len(prompts) + 1)
            pool.reset_rows(rows, fresh)
            runs.append((logits, hidden, _cache_tensors(pool)))
        (lr, hr, ref), (lc, hc, cold), (lw, hw, warm) = runs
        real = mask.bool()
        assert rel_err(lc, lr) < 1e-5 and rel_err(hc[real], hr[real]) < 1e-5
        assert torch.equal(lw, lc) and torch.equal(hw, hc)
        assert ref.keys() == cold.keys() == warm.keys()
        cols = torch.arange(pool.max_len)[None, :] >= pool.pad[:, None]  # [rows, max_len] real KV columns
        for name, t in ref.items():
            assert torch.equal(warm[name], cold[name]), name
            if name.startswith(("k", "v")):
                a, b = cold[name].transpose(1, 2)[cols], t.transpose(1, 2)[cols]
            else:
                a, b = cold[name], t
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert (rel_err(a.float(), b.float()) if b.is_floating_point() else float((a != b).sum())) < 1e-5, name
    assert pc.stats.hit_blocks > 0 and pc.stats.lookups == 2 * len(STRATEGIES) * len(prompts)


def test_eviction_under_a_tiny_bound():
    """A bound of about two blocks' bytes evicts (least recently used, leaves first) and keeps
    within it; outputs stay exact; a bound of 0 stores nothing and hits nothing."""
    family = "qwen3_5"
    prompts, expected = _prompts(), _expected(family)
    sd = specdec.wrap(get_model(family), rollback="snapshot", num_speculative_tokens=3, decode_path="eager")
    _run(sd, prompts, prefix_caching=True, prefix_block_size=BS)
    one = sd.last_stats.prefix_cache["inserted_bytes"] // sd.last_stats.prefix_cache["inserted_blocks"]
    for bound in (int(2.5 * one), 0):
        _check(_run(sd, prompts, prefix_caching=True, prefix_block_size=BS, prefix_cache_bytes=bound), expected,
               prompts)
        st = sd.last_stats.prefix_cache
        assert st["stored_bytes"] <= bound
        if bound:
            assert st["evicted_blocks"] > 0 and st["hit_blocks"] > 0
        else:
            assert st["hit_blocks"] == st["inserted_blocks"] == st["stored_blocks"] == 0


def test_hash_collisions_change_nothing(monkeypatch):
    """Every block hashed to one key: the token comparison still tells blocks apart, so the
    outputs and the counters are those without collisions."""
    family = "kimi_linear"
    prompts, expected = _prompts(), _expected(family)
    monkeypatch.setattr(pc_mod, "block_hash", lambda parent, tokens: 0)
    sd = specdec.wrap(get_model(family), rollback="ring", num_speculative_tokens=3, decode_path="eager")
    _check(_run(sd, prompts, prefix_caching=True, prefix_block_size=BS), expected, prompts)
    want = _counters(prompts)
    assert {k: sd.last_stats.prefix_cache[k] for k in want} == want


class HiddenRecorder(Drafter):
    """Wants every prompt position's hidden state; records what :meth:`admit` gets per request;
    drafts nothing (each step is a plain step)."""

    wants_all_hidden_states = True

    def __init__(self):
        self.seen = {}

    def admit(self, rows, input_ids, attention_mask, hidden_states, requests):
        for h, m, req in zip(hidden_states, attention_mask, requests):
            self.seen[req.index] = h[m.bool()].clone()

    def propose(self, input_ids, lengths, K):
        return torch.zeros(input_ids.shape[0], K, dtype=torch.long), torch.zeros(input_ids.shape[0], dtype=torch.long)


def test_drafter_with_all_hidden_states():
    """A drafter that wants every prompt position's hidden state gets them with prefix caching
    too (cached blocks store them): equal to the uncached prefill's within 1e-5."""
    family = "nemotron_h"
    prompts, expected = _prompts(), _expected(family)
    got = {}
    for caching in (False, True):
        rec = HiddenRecorder()
        sd = specdec.wrap(get_model(family), drafter=rec, num_speculative_tokens=2, decode_path="eager")
        _check(_run(sd, prompts, prefix_caching=caching, prefix_block_size=BS), expected, prompts)
        got[caching] = rec.seen
    assert sd.last_stats.prefix_cache["hit_blocks"] == _counters(prompts)["hit_blocks"]
    for i, p in enumerate(prompts):
        assert got[True][i].shape == (len(p), got[False][i].shape[-1])
        assert rel_err(got[True][i], got[False][i]) < 1e-5, f"req_{i}"


def test_static_path():
    """The static decode path: the pool's first requests are prefilled through the cache into the
    bucket's buffers, later ones moved in with reset_rows; exact."""
    family = "qwen3_next"
    prompts, expected = _prompts(), _expected(family)
    sd = specdec.wrap(get_model(family), rollback="replay", num_speculative_tokens=3, decode_path="static")
    _check(_run(sd, prompts, prefix_caching=True, prefix_block_size=BS), expected, prompts)
    assert sd.last_stats.decode_path == "static"
    assert sd.last_stats.prefix_cache["hit_blocks"] == _counters(prompts)["hit_blocks"]


def test_argument_errors():
    """Bad prefix-caching arguments raise before any work, naming what is accepted."""
    sd = specdec.wrap(get_model("qwen3_5"), num_speculative_tokens=2)
    for kw, err, match in [
        (dict(prefix_caching="yes"), TypeError, "prefix_caching must be a bool"),
        (dict(prefix_caching=True, prefix_block_size=0), ValueError, "prefix_block_size must be >= 1"),
        (dict(prefix_caching=True, prefix_block_size=4.0), TypeError, "prefix_block_size must be an int"),
        (dict(prefix_caching=True, prefix_cache_bytes=-1), ValueError, "prefix_cache_bytes must be >= 0"),
    ]:
        with pytest.raises(err, match=match):
            sd.generate_batch([[5, 6, 7]], max_new_tokens=2, **kw)
    mistral = specdec.wrap(get_model("mistral"), num_speculative_tokens=2)  # sliding_window = 8
    with pytest.raises(ValueError, match="prefix_block_size <= 7"):
        mistral.generate_batch([[5, 6, 7]], max_new_tokens=2, prefix_caching=True, prefix_block_size=8)


# --- the PrefixCache itself, on synthetic blocks -------------------------------------------------
def _block(head_dim: int, hidden: bool = False) -> PrefixBlock:
    """A block of one attention layer (keys / values ``[1, 1, 2, head_dim]`` fp32) and one SSM
    layer (conv ``[1, 3, 4]`` fp32, state ``[1, 2, 2, 2]`` fp64); hidden states ``[1, 2, 5]``."""
    kv = torch.randn(1, 1, 2, head_dim)
    ssm = LayerState(conv_state=torch.randn(1, 3, 4), recurrent_state=torch.randn(1, 2, 2, 2, dtype=torch.float64))
    layers = {0: LayerState(keys=kv.clone(), values=kv.clone()), 1: ssm}
    return PrefixBlock(layers, torch.randn(1, 2, 5) if hidden else None)


def _storage_bytes(block: PrefixBlock) -> int:
    ts = [t for s in block.layers.values() for t in (s.keys, s.values, s.conv_state, s.recurrent_state)]
    return sum(t.untyped_storage().nbytes() for t in [*ts, block.hidden_states] if t is not None)


def test_prefix_cache_lru_and_bytes():
    """Bytes are counted exactly; a lookup leaves the prompt's last token out; eviction takes
    least recently used leaves first, so every entry's parent stays stored; a chain larger than
    the bound is not stored; hidden states are added to a block stored without them."""
    blk = _block(8)
    size = blk.nbytes
    assert size == _storage_bytes(blk) == 2 * 2 * 8 * 4 + 12 * 4 + 8 * 8
    pc = PrefixCache(block_size=2, max_bytes=4 * size)
    a, b = [5, 6, 7, 8, 9, 10], [5, 6, 11, 12]
    chain = pc.match(a)
    assert chain == [] and pc.stats.lookups == 1 and pc.stats.prefilled_tokens == 6
    for j in range(3):
        assert pc.insert(chain, a[2 * j:2 * j + 2], _block(8)) is chain[-1]
    assert len(pc) == 3 and pc.nbytes == 3 * size
    assert len(pc.match(a)) == 2  # (6 - 1) // 2: the last block is recomputed for its logits
    assert len(pc.match(a + [1])) == 3 and pc.stats.hit_tokens == 10
    chain_b = pc.match(b)
    assert len(chain_b) == 1  # shares a's first block
    pc.insert(chain_b, b[2:], _block(8))  # 4 blocks: full
    assert pc.stats.evicted_blocks == 0 and pc.nbytes == 4 * size
    chain_c = pc.match([20, 21, 22])
    pc.insert(chain_c, [20, 21], _block(8))  # evicts the least recently used leaf: a's third block
    assert pc.stats.evicted_blocks == 1 and pc.nbytes == 4 * size
    live = {e.id for e in pc.entries()}
    assert all(e.parent is None or e.parent in live for e in pc.entries())
    assert len(pc.match(a + [1])) == 2 and len(pc.match(b + [1])) == 2
    # a chain that cannot fit is not stored, nor anything after it
    small = PrefixCache(block_size=2, max_bytes=size + 50)  # one block, and room for its hidden states
    chain = small.match(a)
    assert small.insert(chain, a[:2], _block(8)) is not None
    assert small.insert(chain, a[2:4], _block(8)) is None and len(small) == 1
    # hidden states: a lookup that needs them stops at a block without; storing them upgrades it
    assert small.match(a, need_hidden_states=True) == []
    assert small.insert([], a[:2], _block(8, hidden=True)) is not None
    assert len(small.match(a[:3], need_hidden_states=True)) == 1 and small.nbytes == _block(8, True).nbytes
    with pytest.raises(ValueError, match="block_size=2"):
        small.insert([], [1, 2, 3], _block(8))
    with pytest.raises(ValueError, match="prefix_block_size must be >= 1"):
        PrefixCache(0)


@pytest.mark.slow
@pytest.mark.parametrize("family", EXTRA_FAMILIES + ("llama", "mistral"))
def test_other_families(family):
    """The further hybrid families and two attention-only ones (one with sliding-window layers):
    prefix caching stays exact."""
    prompts = _prompts()
    sd = specdec.wrap(get_model(family), rollback="replay", num_speculative_tokens=3, decode_path="eager")
    _check(_run(sd, prompts, prefix_caching=True, prefix_block_size=BS), _expected(family), prompts)
    assert sd.last_stats.prefix_cache["hit_blocks"] == _counters(prompts)["hit_blocks"]
