"""Models whose whole decoder layers compute on several devices (accelerate's ``device_map`` over
a GPU and the CPU, or several GPUs): where specdec places each layer's state, which decode path
it takes, and the errors for layouts it refuses (:class:`specdec.placement.Placement`).

The CPU tests check the parts that need no second device; the ``gpu`` tests split tiny fp32
models between cuda:0 and the CPU (``dispatch_model(..., main_device="cpu")``: "cpu" entries
compute on the CPU, int entries on that GPU) and decode them exactly."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from accelerate import dispatch_model
from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
from helpers import MAX_NEW, hf_greedy, reference
from markers import needs_cuda
from tiny_models import EXTRA_FAMILIES, get_model, make_model, ragged_prompts

import specdec
from specdec.adaptive import FixedCosts
from specdec.cache import HybridCache
from specdec.drafters import DraftModelDrafter, MedusaDrafter, MedusaHeads
from specdec.models import adapter_for
from specdec.models.base import _stack_kv
from specdec.placement import Placement, check_placement, spread_layers

STRATEGIES = ("snapshot", "ring", "replay")
SPLIT_FAMILIES = ("qwen3_5", "nemotron_h", "kimi_linear")
#: continuous batching's requests: prompts 0 and 2 share their first blocks (of 2 tokens)
BATCH_PROMPTS = [[5, 9, 11, 5, 9, 11, 4], [7, 8, 9, 10, 11, 12, 7, 8], [5, 9, 11, 5, 20, 21, 20],
                 [30, 31, 32, 33, 30, 31]]


def hf_alone(family: str, prompts, max_new: int = 8) -> list[list[int]]:
    """HF greedy's new tokens for each of ``prompts`` alone on ``family``'s tiny target in memory
    (on one device): the reference of continuous batching on a spread copy of it."""
    model = get_model(family)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        out.append(hf_greedy(model, ids, torch.ones_like(ids), max_new)[0, len(p):].tolist())
    return out


# ------------------------------------------------------------------------------ CPU: placement


def test_placement_of_one_device_and_its_layout():
    """A model in memory: every layer and the LM head on the CPU, one device, named in its layout."""
    model = get_model("qwen3_5")
    place = adapter_for(model).placement
    assert place == Placement(torch.device("cpu"), (torch.device("cpu"),) * 4)
    assert place.devices == (torch.device("cpu"),) and not place.multi_device and not place.all_cuda
    assert place.layout() == "cpu: layers 0-3, lm_head"
    assert check_placement(model, model.model.layers, model.lm_head) == place


def test_placement_refuses_devices_it_cannot_decode_on():
    """Layers spread over several devices: a device type other than CUDA or CPU, and a CUDA device
    the process does not have, are refused naming the layout; on one device nothing is checked
    (the model runs where it is)."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    with pytest.raises(ValueError, match=r"must compute on cuda or cpu devices; this one has cpu: layers 0, "
                                         r"lm_head; meta: layers 1"):
        Placement(cpu, (cpu, meta))
    missing = torch.device("cuda", torch.cuda.device_count() if torch.cuda.is_available() else 3)
    with pytest.raises(ValueError, match=rf"device {missing} is not available \(this process sees \d+ CUDA device"):
        Placement(cpu, (missing, cpu, cpu))
    assert Placement(meta, (meta, meta)).devices == (meta,)


def test_a_whole_layer_hooked_to_meta_is_refused_at_wrap():
    """One whole decoder layer hooked to compute on ``meta``: a layout over two devices, one of
    them not CUDA or CPU, refused at wrap; unhooked, the model decodes as before."""
    model = get_model("nemotron_h")
    layer = model.model.layers[2]
    add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("meta"), io_same_device=True))
    try:
        with pytest.raises(ValueError, match=r"cuda or cpu devices; this one has cpu: layers 0-1, 3-4, lm_head; "
                                             r"meta: layers 2"):
            specdec.wrap(model)
    finally:
        remove_hook_from_module(layer)
    ids, mask, eos, ref = reference("nemotron_h")
    out = specdec.wrap(model, rollback="replay").generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                                          eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


def test_spread_layers_does_nothing_on_one_device():
    """On one device the layers get no hooks."""
    model = get_model("qwen3_5")
    layers = model.model.layers
    with spread_layers(layers, adapter_for(model).placement):
        assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)


