"""The prefix cache: full KV pages of prompts computed before, indexed by the tokens they hold, so that a prompt
beginning with those tokens (a system prompt, a chat's earlier turns, one document asked several questions) adopts
the pages instead of computing them again.

A block is one full page of a sequence in every layer (one page per layer), keyed by its parent block and its own
tokens, so a key stands for the whole prefix up to the block's end (vLLM's and llama.cpp's hash chains; here the
key is the exact (parent id, tokens) pair, so two prefixes never collide). The cache holds one reference on each
of a block's pages (sharpi.runtime.kv_cache: pages are reference-counted, and written only by a sole holder), so a
block outlives the sequence that computed it; under pool pressure the pool asks the cache to reclaim, and it lets
go of the least recently used blocks that only it holds, leaves first.

Only sequences that hold every position from 0 (no eviction, nothing dropped by a sliding window) give blocks:
the pages of an evicted cache hold a selection of positions, which another prompt cannot share.

A hybrid model (Gated DeltaNet layers) cannot go on from pages alone: its recurrent state after the prefix is not
in them. There a block may hold a snapshot of that state (a slot of the model's StatePool, copied when a prompt's
prefill reached the block's end), and a lookup goes only as far as the deepest block of its chain that holds one.
At most `snapshot_limit` snapshots are kept; past it the least recently used one goes (its block stays).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .kv_cache import PagePool, SequenceCache


@dataclass
class _Block:
    id: int
    key: tuple                      # (parent id, the block's tokens)
    parent: "_Block | None"
    pages: list[int]                # one per layer
    children: int = 0
    state: int | None = None        # a hybrid's recurrent-state snapshot at the block's end (a StatePool slot)


class PrefixHit(NamedTuple):
    tokens: int                     # the prefix's length, in whole blocks
    pages: list[list[int]]          # per layer
    state: int | None               # a hybrid's state snapshot after the prefix (None: no state, or no hit)


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0                   # lookups that reused at least one block
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, pool: PagePool, n_layers: int, states=None, snapshot_limit: int = 0):
        """states: a hybrid model's StatePool, of which the cache keeps at most snapshot_limit slots."""
        self.pool, self.n_layers = pool, n_layers
        self.states, self.snapshot_limit = states, snapshot_limit
        self.page_size = pool.page_size
        self._blocks: dict[tuple, _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()    # least recently used first
        self._snapshots: OrderedDict[int, _Block] = OrderedDict()   # blocks holding a state, least recent first
        self._next_id = 1
        self._page_array: np.ndarray | None = None    # every block's pages, rebuilt after a change
        self.stats = PrefixStats()

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    @property
    def pages(self) -> int:
        return len(self._blocks) * self.n_layers

    def reclaimable(self) -> int:
        """Pages that only the cache holds: what reclaim() can give back now."""
        return int((self.pool.refs[self._pages()] == 1).sum())

    def page_set(self) -> set[int]:
        return set(self._pages().tolist())

    def _pages(self) -> np.ndarray:
        if self._page_array is None:
            self._page_array = np.fromiter((p for b in self._blocks.values() for p in b.pages), np.int64)
        return self._page_array

    def _key(self, tokens: list[int], index: int, parent: _Block | None) -> tuple:
        return parent.id if parent else 0, tuple(tokens[index * self.page_size:(index + 1) * self.page_size])

    def lookup(self, tokens: list[int], limit: int) -> PrefixHit:
        """The longest cached prefix of `tokens` of at most `limit` tokens, in whole blocks (for a hybrid model:
        ending at a block with a state snapshot). The blocks become the most recently used (leaves before their
        parents, so that eviction takes a chain from its end)."""
        self.stats.lookups += 1
        found: list[_Block] = []
        for i in range(min(len(tokens), max(0, limit)) // self.page_size):
            block = self._blocks.get(self._key(tokens, i, found[-1] if found else None))
            if block is None:
                break
            found.append(block)
        if self.states is not None:
            while found and found[-1].state is None:
                found.pop()
            if found:
                self._snapshots.move_to_end(found[-1].id)
        self._touch(found)
        if found:
            self.stats.hits += 1
            self.stats.hit_tokens += len(found) * self.page_size
        pages = [[b.pages[l] for b in found] for l in range(self.n_layers)]
        return PrefixHit(len(found) * self.page_size, pages, found[-1].state if found else None)

    def snapshot(self, tokens: list[int], cache: SequenceCache) -> bool:
        """Index `cache`'s full pages (it holds `tokens`, a whole number of pages, from position 0) and keep a
        copy of its recurrent state with the last block, the least recently used snapshot giving way past
        snapshot_limit; returns whether the state was kept."""
        if self.states is None or self.snapshot_limit <= 0 or cache.logical_length != len(tokens):
            return False
        chain, _ = self._index(tokens, cache)
        if not chain:
            return False
        block = chain[-1]
        if block.state is None:
            if len(self._snapshots) >= self.snapshot_limit:
                self._forget_state(next(iter(self._snapshots.values())))
            block.state = self.states.allocate(like=cache.state_slot())
        self._snapshots[block.id] = block
        self._snapshots.move_to_end(block.id)
        return True

    def _forget_state(self, block: _Block) -> None:
        if block.state is not None:
            self.states.release(block.state)
            block.state = None
            del self._snapshots[block.id]

    def _touch(self, chain: list[_Block]) -> None:
        """Make a chain (root first) the most recently used, its root the most recent of all."""
        for block in reversed(chain):
            self._lru.move_to_end(block.id)

    def insert(self, tokens: list[int], cache: SequenceCache) -> int:
        """Index the full pages of `cache`, which holds `tokens` from position 0 (at least its first
        cache.logical_length of them); returns the blocks added. A cache that does not hold every position from
        0 adds none."""
        return self._index(tokens, cache)[1]

    def _index(self, tokens: list[int], cache: SequenceCache) -> tuple[list[_Block], int]:
        """insert()'s work: (the chain of blocks holding the cache's full pages, root first; the blocks added)."""
        if not cache.contiguous:
            return [], 0
        added, chain = 0, []
        for i in range(min(len(tokens), cache.logical_length) // self.page_size):
            parent = chain[-1] if chain else None
            key = self._key(tokens, i, parent)
            block = self._blocks.get(key)
            if block is None:
                block = _Block(self._next_id, key, parent, [cache.pages[l][i] for l in range(self.n_layers)])
                self._next_id += 1
                self.pool.share(block.pages)
                self._blocks[key] = self._lru[block.id] = block
                self._page_array = None
                if parent is not None:
                    parent.children += 1
                added += 1
            chain.append(block)
        self._touch(chain)
        self.stats.inserted_blocks += added
        return chain, added

    def reclaim(self, wanted: int) -> int:
        """Let go of least recently used leaf blocks that only the cache holds until `wanted` pages are free
        again (or nothing more can go); returns the pages freed."""
        freed = 0
        while freed < wanted:
            victim = next((b for b in self._lru.values()
                           if b.children == 0 and all(self.pool.refs[p] == 1 for p in b.pages)), None)
            if victim is None:
                break
            self._drop(victim)
            freed += len(victim.pages)
        return freed

    def clear(self) -> None:
        """Let go of every block (pages still used by sequences stay with them)."""
        for block in list(self._blocks.values()):
            self._forget_state(block)
            self.pool.release(block.pages)
        self._blocks.clear()
        self._lru.clear()
        self._page_array = None

    def _drop(self, block: _Block) -> None:
        self._page_array = None
        del self._blocks[block.key]
        del self._lru[block.id]
        if block.parent is not None:
            block.parent.children -= 1
        self._forget_state(block)
        self.pool.release(block.pages)
        self.stats.evicted_blocks += 1
