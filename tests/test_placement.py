"""Models dispatched by accelerate (``from_pretrained(..., device_map=...)``): decoder layers whose
weights are offloaded to disk or kept on the CPU, loaded by accelerate's hooks for each forward.
specdec must decode them exactly, leave the hooks as they were, and refuse a layout it cannot
run with a clear error (:mod:`specdec.placement`)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
from helpers import MAX_NEW, hf_greedy, reference
from markers import needs_cuda
from tiny_models import EXTRA_FAMILIES, FAMILIES, VOCAB, get_model, make_model, ragged_prompts
from transformers import AutoModelForCausalLM

import specdec
from specdec.drafters import DraftModelDrafter, MedusaDrafter, MedusaHeads
from specdec.hf_integration import disable_hf_speculation
from specdec.placement import execution_device, execution_devices, offloads_weights

STRATEGIES = ("snapshot", "ring", "replay", "replay_deferred")


def _device_map(model, lm_head: str = "cpu", embeddings: str = "cpu") -> dict:
    """Every other decoder layer offloaded to disk (the first included), the others and the final
    norm on the CPU; the LM head on ``lm_head``, the input embeddings on ``embeddings``."""
    base = model.base_model_prefix
    body = getattr(model, base)
    emb = body.get_input_embeddings()
    dm = {f"{base}.{name}": embeddings if mod is emb else "cpu" for name, mod in body.named_children()
          if name != "layers"}
    dm.update({f"{base}.layers.{i}": "disk" if i % 2 == 0 else "cpu" for i in range(len(body.layers))})
    dm.update({name: lm_head for name, _ in model.named_children() if name != base})
    return dm


_DISPATCHED: dict = {}


def dispatched(family: str, tmp_path_factory, lm_head: str = "cpu", embeddings: str = "cpu"):
    """``family``'s tiny target saved and loaded back with :func:`_device_map` (shared per module)."""
    key = (family, lm_head, embeddings)
    if key not in _DISPATCHED:
        model = get_model(family)
        folder = tmp_path_factory.mktemp(f"{family}_dispatched")
        model.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder, device_map=_device_map(model, lm_head, embeddings),
                                                      offload_folder=str(folder / "offload"), dtype=torch.float32)
        loaded.generation_config = model.generation_config
        assert offloads_weights(loaded) and any(p.device.type == "meta" for p in loaded.parameters())
        _DISPATCHED[key] = loaded.eval()
    return _DISPATCHED[key]


def _hooks(model) -> list:
    return [(name, id(mod._hf_hook), mod.forward.__func__ if hasattr(mod.forward, "__func__") else mod.forward)
            for name, mod in model.named_modules() if hasattr(mod, "_hf_hook")]


@pytest.mark.filterwarnings("ignore:You are calling .generate\\(\\) with the `input_ids` being on a device type")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offloaded_layers_decode_exactly(family, strategy, tmp_path_factory):
    """Half the decoder layers offloaded to disk: greedy output == HF's greedy on the model in
    memory (ragged batch, EOS), on the eager and static paths; the accelerate hooks are the same
    objects afterwards and HF's own generate still gives the same output."""
    ids, mask, eos, ref = reference(family)
    model = dispatched(family, tmp_path_factory)
    hooks = _hooks(model)
    for path in ("auto", "static"):
        sd = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=2, decode_path=path)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), (family, strategy, path)
        assert sd.last_stats.decode_path == ("eager" if path == "auto" else "static")
    assert _hooks(model) == hooks
    if strategy == "replay":  # HF's own assisted generation switched on and off leaves the hooks too
        specdec.enable_hf_speculation(model)
        disable_hf_speculation(model)
        assert _hooks(model) == hooks
    assert any(p.device.type == "meta" for p in model.parameters())  # the offloaded weights were dropped again
    assert torch.equal(hf_greedy(model, ids, mask, eos=eos), ref)


