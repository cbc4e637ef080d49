"""Checks of what the engine promises on a GPU (``experiment=checks``), each ending in a verdict.

One model (default ``qwen35-4b-shape``, random bf16 weights, damped; ``model.targets.0.layers=8``
keeps 6 GDN + 2 attention layers), K = ``num_speculative_tokens``, the oracle drafter
(:class:`specdec.drafters.OracleDrafter` at per-token acceptance ``experiment.acceptance``),
each strategy of ``rollback.strategies``, on ``experiment.decode_path`` (``auto``: the CUDA-graph
path on CUDA; on the CPU the static path, its bookkeeping without graphs). The checks
(``experiment.checks``):

* ``rollback_on_device``: after a batch-4 run, every tensor the cache holds (KV, conv windows,
  each layer's rollback store: live state, snapshot buffer, ring, checkpoint, replay history) is
  on the model's device; ``torch.profiler`` counts device-to-host copies per decode step (a
  long run minus a short one in the same shape bucket, over the difference in steps: the static
  path needs one, the step's "all rows finished?" flag), at most
  ``experiment.max_dtoh_per_step``; ``specdec.Stats`` times the rollback (``rollback_s``) apart
  from drafting and verification. The copy count needs CUDA.
* ``step_cost``: per batch of ``experiment.batch_grid``, the median speculative step is at most
  ``1 + K/4`` times the median plain step (specdec with K = 0 on the same decode path; a step
  = (wall - prefill) / steps of a ``max_new_tokens`` run, ``repeats`` runs after a warm-up); on
  CUDA every run must take the ``cuda_graph`` path (``Stats.capture_error`` says why not).
* ``memory_budget``: per strategy, the extra state bytes per sequence measured from the cache's
  allocations (its store tensors beyond the live fp32 state), and the largest batch whose
  per-sequence memory (live SSM state + extra + conv windows + KV cache for
  ``experiment.context_tokens`` tokens) fits ``experiment.memory_budget_gib``, as run and
  scaled to the model's full depth; holds when replay admits a larger batch than snapshot.
* ``fp32_state``: every stored SSM state (each floating tensor of the store except replay's
  per-token inputs, and the committed state the strategy returns) is fp32.

A verdict per check: ``PASS`` / ``FAIL``, or ``SKIP (needs CUDA)`` for the CUDA-only ones on
another device (their measuring code still runs). Records (``checks.<check>``) are appended to
``results.jsonl`` as measured; ``summary.md`` holds a table per check and the verdicts.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .common import RunRecords, apply_cpu_threads, check_context, common_fields, make_drafter
from .models import layer_counts, load_target, resolve_device, target_config
from .timing import Timing, sync

__all__ = ["run", "CHECKS", "cache_tensors", "fp32_state_check"]

_MIB = 1 << 20


def _nested(prefix: str, obj):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nested(f"{prefix}.{k}", v)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _nested(f"{prefix}[{i}]", v)


def cache_tensors(cache) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor a :class:`specdec.cache.HybridCache` holds: KV buffers,
    its bookkeeping, and per SSM layer its conv window and each tensor of its rollback store
    (``ssm[<layer>].store.<name>``, nested dicts such as the replay history included)."""
    out = []
    for idx, kv in cache.kv.items():
        out += list(_nested(f"kv[{idx}]", kv))
    out += [(k, v) for k, v in vars(cache).items() if isinstance(v, torch.Tensor)]
    for idx, layer in cache.ssm.items():
        out += [(f"ssm[{idx}].{k}", v) for k, v in vars(layer).items() if isinstance(v, torch.Tensor)]
        out += list(_nested(f"ssm[{idx}].store", layer.store.tensors))
    return out


