"""Tree drafting and tree verification through attention KV *and* SSM state.

A draft *tree* (Medusa, Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads") holds several candidate continuations that share prefixes. It is
given in Medusa's format: a list of paths, each a sequence of top-k ranks, one per Medusa head.
``[1, 0]`` is the node whose token is head 0's second-best token followed by head 1's best
token; every path's prefix must be in the tree. Node 0 (the root) is the pending token.

One tree step (the chain step of DESIGN.md, generalised):

1. The drafter gives each node a token (:meth:`MedusaDrafter.propose_tree`).
2. The target runs all N nodes in ONE forward. Node j sits at KV column ``seq_len + j`` (BFS
   order), has position ``seq_len - pad + depth(j)`` and, through the tree attention mask, sees
   the committed prefix plus its own ancestors. SSM layers (STree, Wu et al. 2025, "STree:
   Speculative Tree Decoding for Hybrid State-Space Models") start each node from its
   *parent's* state, and each node's conv window is its ancestor chain
   (:mod:`specdec.kernels.tree_index`); the rollback strategy keeps per-node states (snapshot,
   ring) or per-node replay inputs (replay).
3. Acceptance picks the deepest node whose path the target accepts (:func:`accept_tree`).
4. Commit: the accepted path's KV columns, conv inputs and per-node SSM data move to the step's
   first positions (:func:`commit_path`), then the cache commits them exactly as a chain
   (state := the state after the last accepted node).

Acceptance: greedy (the path whose tokens equal the target's argmax along it; the output equals
plain greedy decoding), lossless sampling (sample the target at each node and follow the child
holding the sampled token: with deterministic top-k candidates this is SpecInfer's
multi-candidate rejection sampling, Miao et al. 2024, and keeps the target's distribution
exactly), or Medusa's *typical acceptance* (``acceptance="typical"``: a candidate is accepted
when its target probability exceeds ``min(posterior_threshold, posterior_alpha * exp(-H))``;
NOT distribution-preserving, faster on weak drafters).

Backends: the tree's SSM verify and conv run on the layer's backend. On the Triton backend
(CUDA by default) each strategy's ``tree_verify`` calls the step kernels with ``parents=`` (one
launch per layer walking the nodes in order, each from its parent's state) and the conv runs
:func:`~specdec.kernels.conv1d.triton_conv.conv1d_tree_verify_triton`; on the torch backend the
reference ops process the tree one depth level at a time (a tree of depth D costs D + 1
batched recurrence updates). Commit uses each backend's own kernels.
"""

from __future__ import annotations

import contextlib
import types

import torch

from .kernels.conv1d.naive import conv1d_tree_verify
from .verify import SamplingConfig, process_logits

__all__ = ["ACCEPTANCE_MODES", "MEDUSA_63", "TREE_PRESETS", "TreeSpec", "accept_tree", "check_tree_nodes", "commit_path",
           "default_tree_paths", "make_tree", "process_tree", "tree_for", "tree_step", "tree_view"]

#: Medusa's ``mc_sim_7b_63`` (FasterDecoding/Medusa, medusa/model/medusa_choices.py): 63 paths of
#: depth <= 4 with top-10 ranks, built greedily from Vicuna-7B head accuracies; listed in the
#: order they were added, so every prefix of the list is itself a tree.
MEDUSA_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)
#: nodes of the ``"default"`` tree, the root included
DEFAULT_TREE_NODES = 16
TREE_PRESETS = ("default", "medusa-63")
ACCEPTANCE_MODES = ("exact", "typical")


