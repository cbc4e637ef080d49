"""CUDA graphs of prompt forwards: a prefill of a few short prompts costs its launches, not its tokens.

An eager prompt forward of a hybrid model launches thousands of kernels from Python (the
Mamba-2 mixers' scans, every norm and projection of every layer): on an H200 about 40 ms of
host time for Nemotron-H-4B's 52 layers whatever the prompt's length, against 10 ms of GPU work
for a 300-token prompt. Continuous batching prefills a few requests at a time, so it pays that
host time on every admission. :class:`PromptGraphs` captures the prompt forward once per shape
bucket (:func:`prompt_bucket`: rows rounded up to a power of two, width to the next of 32, 48,
64, 96, ...) and replays it.

A captured forward runs the model's own body on fixed buffers: the prompts left-padded to the
bucket's width (extra rows hold one token, so no attention row is fully masked), the attention
mask built on the device as the additive ``[B, 1, W, W]`` causal-and-padding mask, and the
mamba / linear-attention layers given the 2-D padding mask, both passed in the per-layer-type
dict the body accepts (as the decode steps pass theirs), so transformers builds no mask and
reads nothing back to the host. HF's cache is created inside the graph; its final states and
the final hidden states are copied into output buffers shared by every bucket, so a captured
bucket holds no memory of its own beyond its inputs (:meth:`PromptGraphs.run` returns views
of them: consume or copy them before the next prompt forward).

Left padding leaves every layer's state as the row's own tokens leave it (the prompt layers
and transformers' linear-attention code zero the padding's inputs; attention masks its
columns); the results equal an eager prefill of the same prompts up to the rounding of the
chunked scans at another chunk offset and of the masked attention kernel.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..graphs import CapturedProgram, _host_syncing_experts, capture_blocker

__all__ = ["PROMPT_GRAPH_ROWS", "PROMPT_GRAPH_TOKENS", "PromptGraphs", "prompt_bucket"]

#: the most rows of one captured prompt forward (its output buffers hold this many rows' states)
PROMPT_GRAPH_ROWS = 8
#: the most tokens, padding included, of one captured prompt forward: beyond about this many the
#: GPU's work outlasts the eager forward's host time and a graph gains little
PROMPT_GRAPH_TOKENS = 2048
#: the narrowest bucket
_MIN_WIDTH = 32
#: the tensors of a :class:`~specdec.prefix_cache.LayerState`, in order
_NAMES = ("keys", "values", "conv_state", "recurrent_state")


def prompt_bucket(rows: int, width: int, max_rows: int = PROMPT_GRAPH_ROWS,
                  max_tokens: int = PROMPT_GRAPH_TOKENS) -> tuple[int, int] | None:
    """The captured shape ``(rows, width)`` that holds ``rows`` prompts of at most ``width``
    tokens: rows rounded up to a power of two, the width to the next of 32, 48, 64, 96, 128, ...
    (``2^k`` and ``3 * 2^(k-1)``: at most a third of a bucket is padding beyond the longest
    prompt). None when the bucket has more than ``max_rows`` rows or ``max_tokens`` tokens."""
    if rows < 1 or width < 1:
        raise ValueError(f"a prompt bucket needs rows >= 1 and width >= 1, got {rows} and {width}")
    B = 1 << (rows - 1).bit_length()
    W = _MIN_WIDTH
    while W < width:
        W = W * 3 // 2 if W & (W - 1) == 0 else W // 3 * 4  # 32 -> 48 -> 64 -> 96 -> 128 ...
    if B > max_rows or B * W > max_tokens:
        return None
    return B, W


class _Outputs:
    """The output buffers every bucket's forward writes: the final hidden states (room for
    ``tokens`` positions) and each layer's state (keys / values for ``tokens`` columns, conv and
    recurrent state for ``rows`` rows), allocated from the first forward's shapes."""

    def __init__(self, hidden: torch.Tensor, states: dict, rows: int, tokens: int):
        self.hidden = torch.empty(tokens * hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        self.states = {}
        for idx, st in states.items():
            keys = None if st.keys is None else torch.empty(tokens * st.keys.shape[1] * st.keys.shape[3],
                                                            dtype=st.keys.dtype, device=st.keys.device)
            values = None if st.values is None else torch.empty(tokens * st.values.shape[1] * st.values.shape[3],
                                                                dtype=st.values.dtype, device=st.values.device)
            conv = None if st.conv_state is None else torch.empty(rows * st.conv_state[0].numel(),
                                                                  dtype=st.conv_state.dtype, device=st.conv_state.device)
            rec = None if st.recurrent_state is None else torch.empty(
                rows * st.recurrent_state[0].numel(), dtype=st.recurrent_state.dtype, device=st.recurrent_state.device)
            self.states[idx] = (keys, values, conv, rec)

    @staticmethod
    def _view(buf: torch.Tensor | None, shape) -> torch.Tensor | None:
        if buf is None:
            return None
        n = 1
        for s in shape:
            n *= s
        if n > buf.numel():
            raise RuntimeError(f"prompt graph output buffer too small: {tuple(shape)} needs {n} of {buf.numel()}")
        return buf[:n].view(shape)

    def views(self, hidden_shape, state_shapes: dict):
        """``(hidden [B, W, D], {idx: LayerState})`` views of the buffers at one bucket's shapes."""
        from ..prefix_cache import LayerState

        hidden = self._view(self.hidden, hidden_shape)
        states = {idx: LayerState(*(self._view(buf, shape) for buf, shape in zip(self.states[idx], shapes)))
                  for idx, shapes in state_shapes.items()}
        return hidden, states


class _Bucket:
    """One bucket's fixed inputs and its program (:class:`~specdec.graphs.CapturedProgram`)."""

    def __init__(self, owner: "PromptGraphs", B: int, W: int, scan: str, graphs: bool):
        dev = owner.adapter.device
        self.B, self.W = B, W
        self.ids = torch.zeros(B, W, dtype=torch.long, device=dev)
        self.mask = torch.zeros(B, W, dtype=torch.long, device=dev)
        self.shapes: dict | None = None  # each output's shape, from the first run
        self.program = CapturedProgram(lambda: owner._forward(self, scan), model=owner.adapter.model,
                                       what=f"the prompt forward of {B} x {W} tokens", graphs=graphs, fuse=False,
                                       pool=owner.pool() if graphs else None)


class PromptGraphs:
    """Prompt forwards of one adapter at bucketed shapes, captured as CUDA graphs (see the
    module docstring).

    Args:
        adapter: the :class:`~specdec.models.HybridAdapter` whose prompts run here.
        max_rows / max_tokens: the largest bucket (:func:`prompt_bucket`).

    ``counts`` holds how many forwards ran as a captured graph (``"cuda_graph"``) and eagerly at
    a bucket's shape (``"static"``: each bucket's first, its warm-up); ``error`` the first
    capture failure's reason (from then on no bucket is captured).
    """

    def __init__(self, adapter, max_rows: int = PROMPT_GRAPH_ROWS, max_tokens: int = PROMPT_GRAPH_TOKENS):
        self.adapter = adapter
        self.max_rows, self.max_tokens = int(max_rows), int(max_tokens)
        self._buckets: dict[tuple, _Bucket] = {}
        self._outputs: _Outputs | None = None
        self.counts = {"cuda_graph": 0, "static": 0}
        self.error: str | None = None
        self._pool = None
        self._blocker = self._why_not()

    def _why_not(self) -> str | None:
        """Why this adapter's prompts cannot run here, or None."""
        ad = self.adapter
        from .base import HybridAdapter

        if type(ad).step_attention_mask is not HybridAdapter.step_attention_mask:
            return "the family passes its body no per-layer-type mask dict"
        if ad.has_sliding_window():
            return "an attention layer keeps a sliding window (the prompt mask is the full causal one)"
        if _host_syncing_experts(ad.model):
            return "the model's experts implementation syncs with the host (and batched experts grow with tokens)"
        return None

    def pool(self):
        """The graph memory pool every bucket captures into: a bucket's temporaries are dead
        once its replay has copied its outputs out, so the buckets share them (the pool holds
        the largest bucket's, not their sum)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def available(self) -> str | None:
        """None when prompts can run here, else why not."""
        return self._blocker

    def bucket(self, rows: int, width: int) -> tuple[int, int] | None:
        """The bucket of ``rows`` prompts ``width`` wide, or None (too large, or not available)."""
        if self._blocker is not None:
            return None
        return prompt_bucket(rows, width, self.max_rows, self.max_tokens)

    def run(self, input_ids: torch.Tensor, mask: torch.Tensor, scan: str, graphs: bool, max_tokens: int | None = None):
        """The prompts ``input_ids [B, W]`` (int64, left-padded as ``mask [B, W]`` says) through
        the body at their bucket's shape, captured as a CUDA graph from the bucket's second use
        when ``graphs`` (CUDA, nothing blocking captures), else eagerly at that shape.

        Returns ``(hidden [B, W, D], {layer index: LayerState})``: the final hidden states and
        each layer's state (keys / values of the ``W`` columns), as an eager prefill leaves them;
        views of buffers the next call overwrites. None when no bucket holds these prompts
        (:meth:`bucket`) in at most ``max_tokens`` tokens (the caller's bound on one forward).
        """
        B, W = input_ids.shape
        key = self.bucket(B, W)
        if key is None or (max_tokens is not None and key[0] * key[1] > max_tokens):
            return None
        graphs = bool(graphs) and self.error is None and capture_blocker() is None and input_ids.is_cuda
        full = key + (scan, graphs)
        bucket = self._buckets.get(full)
        if bucket is None:
            bucket = self._buckets[full] = _Bucket(self, *key, scan, graphs)
        Bb, Wb = key
        bucket.ids.zero_()
        bucket.ids[:B, Wb - W:] = input_ids
        bucket.mask.zero_()
        bucket.mask[:B, Wb - W:] = mask
        bucket.mask[B:, -1] = 1  # rows beyond the prompts hold one token each
        how = bucket.program()
        if bucket.program.error is not None and self.error is None:
            self.error = bucket.program.error
        self.counts[how] += 1
        hidden, states = self._outputs.views(*bucket.shapes)
        from ..prefix_cache import LayerState

        def cut(t, dim):
            return None if t is None else t[:B].narrow(dim, Wb - W, W) if dim is not None else t[:B]

        states = {idx: LayerState(cut(st.keys, 2), cut(st.values, 2), cut(st.conv_state, None),
                                  cut(st.recurrent_state, None)) for idx, st in states.items()}
        return cut(hidden, 1), states

    def _forward(self, bucket: _Bucket, scan: str) -> None:
        """The program a bucket runs (and captures): the body on its buffers, outputs copied out."""
        ad = self.adapter
        B, W = bucket.B, bucket.W
        mask2d = bucket.mask
        dtype = ad.dtype
        real = mask2d.bool()
        causal = torch.ones(W, W, dtype=torch.bool, device=mask2d.device).tril_()
        visible = causal[None] & real[:, None, :]
        mask4d = torch.zeros(B, 1, W, W, dtype=dtype, device=mask2d.device).masked_fill_(
            ~visible[:, None], torch.finfo(dtype).min)
        positions = (mask2d.cumsum(-1) - 1).clamp_(min=0)
        hf_cache = DynamicCache(config=ad.config)
        hidden = ad._prompt_forward(bucket.ids, ad.prompt_mask_arg(mask4d, mask2d), positions, hf_cache, scan)
        states = ad._layer_states(hf_cache)
        if self._outputs is None:
            self._outputs = _Outputs(hidden, states, self.max_rows, self.max_tokens)
        if bucket.shapes is None:
            bucket.shapes = (tuple(hidden.shape), {idx: tuple(None if (t := getattr(st, n)) is None else tuple(t.shape)
                                                              for n in _NAMES) for idx, st in states.items()})
        out_hidden, out_states = self._outputs.views(*bucket.shapes)
        out_hidden.copy_(hidden)
        for idx, st in states.items():
            for n in _NAMES:
                if (src := getattr(st, n)) is not None:
                    getattr(out_states[idx], n).copy_(src)

