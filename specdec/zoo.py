"""The small trained hybrid models that ship with specdec, their tokenizer and prompt sets.

Everything here is offline: files come from the package (``specdec/zoo/``, ``specdec/data/``),
never from a hub. The models were trained by ``specdec.experiments.train_zoo`` on the CPython
standard library sources; ``specdec/zoo/MANIFEST.json`` records the recipe, the corpus, and per
model its class, parameter count, steps, tokens seen, losses and the sha256 of its weights.

Models (``names()``):

=================  ===========================  ==============================================
name               class                        layers
=================  ===========================  ==============================================
``gdn-target``     ``Qwen3_5ForCausalLM``       8: Gated DeltaNet x 6 + gated attention x 2
``gdn-draft``      ``Qwen3_5ForCausalLM``       2: Gated DeltaNet + attention (a draft model)
``mamba2-target``  ``NemotronHForCausalLM``     14 blocks: Mamba-2 x 6, attention x 2, MLP x 6
``kda-target``     ``KimiLinearForCausalLM``    8: Kimi Delta Attention x 6 + MLA x 2
=================  ===========================  ==============================================

Medusa heads (``medusa_names()``), trained by ``specdec.experiments.train_medusa`` on the
frozen target's hidden states and recorded under ``medusa`` in the manifest: ``gdn-medusa``,
4 :class:`specdec.drafters.MedusaHeads` for ``gdn-target`` that project with its LM head (not
stored with them; :func:`load_medusa` binds it).

MTP layers: ``gdn-target`` and ``mamba2-target`` carry multi-token-prediction layers in their own
checkpoints, as Qwen3.5 and Nemotron-H releases do (``mtp.*`` tensors next to the target's, and
the config fields ``mtp_num_hidden_layers`` / ``num_nextn_predict_layers`` +
``mtp_layers_block_type``), trained by ``specdec.experiments.train_mtp`` on the frozen target and
recorded under ``models.<name>.mtp`` in the manifest; transformers ignores them when loading,
``specdec.wrap(model, drafter="mtp")`` drafts with them (:class:`specdec.drafters.MTPDrafter`).

All share one byte-level BPE tokenizer (vocabulary 8192; ``<pad>``/``<bos>``/``<eos>`` = 0/1/2;
encoding prepends ``<bos>``; left padding).

Example::

    import specdec.zoo
    model, tok = specdec.zoo.load("gdn-target")
    p = specdec.zoo.prompts("128", limit=1)[0]
    ids = tok(p["prompt"], return_tensors="pt").input_ids      # LongTensor [1, p["prompt_tokens"]]
    heads = specdec.zoo.load_medusa("gdn-medusa", target=model)  # MedusaHeads bound to model's LM head
    sd = specdec.wrap(model, drafter="mtp")                    # the checkpoint's own MTP layers
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

ZOO_DIR = Path(__file__).resolve().parent / "zoo"
DATA_DIR = Path(__file__).resolve().parent / "data"

_MODELS = ("gdn-target", "gdn-draft", "mamba2-target", "kda-target")
_MEDUSA = ("gdn-medusa",)
_CLASSES = ("Qwen3_5ForCausalLM", "NemotronHForCausalLM", "KimiLinearForCausalLM")
PROMPT_SETS = ("128", "1k", "4k")
_PROMPT_ALIASES = {"128": "128", "1k": "1k", "4k": "4k", "1024": "1k", "4096": "4k"}


def names() -> tuple[str, ...]:
    """The model names ``load`` accepts: ("gdn-target", "gdn-draft", "mamba2-target", "kda-target")."""
    return _MODELS


def medusa_names() -> tuple[str, ...]:
    """The Medusa heads ``load_medusa`` accepts: ("gdn-medusa",)."""
    return _MEDUSA


def _root(root: str | Path | None) -> Path:
    return Path(root) if root is not None else ZOO_DIR


def _check_name(name: str, allow_tokenizer: bool) -> None:
    known = _MODELS + _MEDUSA + (("tokenizer",) if allow_tokenizer else ())
    if name not in known:
        raise ValueError(f"unknown zoo name {name!r}; known names: {', '.join(known)}")


def manifest(root: str | Path | None = None) -> dict:
    """The parsed ``MANIFEST.json`` of the zoo folder ``root`` (default: the shipped zoo).

    Raises FileNotFoundError if the folder holds no manifest."""
    p = _root(root) / "MANIFEST.json"
    if not p.is_file():
        raise FileNotFoundError(f"no zoo manifest at {p}; the zoo is built by `python -m specdec.experiments.train_zoo`")
    return json.loads(p.read_text())


def path(name: str, root: str | Path | None = None) -> str:
    """Local folder of a zoo model, of Medusa heads or of the shared ``"tokenizer"``, as a string.

    A Medusa folder holds ``config.json`` and ``medusa_heads.safetensors`` (load with
    ``load_medusa``). A model folder holds ``config.json``, ``generation_config.json`` and ``model.safetensors``
    (bf16); load it with ``load`` (which checks its hash), or with the class in the manifest
    plus the tokenizer from ``path("tokenizer")``. Raises ValueError for an unknown name."""
    _check_name(name, allow_tokenizer=True)
    return str(_root(root) / name)


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verify(folder: Path, expected: dict[str, str], what: str, suffix: str | None) -> None:
    if not expected:
        raise ValueError(f"the zoo manifest lists no files for {what}")
    present = {p.name for p in folder.glob(f"*{suffix}")} if suffix else set()
    extra = present - set(expected)
    if extra:
        raise ValueError(f"{what}: {folder} holds files the manifest does not list: {sorted(extra)}")
    for fname, digest in expected.items():
        f = folder / fname
        if not f.is_file():
            raise ValueError(f"{what}: {f} is missing")
        got = _sha256(f)
        if got != digest:
            raise ValueError(f"{what}: sha256 mismatch for {f}: manifest says {digest}, file has {got}; "
                             "the file was modified or replaced (reinstall specdec or rerun the zoo recipe)")


def verify(name: str, root: str | Path | None = None) -> None:
    """Check the sha256 of ``name``'s files (model safetensors, Medusa heads files, or the tokenizer
    files) against the manifest. Raises ValueError on an unknown name, a missing, extra or
    mismatching file, or Medusa heads trained on other target weights than the zoo's."""
    _check_name(name, allow_tokenizer=True)
    man = manifest(root)
    folder = _root(root) / name
    if name == "tokenizer":
        _verify(folder, man["tokenizer"]["sha256"], "tokenizer", None)
        return
    if name in _MEDUSA:
        _medusa_entry(name, root)
        _verify(folder, man["medusa"][name]["files"], name, ".safetensors")
        return
    if name not in man.get("models", {}):
        raise ValueError(f"{name!r} is not in the zoo manifest at {_root(root)} (it lists {sorted(man.get('models', {}))})")
    _verify(folder, man["models"][name]["files"], name, ".safetensors")


