"""GPU checks of failure cases C6, C8 and C9 (shared/cases/README.md), one section each, each
ending in a ``C6: PASS ...`` / ``C6: FAIL ...`` line with the measured numbers, plus an
``FP32-STATE`` line (every stored SSM state is fp32).

* **C6** (rollback phase on GPU): after a run, every tensor of the cache (KV, conv windows,
  the strategy's live state, snapshot buffer, ring, checkpoint, replay history) is on the GPU;
  torch.profiler counts device-to-host copies per decode step (the difference between a long
  and a short run, divided by the difference in steps: prefill and argument checks cancel);
  the static path should need one small copy per step (the "all rows finished?" flag). And
  ``Stats.rollback_s`` is measured apart from ``draft_s`` / ``verify_s``.
* **C8** (batch 1, 4, 16; OracleDrafter at per-token acceptance 0.8, K=4): the median time of
  a speculative step is at most ``1 + K/4`` times the median time of a plain step. Plain =
  the same engine with K=0 on the same decode path (``auto``: CUDA graphs on CUDA); for each
  batch the *fastest* strategy's plain step is the reference. Step times are host intervals
  between consecutive verify forwards (each step ends in a host sync, so an interval is one
  whole step: draft, verify, accept, commit); if that hook is unavailable, the mean step time
  ``(wall_s - prefill_s) / steps`` is used. FAIL, saying so, when a run did not take the
  ``cuda_graph`` path on CUDA (a fallback to eager / launch-per-op decoding).
* **C9** (fixed memory budget): for each strategy, the extra state bytes per sequence measured
  from the cache's actual allocations (the strategy's store tensors beyond the live state),
  and the largest batch whose per-sequence memory (live SSM state + extra + conv window + KV
  cache for ``--context`` tokens) fits ``--budget-gib``; for the model as run and scaled to
  the bench shape's full depth. PASS when every strategy is reported and replay admits a
  larger batch than snapshot.

The model is a bench shape of shared/bench_models.md with random weights, cut to ``--layers``
layers (default 8: 6 GDN + 2 attention layers of qwen35-4b-shape). ``--device cpu --tiny``
runs everything in seconds on a tiny model of the same family (CUDA-only checks print
``SKIP (needs CUDA)`` and still exercise the measuring code).

    python benchmarks/cases_gpu.py --out cases_gpu.md                          # H200: ~1-2 min
    python benchmarks/cases_gpu.py --model nemotronh-4b-shape --out cases_gpu_nemotronh.md
    python benchmarks/cases_gpu.py --device cpu --tiny --out /tmp/cases.md    # smoke test, seconds
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import itertools

import torch

import specdec
from specdec.decoding import StaticDecoder
from specdec.drafters import OracleDrafter

STRATEGIES = ("snapshot", "ring", "replay", "replay_deferred")
BENCH_MODELS = ("qwen35-4b-shape", "nemotronh-4b-shape")

# tiny stand-ins of the bench shapes (same classes and layer kinds), for CPU smoke runs
_TINY = {
    "qwen35-4b-shape": {
        "hidden_size": 64, "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True,
    },
    "nemotronh-4b-shape": {
        "hidden_size": 64, "num_hidden_layers": 4, "hybrid_override_pattern": "M-M*", "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
        "conv_kernel": 4, "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": False, "chunk_size": 16,
    },
}


# ---------------------------------------------------------------------------------------------
# shared helpers (benchmarks/long_run.py imports these)


def bench_spec(name: str):
    """The ``model.targets`` entry of conf/model/<name>.yaml (an OmegaConf node)."""
    from omegaconf import OmegaConf

    path = os.path.join(ROOT, "specdec", "conf", "model", f"{name}.yaml")
    if not os.path.isfile(path):
        path = os.path.join(ROOT, "conf", "model", f"{name}.yaml")
    return OmegaConf.load(path).targets[0]


def layer_counts(config) -> tuple[int, int]:
    """(SSM layers, attention layers) of a bench-shape transformers config or config dict."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    pattern = get("hybrid_override_pattern")
    if pattern:
        return str(pattern).count("M"), str(pattern).count("*")
    types = list(get("layer_types") or [])
    return types.count("linear_attention"), types.count("full_attention")