class _Recorder(torch.nn.Module):
    """A layer that records what it was called with and returns its hidden states plus one."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, hidden, mask=None, position_embeddings=None):
        self.calls.append((hidden, mask, position_embeddings))
        return hidden + 1


def test_spread_layers_moves_keyword_inputs_once_per_device(monkeypatch):
    """Layers on two devices (``meta`` stands in for the second; the device check is left out):
    each layer gets every input on its own device; a keyword input is copied once per device for
    the whole block (both ``meta`` layers get the same copy, tuples included), a positional one
    each time; the hooks are gone afterwards."""
    monkeypatch.setattr(Placement, "__post_init__", lambda self: None)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    place = Placement(cpu, (cpu, cpu, meta, meta))  # (nothing comes back from meta: it holds no data)
    layers = torch.nn.ModuleList(_Recorder() for _ in range(4))
    mask, cos_sin = torch.zeros(2, 3), (torch.ones(3), torch.ones(3))
    with spread_layers(layers, place):
        hidden = torch.zeros(2, 3)
        for layer in layers:
            hidden = layer(hidden, mask=mask, position_embeddings=cos_sin)
    for layer, dev in zip(layers, place.layers):
        (h, m, (c, s)), = layer.calls
        assert {h.device, m.device, c.device, s.device} == {dev}
    assert layers[0].calls[0][1] is mask and layers[1].calls[0][2][1] is cos_sin[1]
    assert layers[2].calls[0][1] is layers[3].calls[0][1]
    assert layers[2].calls[0][2][0] is layers[3].calls[0][2][0]
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)


def test_stack_kv_groups_by_device():
    """Keys / values of like shape and dtype on two devices stack per device (one stack cannot
    hold both)."""
    k = torch.ones(2, 1, 3, 4)
    kv = {0: (k, k * 2), 1: (k.to("meta"), k.to("meta")), 2: (k * 3, k * 4)}
    groups = _stack_kv(kv)
    assert [(names, data.device.type, data.shape[0]) for names, data in groups] == [
        ([(0, "keys"), (0, "values"), (2, "keys"), (2, "values")], "cpu", 4),
        ([(1, "keys"), (1, "values")], "meta", 2)]
    assert torch.equal(groups[0][1][3], k * 4)


def test_cache_on_its_home_device_only():
    """A cache whose layers are all on its home device (told so or not) keeps no copies of
    ``seq_len`` and commits as before."""
    cache = HybridCache(2, 16, 3, torch.float32, "cpu")
    assert cache.mirrors == {} and cache.layer_device(0) is None
    cache = HybridCache(2, 16, 3, torch.float32, "cpu", layer_devices=["cpu"] * 3)
    assert cache.mirrors == {} and cache.layer_device(1) == torch.device("cpu")
    cache.seq_len = torch.tensor([4, 6])
    cache.refresh_mirrors()
    cache.advance(3)
    cache.commit(torch.tensor([1, 3]))
    assert cache.seq_len.tolist() == [5, 9] and cache.step_tokens == 0


def test_cache_keeps_seq_len_on_every_layer_device():
    """A cache told that a layer is on another device (``meta`` stands in for it) keeps ``seq_len``
    there, refreshed on load and advanced by each commit (one copy of the accepted counts per
    device)."""
    cache = HybridCache(2, 16, 3, torch.float32, "cpu", layer_devices=["cpu", "meta", "meta"])
    assert list(cache.mirrors) == [torch.device("meta")] and cache.layer_device(1) == torch.device("meta")
    cache.seq_len = torch.tensor([4, 6])
    cache.refresh_mirrors()
    cache.advance(2)
    cache.commit(torch.tensor([2, 1]))
    assert cache.seq_len.tolist() == [6, 7]
    assert cache.mirrors[torch.device("meta")].shape == (2,)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 0\]"):
        cache.commit(torch.tensor([1, 0]))


def _kv_caches(batch: int = 3, max_len: int = 16, step: int = 4):
    """Two caches of one attention layer 0 on the CPU (the home device) holding the same keys /
    values: one alone, one told of a layer 1 on ``meta`` (standing in for a second device; its
    buffers hold no data, so only the CPU layer's values are compared)."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(batch, 1, max_len, 2, generator=g) for _ in range(2))
    caches = []
    for layer_devices in (None, ["cpu", "meta"]):
        cache = HybridCache(batch, max_len, step, torch.float32, "cpu", layer_devices=layer_devices)
        cache.kv[0] = (k.clone(), v.clone())
        if layer_devices is not None:
            cache.kv[1] = (k.to("meta"), v.to("meta"))
        cache.pad = torch.tensor([2, 0, 1][:batch])
        cache.seq_len = torch.tensor([5, 7, 6][:batch])
        cache.refresh_mirrors()
        caches.append(cache)
    return caches


def _same_home_state(alone: HybridCache, spread: HybridCache) -> None:
    assert torch.equal(alone.seq_len, spread.seq_len) and torch.equal(alone.pad, spread.pad)
    assert all(torch.equal(a, b) for a, b in zip(alone.kv[0], spread.kv[0]))
    assert spread.mirrors[torch.device("meta")].shape == spread.seq_len.shape


def test_spread_commit_path_moves_each_device_as_one_device_does():
    """A tree step's path commit on a cache whose layers spread (path and counts copied per
    device): the home layer's keys / values and ``seq_len`` end as on a cache on one device."""
    from specdec.tree import TreeSpec

    tree = TreeSpec([(0,), (1,), (0, 0)])
    path = torch.tensor([[0, 2, 0], [0, 1, 3], [0, 1, 0]])
    num = torch.tensor([2, 3, 1])
    caches = _kv_caches()
    for cache in caches:
        cache.set_tree(tree)
        cache.advance(tree.num_nodes)
        cache.commit_path(path, num)
    _same_home_state(*caches)
    assert caches[1].seq_len.tolist() == [7, 10, 7] and caches[1].step_tokens == 0


def test_spread_row_loads_and_resets_write_each_device_as_one_device_does():
    """load_rows (slots side by side and not) and reset_rows on caches whose layers spread (rows
    copied to each buffer's device): the home layer's keys / values, ``pad`` and ``seq_len`` end as
    on caches on one device."""
    caches = _kv_caches()
    g = torch.Generator().manual_seed(1)
    for rows in ([1], [2, 0]):
        n = len(rows)
        keys = torch.randn(n, 1, 5, 2, generator=g)
        for cache in caches:
            kv = {idx: (keys.to(k.device), keys.to(k.device) + 1) for idx, (k, _) in cache.kv.items()}
            cache.load_rows(rows, 5, torch.tensor([1, 0][:n]), kv, {})
        _same_home_state(*caches)
    sources = _kv_caches(batch=2)
    for cache, source in zip(caches, sources):
        cache.reset_rows([2, 1], source, [0, 1])
    _same_home_state(*caches)
    assert caches[1].seq_len.tolist() == [5, 7, 5]


def test_decode_path_choice_for_a_spread_model(monkeypatch):
    """The path auto takes for layers on several devices, and why (a placement standing in for
    one, the device check left out): eager with a CPU layer, static with every layer on CUDA;
    decode_path="cuda_graph" raises naming the layout."""
    monkeypatch.setattr(Placement, "__post_init__", lambda self: None)
    sd = specdec.wrap(get_model("qwen3_5"))
    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    mixed = "auto: layers on several devices (cuda:0, cpu), not all CUDA: the eager path"
    for layers, want in (((cuda0, cpu, cuda0, cpu), ("eager", mixed)),
                         ((cuda1, cuda1, cuda0, cuda0),
                          ("static", "auto: layers on several CUDA devices: the static path, no CUDA graphs"))):
        place = Placement(cuda0, layers)
        monkeypatch.setattr(type(sd.adapter), "placement", property(lambda self, place=place: place))
        assert sd._choose_path(cuda0, None) == want
        with pytest.raises(ValueError, match=rf"needs every decoder layer and the LM head on one CUDA device; "
                                             rf"this model computes on several \({place.layout()}\)"):
            sd.decode_path = "cuda_graph"
    assert place.layout() == "cuda:0: layers 2-3, lm_head; cuda:1: layers 0-1"


def test_spread_model_with_cuda_layers_chooses_for_them(monkeypatch):
    """The LM head on the CPU, layers alternately on cuda:0 and the CPU (a placement standing in
    for one, the device check left out): the prompt scan and the attention backends are chosen for
    cuda:0 (what prefill resolves its scan for and a step forward its attention backends for: the
    calls stopped there), and with flash-linear-attention's scan each mixer takes the scan of its
    layer's device as the placement says (the CPU ones the torch scan)."""
    import inspect

    monkeypatch.setattr(Placement, "__post_init__", lambda self: None)
    adapter = adapter_for(get_model("qwen3_5"))
    cuda0, cpu = torch.device("cuda", 0), torch.device("cpu")
    place = Placement(cpu, (cuda0, cpu, cuda0, cpu))
    assert place.cuda_device == cuda0 and Placement(cpu, (cpu, cpu)).cuda_device is None
    monkeypatch.setattr(type(adapter), "placement", property(lambda self: place))
    assert adapter._scan_device == cuda0
    routed = {}
    monkeypatch.setattr(adapter, "_routed", lambda forwards: routed.update(forwards))
    adapter._prompt_patched("fla")
    assert {idx: inspect.signature(fwd).parameters["_scan"].default for idx, fwd in routed.items()} == {
        0: "fla", 1: "torch", 2: "fla"}

    # prefill resolves its scan, and a step forward picks its attention backends, for cuda:0
    import specdec.models.base as base

    class Seen(Exception):
        pass

    def record(*args):
        raise Seen(torch.device(args[1] if len(args) > 1 else args[0]))

    monkeypatch.setattr(base, "resolve_scan", record)
    monkeypatch.setattr(base, "sdpa_without_cudnn", record)
    ids, mask, _, _ = reference("qwen3_5")
    with pytest.raises(Seen) as seen:
        adapter.prefill(ids, mask, HybridCache(ids.shape[0], 32, 2, torch.float32, cpu))
    assert seen.value.args[0] == cuda0
    spread_cache = HybridCache(ids.shape[0], 32, 2, torch.float32, cpu, layer_devices=(cpu, cpu, cpu, cpu))
    with pytest.raises(Seen) as seen:
        adapter.forward(ids[:, :1], spread_cache)
    assert seen.value.args[0] == cuda0


def test_stats_name_the_layout_and_why_the_path():
    """A model on one device: Stats name its layout and why the decode path was taken."""
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(get_model("qwen3_5"), rollback="replay", num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)
    st = sd.last_stats
    assert (st.decode_path, st.path_reason, st.devices) == ("eager", "auto: the model is on cpu, not CUDA",
                                                            "cpu: layers 0-3, lm_head")
    sd.decode_path = "static"
    sd.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)
    assert sd.last_stats.path_reason == "decode_path='static' asked for"


