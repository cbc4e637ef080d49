"""The acceptance experiment: targets x drafters x rollback strategies over a prompt set.

For every configuration and prompt it records mean accepted tokens (Spec-Bench's tokens per
target forward, bonus included), acceptance rate, the accepted-length histogram, tokens/s,
the speedup over plain greedy decoding of the same model on the same prompt in the same run
(transformers' ``generate()``), and whether the output equals that plain greedy output token
for token. Results go to ``results.jsonl`` (one record per prompt and configuration),
``summary.md`` (the table, means over prompts) and ``accept_hist.png`` in the run folder.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .report import accept_histogram_plot, print_table, summarize, write_summary

__all__ = ["run", "load_target", "resolve_device"]


def resolve_device(cfg) -> tuple[torch.device, torch.dtype]:
    """``cfg.device`` (auto|cpu|cuda) and ``cfg.dtype`` (auto|float32|bfloat16|float16) to torch objects.

    Raises: ValueError for an unknown value or cuda without a GPU.
    """
    dev = str(cfg.device)
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {cfg.device!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available; use device=cpu")
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dt = str(cfg.dtype)
    if dt == "auto":
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    elif dt in names:
        dtype = names[dt]
    else:
        raise ValueError(f"dtype must be auto or one of {sorted(names)}; got {cfg.dtype!r}")
    return torch.device(dev), dtype


def load_target(spec, device, dtype):
    """(model, tokenizer) for a ``model.targets`` entry: ``source`` zoo or hf."""
    if spec.source == "zoo":
        from .. import zoo

        return zoo.load(spec.name, device=device, dtype=dtype)
    if spec.source == "hf":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(spec.name, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(spec.name)
    raise ValueError(f"model source must be 'zoo' or 'hf', got {spec.source!r}")


def _prompts(cfg):
    from .. import zoo

    return zoo.prompts(str(cfg.prompts.set), limit=cfg.prompts.limit)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _configs(cfg, target_spec):
    for drafter in cfg.drafter.names:
        if drafter == "draft_model" and not target_spec.get("draft"):
            continue
        for strategy in cfg.rollback.strategies:
            yield drafter, strategy


def run(cfg: DictConfig, out_dir: Path, records_sink=None) -> list[dict]:
    """Run the experiment; returns the records (also written to ``out_dir``).

    ``records_sink``: optional callable(list[dict]) -> list[dict] that gathers records across
    processes (multi-GPU runs); the summary is written only where it returns a list.
    """
    import specdec
    from specdec.drafters import DraftModelDrafter, NGramDrafter

    device, dtype = resolve_device(cfg)
    if device.type == "cpu" and cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    torch.manual_seed(int(cfg.seed))
    prompts = _prompts(cfg)
    K = int(cfg.num_speculative_tokens)
    max_new = int(cfg.max_new_tokens)
    records: list[dict] = []
    plan = []
    for spec in cfg.model.targets:
        for drafter, strategy in _configs(cfg, spec):
            plan.append((spec, drafter, strategy))
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    total = len(plan) * len(prompts) + len(cfg.model.targets) * len(prompts)
    bar = tqdm(total=total, desc="acceptance", disable=not cfg.progress, unit="gen") if tqdm else None
    loaded: dict = {}
    for spec in cfg.model.targets:
        model, tok = load_target(spec, device, dtype)
        draft = None
        if spec.get("draft") and "draft_model" in cfg.drafter.names:
            draft, _ = load_target(OmegaConf.create({"name": spec.draft, "source": spec.source}), device, dtype)
        loaded[spec.name] = (model, tok, draft)
        # plain greedy decoding of the same model: the baseline and the exactness reference
        plain = {}
        for p in prompts:
            enc = tok(p["prompt"], return_tensors="pt").to(device)
            if cfg.experiment.warmup and not plain:
                model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
            _sync(device)
            t0 = time.perf_counter()
            ref = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
            _sync(device)
            plain[p["id"]] = (ref, time.perf_counter() - t0)
            if bar:
                bar.update(1)
        for s, drafter_name, strategy in plan:
            if s.name != spec.name:
                continue
            if drafter_name == "ngram":
                drafter = NGramDrafter(**cfg.drafter.ngram)
            else:
                drafter = DraftModelDrafter(draft, rollback=cfg.drafter.draft_rollback)
            sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=K)
            warmed = not cfg.experiment.warmup
            for p in prompts:
                enc = tok(p["prompt"], return_tensors="pt").to(device)
                if not warmed:
                    sd.generate(**enc, max_new_tokens=4, pad_token_id=tok.pad_token_id)
                    warmed = True
                _sync(device)
                t0 = time.perf_counter()
                out = sd.generate(**enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
                _sync(device)
                dt = time.perf_counter() - t0
                ref, ref_s = plain[p["id"]]
                st = sd.last_stats
                new = out.shape[1] - enc["input_ids"].shape[1]
                records.append(
                    {
                        "model": spec.name,
                        "drafter": drafter_name,
                        "rollback": strategy,
                        "num_speculative_tokens": K,
                        "prompt_id": p["id"],
                        "prompt_set": p.get("set", str(cfg.prompts.set)),
                        "prompt_tokens": int(enc["input_ids"].shape[1]),
                        "new_tokens": int(new),
                        "mean_accepted_tokens": st.mean_accepted_tokens,
                        "acceptance_rate": st.acceptance_rate,
                        "accept_histogram": list(st.accept_histogram),
                        "steps": st.steps,
                        "tokens_per_s": new / dt if dt > 0 else 0.0,
                        "plain_tokens_per_s": (ref.shape[1] - enc["input_ids"].shape[1]) / ref_s if ref_s > 0 else 0.0,
                        "speedup": ref_s / dt if dt > 0 else 0.0,
                        "exact": bool(out.shape == ref.shape and torch.equal(out, ref)),
                        "draft_s": st.draft_s,
                        "verify_s": st.verify_s,
                        "rollback_s": st.rollback_s,
                        "wall_s": dt,
                        "device": str(device),
                        "dtype": str(dtype).replace("torch.", ""),
                        "config": OmegaConf.to_container(cfg, resolve=True),
                    }
                )
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    if records_sink is not None:
        records = records_sink(records)
        if records is None:
            return []
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    rows = summarize(records, keys=("model", "drafter", "rollback"))
    title = f"Acceptance: K={K}, {max_new} new tokens, prompt set {cfg.prompts.set} ({len(prompts)} prompts), {device}"
    write_summary(out_dir / "summary.md", title, rows)
    print_table(title, rows)
    accept_histogram_plot(records, out_dir / "accept_hist.png")
    return records
