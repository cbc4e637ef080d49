"""The target's own MTP layers as a drafter (specdec.drafters.MTPDrafter): tiny Qwen3.5,
Qwen3.5-MoE, Qwen3-Next and Nemotron-H checkpoints saved with ``mtp.*`` tensors in the public
layout and loaded back; the first proposal rebuilt by hand from the file with transformers'
layer classes; greedy exactness (every strategy, K in {1, 2, 4}, ragged left-padded batch with
EOS, eager and static paths), trees, lossless sampling; missing / misshapen tensors; the zoo's
gdn-target and mamba2-target with their shipped MTP layers; the training recipe; drafting over a
reduced vocabulary (exact, lossless, checked ids); random layers for benchmark shapes."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from helpers import ALL_STRATEGIES, assert_same_token_distribution, fit_mtp_layers, hf_greedy, rel_err, run_python
from hydra import compose, initialize_config_dir
from markers import ON_CUDA, needs_cuda
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import _CLASSES, make_model, ragged_prompts

import specdec
import specdec.zoo as zoo
from specdec.drafters import MTPDrafter, frequent_token_ids, make_drafter
from specdec.drafters.mtp import mtp_layers_for, write_mtp_tensors
from specdec.experiments.app import CONF_DIR, run_experiment
from specdec.experiments.train_medusa import collect_hidden_states
from specdec.experiments.train_mtp import mtp_accuracy
from specdec.verify import SamplingConfig

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h")
#: the config fields a checkpoint with one MTP layer carries (Nemotron-H: its MoE sizes too, which
#: the tiny target does not use itself)
MTP_FIELDS = {
    "qwen3_5": {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False},
    "qwen3_5_moe": {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False},
    "qwen3_next": {"mtp_num_hidden_layers": 1},
    "nemotron_h": {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["full_attention", "moe"],
                   "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 48},
}


def _random_(layers, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layers.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return layers


def save_with_mtp(family, folder, *, fit_steps=0, seed=0, vocab=None, fields=None, small=False, **write_kw):
    """Save the tiny ``family`` target (``small``: its small model) into ``folder`` with random
    ``mtp.*`` tensors in the public layout (then fitted ``fit_steps`` steps to the target's own
    greedy continuations of the test prompts, so drafts are often accepted) and the config fields
    of ``MTP_FIELDS``; returns the folder."""
    model = make_model(family, seed=seed, small=small, **({"vocab": vocab} if vocab else {}))
    for k, v in (MTP_FIELDS[family] if fields is None else fields).items():
        setattr(model.config, k, v)
    model.save_pretrained(folder)
    layers = _random_(mtp_layers_for(model), seed=seed + 1)
    if fit_steps:
        # a CUDA test run fits on the GPU: with flash-linear-attention installed, transformers runs a
        # Gated DeltaNet prompt through fla's Triton kernels whatever the tensors' device
        dev = "cuda" if ON_CUDA else "cpu"
        model.to(dev)
        layers.to(dev)
        ids, mask = (t.to(dev) for t in ragged_prompts())
        seqs = torch.cat([model.generate(ids[i][mask[i].bool()][None], max_new_tokens=40, do_sample=False,
                                         pad_token_id=0)[:, -44:] for i in range(ids.shape[0])]).cpu()
        torch.manual_seed(seed)
        fit_mtp_layers(model, layers, seqs, fit_steps)
    write_mtp_tensors(layers, folder, **write_kw)
    return folder


def load(family, folder):
    return getattr(tf, _CLASSES[family]).from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per family: a checkpoint folder with fitted MTP layers, and the target loaded back from it."""
    out = {}
    for fam in MTP_FAMILIES:
        folder = save_with_mtp(fam, tmp_path_factory.mktemp(fam), fit_steps=40)
        out[fam] = (folder, load(fam, folder))
    return out


def _reference(model):
    """Ragged left-padded prompts, an EOS that stops row 1 early, and HF greedy's output."""
    ids, mask = ragged_prompts()
    L = ids.shape[1]
    eos = int(hf_greedy(model, ids, mask)[1, L + 3])
    return ids, mask, eos, hf_greedy(model, ids, mask, eos=eos)


# ------------------------------------------------------------------------ layout, by hand


def _by_hand(family, folder, model, tokens, hidden):
    """The MTP output ``[1, T, D]`` of entries (hidden[:, t], tokens[:, t]) at positions 0..T-1,
    causally, built from the file's tensors with transformers' own classes (not specdec's)."""
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        w = {k[len("mtp."):]: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    cfg = copy.deepcopy(model.config)
    T, D = tokens.shape[1], cfg.hidden_size
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    pos = torch.arange(T)[None]
    e = model.get_input_embeddings()(tokens)

    def sub(prefix):  # a module's tensors; per-expert weights stacked as transformers' fused experts hold them
        out = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix) and ".experts." not in k
               and not k[len(prefix):].startswith(("enorm.", "hnorm.", "eh_proj.", "final_layernorm."))}
        for mlp in ("mlp.", "mixer."):
            ex = f"{prefix}{mlp}experts."
            n = sum(1 for k in w if k.startswith(ex) and k.endswith(".down_proj.weight"))
            if n:
                out[f"{mlp}experts.down_proj"] = torch.stack([w[f"{ex}{i}.down_proj.weight"] for i in range(n)])
                if f"{ex}0.gate_proj.weight" in w:  # gated experts: [gate; up] per expert
                    out[f"{mlp}experts.gate_up_proj"] = torch.stack(
                        [torch.cat([w[f"{ex}{i}.gate_proj.weight"], w[f"{ex}{i}.up_proj.weight"]]) for i in range(n)])
                else:
                    out[f"{mlp}experts.up_proj"] = torch.stack([w[f"{ex}{i}.up_proj.weight"] for i in range(n)])
        return out

    if family == "nemotron_h":
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock, NemotronHRMSNorm

        cfg.layer_types = list(cfg.mtp_layers_block_type)
        norms = {}
        for name in ("enorm", "hnorm", "final_layernorm"):
            norms[name] = NemotronHRMSNorm(D, eps=cfg.layer_norm_epsilon)
            j = len(cfg.layer_types) - 1 if name == "final_layernorm" else 0
            norms[name].load_state_dict({"weight": w[f"layers.{j}.{name}.weight"]})
        x = torch.cat([norms["enorm"](e), norms["hnorm"](hidden)], -1) @ w["layers.0.eh_proj.weight"].T
        for j, kind in enumerate(cfg.layer_types):
            block = NemotronHBlock(cfg, j).eval()
            block.load_state_dict(sub(f"layers.{j}."))
            x = block(x, attention_mask=causal if kind == "full_attention" else None)
        return norms["final_layernorm"](x)
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer as Layer
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm as Norm

        pe = model.model.rotary_emb(e, pos)
    else:
        if family == "qwen3_5":
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm as Norm
        else:
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm as Norm
        pe = model.model.rotary_emb(e, pos[None].expand(3, 1, T))  # text positions in all three mRoPE sections
    cfg.layer_types = ["full_attention"]
    norm_e, norm_h, norm = (Norm(D, eps=cfg.rms_norm_eps) for _ in range(3))
    norm_e.load_state_dict({"weight": w["pre_fc_norm_embedding.weight"]})
    norm_h.load_state_dict({"weight": w["pre_fc_norm_hidden.weight"]})
    norm.load_state_dict({"weight": w["norm.weight"]})
    layer = Layer(cfg, 0).eval()
    layer.load_state_dict(sub("layers.0."))
    x = torch.cat([norm_e(e), norm_h(hidden)], -1) @ w["fc.weight"].T  # embedding first, then the hidden state
    return norm(layer(x, position_embeddings=pe, attention_mask=causal, position_ids=pos))