@pytest.mark.parametrize("family", ["bamba", "lfm2", "olmo_hybrid"])
def test_offloaded_layers_of_other_families(family, tmp_path_factory):
    """The families whose mixers read other weights directly (Mamba-2 in Bamba, LFM2's short
    conv, OLMo-hybrid's GDN with its own projections) decode offloaded layers exactly too."""
    assert family in EXTRA_FAMILIES
    ids, mask, eos, ref = reference(family)
    sd = specdec.wrap(dispatched(family, tmp_path_factory), drafter="ngram", rollback="replay", num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_offloaded_lm_head_and_draft_model(family, tmp_path_factory):
    """The LM head offloaded too, and a draft model that is itself dispatched with offloaded layers:
    exact; plain decoding (K = 0) and K = "auto" through the same path as well."""
    ids, mask, eos, ref = reference(family)
    model = dispatched(family, tmp_path_factory, lm_head="disk")
    draft = DraftModelDrafter(dispatched(family, tmp_path_factory))  # (the same weights: every draft accepted)
    for K in (0, 3, "auto"):
        sd = specdec.wrap(model, drafter=draft, rollback="replay", num_speculative_tokens=K)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), K
    assert sd.last_stats.decode_path == "eager"


def test_placement_queries_and_errors(tmp_path_factory):
    """The execution device comes from the hooks (the offloaded weights are on meta); graphs are
    refused for offloaded weights; a layer computing on a CUDA device the machine does not have is
    refused at wrap with the devices and their layers named; the model is left as it was."""
    model = dispatched("qwen3_5", tmp_path_factory)
    body = model.model
    assert execution_device(body.layers[0]) == torch.device("cpu")  # its weights: on meta
    assert all(p.device.type == "meta" for p in body.layers[0].parameters())
    with pytest.raises(ValueError, match="cannot replay a model whose weights accelerate loads"):
        specdec.wrap(model, decode_path="cuda_graph")

    plain = get_model("nemotron_h")  # in memory: one layer given a hook with a device this machine lacks
    layer = plain.model.layers[1]
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 1
    add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("cuda", missing), io_same_device=True))
    try:
        with pytest.raises(ValueError, match=rf"device cuda:{missing} is not available .*computes on cpu: layers 0, "
                                             rf"2-4, lm_head; cuda:{missing}: layers 1\. Dispatch it"):
            specdec.wrap(plain)
    finally:
        remove_hook_from_module(layer)
    assert not hasattr(layer, "_hf_hook")
    ids, mask, eos, ref = reference("nemotron_h")
    out = specdec.wrap(plain, rollback="replay").generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                                          eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


def _split_layer_map(model, layer: int, parts: dict) -> dict:
    """Everything on the CPU, decoder layer ``layer`` mapped per submodule: ``parts[name]``, else "cpu"."""
    dm = {k: "cpu" for k in _device_map(model)}
    del dm[f"model.layers.{layer}"]
    dm.update({f"model.layers.{layer}.{name}": parts.get(name, "cpu")
               for name, _ in model.model.layers[layer].named_children()})
    return dm


