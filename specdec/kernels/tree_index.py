"""Index helpers for running a *tree* of step tokens through a recurrence (torch reference ops and Triton kernels).

A tree step gives its T tokens in topological order with ``parents[j]`` the index of token j's
parent (``parents[j] < j``), or ``-1`` when token j continues from the committed state. A chain is
the tree ``parents = [-1, 0, 1, ..., T-2]``. Token j's recurrent state before it is its parent's
state after it, and its conv window is its ancestor chain (then the committed conv history), as
in STree (Wu et al. 2025, "STree: Speculative Tree Decoding for Hybrid State-Space Models").

The reference ops process the tree level by level: every token of one depth at once, from its
parent's state, so a tree costs ``depth + 1`` sequential updates, not T. The Triton kernels
walk the tokens in order instead and take their per-token tables from :func:`tree_meta` and
:func:`conv_tree_columns_i32` (device tensors cached per tree: no host-to-device copy after a
tree's first step, so a captured step replays without one).
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["check_parents", "conv_tree_columns", "conv_tree_columns_i32", "tree_levels", "tree_meta"]


def check_parents(parents, num_tokens: int | None = None) -> tuple[int, ...]:
    """``parents`` as a tuple of ints, checked: ``-1 <= parents[j] < j``.

    Raises:
        ValueError: a parent that is not an earlier token, or a length other than ``num_tokens``.
    """
    try:
        par = tuple(int(p) for p in parents)
    except TypeError:
        raise ValueError(f"parents must be a sequence of ints, got {type(parents).__name__}") from None
    if num_tokens is not None and len(par) != num_tokens:
        raise ValueError(f"parents has {len(par)} entries for {num_tokens} step tokens")
    for j, p in enumerate(par):
        if not -1 <= p < j:
            raise ValueError(f"parents[{j}] = {p}: a token's parent must be an earlier token (or -1); "
                             "give the tree's tokens in topological (e.g. breadth-first) order")
    return par


@lru_cache(maxsize=256)
def _levels(parents: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    out = []
    for d in range(max(depth) + 1 if depth else 0):
        idx = tuple(j for j, dj in enumerate(depth) if dj == d)
        out.append((idx, tuple(parents[j] + 1 for j in idx)))
    return tuple(out)


_DEVICE_CACHE: dict = {}
_CACHE_LIMIT = 256


def _cached(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` on a miss; a cache past :data:`_CACHE_LIMIT` entries
    starts over (a CUDA graph that captured an entry keeps its own reference: see
    :func:`cached_tensors`)."""
    hit = cache.get(key)
    if hit is None:
        hit = make()
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = hit
    return hit


def cached_tensors() -> list:
    """Every device table the caches of this module hold now. A CUDA graph captured over tree
    steps reads these tables without owning them; its owner keeps this list, so evicting the
    caches cannot free memory the graph still reads."""
    out = []
    for cache in (_TORCH_COLS_CACHE, _META_CACHE, _COLS_CACHE):
        out.extend(cache.values())
    for levels in _DEVICE_CACHE.values():
        for idx, par in levels:
            out += [idx, par]
    return out


def tree_levels(parents, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth level, ``(token indices [n], parent slots [n])`` as int64 tensors on ``device``.

    A parent *slot* is ``parents[j] + 1``: slot 0 holds the initial state, slot ``i + 1`` token
    i's state, which is how the reference ops lay out their ``[B, T + 1, *S]`` state buffer.
    """
    par = check_parents(parents)
    return _cached(_DEVICE_CACHE, (par, str(device)), lambda: [
        (torch.tensor(i, dtype=torch.long, device=device), torch.tensor(p, dtype=torch.long, device=device))
        for i, p in _levels(par)])


@lru_cache(maxsize=256)
def _conv_columns(parents: tuple[int, ...], width: int) -> tuple[tuple[int, ...], ...]:
    hist = width - 1
    rows = []
    for j in range(len(parents)):
        cols = []  # newest first: the token, its ancestors, then the committed history
        a = j
        while a >= 0 and len(cols) < width:
            cols.append(hist + a)
            a = parents[a]
        h = hist - 1
        while len(cols) < width:
            cols.append(h)
            h -= 1
        rows.append(tuple(reversed(cols)))
    return tuple(rows)


_TORCH_COLS_CACHE: dict = {}


def conv_tree_columns(parents, width: int, device) -> torch.Tensor:
    """``[T, W]`` int64: for each token, the conv-window columns of its W conv inputs, oldest
    first (window layout of :mod:`specdec.kernels.conv1d.naive`: history at ``0..W-2``, step
    token i at ``W-1+i``). For a chain these are the columns a plain causal conv reads. Cached
    per (tree, width, device): no host-to-device copy after the first call (CUDA-graph capture)."""
    par = check_parents(parents)
    return _cached(_TORCH_COLS_CACHE, (par, int(width), str(device)), lambda: torch.tensor(
        _conv_columns(par, int(width)), dtype=torch.long, device=device).reshape(len(par), int(width)))


@lru_cache(maxsize=256)
def _meta_rows(parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    paths = []  # root-first ancestor chain of each token, the token included
    for j, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else ()) + (j,))
    width = 2 + max([1] + [len(paths[p]) for p in parents if p >= 0])
    rows = []
    for p in parents:
        path = paths[p] if p >= 0 else ()
        rows.append((p, len(path)) + path + (0,) * (width - 2 - len(path)))
    return tuple(rows)


_META_CACHE: dict = {}


def tree_meta(parents, device) -> torch.Tensor:
    """``[T, M]`` int32 on ``device``, per token j of the tree: ``[parents[j], n, a_0 .. a_{n-1}, 0 ..]``
    where ``a_0 .. a_{n-1}`` is the root-first chain of ancestors ending at the parent (``n = 0``
    when ``parents[j] = -1``): the tokens whose inputs rebuild token j's starting state from the
    step's starting state (replay's tree kernels). Cached per (tree, device)."""
    par = check_parents(parents)
    return _cached(_META_CACHE, (par, str(device)), lambda: torch.tensor(
        _meta_rows(par), dtype=torch.int32, device=device).reshape(len(par), -1))


_COLS_CACHE: dict = {}


def conv_tree_columns_i32(parents, width: int, device) -> torch.Tensor:
    """:func:`conv_tree_columns` as a contiguous int32 tensor, cached per (tree, width, device)."""
    par = check_parents(parents)
    return _cached(_COLS_CACHE, (par, int(width), str(device)), lambda: torch.tensor(
        _conv_columns(par, int(width)), dtype=torch.int32, device=device).reshape(len(par), int(width)))
