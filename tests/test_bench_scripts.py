"""Smoke tests of the GPU benchmark scripts in their tiny CPU modes: they run end to end and
print their PASS / SKIP lines (the real runs are on an H200: benchmarks/cases_gpu.py and
benchmarks/long_run.py docstrings)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, tmp_path, **extra_env):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra_env)
    env.pop("SPECDEC_BACKEND", None)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env, check=False)
    assert res.returncode == 0, f"{script} exited {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res.stdout.splitlines()


def _line(lines, prefix):
    hits = [x for x in lines if x.startswith(prefix)]
    assert len(hits) == 1, f"expected one line starting {prefix!r}, got {hits}\n" + "\n".join(lines[-40:])
    return hits[0]


def test_cases_gpu_tiny_cpu(tmp_path):
    out = tmp_path / "cases.md"
    lines = _run("cases_gpu.py", "--device", "cpu", "--tiny", "--out", str(out), tmp_path=tmp_path)
    assert _line(lines, "C6: ").startswith("C6: SKIP (needs CUDA)")
    assert "rollback time reported apart: yes" in _line(lines, "C6: ")
    assert _line(lines, "C8: ").startswith("C8: SKIP (needs CUDA)")
    assert "ms/step" in _line(lines, "C8: ")
    c9 = _line(lines, "C9: ")
    assert c9.startswith("C9: PASS"), c9
    for s in ("snapshot", "ring", "replay", "replay_deferred"):
        assert f"{s}: +" in c9
    assert _line(lines, "FP32-STATE: ").startswith("FP32-STATE: PASS")
    md = out.read_text()
    for case in ("| C6 | SKIP", "| C8 | SKIP", "| C9 | PASS", "| FP32-STATE | PASS", "## C6", "## C8", "## C9"):
        assert case in md


def test_long_run_tiny_cpu(tmp_path):
    out = tmp_path / "long_run.md"
    lines = _run("long_run.py", "--tiny", "--device", "cpu", "--out", str(out), tmp_path=tmp_path)
    for s in ("snapshot", "ring", "replay", "replay_deferred"):
        line = _line(lines, f"PASS {s}: ")
        assert "0/2 rows diverged" in line  # fp32: speculative == plain, token for token
    assert _line(lines, "FP32-STATE: ").startswith("FP32-STATE: PASS")
    assert _line(lines, "LONG-RUN: ").startswith("LONG-RUN: PASS")
    md = out.read_text()
    assert md.count("| 0/2 | none | yes | yes") == 4


def test_ngram_drafter_bench_tiny_cpu(tmp_path):
    """benchmarks/ngram_drafter.py checks both implementations propose the same before timing
    (it exits non-zero otherwise) and writes one row per (batch, width)."""
    out = tmp_path / "ngram.md"
    _run("ngram_drafter.py", "--device", "cpu", "--batches", "1,3", "--widths", "32,96", "--repeat", "2",
         "--out", str(out), tmp_path=tmp_path)
    rows = [x for x in out.read_text().splitlines() if x.startswith("| ") and x[2].isdigit()]
    assert [tuple(r.split("|")[1:3]) for r in rows] == [(" 1 ", " 32 "), (" 1 ", " 96 "), (" 3 ", " 32 "), (" 3 ", " 96 ")]


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


def test_e2e_divergence_margins():
    """benchmarks/e2e.py reports, for each diverged row, the target's top-2 margin at the first
    divergence (teacher-forced over the reference): positive, one per diverged row, none otherwise."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import e2e

    import specdec

    cpu = torch.device("cpu")
    model = e2e.zoo_model("gdn-target", cpu, torch.float32)
    ids, mask, _ = e2e.zoo_prompts(2, cpu)
    ref = specdec.wrap(model).generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    assert e2e.divergence_margins(model, ref, ref, mask, ids.shape[1]) == []
    out = ref.clone()
    P = ids.shape[1]
    out[1, P + 2] = (out[1, P + 2] + 1) % model.config.vocab_size
    assert e2e.divergence(out, ref, P) == (1, [2])
    margins = e2e.divergence_margins(model, out, ref, mask, P)
    logits = model(input_ids=ref[1:2, :P + 2], attention_mask=mask[1:2, :P + 2] if mask.shape[1] >= P + 2
                   else torch.cat([mask[1:2], mask.new_ones(1, P + 2 - mask.shape[1])], 1)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    assert len(margins) == 1 and abs(margins[0] - float(top[0] - top[1])) < 1e-3 and margins[0] >= 0


def test_tree_kernels_tiny_cpu(tmp_path):
    """benchmarks/tree_kernels.py (interpreter, tiny shapes): one row per variant with the chain as 1.00x,
    a tree of 16 nodes costing more than the 5-token chain, and an unknown variant refused by name."""
    out = tmp_path / "tree.md"
    _run("tree_kernels.py", "--device", "cpu", "--tiny", "--batches", "1", "--ops", "gdn", "--strategies", "replay",
         "--variants", "chain,tree-16-loop", "--reps", "1", "--out", str(out), tmp_path=tmp_path, TRITON_INTERPRET="1")
    rows = [r.split("|") for r in out.read_text().splitlines() if r.startswith("| gdn ")]
    assert [(r[4].strip(), r[5].strip(), r[7].strip()) for r in rows][0] == ("chain", "5", "1.00x")
    assert rows[1][4].strip() == "tree-16-loop" and float(rows[1][7].strip().rstrip("x")) > 1.0
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tree_kernels.py"), "--device", "cpu",
                          "--tiny", "--variants", "chain,tree-32"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""), check=False)
    assert res.returncode != 0 and "tree-32" in res.stderr and "tree-16-loop" in res.stderr