def test_layer_split_between_execution_devices(tmp_path):
    """A device_map that maps one decoder layer's submodules separately: split between "cpu" and
    "disk" (both computing on the CPU) it decodes exactly; with its MLP on another execution device
    ("meta" stands in for a second GPU: on a CPU-only machine "cpu" and "disk" both compute on the
    CPU) wrap() refuses it, naming the devices, the whole layers and the split layer's parts."""
    from accelerate import dispatch_model

    ids, mask, eos, ref = reference("qwen3_5")
    saved = get_model("qwen3_5")
    saved.save_pretrained(tmp_path)
    split = AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map=_split_layer_map(saved, 1, {"linear_attn": "disk"}),
        offload_folder=str(tmp_path / "offload"), dtype=torch.float32).eval()
    assert all(p.device.type == "meta" for p in split.model.layers[1].linear_attn.parameters())
    assert execution_devices(split.model.layers[1]) == {
        torch.device("cpu"): ["linear_attn", "mlp", "input_layernorm", "post_attention_layernorm"]}
    sd = specdec.wrap(split, drafter="ngram", rollback="replay", num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)

    model = dispatch_model(make_model("qwen3_5").eval(), device_map=_split_layer_map(saved, 1, {"mlp": "meta"}),
                           main_device="cpu")
    layer = model.model.layers[1]
    assert execution_device(layer) == torch.device("cpu")  # the first hooked submodule's: not the whole story
    assert execution_devices(layer) == {torch.device("cpu"): ["linear_attn", "input_layernorm",
                                                              "post_attention_layernorm"],
                                        torch.device("meta"): ["mlp"]}
    with pytest.raises(ValueError, match=r"several \(cpu: layers 0, 1\.linear_attn, 1\.input_layernorm, "
                                         r"1\.post_attention_layernorm, 2, 3, lm_head; meta: layers 1\.mlp\)"):
        specdec.wrap(model)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_mtp_drafter_beside_an_offloaded_lm_head(family, tmp_path):
    """drafter="mtp" on a checkpoint loaded with its decoder layers and LM head offloaded: the MTP
    layers are built on the execution device (not meta), the reduced draft vocabulary copies the
    head's rows through its hook, and both decode exactly."""
    from test_mtp import save_with_mtp

    from specdec.drafters import MTPDrafter

    folder = save_with_mtp(family, tmp_path, fit_steps=0)
    in_memory = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = ragged_prompts()
    ref = hf_greedy(in_memory, ids, mask)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=_device_map(in_memory, "disk"),
                                                 offload_folder=str(tmp_path / "offload")).eval()
    vocab = torch.arange(0, VOCAB, 2)
    for drafter in ("mtp", MTPDrafter.from_pretrained(folder, target=model, draft_vocab=vocab)):
        sd = specdec.wrap(model, drafter=drafter, rollback="replay", num_speculative_tokens=2)
        assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0), ref)
        assert next(sd.drafter.layers.parameters()).device == torch.device("cpu")


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_medusa_heads_beside_an_offloaded_lm_head(family, tmp_path_factory, tmp_path):
    """MedusaHeads.from_target on a model whose LM head is offloaded to disk: the heads are built
    on the execution device (not meta) and copy the head's weight through its hook (owned and
    shared projections equal the weight as saved); heads loaded back with from_pretrained(target=)
    land there too; chain and tree drafting decode exactly; the LM head's weight is dropped again."""
    from tree_drafters import SMALL_TREE

    ids, mask, eos, ref = reference(family)
    model = dispatched(family, tmp_path_factory, lm_head="disk")
    saved = get_model(family).lm_head.weight
    assert model.lm_head.weight.device.type == "meta"
    heads = MedusaHeads.from_target(model, num_heads=3)
    assert {p.device for p in heads.parameters()} == {torch.device("cpu")}
    assert all(torch.equal(lin.weight, saved) for lin in heads.lm_heads)
    shared = MedusaHeads.from_target(model, num_heads=2, shared_lm_head=True)
    assert torch.equal(shared.shared_weight, saved)
    heads.save_pretrained(tmp_path)
    back = MedusaHeads.from_pretrained(tmp_path, target=model)
    assert {p.device for p in back.parameters()} == {torch.device("cpu")}
    for drafter in (MedusaDrafter(heads), MedusaDrafter(back, tree=SMALL_TREE), MedusaDrafter(shared, tree="default")):
        sd = specdec.wrap(model, drafter=drafter, rollback="replay", num_speculative_tokens=3)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), drafter
    assert sd.last_stats.proposed_tokens > 0
    assert model.lm_head.weight.device.type == "meta"


