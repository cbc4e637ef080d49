"""End-to-end measurements shared by the rollback comparison and the benchmark.

:func:`plain_reference` times, side by side (:func:`specdec.experiments.timing.time_side_by_side`),
specdec's own plain decoding (``num_speculative_tokens=0``: the speed baseline, and the
benchmark's reference output) and, when asked, transformers' greedy ``generate()`` (the
rollback comparison's exactness reference: its output, and its cache's SSM states after the
last token) and specdec's plain decoding under other environment settings (kernel switches
such as ``SPECDEC_SKINNY_LINEARS=0``: :func:`parse_switches`), round by round with the default's.
:func:`speculative_point` runs ``specdec.wrap(...).generate()`` on the same batch
(a new generator, or one the caller keeps across points: :func:`speculative_generator`) and
returns its timing (median and min-max of the repeats, end to end and of the decode loop
alone), :class:`specdec.Stats`, peak memory and exactness against a reference output: each
diverging row's first divergence with plain decoding's top-2 logit margin there
(:func:`divergence_margins`; in bf16 a divergence is allowed only at a near-tie: docs/design.md,
"One speculative step"), and every SSM layer's committed state against HF's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import warnings
from dataclasses import dataclass, field
from unittest import mock

import torch

from ..drafters import OracleDrafter
from .acceptance import HALF_DTYPES, NEAR_TIE_MARGIN, first_divergence
from .timing import Timing, overlaps, time_runs, time_side_by_side

__all__ = ["batch_encoding", "random_encoding", "timing_batch", "plain_reference", "parse_switches", "CALL_SWITCHES",
           "speculative_generator", "speculative_point", "PlainRun", "state_tolerance", "row_divergences",
           "divergence_margins", "release"]


def batch_encoding(tok, prompts: list[dict], batch: int, device):
    """The first ``batch`` prompts (cycled when fewer), left-padded, as ``tok(...)`` returns them."""
    if not prompts:
        raise ValueError("no prompts: raise prompts.limit")
    texts = [prompts[i % len(prompts)]["prompt"] for i in range(batch)]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True).to(device)


def random_encoding(batch: int, tokens: int, vocab_size: int, device, seed: int = 0) -> dict:
    """``{"input_ids": [batch, tokens], "attention_mask": ones}``: random ids in [10, min(vocab,
    8192)) from a CPU generator seeded with ``seed`` (speed does not depend on the text)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, min(int(vocab_size), 8192), (batch, tokens), generator=g).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def timing_batch(batch: int, prompt_tokens: int | None, prompts: list[dict], tok, vocab_size: int, device,
                 seed: int) -> tuple[dict, int]:
    """The batch a timing experiment decodes and its pad id: ``prompt_tokens`` random ids per row
    (:func:`random_encoding`, seeded ``seed + batch``; pad id 0) when given, else the first
    ``batch`` of ``prompts`` (:func:`batch_encoding`; the tokenizer's pad id)."""
    if prompt_tokens is not None:
        return random_encoding(batch, int(prompt_tokens), vocab_size, device, seed + batch), 0
    return batch_encoding(tok, prompts, batch, device), tok.pad_token_id


def state_tolerance(dtype: torch.dtype) -> float:
    """Relative error below which a committed state counts as equal (fp32: < 1e-5)."""
    return 1e-5 if dtype == torch.float32 else 2e-2