def test_tree_verify_profile_tiny_cpu(tmp_path):
    """benchmarks/tree_verify.py times chain and tree steps and, with --profile, adds one profiled
    verify per configuration: host ops / host ms / kernels columns and a top-ops table per row."""
    out, prof = tmp_path / "tv.md", tmp_path / "tv_profile.md"
    lines = _run("tree_verify.py", "--device", "cpu", "--tiny", "--batch", "2", "--strategies", "snapshot", "replay",
                 "--variants", "chain", "tree-16", "--steps", "1", "--warmup", "0", "--out", str(out),
                 "--profile", str(prof), tmp_path=tmp_path)
    rows = [x.split("|")[1:-1] for x in out.read_text().splitlines() if x.startswith("| snapshot") or x.startswith("| replay")]
    assert [(r[0].strip(), r[2].strip(), r[3].strip()) for r in rows] == [
        ("snapshot", "chain", "5"), ("snapshot", "tree-16", "16"), ("replay", "chain", "5"), ("replay", "tree-16", "16")]
    for r in rows:
        host_ops, host_ms, kernels, busy = (c.strip() for c in r[8:12])
        assert int(host_ops) > 50 and float(host_ms) > 0 and kernels == "0" and busy == "-"  # CPU: no GPU kernels
    assert sum("[profiled: " in x for x in lines) == 4
    text = prof.read_text()
    assert text.count("\n## ") == 4 and text.count("Self CPU time total") == 4


def test_tree_verify_static_path_tiny_cpu(tmp_path):
    """--path static times the engine's fixed-shape bucket (StaticDecoder: tree forward + path
    commit), the CUDA-graph path without the graphs; --path cuda_graph on the CPU is refused."""
    out = tmp_path / "tv.md"
    _run("tree_verify.py", "--device", "cpu", "--tiny", "--batch", "2", "--strategies", "ring", "--path", "static",
         "--variants", "chain", "tree-16", "--steps", "1", "--warmup", "1", "--out", str(out), tmp_path=tmp_path)
    text = out.read_text()
    assert "static path" in text
    rows = [x.split("|")[1:-1] for x in text.splitlines() if x.startswith("| ring")]
    assert [(r[2].strip(), int(r[3])) for r in rows] == [("chain", 5), ("tree-16", 16)]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)  # verify ms, commit ms
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tree_verify.py"), "--device", "cpu",
                          "--path", "cuda_graph"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), check=False)
    assert res.returncode == 2 and "--path cuda_graph needs --device cuda" in res.stderr


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