def _medusa_entry(name: str, root: str | Path | None) -> dict:
    """The manifest entry of Medusa heads ``name``, checked against the manifest of their target:
    heads trained on other target weights raise ValueError."""
    man = manifest(root)
    entry = man.get("medusa", {}).get(name)
    if entry is None:
        raise ValueError(f"{name!r} is not in the zoo manifest at {_root(root)} (its medusa section lists "
                         f"{sorted(man.get('medusa', {}))}); train the heads with "
                         "`python -m specdec experiment=train_medusa`")
    target = entry.get("target")
    if target not in _MODELS:
        raise ValueError(f"{name}: manifest target {target!r} is not one of {_MODELS}")
    target_man = man if target in man.get("models", {}) else manifest(None)
    have = target_man.get("models", {}).get(target, {}).get("files")
    if have != entry.get("target_files"):
        raise ValueError(f"{name} was trained on {target} weights {entry.get('target_files')}, but the zoo's {target} "
                         f"is {have}; retrain the heads with `python -m specdec experiment=train_medusa`")
    return entry


def load_medusa(name: str = "gdn-medusa", target=None, device: str | torch.device | None = None,
                dtype: torch.dtype = torch.float32, root: str | Path | None = None):
    """Load shipped Medusa heads (:class:`specdec.drafters.MedusaHeads`), hash-checked and bound
    to their target's LM head, ready for ``specdec.drafters.MedusaDrafter(heads)``.

    Args:
        name: one of ``medusa_names()``.
        target: the loaded target model (its LM head is shared with the heads; its hidden size and
            vocabulary must match); None loads the zoo target named in the manifest (``gdn-target``).
        device: default the target's device. dtype: the heads' parameter dtype (default fp32).
        root: a zoo folder other than the shipped one (e.g. a recipe run's ``<out_dir>/zoo``); the
            target comes from it when its manifest has the target, else from the shipped zoo.

    Raises:
        ValueError: unknown name; files whose sha256 differs from the manifest; heads trained on
            other target weights than the zoo's; a target whose sizes do not fit the heads.
    """
    from .drafters.medusa import MedusaHeads

    if name not in _MEDUSA:
        raise ValueError(f"unknown Medusa heads {name!r}; known: {', '.join(_MEDUSA)}")
    verify(name, root)
    if target is None:
        entry = _medusa_entry(name, root)
        troot = root if entry["target"] in manifest(root).get("models", {}) else None
        target, _ = load(entry["target"], device=device or "cpu", dtype=dtype, root=troot)
    return MedusaHeads.from_pretrained(path(name, root), target=target, device=device, dtype=dtype)


