"""Prefix caching (``generate_batch(prefix_caching=True)``, :mod:`specdec.prefix_cache`): requests
that share a long prompt prefix reuse its attention KV and SSM state block by block; every
request's tokens still equal HF greedy on its prompt alone (fp32) and the uncached call's; the
state a cached prefill leaves equals the uncached prefill's; hit counters match a count made here
from the prompts alone; eviction under a tiny byte bound and hash collisions change no output."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, record_prompt_forwards, rel_err
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
    """Nine prompts (ids >= 3): seven share a 14-token prefix (3 full blocks and 2 tokens) or part
    of it, two continue others, one repeats another, two are unrelated."""
    g = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()

    shared, a, b, c, d = rand(14), rand(5), rand(2), rand(6), rand(3)
    return [shared + a,            # 19 tokens: 4 full blocks, one forward
            shared + b,            # 16: finds 3 blocks, none with SSM state: a branch point at 12
            rand(9),               # unrelated
            shared[:8] + c,        # finds 2 blocks: a branch point at 8
            shared + a + d,        # continues request 0: hits 3 blocks, a branch point at 16
            shared + b,            # repeats request 1: hits 3 blocks (its last token is run)
            rand(3),               # shorter than a block
            shared + d,            # a third suffix after the shared blocks: hits them, one forward
            shared[:8] + c + a]    # continues request 3: hits 2 blocks, a branch point at 12


BUDGETS = [6, 5, 7, 4, 6, 5, 3, 4, 5]
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


def _simulate(prompts, bs=BS, ssm=True) -> list[tuple[int, int, int]]:
    """What an unbounded prefix cache does with each prompt (in order), worked out from the
    prompts alone: ``(hit blocks, forwards, blocks stored)``. A prompt finds its longest run of
    leading full blocks some earlier prompt stored (at most ``(len - 1) // bs``) and hits up to
    the deepest one holding SSM state (any, for a model without SSM layers: ``ssm=False``); when
    the run goes past the hit it runs two forwards, the first storing SSM state at the run's
    end; it stores every full block of its own, with SSM state at its end if that is a boundary."""
    kv, states, out = set(), set(), []
    for p in prompts:
        blocks = [tuple(p[:(j + 1) * bs]) for j in range(len(p) // bs)]  # each block by its whole prefix
        run = 0
        while run < (len(p) - 1) // bs and blocks[run] in kv:
            run += 1
        hit = max(n for n in range(run + 1) if n == 0 or not ssm or blocks[n - 1] in states)
        if run > hit:
            states.add(blocks[run - 1])
        if len(p) % bs == 0:
            states.add(blocks[-1])
        out.append((hit, 1 + (run > hit), len(set(blocks) - kv)))
        kv.update(blocks)
    return out


def _counters(prompts, bs=BS, ssm=True) -> dict:
    """The counters of an unbounded prefix cache after ``prompts`` (:func:`_simulate`)."""
    sim = _simulate(prompts, bs, ssm)
    hits = sum(h for h, _, _ in sim)
    return dict(lookups=len(prompts), hit_blocks=hits, hit_tokens=hits * bs,
                prefilled_tokens=sum(map(len, prompts)) - hits * bs, prefill_forwards=sum(f for _, f, _ in sim),
                inserted_blocks=sum(n for _, _, n in sim), evicted_blocks=0)


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
    assert want["hit_blocks"] >= 10 and want["inserted_blocks"] >= 8  # the setting exercises the cache,
    assert want["lookups"] < want["prefill_forwards"] < 2 * want["lookups"]  # branch points included
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


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_with_prefix_cache(family):
    """Prompts longer than max_batch_tokens, prefilled a chunk (of whole blocks) per step after
    their cache hit: every request equals HF greedy alone, and the cache holds and hits the same
    blocks as without chunks."""
    prompts, expected = _prompts(), _expected(family)
    want = _counters(prompts)
    assert max(map(len, prompts)) > 2 * BS + 1  # several chunks for the longest prompts
    sd = specdec.wrap(get_model(family), drafter="ngram", rollback="replay", num_speculative_tokens=3,
                      decode_path="eager")
    shapes = record_prompt_forwards(sd)
    cached = _run(sd, prompts, prefix_caching=True, prefix_block_size=BS, max_batch_tokens=BS + 1)
    _check(cached, expected, prompts)
    got = sd.last_stats.prefix_cache
    # more forwards than the cache planned, each within the bound ([0]: the pool's placeholder rows')
    assert len(shapes) > got["prefill_forwards"] + 1 and max(t for _, t in shapes[1:]) <= BS + 1

    assert {k: got[k] for k in ("lookups", "hit_blocks", "hit_tokens", "inserted_blocks")} == {
        k: want[k] for k in ("lookups", "hit_blocks", "hit_tokens", "inserted_blocks")}


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
    """adapter.prefill with a prefix cache against the uncached batched prefill: cold (the prompts
    share blocks among themselves), warm (every block is cached; branch points cost a second
    forward) and hot (every prompt hits in one forward): logits, every position's hidden state,
    and every tensor of the cache each rollback strategy keeps after the rows are moved into a
    pool (reset_rows), within 1e-5 relative (KV compared at real columns); two hot prefills agree
    bit for bit (a hit loads the state stored); the counters are those worked out from the prompts."""
    adapter = adapter_for(get_model(family))
    prompts = _prompts()[:5]
    ids, mask = _ragged(prompts)
    L = ids.shape[1]
    pc = PrefixCache(BS)
    for n, strategy in enumerate(map(make_strategy, STRATEGIES)):
        runs = []
        # uncached, then (first strategy) cold and warm, then hot twice
        for prefix_cache in (None, pc, pc, pc, pc) if n == 0 else (None, pc, pc):
            fresh = adapter.new_cache(len(prompts), L + 8, 3, strategy)
            logits, hidden = adapter.prefill(ids, mask, fresh, True, prefix_cache=prefix_cache)
            pool = adapter.new_cache(len(prompts) + 1, L + 8, 3, strategy)
            adapter.prefill(torch.full((len(prompts) + 1, 2), 5), torch.ones(len(prompts) + 1, 2), pool)
            rows = torch.arange(1, len(prompts) + 1)
            pool.reset_rows(rows, fresh)
            runs.append((logits, hidden, _cache_tensors(pool)))
        (lr, hr, ref), *cached = runs
        real = mask.bool()
        cols = torch.arange(pool.max_len)[None, :] >= pool.pad[:, None]  # [rows, max_len] real KV columns
        for lc, hc, got in cached:
            assert rel_err(lc, lr) < 1e-5 and rel_err(hc[real], hr[real]) < 1e-5
            assert ref.keys() == got.keys()
            for name, t in ref.items():
                if name.startswith(("k", "v")):
                    a, b = got[name].transpose(1, 2)[cols], t.transpose(1, 2)[cols]
                else:
                    a, b = got[name], t
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert (rel_err(a.float(), b.float()) if b.is_floating_point() else float((a != b).sum())) < 1e-5, name
        (lh, hh, hot), (lh2, hh2, hot2) = cached[-2:]
        assert torch.equal(lh2, lh) and torch.equal(hh2, hh)
        assert all(torch.equal(hot2[name], t) for name, t in hot.items())
    everything = prompts * (4 + 2 * (len(STRATEGIES) - 1))
    sim = _simulate(everything)
    assert [f for _, f, _ in sim[2 * len(prompts):]] == [1] * (len(everything) - 2 * len(prompts))  # hot
    assert {k: v for k, v in pc.stats.as_dict().items() if k in _counters(everything)} == _counters(everything)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_forwards(family):
    """A prefix of 4 blocks shared by 5 prompts with their own suffixes, prefilled one at a time:
    the model's body runs 1, 2, then 1 forward(s) per prompt (counted by a hook, and so counted
    in prefill_forwards); from the third prompt on each hits the 4 shared blocks; every prompt's
    logits and the cache it leaves equal its uncached prefill within 1e-5 relative."""
    adapter = adapter_for(get_model(family))
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB - 1, (4 * BS,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 2, 7, 3, 9)]
    sim = _simulate(prompts)
    assert [(h, f) for h, f, _ in sim] == [(0, 1), (0, 2), (4, 1), (4, 1), (4, 1)]
    pc, forwards = PrefixCache(BS), []
    hook = adapter.body.register_forward_pre_hook(lambda module, args: forwards.append(module))
    try:
        for p, (hit, n, _) in zip(prompts, sim):
            ids, mask = torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long)
            runs = []
            for prefix_cache in (None, pc):
                cache = adapter.new_cache(1, len(p) + 4, 3, make_strategy("snapshot"))
                before, hits = len(forwards), pc.stats.hit_blocks
                logits, _ = adapter.prefill(ids, mask, cache, prefix_cache=prefix_cache)
                runs.append((logits, _cache_tensors(cache), len(forwards) - before, pc.stats.hit_blocks - hits))
            (lr, ref, _, _), (lc, got, calls, hits) = runs
            assert calls == n and hits == hit
            assert rel_err(lc, lr) < 1e-5 and ref.keys() == got.keys()
            for name, t in ref.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
                err = rel_err(got[name].float(), t.float()) if t.is_floating_point() else float((got[name] != t).sum())
                assert err < 1e-5, name
    finally:
        hook.remove()
    assert pc.stats.prefill_forwards == 1 + 2 + 1 + 1 + 1 and pc.stats.hit_tokens == 3 * len(shared)


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
    too (cached blocks store them), and with prompts prefilled in chunks after their hit: equal
    to the uncached prefill's within 1e-5."""
    family = "nemotron_h"
    prompts, expected = _prompts(), _expected(family)
    got = {}
    for caching, chunk in ((False, None), (True, None), (True, BS + 1)):
        rec = HiddenRecorder()
        sd = specdec.wrap(get_model(family), drafter=rec, num_speculative_tokens=2, decode_path="eager")
        kw = {} if chunk is None else {"max_batch_tokens": chunk}
        _check(_run(sd, prompts, prefix_caching=caching, prefix_block_size=BS, **kw), expected, prompts)
        got[caching, chunk] = rec.seen
        if caching:
            assert sd.last_stats.prefix_cache["hit_blocks"] == _counters(prompts)["hit_blocks"]
    for key in ((True, None), (True, BS + 1)):
        for i, p in enumerate(prompts):
            assert got[key][i].shape == (len(p), got[False, None][i].shape[-1])
            assert rel_err(got[key][i], got[False, None][i]) < 1e-5, f"req_{i} {key}"


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
    """Bad prefix-caching arguments raise before any work, naming what is accepted, the same from
    generate_batch and init_continuous_batching."""
    sd = specdec.wrap(get_model("qwen3_5"), num_speculative_tokens=2)
    for kw, err, match in [
        (dict(prefix_caching="yes"), TypeError, "prefix_caching must be a bool"),
        (dict(prefix_caching=True, prefix_block_size=0), ValueError, "prefix_block_size must be >= 1"),
        (dict(prefix_caching=True, prefix_block_size=4.0), TypeError, "prefix_block_size must be an int"),
        (dict(prefix_caching=True, prefix_cache_bytes=-1), ValueError, "prefix_cache_bytes must be >= 0"),
    ]:
        with pytest.raises(err, match=match):
            sd.generate_batch([[5, 6, 7]], max_new_tokens=2, **kw)
        with pytest.raises(err, match=match):
            sd.init_continuous_batching(max_length=8, **kw)
    # NumPy integers are ints here too, kept as Python ints
    np = pytest.importorskip("numpy")
    m = sd.init_continuous_batching(max_length=8, prefix_caching=True, prefix_block_size=np.int64(4),
                                    prefix_cache_bytes=np.int32(4096))
    assert (m.prefix_cache.block_size, m.prefix_cache.max_bytes) == (4, 4096)
    assert type(m.prefix_cache.block_size) is int and type(m.prefix_cache.max_bytes) is int


