"""End-to-end measurements shared by the rollback comparison and the benchmark.

:func:`plain_reference` times, side by side (:func:`specdec.experiments.timing.time_side_by_side`),
transformers' own greedy ``generate()`` on a batch (the exactness reference: its output, and
its cache's SSM states after the last token) and specdec's own plain decoding
(``num_speculative_tokens=0``, the speed baseline); :func:`speculative_point` runs
``specdec.wrap(...).generate()`` on the same batch and returns its timing (median and min-max
of the repeats), :class:`specdec.Stats` and exactness (output equal token for token; every
SSM layer's committed state within ``state_tol`` relative error of HF's).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from .timing import Timing, overlaps, time_runs, time_side_by_side

__all__ = ["batch_encoding", "plain_reference", "speculative_point", "PlainRun", "state_tolerance"]


def batch_encoding(tok, prompts: list[dict], batch: int, device):
    """The first ``batch`` prompts (cycled when fewer), left-padded, as ``tok(...)`` returns them."""
    if not prompts:
        raise ValueError("no prompts: raise prompts.limit")
    texts = [prompts[i % len(prompts)]["prompt"] for i in range(batch)]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True).to(device)


def state_tolerance(dtype: torch.dtype) -> float:
    """Relative error below which a committed state counts as equal (fp32: < 1e-5)."""
    return 1e-5 if dtype == torch.float32 else 2e-2


@dataclass
class PlainRun:
    """The baselines on one batch: HF greedy ``generate()``'s output ``[B, L + new]``, its cache
    and wall times (``hf``, seconds), and specdec's plain decoding wall times (``plain``,
    seconds; None when not measured)."""

    out: torch.Tensor
    hf: Timing
    cache: object
    plain: Timing | None = None

    @property
    def seconds(self) -> float:
        """HF generate()'s median wall time."""
        return self.hf.median


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


@torch.no_grad()
def plain_reference(model, enc, max_new: int, pad: int, device, repeats: int = 1, warmup: bool = False,
                    specdec_plain: bool = True) -> PlainRun:
    """Greedy HF generate (``do_sample=False``) and, when ``specdec_plain``, specdec's plain
    decoding (``num_speculative_tokens=0``), timed side by side over ``repeats`` rounds (one
    untimed round first when ``warmup``)."""
    import specdec

    kw = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    fns = {"hf": lambda: model.generate(**enc, **kw, return_dict_in_generate=True)}
    if specdec_plain:
        sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=0)
        fns["plain"] = lambda: sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad)
    res = time_side_by_side(fns, max(1, repeats), device, warmup=int(bool(warmup)))
    hf_t, hf_res = res["hf"]
    return PlainRun(out=hf_res.sequences, hf=hf_t, cache=hf_res.past_key_values,
                    plain=res["plain"][0] if specdec_plain else None)


def _state_error(sd, plain: PlainRun, prompt_len: int, eos: list[int]) -> tuple[float | None, int]:
    """Max relative error over SSM layers between specdec's committed state and HF's, over the
    rows that ran to the end (a row that stopped at EOS was padded on by HF). Returns (err, rows)."""
    cache = getattr(sd, "last_cache", None)
    if cache is None or plain.cache is None:
        return None, 0
    gen = plain.out[:, prompt_len:-1]
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


def _per_step(values: list[float], steps: list[int]) -> tuple[float, float, float]:
    """Median, min and max over repeats of ``values[i] / steps[i]``, in milliseconds."""
    ms = [1e3 * v / max(1, n) for v, n in zip(values, steps)]
    return statistics.median(ms), min(ms), max(ms)


@torch.no_grad()
def speculative_point(model, enc, *, drafter, strategy: str, K: int, max_new: int, pad: int, device, dtype,
                      plain: PlainRun, repeats: int = 1, warmup: bool = False, check_state: bool = True) -> dict:
    """Run ``specdec.wrap(model, drafter, strategy, K).generate`` on ``enc`` ``repeats`` times.

    Returns a dict: ``steps``, ``new_tokens``, ``mean_accepted_tokens``, ``acceptance_rate``,
    ``accept_histogram`` (of the last run), ``wall_s``; ``verify_ms`` / ``commit_ms`` /
    ``draft_ms`` (per verify step, from :class:`specdec.Stats`: ``commit`` is its
    ``rollback_s``, the fold included), ``step_ms`` (verify + commit per step), ``ms_per_step``
    (wall / steps), ``tokens_per_s``, ``plain_tokens_per_s`` (specdec's plain decoding, when
    ``plain.plain`` was measured), ``hf_tokens_per_s``: each the median of the repeats, with
    ``<name>_min`` / ``<name>_max``; ``speedup`` (median tokens/s / median plain tokens/s;
    None without a plain timing), ``hf_speedup`` (/ median HF tokens/s), ``within_noise``
    (the wall-time ranges overlap), ``exact`` (output == HF greedy), ``state_rel_err`` /
    ``state_exact`` / ``state_rows``.
    """
    import specdec

    sd = specdec.wrap(model, drafter=drafter, rollback=str(strategy), num_speculative_tokens=int(K))
    stats = []

    def once():
        out = sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad)
        stats.append(sd.last_stats)
        return out

    if warmup:
        sd.generate(**enc, max_new_tokens=min(4, max_new), pad_token_id=pad)
    wall, out = time_runs(once, max(1, repeats), device)
    st = stats[-1]
    L = enc["input_ids"].shape[1]
    new = int(st.new_tokens)
    plain_new = int((plain.out[:, L:] != pad).sum()) if pad is not None else plain.out[:, L:].numel()
    steps = [s.steps for s in stats]
    exact = bool(out.shape == plain.out.shape and torch.equal(out, plain.out))
    err, rows = _state_error(sd, plain, L, _eos_ids(model)) if (check_state and exact) else (None, 0)
    rec = {
        "steps": st.steps,
        "new_tokens": new,
        "mean_accepted_tokens": st.mean_accepted_tokens,
        "acceptance_rate": st.acceptance_rate,
        "accept_histogram": list(st.accept_histogram),
        **wall.fields("wall_s"),
        **wall.rate(new).fields("tokens_per_s"),
        **plain.hf.rate(plain_new).fields("hf_tokens_per_s"),
        "hf_speedup": None,
        "speedup": None,
        "within_noise": None,
        "exact": exact,
        "state_rel_err": err,
        "state_exact": None if err is None else bool(err < state_tolerance(dtype)),
        "state_rows": rows,
    }
    hf_rate = rec["hf_tokens_per_s"]
    rec["hf_speedup"] = rec["tokens_per_s"] / hf_rate if hf_rate > 0 else 0.0
    for name, values in (("verify_ms", [s.verify_s for s in stats]), ("commit_ms", [s.rollback_s for s in stats]),
                         ("draft_ms", [s.draft_s for s in stats]),
                         ("step_ms", [s.verify_s + s.rollback_s for s in stats]), ("ms_per_step", list(wall.samples))):
        rec[name], rec[f"{name}_min"], rec[f"{name}_max"] = _per_step(values, steps)
    if plain.plain is not None:
        rec.update(plain.plain.rate(new).fields("plain_tokens_per_s"))
        rate = rec["plain_tokens_per_s"]
        rec["speedup"] = rec["tokens_per_s"] / rate if rate > 0 else 0.0
        rec["within_noise"] = overlaps(wall, plain.plain)
    return rec
