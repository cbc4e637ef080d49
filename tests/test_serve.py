"""Serving: the controlled-acceptance oracle in continuous batching (one reference per request,
looked up by the request's index when a row takes it), per-request timing of the pool, and
``experiment=serve`` (continuous batching against fixed batches and continuous plain decoding)
at a CPU size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import record_prompt_forwards
from test_experiments import CPU, _cfg, _check_summary_matches, _records
from test_generate_batch import ROWS, _check, _reference
from tiny_models import get_model

import specdec
from specdec import zoo
from specdec.batching import Request, RequestPool, bytes_per_sequence, left_pad, plan_rows
from specdec.drafters import OracleDrafter
from specdec.experiments.app import run_experiment

K = 4


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_oracle_for_requests_is_exact_through_generate_batch(family):
    """OracleDrafter.for_requests (references: each request's prompt + plain greedy output)
    through generate_batch with more requests than rows: every request equals HF greedy on its
    prompt alone (EOS inside an accepted chain included); acceptance 1 accepts whole chains,
    0 none; the batch form (left-padded reference rows, request i = row i) works the same."""
    prompts, budgets, eos, expected, full = _reference(family)
    model = get_model(family)
    for a in (1.0, 0.6, 0.0):
        sd = specdec.wrap(model, drafter=OracleDrafter.for_requests(full, acceptance=a, seed=1), rollback="replay",
                          num_speculative_tokens=K, decode_path="eager")
        _check(sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS), expected,
               prompts)
        st = sd.last_stats
        assert st.proposed_tokens > 0
        if a == 1.0:
            assert st.accept_histogram[K] > 0 and st.acceptance_rate == 1.0
        if a == 0.0:
            assert st.accepted_tokens == 0
    ids, mask = left_pad(prompts, "cpu")
    G = max(len(f) - len(p) for f, p in zip(full, prompts))
    cont = torch.tensor([f[len(p):] + [0] * (G - len(f) + len(p)) for f, p in zip(full, prompts)])
    batch_form = OracleDrafter(torch.cat([ids, cont], 1), mask, acceptance=1.0)
    sd = specdec.wrap(model, drafter=batch_form, num_speculative_tokens=K, decode_path="static")
    _check(sd.generate_batch(prompts, max_new_tokens=budgets, eos_token_id=eos, max_batch_size=ROWS), expected,
           prompts)
    assert sd.last_stats.accept_histogram[K] > 0


def test_oracle_for_requests_schedule_counts_from_each_prompt():
    """A schedule's positions count from each request's own prompt end (its length comes with
    the request): [1, 1, 1, 1, 0] accepts new tokens 1..3 (token 0 comes from the prefill) and
    nothing after, so every request with room for a 4-draft first step accepts exactly 3."""
    prompts, budgets, _, _, full = _reference("qwen3_5")
    model = get_model("qwen3_5")
    oracle = OracleDrafter.for_requests(full, acceptance=[1.0, 1.0, 1.0, 1.0, 0.0])
    sd = specdec.wrap(model, drafter=oracle, num_speculative_tokens=K, decode_path="eager")
    out = sd.generate_batch(prompts, max_new_tokens=budgets, max_batch_size=ROWS)
    _check(out, [f[len(p):] for f, p in zip(full, prompts)], prompts)
    assert sd.last_stats.accepted_tokens == 3 * sum(b - 2 >= K for b in budgets)


def test_oracle_for_requests_measured_acceptance():
    """On a longer run (8 requests of 96 new tokens through 3 rows, no EOS) the per-draft
    acceptance measured from the accepted-length histogram (accepted drafts / drafts tried, a
    step trying drafts up to its first rejection) is the set rate, and the mean accepted tokens
    per step is 1 + sum_j a^j."""
    model = get_model("nemotron_h")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(4, 14, (8,), generator=g)]
    budget, a = 96, 0.6
    plain = specdec.wrap(model, num_speculative_tokens=0).generate_batch(prompts, max_new_tokens=budget,
                                                                         max_batch_size=ROWS)
    full = [p + plain[f"req_{i}"].generated_tokens for i, p in enumerate(prompts)]
    sd = specdec.wrap(model, drafter=OracleDrafter.for_requests(full, acceptance=a, seed=2), num_speculative_tokens=K,
                      decode_path="static")
    out = sd.generate_batch(prompts, max_new_tokens=budget, max_batch_size=ROWS)
    assert all(out[k].generated_tokens == plain[k].generated_tokens for k in plain)
    h = sd.last_stats.accept_histogram
    accepted = sum(j * n for j, n in enumerate(h))
    rejections = sum(h[:K])  # (a request's last steps, cut by its budget, count as rejections: biased low)
    assert accepted / (accepted + rejections) == pytest.approx(a, abs=0.05)
    assert sd.last_stats.mean_accepted_tokens == pytest.approx(1 + sum(a ** j for j in range(1, K + 1)), abs=0.2)


def test_oracle_for_requests_errors():
    """Bad references, a request without a reference, a reference that is not its request's,
    and a schedule in generate() (no prompt lengths there) say what is wrong."""
    model = get_model("qwen3_5")
    prompts = [[5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="non-empty list"):
        OracleDrafter.for_requests([])
    with pytest.raises(ValueError, match=r"references\[1\] is empty"):
        OracleDrafter.for_requests([[1, 2], []])
    with pytest.raises(TypeError, match=r"references\[0\] must be a list of int"):
        OracleDrafter.for_requests([[1.5, 2]])
    with pytest.raises(ValueError, match="acceptance must be in"):
        OracleDrafter.for_requests([[1, 2]], acceptance=1.2)
    cases = [([[5, 6, 7, 1]], "holds references for 1 requests .* admitted req_1"),
             ([[5, 6, 7, 1], [8, 10, 1]], "reference of req_1 does not start with its prompt")]
    for refs, match in cases:
        sd = specdec.wrap(model, drafter=OracleDrafter.for_requests(refs), num_speculative_tokens=2)
        with pytest.raises(ValueError, match=match):
            sd.generate_batch(prompts, max_new_tokens=3, max_batch_size=1)
    sd = specdec.wrap(model, drafter=OracleDrafter.for_requests([[5, 6, 7, 1]], acceptance=[1.0, 0.5]),
                      num_speculative_tokens=2)
    with pytest.raises(ValueError, match="schedule with OracleDrafter.for_requests runs in generate_batch"):
        sd.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)


def test_oracle_for_requests_in_generate():
    """In generate(), batch row i drafts reference i (a scalar acceptance): exact."""
    prompts, _, _, _, full = _reference("kimi_linear")
    model = get_model("kimi_linear")
    ids, mask = left_pad(prompts[:3], "cpu")
    plain = specdec.wrap(model, num_speculative_tokens=0).generate(ids, attention_mask=mask, max_new_tokens=6,
                                                                   pad_token_id=0)
    sd = specdec.wrap(model, drafter=OracleDrafter.for_requests(full[:3], acceptance=1.0), num_speculative_tokens=K)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0), plain)
    assert sd.last_stats.accept_histogram[K] > 0


def test_request_timings():
    """Per-request times of generate_batch: every request queued at the call's start, admitted
    (ROWS at once, req_0 among them: the first admission fills the rows), its first token after that, finished last; a later request is
    admitted only after an earlier one finished (its row freed); with one row, in input order.
    The outputs carry HF's created_time (queued) and lifespan (admitted, finished); a failed
    request has no timing."""
    prompts, budgets, eos, expected, _ = _reference("nemotron_h")
    sd = specdec.wrap(get_model("nemotron_h"), num_speculative_tokens=2)
    for rows in (ROWS, 1):
        out = sd.generate_batch(prompts + [[]], max_new_tokens=budgets + [3], eos_token_id=eos, max_batch_size=rows)
        times = sd.last_request_timings
        assert list(times) == [f"req_{i}" for i in range(len(prompts))]
        assert len({t.queued for t in times.values()}) == 1
        for key, t in times.items():
            assert t.queued <= t.admitted <= t.first_token <= t.finished
            assert t.time_to_first_token == t.first_token - t.queued
            assert (out[key].created_time, out[key].lifespan) == (t.queued, (t.admitted, t.finished))
        first = [t for t in times.values() if t.admitted == times["req_0"].admitted]
        assert len(first) == rows and min(t.admitted for t in times.values()) == first[0].admitted
        for t in [t for t in times.values() if all(t is not f for f in first)]:  # later admissions
            assert any(u.finished <= t.admitted for u in times.values() if u is not t)
        if rows == 1:
            ordered = list(times.values())
            assert all(a.finished <= b.admitted for a, b in zip(ordered, ordered[1:]))
        _check({k: out[k] for k in list(out)[:-1]}, expected, prompts)


# ------------------------------------------------------------------------------ experiment=serve

SERVE = ["experiment=serve", "model=gdn-target", "experiment.requests=5", "experiment.max_batch_size=2",
         "experiment.prompt_tokens=[16,64]", "experiment.output_tokens=[4,16]",
         "drafter.names=[ngram,oracle]", "drafter.oracle_acceptance=[1.0]"] + CPU


def test_serve_tiny_run(tmp_path: Path):
    """experiment=serve on the zoo's gdn-target (5 requests, pool of 2): continuous plain first,
    then per drafter fixed batches and continuous batching; every request of every run equals
    continuous plain decoding's; the figures are what the per-request samples give; the ratios
    are the runs' throughputs over each other's; the summary and the plot are written."""
    records = run_experiment(_cfg(SERVE), tmp_path)
    assert [(r["run"], r["drafter"], r["num_speculative_tokens"]) for r in records] == [
        ("continuous", "plain", 0), ("fixed_batches", "ngram", 4), ("continuous", "ngram", 4),
        ("fixed_batches", "oracle", 4), ("continuous", "oracle", 4)]
    plain = records[0]
    budgets_total = plain["generated_tokens"]
    assert plain["requests"] == 5 and plain["batch"] == 2 and plain["prompt_source"] == "zoo"
    for r in records:
        assert r["error"] is None and r["exact"] and r["diverged_requests"] == 0
        assert (r["first_divergence"], r["divergence_margins"], r["near_tie"]) == ([], [], None)
        assert r["generated_tokens"] == budgets_total  # ignore_eos: every request runs its own budget
        assert 16 <= r["prompt_tokens_mean"] <= r["prompt_tokens_max"] <= 64 and 4 <= r["max_new_tokens"] <= 16
        assert r["tokens_per_s"] == pytest.approx(budgets_total / r["wall_s"])
        for name in ("ttft", "tpot"):
            samples = r[f"{name}_ms_samples"]
            assert r[f"{name}_p50_ms"] <= r[f"{name}_p90_ms"] <= r[f"{name}_p99_ms"] <= max(samples)
            assert r[f"{name}_mean_ms"] == pytest.approx(sum(samples) / len(samples)) and min(samples) > 0
        assert len(r["ttft_ms_samples"]) == 5
        wait, rest = r["queue_wait_mean_ms"], r["admission_to_first_token_mean_ms"]  # the TTFT's two parts
        assert wait >= 0 and rest > 0 and wait + rest == pytest.approx(r["ttft_mean_ms"])
        assert r["queue_wait_p50_ms"] <= r["queue_wait_p99_ms"]
        assert r["vs_continuous_plain"] == (None if r is plain else
                                            pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"]))
        assert 0 < r["mean_busy_rows"] <= 2 + 1e-9
    for fixed, cont in (records[1:3], records[3:5]):
        assert cont["vs_fixed_batches"] == pytest.approx(cont["tokens_per_s"] / fixed["tokens_per_s"])
        assert fixed["vs_fixed_batches"] is None and fixed["prefix_caching"] is None
        assert cont["prefix_caching"] is False
    for oracle in records[3:5]:  # fixed batches too: each row ends at its own budget, drafting its reference
        assert oracle["mean_accepted_tokens"] > 2 and oracle["acceptance_rate"] == 1.0
    for r in records:  # every step asked for the run's fixed K
        K = r["num_speculative_tokens"]
        assert r["k_histogram"] == [0] * K + [r["steps"]] and r["mean_k"] == K
    assert (tmp_path / "serve_latency.png").stat().st_size > 1000
    _check_summary_matches((tmp_path / "summary.md").read_text(), _records(tmp_path / "results.jsonl"), {
        "tokens/s": ("tokens_per_s", "{:.1f}"), "TTFT p50 ms": ("ttft_p50_ms", "{:.1f}"),
        "TPOT p99 ms": ("tpot_p99_ms", "{:.2f}"), "exact": ("exact", None)}, ["model", "run", "drafter"])


def test_serve_records_the_k_chosen_per_step(tmp_path: Path):
    """With num_speculative_tokens=auto, a run's record counts its steps by the K they asked for
    (``k_histogram``, summed over its calls: as many steps as the run took) and their mean
    (``mean_k``), and the summary shows the mean."""
    records = run_experiment(_cfg(SERVE + ["num_speculative_tokens=auto", "drafter.names=[oracle]",
                                           "experiment.fixed_batches=false"]), tmp_path)
    plain, auto = records
    assert (auto["run"], auto["num_speculative_tokens"], plain["num_speculative_tokens"]) == ("continuous", "auto", 0)
    hist = auto["k_histogram"]
    assert sum(hist) == auto["steps"] > 0 and len(hist) > 2 and auto["exact"]
    assert auto["mean_k"] == pytest.approx(sum(k * n for k, n in enumerate(hist)) / auto["steps"])
    assert 0 < auto["mean_k"] <= len(hist) - 1
    assert plain["k_histogram"] == [plain["steps"]] and plain["mean_k"] == 0
    _check_summary_matches((tmp_path / "summary.md").read_text(), _records(tmp_path / "results.jsonl"), {
        "mean K": ("mean_k", "{:.2f}")}, ["model", "run", "drafter"])


def test_serve_prefix_caching_side_by_side(tmp_path: Path, monkeypatch):
    """A shared prefix on every prompt and prefix_caching=true: every continuous run runs again
    with the prefix cache; outputs equal plain's, the hit rate is what the prefix and the block
    size give, and the ratios are taken against the same run without caching. The warm-up also
    warms the prefix cache's forwards, of the run's block size."""
    from specdec.experiments import serve

    warm_blocks = []
    real_warm = serve._warm_prefill

    def recording_warm(sd, work, sizes, max_batch_tokens, warmed, prefix_block=None):
        warm_blocks.append(prefix_block)
        return real_warm(sd, work, sizes, max_batch_tokens, warmed, prefix_block)

    monkeypatch.setattr(serve, "_warm_prefill", recording_warm)
    cfg = _cfg(SERVE + ["experiment.shared_prefix_tokens=16", "experiment.prefix_caching=true",
                       "experiment.prefix_block_size=8"])
    records = run_experiment(cfg, tmp_path)
    assert None in warm_blocks and 8 in warm_blocks, warm_blocks
    cont = [r for r in records if r["run"] == "continuous"]
    assert all(r["error"] is None and r["exact"] is not False for r in records)
    for drafter in {r["drafter"] for r in cont}:
        pair = {r["prefix_caching"]: r for r in cont if r["drafter"] == drafter}
        assert set(pair) == {False, True}
        off, on = pair[False], pair[True]
        assert off["prefix_hit_rate"] is None and off["vs_no_prefix_cache"] is None
        assert on["prefix_hit_tokens"] > 0 and 0 < on["prefix_hit_rate"] < 1
        assert on["vs_no_prefix_cache"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
        assert on["ttft_speedup_vs_no_prefix_cache"] == pytest.approx(off["ttft_mean_ms"] / on["ttft_mean_ms"])
        # speculation's ratio over plain decoding compares runs with the same cache setting
        plain = {r["prefix_caching"]: r for r in cont if r["drafter"] == "plain"}
        for cached in (False, True) if drafter != "plain" else ():
            want = pair[cached]["tokens_per_s"] / plain[cached]["tokens_per_s"]
            assert pair[cached]["vs_continuous_plain"] == pytest.approx(want), (drafter, cached)
        assert on["vs_fixed_batches"] is None  # fixed batches run without the cache
    assert all(r["prefix_caching"] is None for r in records if r["run"] == "fixed_batches")
    assert "prefix hit rate" in (tmp_path / "summary.md").read_text()


def test_serve_says_when_the_shared_prefix_is_shorter_than_a_block(tmp_path: Path, capsys):
    """A shared prefix shorter than one cached block gives the cache nothing to reuse, and
    manager_warmup without request_rate has no manager to warm up: both said on the console (the
    run goes on, every request exact, the records saying no manager warmed up)."""
    records = run_experiment(_cfg(_serve_with("experiment.requests=2", "drafter.names=[ngram]",
                                              "experiment.shared_prefix_tokens=4", "experiment.prefix_caching=true",
                                              "experiment.prefix_block_size=8", "experiment.fixed_batches=false",
                                              "experiment.manager_warmup=true")),
                             tmp_path)
    out = capsys.readouterr().out
    assert "experiment.shared_prefix_tokens=4 is less than one cached block (experiment.prefix_block_size=8)" in out
    assert "without experiment.request_rate no manager runs" in out
    assert all(r["exact"] is not False and r["manager_warmup"] is False and "manager_warmup_s" not in r
               and r["rehearse"] is False for r in records)


def test_poisson_arrivals():
    """Arrival times: the first at 0, non-decreasing, seeded (the same for a seed, other for
    another), exponential gaps of mean 1 / rate; bad arguments raise."""
    from specdec.experiments.serve import poisson_arrivals

    a = poisson_arrivals(20000, 50.0, seed=1)
    assert a[0] == 0.0 and len(a) == 20000 and all(x <= y for x, y in zip(a, a[1:]))
    assert a == poisson_arrivals(20000, 50.0, seed=1) and a != poisson_arrivals(20000, 50.0, seed=2)
    gaps = torch.tensor(a, dtype=torch.float64).diff()
    assert float(gaps.mean()) == pytest.approx(1 / 50, rel=0.03)
    assert float(gaps.std()) == pytest.approx(1 / 50, rel=0.05)  # (an exponential's spread is its mean)
    assert poisson_arrivals(1, 3.0, seed=0) == (0.0,)
    for n, rate in ((0, 1.0), (3, 0.0), (3, float("inf"))):
        with pytest.raises(ValueError, match="poisson_arrivals needs"):
            poisson_arrivals(n, rate, seed=0)


def _serve_with(*overrides: str) -> list[str]:
    """SERVE with ``overrides`` in place of its settings of the same keys."""
    keys = {o.split("=")[0] for o in overrides}
    return [o for o in SERVE if o.split("=")[0] not in keys] + list(overrides)


def _cached_arrivals(n: int, rate: float, drafter: str, *more: str):
    """The config of ``n`` requests arriving at ``rate`` per second, sharing a 16-token prefix,
    through continuous batching with and without the prefix cache (8-token blocks), ``drafter``."""
    return _cfg(_serve_with(f"experiment.requests={n}", f"drafter.names=[{drafter}]",
                            f"experiment.request_rate={rate}", "experiment.shared_prefix_tokens=16",
                            "experiment.prefix_caching=true", "experiment.prefix_block_size=8",
                            "experiment.fixed_batches=false", *more))


def _check_arrival_runs(records, rate: float, requests: int, seed: int):
    """Every run: exact, ``request_rate`` recorded, each TTFT >= 0 and measured from its request's
    arrival (arrival + TTFT within the wall, which runs from the first arrival to the last
    finish and so covers the last arrival), throughput = tokens / that wall."""
    from specdec.experiments.serve import poisson_arrivals

    arrivals = poisson_arrivals(requests, rate, seed)
    for r in records:
        assert r["error"] is None and r["exact"] and r["request_rate"] == rate, r
        assert r["wall_s"] >= arrivals[-1]
        ttft = r["ttft_ms_samples"]
        assert len(ttft) == requests and min(ttft) >= 0
        assert all(a + t / 1e3 <= r["wall_s"] for a, t in zip(arrivals, ttft))
        assert r["queue_wait_mean_ms"] >= 0 and r["admission_to_first_token_mean_ms"] > 0
        assert r["queue_wait_mean_ms"] + r["admission_to_first_token_mean_ms"] == pytest.approx(r["ttft_mean_ms"])
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])


def test_serve_poisson_arrivals(tmp_path: Path):
    """experiment.request_rate: the requests arrive at seeded Poisson times over the run; each
    continuous run goes through init_continuous_batching, fixed batches wait for their last
    request; outputs equal plain's; every TTFT counts from its request's arrival (with 6
    requests at 4/s the run spans over a second, longer than any request's own time)."""
    rate, n = 4.0, 6
    cfg = _cfg(_serve_with(f"experiment.requests={n}", "drafter.names=[oracle]", f"experiment.request_rate={rate}",
                           "experiment.output_tokens=[4,8]"))
    records = run_experiment(cfg, tmp_path)
    assert [(r["run"], r["drafter"]) for r in records] == [
        ("continuous", "plain"), ("fixed_batches", "oracle"), ("continuous", "oracle")]
    _check_arrival_runs(records, rate, n, seed=int(cfg.seed))
    assert records[2]["mean_accepted_tokens"] > 2  # (the oracle drafted its request's reference)
    assert "Poisson arrivals at 4 requests/s" in (tmp_path / "summary.md").read_text()


def test_serve_poisson_arrivals_prefix_caching(tmp_path: Path):
    """experiment.request_rate with a shared prefix and prefix_caching: the cached runs' managers
    hit the prefix (the cache spans the requests of a run), outputs equal plain's."""
    rate, n = 50.0, 8
    cfg = _cached_arrivals(n, rate, "ngram")
    records = run_experiment(cfg, tmp_path)
    assert [(r["drafter"], r["prefix_caching"]) for r in records] == [
        ("plain", False), ("plain", True), ("ngram", False), ("ngram", True)]
    _check_arrival_runs(records, rate, n, seed=int(cfg.seed))
    for r in records:
        assert (r["prefix_hit_rate"] is not None and r["prefix_hit_rate"] > 0) == r["prefix_caching"]


def test_serve_workload(tmp_path: Path):
    """The workload: seeded, log-uniform lengths within the bounds, the shared prefix on every
    prompt, random ids or zoo prompts cut to length; a request file's prompts (ids or text) and
    budgets (drawn where a line has none); bad lines and lengths beyond the model say what is wrong."""
    from types import SimpleNamespace

    from specdec.experiments.serve import build_workload

    tok = zoo.load_tokenizer()
    exp = SimpleNamespace(requests=200, prompt_tokens=[64, 2048], output_tokens=[32, 512], prompt_source="random",
                          requests_file=None, shared_prefix_tokens=16)
    w = build_workload(exp, tok, 8192, seed=3)
    assert w == build_workload(exp, tok, 8192, seed=3) and w != build_workload(exp, tok, 8192, seed=4)
    own = [len(p) - 16 for p in w.prompts]
    assert min(own) >= 64 and max(own) <= 2048 and min(w.budgets) >= 32 and max(w.budgets) <= 512
    assert sorted(own)[100] < (64 + 2048) / 2  # log-uniform: the median is well below the midpoint
    assert all(p[:16] == w.prompts[0][:16] for p in w.prompts)
    z = build_workload(SimpleNamespace(**{**vars(exp), "prompt_source": "zoo", "requests": 3}), tok, 8192, seed=0)
    texts = "".join(p["prompt"] for p in zoo.prompts("all"))
    assert all(tok.decode(p[16:]) in texts for p in z.prompts)
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_ids": [5, 6, 7], "max_new_tokens": 9}\n\n{"prompt": "def f(x):"}\n'
                    '{"input_ids": [8, 9]}\n')
    f = build_workload(SimpleNamespace(**{**vars(exp), "requests_file": str(path), "shared_prefix_tokens": 0}),
                       tok, 8192, seed=0)
    assert f.prompts[0] == [5, 6, 7] and f.prompts[1] == list(tok("def f(x):").input_ids) and f.prompts[2] == [8, 9]
    assert f.budgets[0] == 9 and all(32 <= b <= 512 for b in f.budgets[1:]) and f.source == "file"
    for text, match in (('{"prompt_ids": []}', "line 1: \"prompt_ids\" must be a non-empty list"),
                        ('{"prompt_ids": [1], "max_new_tokens": 0}', "line 1: \"max_new_tokens\" must be an int"),
                        ('[1, 2]', "line 1: expected a JSON object"), ('{"text": "x"}', "needs \"prompt_ids\"")):
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=match):
            build_workload(SimpleNamespace(**{**vars(exp), "requests_file": str(path)}), tok, 8192, seed=0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        build_workload(exp, tok, 8192, seed=0, max_positions=1024)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):  # zoo text in a 100-token vocabulary
        build_workload(SimpleNamespace(**{**vars(exp), "prompt_source": "zoo"}), tok, 100, seed=0)
    with pytest.raises(ValueError, match="zoo's prompts have at most"):
        build_workload(SimpleNamespace(**{**vars(exp), "prompt_source": "zoo", "prompt_tokens": [64, 9000]}), tok,
                       8192, seed=0)