@pytest.mark.parametrize("family", MTP_FAMILIES)
@torch.no_grad()
def test_first_proposal_equals_the_checkpoint_built_by_hand(saved, family):
    """Step 1 = MTP(h_{L-1}, pending) over the prompt's entries (h_t, x_{t+1}); step 2 = MTP(its
    output, d_1) at position L: both built from the safetensors file with transformers' classes,
    compared with the drafter's draft distributions (sampling: q) and drafts."""
    folder, model = saved[family]
    ids = ragged_prompts()[0][:1]  # the longest prompt, no padding
    L = ids.shape[1]
    hidden = model.model(input_ids=ids).last_hidden_state
    pending = model.lm_head(hidden[:, -1]).argmax(-1)
    drafter = MTPDrafter.from_pretrained(folder, target=model)
    drafter.start(target_vocab_size=96, batch_size=1, device="cpu", sampling=SamplingConfig(),
                  generator=torch.Generator().manual_seed(0), max_length=L + 8)
    drafter.observe_prompt(hidden, torch.ones_like(ids))
    text = torch.cat([ids, pending[:, None]], 1)
    drafts, _ = drafter.propose(text, torch.tensor([L + 1]), 2)
    q = drafter.draft_probs()
    out = _by_hand(family, folder, model, text[:, 1:], hidden)  # entries 0..L-1
    p1 = torch.softmax(model.lm_head(out[:, -1]).float(), -1)
    assert torch.allclose(q[:, 0], p1, atol=1e-5), (family, (q[:, 0] - p1).abs().max())
    out2 = _by_hand(family, folder, model, torch.cat([text[:, 1:], drafts[:, :1]], 1),
                    torch.cat([hidden, out[:, -1:]], 1))  # the entry (step-1 output, d_1) at position L
    p2 = torch.softmax(model.lm_head(out2[:, -1]).float(), -1)
    assert torch.allclose(q[:, 1], p2, atol=1e-5), (family, (q[:, 1] - p2).abs().max())
    # the embedding and LM head are the target's (referenced); the layers hold only the file's MTP tensors
    assert drafter.embed is model.get_input_embeddings() and drafter.adapter.lm_head is model.lm_head
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        stored = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys() if k.startswith("mtp."))
    assert sum(v.numel() for v in drafter.layers.state_dict().values()) == stored


# ------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_exact_every_strategy_and_K(saved, family, path):
    _, model = saved[family]
    ids, mask, eos, ref = _reference(model)
    hist = torch.zeros(5, dtype=torch.long)
    for strategy in ALL_STRATEGIES:
        for K in (1, 2, 4):
            sd = specdec.wrap(model, drafter="mtp", rollback=strategy, num_speculative_tokens=K, decode_path=path)
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos)
            assert torch.equal(out, ref), (family, path, strategy, K)
            assert sd.last_stats.decode_path == path and sd.drafter.last_path == path == sd.last_stats.draft_path
            assert sd.last_stats.draft_error is None
            if K == 4:
                hist += torch.tensor(sd.last_stats.accept_histogram)
    # the fitted layers: steps that accept nothing, a part, and every draft
    assert hist[0] > 0 and hist[1:4].sum() > 0 and hist[4] > 0, (family, hist.tolist())


