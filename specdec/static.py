"""The static decode path: fixed shapes, device-side bookkeeping and CUDA graphs.

For one shape bucket (batch B, step tokens T = K + 1, KV columns ``max_len``) a
:class:`StaticDecoder` keeps one :class:`~specdec.cache.HybridCache` in static mode (every
forward reads all ``max_len`` KV columns, commit runs no host-side checks) and, on CUDA, two
CUDA graphs captured once and replayed every step:

* the target's verify forward of T tokens (all decoder layers, the SSM verify kernels of the
  rollback strategy, the LM head) into static ``logits [B, T, V]`` / ``hidden [B, T, D]``;
* the commit of ``num_tokens [B]`` (conv-window shift, the strategy's commit / fold, KV length).

With a draft tree (:class:`~specdec.tree.TreeSpec`, Medusa drafting) T is the tree's node
count, the forward runs under :func:`~specdec.tree.tree_view` (tree mask and positions, each
SSM node from its parent's state) and the commit is :func:`~specdec.tree.commit_path` of each
row's accepted path ``[B, depth + 1]``: both are captured the same way.

Later ``generate()`` calls of the same bucket prefill into a fresh cache and copy it into the
static buffers (:meth:`HybridCache.copy_from`), so the graphs stay valid. Capturing follows
PyTorch's recipe (warm-up on a side stream, then ``torch.cuda.graph``); a forward run outside
a commit changes no committed state (it only writes step slots), so the warm-up is harmless.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .cache import HybridCache
from .fusion import fused, fusion_enabled
from .tree import commit_path, tree_view

__all__ = ["StaticDecoder", "bucket_length"]


def bucket_length(n: int, multiple: int = 256) -> int:
    """KV columns for ``n`` needed ones, rounded up so nearby lengths share one CUDA graph."""
    return -(-n // multiple) * multiple


def _grouped_mm_is_graph_safe(weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs its CUDA kernel on these weights: bf16 on sm90 / sm100
    only; elsewhere (other dtypes, other GPUs, CPU) PyTorch's fallback copies the group offsets
    to the host, which a CUDA graph cannot capture."""
    if weight.dtype != torch.bfloat16 or not weight.is_cuda:
        return False
    return torch.cuda.get_device_capability(weight.device)[0] in (9, 10)


def _host_syncing_experts(model: torch.nn.Module) -> list:
    """Configs of the model's mixture-of-experts blocks whose experts implementation syncs with
    the host, so it cannot be captured: transformers' ``"eager"`` experts (``nonzero`` to find the
    hit experts) and ``"grouped_mm"`` where :func:`_grouped_mm_is_graph_safe` says no."""
    configs = {}
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        impl = getattr(cfg, "_experts_implementation", None)
        weight = getattr(mod, "gate_up_proj", None)
        if weight is None:
            weight = getattr(mod, "up_proj", None)
        if impl is None or not hasattr(mod, "has_gate") or not isinstance(weight, torch.Tensor):
            continue  # not a transformers experts module (``@use_experts_implementation``)
        if impl == "eager" or (impl == "grouped_mm" and not _grouped_mm_is_graph_safe(weight)):
            configs[id(cfg)] = cfg
    return list(configs.values())


@contextlib.contextmanager
def graph_safe_experts(model: torch.nn.Module):
    """Inside the block, mixture-of-experts blocks whose experts implementation syncs with the
    host (:func:`_host_syncing_experts`) run transformers' ``"batched_mm"`` experts instead
    (gathers each token's expert weights and multiplies batched: no host sync, so it can be
    captured; its memory grows with tokens x top-k x expert size: small for a chain step's B x
    (K + 1) tokens, B x N for a draft tree's N nodes, e.g. 64 x batch for Medusa's 64-node tree). The model's setting is restored on exit; a captured graph keeps the batched kernels."""
    configs = _host_syncing_experts(model)
    saved = [cfg._experts_implementation for cfg in configs]
    if configs:
        warnings.warn(
            f"the model's experts implementation ({', '.join(sorted(set(saved)))}) syncs with the host for these "
            "weights (dtype / GPU); the CUDA graph is captured with transformers' 'batched_mm' experts instead",
            RuntimeWarning, stacklevel=4,
        )
    try:
        for cfg in configs:
            cfg._experts_implementation = "batched_mm"
        yield
    finally:
        for cfg, impl in zip(configs, saved, strict=True):
            cfg._experts_implementation = impl


