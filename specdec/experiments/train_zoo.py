"""The zoo recipe: train the small hybrid models that ship in ``specdec/zoo/``.

Stages, all deterministic given the config and the Python standard library on the machine:

1. corpus: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted relative paths,
   ``site-packages`` and ``__pycache__`` skipped, UTF-8 only, at most ``max_file_bytes``);
   a file is held out iff ``int(sha256(relpath), 16) % heldout_mod == 0``. The corpus depends
   on the Python version, so the manifest records it and the file list's hash.
2. tokenizer: byte-level BPE (``tokenizers``), specials ``<pad>`` ``<bos>`` ``<eos>`` (ids 0, 1, 2),
   saved as a ``transformers.PreTrainedTokenizerFast`` that prepends ``<bos>``.
3. data: ``data/heldout_sample.jsonl`` (the exact token ids behind every manifest
   ``heldout_loss``) and ``data/prompts/code_{128,1k,4k}.jsonl`` (file prefixes cut at a line
   boundary, with their ground-truth continuations), all from held-out files.
4. models: ``gdn-target`` / ``gdn-draft`` (``Qwen3_5ForCausalLM``), ``mamba2-target``
   (``NemotronHForCausalLM``), ``kda-target`` (``KimiLinearForCausalLM``); AdamW, warmup + cosine,
   bf16 autocast over fp32 master weights, random 512-token windows of the packed training
   stream; on CUDA the four train concurrently in their own processes on the one GPU (the
   pure-torch chunked GDN/KDA/Mamba-2 paths are launch-bound, so they share it well).
   Saved in bf16 safetensors.
5. evaluation + manifest: each saved model is reloaded from its bf16 safetensors in fp32 on
   the CPU and scored on the held-out sample (mean next-token cross-entropy, nats); that is the
   manifest's ``heldout_loss``, which ``tests/test_zoo.py`` recomputes.

Run: ``specdec-run experiment=train_zoo [overrides]`` (or ``python -m specdec experiment=train_zoo``;
config ``conf/experiment/train_zoo.yaml``), like every recipe and experiment of the app.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import recipe_out_root

MODEL_NAMES = ("gdn-target", "gdn-draft", "mamba2-target", "kda-target")
MODEL_CLASSES = ("Qwen3_5ForCausalLM", "NemotronHForCausalLM", "KimiLinearForCausalLM")
CONFIG_CLASSES = ("Qwen3_5TextConfig", "NemotronHConfig", "KimiLinearConfig")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
MODULE = "specdec.experiments.train_zoo"


def _sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _log(msg: str) -> None:
    print(f"[train_zoo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------- corpus


def is_heldout(relpath: str, mod: int) -> bool:
    """True iff ``relpath`` (a '/'-separated path relative to the stdlib) is in the held-out split."""
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % mod == 0


def build_corpus(ccfg: Any) -> dict:
    """Read the stdlib ``.py`` files. Returns dict with root, files [(relpath, text)] sorted by
    relpath, train / heldout lists of the same pairs, and the hashes recorded in the manifest."""
    root = Path(ccfg.stdlib or sysconfig.get_paths()["stdlib"]).resolve()
    if not root.is_dir():
        raise ValueError(f"stdlib folder not found: {root}")
    exclude = set(ccfg.exclude_dirs)
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in exclude)
        for fn in filenames:
            if fn.endswith(".py"):
                rels.append(Path(dirpath, fn).relative_to(root).as_posix())
    rels.sort()
    files: list[tuple[str, str]] = []
    skipped = 0
    for rel in rels:
        data = (root / rel).read_bytes()
        if len(data) == 0 or len(data) > ccfg.max_file_bytes:
            skipped += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        files.append((rel, text))
    if not files:
        raise ValueError(f"no usable .py files under {root}")
    content = hashlib.sha256()
    for rel, text in files:
        content.update(rel.encode() + b"\0" + text.encode() + b"\0")
    train = [f for f in files if not is_heldout(f[0], ccfg.heldout_mod)]
    heldout = [f for f in files if is_heldout(f[0], ccfg.heldout_mod)]
    return {
        "root": str(root),
        "files": files,
        "train": train,
        "heldout": heldout,
        "skipped": skipped,
        "file_list_sha256": hashlib.sha256("\n".join(r for r, _ in files).encode()).hexdigest(),
        "content_sha256": content.hexdigest(),
    }


def corpus_token_counts(tokenizer, vocab_size: int, ccfg: Any = None):
    """How often each token id occurs in the zoo's training files (the stdlib ``.py`` files outside
    the held-out split, :func:`build_corpus` with ``ccfg``, default the recipes' corpus config) as
    ``tokenizer`` encodes them, special tokens left out: int64 ``[vocab_size]`` (ids the tokenizer
    never produces count 0). About 2.7M tokens, ~10 s on one CPU thread.

    Raises: ValueError when the tokenizer produces ids >= ``vocab_size``, and :func:`build_corpus`'s."""
    import torch

    from .config import MedusaCorpusConfig

    corpus = build_corpus(ccfg if ccfg is not None else OmegaConf.structured(MedusaCorpusConfig))
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in _encode(tokenizer, [t for _, t in corpus["train"]]):
        ids = torch.tensor(ids, dtype=torch.long)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"the tokenizer produces id {int(ids.max())}, outside the model's vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