def build_bench_model(name: str, device, dtype, layers: int | None = None, tiny: bool = False, seed: int = 0):
    """``(model, info)``: a bench shape with random weights, its first ``layers`` layers only
    (``None``: full depth), or the tiny stand-in. ``info``: the config dicts as run and at full depth."""
    from omegaconf import OmegaConf

    from specdec.experiments.models import build_random_shape

    if name not in BENCH_MODELS:
        raise ValueError(f"bench model must be one of {BENCH_MODELS}, got {name!r}")
    spec = bench_spec(name)
    full = OmegaConf.to_container(spec.config, resolve=True)
    cfg = copy.deepcopy(_TINY[name]) if tiny else copy.deepcopy(full)
    if layers is not None and not tiny:
        n = int(layers)
        if not 1 <= n <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers must be in [1, {cfg['num_hidden_layers']}], got {n}")
        cfg["num_hidden_layers"] = n
        if "hybrid_override_pattern" in cfg:
            cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:n]
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:n]
    entry = OmegaConf.to_container(spec, resolve=True)
    entry["config"] = cfg
    spec = OmegaConf.create(entry)
    model, _ = build_random_shape(spec, device, dtype, seed)
    # damped residual branches (see benchmarks/e2e.py): wide greedy margins, so the oracle's
    # reference stays valid in bf16 and the measured acceptance is the one asked for
    from e2e import damp_residual_branches

    damp_residual_branches(model, 0.01)
    return model, {"config": cfg, "full_config": full}


def walk_cache(cache):
    """``(name, tensor)`` for every tensor a :class:`specdec.cache.HybridCache` holds: KV buffers,
    bookkeeping, and per SSM layer its conv window and every tensor of its rollback store
    (nested dicts, e.g. the replay history, included)."""
    def nested(prefix, obj):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from nested(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from nested(f"{prefix}[{i}]", v)

    for idx, kv in cache.kv.items():
        yield from nested(f"kv[{idx}]", kv)
    for key, val in vars(cache).items():
        if isinstance(val, torch.Tensor):
            yield key, val
    for idx, layer in cache.ssm.items():
        for key, val in vars(layer).items():
            if isinstance(val, torch.Tensor):
                yield f"ssm[{idx}].{key}", val
        yield from nested(f"ssm[{idx}].store", layer.store.tensors)


def fp32_state_check(cache) -> tuple[bool, list[str], list[str]]:
    """Every stored SSM state is fp32: each floating tensor of each layer's rollback store (live,
    snapshot buffer, ring, checkpoint; the replay history holds per-token *inputs* and is
    exempt) and the committed state the strategy returns. Returns (ok, state tensor names
    checked (one layer), offenders)."""
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


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def release(device):
    """Free the CUDA graphs and static buffers of wrappers that went out of scope."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------


class StepTimer:
    """Per-step host intervals of a :class:`SpeculativeGenerator` on the static path: wraps the
    bucket's ``StaticDecoder.forward`` (one call per step; every step ends in a host sync, so
    the interval between two calls is one whole step). Intervals are kept per generate() call."""

    def __init__(self):
        self.runs: list[list[float]] = []
        self._patched = set()

    def attach(self, sd) -> bool:
        decs = [sd.decoder] if isinstance(sd.decoder, StaticDecoder) else []
        if not decs:
            return False
        for dec in decs:
            if id(dec) in self._patched:
                continue
            orig = dec.forward

            def forward(step, _orig=orig):
                if self.runs:
                    self.runs[-1].append(time.perf_counter())
                return _orig(step)

            dec.forward = forward
            self._patched.add(id(dec))
        return True

    def new_run(self):
        self.runs.append([])

    def intervals(self) -> list[float]:
        return [b - a for run in self.runs for a, b in itertools.pairwise(run)]


def make_prompts(B, Lp, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(vocab, 8192), (B, Lp), generator=g)
    mask = torch.ones_like(ids)
    if B > 1:  # ragged: a few rows left-padded
        for r in range(1, B, 2):
            mask[r, : (r * 3) % (Lp // 2)] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)


def time_steps(sd, ids, mask, new, repeats) -> dict:
    """Warm-up call (captures the graphs), then ``repeats`` timed calls; per-step times."""
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
    timer = StepTimer()
    hooked = timer.attach(sd)
    means, stats = [], None
    for _ in range(repeats):
        timer.new_run()
        sync(ids.device)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
        stats = sd.last_stats
        means.append((stats.wall_s - stats.prefill_s) / max(stats.steps, 1))
    iv = timer.intervals() if hooked else []
    med = statistics.median(iv) if iv else statistics.median(means)
    dec = sd.decoder
    return {"out": out, "stats": stats, "median_ms": 1e3 * med, "mean_ms": 1e3 * statistics.mean(means),
                "how": "median of step intervals" if iv else "median over runs of mean step time",
                "capture_error": getattr(dec, "capture_error", None)}


# ---------------------------------------------------------------------------------------------
# C6


def count_dtoh(sd, ids, mask, new) -> tuple[int, int, int]:
    """(device-to-host memcpy events, host-side syncs, steps) of one generate() under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    sync(ids.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sd.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0)
        sync(ids.device)
    dtoh = syncs = 0
    for ev in prof.key_averages():
        key = ev.key.lower()
        if "memcpy" in key and "dtoh" in key.replace(" ", "").replace("-", ""):
            dtoh += ev.count
        elif key in ("cudastreamsynchronize", "cudadevicesynchronize", "cudaeventsynchronize"):
            syncs += ev.count
    return dtoh, syncs, sd.last_stats.steps


