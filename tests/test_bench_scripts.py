"""Smoke tests of the scripts in benchmarks/ (thin scripts over specdec.experiments: the ncu
driver, the per-layer tree kernels, the launch-configuration sweep) in their tiny CPU modes,
through Triton's interpreter. The experiments' own smoke tests are in tests/test_experiments.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, tmp_path, code=0, **extra_env):
    """``script``'s stdout lines; with a non-zero ``code`` (the exit status it must end with), its stderr's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra_env)
    env.pop("SPECDEC_BACKEND", None)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env, check=False)
    assert res.returncode == code, f"{script} exited {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return (res.stdout if code == 0 else res.stderr).splitlines()


def _line(lines, prefix):
    hits = [x for x in lines if x.startswith(prefix)]
    assert len(hits) == 1, f"expected one line starting {prefix!r}, got {hits}\n" + "\n".join(lines[-40:])
    return hits[0]


def test_profile_step_tiny_cpu(tmp_path):
    """benchmarks/profile_step.py (the ncu driver) runs every strategy's step of each op, prints
    one bytes line per strategy, and refuses an unknown strategy by name before running any."""
    env_lines = _run("profile_step.py", "--op", "kda", "--device", "cpu", "--tiny", "--batch", "2", tmp_path=tmp_path,
                     TRITON_INTERPRET="1")
    for s in ("baseline", "snapshot", "ring", "replay", "replay_deferred"):
        assert "MB" in _line(env_lines, f"kda B=2 T=5 {s}: ")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profile_step.py"), "--device", "cpu",
                          "--tiny", "--strategies", "snapshot,rewind"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""), check=False)
    assert res.returncode != 0 and "unknown strategy 'rewind'" in res.stderr and "replay_deferred" in res.stderr
    assert "snapshot:" not in res.stdout, "a strategy ran before the unknown one was refused"


@pytest.mark.slow  # (the script's kernels are tested in test_kernels_triton.py)
def test_tree_kernels_tiny_cpu(tmp_path):
    """benchmarks/tree_kernels.py (interpreter, tiny shapes): one row per variant with the chain as 1.00x
    and the tree's ratio to it (a time: not compared here, interpreter times under load say nothing),
    and an unknown variant refused by name."""
    out = tmp_path / "tree.md"
    _run("tree_kernels.py", "--device", "cpu", "--tiny", "--batches", "1", "--ops", "gdn", "--strategies", "replay",
         "--variants", "chain,tree-16-loop", "--reps", "1", "--out", str(out), tmp_path=tmp_path, TRITON_INTERPRET="1")
    rows = [r.split("|") for r in out.read_text().splitlines() if r.startswith("| gdn ")]
    assert [(r[4].strip(), r[5].strip(), r[7].strip()) for r in rows][0] == ("chain", "5", "1.00x")
    assert (rows[1][4].strip(), rows[1][5].strip()) == ("tree-16-loop", "16") and float(rows[1][7].strip().rstrip("x")) > 0
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tree_kernels.py"), "--device", "cpu",
                          "--tiny", "--variants", "chain,tree-32"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""), check=False)
    assert res.returncode != 0 and "tree-32" in res.stderr and "tree-16-loop" in res.stderr


@pytest.mark.slow  # (the script's kernels are tested in test_kernels_triton.py)
def test_sweep_configs_option_tiny_cpu(tmp_path):
    """benchmarks/sweep_rollback_configs.py --configs sweeps the given launch configurations (here
    one-warp ones the hand-picked lists lack) for every op, one row each; a malformed entry is
    refused by name before anything runs."""
    out = tmp_path / "sweep.md"
    _run("sweep_rollback_configs.py", "--device", "cpu", "--tiny", "--ops", "gdn,mamba2", "--batches", "1",
         "--strategies", "replay", "--configs", "def;8,1,5;16,1,def", "--reps", "1", "--no-precompile",
         "--out", str(out), tmp_path=tmp_path, TRITON_INTERPRET="1")
    rows = [x.split("|")[1:5] for x in out.read_text().splitlines() if x.startswith("| gdn |") or x.startswith("| mamba2 |")]
    rows = [tuple(c.strip() for c in r) for r in rows if r[2].strip() == "replay"]
    cfgs = ["block=def warps=def prefetch=def", "block=8 warps=1 prefetch=5", "block=16 warps=1 prefetch=def"]
    assert rows[:6] == [(op, "1", "replay", c) for op in ("gdn", "mamba2") for c in cfgs]
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sweep_rollback_configs.py"), "--device",
                          "cpu", "--tiny", "--configs", "def;8,x,5"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""), check=False)
    assert res.returncode == 2 and "'8,x,5'" in res.stderr and "integers" in res.stderr