# ------------------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, min_frequency: int, model_max_length: int):
    """Byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast`` whose encodings start
    with ``<bos>`` (``add_special_tokens=True``), pad/bos/eos = ids 0/1/2, left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        model_max_length=model_max_length, padding_side="left",
    )


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Ids without specials, through the Rust tokenizer (parallel)."""
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


# ----------------------------------------------------------------------------- held-out data


def _spread_order(key: str, rel: str) -> str:
    return hashlib.sha256(f"{key}:{rel}".encode()).hexdigest()


def make_heldout_sample(tokenizer, heldout: list[tuple[str, str]], num_files: int, tokens: int) -> list[dict]:
    """``num_files`` held-out files with at least ``tokens - 1`` tokens (chosen in a fixed
    hash order); each row: relpath, input_ids = [<bos>] + the file's first ``tokens - 1`` ids,
    text = those ids decoded."""
    ids = _encode(tokenizer, [t for _, t in heldout])
    cands = [(rel, i) for (rel, _), i in zip(heldout, ids) if len(i) >= tokens - 1]
    cands.sort(key=lambda c: _spread_order("heldout", c[0]))
    rows = []
    for rel, i in cands[:num_files]:
        seq = [tokenizer.bos_token_id] + i[: tokens - 1]
        rows.append({"id": f"heldout-{len(rows):02d}", "source": rel, "num_tokens": len(seq),
                     "input_ids": seq, "text": tokenizer.decode(seq[1:])})
    if not rows:
        raise ValueError(f"no held-out file has {tokens} tokens")
    return rows


def _line_cut(text: str, offsets: list[tuple[int, int]], start_char: int, start_tok: int, budget: int) -> int:
    """Largest line-boundary char position p > start_char with at most ``budget`` tokens in
    text[start_char:p] (estimated from the full-text offsets), or start_char if none."""
    best = start_char
    pos = start_char
    n = len(offsets)
    t = start_tok
    while True:
        nl = text.find("\n", pos)
        if nl < 0:
            p = len(text)
        else:
            p = nl + 1
        while t < n and offsets[t][0] < p:
            t += 1
        if t - start_tok > budget:
            break
        best = p
        if p >= len(text):
            break
        pos = p
    return best