def default_tree_paths(depth: int, nodes: int = DEFAULT_TREE_NODES) -> list[tuple[int, ...]]:
    """The ``"default"`` tree for a depth limit ``depth`` (= min(num_speculative_tokens, heads)).

    The top-1 chain of that depth (so the tree never accepts less than chain drafting from the
    same state), then the paths of :data:`MEDUSA_63` no deeper than ``depth`` in Medusa's order
    until the tree has ``nodes`` nodes (root included). For depth 4: 16 nodes, 4 levels, at most
    7 children per node. 16 nodes: on a GPU a 16-token verify costs about what a 5-token one
    does for a memory-bound model, while snapshot / ring keep 16 SSM states per layer and sequence.
    """
    if depth < 1:
        raise ValueError(f"a draft tree needs depth >= 1, got {depth}")
    paths = [(0,) * d for d in range(1, depth + 1)]
    for p in MEDUSA_63:
        if len(paths) >= nodes - 1:
            break
        if len(p) <= depth and p not in paths:
            paths.append(p)
    return paths


class TreeSpec:
    """A static draft tree (the same for every row and step).

    Args:
        paths: Medusa-format paths (tuples of top-k ranks), validated by :func:`make_tree`.
        preset: the preset name it came from (``"default"`` is rebuilt per depth limit).
        num_heads: the heads it was made for (the default tree's depth cap).

    Attributes (node 0 is the root, the pending token; nodes in BFS order, as Medusa sorts them):
        paths: ``N - 1`` paths sorted by (depth, path). num_nodes: N. parents: ``[N]`` ints
        (``parents[0] = -1``). depth: ``[N]`` ints. max_depth: the deepest path. max_rank: the
        largest top-k rank used.
    """

    def __init__(self, paths, preset: str | None = None, num_heads: int | None = None):
        self.paths = tuple(sorted((tuple(p) for p in paths), key=lambda p: (len(p), p)))
        self.preset = preset
        self.num_heads = num_heads
        index = {(): 0}
        for i, p in enumerate(self.paths):
            index[p] = i + 1
        self.parents = (-1,) + tuple(index[p[:-1]] for p in self.paths)
        self.depth = (0,) + tuple(len(p) for p in self.paths)
        self.num_nodes = len(self.paths) + 1
        self.max_depth = max(self.depth)
        self.max_rank = max(p[-1] for p in self.paths)
        self._tensors: dict = {}
        self._by_depth: dict = {}

    def for_depth(self, max_depth: int) -> TreeSpec:
        """The tree for a depth limit (``num_speculative_tokens``): the default tree is rebuilt at
        that depth (same node budget), any other tree drops its paths deeper than the limit."""
        if max_depth >= self.max_depth and self.preset != "default":
            return self
        hit = self._by_depth.get(max_depth)  # one spec per limit: its device tables are made once
        if hit is not None:
            return hit
        if self.preset == "default":
            depth = min(max_depth, self.num_heads or max_depth)
            if depth == self.max_depth:
                return self
            hit = TreeSpec(default_tree_paths(depth), preset="default", num_heads=self.num_heads)
        else:
            hit = TreeSpec([p for p in self.paths if len(p) <= max_depth], preset=self.preset, num_heads=self.num_heads)
        self._by_depth[max_depth] = hit
        return hit

    def tensors(self, device) -> dict:
        """Index tensors on ``device`` (cached): ``depth [N]``; ``ancestors [N, N]`` bool (i is j or
        one of its ancestors); ``path_of [N, D+1]`` (node j's ancestor at depth i, -1 past depth j);
        ``levels``: per depth d >= 1, ``(nodes [n], their parents [n])``; ``head``, ``rank``
        ``[N-1]``: the Medusa head and top-k rank of nodes 1..N-1; ``leaves``: root-to-leaf paths."""
        key = str(device)
        hit = self._tensors.get(key)
        if hit is not None:
            return hit
        N, D = self.num_nodes, self.max_depth
        anc = torch.zeros(N, N, dtype=torch.bool)
        path_of = torch.full((N, D + 1), -1, dtype=torch.long)
        for j in range(N):
            a = j
            while a >= 0:
                anc[j, a] = True
                path_of[j, self.depth[a]] = a
                a = self.parents[a]
        levels = []
        for d in range(1, D + 1):
            idx = [j for j in range(N) if self.depth[j] == d]
            levels.append((torch.tensor(idx, device=device), torch.tensor([self.parents[j] for j in idx], device=device)))
        has_child = set(self.parents[1:])
        leaves = [path_of[j, : self.depth[j] + 1].to(device) for j in range(N) if j not in has_child]
        hit = {
            "depth": torch.tensor(self.depth, dtype=torch.long, device=device),
            "ancestors": anc.to(device),
            "path_of": path_of.to(device),
            "levels": levels,
            "head": torch.tensor([len(p) - 1 for p in self.paths], dtype=torch.long, device=device),
            "rank": torch.tensor([p[-1] for p in self.paths], dtype=torch.long, device=device),
            "leaves": leaves,
        }
        self._tensors[key] = hit
        return hit

    def __eq__(self, other):
        return isinstance(other, TreeSpec) and self.paths == other.paths

    def __hash__(self):
        return hash(self.paths)

    def __repr__(self):
        name = f"{self.preset!r}, " if self.preset else ""
        return f"TreeSpec({name}nodes={self.num_nodes}, depth={self.max_depth}, max_rank={self.max_rank})"