class StaticDecoder:
    """Static cache + (optionally) CUDA graphs of the verify forward and the commit.

    Args:
        adapter: the target's :class:`~specdec.models.HybridAdapter`. strategy: rollback strategy.
        batch, step_tokens, max_len: the bucket (B, T, KV columns).
        cuda_graphs: capture and replay CUDA graphs (CUDA only); else run the same static calls eagerly.
        fuse: while capturing, run the model's norms/MLPs and our SSM input preparation through
            ``torch.compile`` (:mod:`specdec.fusion`; default: ``SPECDEC_FUSE``, on).
        tree: a draft tree (:class:`~specdec.tree.TreeSpec`) whose ``num_nodes`` is
            ``step_tokens``: every forward verifies the tree, every commit is :meth:`commit_path`.

    Raises: ValueError when ``tree`` does not have ``step_tokens`` nodes.
    """

    def __init__(self, adapter, strategy, batch: int, step_tokens: int, max_len: int, cuda_graphs: bool,
                 fuse: bool | None = None, tree=None):
        if tree is not None and tree.num_nodes != step_tokens:
            raise ValueError(f"a tree bucket's step_tokens must be the tree's node count {tree.num_nodes}, "
                             f"got {step_tokens}")
        self.tree = tree
        self.adapter = adapter
        self.fuse = fusion_enabled() if fuse is None else bool(fuse)
        self.strategy = strategy
        self.batch, self.step_tokens, self.max_len = batch, step_tokens, max_len
        self.cuda_graphs = bool(cuda_graphs)
        self.cache: HybridCache | None = None
        self._fwd_graph = self._commit_graph = None
        self.capture_error: str | None = None

    def new_cache(self) -> HybridCache:
        """A fresh cache of this bucket, for the prefill."""
        return self.adapter.new_cache(self.batch, self.max_len, self.step_tokens, self.strategy, static=True)

    @property
    def path(self) -> str:
        return "cuda_graph" if self._fwd_graph is not None else "static"

    def load(self, fresh: HybridCache) -> None:
        """Make ``fresh`` (just prefilled) the committed state: adopt it on first use (and capture
        the graphs), else copy it into the buffers the graphs point at."""
        if self.cache is None:
            self.cache = fresh
            if self.cuda_graphs:
                self._capture()
        else:
            self.cache.copy_from(fresh)

    # ------------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor):
        if self.tree is None:
            return self.adapter.forward(ids, self.cache)
        with tree_view(self.adapter, self.cache, self.tree):
            return self.adapter.forward(ids, self.cache)

    def _commit(self, num_tokens: torch.Tensor, path: torch.Tensor | None) -> None:
        if self.tree is None:
            self.cache.commit(num_tokens)
        else:
            commit_path(self.cache, path, num_tokens)

    def _capture(self) -> None:
        c, B, T = self.cache, self.batch, self.step_tokens
        dev = c.device
        self._ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        self._num = torch.zeros(B, dtype=torch.long, device=dev)
        # a tree's accepted path; all zeros with zero tokens moves nothing (commit_path keeps the identity)
        self._path = None if self.tree is None else torch.zeros(B, self.tree.max_depth + 1, dtype=torch.long, device=dev)
        try:
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with fused(self.adapter.model, self.fuse), graph_safe_experts(self.adapter.model):
                with torch.cuda.stream(side):
                    for _ in range(2):  # compiles the kernels, allocates lazy buffers (replay history, tree tables)
                        self._forward(self._ids)
                        self._commit(self._num, self._path)  # zero tokens: no committed state changes
                torch.cuda.current_stream(dev).wait_stream(side)
                fwd = torch.cuda.CUDAGraph()
                with torch.cuda.graph(fwd):
                    self._logits, self._hidden = self._forward(self._ids)
            com = torch.cuda.CUDAGraph()
            with torch.cuda.graph(com, pool=fwd.pool()):
                self._commit(self._num, self._path)
            self._fwd_graph, self._commit_graph = fwd, com
            if self.tree is not None:  # the graphs read the tree's index tables: own them (module caches evict)
                from .kernels import tree_index

                self._tables = tree_index.cached_tensors()
        except Exception as err:  # noqa: BLE001 -- any capture failure (an op that syncs on the host): run eagerly
            self.capture_error = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"CUDA-graph capture failed ({self.capture_error}); decoding runs the static path without "
                "graphs (slower: one kernel launch per op)", RuntimeWarning, stacklevel=3,
            )
            self._fwd_graph = self._commit_graph = None
        c.set_step_tokens(0)

    # ------------------------------------------------------------------------------------
    def forward(self, step: torch.Tensor):
        """Verify forward of ``step [B, T]``; returns ``(logits [B, T, V], hidden [B, T, D])``
        (with graphs: the static output tensors, valid until the next call)."""
        if self._fwd_graph is None:
            return self._forward(step)
        self._ids.copy_(step)
        self._fwd_graph.replay()
        self.cache.set_step_tokens(self.step_tokens)
        return self._logits, self._hidden

    def commit(self, num_tokens: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """Keep ``num_tokens [B]`` (int64, on the device, ``<= T``) tokens of the open step per row;
        for a tree bucket, the first ``num_tokens`` nodes of each row's ``path [B, depth + 1]``
        (int64 node indices, ``path[:, 0] = 0``; see :func:`~specdec.tree.commit_path`).

        Raises: ValueError when a tree bucket gets no path or a chain bucket gets one."""
        if (path is None) != (self.tree is None):
            raise ValueError("a tree bucket commits a path: pass path=[B, depth + 1]" if self.tree is not None
                             else "path= is for tree buckets; this bucket verifies chains")
        if self._commit_graph is None:
            self._commit(num_tokens, path)
            return
        self._num.copy_(num_tokens)
        if path is not None:
            self._path.copy_(path)
        self._commit_graph.replay()
        self.cache.set_step_tokens(0)
