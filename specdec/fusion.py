"""Kernel fusion for the CUDA-graph decode path, through ``torch.compile``.

A decode step of a 4B hybrid at batch 1 moves ~8 GB of weights (~2 ms on an H200) but launches
well over a thousand small kernels: each RMSNorm of transformers' models is ~7 element-wise
kernels, each SSM mixer's input preparation (gates, L2 norms, dtype casts) another ~15. Inside
a CUDA graph every kernel still costs a few microseconds, so the step becomes kernel-count
bound. While the static decoder captures its graphs, :func:`fused` swaps

* the ``forward`` of every RMSNorm-like, MLP and rotary-embedding module of the model for
  ``torch.compile``'d versions of their own class's ``forward`` (one compiled graph per class,
  shared by all layers: Inductor fuses the element-wise chains into one Triton kernel each; a
  rotary embedding's cos / sin, ~10 kernels eagerly, once per step), and
* the element-wise input preparation of our SSM mixers (functions decorated :func:`fusable`;
  on the Triton backend, eagerly too, a Gated DeltaNet step's run as one Triton kernel of their
  own instead, :func:`specdec.kernels.gdn.triton_inputs.gdn_step_inputs`, and a Mamba-2 step's
  kernels form theirs from the raw projections, ``dt_bias`` of
  :func:`specdec.kernels.mamba2.triton_step.mamba2_update`) and a chain step's attention mask
  and positions (``specdec.cache``; ~10 element-wise kernels eagerly, one compiled), and
* the rotary embedding function attention layers call between their projections
  (``apply_rotary_pos_emb``, the name every transformers modeling file gives it; ~12 element-wise
  kernels per layer eagerly: slices, a negation, two concatenations, products and sums), looked
  up in the module that defines each attention class of the model and routed to its compiled
  version for the threads inside a block (:data:`FUSABLE_FUNCTIONS`), and
* sibling projections (linears of one module that read the same input: a layer's q / k / v, a
  Gated DeltaNet's qkv / z / b / a) for one launch of
  :func:`~specdec.kernels.linear.grouped_skinny_linear` each, at most 64 rows
  (:func:`~specdec.kernels.linear.merged_linears`; not inside the compiled modules), and
* every linear that does not merge (an MLP's, inside its compiled forward too; output
  projections; the LM head; a sibling group's members that run on their own) for
  :func:`~specdec.kernels.linear.skinny_linear` at most
  :data:`~specdec.kernels.linear.SINGLE_MAX_ROWS` rows
  (:func:`~specdec.kernels.linear.single_linears`), which reads a decode step's weights faster
  than cuBLAS there, and
* at those rows, the MLPs whose forward :func:`specdec.models.mlp.mlp_plan` recognises (a gated
  ``down(act(gate(x)) * up(x))`` or ``down(act(up(x)))``) for two launches: the projections and
  activation before the down projection in one (:func:`~specdec.kernels.linear.mlp_hidden`),
  the down projection through the skinny kernel; other rows run the compiled forward, and
* the residual adds of the decoder layers deferred into the norm that reads their sum: the sum
  and the norm computed by one compiled function (:mod:`specdec.residual`; a sum read by
  anything else is computed first, as it was),

and restores everything afterwards: the graph keeps the fused kernels, the user's model is left
as it was. The math is the models' own (same operations, fp32 where they use fp32); only the
order of floating-point operations inside a fused kernel may differ, as between any two
kernels. ``SPECDEC_FUSE=0`` turns fusion off; ``SPECDEC_MERGE_LINEARS=0`` only the merged
projections (the siblings then run one by one, through the skinny kernel where it applies);
``SPECDEC_SKINNY_LINEARS=0`` only the skinny kernel for the linears that do not merge (and with
it the MLPs' two launches); ``SPECDEC_FUSED_MLPS=0`` only the MLPs' two launches (their compiled
forward with each projection through the skinny kernel runs instead); ``SPECDEC_FUSED_RESIDUALS=0``
only the deferred residual adds.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import types

import torch

from .placement import routed_forward

__all__ = ["FUSABLE_FUNCTIONS", "fusable", "fused", "fusion_enabled", "merging_enabled", "skinny_enabled",
           "fused_mlps_enabled", "residuals_enabled", "prompt_kernels_enabled", "merge_candidates", "single_candidates"]

#: module-level functions that attention classes call by name from their own modeling module,
#: compiled inside :func:`fused` blocks as the norms are
FUSABLE_FUNCTIONS = ("apply_rotary_pos_emb",)

_ACTIVE = threading.local()  # .depth: fused blocks this thread is inside (another thread's are not its own)
_COMPILED: dict = {}
_ROUTED: dict = {}  # (python module, function name) -> [the original function, its router, blocks using it]
_ROUTED_LOCK = threading.Lock()


def _active() -> bool:
    return getattr(_ACTIVE, "depth", 0) > 0


def env_switch(name: str, default: bool = True) -> bool:
    """An environment switch, ``default`` where unset: off for ``0``, ``false``, ``False`` or empty,
    else on."""
    return os.environ.get(name, "1" if default else "0") not in ("0", "false", "False", "")


def prompt_kernels_enabled() -> bool:
    """Whether prompt forwards on the Triton backend run specdec's element-wise kernels
    (``SPECDEC_PROMPT_KERNELS``, default on): the decoder's RMSNorms and MLP activations
    (:func:`specdec.models.common.prompt_kernels`), Mamba-2's per-head passes around fla's scan
    (:mod:`specdec.kernels.mamba2.triton_heads`), and the delta rules' q and k left for fla to
    normalise (:attr:`specdec.models.prompt_layer.DeltaRulePromptLayer.takes_raw_qk`). Off, those
    run as transformers' modules and PyTorch's element-wise ops compute them: an A/B switch, read
    at every prompt forward."""
    return env_switch("SPECDEC_PROMPT_KERNELS")


def fusion_enabled() -> bool:
    """Whether the CUDA-graph path fuses (``SPECDEC_FUSE``, default on)."""
    return env_switch("SPECDEC_FUSE")


def merging_enabled() -> bool:
    """Whether fusion merges sibling projections (``SPECDEC_MERGE_LINEARS``, default on)."""
    return env_switch("SPECDEC_MERGE_LINEARS")


def skinny_enabled() -> bool:
    """Whether fusion runs the linears it does not merge through the skinny kernel
    (``SPECDEC_SKINNY_LINEARS``, default on)."""
    return env_switch("SPECDEC_SKINNY_LINEARS")


def fused_mlps_enabled() -> bool:
    """Whether fusion runs the MLPs it recognises as two launches (``SPECDEC_FUSED_MLPS``, default
    on; only with the skinny kernel, :func:`skinny_enabled`)."""
    return env_switch("SPECDEC_FUSED_MLPS")


def _mlp_forward(plan, compiled):
    """An MLP's routed forward: :func:`~specdec.kernels.linear.mlp_hidden` then the down projection
    where that applies, ``compiled`` (the class's compiled forward) otherwise."""
    from .kernels.linear import mlp_hidden

    def forward(mod, *args, **kwargs):
        if len(args) == 1 and not kwargs and not torch.compiler.is_compiling():
            h = mlp_hidden(args[0], plan)
            if h is not None:
                return plan.down(h)
        return compiled(mod, *args, **kwargs)

    return forward


def _compiled(key, fn, options=None):
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=None, fullgraph=False, options=options)
    return _COMPILED[key]


