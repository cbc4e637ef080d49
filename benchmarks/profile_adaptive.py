"""Where ``num_speculative_tokens="auto"`` spends a step's time against fixed K: one batch of a
bench-shaped model with the oracle drafter, one warmed-up ``generate()`` per setting timed, then
the same call under ``cProfile`` (host: which Python functions take the time between the step's
sync and the next launch) and under ``torch.profiler`` (device: per-kernel time; compare a kernel's
time per call between the settings).

    python benchmarks/profile_adaptive.py nemotronh-4b-shape 16 0.6 3,4,auto --out profile.txt
    python benchmarks/profile_adaptive.py nemotronh-4b-shape 16 0.95 2,auto --max-speculative-tokens 2

(the second: auto held to K <= 2 where it runs K = 2 every step, so its time above the fixed K = 2
is what choosing K costs.)

    python benchmarks/profile_adaptive.py gdn-target 1 ngram 4,auto --prompts 128 --new-tokens 256

(the third: the zoo model with its n-gram drafter on the shipped prompts.)

Arguments: a ``specdec/conf/model`` name, the batch, the oracle's acceptance (or ``ngram``: the
n-gram drafter instead of the oracle), and the settings (a fixed K or ``auto``; every one with
``rollback="replay"`` and ``max_speculative_tokens`` from ``--max-speculative-tokens``, 8 by
default). Prompts are random (``--prompt-tokens``) or, with ``--prompts SET``, the first ``batch``
of a shipped prompt set encoded with the zoo's tokenizer; ``--new-tokens`` new tokens, EOS
ignored; each setting's output is checked against plain decoding first (a difference fails the
run at batch 1; at a larger batch in bf16 a row may part at a near-tie, and the head line counts
such rows). Prints a line per setting: wall ms per step, prefill included (the
median of ``--repeats`` timed calls, with their min-max); the decode loop's ms per step (wall less
prefill) split into the draft, verify and commit laps and the rest (bookkeeping laps and the
call's own work), medians; the K histogram; device time per step. A second line per setting splits one call
(medians over the timed calls): the host time outside the engine's step clock (before its first
mark and after its last), the clock's laps before the first step other than the prefill (the
strategy's choice, the policy's setup: ``calibration``; the first proposal), the prefill, the first
step, the median step, the last step (a step: the laps from one ``verify`` lap to the next), and the steps that
changed K, their time over their K's median step summed (medians over the timed calls), to find
time a call spends outside its steady steps. A third line sums the call's steps by kind: the
speculative steps, and the plain steps (K = 0) that made a shadow proposal, that came right after
one, and the others; each kind's count, mean and total ms (the count and the total: medians over
the timed calls), to find which steps hold the time the policy's measured costs do not show.
Writes the three reports per setting to ``--out``. The model is the app's (``load_app_model``:
its dtype for the device, bf16 on CUDA); on a CPU this is a smoke test.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import specdec  # noqa: E402
import specdec.engine  # noqa: E402
from specdec.clock import StepClock  # noqa: E402
from specdec import zoo  # noqa: E402
from specdec.drafters import OracleDrafter  # noqa: E402
from specdec.experiments.e2e import timing_batch  # noqa: E402
from specdec.experiments.models import load_app_model  # noqa: E402

class _KeptClock(StepClock):
    """The engine's step clock, kept: :data:`_CLOCKS` holds the last call's."""

    def __init__(self, device):
        super().__init__(device)
        _CLOCKS[:] = [self]


_CLOCKS: list[StepClock] = []

#: the kinds of step :func:`call_segments` sums apart
KINDS = ("plain", "shadow", "after shadow", "speculative")


def call_segments(clock: StepClock, wall_s: float, k_per_step: list[int] | None = None) -> dict[str, float]:
    """One call's time in ms: ``outside`` (host wall less the clock's first-to-last mark),
    ``setup`` (laps before the first ``verify`` lap, the prefill's left out: the first step's
    proposal included), ``prefill``, and the ``first``, ``median`` and ``last`` step (a step: the
    laps from one ``verify`` lap to the next, the next step's proposal included where it is made
    ahead; the last step holds a dropped step's laps);
    the clock's events must have completed. With ``k_per_step`` (the call's K of every step, as
    many as the clock's steps): ``switch_excess``, over the steps whose K differs from the step
    before's (``switches`` of them), their time less the median step at their K, summed: what
    changing K costs beyond the steps themselves (a replay fold, another graph's first replay);
    and per kind of step, ``"<kind> steps"`` (how many) and ``"<kind> ms"`` (their time summed):
    ``speculative`` (K > 0), ``shadow`` (a plain step that made a shadow proposal), ``after
    shadow`` (the plain step after one) and ``plain`` (the other plain steps); a kind that did
    not occur is left out.
    A step's segment ends with the next step's proposal where that is made ahead, so a new K's
    first proposal falls in the step before the switch, not in ``switch_excess``."""
    laps = clock.laps()
    # (a step that makes a shadow proposal laps "verify" on both sides of its "shadow" lap)
    starts = [i for i, (phase, _) in enumerate(laps) if phase == "verify" and (i == 0 or laps[i - 1][0] != "shadow")]
    if not starts:
        raise ValueError("the call ran no step")
    before = laps[:starts[0]]
    bounds = list(zip(starts, starts[1:] + [len(laps)]))
    steps = [sum(span for _, span in laps[a:b]) for a, b in bounds]
    out = {}
    if k_per_step is not None:
        if len(k_per_step) != len(steps):
            raise ValueError(f"{len(k_per_step)} K values for the clock's {len(steps)} steps")
        median_at = {k: statistics.median(t for t, j in zip(steps, k_per_step) if j == k) for k in set(k_per_step)}
        switched = [i for i in range(1, len(steps)) if k_per_step[i] != k_per_step[i - 1]]
        out = {"switches": float(len(switched)),
               "switch_excess": 1e3 * sum(steps[i] - median_at[k_per_step[i]] for i in switched)}
        shadowed = [any(phase == "shadow" for phase, _ in laps[a:b]) for a, b in bounds]
        for i, (t, k) in enumerate(zip(steps, k_per_step)):
            kind = ("speculative" if k else "shadow" if shadowed[i] else
                    "after shadow" if i and shadowed[i - 1] else "plain")
            out[f"{kind} steps"] = out.get(f"{kind} steps", 0.0) + 1
            out[f"{kind} ms"] = out.get(f"{kind} ms", 0.0) + 1e3 * t
    return {**out, "outside": 1e3 * (wall_s - sum(span for _, span in laps)),
            "setup": 1e3 * sum(span for phase, span in before if phase != "prefill"),
            "prefill": 1e3 * sum(span for phase, span in before if phase == "prefill"),
            "first": 1e3 * steps[0], "median": 1e3 * statistics.median(steps), "last": 1e3 * steps[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("acceptance", help="the oracle's acceptance in [0, 1], or ngram")
    ap.add_argument("settings", help="comma-separated: fixed K values and/or auto")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None, help="a shipped prompt set (specdec.zoo.prompts) instead of random ids")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-speculative-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="timed calls per setting (median)")
    ap.add_argument("--out", default="profile_adaptive.txt")
    args = ap.parse_args(argv)
    settings = [s if s == "auto" else int(s) for s in args.settings.split(",")]
    specdec.engine.StepClock = _KeptClock  # (the engine makes one per call)
    model, dev = load_app_model(args.model, "cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    ngram = args.acceptance == "ngram"
    if not ngram:
        try:
            acceptance = float(args.acceptance)
        except ValueError:
            ap.error(f"acceptance must be a number in [0, 1] or ngram; got {args.acceptance!r}")
    prompts, tok = ([], None) if args.prompts is None else (zoo.prompts(args.prompts), zoo.load_tokenizer())
    enc, pad = timing_batch(args.batch, None if prompts else args.prompt_tokens, prompts, tok,
                            model.config.vocab_size, dev, 0)
    kw = dict(**enc, max_new_tokens=args.new_tokens, pad_token_id=pad)
    ref = specdec.wrap(model, drafter="ngram", num_speculative_tokens=0).generate(**kw)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    report = []
    for K in settings:
        drafter = "ngram" if ngram else OracleDrafter(ref, enc["attention_mask"], acceptance=acceptance)
        sd = specdec.wrap(model, drafter=drafter, rollback="replay", num_speculative_tokens=K,
                          max_speculative_tokens=args.max_speculative_tokens)
        for _ in range(2):  # compile, capture, calibrate
            sd.generate(**kw)
        walls, phases, segments, parted = [], [], [], 0
        for _ in range(max(1, args.repeats)):
            sync()
            start = time.perf_counter()
            out = sd.generate(**kw)
            sync()
            wall, st = time.perf_counter() - start, sd.last_stats
            segments.append(call_segments(_CLOCKS[0], wall, st.k_per_step))
            walls.append(wall * 1e3 / st.steps)
            # per step, ms: the decode loop (wall - prefill), its draft / verify / commit laps, and the rest
            # (bookkeeping laps, the call's own work: the policy's, for auto)
            decode = (wall - st.prefill_s) * 1e3 / st.steps
            laps = [t * 1e3 / st.steps for t in (st.draft_s, st.verify_s, st.rollback_s)]
            phases.append([decode, *laps, decode - sum(laps)])
            parted = max(parted, int((out != ref).any(-1).sum()))
            if parted and args.batch == 1:
                raise SystemExit(f"K={K}: output differs from plain decoding")
        steps, hist = sd.last_stats.steps, sd.last_stats.k_histogram
        walls.sort()
        decode, draft, verify, commit, rest = (statistics.median(p[i] for p in phases) for i in range(5))
        host = cProfile.Profile()
        host.enable()
        sd.generate(**kw)
        host.disable()
        by_self, by_total = io.StringIO(), io.StringIO()
        pstats.Stats(host, stream=by_self).sort_stats("tottime").print_stats(30)
        pstats.Stats(host, stream=by_total).sort_stats("cumulative").print_stats(45)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            sd.generate(**kw)
        events = prof.key_averages()
        device_ms = sum(e.self_device_time_total for e in events) / 1e3 if cuda else float("nan")
        profiled_steps = sd.last_stats.steps
        head = (f"K={K} batch {args.batch} acceptance {args.acceptance}: {statistics.median(walls):.3f} ms a step "
                f"(min-max {walls[0]:.3f}-{walls[-1]:.3f} over {len(walls)} calls; prefill included, {steps} "
                f"steps; {parted} rows parted from plain decoding), decode {decode:.3f} (draft {draft:.3f}, verify {verify:.3f}, commit {commit:.3f}, "
                f"rest {rest:.3f}), K histogram {hist}; device time "
                f"{device_ms / profiled_steps:.3f} ms a step ({profiled_steps} profiled steps)")
        seg = {k: statistics.median(c.get(k, 0.0) for c in segments) for k in set().union(*segments)}
        head += ("\n   one call, ms: outside the clock {outside:.2f}, setup {setup:.2f}, prefill {prefill:.2f}, "
                 "first step {first:.3f}, median step {median:.3f}, last step {last:.3f}, "
                 "K switches {switches:.0f}, switch steps over their K's median {switch_excess:.2f}").format(**seg)
        kinds = [kind for kind in KINDS if seg.get(f"{kind} steps")]
        head += "\n   steps by kind, count x mean ms = ms: " + "; ".join(
            f"{kind} {seg[kind + ' steps']:.0f} x {seg[kind + ' ms'] / seg[kind + ' steps']:.3f} = {seg[kind + ' ms']:.2f}"
            for kind in kinds)
        print(head, flush=True)
        table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30)
        report += [f"== {head}", "-- cProfile, by own time", by_self.getvalue(), "-- cProfile, cumulative",
                   by_total.getvalue(), "-- torch.profiler", table]
        sd.release()
        del sd
    with open(args.out, "w") as f:
        f.write("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