def load_tokenizer(root: str | Path | None = None):
    """The shared tokenizer (``transformers.PreTrainedTokenizerFast``), hash-checked.

    ``tok(text).input_ids`` starts with ``<bos>`` (id 1); pad/bos/eos ids are 0/1/2;
    ``padding_side="left"``. Raises ValueError if the files do not match the manifest."""
    from transformers import PreTrainedTokenizerFast

    verify("tokenizer", root)
    return PreTrainedTokenizerFast.from_pretrained(path("tokenizer", root), local_files_only=True)


def load(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         root: str | Path | None = None) -> tuple[Any, Any]:
    """Load a zoo model and the shared tokenizer, offline.

    Args:
        name: one of ``names()`` (or of ``medusa_names()``: then ``(heads, tokenizer)``, the heads
            bound to their zoo target's LM head; see :func:`load_medusa`).
        device: where the model goes (``"cpu"``, ``"cuda"``, ...).
        dtype: parameter dtype; the shipped weights are bf16, upcast on load (default fp32).
        root: a zoo folder other than the shipped one (e.g. the output of a recipe run).

    Returns:
        ``(model, tokenizer)``: the transformers causal LM (class from the manifest, eval mode;
        ``model(input_ids LongTensor [B, L]).logits`` is ``[B, L, 8192]`` in ``dtype``) and the
        ``PreTrainedTokenizerFast``.

    Raises:
        ValueError: unknown name, or a weight/tokenizer file whose sha256 differs from the manifest.
        FileNotFoundError: no manifest in the zoo folder.
    """
    import transformers

    _check_name(name, allow_tokenizer=False)
    if name in _MEDUSA:
        return load_medusa(name, device=device, dtype=dtype, root=root), load_tokenizer(root)
    verify(name, root)  # before anything is deserialised
    entry = manifest(root)["models"][name]
    cls_name = entry["class"]
    if cls_name not in _CLASSES:
        raise ValueError(f"{name}: manifest class {cls_name!r} is not one of {_CLASSES}")
    from .quiet import quiet_transformers

    with quiet_transformers(device):  # no "Loading weights" bar, no notes about GPU-only kernels on CPU
        model = getattr(transformers, cls_name).from_pretrained(
            path(name, root), dtype=dtype, local_files_only=True, use_safetensors=True,
        )
    model = model.to(device).eval()
    return model, load_tokenizer(root)


def _read_jsonl(p: Path) -> list[dict]:
    if not p.is_file():
        raise FileNotFoundError(f"missing data file {p}; it is written by `python -m specdec.experiments.train_zoo`")
    with open(p, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompts(length: str | int = "128", limit: int | None = None, data_dir: str | Path | None = None) -> list[dict]:
    """Code-completion prompts cut from held-out stdlib files (never trained on).

    Args:
        length: ``"128"``, ``"1k"``, ``"4k"`` (also 128, 1024, 4096) or ``"all"`` (the three sets, in that order).
        limit: at most this many prompts from each selected set (None: all: 32, 16 and 8).
        data_dir: a data folder other than the shipped ``specdec/data``.

    Returns:
        list of dicts: ``id``, ``set``, ``source`` (path relative to the stdlib), ``prompt``
        (a line-aligned file prefix), ``continuation`` (the text that follows, line-aligned, at
        most 256 tokens of the whole file's tokenization; tokenized on its own it can come out a
        token or two longer), ``prompt_tokens`` (``len(tok(prompt).input_ids)``, ``<bos>``
        included), ``continuation_tokens`` (``len`` of the continuation tokenized on its own,
        without ``<bos>``).

    Raises ValueError for an unknown length or a negative limit.
    """
    key = str(length)
    if key == "all":
        keys = list(PROMPT_SETS)
    elif key in _PROMPT_ALIASES:
        keys = [_PROMPT_ALIASES[key]]
    else:
        raise ValueError(f"unknown prompt length {length!r}; use one of {PROMPT_SETS + ('all',)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    d = Path(data_dir) if data_dir is not None else DATA_DIR
    out: list[dict] = []
    for k in keys:
        rows = _read_jsonl(d / "prompts" / f"code_{k}.jsonl")
        out.extend(rows if limit is None else rows[:limit])
    return out


def heldout_sample(data_dir: str | Path | None = None) -> list[dict]:
    """The held-out evaluation sample behind each manifest ``heldout_loss``: 8 rows, each with
    ``source``, ``input_ids`` (list of 512 ints, ``<bos>`` first) and ``text``. The loss is the
    mean next-token cross-entropy (nats) over all 8 x 511 predicted positions."""
    d = Path(data_dir) if data_dir is not None else DATA_DIR
    return _read_jsonl(d / "heldout_sample.jsonl")
