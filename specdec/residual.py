"""Residual adds deferred into the norm that reads their sum, while the CUDA-graph decode path
captures (:func:`deferred_residuals`, entered by :func:`specdec.fusion.fused`).

A pre-norm decoder layer adds each branch's output (the token mixer's, the MLP's) to the
residual stream, and the next thing to read the sum is a norm: the layer's second norm, or the
next layer's first (the model's final norm after the last layer)::

    h = residual + mixer(norm1(residual))      # one element-wise kernel
    y = norm2(h)                               # one reduction kernel

Two kernels per add on every layer, ~50-65 per decode step of a 4B hybrid, each a launch that
costs more than its few kilobytes of work. Inside the block the add is not computed where the
layer's code writes it: the branch's output comes back as a :class:`DeferredResidual` marked
"branch", and ``residual + branch`` returns a "pending" :class:`DeferredResidual` -- storage for
the sum, not yet written. The norm that then reads it (a module :func:`specdec.fusion.fused`
routes) computes the sum and the norm in one compiled function, writing the sum into that
storage as the norm reads it: one kernel where there were two (``torch.compile`` fuses an add
into the reduction that reads it), with the sum rounded to its dtype as the eager add rounds it
(Inductor's ``emulate_precision_casts``). Any other use of a pending sum -- another op, a
``data_ptr`` read by a kernel launch, an unexpected consumer -- first computes it with the eager
add, so the result is the layer's whatever reads it: only the kernel count changes. A
``.to()`` that would return the tensor itself (Nemotron-H's ``norm(h.to(norm.weight.dtype))``)
returns the pending sum as it is.

The sum is read when it is consumed, not when the add runs: an addend written in place in
between (no layer of the supported families does; their branches return fresh tensors) raises
a ``RuntimeError`` rather than give another sum (checked by version counters where the tensors
have them). Outputs that need a gradient are not deferred. Layer outputs a model records
(``output_hidden_states=True``) may come back as written :class:`DeferredResidual` tensors: their
values are the layer's, each later op on them unwraps them.

The branches are the direct children of each decoder layer (the modules of an ``nn.ModuleList``
named ``layers``) other than norms; their outputs (a tensor, or a tuple's first tensor) are
wrapped by a forward hook that acts only on threads inside a :func:`specdec.fusion.fused` block.
``SPECDEC_FUSED_RESIDUALS=0`` turns this off.
"""

from __future__ import annotations

import contextlib

import torch

from .kernels.linear import tensor_version

__all__ = ["DeferredResidual", "deferred_residuals", "residual_branches", "consume", "is_pending", "plain",
           "is_residual_hook"]

_ADDS = (torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add)