#: a manager's bound above every request of _prompts() (longest prompt 22 + largest budget 7)
MAX_LENGTH = 32


def _manager(family, rows=ROWS, **kw):
    sd = specdec.wrap(get_model(family), drafter="ngram", rollback="replay", num_speculative_tokens=3,
                      decode_path="eager")
    return sd, sd.init_continuous_batching(max_length=MAX_LENGTH, max_batch_size=rows, eos_token_id=EOS, **kw)


def _add(m, prompts, budgets, offset=0) -> list[str]:
    return [m.add_request(p, request_id=f"req_{offset + i}", max_new_tokens=b)
            for i, (p, b) in enumerate(zip(prompts, budgets))]


@pytest.mark.parametrize("family", FAMILIES)
def test_manager_matches_uncached_and_hf(family):
    """init_continuous_batching(prefix_caching=True): requests sharing a prefix, more than the
    pool's rows, most added while the first ones decode: each equals HF greedy on its prompt alone
    (the tokens of the manager without caching); the cache was hit."""
    prompts, expected = _prompts(), _expected(family)
    sd, m = _manager(family, prefix_caching=True, prefix_block_size=BS)
    assert m.prefix_cache is not None and m.prefix_cache.block_size == BS
    with m:
        _add(m, prompts[:3], BUDGETS[:3])
        got = [m.get_result(timeout=60)]
        _add(m, prompts[3:], BUDGETS[3:], offset=3)
        got += list(m)
    _check({o.request_id: o for o in sorted(got, key=lambda o: int(o.request_id[4:]))}, expected, prompts)
    counters = sd.last_stats.prefix_cache
    assert counters["lookups"] == len(prompts) and counters["hit_blocks"] > 0
    assert counters["hit_tokens"] == BS * counters["hit_blocks"] and counters["stored_bytes"] > 0
    sd, plain = _manager(family)
    assert plain.prefix_cache is None
    with plain:
        _add(plain, prompts, BUDGETS)
        uncached = {o.request_id: o for o in plain}
    assert [uncached[f"req_{i}"].generated_tokens for i in range(len(prompts))] == expected
    assert sd.last_stats.prefix_cache is None


