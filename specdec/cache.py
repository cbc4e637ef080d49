"""The hybrid cache: a static, position-indexed KV cache for attention layers and, for SSM
layers, a conv window plus recurrent state kept through a rollback strategy.

Layout (left-padded batches, as Hugging Face lays them out): column ``c`` of row ``b`` of
every KV buffer holds the token at that column of the left-padded sequence; columns
``< pad[b]`` are padding and always masked. ``seq_len[b]`` columns are committed. A step
writes its tokens at columns ``seq_len[b] + j``; attention of step token j sees columns
``pad[b] .. seq_len[b] + j``. Rolling attention back is just not advancing ``seq_len`` past
the accepted tokens: stale columns are masked and later overwritten.

SSM layers get a :class:`SSMLayerCache` that the model adapters call from the mixer:
``conv(...)`` for the causal conv (window of W-1+T_max inputs, commit by offset) and
``ssm(...)`` for the recurrence (through the rollback strategy).

Tree steps (:mod:`specdec.tree`: a draft tree of N nodes verified in one forward). The cache has
an explicit mode, :meth:`HybridCache.set_tree`: while a tree is set, every forward is a tree
forward. Node j (BFS order, node 0 = the pending token) is written at KV column
``seq_len + j`` with position ``seq_len - pad + depth(j)``; the attention mask lets it see the
committed prefix, its ancestors and itself; every SSM layer runs node j's conv over its
ancestor chain and its recurrence from its *parent's* state (``strategy.tree_verify``; STree,
Wu et al. 2025, "STree: Speculative Tree Decoding for Hybrid State-Space Models").
:meth:`HybridCache.commit_path` then moves each row's accepted path to the step's first
positions (KV columns, conv inputs, per-node SSM data) and commits it exactly as a chain step
that ran the path's tokens.

Plain steps (:meth:`HybridCache.set_plain`): a step of one token that every row keeps (K = 0)
updates each SSM layer's committed state in place, as plain decoding does, instead of keeping
rollback data (:meth:`RollbackStrategy.plain_verify <specdec.rollback.RollbackStrategy.plain_verify>`).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .fusion import fusable
from .graphs import CapturedProgram
from .kernels import SSMOp, backend, conv1d_op
from .kernels.conv1d import new_conv_window
from .kernels.kv import write_kv
from .kernels.slots import to_slots
from .placement import on_device
from .rollback import RollbackStrategy

__all__ = ["HybridCache", "SSMLayerCache"]


@fusable
def _chain_mask(seq_len: torch.Tensor, pad: torch.Tensor, offset: int, t: int, end: int, dtype) -> torch.Tensor:
    """:meth:`HybridCache.attention_mask` of a chain step (element-wise: one kernel on the CUDA-graph
    path, ~10 eagerly): ``[B, 1, t, end]``, 0 where ``pad[b] <= c <= seq_len[b] + offset + j``, else
    the dtype's lowest value."""
    cols = torch.arange(end, device=seq_len.device)[None, None, :]
    last = (seq_len[:, None] + offset + torch.arange(t, device=seq_len.device)[None, :])[:, :, None]
    visible = (cols >= pad[:, None, None]) & (cols <= last)
    mask = torch.zeros(seq_len.shape[0], 1, t, end, dtype=dtype, device=seq_len.device)
    return mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)


@fusable
def _chain_positions(seq_len: torch.Tensor, pad: torch.Tensor, offset: int, t: int) -> torch.Tensor:
    """:meth:`HybridCache.position_ids` of a chain step: ``seq_len - pad + offset + j``, ``[B, t]``."""
    return seq_len[:, None] - pad[:, None] + offset + torch.arange(t, device=seq_len.device)[None, :]


def _load_windows(layers: list["SSMLayerCache"], conv_states: list[torch.Tensor], rows: torch.Tensor | slice) -> None:
    """Each of ``layers``' conv window at slots ``rows`` (``[n]`` int64 or a slice): the last ``W - 1``
    inputs of its ``conv_states [n, C, >= W-1]`` (cast to the window's dtype), then zeros. A slice
    writes through views: every layer's windows in one fill and one copy."""
    if isinstance(rows, slice):
        wins = [layer.conv_window[rows] for layer in layers]
        torch._foreach_zero_(wins)
        hist = [(w[:, :, :layer.conv_width - 1], c[:, :, c.shape[-1] - layer.conv_width + 1:])
                for w, layer, c in zip(wins, layers, conv_states) if layer.conv_width > 1]
        if hist:
            torch._foreach_copy_([w for w, _ in hist], [c for _, c in hist])
        return
    for layer, conv_state in zip(layers, conv_states):
        hist, win = layer.conv_width - 1, layer.conv_window
        win[rows] = 0
        if hist:
            win[rows, :, :hist] = conv_state[:, :, conv_state.shape[-1] - hist:].to(win)