class DeferredResidual(torch.Tensor):
    """A tensor of the residual stream inside :func:`deferred_residuals`: ``kind`` ``"branch"`` (a
    branch's output, to be added), ``"pending"`` (a sum whose storage is not yet written; ``parts``
    the two addends) or ``"done"`` (written). Every torch function but the deferred add and a no-op
    ``.to()`` runs on plain tensors (a pending sum computed first) and returns plain results."""

    kind: str
    parts: tuple | None
    #: the plain tensor this one wraps (what :func:`plain` returns: not an alias made from the
    #: subclass, whose ``_base`` would be the subclass again, a cycle ``torch.compile`` cannot trace)
    base: torch.Tensor

    @staticmethod
    def of(t: torch.Tensor, kind: str, parts: tuple | None = None) -> "DeferredResidual":
        with torch._C.DisableTorchFunctionSubclass():
            r = torch.Tensor._make_subclass(DeferredResidual, t)
        r.kind, r.parts, r.base = kind, parts, t
        return r

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ADDS and len(args) == 2 and not kwargs:
            pending = _defer(*args)
            if pending is not None:
                return pending
        if func is torch.Tensor.to and args and _is_noop_to(args[0], args[1:], kwargs):
            return args[0]
        args, kwargs = _plain_tree(args), _plain_tree(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def is_pending(t) -> bool:
    """Whether ``t`` is a pending sum (its storage not yet written)."""
    return type(t) is DeferredResidual and t.kind == "pending"


def plain(t: torch.Tensor, compute: bool = True) -> torch.Tensor:
    """``t`` as a plain tensor sharing its storage; a pending sum computed first (``compute``).

    Raises:
        RuntimeError: an addend of the pending sum was written in place after the add (the sum
            read now would not be the one the add named).
    """
    if type(t) is not DeferredResidual:
        return t
    if t.kind == "pending" and compute:
        a, b = _parts(t)
        with torch._C.DisableTorchFunctionSubclass():
            torch.add(a, b, out=t.base)
        t.kind, t.parts = "done", None
    return t.base


def _parts(t: "DeferredResidual") -> tuple[torch.Tensor, torch.Tensor]:
    """A pending sum's addends, checked unwritten since the add."""
    (a, va), (b, vb) = t.parts
    if tensor_version(a) != va or tensor_version(b) != vb:
        raise RuntimeError("an addend of a deferred residual add was written in place before the sum was read; "
                           "run without SPECDEC_FUSED_RESIDUALS (=0) for such a model")
    return a, b


def _plain_tree(x):
    if type(x) is DeferredResidual:
        return plain(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain_tree(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain_tree(v) for k, v in x.items()}
    return x


def _defer(x, y) -> DeferredResidual | None:
    """``x + y`` as a pending sum where one is a branch's output and the other a plain or written
    tensor of the same shape, dtype and device (no gradient); None otherwise."""
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None
    kinds = (getattr(x, "kind", None) if type(x) is DeferredResidual else "plain",
             getattr(y, "kind", None) if type(y) is DeferredResidual else "plain")
    if sorted(kinds) not in (["branch", "plain"], ["branch", "done"]):
        return None
    with torch._C.DisableTorchFunctionSubclass():
        if (x.shape != y.shape or x.dtype != y.dtype or x.device != y.device or not x.dtype.is_floating_point
                or x.requires_grad or y.requires_grad):
            return None
    a, b = plain(x), plain(y)
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.empty_like(a, memory_format=torch.contiguous_format)
    return DeferredResidual.of(out, "pending", ((a, tensor_version(a)), (b, tensor_version(b))))


def _is_noop_to(t, args, kwargs) -> bool:
    """Whether ``t.to(*args, **kwargs)`` would return ``t`` itself (same dtype and device, no copy)."""
    if not is_pending(t):
        return False
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return False
    if kwargs.get("copy") or memory_format not in (None, torch.preserve_format):
        return False
    if args and isinstance(args[0], torch.Tensor):  # .to(other): other's dtype and device
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return (dtype is None or dtype == t.dtype) and (device is None or torch.device(device) == t.device)


def consume(x: DeferredResidual, add_then) -> torch.Tensor:
    """A pending sum's reader: ``add_then(a, b, out)`` computes ``out = a + b`` into the sum's
    storage and returns what it reads from it (a norm's output); the sum is written afterwards."""
    a, b = _parts(x)
    y = add_then(a, b, plain(x, compute=False))
    x.kind, x.parts = "done", None
    return y


def is_residual_hook(hook) -> bool:
    """Whether ``hook`` is the forward hook of :func:`deferred_residuals` (it wraps a module's output
    and changes nothing else: a module's forward stays what it computes)."""
    return getattr(hook, "specdec_residual_hook", False)


def residual_branches(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The direct children of ``model``'s decoder layers (the elements of each ``nn.ModuleList``
    named ``layers``) that are not norms (class names ending in ``Norm``): the branches whose
    outputs a layer adds to its residual stream."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            for layer in mod:
                found += [c for c in layer.children() if not type(c).__name__.endswith("Norm")]
    return found


@contextlib.contextmanager
def deferred_residuals(model: torch.nn.Module, active):
    """Within the block, on threads for which ``active()`` is true, the outputs of
    :func:`residual_branches` come back as branch :class:`DeferredResidual` tensors, so the adds
    that put them on the residual stream are deferred (see the module docstring). The hooks are
    removed afterwards."""
    def wrap(module, args, out):  # (its semantics are the module's: is_residual_hook)
        if not active():
            return None
        first = out[0] if isinstance(out, tuple) and out else out
        if not (type(first) is torch.Tensor and first.dtype.is_floating_point):
            return None
        if torch.is_grad_enabled() and first.requires_grad:  # (a subclass made of it would have no autograd history)
            return None
        return DeferredResidual.of(out, "branch") if first is out else (DeferredResidual.of(first, "branch"),) + out[1:]

    wrap.specdec_residual_hook = True
    handles = [m.register_forward_hook(wrap) for m in residual_branches(model)]
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()