def test_simulate_adaptive_replays_the_policy(tmp_path):
    """benchmarks/simulate_adaptive.py: a fixed K at acceptance 1 commits K + 1 tokens per step, so
    its rate is exact; the step costs come from the results' fastest cells, linear between the
    measured K; the script prints one row per batch and workload from an experiment=adaptive
    results file."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("simulate_adaptive", os.path.join(ROOT, "benchmarks",
                                                                                     "simulate_adaptive.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    records = [{"batch": 4, "num_speculative_tokens": K, "rollback": r, "acceptance": a,
                "decode_ms_per_step": 2.0 + K * (0.5 if r == "ring" else 0.7), "plain_decode_ms_per_step": 1.5}
               for K in (1, 4) for r in ("ring", "replay") for a in (0.5, 1.0)]
    costs = sim.step_costs(records, 4, 4)
    assert costs == [0.0015, 0.0025, 0.003, 0.0035, 0.004]
    from specdec.adaptive import PolicySettings
    rate, ks, learned = sim.simulate(costs, 4, 1.0, 20, PolicySettings(), 3, seed=0)
    assert ks == [3] * 5 and rate == 4 * 20 / (5 * costs[3]) and learned is None
    rate0, ks, learned = sim.simulate(costs, 4, 0.0, 20, PolicySettings(), None, seed=0)
    assert rate0 <= 4 * 20 / (20 * costs[0]) + 1e-9  # nothing accepted: no faster than plain
    # it never speculated (a probe costs 67% of a plain step here): nothing observed, the prior stands
    assert set(ks) == {0} and torch.allclose(learned, torch.full((4,), PolicySettings().prior_acceptance))
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = _run("simulate_adaptive.py", str(path), "--max-new", "12", "--max-k", "4", "--seeds", "1",
                 tmp_path=tmp_path)
    rows = [x for x in lines if x.startswith("| 4 |")]
    assert [x.split("|")[2].strip() for x in rows] == ["0.5", "1", "0.9->0.1"]
    # --learned: the policy's costs from the auto record's calibration and the steps it runs
    learning = sim.Learning([0.0012, 0.0016, 0.0020, 0.0024, 0.0028], 0.0001, 0.0001, 0.0, 0.0, 0)
    rate, ks, _ = sim.simulate(costs, 4, 1.0, 40, PolicySettings(), None, seed=0, learning=learning)
    run = {K for K in ks if ks.count(K) > 1}  # (a width run twice in the call: its second step observed)
    assert run and all(learning.model.measured(sim.Learning.KEY, K) == (ks.count(K) - 1 >= 4) for K in run)
    assert learning.model.target_s(sim.Learning.KEY, ks[-1]) + learning.model.draft_s(
        sim.Learning.DRAFTER, sim.Learning.KEY, ks[-1]) == pytest.approx(costs[ks[-1]])  # (no noise: the truth)
    records.append({"batch": 4, "num_speculative_tokens": "auto", "rollback": "auto", "acceptance": 0.5,
                    "calibrated_step_ms": [1.2, 1.6, 2.0, 2.4, 2.8], "draft_ms": 0.1})
    for r in records:
        r.setdefault("draft_ms", 0.1)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = _run("simulate_adaptive.py", str(path), "--max-new", "12", "--max-k", "4", "--seeds", "1", "--learned",
                 "--excess", "0.04", tmp_path=tmp_path)
    assert len([x for x in lines if x.startswith("| 4 |")]) == 3


def test_step_attention_tiny_cpu(tmp_path):
    """benchmarks/step_attention.py times the step with the grouped step attention and with
    transformers' sdpa side by side and checks both give the same tokens (zoo tiny target, CPU)."""
    lines = _run("step_attention.py", "--tiny", "--device", "cpu", "--batch", "2", "--columns", "16", "--new", "4",
                 "--repeats", "2", tmp_path=tmp_path)
    line = _line(lines, "B=  2 L=   16:")
    assert "same tokens: True" in line and "grouped" in line and "sdpa/grouped" in line
    assert "1 grouped-query attention config(s)" in lines[0]