# ------------------------------------------------------------------------------ CPU: two names of the CPU


def two_name_model(family: str):
    """``family``'s tiny target (a fresh copy of :func:`get_model`'s weights) with its odd decoder
    layers hooked to compute on ``cpu:0``, the rest on ``cpu``. torch tells the two device names
    apart (``torch.device("cpu:0") != torch.device("cpu")``) while every tensor lands on the
    CPU, so the model counts as spread over two devices and every per-device path runs (the
    layers' hooks, the per-device copies of ``seq_len`` and of each commit's counts and path,
    row loads and resets per device) on this machine."""
    model = make_model(family)
    for i, layer in enumerate(adapter_for(model).body.layers):
        if i % 2:
            add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("cpu", 0), io_same_device=True))
    return model


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_two_device_names_decode_exactly(family, strategy):
    """Layers alternately on ``cpu`` and ``cpu:0`` (:func:`two_name_model`): eager (auto) and
    static decode a ragged batch, a row stopping at EOS, exactly as HF's greedy; Stats name the
    layout and why the path; the cache keeps ``seq_len`` on ``cpu:0`` too, in step with home's."""
    model = two_name_model(family)
    place = adapter_for(model).placement
    assert place.multi_device and place.devices == (torch.device("cpu"), torch.device("cpu", 0))
    ids, mask, eos, ref = reference(family)
    for path in ("auto", "static"):
        sd = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=3, decode_path=path)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), path
        st = sd.last_stats
        assert st.decode_path == ("eager" if path == "auto" else path)
        assert st.devices == place.layout() and st.path_reason.startswith(
            "auto: layers on several devices (cpu, cpu:0)" if path == "auto" else "decode_path=")
        cache = sd.last_cache
        assert torch.equal(cache.mirrors[torch.device("cpu", 0)], cache.seq_len)
        assert {layer.device for layer in cache.ssm.values()} <= set(place.devices)


