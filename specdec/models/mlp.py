"""Which MLP blocks a decode step may run as two skinny launches: :func:`mlp_plan`.

A transformer MLP at decode time is ``down(act(gate(x)) * up(x))`` (a gated MLP: SwiGLU for SiLU;
Shazeer, "GLU Variants Improve Transformer", 2020) or ``down(act(up(x)))`` (e.g. Nemotron-H's
squared ReLU). Eagerly (or compiled, with the projections as opaque kernels) that is four or
five launches: the projections, the activation (and the product), the down projection.
:func:`specdec.kernels.linear.mlp_hidden` computes everything before the down projection in one
launch of the skinny kernel with its activation epilogue; :func:`specdec.fusion.fused` routes
the MLPs :func:`mlp_plan` recognises through it while the CUDA-graph decode path captures.

An MLP is recognised by what its ``forward`` computes, read from its source: it must be one of
:data:`MLP_FORWARDS` (the forms transformers' own MLP classes use, e.g. Qwen3.5's, Llama's,
Nemotron-H's, Phi-3's fused gate-up projection), with its projections plain ``nn.Linear``
modules without hooks and its activation one the kernel computes (:data:`ACTIVATION_CLASSES`).
A class whose forward differs in any way (a multiplier, an adapter, dropout) is left to its own
forward, as is any class whose source cannot be read.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch.nn as nn

from ..placement import unhooked

__all__ = ["MLP_FORWARDS", "ACTIVATION_CLASSES", "MLPPlan", "mlp_plan"]

#: a forward's source (stripped lines, comments and blank lines dropped) -> (gate, up, down, activation)
#: attribute names: gate None for ``down(act(up(x)))``; gate "" for a fused gate-up projection
#: whose output's first half is the gate (``up`` names it); activation "silu" where the forward
#: calls ``F.silu`` itself, else the attribute holding the activation module
MLP_FORWARDS: dict[str, tuple[str | None, str, str, str]] = {
    # Llama, Qwen2/3, Qwen3.5 (+ MoE shared experts), Qwen3-Next, Bamba, Jamba, Kimi Linear, Olmo-Hybrid, ...
    "def forward(self, x):\n"
    "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n"
    "return down_proj": ("gate_proj", "up_proj", "down_proj", "act_fn"),
    # Nemotron-H, Nemotron, Arcee, Apertus
    "def forward(self, x):\n"
    "return self.down_proj(self.act_fn(self.up_proj(x)))": (None, "up_proj", "down_proj", "act_fn"),
    # LFM2
    "def forward(self, x):\n"
    "return self.w2(F.silu(self.w1(x)) * self.w3(x))": ("w1", "w3", "w2", "silu"),
    # Phi-3, GLM
    "def forward(self, hidden_states: torch.FloatTensor) -> torch.FloatTensor:\n"
    "up_states = self.gate_up_proj(hidden_states)\n"
    "gate, up_states = up_states.chunk(2, dim=-1)\n"
    "up_states = up_states * self.activation_fn(gate)\n"
    "return self.down_proj(up_states)": ("", "gate_up_proj", "down_proj", "activation_fn"),
    # Granite-4 hybrids
    "def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:\n"
    "hidden_states = self.input_linear(hidden_states)\n"
    "chunked_hidden_states = hidden_states.chunk(2, dim=-1)\n"
    "hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1]\n"
    "hidden_states = self.output_linear(hidden_states)\n"
    "return hidden_states": ("", "input_linear", "output_linear", "activation"),
}


def _activation_classes() -> dict[type, str]:
    import transformers.activations as act

    return {nn.SiLU: "silu", act.SiLUActivation: "silu", act.ReLUSquaredActivation: "relu2"}


#: activation modules (exactly these classes) -> the kernel's name for what they compute
#: (:data:`specdec.kernels.linear.ACTIVATIONS`)
ACTIVATION_CLASSES = _activation_classes()


@dataclass(frozen=True)
class MLPPlan:
    """How to run one MLP module's step: ``down(act(gate(x)) * up(x))``, ``down(act(up(x)))``
    (``gate`` None) or, ``halves``, ``down(act(first half of up(x)) * second half)``."""

    gate: nn.Linear | None
    up: nn.Linear
    down: nn.Linear
    activation: str
    halves: bool = False


@functools.lru_cache(maxsize=None)
def _form_of(forward) -> tuple | None:
    """The :data:`MLP_FORWARDS` entry of a class's ``forward`` function by its source, or None (also
    for a wrapper: ``inspect`` would read the wrapped function's source, not the wrapper's)."""
    if inspect.unwrap(forward) is not forward:
        return None
    try:
        src = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    lines = [line.strip() for line in src.splitlines()]
    return MLP_FORWARDS.get("\n".join(line for line in lines if line and not line.startswith("#")))


def _unhooked(module) -> bool:
    """No forward replaced on the instance, and :func:`specdec.placement.unhooked`."""
    return "forward" not in vars(module) and unhooked(module)


def _plain(linear) -> bool:
    return type(linear) is nn.Linear and _unhooked(linear)


def mlp_plan(module: nn.Module) -> MLPPlan | None:
    """``module``'s :class:`MLPPlan`, or None where its step must run its own forward: a forward
    not among :data:`MLP_FORWARDS` (or replaced on the instance, or hooked other than by
    :func:`specdec.residual.deferred_residuals`), projections that are
    not plain ``nn.Linear`` modules (subclasses, forward hooks, accelerate's hooks), an activation
    not in :data:`ACTIVATION_CLASSES` (or hooked, or its forward replaced on the instance), a fused
    gate-up projection of odd width, gate and up projections that differ in width, dtype, device
    or having a bias, or global module hooks (``register_module_forward_hook``: they would not see
    the projections the launch replaces)."""
    from torch.nn.modules import module as nn_module

    if not _unhooked(module):
        return None
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:  # (they would not see the projections)
        return None
    form = _form_of(type(module).forward)
    if form is None:
        return None
    gate_name, up_name, down_name, act_name = form
    up, down = getattr(module, up_name, None), getattr(module, down_name, None)
    gate = getattr(module, gate_name, None) if gate_name else None
    if not (_plain(up) and _plain(down) and (gate_name in (None, "") or _plain(gate))):
        return None
    if act_name == "silu":
        activation = "silu"
    else:
        act = getattr(module, act_name, None)
        activation = ACTIVATION_CLASSES.get(type(act))
        if activation is None or not _unhooked(act):
            return None
    if gate_name == "" and up.out_features % 2:
        return None
    if gate is not None and gate.out_features != up.out_features:
        return None
    if gate is not None and (gate.weight.dtype, gate.weight.device, gate.bias is None) != \
            (up.weight.dtype, up.weight.device, up.bias is None):
        return None
    return MLPPlan(gate=gate, up=up, down=down, activation=activation, halves=gate_name == "")