def _per_step_k(d, path: str, max_k: int):
    """``d`` set up as the engine sets a drafter for K chosen per step on decode path ``path``."""
    d.set_decode_path(path)
    d.set_speculation(max_k, True)
    return d


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_steps_without_a_proposal_keep_every_entry(family, path):
    """With K chosen per step, steps at K = 0 (and steps before the first proposal) hand their
    committed positions' hidden states to the drafter without asking for drafts. The next
    proposal runs them all, in order: its MTP cache holds an entry for every committed position
    and its first step's draft distribution equals that of a drafter fed the whole text as its
    prompt. On the static path the kept entries beyond the program's K + 1 are first run by the
    catch-up program."""
    from test_generate_batch_drafters import mtp_target

    target, layers = mtp_target(family)  # (fitted here on first use: outside no_grad)
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (2, 10))
    full = target.generate(ids, max_new_tokens=14, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hidden = target.model(input_ids=full).last_hidden_state
    V, L0, K = target.config.vocab_size, ids.shape[1], 2
    ones = torch.ones(2, dtype=torch.long)

    def drafter(prompt_len, path="eager"):
        d = _per_step_k(MTPDrafter(target, layers), path, K)
        d.start(target_vocab_size=V, batch_size=2, device="cpu", sampling=SamplingConfig(),
                generator=torch.Generator().manual_seed(0), max_length=full.shape[1] + 8)
        d.observe_prompt(hidden[:, :prompt_len], torch.ones(2, prompt_len, dtype=torch.long))
        return d

    seen = torch.empty(2, 1, hidden.shape[-1])  # one buffer, rewritten each plain step (as a CUDA graph's output is)

    def plain_step(d, n):
        seen.copy_(hidden[:, n - 1:n])
        d.observe_tokens(seen, ones)

    for before, between in ((0, 0), (0, 1), (0, 5), (3, 0), (2, 4)):
        d, n = drafter(L0, path), L0 + 1  # the text: the prompt and its pending token
        for _ in range(before):  # plain steps before the first proposal: one committed position each
            plain_step(d, n)
            n += 1
        d.propose(full[:, :n], torch.full((2,), n), K)
        # a step that accepts the first draft: the pending token's and that draft's positions
        d.observe_tokens(hidden[:, n - 1:n + 1], 2 * ones)
        n += 2
        for _ in range(between):  # plain steps: no proposal asked
            plain_step(d, n)
            n += 1
        d.propose(full[:, :n], torch.full((2,), n), K)
        assert d.last_path == path and d.cache.seq_len.tolist() == [n - 1] * 2, (family, before, between)
        fresh = drafter(n - 1)
        fresh.propose(full[:, :n], torch.full((2,), n), K)
        # (the first step's: later steps read the token sampled at the first, from another generator state)
        assert torch.allclose(d.draft_probs()[:, 0], fresh.draft_probs()[:, 0], atol=1e-5), (family, before, between)


def test_a_row_admitted_before_the_first_proposal_keeps_none_of_its_old_prompt():
    """Continuous batching before the first proposal: a row that takes a shorter prompt than the
    one it had is prefilled with the new prompt alone (its old prompt's columns left out), as a
    drafter started on the new prompt would."""
    from test_generate_batch_drafters import mtp_target

    target, layers = mtp_target("qwen3_5")
    torch.manual_seed(2)
    V, K = target.config.vocab_size, 2
    old = target.generate(torch.randint(3, 90, (2, 10)), max_new_tokens=1, do_sample=False, pad_token_id=0)
    new = target.generate(torch.randint(3, 90, (1, 4)), max_new_tokens=1, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        h_old, h_new = (target.model(input_ids=t[:, :-1]).last_hidden_state for t in (old, new))

    def drafter(batch):
        d = MTPDrafter(target, layers)
        d.start(target_vocab_size=V, batch_size=batch, device="cpu", sampling=SamplingConfig(),
                generator=torch.Generator().manual_seed(0), max_length=16)
        return d

    d = drafter(2)
    d.observe_prompt(h_old, torch.ones(2, 10, dtype=torch.long))
    d.admit(torch.tensor([1]), new[:, :-1], torch.ones(1, 4, dtype=torch.long), h_new, None)
    text = torch.zeros(2, 11, dtype=torch.long)
    text[0], text[1, :5] = old[0], new[0]
    d.propose(text, torch.tensor([11, 5]), K)
    fresh = drafter(1)
    fresh.observe_prompt(h_new, torch.ones(1, 4, dtype=torch.long))
    fresh.propose(new, torch.tensor([5]), K)
    assert int(d.cache.seq_len[1] - d.cache.pad[1]) == int(fresh.cache.seq_len[0]) == 4  # (entries past its padding)
    assert torch.allclose(d.draft_probs()[1, 0], fresh.draft_probs()[0, 0], atol=1e-5)


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_a_long_run_of_plain_steps_catches_up_in_chunks(family, path):
    """A row that ended at the end of the text (no more entries) beside a row that went on for more
    plain steps than the MTP cache has spare columns: the next proposal catches up in chunks and
    writes no KV column past the cache (one forward of every entry would, for the ended row), and
    the live row's first draft distribution equals a drafter fed its whole text. (On the static
    path the chunks are the catch-up program's K + 1 entries.)"""
    from test_generate_batch_drafters import mtp_target

    target, layers = mtp_target(family)
    torch.manual_seed(1)
    V, K = target.config.vocab_size, 2
    full = target.generate(torch.randint(3, 90, (2, 6)), max_new_tokens=34, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hidden = target.model(input_ids=full).last_hidden_state
    W = full.shape[1]  # 40 columns: the text's most

    def drafter(rows, prompt_len, path="eager"):
        d = _per_step_k(MTPDrafter(target, layers), path, K)
        d.start(target_vocab_size=V, batch_size=len(rows), device="cpu", sampling=SamplingConfig(),
                generator=torch.Generator().manual_seed(0), max_length=W)
        d.observe_prompt(hidden[rows, :prompt_len], torch.ones(len(rows), prompt_len, dtype=torch.long))
        return d

    d, n = drafter([0, 1], 6, path), torch.tensor([7, 7])  # each prompt and its pending token
    d.propose(full, n, K)
    d.observe_tokens(hidden[:, 6:39], torch.tensor([33, 1]))  # row 0 takes its last 33 tokens and ends
    n += torch.tensor([33, 1])
    d.propose(full, n, K)
    for _ in range(30):  # row 1 alone, 30 plain steps: more entries than the cache's 12 spare columns
        d.observe_tokens(torch.stack([hidden[0, :1], hidden[1, n[1] - 1:n[1]]]), torch.tensor([0, 1]))
        n[1] += 1
    d.propose(full, n, K)
    assert d.last_path == path and d.cache.seq_len.tolist() == [39, int(n[1]) - 1]
    grew = "grew from at most 2 to 3" if path == "eager" else "=3 is above the largest K of this generate"
    with pytest.raises(ValueError, match=grew):
        d.propose(full, n, K + 1)  # (a cache made for K = 2, without set_speculation: not written past)
    fresh = drafter([1], int(n[1]) - 1)
    fresh.propose(full[1:], n[1:], K)
    assert torch.allclose(d.draft_probs()[1, 0], fresh.draft_probs()[0, 0], atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_fixed_k_static_drafts_equal_the_eager_ones(family):
    """A fixed K on the static path proposes what the eager path does for every row, a row that
    has ended (no entries to run) included, over proposals after steps that committed 0 to K + 1
    positions a row."""
    from test_generate_batch_drafters import mtp_target

    target, layers = mtp_target(family)
    torch.manual_seed(3)
    full = target.generate(torch.randint(3, 90, (2, 6)), max_new_tokens=30, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hidden = target.model(input_ids=full).last_hidden_state
    K, drafts = 2, {}
    for path in ("eager", "static"):
        d = MTPDrafter(target, layers)
        d.set_decode_path(path)
        d.set_speculation(K, False)
        d.start(target_vocab_size=target.config.vocab_size, batch_size=2, device="cpu", max_length=full.shape[1])
        d.observe_prompt(hidden[:, :6], torch.ones(2, 6, dtype=torch.long))
        n, drafts[path] = [7, 7], []
        for take in ([2, 1], [1, 3], [3, 0], [1, 0], [2, 0]):  # row 1 ends after its third step
            drafts[path].append(d.propose(full, torch.tensor(n), K)[0])
            seen = torch.zeros(2, K + 1, hidden.shape[-1])
            for b in range(2):
                seen[b, :take[b]] = hidden[b, n[b] - 1:n[b] - 1 + take[b]]
            d.observe_tokens(seen, torch.tensor(take))
            n = [a + t for a, t in zip(n, take)]
        drafts[path].append(d.propose(full, torch.tensor(n), K)[0])
        assert d.last_path == path
    assert torch.equal(torch.stack(drafts["eager"]), torch.stack(drafts["static"])), family


def test_each_failed_capture_of_k_chosen_per_step_is_reported(monkeypatch):
    """K chosen per step on the CUDA-graph path (captures simulated on a CPU): a program whose
    capture fails (the catch-up's, K = 2's) runs uncaptured from then on, and the drafter's
    ``capture_error`` (the call's ``draft_error``) names each, also after another K's program
    captured; the drafts equal the eager path's."""
    import specdec.graphs as graphs
    from test_generate_batch_drafters import mtp_target

    class Replayed:  # a "graph" that runs the program
        def __init__(self, fn):
            self.replay = fn

    def capture(fn, *, what, **kw):
        if "catch-up" in what or "K = 2" in what:
            raise graphs.CaptureFailure(what, RuntimeError("simulated"))
        return Replayed(fn), None

    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    target, layers = mtp_target("qwen3_5")
    torch.manual_seed(1)
    V = target.config.vocab_size
    full = target.generate(torch.randint(3, 90, (2, 6)), max_new_tokens=34, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hidden = target.model(input_ids=full).last_hidden_state
    drafts = {}
    for path in ("eager", "cuda_graph"):
        d = _per_step_k(MTPDrafter(target, layers), path, 2)
        d.start(target_vocab_size=V, batch_size=2, device="cpu", max_length=full.shape[1])
        d.observe_prompt(hidden[:, :6], torch.ones(2, 6, dtype=torch.long))
        n, drafts[path] = 7, []
        with pytest.warns(RuntimeWarning) if path == "cuda_graph" else contextlib.nullcontext():
            for K in (2, 2, 2, 1, 1, 1):  # each proposal after 4 plain steps: the catch-up runs
                drafts[path].append(d.propose(full, torch.full((2,), n), K)[0])
                for _ in range(4):
                    d.observe_tokens(hidden[:, n - 1:n], torch.ones(2, dtype=torch.long))
                    n += 1
        if path == "cuda_graph":
            assert d._static.programs[1].graph is not None and d.last_path == "cuda_graph"
            assert "the MTP catch-up: RuntimeError" in d.capture_error
            assert "the MTP proposal (K = 2): RuntimeError" in d.capture_error
    assert all(torch.equal(a, b) for a, b in zip(drafts["eager"], drafts["cuda_graph"]))


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_tree_drafting_exact(saved, family):
    _, model = saved[family]
    ids, mask, eos, ref = _reference(model)
    folder = saved[family][0]
    for path, tree, strategy in (("eager", "default", "snapshot"), ("static", [[0], [1], [0, 0], [0, 1], [0, 0, 0]],
                                                                             "replay")):
        drafter = MTPDrafter.from_pretrained(folder, target=model, tree=tree)
        sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=3, decode_path=path)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos)
        assert torch.equal(out, ref), (family, path, tree)
        assert sd.last_stats.mean_accepted_tokens > 1.0


@torch.no_grad()
def test_tree_nodes_are_top_k_of_each_step(saved):
    folder, model = saved["qwen3_5"]
    ids = ragged_prompts()[0][:1]
    hidden = model.model(input_ids=ids).last_hidden_state
    text = torch.cat([ids, model.lm_head(hidden[:, -1]).argmax(-1)[:, None]], 1)
    chain = MTPDrafter.from_pretrained(folder, target=model)
    tree = MTPDrafter.from_pretrained(folder, target=model, tree=[[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]])
    for d in (chain, tree):
        d.start(target_vocab_size=96, batch_size=1, device="cpu", sampling=SamplingConfig(),
                generator=torch.Generator().manual_seed(0), max_length=32)
        d.observe_prompt(hidden, torch.ones_like(ids))
    chain.sampling = None
    top1 = chain.propose(text, torch.tensor([text.shape[1]]), 3)[0]
    nodes = tree.propose_tree(text, torch.tensor([text.shape[1]]), tree.tree.for_depth(3))
    # BFS order (depth, path): [0], [1], [2], [0,0], [0,1], [0,0,0]; the top-1 chain is the first branch
    assert nodes[0, [0, 3, 5]].tolist() == top1[0].tolist()
    assert len(set(nodes[0, :3].tolist())) == 3 and len(set(nodes[0, 3:5].tolist())) == 2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_cuda_graph_proposals_exact(saved, family):
    """On CUDA (fp32): the MTP proposal captured as a CUDA graph (chain and tree; Qwen3.5's chain also
    compiled whole, ``compile_proposal=True``) keeps the output equal to plain greedy decoding;
    from the second proposal on it replays the graph."""
    folder = saved[family][0]
    model = load(family, folder).cuda()
    ids, mask = (t.cuda() for t in ragged_prompts())
    L = ids.shape[1]
    eos = int(hf_greedy(model, ids, mask)[1, L + 3])
    ref = hf_greedy(model, ids, mask, eos=eos)
    # compiled whole (about a minute per shape): the chain of one family
    for tree, compiled in ((None, False), ("default", False), (None, family == "qwen3_5")):
        drafter = MTPDrafter.from_pretrained(folder, target=model, tree=tree, compile_proposal=compiled)
        sd = specdec.wrap(model, drafter=drafter, rollback="replay", num_speculative_tokens=3, decode_path="cuda_graph")
        for _ in range(2):
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos)
            assert torch.equal(out, ref), (family, tree, compiled)
        assert drafter.last_path == "cuda_graph", drafter.capture_error
        assert drafter.compile_error is None, drafter.compile_error  # (compiled: captured as one compiled graph)
        assert sd.last_stats.decode_path == "cuda_graph", sd.last_stats.capture_error


@pytest.mark.parametrize("family, draft_vocab", [(f, None) for f in MTP_FAMILIES] + [("qwen3_5", [3, 5, 7, 11, 40])],
                         ids=[*MTP_FAMILIES, "qwen3_5-draft-vocab"])
def test_static_proposal_traces_as_one_graph(saved, family, draft_vocab):
    """With ``compile_proposal=True`` the captured proposal is compiled whole with ``fullgraph=True``
    (CapturedProgram's ``compile_whole``): dynamo must trace it (catch-up, K - 1 steps, the LM head, argmax, the
    cache's bookkeeping) without a graph break, and the traced program must propose what the
    eager one does and leave the MTP cache as it does. Checked here with the ``aot_eager``
    backend (dynamo and functionalisation, no Inductor): on CPU the program is never captured."""
    folder, model = saved[family]
    ids, mask = ragged_prompts()
    drafter = MTPDrafter.from_pretrained(folder, target=model, draft_vocab=draft_vocab)
    sd = specdec.wrap(model, drafter=drafter, rollback="replay", num_speculative_tokens=4, decode_path="static")
    sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
    st = drafter._static
    cache = st.cache
    before = (cache.seq_len.clone(), {i: (k.clone(), v.clone()) for i, (k, v) in cache.kv.items()})

    def run(program):
        cache.seq_len.copy_(before[0])
        for i, (k, v) in before[1].items():
            cache.kv[i][0].copy_(k)
            cache.kv[i][1].copy_(v)
        st.outs[4].fill_(-1)  # poisoned: the program writes every draft
        with torch.no_grad():
            program()
        return st.outs[4].clone(), cache.seq_len.clone(), {i: (k.clone(), v.clone()) for i, (k, v) in cache.kv.items()}

    eager = run(st.programs[4].fn)
    torch._dynamo.reset()
    traced = run(torch.compile(st.programs[4].fn, fullgraph=True, dynamic=False, backend="aot_eager"))
    assert (eager[0] >= 0).all()
    assert torch.equal(traced[0], eager[0]) and torch.equal(traced[1], eager[1]), family
    for i in eager[2]:
        # every KV column, the committed ones and the open step's: the same ops, bit for bit with
        # transformers 5.17; newer releases' layers trace into other decompositions (1 ulp apart)
        for got, want in zip(traced[2][i], eager[2][i]):
            assert rel_err(got, want) < 1e-6, i


SAMPLING_KW = dict(temperature=0.8, top_k=6, top_p=0.95)


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    """The tiny-vocabulary target with MTP layers (its folder and the loaded model), the prompt
    repeated N times and HF sampling's continuations of it (drawn once for the sampling cases)."""
    V, N, P = 8, 2500, 3
    # the small model (one Gated DeltaNet and one attention layer): each case prefills N rows on both paths
    folder = save_with_mtp("qwen3_5", tmp_path_factory.mktemp("mtp_sampling"), seed=3, vocab=V, small=True)
    target = load("qwen3_5", folder)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]]).repeat(N, 1)
    hf = target.generate(prompt, max_new_tokens=P, do_sample=True, pad_token_id=0, **SAMPLING_KW)
    return (V, N, P), folder, target, prompt, hf


