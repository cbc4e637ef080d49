"""Prompt forwards at bucketed shapes (``specdec.models.prompt_graphs``): the same states as an
eager prefill of the same prompts, every output written, nothing read back to the host inside
the forward (what lets CUDA capture it), captured and replayed on CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import MAX_NEW, hf_greedy
from markers import needs_cuda
from tiny_models import get_model, make_model, ragged_prompts
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache

import specdec
from specdec.models import adapter_for
from specdec.graphs import bucket_width
from specdec.models.prompt_graphs import PromptGraphs, prompt_bucket

#: families whose prompts the buckets serve on CPU (the MoE families' experts sync with the host)
SERVED = ["qwen3_5", "nemotron_h"]
NAMES = ("keys", "values", "conv_state", "recurrent_state")


def test_prompt_bucket_shapes():
    """Rows round up to a power of two, widths to 32, 48, 64, 96, ...: never less than asked,
    never more than a third of a bucket beyond the width (from 32 on); None past the limits."""
    assert bucket_width(0) == 0 and bucket_width(1) == 32 and bucket_width(1000) == 1024
    widths = [prompt_bucket(1, w, 1, 10 ** 6)[1] for w in range(1, 3000)]
    assert sorted(set(widths))[:8] == [32, 48, 64, 96, 128, 192, 256, 384]
    for w, b in zip(range(1, 3000), widths):
        assert b >= w and (w <= 32 or b <= 1.5 * w)
    assert [prompt_bucket(r, 32, 64, 10 ** 6)[0] for r in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert prompt_bucket(9, 32, max_rows=8) is None
    assert prompt_bucket(4, 600, max_rows=8, max_tokens=2048) is None  # 4 x 768 tokens
    assert prompt_bucket(2, 600, max_rows=8, max_tokens=2048) == (2, 768)
    with pytest.raises(ValueError, match="rows >= 1 and width >= 1"):
        prompt_bucket(0, 10)


def _eager(ad, ids, mask):
    hf = DynamicCache(config=ad.config)
    hidden = ad._prompt_forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), hf, "torch")
    return hidden, ad._layer_states(hf)


@pytest.mark.parametrize("fam", SERVED)
def test_bucketed_forward_equals_eager(fam):
    """Ragged prompts through a bucket (more rows and columns of padding): hidden states at every
    real position, keys / values of every column, conv windows and recurrent states equal the
    eager forward's to fp32 rounding; the shared buffers, poisoned first, are written wherever
    read. A second shape through the same buffers gives its own eager result."""
    model = make_model(fam).float()
    ad = adapter_for(model)
    graphs = PromptGraphs(ad)
    for batch, lengths in ((3, (12, 7, 10)), (2, (5, 40))):
        ids, mask = ragged_prompts(batch, lengths=lengths, seed=batch)
        for buf in graphs._arena.buffers.values():  # poison what the last shape left
            buf.fill_(float("nan"))
        got_hidden, _, got = graphs.run(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), "torch", graphs=False)
        want_hidden, want = _eager(ad, ids, mask)
        real = mask.bool()
        torch.testing.assert_close(got_hidden[real], want_hidden[real], rtol=1e-5, atol=1e-5)
        assert set(got) == set(want)
        for idx in want:
            for n in NAMES:
                w, g = getattr(want[idx], n), getattr(got[idx], n)
                assert (w is None) == (g is None), (idx, n)
                if w is None:
                    continue
                assert g.shape == w.shape, (idx, n)
                if n in ("keys", "values"):  # real columns only: padding columns are masked
                    w, g = w.transpose(1, 2)[real], g.transpose(1, 2)[real]
                assert not torch.isnan(g).any(), (idx, n)
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"layer {idx} {n}")
    assert graphs.counts == {"cuda_graph": 0, "captured": 0, "static": 2, "eager": 0}


class _HostReads(TorchFunctionMode):
    """Records every read of a tensor's value by the host (``bool``, ``item``, ``tolist``, ...)."""

    READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fam", SERVED)
def test_bucketed_forward_reads_nothing_back(fam):
    """The program a bucket captures reads no tensor value on the host (a CUDA graph cannot
    capture a host sync); an eager prefill with padding reads some (transformers' mask
    shortcuts), which the bucket's masks avoid."""
    model = make_model(fam).float()
    ad = adapter_for(model)
    graphs = PromptGraphs(ad)
    ids, mask = ragged_prompts(3)
    graphs.run(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), "torch", graphs=False)  # the bucket, the buffers
    bucket = next(iter(graphs._buckets.values()))
    with _HostReads() as probe:
        bucket.program()
    assert probe.reads == []
    with _HostReads() as probe:
        _eager(ad, ids, mask)
    assert probe.reads  # the probe sees what it must not see in the bucket


