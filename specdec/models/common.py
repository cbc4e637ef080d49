"""What the family adapters share beyond :mod:`specdec.models.base`: :func:`layer_types_of`,
:func:`cache_keyword` (the name a forward takes its cache by), :func:`l2norm` (the delta-rule
mixers' q / k normalisation), :func:`gated_norm` (the gated RMSNorm after a mixer's
recurrence) and :func:`prompt_kernels` (a prompt forward's plain RMSNorms and MLP activations in
one launch each).

The hooks by which the Hugging Face families differ *outside* their SSM mixer live on
:class:`~specdec.models.base.HybridAdapter`, which every adapter subclasses (one prefill / step
path):

* how the decoder body is called (``cache_arg``: ``past_key_values`` or Mamba2's
  ``cache_params``; ``uses_position_ids``; :meth:`step_attention_mask` for what the body takes as
  ``attention_mask`` during a step: a per-layer-type dict, a single 4-D mask, or None);
* layers that hold *both* an attention KV cache and SSM state (Falcon-H1's parallel blocks,
  Zamba2's hybrid layers with the shared attention block): prefill loads every state a layer
  of HF's ``DynamicCache`` holds, not one or the other;
* the LM head (:meth:`logits`: Falcon-H1's ``lm_head_multiplier``, Granite's ``logits_scaling``);
* sliding-window attention layers (their mask: :meth:`HybridCache.sliding_mask <specdec.cache.HybridCache.sliding_mask>`).

The mixers themselves stay in the family modules and call the shared ops through
``layer.conv`` / ``layer.ssm``.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from ..kernels.gdn import L2NORM_EPS
from ..kernels.linear import mlp_activation
from ..kernels.protocol import FLOAT_DTYPES
from ..kernels.norm import gated_norm_form, gated_rms_norm, rms_norm, rms_norm_form
from ..placement import routed_forward
from .mlp import MLPPlan, mlp_plan
from .prompt_layer import PromptLayer

__all__ = ["cache_keyword", "gated_norm", "layer_types_of", "l2norm", "plain_norms", "prompt_mlps", "prompt_kernels"]


def cache_keyword(forward, legacy: str = "past_key_values") -> str:
    """The keyword ``forward`` (a model's, a body's or a decoder layer's) takes its cache by:
    ``legacy`` (``past_key_values``, or Mamba2's ``cache_params``) where it names that parameter or
    has no ``cache`` one, else ``cache`` (transformers >= 5.24, where the legacy names still work
    but warn that they go in 5.40). It reads the signature: callers keep the answer."""
    params = inspect.signature(forward).parameters
    return legacy if legacy in params or "cache" not in params else "cache"


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """transformers' / flash-linear-attention's L2 norm of a delta-rule mixer's q or k over the last
    dim: ``x * rsqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_norm(norm, layer, y: torch.Tensor, gate: torch.Tensor, *, steps: bool = True) -> torch.Tensor:
    """``norm(y, gate)``, as one launch of :func:`specdec.kernels.norm.gated_rms_norm` where the
    module computes one of that kernel's arithmetics (:func:`~specdec.kernels.norm.gated_norm_form`)
    with its weight on y's device in y's dtype, and ``layer`` runs Triton kernels: a prompt layer
    whose conv does (:class:`~specdec.models.prompt_layer.PromptLayer`), or with ``steps`` a
    decode step's layer cache on the Triton backend. Else the module's own forward (inside a
    ``torch.compile`` trace too: Inductor fuses it there)."""
    prompt = isinstance(layer, PromptLayer)
    if not (prompt or steps) or torch.compiler.is_compiling():
        return norm(y, gate)
    if ((layer.conv_op if prompt else layer.op).backend == "triton" and norm.weight.dtype == y.dtype
            and norm.weight.device == y.device):
        form = gated_norm_form(norm, y.shape[-1])
        if form is not None:
            return gated_rms_norm(y, gate, norm.weight, norm.variance_epsilon, *form)
    return norm(y, gate)


def plain_norms(modules) -> list[tuple[torch.nn.Module, tuple[float, bool, bool]]]:
    """``(module, form)`` for each of ``modules`` (an iterable, e.g. ``model.modules()``) that
    :func:`~specdec.kernels.norm.rms_norm` computes (``form``: :func:`~specdec.kernels.norm.rms_norm_form`), in order."""
    return [(mod, form) for mod in modules if (form := rms_norm_form(mod)) is not None]


def _kernel_input(args, kwargs, weight: torch.Tensor) -> torch.Tensor | None:
    """The one positional input of a routed module's call when a prompt kernel takes it: a tensor
    in ``weight``'s dtype (one of :data:`~specdec.kernels.protocol.FLOAT_DTYPES`: fp64 keeps the
    module's forward) and device, outside a ``torch.compile`` trace; else None (the module's own
    forward runs)."""
    x = args[0] if len(args) == 1 and not kwargs else None
    if (not isinstance(x, torch.Tensor) or torch.compiler.is_compiling() or x.dtype not in FLOAT_DTYPES
            or x.dtype != weight.dtype or x.device != weight.device):
        return None
    return x


def _plain_norm_forward(form):
    def forward(mod, *args, **kwargs):
        x = _kernel_input(args, kwargs, mod.weight)
        if x is None:
            return type(mod).forward(mod, *args, **kwargs)
        return rms_norm(x, mod.weight, *form)

    return forward


def prompt_mlps(modules) -> list[tuple[torch.nn.Module, MLPPlan]]:
    """``(module, plan)`` for each of ``modules`` (an iterable, e.g. ``model.modules()``) that is an
    MLP whose forward :func:`~specdec.models.mlp.mlp_plan` recognises, in order. A plan holds the
    projection modules it read: make it anew before each routed block (a projection replaced, a
    hook added or a forward set on the instance since changes or withdraws it)."""
    return [(mod, plan) for mod in modules if (plan := mlp_plan(mod)) is not None]


def _mlp_forward(plan: MLPPlan):
    def forward(mod, *args, **kwargs):
        x = _kernel_input(args, kwargs, plan.up.weight)
        if x is None:
            return type(mod).forward(mod, *args, **kwargs)
        if plan.halves:  # one projection whose output's first half is the gate
            h = plan.up(x)
            n = h.shape[-1] // 2
            g, u = h[..., :n], h[..., n:]
        elif plan.gate is not None:
            g, u = plan.gate(x), plan.up(x)
        else:
            g, u = plan.up(x), None
        return plan.down(mlp_activation(g, u, plan.activation))

    return forward


@contextlib.contextmanager
def prompt_kernels(norms: list[tuple[torch.nn.Module, tuple[float, bool, bool]]],
                   mlps: list[tuple[torch.nn.Module, MLPPlan]] = ()):
    """Within the block, called from this thread with one positional input in its weight's dtype
    (fp32, bf16 or fp16) and device, each ``(module, form)`` of ``norms`` (:func:`plain_norms`)
    runs as one launch of :func:`~specdec.kernels.norm.rms_norm` instead of its ~8 element-wise
    kernels, and each ``(module, plan)`` of ``mlps`` (:func:`prompt_mlps`) as its projections with
    the activation (and a gated MLP's product) between them in one launch of
    :func:`~specdec.kernels.linear.mlp_activation` instead of two; any other call (other or keyword
    arguments, another dtype, inside a ``torch.compile`` trace) runs its class's forward. The
    caller decides the Triton backend applies; the modules' forwards are as they were after."""
    with contextlib.ExitStack() as stack:
        for mod, form in norms:
            stack.enter_context(routed_forward(mod, _plain_norm_forward(form)))
        for mod, plan in mlps:
            stack.enter_context(routed_forward(mod, _mlp_forward(plan)))
        yield


def layer_types_of(config) -> list[str]:
    """Per-layer attention type as transformers' ``DynamicCache`` infers it (``layer_types``, else
    ``sliding_attention`` everywhere when ``sliding_window`` is set, else ``full_attention``)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    n = config.num_hidden_layers
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n