@pytest.mark.parametrize("override, match", [
    ("experiment.prompt_tokens=[64,32]", "experiment.prompt_tokens must be \\[min, max\\]"),
    ("experiment.max_batch_size=0", "max_batch_size must be an int >= 1 or auto"),
    ("experiment.max_batch_size=big", "max_batch_size must be an int >= 1 or auto"),
    ("experiment.memory_budget=lots", "memory_budget 'lots': give bytes as an int or a number with a unit"),
    ("num_speculative_tokens=0", "num_speculative_tokens must be >= 1 or auto"),
    ("drafter.names=[draft_model]", "experiment=serve runs the drafters ngram, oracle, mtp"),
    ("experiment.request_rate=0", "experiment.request_rate must be a number of requests per second > 0"),
])
def test_serve_bad_settings(override, match):
    with pytest.raises(ValueError, match=match):
        run_experiment(_cfg(SERVE + [override]), Path("/nonexistent"))


def test_serve_auto_pool_size(tmp_path: Path):
    """max_batch_size=auto with a memory budget: each continuous run has the rows generate_batch
    planned for its strategy (replay more than snapshot in the same budget, each as
    bytes_per_sequence gives them), its fixed batches that many requests, outputs equal plain's."""
    from specdec.experiments.serve import build_workload

    budget = "6MiB"
    cfg = _cfg(["experiment=serve", "model=gdn-target", "experiment.requests=24", "experiment.max_batch_size=auto",
                f"experiment.memory_budget={budget}", "experiment.prompt_tokens=[16,64]",
                "experiment.output_tokens=[4,16]", "drafter.names=[ngram]", "rollback.strategies=[snapshot,replay]",
                "experiment.warmup=false"] + CPU)
    records = run_experiment(cfg, tmp_path)
    assert all(r["error"] is None and r["exact"] is not False for r in records)
    cont = {r["rollback"]: r for r in records if r["run"] == "continuous" and r["drafter"] == "ngram"}
    fixed = {r["rollback"]: r for r in records if r["run"] == "fixed_batches"}
    model, tok = zoo.load("gdn-target")
    work = build_workload(cfg.experiment, tok, model.config.vocab_size, int(cfg.seed),
                          model.config.max_position_embeddings)
    span = RequestPool.span_of([Request(i, tuple(p), b) for i, (p, b) in enumerate(zip(work.prompts, work.budgets))])
    for strategy in ("snapshot", "replay"):
        want = plan_rows("auto", len(work.prompts), lambda s=strategy: bytes_per_sequence(model, s, span, 4),
                         budget).rows
        assert cont[strategy]["batch"] == fixed[strategy]["batch"] == want
        assert "MiB" in cont[strategy]["batch_size_reason"]
    assert cont["replay"]["batch"] > cont["snapshot"]["batch"]


