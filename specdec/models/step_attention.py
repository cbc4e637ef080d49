"""Attention of a decode / verify step with grouped-query heads, without copying the KV cache per
query head.

A step reads the whole KV cache (in static mode every column of the pool's span) under an
additive mask ``[B, 1, t, L]``. transformers' ``sdpa`` attention then repeats the keys and values
of every KV head for each of its query heads (``repeat_kv``: ``torch.nn.functional.scaled_dot_product_attention``
accepts ``enable_gqa`` only without a mask), so a layer of ``H`` query heads over ``H_kv`` KV
heads copies ``2 * B * H * L * D`` cache elements per step; with a 2,560-column pool that copy
outweighs the attention itself.

:func:`grouped_step_attention` folds each KV head's ``R = H / H_kv`` query heads into the query
length instead (the multi-query form of grouped-query attention, as decoding kernels such as
FlashDecoding order it): ``q [B, H, t, D] -> [B, H_kv, R t, D]`` and the mask's rows repeated
``R`` times, so one SDPA call reads each cached key once. Every query row keeps its own softmax
over the same keys under the same mask, so the result is the same attention (up to the kernel's
rounding for another query count). :meth:`HybridAdapter.forward
<specdec.models.base.HybridAdapter.forward>` routes the step's attention layers through it when
the model runs transformers' ``sdpa`` (:func:`grouped_step_attention_for`); prefill keeps
transformers' own path.

:func:`sdpa_without_cudnn` picks the SDPA kernels of attention whose shapes change from call to
call: a prompt's forward (prompts come in every length) and a step over a growing KV cache (the
eager path reads one more column each step). torch (2.5 and later) tries cuDNN's attention first
on Hopper and newer GPUs when a mask is given, and cuDNN builds an execution plan for every new
shape it meets: on an H200 each attention call of a prefill spent 13-21 ms of host time building
its plan (four attention layers: 54-84 ms a masked forward, whatever the prompt's length). Without
cuDNN, torch runs FlashAttention (no mask) or its memory-efficient kernel (a mask), which need no
plan. A static cache's steps (the static and CUDA-graph paths) keep one shape per bucket and
torch's own choice.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..fusion import env_switch
from ..kernels import backend
from ..kernels.attention import step_attention, step_attention_fits

__all__ = ["GROUPED_STEP_ATTENTION", "SDPA_BACKENDS_WITHOUT_CUDNN", "sdpa_without_cudnn", "grouped_step_attention", "grouped_step_attention_for", "grouped_attention_configs"]

#: the name :func:`grouped_step_attention` is registered under in transformers' ``AttentionInterface``
GROUPED_STEP_ATTENTION = "specdec_grouped_sdpa"
#: the SDPA backends :func:`sdpa_without_cudnn` allows on CUDA, in torch's order of preference: all but cuDNN's
SDPA_BACKENDS_WITHOUT_CUDNN = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


#: the blocks of :func:`sdpa_without_cudnn` open now, across threads, and the flags' context of
#: the first of them (restored when the last one closes), under the lock
_NO_CUDNN = {"open": 0, "flags": None}
_NO_CUDNN_LOCK = threading.Lock()


@contextlib.contextmanager
def sdpa_without_cudnn(device):
    """Within the block, ``scaled_dot_product_attention`` on CUDA uses only
    :data:`SDPA_BACKENDS_WITHOUT_CUDNN` (see the module docstring: no per-shape cuDNN plans); on other
    devices nothing changes. torch keeps the allowed backends in process-wide flags
    (:func:`torch.nn.attention.sdpa_kernel`), so attention run by another thread inside the block
    is held to them too. Blocks of several threads may overlap in any order: the first to open
    sets the flags, the last to close restores them as they were before the first (each block
    restoring its own entry's flags would leave cuDNN off for good when two overlap)."""
    if torch.device(device).type != "cuda":
        yield
        return
    with _NO_CUDNN_LOCK:
        if _NO_CUDNN["open"] == 0:
            flags = sdpa_kernel(list(SDPA_BACKENDS_WITHOUT_CUDNN))
            flags.__enter__()
            _NO_CUDNN["flags"] = flags
        _NO_CUDNN["open"] += 1
    try:
        yield
    finally:
        with _NO_CUDNN_LOCK:
            _NO_CUDNN["open"] -= 1
            if _NO_CUDNN["open"] == 0:
                flags, _NO_CUDNN["flags"] = _NO_CUDNN["flags"], None
                flags.__exit__(None, None, None)


def grouped_step_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, t, D]``, ``key`` / ``value [B,
    H_kv, L, D]`` (any float dtype), ``attention_mask`` additive or boolean, ``[B, 1, t, L]``.
    Returns ``(output [B, t, H, D], None)`` as ``sdpa_attention_forward`` does.

    With a mask of one head row, ``H_kv < H`` and no position bias, the query heads of each KV
    head are folded into the query length (see the module docstring); anything else goes to
    transformers' ``sdpa_attention_forward`` unchanged."""
    B, H, t, D = query.shape
    Hkv = key.shape[1]
    folds = (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
             and Hkv < H and H % Hkv == 0 and kwargs.get("position_bias") is None
             and not kwargs.get("output_attentions", False) and value.shape[1] == Hkv)
    if not folds:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout == 0.0 and _kernel_takes(query, key, value, attention_mask):
        return step_attention(query, key, value, attention_mask, scaling, backend_name="triton"), None
    R, L, Dv = H // Hkv, key.shape[2], value.shape[-1]
    q = query.reshape(B, Hkv, R * t, D)  # query head h = j R + r (repeat_kv's order) -> KV head j, rows r t ...
    mask = attention_mask.expand(B, 1, t, L)[:, :, None].expand(B, 1, R, t, L).reshape(B, 1, R * t, L)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(B, H, t, Dv).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_STEP_ATTENTION, grouped_step_attention)