@pytest.mark.parametrize("family", EXTRA_FAMILIES)
def test_two_device_names_of_other_families(family):
    """The other families (short convs, shared attention blocks, MoE, ...) spread over two device
    names: exact on the eager and static paths."""
    model = two_name_model(family)
    ids, mask, eos, ref = reference(family)
    for path in ("eager", "static"):
        sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path=path)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref), path


def test_two_device_names_with_a_draft_model():
    """A draft model (itself on the target's home device) drafting for a target spread over two
    device names: exact."""
    model = two_name_model("qwen3_5")
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(model, drafter=DraftModelDrafter(get_model("qwen3_5", "perturbed")), rollback="replay",
                      num_speculative_tokens=3)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)
    assert sd.last_stats.accepted_tokens > 0


def draft_on(device, family="qwen3_5"):
    """``family``'s perturbed tiny model (a fresh copy), its decoder layers and LM head hooked to
    compute on ``device``: a draft model on a device of its own."""
    draft = copy.deepcopy(get_model(family, "perturbed"))
    for mod in (*draft.model.layers, draft.lm_head):
        add_hook_to_module(mod, AlignDevicesHook(execution_device=torch.device(device), io_same_device=True))
    return draft


@pytest.mark.parametrize("path", ["eager", "static"])
def test_a_draft_model_on_a_device_of_its_own(path):
    """A draft model computing on ``cpu:0`` for a target on ``cpu`` (two device names: the
    drafter takes the text to its device and hands the drafts back): exact on the eager and the
    static proposal path, in ``generate()`` and in continuous batching (rows admitted into the
    draft's cache on its device)."""
    draft = DraftModelDrafter(draft_on("cpu:0"))
    assert draft.adapter.device == torch.device("cpu", 0)
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(get_model("qwen3_5"), drafter=draft, rollback="replay", num_speculative_tokens=3,
                      decode_path=path)
    for _ in range(2):  # (the second: the static proposal programs' warm-up)
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, ref)
    assert sd.last_stats.accepted_tokens > 0 and sd.last_stats.draft_path == path
    batch = sd.generate_batch(BATCH_PROMPTS, max_new_tokens=8, max_batch_size=2)
    assert [o.generated_tokens for o in batch.values()] == hf_alone("qwen3_5", BATCH_PROMPTS)


def test_a_cpu_draft_beside_a_gpu_target_refuses_forced_triton(monkeypatch):
    """SPECDEC_BACKEND=triton (stood in for) with a draft model on the CPU and the target's LM
    head on a GPU: start() raises naming the draft's device and what to set instead."""
    import specdec.drafters.draft_model as dm

    monkeypatch.setattr(dm, "backend", lambda device=None: "triton")
    drafter = DraftModelDrafter(get_model("qwen3_5", "perturbed"))
    with pytest.raises(ValueError, match="SPECDEC_BACKEND=triton runs Triton kernels everywhere, but the draft model "
                                         "computes on cpu, .* set it to 'torch'"):
        drafter.start(target_vocab_size=drafter.vocab_size, batch_size=1, device=torch.device("cuda", 0))
    drafter.start(target_vocab_size=drafter.vocab_size, batch_size=1, device=torch.device("cpu"))  # one device: no check
    assert drafter.home == torch.device("cpu")


def test_a_draft_model_spread_over_devices_is_refused():
    """A draft model whose layers compute on two devices: a ValueError naming its layout."""
    with pytest.raises(ValueError, match=r"a draft model must compute on one device; this one is spread over "
                                         r"several \(cpu: layers 0, 2, lm_head; cpu:0: layers 1, 3\)"):
        DraftModelDrafter(two_name_model("qwen3_5"))


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_two_device_names_under_hf_prompt_lookup(family):
    """HF's own generate(prompt_lookup_num_tokens=...) on an enabled model spread over two device
    names (its speculative cache commits and rolls back per device): exact, lookups rolled back."""
    from specdec.hf_integration import disable_hf_speculation

    model = two_name_model(family)
    ids, mask = ragged_prompts(batch=1)
    kw = dict(attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    specdec.enable_hf_speculation(model, rollback="replay")
    try:
        out = model.generate(ids, return_dict_in_generate=True, prompt_lookup_num_tokens=3, **kw)
    finally:
        disable_hf_speculation(model)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values if "past_key_values" in out else out.cache
    assert cache.crop_stats["rolled_back_tokens"] > 0


def test_two_device_names_keep_layer_devices_when_hf_steps_grow(monkeypatch):
    """HF's prompt lookup on an enabled model spread over two device names, whose first lookups
    find nothing (one-token steps) so that a later lookup grows the cache's step room: every SSM
    layer rebuilt for the wider steps stays on its own device, and the output is exact."""
    import specdec.hf_integration as hf

    grown = []
    grow = hf._grow_steps

    def spy(cache, T):
        grow(cache, T)
        grown.append({idx: layer.device for idx, layer in cache.ssm.items()})

    monkeypatch.setattr(hf, "_grow_steps", spy)
    model = two_name_model("qwen3_5")
    place = adapter_for(model).placement
    ids = torch.tensor([[3, 17, 29, 41, 5, 8, 13, 21, 34, 55]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    specdec.enable_hf_speculation(model, rollback="replay")
    try:
        out = model.generate(ids, return_dict_in_generate=True, prompt_lookup_num_tokens=3, **kw)
    finally:
        hf.disable_hf_speculation(model)
    assert torch.equal(out.sequences, ref)
    assert grown and all(devs == {idx: place.layers[idx] for idx in devs} for devs in grown)
    cache = out.past_key_values if "past_key_values" in out else out.cache
    assert {idx: layer.device for idx, layer in cache.hybrid.ssm.items()} == grown[-1]


@pytest.mark.parametrize("path", ["eager", "static"])
def test_two_device_names_with_mtp_layers(tmp_path, path):
    """The target's MTP layers (random, next to the LM head) drafting for a target spread over two
    device names: exact."""
    from test_mtp import load, save_with_mtp

    model = load("qwen3_5", save_with_mtp("qwen3_5", tmp_path))
    ids, mask, eos, ref = reference("qwen3_5")
    for i, layer in enumerate(model.model.layers):
        if i % 2:
            add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device("cpu", 0), io_same_device=True))
    sd = specdec.wrap(model, drafter="mtp", rollback="replay", num_speculative_tokens=2, decode_path=path)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)
    assert sd.last_stats.decode_path == path and sd.last_stats.draft_path == path


