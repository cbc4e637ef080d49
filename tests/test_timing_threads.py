"""The timing helper (median, min-max, side by side, overlap) and the CPU thread-count chooser
(never overrides the user's count; 1 thread for small models; warns when likely slow)."""

from __future__ import annotations

import warnings

import pytest
import torch

from specdec import threads
from specdec.experiments.timing import Timing, overlaps, paired_ratio, spans_one, time_runs, time_side_by_side


def test_timing_median_spread_and_rate():
    t = Timing((0.4, 0.1, 0.2))
    assert (t.median, t.low, t.high, t.repeats) == (0.2, 0.1, 0.4, 3)
    r = t.rate(8)
    assert r.samples == pytest.approx((20.0, 80.0, 40.0)) and r.median == pytest.approx(40.0)
    assert t.fields("s") == {"s": 0.2, "s_min": 0.1, "s_max": 0.4}
    assert overlaps(Timing((1.0, 2.0)), Timing((1.9, 3.0))) and not overlaps(Timing((1.0, 2.0)), Timing((2.1, 3.0)))
    assert overlaps(Timing((1.0,)), Timing((1.0, 2.0))) is None  # one run has no spread to judge by
    with pytest.raises(ValueError):
        Timing(())


def test_side_by_side_runs_round_robin():
    calls = []
    res = time_side_by_side({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, repeats=3,
                            warmup=1)
    assert calls == ["a", "b"] * 2 + ["b", "a", "a", "b"]  # one warmup round, then 3 timed rounds, each runs both
    calls.clear()  # three functions: each starts one round
    time_side_by_side({n: (lambda n=n: calls.append(n)) for n in "abc"}, repeats=3)
    assert calls == list("abc" "bca" "cab")
    assert res["a"][1] == 1 and res["b"][1] == 2 and res["a"][0].repeats == 3
    t, out = time_runs(lambda: "x", repeats=2)
    assert out == "x" and t.repeats == 2 and all(s >= 0 for s in t.samples)
    with pytest.raises(ValueError, match="repeats"):
        time_runs(lambda: None, repeats=0)


@pytest.fixture
def clean_threads(monkeypatch):
    """torch's default count, no thread variables, the module's memory cleared; restored after."""
    before = torch.get_num_threads()
    for var in threads.THREAD_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "_set_by_us", None)
    monkeypatch.setattr(threads, "available_cpus", lambda: 4)
    torch.set_num_threads(4) if before != 4 else None
    yield
    torch.set_num_threads(before)


def _tiny():
    return torch.nn.Linear(8, 8)


def test_small_model_gets_one_thread(clean_threads, monkeypatch):
    monkeypatch.setattr(threads, "free_cpus", lambda: 4)
    choice = threads.configure_cpu_threads(_tiny())
    assert (choice.threads, choice.source) == (1, "chosen") and torch.get_num_threads() == 1
    assert choice.describe() == "CPU threads: 1 (chosen: 0.0M parameters, small model)"
    again = threads.configure_cpu_threads(_tiny())  # its own earlier choice is not the user's
    assert (again.threads, again.source) == (1, "chosen")


def test_large_model_gets_the_free_cpus(clean_threads, monkeypatch):
    monkeypatch.setattr(threads, "free_cpus", lambda: 3)
    choice = threads.configure_cpu_threads(None, num_parameters=4_000_000_000)
    assert (choice.threads, choice.source) == (3, "chosen") and "4.0B parameters" in choice.reason
    monkeypatch.setattr(threads, "free_cpus", lambda: 4)
    threads._set_by_us = None
    torch.set_num_threads(4)
    kept = threads.configure_cpu_threads(None, num_parameters=4_000_000_000)
    assert (kept.threads, kept.source) == (4, "default")


def test_the_users_count_is_never_overridden(clean_threads, monkeypatch):
    monkeypatch.setattr(threads, "free_cpus", lambda: 1)
    torch.set_num_threads(2)  # the user's own call
    with pytest.warns(UserWarning, match="likely slow"):
        choice = threads.configure_cpu_threads(_tiny())
    assert (choice.threads, choice.source) == (2, "torch.set_num_threads") and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 1 thread: no warning
        env = threads.configure_cpu_threads(_tiny())
    assert (env.threads, env.source) == (1, "OMP_NUM_THREADS")
    arg = threads.configure_cpu_threads(_tiny(), threads=3)  # an explicit argument wins over everything
    assert (arg.threads, arg.source) == (3, "argument") and torch.get_num_threads() == 3
    torch.set_num_threads(2)  # changed by the user after this module set 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    with pytest.warns(UserWarning):
        assert threads.configure_cpu_threads(_tiny()).source == "torch.set_num_threads"
    with pytest.raises(ValueError, match="threads must be >= 1"):
        threads.configure_cpu_threads(_tiny(), threads=0)


def test_not_on_cpu_changes_nothing(clean_threads):
    choice = threads.configure_cpu_threads(_tiny(), device="cuda")
    assert choice.source == "not on CPU" and torch.get_num_threads() == 4


def test_free_cpus_subtracts_the_load(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    assert threads.free_cpus() == 1
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (5.0, 0.0, 0.0))
    assert threads.free_cpus() == 1  # at least one
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    assert threads.free_cpus() == 2


def test_paired_ratio_is_round_by_round():
    fast, slow = Timing((2.0, 4.0, 3.0)), Timing((1.0, 2.5, 2.0))  # round 2 ran on a busy machine: both slower
    r = paired_ratio(fast, slow)
    assert r.samples == pytest.approx((2.0, 1.6, 1.5)) and r.median == pytest.approx(1.6)
    assert spans_one(r) is False and spans_one(Timing((0.9, 1.2))) is True and spans_one(Timing((1.1,))) is None
    assert overlaps(fast, slow)  # the figures' ranges overlap although every round told them apart
    with pytest.raises(ValueError, match="same rounds"):
        paired_ratio(Timing((1.0, 2.0)), Timing((1.0,)))


def test_app_notes_a_gpu_sized_model_on_a_cpu(clean_threads, monkeypatch, capsys):
    """The app's thread line is followed by a note where the model is GPU-sized (the bench shapes
    on a CPU take minutes a call), naming the tiny configs that run on a CPU."""
    from omegaconf import OmegaConf

    from specdec.experiments import common

    monkeypatch.setattr(threads, "free_cpus", lambda: 4)
    cfg = OmegaConf.create({"cpu_threads": None})
    common.apply_cpu_threads(cfg, _tiny(), "cpu")
    assert "takes minutes" not in capsys.readouterr().out
    monkeypatch.setattr(common, "CPU_SLOW_PARAMETERS", 64)  # (the Linear's 72 parameters count as GPU-sized)
    common.apply_cpu_threads(cfg, _tiny(), "cpu")
    out = capsys.readouterr().out
    assert "model on a CPU takes minutes a call" in out and "model=qwen35-tiny-shape" in out
