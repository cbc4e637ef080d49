"""Decoders: how the target's steps run. One interface, two implementations.

The decode loop (:meth:`specdec.engine.SpeculativeGenerator.generate`) drives a
:class:`Decoder` the same way for chains and trees: ``prefill`` the prompts, then per step
``forward`` the step's tokens and ``commit`` each row's kept tokens (a tree step: its accepted
path). What differs is how shapes and host work are handled:

* :class:`EagerDecoder` (``decode_path="eager"``): dynamic shapes. A cache sized for the call;
  each chain step runs ``1 + max(k)`` tokens (the longest row's drafts: one host sync), and the
  cache checks every commit on the host.
* :class:`StaticDecoder` (``"static"`` / ``"cuda_graph"``): fixed shapes for one bucket (batch B,
  step tokens T, KV columns ``max_len``). Every step runs T tokens (rows with fewer drafts carry
  placeholders that never reach a committed state), the cache is in static mode (every forward
  reads all ``max_len`` KV columns, commit runs no host-side checks) and, on CUDA, the verify
  forward and the commit are CUDA graphs captured once (:func:`specdec.graphs.capture`) and
  replayed every step. Later calls of the same bucket prefill into a fresh cache and copy it
  into the static buffers (:meth:`HybridCache.copy_from`), so the graphs stay valid.

With a draft tree (:class:`~specdec.tree.TreeSpec`) the cache is in tree mode
(:meth:`HybridCache.set_tree`): every forward runs the tree's N nodes and ``commit`` takes each
row's accepted path.
"""

from __future__ import annotations

import abc
import contextlib
import warnings

import torch

from .cache import HybridCache
from .graphs import CaptureFailure, bucket_length, capture
from .kernels import tree_index
from .rollback import RollbackStrategy

__all__ = ["Decoder", "EagerDecoder", "StaticDecoder"]


