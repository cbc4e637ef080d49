"""Draft trees: their shape, presets and parsing (pure data; no tensors of a model).

A draft *tree* (Medusa, Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads") holds several candidate continuations that share prefixes. It is
given in Medusa's format: a list of paths, each a sequence of top-k ranks, one per Medusa head.
``[1, 0]`` is the node whose token is head 0's second-best token followed by head 1's best
token; every path's prefix must be in the tree. Node 0 (the root) is the pending token.

One tree step (the chain step, generalised; the decode loop is :mod:`specdec.engine`):

1. The drafter gives each node a token (:meth:`Drafter.propose_tree
   <specdec.drafters.Drafter.propose_tree>`).
2. The target runs all N nodes in ONE forward, with the cache in tree mode
   (:meth:`HybridCache.set_tree <specdec.cache.HybridCache.set_tree>`): node j sits at KV
   column ``seq_len + j`` (BFS order) with position ``seq_len - pad + depth(j)`` and sees the
   committed prefix plus its own ancestors; SSM layers start each node from its *parent's*
   state and run its conv over its ancestor chain (the rollback strategy keeps per-node states
   or per-node replay inputs; :mod:`specdec.kernels.tree_index` builds the kernels' tables).
3. Acceptance picks the deepest node whose path the target accepts
   (:func:`specdec.verify.accept_tree`: greedy, lossless sampling, or Medusa's typical acceptance).
4. Commit: :meth:`HybridCache.commit_path <specdec.cache.HybridCache.commit_path>` moves the
   accepted path to the step's first positions and commits it exactly as a chain.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_TREE_NODES", "MEDUSA_63", "TREE_PRESETS", "TreeSpec", "default_tree_paths", "make_tree", "tree_for"]

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
#: preset names :func:`make_tree` takes (``"mc_sim_7b_63"``, Medusa's own name, also names ``"medusa-63"``)
TREE_PRESETS = ("default", "medusa-63")


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

    def node_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The tokens of nodes 1..N-1 from per-depth logits ``[B, D, V]`` (``D >= max_depth``; row d-1
        scores depth d, e.g. Medusa head d-1 or MTP step d): node ``p`` holds the rank ``p[-1]``
        token of depth ``len(p)``. Returns ``[B, N-1]`` int64 on the logits' device."""
        top = logits.topk(self.max_rank + 1, dim=-1).indices  # [B, D, R]
        tt = self.tensors(top.device)
        return top[:, tt["head"], tt["rank"]]

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
    spec = drafter.tree if drafter is not None else None
    if spec is None or num_speculative_tokens < 1:
        return None
    if not isinstance(spec, TreeSpec):
        raise TypeError(f"drafter.tree must be a specdec.tree.TreeSpec or None, got {type(spec).__name__}")
    return spec.for_depth(num_speculative_tokens)