def case_c6(model, args, device, report):
    print("\n## C6: rollback phase on GPU", flush=True)
    cuda = device.type == "cuda"
    B = 4
    ids, mask = make_prompts(B, args.prompt_len, model.config.vocab_size, device, seed=6)
    # both profiled runs must fall in one static shape bucket (else the second one recaptures)
    from specdec.graphs import bucket_length

    short, long_ = args.c6_new
    extra = args.prompt_len + 2 * (args.K + 1)
    long_ = min(long_, bucket_length(short + extra) - extra)
    if long_ <= short:
        short, long_ = 1, bucket_length(1 + extra) - extra
    args.c6_new = [short, long_]
    rows, ok = [], True
    plain = specdec.wrap(model, drafter="ngram", rollback="ring", num_speculative_tokens=0)
    ref = plain.generate(ids, attention_mask=mask, max_new_tokens=max(args.c6_new), pad_token_id=0)
    for strategy in args.strategies:
        oracle = OracleDrafter(ref, mask, acceptance=args.acceptance, seed=6)
        sd = specdec.wrap(model, drafter=oracle, rollback=strategy, num_speculative_tokens=args.K,
                          decode_path=args.decode_path)
        sd.generate(ids, attention_mask=mask, max_new_tokens=args.c6_new[1], pad_token_id=0)  # warm-up / capture
        sd.generate(ids, attention_mask=mask, max_new_tokens=args.c6_new[1], pad_token_id=0)
        st = sd.last_stats
        tensors = list(walk_cache(sd.last_cache))
        off = [n for n, t in tensors if t.device.type != "cuda"]
        store_names = sorted({n.split(".store.")[1].split(".")[0] for n, _ in tensors if ".store." in n})
        separate = st.rollback_s > 0 and st.draft_s > 0 and st.verify_s > 0
        row = {"strategy": strategy, "path": st.decode_path, "tensors": len(tensors), "off_device": len(off),
                   "stores": ",".join(store_names), "draft_ms": 1e3 * st.draft_s, "verify_ms": 1e3 * st.verify_s,
                   "rollback_ms": 1e3 * st.rollback_s, "steps": st.steps, "separate": separate}
        if cuda:
            try:
                (c1, s1, n1), (c2, s2, n2) = (count_dtoh(sd, ids, mask, n) for n in args.c6_new)
                per = (c2 - c1) / (n2 - n1) if n2 != n1 else float("nan")
                syncs = (s2 - s1) / (n2 - n1) if n2 != n1 else float("nan")
            except Exception as err:  # noqa: BLE001 -- report a profiler failure as a failed check
                print(f"  {strategy}: torch.profiler failed: {type(err).__name__}: {err}", flush=True)
                per = syncs = float("nan")
            row.update(dtoh_per_step=per, syncs_per_step=syncs)
            good = not off and separate and per <= args.max_dtoh_per_step
        else:
            row.update(dtoh_per_step=float("nan"), syncs_per_step=float("nan"))
            good = separate
        ok &= good
        rows.append(row)
        print(f"  {strategy}: path {st.decode_path}, {len(tensors)} cache tensors ({len(off)} off the GPU), "
              f"stores [{row['stores']}], draft {row['draft_ms']:.2f} ms / verify {row['verify_ms']:.2f} ms / "
              f"rollback {row['rollback_ms']:.2f} ms over {st.steps} steps, D2H copies per step "
              f"{row['dtoh_per_step']:.2f}", flush=True)
    summary = "; ".join(f"{r['strategy']}: {r['off_device']}/{r['tensors']} tensors off GPU, "
                        f"{r['dtoh_per_step']:.2f} D2H/step, rollback {r['rollback_ms']:.2f} ms apart from "
                        f"draft {r['draft_ms']:.2f} / verify {r['verify_ms']:.2f} ms" for r in rows)
    if not cuda:
        line = f"C6: SKIP (needs CUDA) -- on {device.type}: rollback time reported apart: " \
               f"{'yes' if ok else 'NO'}; {summary}"
    else:
        line = f"C6: {'PASS' if ok else 'FAIL'} (all store tensors on the GPU, <= {args.max_dtoh_per_step} " \
               f"D2H copy per decode step, rollback_s > 0 timed apart) -- {summary}"
    print(line, flush=True)
    md = ["## C6: rollback phase on GPU", "",
          (f"Batch {B}, prompt {args.prompt_len}, K={args.K}, OracleDrafter acceptance {args.acceptance}. "
          f"D2H copies per step = (copies in a {args.c6_new[1]}-token run - in a {args.c6_new[0]}-token run) / "
          "(difference in steps), from torch.profiler."), "",
          ("| strategy | decode path | cache tensors | off GPU | store tensors | D2H copies / step | "
          "host syncs / step | draft ms | verify ms | rollback ms | steps |"),
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['strategy']} | {r['path']} | {r['tensors']} | {r['off_device']} | {r['stores']} | "
                  f"{r['dtoh_per_step']:.2f} | {r['syncs_per_step']:.2f} | {r['draft_ms']:.2f} | "
                  f"{r['verify_ms']:.2f} | {r['rollback_ms']:.2f} | {r['steps']} |")
    md += ["", f"**{line}**", ""]
    report.append((line, md))
    return ok