def test_manager_cache_persists_across_runs():
    """One row (requests prefilled in the order they were added): the counters after a run are
    those an unbounded cache gives for its prompts; a second run of the same manager (start()
    after stop()) finds the first run's blocks, its counters those of both runs' prompts in
    order; outputs exact in both; a new manager starts with an empty cache."""
    family = "qwen3_next"
    prompts, expected = _prompts(), _expected(family)
    sd, m = _manager(family, rows=1, prefix_caching=True, prefix_block_size=BS)
    for run in range(2):
        with m:
            _add(m, prompts, BUDGETS, offset=run * len(prompts))
            got = {o.request_id: o for o in m}
        assert [got[f"req_{run * len(prompts) + i}"].generated_tokens for i in range(len(prompts))] == expected
        want = _counters(prompts * (run + 1))
        assert {k: sd.last_stats.prefix_cache[k] for k in want} == want
    assert want["hit_blocks"] > 2 * _counters(prompts)["hit_blocks"]  # the second run reused the first's blocks
    _, fresh = _manager(family, rows=1, prefix_caching=True, prefix_block_size=BS)
    assert fresh.prefix_cache is not m.prefix_cache and len(fresh.prefix_cache) == 0


def test_blocks_longer_than_a_sliding_window():
    """Sliding-window layers that keep fewer keys than a block (window 8: 7 keys; blocks of 8
    tokens): a block's keys / values are taken as the layers receive them in the forward, so the
    outputs still equal HF greedy and a hit serves the shared blocks."""
    family = "mistral"
    assert get_model(family).config.sliding_window == 8
    prompts = _prompts()
    sd = specdec.wrap(get_model(family), rollback="replay", num_speculative_tokens=3, decode_path="eager")
    _check(_run(sd, prompts, prefix_caching=True, prefix_block_size=8), _expected(family), prompts)
    want = _counters(prompts, bs=8, ssm=False)
    assert want["hit_blocks"] > 0 and sd.last_stats.prefix_cache["hit_blocks"] == want["hit_blocks"]