def make_tree(tree, num_heads: int, vocab_size: int | None = None) -> TreeSpec:
    """Parse and validate a draft tree for ``num_heads`` Medusa heads over ``vocab_size`` tokens.

    Args:
        tree: ``"default"`` (:func:`default_tree_paths`, 16 nodes at depth min(K, num_heads)),
            ``"medusa-63"`` (:data:`MEDUSA_63`, Medusa's 64-node tree, paths deeper than
            ``num_heads`` dropped), or a list of paths in Medusa's format: each path a non-empty
            list of top-k ranks (ints >= 0), path ``p`` meaning "rank ``p[d]`` of head ``d`` at
            depth d + 1", e.g. ``[[0], [0, 0], [1], [0, 1]]``.

    Returns: a :class:`TreeSpec`.

    Raises:
        TypeError: ``tree`` is neither a string nor a list.
        ValueError: an unknown preset; an empty tree; a path that is empty, not a list of ints,
            has a negative rank or a rank >= ``vocab_size``, is deeper than ``num_heads``, is
            listed twice, or whose prefix is not in the tree.
    """
    if isinstance(tree, str):
        if tree == "default":
            return TreeSpec(default_tree_paths(num_heads), preset="default", num_heads=num_heads)
        if tree in ("medusa-63", "mc_sim_7b_63"):
            return TreeSpec([p for p in MEDUSA_63 if len(p) <= num_heads], preset="medusa-63", num_heads=num_heads)
        raise ValueError(f"unknown draft tree {tree!r}; use one of {TREE_PRESETS} or a list of paths in Medusa's "
                         "format, e.g. [[0], [0, 0], [1]]")
    if isinstance(tree, TreeSpec):
        tree = [list(p) for p in tree.paths]
    if not isinstance(tree, (list, tuple)):
        raise TypeError(f"tree must be a preset name {TREE_PRESETS} or a list of paths (lists of top-k ranks), "
                         f"got {type(tree).__name__}")
    if not tree:
        raise ValueError("the draft tree is empty; give at least one path, e.g. [[0]]")
    seen = set()
    for i, p in enumerate(tree):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"tree path {i} ({p!r}) must be a non-empty list of top-k ranks, e.g. [0, 1]")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in p):
            raise ValueError(f"tree path {i} ({list(p)}) must hold ints (top-k ranks)")
        if any(r < 0 for r in p):
            raise ValueError(f"tree path {i} ({list(p)}) has a negative rank; ranks are 0-based top-k positions")
        if vocab_size is not None and max(p) >= vocab_size:
            raise ValueError(f"tree path {i} ({list(p)}) has rank {max(p)}, out of range for a vocabulary of "
                             f"{vocab_size} tokens")
        if len(p) > num_heads:
            raise ValueError(f"tree path {i} ({list(p)}) has depth {len(p)} but there are only {num_heads} "
                             "Medusa heads (one per depth)")
        t = tuple(p)
        if t in seen:
            raise ValueError(f"tree path {list(p)} is listed twice")
        seen.add(t)
    for p in seen:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"tree path {list(p)} is missing its prefix {list(p[:-1])}; every path's prefixes "
                             "must be in the tree")
    return TreeSpec(seen, num_heads=num_heads)


