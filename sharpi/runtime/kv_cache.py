"""The paged KV cache: one page pool shared by all layers and sessions, page tables per session and layer.

Pool layout [pages, 2 (k, v), kv_heads, page_size, head_dim] (see codegen's paged-attention kernels).
`length[l]` is the slots layer l holds; `logical_length` the tokens the sequence has seen. New tokens are
written after the held slots and RoPE'd at logical_length, so both stay right after an eviction.

Sliding-window layers (window w > 0) hold at most w slots: after every forward, the slots no later query can see
(all but the last w - 1) are dropped from the front, and pages that only held dropped slots go back to the pool
at once. `start[l]` is the first held slot's offset in the layer's first page, so the kernels' slot count for the
layer (`kv_lens`) is start + length. The attention kernels' window counts slots back from the query, which is
the same as counting positions while a layer is never compacted: SnapKV leaves these layers alone (they already
keep their last window).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..common.errors import ConfigError, ContextLengthError, KeepSetError, SharpiError
from ..common.kv_format import gather_slots


class PoolExhaustedError(ContextLengthError):
    """The page pool has no room for more tokens: the sessions of this model hold all its pages. Closing a session
    (or loading the model with a larger pool_sequences) makes room; nothing was changed by the refused call."""


class PoolAllocationError(SharpiError):
    """The device cannot hold the page pool a model was loaded with (pool_sequences full-context sequences)."""


class PagePool:
    """The pool's pages, reference-counted: a page may be held by several sequences (a fork, a shared prompt
    prefix) and by the prefix cache, and goes back to the free list when its last holder lets it go. Holders
    never write a page they share (SequenceCache copies it first). The pool's memory belongs to the backend (a TVM
    tensor on CPU, a wgpu buffer on Vulkan), which the kernels write in place."""

    def __init__(self, backend, num_pages: int, page_size: int, page_bytes: int, kv_format=None):
        self.backend = backend
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.kv_format = kv_format          # a common.kv_format.KVFormat: how the host reads keys from pages
        self.num_pages = num_pages
        self.free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self.refs = np.zeros(num_pages, np.int32)
        # Called with the number of pages wanted when the free list is short (the prefix cache gives back pages
        # only it holds); returns whether it freed any.
        self.reclaim = None

    @property
    def free_count(self) -> int:
        return len(self.free)

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free) and self.reclaim is not None:
            self.reclaim(count - len(self.free))
        if count > len(self.free):
            raise PoolExhaustedError(f"The KV page pool is exhausted: {count} more pages needed, "
                                     f"{len(self.free)} of {self.num_pages} free; release a session first.")
        pages = [self.free.pop() for _ in range(count)]
        self.refs[pages] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder of each page."""
        np.add.at(self.refs, pages, 1)

    def release(self, pages: list[int]) -> None:
        """One holder fewer of each page; pages nobody holds go back to the free list."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    def shared(self, page: int) -> bool:
        return self.refs[page] > 1

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.backend.copy_pages(src, dst)

    def read_pages(self, pages: list[int]) -> np.ndarray:
        """A copy of the pages' contents, [len(pages), 2, kv_heads, page_size, head_dim]."""
        return self.backend.read_pages(pages)

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        self.backend.write_pages(pages, data)


@dataclass(frozen=True)
class TailPage:
    """A layer's part-full last page as it was: its index in the layer's pages, the slots it held, its contents
    [1, 2 (or 1 packed), kv_heads, page_size, row]."""
    index: int
    held: int
    data: np.ndarray