def test_cpu_threads_for_offloaded_first_parameters(tmp_path_factory, monkeypatch):
    """The model's first parameters (its input embeddings) offloaded to disk, so on meta: wrap()
    picks the CPU thread count for the device the model computes on (the CPU), not "not on CPU";
    configure_cpu_threads(model) without a device too; the decoding is exact."""
    from specdec import threads

    ids, mask, eos, ref = reference("qwen3_5")
    model = dispatched("qwen3_5", tmp_path_factory, embeddings="disk")
    assert next(model.parameters()).device.type == "meta"
    real, seen = threads.configure_cpu_threads, []

    def record(*args, **kwargs):
        seen.append((kwargs.get("device"), real(*args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(threads, "configure_cpu_threads", record)
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
    assert [(dev, choice.source != "not on CPU") for dev, choice in seen] == [(torch.device("cpu"), True)]
    assert real(model).source != "not on CPU"
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)


def test_app_loads_an_hf_target_with_a_device_map(tmp_path):
    """specdec-run model=hf with model.targets.0.device_map=auto and a CPU budget that sends the
    layers to disk: the run decodes the offloaded model exactly; a device_map accelerate does not
    know, or max_memory without a device_map, is one clear error."""
    from omegaconf import OmegaConf
    from test_experiments import _cfg

    import specdec.zoo
    from specdec.experiments.app import run_experiment
    from specdec.experiments.models import load_hf

    folder = tmp_path / "model"
    make_model("qwen3_5", vocab=8192).save_pretrained(folder)  # the zoo tokenizer's vocabulary
    tok = specdec.zoo.path("tokenizer")
    spec = OmegaConf.create({"name": str(folder), "source": "hf", "tokenizer": str(tok), "device_map": "auto",
                             "max_memory": {"cpu": "60KB"}, "offload_folder": str(tmp_path / "offload")})
    model, _ = load_hf(spec, torch.device("cpu"), torch.float32)
    assert offloads_weights(model) and (tmp_path / "offload").is_dir()
    cfg = _cfg(["model=hf", f"model.targets.0.name={folder}", f"model.targets.0.tokenizer={tok}",
                "model.targets.0.device_map=auto", "model.targets.0.max_memory={cpu: 60KB}", "drafter=ngram",
                "rollback=replay", "prompts.limit=1", "max_new_tokens=4", "repeats=1", "device=cpu", "progress=false"])
    records = run_experiment(cfg, tmp_path / "run")
    assert len(records) == 1 and records[0]["exact"]
    for bad, match in (({"device_map": "everywhere"}, "device_map must be one of auto, balanced"),
                       ({"device_map": 0}, "device_map must be one of auto, balanced"),
                       ({"max_memory": {"cpu": "1GiB"}}, "need model.targets.N.device_map")):
        with pytest.raises(ValueError, match=match):
            load_hf(OmegaConf.create({"name": str(folder), "source": "hf", **bad}), torch.device("cpu"), torch.float32)


def test_routed_forward_stays_behind_the_hook():
    """A forward swapped in by routed_forward runs behind the module's accelerate hook (its
    pre_forward still sees each call) and the hooked forward is the same after the block; a
    module without a hook gets back the instance forward it had (or none)."""
    from accelerate.hooks import ModelHook

    from specdec.placement import routed_forward

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    lin = torch.nn.Linear(3, 3)
    add_hook_to_module(lin, Count())
    hooked, old = lin.forward, lin._old_forward
    x = torch.randn(2, 3)
    with routed_forward(lin, lambda mod, inp: inp * 2):
        assert torch.equal(lin(x), x * 2) and Count.calls == 1
    assert lin.forward is hooked and lin._old_forward is old and torch.equal(lin(x), old(x)) and Count.calls == 2
    plain = torch.nn.Linear(3, 3)
    with routed_forward(plain, lambda mod, inp: inp + 1):
        assert torch.equal(plain(x), x + 1)
    assert "forward" not in plain.__dict__


def test_routed_forward_is_per_thread():
    """While one thread's routed_forward block is open, a call of the module from another thread
    runs the forward the instance had (not the routed one), and another thread's routed block
    waits until the first one ends (a module's forward is one attribute for every thread)."""
    import threading

    from specdec.placement import routed_forward

    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    want = F.linear(x, lin.weight, lin.bias)
    seen, opened, release = {}, threading.Event(), threading.Event()

    def other_thread():
        seen["plain"] = lin(x)
        opened.set()
        with routed_forward(lin, lambda mod, inp: inp - 1):  # waits for the main thread's block
            seen["routed"] = lin(x)
            seen["order"] = release.is_set()

    with routed_forward(lin, lambda mod, inp: inp * 2):
        worker = threading.Thread(target=other_thread)
        worker.start()
        assert opened.wait(timeout=60)  # its plain call ran while this block is open
        assert torch.equal(lin(x), x * 2)
        release.set()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert torch.equal(seen["plain"], want), "another thread's call ran this thread's routed forward"
    assert torch.equal(seen["routed"], x - 1) and seen["order"], "the second block did not wait for the first"
    assert "forward" not in lin.__dict__ and torch.equal(lin(x), want)


def test_generators_on_one_model_in_two_threads():
    """Two wraps of one model generating from two threads at once, and the model's own generate()
    in a third, each give the greedy reference; the model is unchanged afterwards."""
    import threading

    model = get_model("nemotron_h")
    ids, mask = ragged_prompts()
    sds = [specdec.wrap(model, num_speculative_tokens=3) for _ in range(2)]
    want = hf_greedy(model, ids, mask)  # (after wrap, which may set torch's CPU thread count)
    outs, errors = [], []

    def work(run):
        try:
            for _ in range(3):
                outs.append(run())
        except Exception as err:  # (reported below: a thread's exception is otherwise lost)
            errors.append(err)

    runs = [lambda sd=sd: sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0) for sd in sds]
    runs.append(lambda: hf_greedy(model, ids, mask))
    threads = [threading.Thread(target=work, args=(run,)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(outs) == 9 and all(torch.equal(out, want) for out in outs)
    assert torch.equal(hf_greedy(model, ids, mask), want)


def test_a_drafter_with_state_drafts_for_one_generator_at_a_time():
    """One draft-model drafter (it keeps each call's draft cache) given to two generators of one
    model: while one generator's call decodes on a thread, the other's call is refused with an
    error that says so (it would have overwritten that call's draft state), and both calls
    after it are exact."""
    import threading

    from specdec.drafters import DraftModelDrafter

    model = get_model("nemotron_h")
    ids, mask = ragged_prompts()
    want = hf_greedy(model, ids, mask)
    drafter = DraftModelDrafter(get_model("nemotron_h", "perturbed"))
    first, second = (specdec.wrap(model, drafter=drafter, num_speculative_tokens=3) for _ in range(2))
    inside, release, errors = threading.Event(), threading.Event(), []

    class Hold:  # a stopping criterion that holds the first call after its first step
        def __call__(self, input_ids, scores, **kw):
            inside.set()
            release.wait(timeout=60)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run_first():
        try:
            out = first.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0,
                                 stopping_criteria=[Hold()])
            assert torch.equal(out, want)
        except Exception as err:  # (reported below)
            errors.append(err)

    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        assert inside.wait(timeout=120)
        with pytest.raises(RuntimeError, match=r"drafter \(DraftModelDrafter\) is drafting for another generator's call"):
            second.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
        manager = second.init_continuous_batching(max_length=64)  # its loop would draft with it too
        with pytest.raises(RuntimeError, match="is drafting for another generator's call"):
            manager.start()
        assert not manager.is_running()
        plain = specdec.wrap(model, drafter=drafter, num_speculative_tokens=0)  # K = 0 drafts nothing
        assert torch.equal(plain.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0), want)
    finally:
        release.set()
        thread.join(timeout=300)
    assert not errors, errors
    assert torch.equal(second.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0), want)