def residuals_enabled() -> bool:
    """Whether fusion defers residual adds into the norms that read them (``SPECDEC_FUSED_RESIDUALS``,
    default on; :mod:`specdec.residual`)."""
    return env_switch("SPECDEC_FUSED_RESIDUALS")


def _add_then(cls):
    """``fn(mod, a, b, out)``: ``out = a + b``, then ``cls.forward(mod, out)`` -- a norm of the sum,
    compiled as one kernel with the sum rounded as the eager add rounds it."""
    def add_then(mod, a, b, out):
        torch.add(a, b, out=out)
        return cls.forward(mod, out)

    return _compiled(("add", cls, cls.forward), add_then, {"emulate_precision_casts": True})


def _norm_forward(cls, compiled):
    """A norm's routed forward: a pending residual sum (:mod:`specdec.residual`) computed with the
    norm in one compiled function, anything else through ``compiled`` (the class's compiled forward)."""
    from .residual import DeferredResidual, consume, plain

    add_then = _add_then(cls)

    def forward(mod, x, *args, **kwargs):
        if type(x) is DeferredResidual:
            if x.kind == "pending" and not args and not kwargs:
                return consume(x, lambda a, b, out: add_then(mod, a, b, out))
            x = plain(x)
        return compiled(mod, x, *args, **kwargs)

    return forward