def tree_for(drafter, num_speculative_tokens: int) -> TreeSpec | None:
    """The tree a drafter drafts for this K (its ``tree`` attribute, depth-limited to K), or None
    for chain drafting."""
    spec = getattr(drafter, "tree", None) if drafter is not None else None
    if spec is None or num_speculative_tokens < 1:
        return None
    if not isinstance(spec, TreeSpec):
        raise TypeError(f"drafter.tree must be a specdec.tree.TreeSpec or None, got {type(spec).__name__}")
    return spec.for_depth(num_speculative_tokens)


# ----------------------------------------------------------------------------------- verify


def _attention_mask(cache, spec: TreeSpec, t: int, dtype) -> torch.Tensor:
    """Additive ``[B, 1, N, end]``: node j sees columns ``pad <= c < seq_len`` and the columns of
    its ancestors and itself (``seq_len + a``)."""
    if t != spec.num_nodes:
        raise ValueError(f"a tree forward runs all {spec.num_nodes} nodes at once, got {t} tokens")
    dev = cache.device
    end = cache.kv_end(t)
    cols = torch.arange(end, device=dev)[None, :]
    committed = (cols >= cache.pad[:, None]) & (cols < cache.seq_len[:, None])  # [B, end]
    vis = committed[:, None, :].expand(cache.batch, t, end).clone()
    step_cols = (cache.seq_len[:, None] + torch.arange(t, device=dev)[None, :])[:, None, :].expand(cache.batch, t, t)
    vis.scatter_(2, step_cols, spec.tensors(dev)["ancestors"][None].expand(cache.batch, t, t))
    mask = torch.zeros(cache.batch, 1, t, end, dtype=dtype, device=dev)
    return mask.masked_fill_(~vis[:, None], torch.finfo(dtype).min)


def _sliding_mask(cache, spec: TreeSpec, t: int, window: int, dtype) -> torch.Tensor:
    """The tree mask of a sliding-window layer: a node at depth d has the query column
    ``seq_len + d``; it sees only columns whose *logical* column (an ancestor's: ``seq_len +
    its depth``) is greater than that minus ``window``."""
    mask = _attention_mask(cache, spec, t, dtype)
    dev = cache.device
    end = mask.shape[-1]
    depth = spec.tensors(dev)["depth"]
    cols = torch.arange(end, device=dev)[None, :]
    rel = cols - cache.seq_len[:, None]  # [B, end]
    in_step = (rel >= 0) & (rel < t)
    logical = torch.where(in_step, cache.seq_len[:, None] + depth[rel.clamp(0, t - 1)], cols)
    q = cache.seq_len[:, None] + depth[None, :]  # [B, N]
    too_old = logical[:, None, :] <= (q - window)[:, :, None]
    return mask.masked_fill(too_old[:, None], torch.finfo(dtype).min)