class SSMLayerCache:
    """Conv window and recurrent state of one SSM layer.

    Args:
        op: the recurrence (``specdec.kernels.get_op``). strategy: the rollback strategy.
        batch, max_step_tokens: B and T_max (= num_speculative_tokens + 1).
        layer: layer index (for error messages).
        device: the device the layer computes on, where its conv window and store live (None:
            the cache's home device; :meth:`HybridCache.commit` hands it tensors there).
        state_indices: ``[batch]`` int64 state slot of each row on the layer's device (negative:
            a padding row), or None (row b is slot b). With it, the conv windows and the
            recurrent states are pools of ``num_slots`` slots (:class:`specdec.rollback.LayerStore`):
            :meth:`load` takes and :meth:`ssm_state` / :meth:`conv_state` return whole pools.

    ``conv_op`` is the causal conv on the backend ``op`` runs on (``specdec.kernels.conv1d_op``).
    """

    def __init__(self, op: SSMOp, strategy: RollbackStrategy, batch: int, max_step_tokens: int, layer: int,
                 state_indices: torch.Tensor | None = None, device: torch.device | str | None = None):
        self.op = op
        self.device = None if device is None else torch.device(device)
        self.conv_op = conv1d_op(backend_name=op.backend)
        self.strategy = strategy
        self.layer = layer
        self.max_step_tokens = max_step_tokens
        self.store = strategy.new_store(batch, max_step_tokens, layer, state_indices)
        self.conv_window: torch.Tensor | None = None
        self.conv_width = 0
        self.params: dict = {}
        self.step_tokens = 0  # tokens of the open step run through conv (same for the SSM store)
        self.has_recurrence = True
        self.state_shape: tuple | None = None  # (set by load)
        #: the tree of the cache's tree mode (``parents``, ``parents[j] < j``, -1 = the committed
        #: state), or None for chain steps; set by :meth:`HybridCache.set_tree`
        self.tree_parents: tuple[int, ...] | None = None
        #: plain mode (:meth:`HybridCache.set_plain`): steps update the state in place
        self.plain = False

    @property
    def state_indices(self) -> torch.Tensor | None:
        """The row -> slot map of this layer's conv windows and store (None: row b is slot b)."""
        return self.store.state_indices

    # --- loading ---------------------------------------------------------------------------
    def load(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None, conv_width: int) -> None:
        """Set the committed state after prefill.

        Args:
            conv_state: ``[num_slots, C, >= W-1]`` last conv inputs (the last W-1 are kept) or None
                for a layer without conv. ssm_state: ``[num_slots, *S]``, or None for a conv-only layer
                (LFM2's short convs: its rollback is the conv window's offset alone).
            conv_width: W.
        """
        if conv_state is not None:
            hist = conv_width - 1
            B, C = conv_state.shape[:2]
            win = new_conv_window(B, C, hist + self.max_step_tokens, conv_state)  # time-major
            if hist:
                win[:, :, :hist] = conv_state[:, :, conv_state.shape[-1] - hist :]
            self.conv_window = win
        self.conv_width = conv_width
        self.has_recurrence = ssm_state is not None
        #: one sequence's recurrent state shape ``S`` as loaded (None: no recurrence)
        self.state_shape = tuple(ssm_state.shape[1:]) if self.has_recurrence else None
        if self.has_recurrence:
            self.strategy.load(self.store, ssm_state)
        self.step_tokens = 0

    def check_load_rows(self, n: int, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
                        conv_width: int) -> None:
        """Raise ValueError unless :meth:`HybridCache.load_rows` can write ``n`` rows of these
        states into this layer: the layer's conv width, conv window and recurrence as loaded
        before, ``conv_state [n, C, >= W-1]`` with this window's C channels, ``ssm_state [n, *S]``
        with the loaded state's S."""
        if self.state_shape is None and self.conv_window is None:
            raise ValueError(f"SSM layer {self.layer}: nothing loaded into it yet; prefill the whole cache first")
        if (conv_width != self.conv_width or (conv_state is None) != (self.conv_window is None)
                or (ssm_state is not None) != self.has_recurrence):
            raise ValueError(f"SSM layer {self.layer}: the prefill's conv window / recurrence differs from this "
                             "cache's (was the cache loaded by a prefill of the same model?)")
        if conv_state is not None and (conv_state.dim() != 3 or conv_state.shape[:2] != (n, self.conv_window.shape[1])
                                       or conv_state.shape[2] < conv_width - 1):
            raise ValueError(f"SSM layer {self.layer}: conv state of shape {tuple(conv_state.shape)} for {n} rows; "
                             f"expected [{n}, {self.conv_window.shape[1]}, >= {conv_width - 1}]")
        if ssm_state is not None and tuple(ssm_state.shape) != (n, *self.state_shape):
            raise ValueError(f"SSM layer {self.layer}: recurrent state of shape {tuple(ssm_state.shape)} for {n} "
                             f"rows; expected {(n, *self.state_shape)}")

    def reset_state_rows(self, rows: torch.Tensor | slice, ssm_state: torch.Tensor | None) -> None:
        """:meth:`HybridCache.load_rows`'s recurrent part for this layer: the committed state of
        slots ``rows`` becomes ``ssm_state [n, *S]`` through the strategy's ``reset_rows``
        (nothing for a conv-only layer). The caller checks the shapes (:meth:`check_load_rows`)."""
        if self.has_recurrence:
            self.strategy.reset_rows(self.store, self.op, self.params, rows, ssm_state)

    # --- called by adapters during a forward --------------------------------------------------
    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
        """Causal depthwise conv of this step's inputs ``x [B, t, C]`` -> ``[B, t, C]`` (in tree
        mode each node's window is its ancestor chain; in plain mode the token is committed as it
        runs, :meth:`Conv1dOp.update <specdec.kernels.conv1d.Conv1dOp.update>`)."""
        if self.plain:
            return self.conv_op.update(self.conv_window, x, weight, bias, activation, state_indices=self.state_indices)
        if self.tree_parents is not None:
            return self.conv_op.tree_verify(self.conv_window, x, weight, bias, activation, self.tree_parents,
                                            state_indices=self.state_indices)
        return self.conv_op.verify(self.conv_window, x, weight, bias, activation, self.step_tokens,
                                   state_indices=self.state_indices)

    def ssm(self, inputs: dict, params: dict) -> torch.Tensor:
        """Run the recurrence on this step's ``inputs`` through the rollback strategy (in tree mode,
        each node from its parent's state: ``strategy.tree_verify``)."""
        if not self.has_recurrence:
            raise RuntimeError(f"layer {self.layer} is conv-only: it has no recurrence")
        self.params = params
        if self.tree_parents is not None:
            return self.strategy.tree_verify(self.store, self.op, inputs, params, self.tree_parents)
        if self.plain:
            return self.strategy.plain_verify(self.store, self.op, inputs, params)
        return self.strategy.verify(self.store, self.op, inputs, params)

    def advance(self, t: int) -> None:
        self.step_tokens += t

    # --- commit / inspection ---------------------------------------------------------------
    def compact_path(self, src: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """After a tree forward: move each row's accepted path (``src [B, P]`` int64, the tree
        index of the path's i-th token, the identity past ``num_tokens``) to the step's first
        positions: conv inputs to window columns ``W-1+i``, SSM data through the strategy's
        ``compact_path``. A following :meth:`commit` then commits the path as a chain."""
        win = self.conv_window
        if win is not None:
            if self.state_indices is not None:  # the window pool is per slot: the path of each slot's row
                i = torch.arange(src.shape[1], device=src.device)[None, :]
                num = to_slots(num_tokens, self.state_indices, win.shape[0])
                src = torch.where(i < num[:, None], to_slots(src, self.state_indices, win.shape[0]), i)
            B, P = src.shape
            h = self.conv_width - 1
            moved = win.gather(2, (h + src)[:, None, :].expand(B, win.shape[1], P))  # all reads before writes
            win[:, :, h : h + P] = moved
        if self.has_recurrence:
            self.strategy.compact_path(self.store, self.op, self.params, src, num_tokens)

    def commit(self, num_tokens: torch.Tensor) -> None:
        if self.conv_window is not None and not self.plain:  # (a plain step's conv committed as it ran)
            self.conv_op.commit(self.conv_window, num_tokens, self.conv_width, state_indices=self.state_indices)
        if self.has_recurrence:
            commit = self.strategy.plain_commit if self.plain else self.strategy.commit
            commit(self.store, self.op, self.params, num_tokens)
        self.step_tokens = 0

    def ssm_state(self) -> torch.Tensor:
        """Committed recurrent state ``[num_slots, *S]`` fp32 (None for a conv-only layer)."""
        if not self.has_recurrence:
            return None
        return self.strategy.state(self.store, self.op, self.params)

    def conv_state(self) -> torch.Tensor | None:
        """Committed conv history ``[num_slots, C, W-1]``."""
        if self.conv_window is None:
            return None
        return self.conv_window[:, :, : self.conv_width - 1]


def _row_index(x, n_max: int, what: str, device) -> torch.Tensor:
    """``x`` (an integer tensor or sequence of ints) as a 1-D int64 index on ``device``, checked:
    integers (not bool / float), values in ``[0, n_max)``, distinct (ValueError naming ``what``)."""
    idx = x if isinstance(x, torch.Tensor) else torch.as_tensor(list(x))
    if idx.numel() and (idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex()):
        raise ValueError(f"{what} must be integer slot indices, got {idx.dtype} values {idx.tolist()}")
    idx = idx.long()
    if idx.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(idx.shape)}")
    vals = idx.tolist()
    if any(v < 0 or v >= n_max for v in vals):
        raise ValueError(f"{what} must be in [0, {n_max}), got {vals}")
    if len(set(vals)) != len(vals):
        raise ValueError(f"{what} must be distinct, got {vals}")
    return idx.to(device)