@pytest.mark.parametrize("K", [0, "auto"])
def test_two_device_names_plain_and_chosen_k(K):
    """Plain steps (K = 0) and K chosen per step on a model spread over two device names: exact."""
    model = two_name_model("nemotron_h")
    ids, mask, eos, ref = reference("nemotron_h")
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=K, max_speculative_tokens=4,
                      cost_model=FixedCosts(lambda strategy, batch, K: 1.0 + 0.1 * K))
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_device_names_medusa_tree(strategy):
    """A Medusa draft tree on a model spread over two device names (path commits per device): exact."""
    model = two_name_model("qwen3_5")
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(model, drafter=MedusaDrafter(MedusaHeads.from_target(model, num_heads=2), tree="default"),
                      rollback=strategy, decode_path="eager")
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=0), ref)


@pytest.mark.parametrize("path, prefix_caching", [("eager", False), ("static", False), ("eager", True)])
def test_two_device_names_generate_batch(path, prefix_caching):
    """Continuous batching on a model spread over two device names (rows loaded and reset per
    device; with prefix caching, blocks stored per device): every request's tokens are HF greedy's
    on its prompt alone on the model in memory."""
    model = two_name_model("kimi_linear")
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path=path)
    alone = hf_alone("kimi_linear", BATCH_PROMPTS)
    out = sd.generate_batch(BATCH_PROMPTS, max_new_tokens=8, max_batch_size=2, prefix_caching=prefix_caching,
                            **({"prefix_block_size": 2} if prefix_caching else {}))
    assert [o.generated_tokens for o in out.values()] == alone
    assert sd.last_stats.decode_path == path


def test_spread_prompt_kernels_route_only_modules_of_decoder_layers(monkeypatch):
    """With the Triton backend (stood in for: the kernels themselves are not run), a model spread
    over two device names routes only the norms and MLPs of its decoder layers (each runs with its
    layer's device current), not the final norm; on one device the final norm is routed as before."""
    import contextlib

    import specdec.models.base as base

    routed = []

    def record(norms, mlps=()):
        routed.append({id(mod) for mod, _ in (*norms, *mlps)})
        return contextlib.nullcontext()

    monkeypatch.setattr(base, "backend", lambda device=None: "triton")
    monkeypatch.setattr(base.HybridAdapter, "check_backend", lambda self: None)  # (the layers' devices: not run)
    monkeypatch.setattr(base, "prompt_kernels", record)
    ids, mask, _, _ = reference("qwen3_5")
    for model in (two_name_model("qwen3_5"), make_model("qwen3_5")):
        specdec.wrap(model, drafter="ngram", rollback="replay").generate(ids, attention_mask=mask, max_new_tokens=2,
                                                                         pad_token_id=0)
        inside = {id(mod) for layer in model.model.layers for mod in layer.modules()}
        assert routed[-1] and (routed[-1] - inside == set()) == adapter_for(model).placement.multi_device
        assert (id(model.model.norm) in routed[-1]) != adapter_for(model).placement.multi_device
    # the Triton backend on cpu:0 only: only the modules of the layers there are routed
    monkeypatch.setattr(base, "backend", lambda device=None: "triton" if torch.device(device) == torch.device("cpu", 0)
                        else "torch")
    model = two_name_model("qwen3_5")
    specdec.wrap(model, drafter="ngram", rollback="replay").generate(ids, attention_mask=mask, max_new_tokens=2,
                                                                     pad_token_id=0)
    odd = {id(mod) for i, layer in enumerate(model.model.layers) if i % 2 for mod in layer.modules()}
    assert routed[-1] and routed[-1] <= odd


def test_forced_triton_backend_with_cpu_layers_is_refused(monkeypatch):
    """The Triton backend forced (stood in for) on a model whose layers spread, some on the CPU:
    wrap and every new cache (HF's assisted generation makes its own) raise naming those layers;
    on one device the backend is the caller's to choose."""
    import specdec.models.base as base

    model = two_name_model("qwen3_5")
    monkeypatch.setattr(base, "backend", lambda device=None: "triton")
    with pytest.raises(ValueError, match=r"SPECDEC_BACKEND=triton runs Triton kernels everywhere, but layer 0, "
                                         r"layer 1, layer 2, layer 3, the LM head \(with the decode loop's bookkeeping "
                                         r"and the drafters\) of this model compute on the CPU \(cpu: layers 0, 2, "
                                         r"lm_head"):
        specdec.wrap(model)
    with pytest.raises(ValueError, match="SPECDEC_BACKEND=triton"):
        adapter_for(model).new_cache(1, 8, 2, specdec.rollback.make_strategy("replay"))
    adapter_for(make_model("qwen3_5")).check_backend()