def test_a_routed_compiled_forward_traces_inside_a_whole_compile():
    """A module whose forward ``fused`` swapped for a compiled one, called from a program compiled
    whole with ``fullgraph=True`` (an MTP proposal with ``compile_proposal=True``), traces and gives
    the module's own output: a bound method there lost its module argument under torch 2.11."""
    from specdec.fusion import fused

    model = make_model("qwen3_5", seed=0).eval()
    norm = model.model.norm
    x = torch.randn(2, 3, norm.weight.shape[0])
    want = norm(x)
    program = torch.compile(lambda: norm(x), fullgraph=True, dynamic=False)
    with torch.no_grad(), fused(model):
        assert "forward" in norm.__dict__  # swapped
        got = program()
    torch.testing.assert_close(got, want)


def test_a_compiled_forward_calling_routed_submodules_compiles_once_over_blocks():
    """A compiled forward (as ``fused`` gives an MLP) whose linears are routed too (as the skinny
    and merged linears are on CUDA) compiles once however often the routes are made again (each
    ``fused`` block, each CUDA-graph capture): with the linears' forwards bound as partials,
    dynamo guarded them by identity and compiled again at every block, inside a capture too."""
    from torch._dynamo.utils import counters

    from specdec.placement import routed_forward

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)) ** 2)

    torch._dynamo.reset()
    counters.clear()
    mlp = MLP().eval()
    x = torch.randn(2, 8)
    want = mlp(x)
    compiled = torch.compile(MLP.forward, backend="eager")
    outs = []
    for _ in range(3):
        with torch.no_grad(), contextlib.ExitStack() as stack:
            stack.enter_context(routed_forward(mlp, compiled))
            for lin in (mlp.up, mlp.down):
                stack.enter_context(routed_forward(lin, lambda mod, h: F.linear(h, mod.weight, mod.bias)))
            outs += [mlp(x), mlp(x)]
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
    for got in outs:
        torch.testing.assert_close(got, want)