def release(device) -> None:
    """Free what went out of scope (static buffers, CUDA graphs) before the next measurement."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class PlainRun:
    """The baselines on one batch.

    Attributes:
        plain_out: specdec's plain decoding output ``[B, L + new]``.
        plain: its wall times (seconds, one per repeat).
        plain_stats: the :class:`specdec.Stats` of those timed runs, in order.
        hf_out: HF greedy ``generate()``'s output (None when HF was not run).
        hf: its wall times (None when not run). cache: its cache (for the state check).
        switched: specdec's plain decoding under each environment setting asked for, by its
            label (:func:`parse_switches`), timed round by round with the default's.
    """

    plain_out: torch.Tensor
    plain: Timing
    plain_stats: tuple
    hf_out: torch.Tensor | None = None
    hf: Timing | None = None
    cache: object = None
    switched: dict = field(default_factory=dict)

    def decode(self) -> tuple[Timing, Timing]:
        """``(decode tokens/s, decode ms per step)`` of the plain runs: new tokens / (wall -
        prefill) and (wall - prefill) / steps per repeat."""
        return _decode_timings(self.plain, self.plain_stats)


def _decode_timings(wall: Timing, stats) -> tuple[Timing, Timing]:
    decode = [max(w - st.prefill_s, 1e-12) for w, st in zip(wall.samples, stats)]
    rates = Timing(tuple(st.new_tokens / d for d, st in zip(decode, stats)))
    per_step = Timing(tuple(1e3 * d / max(1, st.steps) for d, st in zip(decode, stats)))
    return rates, per_step


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _new_tokens(out: torch.Tensor, prompt_width: int, pad: int | None, eos: list[int]) -> int:
    new = out[:, prompt_width:]
    if not eos or pad is None:  # every row ran its whole budget
        return new.numel()
    return int((new != pad).sum())


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: the environment switches specdec reads while a call runs (a capture included), which a
#: ``plain_switches`` entry can change: fusion, the merged / skinny linears, the kernels' backend,
#: the prompt forward's kernels, proposals before the sync, the step programs, debug checks
CALL_SWITCHES = ("SPECDEC_FUSE", "SPECDEC_MERGE_LINEARS", "SPECDEC_SKINNY_LINEARS", "SPECDEC_FUSED_MLPS",
                 "SPECDEC_FUSED_RESIDUALS", "SPECDEC_STEP_ATTENTION_KERNEL", "SPECDEC_PROMPT_KERNELS",
                 "SPECDEC_BACKEND",
                 "SPECDEC_OVERLAP", "SPECDEC_OVERLAP_STEPS", "SPECDEC_STEP_GRAPHS", "SPECDEC_CAPTURED_PROPOSALS",
                 "SPECDEC_COMPILED_STEPS", "SPECDEC_SHADOW_PROPOSALS",
                 "SPECDEC_DEBUG")


def parse_switches(entries) -> dict[str, dict[str, str]]:
    """``{label: {NAME: VALUE, ...}}`` for entries ``"NAME=VALUE"`` (several joined by ``,``;
    spaces around names and values dropped), e.g. ``"SPECDEC_SKINNY_LINEARS=0"`` or
    ``"SPECDEC_MERGE_LINEARS=0,SPECDEC_SKINNY_LINEARS=0"``; the label is the entry so written
    (``NAME=VALUE`` joined by ``,``). Warns (``UserWarning``) for a name outside
    :data:`CALL_SWITCHES` (specdec may not read it during a call: its run would time the default
    again) and for a setting equal to the current environment.

    Raises: ValueError for an entry that is not of that form, one that sets a name twice, or two
    entries of the same settings (naming them)."""
    out: dict[str, dict[str, str]] = {}
    seen: dict[frozenset, str] = {}
    for entry in (str(e) for e in entries):
        env = {}
        for part in entry.split(","):
            name, eq, value = part.partition("=")
            name, value = name.strip(), value.strip()
            if not eq or not _ENV_NAME.fullmatch(name):
                raise ValueError(f"a switch must be NAME=VALUE (an environment variable; several joined by ','), "
                                 f"e.g. SPECDEC_SKINNY_LINEARS=0; got {entry!r}")
            if name in env:
                raise ValueError(f"the switch {entry!r} sets {name} twice")
            env[name] = value
        label = ",".join(f"{k}={v}" for k, v in env.items())
        key = frozenset(env.items())
        if key in seen:
            raise ValueError(f"the switches {seen[key]!r} and {entry!r} are the same settings")
        seen[key] = entry
        unread = [k for k in env if k not in CALL_SWITCHES]
        if unread:
            warnings.warn(f"switch {label!r}: specdec does not read {', '.join(unread)} during a call (it reads "
                          f"{', '.join(CALL_SWITCHES)}); its run may time the default again", UserWarning, stacklevel=2)
        if all(os.environ.get(k) == v for k, v in env.items()):
            warnings.warn(f"switch {label!r} equals the current environment: it times the default again",
                          UserWarning, stacklevel=2)
        out[label] = env
    return out


@torch.no_grad()
def plain_reference(model, enc, max_new: int, pad: int, device, repeats: int = 1, warmup: bool = False,
                    hf: bool = True, hf_max_new: int | None = None, decode_path: str = "auto",
                    switches: dict[str, dict[str, str]] | None = None) -> PlainRun:
    """specdec's plain decoding (``num_speculative_tokens=0`` on ``decode_path``), when ``hf``
    HF's greedy ``generate()`` (``do_sample=False``, ``hf_max_new`` new tokens, default
    ``max_new``), and specdec's plain decoding under each of ``switches`` (label -> environment
    settings, :func:`parse_switches`; each its own generator, so its CUDA graphs are captured
    under its settings, and every call of it runs under them), timed side by side over
    ``repeats`` rounds (one untimed round first when ``warmup``: it captures the CUDA graphs of
    the timed shape)."""
    import specdec

    def plain_run(env):
        sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=0, decode_path=decode_path)
        stats = []

        def plain():
            with mock.patch.dict(os.environ, env) if env else contextlib.nullcontext():
                out = sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad)
            stats.append(sd.last_stats)
            return out

        return sd, stats, plain

    sd, stats, plain = plain_run({})
    fns = {"plain": plain}
    others = {label: plain_run(env) for label, env in (switches or {}).items()}
    fns.update({f"switch {label}": fn for label, (_, _, fn) in others.items()})
    if hf:
        n = max_new if hf_max_new is None else int(hf_max_new)
        fns["hf"] = lambda: model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                                           return_dict_in_generate=True)
    res = time_side_by_side(fns, max(1, repeats), device, warmup=int(bool(warmup)))
    sd.release()
    run = PlainRun(plain_out=res["plain"][1], plain=res["plain"][0], plain_stats=tuple(stats[-max(1, repeats):]))
    for label, (sd_s, stats_s, _) in others.items():
        sd_s.release()
        wall, out = res[f"switch {label}"]
        run.switched[label] = PlainRun(plain_out=out, plain=wall, plain_stats=tuple(stats_s[-max(1, repeats):]))
    if hf:
        run.hf, hf_res = res["hf"]
        run.hf_out, run.cache = hf_res.sequences, hf_res.past_key_values
    release(device)
    return run


def _state_error(sd, plain: PlainRun, prompt_len: int, eos: list[int]) -> tuple[float | None, int]:
    """Max relative error over SSM layers between specdec's committed state and HF's, over the
    rows that ran to the end (a row that stopped at EOS was padded on by HF). Returns (err, rows)."""
    cache = getattr(sd, "last_cache", None)
    if cache is None or plain.cache is None or plain.hf_out is None:
        return None, 0
    gen = plain.hf_out[:, prompt_len:-1]
    rows = torch.ones(gen.shape[0], dtype=torch.bool, device=gen.device)
    for e in eos:
        rows &= ~(gen == e).any(dim=1)
    if not bool(rows.any()):
        return None, 0
    worst = 0.0
    for idx, layer in cache.ssm.items():
        try:
            ref = plain.cache.layers[idx].recurrent_states[0]
        except (AttributeError, IndexError, KeyError, TypeError):
            return None, 0
        got = layer.ssm_state()
        ref = ref.float().reshape(got.shape)[rows].double()
        got = got[rows].double()
        worst = max(worst, float((got - ref).norm() / ref.norm().clamp(min=1e-30)))
    return worst, int(rows.sum())


def row_divergences(out: torch.Tensor, reference: torch.Tensor, prompt_width: int) -> tuple[list[int], list[int]]:
    """``(rows, positions)``: the rows of ``out [B, L1]`` that differ from ``reference [B, L2]``
    (both with the ``prompt_width`` prompt columns) and, for each, the new-token position of the
    first difference (a row ending early differs where it ends)."""
    rows, positions = [], []
    for r in range(out.shape[0]):
        pos = first_divergence(out[r:r + 1], reference[r:r + 1])
        if pos is not None:
            rows.append(r)
            positions.append(pos - prompt_width)
    return rows, positions


@torch.no_grad()
def divergence_margins(model, reference: torch.Tensor, attention_mask: torch.Tensor, rows: list[int],
                       positions: list[int], prompt_width: int) -> list[float | None]:
    """Plain decoding's top-2 logit margin at each diverging row's first divergence: one
    teacher-forced forward of ``model`` over the row's prompt and ``reference`` text before that
    position (the same prefix plain decoding saw; a recomputation, so in bf16 it may round
    differently from the decode step itself). None where the reference had already ended.

    Args:
        reference: ``[B, prompt_width + G]`` plain output. attention_mask: ``[B, prompt_width]``.
        rows, positions: from :func:`row_divergences`.
    """
    margins: list[float | None] = []
    for r, pos in zip(rows, positions):
        end = prompt_width + pos
        if end >= reference.shape[1]:
            margins.append(None)
            continue
        mask = torch.cat([attention_mask[r:r + 1], attention_mask.new_ones(1, pos)], dim=1)
        logits = model(input_ids=reference[r:r + 1, :end], attention_mask=mask).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        margins.append(round(float(top[0] - top[1]), 4))
    return margins


def _per_step(values: list[float], steps: list[int]) -> tuple[float, float, float]:
    """Median, min and max over repeats of ``values[i] / steps[i]``, in milliseconds."""
    ms = [1e3 * v / max(1, n) for v, n in zip(values, steps)]
    return statistics.median(ms), min(ms), max(ms)


def speculative_generator(model, *, drafter, strategy: str, K: int | str, decode_path: str = "auto",
                          max_speculative_tokens: int = 8):
    """``specdec.wrap(model, drafter, rollback=strategy, num_speculative_tokens=K, decode_path,
    max_speculative_tokens)``: the generator :func:`speculative_point` runs. ``strategy`` / ``K``
    may be ``"auto"`` (K up to ``max_speculative_tokens``)."""
    import specdec

    return specdec.wrap(model, drafter=drafter, rollback=str(strategy),
                        num_speculative_tokens=K if K == "auto" else int(K),
                        decode_path=decode_path, max_speculative_tokens=max_speculative_tokens)


@torch.no_grad()
def speculative_point(model, enc, *, drafter, strategy: str, K: int | str, max_new: int, pad: int, device, dtype,
                      plain: PlainRun, reference: torch.Tensor, repeats: int = 1, warmup: bool = False,
                      check_state: bool = True, decode_path: str = "auto", max_speculative_tokens: int = 8,
                      sd=None) -> dict:
    """Run ``specdec.wrap(model, drafter, strategy, K, decode_path).generate`` on ``enc`` ``repeats`` times
    (after one untimed call of the same shape when ``warmup``: it compiles, captures and, for
    ``"auto"``, measures the step costs). ``strategy`` / ``K`` may be ``"auto"`` (K up to
    ``max_speculative_tokens``).

    ``sd``: a generator the caller keeps across points instead of a new one (made by
    :func:`speculative_generator` with the same ``strategy``, ``K``, ``decode_path`` and
    ``max_speculative_tokens``): ``drafter`` is assigned to it, which keeps its static decoder
    and CUDA graphs (once it has run this shape, a ``warmup`` compiles and captures nothing; with
    ``"auto"`` it still measures the new drafter's proposal times and chooses the strategy
    again, as for a new generator), and the caller releases it. Without ``sd`` the new generator
    is released before returning.

    An :class:`~specdec.drafters.OracleDrafter` draws its corruptions from ``seed + i`` in the
    i-th timed call (the warm-up's and the first from ``seed``; its ``seed`` is put back after):
    the repeats sample the acceptance's randomness, not only the timing's, and every point's
    i-th call has the same draws (the end of a fixed batch is its slowest row's, so one draw
    per point would make the best of several points a maximum over draws).

    Returns a dict: ``steps``, ``new_tokens``, ``mean_accepted_tokens``, ``acceptance_rate``,
    ``accept_histogram`` (of the last run); ``wall_s``, ``tokens_per_s`` (end to end),
    ``decode_tokens_per_s`` (new tokens / (wall - prefill)), ``plain_tokens_per_s``,
    ``plain_decode_tokens_per_s``, ``hf_tokens_per_s`` (when HF ran): each the median of the
    repeats with ``<name>_min`` / ``<name>_max``; ``speedup`` / ``decode_speedup`` (median /
    plain's median), ``hf_speedup``, ``within_noise`` (the wall-time ranges of speculative and
    plain overlap); per verify step ``verify_ms`` / ``commit_ms`` / ``draft_ms`` (from
    :class:`specdec.Stats`; ``commit`` is its ``rollback_s``, the fold included), ``step_ms``
    (verify + commit), ``ms_per_step`` (wall / steps), ``decode_ms_per_step`` and
    ``plain_decode_ms_per_step`` ((wall - prefill) / steps), with min-max; the plain steps'
    ``plain_draft_ms`` / ``plain_verify_ms`` / ``plain_commit_ms`` the same way (their draft is
    the loop's own work before the forward: no drafter runs); ``draft_share``,
    ``verify_share``, ``rollback_share`` of the decode steps' time; ``decode_path``,
    ``capture_error``, ``draft_path`` / ``draft_error`` (:class:`specdec.Stats`), ``prefill_s``, ``peak_gib`` (CUDA); ``exact`` (output == ``reference``
    token for token), ``diverged_rows``, ``diverged_row_ids``, ``first_divergence`` (new-token
    positions), ``divergence_margins`` (:func:`divergence_margins`), ``near_tie`` (every margin <
    0.25 in bf16/fp16; None without divergences); ``state_rel_err`` / ``state_exact`` /
    ``state_rows`` (committed SSM states vs HF's, when ``check_state`` and HF ran at ``max_new``);
    ``k_histogram`` (steps per K), ``rollback_used`` (the strategy that ran) and
    ``calibration_s`` (median; the cost measurements of ``"auto"``); with ``K="auto"`` also
    ``k_per_step`` (the last run's K of every step) and ``predicted_tokens_per_s`` /
    ``measured_tokens_per_s`` (the policy's, median), the last run's ``predicted_step_ms`` /
    ``measured_step_ms`` / ``calibrated_step_ms`` / ``expected_tokens`` per K, ``leave_ms`` and ``catch_up_ms`` (:class:`specdec.Stats`'
    ``predicted_step_s`` / ``measured_step_s`` / ``calibrated_step_s`` / ``expected_tokens`` / ``leave_s`` /
    ``catch_up_s``)
    and ``speculation_gain_per_step`` with its median ``speculation_gain``; with
    ``strategy="auto"`` ``rollback_reason``.
    """
    own = sd is None
    if own:
        sd = speculative_generator(model, drafter=drafter, strategy=strategy, K=K, decode_path=decode_path,
                                   max_speculative_tokens=max_speculative_tokens)
    elif sd.drafter is not drafter:
        sd.drafter = drafter
    stats = []
    oracle = drafter if isinstance(drafter, OracleDrafter) else None
    base_seed = None if oracle is None else oracle.seed

    def once():
        if oracle is not None:  # each timed call draws its own corruptions: the same draws for every
            oracle.seed = base_seed + len(stats)  # point's i-th call, so points compare over the same draws
        out = sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad)
        stats.append(sd.last_stats)
        return out

    if warmup:
        once()
        stats.clear()
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        wall, out = time_runs(once, max(1, repeats), device)
    finally:
        if oracle is not None:
            oracle.seed = base_seed
    st = stats[-1]
    L = enc["input_ids"].shape[1]
    new = int(st.new_tokens)
    steps = [s.steps for s in stats]
    rows, positions = row_divergences(out, reference, L)
    margins = divergence_margins(model, reference, enc["attention_mask"], rows, positions, L) if rows else []
    exact = not rows and out.shape == reference.shape
    err, state_rows = (None, 0)
    if check_state and exact and plain.hf_out is not None and plain.hf_out.shape == out.shape:
        err, state_rows = _state_error(sd, plain, L, _eos_ids(model))
    decode_rate, decode_ms = _decode_timings(wall, stats)
    phases = [sum(getattr(s, k) for s in stats) for k in ("draft_s", "verify_s", "rollback_s")]
    total = sum(phases)
    rec = {
        "steps": st.steps,
        "new_tokens": new,
        "mean_accepted_tokens": st.mean_accepted_tokens,
        "acceptance_rate": st.acceptance_rate,
        "accept_histogram": list(st.accept_histogram),
        **wall.fields("wall_s"),
        **wall.rate(new).fields("tokens_per_s"),
        **decode_rate.fields("decode_tokens_per_s"),
        **decode_ms.fields("decode_ms_per_step"),
        "draft_share": phases[0] / total if total else None,
        "verify_share": phases[1] / total if total else None,
        "rollback_share": phases[2] / total if total else None,
        "decode_path": st.decode_path,
        "capture_error": st.capture_error,
        "draft_path": st.draft_path,
        "draft_error": st.draft_error,
        "prefill_s": Timing(tuple(s.prefill_s for s in stats)).median,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "exact": exact,
        "diverged_rows": len(rows),
        "diverged_row_ids": rows,
        "first_divergence": positions,
        "divergence_margins": margins,
        "near_tie": (all(m is not None and m < NEAR_TIE_MARGIN for m in margins) and dtype in HALF_DTYPES
                     if rows else None),
        "state_rel_err": err,
        "state_exact": None if err is None else bool(err < state_tolerance(dtype)),
        "state_rows": state_rows,
        "k_histogram": list(st.k_histogram),
        "rollback_used": st.rollback,
        "calibration_s": Timing(tuple(s.calibration_s for s in stats)).median,
    }
    if K == "auto":
        rec["k_per_step"] = list(st.k_per_step)
        for name in ("predicted_tokens_per_s", "measured_tokens_per_s"):
            rec[name] = Timing(tuple(getattr(s, name) or 0.0 for s in stats)).median
        rec["predicted_step_ms"] = [t * 1e3 for t in st.predicted_step_s]
        rec["measured_step_ms"] = [None if t is None else t * 1e3 for t in st.measured_step_s]
        rec["calibrated_step_ms"] = [None if t is None else t * 1e3 for t in st.calibrated_step_s]
        rec["expected_tokens"] = list(st.expected_tokens)
        rec["leave_ms"] = None if st.leave_s is None else st.leave_s * 1e3
        rec["catch_up_ms"] = None if st.catch_up_s is None else st.catch_up_s * 1e3
        rec["speculation_gain_per_step"] = list(st.speculation_gain_per_step)
        rec["speculation_gain"] = (statistics.median(st.speculation_gain_per_step)
                                   if st.speculation_gain_per_step else None)
    if strategy == "auto":
        rec["rollback_reason"] = st.rollback_reason
    for name, values in (("verify_ms", [s.verify_s for s in stats]), ("commit_ms", [s.rollback_s for s in stats]),
                         ("draft_ms", [s.draft_s for s in stats]),
                         ("step_ms", [s.verify_s + s.rollback_s for s in stats]), ("ms_per_step", list(wall.samples))):
        rec[name], rec[f"{name}_min"], rec[f"{name}_max"] = _per_step(values, steps)
    plain_steps = [s.steps for s in plain.plain_stats]
    for name, attr in (("plain_draft_ms", "draft_s"), ("plain_verify_ms", "verify_s"), ("plain_commit_ms", "rollback_s")):
        rec[name], rec[f"{name}_min"], rec[f"{name}_max"] = _per_step([getattr(s, attr) for s in plain.plain_stats],
                                                                      plain_steps)
    plain_rate, plain_ms = plain.decode()
    rec.update(plain.plain.rate(new).fields("plain_tokens_per_s"))
    rec.update(plain_rate.fields("plain_decode_tokens_per_s"))
    rec.update(plain_ms.fields("plain_decode_ms_per_step"))
    rec["speedup"] = rec["tokens_per_s"] / rec["plain_tokens_per_s"] if rec["plain_tokens_per_s"] > 0 else 0.0
    rec["decode_speedup"] = (rec["decode_tokens_per_s"] / rec["plain_decode_tokens_per_s"]
                             if rec["plain_decode_tokens_per_s"] > 0 else 0.0)
    rec["within_noise"] = overlaps(wall, plain.plain)
    rec["hf_speedup"] = None
    if plain.hf is not None:
        rec.update(plain.hf.rate(_new_tokens(plain.hf_out, L, pad, _eos_ids(model))).fields("hf_tokens_per_s"))
        rec["hf_speedup"] = rec["tokens_per_s"] / rec["hf_tokens_per_s"] if rec["hf_tokens_per_s"] > 0 else 0.0
    if own:
        sd.release()
        release(device)
    return rec
