"""What an SSM mixer's ``mixer_forward`` runs against during prefill, in place of its layer
cache: a :class:`PromptLayer` (the families' subclasses are :data:`specdec.models.base.PROMPT_LAYERS`).

A prompt layer computes a whole prompt's conv and recurrence as transformers' prefill of that
mixer does and leaves in HF's cache layer ``mixer.layer_idx`` the conv window and recurrent
state that prefill leaves, so the same ``mixer_forward`` serves a decode step (against a
:class:`~specdec.cache.SSMLayerCache`) and a prompt. What it adds to HF's prefill is
state-neutral left padding: a row's padding changes neither its conv window nor its recurrent
state, so the rows of one batch may continue from different states (a prefix cache's hits,
:meth:`specdec.models.HybridAdapter.batches_cached_prefill`). This base class holds what every
prompt layer shares: the padding mask and the prompt's causal depthwise conv.
"""

from __future__ import annotations

import importlib
import inspect
import sys

import torch
from transformers.models.mamba2.modeling_mamba2 import apply_mask_to_padding_states

from ..kernels import conv1d_op
from ..placement import execution_device

__all__ = ["DeltaRulePromptLayer", "PromptLayer"]


class PromptLayer:
    """The prompt's conv and HF's cache layer of one SSM mixer during prefill; subclasses add the
    recurrence (``ssm``). When that layer already holds a state (``has_previous_state``: a prompt
    continued from a cached prefix, as HF's mixers continue a multi-token prefill) the conv
    starts from its conv window and the recurrence from its recurrent state; otherwise both
    start from zeros.

    Args:
        mixer: the HF mixer (its ``layer_idx`` is used).
        cache_params: HF's cache for this prefill (a ``DynamicCache`` with linear-attention layers).
        attention_mask: the 2-D left-padding mask ``[B, L]`` (1 = token) of the prompt's columns,
            or None (no padding).
        scan: how the subclass runs the recurrence (``"fla"`` or ``"torch"``:
            :func:`specdec.kernels.mamba2.chunked.resolve_scan`).
    """

    #: left padding leaves the conv window and recurrent state as the row's tokens alone leave them
    state_neutral_padding = True

    @classmethod
    def serves(cls, mixer, scan: str) -> bool:
        """Whether this layer can run ``mixer``'s prefill with ``scan`` (else that mixer keeps
        transformers' own forward, and its padding is not state-neutral)."""
        return True

    def __init__(self, mixer, cache_params, attention_mask: torch.Tensor | None, scan: str):
        self.layer_idx = mixer.layer_idx
        self.cache_params = cache_params
        self.attention_mask = attention_mask
        self.scan = scan
        self.conv_op = conv1d_op(execution_device(mixer))
        self.continued = cache_params.has_previous_state(self.layer_idx)

    def mask_padding(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [B, L, D]`` with padding positions zeroed (HF's ``apply_mask_to_padding_states``)."""
        return apply_mask_to_padding_states(hidden_states, self.attention_mask)

    def at_tokens(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``x [B, L, ...]`` with its padding positions set to ``fill`` (unchanged without padding)."""
        if self.attention_mask is None:
            return x
        real = self.attention_mask.bool().reshape(*self.attention_mask.shape, *(1,) * (x.dim() - 2))
        return torch.where(real, x, fill)

    def initial_state(self) -> torch.Tensor | None:
        """HF's recurrent state of this layer for a continued prompt, else None (zeros)."""
        return self.cache_params.layers[self.layer_idx].recurrent_states[0] if self.continued else None

    def store_state(self, state: torch.Tensor) -> None:
        """Leave the prompt's final recurrent ``state`` (``[B, H, P, N]`` for Mamba-2, ``[B, H, K,
        V]`` for a delta rule; fp32) in HF's cache layer.

        A layer that holds none yet (a prompt from scratch) takes the tensor itself, where HF's
        ``update_recurrent_state`` would allocate zeros of its size and copy it in. A view into a
        larger buffer (the torch scan's per-chunk states) is copied out once, so the buffer is not
        kept alive. A layer holding a state (a continued prompt, or one restored before a
        captured prompt graph runs), or a cache layer of another layout, gets HF's update: the
        state copied in."""
        layer = self.cache_params.layers[self.layer_idx]
        fresh = getattr(layer, "is_recurrent_states_initialized", {}).get(0) is False
        if fresh and isinstance(getattr(layer, "recurrent_states", None), dict):
            own = state.is_contiguous() and state.untyped_storage().nbytes() == state.numel() * state.element_size()
            layer.recurrent_states[0] = state if own else state.clone(memory_format=torch.contiguous_format)
            layer.is_recurrent_states_initialized[0] = True
        else:
            self.cache_params.update_recurrent_state(state, self.layer_idx)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
        """Causal depthwise conv of the prompt ``x [B, L, C]`` (weight ``[C, W]``) from HF's conv
        window (a continued prompt) or a zero history -> ``[B, L, C]`` in ``x.dtype``, padding
        zeroed; each row's last ``W`` inputs (its tokens', then its history's, then zeros) become
        HF's conv state. Computed in the prompt's own layout, in fp32
        (:meth:`specdec.kernels.conv1d.Conv1dOp.prompt`). With left padding each row's history
        is placed right before its first token, the padding's inputs taken as zeros."""
        W = weight.shape[-1]
        history = None
        if self.continued and W > 1:  # the W-1 inputs before the prompt, [B, W-1, C]
            history = self.cache_params.layers[self.layer_idx].conv_states[0][:, :, 1 - W:].transpose(1, 2)
        real = self.attention_mask is not None
        x = self.at_tokens(x)  # padding's inputs are zeros
        if real and history is not None:  # each row's history right before its first token
            B, L, C = x.shape
            u = x.new_zeros(B, W - 1 + L, C)  # [zeros, history, tokens] per row, right-aligned
            u[:, W - 1:] = x
            first = (L - self.attention_mask.sum(-1)).to(x.device)  # each row's first token's column
            cols = first[:, None] + torch.arange(W - 1, device=x.device)  # its history's columns in u
            u.scatter_(1, cols[:, :, None].expand(B, W - 1, C), history.to(u.dtype))
            x, history = u[:, W - 1:], u[:, :W - 1]
            last = u[:, -W:]
        else:
            last = x[:, -W:]
        out = self.conv_op.prompt(x, weight, bias, activation, history)  # before the state update: history may be a view
        self.cache_params.update_conv_state(last.transpose(1, 2), self.layer_idx, conv_kernel_size=W)
        return self.at_tokens(out)


class DeltaRulePromptLayer(PromptLayer):
    """A delta-rule mixer's prompt layer (Gated DeltaNet, Kimi Delta Attention): after the conv
    over q | k | v (:class:`PromptLayer`), the chunked (gated) delta rule over the prompt from
    HF's recurrent state of a continued prompt, or zeros, the final state written into HF's
    cache layer. A subclass names the two implementations of its rule: ``fla_rule`` (module,
    function) of flash-linear-attention (``scan="fla"``) and ``torch_rule``, transformers' torch
    reference of it in the mixer's own modeling module (``"torch"``; unwrapped from the
    dispatch that transformers' forward goes through, which picks fla's when it is installed).

    ``ssm`` takes the step's fp32 inputs (q and k L2-normalised, q scaled by ``1/sqrt(d_k)``, per
    value head; the decay ``g`` in log space, per head or per channel) and runs the rule on them:
    fla's with ``scale=1`` and its operands in a bf16 / fp16 model's dtype (the decay in fp32);
    transformers' reference scales q itself, so it is handed q times ``sqrt(d_k)``. fla's rule
    also takes q and k as the conv leaves them (:attr:`takes_raw_qk`; the Gated DeltaNet, OLMo-hybrid
    and KDA mixers hand them so) and normalises them itself. transformers'
    prefill calls the same functions on the same inputs, normalising q and k inside them; the
    conv here is computed in fp32 with one rounding to the model dtype (HF's torch conv rounds
    before its activation). In fp32 the two agree to rounding.

    Left padding is state-neutral (:attr:`state_neutral_padding`): padding positions get
    ``g = 0`` (no decay) and ``beta = 0`` (no write), so the recurrent state passes them
    unchanged, and the conv places each row's history right before its first token.
    transformers' prefill decays a continued state over its padding (and, where the conv has a
    bias, writes the padding into it); from a zero state and without a conv bias the two agree.

    Args: as :class:`PromptLayer`. A mixer whose modeling module has no ``torch_rule`` (remote
        code, another transformers release) is not served with ``scan="torch"`` (:meth:`serves`):
        it keeps transformers' own forward.
    """

    #: transformers' torch reference of the chunked rule, by its name in the mixer's modeling module
    torch_rule: str = ""
    #: flash-linear-attention's chunked rule: (module, function)
    fla_rule: tuple[str, str] = ("", "")

    @classmethod
    def _torch_rule_of(cls, mixer):
        return getattr(sys.modules.get(type(mixer).__module__), cls.torch_rule, None)

    @classmethod
    def serves(cls, mixer, scan: str) -> bool:
        return scan == "fla" or cls._torch_rule_of(mixer) is not None

    def __init__(self, mixer, cache_params, attention_mask: torch.Tensor | None, scan: str):
        super().__init__(mixer, cache_params, attention_mask, scan)
        if scan == "fla":
            self._rule = getattr(importlib.import_module(self.fla_rule[0]), self.fla_rule[1])
            dtype = mixer.conv1d.weight.dtype  # (not A_log's or dt_bias's: checkpoints may keep those in fp32)
            self._operand_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        else:  # the torch reference, not the kernel transformers' dispatch picks when fla is found
            self._rule = inspect.unwrap(self._torch_rule_of(mixer))

    @property
    def takes_raw_qk(self) -> bool:
        """Whether :meth:`ssm` takes q and k as the conv leaves them (``params["raw_qk"]``): one per
        key head, not normalised. fla's rule (``scan="fla"``) L2-normalises them in its kernel,
        scales q by ``1/sqrt(d_k)`` and reads each key head's for its group of value heads (GVA),
        as transformers' prefill has it normalise them: no fp32 copies of q and k repeated per
        value head. Off with ``SPECDEC_PROMPT_KERNELS=0`` (:func:`~specdec.fusion.prompt_kernels_enabled`)."""
        from ..fusion import prompt_kernels_enabled

        return self.scan == "fla" and prompt_kernels_enabled()

    def ssm(self, inputs: dict, params: dict) -> torch.Tensor:
        """The prompt's outputs ``o [B, L, H, V]`` from ``inputs`` q, k ``[B, L, H, K]``, v ``[B,
        L, H, V]``, g ``[B, L, H]`` or ``[B, L, H, K]``, beta ``[B, L, H]`` (fp32), in
        ``params["y_dtype"]`` (default: what the rule returns); the final state ``[B, H, K, V]``
        fp32 goes to HF's cache. With ``params["raw_qk"]`` (where :attr:`takes_raw_qk`), q and k
        are ``[B, L, Hk, K]`` for ``Hk`` key heads dividing ``H``, not normalised, in any float
        dtype.

        Raises:
            ValueError: ``raw_qk`` inputs where the rule does not take them.
        """
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        raw_qk = bool(params.get("raw_qk", False))
        if raw_qk and not self.takes_raw_qk:
            raise ValueError(f"the {self.scan!r} rule takes q and k normalised per value head, not as the conv leaves them")
        g, beta = self.at_tokens(inputs["g"]), self.at_tokens(inputs["beta"])  # padding: no decay, no write
        h0 = self.initial_state()
        h0 = None if h0 is None else h0.float()
        if self.scan == "fla":
            dt = self._operand_dtype
            o, state = self._rule(q.to(dt), k.to(dt), v.to(dt), g.float(), beta.to(dt),
                                  scale=q.shape[-1] ** -0.5 if raw_qk else 1.0, initial_state=h0,
                                  output_final_state=True, use_qk_l2norm_in_kernel=raw_qk)
        else:
            o, state = self._rule(q * q.shape[-1] ** 0.5, k, v, g=g, beta=beta, initial_state=h0,
                                  output_final_state=True, use_qk_l2norm_in_kernel=False)
        self.store_state(state.float())
        return o.to(params.get("y_dtype", o.dtype))
