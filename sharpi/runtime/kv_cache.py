"""The paged KV cache: one page pool shared by all layers and sessions, page tables per session and layer.

Pool layout [pages, 2 (k, v), kv_heads, page_size, head_dim] (see codegen's paged-attention kernels).
`length[l]` is the slots layer l holds; `logical_length` the tokens the sequence has seen. New tokens are
written at slot length[l] and RoPE'd at logical_length, so both stay right after an eviction.
"""
from __future__ import annotations

import math

import numpy as np

from ..common.errors import ContextLengthError, KeepSetError


class PagePool:
    """The pool tensor (owned here, written in place by the kernels) and its free list."""

    def __init__(self, tensor, page_size: int, page_bytes: int):
        self.tensor = tensor
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.num_pages = int(tensor.shape[0])
        self.free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._view = None

    @property
    def free_count(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise ContextLengthError(f"The KV page pool is exhausted: {count} more pages needed, "
                                     f"{len(self.free)} of {self.num_pages} free; release a session first.")
        return [self.free.pop() for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))

    def view(self) -> np.ndarray:
        """A numpy view of the pool (CPU only) for bookkeeping copies: fork, compaction."""
        if self._view is None:
            self._view = np.from_dlpack(self.tensor)
        return self._view


class SequenceCache:
    """One sequence's page tables and lengths."""

    def __init__(self, pool: PagePool, n_layers: int, max_pages: int):
        self.pool = pool
        self.n_layers = n_layers
        self.max_pages = max_pages
        self.pages: list[list[int]] = [[] for _ in range(n_layers)]
        self.length = [0] * n_layers
        self.logical_length = 0
        self.positions: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(n_layers)]
        self._table = np.zeros((n_layers, max_pages), np.int32)

    @property
    def capacity(self) -> int:
        return self.max_pages * self.pool.page_size

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more slots in every layer (allocating pages)."""
        size = self.pool.page_size
        need_per_layer = [math.ceil((self.length[l] + n_new) / size) - len(self.pages[l]) for l in range(self.n_layers)]
        if max(self.length) + n_new > self.capacity:
            raise ContextLengthError(f"The sequence would hold {max(self.length) + n_new} tokens, more than the "
                                     f"context of {self.capacity}.")
        total = sum(max(0, k) for k in need_per_layer)
        new_pages = self.pool.allocate(total)
        for l, need in enumerate(need_per_layer):
            for _ in range(max(0, need)):
                page = new_pages.pop()
                self._table[l, len(self.pages[l])] = page
                self.pages[l].append(page)

    def advance(self, n_new: int) -> None:
        """Record n_new tokens written at slots length[l].. and logical positions logical_length.."""
        new_positions = np.arange(self.logical_length, self.logical_length + n_new, dtype=np.int64)
        for l in range(self.n_layers):
            self.length[l] += n_new
            self.positions[l] = np.concatenate([self.positions[l], new_positions])
        self.logical_length += n_new

    def page_table(self) -> np.ndarray:
        return self._table

    def kv_lens(self) -> np.ndarray:
        return np.asarray(self.length, dtype=np.int32)

    @property
    def kv_bytes(self) -> int:
        return sum(len(p) for p in self.pages) * self.pool.page_bytes

    def release(self) -> None:
        for l in range(self.n_layers):
            self.pool.release(self.pages[l])
            self.pages[l] = []
            self.length[l] = 0
            self.positions[l] = np.zeros(0, np.int64)
        self._table[:] = 0
        self.logical_length = 0

    def fork(self) -> "SequenceCache":
        """A copy with its own pages (contents copied), so both sequences can go on independently."""
        other = SequenceCache(self.pool, self.n_layers, self.max_pages)
        count = sum(len(p) for p in self.pages)
        fresh = self.pool.allocate(count)
        pool = self.pool.view()
        for l in range(self.n_layers):
            mine = self.pages[l]
            theirs = [fresh.pop() for _ in mine]
            if mine:
                pool[theirs] = pool[mine]
            other.pages[l] = theirs
            other._table[l, :len(theirs)] = theirs
        other.length = list(self.length)
        other.positions = [p.copy() for p in self.positions]
        other.logical_length = self.logical_length
        return other

    def compact(self, layer: int, keep: np.ndarray) -> None:
        """Keep only the slots in `keep` (strictly increasing) of one layer, gathered to the front."""
        keep = np.asarray(keep, dtype=np.int64)
        n = self.length[layer]
        if keep.ndim != 1 or len(keep) > n or (len(keep) and (keep[0] < 0 or keep[-1] >= n)) \
                or np.any(np.diff(keep) <= 0):
            raise KeepSetError(f"Keep list for layer {layer} must be strictly increasing slots in [0, {n}) and "
                               f"at most {n} long.")
        size = self.pool.page_size
        pool = self.pool.view()
        pages = np.asarray(self.pages[layer])
        src_page, src_off = pages[keep // size], keep % size
        data = pool[src_page, :, :, src_off, :].copy()   # [k, 2, kvh, d] (advanced indexing puts k first)
        dst = np.arange(len(keep))
        pool[pages[dst // size], :, :, dst % size, :] = data
        used = math.ceil(len(keep) / size)
        self.pool.release(self.pages[layer][used:])
        self.pages[layer] = self.pages[layer][:used]
        self._table[layer, used:] = 0
        self.length[layer] = len(keep)
        self.positions[layer] = self.positions[layer][keep]
