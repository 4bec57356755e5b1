"""The prefix cache's bookkeeping on a page pool without a device: blocks keyed by their whole prefix, one
reference per page, reclaim of the least recently used leaves only, and pool allocation reclaiming by itself;
the conversation cache of compressed sequences: exact continuations only, the longest, the same SnapKV settings,
least recently used first."""
from __future__ import annotations

import numpy as np

from sharpi.runtime.conversation_cache import ConversationCache
from sharpi.runtime.kv_cache import PagePool, SequenceCache
from sharpi.runtime.prefix_cache import PrefixCache

PAGE, LAYERS = 4, 2


class _NoDevice:
    def copy_pages(self, src, dst):
        pass


def _pool(pages: int = 32) -> PagePool:
    return PagePool(_NoDevice(), pages, PAGE, page_bytes=1)


def _sequence(pool: PagePool, tokens: list[int]) -> SequenceCache:
    cache = SequenceCache(pool, LAYERS, 1, max_pages=8)
    cache.reserve(len(tokens))
    cache.advance(len(tokens))
    return cache


def test_lookup_finds_the_longest_cached_prefix_in_whole_pages():
    pool = _pool()
    cache = PrefixCache(pool, LAYERS)
    tokens = list(range(10))                               # 2 full pages and a part
    seq = _sequence(pool, tokens)
    assert cache.insert(tokens, seq) == 2 and cache.pages == 2 * LAYERS
    assert all(pool.refs[p] == 2 for l in range(LAYERS) for p in seq.pages[l][:2])
    n, pages, _ = cache.lookup(tokens + [99], limit=11)
    assert n == 8 and pages == [seq.pages[l][:2] for l in range(LAYERS)]
    assert cache.lookup(tokens, limit=7)[0] == 4           # the limit counts in whole pages
    assert cache.lookup([0, 1, 2, 3, 4, 5, 6, 0, 8], limit=9)[0] == 4     # the second page differs
    assert cache.lookup([9] + tokens[1:], limit=10)[0] == 0
    # the same second page's tokens after another first page is another block: keys hold the whole prefix
    other = [7, 7, 7, 7] + tokens[4:8]
    assert cache.lookup(other, limit=8)[0] == 0


def test_reclaim_frees_only_pages_the_cache_alone_holds_leaves_first():
    pool = _pool()
    cache = PrefixCache(pool, LAYERS)
    a, b = list(range(8)), list(range(100, 112))
    seq_a, seq_b = _sequence(pool, a), _sequence(pool, b)
    cache.insert(a, seq_a)
    cache.insert(b, seq_b)
    assert cache.reclaimable() == 0 and cache.reclaim(100) == 0       # both sequences still hold them
    seq_a.release()
    assert cache.reclaimable() == 2 * LAYERS
    cache.lookup(a, limit=8)                               # a is now the most recently used
    seq_b.release()
    assert cache.reclaim(1) == LAYERS                      # one block: b's last page (the LRU leaf)
    assert cache.lookup(b, limit=12)[0] == 8 and cache.lookup(a, limit=8)[0] == 8
    free = pool.free_count
    assert cache.reclaim(100) == 4 * LAYERS and pool.free_count == free + 4 * LAYERS and cache.blocks == 0
    assert pool.free_count == pool.num_pages


def test_the_pool_reclaims_from_the_cache_when_it_runs_short():
    pool = _pool(pages=12)
    cache = PrefixCache(pool, LAYERS)
    pool.reclaim = cache.reclaim
    tokens = list(range(16))                               # 4 pages a layer: 8 of the 12
    seq = _sequence(pool, tokens)
    cache.insert(tokens, seq)
    seq.release()
    assert pool.free_count == 4 and cache.reclaimable() == 8
    other = SequenceCache(pool, LAYERS, 1, max_pages=8)
    n, pages, _ = cache.lookup(tokens + [1], limit=15)
    other.adopt(pages, n)                                  # 12 tokens: 3 pages a layer, shared
    assert n == 12 and np.all(pool.refs[pages[0]] == 2)
    other.reserve(4)                                       # a fresh page a layer: from the free list
    fresh = other.pages[0][3]
    assert pool.refs[fresh] == 1 and pool.free_count == 2
    other.advance(4)
    grown = SequenceCache(pool, LAYERS, 1, max_pages=8)
    grown.reserve(8)                                       # 4 pages: the 2 free, the 2 of the block only the
    assert pool.free_count == 0 and cache.blocks == 3      # cache held (the others are shared: not reclaimed)
    grown.release()
    other.release()
    cache.clear()
    assert pool.free_count == pool.num_pages and not pool.refs.any()


class _CompressedSession:
    """What the conversation cache reads of a finished compressed session (sharpi.runtime.session.Session)."""

    def __init__(self, pool: PagePool, tokens: list[int], budget: int = 8):
        self.cache = _sequence(pool, tokens[:budget])       # a compressed cache: fewer slots than tokens seen
        self.logical_length, self.evicted, self.closed = len(tokens), True, False
        self.snapkv, self.snapkv_budget, self.scorer = "settings", budget, None

    def close(self):
        if not self.closed:
            self.cache.release()
            self.closed = True


def test_the_conversation_cache_serves_only_exact_continuations_and_gives_pages_back():
    pool = _pool()
    cache = ConversationCache(pool, max_entries=3)
    one, two = list(range(20)), list(range(100, 130))
    a, b = _CompressedSession(pool, one), _CompressedSession(pool, two)
    assert cache.insert(one, a, 16) and cache.insert(two, b, 16)
    assert cache.reclaimable() == 2 * 2 * LAYERS and len(cache.page_set()) == 2 * 2 * LAYERS
    assert cache.lookup(one + [7], like=a).session is a          # continues `one` exactly
    assert cache.lookup(one, like=a) is None                     # nothing left to compute
    assert cache.lookup([1] + one[1:] + [7], like=a) is None     # not its tokens: never a prefix of another prompt
    other = _CompressedSession(pool, [5])
    other.snapkv_budget = 4
    assert cache.lookup(one + [7], like=other) is None           # other SnapKV settings
    longer = _CompressedSession(pool, one + [7, 8])
    assert cache.insert(one + [7, 8], longer, 16)
    assert cache.lookup(one + [7, 8, 9], like=a).session is longer    # the longest entry
    not_compressed = _CompressedSession(pool, [1, 2])
    not_compressed.evicted = False
    assert not cache.insert([1, 2], not_compressed, 2)
    free = pool.free_count
    assert cache.reclaim(1) == 2 * LAYERS and b.closed           # `two`, the least recently used, goes first
    assert pool.free_count == free + 2 * LAYERS
    cache.insert([9] * 20, _CompressedSession(pool, [9] * 20), 16)
    cache.insert([8] * 20, _CompressedSession(pool, [8] * 20), 16)
    assert len(cache) == 3 and a.closed                          # the entry bound drops the LRU one
    cache.clear()
    assert len(cache) == 0 and longer.closed