class Decoder(abc.ABC):
    """The target's steps for one batch shape.

    Attributes:
        cache: the :class:`~specdec.cache.HybridCache` of the last :meth:`prefill`.
        tree: the draft tree every step verifies, or None (chains).
        step_tokens: the most tokens one forward runs (T = K + 1, or the tree's node count N).
        path: ``"eager"``, ``"static"`` or ``"cuda_graph"``: how the steps run.
        prompt_path: the same for prompt forwards (:meth:`specdec.models.HybridAdapter.prefill`).
        capture_error: why CUDA graphs were asked for but not used (the capture's error), or None.
    """

    def __init__(self, adapter, strategy: RollbackStrategy, batch: int, step_tokens: int, tree=None):
        if tree is not None and tree.num_nodes != step_tokens:
            raise ValueError(f"a tree decoder's step_tokens must be the tree's node count {tree.num_nodes}, "
                             f"got {step_tokens}")
        self.adapter = adapter
        self.strategy = strategy
        self.batch = batch
        self.step_tokens = step_tokens
        self.tree = tree
        self.cache: HybridCache | None = None
        self.capture_error: str | None = None

    @property
    @abc.abstractmethod
    def path(self) -> str: ...

    @abc.abstractmethod
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_hidden_states: bool = False,
                prefix_cache=None, max_tokens: int | None = None):
        """Run the prompts ``[B, L]`` (left-padded, int64; mask 0/1) into a fresh committed state
        (through ``prefix_cache``, a :class:`~specdec.prefix_cache.PrefixCache`, when given; in
        forwards of at most ``max_tokens`` tokens, padding included, when given:
        :meth:`HybridAdapter.prefill <specdec.models.HybridAdapter.prefill>`); returns
        ``(logits [B, V], hidden [B, D])`` at each row's last prompt token (with
        ``all_hidden_states``, ``hidden [B, L, D]`` of every position)."""

    def width(self, num_drafts: torch.Tensor, num_speculative_tokens: int) -> int:
        """Tokens the next chain forward runs when row b verifies ``num_drafts[b]`` drafts (``[B]``
        int64 on the device) of a step that asked for ``num_speculative_tokens`` (K, with
        ``K + 1 <= step_tokens``): ``K + 1`` (static shapes: one shape per K), or fewer. A tree
        forward always runs the tree's ``step_tokens`` nodes."""
        return num_speculative_tokens + 1

    def prepare(self, widths) -> None:
        """Make every chain step width in ``widths`` ready to run without first-use work (the
        CUDA-graph path captures the widths it lacks; other paths have nothing to prepare)."""

    @abc.abstractmethod
    def forward(self, tokens: torch.Tensor, plain: bool = False):
        """Verify forward of ``tokens [B, t]`` (``t = width(...)``; a tree: its N node tokens);
        returns ``(logits [B, t, V], hidden [B, t, D])``.

        ``plain``: a step of one token per row that speculates nothing (K = 0) runs as plain
        decoding, updating the SSM states in place (:meth:`HybridCache.set_plain`) where the
        strategy can (:attr:`RollbackStrategy.has_plain_steps`); its commit must keep the token of
        every row whose state is read again. A decoder of one-token steps always runs them so."""

    def runs_plain(self, t: int, plain: bool) -> bool:
        """Whether a chain forward of ``t`` tokens asked with ``plain`` runs as a plain step (see
        :meth:`forward`)."""
        if t != 1 or self.tree is not None or not self.strategy.has_plain_steps:
            return False
        return plain or self.step_tokens == 1

    @abc.abstractmethod
    def commit(self, num_tokens: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """Keep ``num_tokens [B]`` (int64, on the device, ``<= t``) tokens of the open step per row;
        a tree step keeps the first ``num_tokens`` nodes of each row's ``path [B, depth + 1]`` (int64
        node indices, ``path[:, 0] = 0``; :meth:`HybridCache.commit_path`).

        Raises: ValueError when a tree step gets no path or a chain step gets one."""

    def _check_path(self, path) -> None:
        if (path is None) != (self.tree is None):
            raise ValueError("a tree step commits a path: pass path=[B, depth + 1]" if self.tree is not None
                             else "path= is for tree steps; this decoder verifies chains")

    def _commit(self, num_tokens: torch.Tensor, path: torch.Tensor | None) -> None:
        if self.tree is None:
            self.cache.commit(num_tokens)
        else:
            self.cache.commit_path(path, num_tokens)


class EagerDecoder(Decoder):
    """Dynamic shapes: a cache per ``generate()`` call of ``max_len`` KV columns; chain steps run
    ``1 + max(k)`` tokens.

    Args:
        adapter: the target's :class:`~specdec.models.HybridAdapter`. strategy: rollback strategy.
        batch: B. step_tokens: the most tokens of one forward. max_len: KV columns.
        tree: a draft tree whose ``num_nodes`` is ``step_tokens``, or None.
    """

    def __init__(self, adapter, strategy, batch: int, step_tokens: int, max_len: int, tree=None):
        super().__init__(adapter, strategy, batch, step_tokens, tree)
        self.max_len = max_len

    @property
    def path(self) -> str:
        return "eager"

    prompt_path = "eager"

    def prefill(self, input_ids, attention_mask, all_hidden_states=False, prefix_cache=None, max_tokens=None):
        self.cache = self.adapter.new_cache(self.batch, self.max_len, self.step_tokens, self.strategy)
        out = self.adapter.prefill(input_ids, attention_mask, self.cache, all_hidden_states, prefix_cache=prefix_cache,
                                   max_tokens=max_tokens)
        self.cache.set_tree(self.tree)
        return out

    def width(self, num_drafts, num_speculative_tokens):
        return 1 + int(num_drafts.max())  # the longest row's drafts (one host sync)

    def forward(self, tokens, plain=False):
        self.cache.set_plain(self.runs_plain(tokens.shape[1], plain))
        return self.adapter.forward(tokens, self.cache)

    def commit(self, num_tokens, path=None):
        self._check_path(path)
        self._commit(num_tokens, path)


class _Graphs:
    """The CUDA graphs of one step width t (a plain step or not): the verify forward of
    ``ids [B, t]`` (outputs ``logits`` / ``hidden``) and the commit that follows it."""

    def __init__(self, forward, commit, ids, logits, hidden):
        self.forward, self.commit = forward, commit
        self.ids, self.logits, self.hidden = ids, logits, hidden


class StaticDecoder(Decoder):
    """Static cache + (optionally) CUDA graphs of the verify forward and the commit.

    Args:
        adapter: the target's :class:`~specdec.models.HybridAdapter`. strategy: rollback strategy.
        batch, step_tokens, max_len: the bucket (B, the most tokens of one step T, KV columns).
        cuda_graphs: capture and replay CUDA graphs (CUDA only); else run the same static calls eagerly.
        fuse: while capturing, run the model's norms/MLPs and our SSM input preparation through
            ``torch.compile`` (:mod:`specdec.fusion`; default: ``SPECDEC_FUSE``, on).
        tree: a draft tree (:class:`~specdec.tree.TreeSpec`) whose ``num_nodes`` is
            ``step_tokens``: every forward verifies the tree, every commit takes a path.

    A chain step may run any width ``t <= step_tokens`` (``num_speculative_tokens="auto"`` varies
    it per step): each width is its own static shape, with its own pair of graphs, captured on
    its first forward (the full width ``step_tokens`` at the first prefill); a plain step
    (``forward(..., plain=True)``) has its own pair too. A capture's warm-up commits zero tokens,
    which leaves the committed state as it was, except in a plain step, which writes it in place:
    that one is captured inside :meth:`HybridCache.plain_state_kept` (one copy of the SSM states
    while it runs).

    Raises: ValueError when ``tree`` does not have ``step_tokens`` nodes.
    """

    def __init__(self, adapter, strategy, batch: int, step_tokens: int, max_len: int, cuda_graphs: bool,
                 fuse: bool | None = None, tree=None):
        super().__init__(adapter, strategy, batch, step_tokens, tree)
        self.max_len = max_len
        self.cuda_graphs = bool(cuda_graphs)
        self.fuse = fuse
        self._graphs: dict[tuple[int, bool], _Graphs] = {}  # (step width, plain step) -> its graphs
        self._open: _Graphs | None = None  # the graphs of the open step's forward
        self._capture_failed = False  # a capture failed: every width runs without graphs
        self._open_width = 0  # tokens of the open chain step that keeps rollback data (0: none, or plain)
        self._history = 0  # the most committed tokens a row's rollback history may hold (_size_fold)
        #: what the decode loop keeps with this bucket between calls of one shape (the captured
        #: programs of a step and the rows and counters they read: ``specdec.engine._StepPrograms``), or None
        self.loop_state = None

    @classmethod
    def bucket(cls, adapter, strategy, batch: int, step_tokens: int, needed_len: int, cuda_graphs: bool, tree=None):
        """The decoder of the bucket holding ``needed_len`` KV columns (rounded up by
        :func:`~specdec.graphs.bucket_length`, so nearby lengths share one set of graphs)."""
        return cls(adapter, strategy, batch, step_tokens, bucket_length(needed_len), cuda_graphs, tree=tree)

    @property
    def key(self) -> tuple:
        return self.batch, self.step_tokens, self.max_len, self.cuda_graphs, self.tree

    def new_cache(self) -> HybridCache:
        """A fresh cache of this bucket, for the prefill."""
        return self.adapter.new_cache(self.batch, self.max_len, self.step_tokens, self.strategy, static=True)

    @property
    def path(self) -> str:
        return "cuda_graph" if self._graphs else "static"

    @property
    def prompt_path(self) -> str:
        """How prompts run (:meth:`specdec.models.HybridAdapter.prefill`'s ``prompt_path``): at
        bucketed shapes, captured as CUDA graphs when the steps are."""
        return "cuda_graph" if self.cuda_graphs else "static"

    def prefill(self, input_ids, attention_mask, all_hidden_states=False, prefix_cache=None, max_tokens=None):
        fresh = self.new_cache()
        out = self.adapter.prefill(input_ids, attention_mask, fresh, all_hidden_states, prefix_cache=prefix_cache,
                                   max_tokens=max_tokens, prompt_path=self.prompt_path)
        self.load(fresh)
        return out

    def load(self, fresh: HybridCache) -> None:
        """Make ``fresh`` (just prefilled) the committed state: adopt it on first use (and capture
        the graphs of the full width), else copy it into the buffers the graphs point at."""
        self._history = 0  # (a prefilled cache holds no rollback history)
        if self.cache is None:
            self.cache = fresh
            self.cache.set_tree(self.tree)
            self.cache.flush_graphs = self.cuda_graphs
            if self.cuda_graphs:
                self._capture(self.step_tokens, self.runs_plain(self.step_tokens, False))
        else:
            self.cache.copy_from(fresh)

    def _size_fold(self, t: int, plain: bool) -> None:
        """Before a forward (or capture) of ``t`` tokens: a chain step narrower than the decoder
        (``num_speculative_tokens="auto"`` runs every K on one decoder sized for the largest) folds
        replay's committed history as a decoder sized for ``t`` would
        (:meth:`HybridCache.set_fold_max`); when the step committed before it was wider, its
        history is flushed first (:meth:`HybridCache.flush`: one fold per SSM layer; at most once
        per change to a smaller K)."""
        c = self.cache
        if plain or self.tree is not None or t >= self.step_tokens:
            c.set_fold_max(None)
            return
        if self._history > t and self.strategy.sizes_fold:
            c.flush()
            self._history = 0
        c.set_fold_max(t)

    def _capture(self, t: int, plain: bool) -> _Graphs | None:
        """Capture the forward of ``t`` step tokens (a plain step or not) and its commit (no
        committed state changes: the warm-up commits zero tokens, and a plain step's runs inside
        :meth:`HybridCache.plain_state_kept`); on failure record why and run without graphs from now on."""
        c = self.cache
        self._size_fold(t, plain)  # (the warm-up verifies on the committed state: its fold must fit)
        with contextlib.ExitStack() as stack:
            c.set_plain(plain)
            if plain:
                try:
                    stack.enter_context(c.plain_state_kept())
                except torch.OutOfMemoryError as err:
                    return self._capture_failed_with(CaptureFailure("a plain step (its warm-up's copy of the SSM "
                                                                    "states)", err))
            return self._capture_step(t, plain)

    def _capture_failed_with(self, err: CaptureFailure) -> None:
        self.capture_error = err.reason
        warnings.warn(f"{err}; decoding runs the static path without graphs (slower: one kernel launch per op)",
                      RuntimeWarning, stacklevel=5)
        self._capture_failed = True
        self._graphs.clear()
        self.cache.flush_graphs = False
        self.cache.set_step_tokens(0)

    def _capture_step(self, t: int, plain: bool) -> _Graphs | None:
        c, B = self.cache, self.batch
        dev = c.device
        ids = torch.zeros(B, t, dtype=torch.long, device=dev)
        if self._graphs:  # one token-count buffer and path buffer for every width
            num, path = self._num.zero_(), self._path  # zeros: the warm-up commits nothing
            if path is not None:
                path.zero_()
        else:
            num = self._num = torch.zeros(B, dtype=torch.long, device=dev)
            # a tree's accepted path; all zeros with zero tokens moves nothing (commit_path keeps the identity)
            path = self._path = (None if self.tree is None
                                 else torch.zeros(B, self.tree.max_depth + 1, dtype=torch.long, device=dev))
        model = self.adapter.model

        def warm():  # compiles the kernels, allocates lazy buffers (replay history, tree tables)
            self.adapter.forward(ids, c)
            self._commit(num, path)  # zero tokens: no committed state changes

        # every width shares one memory pool: a width's temporaries may reuse another's, which is
        # safe because each replay's outputs are read before any other width replays
        pool = next(iter(self._graphs.values())).forward.pool() if self._graphs else None
        try:
            fwd, (logits, hidden) = capture(lambda: self.adapter.forward(ids, c), model=model,
                                            what="the verify forward", warmup_fn=warm, fuse=self.fuse, pool=pool)
            com, _ = capture(lambda: self._commit(num, path), model=model, what="the commit", warmup=0,
                             fuse=self.fuse, pool=fwd.pool())
        except CaptureFailure as err:
            return self._capture_failed_with(err)
        graphs = self._graphs[t, plain] = _Graphs(fwd, com, ids, logits, hidden)
        if self.tree is not None:  # the graphs read the tree's index tables: own them (module caches evict)
            self._tables = tree_index.cached_tensors()
        c.set_step_tokens(0)
        return graphs

    def prepare(self, widths) -> None:
        for t in widths:
            if not self.cuda_graphs or self._capture_failed:
                return
            key = t, self.runs_plain(t, t == 1)  # (a step of one token speculates nothing: a plain step)
            if key not in self._graphs:
                self._capture(*key)

    def forward(self, tokens, plain=False):
        """With graphs, the outputs are the static tensors of the step's width, valid until the
        next forward of that width."""
        key = t, plain = tokens.shape[1], self.runs_plain(tokens.shape[1], plain)
        graphs = self._graphs.get(key)
        if graphs is None and self.cuda_graphs and not self._capture_failed:
            graphs = self._capture(t, plain)
        self._size_fold(t, plain)
        self._open = graphs
        self.cache.set_plain(plain)  # (entering plain mode flushes the strategies' rollback data)
        self._open_width = 0 if plain else t
        if plain:
            self._history = 0
        if graphs is None:
            return self.adapter.forward(tokens, self.cache)
        graphs.ids.copy_(tokens)
        graphs.forward.replay()
        self.cache.set_step_tokens(t)
        return graphs.logits, graphs.hidden

    def commit(self, num_tokens, path=None):
        self._check_path(path)
        graphs, self._open = self._open, None
        self._history, self._open_width = self._open_width, 0
        if graphs is None:
            self._commit(num_tokens, path)
            return
        self._num.copy_(num_tokens)
        if path is not None:
            self._path.copy_(path)
        graphs.commit.replay()
        self.cache.set_step_tokens(0)