@pytest.mark.parametrize("draft_vocab", [None, [1, 3, 4, 6]], ids=["full-vocab", "draft-vocab-4-of-8"])
def test_sampling_keeps_the_target_distribution(sampling_setup, draft_vocab):
    """Lossless sampling; with a reduced vocabulary q is the drafter's softmax over those ids and
    zero elsewhere (the target samples every token, also those never drafted)."""
    (V, N, P), folder, target, prompt, hf = sampling_setup
    kw = SAMPLING_KW
    for path in ("eager", "static"):
        drafter = "mtp" if draft_vocab is None else MTPDrafter.from_pretrained(folder, target=target,
                                                                             draft_vocab=torch.tensor(draft_vocab))
        sd = specdec.wrap(target, drafter=drafter, rollback="ring", num_speculative_tokens=3, decode_path=path)
        out = sd.generate(prompt, max_new_tokens=P, do_sample=True, generator=torch.Generator().manual_seed(11),
                          pad_token_id=0, **kw)
        q = sd.drafter.draft_probs()
        assert q is not None and q.shape == (N, 3, V) and torch.allclose(q.sum(-1), torch.ones(N, 3))
        assert 0 < sd.last_stats.acceptance_rate < 1
        assert_same_token_distribution(hf, out, prompt.shape[1], P, V)
        if draft_vocab is not None:
            outside = [t for t in range(V) if t not in draft_vocab]
            assert q[:, :, outside].abs().max() == 0
            assert torch.isin(out[:, prompt.shape[1]:], torch.tensor(outside)).any()  # the target still samples them


