"""RMSNorms in one Triton launch: the gated norm after an SSM mixer's recurrence, and the plain
norms before each block of a prompt forward.

Every Mamba-2 family normalises the recurrence's output ``y`` gated by ``silu(gate)`` before its
output projection, by groups of ``group_size`` channels (one group: Mamba-2, Bamba, Granite-4;
``n_groups`` groups: Nemotron-H / Zamba2), as transformers' ``MambaRMSNormGated`` and
``Zamba2RMSNormGated`` compute it::

    h   = y * silu(gate)                                    (fp32)
    h   = h * rsqrt(mean(h^2 over each group) + eps)        (fp32)
    out = weight * round(h to y's dtype)                    (the product in the weight's / y's dtype)

The Gated DeltaNet families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid) gate after the norm,
over each head's channels, as their ``*RMSNormGated`` classes compute it (``gate_after``)::

    h   = y * rsqrt(mean(y^2) + eps)                        (fp32)
    p   = weight * round(h to y's dtype)                    (in y's dtype: rounded)
    out = round(p * silu(gate) to y's dtype)                (the product in fp32)

Kimi Delta Attention (Kimi-Linear's ``KimiLinearRMSNormGated``) gates after the norm too, by
``sigmoid(gate)``, in fp32 throughout with the weight cast to fp32 (``activation="sigmoid"``,
``rounded=False``)::

    h   = y * rsqrt(mean(y^2) + eps)                        (fp32)
    out = round(weight * h * sigmoid(gate) to y's dtype)    (fp32, left to right)

The decoder layers' plain RMSNorms come in three arithmetics (:func:`rms_norm_form`):
transformers' Llama-style ``weight * round(x * rsqrt(mean(x^2) + eps))`` (Mamba-2, Bamba,
Granite-4, Nemotron-H, Zamba2, Falcon-H1, LFM2, Kimi-Linear; ``rounded``), OLMo-hybrid's
``round(weight * x * rsqrt(...))`` (fp32 throughout) and the Qwen3-Next / Qwen3.5 zero-centred
``round(x * rsqrt(...) * (1 + weight))`` (``offset``, fp32 throughout). Eagerly each is ~8
element-wise launches over fp32 copies of the hidden states; a prompt forward on the Triton
backend runs them here in one (:func:`specdec.models.common.prompt_kernels`).

A Mamba-2 decode step and a Mamba-2, Gated DeltaNet or KDA prompt run the gated norm here. Compiled by Inductor
as part of the captured step, the module is two kernels (the groups' variance, then the
scaling); run eagerly over a prompt, it is ~8 element-wise launches over fp32 copies of ``y``.
Here one program owns one (token, group) and does all of it, reading ``gate`` where the input
projection wrote it. mamba_ssm's ``RMSNormGated`` is not installed here, and
flash-linear-attention's fused gated norm rounds otherwise (the product with the weight in
fp32), hence a kernel of our own. :func:`gated_rms_norm_reference` is the torch form (the
modules' arithmetic, line by line); :func:`gated_norm_form` says which modules it computes.
"""

from __future__ import annotations

import torch

__all__ = ["GATE_ACTIVATIONS", "check_activation", "gated_norm_form", "gated_rms_norm", "gated_rms_norm_reference",
           "rms_norm", "rms_norm_form", "rms_norm_reference"]

#: the gate activations the kernel computes
GATE_ACTIVATIONS = ("silu", "sigmoid")