# --- the PrefixCache itself, on synthetic blocks -------------------------------------------------
def _block(head_dim: int, hidden: bool = False, state: bool = True) -> PrefixBlock:
    """A block of one attention layer (keys / values ``[1, 1, 2, head_dim]`` fp32) and, with
    ``state``, one SSM layer's state (conv ``[1, 3, 4]`` fp32, recurrent ``[1, 2, 2, 2]`` fp64);
    hidden states ``[1, 2, 5]``."""
    kv = torch.randn(1, 1, 2, head_dim)
    ssm = LayerState(conv_state=torch.randn(1, 3, 4), recurrent_state=torch.randn(1, 2, 2, 2, dtype=torch.float64))
    return PrefixBlock({0: LayerState(keys=kv.clone(), values=kv.clone())}, {1: ssm} if state else None,
                       torch.randn(1, 2, 5) if hidden else None)


def _storage_bytes(block: PrefixBlock) -> int:
    states = [*block.kv.values(), *(block.ssm_state or {}).values()]
    ts = [t for s in states for t in (s.keys, s.values, s.conv_state, s.recurrent_state)]
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
    found = pc.match(a)
    assert found.chain == [] and found.hit == 0 and found.forward_ends == (6,)
    assert pc.stats.lookups == 1 and pc.stats.prefilled_tokens == 6
    chain = []
    for j in range(3):
        assert pc.insert(chain, a[2 * j:2 * j + 2], _block(8)) is chain[-1]
    assert len(pc) == 3 and pc.nbytes == 3 * size
    assert pc.match(a).hit == 2  # (6 - 1) // 2: the last block is recomputed for its logits
    assert pc.match(a + [1]).hit == 3 and pc.stats.hit_tokens == 10
    chain_b = pc.match(b).chain
    assert len(chain_b) == 1  # shares a's first block
    pc.insert(chain_b, b[2:], _block(8))  # 4 blocks: full
    assert pc.stats.evicted_blocks == 0 and pc.nbytes == 4 * size
    chain_c = pc.match([20, 21, 22]).chain
    pc.insert(chain_c, [20, 21], _block(8))  # evicts the least recently used leaf: a's third block
    assert pc.stats.evicted_blocks == 1 and pc.nbytes == 4 * size
    live = {e.id for e in pc.entries()}
    assert all(e.parent is None or e.parent in live for e in pc.entries())
    assert pc.match(a + [1]).hit == 2 and pc.match(b + [1]).hit == 2
    # a chain that cannot fit is not stored, nor anything after it
    small = PrefixCache(block_size=2, max_bytes=size + 50)  # one block, and room for its hidden states
    chain = small.match(a).chain
    assert small.insert(chain, a[:2], _block(8)) is not None
    assert small.insert(chain, a[2:4], _block(8)) is None and len(small) == 1
    # hidden states: a lookup that needs them stops at a block without; storing them upgrades it
    assert small.match(a, need_hidden_states=True).chain == []
    assert small.insert([], a[:2], _block(8, hidden=True)) is not None
    assert small.match(a[:3], need_hidden_states=True).hit == 1 and small.nbytes == _block(8, True).nbytes
    assert small.stats.stored_bytes == small.stats.inserted_bytes - small.stats.evicted_bytes
    with pytest.raises(ValueError, match="block_size=2"):
        small.insert([], [1, 2, 3], _block(8))
    with pytest.raises(ValueError, match="prefix_block_size must be >= 1"):
        PrefixCache(0)


def test_prefix_cache_branch_points():
    """Blocks stored without SSM state are found but not hit: a lookup hits up to the deepest
    block holding state and plans a first forward to a branch point at the end of the blocks
    found; storing the state there adds exactly its bytes to the block (its keys / values kept)
    and later lookups hit it in one forward. Stored tensors are compact copies of views."""
    pc = PrefixCache(block_size=2)
    a, b = [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 12, 13]
    chain = []
    for j in range(3):  # a prefill of a in one forward: state only at its end (a block boundary)
        pc.insert(chain, a[2 * j:2 * j + 2], _block(8, state=j == 2))
    kv_only, with_state = chain[0].block.nbytes, chain[2].block.nbytes
    assert kv_only == 2 * 2 * 8 * 4 and with_state == kv_only + 12 * 4 + 8 * 8
    found = pc.match(a + [1])  # extends a: hits all of it
    assert (len(found.chain), found.hit, found.forward_ends) == (3, 3, (7,))
    assert pc.stats.hit_bytes == 3 * kv_only + (with_state - kv_only)
    found = pc.match(b)  # shares a's first two blocks, which hold no state: a branch point at 4
    assert (len(found.chain), found.hit, found.forward_ends) == (2, 0, (4, 7))
    assert pc.stats.prefill_forwards == 1 + 2 and pc.stats.prefilled_tokens == 1 + 7
    before, kv = pc.stats.as_dict(), chain[1].block.kv[0].keys
    branch = []
    pc.insert(branch, b[:2], _block(8, state=False))  # the first forward's blocks, the last with state
    pc.insert(branch, b[2:4], _block(8))
    assert branch == chain[:2] and chain[1].block.kv[0].keys is kv  # keys / values kept
    after = pc.stats.as_dict()
    assert after["inserted_blocks"] == before["inserted_blocks"] and len(pc) == 3
    added = with_state - kv_only
    assert after["inserted_bytes"] - before["inserted_bytes"] == added == pc.nbytes - before["stored_bytes"]
    pc.insert(branch, b[4:6], _block(8, state=False))  # the second forward's block
    found = pc.match([5, 6, 7, 8, 20, 21, 22])  # a third suffix after the shared prefix: hits it, one forward
    assert (len(found.chain), found.hit, found.forward_ends) == (2, 2, (7,))
    found = pc.match(b + [14])  # extends b, whose last block holds no state: a branch point at 6
    assert (len(found.chain), found.hit, found.forward_ends) == (3, 2, (6, 8))
    view = torch.randn(1, 1, 10, 8)[:, :, 4:6]  # a view into a larger buffer
    entry = pc.insert([], [30, 31], PrefixBlock({0: LayerState(view, view)}, {}))
    assert entry.block.nbytes == _storage_bytes(entry.block) == 2 * 2 * 8 * 4
    assert pc.stats.stored_bytes == pc.stats.inserted_bytes == pc.nbytes


