"""The MTP recipe: multi-token-prediction layers for a frozen zoo target, stored in its checkpoint.

A checkpoint of Qwen3.5 or Nemotron-H ships MTP layers under ``mtp.*`` next to the target's
weights (:mod:`specdec.drafters.mtp`). This recipe trains such layers for a zoo target and writes
them into the target's own checkpoint, with the config fields a real checkpoint carries, so
``specdec.zoo.load(target)`` then ``specdec.wrap(model, drafter="mtp")`` takes the path a hub
checkpoint takes.

Stages (deterministic given the config, the zoo and the Python standard library on the machine):

1. corpus and hidden states: as the Medusa recipe (:func:`~specdec.experiments.train_medusa.training_windows`,
   the zoo's held-out files excluded; the frozen fp32 target's final hidden states of every window).
2. training: the MTP at entry t takes the target's hidden state h_t and the token x_{t+1} and is
   trained to predict token t + 2, as the models' authors train their MTP modules (DeepSeek-AI
   2024, DeepSeek-V3 section 2.2; labels: the target's own greedy tokens, ``train.labels=target``,
   its whole distributions with ``train.soft_labels=true``, or the corpus). With ``train.chain_steps`` = S > 1 the MTP also runs its drafting recursion
   S - 1 more times, as :class:`~specdec.drafters.MTPDrafter` drafts: step k of the chain that
   starts at t takes step k - 1's output and the token x_{t+k} at position t + k - 1 and predicts
   token t + k + 1; its attention sees the step-1 entries up to t and its own chain's entries,
   exactly the cache it has when drafting (:func:`chain_outputs`). The loss is the sum over steps
   of the cross-entropy at ``train.batch_positions`` random positions per step.
3. evaluation and files: per-step top-1 accuracy on the shipped held-out sample (against the
   text, and against the target's greedy token: step 1's is the rate greedy verification
   accepts d_1 there) with the saved weights; the layers are written into
   ``<out>/zoo/<target>/model.safetensors`` (:func:`~specdec.drafters.mtp.write_mtp_tensors`;
   every other tensor checked unchanged) and recorded under ``models.<target>.mtp`` of
   ``<out>/zoo/MANIFEST.json`` with the file's new sha256 (Medusa heads of that target keep
   matching it: their ``target_files`` follow).

Run: ``python -m specdec experiment=train_mtp [target=mamba2-target]`` (config
``conf/experiment/train_mtp.yaml``). CPU smoke run (seconds):
``... data.tokens=4096 data.seq_len=128 train.steps=3 out_dir=/tmp/mtp``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from .config import recipe_out_root
from .train_medusa import (collect_hidden_states, environment_fields, fit, setup_run, target_predictions,
                           training_windows)

MODULE = "specdec.experiments.train_mtp"

__all__ = ["run", "chain_outputs", "mtp_loss", "fit_mtp", "mtp_accuracy", "init_from_target"]


def _log(msg: str) -> None:
    print(f"[train_mtp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class _ChainKV:
    """What the MTP's attention calls as its cache while training (HF ``Cache.update``): every call
    of a layer appends its keys / values, and the layer attends to all of them (the mask of
    :func:`chain_outputs` says which)."""

    def __init__(self):
        self.kv: dict[int, list] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        seen = self.kv.setdefault(layer_idx, [])
        seen.append((key_states, value_states))
        return torch.cat([k for k, _ in seen], dim=2), torch.cat([v for _, v in seen], dim=2)


def chain_outputs(drafter, hidden: torch.Tensor, ids: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
    """The MTP's outputs of drafting steps 1..``num_steps`` for every chain start of the windows.

    Args:
        drafter: a :class:`~specdec.drafters.MTPDrafter` (its layers, the target's embedding and
            rotary embedding). hidden: ``[W, L, D]`` the target's final hidden states of ``ids [W, L]``.

    Returns: ``num_steps`` tensors ``[W, L - 1, D]``: entry t of step k is the output of the chain
    started at position t after k steps (it scores token t + k + 1; meaningful for t + k + 1 < L).
    Step 1 runs (h_t, x_{t+1}) at position t, causally; step k > 1 runs (step k - 1's output,
    x_{t+k}) at position t + k - 1 and attends to the step-1 entries up to t and to its own
    chain's entries of the steps before it that ran the same MTP layer, as in drafting.
    """
    W, L, _ = hidden.shape
    T = L - 1
    t = torch.arange(T, device=hidden.device)
    neg = torch.finfo(hidden.dtype).min
    zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
    causal = torch.where(t[None, :] <= t[:, None], zero, neg)  # step-1 entries up to the chain's start
    own = torch.where(t[None, :] == t[:, None], zero, neg)  # the chain's own entry of an earlier step
    n = drafter.layers.num_steps
    kv = _ChainKV()
    outs, h = [], hidden[:, :T]
    for k in range(1, num_steps + 1):
        same = [s for s in range(1, k + 1) if (s - 1) % n == (k - 1) % n]  # the steps this step's layer ran
        mask = torch.cat([causal if s == 1 else own for s in same], dim=1)[None, None].expand(W, 1, T, T * len(same))
        pos = (t + k - 1)[None].expand(W, T)
        x = drafter.embed(ids[:, (t + k).clamp(max=L - 1)])
        h = drafter.layers(x, h.to(x.dtype), k - 1, position_embeddings=drafter.position_embeddings(x, pos),
                           attention_mask=mask, position_ids=pos, cache=kv)
        outs.append(h)
    return outs


def mtp_loss(drafter, hidden: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor | None, num_steps: int,
             batch_positions: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over drafting steps of the cross-entropy of step k's logits against token t + k + 1, at
    ``batch_positions`` random chain starts per step: against ``labels [W, L]`` (the text, or the
    target's greedy tokens), or with ``labels=None`` against the target's own distribution of that
    token, ``softmax(lm_head(hidden[t + k]))`` (self-distillation with soft labels: the KL
    divergence up to a constant). Returns ``(loss, per_step [num_steps])``."""
    W, L = ids.shape
    per = []
    for k, out in enumerate(chain_outputs(drafter, hidden, ids, num_steps), start=1):
        valid = L - 1 - k  # chain starts t with a label at t + k + 1 <= L - 1
        flat = torch.randint(0, W * valid, (min(batch_positions, W * valid),), generator=generator).to(ids.device)
        w, t = flat // valid, flat % valid
        logits = drafter.adapter.logits(out[w, t]).float()
        if labels is None:
            with torch.no_grad():
                p = torch.softmax(drafter.adapter.logits(hidden[w, t + k]).float(), dim=-1)
            per.append(-(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean())
        else:
            per.append(F.cross_entropy(logits, labels[w, t + k + 1]))
    per = torch.stack(per)
    return per.sum(), per


def fit_mtp(drafter, hidden: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor | None, *, steps: int,
            chain_steps: int = 1, batch_windows: int = 4, batch_positions: int = 1024, **kw) -> dict:
    """Train ``drafter.layers`` (the target frozen) on windows ``ids [W, L]`` with the target's
    hidden states ``hidden [W, L, D]`` and ``labels [W, L]`` (None: the target's distributions):
    each step draws ``batch_windows`` windows and scores :func:`mtp_loss` over ``chain_steps``
    drafting steps; ``kw`` as :func:`~specdec.experiments.train_medusa.fit`. Returns its dict
    (train_loss_per_step, history with loss_per_step, ...) and positions_seen."""
    dev = next(drafter.layers.parameters()).device
    W = ids.shape[0]
    bw = min(batch_windows, W)

    def batch_loss(gen):
        pick = torch.randperm(W, generator=gen)[:bw]
        return mtp_loss(drafter, hidden[pick].to(dev), ids[pick].to(dev),
                        None if labels is None else labels[pick].to(dev), chain_steps, batch_positions, gen)

    drafter.layers.requires_grad_(True)
    out = fit(drafter.layers, batch_loss, steps=steps, part="step", **kw)
    drafter.layers.requires_grad_(False)
    return {**out, "positions_seen": out["steps"] * chain_steps * batch_positions}


@torch.no_grad()
def mtp_accuracy(drafter, hidden: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, num_steps: int) -> dict:
    """Per drafting step k, the top-1 accuracy of the MTP's prediction of token t + k + 1 against
    ``labels [W, L]`` over every chain start that has one (one window at a time); returns
    ``{"top1": [num_steps], "positions": [num_steps]}``."""
    hits, counts = [0.0] * num_steps, [0] * num_steps
    dev = next(drafter.layers.parameters()).device
    for w in range(ids.shape[0]):
        outs = chain_outputs(drafter, hidden[w: w + 1].to(dev), ids[w: w + 1].to(dev), num_steps)
        L = ids.shape[1]
        for k, out in enumerate(outs, start=1):
            T = L - 1 - k
            if T < 1:
                continue
            pred = drafter.adapter.logits(out[0, :T]).argmax(-1)
            hits[k - 1] += (pred == labels[w, k + 1: k + 1 + T].to(dev)).float().sum().item()
            counts[k - 1] += T
    return {"top1": [h / c if c else None for h, c in zip(hits, counts)], "positions": counts}


def init_from_target(layers, model) -> list[int]:
    """Copy into each MTP decoder layer the weights of the target's last layer of the same kind
    (``block_type``) whose weights have the same names and shapes (EAGLE's initialisation of its
    draft layer); returns the target layer copied into each MTP layer (-1: none fits)."""
    body = getattr(model, "model", None) or getattr(model, "backbone", None)
    source = []
    for layer in layers.layers:
        want = {k: v.shape for k, v in layer.state_dict().items()}
        match = -1
        for i, cand in enumerate(body.layers):
            have = {k: v.shape for k, v in cand.state_dict().items()}
            if getattr(cand, "block_type", None) == layer.block_type and have == want:
                match = i
        if match >= 0:
            layer.load_state_dict(body.layers[match].state_dict())
        source.append(match)
    return source


# --------------------------------------------------------------------------------------- main


def _target_dir(zoo, zoo_dir: Path, name: str) -> Path:
    """The target's checkpoint folder the layers go into: the package's, or a copy under ``out_dir``
    (with the tokenizer and their manifest entries, so ``zoo.load(name, root=...)`` reads it) so
    the package is left as it is."""
    folder = zoo_dir / name
    if Path(zoo.path(name)).resolve() != folder.resolve():
        shipped = zoo.manifest()
        for sub in (name, "tokenizer"):
            if (zoo_dir / sub).exists():
                shutil.rmtree(zoo_dir / sub)
            shutil.copytree(zoo.path(sub), zoo_dir / sub)
        man_path = zoo_dir / "MANIFEST.json"
        man = json.loads(man_path.read_text()) if man_path.is_file() else {"format": 1}
        man.setdefault("models", {})[name] = shipped["models"][name]
        man["tokenizer"] = shipped["tokenizer"]
        man_path.write_text(json.dumps(man, indent=2) + "\n")
    return folder


def run(cfg: DictConfig) -> dict:
    """Run the recipe; returns the manifest record (also in ``<out>/zoo/MANIFEST.json``)."""
    from safetensors.torch import load_file

    from .. import zoo
    from ..drafters.mtp import MTPDrafter, mtp_layers_for, write_mtp_tensors

    t_start = time.time()
    resolved, device = setup_run(cfg)
    tc = cfg.train
    if int(tc.steps) < 1 or int(tc.batch_positions) < 1 or int(tc.batch_windows) < 1 or int(tc.chain_steps) < 1:
        raise ValueError("train.steps, train.batch_positions, train.batch_windows and train.chain_steps must be >= 1")
    if int(tc.chain_steps) + 2 > int(cfg.data.seq_len):
        raise ValueError(f"train.chain_steps={tc.chain_steps} needs data.seq_len > {int(tc.chain_steps) + 1}")
    storage = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(cfg.mtp.storage_dtype))
    if storage is None:
        raise ValueError(f"mtp.storage_dtype must be float32, bfloat16 or float16; got {str(cfg.mtp.storage_dtype)!r}")
    labels_kind = str(tc.labels)
    if labels_kind not in ("target", "corpus"):
        raise ValueError(f"train.labels must be corpus or target, got {labels_kind!r}")
    if tc.soft_labels and labels_kind != "target":
        raise ValueError("train.soft_labels=true distils the target's distributions: it needs train.labels=target")
    torch.manual_seed(int(cfg.seed))
    progress = bool(cfg.progress)

    # 1. target (frozen), the MTP config fields, corpus windows, hidden states, labels
    name = str(cfg.target)
    model, tokenizer = zoo.load(name, device=device, dtype=torch.float32)
    model.requires_grad_(False)
    fields = dict(OmegaConf.to_container(cfg.mtp.config, resolve=True).get(name, {}) or {})
    for key, value in fields.items():
        if not hasattr(model.config, key):
            raise ValueError(f"mtp.config.{name}.{key}: {type(model.config).__name__} has no field {key!r}")
        setattr(model.config, key, value)
    layers = mtp_layers_for(model, num_steps=int(cfg.mtp.num_layers))
    layers.init_weights(model)  # the family's own initialisation (transformers' _init_weights)
    copied = init_from_target(layers, model) if cfg.mtp.init_from_target else None
    if copied is not None:
        _log(f"MTP layers initialised from target layers {copied} (-1: none of the same kind and shapes)")
    drafter = MTPDrafter(model, layers)
    windows, corpus_rec = training_windows(cfg, tokenizer, log=_log)
    t0 = time.time()
    hidden = collect_hidden_states(model, windows, int(cfg.data.batch_windows), progress)
    hidden_s = time.time() - t0
    _log(f"hidden states: {windows.numel()} tokens in {hidden_s:.1f}s ({device}, {torch.get_num_threads()} thread(s))")
    labels = target_predictions(model, hidden, windows) if labels_kind == "target" else windows
    if tc.soft_labels:  # the target's whole distribution of each token instead of its greedy choice
        labels = None

    # 2. training
    S = int(tc.chain_steps)
    trained = fit_mtp(drafter, hidden, windows, labels, steps=int(tc.steps), chain_steps=S,
                      batch_windows=int(tc.batch_windows), batch_positions=int(tc.batch_positions), lr=float(tc.lr),
                      weight_decay=float(tc.weight_decay), betas=tuple(tc.betas), warmup_steps=int(tc.warmup_steps),
                      min_lr_ratio=float(tc.min_lr_ratio), grad_clip=float(tc.grad_clip),
                      log_every=int(tc.log_every), seed=int(cfg.seed) + 1, time_budget_s=tc.time_budget_s,
                      progress=progress, log=_log)
    del hidden

    # 3. into the target's checkpoint; reload it as a user would; evaluate; manifest
    out_root = recipe_out_root(cfg)
    zoo_dir = out_root / "zoo"
    folder = _target_dir(zoo, zoo_dir, name)
    weights = folder / "model.safetensors"
    before = load_file(str(weights))
    write_mtp_tensors(layers, folder, dtype=storage, config_fields=fields)
    after = load_file(str(weights))
    unchanged = all(k in after and torch.equal(after[k], v) for k, v in before.items() if not k.startswith("mtp."))
    if not unchanged:
        raise RuntimeError(f"writing the MTP tensors changed other tensors of {weights}")
    man_path = zoo_dir / "MANIFEST.json"
    man = json.loads(man_path.read_text())
    entry = man["models"][name]
    old_files = dict(entry["files"])
    entry["files"] = {"model.safetensors": zoo._sha256(weights)}
    entry["bytes"] = weights.stat().st_size
    for heads in man.get("medusa", {}).values():  # the target's weights are unchanged: its heads still fit
        if heads.get("target") == name and heads.get("target_files") == old_files:
            heads["target_files"] = dict(entry["files"])
    man_path.write_text(json.dumps(man, indent=2) + "\n")

    # the held-out figures in fp32 on the CPU whatever the training device, so that they are
    # reproducible anywhere (the zoo's tests recompute them there)
    reloaded, _ = zoo.load(name, device="cpu", dtype=torch.float32, root=zoo_dir)
    saved = MTPDrafter.for_model(reloaded)  # what specdec.wrap(model, drafter="mtp") builds
    sample = zoo.heldout_sample()
    held_ids = torch.tensor([r["input_ids"] for r in sample], dtype=torch.long)
    held_hidden = collect_hidden_states(reloaded, held_ids, int(cfg.data.batch_windows), progress=False)
    ev = mtp_accuracy(saved, held_hidden, held_ids, held_ids, S)
    agree = mtp_accuracy(saved, held_hidden, held_ids, target_predictions(reloaded, held_hidden, held_ids), S)
    _log("held-out top-1 per step " + " ".join(f"{a:.4f}" for a in ev["top1"]) + "; agreement with the target's "
         "greedy token " + " ".join(f"{a:.4f}" for a in agree["top1"]))
    record = {
        "class": f"specdec.drafters.mtp.{type(layers).__name__}",
        "count_field": layers.count_field,
        "num_layers": layers.num_steps,
        "config_fields": {layers.count_field: layers.num_steps, **fields},
        "initialised_from_target_layers": copied,
        "storage_dtype": str(storage).replace("torch.", ""),
        "parameters": sum(p.numel() for p in layers.parameters()),
        "recipe": {"module": MODULE, "config": resolved, "argv": sys.argv[1:]},
        "seed": int(cfg.seed),
        "steps": trained["steps"],
        "planned_steps": int(tc.steps),
        "stopped_early": trained["stopped_early"],
        "chain_steps": S,
        "batch_windows": int(tc.batch_windows),
        "batch_positions": int(tc.batch_positions),
        "positions_seen": trained["positions_seen"],
        "train_tokens": int(windows.numel()),
        "corpus": corpus_rec,
        "labels": labels_kind,
        "soft_labels": bool(tc.soft_labels),
        "train_loss_per_step": trained["train_loss_per_step"],
        "loss_history": trained["history"],
        "heldout_top1": [round(a, 4) for a in ev["top1"]],
        "heldout_target_agreement": [round(a, 4) for a in agree["top1"]],
        "heldout_positions": ev["positions"],
        "heldout_note": "step k at chain start t against token t+k+1 of the 8 x 512-token held-out sample "
                        "(heldout_top1: the text; heldout_target_agreement: the target's greedy token after the "
                        "text's prefix, step 1's is the rate greedy verification accepts d_1 there)",
        "other_tensors_unchanged": unchanged,
        "hidden_states_seconds": round(hidden_s, 1),
        "train_seconds": trained["seconds"],
        "total_seconds": round(time.time() - t_start, 1),
        **environment_fields(device),
    }
    man = json.loads(man_path.read_text())
    man["models"][name]["mtp"] = record
    man_path.write_text(json.dumps(man, indent=2) + "\n")
    _log(f"wrote the MTP layers into {weights} ({entry['bytes']} bytes) and {man_path}; {record['total_seconds']}s total")
    return record


def main() -> None:
    """``python -m specdec.experiments.train_mtp [overrides]``: the shared app with ``experiment=train_mtp``."""
    if not any(a.startswith("experiment=") for a in sys.argv[1:]):
        sys.argv.insert(1, "experiment=train_mtp")
    from .app import main as app_main

    app_main()


if __name__ == "__main__":
    main()