def make_prompt_sets(tokenizer, heldout: list[tuple[str, str]], sets: Any, continuation_tokens: int,
                     min_fill: float) -> dict[str, list[dict]]:
    """Code-completion prompts from held-out files: for each set (target T tokens, count C),
    files are taken in a fixed hash order; the prompt is the file's longest line-aligned prefix
    of at most T tokens (``<bos>`` not counted; at least ``min_fill * T``), the continuation
    the following line-aligned text of at most ``continuation_tokens`` tokens as counted in the
    whole file's tokenization (tokenized alone it can be a token or two longer; at least a
    quarter of the budget). Rows: id, set, source, prompt, continuation, prompt_tokens (with the
    ``<bos>`` the tokenizer prepends), continuation_tokens."""
    backend = tokenizer.backend_tokenizer
    encs = backend.encode_batch([t for _, t in heldout], add_special_tokens=False)
    out: dict[str, list[dict]] = {}
    for key, spec in sets.items():
        target, count = int(spec["tokens"]), int(spec["count"])
        order = sorted(range(len(heldout)), key=lambda j: _spread_order(f"prompts-{key}", heldout[j][0]))
        rows: list[dict] = []
        for j in order:
            if len(rows) >= count:
                break
            rel, text = heldout[j]
            offs = encs[j].offsets
            if len(offs) < target * min_fill + continuation_tokens // 4:
                continue
            p = _line_cut(text, offs, 0, 0, target)
            # the estimate counts tokens of the full text; re-tokenize the prefix for the exact count
            while p > 0 and len(backend.encode(text[:p], add_special_tokens=False).ids) > target:
                p = text.rfind("\n", 0, p - 1) + 1
            prompt = text[:p]
            n_prompt = len(backend.encode(prompt, add_special_tokens=False).ids)
            if n_prompt < target * min_fill:
                continue
            t0 = next((t for t, o in enumerate(offs) if o[0] >= p), len(offs))
            q = _line_cut(text, offs, p, t0, continuation_tokens)
            cont = text[p:q]
            n_cont = len(backend.encode(cont, add_special_tokens=False).ids)
            if n_cont < continuation_tokens // 4:
                continue
            rows.append({"id": f"code_{key}-{len(rows):02d}", "set": key, "source": rel, "prompt": prompt,
                         "continuation": cont, "prompt_tokens": n_prompt + 1, "continuation_tokens": n_cont})
        out[key] = rows
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------- models


def build_model(mcfg: dict, vocab_size: int):
    """A freshly initialised model from a ``models.<name>`` config entry (plain dict)."""
    import transformers

    if mcfg["class"] not in MODEL_CLASSES or mcfg["config_class"] not in CONFIG_CLASSES:
        raise ValueError(f"unsupported class {mcfg['class']}/{mcfg['config_class']}; known: {MODEL_CLASSES}")
    kwargs = dict(mcfg["config"])
    kwargs.update(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, mcfg["config_class"])(**kwargs)
    return getattr(transformers, mcfg["class"])(config)