@contextlib.contextmanager
def tree_view(adapter, cache, spec: TreeSpec):
    """For one forward of the tree's N nodes through ``adapter.forward(tokens [B, N], cache)``:
    the cache's attention mask and positions become the tree's, and every SSM layer runs its conv
    and recurrence per node from the node's parent (``strategy.tree_verify``).

    Raises: ValueError when the step already ran tokens (a tree step is the step's only forward)."""
    if cache.step_tokens:
        raise ValueError(f"a tree step must be the step's only forward; this step already ran {cache.step_tokens} tokens")
    parents = spec.parents
    patched_cache = ("attention_mask", "position_ids")
    cache.attention_mask = lambda t, dtype: _attention_mask(cache, spec, t, dtype)
    cache.position_ids = lambda t: (cache.seq_len - cache.pad)[:, None] + spec.tensors(cache.device)["depth"][None, :t]
    adapter.sliding_mask = types.MethodType(
        lambda self, c, t, window: _sliding_mask(c, spec, t, window, self.dtype), adapter)

    def conv(layer, x, weight, bias, activation):
        if layer.op.kernels is not None:  # the Triton backend: one launch, each token over its ancestor chain
            from .kernels.conv1d.triton_conv import conv1d_tree_verify_triton

            return conv1d_tree_verify_triton(layer.conv_window, x, weight, bias, activation, parents)
        return conv1d_tree_verify(layer.conv_window, x, weight, bias, activation, parents)

    def ssm(layer, inputs, params):
        if not layer.has_recurrence:
            raise RuntimeError(f"layer {layer.layer} is conv-only: it has no recurrence")
        layer.params = params
        return layer.strategy.tree_verify(layer.store, layer.op, inputs, params, parents)

    layers = list(cache.ssm.values())
    try:
        for layer in layers:
            layer.conv = types.MethodType(conv, layer)
            layer.ssm = types.MethodType(ssm, layer)
        yield
    finally:
        for name in patched_cache:
            cache.__dict__.pop(name, None)
        adapter.__dict__.pop("sliding_mask", None)
        for layer in layers:
            layer.__dict__.pop("conv", None)
            layer.__dict__.pop("ssm", None)


# ------------------------------------------------------------------------------- acceptance


def accept_tree(logits: torch.Tensor, tokens: torch.Tensor, spec: TreeSpec, limit: torch.Tensor,
                sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                acceptance: str = "exact", posterior_threshold: float = 0.09, posterior_alpha: float = 0.3):
    """Pick the accepted path of each row.

    Args:
        logits: ``[B, N, V]`` target logits of the tree's nodes (logits j predict the token after node j).
        tokens: ``[B, N]`` int64 node tokens (node 0: the pending token).
        spec: the tree. limit: ``[B]`` int64, the deepest node a row may accept (budget; 0 = none).
        sampling: None (greedy) or the sampling settings. generator: for reproducible sampling.
        acceptance: ``"exact"`` (greedy, or lossless sampling: sample the target at every node,
            follow the child holding the sampled token) or ``"typical"`` (Medusa's typical
            acceptance; not distribution-preserving).
        posterior_threshold, posterior_alpha: typical acceptance's epsilon and delta: a node is
            accepted when its parent's target probability of its token exceeds
            ``min(posterior_threshold, posterior_alpha * exp(-entropy))``.

    Returns:
        ``(best [B], num_accepted [B], next_token [B])``: the deepest accepted node (ties, possible
        only with typical acceptance: the path of highest target likelihood), its depth, and the
        correction/bonus token drawn at it.
    """
    B, N, V = logits.shape
    dev = logits.device
    tt = spec.tensors(dev)
    depth = tt["depth"]
    rows = torch.arange(B, device=dev)
    score = torch.zeros(B, N, device=dev)  # path log-likelihood (typical acceptance's tie-break)
    ok = torch.zeros(B, N, dtype=torch.bool, device=dev)
    ok[:, 0] = True
    if acceptance == "typical":
        probs = process_logits(logits, sampling) if sampling is not None else torch.softmax(logits.float(), -1)
        entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
        thr = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
        for d, (idx, par) in enumerate(tt["levels"], start=1):
            p_tok = probs[:, par].gather(2, tokens[:, idx, None])[..., 0]  # [B, n]
            ok[:, idx] = ok[:, par] & (p_tok > thr[:, par]) & (limit >= d)[:, None]
            score[:, idx] = score[:, par] + torch.log(p_tok.clamp(min=1e-30))
    else:
        if sampling is None:
            target = logits.argmax(-1)  # [B, N]
        else:
            p = process_logits(logits, sampling)
            target = torch.multinomial(p.reshape(B * N, V), 1, generator=generator).reshape(B, N)
        for d, (idx, par) in enumerate(tt["levels"], start=1):
            ok[:, idx] = ok[:, par] & (tokens[:, idx] == target[:, par]) & (limit >= d)[:, None]
    deepest = torch.where(ok, depth[None, :], torch.full_like(depth[None, :], -1)).max(1).values
    cand = ok & (depth[None, :] == deepest[:, None])
    best = torch.where(cand, score, torch.full_like(score, float("-inf"))).argmax(1)
    n = depth[best]
    if acceptance != "typical":
        return best, n, target[rows, best]
    if sampling is None:
        return best, n, logits[rows, best].argmax(-1)
    # Medusa's typical sampling of the next token: the target's (processed) distribution without
    # the tokens below the threshold (never empty for posterior_alpha <= 1: exp(-H) <= max p)
    p_best = probs[rows, best]
    p_best = p_best.masked_fill(p_best < thr[rows, best][:, None], 0.0)
    return best, n, torch.multinomial(p_best, 1, generator=generator)[:, 0]