def test_profile_admission_cpu(tmp_path):
    """benchmarks/profile_admission.py times and profiles admissions with and without the prefix
    cache, per prefill region, on the Nemotron-H shape's 52 layers at tiny widths (CPU); the first
    tokens agree."""
    widths = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1,
              "vocab_size": 256}
    lines = _run("profile_admission.py", "--device", "cpu", "--prompts", "3", "--rows", "2", "--prefix", "8",
                 "--suffix", "3,5", "--block", "4", "--warmup", "1", "--repeats", "1", "--top", "3", "--override",
                 *[f"model.targets.0.config.{k}={v}" for k, v in widths.items()], tmp_path=tmp_path)
    assert "52 layers, hidden 32" in lines[0]
    for state in ("off", "on"):
        assert _line(lines, f"prefix cache {state}: wall ms per call")
    regions = [x.split() for x in lines if x.strip().startswith(("prefill ", "forward ", "store ", "lookup "))]
    assert {r[0] for r in regions} >= {"prefill", "forward", "store", "lookup"}
    assert all(int(r[1]) > 0 and float(r[2]) > 0 for r in regions)
    calls = [x.split() for x in lines if x.strip().startswith("generate_batch ")]
    assert [int(c[1]) for c in calls] == [1, 1]  # one profiled call per mode, counted once
    assert _line(lines, "first tokens identical with the cache on and off: True")


def test_profile_adaptive_cpu(tmp_path):
    """benchmarks/profile_adaptive.py on a tiny random-shape model (CPU, fp32): one line per
    setting (its output checked against plain decoding first), the median of --repeats calls,
    the K histogram of auto's call (held to K <= 1 by --max-speculative-tokens), and the host and
    device reports per setting in --out."""
    lines = _run("profile_adaptive.py", "qwen35-tiny-shape", "2", "0.6", "1,auto", "--prompt-tokens", "8",
                 "--new-tokens", "8", "--max-speculative-tokens", "1", "--repeats", "2", "--out", "p.txt",
                 tmp_path=tmp_path)
    fixed, auto = _line(lines, "K=1 batch 2"), _line(lines, "K=auto batch 2")
    assert "K histogram [0, " in fixed and "over 2 calls" in auto
    hist = auto.split("K histogram [")[1].split("]")[0].split(",")
    assert len(hist) == 2 and sum(int(h) for h in hist) > 0  # K = 0 and K = 1 only
    report = (tmp_path / "p.txt").read_text()
    assert report.count("-- cProfile, by own time") == 2 and report.count("-- torch.profiler") == 2
    calls = [x for x in lines if x.strip().startswith("one call, ms:")]
    assert len(calls) == 2  # one per setting
    for line in calls:
        parts = dict(p.strip().rsplit(" ", 1) for p in line.split("ms:", 1)[1].split(","))
        assert set(parts) == {"outside the clock", "setup", "prefill", "first step", "median step", "last step",
                              "K switches", "switch steps over their K's median"}
        assert float(parts["prefill"]) > 0 and float(parts["median step"]) > 0 and float(parts["outside the clock"]) >= 0
    kinds = [x.split("ms:", 1)[1] for x in lines if x.strip().startswith("steps by kind")]
    assert len(kinds) == 2
    for line in kinds:  # "kind n x mean = total" per kind; the fixed K = 1 call's 4 steps (8 tokens, 2 rows) at least
        for part in line.split(";"):
            name, n, mean, total = re.fullmatch(r"\s*([a-z ]+) (\d+) x ([\d.]+) = ([\d.]+)", part).groups()
            assert name in ("plain", "shadow", "after shadow", "speculative") and int(n) > 0
            assert float(total) == pytest.approx(int(n) * float(mean), rel=0.01, abs=0.01)
    assert kinds[0].split(";")[0].strip().startswith("speculative ")


def test_profile_adaptive_ngram_on_shipped_prompts(tmp_path):
    """benchmarks/profile_adaptive.py with the zoo model's n-gram drafter on a shipped prompt set:
    the batch-1 output checked against plain decoding (no row parted); an acceptance that is
    neither a number nor ``ngram`` is refused naming what is accepted."""
    lines = _run("profile_adaptive.py", "gdn-target", "1", "ngram", "2", "--prompts", "128", "--new-tokens", "8",
                 "--out", "p.txt", tmp_path=tmp_path)
    head = _line(lines, "K=2 batch 1 acceptance ngram")
    assert "; 0 rows parted from plain decoding)" in head and "K histogram [0, 0, " in head
    bad = _run("profile_adaptive.py", "gdn-target", "1", "often", "2", tmp_path=tmp_path, code=2)
    assert "acceptance must be a number in [0, 1] or ngram; got 'often'" in bad[-1]


