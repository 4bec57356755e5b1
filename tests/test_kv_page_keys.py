"""q4_ch keys (4 bits per channel over a page, sharpi.common.kv_format): the CPU kernels against the numpy emulation
of the same pages. Stores are bit-exact (kv_append re-encodes a page from what it holds, compaction each destination
page from its kept slots); attention and SnapKV scores read the dequantized pages within float tolerance."""
import numpy as np
import pytest

from sharpi.codegen.kernels.paged_attention import (make_kv_append, make_kv_append_batch, make_paged_attention,
                                                    make_paged_attention_batch)
from sharpi.codegen.kernels.snapkv import make_kv_compact, make_snapkv_score
from sharpi.common.errors import ConfigError
from sharpi.common.kv_format import (KVFormat, append_page_keys, dequantize_channels, encode_rows, gather_slots,
                                     quantize_channels)
from sharpi.testing.snapkv import score_reference
from test_kernels import _attention_reference, _build, _t
from test_kv_quant import _kernel, three_sequences

PAGE = 16
PAIRS = [("q4_ch", "q4_0"), ("q4_ch", "float16"), ("q4_ch", "q8_0")]


def _ids(pair):
    return "-".join(pair)


def emulate_append(fmt, pool, table_row, held, k, v):
    """numpy's kv_append of keys and values f32 [n, kvh, d] at slots held .. of the layer whose pages are
    table_row, into pool (uint8, changed in place): values row by row, keys a page at a time."""
    P, n = fmt.page_size, len(k)
    rows = encode_rows(fmt, k, v)
    value = fmt.part(1)
    for t in range(n):
        slot = held + t
        pool[table_row[slot // P], 0, :, slot % P, value.offset:value.offset + value.nbytes] = \
            rows[t, :, value.offset:value.offset + value.nbytes]
    for i in range(held // P, (held + n - 1) // P + 1):
        lo, hi = max(held, i * P), min(held + n, (i + 1) * P)
        page = table_row[i]
        pool[page, 0] = append_page_keys(fmt, pool[page, 0], lo - i * P, k[lo - held:hi - held])


def _layer_values(fmt, pool, table_row, count, which):
    """What a layer's slots 0 .. count - 1 hold, read back: f32 [count, kvh, d]."""
    pages = pool[table_row[:(count + fmt.page_size - 1) // fmt.page_size]]
    return fmt.decode(pages, which).transpose(0, 2, 1, 3).reshape(-1, fmt.kv_heads, fmt.head_dim)[:count]


def _appended(fmt, k_all, v_all, held, table, layer):
    """(tvm pool, numpy pool) after slots 0 .. held - 1 were appended in one call and the rest in a second."""
    pool = np.zeros(fmt.pool_shape(int(table.max()) + 2), np.uint8)
    expected = pool.copy()
    lens = np.zeros(table.shape[0], np.int32)
    tvm_pool = _t(pool)
    append = _kernel(make_kv_append, fmt.kv_heads, fmt.head_dim, PAGE, kv_dtype=fmt)
    if held:
        append(tvm_pool, _t(k_all[:held]), _t(v_all[:held]), _t(table), _t(lens), layer)
        emulate_append(fmt, expected, table[layer], 0, k_all[:held], v_all[:held])
    lens[layer] = held
    append(tvm_pool, _t(k_all[held:]), _t(v_all[held:]), _t(table), _t(lens), layer)
    emulate_append(fmt, expected, table[layer], held, k_all[held:], v_all[held:])
    return tvm_pool, expected, lens


def test_the_rule_is_within_half_a_step_and_stable(rng):
    """A channel's values come back within half its step (range / 15) plus the f16 rounding of the minimum and
    scale; a constant channel comes back as its f16 value; a page encoded again from what it holds keeps its
    bytes (what lets kv_append re-encode held slots without drifting)."""
    x = (rng.standard_normal((3, 16, 64)) * rng.uniform(0.01, 30, (3, 1, 64))).astype(np.float32)
    x[1, :, 5] = 2.5
    q, d, m = quantize_channels(x)
    back = dequantize_channels(q, d, m)
    step = (x.max(1) - x.min(1)) / 15
    slack = np.abs(x).max(1) * 2.0 ** -10 + step * 16 * 2.0 ** -11
    assert np.all(np.abs(back - x) <= (step / 2 + slack)[:, None] + 1e-6)
    assert np.all(back[1, :, 5] == 2.5)
    q2, d2, m2 = quantize_channels(back)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(d2, d)
    np.testing.assert_array_equal(m2, m)


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("held,new", [(0, 23), (15, 1), (21, 17), (3, 40), (32, 1)])
def test_append_stores_the_emulated_pages(pair, held, new, rng):
    """kv_append's pages equal numpy's byte for byte (pages out of order, a page started by one call and
    finished by the next, a call spanning three pages); pages the layer does not hold stay untouched."""
    kv_heads, d, layer = 2, 64, 1
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    table = np.zeros((3, 4), np.int32)
    table[layer] = [6, 2, 9, 4]
    k_all = (3 * rng.standard_normal((held + new, kv_heads, d)) + rng.standard_normal(d)).astype(np.float32)
    v_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    pool, expected, _ = _appended(fmt, k_all, v_all, held, table, layer)
    np.testing.assert_array_equal(pool.numpy(), expected)
    assert expected[table[layer][:(held + new + PAGE - 1) // PAGE]].any()
    # and what it holds is the keys within 4 bits of each channel's range in its page
    stored = _layer_values(fmt, expected, table[layer], held + new, 0)
    assert np.abs(stored - k_all).max() < 0.1 * (k_all.max() - k_all.min())


@pytest.mark.parametrize("pair", PAIRS[:2], ids=_ids)
@pytest.mark.parametrize("held,new,window", [(0, 23, 0), (30, 1, 0), (20, 17, 19), (40, 1, 19)])
def test_attention_reads_the_stored_pages(pair, held, new, window, rng):
    heads, kv_heads, d, layer = 4, 2, 64, 0
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    table = np.asarray([[5, 2, 9, 1, 7]], np.int32)
    k_all = (2 * rng.standard_normal((held + new, kv_heads, d))).astype(np.float32)
    v_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    pool, expected, lens = _appended(fmt, k_all, v_all, held, table, layer)
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((new, heads, d), np.float32))
    _kernel(make_paged_attention, heads, kv_heads, d, PAGE, d ** -0.5, 1 if new == 1 else None, kv_dtype=fmt,
            window=window)(_t(q), pool, _t(table), _t(lens), layer, out)
    k_seen, v_seen = (_layer_values(fmt, expected, table[layer], held + new, w) for w in (0, 1))
    np.testing.assert_allclose(out.numpy(), _attention_reference(q, k_seen, v_seen, held, window), rtol=1e-4,
                               atol=1e-5)


def test_batched_append_and_attention(rng):
    """decode_batch's kernels: token b re-encodes sequence b's last page with its own key, and attends over its
    sequence only."""
    heads, kv_heads, d, layers, layer = 4, 2, 64, 2, 1
    fmt = KVFormat("q4_ch", "q4_0", kv_heads, PAGE, d)
    pool, tables, lens, ks, vs = three_sequences(fmt, layers, layer, rng)
    held = list(lens[:, layer])
    expected = np.zeros(fmt.pool_shape(14), np.uint8)
    for b, h in enumerate(held):
        emulate_append(fmt, expected, tables[b, layer], 0, ks[b][:h], vs[b][:h])
        emulate_append(fmt, expected, tables[b, layer], h, ks[b][h:], vs[b][h:])
    _build(make_kv_append_batch(kv_heads, d, PAGE, kv_dtype=fmt))(
        pool, _t(np.stack([k[-1] for k in ks])), _t(np.stack([v[-1] for v in vs])), _t(tables), _t(lens), layer)
    np.testing.assert_array_equal(pool.numpy(), expected)
    q = rng.standard_normal((3, heads, d)).astype(np.float32)
    out = _t(np.zeros((3, heads, d), np.float32))
    _build(make_paged_attention_batch(heads, kv_heads, d, PAGE, d ** -0.5, kv_dtype=fmt))(
        _t(q), pool, _t(tables), _t(lens), layer, out)
    for b, h in enumerate(held):
        k_seen, v_seen = (_layer_values(fmt, expected, tables[b, layer], h + 1, w) for w in (0, 1))
        np.testing.assert_allclose(out.numpy()[b:b + 1], _attention_reference(q[b:b + 1], k_seen, v_seen, h),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_snapkv_scores_read_the_stored_pages(reduce, rng):
    heads, kv_heads, d, held, new, window, max_pages = 4, 2, 64, 20, 30, 8, 5
    fmt = KVFormat("q4_ch", "q4_0", kv_heads, PAGE, d)
    table = np.asarray([[5, 2, 9, 1, 7]], np.int32)
    keys = (2 * rng.standard_normal((held + new, kv_heads, d))).astype(np.float32)
    values = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    pool, expected, lens = _appended(fmt, keys, values, held, table, 0)
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((kv_heads, max_pages * PAGE), np.float32))
    signed = window if reduce == "sum" else -window
    _kernel(make_snapkv_score, heads, kv_heads, d, PAGE, max_pages, d ** -0.5, kv_dtype=fmt)(
        _t(q), pool, _t(table), _t(lens), 0, _t(np.array([signed], np.int32)), out)
    k_seen = _layer_values(fmt, expected, table[0], held + new, 0)
    np.testing.assert_allclose(out.numpy()[:, :held + new], score_reference(q[-window:], k_seen, held, d ** -0.5,
                                                                            reduce), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pair", PAIRS[::2], ids=_ids)
def test_compaction_reencodes_each_destination_page(pair, rng):
    """snapkv_compact's pages equal kv_format.gather_slots' byte for byte: kept values move by their bytes, kept
    keys are encoded again per destination page from what their source pages held; a layer with count 0 is left
    alone."""
    kv_heads, d, layers, max_pages, total = 2, 64, 2, 3, 40
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    table = np.asarray([[1, 4, 2], [3, 5, 6]], np.int32)
    pool = np.zeros(fmt.pool_shape(7), np.uint8)
    for l in range(layers):
        emulate_append(fmt, pool, table[l], 0, *(3 * rng.standard_normal((2, total, kv_heads, d))).astype(np.float32))
    keep = np.zeros((layers, kv_heads, max_pages * PAGE), np.int32)
    kept = 21                                     # a full destination page and a part of one
    count = np.asarray([kept, 0], np.int32)
    sources = [np.sort(rng.choice(total, kept, replace=False)) for _ in range(kv_heads)]
    for h in range(kv_heads):
        keep[0, h, :kept] = sources[h]
    tvm_pool = _t(pool)
    _build(make_kv_compact(layers, kv_heads, d, PAGE, max_pages, kv_dtype=fmt))(tvm_pool, _t(table), _t(keep),
                                                                                _t(count))
    after = tvm_pool.numpy()
    expected = pool.copy()
    expected[table[0]] = gather_slots(fmt, pool[table[0]], sources)
    np.testing.assert_array_equal(after[table[0, :2]], expected[table[0, :2]])
    np.testing.assert_array_equal(after[table[1]], pool[table[1]])
    # the kept keys read back within a step of what they held before
    before = _layer_values(fmt, pool, table[0], total, 0)
    now = _layer_values(fmt, after, table[0], kept, 0)
    for h in range(kv_heads):
        assert np.abs(now[:, h] - before[sources[h], h]).max() < 0.15 * np.ptp(before[:, h])


def test_formats_take_q4_ch_for_keys_only():
    assert KVFormat("q4_ch", "q4_0", 1, PAGE, 64).row_bytes == 48 + 36      # 32 quant bytes + 4 channels' d, m
    assert KVFormat("q4_ch", "q4_0", 1, PAGE, 256).part(0).nbytes == 128 + 64
    with pytest.raises(ConfigError, match="q4_ch is a key type"):
        KVFormat("q4_0", "q4_ch", 1, PAGE, 64)
    with pytest.raises(ConfigError, match="multiple of the page size"):
        KVFormat("q4_ch", "q4_0", 1, 64, 96)


# -- end to end on a tiny model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen2 (key bias shaped as Qwen2.5's) and its q4_ch / q4_0 artifacts with and without the SnapKV ops
    (float matmuls: exact to the numpy reference but for the cache's rounding)."""
    import sharpi
    from test_kv_quant import tiny_qwen_path
    path = tiny_qwen_path.__wrapped__(tmp_path_factory)
    out = tmp_path_factory.mktemp("q4ch-artifacts")
    made = {snapkv: sharpi.load(sharpi.compile(str(path), output=out / snapkv, matmuls="float", kv_dtype_k="q4_ch",
                                               kv_dtype_v="q4_0", snapkv=snapkv, use_cache=False))
            for snapkv in ("on", "off")}
    return path, made


def test_tiny_model_matches_the_reference_fed_call_by_call(tiny):
    """Prefill, decode steps that continue a page, a batched decode of two forks, compaction on the device and
    through host memory, and decode after it: each equals the float32 forward fed call by call whose cache holds
    what a q4_ch / q4_0 cache holds (testing.reference.ReferenceSession), within the float32 tolerance; the host's
    view of the keys is that cache (plus the key bias)."""
    from sharpi.runtime.session import decode_batch
    from sharpi.testing.reference import NumpyReference, ReferenceSession
    path, made = tiny
    model = made["on"]
    assert model.manifest.kv_types == ("q4_ch", "q4_0") and model.manifest.kv_key_offset == "attn_k.bias"
    ref = NumpyReference(path)
    ref.kv_types = ("q4_ch", "q4_0")
    ids = list(np.random.default_rng(3).integers(0, model.config.vocab_size, 44))
    close = dict(rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(model.score(ids), ref.forward(ids), **close)
    with model.session() as s:
        r = ReferenceSession(ref)
        np.testing.assert_allclose(s.prefill(ids[:30]), r.feed(ids[:30])[-1], **close)
        for i in range(30, 34):           # slots 30 .. 33: the page of 16 .. 31 re-encoded, then a new page
            np.testing.assert_allclose(s.decode(ids[i]), r.feed(ids[i:i + 1])[0], **close)
        keys = s.cached_keys()
        # the engine's keys differ from numpy's by float rounding (~1e-6), which may move a page's f16 minimum or
        # scale by an f16 step (2.4e-4 near 0.45) and the values read back with it
        for l in range(2):
            np.testing.assert_allclose(keys[l], r.keys[l] + ref.cache_offset(l, (2, 1, 32)), atol=2e-3)
        with s.fork() as a, s.fork() as b:
            expected = r.feed(ids[34:35])[0]
            np.testing.assert_allclose(decode_batch([a, b], [ids[34]] * 2), [expected, expected], **close)
    for snapkv in ("on", "off"):
        with made[snapkv].session() as s:
            r = ReferenceSession(ref)
            s.prefill(ids[:36]), r.feed(ids[:36])
            keep = [np.sort(np.stack([np.random.default_rng(10 * l + h).choice(36, 21, replace=False)
                                      for h in range(2)]), axis=1) for l in range(2)]
            s.compact(keep)
            r.compact(keep)                  # slots are positions here: nothing was compacted before
            for i in range(36, 39):
                np.testing.assert_allclose(s.decode(ids[i]), r.feed(ids[i:i + 1])[0], **close, err_msg=snapkv)


def test_q4_ch_is_refused_for_values(tiny, tmp_path):
    import sharpi
    path, _ = tiny
    with pytest.raises(ConfigError, match="q4_ch is a key type"):
        sharpi.compile(str(path), kv_dtype="q4_ch", output=tmp_path / "both")
    with pytest.raises(ConfigError, match="q4_ch is a key type"):
        sharpi.compile(str(path), target="vulkan", kv_dtype_v="q4_ch", output=tmp_path / "values")
    assert not (tmp_path / "both").exists() and not (tmp_path / "values").exists()
