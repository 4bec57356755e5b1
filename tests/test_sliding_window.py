"""Sliding-window layers in the paged cache: a local layer holds at most its window and gives pages back as the
sequence grows; SnapKV evicts only the global layers (local ones keep their last window). Bookkeeping on a toy
pool, then Gemma 3 (window 512, global layers 5, 11, 17) against the exact numpy reference."""
from __future__ import annotations

import numpy as np
import pytest

import sharpi
from sharpi.runtime.kv_cache import PagePool, SequenceCache

PAGE, WINDOW = 4, 6


def _toy_cache(pages=64):
    pool = PagePool(backend=None, num_pages=pages, page_size=PAGE, page_bytes=100)
    return pool, SequenceCache(pool, n_layers=2, kv_heads=1, max_pages=16, windows=[WINDOW, 0])


@pytest.mark.parametrize("chunks", [[1] * 30, [13, 1, 1, 9, 1], [5, 5, 5, 5]])
def test_local_layer_keeps_its_window_and_returns_pages(chunks):
    pool, cache = _toy_cache()
    fed = 0
    for n in chunks:
        cache.reserve(n)
        # every slot the forward writes has a page, after the held ones
        assert len(cache.pages[0]) * PAGE >= cache.kv_lens()[0] + n
        cache.advance(n)
        fed += n
        held = min(fed, WINDOW - 1)          # the next query sees itself and the WINDOW - 1 before it
        assert cache.length == [held, fed]
        np.testing.assert_array_equal(cache.positions[0][0], np.arange(fed - held, fed))
        assert cache.kv_lens()[0] == cache.start[0] + held and cache.start[0] < PAGE
        assert len(cache.pages[0]) == -(-(cache.start[0] + held) // PAGE)       # no page holds only dropped slots
        assert pool.free_count == pool.num_pages - len(cache.pages[0]) - len(cache.pages[1])
        assert list(cache.page_table()[0, :len(cache.pages[0])]) == cache.pages[0]
    cache.release()
    assert pool.free_count == pool.num_pages


def test_keep_sets_leave_local_layers_alone():
    _, cache = _toy_cache()
    cache.reserve(10)
    cache.advance(10)
    rows = cache.keep_rows([1, 4, 7])                  # one list: the global layer's
    assert rows[0] is None and rows[1].tolist() == [[1, 4, 7]]
    with pytest.raises(sharpi.KeepSetError, match="sliding-window layer"):
        cache.keep_rows([[0, 1], [1, 4, 7]])
    with pytest.raises(sharpi.KeepSetError, match="needs a keep list"):
        cache.keep_rows([None, None])


# -- Gemma 3 ----------------------------------------------------------------------------------------------------
PROMPT, DECODE = 600, 4          # past the 512 window in both the chunked prefill (512 + 88) and decode


@pytest.fixture(scope="module")
def long_ids(gemma3):
    """PROMPT + DECODE tokens of the golden text, repeated (BOS first)."""
    import json
    from conftest import DATA
    ids = json.loads((DATA / "gemma3-270m-q4_k_m.json").read_text())["teacher_forced"]["ids"]
    body = ids[1:] * (-(-(PROMPT + DECODE) // (len(ids) - 1)))
    return ids[:1] + body[:PROMPT + DECODE - 1]


def _local(model):
    return [l for l in range(model.config.n_layers) if model.config.is_local(l)]


def _close(got, want):
    """Same top token and logits within 1% of the reference's spread (float32 kernels vs float32 numpy; the
    quantized weights are dequantized exactly by both)."""
    assert int(np.argmax(got)) == int(np.argmax(want))
    assert np.abs(got - want).max() <= 0.01 * want.std(), (np.abs(got - want).max(), want.std())


@pytest.mark.slow
def test_gemma3_sliding_window_in_the_cache(gemma3, gemma3_reference, long_ids):
    local = _local(gemma3)
    reference = gemma3_reference.forward(long_ids)
    pool = gemma3.engine.pool
    free_before = pool.free_count
    with gemma3.session() as s:
        got = [s.prefill(long_ids[:PROMPT])]
        got += [s.decode(t) for t in long_ids[PROMPT:PROMPT + DECODE - 1]]
        total = PROMPT + DECODE - 1
        for l in range(gemma3.config.n_layers):
            assert s.kv_length[l] == (511 if l in local else total)
        pages = [len(p) for p in s._cache.pages]
        assert max(pages[l] for l in local) <= 512 // 16 + 1          # the window's pages, +1 partly dropped
        assert s.kv_bytes == sum(pages) * pool.page_bytes
        assert free_before - pool.free_count == sum(pages)             # everything else is back in the pool
    assert pool.free_count == free_before
    for row, logits in zip(range(PROMPT - 1, PROMPT + DECODE - 1), got):
        _close(logits, reference[row])


@pytest.mark.slow
def test_gemma3_snapkv_evicts_global_layers_only(gemma3, gemma3_reference, long_ids):
    """The rule: global layers keep their SnapKV keep sets (budget slots), local layers their last window; the
    next token's logits equal the reference attending over exactly those positions."""
    local, budget = _local(gemma3), 256
    prompt, token = long_ids[:PROMPT], long_ids[PROMPT]
    with gemma3.session(snapkv_budget=budget) as s:
        s.prefill(prompt)
        assert s.evicted and s.logical_length == PROMPT
        kept = s.kept_positions
        for l in range(gemma3.config.n_layers):
            if l in local:
                np.testing.assert_array_equal(kept[l][0], np.arange(PROMPT - 511, PROMPT))
            else:
                assert kept[l].shape == (1, budget) and np.all(np.diff(kept[l][0]) > 0)
                assert kept[l][0, -1] == PROMPT - 1          # the recency window is kept
        got = s.decode(token)
    _close(got, gemma3_reference.decode_after_compaction(prompt, kept, token))