# ------------------------------------------------------------------------ reduced draft vocabulary


def _outside_ids(ref, prompt_len, vocab=96, keep=40):
    """A draft vocabulary of ``keep`` ids that leaves out the two tokens HF's greedy output
    generates most often (so the target's token often falls outside it)."""
    new = ref[:, prompt_len:].reshape(-1)
    common = torch.bincount(new, minlength=vocab).topk(2).indices
    rest = [t for t in range(vocab) if t not in common.tolist()]
    return torch.tensor(rest[:keep]), common


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_reduced_vocabulary_greedy_exact(saved, family):
    """Greedy output equals HF's when the drafter scores only a subset of the vocabulary that
    leaves out tokens the target generates: chains on both paths and every strategy, and a tree;
    drafts stay inside the subset."""
    folder, model = saved[family]
    ids, mask, eos, ref = _reference(model)
    vocab, left_out = _outside_ids(ref, ids.shape[1])
    assert torch.isin(ref[:, ids.shape[1]:], left_out).any()
    for path in ("eager", "static"):
        for strategy in ALL_STRATEGIES:
            drafter = MTPDrafter.from_pretrained(folder, target=model, draft_vocab=vocab[torch.randperm(40)])
            sd = specdec.wrap(model, drafter=drafter, rollback=strategy, num_speculative_tokens=4, decode_path=path)
            out = sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos)
            assert torch.equal(out, ref), (family, path, strategy)
            assert sd.last_stats.decode_path == path
    text = torch.cat([ids[:1], ref[:1, ids.shape[1]:ids.shape[1] + 1]], 1)
    drafter.start(target_vocab_size=96, batch_size=1, device="cpu", max_length=32)
    drafter.observe_prompt(model(ids[:1], attention_mask=mask[:1], output_hidden_states=True).hidden_states[-1],
                           mask[:1])
    drafter.set_decode_path("eager")
    assert torch.isin(drafter.propose(text, torch.tensor([text.shape[1]]), 4)[0], vocab).all()
    tree = MTPDrafter.from_pretrained(folder, target=model, tree="default", draft_vocab=vocab)
    sd = specdec.wrap(model, drafter=tree, rollback="replay", num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos), ref)