class HybridCache:
    """Static KV cache + SSM layer caches for one batch of sequences.

    Args:
        batch: B. max_len: KV columns (prompt + new tokens + T_max).
        max_step_tokens: T_max. dtype: of the KV buffers. device: the home device (the LM
            head's), where ``seq_len``, ``pad``, masks and positions live and where
            :meth:`commit` takes ``num_tokens``.
        layer_devices: for a model whose decoder layers compute on several devices, each
            layer's device (``[num_layers]``); None: every layer on ``device``. Each layer's KV
            buffers, conv window and rollback store live on its device; ``seq_len`` has a copy
            on every other device (:attr:`mirrors`), advanced by :meth:`commit` with one copy of
            ``num_tokens`` per device.

    Attention modules of Hugging Face models call :meth:`update` as they would on their own
    ``Cache``; it writes the step's keys/values at each row's own columns and returns the
    buffers up to the last column any row needs.

    Code that writes ``seq_len`` (assigns it or writes into it) outside this class calls
    :meth:`refresh_mirrors` afterwards.
    """

    is_compileable = False

    def __init__(self, batch: int, max_len: int, max_step_tokens: int, dtype, device, static: bool = False,
                 layer_devices=None):
        self.batch = batch
        #: static mode (the CUDA-graph decode path): every forward reads all ``max_len`` KV columns
        #: (fixed shapes) and ``commit`` runs no host-side checks (no device-to-host sync)
        self.static = bool(static)
        self.max_len = max_len
        self.max_step_tokens = max_step_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kv_backend = backend(self.device)  # (the step's key / value writes: :func:`specdec.kernels.kv.write_kv`)
        self.ssm: dict[int, SSMLayerCache] = {}
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.seq_len = torch.zeros(batch, dtype=torch.long, device=self.device)
        #: each layer's device where the layers spread over several devices, else None
        self.layer_devices = None if layer_devices is None else tuple(map(torch.device, layer_devices))
        #: ``seq_len`` on each device but the home one that a layer computes on (empty: one device)
        self.mirrors: dict[torch.device, torch.Tensor] = {
            dev: self.seq_len.to(dev) for dev in dict.fromkeys(self.layer_devices or ()) if dev != self.device}
        #: the key / value writes' backend on each device of :attr:`mirrors`
        self._kv_backends = {dev: backend(dev) for dev in self.mirrors}
        self.step_tokens = 0
        #: the draft tree of the cache's tree mode (:meth:`set_tree`), or None for chain steps
        self.tree = None
        #: plain mode (:meth:`set_plain`): one-token steps that update the SSM states in place
        self.plain = False
        self._kept = 0  # depth of open plain_state_kept() blocks
        self._fold_max: tuple = (None, 0)  # (the last set_fold_max, the SSM layers it was set on)
        self._flush_graphs = False
        self._flush_program: tuple | None = None  # (the flush_key tuple it was made for, its CapturedProgram)

    def layer_device(self, layer_idx: int) -> torch.device | None:
        """The device decoder layer ``layer_idx`` computes on where the layers spread over several
        devices (``layer_devices``), else None (every layer on :attr:`device`)."""
        return None if self.layer_devices is None else self.layer_devices[layer_idx]

    def _kv_device(self, layer_idx: int) -> torch.device:
        """The device whose copy of ``seq_len`` attention layer ``layer_idx``'s keys / values are
        written with where the layers spread: its decoder layer's (an index past the decoder
        layers: its buffers')."""
        if self.layer_devices is not None and 0 <= layer_idx < len(self.layer_devices):
            return self.layer_devices[layer_idx]
        return self.kv[layer_idx][0].device

    def _ssm_by_device(self) -> dict[torch.device, list[SSMLayerCache]]:
        """The SSM layers grouped by the device they compute on (home first)."""
        groups: dict[torch.device, list[SSMLayerCache]] = {self.device: []}
        for layer in self.ssm.values():
            groups.setdefault(layer.device or self.device, []).append(layer)
        return groups

    def refresh_mirrors(self) -> None:
        """Copy ``seq_len`` into its copy on every other device (:attr:`mirrors`), after a write
        other than :meth:`commit`'s (a load, a row reset)."""
        for dev, mirror in self.mirrors.items():
            mirror.copy_(self.seq_len, non_blocking=dev.type == "cuda")

    def _copies(self, t: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """``t`` (on the home device) on every device a layer computes on: ``{device: tensor}``,
        one copy per other device (not blocking the host toward a CUDA device)."""
        out = {self.device: t}
        for dev in self.mirrors:
            out[dev] = t.to(dev, non_blocking=dev.type == "cuda")
        return out

    # --- attention KV ----------------------------------------------------------------------
    def _buffers(self, layer_idx: int, like: torch.Tensor):
        if layer_idx not in self.kv:
            raise KeyError(f"attention layer {layer_idx} has no KV buffer (was prefill loaded?)")
        return self.kv[layer_idx]

    def load_kv(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy prefill keys/values ``[B, H, L, D]`` into columns ``0..L-1``."""
        B, H, L, _ = keys.shape
        kbuf = keys.new_zeros(B, H, self.max_len, keys.shape[-1])
        vbuf = values.new_zeros(B, values.shape[1], self.max_len, values.shape[-1])
        kbuf[:, :, :L] = keys
        vbuf[:, :, :L] = values
        self.kv[layer_idx] = (kbuf, vbuf)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, **kwargs):
        """HF ``Cache.update``: write ``[B, H, t, D]`` at each row's step columns; return buffers."""
        kbuf, vbuf = self._buffers(layer_idx, key_states)
        t = key_states.shape[2]
        seq_len, kv_backend = self.seq_len, self._kv_backend
        if self.mirrors:
            dev = self._kv_device(layer_idx)
            if dev != self.device:  # (a layer on another device: its copy of seq_len)
                seq_len, kv_backend = self.mirrors[dev], self._kv_backends[dev]
        write_kv(kbuf, vbuf, key_states, value_states, seq_len, self.step_tokens, backend_name=kv_backend)
        end = self.kv_end(t)
        return kbuf[:, :, :end], vbuf[:, :, :end]

    def kv_end(self, t: int) -> int:
        """Number of KV columns a forward of ``t`` step tokens reads (all of them in static mode)."""
        if self.static:
            return self.max_len
        return int(self.seq_len.max()) + self.step_tokens + t

    def attention_mask(self, t: int, dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, t, end]``: step token j of row b sees ``pad[b] <= c <= seq_len[b] + offset + j``;
        in tree mode node j sees the committed columns and the columns of its ancestors and itself."""
        end = self.kv_end(t)
        if self.tree is not None:
            return self._tree_mask(t, end, dtype)
        return _chain_mask(self.seq_len, self.pad, self.step_tokens, t, end, dtype)

    def _tree_mask(self, t: int, end: int, dtype) -> torch.Tensor:
        spec = self.tree
        if t != spec.num_nodes or self.step_tokens:
            raise ValueError(f"a tree forward runs all {spec.num_nodes} nodes at once as the step's only forward, "
                             f"got {t} tokens after {self.step_tokens}")
        dev = self.device
        cols = torch.arange(end, device=dev)[None, :]
        committed = (cols >= self.pad[:, None]) & (cols < self.seq_len[:, None])  # [B, end]
        vis = committed[:, None, :].expand(self.batch, t, end).clone()
        step_cols = (self.seq_len[:, None] + torch.arange(t, device=dev)[None, :])[:, None, :].expand(self.batch, t, t)
        vis.scatter_(2, step_cols, spec.tensors(dev)["ancestors"][None].expand(self.batch, t, t))
        mask = torch.zeros(self.batch, 1, t, end, dtype=dtype, device=dev)
        return mask.masked_fill_(~vis[:, None], torch.finfo(dtype).min)

    def sliding_mask(self, t: int, window: int, dtype) -> torch.Tensor:
        """Additive ``[B, 1, t, end]`` mask of a sliding-window layer: the causal (or tree) mask, and a
        query at logical column ``q`` (``seq_len + offset + j``; a tree node: ``seq_len + depth``)
        sees only columns whose logical column is ``> q - window`` (transformers' sliding overlay;
        a tree column's logical column is its node's)."""
        mask = self.attention_mask(t, dtype)
        end = mask.shape[-1]
        dev = self.device
        cols = torch.arange(end, device=dev)[None, :]
        if self.tree is None:
            q = self.seq_len[:, None] + self.step_tokens + torch.arange(t, device=dev)[None, :]  # [B, t]
            logical = cols.expand(self.batch, end)
        else:
            depth = self.tree.tensors(dev)["depth"]
            rel = cols - self.seq_len[:, None]  # [B, end]
            in_step = (rel >= 0) & (rel < t)
            logical = torch.where(in_step, self.seq_len[:, None] + depth[rel.clamp(0, t - 1)], cols)
            q = self.seq_len[:, None] + depth[None, :]  # [B, N]
        too_old = logical[:, None, :] <= (q - window)[:, :, None]
        return mask.masked_fill(too_old[:, None], torch.finfo(dtype).min)

    def position_ids(self, t: int) -> torch.Tensor:
        """``[B, t]`` positions of the step tokens (column minus left padding; a tree node: the
        committed length plus its depth)."""
        if self.tree is not None:
            return (self.seq_len - self.pad)[:, None] + self.tree.tensors(self.device)["depth"][None, :t]
        return _chain_positions(self.seq_len, self.pad, self.step_tokens, t)

    # --- HF Cache API bits that model code may query -------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.seq_len.max())

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return True

    # --- step bookkeeping ------------------------------------------------------------------
    def set_tree(self, tree) -> None:
        """Enter tree mode for ``tree`` (a :class:`~specdec.tree.TreeSpec`): every following forward
        runs the tree's N nodes as its step's only forward (tree attention mask and positions, each
        SSM node from its parent's state) and steps are committed with :meth:`commit_path`.
        ``None`` returns to chain steps.

        Raises: ValueError when a step is open."""
        if self.step_tokens:
            raise ValueError(f"set_tree needs no open step; this step already ran {self.step_tokens} tokens")
        if tree is not None and self.plain:
            raise ValueError("tree steps are not plain steps: leave plain mode first (set_plain(False))")
        self.tree = tree
        for layer in self.ssm.values():
            layer.tree_parents = None if tree is None else tuple(tree.parents)

    @property
    def has_plain_steps(self) -> bool:
        """Whether every SSM layer's strategy runs plain steps in place
        (:attr:`RollbackStrategy.has_plain_steps`), so :meth:`set_plain` may enter plain mode."""
        return all(layer.strategy.has_plain_steps for layer in self.ssm.values() if layer.has_recurrence)

    def set_plain(self, plain: bool) -> None:
        """Enter (True) or leave plain mode. In plain mode every forward is a plain decoding step of
        one token per row: each SSM layer updates its committed state in place
        (:meth:`RollbackStrategy.plain_verify`: one state read and one write, as plain decoding,
        where a speculative step also keeps rollback data), and the step's token is kept: commit 1
        for every row whose state is read again. Entering flushes each strategy's pending rollback
        data into the state (:meth:`RollbackStrategy.flush`: replay folds its input history);
        leaving needs nothing. A step that speculates no tokens (K = 0) runs in plain mode.

        Raises: ValueError when a step is open, in tree mode, or when a layer's strategy has no
        plain steps (:attr:`has_plain_steps`)."""
        plain = bool(plain)
        if plain == self.plain:
            return
        if self.step_tokens:
            raise ValueError(f"set_plain needs no open step; this step already ran {self.step_tokens} tokens")
        if plain and self.tree is not None:
            raise ValueError("plain steps are chain steps: leave tree mode first (set_tree(None))")
        if plain and not self.has_plain_steps:
            names = sorted({layer.strategy.name for layer in self.ssm.values() if not layer.strategy.has_plain_steps})
            raise ValueError(f"rollback strategy {names} has no plain steps; strategies with them: "
                             "snapshot, replay and the in-place update of plain decoding")
        if plain:
            self.flush()
        for layer in self.ssm.values():
            layer.plain = plain
        self.plain = plain

    @property
    def flush_graphs(self) -> bool:
        """Whether the device part of :meth:`flush` runs as a CUDA graph (a decoder that captures
        its steps sets it; set to False, the captured flush is dropped)."""
        return self._flush_graphs

    @flush_graphs.setter
    def flush_graphs(self, on: bool) -> None:
        self._flush_graphs = bool(on)
        if not on:
            self._flush_program = None

    def flush(self) -> None:
        """Flush every SSM layer's pending rollback data into its committed state
        (:meth:`RollbackStrategy.flush`: replay folds its input history; the others hold none).
        Changes no committed state.

        With :attr:`flush_graphs`, the layers' device parts (:meth:`RollbackStrategy.flush_device`:
        for replay, a fold and a reset per layer, which the host would otherwise launch one by one
        between two steps) run as one :class:`~specdec.graphs.CapturedProgram`: eagerly at the first
        flush, captured at the second, replayed from then on; made again when a layer's
        :meth:`RollbackStrategy.flush_key` changes, and eager while any layer's is None or once a
        capture failed (which warns). A strategy that overrides :meth:`RollbackStrategy.flush`
        itself runs its own, eagerly.

        Raises: ValueError when a step is open."""
        if self.step_tokens:
            raise ValueError(f"flush needs no open step; this step already ran {self.step_tokens} tokens")
        layers = [layer for layer in self.ssm.values() if layer.has_recurrence]
        if any(type(layer.strategy).flush is not RollbackStrategy.flush for layer in layers):
            for layer in layers:  # (a flush not split into host and device parts)
                layer.strategy.flush(layer.store, layer.op, layer.params)
            return
        for layer in layers:
            layer.strategy.flush_host(layer.store)
        if not self.flush_graphs:
            self._flush_device(layers)
            return
        keys = tuple(layer.strategy.flush_key(layer.store, layer.op, layer.params) for layer in layers)
        if all(key == () for key in keys):  # (nothing pending on the device: snapshot, ring, replay before a verify)
            return
        if None in keys:
            self._flush_device(layers)
            return
        if self._flush_program is None or self._flush_program[0] != keys:
            program = CapturedProgram(functools.partial(HybridCache._flush_device, layers), model=None,
                                      what="the rollback flush", graphs=True)  # (no cycle through the cache)
            self._flush_program = keys, program
        program = self._flush_program[1]
        program()
        if program.error is not None:  # (its capture failed and warned: eager flushes from now on, not tried again)
            self.flush_graphs = False

    @staticmethod
    def _flush_device(layers) -> None:
        for layer in layers:
            with on_device(layer.device):  # (None, a context doing nothing, unless the layers spread)
                layer.strategy.flush_device(layer.store, layer.op, layer.params)

    def set_fold_max(self, n: int | None) -> None:
        """Promise that no row's rollback history holds more than ``n`` committed tokens when a
        step starts, for every step until the next call (None: no promise): fused replay then
        sizes the fold inside each step's first verify for ``n`` tokens instead of
        ``max_step_tokens`` (:attr:`LayerStore.fold_max`), as a decoder sized for the step's own
        width does. A CUDA graph captured meanwhile keeps the size, so the caller keeps the
        promise at every replay: after a step wider than ``n``, :meth:`flush` first. Debug mode
        checks it at each eager verify (not inside graphs); a broken promise folds too few tokens.

        Raises: ValueError when ``n`` is neither None nor an int in ``[0, max_step_tokens]``."""
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.max_step_tokens):
            raise ValueError(f"fold_max must be None or an int in [0, {self.max_step_tokens}], got {n!r}")
        if self._fold_max == (n, len(self.ssm)):  # (set before every step: the layers only when it changes)
            return
        for layer in self.ssm.values():
            layer.store.fold_max = n
        self._fold_max = (n, len(self.ssm))

    @contextlib.contextmanager
    def plain_state_kept(self):
        """Plain mode (:meth:`set_plain`) for steps whose tokens are placeholders (a CUDA-graph
        capture's warm-up, a calibration): every SSM layer's committed state and conv history (a
        plain step commits both as it runs) are copied on entry and written back on exit, in place.
        Holds one copy of them meanwhile; nested blocks share the outermost one's copy. KV columns
        need no copy: a commit of zero tokens leaves them as they were."""
        self.set_plain(True)
        saved = []
        if not self._kept:
            for layer in self.ssm.values():
                if layer.has_recurrence:
                    saved.append(layer.strategy.plain_state(layer.store))
                if layer.conv_window is not None:
                    saved.append(layer.conv_state())
            saved = [(live, live.clone()) for live in saved]
        self._kept += 1
        try:
            yield
        finally:
            self._kept -= 1
            for live, copy in saved:
                live.copy_(copy)

    def commit_path(self, path: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Commit each row's accepted path of the open tree step.

        Moves the path's attention keys/values to consecutive KV columns ``seq_len + i``, its conv
        inputs to window columns ``W-1+i`` and its SSM data to the strategy's step positions
        (:meth:`SSMLayerCache.compact_path`), then commits ``num_tokens`` exactly as a chain step
        that ran the path's tokens (:meth:`commit`).

        Args:
            path: ``[B, P]`` int64 tree node indices of each row's path (``path[:, 0] = 0``).
            num_tokens: ``[B]`` int64 in ``[0, P]``: the path's first tokens to keep.

        Raises: ValueError outside tree mode.
        """
        if self.tree is None:
            raise ValueError("commit_path is for tree steps (set_tree); a chain step commits with commit()")
        if self.mirrors:
            self._commit_path_spread(path, num_tokens)
            return
        B, P = path.shape
        dev = path.device
        i = torch.arange(P, device=dev)[None, :]
        src = torch.where(i < num_tokens[:, None], path, i)  # identity past the kept tokens
        rows = torch.arange(B, device=dev)[:, None]
        for layer in self.ssm.values():
            layer.compact_path(src, num_tokens)
        dst_cols = self.seq_len[:, None] + i
        src_cols = self.seq_len[:, None] + src
        for kbuf, vbuf in self.kv.values():
            for buf in (kbuf, vbuf):
                view = buf.permute(0, 2, 1, 3)  # [B, L, H, D]
                view[rows, dst_cols] = view[rows, src_cols]
        self.commit(num_tokens)

    def _commit_path_spread(self, path: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """:meth:`commit_path` where the layers spread over several devices: ``path`` and
        ``num_tokens`` copied once to every other device, each device's layers moved there with
        that device current, then :meth:`_commit_spread` with the same copies."""
        B, P = path.shape
        num_tokens = num_tokens.to(device=self.device, dtype=torch.long)
        if not self.static:
            num_tokens = self._checked(num_tokens)
        paths, nums = self._copies(path.to(self.device)), self._copies(num_tokens)
        seq_lens = {self.device: self.seq_len, **self.mirrors}
        kv_by_device: dict[torch.device, list[torch.Tensor]] = {}
        for idx, (kbuf, vbuf) in self.kv.items():
            kv_by_device.setdefault(self._kv_device(idx), []).extend((kbuf, vbuf))
        ssm = self._ssm_by_device()
        for dev in dict.fromkeys((*ssm, *kv_by_device)):
            with on_device(dev):
                i = torch.arange(P, device=dev)[None, :]
                src = torch.where(i < nums[dev][:, None], paths[dev], i)  # identity past the kept tokens
                for layer in ssm.get(dev, ()):
                    layer.compact_path(src, nums[dev])
                rows = torch.arange(B, device=dev)[:, None]
                dst_cols = seq_lens[dev][:, None] + i
                src_cols = seq_lens[dev][:, None] + src
                for buf in kv_by_device.get(dev, ()):
                    view = buf.permute(0, 2, 1, 3)  # [B, L, H, D]
                    view[rows, dst_cols] = view[rows, src_cols]
        self._commit_spread(num_tokens, nums)

    def set_step_tokens(self, t: int) -> None:
        """Set the host-side count of open-step tokens on the cache, every layer and store, without
        running anything: after a CUDA-graph replay of a forward (``t`` = its tokens), or to
        discard a forward that will not be committed (``t = 0``; it changed no committed state)."""
        self.step_tokens = t
        for layer in self.ssm.values():
            layer.step_tokens = t
            layer.store.step_tokens = t

    def copy_from(self, other: HybridCache) -> None:
        """Copy every committed buffer of ``other`` (same shapes, e.g. freshly prefilled) into this
        cache's own tensors in place, so tensors a captured CUDA graph points at stay valid."""
        if (other.batch, other.max_len, other.max_step_tokens) != (self.batch, self.max_len, self.max_step_tokens):
            raise ValueError("copy_from needs a cache of the same batch, max_len and max_step_tokens")
        if set(other.kv) != set(self.kv) or set(other.ssm) != set(self.ssm):
            raise ValueError("copy_from needs a cache with the same layers")
        for idx, (k, v) in other.kv.items():
            self.kv[idx][0].copy_(k)
            self.kv[idx][1].copy_(v)
        self.pad.copy_(other.pad)
        self.seq_len.copy_(other.seq_len)
        self.refresh_mirrors()

        def copy_tree(dst: dict, src: dict):
            for key, val in src.items():
                if val is None:  # allocated lazily (replay history): keep ours, its length is reset
                    continue
                if isinstance(val, dict):
                    copy_tree(dst[key], val)
                else:
                    dst[key].copy_(val)

        for idx, layer in other.ssm.items():
            mine = self.ssm[idx]
            if layer.conv_window is not None:
                mine.conv_window.copy_(layer.conv_window)
            mine.conv_width, mine.has_recurrence = layer.conv_width, layer.has_recurrence
            copy_tree(mine.store.tensors, layer.store.tensors)
        self.set_step_tokens(0)

    def reset_rows(self, rows, source: HybridCache, source_rows=None) -> None:
        """Give batch slots ``rows`` to new sequences that were prefilled into ``source`` (batch
        serving: a sequence finished, its slot takes the next prompt while the others go on).

        For each ``i``, slot ``rows[i]`` takes row ``source_rows[i]`` of ``source``: its KV columns
        (all ``max_len`` of every attention layer), ``pad`` and ``seq_len``, the conv window of
        every SSM layer, and the committed recurrent state, set through each layer's rollback
        strategy (:meth:`RollbackStrategy.reset_rows`), which also resets the slot's cursors: a
        ring's head, replay's checkpoint / input history and its length, snapshot buffers. The
        other rows keep their committed state (KV, ``pad``, ``seq_len``, conv window, the state
        :meth:`SSMLayerCache.ssm_state` returns) bit for bit. Every buffer is written in place
        when the strategy's ``resets_in_place`` (every built-in strategy), so CUDA graphs captured
        on this cache stay valid; a strategy without it reloads its store (new tensors).

        Typical use::

            src = adapter.new_cache(1, cache.max_len, cache.max_step_tokens, strategy)
            logits, hidden = adapter.prefill(new_ids, new_mask, src)   # new_ids [1, L]
            cache.reset_rows([slot], src)                             # the new prompt's pending
                                                                      # token comes from logits
        Args:
            rows: ``[n]`` int (LongTensor or list): distinct slot indices in ``[0, batch)``.
            source: a cache of the same ``max_len``, ``max_step_tokens``, KV dtype and layers
                (the same model), of any batch size, with no open step.
            source_rows: ``[n]`` int: the rows of ``source`` to take, in ``[0, source.batch)``
                (default ``0 .. n-1``).

        Raises:
            ValueError: a step is open on either cache (``step_tokens != 0``: commit it first);
                ``rows`` / ``source_rows`` out of range, repeated, not 1-D or of different
                lengths; ``source`` of another ``max_len`` / ``max_step_tokens`` / layer set, or
                whose layers differ in shape (conv width, KV heads or head size).
        """
        for cache, what in ((self, "this cache"), (source, "source")):
            cache._check_closed("reset_rows", what)
        rows = _row_index(rows, self.batch, "rows", self.device)
        n = rows.numel()
        source_rows = _row_index(range(n) if source_rows is None else source_rows, source.batch, "source_rows",
                                 self.device)
        if source_rows.numel() != n:
            raise ValueError(f"rows and source_rows must have the same length, got {n} and {source_rows.numel()}")
        if (source.max_len, source.max_step_tokens) != (self.max_len, self.max_step_tokens):
            raise ValueError(f"reset_rows needs a source cache of the same max_len and max_step_tokens "
                             f"({self.max_len}, {self.max_step_tokens}), got ({source.max_len}, {source.max_step_tokens})")
        if set(source.kv) != set(self.kv) or set(source.ssm) != set(self.ssm):
            raise ValueError("reset_rows needs a source cache with the same attention and SSM layers (same model)")
        for idx, (k, v) in source.kv.items():
            if k.shape[1:] != self.kv[idx][0].shape[1:] or v.shape[1:] != self.kv[idx][1].shape[1:]:
                raise ValueError(f"attention layer {idx}: source KV buffers {tuple(k.shape[1:])} differ from "
                                 f"this cache's {tuple(self.kv[idx][0].shape[1:])}")
        for idx, layer in source.ssm.items():
            mine = self.ssm[idx]
            same = (layer.conv_width == mine.conv_width and layer.has_recurrence == mine.has_recurrence
                    and (layer.conv_window is None) == (mine.conv_window is None)
                    and (layer.conv_window is None or layer.conv_window.shape[1:] == mine.conv_window.shape[1:]))
            if not same:
                raise ValueError(f"SSM layer {idx}: the source's conv window / recurrence differs from this cache's")
        if n == 0:
            return
        src_rows = source_rows.to(source.device)
        # each buffer indexed with the rows on its own device (copied once per device where the
        # layers spread), each SSM layer's strategy run with its device current
        mine_rows, their_rows = {rows.device: rows}, {src_rows.device: src_rows}

        def on(index: dict, dev: torch.device) -> torch.Tensor:
            if dev not in index:
                index[dev] = next(iter(index.values())).to(dev)
            return index[dev]

        for idx, (k, v) in source.kv.items():
            for buf, new in zip(self.kv[idx], (k, v)):
                buf[on(mine_rows, buf.device)] = new[on(their_rows, new.device)].to(buf)
        self.pad[rows] = source.pad[on(their_rows, source.device)].to(self.device)
        self.seq_len[rows] = source.seq_len[on(their_rows, source.device)].to(self.device)
        for idx, layer in source.ssm.items():
            mine = self.ssm[idx]
            dev = mine.device or self.device
            with on_device(dev):
                if layer.conv_window is not None:
                    win = mine.conv_window
                    win[on(mine_rows, win.device)] = layer.conv_window[on(their_rows, layer.conv_window.device)].to(win)
                if mine.has_recurrence:
                    state = layer.ssm_state()
                    state = state[on(their_rows, state.device)].to(dev)
                    mine.strategy.reset_rows(mine.store, mine.op, mine.params, on(mine_rows, dev), state)
        self.refresh_mirrors()

    def load_rows(self, rows, length: int, pad: torch.Tensor, keys_values: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  ssm_states: dict[int, tuple[torch.Tensor | None, torch.Tensor | None, int]]) -> None:
        """Give batch slots ``rows`` to new sequences prefilled elsewhere, written in place: what
        :meth:`reset_rows` from a cache of their own, loaded with their prefill, leaves in them,
        without that cache (its allocation, its load and the copy out of it). For each ``i`` slot
        ``rows[i]`` takes ``length`` columns of keys / values (the rest zero), ``pad[i]`` and
        ``seq_len = length``, and each SSM layer's conv window (the last ``W - 1`` inputs, then
        zeros) and committed state (:meth:`SSMLayerCache.reset_state_rows`, through its rollback
        strategy's ``reset_rows``). The
        other rows keep their committed state bit for bit.

        Args:
            rows: ``[n]`` int (LongTensor or list): distinct slot indices in ``[0, batch)``.
            length: L, the prompts' left-padded width (``L <= max_len``).
            pad: ``[n]`` int64: each prompt's left padding.
            keys_values: ``{layer: (keys, values)}``, each ``[n, H, L, D]``, for every attention layer.
            ssm_states: ``{layer: (conv_state, recurrent_state, conv width)}`` for every SSM layer,
                as :meth:`SSMLayerCache.load` takes them (``[n, ...]``).

        Raises:
            ValueError: a step is open (commit it first); ``rows`` not integers, out of range,
                repeated or not 1-D; a layer missing or extra, or a state of another shape than
                this cache's; ``length`` beyond ``max_len``. Everything is checked before the first
                write: a refused call leaves the cache as it was.
        """
        slots = self.check_load_rows(rows)
        n = len(slots)
        # slots side by side (one admitted row, or free rows in a run) as a slice: no index copied to
        # the device (a copy from host memory waits for it) and views, so one copy for every layer
        first = slots[0] if slots else 0
        if slots == list(range(first, first + n)):
            rows = slice(first, first + n)
        else:
            rows = torch.tensor(slots, dtype=torch.long, device=self.device)
        if set(keys_values) != set(self.kv) or set(ssm_states) != set(self.ssm):
            raise ValueError(f"load_rows needs the states of every layer of this cache: attention layers "
                             f"{sorted(self.kv)} and SSM layers {sorted(self.ssm)}, got {sorted(keys_values)} and "
                             f"{sorted(ssm_states)}")
        if length > self.max_len:
            raise ValueError(f"load_rows: prompts of {length} columns do not fit this cache's {self.max_len}")
        # every check before the first write: a refused call leaves the rows as they were
        for idx, (k, v) in keys_values.items():
            for buf, new in zip(self.kv[idx], (k, v)):
                if new.shape != (n, buf.shape[1], length, buf.shape[3]):
                    raise ValueError(f"attention layer {idx}: keys / values of shape {tuple(new.shape)} for "
                                     f"{n} rows of {length} columns do not fit buffers {tuple(buf.shape)}")
        if pad.shape != (n,):
            raise ValueError(f"load_rows: pad of shape {tuple(pad.shape)} for {n} rows")
        for idx, (conv_state, state, conv_width) in ssm_states.items():
            self.ssm[idx].check_load_rows(n, conv_state, state, conv_width)
        if self.mirrors:  # (each device's buffers with rows there; each device's layers with it current)
            index = {self.device: rows}
            for dev in self.mirrors:
                index[dev] = rows if isinstance(rows, slice) else rows.to(dev)
            for idx, (k, v) in keys_values.items():
                at = index[self._kv_device(idx)]
                for buf, new in zip(self.kv[idx], (k, v)):
                    buf[at, :, :length] = new.to(buf)
                    buf[at, :, length:] = 0
            for idx, (conv_state, state, _) in ssm_states.items():
                layer = self.ssm[idx]
                dev = layer.device or self.device
                with on_device(dev):
                    if conv_state is not None:
                        _load_windows([layer], [conv_state.to(dev)], rows=index[dev])
                    layer.reset_state_rows(index[dev], None if state is None else state.to(dev))
            self.pad[rows] = pad.to(self.pad)
            self.seq_len[rows] = length
            self.refresh_mirrors()
            return
        kv = [(buf, new) for idx, (k, v) in keys_values.items() for buf, new in zip(self.kv[idx], (k, v))]
        if isinstance(rows, slice) and kv:
            torch._foreach_copy_([buf[rows, :, :length] for buf, _ in kv], [new for _, new in kv])
            torch._foreach_zero_([buf[rows, :, length:] for buf, _ in kv])
        else:
            for buf, new in kv:
                buf[rows, :, :length] = new.to(buf.dtype)
                buf[rows, :, length:] = 0
        self.pad[rows] = pad.to(self.pad)
        self.seq_len[rows] = length
        windows = [(self.ssm[idx], conv_state) for idx, (conv_state, _, _) in ssm_states.items()
                   if conv_state is not None]
        if windows:
            _load_windows(*map(list, zip(*windows)), rows=rows)
        for idx, (_, state, _) in ssm_states.items():
            self.ssm[idx].reset_state_rows(rows, state)

    def check_load_rows(self, rows) -> list[int]:
        """``rows`` as :meth:`load_rows` takes them, checked (a host list of ints back); ValueError
        when they are not distinct slots in ``[0, batch)``, a step is open, or no prefill has
        loaded this cache yet (its buffers are made by the first one)."""
        self._check_closed("load_rows", "this cache")
        if not self.kv and all(layer.state_shape is None and layer.conv_window is None for layer in self.ssm.values()):
            raise ValueError("load_rows: this cache holds nothing yet (its buffers are made by its first prefill); "
                             "prefill the whole cache first")
        return _row_index(rows, self.batch, "rows", "cpu").tolist()

    def _check_closed(self, what: str, name: str) -> None:
        """Raise ValueError when a step is open on this cache (``what`` needs none; ``name``: this
        cache in the message)."""
        if self.step_tokens or any(layer.step_tokens for layer in self.ssm.values()):
            raise ValueError(f"{what} needs no open step, but {name} has "
                             f"{self.step_tokens or max(layer.step_tokens for layer in self.ssm.values())} step "
                             "tokens run and not committed: commit the step first (commit zeros to discard it)")

    def advance(self, t: int) -> None:
        """Mark ``t`` more step tokens as run (called after a forward)."""
        self.step_tokens += t
        for layer in self.ssm.values():
            layer.advance(t)

    def commit(self, num_tokens: torch.Tensor) -> None:
        """Per row, keep the first ``num_tokens[b]`` tokens of the open step; close it.

        In static mode the bounds checks are skipped (they need the values on the host); the
        static decode path guarantees ``0 <= num_tokens <= step tokens`` and sizes ``max_len``
        for the whole generation.
        """
        if self.mirrors:
            self._commit_spread(num_tokens if self.static else self._checked(num_tokens))
            return
        if self.static:
            for layer in self.ssm.values():
                layer.commit(num_tokens)
            self.seq_len += num_tokens
            self.step_tokens = 0
            return
        num_tokens = self._checked(num_tokens)
        for layer in self.ssm.values():
            layer.commit(num_tokens)
        self.seq_len += num_tokens
        self.step_tokens = 0
        self._check_room()

    def _checked(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """``num_tokens`` of an eager :meth:`commit` as int64 on the home device, checked."""
        if num_tokens.shape != (self.batch,):
            raise ValueError(f"num_tokens must have shape [{self.batch}], got {tuple(num_tokens.shape)}")
        num_tokens = num_tokens.to(device=self.device, dtype=torch.long)
        if bool(((num_tokens < 0) | (num_tokens > self.step_tokens)).any()):
            raise ValueError(f"num_tokens must be in [0, {self.step_tokens}], got {num_tokens.tolist()}")
        return num_tokens

    def _check_room(self) -> None:
        if int(self.seq_len.max()) + self.max_step_tokens > self.max_len:
            raise ValueError("KV cache is full: raise max_len (prompt + max_new_tokens + num_speculative_tokens + 1)")

    def _commit_spread(self, num_tokens: torch.Tensor, copies: dict | None = None) -> None:
        """:meth:`commit` where the layers spread over several devices: ``num_tokens`` (home,
        int64, checked) copied once to every other device (``copies``: already copied), each SSM
        layer committed with its device's copy and that device current, every ``seq_len`` copy
        advanced by its own."""
        num = self._copies(num_tokens) if copies is None else copies
        for dev, layers in self._ssm_by_device().items():
            with on_device(dev):
                for layer in layers:
                    layer.commit(num[dev])
        self.seq_len += num_tokens
        for dev, mirror in self.mirrors.items():
            mirror += num[dev]
        self.step_tokens = 0
        if not self.static:
            self._check_room()