#: the transformers classes whose forward is the gate-first arithmetic with one group of every channel
_ONE_GROUP = ("MambaRMSNormGated", "BambaRMSNormGated", "GraniteMoeHybridRMSNormGated")
#: ... and with ``group_size`` channels per group
_GROUPED = ("Zamba2RMSNormGated",)
#: the transformers classes whose forward is the ``gate_after`` arithmetic over every channel (with
#: ``activation == "silu"``)
_GATE_AFTER = ("Qwen3NextRMSNormGated", "Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated", "OlmoHybridRMSNormGated")
#: ... and the fp32 one gated by a sigmoid after the norm (with ``activation == "sigmoid"``)
_SIGMOID_AFTER = ("KimiLinearRMSNormGated",)
#: the transformers RMSNorm classes whose forward is ``weight * round(x * rsqrt(mean(x^2) + eps))``
#: (eps ``variance_epsilon``)
_PLAIN_ROUNDED = ("MambaRMSNorm", "Mamba2RMSNorm", "BambaRMSNorm", "GraniteMoeHybridRMSNorm", "NemotronHRMSNorm",
                  "Zamba2RMSNorm", "FalconH1RMSNorm", "Lfm2RMSNorm", "KimiLinearRMSNorm",
                  # and the attention-only families a draft model may come from
                  "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen3RMSNorm",
                  "Qwen3MoeRMSNorm", "Phi3RMSNorm", "GraniteRMSNorm")
#: ... whose forward is ``round(weight * x * rsqrt(mean(x^2) + eps))`` in fp32 (eps ``variance_epsilon``)
_PLAIN_FP32 = ("OlmoHybridRMSNorm", "Olmo2RMSNorm")
#: ... whose forward is ``round(x * rsqrt(mean(x^2) + eps) * (1 + weight))`` in fp32 (eps ``eps``)
_PLAIN_OFFSET = ("Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")


def check_activation(activation: str) -> None:
    """Raises ValueError unless ``activation`` is one of :data:`GATE_ACTIVATIONS`."""
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")


def gated_norm_form(norm: torch.nn.Module, channels: int) -> tuple[int, bool, str, bool] | None:
    """``(group_size, gate_after, activation, rounded)``, the arguments of :func:`gated_rms_norm`
    after ``eps``: how ``norm`` normalises ``channels`` channels when its class's forward is an
    arithmetic of this module (a class of transformers' own modeling code named in ``_ONE_GROUP``
    -- without a ``group_size`` of its own --, ``_GROUPED``, group size dividing ``channels``,
    ``_GATE_AFTER`` with a silu gate, or ``_SIGMOID_AFTER`` with a sigmoid gate); else None (the
    caller runs the module itself). A forward set on the instance is taken to compute its class's
    (specdec's compiled routing and accelerate's hooks do; tests/test_norms.py checks each
    class against the formula)."""
    cls = type(norm)
    if (cls.__name__ not in _ONE_GROUP + _GROUPED + _GATE_AFTER + _SIGMOID_AFTER
            or not cls.__module__.startswith("transformers.models.")):
        return None  # (e.g. a checkpoint's own modeling code of the same class name, grouped otherwise)
    activation = getattr(norm, "activation", None)
    if cls.__name__ in _GATE_AFTER:
        return (channels, True, "silu", True) if activation == "silu" else None
    if cls.__name__ in _SIGMOID_AFTER:
        return (channels, True, "sigmoid", False) if activation == "sigmoid" else None
    if cls.__name__ in _ONE_GROUP:
        return (channels, False, "silu", True) if not hasattr(norm, "group_size") else None
    size = int(getattr(norm, "group_size", 0))
    return (size, False, "silu", True) if size > 0 and channels % size == 0 else None


