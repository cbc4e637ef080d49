"""The shipped zoo: loading, hash checks, held-out losses against the manifest, prompt sets,
and a CPU smoke run of the recipe that built it (specdec.experiments.train_zoo)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import specdec.zoo as zoo

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def man():
    return zoo.manifest()


@pytest.fixture(scope="module")
def tok():
    return zoo.load_tokenizer()


def _heldout_loss(model) -> float:
    """Mean next-token cross-entropy over the shipped held-out sample (fp32, CPU)."""
    ids = torch.tensor([r["input_ids"] for r in zoo.heldout_sample()], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()


def test_names_paths_and_unknown_name():
    assert zoo.names() == ("gdn-target", "gdn-draft", "mamba2-target", "kda-target")
    for n in zoo.names() + ("tokenizer",):
        assert Path(zoo.path(n)).is_dir(), n
    with pytest.raises(ValueError, match="known names: gdn-target, gdn-draft, mamba2-target, kda-target"):
        zoo.load("gpt-2")
    with pytest.raises(ValueError, match="unknown zoo name"):
        zoo.path("nope")
    with pytest.raises(ValueError, match="unknown zoo name"):
        zoo.load("tokenizer")


def test_manifest_contents(man):
    assert man["recipe"]["module"] == "specdec.experiments.train_zoo"
    assert man["python_version"] and len(man["corpus"]["file_list_sha256"]) == 64
    assert set(man["models"]) == set(zoo.names())
    total_params = sum(m["parameters"] for m in man["models"].values())
    assert total_params < 16_000_000
    weight_bytes = sum((Path(zoo.path(n)) / "model.safetensors").stat().st_size for n in zoo.names())
    assert weight_bytes < 30_000_000
    expected_class = {"gdn-target": "Qwen3_5ForCausalLM", "gdn-draft": "Qwen3_5ForCausalLM",
                      "mamba2-target": "NemotronHForCausalLM", "kda-target": "KimiLinearForCausalLM"}
    for name, m in man["models"].items():
        assert m["class"] == expected_class[name]
        assert m["steps"] > 0 and m["tokens_seen"] == m["steps"] * m["batch_size"] * m["seq_len"]
        assert set(m["files"]) == {"model.safetensors"}
    # the target is clearly better than its draft, and everything is far below a uniform guess
    v = man["tokenizer"]["vocab_size"]
    assert man["models"]["gdn-target"]["heldout_loss"] < man["models"]["gdn-draft"]["heldout_loss"] - 0.1
    for m in man["models"].values():
        assert m["heldout_loss"] < 0.5 * math.log(v)


@pytest.mark.parametrize("name", zoo.names())
def test_heldout_loss_matches_manifest(name, man):
    model, tokenizer = zoo.load(name)
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert type(model).__name__ == man["models"][name]["class"]
    assert sum(p.numel() for p in model.parameters()) == man["models"][name]["parameters"]
    assert model.config.vocab_size == len(tokenizer) == man["tokenizer"]["vocab_size"]
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    loss = _heldout_loss(model)
    ref = man["models"][name]["heldout_loss"]
    assert abs(loss - ref) <= 0.05 * ref, (name, loss, ref)
    assert loss < 0.5 * math.log(len(tokenizer))


def test_tampered_copy_raises(tmp_path):
    root = tmp_path / "zoo"
    root.mkdir()
    shutil.copy(Path(zoo.path("gdn-draft")).parent / "MANIFEST.json", root / "MANIFEST.json")
    for n in ("gdn-draft", "tokenizer"):
        shutil.copytree(zoo.path(n), root / n)
    model, _ = zoo.load("gdn-draft", root=root)  # an intact copy loads
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    f = root / "gdn-draft" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        zoo.load("gdn-draft", root=root)
    with pytest.raises(ValueError, match="is missing"):  # listed in the manifest, not copied
        zoo.load("gdn-target", root=root)
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="sha256 mismatch"):
        zoo.load_tokenizer(root)


def test_tokenizer(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "def add(a, b):\n    return a + b\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) < len(text)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_heldout_sample_is_tokenizer_consistent(tok):
    rows = zoo.heldout_sample()
    assert len(rows) == 8
    for r in rows:
        assert len(r["input_ids"]) == 512 and r["input_ids"][0] == tok.bos_token_id
        assert tok.decode(r["input_ids"][1:]) == r["text"]


def test_prompts(tok):
    want = {"128": (128, 32), "1k": (1024, 16), "4k": (4096, 8)}
    for key, (target, count) in want.items():
        rows = zoo.prompts(key)
        assert len(rows) == count
        assert len({r["source"] for r in rows}) == count
        for r in rows:
            assert set(r) >= {"id", "source", "prompt", "continuation", "prompt_tokens"}
            assert r["set"] == key and r["prompt"].endswith("\n") and r["continuation"]
            n = len(tok(r["prompt"]).input_ids)
            assert n == r["prompt_tokens"]
            assert 0.75 * target <= n <= target + 1
            m = len(tok(r["continuation"], add_special_tokens=False).input_ids)
            assert m == r["continuation_tokens"]
            assert 64 <= m <= 256 + 4  # cut at <= 256 tokens of the whole file's tokenization
    assert len(zoo.prompts("all")) == 56
    assert len(zoo.prompts("all", limit=2)) == 6
    assert [r["id"] for r in zoo.prompts(1024, limit=3)] == [r["id"] for r in zoo.prompts("1k")[:3]]
    with pytest.raises(ValueError, match="unknown prompt length"):
        zoo.prompts("2k")


def test_recipe_smoke_on_cpu(tmp_path):
    """The recipe end to end on this machine's stdlib at a tiny scale (seconds): 128-token training
    windows and held-out rows, and one file in 50 held out (the prompt sets still fill), so that
    tokenizing the held-out files and the four models' steps take a few seconds, not twenty."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "specdec", "experiment=train_zoo", "device=cpu", "steps_scale=0.002",
           f"out_dir={out}", "heldout.num_files=2", "heldout.tokens=128", "train.seq_len=128",
           "corpus.heldout_mod=50", f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    man = json.loads((out / "zoo" / "MANIFEST.json").read_text())
    assert set(man["models"]) == set(zoo.names())
    assert man["python_version"] == ".".join(map(str, sys.version_info[:3]))
    for m in man["models"].values():
        assert m["steps"] == 2 and m["batch_size"] == 1 and math.isfinite(m["heldout_loss"])
        assert m["seq_len"] == 128 and m["tokens_seen"] == 2 * 128
    assert [len(r["input_ids"]) for r in zoo.heldout_sample(out / "data")] == [128, 128]
    assert len(zoo.prompts("128", data_dir=out / "data")) > 0
    model, tokenizer = zoo.load("gdn-draft", root=out / "zoo")
    assert model.config.vocab_size == len(tokenizer)