def fusable(fn):
    """Run ``fn`` eagerly, or ``torch.compile``'d while :func:`fused` is active."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _active():
            return _compiled(fn, fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _is_fusable_class(mod: torch.nn.Module) -> bool:
    return type(mod).__name__.endswith(("RMSNorm", "RMSNormGated", "MLP", "RotaryEmbedding"))


def _is_fusable_module(mod: torch.nn.Module) -> bool:
    return _is_fusable_class(mod) and "forward" not in vars(mod)


def _function_sites(model: torch.nn.Module) -> list[tuple[types.ModuleType, str]]:
    """(python module, name) of each :data:`FUSABLE_FUNCTIONS` function defined in the module of
    an attention class of ``model`` (a class whose name ends with ``Attention``)."""
    sites = {}
    for mod in model.modules():
        if not type(mod).__name__.endswith("Attention"):
            continue
        where = sys.modules.get(type(mod).__module__)
        for name in FUSABLE_FUNCTIONS:
            fn = getattr(where, name, None)
            if inspect.isfunction(fn):  # (a router of a block already open is one too)
                sites[(where.__name__, name)] = (where, name)
    return list(sites.values())


@contextlib.contextmanager
def _routed_function(where: types.ModuleType, name: str):
    """Within the block (counted over threads and nested blocks), ``where.<name>`` is a router that
    runs the function compiled for a thread inside a :func:`fused` block and as it was otherwise
    (and inside a ``torch.compile`` trace, which inlines it); the function is back afterwards."""
    key = (where.__name__, name)
    with _ROUTED_LOCK:
        entry = _ROUTED.get(key)
        if entry is None:
            original = getattr(where, name)

            @functools.wraps(original)
            def router(*args, **kwargs):
                if torch.compiler.is_compiling() or not _active():
                    return original(*args, **kwargs)
                return _compiled(original, original)(*args, **kwargs)

            setattr(where, name, router)
            entry = _ROUTED[key] = [original, router, 0]
        entry[2] += 1
    try:
        yield
    finally:
        with _ROUTED_LOCK:
            entry[2] -= 1
            if entry[2] == 0:
                del _ROUTED[key]
                if getattr(where, name, None) is entry[1]:  # (not if someone replaced it since)
                    setattr(where, name, entry[0])


def merge_candidates(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """The sibling groups :func:`fused` routes through
    :func:`~specdec.kernels.linear.merged_linears`: :func:`~specdec.kernels.linear.sibling_groups`
    outside the modules it compiles (their linears run inside the compiled forward)."""
    from .kernels.linear import sibling_groups

    return sibling_groups(model, skip=_is_fusable_class)  # (by class: inside a block their forward is swapped)


def single_candidates(model: torch.nn.Module, groups: list[list[torch.nn.Linear]]) -> list[torch.nn.Linear]:
    """The linears :func:`fused` routes through :func:`~specdec.kernels.linear.single_linears`:
    every ``nn.Linear`` of ``model`` (exactly that class, without forward hooks -- but those of
    :func:`specdec.residual.deferred_residuals` -- or an accelerate hook) in none of ``groups``."""
    from .placement import unhooked

    grouped = {id(m) for g in groups for m in g}
    return [m for m in model.modules() if type(m) is torch.nn.Linear and id(m) not in grouped and unhooked(m)]


@contextlib.contextmanager
def fused(model: torch.nn.Module | None, enabled: bool = True, *, modules: bool = True):
    """Within the block, norms/MLPs of ``model`` (None: no model) and, on this thread, the
    :data:`FUSABLE_FUNCTIONS` of its attention classes' modules and :func:`fusable` functions run
    compiled, and on this thread its linears run the merged and skinny kernels (on the Triton
    backend; see the module's docstring) (blocks nest; another thread's calls stay eager).
    Dynamo's recompile limits are raised for the block, for the process.

    ``modules=False`` leaves the norms / MLPs' own forwards in place: for a program compiled whole,
    whose compile fuses them anyway. Routed there, each block's new binding of their compiled
    forward (which dynamo guards by identity) would compile the whole program again."""
    if not enabled:
        yield
        return
    # one compiled forward serves every layer of a class, but input shapes/strides differ per
    # call site (hidden states, per-head q/k norms) and per bucket (batch, T): allow enough
    # recompiles, or dynamo silently falls back to the unfused forward after 8 of them
    import torch._dynamo.config as dynamo_config

    limits = {k: max(getattr(dynamo_config, k), 64) for k in ("recompile_limit", "cache_size_limit")
              if hasattr(dynamo_config, k)}
    saved = {k: getattr(dynamo_config, k) for k in limits}
    entered = False
    try:
        for k, v in limits.items():
            setattr(dynamo_config, k, v)
        with contextlib.ExitStack() as stack:
            siblings = merge_candidates(model) if model is not None and merging_enabled() else []
            from .kernels import backend
            from .models.mlp import mlp_plan  # (here: specdec.models imports this module)

            two_launch_mlps = skinny_enabled() and fused_mlps_enabled()
            residuals = model is not None and modules and residuals_enabled()
            for mod in model.modules() if model is not None and modules else ():
                if _is_fusable_module(mod):
                    cls = type(mod)
                    forward = _compiled((cls, cls.forward), cls.forward)  # (a class's forward replaced: compiled anew)
                    plan = mlp_plan(mod) if two_launch_mlps else None
                    if plan is not None and backend(plan.up.weight.device) == "triton":  # (the skinny kernel's backend)
                        forward = _mlp_forward(plan, forward)
                    elif residuals and cls.__name__.endswith("RMSNorm"):
                        forward = _norm_forward(cls, forward)
                    stack.enter_context(routed_forward(mod, forward))
            for where, name in _function_sites(model) if model is not None else ():
                stack.enter_context(_routed_function(where, name))
            if siblings:
                from .kernels.linear import merged_linears

                stack.enter_context(merged_linears(model, groups=siblings))
            if model is not None and skinny_enabled():
                from .kernels.linear import single_linears

                stack.enter_context(single_linears(single_candidates(model, siblings)))
            if residuals:  # (last: the candidates above are chosen before its hooks are on the layers' children)
                from .residual import deferred_residuals

                stack.enter_context(deferred_residuals(model, _active))
            _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
            entered = True
            yield
    finally:
        if entered:
            _ACTIVE.depth -= 1
        for k, v in saved.items():
            setattr(dynamo_config, k, v)