def test_policy_host_cpu(tmp_path):
    """benchmarks/policy_host.py times the policy's host calls of every step and counts the
    steps per K (all of the timed ones); a high acceptance settles on a K > 0, a nil one on
    plain steps but for probes; an acceptance outside [0, 1] is refused naming the range."""
    for acceptance, speculates in (("0.9", True), ("0", False)):
        line = _line(_run("policy_host.py", "--batch", "2", "--acceptance", acceptance, "--steps", "60",
                          "--warmup", "20", tmp_path=tmp_path), "policy host time per step, batch 2")
        medians = [float(m) for m in re.findall(r"([\d.]+) us median", line)]
        assert len(medians) == 3 and all(m > 0 for m in medians)
        hist = [int(h) for h in line.split("steps per K [")[1].rstrip("]").split(",")]
        assert len(hist) == 9 and sum(hist) == 60
        assert hist[0] == 0 if speculates else hist[0] >= 48  # (at acceptance 0: plain steps, and a probe now and then)
    bad = _run("policy_host.py", "--acceptance", "1.5", tmp_path=tmp_path, code=2)
    assert "--acceptance must be in [0, 1]; got 1.5" in bad[-1]


def test_profile_adaptive_call_segments():
    """profile_adaptive.call_segments groups a call's laps into the time before its first step
    (the prefill apart) and its steps, each from one verify lap to the next (a proposal made
    ahead between them belongs to the step before)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from profile_adaptive import call_segments
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))

    class Laps:
        def laps(self):
            return [("calibration", 0.001), ("prefill", 0.010), ("calibration", 0.002), ("prefill", 0.003),
                    ("draft", 0.001), ("verify", 0.004), ("bookkeeping", 0.001), ("draft", 0.001),  # step 1: 6 ms
                    ("verify", 0.002), ("draft", 0.001),  # step 2: 3 ms (its next proposal made ahead)
                    ("verify", 0.003), ("rollback", 0.001), ("draft", 0.002), ("dropped step", 0.004)]  # 10 ms
    seg = call_segments(Laps(), wall_s=0.041)
    want = {"outside": 5.0, "setup": 4.0, "prefill": 13.0, "first": 6.0, "median": 6.0, "last": 10.0}
    assert seg == pytest.approx(want)
    # steps of 6, 3 and 10 ms at K = 1, 0, 1: both later steps switch; the 3 ms one is K = 0's
    # only step (0 over its median), the 10 ms one is 2 ms over K = 1's median of 6 and 10
    seg = call_segments(Laps(), wall_s=0.041, k_per_step=[1, 0, 1])
    assert seg["switches"] == 2 and seg["switch_excess"] == pytest.approx(2.0)
    assert seg["first"] == pytest.approx(6.0)
    assert call_segments(Laps(), wall_s=0.041, k_per_step=[2, 2, 2])["switches"] == 0
    with pytest.raises(ValueError, match="2 K values for the clock's 3 steps"):
        call_segments(Laps(), wall_s=0.041, k_per_step=[1, 1])
    # by kind: with K = 0, 0, 0 the second step is plain; with K = 1, 0, 0 and a shadow proposal
    # in the second step (its verify laps on both sides of it: one step), the third comes after it
    by_kind = call_segments(Laps(), wall_s=0.041, k_per_step=[0, 0, 0])
    assert (by_kind["plain steps"], by_kind["plain ms"]) == (3, pytest.approx(19.0))

    class Shadowed:
        def laps(self):
            laps = Laps().laps()
            return laps[:9] + [("shadow", 0.005), ("verify", 0.001)] + laps[9:]
    by_kind = call_segments(Shadowed(), wall_s=0.047, k_per_step=[1, 0, 0])
    assert by_kind["speculative steps"] == 1 and by_kind["speculative ms"] == pytest.approx(6.0)
    assert by_kind["shadow steps"] == 1 and by_kind["shadow ms"] == pytest.approx(9.0)
    assert by_kind["after shadow steps"] == 1 and by_kind["after shadow ms"] == pytest.approx(10.0)
    assert "plain steps" not in by_kind and by_kind["median"] == pytest.approx(9.0)
    with pytest.raises(ValueError, match="ran no step"):
        call_segments(type("NoSteps", (), {"laps": lambda self: [("prefill", 0.01)]})(), wall_s=0.02)


def test_fold_launch_tiny_cpu(tmp_path):
    """benchmarks/fold_launch.py on tiny layers through Triton's interpreter: one row per op,
    batch and T, a column per launch rule and one with the fold sized for the step, and the
    library's rule for the T_max asked."""
    lines = _run("fold_launch.py", "--device", "cpu", "--tiny", "--batches", "2", "--t-max", "6", "--steps", "2",
                 tmp_path=tmp_path, TRITON_INTERPRET="1")
    assert "library rule: (4, True)" in _line(lines, "# fused replay verify")
    for op in ("mamba2", "gdn"):
        cells = _line(lines, f"| {op} | 2 | 2 |").strip("|").split("|")
        assert len(cells) == 9 and all(float(c) > 0 for c in cells[3:])