@pytest.mark.parametrize("fam", SERVED)
def test_continued_forward_reads_nothing_back(fam):
    """The same for a bucket that continues prompts from a prefix cache's hit (HF's cache loaded
    from restored keys / values, conv windows and recurrent states inside the program; both
    families' prompt layers make their padding state-neutral, so their continued prompts run
    in buckets)."""
    from specdec.prefix_cache import PrefixCache
    from specdec.rollback import make_strategy

    model = make_model(fam).float()
    ad = adapter_for(model)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 100, (8,), generator=g)
    prompts = [torch.cat([shared, torch.randint(3, 100, (n,), generator=g)]) for n in (3, 5)]
    pc = PrefixCache(4)
    for batch in ([prompts[0]], prompts):
        ids, mask = ragged_prompts(len(batch), lengths=[len(p) for p in batch])
        for b, p in enumerate(batch):
            ids[b, ids.shape[1] - len(p):] = p
        cache = ad.new_cache(len(batch), ids.shape[1] + 4, 3, make_strategy("snapshot"))
        ad.prefill(ids, mask, cache, prefix_cache=pc, prompt_path="static")
    continued = [b for b in ad.prompt_graphs._buckets.values() if b.restored and b.P]
    assert continued and pc.stats.hit_blocks > 0
    for bucket in continued:
        with _HostReads() as probe:
            bucket.program()
        assert probe.reads == [], (bucket.B, bucket.T, bucket.P)


def test_families_the_buckets_do_not_serve_prefill_eagerly():
    """A model whose experts sync with the host (on CPU: the MoE families) says why, and its
    prompts run eagerly on every prompt path, with the same result."""
    model = make_model("qwen3_next").float()
    ad = adapter_for(model)
    assert "experts" in ad.prompt_graphs.available
    ids, mask = ragged_prompts(3)
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path="static")
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert torch.equal(out, hf_greedy(model, ids, mask, MAX_NEW))


@pytest.mark.parametrize("fam", SERVED)
def test_static_path_prefills_through_buckets_exactly(fam):
    """``generate()`` on the static decode path prefills through a bucket (counted) and stays
    exact against HF's greedy output; a prompt path the adapter does not know is refused."""
    model = get_model(fam)
    ids, mask = ragged_prompts(3)
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path="static")
    before = dict(sd.adapter.prompt_graphs.counts)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert sd.adapter.prompt_graphs.counts["static"] == before["static"] + 1
    assert torch.equal(out, hf_greedy(model, ids, mask, MAX_NEW))
    ad = adapter_for(model)
    cache = ad.new_cache(3, 32, 4, sd._strategy)
    with pytest.raises(ValueError, match="prompt_path must be one of"):
        ad.prefill(ids, mask, cache, prompt_path="graph")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fam", SERVED)
def test_cuda_graph_prompts_replay_exactly(fam):
    """On CUDA (fp32 tiny models): the second prefill of a bucket replays its captured graph, and
    generate() on the CUDA-graph path equals the eager path token for token, with other prompts
    in the same bucket too."""
    model = get_model(fam).cuda()
    try:
        for seed in (0, 1, 2):
            ids, mask = ragged_prompts(3, seed=seed)
            ids, mask = ids.cuda(), mask.cuda()
            outs = {}
            for path in ("eager", "cuda_graph"):
                sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path=path)
                outs[path] = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
            assert torch.equal(outs["eager"], outs["cuda_graph"]), seed
        sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path="cuda_graph")
        for _ in range(3):
            sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
        pg = sd.adapter.prompt_graphs
        # a bucket's second use captures it (counted apart), later ones replay
        assert pg.error is None and pg.counts["captured"] >= 1, (pg.counts, pg.error)
        assert pg.counts["captured"] + pg.counts["cuda_graph"] >= 2, pg.counts
        # a bucket met once waits for its capture (pending) until its second use
        wide = torch.ones(2, 40, dtype=torch.long, device="cuda")
        key = pg.bucket(*wide.shape)
        assert key is not None and key != pg.bucket(*ids.shape)
        waiting = [k for k in pg.pending() if k[:3] == key]
        assert not waiting and not any(k[:3] == pg.bucket(*ids.shape) for k in pg.pending())
        for uses in (1, 2):
            sd.generate(wide, max_new_tokens=2, pad_token_id=0)
            waiting = [k for k in pg.pending() if k[:3] == key]
            assert len(waiting) == (uses == 1), (uses, pg.pending())
    finally:
        get_model(fam).cpu()


