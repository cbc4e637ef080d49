"""The Medusa-1 recipe: heads for a frozen zoo target, trained on its final hidden states.

Stages (deterministic given the config, the zoo and the Python standard library on the machine):

1. corpus: the zoo recipe's corpus builder (:func:`specdec.experiments.train_zoo.build_corpus`)
   with the same held-out rule, so no file behind the held-out prompts or the held-out sample
   is trained on. Training files are taken in a fixed hash order and encoded with the zoo
   tokenizer until a pool of ``data.pool_factor x data.tokens`` tokens is packed
   (``<bos> ids <eos>`` per file); ``data.tokens / data.seq_len`` non-overlapping windows are
   drawn from the pool at random (``seed``).
2. hidden states: the target (fp32, frozen, eval) runs each window once; its final hidden states
   (what the engine hands to :meth:`specdec.drafters.Drafter.observe`, the input of the LM
   head) are kept in memory with the window's token ids.
3. training: head k's logits at position t are scored against token t + 2 + k (the base LM head
   at t predicts t + 1): loss = sum over heads of the mean cross-entropy. Random batches of
   ``train.batch_positions`` positions, AdamW, linear warmup + cosine decay, a tqdm bar; the
   loss of every head is logged.
4. evaluation + manifest: per-head top-1 accuracy (and cross-entropy) on the shipped held-out
   sample (``specdec/data/heldout_sample.jsonl``, 8 x 512 tokens), next to the LM head's own
   next-token accuracy; the heads are saved by :meth:`MedusaHeads.save_pretrained` into
   ``<out>/zoo/<name>/`` and recorded under ``medusa.<name>`` of ``<out>/zoo/MANIFEST.json``
   (recipe, seed, steps, tokens, accuracies, sha256 of the files and of the target's weights,
   device, date).

With ``heads.shared_lm_head`` (the shipped default) the heads project with the target's own
frozen LM head, which is not stored: the file holds the residual blocks and the per-head
vocabulary biases only, and :func:`specdec.zoo.load_medusa` binds the target's LM head again
(checking that the target's weights are the ones the heads were trained on).

Run: ``specdec-run experiment=train_medusa [overrides]`` (or ``python -m specdec experiment=train_medusa``;
config ``conf/experiment/train_medusa.yaml``), like every recipe and experiment of the app.
CPU smoke run (seconds): ``... data.tokens=2048 data.seq_len=128 train.steps=3 out_dir=/tmp/medusa``.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from .config import recipe_out_root

MODULE = "specdec.experiments.train_medusa"

__all__ = ["run", "collect_hidden_states", "target_predictions", "training_windows", "medusa_targets", "medusa_loss",
           "fit", "fit_heads", "head_accuracy", "setup_run", "environment_fields"]


def _log(msg: str) -> None:
    print(f"[train_medusa {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _body(model):
    body = getattr(model, "model", None) or getattr(model, "backbone", None)
    if body is None:
        raise ValueError(f"{type(model).__name__} has no decoder body (.model / .backbone)")
    return body


@torch.no_grad()
def collect_hidden_states(model, windows: torch.Tensor, batch: int = 8, progress: bool = True) -> torch.Tensor:
    """The target's final hidden states (the LM head's input) for ``windows [W, L]``: ``[W, L, D]`` fp32 on CPU."""
    from tqdm.auto import tqdm

    dev = next(model.parameters()).device
    body = _body(model)
    out = []
    bar = tqdm(total=windows.shape[0], desc="hidden states", unit="win", disable=not progress, dynamic_ncols=True)
    for i in range(0, windows.shape[0], batch):
        ids = windows[i: i + batch].to(dev)
        h = body(input_ids=ids, use_cache=False).last_hidden_state
        out.append(h.float().cpu())
        bar.update(ids.shape[0])
    bar.close()
    return torch.cat(out)


def medusa_targets(hidden: torch.Tensor, ids: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``hidden [W, L, D]`` / ``ids [W, L]`` into training pairs: the hidden state at
    position t and, per head k, the token at t + 2 + k. Only positions where every head has a
    target are kept (t <= L - 2 - num_heads). Returns ``(x [N, D], y [N, num_heads])``."""
    W, L, D = hidden.shape
    T = L - 1 - num_heads
    if T < 1:
        raise ValueError(f"windows of {L} tokens are too short for {num_heads} heads (need > {num_heads + 1})")
    x = hidden[:, :T].reshape(-1, D)
    y = torch.stack([ids[:, 2 + k: 2 + k + T] for k in range(num_heads)], dim=-1).reshape(-1, num_heads)
    return x, y.long()