def gated_rms_norm_reference(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             group_size: int, gate_after: bool = False, activation: str = "silu",
                             rounded: bool = True) -> torch.Tensor:
    """The gated RMSNorm of ``y [..., D]`` by ``gate [..., D]`` over groups of ``group_size``
    channels, as transformers' ``MambaRMSNormGated`` / ``Zamba2RMSNormGated`` compute it, with
    ``gate_after`` as the Gated DeltaNet families' ``*RMSNormGated`` do, and with
    ``activation="sigmoid", rounded=False`` as ``KimiLinearRMSNormGated`` does (the formulas of
    the module docstring). Returns ``[..., D]`` in the dtype of ``weight * y`` (``gate_after`` or
    not ``rounded``: y's)."""
    check_activation(activation)
    act = torch.nn.functional.silu(gate.float()) if activation == "silu" else torch.sigmoid(gate.float())
    h = y.float() if gate_after else y.float() * act
    g = h.view(*h.shape[:-1], h.shape[-1] // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * g.view(h.shape).to(y.dtype) if rounded else weight.float() * g.view(h.shape)
    if gate_after:
        return (out * act).to(y.dtype)
    return out if rounded else out.to(y.dtype)


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                   gate_after: bool = False, activation: str = "silu", rounded: bool = True, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gated_rms_norm_reference` in one Triton launch.

    Args:
        y: ``[..., D]`` (fp32 / bf16 / fp16). gate: ``[..., D]``, any dtype. Read in place when
            their rows are contiguous in D at any row stride (e.g. the gate a slice of the input
            projection's output), else copied.
        weight: ``[D]``, y's dtype. eps: the module's ``variance_epsilon``.
        group_size: channels per group, dividing D. gate_after: the Gated DeltaNet order (gate
            after the norm) instead of the Mamba-2 one.
        activation: the gate's, ``"silu"`` or ``"sigmoid"``. rounded: round where the Mamba-2 and
            Gated DeltaNet modules round (else fp32 throughout, KDA's module).
        out: optional contiguous ``[..., D]`` output in y's dtype.

    Returns:
        ``[..., D]`` in y's dtype, contiguous.

    Raises:
        ValueError: shapes or dtypes that do not fit, a group size not dividing D, or another
            activation.
    """
    from .triton_norm import gated_rms_norm_triton  # lazy: the backend decides TRITON_INTERPRET first

    return gated_rms_norm_triton(y, gate, weight, eps, group_size, gate_after, activation, rounded, out=out)


def rms_norm_form(norm: torch.nn.Module) -> tuple[float, bool, bool] | None:
    """``(eps, offset, rounded)``, the arguments of :func:`rms_norm` after the weight, when the
    class of ``norm`` is one of transformers' own RMSNorms whose forward is one of that kernel's
    arithmetics (the module docstring); else None (the caller runs the module itself). A forward
    set on the instance is taken to compute its class's (specdec's routing and accelerate's hooks
    do; tests/test_norms.py checks each class against the formula)."""
    cls = type(norm)
    if not cls.__module__.startswith("transformers.models.") or not isinstance(getattr(norm, "weight", None),
                                                                                torch.Tensor):
        return None
    if cls.__name__ in _PLAIN_ROUNDED + _PLAIN_FP32:
        eps = getattr(norm, "variance_epsilon", None)
        return None if eps is None else (float(eps), False, cls.__name__ in _PLAIN_ROUNDED)
    if cls.__name__ in _PLAIN_OFFSET:
        eps = getattr(norm, "eps", None)
        return None if eps is None else (float(eps), True, False)
    return None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
                       rounded: bool = True) -> torch.Tensor:
    """The RMSNorm of ``x [..., D]`` over its last dim as transformers' RMSNorm classes compute it
    (the three arithmetics of the module docstring: ``rounded`` the Llama-style one, ``offset``
    the zero-centred one, neither OLMo-hybrid's). Returns ``[..., D]``: with ``rounded`` in the
    dtype of ``weight * x``, else in x's."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    if rounded:
        return weight * h.to(x.dtype)
    return (weight * h).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False, rounded: bool = True, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rms_norm_reference` in one Triton launch (one program per row of ``D``).

    Args:
        x: ``[..., D]`` (fp32 / bf16 / fp16), read in place when its rows are contiguous in D at
            any row stride, else copied. weight: ``[D]``, x's dtype. eps: the module's epsilon.
        offset: scale by ``1 + weight`` (zero-centred, fp32). rounded: round the normalised value
            to x's dtype before the product with the weight (ignored with ``offset``).
        out: optional contiguous ``[..., D]`` output in x's dtype.

    Returns:
        ``[..., D]`` in x's dtype, contiguous.

    Raises:
        ValueError: a weight not ``[D]`` or not in x's dtype, x not fp32 / bf16 / fp16, or an ``out``
            that does not fit.
    """
    from .triton_norm import rms_norm_triton  # lazy: the backend decides TRITON_INTERPRET first

    return rms_norm_triton(x, weight, eps, offset, rounded and not offset, out=out)