def heldout_loss(model, sample: list[dict]) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over the held-out sample rows, computed
    in the model's dtype on its device with the logits upcast to fp32; one sequence at a time."""
    import torch
    import torch.nn.functional as F

    dev = next(model.parameters()).device
    by_len: dict[int, list[list[int]]] = {}
    for row in sample:  # rows of equal length go through in one batch (no padding anywhere)
        by_len.setdefault(len(row["input_ids"]), []).append(row["input_ids"])
    total, count = 0.0, 0
    with torch.no_grad():
        for seqs in by_len.values():
            ids = torch.tensor(seqs, dtype=torch.long, device=dev)
            logits = model(input_ids=ids, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += ids.numel() - ids.shape[0]
    return total / count


def _lr_lambda(warmup: int, steps: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def train_one(job: dict) -> dict:
    """Train one model (runs in its own process in parallel mode). ``job`` is plain data:
    name, model (config entry), train (merged train settings), seed, device, vocab_size,
    train_stream / heldout_stream (paths to int32 token tensors), save_dir, log_path, threads.
    Saves the bf16 model to save_dir and returns the training record."""
    import torch

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    name, tc = job["name"], job["train"]
    logf = open(job["log_path"], "a", buffering=1)

    def log(msg: str) -> None:
        line = f"[{name} {time.strftime('%H:%M:%S')}] {msg}"
        logf.write(line + "\n")
        print(line, flush=True)

    device = torch.device(job["device"])
    torch.manual_seed(job["seed"])
    model = build_model(job["model"], job["vocab_size"]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    stream = torch.load(job["train_stream"])
    L, B, steps = int(tc["seq_len"]), int(tc["batch_size"]), int(tc["steps"])
    if len(stream) <= L + 1:
        raise ValueError(f"training stream too short ({len(stream)} tokens) for seq_len {L}")
    gen = torch.Generator().manual_seed(job["seed"] + 1)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(tc["weight_decay"])}, {"params": no_decay, "weight_decay": 0.0}],
        lr=float(tc["lr"]), betas=tuple(tc["betas"]), eps=1e-8, fused=device.type == "cuda",
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(int(tc["warmup_steps"]), steps, float(tc["min_lr_ratio"])))
    use_bf16 = bool(tc["bf16"]) and device.type == "cuda"
    arange = torch.arange(L)
    log(f"{job['model']['class']} params={n_params} steps={steps} batch={B}x{L} device={device} bf16={use_bf16}")

    model.train()
    losses: list[torch.Tensor] = []
    logged: list[float] = []
    t0 = time.time()
    stopped_early = False
    step = 0
    for step in range(steps):
        starts = torch.randint(0, len(stream) - L, (B,), generator=gen)
        x = stream[starts[:, None] + arange].long()
        x = x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(tc["grad_clip"]))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if (step + 1) % int(tc["log_every"]) == 0 or step + 1 == steps:
            vals = torch.stack(losses).float().cpu().tolist()
            logged.extend(vals)
            losses = []
            el = time.time() - t0
            log(f"step {step + 1}/{steps} loss {sum(vals) / len(vals):.4f} lr {sched.get_last_lr()[0]:.2e} "
                f"{el:.1f}s {(step + 1) * B * L / el:.0f} tok/s")
            if el > float(tc["time_budget_s"]) and step + 1 < steps:
                log(f"time budget {tc['time_budget_s']}s reached: stopping early at step {step + 1}")
                stopped_early = True
                break
    if losses:
        logged.extend(torch.stack(losses).float().cpu().tolist())
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t0
    done = step + 1
    tail = logged[-100:]
    train_loss = sum(tail) / len(tail)

    # bf16 loss over held-out split windows, on the training device (a larger, cheaper check)
    model.eval()
    hstream = torch.load(job["heldout_stream"])
    nwin = min(int(tc["heldout_split_windows"]), len(hstream) // L)
    split_loss = None
    if nwin > 0:
        wins = hstream[: nwin * L].view(nwin, L).long()
        tot = 0.0
        with torch.no_grad():
            for i in range(0, nwin, B):
                xb = wins[i: i + B].to(device)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    tot += model(input_ids=xb, labels=xb, use_cache=False).loss.item() * xb.shape[0]
        split_loss = tot / nwin

    save_dir = Path(job["save_dir"])
    if save_dir.exists():
        shutil.rmtree(save_dir)
    model.to(torch.bfloat16).save_pretrained(str(save_dir))
    if not (save_dir / "model.safetensors").is_file():
        raise RuntimeError(f"{save_dir}: save_pretrained wrote no model.safetensors: {os.listdir(save_dir)}")
    rec = {
        "class": job["model"]["class"],
        "config_class": job["model"]["config_class"],
        "parameters": n_params,
        "seed": job["seed"],
        "steps": done,
        "planned_steps": steps,
        "stopped_early": stopped_early,
        "batch_size": B,
        "seq_len": L,
        "tokens_seen": done * B * L,
        "lr": float(tc["lr"]),
        "train_loss": train_loss,
        "heldout_split_loss_bf16": split_loss,
        "heldout_split_windows": nwin,
        "train_seconds": round(train_s, 2),
        "tokens_per_second": round(done * B * L / train_s, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    log(f"done: {json.dumps(rec)}")
    logf.close()
    with open(job["result_path"], "w") as f:
        json.dump(rec, f)
    return rec


# --------------------------------------------------------------------------------------- main


def _pack(tokenizer, files: list[tuple[str, str]]):
    """[<bos>] ids [<eos>] per file, concatenated in order, as an int32 tensor."""
    import torch

    out: list[int] = []
    for ids in _encode(tokenizer, [t for _, t in files]):
        out.append(tokenizer.bos_token_id)
        out.extend(ids)
        out.append(tokenizer.eos_token_id)
    return torch.tensor(out, dtype=torch.int32)


def run(cfg: DictConfig) -> dict:
    """Run the whole recipe; returns the manifest (also written to ``<out_dir>/zoo/MANIFEST.json``)."""
    import torch
    import tokenizers
    import transformers

    t_start = time.time()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    unknown = [m for m in cfg.models_to_train if m not in cfg.models]
    if unknown:
        raise ValueError(f"unknown models {unknown}; known: {list(cfg.models)}")
    out_dir = recipe_out_root(cfg)
    zoo_dir, data_dir = out_dir / "zoo", out_dir / "data"
    zoo_dir.mkdir(parents=True, exist_ok=True)
    own_work = cfg.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="train_zoo_")) if own_work else Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    log_dir = Path(cfg.log_dir) if cfg.log_dir else work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    device = str(cfg.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available (use device=cpu)")
    batch_scale = min(1.0, float(cfg.batch_scale))
    corpus_scale = min(1.0, float(cfg.corpus_scale))

    # 1. corpus
    corpus = build_corpus(cfg.corpus)
    train_files = corpus["train"]
    if corpus_scale < 1.0:
        keep = max(int(cfg.corpus.min_train_files), math.ceil(len(train_files) * corpus_scale))
        train_files = sorted(train_files, key=lambda f: _spread_order("corpus", f[0]))[:keep]
        train_files.sort()
    _log(f"corpus: {len(corpus['files'])} files ({len(corpus['train'])} train, {len(corpus['heldout'])} held out, "
         f"{len(train_files)} used) from {corpus['root']}, python {platform.python_version()}")

    # 2. tokenizer
    tok_dir = zoo_dir / "tokenizer"
    if cfg.reuse_tokenizer and (tok_dir / "tokenizer.json").is_file():
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(tok_dir), local_files_only=True)
        _log(f"tokenizer: reused {tok_dir}")
    else:
        tokenizer = train_tokenizer([t for _, t in train_files], int(cfg.tokenizer.vocab_size),
                                    int(cfg.tokenizer.min_frequency), int(cfg.tokenizer.model_max_length))
        if tok_dir.exists():
            shutil.rmtree(tok_dir)
        tokenizer.save_pretrained(str(tok_dir))
    vocab = len(tokenizer)
    _log(f"tokenizer: vocab {vocab} ({time.time() - t_start:.1f}s)")

    # 3. data: held-out sample, prompt sets, token streams
    sample = make_heldout_sample(tokenizer, corpus["heldout"], int(cfg.heldout.num_files), int(cfg.heldout.tokens))
    _write_jsonl(data_dir / "heldout_sample.jsonl", sample)
    psets = make_prompt_sets(tokenizer, corpus["heldout"], cfg.prompts.sets, int(cfg.prompts.continuation_tokens),
                             float(cfg.prompts.min_fill))
    for key, rows in psets.items():
        _write_jsonl(data_dir / "prompts" / f"code_{key}.jsonl", rows)
    train_stream = _pack(tokenizer, train_files)
    heldout_stream = _pack(tokenizer, corpus["heldout"])
    torch.save(train_stream, work / "train_stream.pt")
    torch.save(heldout_stream, work / "heldout_stream.pt")
    _log(f"data: train stream {len(train_stream)} tokens, held-out {len(heldout_stream)} tokens, "
         f"prompts {({k: len(v) for k, v in psets.items()})} ({time.time() - t_start:.1f}s)")

    # 4. models
    jobs = []
    for i, name in enumerate(cfg.models_to_train):
        mc = OmegaConf.to_container(cfg.models[name], resolve=True)
        tc = OmegaConf.to_container(cfg.train, resolve=True)
        tc.update(mc.get("train") or {})
        tc["steps"] = max(1, round(int(tc["steps"]) * float(cfg.steps_scale)))
        tc["batch_size"] = max(1, round(int(tc["batch_size"]) * batch_scale))
        tc["warmup_steps"] = max(1, min(int(tc["warmup_steps"]), tc["steps"] // 10))
        tc["heldout_split_windows"] = max(1, round(int(tc["heldout_split_windows"]) * batch_scale))
        jobs.append({
            "name": name, "model": mc, "train": tc, "seed": int(cfg.seed) + 1000 * (list(cfg.models).index(name) + 1),
            "device": device, "vocab_size": vocab,
            "train_stream": str(work / "train_stream.pt"), "heldout_stream": str(work / "heldout_stream.pt"),
            "save_dir": str(zoo_dir / name), "log_path": str(log_dir / f"{name}.log"),
            "result_path": str(work / f"{name}.result.json"),
            "threads": int(cfg.threads_per_worker),
        })
    parallel = (device.startswith("cuda")) if str(cfg.parallel) == "auto" else bool(cfg.parallel)
    t_train = time.time()
    if parallel and len(jobs) > 1:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=train_one, args=(j,), name=j["name"]) for j in jobs]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [p.name for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"training failed for {bad}; see logs in {log_dir}")
        records = {j["name"]: json.loads(Path(j["result_path"]).read_text()) for j in jobs}
    else:
        records = {j["name"]: train_one(j) for j in jobs}
    train_wall = time.time() - t_train
    _log(f"training wall time {train_wall:.1f}s")

    # 5. evaluation from the saved bf16 weights, fp32 on the CPU, and the manifest
    man_path = zoo_dir / "MANIFEST.json"
    old = json.loads(man_path.read_text()) if man_path.is_file() else {}
    tok_hashes = {f.name: _sha256_file(f) for f in sorted(tok_dir.iterdir()) if f.is_file()}
    models_out = {}
    if old.get("tokenizer", {}).get("sha256") == tok_hashes:  # keep models trained on this tokenizer before
        models_out.update({k: v for k, v in old.get("models", {}).items() if k not in records})
    for name, rec in records.items():
        cls = getattr(transformers, rec["class"])
        m = cls.from_pretrained(str(zoo_dir / name), dtype=torch.float32, local_files_only=True,
                                use_safetensors=True).eval()
        rec["heldout_loss"] = heldout_loss(m, sample)
        rec["heldout_loss_dtype"] = "float32 (bf16 weights upcast), cpu"
        rec["files"] = {f.name: _sha256_file(f) for f in sorted((zoo_dir / name).iterdir())
                        if f.suffix == ".safetensors"}
        rec["bytes"] = sum(f.stat().st_size for f in (zoo_dir / name).iterdir() if f.is_file())
        models_out[name] = rec
        _log(f"{name}: heldout_loss {rec['heldout_loss']:.4f} train_loss {rec['train_loss']:.4f} "
             f"params {rec['parameters']} steps {rec['steps']} tokens {rec['tokens_seen']}")
        del m
    manifest = {
        "format": 1,
        "recipe": {"module": MODULE, "config": resolved, "argv": sys.argv[1:]},
        "seed": int(cfg.seed),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python_version": platform.python_version(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "platform": platform.platform(),
        "corpus": {
            "source": f"CPython {platform.python_version()} standard library .py files",
            "stdlib_dir": corpus["root"],
            "file_list_sha256": corpus["file_list_sha256"],
            "content_sha256": corpus["content_sha256"],
            "num_files": len(corpus["files"]),
            "num_train_files": len(corpus["train"]),
            "num_train_files_used": len(train_files),
            "num_heldout_files": len(corpus["heldout"]),
            "skipped_files": corpus["skipped"],
            "heldout_rule": f"int(sha256(relpath).hexdigest(), 16) % {cfg.corpus.heldout_mod} == 0",
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
        },
        "tokenizer": {"path": "tokenizer", "vocab_size": vocab, "sha256": tok_hashes,
                      "special_tokens": {s: i for i, s in enumerate(SPECIAL_TOKENS)},
                      "adds_bos": True},
        "heldout_sample": {"path": "data/heldout_sample.jsonl", "num_sequences": len(sample),
                           "tokens_per_sequence": int(cfg.heldout.tokens),
                           "sha256": _sha256_file(data_dir / "heldout_sample.jsonl"),
                           "loss": "mean next-token cross-entropy in nats over all positions"},
        "prompts": {k: {"path": f"data/prompts/code_{k}.jsonl", "count": len(v),
                        "target_tokens": int(cfg.prompts.sets[k]["tokens"]),
                        "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in v) / max(1, len(v)), 1)}
                    for k, v in psets.items()},
        "training_wall_seconds": round(train_wall, 1),
        "parallel": parallel,
        "models": {k: models_out[k] for k in sorted(models_out, key=lambda n: (MODEL_NAMES + (n,)).index(n))},
    }
    man_path.write_text(json.dumps(manifest, indent=2) + "\n")
    _log(f"wrote {man_path} ({time.time() - t_start:.1f}s total)")
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return manifest