def step_attention_kernel_enabled() -> bool:
    """Whether :func:`grouped_step_attention` runs :func:`specdec.kernels.attention.step_attention`
    on the Triton backend (``SPECDEC_STEP_ATTENTION_KERNEL``, default on; ``0``: SDPA)."""
    return env_switch("SPECDEC_STEP_ATTENTION_KERNEL")


def _kernel_takes(query, key, value, mask) -> bool:
    """The step-attention kernel for this call: switched on, the Triton backend for the device, not
    inside a whole-program ``torch.compile`` (which traces SDPA instead), tensors it takes."""
    return (step_attention_kernel_enabled() and not torch.compiler.is_compiling()
            and backend(query.device) == "triton" and step_attention_fits(query, key, value, mask))


def grouped_step_attention_for(configs) -> contextlib.AbstractContextManager:
    """A context in which this thread's calls of transformers' ``sdpa`` attention run
    :func:`grouped_step_attention` (a no-op unless one of ``configs``, from
    :func:`grouped_attention_configs`, runs ``sdpa``).

    The configs are left as they are (another thread's forward of the same model builds its masks
    and runs its attention as it would without specdec): while any thread is inside such a block,
    ``AttentionInterface``'s ``"sdpa"`` entry is a router that sends the calls of threads inside
    a block (and of a ``torch.compile`` trace, which only such a thread runs) to
    :func:`grouped_step_attention`, and every other call to the function it replaced."""
    if not any(getattr(cfg, "_attn_implementation_internal", None) == "sdpa" for cfg in configs):
        return contextlib.nullcontext()
    return _routed_sdpa()


_ROUTED_HERE = threading.local()  # .depth: grouped_step_attention_for blocks open in this thread
_ROUTED_LOCK = threading.Lock()
_ROUTED = [None, 0]  # the "sdpa" entry the router replaced, blocks open over all threads


def _sdpa_router(module, query, key, value, attention_mask, **kwargs):
    if torch.compiler.is_compiling() or getattr(_ROUTED_HERE, "depth", 0):
        return grouped_step_attention(module, query, key, value, attention_mask, **kwargs)
    return _ROUTED[0](module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def _routed_sdpa():
    mapping = AttentionInterface._global_mapping
    with _ROUTED_LOCK:
        if _ROUTED[1] == 0:
            _ROUTED[0] = mapping["sdpa"]
            mapping["sdpa"] = _sdpa_router
        _ROUTED[1] += 1
    _ROUTED_HERE.depth = getattr(_ROUTED_HERE, "depth", 0) + 1
    try:
        yield
    finally:
        _ROUTED_HERE.depth -= 1
        with _ROUTED_LOCK:
            _ROUTED[1] -= 1
            if _ROUTED[1] == 0 and mapping.get("sdpa") is _sdpa_router:  # (not if "sdpa" was registered anew)
                mapping["sdpa"] = _ROUTED[0]


def grouped_attention_configs(model) -> list:
    """The configs of ``model``'s grouped-query attention layers (``num_key_value_groups > 1``), one
    per config object."""
    return list({id(m.config): m.config for m in model.modules()
                 if getattr(m, "num_key_value_groups", 1) > 1 and hasattr(m, "config")}.values())
