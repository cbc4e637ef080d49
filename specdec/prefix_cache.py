"""Prefix caching for hybrid models: prompts that share a prefix reuse its state, block by block.

A prompt is cut into blocks of ``block_size`` tokens. Block i is keyed by a hash chain, as
vLLM's and SGLang's prefix caches key KV blocks: ``block_hash(key of block i-1, tokens of block
i)``, so a key depends on every token up to the block's end. Hashes only find candidates: an
entry matches when its own tokens equal the block's and its parent is the entry matched for
block i-1, so by induction every token of the prefix was compared and a hash collision cannot
hand a prompt another prompt's state.

An entry's value (:class:`PrefixBlock`) holds what a prefill that runs past the block leaves
for its positions: each attention layer's keys and values of the block's positions (a hit on n
blocks concatenates n of them) and, when the prefill was asked for them, the final hidden states
of those positions. These come out of any forward over the block, so every full block of a
prompt is stored. An SSM layer's conv window and recurrent state exist only where a forward
ends, so a block holds them (``ssm_state``) only at selected boundaries, as SGLang's Mamba radix
cache keeps SSM states at branch points and vLLM's ``align`` mode at block-aligned ends:

* the prompt's end, when it falls on a block boundary (a forward returns only its final state,
  so storing it at the last boundary before an unaligned end would cost every miss a second
  forward; a prompt that extends this one makes that boundary a branch point instead);
* branch points: when a lookup finds a chain of cached blocks that goes further than the deepest
  block holding SSM state, the prompt is prefilled in two forwards, the first ending at the
  chain's last block, whose state is stored there (later prompts sharing that prefix hit it);
  not when ``max_bytes`` could not hold that state with its chain (the split would then cost a
  forward for nothing).

A lookup's hit is the longest chain of cached blocks whose last block holds SSM state (a model
without SSM layers: every block). So prompts with a shared prefix of several blocks and their
own suffixes take 1 forward (the first), 2 (the second: the shared blocks' K/V are found, their
end gets its state) and from then on 1 over their own suffix, loading the shared prefix. A hit
reuses whole blocks and leaves at least the prompt's last token to compute (its logits pick the
first new token).

Memory is bounded by ``max_bytes``: the bytes of every stored tensor, counted exactly. Each is
a compact copy, made by :meth:`PrefixCache.insert`, never a view into a larger buffer; or, where
the caller hands over a block's keys / values already copied (``kv_copied``), views that
together cover buffers of that block's own (the prefill copies each new block's keys / values of
every attention layer in one copy, a view per layer: one op per block, not one per layer). Eviction
is least-recently-used, whole blocks at a time; a chain is touched from its last block to its
first, so a block is always more recently used than its descendants and eviction takes leaves
first (an evicted block never strands a cached child).

The prefill that reads and fills the cache is :meth:`specdec.models.HybridAdapter.prefill`
(``prefix_cache=``); :meth:`specdec.engine.SpeculativeGenerator.generate_batch` runs it with
``prefix_caching=True``.
"""

from __future__ import annotations

import functools
import itertools
import numbers
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields

import torch

__all__ = ["DEFAULT_PREFIX_CACHE_BYTES", "PREFIX_BLOCK_SIZE", "LayerState", "PrefixBlock", "PrefixCache",
           "PrefixCacheStats", "PrefixEntry", "PrefixMatch", "block_hash", "check_prefix_cache_args"]