def fp32_state_check(cache) -> tuple[bool, list[str], list[str]]:
    """Every stored SSM state is fp32: each floating tensor of each layer's rollback store (live,
    snapshot buffer, ring, checkpoint; the replay history holds per-token inputs and is exempt)
    and the committed state the strategy returns. Returns ``(ok, the state tensors checked (one
    layer), offenders)``."""
    bad, names = [], None
    for idx, layer in cache.ssm.items():
        if not layer.has_recurrence:
            continue
        keys = [k for k, v in layer.store.tensors.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        names = keys if names is None else names
        bad += [f"ssm[{idx}].store.{k} {layer.store.tensors[k].dtype}" for k in keys
                if layer.store.tensors[k].dtype != torch.float32]
        st = layer.ssm_state()
        if st is not None and st.dtype != torch.float32:
            bad.append(f"ssm[{idx}].ssm_state() {st.dtype}")
    return not bad and bool(names), names or [], bad


def _prompts(batch: int, tokens: int, vocab: int, device, seed: int) -> dict:
    """Random prompts, every second row left-padded by a few tokens (ragged rows)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(vocab, 8192), (batch, tokens), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, batch, 2):
        mask[r, : (r * 3) % (tokens // 2)] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0).to(device), "attention_mask": mask.to(device)}


class _Run:
    """The model, its settings and helpers the checks share."""

    def __init__(self, cfg, spec, model, device, dtype):
        self.cfg, self.spec, self.model, self.device, self.dtype = cfg, spec, model, device, dtype
        self.exp = cfg.experiment
        self.K = int(cfg.num_speculative_tokens)
        self.cuda = device.type == "cuda"
        path = str(self.exp.decode_path)
        self.decode_path = "static" if path == "auto" and not self.cuda else path
        self.strategies = [str(s) for s in cfg.rollback.strategies]

    def wrap(self, drafter, strategy: str, K: int):
        import specdec

        return specdec.wrap(self.model, drafter=drafter, rollback=strategy, num_speculative_tokens=K,
                            decode_path=self.decode_path)

    def oracle(self, enc, new: int):
        """An oracle drafter over specdec plain's output of ``enc`` (``new`` tokens)."""
        plain = self.wrap("ngram", self.strategies[0], 0)
        ref = plain.generate(**enc, max_new_tokens=new, pad_token_id=0)
        plain.release()
        return make_drafter(self.cfg, "oracle", reference=ref, attention_mask=enc["attention_mask"],
                            acceptance=float(self.exp.acceptance))

    def record(self, check: str, **fields) -> dict:
        return {**common_fields(self.cfg, f"checks.{check}", self.spec, self.device, self.dtype),
                "num_speculative_tokens": self.K, **fields}


def _step_times(sd, enc, new: int, repeats: int) -> tuple[Timing, object]:
    """Milliseconds per decode step ((wall - prefill) / steps, from :class:`specdec.Stats`) of
    ``repeats`` runs after a warm-up; returns (Timing, the last Stats)."""
    sd.generate(**enc, max_new_tokens=new, pad_token_id=0)
    ms = []
    for _ in range(repeats):
        sd.generate(**enc, max_new_tokens=new, pad_token_id=0)
        st = sd.last_stats
        ms.append(1e3 * (st.wall_s - st.prefill_s) / max(1, st.steps))
    return Timing(tuple(ms)), st


def _count_transfers(sd, enc, new: int) -> tuple[int, int, int]:
    """(device-to-host copies, host syncs, steps) of one ``generate()`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    sync(enc["input_ids"].device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sd.generate(**enc, max_new_tokens=new, pad_token_id=0)
        sync(enc["input_ids"].device)
    dtoh = syncs = 0
    for ev in prof.key_averages():
        key = ev.key.lower()
        if "memcpy" in key and "dtoh" in key.replace(" ", "").replace("-", ""):
            dtoh += ev.count
        elif key in ("cudastreamsynchronize", "cudadevicesynchronize", "cudaeventsynchronize"):
            syncs += ev.count
    return dtoh, syncs, sd.last_stats.steps


def rollback_on_device(run: _Run) -> tuple[list[dict], str]:
    """The ``rollback_on_device`` check (module docstring): records and verdict."""
    from specdec.graphs import bucket_length

    exp = run.exp
    enc = _prompts(4, int(exp.prompt_tokens), run.model.config.vocab_size, run.device, int(run.cfg.seed) + 6)
    short, long_ = (int(n) for n in exp.transfer_new_tokens)
    extra = int(exp.prompt_tokens) + 2 * (run.K + 1)  # the engine's bucket: prompt + new + 2 T
    long_ = min(long_, bucket_length(short + extra) - extra)  # both runs in one bucket: no recapture
    records, ok = [], True
    for strategy in run.strategies:
        sd = run.wrap(run.oracle(enc, long_), strategy, run.K)
        sd.generate(**enc, max_new_tokens=long_, pad_token_id=0)  # warm-up, capture
        sd.generate(**enc, max_new_tokens=long_, pad_token_id=0)
        st = sd.last_stats
        tensors = cache_tensors(sd.last_cache)
        off = [n for n, t in tensors if t.device.type != run.device.type]
        stores = sorted({n.split(".store.")[1].split(".")[0] for n, _ in tensors if ".store." in n})
        apart = st.rollback_s > 0 and st.draft_s > 0 and st.verify_s > 0
        rec = run.record("rollback_on_device", rollback=strategy, decode_path=st.decode_path,
                         cache_tensors=len(tensors), off_device=len(off), stores=",".join(stores),
                         draft_ms=1e3 * st.draft_s, verify_ms=1e3 * st.verify_s, rollback_ms=1e3 * st.rollback_s,
                         steps=st.steps, rollback_apart=apart, dtoh_per_step=None, syncs_per_step=None)
        good = apart and not off
        if run.cuda and long_ > short:
            (c1, s1, n1), (c2, s2, n2) = (_count_transfers(sd, enc, n) for n in (short, long_))
            if n2 != n1:
                rec.update(dtoh_per_step=(c2 - c1) / (n2 - n1), syncs_per_step=(s2 - s1) / (n2 - n1))
            good &= rec["dtoh_per_step"] is not None and rec["dtoh_per_step"] <= float(exp.max_dtoh_per_step)
        rec["ok"] = good
        ok &= good
        records.append(rec)
        sd.release()
    detail = "; ".join(f"{r['rollback']}: {r['off_device']}/{r['cache_tensors']} tensors off the device, "
                       + (f"{r['dtoh_per_step']:.2f} D2H/step, " if r["dtoh_per_step"] is not None else "")
                       + f"rollback {r['rollback_ms']:.2f} ms apart from draft {r['draft_ms']:.2f} / verify "
                       f"{r['verify_ms']:.2f} ms" for r in records)
    if not run.cuda:
        apart = all(r["rollback_apart"] for r in records)
        return records, (f"SKIP (needs CUDA) -- on {run.device.type}: rollback time reported apart: "
                         f"{'yes' if apart else 'NO'}; {detail}")
    return records, (f"{'PASS' if ok else 'FAIL'} (every cache tensor on the GPU, <= {exp.max_dtoh_per_step} D2H "
                     f"copy per decode step, rollback timed apart) -- {detail}")


def step_cost(run: _Run) -> tuple[list[dict], str]:
    """The ``step_cost`` check (module docstring): records and verdict."""
    exp = run.exp
    bound = 1 + run.K / 4
    new, repeats = int(run.cfg.max_new_tokens), int(run.cfg.repeats)
    records, ok, slow = [], True, []
    for B in (int(b) for b in exp.batch_grid):
        enc = _prompts(B, int(exp.prompt_tokens), run.model.config.vocab_size, run.device, int(run.cfg.seed) + 8 + B)
        plain_sd = run.wrap("ngram", run.strategies[0], 0)  # K = 0: the in-place update whatever the strategy
        plain, plain_st = _step_times(plain_sd, enc, new, repeats)
        plain_sd.release()
        if run.cuda and plain_st.decode_path != "cuda_graph":
            slow.append(f"plain B={B} ran {plain_st.decode_path!r} ({plain_st.capture_error})")
        oracle = run.oracle(enc, new)
        for strategy in run.strategies:
            sd = run.wrap(oracle, strategy, run.K)
            spec_t, st = _step_times(sd, enc, new, repeats)
            sd.release()
            ratio = spec_t.median / plain.median
            graph_ok = not run.cuda or st.decode_path == "cuda_graph"
            if not graph_ok:
                slow.append(f"speculative B={B} {strategy} ran {st.decode_path!r} ({st.capture_error})")
            good = ratio <= bound and graph_ok
            ok &= good
            records.append(run.record("step_cost", rollback=strategy, batch=B, repeats=repeats,
                                      **plain.fields("plain_step_ms"), **spec_t.fields("step_ms"), ratio=ratio,
                                      bound=bound, decode_path=st.decode_path, capture_error=st.capture_error,
                                      mean_accepted_tokens=st.mean_accepted_tokens,
                                      acceptance_rate=st.acceptance_rate,
                                      tokens_gain=st.mean_accepted_tokens / ratio, ok=good))
    worst = max(records, key=lambda r: r["ratio"])
    detail = (f"worst ratio {worst['ratio']:.2f} (B={worst['batch']} {worst['rollback']}: {worst['step_ms']:.3f} vs "
              f"{worst['plain_step_ms']:.3f} ms/step), bound {bound:.2f}; decode paths "
              f"{sorted({r['decode_path'] for r in records})}" + ("; SLOW PATH: " + "; ".join(slow) if slow else ""))
    if not run.cuda:
        return records, f"SKIP (needs CUDA) -- measured on {run.device.type}, decode path {run.decode_path}: {detail}"
    return records, (f"{'PASS' if ok else 'FAIL'} (median speculative step <= (1 + K/4) x median plain step, "
                     f"cuda_graph path) -- {detail}")


def _short_runs(run: _Run, enc) -> dict:
    """One short ``generate()`` per strategy: ``{strategy: its cache}`` (for the memory and fp32
    checks, which inspect the cache)."""
    caches = {}
    for strategy in run.strategies:
        sd = run.wrap("ngram", strategy, run.K)
        sd.generate(**enc, max_new_tokens=2 * run.K + 4, pad_token_id=0)
        caches[strategy] = sd.last_cache
        sd.release()
    return caches


def _full_depth_counts(spec, model) -> tuple[tuple[int, int], tuple[int, int]]:
    """(SSM, attention) layer counts as run and at the model's full depth (a random-shape target
    cut by ``layers``; other targets run at full depth)."""
    as_run = layer_counts(model.config)
    if str(spec.source) != "random_shape" or spec.get("layers") is None:
        return as_run, as_run
    full = OmegaConf.to_container(spec, resolve=True)
    full["layers"] = None
    return as_run, layer_counts(target_config(OmegaConf.create(full)))


def memory_budget(run: _Run, caches: dict) -> tuple[list[dict], str]:
    """The ``memory_budget`` check on one short run's cache per strategy: records and verdict."""
    exp = run.exp
    budget = float(exp.memory_budget_gib) * (1 << 30)
    context = int(exp.context_tokens)
    (ssm_run, att_run), (ssm_full, att_full) = _full_depth_counts(run.spec, run.model)
    records = []
    for strategy, cache in caches.items():
        live = extra = conv = 0
        n_ssm = 0
        for layer in cache.ssm.values():
            if layer.conv_window is not None:
                conv += layer.conv_window.numel() * layer.conv_window.element_size()
            if not layer.has_recurrence:
                continue
            n_ssm += 1
            store = sum(t.numel() * t.element_size() for _, t in _nested("", layer.store.tensors))
            live_bytes = layer.ssm_state().numel() * 4  # the live state (fp32)
            live += live_bytes
            extra += store - live_bytes
        kv = sum(t.numel() * t.element_size() for pair in cache.kv.values() for t in pair)
        kv_tok = kv / (cache.batch * cache.max_len)  # per sequence and token, all attention layers
        per = {k: v / cache.batch for k, v in {"live": live, "extra": extra, "conv": conv}.items()}
        per_seq = per["live"] + per["extra"] + per["conv"] + kv_tok * context
        s = ssm_full / max(n_ssm, 1)
        a = att_full / max(att_run, 1) if att_run else 0.0
        full = {k: v * s for k, v in per.items()}
        per_seq_full = full["live"] + full["extra"] + full["conv"] + kv_tok * a * context
        records.append(run.record("memory_budget", rollback=strategy, live_MiB=per["live"] / _MIB,
                                  extra_MiB=per["extra"] / _MIB, conv_MiB=per["conv"] / _MIB,
                                  kv_KiB_per_token=kv_tok / 1024, max_batch=int(budget // per_seq),
                                  extra_MiB_full=full["extra"] / _MIB, max_batch_full=int(budget // per_seq_full),
                                  max_batch_ssm_full=int(budget // (full["live"] + full["extra"])),
                                  memory_budget_gib=float(exp.memory_budget_gib), context_tokens=context,
                                  ssm_layers=ssm_run, attention_layers=att_run, ssm_layers_full=ssm_full,
                                  attention_layers_full=att_full))
    by = {r["rollback"]: r for r in records}
    if "replay" in by and "snapshot" in by:
        r, s = by["replay"], by["snapshot"]
        ok = r["max_batch"] > s["max_batch"] and r["max_batch_full"] > s["max_batch_full"]
        cmp = (f"replay admits {r['max_batch_full']} vs snapshot {s['max_batch_full']} (full depth; as run "
               f"{r['max_batch']} vs {s['max_batch']})")
    else:
        ok, cmp = False, "replay and snapshot both needed for the comparison"
    detail = "; ".join(f"{r['rollback']}: +{r['extra_MiB_full']:.2f} MiB/seq, max batch {r['max_batch_full']}"
                       for r in records)
    return records, (f"{'PASS' if ok else 'FAIL'} ({exp.memory_budget_gib} GiB budget, {context}-token context, full "
                     f"depth) -- {cmp}; {detail}")


def fp32_state(run: _Run, caches: dict) -> tuple[list[dict], str]:
    """The ``fp32_state`` check on one short run's cache per strategy: records and verdict."""
    records, msgs = [], []
    for strategy, cache in caches.items():
        ok, names, bad = fp32_state_check(cache)
        records.append(run.record("fp32_state", rollback=strategy, state_tensors=",".join(names), offenders=bad,
                                  ok=ok))
        msgs.append(f"{strategy}: [{','.join(names)}] " + ("fp32" if ok else "NOT fp32: " + "; ".join(bad[:3])))
    return records, f"{'PASS' if all(r['ok'] for r in records) else 'FAIL'} -- " + "; ".join(msgs)


#: checks that inspect the caches of one short run per strategy, and checks that run their own
_ON_CACHES = {"memory_budget": memory_budget, "fp32_state": fp32_state}
_ON_RUNS = {"step_cost": step_cost, "rollback_on_device": rollback_on_device}
#: the checks, in the order they run (cheapest first)
CHECKS = tuple(_ON_CACHES) + tuple(_ON_RUNS)


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Run the checks; returns the records (also in ``out_dir``). Prints one verdict line per
    check (``<check>: PASS|FAIL|SKIP (needs CUDA) -- ...``)."""
    from .e2e import release
    from .report import write_report

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    log = RunRecords(out_dir)
    chosen = [c for c in CHECKS if c in {str(x) for x in exp.checks}]
    verdicts = []
    for spec in cfg.model.targets:
        model, _ = load_target(spec, device, dtype, int(cfg.seed))
        apply_cpu_threads(cfg, model, device)
        if "step_cost" in chosen:  # (before any generation: the runs' new tokens within the context)
            check_context(str(spec.name), model, int(exp.prompt_tokens), int(cfg.max_new_tokens))
        if "rollback_on_device" in chosen:
            check_context(str(spec.name), model, int(exp.prompt_tokens), max(int(n) for n in exp.transfer_new_tokens),
                          "experiment.transfer_new_tokens")
        r = _Run(cfg, spec, model, device, dtype)
        caches = None
        with torch.no_grad():
            for check in chosen:
                if check in _ON_CACHES:
                    if caches is None:
                        enc = _prompts(4, int(exp.prompt_tokens), model.config.vocab_size, device, int(cfg.seed) + 9)
                        caches = _short_runs(r, enc)
                    recs, verdict = _ON_CACHES[check](r, caches)
                else:
                    recs, verdict = _ON_RUNS[check](r)
                line = f"{check}: {verdict}"
                print(line, flush=True)
                verdicts.append(f"{spec.name}, {line}" if len(cfg.model.targets) > 1 else line)
                for rec in recs:
                    log.add(rec)
                release(device)
        del model, caches
    title = (f"Checks: {', '.join(t.name for t in cfg.model.targets)}, {str(dtype).replace('torch.', '')}, {device}, "
             f"K={cfg.num_speculative_tokens}, oracle drafter at acceptance {exp.acceptance}")
    text = write_report(log.records, log.out_dir, title)
    text += "\n## Verdicts\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n"
    (log.out_dir / "summary.md").write_text(text)
    return log.records
