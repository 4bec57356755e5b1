"""KV compaction (the seed's PagedKvCache.Compact tests in this project's terms), on the real model's cache."""
import numpy as np
import pytest

import sharpi


def _layer_slots(session, model, layer):
    """The held K/V of one layer, [2, kv_heads, length, head_dim], read from the pool."""
    cache = session._cache
    pages = model.engine.pool.read_pages(cache.pages[layer])      # [pages, 2, kv_heads, page_size, head_dim]
    slots = np.arange(cache.length[layer])
    return pages[slots // cache.pool.page_size, :, :, slots % cache.pool.page_size, :].transpose(1, 2, 0, 3).copy()


@pytest.fixture
def session20(smollm2):
    s = smollm2.session()
    s.prefill(smollm2.tokenize("The grass is green. The sky is blue. The sun is yellow. Here we go. " * 2)[:20])
    assert s.kv_length == [20] * smollm2.config.n_layers
    yield s
    s.close()


def test_keep_everything_is_a_no_op(smollm2, session20):
    before = [_layer_slots(session20, smollm2, l) for l in range(smollm2.config.n_layers)]
    session20.compact(list(range(20)))
    assert session20.kv_length == [20] * smollm2.config.n_layers and session20.logical_length == 20
    for l in range(smollm2.config.n_layers):
        np.testing.assert_array_equal(_layer_slots(session20, smollm2, l), before[l])


def test_keep_subset_keeps_order_and_values_in_every_layer(smollm2, session20):
    keep = [0, 5, 11, 17, 19]
    before = [_layer_slots(session20, smollm2, l) for l in range(smollm2.config.n_layers)]
    free_before = smollm2.engine.pool.free_count
    session20.compact(keep)
    assert session20.kv_length == [5] * smollm2.config.n_layers and session20.logical_length == 20
    assert smollm2.engine.pool.free_count == free_before + smollm2.config.n_layers   # 2 pages -> 1 page a layer
    for l in range(smollm2.config.n_layers):
        np.testing.assert_array_equal(_layer_slots(session20, smollm2, l), before[l][:, :, keep])
        np.testing.assert_array_equal(session20.kept_positions[l], np.tile(keep, (smollm2.config.n_kv_heads, 1)))


def test_append_after_compaction_lands_at_the_compacted_tail(smollm2, session20):
    session20.compact([0, 5, 11, 17, 19])
    session20.decode(42)
    assert session20.kv_length == [6] * smollm2.config.n_layers and session20.logical_length == 21
    assert all(p[:, -1].tolist() == [20] * smollm2.config.n_kv_heads for p in session20.kept_positions)


def test_per_head_keep_sets(smollm2, session20):
    kvh = smollm2.config.n_kv_heads
    rows = np.array([[0, 3, 19], [1, 2, 4], [5, 6, 7]])[:kvh]
    before = _layer_slots(session20, smollm2, 0)
    session20.compact([rows] * smollm2.config.n_layers)
    after = _layer_slots(session20, smollm2, 0)
    for h in range(kvh):
        np.testing.assert_array_equal(after[:, h], before[:, h, rows[h]])
    np.testing.assert_array_equal(session20.kept_positions[0], rows)


@pytest.mark.parametrize("keep", [[0, 20], [-1, 3], [3, 2], [1, 1, 2], list(range(21)), [0.5, 1.5]])
def test_bad_keep_lists_raise(session20, keep):
    with pytest.raises(sharpi.KeepSetError):
        session20.compact(keep)
    assert session20.kv_length[0] == 20     # nothing was touched
    with pytest.raises(ValueError):          # KeepSetError is also a ValueError
        session20.compact(keep)