def test_two_device_names_read_their_seq_len_copies(monkeypatch):
    """The layers hooked to ``cpu:0`` read ``cpu:0``'s copy of ``seq_len`` (qwen3_5's attention
    layer 3 is one): after generate() and continuous batching with prefix caching the copy equals
    ``seq_len`` and both outputs are HF greedy's, and with the copies never refreshed after a load
    (``refresh_mirrors`` a no-op) that layer writes its keys / values at the wrong columns, so both
    outputs change."""
    model = two_name_model("qwen3_5")
    assert adapter_for(model).placement.layers[3] == torch.device("cpu", 0)
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path="eager")

    def run():
        out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
        copies = sd.last_cache.mirrors
        assert list(copies) == [torch.device("cpu", 0)] and 3 in sd.last_cache.kv
        same = torch.equal(copies[torch.device("cpu", 0)], sd.last_cache.seq_len)
        batch = sd.generate_batch(BATCH_PROMPTS, max_new_tokens=8, max_batch_size=2, prefix_caching=True,
                                  prefix_block_size=2)
        return out, [o.generated_tokens for o in batch.values()], same

    out, batch, same = run()
    assert torch.equal(out, ref) and same and batch == hf_alone("qwen3_5", BATCH_PROMPTS)
    monkeypatch.setattr(HybridCache, "refresh_mirrors", lambda self: None)
    stale, stale_batch, _ = run()
    assert not torch.equal(stale, ref) and stale_batch != batch


def test_memory_of_a_spread_model_is_each_devices_own(monkeypatch):
    """The memory a spread model's call may take is, per device, its free memory plus what the
    generator's kept caches hold on that device, the least over the devices: the bytes kept on
    one device do not count as free on another (every stand-in tensor is on ``cpu``, so
    ``cpu:0`` holds none of them)."""
    from specdec import batching, engine

    sd = specdec.wrap(two_name_model("qwen3_5"), drafter="ngram", rollback="replay", num_speculative_tokens=3)
    ids, mask, eos, _ = reference("qwen3_5")
    sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    held = batching.cache_bytes(sd.last_cache)
    assert held > 0 and batching.cache_bytes(sd.last_cache, "cpu") == held
    assert batching.cache_bytes(sd.last_cache, torch.device("cpu", 0)) == 0
    cpu, cpu0 = torch.device("cpu"), torch.device("cpu", 0)
    for free, expected in (({cpu: 10, cpu0: 10**9}, 10 + held), ({cpu: 10**9, cpu0: 5}, 5)):
        monkeypatch.setattr(engine, "free_memory", lambda dev, free=free: free[torch.device(dev)])
        assert sd._available_memory() == expected
    monkeypatch.setattr(engine, "free_memory", lambda dev: None if dev == cpu0 else 10)
    assert sd._available_memory() is None
    monkeypatch.setattr(engine, "free_memory", lambda dev: 10)  # (cpu:0 holds none of the caches: 10 B there)
    with pytest.warns(UserWarning, match="beyond the model's context"), pytest.raises(
            ValueError, match=r"more than the 10 B available on the device with the least of it among "
                              r"cpu, cpu:0 \(its free memory and this generator's caches there\); ask for fewer"):
        sd.generate(ids, attention_mask=mask, max_new_tokens=10**9, pad_token_id=0)


# ------------------------------------------------------------------------------ GPU: cuda:0 + CPU


def split_map(model, home) -> dict:
    """Decoder layers alternately on cuda:0 (0, 2, ...) and the CPU (1, 3, ...); every other module
    (embeddings, final norm, rotary, LM head) on ``home`` (0 or "cpu")."""
    base = model.base_model_prefix
    body = getattr(model, base)
    dm = {f"{base}.{name}": home for name, _ in body.named_children() if name != "layers"}
    dm.update({f"{base}.layers.{i}": 0 if i % 2 == 0 else "cpu" for i in range(len(body.layers))})
    dm.update({name: home for name, _ in model.named_children() if name != base})
    return dm


_SPLIT: dict = {}


def split_model(family: str, home):
    """``family``'s tiny target (the weights of :func:`get_model`'s) dispatched by :func:`split_map`,
    made once per (family, home)."""
    key = (family, home)
    if key not in _SPLIT:
        model = copy.deepcopy(make_model(family)).eval()
        _SPLIT[key] = dispatch_model(model, device_map=split_map(model, home), main_device="cpu")
    return _SPLIT[key]


def _home(home) -> torch.device:
    return torch.device("cuda", 0) if home == 0 else torch.device("cpu")


def _tensors(x):
    """Every tensor in ``x`` (a tensor, or nested dicts / lists / tuples of them)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def check_cache_devices(sd, cache) -> None:
    """Every KV buffer, conv window and rollback store tensor of ``cache`` on its layer's device, each
    SSM layer's op on the backend of its device, ``seq_len`` on the home device."""
    place = sd.adapter.placement
    assert cache.device == place.home and cache.seq_len.device == place.home
    for idx, bufs in cache.kv.items():
        assert {b.device for b in bufs} == {place.layers[idx]}, idx
    for idx, layer in cache.ssm.items():
        dev = place.layers[idx]
        assert layer.device == dev, idx
        assert layer.op.backend == ("triton" if dev.type == "cuda" else "torch"), idx
        found = list(_tensors(layer.store.tensors)) + ([layer.conv_window] if layer.conv_window is not None else [])
        assert found and {t.device for t in found} == {dev}, idx


