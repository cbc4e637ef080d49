"""Linear layer ``y = act(x @ weight.T + bias)`` and a gated MLP's first half
``act(x @ gate.T + b_g) * (x @ up.T + b_u)``, fp32 torch references.

The references compute in fp32 whatever the inputs' dtype (the skinny kernel accumulates in
fp32 too): ``x.float() @ weight.float().T + bias.float()``, then the activation in fp32 without
rounding in between.
"""

from __future__ import annotations

import torch

__all__ = ["ACTIVATIONS", "activation_ref", "linear_ref", "gated_linear_ref"]


#: the activations the kernels apply after a linear: SiLU (``x * sigmoid(x)``; Elfwing et al. 2017,
#: as transformers' ``"silu"``) and squared ReLU (``relu(x) ** 2``; So et al., "Primer", 2021, as
#: transformers' ``"relu2"``)
ACTIVATIONS = ("silu", "relu2")


def activation_ref(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``activation(y)`` in fp32 (None: ``y`` as fp32).

    Raises:
        ValueError: an activation not in :data:`ACTIVATIONS`.
    """
    y = y.float()
    if activation is None:
        return y
    if activation == "silu":
        return torch.nn.functional.silu(y)
    if activation == "relu2":
        return torch.relu(y).square()
    raise ValueError(f"activation must be one of {ACTIVATIONS} or None, got {activation!r}")


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str | None = None) -> torch.Tensor:
    """``activation(x @ weight.T + bias)`` in fp32.

    Args:
        x: ``[..., K]`` any float dtype. weight: ``[N, K]``. bias: ``[N]`` or None.
        activation: one of :data:`ACTIVATIONS`, or None.

    Returns:
        ``[..., N]`` fp32.
    """
    y = x.float() @ weight.float().T
    return activation_ref(y + bias.float() if bias is not None else y, activation)


def gated_linear_ref(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                     gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                     activation: str = "silu") -> torch.Tensor:
    """``activation(x @ gate_weight.T + gate_bias) * (x @ up_weight.T + up_bias)`` in fp32: the
    input of a gated MLP's down projection (SwiGLU for SiLU; Shazeer, "GLU Variants Improve
    Transformer", 2020).

    Args:
        x: ``[..., K]`` any float dtype. gate_weight, up_weight: ``[N, K]``. gate_bias, up_bias:
            ``[N]`` or None. activation: one of :data:`ACTIVATIONS`.

    Returns:
        ``[..., N]`` fp32.
    """
    return linear_ref(x, gate_weight, gate_bias, activation) * linear_ref(x, up_weight, up_bias)