@pytest.mark.gpu
@needs_cuda
def test_a_failed_capture_leaves_the_captured_buckets_replaying(monkeypatch):
    """On CUDA: when one bucket's capture fails, it and buckets met later run uncaptured (at their
    bucket's shape), a bucket waiting for its capture is not captured any more, and the buckets
    captured before keep replaying their graphs; outputs stay the eager path's."""
    import specdec.graphs as graphs

    model = get_model("nemotron_h").cuda()
    try:
        ids, mask = ragged_prompts(3, seed=0)
        ids, mask = ids.cuda(), mask.cuda()
        ref = specdec.wrap(model, decode_path="eager").generate(ids, attention_mask=mask, max_new_tokens=4,
                                                                 pad_token_id=0)
        sd = specdec.wrap(model, decode_path="cuda_graph")
        pg = sd.adapter.prompt_graphs
        for _ in range(2):  # its bucket captured
            sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
        assert pg.error is None and pg.counts["captured"] == 1, pg.counts
        waiting = torch.ones(1, 9, dtype=torch.long, device="cuda")  # another bucket, met once: waiting
        sd.generate(waiting, max_new_tokens=2, pad_token_id=0)
        assert len(pg.pending()) == 1, pg.pending()
        real = graphs.capture
        wide = torch.ones(1, 40, dtype=torch.long, device="cuda")  # a third bucket: its capture fails
        B, T, _ = pg.bucket(*wide.shape)

        def failing(*args, what, **kwargs):
            if f"prompt forward of {B} x {T} tokens" in what:
                raise graphs.CaptureFailure(what, RuntimeError("simulated"))
            return real(*args, what=what, **kwargs)

        monkeypatch.setattr(graphs, "capture", failing)
        for _ in range(2):
            sd.generate(wide, max_new_tokens=2, pad_token_id=0)
        assert pg.error is not None and "simulated" in pg.error and not pg.pending()
        before = dict(pg.counts)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
        assert torch.equal(out, ref)
        assert pg.counts["cuda_graph"] == before["cuda_graph"] + 1, (before, pg.counts)  # still replayed
        sd.generate(waiting, max_new_tokens=2, pad_token_id=0)  # its second use: not captured after the failure
        assert pg.counts["captured"] == before["captured"] and pg.counts["static"] == before["static"] + 1, pg.counts
    finally:
        get_model("nemotron_h").cpu()


def test_padding_columns_of_every_row_are_left_out():
    """Prompts padded to a fixed length (columns that are padding in every row) run in the bucket
    of their longest real prompt, and leave the same logits and cache as the eager prefill."""
    from specdec.rollback import make_strategy

    model = make_model("nemotron_h").float()
    ad = adapter_for(model)
    ids, mask = ragged_prompts(3)  # longest prompt: 12 tokens
    ids = torch.cat([torch.zeros(3, 60, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(3, 60, dtype=torch.long), mask], dim=1)
    out = {}
    for path in ("eager", "static"):
        cache = ad.new_cache(3, ids.shape[1] + 4, 3, make_strategy("snapshot"))
        out[path] = ad.prefill(ids, mask, cache, prompt_path=path), cache
    assert [k[:3] for k in ad.prompt_graphs._buckets] == [(4, 32, 0)]
    (l1, h1), c1 = out["eager"]
    (l2, h2), c2 = out["static"]
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2, h1, rtol=1e-5, atol=1e-5)
    assert torch.equal(c1.pad, c2.pad) and torch.equal(c1.seq_len, c2.seq_len)
    step = l1.argmax(-1, keepdim=True)  # a decode step reads every state the prefill left
    torch.testing.assert_close(ad.forward(step, c2)[0], ad.forward(step, c1)[0], rtol=1e-5, atol=1e-5)


def test_forwards_no_bucket_holds_are_counted_eager():
    """More rows than a bucket holds, or more tokens than the caller allows: no bucket runs them
    (None) and they are counted as eager forwards."""
    ad = adapter_for(make_model("nemotron_h").float())
    graphs = PromptGraphs(ad, max_rows=2)
    ids, mask = ragged_prompts(3)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert graphs.run(ids, mask, pos, "torch", graphs=False) is None  # 3 rows -> a bucket of 4 > 2
    assert graphs.run(ids[:2], mask[:2], pos[:2], "torch", graphs=False, max_tokens=40) is None  # 2 x 32 > 40
    assert graphs.counts == {"cuda_graph": 0, "captured": 0, "static": 0, "eager": 2}