def medusa_loss(heads, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over heads of the mean cross-entropy of head k's logits against ``y[:, k]``;
    returns ``(loss, per_head [num_heads])``."""
    logits = heads(x)  # [N, H, V]
    H = logits.shape[1]
    per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="none")
    per = per.view(-1, H).mean(0)
    return per.sum(), per


def _lr_lambda(warmup: int, steps: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def fit(module, batch_loss, *, steps: int, lr: float = 1e-3, weight_decay: float = 0.0, betas=(0.9, 0.95),
        warmup_steps: int = 10, min_lr_ratio: float = 0.1, grad_clip: float = 1.0, log_every: int = 25, seed: int = 0,
        time_budget_s: float | None = None, progress: bool = True, log=_log, part: str = "head") -> dict:
    """Train ``module``'s trainable parameters: AdamW (weight decay on matrices only), linear
    warmup then cosine decay to ``min_lr_ratio``, gradient clipping, a tqdm bar and a log line
    every ``log_every`` steps; stops early (recorded) past ``time_budget_s`` seconds.

    ``batch_loss(generator)`` draws a batch with the ``torch.Generator`` and returns ``(loss,
    per_part [P])``: the loss to minimise and its parts (per head, per MTP step, ...), logged as
    ``loss_per_<part>``.

    Returns a dict: steps (done), train_loss_per_<part> (mean over the last ``log_every`` steps),
    history (per logged step: step, loss_per_<part>), seconds, stopped_early.

    Raises: ValueError when the module has no trainable parameter."""
    from tqdm.auto import tqdm

    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=tuple(betas))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(max(1, warmup_steps), steps, min_lr_ratio))
    gen = torch.Generator().manual_seed(seed)
    key = f"loss_per_{part}"
    module.train()
    history, window = [], []
    t0 = time.time()
    bar = tqdm(total=steps, desc=f"train {part}s", unit="step", disable=not progress, dynamic_ncols=True)
    done = 0
    stopped = False
    for step in range(steps):
        loss, per = batch_loss(gen)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        window.append(per.detach().cpu())
        done = step + 1
        bar.update(1)
        if done % log_every == 0 or done == steps:
            mean = torch.stack(window).mean(0).tolist()
            window = []
            history.append({"step": done, key: [round(v, 4) for v in mean]})
            bar.set_postfix_str(" ".join(f"{part[0]}{k}={v:.3f}" for k, v in enumerate(mean)))
            log(f"step {done}/{steps} loss per {part} " + " ".join(f"{v:.4f}" for v in mean)
                + f" lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.1f}s")
            if time_budget_s is not None and time.time() - t0 > time_budget_s and done < steps:
                log(f"time budget {time_budget_s}s reached: stopping at step {done}")
                stopped = True
                break
    bar.close()
    module.eval()
    return {"steps": done, f"train_{key}": history[-1][key] if history else None, "history": history,
            "seconds": round(time.time() - t0, 2), "stopped_early": stopped}


def fit_heads(heads, x: torch.Tensor, y: torch.Tensor, *, steps: int, batch_positions: int = 1024, **kw) -> dict:
    """Train ``heads`` (its trainable parameters only) on pairs from :func:`medusa_targets`: random
    batches of ``batch_positions`` pairs, the loss of :func:`medusa_loss`; ``kw`` as :func:`fit`.

    Returns :func:`fit`'s dict (train_loss_per_head, history with loss_per_head, ...) and
    positions_seen, batch_positions."""
    dev = next(p for p in heads.parameters() if p.requires_grad).device
    N = x.shape[0]
    bs = min(batch_positions, N)

    def batch_loss(gen):
        idx = torch.randint(0, N, (bs,), generator=gen)
        return medusa_loss(heads, x[idx].to(dev), y[idx].to(dev))

    out = fit(heads, batch_loss, steps=steps, part="head", **kw)
    return {**out, "positions_seen": out["steps"] * bs, "batch_positions": bs}


@torch.no_grad()
def head_accuracy(heads, hidden: torch.Tensor, ids: torch.Tensor, lm_head=None) -> dict:
    """Per-head top-1 accuracy and cross-entropy of head k at position t against token t + 2 + k,
    over every position where that head has a target, for ``hidden [W, L, D]`` / ``ids [W, L]``;
    with ``lm_head`` also the LM head's own next-token top-1 accuracy (position t -> t + 1)."""
    W, L, D = hidden.shape
    H = heads.num_heads
    dev = heads.shared_weight.device if heads.shared_lm_head else next(heads.parameters()).device
    hits, nll, counts = [0.0] * H, [0.0] * H, [0] * H
    base_hits = 0.0
    for w in range(W):  # one window at a time: [L, H, V] logits
        logits = heads(hidden[w].to(dev)).float()
        for k in range(H):
            T = L - 2 - k
            if T < 1:
                continue
            tgt = ids[w, 2 + k: 2 + k + T].to(dev)
            hits[k] += (logits[:T, k].argmax(-1) == tgt).float().sum().item()
            nll[k] += F.cross_entropy(logits[:T, k], tgt, reduction="sum").item()
            counts[k] += T
        if lm_head is not None:
            base = lm_head(hidden[w, :-1].to(lm_head.weight.device, lm_head.weight.dtype)).float()
            base_hits += (base.argmax(-1) == ids[w, 1:].to(base.device)).float().sum().item()
    out = {"top1": [h / c if c else None for h, c in zip(hits, counts)],
           "cross_entropy": [s / c if c else None for s, c in zip(nll, counts)], "positions": counts}
    if lm_head is not None:
        out["lm_head_top1"] = base_hits / (W * (L - 1))
    return out


@torch.no_grad()
def target_predictions(model, hidden: torch.Tensor, ids: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """Self-distillation labels: ``[W, L]`` ids whose entry t + 1 is the target's greedy token
    after position t (``argmax lm_head(hidden[:, t])``) and whose entry 0 is ``ids[:, 0]``; so
    :func:`medusa_targets` on them trains head k towards the token the target itself would
    choose at t + 2 + k after the corpus prefix (with k = 0, exactly what greedy verification
    accepts). On ``ids``' device."""
    lm_head = model.get_output_embeddings()
    dev = lm_head.weight.device
    pred = torch.cat([lm_head(hidden[i: i + batch].to(dev, lm_head.weight.dtype)).argmax(-1).cpu()
                      for i in range(0, hidden.shape[0], batch)])
    return torch.cat([ids[:, :1], pred[:, :-1].to(ids.device)], dim=1)


# --------------------------------------------------------------------------------------- data


def training_windows(cfg, tokenizer, log=_log) -> tuple[torch.Tensor, dict]:
    """``[W, seq_len]`` int64 windows of the packed training files (``cfg.corpus``, ``cfg.data``,
    ``cfg.seed``; the zoo's held-out files excluded), and the corpus record."""
    from .train_zoo import _encode, _spread_order, build_corpus

    corpus = build_corpus(cfg.corpus)
    train = sorted(corpus["train"], key=lambda f: _spread_order(f"medusa-{int(cfg.seed)}", f[0]))
    L = int(cfg.data.seq_len)
    n_win = max(1, int(cfg.data.tokens) // L)
    want = max(n_win * L, int(float(cfg.data.pool_factor) * n_win * L)) + 1
    stream: list[int] = []
    used = 0
    for i in range(0, len(train), 32):
        chunk = train[i: i + 32]
        for ids in _encode(tokenizer, [t for _, t in chunk]):
            stream.append(tokenizer.bos_token_id)
            stream.extend(ids)
            stream.append(tokenizer.eos_token_id)
        used += len(chunk)
        if len(stream) >= want:
            break
    total = len(stream) // L
    if total < n_win:
        raise ValueError(f"the training files give {total} windows of {L} tokens; data.tokens={cfg.data.tokens} needs {n_win}")
    g = torch.Generator().manual_seed(int(cfg.seed))
    pick = torch.randperm(total, generator=g)[:n_win].sort().values
    windows = torch.tensor(stream[: total * L], dtype=torch.long).view(total, L)[pick]
    record = {
        "source": f"CPython {platform.python_version()} standard library .py files",
        "stdlib_dir": corpus["root"],
        "file_list_sha256": corpus["file_list_sha256"],
        "content_sha256": corpus["content_sha256"],
        "num_train_files": len(corpus["train"]),
        "num_train_files_used": used,
        "num_heldout_files": len(corpus["heldout"]),
        "heldout_rule": f"int(sha256(relpath).hexdigest(), 16) % {cfg.corpus.heldout_mod} == 0",
        "pool_tokens": len(stream),
        "windows": n_win,
        "seq_len": L,
    }
    log(f"corpus: {len(corpus['train'])} train files ({used} encoded, {len(stream)} tokens pooled), "
        f"{n_win} windows of {L} tokens from {corpus['root']}")
    return windows, record


# --------------------------------------------------------------------------------------- main


def setup_run(cfg: DictConfig) -> tuple[dict, str]:
    """What a recipe over the target's hidden states does first: ``(resolved config without
    Hydra's node, device "cpu" | "cuda")``; sets the CPU threads (``cpu_threads``).

    Raises: ValueError for device=cuda without CUDA or a ``data.tokens`` / ``seq_len`` /
    ``batch_windows`` below 1."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    device = str(cfg.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available (use device=cpu)")
    if device == "cpu" and cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    for key in ("tokens", "seq_len", "batch_windows"):
        if int(cfg.data[key]) < 1:
            raise ValueError(f"data.{key} must be >= 1, got {cfg.data[key]}")
    return resolved, device


def environment_fields(device: str) -> dict:
    """The fields of a manifest record that say where and when it ran: device, cpu_threads, date,
    python_version, versions (torch, transformers)."""
    import transformers

    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "cpu_threads": torch.get_num_threads() if device == "cpu" else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python_version": platform.python_version(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def run(cfg: DictConfig) -> dict:
    """Run the recipe; returns the manifest entry (also written to ``<out>/zoo/MANIFEST.json``)."""
    from .. import zoo
    from ..drafters.medusa import MedusaHeads, WEIGHTS_NAME, CONFIG_NAME

    t_start = time.time()
    resolved, device = setup_run(cfg)
    if int(cfg.train.steps) < 1 or int(cfg.train.batch_positions) < 1:
        raise ValueError("train.steps and train.batch_positions must be >= 1")
    storage = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(cfg.heads.storage_dtype))
    if storage is None:
        raise ValueError("heads.storage_dtype must be float32, bfloat16 or float16; "
                         f"got {str(cfg.heads.storage_dtype)!r}")
    torch.manual_seed(int(cfg.seed))
    progress = bool(cfg.progress)

    # 1-2. target, corpus windows, hidden states
    target_name = str(cfg.target)
    model, tokenizer = zoo.load(target_name, device=device, dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    windows, corpus_rec = training_windows(cfg, tokenizer)
    t0 = time.time()
    hidden = collect_hidden_states(model, windows, int(cfg.data.batch_windows), progress)
    hidden_s = time.time() - t0
    _log(f"hidden states: {windows.numel()} tokens in {hidden_s:.1f}s ({windows.numel() / hidden_s:.0f} tok/s, "
         f"{device}, {torch.get_num_threads()} thread(s))")

    # 3. heads and training
    hc = cfg.heads
    heads = MedusaHeads.from_target(model, num_heads=int(hc.num_heads), num_layers=int(hc.num_layers),
                                    shared_lm_head=bool(hc.shared_lm_head), vocab_bias=bool(hc.vocab_bias),
                                    lm_head_rank=int(hc.lm_head_rank))
    labels = str(cfg.train.labels)
    if labels == "target":  # self-distillation: the target's own greedy token at each position
        t0 = time.time()
        label_ids = target_predictions(model, hidden, windows)
        _log(f"labels: the target's greedy predictions ({time.time() - t0:.1f}s)")
    elif labels == "corpus":
        label_ids = windows
    else:
        raise ValueError(f"train.labels must be corpus or target, got {labels!r}")
    x, y = medusa_targets(hidden, label_ids, heads.num_heads)
    del hidden
    tc = cfg.train
    trained = fit_heads(heads, x, y, steps=int(tc.steps), batch_positions=int(tc.batch_positions), lr=float(tc.lr),
                    weight_decay=float(tc.weight_decay), betas=tuple(tc.betas), warmup_steps=int(tc.warmup_steps),
                    min_lr_ratio=float(tc.min_lr_ratio), grad_clip=float(tc.grad_clip), log_every=int(tc.log_every),
                    seed=int(cfg.seed) + 1, time_budget_s=tc.time_budget_s, progress=progress)
    del x, y

    # 4. save, reload, evaluate on the held-out sample, manifest
    out_root = recipe_out_root(cfg)
    zoo_dir = out_root / "zoo"
    save_dir = zoo_dir / str(cfg.name)
    if save_dir.exists():
        for f in save_dir.iterdir():
            if f.is_file():
                f.unlink()
    heads.save_pretrained(save_dir, dtype=storage)
    saved = MedusaHeads.from_pretrained(save_dir, target=model, dtype=torch.float32)  # what users load
    sample = zoo.heldout_sample()
    held_ids = torch.tensor([r["input_ids"] for r in sample], dtype=torch.long)
    held_hidden = collect_hidden_states(model, held_ids, int(cfg.data.batch_windows), progress=False)
    ev = head_accuracy(saved, held_hidden, held_ids, lm_head=model.get_output_embeddings())
    agree = head_accuracy(saved, held_hidden, target_predictions(model, held_hidden, held_ids))
    _log("held-out top-1 per head " + " ".join(f"{a:.4f}" for a in ev["top1"])
         + f" (LM head next-token {ev['lm_head_top1']:.4f}); agreement with the target's greedy token "
         + " ".join(f"{a:.4f}" for a in agree["top1"]))

    files = {f.name: zoo._sha256(f) for f in sorted(save_dir.iterdir()) if f.name in (CONFIG_NAME, WEIGHTS_NAME)}
    target_man = zoo.manifest()["models"][target_name]
    entry = {
        "class": "specdec.drafters.MedusaHeads",
        "target": target_name,
        "target_files": dict(target_man["files"]),
        "heads": heads.config_dict(),
        "storage_dtype": str(storage).replace("torch.", ""),
        "trainable_parameters": sum(p.numel() for p in heads.parameters() if p.requires_grad),
        "stored_parameters": sum(v.numel() for v in heads.state_dict().values()),
        "recipe": {"module": MODULE, "config": resolved, "argv": sys.argv[1:]},
        "seed": int(cfg.seed),
        "steps": trained["steps"],
        "planned_steps": int(tc.steps),
        "stopped_early": trained["stopped_early"],
        "batch_positions": trained["batch_positions"],
        "positions_seen": trained["positions_seen"],
        "train_tokens": int(windows.numel()),
        "corpus": corpus_rec,
        "train_loss_per_head": trained["train_loss_per_head"],
        "loss_history": trained["history"],
        "heldout_top1": [round(a, 4) for a in ev["top1"]],
        "heldout_cross_entropy": [round(c, 4) for c in ev["cross_entropy"]],
        "heldout_positions": ev["positions"],
        "heldout_lm_head_top1": round(ev["lm_head_top1"], 4),
        "heldout_target_agreement": [round(a, 4) for a in agree["top1"]],
        "heldout_note": "heldout_top1: head k at position t against token t+2+k of the 8 x 512-token held-out "
                        "sample; heldout_lm_head_top1: the target's own next-token accuracy (t -> t+1); "
                        "heldout_target_agreement: head k against the target's greedy token at t+2+k after the "
                        "held-out prefix (k=0: the rate greedy verification accepts d_1 on that text)",
        "labels": labels,
        "hidden_states_seconds": round(hidden_s, 1),
        "train_seconds": trained["seconds"],
        "total_seconds": round(time.time() - t_start, 1),
        **environment_fields(device),
        "files": files,
        "bytes": sum((save_dir / f).stat().st_size for f in files),
    }
    man_path = zoo_dir / "MANIFEST.json"
    man = json.loads(man_path.read_text()) if man_path.is_file() else {"format": 1}
    man.setdefault("medusa", {})[str(cfg.name)] = entry
    man_path.write_text(json.dumps(man, indent=2) + "\n")
    _log(f"saved {save_dir} ({entry['bytes']} bytes) and {man_path}; {entry['total_seconds']}s total")
    return entry
