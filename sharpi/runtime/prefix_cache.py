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
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .kv_cache import PagePool, SequenceCache


@dataclass
class _Block:
    id: int
    key: tuple                      # (parent id, the block's tokens)
    parent: "_Block | None"
    pages: list[int]                # one per layer
    children: int = 0


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0                   # lookups that reused at least one block
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, pool: PagePool, n_layers: int):
        self.pool, self.n_layers = pool, n_layers
        self.page_size = pool.page_size
        self._blocks: dict[tuple, _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()    # least recently used first
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

    def lookup(self, tokens: list[int], limit: int) -> tuple[int, list[list[int]]]:
        """The longest cached prefix of `tokens` of at most `limit` tokens, in whole blocks: (its token count,
        its pages per layer). The blocks become the most recently used (leaves before their parents, so that
        eviction takes a chain from its end)."""
        self.stats.lookups += 1
        found: list[_Block] = []
        for i in range(min(len(tokens), max(0, limit)) // self.page_size):
            block = self._blocks.get(self._key(tokens, i, found[-1] if found else None))
            if block is None:
                break
            found.append(block)
        self._touch(found)
        if found:
            self.stats.hits += 1
            self.stats.hit_tokens += len(found) * self.page_size
        pages = [[b.pages[l] for b in found] for l in range(self.n_layers)]
        return len(found) * self.page_size, pages

    def _touch(self, chain: list[_Block]) -> None:
        """Make a chain (root first) the most recently used, its root the most recent of all."""
        for block in reversed(chain):
            self._lru.move_to_end(block.id)

    def insert(self, tokens: list[int], cache: SequenceCache) -> int:
        """Index the full pages of `cache`, which holds `tokens` from position 0 (at least its first
        cache.logical_length of them); returns the blocks added. A cache that does not hold every position from
        0 adds none."""
        if not cache.contiguous:
            return 0
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
        return added

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
        self.pool.release(block.pages)
        self.stats.evicted_blocks += 1