@torch.no_grad()
def test_reduced_vocabulary_scores_the_lm_head_rows(saved):
    """The draft distribution over a subset is the softmax of the full logits' columns of those
    ids (the copied rows of the shared LM head), mapped back to the target's ids; the drafter
    holds an [N, D] copy of those rows."""
    folder, model = saved["qwen3_5"]
    ids = ragged_prompts()[0][:1]
    hidden = model.model(input_ids=ids).last_hidden_state
    text = torch.cat([ids, model.lm_head(hidden[:, -1]).argmax(-1)[:, None]], 1)
    vocab = torch.tensor([90, 5, 17, 3, 64, 41, 8, 77])
    qs = []
    for d in (MTPDrafter.from_pretrained(folder, target=model), MTPDrafter.from_pretrained(folder, target=model,
                                                                                          draft_vocab=vocab)):
        d.start(target_vocab_size=96, batch_size=1, device="cpu", sampling=SamplingConfig(temperature=1.0),
                generator=torch.Generator().manual_seed(0), max_length=32)
        d.observe_prompt(hidden, torch.ones_like(ids))
        drafts, _ = d.propose(text, torch.tensor([text.shape[1]]), 1)
        qs.append(d.draft_probs()[0, 0])
    full, reduced = qs
    sub = vocab.sort().values
    assert torch.allclose(reduced[sub], full[sub] / full[sub].sum(), atol=1e-6)
    assert reduced.sum().item() == pytest.approx(1.0) and (reduced > 0).sum() == len(vocab)
    assert torch.isin(drafts, vocab).all()
    assert torch.equal(d._head_weight, model.lm_head.weight[sub]) and d._head_weight.data_ptr() != model.lm_head.weight.data_ptr()


def test_draft_vocabulary_is_checked(saved):
    folder, model = saved["qwen3_5"]
    for bad, msg in ((torch.tensor([3, 96]), r"outside the target's vocabulary \[0, 96\): \[96\]"),
                     (torch.tensor([-1, 4]), r"outside .*: \[-1\]"),
                     (torch.tensor([5, 7, 5]), r"more than once: \[5\]"),
                     (torch.tensor([], dtype=torch.long), "non-empty 1-D"),
                     (torch.tensor([[1, 2]]), "non-empty 1-D")):
        with pytest.raises(ValueError, match=msg):
            MTPDrafter.from_pretrained(folder, target=model, draft_vocab=bad)
    with pytest.raises(TypeError, match="integer token ids"):
        MTPDrafter.from_pretrained(folder, target=model, draft_vocab=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="rank"):  # a tree ranking deeper than the draft vocabulary
        MTPDrafter.from_pretrained(folder, target=model, tree=[[0], [3]], draft_vocab=torch.tensor([4, 5, 6]))


