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
reads nothing back to the host. HF's cache is created inside the graph (loaded, for a prompt
continued from a prefix cache's hit, from the restored states: their keys / values left-padded
to a bucketed prefix width too); its final states, the forward's new keys / values and the
final hidden states are copied (one ``_foreach_copy_``) into buffers shared by every bucket, so a
captured bucket holds no memory of its own beyond its small token inputs (:meth:`PromptGraphs.run`
returns views of them, or copies: consume views before the next prompt forward). The layers'
outputs of one kind and shape sit stacked in one buffer (:class:`_Group`), so returning them costs
a few ops per kind, not a slice and a clone per layer and tensor.

Left padding leaves every layer's state as the row's own tokens leave it from a zero state (the
prompt layers and transformers' linear-attention code zero the padding's inputs; attention
masks its columns), and from a restored state where the SSM layers' padding is state-neutral
(:meth:`~specdec.models.HybridAdapter.batches_cached_prefill`); the results equal an eager prefill of the same prompts up to the rounding of the
chunked scans at another chunk offset and of the masked attention kernel.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..graphs import CapturedProgram, _host_syncing_experts, bucket_width, capture_blocker

__all__ = ["PROMPT_GRAPH_COLUMNS", "PROMPT_GRAPH_ROWS", "PROMPT_GRAPH_TOKENS", "PromptGraphs", "prompt_bucket"]

#: the most rows of one captured prompt forward (the shared buffers hold this many rows' states)
PROMPT_GRAPH_ROWS = 8
#: the most new tokens, padding included, of one captured prompt forward: beyond about this many
#: the GPU's work outlasts the eager forward's host time and a graph gains little
PROMPT_GRAPH_TOKENS = 2048
#: the most attention columns (restored prefix and new tokens, padding included, x rows) of one
#: captured prompt forward: four rows of a 1,024-token cached prefix and ~1,000 new tokens each.
#: The shared key/value buffers hold this many columns per attention layer, allocated at a model's
#: first bucket (Nemotron-H shape, 4 attention layers of 8 x 128 bf16 keys and values: 128 MiB, and
#: as much again for the restored prefixes of a prefix cache's continued forwards)
PROMPT_GRAPH_COLUMNS = 8192
#: the tensors of a :class:`~specdec.prefix_cache.LayerState`, in order
_NAMES = ("keys", "values", "conv_state", "recurrent_state")


def prompt_bucket(rows: int, width: int, max_rows: int = PROMPT_GRAPH_ROWS,
                  max_tokens: int = PROMPT_GRAPH_TOKENS) -> tuple[int, int] | None:
    """The captured shape ``(rows, width)`` that holds ``rows`` prompts of at most ``width``
    tokens: rows rounded up to a power of two, the width by :func:`bucket_width`. None when the
    bucket has more than ``max_rows`` rows or ``max_tokens`` tokens."""
    if rows < 1 or width < 1:
        raise ValueError(f"a prompt bucket needs rows >= 1 and width >= 1, got {rows} and {width}")
    B, W = 1 << (rows - 1).bit_length(), bucket_width(width)
    if B > max_rows or B * W > max_tokens:
        return None
    return B, W