def test_serve_auto_pool_size_with_arrivals(tmp_path: Path):
    """max_batch_size=auto with request_rate: each manager's pool is planned as generate_batch
    plans it, at most one row per request (a budget that fits more rows than there are requests),
    the reason says so; fixed batches take that many; outputs equal plain's."""
    from specdec.experiments.serve import build_workload

    budget, n = "10MiB", 4
    cfg = _cfg(["experiment=serve", "model=gdn-target", f"experiment.requests={n}", "experiment.max_batch_size=auto",
                f"experiment.memory_budget={budget}", "experiment.prompt_tokens=[16,64]",
                "experiment.output_tokens=[4,16]", "drafter.names=[ngram]", "rollback.strategies=[replay]",
                "experiment.request_rate=50", "experiment.warmup=false"] + CPU)
    model, tok = zoo.load("gdn-target")
    work = build_workload(cfg.experiment, tok, model.config.vocab_size, int(cfg.seed),
                          model.config.max_position_embeddings)
    span = RequestPool.span_of(work.requests())
    assert plan_rows("auto", None, lambda: bytes_per_sequence(model, "replay", span, 4), budget).rows > n
    records = run_experiment(cfg, tmp_path)
    assert [(r["run"], r["drafter"]) for r in records] == [
        ("continuous", "plain"), ("fixed_batches", "ngram"), ("continuous", "ngram")]
    for r in records:
        assert r["error"] is None and r["exact"] is not False and r["batch"] == n, r
    for r in (records[0], records[2]):
        assert f"capped at {n} (requests)" in r["batch_size_reason"], r["batch_size_reason"]