def test_frequent_token_ids():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3])
    assert frequent_token_ids(3, counts=counts).tolist() == [0, 2, 3]
    assert frequent_token_ids(6, counts=counts).tolist() == [0, 1, 2, 3, 4, 6]  # ties (ids 1, 5): the lower first
    tokens = torch.tensor([[6, 6, 2], [6, 4, 2]])
    assert frequent_token_ids(2, tokens=tokens, vocab_size=7).tolist() == [2, 6]
    with pytest.raises(ValueError, match="exactly one"):
        frequent_token_ids(2)
    with pytest.raises(ValueError, match="vocab_size"):
        frequent_token_ids(2, tokens=tokens)
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        frequent_token_ids(2, tokens=tokens, vocab_size=5)
    with pytest.raises(ValueError, match=r"n must be in \[1, 7\]"):
        frequent_token_ids(8, counts=counts)
    with pytest.raises(ValueError, match=">= 0"):
        frequent_token_ids(1, counts=torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_random_layers_for_a_shape_without_mtp_weights(family):
    """MTPDrafter.random: layers built from a config that declares none, seeded (the caller's
    random state untouched), exact as any drafter."""
    model = make_model(family)
    ids, mask, eos, ref = _reference(model)
    state = torch.random.get_rng_state()
    a, b = MTPDrafter.random(model, seed=3), MTPDrafter.random(model, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (k, v), w in zip(a.layers.state_dict().items(), b.layers.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert a.layers.num_steps == 1
    sd = specdec.wrap(model, drafter=MTPDrafter.random(model, num_layers=2, draft_vocab=torch.arange(3, 40)),
                      num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos), ref)


def test_a_drafter_made_for_another_model_is_refused():
    """An MTP drafter reads its target's embedding and LM head: given to a generator of another
    model (here a second copy of the same weights), wrap() and the drafter setter refuse it,
    naming how to make one for this model; the generator keeps its drafter."""
    model = make_model("qwen3_5")
    other = copy.deepcopy(model)
    drafter = MTPDrafter.random(model, seed=3)
    with pytest.raises(ValueError, match=r"made for another model .*MTPDrafter\.random\(model"):
        specdec.wrap(other, drafter=drafter, num_speculative_tokens=2)
    sd = specdec.wrap(other, drafter="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="made for another model"):
        sd.drafter = drafter
    assert type(sd.drafter).__name__ == "NGramDrafter"
    sd.drafter = MTPDrafter.random(other, seed=3)  # made for this one
    ids, mask, eos, ref = _reference(other)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=eos), ref)


def test_a_compiled_model_takes_the_drafter_made_for_the_model_it_wraps():
    """torch.compile(model) wraps the model the drafter was made for: its MTP drafter (made
    for the model or for the compiled wrapper) is the same model's, accepted both ways, exact."""
    model = make_model("qwen3_5")
    compiled = torch.compile(model)
    ids, mask, eos, ref = _reference(model)
    for target, made_for in ((compiled, model), (model, compiled)):
        sd = specdec.wrap(target, drafter=MTPDrafter.random(made_for, seed=3), num_speculative_tokens=2,
                          decode_path="eager")
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, eos_token_id=eos)
        assert torch.equal(out, ref[:, :out.shape[1]])


# ------------------------------------------------------------------------ checkpoints and errors


