"""q4_ch keys (4 bits per channel over a page) on the GPU kernels (gpu/kv_rows.py's page encode: a workgroup per
page and KV head), built to WGSL and run on Vulkan (lavapipe in CI), against kv_format's numpy emulation: appends
and compaction byte for byte, attention and SnapKV scores within float tolerance of numpy on the pages as stored,
and a tiny qwen2 on Vulkan equal to the float32 forward fed call by call with the same cache. head_dim 96: three
q4_0 blocks a value, six channels' stats a key row."""
import numpy as np
import pytest
from tvm import relax, tirx

from sharpi.common.kv_format import KVFormat, gather_slots
from sharpi.testing.snapkv import score_reference
from test_kernels import _attention_reference
from test_kv_page_keys import PAGE, _layer_values, emulate_append
from test_kv_quant_gpu import (D, HEADS, KV_HEADS, LAYER, LAYERS, MAX_PAGES, POOL_PAGES, SCALE, _name, _table, _words,
                               add_pool_kernels)
from vulkan_device import plan_runner

PAIRS = [("q4_ch", "q4_0"), ("q4_ch", "q8_0"), ("q4_ch", "float16")]
READ_PAIR = PAIRS[0]
# the emulation decodes whole pages, and a pool of random bytes holds NaN halves in the slots no call writes
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _ids(pair):
    return "-".join(pair)


def _fmt(pair) -> KVFormat:
    return KVFormat(*pair, KV_HEADS, PAGE, D)