#: tokens per block when ``prefix_block_size`` is not given (vLLM's and SGLang's page sizes are 16-64)
PREFIX_BLOCK_SIZE = 64
#: the cache's byte bound when ``prefix_cache_bytes`` is not given (1 GiB)
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
#: the parent key of a prompt's first block
_ROOT = 0


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The key of a block of ``tokens`` whose preceding block has key ``parent`` (``0`` for a
    prompt's first block): Python's hash of the pair, a 64-bit int. Keys only find candidates
    (:class:`PrefixCache` compares the tokens), so collisions cost time, never exactness."""
    return hash((parent, tokens))


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """A compact copy of ``t`` (its own storage, exactly ``t``'s bytes)."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class LayerState:
    """What one layer of Hugging Face's cache holds for one sequence (batch 1); None where the
    layer holds no such state.

    keys, values: ``[1, H_kv, t, D]`` attention keys / values of ``t`` positions (a
    :class:`PrefixBlock`: the block's own positions). conv_state: ``[1, C, W]`` an SSM layer's
    last conv inputs (HF keeps the kernel width W). recurrent_state: ``[1, *S]`` its recurrent
    state (Mamba-2 ``[1, H, P, N]``, GDN / KDA ``[1, H, K, V]``), in the dtype HF's cache holds.
    """

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the tensors held (counted once: the state is frozen)."""
        return sum(_tensor_bytes(getattr(self, f.name)) for f in fields(self))

    def copy(self) -> "LayerState":
        """Compact copies of the tensors held."""
        return LayerState(*(_copy(getattr(self, f.name)) for f in fields(self)))


def _states_bytes(states: dict[int, LayerState] | None) -> int:
    return 0 if states is None else sum(s.nbytes for s in states.values())


def _copy_states(states: dict[int, LayerState] | None) -> dict[int, LayerState] | None:
    return None if states is None else {idx: s.copy() for idx, s in states.items()}


@dataclass(frozen=True)
class PrefixBlock:
    """The cached value of one block.

    kv: layer index -> :class:`LayerState` holding an attention layer's ``keys`` / ``values`` of
    the block's positions. ssm_state: layer index -> :class:`LayerState` holding an SSM layer's
    ``conv_state`` and ``recurrent_state`` at the block's end; None when the block does not hold
    them (only boundaries where a prefill's forward ended do), ``{}`` for a model without SSM
    layers. hidden_states: ``[1, block_size, D]`` the final hidden states of the block's
    positions, or None when the prefill that stored it was not asked for them.
    """

    kv: dict[int, LayerState]
    ssm_state: dict[int, LayerState] | None = None
    hidden_states: torch.Tensor | None = None

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of every tensor of the block (what it counts against ``max_bytes``; the block is
        frozen, so counted once)."""
        return _states_bytes(self.kv) + _states_bytes(self.ssm_state) + _tensor_bytes(self.hidden_states)

    def merged(self, new: "PrefixBlock") -> "PrefixBlock":
        """This block with what ``new`` (the same block from another prefill) holds and it lacks
        (SSM state, hidden states) added as compact copies; ``self`` when ``new`` adds nothing.
        Keys / values are kept: a block's are stored once."""
        add_state = self.ssm_state is None and new.ssm_state is not None
        add_hidden = self.hidden_states is None and new.hidden_states is not None
        if not (add_state or add_hidden):
            return self
        return PrefixBlock(self.kv, _copy_states(new.ssm_state) if add_state else self.ssm_state,
                           _copy(new.hidden_states) if add_hidden else self.hidden_states)

    def copy(self) -> "PrefixBlock":
        """Compact copies of every tensor of the block."""
        return PrefixBlock(_copy_states(self.kv), _copy_states(self.ssm_state), _copy(self.hidden_states))


@dataclass(eq=False)
class PrefixEntry:
    """A stored block: its key, tokens, parent entry's id (None for a prompt's first block), value."""

    id: int
    key: int
    tokens: tuple[int, ...]
    parent: int | None
    block: PrefixBlock
    live: bool = True


@dataclass(frozen=True)
class PrefixMatch:
    """What :meth:`PrefixCache.match` found for a prompt of ``length`` tokens.

    chain: the entries of the longest run of the prompt's leading full blocks that are cached (at
    most ``(length - 1) // block_size``; with ``need_hidden_states``, blocks holding them).
    hit: how many of them a prefill loads: up to the deepest one holding SSM state (0: none).
    forward_ends: the token positions where the prefill's forwards end, from ``hit * block_size``:
    ``(len(chain) * block_size, length)`` when the chain goes past the hit (a branch point: the
    first forward ends at the chain's last block and stores its SSM state there), else ``(length,)``
    (also when ``max_bytes`` could not hold that state with its chain).
    """

    chain: list[PrefixEntry]
    hit: int
    forward_ends: tuple[int, ...]


@dataclass
class PrefixCacheStats:
    """Counters of a :class:`PrefixCache` (bytes are tensor bytes; tokens are prompt tokens).

    lookups: prompts looked up. hit_blocks / hit_tokens: blocks / tokens whose state a prefill
    loaded instead of computing. hit_bytes: the bytes of cached state those hits read (keys /
    values and hidden states of each hit block, SSM state of the last). prefilled_tokens: prompt
    tokens left to compute after the lookups. prefill_forwards: forwards the lookups planned for
    those prefills (one per prompt, two where a prompt makes a branch point; per prompt:
    ``prefill_forwards / lookups``; a prompt prefilled in chunks, longer than an admission's
    ``max_batch_tokens``, runs a planned forward as several). inserted_blocks: blocks stored. inserted_bytes: bytes added (blocks stored, and
    SSM or hidden states added to a stored block). evicted_blocks / evicted_bytes: blocks dropped
    to stay within ``max_bytes``. stored_blocks / stored_bytes: what the cache holds now
    (``stored_bytes == inserted_bytes - evicted_bytes``).
    """

    lookups: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    hit_bytes: int = 0
    prefilled_tokens: int = 0
    prefill_forwards: int = 0
    inserted_blocks: int = 0
    inserted_bytes: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def check_prefix_cache_args(block_size, max_bytes) -> None:
    """Raise TypeError / ValueError unless ``block_size`` is an int >= 1 and ``max_bytes`` an int >= 0
    (any integral type: a NumPy integer too; not a bool)."""
    for name, value, low in (("prefix_block_size", block_size, 1), ("prefix_cache_bytes", max_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


class PrefixCache:
    """Blocks of prompt state keyed by hash chains, LRU-evicted to a byte bound.

    Args:
        block_size: tokens per block (default :data:`PREFIX_BLOCK_SIZE`).
        max_bytes: the most bytes of tensors stored (default :data:`DEFAULT_PREFIX_CACHE_BYTES`);
            a block whose chain (it and its ancestors) does not fit is not stored.

    Attributes:
        stats: :class:`PrefixCacheStats`, counted since construction.

    Raises:
        TypeError / ValueError: ``block_size`` not an int >= 1, ``max_bytes`` not an int >= 0.
    """

    def __init__(self, block_size: int = PREFIX_BLOCK_SIZE, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
        check_prefix_cache_args(block_size, max_bytes)
        self.block_size = int(block_size)
        self.max_bytes = int(max_bytes)
        self.stats = PrefixCacheStats()
        self._buckets: dict[int, list[PrefixEntry]] = {}
        self._lru: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._ids = itertools.count()
        #: the most bytes of SSM state a block offered to :meth:`insert` held (None: none seen yet);
        #: :meth:`match` makes no branch point whose state could not be stored
        self._state_bytes: int | None = None

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        """Bytes of every block stored."""
        return self.stats.stored_bytes

    def entries(self) -> list[PrefixEntry]:
        """The stored entries, least recently used first."""
        return list(self._lru.values())

    # --- lookups ------------------------------------------------------------------------------
    def match(self, tokens, need_hidden_states: bool = False) -> PrefixMatch:
        """Look up ``tokens`` (a prompt, a sequence of ints): the longest cached chain of full
        blocks it starts with, leaving at least its last token out (at most ``(len(tokens) - 1) //
        block_size`` blocks; with ``need_hidden_states`` it ends before the first block stored
        without hidden states), its hit (up to the deepest block holding SSM state) and the
        forwards that prefill the rest (:class:`PrefixMatch`). The chain is marked most recently
        used and counted in :attr:`stats` (a lookup, its hit blocks, tokens and bytes, the tokens
        left to prefill and the forwards)."""
        bs = self.block_size
        chain: list[PrefixEntry] = []
        for i in range((len(tokens) - 1) // bs):
            entry = self._find(chain[-1] if chain else None, tuple(tokens[i * bs:(i + 1) * bs]))
            if entry is None or (need_hidden_states and entry.block.hidden_states is None):
                break
            chain.append(entry)
        hit = next((n for n in range(len(chain), 0, -1) if chain[n - 1].block.ssm_state is not None), 0)
        ends = (len(chain) * bs, len(tokens)) if len(chain) > hit and self._state_fits(chain) else (len(tokens),)
        self._touch(chain)
        s = self.stats
        s.lookups += 1
        s.hit_blocks += hit
        s.hit_tokens += hit * bs
        if hit:
            s.hit_bytes += _states_bytes(chain[hit - 1].block.ssm_state) + sum(
                _states_bytes(e.block.kv) + (_tensor_bytes(e.block.hidden_states) if need_hidden_states else 0)
                for e in chain[:hit])
        s.prefilled_tokens += len(tokens) - hit * bs
        s.prefill_forwards += len(ends)
        return PrefixMatch(chain, hit, ends)

    def insert(self, chain: list[PrefixEntry], tokens, block: PrefixBlock, kv_copied: bool = False) -> PrefixEntry | None:
        """Store ``block``, the block of ``tokens`` (``block_size`` ints) that follows ``chain``
        (the entries of the prompt's earlier blocks, in order, as :meth:`match` and earlier
        inserts returned them); on success append its entry to ``chain``. ``block``'s tensors may
        be views: what is stored are compact copies. With ``kv_copied`` its keys / values are
        stored as they are: the caller made them for this block alone (compact tensors, or views
        that together cover buffers nothing else holds), so their bytes are the buffers'.

        A block already stored keeps its keys / values; SSM state and hidden states it lacks and
        ``block`` holds are added (:meth:`PrefixBlock.merged`). Least recently used blocks outside
        ``chain`` are evicted to make room.

        Returns: the entry, or None when it is not stored: its chain would exceed ``max_bytes``,
        or an ancestor was evicted (later blocks of the prompt cannot be stored either).

        Raises: ValueError when ``tokens`` is not one block long.
        """
        tokens = tuple(tokens)
        if len(tokens) != self.block_size:
            raise ValueError(f"a block holds block_size={self.block_size} tokens, got {len(tokens)}")
        if block.ssm_state is not None:
            self._state_bytes = max(self._state_bytes or 0, _states_bytes(block.ssm_state))
        parent = chain[-1] if chain else None
        if parent is not None and not parent.live:
            return None
        entry = self._find(parent, tokens)
        if entry is not None:
            stored = entry.block.merged(block)
        elif kv_copied:
            stored = PrefixBlock(block.kv, _copy_states(block.ssm_state), _copy(block.hidden_states))
        else:
            stored = block.copy()
        if entry is not None and stored is entry.block:  # nothing to add
            chain.append(entry)
            self._touch(chain)
            return entry
        old = entry.block.nbytes if entry is not None else 0
        need = stored.nbytes
        if sum(e.block.nbytes for e in chain) + need > self.max_bytes:
            return None
        self._evict(self.stats.stored_bytes - old + need, protect={id(e) for e in chain} | {id(entry)})
        s = self.stats
        if entry is None:
            key = block_hash(parent.key if parent is not None else _ROOT, tokens)
            entry = PrefixEntry(next(self._ids), key, tokens, parent.id if parent is not None else None, stored)
            self._buckets.setdefault(key, []).append(entry)
            self._lru[entry.id] = entry
            s.stored_blocks += 1
            s.inserted_blocks += 1
        else:  # the same block, now with SSM state or hidden states
            entry.block = stored
        s.stored_bytes += need - old
        s.inserted_bytes += need - old
        chain.append(entry)
        self._touch(chain)
        return entry

    # --- internals --------------------------------------------------------------------------
    def _state_fits(self, chain: list[PrefixEntry]) -> bool:
        """Whether SSM state added to ``chain``'s last block could be stored (:meth:`insert`'s
        bound: the chain's bytes and the state within ``max_bytes``). A branch point whose state
        cannot be stored would split the prompt's prefill into two forwards for nothing, prompt
        after prompt; unknown before the first block with state is offered."""
        if self._state_bytes is None:
            return True
        return sum(e.block.nbytes for e in chain) + self._state_bytes <= self.max_bytes

    def _find(self, parent: PrefixEntry | None, tokens: tuple[int, ...]) -> PrefixEntry | None:
        """The entry of ``tokens`` after ``parent``: same key, same tokens, same parent entry."""
        key = block_hash(parent.key if parent is not None else _ROOT, tokens)
        parent_id = parent.id if parent is not None else None
        for entry in self._buckets.get(key, ()):
            if entry.parent == parent_id and entry.tokens == tokens:
                return entry
        return None

    def _touch(self, chain: list[PrefixEntry]) -> None:
        """Mark ``chain`` most recently used, its first block last (a parent stays more recent
        than its children, so LRU order evicts leaves first)."""
        for entry in reversed(chain):
            self._lru.move_to_end(entry.id)

    def _evict(self, total: int, protect: set[int]) -> None:
        """Drop least recently used entries (not those in ``protect``, by ``id()``) until the
        bytes stored plus the pending change ``total - stored_bytes`` fit ``max_bytes``."""
        if total <= self.max_bytes:
            return
        s = self.stats
        victims = []  # (chosen first, oldest first: the walk stops at the last one, not the whole order)
        for entry in self._lru.values():
            if total <= self.max_bytes:
                break
            if id(entry) not in protect:
                victims.append(entry)
                total -= entry.block.nbytes
        for entry in victims:
            nbytes = entry.block.nbytes
            del self._lru[entry.id]
            bucket = self._buckets[entry.key]
            bucket.remove(entry)
            if not bucket:
                del self._buckets[entry.key]
            entry.live = False
            s.stored_blocks -= 1
            s.stored_bytes -= nbytes
            s.evicted_blocks += 1
            s.evicted_bytes += nbytes
