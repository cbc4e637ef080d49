"""Medusa heads and the chain drafter (specdec.drafters.medusa), the zoo's gdn-medusa heads, and
the training recipe (specdec.experiments.train_medusa): shapes, identity at initialisation,
save/load, size errors, greedy exactness (two families x three rollback strategies, ragged
left-padded batch), lossless sampling, the shipped heads on gdn-target, and a CPU smoke run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_same_token_distribution, fit_medusa_heads, medusa_prompts, run_python
from hydra import compose, initialize_config_dir
from tiny_models import make_model, ragged_prompts

import specdec
import specdec.zoo as zoo
from specdec.drafters import MedusaDrafter, MedusaHeads
from specdec.drafters.medusa import CONFIG_NAME, WEIGHTS_NAME
from specdec.experiments.app import CONF_DIR, one_line, run_experiment
from specdec.experiments.train_medusa import collect_hidden_states, head_accuracy
from specdec.rollback import STRATEGIES

FAMILIES = ("qwen3_5", "nemotron_h")


def _randomize(heads: MedusaHeads, seed: int = 0, scale: float = 0.2) -> MedusaHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads


# --------------------------------------------------------------------------------- the module


@pytest.mark.parametrize("shared", [False, True])
def test_shapes_and_separate_instances(shared):
    model = make_model("qwen3_5")
    kw = dict(shared_lm_head=True, vocab_bias=True, lm_head_rank=4) if shared else {}
    heads = MedusaHeads(48, 96, num_heads=3, num_layers=2, **kw).init_from_lm_head(model.lm_head)
    assert heads(torch.randn(5, 48)).shape == (5, 3, 96)
    assert heads(torch.randn(2, 7, 48)).shape == (2, 7, 3, 96)
    assert heads(torch.randn(5, 48), num_heads=2).shape == (5, 2, 96)
    blocks = [b for head in heads.blocks for b in head]
    assert len(blocks) == 6 and len({id(b) for b in blocks}) == 6
    assert len({b.linear.weight.data_ptr() for b in blocks}) == 6  # no weight shared between blocks
    if not shared:
        assert len({lin.weight.data_ptr() for lin in heads.lm_heads}) == 3
    else:  # the target's weight is referenced, not a parameter, and not in the state dict
        assert heads.shared_weight.data_ptr() == model.lm_head.weight.data_ptr()
        assert "shared_weight" not in heads.state_dict()
        assert all(p is not model.lm_head.weight for p in heads.parameters())
    with pytest.raises(ValueError, match="num_heads"):
        heads(torch.randn(1, 48), num_heads=4)
    with pytest.raises(ValueError, match="lm_head_rank"):
        MedusaHeads(48, 96, lm_head_rank=2)


@pytest.mark.parametrize("shared", [False, True])
def test_fresh_heads_are_identity_then_lm_head(shared):
    model = make_model("nemotron_h")
    heads = MedusaHeads(48, 96, num_heads=4, num_layers=3, shared_lm_head=shared)
    x = torch.randn(6, 48)
    for head in heads.blocks:
        assert torch.equal(head(x), x)  # zero-initialised residual blocks
    heads.init_from_lm_head(model.lm_head)
    want = model.lm_head(x)
    got = heads(x)
    for k in range(4):
        assert torch.allclose(got[:, k], want, atol=1e-5)
    assert torch.allclose(MedusaHeads.from_target(model, num_heads=2)(x)[:, 1], want, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_save_load_round_trip(tmp_path, shared):
    model = make_model("qwen3_5")
    kw = dict(shared_lm_head=True, vocab_bias=True, lm_head_rank=3) if shared else dict(vocab_bias=True)
    heads = _randomize(MedusaHeads.from_target(model, num_heads=3, num_layers=2, **kw))
    x = torch.randn(4, 48)
    heads.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_layers"]) == (
        "medusa_heads", 48, 96, 3, 2)
    assert cfg["shared_lm_head"] is shared
    back = MedusaHeads.from_pretrained(tmp_path, target=model)
    assert torch.equal(back(x), heads(x))
    if shared:
        loose = MedusaHeads.from_pretrained(tmp_path)  # without the target: unbound
        assert not loose.is_bound
        with pytest.raises(ValueError, match="init_from_lm_head"):
            loose(x)
        with pytest.raises(ValueError, match="not bound"):
            MedusaDrafter(loose)
        assert torch.equal(loose.init_from_lm_head(model)(x), heads(x))
    else:
        assert torch.equal(MedusaHeads.from_pretrained(tmp_path)(x), heads(x))
    heads.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    small = MedusaHeads.from_pretrained(tmp_path / "bf16", target=model)
    assert (tmp_path / "bf16" / WEIGHTS_NAME).stat().st_size < (tmp_path / WEIGHTS_NAME).stat().st_size
    assert torch.allclose(small(x), heads(x), atol=0.1, rtol=0.05)
    with pytest.raises(FileNotFoundError):
        MedusaHeads.from_pretrained(tmp_path / "nope")


def test_size_mismatch_errors():
    model = make_model("qwen3_5")  # hidden 48, vocab 96
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match="hidden states of size 32"):
        MedusaHeads(32, 96).init_from_lm_head(model.lm_head)
    with pytest.raises(ValueError, match="vocabulary of 90 tokens"):
        MedusaHeads(48, 90).init_from_lm_head(model)
    with pytest.raises(ValueError, match="vocabulary"):  # the engine's check when wrapping
        specdec.wrap(model, drafter=MedusaDrafter(MedusaHeads(48, 90)), rollback="replay")
    with pytest.raises(ValueError, match="vocabulary of 90 tokens, but the target's has 96"):
        MedusaDrafter(MedusaHeads(48, 90)).start(target_vocab_size=96, batch_size=1, device="cpu")
    sd = specdec.wrap(model, drafter=MedusaDrafter(MedusaHeads(40, 96)), rollback="replay")
    with pytest.raises(ValueError, match="hidden states of size 40, but the target's final hidden state has size 48"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="unknown draft tree"):  # tree validation: tests/test_medusa_tree.py
        MedusaDrafter(MedusaHeads(48, 96), tree="bushy")
    with pytest.raises(TypeError, match="MedusaHeads"):
        MedusaDrafter("gdn-medusa")
    with pytest.raises(RuntimeError, match="before observe"):
        MedusaDrafter(MedusaHeads(48, 96)).propose(ids, mask.sum(1), 3)


def test_heads_sharing_another_models_lm_head_are_refused():
    """Heads that project with a shared LM head bound from model A draft with A's weights: a
    generator of model B (a copy of A) refuses them, naming how to bind them to B; bound to B
    (or owning their projections) they are accepted."""
    import copy

    model = make_model("qwen3_5")
    other = copy.deepcopy(model)
    shared = MedusaHeads.from_target(model, num_heads=2, shared_lm_head=True)
    with pytest.raises(ValueError, match=r"another model's LM head.*init_from_lm_head\(model\)"):
        specdec.wrap(other, drafter=MedusaDrafter(shared), rollback="replay")
    sd = specdec.wrap(other, drafter="ngram", rollback="replay")
    with pytest.raises(ValueError, match="another model's LM head"):
        sd.drafter = MedusaDrafter(shared)
    assert type(sd.drafter).__name__ == "NGramDrafter"
    sd.drafter = MedusaDrafter(shared.init_from_lm_head(other))  # bound to this model now
    sd.drafter = MedusaDrafter(MedusaHeads.from_target(model, num_heads=2))  # owned projections: any target
    ids, mask = ragged_prompts()
    ref = other.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0), ref)


# ----------------------------------------------------------------------------- exactness


def _fitted_heads(model, num_heads: int = 4) -> MedusaHeads:
    """Heads fitted (in under a second) to the tiny model's own greedy continuations of the test
    prompts, so drafts are often accepted: verification sees full, partial and no acceptance."""
    return fit_medusa_heads(model, *medusa_prompts(), num_heads=num_heads, num_layers=2, steps=300)


@pytest.fixture(scope="module")
def tiny_heads():
    out = {}
    for fam in FAMILIES:
        model = make_model(fam, seed=0)
        out[fam] = (model, _randomize(MedusaHeads(48, 96, num_heads=3, num_layers=2), seed=1), _fitted_heads(model))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_exact_ragged_batch(tiny_heads, family, strategy):
    model, random_heads, fitted = tiny_heads[family]
    ids, mask = medusa_prompts()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    for heads, K in ((random_heads, 5), (fitted, 4), (fitted, 2)):  # K > heads: num_heads drafts wide
        sd = specdec.wrap(model, drafter=MedusaDrafter(heads), rollback=strategy, num_speculative_tokens=K)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0)
        assert torch.equal(out, ref), (family, strategy, K)
        st = sd.last_stats
        assert 0 < st.proposed_tokens <= st.steps * 3 * min(K, heads.num_heads)
        if heads is fitted:  # some steps accepted nothing, some a part, some every draft
            h = st.accept_histogram
            assert h[0] + sum(h[1:K]) > 0 and h[K] > 0 and sum(h[1:]) > h[0], (K, h)


@pytest.mark.parametrize("K", [5, "auto"])
def test_a_chain_steps_at_most_one_draft_per_head_wide(tiny_heads, K, monkeypatch):
    """A chain of 3 heads asked for K = 5 (or "auto" up to max_speculative_tokens = 8): on the
    static path every step's forward is at most 4 tokens wide (3 drafts and the last token), not
    padded to K + 1; the histograms count 0..3; exact."""
    from specdec.decoding import StaticDecoder

    model, heads, _ = tiny_heads["qwen3_5"]
    widths = []
    forward = StaticDecoder.forward

    def counted(self, tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(StaticDecoder, "forward", counted)
    ids, mask = medusa_prompts()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    drafter = MedusaDrafter(heads)
    assert drafter.max_drafts == heads.num_heads == 3
    sd = specdec.wrap(model, drafter=drafter, num_speculative_tokens=K, decode_path="static")
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(out, ref)
    assert widths and max(widths) == 4 if K == 5 else 1 <= min(widths) <= max(widths) <= 4, widths
    assert len(sd.last_stats.accept_histogram) == len(sd.last_stats.k_histogram) == 4


def test_sampling_keeps_the_target_distribution():
    V, N, P = 8, 2500, 3
    target = make_model("qwen3_5", seed=3, vocab=V, small=True)  # (small: N rows prefilled, twice)
    heads = _randomize(MedusaHeads.from_target(target, num_heads=3, vocab_bias=True), seed=2, scale=0.1)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]]).repeat(N, 1)
    kw = dict(temperature=0.8, top_k=6, top_p=0.95)
    hf = target.generate(prompt, max_new_tokens=P, do_sample=True, pad_token_id=0, **kw)
    drafter = MedusaDrafter(heads)
    sd = specdec.wrap(target, drafter=drafter, rollback="ring", num_speculative_tokens=3)
    out = sd.generate(prompt, max_new_tokens=P, do_sample=True, generator=torch.Generator().manual_seed(11),
                      pad_token_id=0, **kw)
    assert drafter.draft_probs() is not None and drafter.draft_probs().shape[1:] == (3, V)
    assert 0 < sd.last_stats.acceptance_rate < 1
    assert_same_token_distribution(hf, out, prompt.shape[1], P, V)


# ---------------------------------------------------------------------------- shipped heads


@pytest.fixture(scope="module")
def gdn():
    model, tok = zoo.load("gdn-target")
    return model, tok, zoo.load_medusa("gdn-medusa", target=model)


def test_zoo_heads_manifest_and_heldout_accuracy(gdn):
    model, _, heads = gdn
    entry = zoo.manifest()["medusa"]["gdn-medusa"]
    assert entry["target"] == "gdn-target" and entry["recipe"]["module"] == "specdec.experiments.train_medusa"
    assert entry["target_files"] == zoo.manifest()["models"]["gdn-target"]["files"]
    folder = Path(zoo.path("gdn-medusa"))
    assert set(entry["files"]) == {CONFIG_NAME, WEIGHTS_NAME}
    assert (folder / WEIGHTS_NAME).stat().st_size < 6_000_000
    assert heads.shared_lm_head and heads.shared_weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert heads.num_heads == entry["heads"]["num_heads"] == len(entry["heldout_top1"])
    # the manifest's per-head accuracy, recomputed from the shipped held-out sample
    ids = torch.tensor([r["input_ids"] for r in zoo.heldout_sample()], dtype=torch.long)
    hidden = collect_hidden_states(model, ids, progress=False)
    ev = head_accuracy(heads, hidden, ids, lm_head=model.lm_head)
    assert [round(a, 4) for a in ev["top1"]] == pytest.approx(entry["heldout_top1"], abs=2e-4)
    assert ev["lm_head_top1"] == pytest.approx(entry["heldout_lm_head_top1"], abs=2e-4)
    assert ev["top1"][0] > 0.1 and ev["top1"][0] > ev["top1"][-1]  # far above chance (1/8192)


def test_zoo_heads_exact_and_accepting(gdn):
    model, tok, heads = gdn
    texts = [p["prompt"] for p in zoo.prompts("128", limit=3)]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert bool((enc.attention_mask == 0).any())  # ragged, left-padded
    ref = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    sd = specdec.wrap(model, drafter=MedusaDrafter(heads), rollback="replay", num_speculative_tokens=4)
    out = sd.generate(**enc, max_new_tokens=24, pad_token_id=tok.pad_token_id)
    assert torch.equal(out, ref)
    assert sd.last_stats.mean_accepted_tokens > 1.0


def test_zoo_heads_integrity_errors(tmp_path):
    root = tmp_path / "zoo"
    shutil.copytree(zoo.path("gdn-medusa"), root / "gdn-medusa")
    man = zoo.manifest()
    man.pop("models")
    (root / "MANIFEST.json").write_text(json.dumps(man))
    model, _ = zoo.load("gdn-target")
    assert zoo.load_medusa("gdn-medusa", target=model, root=root).is_bound  # intact copy; target from the package
    man["medusa"]["gdn-medusa"]["target_files"] = {"model.safetensors": "0" * 64}
    (root / "MANIFEST.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="retrain the heads"):
        zoo.load_medusa("gdn-medusa", target=model, root=root)
    man = zoo.manifest()
    man.pop("models")
    (root / "MANIFEST.json").write_text(json.dumps(man))
    f = root / "gdn-medusa" / WEIGHTS_NAME
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        zoo.load_medusa("gdn-medusa", target=model, root=root)
    with pytest.raises(ValueError, match="unknown Medusa heads"):
        zoo.load_medusa("gdn-target")


# ------------------------------------------------------------------------------ experiments


def test_acceptance_experiment_with_medusa(tmp_path):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=zoo", "drafter=medusa", "rollback=replay", "prompts.limit=1", "max_new_tokens=8",
            "experiment.warmup=false", "device=cpu", "progress=false"])
    records = run_experiment(cfg, tmp_path)
    assert [(r["model"], r["drafter"]) for r in records] == [("gdn-target", "medusa")]  # the others have no heads
    assert records[0]["exact"] and records[0]["mean_accepted_tokens"] >= 1.0
    assert "| gdn-target | medusa | replay |" in (tmp_path / "summary.md").read_text()


def test_training_recipe_smoke(tmp_path):
    """``python -m specdec experiment=train_medusa`` end to end at a tiny scale (seconds)."""
    out = tmp_path / "run"
    proc = run_python(["-m", "specdec", "experiment=train_medusa", "device=cpu", "progress=false",
                       "data.tokens=2048", "data.seq_len=128", "train.steps=3", "train.batch_positions=64",
                       "train.log_every=1", "heads.num_heads=3", "heads.num_layers=1", f"out_dir={out}",
                       f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss per head" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"specdec-run: trained; models and manifest in {out / 'zoo'} (MANIFEST.json)"
    entry = json.loads((out / "zoo" / "MANIFEST.json").read_text())["medusa"]["gdn-medusa"]
    assert entry["steps"] == 3 and entry["train_tokens"] == 2048 and entry["positions_seen"] == 3 * 64
    assert len(entry["train_loss_per_head"]) == 3 and len(entry["heldout_top1"]) == 3
    assert entry["labels"] == "target" and entry["recipe"]["config"]["data"]["tokens"] == 2048
    heads = zoo.load_medusa("gdn-medusa", root=out / "zoo")  # the target comes from the shipped zoo
    assert heads.num_heads == 3 and heads.is_bound
    # a label source outside the schema's is refused when the config is composed, before anything runs (in-process:
    # specdec-run prints a composition error as one line, exit status 2, as test_experiments.py's
    # test_bad_value_gives_a_one_line_error[device=tpu-...] checks through a subprocess)
    with pytest.raises(Exception) as info, initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        compose(config_name="config", overrides=["experiment=train_medusa", "train.labels=guess"])
    text = one_line(info.value)
    assert "\n" not in text and "train.labels=guess" in text and "expected one of [corpus, target]" in text, text