class SequenceCache:
    """One sequence's page tables and lengths."""

    def __init__(self, pool: PagePool, n_layers: int, kv_heads: int, max_pages: int,
                 windows: list[int] | None = None, states=None):
        """n_layers: the layers with a KV cache; states: a hybrid model's StatePool (its recurrent layers' state
        slot is this sequence's too), or None."""
        self.pool = pool
        self.states = states
        self.state: int | None = None                       # the sequence's slot in `states`, once it has one
        self.n_layers = n_layers
        self.kv_heads = kv_heads
        self.max_pages = max_pages
        self.windows = list(windows or [0] * n_layers)     # per layer: sliding window, 0 = sees everything
        self.pages: list[list[int]] = [[] for _ in range(n_layers)]
        self.length = [0] * n_layers
        self.start = [0] * n_layers                         # offset of the first held slot in pages[l][0]
        self.logical_length = 0
        # per layer [kv_heads, length]: the logical position each held slot came from
        self.positions: list[np.ndarray] = [self._no_positions() for _ in range(n_layers)]
        self._table = np.zeros((n_layers, max_pages), np.int32)
        self.compacted = False                              # kept slots no longer equal positions
        # Slots a sliding-window layer holds beyond its window, so that truncating that many tokens still leaves
        # it its window (speculative decoding rolls back rejected drafts).
        self.slack = 0

    def _no_positions(self) -> np.ndarray:
        return np.zeros((self.kv_heads, 0), np.int64)

    @property
    def capacity(self) -> int:
        return self.max_pages * self.pool.page_size

    def is_local(self, layer: int) -> bool:
        return self.windows[layer] > 0

    def reserve(self, n_new: int) -> None:
        """Make room for n_new more slots in every layer (allocating pages)."""
        size = self.pool.page_size
        if max(self.length) + n_new > self.capacity:
            raise ContextLengthError(f"The sequence would hold {max(self.length) + n_new} tokens, more than the "
                                     f"context of {self.capacity}.")
        need_per_layer, shared_tail = self._growth(n_new)
        new_pages = self.pool.allocate(sum(need_per_layer) + len(shared_tail))
        for l in shared_tail:
            self._copy_on_write(l, (self.start[l] + self.length[l]) // size, new_pages.pop())
        for l, need in enumerate(need_per_layer):
            for _ in range(need):
                page = new_pages.pop()
                self._table[l, len(self.pages[l])] = page
                self.pages[l].append(page)

    def pages_needed(self, n_new: int) -> int:
        """The pages reserve(n_new) would take from the pool now (new pages, and copies of a shared tail page)."""
        need_per_layer, shared_tail = self._growth(n_new)
        return sum(need_per_layer) + len(shared_tail)

    def _growth(self, n_new: int) -> tuple[list[int], list[int]]:
        """Per layer the new pages n_new more slots need, and the layers whose first new slot lands in a page
        they hold part full and share (copied first)."""
        size = self.pool.page_size
        need = [max(0, math.ceil((self.start[l] + self.length[l] + n_new) / size) - len(self.pages[l]))
                for l in range(self.n_layers)]
        return need, [l for l in range(self.n_layers) if self._tail_page_shared(l)]

    def _tail_page_shared(self, layer: int) -> bool:
        """Whether the next slot of `layer` falls in a page it already holds, and that page is shared."""
        slot = self.start[layer] + self.length[layer]
        index = slot // self.pool.page_size
        return slot % self.pool.page_size != 0 and index < len(self.pages[layer]) and \
            self.pool.shared(self.pages[layer][index])

    def _copy_on_write(self, layer: int, index: int, fresh: int) -> None:
        """Give `layer` its own copy (page `fresh`) of its index-th page, which others hold too."""
        old = self.pages[layer][index]
        self.pool.copy_pages([old], [fresh])
        self.pool.release([old])
        self.pages[layer][index] = fresh
        self._table[layer, index] = fresh

    def own_pages(self, layer: int, count: int) -> None:
        """Make the first `count` pages of `layer` this sequence's alone (copies of the shared ones), before a
        compaction writes them."""
        shared = [i for i in range(min(count, len(self.pages[layer]))) if self.pool.shared(self.pages[layer][i])]
        fresh = self.pool.allocate(len(shared))
        for i, page in zip(shared, fresh):
            self._copy_on_write(layer, i, page)

    def advance(self, n_new: int) -> None:
        """Record n_new tokens written at slots length[l].. and logical positions logical_length.."""
        new = np.broadcast_to(np.arange(self.logical_length, self.logical_length + n_new, dtype=np.int64),
                              (self.kv_heads, n_new))
        for l in range(self.n_layers):
            self.length[l] += n_new
            self.positions[l] = np.concatenate([self.positions[l], new], axis=1)
            if self.windows[l]:
                self._slide(l)
        self.logical_length += n_new

    def _slide(self, layer: int) -> None:
        """Drop the slots of a sliding-window layer that no later query sees (it sees its own slot and the w - 1
        before it), and give back the pages holding only dropped slots."""
        dead = self.length[layer] - (self.windows[layer] - 1 + self.slack)
        if dead <= 0:
            return
        self.length[layer] -= dead
        self.start[layer] += dead
        self.positions[layer] = self.positions[layer][:, dead:]
        gone = self.start[layer] // self.pool.page_size
        if gone:
            self.pool.release(self.pages[layer][:gone])
            self.pages[layer] = self.pages[layer][gone:]
            self.start[layer] -= gone * self.pool.page_size
            held = len(self.pages[layer])
            self._table[layer, :held] = self.pages[layer]
            self._table[layer, held:] = 0

    def page_table(self) -> np.ndarray:
        return self._table

    def kv_lens(self) -> np.ndarray:
        """Per layer, the slots the kernels count from the start of the layer's page table."""
        return np.asarray([s + n for s, n in zip(self.start, self.length)], dtype=np.int32)

    @property
    def kv_bytes(self) -> int:
        """The memory the sequence holds: its pages, and a hybrid's recurrent-state slot."""
        state = self.states.slot_bytes if self.state is not None else 0
        return sum(len(p) for p in self.pages) * self.pool.page_bytes + state

    def state_slot(self) -> int:
        """The sequence's recurrent-state slot (a hybrid model's), taken from the pool (empty) at its first use."""
        if self.state is None:
            self.state = self.states.allocate()
        return self.state

    def release(self) -> None:
        if self.state is not None:
            self.states.release(self.state)
            self.state = None
        for l in range(self.n_layers):
            self.pool.release(self.pages[l])
            self.pages[l] = []
            self.length[l] = 0
            self.start[l] = 0
            self.positions[l] = self._no_positions()
        self._table[:] = 0
        self.logical_length = 0
        self.compacted = False

    def fork(self) -> "SequenceCache":
        """A copy that shares every page (copy-on-write: whichever sequence writes a shared page first copies it),
        so both sequences can go on independently; a fork costs no memory until they differ."""
        other = SequenceCache(self.pool, self.n_layers, self.kv_heads, self.max_pages, self.windows, self.states)
        if self.state is not None:                         # a recurrent state is copied at once
            other.state = self.states.allocate(like=self.state)
        for l in range(self.n_layers):
            self.pool.share(self.pages[l])
            other.pages[l] = list(self.pages[l])
            other._table[l, :len(self.pages[l])] = self.pages[l]
        other.length = list(self.length)
        other.start = list(self.start)
        other.positions = [p.copy() for p in self.positions]
        other.logical_length = self.logical_length
        other.compacted = self.compacted
        other.slack = self.slack
        return other

    def adopt(self, pages: list[list[int]], tokens: int, state: int | None = None) -> None:
        """Start this (empty) sequence from a shared prefix: `pages` per layer holding its first `tokens` tokens'
        keys and values, contiguous from position 0 (the prefix cache's full pages); for a hybrid model, `state`
        the slot holding its recurrent state after them (copied into the sequence's own)."""
        assert self.logical_length == 0 and all(not p for p in self.pages)
        if self.states is not None:
            if state is None:
                raise ConfigError("A hybrid model's sequence cannot start from cached pages alone: its recurrent "
                                  "state at the prefix's end is needed too.")
            if self.state is not None:
                self.states.release(self.state)
            self.state = self.states.allocate(like=state)
        for l, layer_pages in enumerate(pages):
            self.pool.share(layer_pages)
            self.pages[l] = list(layer_pages)
            self._table[l, :len(layer_pages)] = layer_pages
            self.length[l] = tokens
            self.positions[l] = np.broadcast_to(np.arange(tokens, dtype=np.int64), (self.kv_heads, tokens)).copy()
        self.logical_length = tokens

    def tail_snapshot(self) -> list[TailPage | None]:
        """Per layer, the page the next token lands in if it is part full, as it is now (None for a layer whose
        next token starts a page, and for every layer where keys are not page-scaled): truncate() restores the
        slots it held from it, where the tokens fed since re-encoded that page with keys that are then dropped."""
        fmt, size = self.pool.kv_format, self.pool.page_size
        if fmt is None or not fmt.page_scaled_keys:
            return [None] * self.n_layers
        snapshot: list[TailPage | None] = []
        for l in range(self.n_layers):
            end = self.start[l] + self.length[l]
            index = end // size
            partial = end % size and index < len(self.pages[l])
            snapshot.append(TailPage(index, end % size, self.pool.read_pages([self.pages[l][index]]))
                            if partial else None)
        return snapshot

    def truncate(self, n: int, snapshot: list[TailPage | None] | None = None) -> None:
        """Forget the last n tokens: every layer drops its last n slots (they must hold the last n positions:
        tokens fed since any compaction, and within a sliding-window layer's slack) and gives back the pages
        that held only them; logical_length goes back by n, so the next token takes the first dropped one's
        position. Page-scaled keys of a page left part full are encoded again from the slots it keeps (those
        held before `snapshot` was taken as they were then, tail_snapshot), as if the dropped ones never came.
        A ConfigError, with nothing changed, where the cache no longer holds what n tokens back it held."""
        if n == 0:
            return
        self._check_truncatable(n)
        size = self.pool.page_size
        snapshot = snapshot or [None] * self.n_layers
        for l in range(self.n_layers):
            self.length[l] -= n
            self.positions[l] = self.positions[l][:, :self.length[l]]
            end = self.start[l] + self.length[l]
            used = math.ceil(end / size)
            self.pool.release(self.pages[l][used:])
            self.pages[l] = self.pages[l][:used]
            self._table[l, used:] = 0
            if end % size and self.pool.kv_format is not None and self.pool.kv_format.page_scaled_keys:
                self._encode_last_page(l, snapshot[l])
        self.logical_length -= n

    def _check_truncatable(self, n: int) -> None:
        if not 0 < n <= self.logical_length:
            raise ConfigError(f"Cannot roll back {n} tokens of a sequence of {self.logical_length}.")
        if self.states is not None:
            raise ConfigError(f"Cannot roll back {n} tokens of a hybrid model's sequence: its recurrent state keeps "
                              f"no history.")
        last = np.arange(self.logical_length - n, self.logical_length)
        for l in range(self.n_layers):
            keeps = min(self.windows[l] - 1, self.logical_length - n) if self.windows[l] else 0
            if self.length[l] - n < keeps or self.positions[l].shape[1] < n or \
                    np.any(self.positions[l][:, self.positions[l].shape[1] - n:] != last):
                raise ConfigError(f"Cannot roll back {n} tokens: layer {l} no longer holds what it held {n} tokens "
                                  f"ago (an eviction or a sliding window dropped slots since).")

    def _encode_last_page(self, layer: int, before: TailPage | None) -> None:
        """Encode the keys of the layer's last page (part full) again over the slots it holds: those it held at
        `before` from that copy, the rest as stored now (kv_format.gather_slots, the compaction's rule)."""
        size, fmt = self.pool.page_size, self.pool.kv_format
        index = len(self.pages[layer]) - 1
        held = self.start[layer] + self.length[layer] - index * size
        page = self.pool.read_pages([self.pages[layer][index]])
        if before is not None and before.index == index and before.held <= held:
            source = np.concatenate([before.data, page])
            slots = np.concatenate([np.arange(before.held), size + np.arange(before.held, held)])
        else:
            source, slots = page, np.arange(held)
        encoded = gather_slots(fmt, source, [slots] * self.kv_heads)[:1]
        self.pool.write_pages([self.pages[layer][index]], encoded)

    @property
    def contiguous(self) -> bool:
        """Whether every layer holds every position from 0, in order (no eviction, nothing dropped by a sliding
        window yet): its full pages can be shared as a prompt prefix."""
        return not self.compacted and all(self.start[l] == 0 and self.length[l] == self.logical_length
                                          for l in range(self.n_layers))

    def keep_rows(self, keep) -> list[np.ndarray | None]:
        """Validate a keep set for compact(): one list for every layer and head, or per layer either one list
        (all heads) or an array [kv_heads, k] (one list per KV head; every head keeps the same count so the
        cache stays rectangular). Slot indices, strictly increasing, within the layer's length. Sliding-window
        layers keep their window: one list for all layers applies to the others, and a per-layer entry for a
        window layer must be None. Returns one [kv_heads, k] array per layer (None: left alone); raises
        KeepSetError before anything is changed."""
        rows = self._keep_per_layer(keep)
        for layer, layer_rows in enumerate(rows):
            if layer_rows is not None:
                self._validate_keep(layer, layer_rows)
        return rows

    def move_slots(self, rows: list[np.ndarray]) -> None:
        """Gather the kept slots to the front of each layer and head through host memory (the compiled
        snapkv_compact kernel does the same on the device when every layer keeps the same count): rows move whole,
        and keys whose scales are their page's are encoded again per destination page (kv_format.gather_slots)."""
        for layer, layer_rows in enumerate(rows):
            if not self.pages[layer] or layer_rows is None:
                continue
            data = self.pool.read_pages(self.pages[layer])    # [pages, 2 (or 1 packed), kv_heads, page_size, d]
            self.pool.write_pages(self.pages[layer], gather_slots(self.pool.kv_format, data, layer_rows))

    def record_compaction(self, rows: list[np.ndarray]) -> None:
        """Bookkeeping after the slots moved: lengths, kept positions, trailing pages back to the pool at once.
        logical_length is unchanged, so later tokens are still RoPE'd at their true positions."""
        self.compacted = True
        for layer, layer_rows in enumerate(rows):
            if layer_rows is None:
                continue
            k = layer_rows.shape[1]
            used = math.ceil(k / self.pool.page_size)
            self.pool.release(self.pages[layer][used:])
            self.pages[layer] = self.pages[layer][:used]
            self._table[layer, used:] = 0
            self.length[layer] = k
            self.positions[layer] = np.take_along_axis(self.positions[layer], layer_rows, axis=1)

    def _keep_per_layer(self, keep) -> list[np.ndarray]:
        if isinstance(keep, np.ndarray) and keep.ndim == 1 or (isinstance(keep, (list, tuple)) and
                                                                 (len(keep) == 0 or np.isscalar(keep[0]))):
            keep = [None if self.is_local(l) else keep for l in range(self.n_layers)]
        if len(keep) != self.n_layers:
            raise KeepSetError(f"compact() needs one keep list, or one per layer ({self.n_layers}); got {len(keep)}.")
        rows = []
        for layer, layer_keep in enumerate(keep):
            if self.is_local(layer) and layer_keep is not None:
                raise KeepSetError(f"Layer {layer} is a sliding-window layer: it keeps its last window; pass None "
                                   f"for it.")
            if layer_keep is None:
                if not self.is_local(layer):
                    raise KeepSetError(f"Layer {layer} needs a keep list (None is for sliding-window layers).")
                rows.append(None)
                continue
            a = np.asarray(layer_keep)
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise KeepSetError("Keep lists hold integer slot indices.")
            a = a.astype(np.int64)
            if a.ndim == 1:
                a = np.broadcast_to(a, (self.kv_heads, a.size))
            if a.ndim != 2 or a.shape[0] != self.kv_heads:
                raise KeepSetError(f"A per-head keep set must have shape [kv_heads={self.kv_heads}, k].")
            rows.append(a)
        return rows

    def _validate_keep(self, layer: int, rows: np.ndarray) -> None:
        n = self.length[layer]
        if rows.shape[1] > n:
            raise KeepSetError(f"Keep list for layer {layer} has {rows.shape[1]} slots but the layer holds {n}.")
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise KeepSetError(f"Keep list for layer {layer} has a slot outside [0, {n}).")
        if rows.shape[1] > 1 and np.any(np.diff(rows, axis=1) <= 0):
            raise KeepSetError(f"Keep list for layer {layer} is not strictly increasing (unsorted or duplicates).")