# ---------------------------------------------------------------------------------------------
# C8


def case_c8(model, args, device, report):
    print("\n## C8: speculative step vs plain step", flush=True)
    cuda = device.type == "cuda"
    bound = 1 + args.K / 4
    rows, ok, problems = [], True, []
    for B in args.batches:
        ids, mask = make_prompts(B, args.prompt_len, model.config.vocab_size, device, seed=8 + B)
        plain_ms, ref = {}, None
        for strategy in args.strategies:
            sd0 = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=0,
                               decode_path=args.decode_path)
            res = time_steps(sd0, ids, mask, args.c8_new, args.repeats)
            plain_ms[strategy] = res["median_ms"]
            ref = res["out"] if ref is None else ref
            if cuda and res["stats"].decode_path != "cuda_graph":
                problems.append(f"plain B={B} {strategy} ran {res['stats'].decode_path!r}"
                                + (f" (capture failed: {res['capture_error']})" if res["capture_error"] else ""))
        best_plain = min(plain_ms.values())
        for strategy in args.strategies:
            oracle = OracleDrafter(ref, mask, acceptance=args.acceptance, seed=8)
            sd = specdec.wrap(model, drafter=oracle, rollback=strategy, num_speculative_tokens=args.K,
                              decode_path=args.decode_path)
            res = time_steps(sd, ids, mask, args.c8_new, args.repeats)
            st = res["stats"]
            ratio = res["median_ms"] / best_plain
            slow_path = cuda and st.decode_path != "cuda_graph"
            if slow_path:
                problems.append(f"speculative B={B} {strategy} ran {st.decode_path!r}"
                                + (f" (capture failed: {res['capture_error']})" if res["capture_error"] else ""))
            good = ratio <= bound and not slow_path
            ok &= good
            rows.append({"B": B, "strategy": strategy, "plain_ms": plain_ms[strategy], "best_plain": best_plain,
                             "spec_ms": res["median_ms"], "ratio": ratio, "path": st.decode_path, "mat": st.mean_accepted_tokens,
                             "acc": st.acceptance_rate, "tok_s_gain": st.mean_accepted_tokens / ratio, "how": res["how"],
                             "good": good})
            print(f"  B={B:<3} {strategy:<16} plain {plain_ms[strategy]:7.3f} ms/step (best {best_plain:.3f}), "
                  f"speculative {res['median_ms']:7.3f} ms/step, ratio {ratio:.2f} (bound {bound:.2f}), "
                  f"path {st.decode_path}, mean accepted {st.mean_accepted_tokens:.2f}, "
                  f"acceptance {st.acceptance_rate:.2f}", flush=True)
            del sd
        release(device)
    worst = max(rows, key=lambda r: r["ratio"])
    summary = (f"worst ratio {worst['ratio']:.2f} (B={worst['B']} {worst['strategy']}: {worst['spec_ms']:.3f} vs "
               f"{worst['best_plain']:.3f} ms/step), bound {bound:.2f}; paths "
               f"{sorted({r['path'] for r in rows})}")
    slow = "; SLOW PATH: " + "; ".join(problems) if problems else ""
    if not cuda:
        line = f"C8: SKIP (needs CUDA) -- measured on {device.type}, decode_path={args.decode_path}: {summary}"
    else:
        line = f"C8: {'PASS' if ok else 'FAIL'} (median speculative step <= (1 + K/4) x median plain step, " \
               f"cuda_graph path) -- {summary}{slow}"
    print(line, flush=True)
    md = ["## C8: speculative step vs plain step", "",
          (f"K={args.K}, OracleDrafter per-token acceptance {args.acceptance}, prompt {args.prompt_len}, "
          f"{args.c8_new} new tokens, {args.repeats} timed runs after a warm-up; bound 1 + K/4 = {bound:.2f}. "
          f"Plain = specdec K=0, same decode path; the ratio uses the fastest strategy's plain step. "
          f"Step time: {rows[0]['how']}."), "",
          ("| batch | strategy | plain ms/step | speculative ms/step | ratio | decode path | mean accepted tokens | "
          "acceptance | tokens/s gain | ok |"),
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['B']} | {r['strategy']} | {r['plain_ms']:.3f} | {r['spec_ms']:.3f} | {r['ratio']:.2f} | "
                  f"{r['path']} | {r['mat']:.2f} | {r['acc']:.2f} | {r['tok_s_gain']:.2f}x | "
                  f"{'yes' if r['good'] else 'NO'} |")
    md += ["", f"**{line}**", ""]
    report.append((line, md))
    return ok or not cuda