def test_a_program_compiled_whole_compiles_once_over_blocks(monkeypatch):
    """A program compiled whole (``compile_proposal=True``) runs inside one ``fused`` block for its
    warm-up and another for its capture, and compiles once: there the norms / MLPs keep their own
    forwards (``modules=False``, which ``CapturedProgram`` asks for); routed to their compiled
    forwards, the program still compiles once (the router a block installs is guarded through
    to the same compiled forward, not by its own identity)."""
    from torch._dynamo.utils import counters

    import specdec.graphs as graphs
    from specdec.fusion import fused

    model = make_model("qwen3_5", seed=0).eval()
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    x = torch.randn(2, 3, norm.weight.shape[0])
    want = mlp(norm(x))
    for modules, compiles in ((False, 1), (True, 1)):
        torch._dynamo.reset()
        counters.clear()
        program = torch.compile(lambda: mlp(norm(x)), fullgraph=True, backend="eager")
        for _ in range(2):
            with torch.no_grad(), fused(model, modules=modules):
                torch.testing.assert_close(program(), want)
        assert counters["stats"]["unique_graphs"] == compiles, (modules, dict(counters["stats"]))
    # CapturedProgram's warm-up of a program compiled whole leaves the modules alone
    seen = []

    @contextlib.contextmanager
    def recording(model, enabled=True, *, modules=True):
        seen.append(modules)
        yield

    monkeypatch.setattr(graphs, "fused", recording)
    monkeypatch.setattr(graphs.torch, "compile", lambda fn, **kw: (lambda: fn()))
    prog = graphs.CapturedProgram(lambda: None, model=model, what="a test program", graphs=True, compile_whole=True,
                                  fuse=True)
    prog()
    assert seen == [False]


def test_decoding_runs_with_the_models_device_current(monkeypatch):
    """generate(), generate_batch() and HF's assisted generation on an enabled model run their
    forwards inside on_device(the model's device): Triton launches, and torch captures CUDA
    graphs, on the current device, not on their tensors' (a model on cuda:1 with cuda:0 current
    would read another device's memory). on_device is torch.cuda.device for a CUDA device (built
    without touching CUDA) and does nothing for the CPU."""
    from specdec import engine, hf_integration, placement

    cuda = placement.on_device(torch.device("cuda", 1))
    assert isinstance(cuda, torch.cuda.device) and cuda.idx == 1
    assert isinstance(placement.on_device("cpu"), contextlib.nullcontext)
    entered, inside, forwards = [], [], []

    @contextlib.contextmanager
    def record(device):
        entered.append(torch.device(device))
        inside.append(device)
        try:
            yield
        finally:
            inside.pop()

    def watch(adapter):  # each forward of the adapter records whether a device context is open
        real = adapter.forward
        monkeypatch.setattr(adapter, "forward", lambda *a, **k: (forwards.append(bool(inside)), real(*a, **k))[1])

    monkeypatch.setattr(engine, "on_device", record)
    monkeypatch.setattr(hf_integration, "on_device", record)
    ids, mask, eos, ref = reference("qwen3_5")
    model = get_model("qwen3_5")
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3)
    watch(sd.adapter)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)
    assert entered == [torch.device("cpu")]
    sd.generate_batch([[5, 6, 7]], max_new_tokens=2)
    assert entered == [torch.device("cpu")] * 2
    one, one_mask = ids[:1], mask[:1]  # (HF's assisted generation takes one row)
    specdec.enable_hf_speculation(model)
    try:
        watch(model._specdec_hf["adapter"])
        out = model.generate(one, attention_mask=one_mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                             prompt_lookup_num_tokens=2)
    finally:
        disable_hf_speculation(model)
    assert torch.equal(out, hf_greedy(model, one, one_mask, max_new=4))
    assert len(entered) > 2 and set(entered) == {torch.device("cpu")}
    assert len(forwards) > 3 and all(forwards), forwards


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
@pytest.mark.parametrize("path", ["static", "cuda_graph"])
def test_a_model_on_the_second_gpu_decodes_exactly(path):
    """A model moved to cuda:1 while cuda:0 is current decodes exactly on both decode paths, on the
    path asked for (its Triton kernels and CUDA graphs on cuda:1), after a model on cuda:0 decoded
    on the same path in the process (torch's own capture stream would stay on the device of the
    process's first capture), and cuda:0 stays current afterwards."""
    ids, mask, eos, _ = reference("qwen3_5")
    torch.cuda.set_device(0)
    for dev in ("cuda:0", "cuda:1"):
        model = make_model("qwen3_5").to(dev)
        on = ids.to(dev), mask.to(dev)
        ref = hf_greedy(model, *on, eos=eos)
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path=path)
        out = sd.generate(on[0], attention_mask=on[1], max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), dev
        assert sd.last_stats.decode_path == path, (dev, sd.last_stats.capture_error)
        assert torch.cuda.current_device() == 0