def test_policy_on_zoo_charges_each_step_its_cost(tmp_path):
    """benchmarks/policy_on_zoo.py: plain decoding (K = 0) is 1.0x of itself, one step per new
    token but the first of each batch; a fixed K is charged its cost for each of its steps, and
    auto's steps by the K each ran, at batch 1 and 2; the costs come from a bench record of K
    chosen per step; bad arguments end with a message naming what is accepted."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("policy_on_zoo", os.path.join(ROOT, "benchmarks", "policy_on_zoo.py"))
    poz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(poz)
    from specdec import zoo

    costs = [1.0, 1.5, 1.6, 1.7]
    for batch in (1, 2):
        rows = poz.run(costs, "ngram", [p["prompt"] for p in zoo.prompts(limit=2)], 24, [0, 2, "auto"], batch)
        plain, two, auto = rows
        assert plain["vs_plain"] == 1.0 and plain["k_histogram"] == [plain["steps"], 0, 0, 0] == [2 * 23 // batch, 0, 0, 0]
        assert two["k_histogram"] == [0, 0, two["steps"], 0]
        assert two["vs_plain"] == pytest.approx(plain["steps"] * costs[0] / (two["steps"] * costs[2]))
        charged = sum(n * t for n, t in zip(auto["k_histogram"], costs))
        assert auto["vs_plain"] == pytest.approx(plain["steps"] * costs[0] / charged)
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"drafter": "ngram", "batch": 1, "num_speculative_tokens": "auto",
                                "predicted_step_ms": [0.3, 0.4, 0.45]}) + "\n")
    assert poz.recorded_costs(str(path), "ngram") == [0.3, 0.4, 0.45]
    with pytest.raises(ValueError, match="no batch-1 record of drafter 'mtp'"):
        poz.recorded_costs(str(path), "mtp")
    with pytest.raises(SystemExit, match=r"each K in \[0, 2\]"):
        poz.main(["--from-results", str(path), "--ks", "3"])
    with pytest.raises(SystemExit, match="no batch-16 record of drafter 'ngram'"):
        poz.main(["--from-results", str(path), "--batch", "16"])
    with pytest.raises(SystemExit, match="--ks: fixed K and/or auto"):
        poz.main(["--costs", "1,2", "--ks", "0,two"])
    with pytest.raises(SystemExit, match="--max-new: >= 2"):
        poz.main(["--costs", "1,2", "--max-new", "1"])


def test_switch_cost_times_every_flush_and_groups_the_forwards():
    """benchmarks/switch_cost.py (CPU, the static path): every flush is timed, a plain step after
    a speculative one is preceded by one (K scripted through switches both ways; the output
    equals greedy decoding), each forward after the first lands in the group of the
    step before it (a narrowing flush before a narrower step), the calibration's forwards in
    none; bad arguments end with a message."""
    import importlib.util

    from helpers import ORDER, ScriptedCosts

    spec = importlib.util.spec_from_file_location("switch_cost", os.path.join(ROOT, "benchmarks", "switch_cost.py"))
    sc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sc)
    from specdec import zoo

    assert sc._group(1, True, None) is None
    assert sc._group(1, True, (1, True)) == "plain after plain" and sc._group(1, True, (5, False)) == "plain after speculative"
    assert sc._group(5, False, (5, False)) == "speculative after the same width"
    assert sc._group(3, False, (5, False)) == "speculative after a wider step"
    assert sc._group(5, False, (3, False)) is None and sc._group(5, False, (1, True)) is None
    prompt = zoo.prompts(limit=1)[0]["prompt"]
    r = sc.measure("ngram", [prompt], 32, "cpu", "static", ScriptedCosts(ORDER))  # (K through up and down)
    switches = len(r["forward_ms"]["plain after speculative"])
    narrower = len(r["forward_ms"]["speculative after a wider step"])
    assert len(r["k_histograms"]) == 1 and sum(r["k_histograms"][0]) > 0
    assert switches >= 1 and narrower >= 1 and len(r["flush_ms"]) >= switches + narrower
    model, tok = zoo.load("gdn-target")
    ids = tok([prompt], return_tensors="pt").input_ids
    assert torch.equal(r["outputs"][0], model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0))
    assert all(t > 0 for ts in [r["flush_ms"], *r["forward_ms"].values()] for t in ts)
    assert sum(map(len, r["forward_ms"].values())) <= sum(r["k_histograms"][0])  # (no calibration's forwards)
    with pytest.raises(SystemExit, match="--prompts: >= 1"):
        sc.main(["--prompts", "0"])