def process_tree(proc, logits: torch.Tensor, tokens: torch.Tensor, n_gen: torch.Tensor, spec: TreeSpec):
    """The engine's target logits processor (repetition penalty, min length) on a tree: each node
    is processed with its own prefix (its ancestors' tokens), by running ``proc`` along every
    root-to-leaf path (a node's result depends on its ancestors only, so shared nodes agree)."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for path in spec.tensors(logits.device)["leaves"]:
        out[:, path] = proc(logits[:, path], tokens[:, path], n_gen)
    return out


# ----------------------------------------------------------------------------------- commit


def commit_path(cache, path: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """Commit each row's accepted path of the open tree step.

    Moves the accepted nodes' attention keys/values to consecutive KV columns ``seq_len + i``,
    their conv inputs to conv-window step columns ``W-1+i`` and their SSM data to the strategy's
    step positions (``strategy.compact_path``), then runs ``cache.commit(num_tokens)``: the
    result is exactly a chain step that ran the path's tokens.

    Args:
        cache: the :class:`~specdec.cache.HybridCache` after a tree forward.
        path: ``[B, P]`` int64 tree node indices of each row's path (``path[:, 0] = 0``).
        num_tokens: ``[B]`` int64 in ``[0, P]``: the path's first tokens to keep.
    """
    B, P = path.shape
    dev = path.device
    i = torch.arange(P, device=dev)[None, :]
    src = torch.where(i < num_tokens[:, None], path, i)  # identity past the kept tokens
    rows = torch.arange(B, device=dev)[:, None]
    for layer in cache.ssm.values():
        win = layer.conv_window
        if win is not None:
            h = layer.conv_width - 1
            moved = win.gather(2, (h + src)[:, None, :].expand(B, win.shape[1], P))  # all reads before writes
            win[:, :, h : h + P] = moved
        if layer.has_recurrence:
            layer.strategy.compact_path(layer.store, layer.op, layer.params, src, num_tokens)
    dst_cols = cache.seq_len[:, None] + i
    src_cols = cache.seq_len[:, None] + src
    for kbuf, vbuf in cache.kv.values():
        for buf in (kbuf, vbuf):
            view = buf.permute(0, 2, 1, 3)  # [B, L, H, D]
            view[rows, dst_cols] = view[rows, src_cols]
    cache.commit(num_tokens)


# -------------------------------------------------------------------------------- one step


def check_tree_nodes(nodes, batch: int, spec: TreeSpec) -> torch.Tensor:
    """What ``propose_tree`` returned, checked on the host (no device sync): an integer tensor
    ``[batch, N - 1]``. The eager and the static decode loops both call it.

    Raises: ValueError for another type or shape; TypeError for a bool / float / complex dtype."""
    N = spec.num_nodes
    if not isinstance(nodes, torch.Tensor) or nodes.shape != (batch, N - 1):
        got = tuple(nodes.shape) if isinstance(nodes, torch.Tensor) else type(nodes).__name__
        raise ValueError(f"propose_tree must return node tokens [{batch}, {N - 1}], got {got}")
    if nodes.dtype == torch.bool or nodes.dtype.is_floating_point or nodes.dtype.is_complex:
        raise TypeError(f"propose_tree returned node tokens of dtype {nodes.dtype}; expected an integer dtype (int64)")
    return nodes


def tree_step(adapter, drafter, cache, spec: TreeSpec, *, text, lengths, n_gen, finished, max_new, sampling,
              generator, proc, emit, warped, timer, stats) -> tuple[int, int]:
    """One speculative step with a draft tree (called by the engine's loop for tree drafters).

    ``text``, ``lengths``, ``n_gen``, ``finished``: the engine's per-row state; ``emit`` /
    ``warped`` / ``timer`` / ``proc``: its token sink, score warping, clock and logits processor.
    Updates ``stats`` (steps, proposed = each row's depth limit, accepted, histogram, phase
    times). Returns ``(rows that took part, tokens they committed)`` for the per-row mean.

    Raises: ValueError when the drafter returns node tokens of the wrong shape or outside the
    vocabulary; TypeError for node tokens of a non-integer dtype.
    """
    dev = text.device
    B = text.shape[0]
    rows = torch.arange(B, device=dev)
    t0 = timer.now()
    nodes = check_tree_nodes(drafter.propose_tree(text, lengths, spec), B, spec)
    V = adapter.vocab_size
    nodes = nodes.to(dev).long()
    if bool(((nodes < 0) | (nodes >= V)).any()):
        raise ValueError(f"drafter proposed token ids outside the target's vocabulary [0, {V})")
    t1 = timer.now()
    limit = (max_new - n_gen - 1).clamp(min=0, max=spec.max_depth).masked_fill(finished, 0)
    tokens = torch.cat([text[rows, lengths - 1][:, None], nodes], dim=1)  # [B, N]: pending token, then nodes
    with tree_view(adapter, cache, spec):
        logits, hidden = adapter.forward(tokens, cache)
    raw = logits
    if proc is not None:
        logits = process_tree(proc, logits, tokens, n_gen, spec)
    best, n, c = accept_tree(
        logits, tokens, spec, limit, sampling, generator, getattr(drafter, "acceptance", "exact"),
        getattr(drafter, "posterior_threshold", 0.09), getattr(drafter, "posterior_alpha", 0.3),
    )
    active = ~finished
    path = spec.tensors(dev)["path_of"][best]  # [B, D+1], -1 past the accepted depth
    i = torch.arange(path.shape[1], device=dev)[None, :]
    path = torch.where(i <= n[:, None], path, i)
    new = torch.cat([tokens.gather(1, path)[:, 1:], c[:, None]], dim=1)
    new[rows, n] = c
    taken = emit(new, n + 1, warped(logits[rows[:, None], path]), raw[rows[:, None], path])
    t2 = timer.now()
    commit_path(cache, path, torch.minimum(taken, n + 1))
    if drafter.wants_hidden_states:  # hidden state of the node whose logits gave c
        drafter.observe(hidden[rows, best])
    t3 = timer.now()
    stats.steps += 1
    na = n[active]
    stats.proposed_tokens += int(limit[active].sum())
    stats.accepted_tokens += int(na.sum())
    for v in na.tolist():
        stats.accept_histogram[v] += 1
    stats.draft_s += t1 - t0
    stats.verify_s += t2 - t1
    stats.rollback_s += t3 - t2
    return int(active.sum()), int((na + 1).sum())
