"""The prefix cache's bookkeeping on a page pool without a device: blocks keyed by their whole prefix, one
reference per page, reclaim of the least recently used leaves only, and pool allocation reclaiming by itself."""
from __future__ import annotations

import numpy as np

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
    n, pages = cache.lookup(tokens + [99], limit=11)
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
    n, pages = cache.lookup(tokens + [1], limit=15)
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
