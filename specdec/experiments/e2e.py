"""End-to-end measurements shared by the rollback comparison and the benchmark.

:func:`plain_reference` runs transformers' own greedy ``generate()`` on a batch (the speed
baseline and the exactness reference: its output, and its cache's SSM states after the last
token); :func:`speculative_point` runs ``specdec.wrap(...).generate()`` on the same batch and
returns timing, :class:`specdec.Stats` and exactness (output equal token for token; every
SSM layer's committed state within ``state_tol`` relative error of HF's).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["batch_encoding", "plain_reference", "speculative_point", "PlainRun", "state_tolerance"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def batch_encoding(tok, prompts: list[dict], batch: int, device):
    """The first ``batch`` prompts (cycled when fewer), left-padded, as ``tok(...)`` returns them."""
    if not prompts:
        raise ValueError("no prompts: raise prompts.limit")
    texts = [prompts[i % len(prompts)]["prompt"] for i in range(batch)]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True).to(device)


def state_tolerance(dtype: torch.dtype) -> float:
    """Relative error below which a committed state counts as equal (DESIGN.md: fp32 < 1e-5)."""
    return 1e-5 if dtype == torch.float32 else 2e-2


@dataclass
class PlainRun:
    """HF greedy generate on one batch: output ``[B, L + new]``, seconds (median), its cache."""

    out: torch.Tensor
    seconds: float
    cache: object


def _eos_ids(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


@torch.no_grad()
def plain_reference(model, enc, max_new: int, pad: int, device, repeats: int = 1, warmup: bool = False) -> PlainRun:
    """Greedy HF generate (``do_sample=False``), timed; median of ``repeats`` runs."""
    kw = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    if warmup:
        model.generate(**enc, **{**kw, "max_new_tokens": min(4, max_new)})
    times, res = [], None
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        res = model.generate(**enc, **kw, return_dict_in_generate=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return PlainRun(out=res.sequences, seconds=statistics.median(times), cache=res.past_key_values)


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


@torch.no_grad()
def speculative_point(model, enc, *, drafter, strategy: str, K: int, max_new: int, pad: int, device, dtype,
                      plain: PlainRun, repeats: int = 1, warmup: bool = False, check_state: bool = True) -> dict:
    """Run ``specdec.wrap(model, drafter, strategy, K).generate`` on ``enc``; figures per point.

    Returns a dict: ``steps``, ``new_tokens``, ``mean_accepted_tokens``, ``acceptance_rate``,
    ``accept_histogram``, ``wall_s`` (median), ``verify_ms`` / ``commit_ms`` / ``draft_ms`` (per
    verify step, from :class:`specdec.Stats`: ``commit`` is its ``rollback_s``, the fold
    included), ``step_ms`` (verify + commit per step), ``ms_per_step`` (wall / steps),
    ``tokens_per_s``, ``plain_tokens_per_s``, ``speedup`` (plain seconds / speculative seconds),
    ``exact`` (output == HF greedy), ``state_rel_err`` / ``state_exact`` / ``state_rows``.
    """
    import specdec

    sd = specdec.wrap(model, drafter=drafter, rollback=str(strategy), num_speculative_tokens=int(K))
    if warmup:
        sd.generate(**enc, max_new_tokens=min(4, max_new), pad_token_id=pad)
    times, out, st = [], None, None
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        out = sd.generate(**enc, max_new_tokens=max_new, pad_token_id=pad)
        _sync(device)
        times.append(time.perf_counter() - t0)
        st = sd.last_stats
    wall = statistics.median(times)
    L = enc["input_ids"].shape[1]
    new = int(st.new_tokens)
    plain_new = int((plain.out[:, L:] != pad).sum()) if pad is not None else plain.out[:, L:].numel()
    steps = max(1, st.steps)
    exact = bool(out.shape == plain.out.shape and torch.equal(out, plain.out))
    err, rows = _state_error(sd, plain, L, _eos_ids(model)) if (check_state and exact) else (None, 0)
    return {
        "steps": st.steps,
        "new_tokens": new,
        "mean_accepted_tokens": st.mean_accepted_tokens,
        "acceptance_rate": st.acceptance_rate,
        "accept_histogram": list(st.accept_histogram),
        "wall_s": wall,
        "verify_ms": 1e3 * st.verify_s / steps,
        "commit_ms": 1e3 * st.rollback_s / steps,
        "draft_ms": 1e3 * st.draft_s / steps,
        "step_ms": 1e3 * (st.verify_s + st.rollback_s) / steps,
        "ms_per_step": 1e3 * wall / steps,
        "tokens_per_s": new / wall if wall > 0 else 0.0,
        "plain_tokens_per_s": plain_new / plain.seconds if plain.seconds > 0 else 0.0,
        "speedup": plain.seconds / wall if wall > 0 else 0.0,
        "exact": exact,
        "state_rel_err": err,
        "state_exact": None if err is None else bool(err < state_tolerance(dtype)),
        "state_rows": rows,
    }
