"""Models dispatched by accelerate (``from_pretrained(..., device_map=...)``, ``dispatch_model``).

accelerate's big-model dispatch places each module on a device and attaches a hook
(``accelerate.hooks.AlignDevicesHook``, module attribute ``_hf_hook``) that moves a module's
inputs to its *execution device* before its forward. With offloading (``device_map`` entries
``"cpu"`` on a GPU machine, or ``"disk"``), a module's weights stay on the ``meta`` device and the
hook loads them for the length of that module's own forward, then drops them again
(https://huggingface.co/docs/accelerate/usage_guides/big_modeling).

specdec runs its own forward for each SSM mixer and reads some weights directly (the conv
kernel's ``conv1d.weight``, ``A_log``, ``dt_bias``), which a hook on a submodule would not have
loaded. This module gives what the adapters need to work under such hooks:

* :func:`execution_device`: where a module computes (its hook's execution device, else where its
  weights are), and :func:`execution_devices`: where each of its hooked parts computes;
* :func:`routed_forward`: replace a module's forward for a while, keeping its hook in front of it;
* :func:`materialized`: the weights of a module and all its submodules loaded for a block of code;
* :func:`on_device`: the model's CUDA device made the current one while specdec decodes (Triton
  launches on the current device, not on its tensors'), and :func:`spread_layers`: each decoder
  layer of a model spread over several devices given its inputs on its device, with it current;
* :func:`check_placement`: the layouts specdec decodes (each decoder layer, its submodules
  included, computing on one CUDA or CPU device; the layers may spread over several), as a
  :class:`Placement`, with a clear error for the others, and :func:`offloads_weights`: whether
  weights are loaded per forward, which CUDA graphs cannot replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types

import torch

__all__ = ["Placement", "check_placement", "execution_device", "execution_devices", "materialized", "offloads_weights",
           "on_device", "routed_forward", "spread_layers", "unhooked"]


def on_device(device: torch.device | str | None) -> contextlib.AbstractContextManager:
    """A context in which ``device`` is torch's current CUDA device (``torch.cuda.device``), for a
    CUDA ``device``; for any other device, or None, a context that does nothing. Triton launches a
    kernel on the current device whatever device its tensors are on, and specdec's captures
    (:func:`specdec.graphs.capture`) and syncs take the current device: a model on ``cuda:1``
    runs its kernels there only inside this context (with ``cuda:0`` current they would read
    another device's memory)."""
    if device is None:
        return contextlib.nullcontext()
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def unhooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs its forward alone: no forward pre-hooks, no forward hooks but
    :func:`specdec.residual.deferred_residuals`' (they mark the output, its values stay), no
    accelerate hook. (A forward replaced on the instance is the caller's to check.)"""
    from .residual import is_residual_hook

    return (not module._forward_pre_hooks and all(map(is_residual_hook, module._forward_hooks.values()))
            and getattr(module, "_hf_hook", None) is None)


def _hooks(module: torch.nn.Module) -> list:
    """The accelerate hooks on ``module`` (a ``SequentialHook``'s parts), or []."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def _hook_device(module: torch.nn.Module) -> torch.device | None:
    """The execution device named by ``module``'s own accelerate hook (an int: that CUDA device),
    or None when it has no hook naming one."""
    for hook in _hooks(module):
        dev = getattr(hook, "execution_device", None)
        if dev is not None:
            return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    return None


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """The device ``module`` computes on: the execution device of its accelerate hook (or of the
    first hooked submodule, in ``module.modules()`` order), else the device of its first weight or
    buffer not on ``meta``; None when it has neither. Submodules hooked to other devices are not
    looked at: :func:`execution_devices` gives every part's device."""
    for mod in module.modules():
        dev = _hook_device(mod)
        if dev is not None:
            return dev
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "meta":
            return t.device
    return None


def execution_devices(module: torch.nn.Module) -> dict[torch.device | None, list[str]]:
    """Where the parts of ``module`` compute, from the accelerate hooks on it and on every
    submodule: ``{device: names}``, in the order first met, the names (relative to ``module``,
    ``""`` for ``module`` itself) of the outermost hooked modules on that device; a hooked
    submodule inside one hooked to the same device is not named again. Without any hook naming a
    device, ``{execution_device(module): [""]}`` (the key None: no weights anywhere but ``meta``)."""
    hooked: dict[str, torch.device] = {}
    found: dict[torch.device | None, list[str]] = {}
    for name, mod in module.named_modules():
        dev = _hook_device(mod)
        if dev is None:
            continue
        hooked[name] = dev
        outer = name
        while outer:  # the nearest hooked module around this one
            outer = outer.rpartition(".")[0]
            if outer in hooked:
                break
        if outer not in hooked or outer == name or hooked[outer] != dev:
            found.setdefault(dev, []).append(name)
    return found or {execution_device(module): [""]}


def offloads_weights(module: torch.nn.Module) -> bool:
    """Whether any weight of ``module`` is loaded by a hook for each forward (accelerate's
    ``offload``), or is still on the ``meta`` device."""
    return any(getattr(h, "offload", False) for mod in module.modules() for h in _hooks(mod)) or any(
        p.device.type == "meta" for p in module.parameters())


#: held by a thread while any of its :func:`routed_forward` blocks is open: a module's forward is
#: an attribute every thread sees, so one thread at a time replaces forwards (another thread's
#: specdec forward waits for the block to end; its own blocks nest)
_ROUTE_LOCK = threading.RLock()


@contextlib.contextmanager
def routed_forward(module: torch.nn.Module, forward):
    """Within the block, calling ``module(...)`` from this thread runs ``forward(module, ...)``:
    behind the module's accelerate hook when it has one (the hook still loads its weights and
    moves the inputs), and whatever forward the instance had before is back afterwards.

    Thread-safe for eager callers: the block holds :data:`_ROUTE_LOCK` (another thread's routed
    blocks, on any module, wait for it: specdec's forwards run one at a time in a process), and an
    eager call of ``module`` from another thread meanwhile (the model's own ``generate()``, say)
    runs the forward the instance had before, not this one. Inside a ``torch.compile`` trace the
    routed forward is the one traced, whichever thread traces: another thread compiling the same
    model while a block is open is not supported."""
    # a compiled forward (a fused norm's) as a partial: torch 2.11's dynamo drops the module argument
    # of a bound method whose function is itself compiled (inside a program compiled whole). Any
    # other forward as a bound method: dynamo guards a partial by identity, so a compiled forward
    # that calls routed submodules (an MLP's linears) would compile again at each block, also
    # inside a CUDA-graph capture, which then fails
    compiled = hasattr(forward, "_torchdynamo_orig_callable")
    bound = functools.partial(forward, module) if compiled else types.MethodType(forward, module)
    attr = "_old_forward" if getattr(module, "_hf_hook", None) is not None and hasattr(module, "_old_forward") \
        else "forward"
    with _ROUTE_LOCK:
        before = module.__dict__.get(attr, None)
        # what another thread's call runs meanwhile: the instance's forward as it was
        other = before if before is not None else types.MethodType(type(module).forward, module)
        owner = threading.get_ident()

        def call(*args, **kwargs):
            if torch.compiler.is_compiling() or threading.get_ident() == owner:
                return bound(*args, **kwargs)
            return other(*args, **kwargs)

        setattr(module, attr, call)
        try:
            yield
        finally:
            if before is None:
                module.__dict__.pop(attr, None)
            else:
                setattr(module, attr, before)


@contextlib.contextmanager
def materialized(module: torch.nn.Module, own: bool = False):
    """Within the block, every offloaded weight of ``module``'s submodules (and with ``own`` of
    ``module`` itself; without, its hook loads those around its forward) is loaded on its
    execution device, so code that reads them directly (``mixer.conv1d.weight``) sees real
    tensors; they are dropped again afterwards. A no-op without offloading hooks."""
    hooked = [(mod, h) for mod in module.modules() if own or mod is not module for h in _hooks(mod)
              if getattr(h, "offload", False)]
    done = []
    try:
        for mod, hook in hooked:
            hook.pre_forward(mod)
            done.append((mod, hook))
        yield
    finally:
        for mod, hook in reversed(done):
            hook.post_forward(mod, None)


#: the device types a decoder layer may compute on
LAYER_DEVICE_TYPES = ("cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a model's decoder layers and LM head compute.

    Attributes:
        home: the LM head's execution device. The decode loop's bookkeeping (tokens, acceptance,
            the cache's ``seq_len`` / ``pad``, masks, positions) lives here, and the adapter
            returns logits and hidden states here.
        layers: the execution device of each decoder layer, in order (each layer's KV cache,
            conv window, recurrent state and rollback store live there).

    Raises (at construction, when the layers and the head are on several devices):
        ValueError: a device type other than those of :data:`LAYER_DEVICE_TYPES`, or a CUDA
            device this process does not have.
    """

    home: torch.device
    layers: tuple[torch.device, ...]

    def __post_init__(self):
        if not self.multi_device:
            return
        for dev in self.devices:
            if dev.type not in LAYER_DEVICE_TYPES:
                raise ValueError(f"a model whose decoder layers spread over several devices must compute on "
                                 f"{' or '.join(LAYER_DEVICE_TYPES)} devices; this one has {self.layout()}")
            if dev.type == "cuda" and (not torch.cuda.is_available() or dev.index is None
                                       or dev.index >= torch.cuda.device_count()):
                have = torch.cuda.device_count() if torch.cuda.is_available() else 0
                raise ValueError(f"device {dev} is not available (this process sees {have} CUDA device"
                                 f"{'' if have == 1 else 's'}); this model computes on {self.layout()}. Dispatch "
                                 "it with a device_map naming devices this machine has")

    @functools.cached_property
    def devices(self) -> tuple[torch.device, ...]:
        """Every device a layer or the LM head computes on: ``home`` first, then the others in
        layer order."""
        return tuple(dict.fromkeys((self.home, *self.layers)))

    @property
    def multi_device(self) -> bool:
        """Whether the layers and the LM head compute on more than one device."""
        return len(self.devices) > 1

    @property
    def all_cuda(self) -> bool:
        """Whether every layer and the LM head compute on CUDA devices."""
        return all(dev.type == "cuda" for dev in self.devices)

    @property
    def cuda_device(self) -> torch.device | None:
        """A CUDA device something computes on: ``home`` when it is one, else the first CUDA layer's;
        None when nothing computes on CUDA."""
        return next((dev for dev in self.devices if dev.type == "cuda"), None)

    def layout(self) -> str:
        """The layout in words: each device and what computes there, e.g.
        ``"cuda:0: layers 0-1, lm_head; cpu: layers 2-3"``."""
        parts = []
        for dev in self.devices:
            idx = [i for i, d in enumerate(self.layers) if d == dev]
            runs = []
            for i in idx:
                if runs and runs[-1][1] == i - 1:
                    runs[-1][1] = i
                else:
                    runs.append([i, i])
            what = [f"layers {', '.join(str(a) if a == b else f'{a}-{b}' for a, b in runs)}"] if runs else []
            parts.append(f"{dev}: {', '.join(what + (['lm_head'] if dev == self.home else []))}")
        return "; ".join(parts)


def _normalized(dev: torch.device) -> torch.device:
    """``dev`` with the index of the current CUDA device for a bare ``cuda`` (where there is one)."""
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def check_placement(model: torch.nn.Module, layers, lm_head: torch.nn.Module) -> Placement:
    """Where each decoder layer of ``layers`` and ``lm_head`` compute (their weights may be
    offloaded to the CPU or disk by accelerate's hooks), as a :class:`Placement`. Layers may
    compute on different devices (``device_map`` spreading whole layers over GPUs, or a GPU and
    the CPU); each one, its submodules included, computes on one.

    Raises:
        ValueError: a layer's submodules compute on several devices, or a module has no weights
            anywhere but on ``meta`` and no hook to load them; the message names the devices and
            their layers (``"3"``), or for a layer split between devices its parts (``"3.mlp"``,
            see :func:`execution_devices`). A device :class:`Placement` refuses (another type
            than CUDA or CPU, a CUDA device this process does not have) when the layers spread.
    """
    where: dict[torch.device | None, list[str]] = {}
    found: list[torch.device | None] = []
    split = False

    def add(module, label):
        nonlocal split
        parts = execution_devices(module)
        split = split or len(parts) > 1
        found.append(next(iter(parts)) if len(parts) == 1 else None)
        for dev, names in parts.items():
            where.setdefault(dev, []).extend(
                [label] if len(parts) == 1 else [f"{label}.{n}" if n else label for n in names])

    for i, layer in enumerate(layers):
        add(layer, str(i))
    add(lm_head, "lm_head")
    if split or None in where:
        spread = "; ".join(f"{'no device (weights on meta, no hook)' if dev is None else dev}: layers "
                           f"{', '.join(names)}" for dev, names in where.items())
        raise ValueError(
            f"specdec decodes a model each of whose decoder layers, and its LM head, computes on one device; this "
            f"{type(model).__name__} computes on several ({spread}). Load it with a device_map that puts every "
            "layer, each of its submodules included, on one execution device (weights may be offloaded to 'cpu' "
            "or 'disk': accelerate's hooks load them per forward), e.g. device_map='auto', which places whole "
            "decoder layers")
    *per_layer, home = map(_normalized, found)
    return Placement(home, tuple(per_layer))


@contextlib.contextmanager
def spread_layers(layers, placement: Placement):
    """Within the block, calls of the decoder ``layers`` (``placement.layers[i]`` is layer i's
    device) of a model spread over several devices get their inputs on their own device and run
    with it current: a forward pre-hook on each layer copies every tensor argument on another
    device (hidden states, the mask, ``position_embeddings``' cos / sin, position ids; inside
    tuples, lists and dicts too) to the layer's device, a keyword argument once per device for
    the whole block (the copies are kept until it ends, so the layers after the first of a device
    find them; a positional one, the hidden states the layer before returned, is copied each
    time, not kept), and makes a CUDA layer's device torch's current one (Triton launches there), a forward hook
    making ``home``'s current again after it. accelerate's hooks, which run after these, then
    find every input in place. Copies to a CUDA device do not block the host; copies to the CPU
    do (the CPU computes on the host). The current CUDA device at entry is current again at the
    end, also after an error. Does nothing for a placement on one device."""
    if not placement.multi_device:
        yield
        return
    home = placement.home
    memo: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def moved(x, dev, keep: bool):
        if isinstance(x, torch.Tensor):
            if x.device == dev:
                return x
            if not keep:
                return x.to(dev, non_blocking=dev.type == "cuda")
            hit = memo.get((id(x), dev))
            if hit is None:  # (the source kept alongside: its id stays its own while the block lasts)
                hit = memo[(id(x), dev)] = (x, x.to(dev, non_blocking=dev.type == "cuda"))
            return hit[1]
        if type(x) in (tuple, list):
            return type(x)(moved(v, dev, keep) for v in x)
        if type(x) is dict:
            return {k: moved(v, dev, keep) for k, v in x.items()}
        return x

    def before(dev):
        def hook(module, args, kwargs):
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            return moved(args, dev, False), moved(kwargs, dev, True)
        return hook

    def after(module, args, output):
        torch.cuda.set_device(home)

    handles = []
    cuda = any(dev.type == "cuda" for dev in placement.devices)
    current = torch.cuda.current_device() if cuda else None
    try:
        for layer, dev in zip(layers, placement.layers):
            handles.append(layer.register_forward_pre_hook(before(dev), with_kwargs=True))
            if dev.type == "cuda" and dev != home and home.type == "cuda":
                handles.append(layer.register_forward_hook(after))
        yield
    finally:
        for handle in handles:
            handle.remove()
        memo.clear()
        if cuda:
            torch.cuda.set_device(current)