def test_no_branch_point_whose_state_cannot_be_stored():
    """A bound that holds a chain's keys / values but not the SSM state a branch point would add
    plans one forward (the split would be refused its state, prompt after prompt); with room for
    the state the same lookup plans the branch point. Before any state is offered its size is
    unknown and the branch point is planned."""
    a, b = [5, 6, 7, 8, 9], [5, 6, 7, 8, 11, 12]
    kv_only, state = _block(8, state=False).nbytes, _block(8).nbytes - _block(8, state=False).nbytes
    for room, ends in ((state - 1, (6,)), (state, (4, 6))):
        pc = PrefixCache(block_size=2, max_bytes=2 * kv_only + room)
        chain = []
        for j in range(2):
            pc.insert(chain, a[2 * j:2 * j + 2], _block(8, state=False))
        assert pc.match(b).forward_ends == (4, 6)  # no state offered yet: its size is unknown
        pc.insert([], [40, 41], _block(8))  # a block with state (evicts a's blocks if it must)
        chain = []
        for j in range(2):
            pc.insert(chain, a[2 * j:2 * j + 2], _block(8, state=False))
        found = pc.match(b)
        assert len(found.chain) == 2 and found.hit == 0 and found.forward_ends == ends, room
        branch = []
        stored = [pc.insert(branch, b[2 * j:2 * j + 2], _block(8, state=j == 1)) for j in range(2)]
        assert (stored[1] is not None) == (len(ends) == 2)  # the split's state is stored exactly when planned


def test_small_bound_costs_no_extra_forwards():
    """Prompts sharing a prefix under a bound too small for one block's SSM state: one forward per
    prompt, as without a cache, once the first branch point has shown the cache a state's size
    (that prompt's two forwards are the only extra one); the outputs of an uncached run."""
    family = "qwen3_5"
    prompts, expected = _prompts(), _expected(family)
    sd = specdec.wrap(get_model(family), rollback="snapshot", num_speculative_tokens=3, decode_path="eager")
    _run(sd, prompts, prefix_caching=True, prefix_block_size=BS)
    st = sd.last_stats.prefix_cache
    assert st["prefill_forwards"] > st["lookups"] + 1  # this workload has several branch points
    pc = PrefixCache(BS)  # a block's bytes without and with SSM state: a prefill ending on a block boundary
    adapter = adapter_for(get_model(family))
    p = prompts[0][:3 * BS]
    adapter.prefill(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long),
                    adapter.new_cache(1, len(p) + 4, 3, make_strategy("snapshot")), prefix_cache=pc)
    kv = min(e.block.nbytes for e in pc.entries() if e.block.ssm_state is None)
    assert kv * 4 < max(e.block.nbytes for e in pc.entries()) - kv  # one block's state outweighs 4 blocks' K / V
    _check(_run(sd, prompts, prefix_caching=True, prefix_block_size=BS, prefix_cache_bytes=4 * kv), expected, prompts)
    st = sd.last_stats.prefix_cache
    assert st["inserted_blocks"] > 0 and st["lookups"] == len(prompts)
    assert st["prefill_forwards"] == st["lookups"] + 1


@pytest.mark.slow
@pytest.mark.parametrize("family", EXTRA_FAMILIES + ("llama", "mistral"))
def test_other_families(family):
    """The further hybrid families and two attention-only ones (one with sliding-window layers):
    prefix caching stays exact; without SSM layers every cached block is a hit (one forward each)."""
    prompts = _prompts()
    sd = specdec.wrap(get_model(family), rollback="replay", num_speculative_tokens=3, decode_path="eager")
    _check(_run(sd, prompts, prefix_caching=True, prefix_block_size=BS), _expected(family), prompts)
    ssm = family in EXTRA_FAMILIES
    assert bool(sd.adapter.ssm_layers()) == ssm
    want = _counters(prompts, ssm=ssm)
    got = sd.last_stats.prefix_cache
    assert got["hit_blocks"] == want["hit_blocks"] and got["prefill_forwards"] == want["prefill_forwards"]
    assert ssm or want["prefill_forwards"] == len(prompts)