def _generate(sd, home, **kw):
    ids, mask, eos, ref = reference(kw.pop("family"))
    dev = _home(home)
    out = sd.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=MAX_NEW, eos_token_id=eos,
                      pad_token_id=0, **kw)
    return out.cpu(), ref


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("home", [0, "cpu"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_cuda_cpu_split_decodes_exactly(family, strategy, home):
    """Layers alternately on cuda:0 and the CPU, the LM head on ``home``: every path decodes a
    ragged batch (a row stopping at EOS) exactly as HF's greedy on the model in memory, auto takes
    the eager path and says why, and each layer's state lives on its device."""
    model = split_model(family, home)
    place = adapter_for(model).placement
    assert place.home == _home(home) and place.multi_device and not place.all_cuda
    assert {d.type for d in place.layers} == {"cuda", "cpu"}
    for path in ("auto", "eager", "static"):
        sd = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=3, decode_path=path)
        out, ref = _generate(sd, home, family=family)
        assert torch.equal(out, ref), path
        st = sd.last_stats
        want = "eager" if path == "auto" else path
        assert st.decode_path == want, (path, st.capture_error)
        assert st.path_reason == (f"auto: layers on several devices ({', '.join(map(str, place.devices))}), not all "
                                  "CUDA: the eager path" if path == "auto" else f"decode_path={path!r} asked for")
        assert st.devices == place.layout()
        check_cache_devices(sd, sd.last_cache)
        assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("home", [0, "cpu"])
def test_cuda_cpu_split_refuses_cuda_graphs(home):
    """decode_path="cuda_graph" on a split model raises naming the layout, at wrap and when set."""
    model = split_model("qwen3_5", home)
    layout = adapter_for(model).placement.layout()
    assert set(layout.split("; ")) == {f"cuda:0: layers 0, 2{', lm_head' if home == 0 else ''}",
                                       f"cpu: layers 1, 3{', lm_head' if home == 'cpu' else ''}"}
    with pytest.raises(ValueError, match=r"needs every decoder layer and the LM head on one CUDA device; this model "
                                         rf"computes on several \({re.escape(layout)}\)"):
        specdec.wrap(model, decode_path="cuda_graph")
    sd = specdec.wrap(model)
    with pytest.raises(ValueError, match="needs every decoder layer and the LM head on one CUDA device"):
        sd.decode_path = "cuda_graph"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("home", [0, "cpu"])
@pytest.mark.parametrize("K", [0, "auto"])
def test_cuda_cpu_split_plain_and_chosen_k(home, K):
    """Plain steps (K = 0: the in-place update) and K chosen per step on the split: exact."""
    model = split_model("nemotron_h", home)
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=K, max_speculative_tokens=4,
                      cost_model=FixedCosts(lambda strategy, batch, K: 1.0 + 0.1 * K))
    out, ref = _generate(sd, home, family="nemotron_h")
    assert torch.equal(out, ref)
    check_cache_devices(sd, sd.last_cache)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("home", [0, "cpu"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_cpu_split_medusa_tree(home, strategy):
    """A Medusa draft tree on the split (path commits moved per device): exact."""
    model = split_model("qwen3_5", home)
    heads = MedusaHeads.from_target(model, num_heads=2)
    sd = specdec.wrap(model, drafter=MedusaDrafter(heads, tree="default"), rollback=strategy, decode_path="eager")
    out, ref = _generate(sd, home, family="qwen3_5")
    assert torch.equal(out, ref)
    check_cache_devices(sd, sd.last_cache)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("home", [0, "cpu"])
@pytest.mark.parametrize("path, prefix_caching", [("eager", False), ("static", False), ("eager", True)])
def test_cuda_cpu_split_generate_batch(home, path, prefix_caching):
    """Continuous batching on the split (rows loaded in place per device as requests are admitted;
    with prefix caching, blocks of every layer's keys stored per device): every request's tokens
    are HF greedy's on its prompt alone on the model in memory."""
    family = "kimi_linear"
    model = split_model(family, home)
    sd = specdec.wrap(model, drafter="ngram", rollback="replay", num_speculative_tokens=3, decode_path=path)
    alone = hf_alone(family, BATCH_PROMPTS)
    out = sd.generate_batch(BATCH_PROMPTS, max_new_tokens=8, max_batch_size=2, prefix_caching=prefix_caching,
                            **({"prefix_block_size": 2} if prefix_caching else {}))
    assert [o.generated_tokens for o in out.values()] == alone
    assert sd.last_stats.decode_path == path


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("home", [0, "cpu"])
def test_cuda_cpu_split_under_hf_prompt_lookup(home):
    """HF's own generate(prompt_lookup_num_tokens=...) on an enabled split model, whose first
    lookups find nothing so that the step room grows: exact as HF's greedy on the model in memory,
    and every layer's state (the SSM layers rebuilt for the wider steps too) on its device."""
    from types import SimpleNamespace

    from specdec.hf_integration import disable_hf_speculation

    family = "qwen3_5"
    model = split_model(family, home)
    ids = torch.tensor([[3, 17, 29, 41, 5, 8, 13, 21, 34, 55]])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = hf_greedy(get_model(family), ids, torch.ones_like(ids), max_new=12)
    dev = _home(home)
    specdec.enable_hf_speculation(model, rollback="replay")
    try:
        out = model.generate(ids.to(dev), attention_mask=torch.ones_like(ids).to(dev), return_dict_in_generate=True,
                             prompt_lookup_num_tokens=3, **kw)
    finally:
        disable_hf_speculation(model)
    assert torch.equal(out.sequences.cpu(), ref)
    cache = out.past_key_values if "past_key_values" in out else out.cache
    assert cache.hybrid.max_step_tokens > 1
    check_cache_devices(SimpleNamespace(adapter=adapter_for(model)), cache.hybrid)
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["eager", "static"])
def test_cuda_cpu_split_with_mtp_layers(tmp_path, path):
    """The target's MTP layers drafting on the split, with the input embeddings and rotary module on
    cuda:0 and the LM head (so the MTP layers) on the CPU: the embeddings and cos / sin they
    take cross devices; exact."""
    from test_mtp import load, save_with_mtp

    model = load("qwen3_5", save_with_mtp("qwen3_5", tmp_path))
    dm = split_map(model, "cpu")
    dm.update({"model.embed_tokens": 0, "model.rotary_emb": 0})
    model = dispatch_model(model, device_map=dm, main_device="cpu")
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(model, drafter="mtp", rollback="replay", num_speculative_tokens=2, decode_path=path)
    out = sd.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.cpu(), ref)
    assert sd.last_stats.decode_path == path and sd.last_stats.draft_path == path
    check_cache_devices(sd, sd.last_cache)