class _Arena:
    """Flat buffers shared by every bucket, each allocated once, at its capacity, on the first
    (eager) run that needs it, and viewed at each bucket's shapes."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def view(self, name: str, shape, dtype, device, capacity: int) -> torch.Tensor:
        """Buffer ``name`` (``capacity`` elements) as a contiguous ``shape`` tensor."""
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.empty(capacity, dtype=dtype, device=device)
        n = math.prod(shape)
        if n > buf.numel():
            raise RuntimeError(f"prompt graph buffer {name} holds {buf.numel()} elements, {tuple(shape)} needs {n}")
        return buf[:n].view(tuple(shape))


@dataclasses.dataclass(frozen=True)
class _Group:
    """Same-shaped outputs of several layers stacked in one shared buffer: ``data [m, B, ...]``
    holds ``members[i] = (layer index, LayerState field)`` at ``i``; ``columns``: the outputs
    are keys / values (``[m, B, H, C, D]``, columns on axis 3)."""

    members: tuple[tuple[int, str], ...]
    data: torch.Tensor
    columns: bool


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """A bucket's output buffers, viewed at its shapes: ``hidden [B, T, D]``, the attention
    layers' keys / values of the new columns (``new_kv``) and every layer's final state
    (``states``), each kind in :class:`_Group` s; ``targets``: every output buffer, the order
    :meth:`PromptGraphs._forward` copies into them (hidden states, ``new_kv``'s members, then
    ``states``')."""

    hidden: torch.Tensor
    new_kv: tuple[_Group, ...]
    states: tuple[_Group, ...]
    targets: tuple[torch.Tensor, ...]


class _Bucket:
    """One bucket's token inputs (ids ``[B, T]``, mask ``[B, P + T]``, positions ``[B, T]``), the
    names of the layers it restores, and its program (:class:`~specdec.graphs.CapturedProgram`)."""

    def __init__(self, owner: "PromptGraphs", B: int, T: int, P: int, restored: tuple, scan: str, graphs: bool):
        dev = owner.adapter.device
        self.B, self.T, self.P, self.restored = B, T, P, restored
        self.ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.mask = torch.zeros(B, P + T, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.shapes: tuple | None = None  # each output's shape and dtype, from the first run
        self.restore_views: dict[int, dict[str, torch.Tensor]] = {}  # the restored states' buffers
        self.outputs: _Outputs | None = None  # views of the output buffers at these shapes
        what = f"the prompt forward of {B} x {T} tokens" + (f" after {P} restored columns" if P else "")
        self.program = CapturedProgram(lambda: owner._forward(self, scan), model=owner.adapter.model, what=what,
                                       graphs=graphs, fuse=False, pool=owner.pool() if graphs else None)


class PromptGraphs:
    """Prompt forwards of one adapter at bucketed shapes, captured as CUDA graphs (see the
    module docstring).

    Args:
        adapter: the :class:`~specdec.models.HybridAdapter` whose prompts run here.
        max_rows / max_tokens: the largest bucket (:func:`prompt_bucket`); max_columns: the most
            attention columns (rows x (prefix + new tokens), bucketed).

    ``counts`` holds how many forwards replayed a captured graph (``"cuda_graph"``), captured
    their bucket's graph and then replayed it (``"captured"``: on the CUDA-graph path each
    bucket's second, which costs the capture), ran eagerly at a bucket's shape (``"static"``: on the CUDA-graph path each bucket's first, its warm-up) and
    eagerly at their own shape because no bucket held them (``"eager"``: too many rows, tokens or
    columns, or not :attr:`available`); ``error`` the first capture failure's reason (from then
    on no new bucket is captured; the buckets captured before keep replaying their graphs).
    """

    def __init__(self, adapter, max_rows: int = PROMPT_GRAPH_ROWS, max_tokens: int = PROMPT_GRAPH_TOKENS,
                 max_columns: int = PROMPT_GRAPH_COLUMNS):
        self.adapter = adapter
        self.max_rows, self.max_tokens, self.max_columns = int(max_rows), int(max_tokens), int(max_columns)
        self._buckets: dict[tuple, _Bucket] = {}
        self._arena = _Arena()
        self.counts = {"cuda_graph": 0, "captured": 0, "static": 0, "eager": 0}
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
        if ad.placement.multi_device:
            return "the decoder layers compute on several devices (one bucket's buffers live on one)"
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

    def pending(self) -> set[tuple]:
        """The buckets whose forward has run once on the CUDA-graph path, not yet captured: the
        next forward of each captures its graph (counted ``"captured"``). Empty where nothing is
        captured (not CUDA, or after a capture failed)."""
        return {key for key, b in self._buckets.items()
                if b.program.graphs and b.program.graph is None and b.program.error is None and self.error is None}

    @property
    def available(self) -> str | None:
        """None when prompts can run here, else why not."""
        return self._blocker

    def bucket(self, rows: int, width: int, prefix: int = 0, max_tokens: int | None = None) -> tuple | None:
        """The bucket ``(rows, width, prefix)`` of ``rows`` prompts of ``width`` new tokens after
        ``prefix`` restored columns, or None: not available here, or more than ``max_rows`` rows,
        ``max_tokens`` new tokens (this object's, and the caller's ``max_tokens``) or
        ``max_columns`` attention columns."""
        if self._blocker is not None:
            return None
        key = prompt_bucket(rows, width, self.max_rows, self.max_tokens)
        if key is None:
            return None
        B, T = key
        P = bucket_width(prefix)
        if (max_tokens is not None and B * T > max_tokens) or B * (P + T) > self.max_columns:
            return None
        return B, T, P

    def run(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, scan: str, graphs: bool,
            max_tokens: int | None = None, restore: dict | None = None, copy: bool = False):
        """The prompts ``input_ids [B, T]`` (int64, left-padded) through the body at their
        bucket's shape, captured as a CUDA graph from the bucket's second use when ``graphs``
        (CUDA, nothing blocking captures), else eagerly at that shape.

        Args:
            mask: ``[B, P + T]`` (int64, 1 = token): the ``P`` restored columns, then the new ones.
            positions: ``[B, T]`` the new tokens' position ids.
            scan: the Mamba-2 prompt scan (resolved). graphs: capture.
            max_tokens: the caller's bound on one forward's tokens, padding included.
            restore: ``{layer index: LayerState}`` the batch's states before the forward (keys /
                values ``[B, H, P, D]``, left-padded; conv / recurrent ``[B, ...]``), or None
                (``P = 0``: every row starts from nothing).
            copy: return copies, not views of the shared buffers.

        Returns ``(hidden [B, T, D], new_kv, states)``: the final hidden states, each attention
        layer's keys / values of the ``T`` new columns (``{idx: (keys, values)}``) and each layer's state after the forward (keys / values of the ``P + T``
        columns), as the eager forward leaves them; views of buffers the next call overwrites
        unless ``copy``. None when no bucket holds the batch (:meth:`bucket`).
        """
        from ..prefix_cache import LayerState

        B, T = input_ids.shape
        P = mask.shape[1] - T
        key = self.bucket(B, T, P, max_tokens)
        if key is None:
            self.counts["eager"] += 1
            return None
        graphs = bool(graphs) and capture_blocker() is None and input_ids.is_cuda
        restored = tuple(sorted(restore)) if restore else ()
        full = key + (restored, scan, graphs)
        bucket = self._buckets.get(full)
        if bucket is None:  # (after a capture failed, a new bucket runs uncaptured; captured ones keep replaying)
            bucket = self._buckets[full] = _Bucket(self, *key, restored, scan, graphs and self.error is None)
        Bb, Tb, Pb = key
        bucket.ids.zero_()
        bucket.ids[:B, Tb - T:] = input_ids
        bucket.positions.zero_()
        bucket.positions[:B, Tb - T:] = positions
        bucket.mask.zero_()
        bucket.mask[:B, Pb - P:Pb] = mask[:, :P]
        bucket.mask[:B, Pb + Tb - T:] = mask[:, P:]
        bucket.mask[B:, -1] = 1  # rows beyond the prompts hold one token each
        # the restored states into the bucket's buffers: one fill and one copy for every layer
        zeros, dsts, srcs = [], [], []
        for idx, st in (restore or {}).items():
            views = bucket.restore_views.setdefault(idx, {})  # (the buffers never move: viewed once)
            for n in _NAMES:
                if (src := getattr(st, n)) is None:
                    continue
                if (dst := views.get(n)) is None:
                    shape = (Bb, src.shape[1], Pb, src.shape[3]) if n in ("keys", "values") else (Bb, *src.shape[1:])
                    dst = views[n] = self._arena.view(f"in.{idx}.{n}", shape, src.dtype, src.device,
                                                      self._capacity(n, shape))
                if n in ("keys", "values"):  # the rows' columns right-aligned; zeros before them
                    zeros.append(dst[:B, :, :Pb - P])
                    dsts.append(dst[:B, :, Pb - P:])
                else:
                    dsts.append(dst[:B])
                zeros.append(dst[B:])  # rows beyond the prompts start from nothing
                srcs.append(src)
        if dsts:
            torch._foreach_zero_(zeros)
            torch._foreach_copy_(dsts, srcs)
        uncaptured = bucket.program.graph is None
        how = bucket.program()
        if how == "cuda_graph" and uncaptured:
            how = "captured"
        if bucket.program.error is not None and self.error is None:
            self.error = bucket.program.error
            for other in self._buckets.values():  # (the ones waiting for their capture: none)
                if other.program.graph is None:
                    other.program.graphs = False
        self.counts[how] += 1
        out = self._output_views(bucket)

        def rows(g: _Group) -> torch.Tensor:  # the B rows of a group; keys / values at the real P + T columns
            d = g.data[:, :B]
            if not g.columns:
                return d.clone() if copy else d
            if not P:
                return d.narrow(3, Tb - T, T).clone() if copy else d.narrow(3, Tb - T, T)
            return torch.cat([d[:, :, :, Pb - P:Pb], d[:, :, :, Pb + Tb - T:]], dim=3)

        fields: dict[int, dict[str, torch.Tensor]] = {}
        for g in out.states:
            for (idx, n), t in zip(g.members, rows(g).unbind(0)):
                fields.setdefault(idx, {})[n] = t
        new: dict[int, dict[str, torch.Tensor]] = {}
        for g in out.new_kv:
            d = g.data[:, :B, :, Tb - T:]
            for (idx, n), t in zip(g.members, (d.clone() if copy else d).unbind(0)):
                new.setdefault(idx, {})[n] = t
        hidden = out.hidden[:B, Tb - T:]
        new_kv = {idx: (kv["keys"], kv["values"]) for idx, kv in sorted(new.items())}
        return hidden.clone() if copy else hidden, new_kv, {idx: LayerState(**f) for idx, f in sorted(fields.items())}

    # --- buffers ------------------------------------------------------------------------------
    def _capacity(self, n: str, shape) -> int:
        """Elements a shared buffer of kind ``n`` (a :class:`LayerState` field or ``"hidden"``)
        needs at the largest bucket, given one bucket's ``shape``: keys / values (``[B, H, C,
        D]``) ``max_columns`` columns, a hidden state (``[B, T, D]``) ``max_tokens`` positions, a
        conv / recurrent state (``[B, ...]``) ``max_rows`` rows."""
        if n in ("keys", "values"):
            return self.max_columns * shape[1] * shape[3]
        if n == "hidden":
            return self.max_tokens * shape[-1]
        return self.max_rows * int(torch.Size(shape[1:]).numel())

    def _output_views(self, bucket: _Bucket) -> _Outputs:
        """The :class:`_Outputs` of ``bucket``: views of the output buffers at its shapes (built
        once per bucket: the buffers never move)."""
        if bucket.outputs is None:
            bucket.outputs = self._new_output_views(bucket)
        return bucket.outputs

    def _new_output_views(self, bucket: _Bucket) -> _Outputs:
        hidden_spec, kv_specs, state_specs = bucket.shapes
        dev = bucket.ids.device

        def groups(prefix: str, specs: dict[tuple[int, str], tuple]) -> tuple[_Group, ...]:
            # by kind, shape (but the batch and columns) and dtype: one buffer, named by all of them
            by: dict[tuple, list[tuple[int, str]]] = {}
            for (idx, n), (shape, dtype) in sorted(specs.items()):
                kv = n in ("keys", "values")
                rest = (shape[1], shape[3]) if kv else shape[1:]
                by.setdefault(("kv" if kv else n, rest, dtype), []).append((idx, n))
            out = []
            for (kind, rest, dtype), members in by.items():
                shape, dtype = specs[members[0]]
                m = len(members)
                name = f"{prefix}.{kind}.{m}.{str(dtype).removeprefix('torch.')}.{'x'.join(map(str, rest))}"
                data = self._arena.view(name, (m, *shape), dtype, dev, m * self._capacity(members[0][1], shape))
                out.append(_Group(tuple(members), data, kind == "kv"))
            return tuple(out)

        hidden = self._arena.view("out.hidden", hidden_spec[0], hidden_spec[1], dev,
                                  self._capacity("hidden", hidden_spec[0]))
        new_kv = groups("new", {(idx, n): spec for idx, specs in kv_specs.items()
                                for n, spec in zip(("keys", "values"), specs) if spec is not None})
        states = groups("out", {(idx, n): spec for idx, specs in state_specs.items()
                                for n, spec in zip(_NAMES, specs) if spec is not None})
        targets = (hidden,) + tuple(t for g in new_kv + states for t in g.data.unbind(0))
        return _Outputs(hidden, new_kv, states, targets)

    @torch.no_grad()
    def _forward(self, bucket: _Bucket, scan: str) -> None:
        """The program a bucket runs (and captures): HF's cache loaded from the restored states,
        the body on the bucket's tokens, the outputs copied out."""
        from .base import _KVRecordingCache

        ad = self.adapter
        B, T, P = bucket.B, bucket.T, bucket.P
        mask2d, dev, dtype = bucket.mask, bucket.ids.device, ad.dtype
        visible = (torch.arange(P + T, device=dev)[None, :] <= torch.arange(P, P + T, device=dev)[:, None])
        visible = visible[None] & mask2d.bool()[:, None, :]  # [B, T, P + T]: causal, not padding
        mask4d = torch.zeros(B, 1, T, P + T, dtype=dtype, device=dev).masked_fill_(~visible[:, None],
                                                                                   torch.finfo(dtype).min)
        hf_cache = _KVRecordingCache(ad.config)
        for idx in bucket.restored:
            views = bucket.restore_views[idx]
            if "keys" in views and P:
                hf_cache.update(views["keys"], views["values"], idx)
            if "conv_state" in views:
                hf_cache.update_conv_state(views["conv_state"], idx, conv_kernel_size=views["conv_state"].shape[-1])
            if "recurrent_state" in views:
                hf_cache.update_recurrent_state(views["recurrent_state"], idx)
        hf_cache.new_kv.clear()
        hidden = ad._prompt_forward(bucket.ids, ad.prompt_mask_arg(mask4d, mask2d[:, P:]), bucket.positions,
                                    hf_cache, scan)
        states = ad._layer_states(hf_cache)
        new_kv = dict(hf_cache.new_kv)
        if bucket.shapes is None:
            def spec(t):
                return None if t is None else (tuple(t.shape), t.dtype)

            bucket.shapes = ((tuple(hidden.shape), hidden.dtype),
                             {idx: (spec(k), spec(v)) for idx, (k, v) in new_kv.items()},
                             {idx: tuple(spec(getattr(st, n)) for n in _NAMES) for idx, st in states.items()})
        out = self._output_views(bucket)
        kv = {(idx, n): t for idx, pair in new_kv.items() for n, t in zip(("keys", "values"), pair)}
        torch._foreach_copy_(list(out.targets), [hidden] + [kv[m] for g in out.new_kv for m in g.members]
                             + [getattr(states[idx], n) for g in out.states for idx, n in g.members])