# --- prompts prefilled together through the cache (Mamba-2, GDN and KDA families) -----------------
BATCHED_FAMILIES = ("nemotron_h", "bamba", "qwen3_5", "olmo_hybrid", "kimi_linear")
#: those whose prompt forwards run in buckets (the tiny Kimi-Linear's MoE experts sync with the host: eager)
BUCKETED_FAMILIES = tuple(f for f in BATCHED_FAMILIES if f != "kimi_linear")


def _batch_prompts():
    """``(warm, batch)``: two prompts that fill the cache (the first stores SSM state at 16, the
    second a branch point at 8 and state at its end, 12, on its own branch), then seven that hit
    it at 4, 4, 3, 2, 0, 0 and 3 blocks, with suffixes of 2-10 tokens; two make branch points (at
    12, at 4). The last shares 3 blocks with the fourth, which hits 2 and stores state at 12, so
    it waits for a second round (and then hits 3)."""
    g = torch.Generator().manual_seed(11)

    def rand(n):
        return torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()

    shared, u = rand(16), rand(4)
    warm = [shared, shared[:8] + u]
    batch = [shared + rand(5),  # hits 4 blocks, one forward of 5 tokens
             shared + rand(2),  # hits 4 blocks, one forward of 2
             shared[:8] + u + rand(3),  # hits warm[1]'s 3 blocks, one forward of 3
             shared[:12] + rand(6),  # hits 2 and finds 3 blocks: forwards to 12 and to 18
             rand(7),  # unrelated: one forward
             shared[:4] + rand(9),  # finds 1 block without state: forwards to 4 and to 13
             shared[:12] + rand(3)]  # after the fourth stored state at 12: hits 3, one forward
    return warm, batch


def _per_row(adapter, monkeypatch):
    """``adapter`` with its cached prefill taking each prompt on its own."""
    monkeypatch.setattr(adapter, "batches_cached_prefill", lambda scan: False)


def _block_path(pc) -> dict:
    """Every stored block of ``pc`` by the tokens of its whole prefix."""
    by_id = {e.id: e for e in pc.entries()}

    def path(e):
        return (path(by_id[e.parent]) if e.parent is not None else ()) + e.tokens

    return {path(e): e.block for e in pc.entries()}


def _assert_blocks_close(got, ref):
    assert got.keys() == ref.keys()
    for key, want in ref.items():
        have = got[key]
        for name in ("kv", "ssm_state"):
            a, b = getattr(have, name), getattr(want, name)
            assert (a is None) == (b is None) and (a is None or a.keys() == b.keys()), (name, key)
            for idx in (b or {}):
                for f in ("keys", "values", "conv_state", "recurrent_state"):
                    x, y = getattr(a[idx], f), getattr(b[idx], f)
                    assert (x is None) == (y is None) and (x is None or (x.shape == y.shape and rel_err(x, y) < 1e-5))
        assert (have.hidden_states is None) == (want.hidden_states is None)
        assert have.hidden_states is None or rel_err(have.hidden_states, want.hidden_states) < 1e-5


def _assert_prefills_close(have, want, batch, cache):
    """Two cached prefills of ``batch`` agree: ``(logits, hidden, cache tensors, prefix cache)``
    of each within 1e-5 relative (hidden states at real positions, keys / values at ``cache``'s
    real columns), and their prefix caches hold the same blocks and states."""
    (lb, hb, got, pc_b), (lr, hr, ref, pc_ref) = have, want
    real = _ragged(batch)[1].bool()
    assert rel_err(lb, lr) < 1e-5 and rel_err(hb[real], hr[real]) < 1e-5
    cols = torch.arange(cache.max_len)[None, :] >= cache.pad[:, None]
    assert ref.keys() == got.keys()
    for name, t in ref.items():
        a, b = (got[name].transpose(1, 2)[cols], t.transpose(1, 2)[cols]) if name.startswith(("k", "v")) else (got[name], t)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert (rel_err(a.float(), b.float()) if b.is_floating_point() else float((a != b).sum())) < 1e-5, name
    _assert_blocks_close(_block_path(pc_b), _block_path(pc_ref))


@pytest.mark.parametrize("family", BATCHED_FAMILIES)
def test_batched_cached_prefill_matches_per_row(family, monkeypatch):
    """Seven prompts continued from cached prefixes of 16, 16, 12, 8, 0, 0 (and, in a second
    round, 12) tokens with suffixes of 2-10 tokens, two with branch points, prefilled together:
    the body runs one forward per wave (2 waves, then 1: 3) where the per-row path runs 9, one
    per planned forward; logits, every
    position's hidden state and every tensor of the cache it leaves equal the per-row path's
    within 1e-5 relative (KV at real columns), and the prefix cache stores the same blocks (by
    their whole prefix), states and hidden states within 1e-5, with the same counters."""
    adapter = adapter_for(get_model(family))
    assert adapter.batches_cached_prefill("torch") and not adapter.batches_cached_prefill("hf")
    warm, batch = _batch_prompts()
    runs, forwards = [], []
    hook = adapter.body.register_forward_pre_hook(lambda module, args: forwards.append(module))
    try:
        for batched in (False, True):
            with monkeypatch.context() as m:
                if not batched:
                    _per_row(adapter, m)
                pc = PrefixCache(BS)
                for prompts in (warm, batch):
                    ids, mask = _ragged(prompts)
                    cache = adapter.new_cache(len(prompts), ids.shape[1] + 4, 3, make_strategy("snapshot"))
                    before = len(forwards)
                    logits, hidden = adapter.prefill(ids, mask, cache, True, prefix_cache=pc)
                runs.append((logits, hidden, _cache_tensors(cache), pc, len(forwards) - before))
    finally:
        hook.remove()
    (lr, hr, ref, pc_ref, n_ref), (lb, hb, got, pc_b, n_b) = runs
    assert n_ref == 9 and n_b == 3
    assert pc_b.stats.as_dict() == pc_ref.stats.as_dict()
    hits = _simulate(warm + batch)[len(warm):]
    assert [h for h, _, _ in hits] == [4, 4, 3, 2, 0, 0, 3] and [f for _, f, _ in hits] == [1, 1, 1, 2, 1, 2, 1]
    _assert_prefills_close((lb, hb, got, pc_b), (lr, hr, ref, pc_ref), batch, cache)