# ---------------------------------------------------------------------------------------------
# C9


def case_c9(model, info, args, device, report):
    print("\n## C9: extra state memory and max batch in a fixed budget", flush=True)
    B = 4
    ids, mask = make_prompts(B, args.prompt_len, model.config.vocab_size, device, seed=9)
    ssm_run, att_run = layer_counts(info["config"])
    ssm_full, att_full = layer_counts(info["full_config"])
    budget = int(args.budget_gib * (1 << 30))
    rows, fp32_ok, fp32_msgs = [], True, []
    for strategy in args.strategies:
        sd = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=args.K,
                          decode_path=args.decode_path)
        sd.generate(ids, attention_mask=mask, max_new_tokens=2 * args.K + 4, pad_token_id=0)
        cache = sd.last_cache
        live = extra = conv = 0
        n_ssm = 0
        for layer in cache.ssm.values():
            if layer.conv_window is not None:
                conv += layer.conv_window.numel() * layer.conv_window.element_size()
            if not layer.has_recurrence:
                continue
            n_ssm += 1
            store = sum(t.numel() * t.element_size() for _, t in walk_cache_store(layer.store.tensors))
            st = layer.ssm_state()
            lb = st.numel() * 4  # the live state (fp32)
            live += lb
            extra += store - lb
        kv = sum(t.numel() * t.element_size() for pair in cache.kv.values() for t in pair)
        kv_tok = kv / (cache.batch * cache.max_len)  # per sequence and token, all attention layers
        ok32, names, bad = fp32_state_check(cache)
        fp32_ok &= ok32
        fp32_msgs.append(f"{strategy}: [{','.join(names)}] " + ("fp32" if ok32 else "NOT fp32: " + "; ".join(bad[:3])))
        per = {k: v / cache.batch for k, v in {"live": live, "extra": extra, "conv": conv}.items()}
        per_seq_run = per["live"] + per["extra"] + per["conv"] + kv_tok * args.context
        s = ssm_full / max(n_ssm, 1)
        a = att_full / max(att_run, 1) if att_run else 0.0
        per_full = {k: v * s for k, v in per.items()}
        per_seq_full = per_full["live"] + per_full["extra"] + per_full["conv"] + kv_tok * a * args.context
        rows.append({"strategy": strategy, "live": per["live"], "extra": per["extra"], "conv": per["conv"], "kv_tok": kv_tok,
                         "per_seq": per_seq_run, "max_b": int(budget // per_seq_run), "extra_full": per_full["extra"],
                         "per_seq_full": per_seq_full, "max_b_full": int(budget // per_seq_full),
                         "ssm_only_full": int(budget // (per_full["live"] + per_full["extra"]))})
        r = rows[-1]
        print(f"  {strategy:<16} extra {r['extra'] / 2**20:8.3f} MiB/seq (live {r['live'] / 2**20:.3f}, conv "
              f"{r['conv'] / 2**20:.3f}, KV {r['kv_tok'] * args.context / 2**20:.3f} MiB at {args.context} tokens) "
              f"-> max batch {r['max_b']} in {args.budget_gib} GiB; full depth ({ssm_full} SSM + {att_full} attention "
              f"layers): extra {r['extra_full'] / 2**20:.2f} MiB/seq, max batch {r['max_b_full']}", flush=True)
    by = {r["strategy"]: r for r in rows}
    ok = len(rows) == len(args.strategies) and all(r["max_b"] >= 0 for r in rows)
    cmp = ""
    if "replay" in by and "snapshot" in by:
        ok &= by["replay"]["max_b"] > by["snapshot"]["max_b"] and by["replay"]["max_b_full"] > by["snapshot"]["max_b_full"]
        cmp = (f"replay admits {by['replay']['max_b_full']} vs snapshot {by['snapshot']['max_b_full']} "
               f"(full depth; as run {by['replay']['max_b']} vs {by['snapshot']['max_b']})")
    else:
        ok = False
        cmp = "replay and snapshot both needed for the comparison"
    summary = "; ".join(f"{r['strategy']}: +{r['extra_full'] / 2**20:.2f} MiB/seq, max batch {r['max_b_full']}"
                        for r in rows)
    line = f"C9: {'PASS' if ok else 'FAIL'} ({args.budget_gib} GiB budget, {args.context}-token context, " \
           f"full depth) -- {cmp}; {summary}"
    fp_line = f"FP32-STATE: {'PASS' if fp32_ok else 'FAIL'} -- " + "; ".join(fp32_msgs)
    print(line, flush=True)
    print(fp_line, flush=True)
    md = ["## C9: extra state memory and max batch in a fixed budget", "",
          (f"Measured from the cache's allocations after a batch-{B} run (K={args.K}): extra = bytes of the "
          "strategy's store tensors beyond the live fp32 state, per sequence, summed over SSM layers. Per-sequence "
          f"memory = live + extra + conv window + KV cache for {args.context} tokens; max batch = "
          f"floor({args.budget_gib} GiB / that). As run: {ssm_run} SSM + {att_run} attention layers; full depth: "
          f"{ssm_full} + {att_full} (per-layer numbers scaled)."), "",
          ("| strategy | live MiB/seq | extra MiB/seq | conv MiB/seq | KV KiB/token | max batch (as run) | "
          "extra MiB/seq (full) | max batch (full) | max batch, SSM state only (full) |"),
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['strategy']} | {r['live'] / 2**20:.3f} | {r['extra'] / 2**20:.3f} | {r['conv'] / 2**20:.4f} | "
                  f"{r['kv_tok'] / 1024:.2f} | {r['max_b']} | {r['extra_full'] / 2**20:.2f} | {r['max_b_full']} | "
                  f"{r['ssm_only_full']} |")
    md += ["", f"**{line}**", "", f"**{fp_line}**", ""]
    report.append((line, md))
    report.append((fp_line, []))
    return ok and fp32_ok


def walk_cache_store(tensors):
    for key, val in tensors.items():
        if isinstance(val, torch.Tensor):
            yield key, val
        elif isinstance(val, dict):
            yield from walk_cache_store(val)


# ---------------------------------------------------------------------------------------------


def write_report(args, argv, title, report, wall):
    """Markdown: a summary table of the result lines (in C6, C8, C9 order), then each case's section."""
    order = {"C6": 0, "C8": 1, "C9": 2, "FP32-STATE": 3}
    report = sorted(report, key=lambda r: order.get(r[0].split(":", 1)[0], 9))
    head = [title, "", (f"`python benchmarks/cases_gpu.py {' '.join(sys.argv[1:] if argv is None else argv)}` "
            f"({wall:.0f} s)"), "", "| check | result |", "|---|---|"]
    for line, _ in report:
        name, rest = line.split(":", 1)
        head.append(f"| {name} | {rest.strip().replace('|', '/')} |")
    with open(args.out, "w") as f:
        f.write("\n".join(head + [""] + [x for _, md in report for x in md]) + "\n")
    return head


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--model", default="qwen35-4b-shape", choices=BENCH_MODELS)
    ap.add_argument("--layers", type=int, default=8, help="first N layers of the bench shape (full depth: 0)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same family, small settings (CPU smoke)")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--c8-new", type=int, default=128, help="new tokens per timed C8 run")
    ap.add_argument("--repeats", type=int, default=3, help="timed C8 runs per setting (after one warm-up)")
    ap.add_argument("--c6-new", default="8,40", help="new tokens of the short and the long profiled C6 run")
    ap.add_argument("--max-dtoh-per-step", type=float, default=1.25)
    ap.add_argument("--budget-gib", type=float, default=40.0)
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence for the KV part of C9")
    ap.add_argument("--decode-path", default="auto")
    ap.add_argument("--cases", default="C6,C8,C9")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", default="cases_gpu.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but no CUDA device; use --device cpu --tiny")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.tiny:
        args.prompt_len = min(args.prompt_len, 16)
        args.c8_new = min(args.c8_new, 12)
        args.repeats = min(args.repeats, 1)
        args.batches = "1,4" if args.batches == "1,4,16" else args.batches
    args.batches = [int(b) for b in args.batches.split(",")]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.c6_new = [int(n) for n in args.c6_new.split(",")]
    if device.type != "cuda" and args.decode_path == "auto":
        args.decode_path = "static"  # exercise the static path's bookkeeping and the step hook on CPU
    cases = {c.strip().upper() for c in args.cases.split(",")}

    t0 = time.perf_counter()
    model, info = build_bench_model(args.model, device, dtype, layers=args.layers or None, tiny=args.tiny)
    n_ssm, n_att = layer_counts(info["config"])
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model}{' (tiny)' if args.tiny else ''}: {n_ssm} SSM + {n_att} attention layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {dtype}, {dev_name}; "
          f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    report, ok, head = [], True, []
    title = (f"# GPU case checks C6 / C8 / C9: {args.model}{' (tiny)' if args.tiny else ''}, "
             f"{n_ssm} SSM + {n_att} attention layers, {str(dtype).replace('torch.', '')}, {dev_name}, "
             f"{datetime.date.today()}")
    # cheapest first; the report is rewritten after every case, so a run cut short still reports
    with torch.no_grad():
        for name, fn in (("C9", lambda: case_c9(model, info, args, device, report)),
                         ("C8", lambda: case_c8(model, args, device, report)),
                         ("C6", lambda: case_c6(model, args, device, report))):
            if name in cases:
                ok &= fn()
                release(device)
                head = write_report(args, argv, title, report, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    print("\n" + "\n".join(head), flush=True)
    print(f"\nwrote {args.out} ({wall:.1f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