def test_sharded_and_fused_expert_checkpoints_load_the_same(saved, tmp_path):
    folder, model = saved["qwen3_5_moe"]
    ids, mask, eos, ref = _reference(model)
    sd = specdec.wrap(model, drafter="mtp", num_speculative_tokens=3)
    one = sd.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    tensors = {k: v for k, v in load_file(str(Path(folder) / "model.safetensors")).items() if k.startswith("mtp.")}
    fused = {}  # experts stored fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
    E = model.config.num_experts
    pre = "mtp.layers.0.mlp.experts."
    fused[pre + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{pre}{e}.gate_proj.weight"),
                                                          tensors.pop(f"{pre}{e}.up_proj.weight")]) for e in range(E)])
    fused[pre + "down_proj"] = torch.stack([tensors.pop(f"{pre}{e}.down_proj.weight") for e in range(E)])
    save_file({**tensors, **fused}, str(sharded / "model-mtp.safetensors"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in {**tensors, **fused}})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((sharded / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (sharded / "config.json").write_text(json.dumps(cfg))
    again = load("qwen3_5_moe", sharded)
    assert torch.equal(specdec.wrap(again, drafter="mtp", num_speculative_tokens=3).generate(
        ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), one)
    d1, d2 = MTPDrafter.from_pretrained(folder, target=model), MTPDrafter.from_pretrained(sharded, target=model)
    for (k1, v1), (k2, v2) in zip(d1.layers.state_dict().items(), d2.layers.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2), k1


def test_missing_and_misshapen_tensors_raise(saved, tmp_path):
    folder, model = saved["qwen3_5"]
    plain = tmp_path / "plain"
    model.save_pretrained(plain)  # transformers drops mtp.*: a checkpoint without MTP tensors
    with pytest.raises(ValueError, match=r"no MTP tensors \(names starting with mtp\. .*plain/model.safetensors"):
        MTPDrafter.from_pretrained(plain, target=model)
    state = load_file(str(Path(folder) / "model.safetensors"))
    cases = {
        "missing": ({k: v for k, v in state.items() if k != "mtp.norm.weight"}, r"missing \['mtp.norm.weight'\]"),
        "misshapen": ({**state, "mtp.fc.weight": state["mtp.fc.weight"][:, :48].contiguous()},
                      r"wrong shapes \['mtp.fc.weight: \(48, 48\), expected \(48, 96\)'\]"),
        "unexpected": ({**state, "mtp.layers.1.input_layernorm.weight": state["mtp.norm.weight"].clone()},
                       r"unexpected \['mtp.layers.1.input_layernorm.weight'\]"),
    }
    for case, (tensors, msg) in cases.items():
        bad = tmp_path / case
        model.save_pretrained(bad)
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=msg):
            MTPDrafter.from_pretrained(bad, target=model)
        with pytest.raises(ValueError, match="mtp_num_hidden_layers=1"):
            specdec.wrap(load("qwen3_5", bad), drafter="mtp")
    # the MTP tensors shipped, the config's count field lost: the message says the files hold them
    nofield = tmp_path / "nofield"
    model.save_pretrained(nofield)
    save_file(state, str(nofield / "model.safetensors"))
    bare = make_model("qwen3_5")  # its config declares no MTP layers
    with pytest.raises(ValueError, match=r"mtp_num_hidden_layers=None.*holds MTP tensors, so its config.json lacks"):
        MTPDrafter.from_pretrained(nofield, target=bare)
    with pytest.raises(ValueError, match=r"mtp_num_hidden_layers=None\): a checkpoint that ships them sets it") as err:
        MTPDrafter.from_pretrained(plain, target=bare)  # no MTP tensors either: only the config is named
    assert "holds MTP tensors" not in str(err.value) and "ships no MTP head" in str(err.value)
    assert type(err.value) is ValueError and "drafter='ngram'" in str(err.value)  # (not a private subclass)
    # an index that maps the MTP tensors to a shard that is not there
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded)
    (sharded / "model.safetensors").unlink()
    weight_map = {k: "model-mtp.safetensors" if k.startswith("mtp.") else "model-0.safetensors" for k in state}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({k: v for k, v in state.items() if not k.startswith("mtp.")}, str(sharded / "model-0.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"index.json maps the MTP tensors .* to model-mtp.safetensors, "
                                                r"which is not in"):
        MTPDrafter.from_pretrained(sharded, target=model)
    moe = saved["nemotron_h"][0]
    state = load_file(str(Path(moe) / "model.safetensors"))
    state.pop("mtp.layers.1.mixer.experts.3.up_proj.weight")
    bad = tmp_path / "expert"
    saved["nemotron_h"][1].save_pretrained(bad)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['mtp.layers.1.mixer.experts.up_proj'\]"):
        MTPDrafter.from_pretrained(bad, target=saved["nemotron_h"][1])


def test_what_the_drafter_needs_is_checked():
    model = make_model("qwen3_5")
    with pytest.raises(ValueError, match="declares no MTP layers"):
        mtp_layers_for(model)
    for bad in (0, -1, 1.5, True):  # a count asked for: the caller's argument named, not the config
        with pytest.raises(ValueError, match=rf"the number of MTP layers must be an int >= 1, got {bad!r}"):
            MTPDrafter.random(model, num_layers=bad)
    model.config.mtp_num_hidden_layers = 1
    with pytest.raises(ValueError, match="config._name_or_path is empty"):
        specdec.wrap(model, drafter="mtp")
    with pytest.raises(ValueError, match="pass the target"):
        make_drafter("mtp")
    with pytest.raises(ValueError, match="no MTP layout is known for model_type 'kimi_linear'"):
        mtp_layers_for(make_model("kimi_linear"))
    with pytest.raises(FileNotFoundError, match="not one"):
        MTPDrafter.from_pretrained("/nonexistent", target=model)
    with pytest.raises(ValueError, match="use one of .*'mtp'"):
        make_drafter("eagle")
    layers = mtp_layers_for(model)
    with pytest.raises(RuntimeError, match="before observe_prompt"):
        MTPDrafter(model, layers).propose(torch.ones(1, 4, dtype=torch.long), torch.tensor([4]), 2)
    with pytest.raises(TypeError, match="compile_proposal must be a bool, got int"):
        MTPDrafter(model, layers, compile_proposal=1)


# ------------------------------------------------------------------------ the zoo


@pytest.mark.parametrize("name", ["gdn-target", "mamba2-target"])
def test_zoo_targets_ship_mtp_layers(name):
    model, tok = zoo.load(name)
    entry = zoo.manifest()["models"][name]["mtp"]
    cfg = model.config
    assert getattr(cfg, entry["count_field"]) == entry["num_layers"] == 1
    assert entry["recipe"]["module"] == "specdec.experiments.train_mtp" and entry["other_tensors_unchanged"]
    texts = [p["prompt"] for p in zoo.prompts("128", limit=3)]
    enc = tok(texts, return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    sd = specdec.wrap(model, drafter="mtp", rollback="replay", num_speculative_tokens=4)
    assert isinstance(sd.drafter, MTPDrafter)
    out = sd.generate(**enc, max_new_tokens=24, pad_token_id=tok.pad_token_id)
    assert torch.equal(out, ref)
    assert sd.last_stats.mean_accepted_tokens > 1.5
    # the manifest's per-step held-out accuracy, recomputed from the shipped sample
    ids = torch.tensor([r["input_ids"] for r in zoo.heldout_sample()], dtype=torch.long)
    hidden = collect_hidden_states(model, ids, progress=False)
    ev = mtp_accuracy(sd.drafter, hidden, ids, ids, entry["chain_steps"])
    # (recorded with transformers 5.17; later releases' fp32 forwards round differently, which flips
    # a few of the ~10k near-tied argmaxes: up to 3e-4 with 5.25)
    assert [round(a, 4) for a in ev["top1"]] == pytest.approx(entry["heldout_top1"], abs=1e-3)
    assert ev["top1"][0] > 0.25  # trained: a random layer scores ~1/8192


def test_acceptance_experiment_with_mtp(tmp_path):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=zoo", "drafter=mtp", "rollback=replay", "prompts.limit=1", "max_new_tokens=8",
            "experiment.warmup=false", "device=cpu", "progress=false"])
    records = run_experiment(cfg, tmp_path)
    assert [(r["model"], r["drafter"]) for r in records] == [("gdn-target", "mtp"), ("mamba2-target", "mtp")]
    assert all(r["exact"] and r["mean_accepted_tokens"] >= 1.0 for r in records)
    # a reduced draft vocabulary: the corpus's 1024 most frequent tokens, its own row
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=gdn-target", "drafter=mtp", "drafter.mtp_draft_vocab=1024", "rollback=replay", "prompts.limit=1",
            "max_new_tokens=8", "experiment.warmup=false", "device=cpu", "progress=false"])
    records = run_experiment(cfg, tmp_path / "reduced")
    assert [(r["drafter"], r["exact"]) for r in records] == [("mtp-vocab:1024", True)]


def test_training_recipe_smoke(tmp_path):
    """``python -m specdec experiment=train_mtp`` end to end at a tiny scale (seconds)."""
    out = tmp_path / "run"
    proc = run_python(["-m", "specdec", "experiment=train_mtp", "target=mamba2-target", "device=cpu", "progress=false",
                       "data.tokens=2048", "data.seq_len=128", "train.steps=2", "train.batch_positions=64",
                       "train.log_every=1", "train.chain_steps=2", f"out_dir={out}",
                       f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss per step" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"specdec-run: trained; models and manifest in {out / 'zoo'} (MANIFEST.json)"
    man = json.loads((out / "zoo" / "MANIFEST.json").read_text())
    entry = man["models"]["mamba2-target"]["mtp"]
    assert entry["steps"] == 2 and entry["train_tokens"] == 2048 and len(entry["heldout_top1"]) == 2
    assert entry["config_fields"]["num_nextn_predict_layers"] == 1 and entry["other_tensors_unchanged"]
    model, _ = zoo.load("mamba2-target", root=out / "zoo")  # hash-checked against the new manifest
    assert model.config.num_nextn_predict_layers == 1 and model.config.moe_intermediate_size == 96
    assert isinstance(specdec.wrap(model, drafter="mtp").drafter, MTPDrafter)
    assert zoo.manifest()["models"]["mamba2-target"]["files"] != man["models"]["mamba2-target"]["files"]