@torch.no_grad()
def test_batched_cached_prefill_under_eviction(monkeypatch):
    """With a byte-bounded prefix cache that evicts during the batch, the batched prefill's
    logits, hidden states and cache still equal the per-row path's (within 1e-5): a prompt runs
    from the states it loaded at its lookup even if a later insert of its round evicts them (what
    the cache holds and counts afterwards may differ from an in-order run's)."""
    adapter = adapter_for(get_model("nemotron_h"))
    warm, batch = _batch_prompts()
    runs = []
    for batched in (False, True):
        with monkeypatch.context() as m:
            if not batched:
                _per_row(adapter, m)
            pc = PrefixCache(BS, max_bytes=6000)
            for prompts in (warm, batch):
                ids, mask = _ragged(prompts)
                cache = adapter.new_cache(len(prompts), ids.shape[1] + 4, 3, make_strategy("snapshot"))
                logits, hidden = adapter.prefill(ids, mask, cache, True, prefix_cache=pc)
            assert pc.stats.evicted_blocks > 0 and pc.stats.hit_blocks > 0
            runs.append((logits, hidden, _cache_tensors(cache)))
    (lr, hr, ref), (lb, hb, got) = runs
    real = _ragged(batch)[1].bool()
    assert rel_err(lb, lr) < 1e-5 and rel_err(hb[real], hr[real]) < 1e-5
    cols = torch.arange(cache.max_len)[None, :] >= cache.pad[:, None]
    for name, t in ref.items():
        a, b = (got[name].transpose(1, 2)[cols], t.transpose(1, 2)[cols]) if name.startswith(("k", "v")) else (got[name], t)
        assert (rel_err(a.float(), b.float()) if b.is_floating_point() else float((a != b).sum())) < 1e-5, name


@pytest.mark.parametrize("family", BATCHED_FAMILIES)
@torch.no_grad()
def test_left_padding_is_state_neutral(family):
    """A prompt continued from a prefix's state with padding columns before it (3, and more than
    the conv width before a suffix shorter than it) ends in the state it ends in alone: every
    layer's conv window, recurrent state and keys / values (at real columns), and its last
    hidden state, within 1e-5 relative (equal but for the chunked scan's rounding)."""
    adapter = adapter_for(get_model(family))
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, VOCAB - 1, (1, 9), generator=g)
    P = prefix.shape[1]
    base = _KV(adapter)
    adapter._prompt_forward(prefix, torch.ones_like(prefix), torch.arange(P)[None], base, "torch")
    start = adapter._layer_states(base)
    for n, pad in ((6, 3), (2, 7)):
        suffix = torch.randint(3, VOCAB - 1, (1, n), generator=g)
        runs = []
        for p in (0, pad):
            hf = _KV(adapter)
            adapter._restore(hf, [start], P)
            ids = torch.cat([torch.zeros(1, p, dtype=torch.long), suffix], 1)
            mask = torch.cat([torch.ones(1, P), torch.zeros(1, p), torch.ones(1, n)], 1).long()
            pos = torch.cat([torch.zeros(1, p, dtype=torch.long), torch.arange(P, P + n)[None]], 1)
            out = adapter._prompt_forward(ids, mask, pos, hf, "torch")
            states = adapter._layer_states(hf)
            real = mask[0].bool()
            runs.append((out[:, -1], {idx: (s.keys[:, :, real] if s.keys is not None else None,
                                            s.values[:, :, real] if s.values is not None else None,
                                            s.conv_state, s.recurrent_state) for idx, s in states.items()}))
        (h_alone, alone), (h_pad, padded) = runs
        assert rel_err(h_pad, h_alone) < 1e-5 and alone.keys() == padded.keys()
        kinds = set()
        for idx, ts in alone.items():
            for kind, a, b in zip(("keys", "values", "conv", "recurrent"), padded[idx], ts):
                assert (a is None) == (b is None), (idx, kind)
                if b is not None:
                    kinds.add(kind)
                    assert a.shape == b.shape and rel_err(a, b) < 1e-5, (idx, kind, n, pad)
        assert kinds == {"keys", "values", "conv", "recurrent"}


def _KV(adapter):
    from specdec.models.base import _KVRecordingCache

    return _KVRecordingCache(adapter.config)