def _module():
    """append_ and compact_ for every pair; attend_, append_batch_, attend_batch_ and score_ for READ_PAIR."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    for pair in PAIRS:
        add_pool_kernels(bb, _fmt(pair), n, reads=pair == READ_PAIR, compact=True)
    return bb.get()


@pytest.fixture(scope="module")
def vk(tmp_path_factory):
    return plan_runner(_module(), tmp_path_factory.mktemp("kv-page-keys-gpu"))


def _keys(rng, n):
    """Keys [n, kv_heads, D] whose channels differ in offset and spread by orders of magnitude (1e-4 .. 1e3, all
    within f16's range), with a constant channel (scale 0) and a channel of one value repeated but once."""
    spread = 10.0 ** rng.uniform(-4, 3, (1, KV_HEADS, D))
    x = rng.standard_normal((n, KV_HEADS, D)) * spread + rng.uniform(-100, 100, (1, KV_HEADS, D))
    x[:, 0, 5] = -1.25
    x[:, 1, 40] = 3.0
    x[n // 2, 1, 40] = 3.5
    return x.astype(np.float32)


def _appended(vk, fmt, k, v, held, table, garbage):
    """(Vulkan pool, numpy pool) after slots 0 .. held - 1 were appended in one call and the rest in a second."""
    pool, expected = _words(garbage), garbage.copy()
    lens = np.array([7, 7], np.int32)
    lens[LAYER] = 0
    if held:
        pool = vk.run(_name("append", fmt), pool, k[:held], v[:held], table, lens)
        emulate_append(fmt, expected, table[LAYER], 0, k[:held], v[:held])
    lens[LAYER] = held
    pool = vk.run(_name("append", fmt), pool, k[held:], v[held:], table, lens)
    emulate_append(fmt, expected, table[LAYER], held, k[held:], v[held:])
    return pool, expected, lens


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_append_stores_the_emulated_pages(vk, pair, rng):
    """kv_append's pages equal numpy's byte for byte (pages out of order, a page started by one call and continued
    by the next, a call across three pages, one starting on a page boundary, a single token); bytes the calls do not
    write (the rest of the pool: random bytes) stay as they were."""
    fmt = _fmt(pair)
    for held, new in ((0, 23), (15, 1), (21, 17), (3, 40), (32, 1)):
        table = _table(rng)
        garbage = rng.integers(0, 256, fmt.pool_shape(POOL_PAGES), np.uint8)
        k, v = _keys(rng, held + new), rng.standard_normal((held + new, KV_HEADS, D)).astype(np.float32)
        pool, expected, _ = _appended(vk, fmt, k, v, held, table, garbage)
        np.testing.assert_array_equal(pool.view(np.uint8), expected, err_msg=f"held={held} new={new}")


def test_batched_append_and_attention(vk, rng):
    """decode_batch's kernels: token b re-encodes sequence b's last page with its key (bit-exact) and attends over
    its sequence only."""
    fmt = _fmt(READ_PAIR)
    held = [5, 16, 33]
    tables = np.stack([_table(np.random.default_rng(b)) for b in range(3)])
    tables[:, LAYER] = np.arange(3 * MAX_PAGES).reshape(3, MAX_PAGES)
    ks = [_keys(rng, h + 1) for h in held]
    vs = [rng.standard_normal((h + 1, KV_HEADS, D)).astype(np.float32) for h in held]
    pool = np.zeros(fmt.pool_shape(POOL_PAGES), np.uint8)
    for b, h in enumerate(held):
        emulate_append(fmt, pool, tables[b, LAYER], 0, ks[b][:h], vs[b][:h])
    lens = np.zeros((3, LAYERS), np.int32)
    lens[:, LAYER] = held
    stored = vk.run(_name("append_batch", fmt), _words(pool), np.stack([k[-1] for k in ks]),
                    np.stack([v[-1] for v in vs]), tables, lens)
    for b, h in enumerate(held):
        emulate_append(fmt, pool, tables[b, LAYER], h, ks[b][h:], vs[b][h:])
    np.testing.assert_array_equal(stored.view(np.uint8), pool)
    q = rng.standard_normal((3, HEADS, D)).astype(np.float32)
    for function in ("attend_batch", "attend_batch_split"):     # one workgroup a (sequence, head), and CUDA's split
        out = vk.run(_name(function, fmt), q, stored, tables, lens)
        for b, h in enumerate(held):
            k_seen, v_seen = (_layer_values(fmt, pool, tables[b, LAYER], h + 1, w) for w in (0, 1))
            np.testing.assert_allclose(out[b:b + 1], _attention_reference(q[b:b + 1], k_seen, v_seen, h),
                                       rtol=1e-4, atol=2e-5, err_msg=function)


def test_attention_reads_the_stored_pages(vk, rng):
    """Prefill from empty, prefill after held slots, decode, and the tiled prompt kernel on each: numpy's
    attention over the pages as stored."""
    fmt = _fmt(READ_PAIR)
    for held, new in ((0, 23), (20, 17), (40, 1)):
        table = _table(rng)
        k, v = (2 * rng.standard_normal((2, held + new, KV_HEADS, D))).astype(np.float32)
        pool, expected, lens = _appended(vk, fmt, k, v, held, table,
                                         rng.integers(0, 256, fmt.pool_shape(POOL_PAGES), np.uint8))
        lens[LAYER] = held
        q = rng.standard_normal((new, HEADS, D)).astype(np.float32)
        k_seen, v_seen = (_layer_values(fmt, expected, table[LAYER], held + new, w) for w in (0, 1))
        for kind in ("attend", "attend_flash"):
            out = vk.run(_name(kind, fmt), q, pool, table, lens)
            np.testing.assert_allclose(out, _attention_reference(q, k_seen, v_seen, held), rtol=1e-4, atol=2e-5,
                                       err_msg=f"{kind} held={held} new={new}")


def test_snapkv_scores_read_the_stored_pages(vk, rng):
    """Row stats and score (summed over the window, and its maximum) over the keys as stored."""
    fmt = _fmt(READ_PAIR)
    held, new, window = 20, 30, 8
    table = _table(rng)
    k, v = (2 * rng.standard_normal((2, held + new, KV_HEADS, D))).astype(np.float32)
    pool, expected, lens = _appended(vk, fmt, k, v, held, table, np.zeros(fmt.pool_shape(POOL_PAGES), np.uint8))
    lens[:] = 0
    lens[LAYER] = held
    q = rng.standard_normal((new, HEADS, D)).astype(np.float32)
    k_seen = _layer_values(fmt, expected, table[LAYER], held + new, 0)
    for reduce, signed in (("sum", window), ("max", -window)):
        out = vk.run(_name("score", fmt), q, pool, table, lens, np.array([signed], np.int32))
        np.testing.assert_allclose(out[:, :held + new], score_reference(q[-window:], k_seen, held, SCALE, reduce),
                                   rtol=1e-4, atol=1e-6, err_msg=reduce)


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_compaction_reencodes_each_destination_page(vk, pair, rng):
    """The compaction kernel's pages equal kv_format.gather_slots' byte for byte (kept values by their bytes, kept
    keys encoded again per destination page, a full destination page and part of one, sources in the destination
    page itself and after it); a layer with count 0 and the pool's other pages are left alone."""
    fmt = _fmt(pair)
    total, kept = 50, 21
    table = _table(rng)
    pool = rng.integers(0, 256, fmt.pool_shape(POOL_PAGES), np.uint8)
    emulate_append(fmt, pool, table[LAYER], 0, _keys(rng, total), rng.standard_normal((total, KV_HEADS, D))
                   .astype(np.float32))
    keep = np.zeros((LAYERS, KV_HEADS, MAX_PAGES * PAGE), np.int32)
    count = np.zeros(LAYERS, np.int32)
    count[LAYER] = kept
    sources = [np.sort(rng.choice(total, kept, replace=False)),
               np.concatenate([[0, 1, 2], np.sort(rng.choice(np.arange(3, total), kept - 3, replace=False))])]
    for h in range(KV_HEADS):
        keep[LAYER, h, :kept] = sources[h]
    got = vk.run(_name("compact", fmt), _words(pool), table, keep, count).view(np.uint8)
    expected = pool.copy()
    expected[table[LAYER]] = gather_slots(fmt, pool[table[LAYER]], sources)
    written = table[LAYER, :2]
    np.testing.assert_array_equal(got[written], expected[written])
    untouched = np.setdiff1d(np.arange(POOL_PAGES), written)
    np.testing.assert_array_equal(got[untouched], pool[untouched])


def test_tiny_model_on_vulkan_matches_the_reference_fed_call_by_call(tmp_path_factory):
    """q4_ch keys and q4_0 values through the whole Vulkan path (prefill, decode continuing a page, a batched
    decode of forks, compaction on the device): the float32 forward fed call by call whose cache holds what this
    cache holds (testing.reference.ReferenceSession)."""
    import sharpi
    from sharpi.runtime.session import decode_batch
    from sharpi.testing.reference import NumpyReference, ReferenceSession
    from test_kv_quant import tiny_qwen_path
    from vulkan_device import on_vulkan
    path = tiny_qwen_path.__wrapped__(tmp_path_factory)
    artifact = sharpi.compile(str(path), target="vulkan", output=tmp_path_factory.mktemp("q4ch-vulkan") / "vk",
                              kv_dtype_k="q4_ch", kv_dtype_v="q4_0", use_cache=False)
    model = on_vulkan(lambda: sharpi.load(artifact))
    assert model.manifest.kv_types == ("q4_ch", "q4_0")
    ref = NumpyReference(path)
    ref.kv_types = ("q4_ch", "q4_0")
    ids = list(np.random.default_rng(3).integers(0, model.config.vocab_size, 44))
    close = dict(rtol=1e-3, atol=1e-3)
    with model.session() as s:
        r = ReferenceSession(ref)
        np.testing.assert_allclose(s.prefill(ids[:30]), r.feed(ids[:30])[-1], **close)
        for i in range(30, 34):
            np.testing.assert_allclose(s.decode(ids[i]), r.feed(ids[i:i + 1])[0], **close)
        with s.fork() as a, s.fork() as b:
            expected = r.feed(ids[34:35])[0]
            np.testing.assert_allclose(decode_batch([a, b], [ids[34]] * 2), [expected, expected], **close)
    with model.session() as s:
        r = ReferenceSession(ref)
        s.prefill(ids[:36]), r.feed(ids[:36])
        keep = [np.sort(np.stack([np.random.default_rng(10 * l + h).choice(36, 21, replace=False)
                                  for h in range(2)]), axis=1) for l in range(2)]
        s.compact(keep)
        r.compact(keep)
        for i in range(36, 39):
            np.testing.assert_allclose(s.decode(ids[i]), r.feed(ids[i:i + 1])[0], **close)