def decodes_with_draft_on(target_dev: str, draft_dev: str, path: str, draft_path: str):
    """A target on ``target_dev`` drafted for by a draft model on ``draft_dev`` on ``path``: exact
    (three greedy calls: the draft's static programs run eagerly, warm up, then are captured where
    the path captures; then continuous batching), the draft's proposals on ``draft_path``, its
    cache on its device. Returns the generator."""
    target = copy.deepcopy(get_model("qwen3_5")).to(target_dev)
    drafter = DraftModelDrafter(copy.deepcopy(get_model("qwen3_5", "perturbed")).to(draft_dev))
    ids, mask, eos, ref = reference("qwen3_5")
    sd = specdec.wrap(target, drafter=drafter, rollback="replay", num_speculative_tokens=3, decode_path=path)
    for _ in range(3):
        out = sd.generate(ids.to(target_dev), attention_mask=mask.to(target_dev), max_new_tokens=MAX_NEW,
                          eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out.cpu(), ref)
    st = sd.last_stats
    assert st.accepted_tokens > 0 and st.decode_path == path and st.draft_path == draft_path, st.draft_error
    assert drafter.cache.seq_len.device == torch.device(draft_dev)
    batch = sd.generate_batch(BATCH_PROMPTS, max_new_tokens=8, max_batch_size=2)
    assert [o.generated_tokens for o in batch.values()] == hf_alone("qwen3_5", BATCH_PROMPTS)
    return sd


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("target_on, path", [("cuda", "eager"), ("cuda", "static"), ("cuda", "cuda_graph"),
                                             ("cpu", "eager"), ("cpu", "static")])  # (a CPU target: no graphs)
def test_a_draft_model_on_the_other_device(target_on, path):
    """The target on cuda:0 with its draft model on the CPU, or the target on the CPU with its draft
    on cuda:0 (:func:`decodes_with_draft_on`; a CPU draft runs its static programs uncaptured); a
    CUDA target with a CPU draft also sampled twice from one seed of the call's CUDA generator,
    which draws the draft's tokens too: the same text."""
    draft_dev = "cpu" if target_on == "cuda" else "cuda:0"
    target_dev = "cuda:0" if target_on == "cuda" else "cpu"
    sd = decodes_with_draft_on(target_dev, draft_dev, path, "static" if path == "cuda_graph" else path)
    if target_on == "cuda" and path == "eager":
        ids, mask, _, _ = reference("qwen3_5")
        sampled = [sd.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=MAX_NEW, do_sample=True,
                               pad_token_id=0, generator=torch.Generator("cuda").manual_seed(0)) for _ in range(2)]
        assert torch.equal(*sampled) and sampled[0].device.type == "cuda"  # (the CUDA generator drew every token)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
@pytest.mark.parametrize("path", ["static", "cuda_graph"])
@pytest.mark.parametrize("target_gpu, draft_gpu", [(0, 1), (1, 0)])
def test_a_draft_model_on_another_gpu(target_gpu, draft_gpu, path):
    """The target on one GPU and its draft model on the other, cuda:0 current
    (:func:`decodes_with_draft_on`: the draft's programs captured on its own device on the
    CUDA-graph path), cuda:0 current afterwards."""
    torch.cuda.set_device(0)
    decodes_with_draft_on(f"cuda:{target_gpu}", f"cuda:{draft_gpu}", path, path)
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_gpu_split_decodes_exactly(strategy):
    """Layers 0-1 on cuda:0, the others and the LM head on cuda:1 (the home device differs from
    the embeddings'), cuda:0 current: auto takes the static path and says why; every path is
    exact; cuda:0 is current afterwards."""
    family = "qwen3_5"
    model = copy.deepcopy(make_model(family)).eval()
    n = len(model.model.layers)
    dm = {f"model.{name}": 0 for name, _ in model.model.named_children() if name != "layers"}
    dm.update({f"model.layers.{i}": 0 if i < n // 2 else 1 for i in range(n)})
    dm["lm_head"] = 1
    model = dispatch_model(model, device_map=dm, main_device="cpu")
    torch.cuda.set_device(0)
    ids, mask, eos, ref = reference(family)
    for path in ("auto", "eager", "static"):
        sd = specdec.wrap(model, drafter="ngram", rollback=strategy, num_speculative_tokens=3, decode_path=path)
        out = sd.generate(ids.to("cuda:1"), attention_mask=mask.to("cuda:1"), max_new_tokens=MAX_NEW,
                          eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out.cpu(), ref), path
        st = sd.last_stats
        assert st.decode_path == ("static" if path == "auto" else path)
        if path == "auto":
            assert st.path_reason == "auto: layers on several CUDA devices: the static path, no CUDA graphs"
        assert st.devices == "cuda:1: layers 2-3, lm_head; cuda:0: layers 0-1"
        check_cache_devices(sd, sd.last_cache)
        assert torch.cuda.current_device() == 0