@pytest.mark.parametrize("family", BATCHED_FAMILIES)
def test_batched_cached_generate(family):
    """generate_batch with prefix caching and every request admitted at once (the nine prompts,
    then again warm): outputs identical to caching off and to HF greedy alone; the admissions'
    prompt forwards are fewer than the forwards the cache planned (one per prompt, two at a
    branch point), which the per-row path runs one by one."""
    prompts = _prompts()
    sd = specdec.wrap(get_model(family), drafter="ngram", rollback="replay", num_speculative_tokens=3,
                      decode_path="eager")
    uncached = sd.generate_batch(prompts, max_new_tokens=BUDGETS, eos_token_id=EOS, max_batch_size=len(prompts))
    _check(uncached, _expected(family), prompts)
    shapes = record_prompt_forwards(sd)
    cached = sd.generate_batch(prompts + prompts, max_new_tokens=BUDGETS + BUDGETS, eos_token_id=EOS,
                               max_batch_size=len(prompts), prefix_caching=True, prefix_block_size=BS)
    want = [o.generated_tokens for o in uncached.values()]
    assert [o.generated_tokens for o in cached.values()] == want + want
    planned = sd.last_stats.prefix_cache["prefill_forwards"]
    assert planned == _counters(prompts + prompts)["prefill_forwards"]
    assert len(shapes) - 1 < planned  # ([0]: the pool's placeholder rows' forward)


def test_an_admission_looks_its_prompts_up_in_queue_order():
    """One admission of three prompts where the second ends on a block boundary (so it stores its
    block with SSM state) and the third continues it: the third hits that block, as when they are
    admitted one by one; sorted by length, as an uncached admission orders them, it would be
    looked up before the second and miss."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB - 1, (BS + 1,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB - 1, (BS + 2,), generator=g).tolist(), shared[:BS], shared]
    model = get_model(FAMILIES[0])
    want = [hf_greedy(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), 3)[0, len(p):].tolist()
            for p in prompts]
    for rows in (1, len(prompts)):
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")
        out = sd.generate_batch(prompts, max_new_tokens=3, max_batch_size=rows, prefix_caching=True,
                                prefix_block_size=BS)
        assert [o.generated_tokens for o in out.values()] == want
        counted = {k: sd.last_stats.prefix_cache[k] for k in ("hit_blocks", "prefilled_tokens", "prefill_forwards")}
        assert counted == {k: _counters(prompts)[k] for k in counted} and counted["hit_blocks"] == 1, rows


def test_right_aligned_columns_match_their_definition():
    """The gather index of a batched cached forward's keys / values (built on the device) picks, per
    row, its last ``prefix[b]`` prefix columns then its last ``new[b]`` new ones, right-aligned and
    padded at the left; the no-gather case only when that is every row's last W columns."""
    import random

    from specdec.models.base import _right_aligned

    rng = random.Random(0)
    for _ in range(300):
        B, P, T = rng.randint(1, 4), rng.randint(0, 6), rng.randint(1, 6)
        prefix, new = [rng.randint(0, P) for _ in range(B)], [rng.randint(1, T) for _ in range(B)]
        cols = [list(range(P - p, P)) + list(range(P + T - n, P + T)) for p, n in zip(prefix, new)]
        W = max(map(len, cols))
        index, pad = _right_aligned(prefix, new, P, T, "cpu")
        if index is None:
            assert all(c == list(range(P + T - W, P + T)) for c in cols)
            continue
        padded = pad[:, 0, :, 0].tolist() if pad is not None else [[False] * W] * B
        for b, c in enumerate(cols):
            assert padded[b] == [True] * (W - len(c)) + [False] * len(c)
            assert index[b, 0, W - len(c):, 0].tolist() == c


@pytest.mark.parametrize("family", BUCKETED_FAMILIES)
def test_batched_cached_prefill_through_buckets(family):
    """The batched cached prefill on the bucketed prompt path (``prompt_path="static"``, what the
    CUDA-graph path captures: rows, new tokens and restored prefix columns padded further, states
    loaded from shared buffers): logits, every position's hidden state, every tensor of the cache
    it leaves and every block and state the prefix cache stores equal the eager path's within
    1e-5 relative, with the same counters; the buckets ran every forward."""
    adapter = adapter_for(get_model(family))
    warm, batch = _batch_prompts()
    runs, forwards = [], []
    hook = adapter.body.register_forward_pre_hook(lambda module, args: forwards.append(module))
    try:
        for path in ("eager", "static"):
            before, calls = adapter.prompt_graphs.counts["static"], len(forwards)
            pc = PrefixCache(BS)
            for prompts in (warm, batch):
                ids, mask = _ragged(prompts)
                cache = adapter.new_cache(len(prompts), ids.shape[1] + 4, 3, make_strategy("snapshot"))
                logits, hidden = adapter.prefill(ids, mask, cache, True, prefix_cache=pc, prompt_path=path)
            runs.append((logits, hidden, _cache_tensors(cache), pc,
                         (adapter.prompt_graphs.counts["static"] - before, len(forwards) - calls)))
    finally:
        hook.remove()
    (lr, hr, ref, pc_ref, n_ref), (lb, hb, got, pc_b, n_b) = runs
    assert n_ref[0] == 0 and n_b[0] == n_b[1] == n_ref[1] > 3  # every forward of the eager path, in a bucket
    assert pc_b.stats.as_dict() == pc_ref.stats.as_dict()
    _assert_prefills_close((lb, hb, got, pc_b), (lr, hr, ref, pc_ref), batch, cache)