def test_serve_defaults_are_the_library_defaults():
    """The serve experiment's generate_batch settings default to the library's own constants (the
    config module stays import-light, so it repeats them: this keeps them one value)."""
    from specdec.batching import DEFAULT_MAX_BATCH_TOKENS
    from specdec.experiments.config import ServeExperiment
    from specdec.prefix_cache import PREFIX_BLOCK_SIZE

    exp = ServeExperiment()
    assert (exp.max_batch_tokens, exp.prefix_block_size) == (DEFAULT_MAX_BATCH_TOKENS, PREFIX_BLOCK_SIZE)


def test_warm_prefill_meets_every_prefill_group_size():
    """The serving warm-up runs one prefill forward of each row count it is given that the model
    has not met and that some prompts of the workload fit within the token bound, of the
    workload's own prompts (longer with the count); every forward a continuous run (its first
    admission and the later ones; a fixed or an auto-sized pool) or generate() on fixed batches
    then runs has a row count the warm-up met."""
    from specdec.batching import admission_rows
    from specdec.experiments.serve import _admission_sizes, _fixed_groups, _warm_prefill, build_workload

    cfg = _cfg(["experiment=serve", "model=gdn-target", "experiment.requests=30", "experiment.prompt_tokens=[16,64]",
                "experiment.output_tokens=[2,6]"] + CPU)
    model, tok = zoo.load("gdn-target")
    work = build_workload(cfg.experiment, tok, model.config.vocab_size, 0, model.config.max_position_embeddings)
    sd = specdec.wrap(model, num_speculative_tokens=0)
    calls = record_prompt_forwards(sd)
    lengths = sorted(len(p) for p in work.prompts)
    for rows in (1, 20, 64):
        calls.clear()
        warmed = set()
        _warm_prefill(sd, work, range(1, admission_rows(rows) + 1), 1000, warmed)
        assert [c[0] for c in calls] == list(range(1, admission_rows(rows) + 1)) == sorted(warmed)
        widths = [c[1] for c in calls]
        assert widths == sorted(widths) and widths[-1] == lengths[-1]
    calls.clear()
    _warm_prefill(sd, work, [2, 3, 5], 1000, warmed)  # all met already (rows=64: 1 .. 8)
    assert calls == [] and warmed == set(range(1, 9))
    _warm_prefill(sd, work, [9, 3], 1000, warmed)
    assert [c[0] for c in calls] == [9] and 9 in warmed
    # each forward within the bound: the longest prompts that fit, or (fewer fit) the shortest cut
    calls.clear()
    _warm_prefill(sd, work, [12, 30, 31], 12 * lengths[11], warmed)  # (31: more than the workload's requests)
    assert [c[0] for c in calls] == [12, 30] and warmed >= {12, 30} and 31 not in warmed
    assert calls[0][1] == lengths[11] and calls[1][1] == 12 * lengths[11] // 30
    # with a prefix cache: each group stored up to a block boundary near its middle, then continued
    calls.clear()
    cached = set()
    _warm_prefill(sd, work, [2], 1000, cached, prefix_block=4)
    fits = sorted(work.prompts, key=len)[-2:]  # the largest count gets the longest prompts that fit
    cuts = [len(p) // 2 // 4 * 4 for p in fits]
    rests = [len(p) - c for p, c in zip(fits, cuts)]
    if sd.adapter.batches_cached_prefill("auto"):  # (GDN: its cached prompts run together, left-padded)
        want = [(2, max(cuts)), (2, max(rests))]
    else:
        want = [(1, c) for c in cuts] + [(1, r) for r in rests]
    assert cached == {("cached", 2)} and calls == want
    # every forward a timed run then runs was warmed
    for B, bound, budget in ((16, 400, None), (4, 10**6, None), ("auto", 400, "6MiB")):
        warmed = set()
        _warm_prefill(sd, work, _admission_sizes(sd, work, B, bound, budget), bound, warmed)
        calls.clear()
        sd.generate_batch(work.prompts, max_new_tokens=work.budgets, max_batch_size=B, max_batch_tokens=bound,
                          **({"memory_budget": budget} if budget else {}))
        assert calls and {c[0] for c in calls} <= warmed, (B, bound, sorted({c[0] for c in calls}), sorted(warmed))
    # with prefix caching an auto pool leaves the cache's default byte bound out of the budget: the
    # prediction plans as the call does
    from specdec.experiments.serve import _pool_plan

    budget = (1 << 30) + (6 << 20)  # the default 1 GiB cache bound and 6 MiB for the pool
    sd.generate_batch(work.prompts, max_new_tokens=work.budgets, max_batch_size="auto", memory_budget=budget,
                      prefix_caching=True)
    rows = _pool_plan(sd, work, "auto", budget, True).rows
    assert rows == sd.last_stats.max_batch_size < _pool_plan(sd, work, "auto", budget, False).rows
    for B, bound in ((8, 200), (16, 400), (30, 10**6)):
        calls.clear()
        sd.max_batch_tokens = bound
        for lo in range(0, len(work.prompts), B):
            ids, mask = left_pad(work.prompts[lo:lo + B], "cpu")
            sd.generate(ids, attention_mask=mask, max_new_tokens=1, pad_token_id=0)
        assert _fixed_groups(work, B, bound) == {c[0] for c in calls}


def test_divergence_fields_locate_each_diverged_request_and_its_margin():
    """A diverged request's record gives where its tokens first leave plain decoding's and plain
    decoding's top-2 logit margin there, computed from the model over the prompt and the plain
    tokens before that position; None where one of the two ended first; near_tie is never True
    in fp32; no divergence gives empty lists (None without a reference)."""
    from specdec.experiments.serve import _divergence_fields

    model, _ = zoo.load("gdn-target")
    prompts = [[5, 17, 9, 33, 2, 71], [44, 3, 12], [8, 8, 19, 7]]
    reference = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        reference.append(out[0, len(p):].tolist())
    tokens = [list(reference[0]), list(reference[1]), list(reference[2][:3])]
    tokens[0][2] = (reference[0][2] + 1) % model.config.vocab_size  # request 0 leaves plain decoding at its token 2
    got = _divergence_fields(model, prompts, reference, tokens, [0, 2])
    with torch.no_grad():
        top = model(torch.tensor([prompts[0] + reference[0][:2]])).logits[0, -1].float().topk(2).values
    assert got["first_divergence"] == [2, 3]
    assert got["divergence_margins"][0] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert got["divergence_margins"][1] is None  # request 2 ended after 3 of plain decoding's 6 tokens
    assert got["near_tie"] is False
    assert _divergence_fields(model, prompts, reference, reference, []) == {
        "first_divergence": [], "divergence_margins": [], "near_tie": None}
    assert _divergence_fields(model, prompts, reference, reference, None)["first_divergence"] is None


def test_warm_prefill_holds_no_more_than_the_pool_would(monkeypatch):
    """The warm-up's prefill of the pool's row count must fit where the pool fits: the generator's
    kept pool and graphs are freed first, and the warm caches carry the states alone (no rollback
    store: a snapshot store doubled a 287-row cache of the Nemotron-H shape, out of memory on an
    80 GB GPU with a 40 GiB budget)."""
    from specdec.experiments.serve import _warm_prefill, build_workload
    from specdec.models.base import HybridAdapter
    from specdec.rollback.inplace import InPlaceUpdate

    cfg = _cfg(["experiment=serve", "model=gdn-target", "experiment.requests=12", "experiment.prompt_tokens=[16,32]",
                "experiment.output_tokens=[2,4]"] + CPU)
    model, tok = zoo.load("gdn-target")
    work = build_workload(cfg.experiment, tok, model.config.vocab_size, 0, model.config.max_position_embeddings)
    sd = specdec.wrap(model, num_speculative_tokens=2, rollback="snapshot")
    sd.generate_batch(work.prompts[:4], max_new_tokens=2, max_batch_size=4)
    assert sd.last_cache is not None  # the pool a next call of that shape would reuse
    made = []
    real = HybridAdapter.new_cache

    def recording(self, batch, *args, **kwargs):
        cache = real(self, batch, *args, **kwargs)
        made.append((batch, cache, sd.last_cache))
        return cache

    monkeypatch.setattr(HybridAdapter, "new_cache", recording)
    _warm_prefill(sd, work, [1, 6], 10**4, set())
    assert [m[0] for m in made] == [1, 6]
    for batch, cache, kept in made:
        assert kept is None and not sd._static  # freed before the first forward
        assert cache.ssm and all(isinstance(layer.strategy, InPlaceUpdate) for layer in cache.ssm.values())


def test_serve_rehearsal_passes_over_the_workload_untimed(tmp_path: Path, monkeypatch):
    """experiment.rehearse=true: each continuous run calls generate_batch on the whole workload
    once more, before its timed passes (the warm-up call, the rehearsal, the timed call), on the
    static path so its prompt forwards run in buckets; outputs stay exact and the records keep
    one timed pass's samples."""
    from specdec.engine import SpeculativeGenerator

    calls = []
    real = SpeculativeGenerator.generate_batch

    def counting(self, inputs, *args, **kwargs):
        calls.append(len(inputs))
        return real(self, inputs, *args, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate_batch", counting)
    records = run_experiment(_cfg(_serve_with("experiment.rehearse=true", "experiment.fixed_batches=false",
                                               "drafter.names=[ngram]", "experiment.decode_path=static")), tmp_path)
    assert [(r["run"], r["drafter"]) for r in records] == [("continuous", "plain"), ("continuous", "ngram")]
    for r in records:
        assert r["error"] is None and r["exact"] and len(r["ttft_ms_samples"]) == 5 and r["rehearse"] is True
        # the timed pass's prompt forwards: its admissions (the first requests' placeholders and
        # each admission's prompts), each in a bucket, uncaptured (no CUDA here)
        assert r["prompt_forwards_static"] >= 2 and r["prompt_forwards_cuda_graph"] == r["prompt_forwards_captured"] == 0
        assert r["prompt_forwards_eager"] == 0
    whole = [n for n in calls if n == 5]
    assert len(whole) == 4  # per run: the rehearsal and the timed pass over the 5 requests
    assert all(r["rehearsals"] == 1 for r in records)  # no bucket waits for a capture without CUDA


@pytest.mark.parametrize("settles", [True, False])
def test_serve_rehearses_until_no_bucket_waits_for_its_capture(tmp_path: Path, monkeypatch, settles):
    """experiment.rehearse=true passes over the workload again while the last pass met a prompt
    bucket it left uncaptured (a bucket met once there would be captured inside the timed pass),
    at most MAX_REHEARSALS passes; the records count them. No CUDA here, so the buckets left
    waiting are given: each whole pass of a run leaves a new one (``settles=False``), or only the
    run's first pass does."""
    from specdec.engine import SpeculativeGenerator
    from specdec.experiments.serve import MAX_REHEARSALS
    from specdec.models.prompt_graphs import PromptGraphs

    whole = []  # whole passes over the 5 requests in the current run
    real = SpeculativeGenerator.generate_batch

    def counting(self, inputs, *args, **kwargs):
        if len(inputs) < 5:  # a run's warm-up call: a new run
            whole.clear()
        out = real(self, inputs, *args, **kwargs)
        if len(inputs) == 5:
            whole.append(1)
        return out

    def pending(self):
        return {("bucket", len(whole) if not settles else min(len(whole), 1))}

    monkeypatch.setattr(SpeculativeGenerator, "generate_batch", counting)
    monkeypatch.setattr(PromptGraphs, "pending", pending)
    records = run_experiment(_cfg(_serve_with("experiment.rehearse=true", "experiment.fixed_batches=false",
                                               "drafter.names=[ngram]")), tmp_path)
    expected = 2 if settles else MAX_REHEARSALS
    assert [(r["run"], r["rehearsals"]) for r in records] == [("continuous", expected)] * 2
    assert all(r["error"] is None and r["exact"] and len(r["ttft_ms_samples"]) == 5 for r in records)


def test_serve_manager_warmup(tmp_path: Path, monkeypatch):
    """experiment.manager_warmup=true with request_rate: each pass's manager runs warmup() before
    start() (the grid, then with prefix caching the workload's first prompts); outputs stay exact;
    records say so and carry the warm-ups' prompt forwards (the static path: each at a bucket's
    shape), which the timed passes' counts leave out; the summary shows the warm-up's seconds."""
    from specdec.experiments.serve import MANAGER_WARMUP_PROMPTS
    from specdec.serving import ContinuousBatchingManager

    calls = []
    real = ContinuousBatchingManager.warmup

    def recording(self, prompts=None, **kw):
        got = real(self, prompts, **kw)
        calls.append((self.is_running(), None if prompts is None else len(prompts), self.prefix_cache is not None, got))
        return got

    monkeypatch.setattr(ContinuousBatchingManager, "warmup", recording)
    rate, n = 50.0, 4
    # (shorter prompts and budgets than the other runs': the grid a warm-up runs spans max_length's buckets)
    cfg = _cached_arrivals(n, rate, "oracle", "experiment.manager_warmup=true", "experiment.decode_path=static",
                           "experiment.prompt_tokens=[16,32]", "experiment.output_tokens=[4,8]")
    records = run_experiment(cfg, tmp_path)
    assert [(r["drafter"], r["prefix_caching"]) for r in records] == [
        ("plain", False), ("plain", True), ("oracle", False), ("oracle", True)]
    _check_arrival_runs(records, rate, n, seed=int(cfg.seed))
    # per run, one timed pass: the grid, then (with the cache) the workload's first prompts; never while running
    assert [(running, given, cached) for running, given, cached, _ in calls] == 2 * [
        (False, None, False), (False, None, True), (False, min(n, MANAGER_WARMUP_PROMPTS), True)]
    for r, run in zip(records, ([0], [1, 2], [3], [4, 5])):  # each record: its pass's warm-ups, summed
        assert r["manager_warmup"] is True and r["manager_warmup_s"] > 0
        for how in ("cuda_graph", "captured", "static", "eager"):
            want = sum(calls[i][3]["prompt_forwards"][how] for i in run)
            assert r[f"manager_warmup_prompt_forwards_{how}"] == want, (how, r["prefix_caching"])
        assert r["manager_warmup_prompt_forwards_static"] > 0 and r["manager_warmup_prompt_forwards_eager"] == 0
        # the timed pass's own: its placeholders, and each request's one or two forwards (a branch point)
        assert 0 < r["prompt_forwards_static"] <= 1 + 2 * n < r["manager_warmup_prompt_forwards_static"]
    assert "manager warm-up s" in (tmp_path / "summary.md").read_text()
