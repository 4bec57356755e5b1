"""Quantized KV pools (q8_0, q4_0, and keys and values of different types): the CPU kernels against the numpy
emulation in sharpi.common.kv_format. Stores are bit-exact; attention and SnapKV scores read the dequantized values
within float tolerance of numpy on the same dequantized values."""
import functools

import numpy as np
import pytest

from sharpi.codegen.kernels.paged_attention import (make_kv_append, make_kv_append_batch, make_paged_attention,
                                                    make_paged_attention_batch)
from sharpi.codegen.kernels.snapkv import make_kv_compact, make_snapkv_score
from sharpi.common.kv_format import KVFormat, dequantize_kv, encode_rows, quantize_kv
from sharpi.testing.snapkv import score_reference
from test_kernels import _attention_reference, _build, _t

PAGE = 16
FORMATS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("float16", "q8_0"), ("q4_0", "float32")]


def _ids(pair):
    return "-".join(pair)


@functools.lru_cache(maxsize=None)
def _kernel(make, *args, **kwargs):
    """A built CPU kernel, once per maker and arguments: the tests share kernels, and LLVM builds are most of
    their time."""
    return _build(make(*args, **kwargs))


def _stored_rows(fmt, pool, table_row, count):
    """The rows of slots 0 .. count - 1 of a layer: uint8 [count, kv_heads, row]."""
    pages = pool[table_row[:(count + PAGE - 1) // PAGE]][:, 0]            # [pages, kvh, page, row]
    return pages.transpose(0, 2, 1, 3).reshape(-1, fmt.kv_heads, fmt.row_bytes)[:count]


def _decoded(fmt, k, v):
    """What the pool holds for keys and values f32 [n, kvh, d], read back as f32."""
    rows = encode_rows(fmt, k, v)[:, :, None, None]                        # as [n, 1 (kv), 1 (slot)...]
    pages = rows.transpose(0, 2, 1, 3, 4)                                   # [n, 1, kvh, 1, row]
    return fmt.decode(pages, 0)[:, :, 0], fmt.decode(pages, 1)[:, :, 0]


def _append_all(fmt, k_all, v_all, held, table, layer):
    """A pool with slots 0 .. held - 1 appended in one call and the rest in a second; returns (pool, lens)."""
    d = fmt.head_dim
    pool = _t(np.zeros(fmt.pool_shape(int(table.max()) + 2), fmt.pool_dtype))
    lens = np.zeros(table.shape[0], np.int32)
    append = _kernel(make_kv_append, fmt.kv_heads, d, PAGE, kv_dtype=fmt)
    if held:
        append(pool, _t(k_all[:held]), _t(v_all[:held]), _t(table), _t(lens), layer)
    lens[layer] = held
    append(pool, _t(k_all[held:]), _t(v_all[held:]), _t(table), _t(lens), layer)
    return pool, lens


def test_codec_bounds(rng):
    """The numpy rule itself: q8_0 within half a step of x (step max|x| / 127); q4_0 within half a step (the
    largest magnitude / 8) on the side of the block's largest magnitude, within one on the other (its quants reach
    -8 steps one way and 7 the other, as ggml's); plus what the f16 scale's rounding (2^-11 of it) adds at the
    largest quant. Zero blocks stay zero."""
    x = (rng.standard_normal((50, 64)) * rng.uniform(0.01, 30, (50, 1))).astype(np.float32)
    x[3] = 0
    for dtype, steps, slack in (("q8_0", 127, 0.5), ("q4_0", 8, 1.0)):
        q, d = quantize_kv(dtype, x)
        back = dequantize_kv(dtype, q, d)
        blocks = np.abs(x).reshape(50, 2, 32).max(-1)
        step = np.repeat(blocks / steps, 32, axis=1)
        assert np.all(np.abs(back - x) <= step * (slack + steps * 2.0 ** -11) + 1e-7), dtype
        assert not back[3].any()


@pytest.mark.parametrize("pair", FORMATS, ids=_ids)
@pytest.mark.parametrize("held,new", [(0, 23), (15, 1), (21, 17)])
def test_append_stores_the_emulated_bytes(pair, held, new, rng):
    """kv_append's bytes equal kv_format.encode_rows' for every slot (pages out of order, a page started by one
    call and finished by the next); slots past the end stay untouched."""
    kv_heads, d, layer = 2, 64, 1
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    table = np.zeros((3, 4), np.int32)
    table[layer] = [6, 2, 9, 4]
    k_all = (3 * rng.standard_normal((held + new, kv_heads, d))).astype(np.float32)
    v_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    pool, _ = _append_all(fmt, k_all, v_all, held, table, layer)
    stored = pool.numpy()
    np.testing.assert_array_equal(_stored_rows(fmt, stored, table[layer], held + new), encode_rows(fmt, k_all, v_all))
    used = set(table[layer][:(held + new + PAGE - 1) // PAGE])
    assert not stored[[p for p in range(len(stored)) if p not in used]].any()
    last = table[layer][(held + new - 1) // PAGE]
    assert not stored[last, :, :, (held + new) % PAGE or PAGE:].any()


# (held, new, window): a prefill from empty, a decode, a windowed prefill after held slots, a windowed decode; each
# format takes a prefill and a decode (the kernels' code per format is the same for every case), each case
# several formats
_PREFILL, _DECODE, _WINDOWED_PREFILL, _WINDOWED_DECODE = (0, 23, 0), (30, 1, 0), (20, 17, 19), (40, 1, 19)
ATTENTION_CASES = [
    (FORMATS[0], 4, 2, 64, _PREFILL), (FORMATS[0], 4, 2, 64, _WINDOWED_DECODE),
    (FORMATS[1], 4, 2, 64, _WINDOWED_PREFILL), (FORMATS[1], 4, 2, 64, _DECODE),
    (FORMATS[2], 4, 2, 64, _WINDOWED_PREFILL), (FORMATS[2], 4, 2, 64, _WINDOWED_DECODE),
    (FORMATS[3], 4, 2, 64, _PREFILL), (FORMATS[3], 4, 2, 64, _DECODE),
    (FORMATS[4], 4, 2, 64, _WINDOWED_PREFILL), (FORMATS[4], 4, 2, 64, _DECODE),
    (("q8_0", "q8_0"), 4, 1, 32, _WINDOWED_PREFILL), (("q4_0", "q4_0"), 4, 1, 32, _WINDOWED_DECODE),
    # 7 heads a KV head (Qwen2.5's): the heads walk each page one at a time, over its unpacked copy (kv_rows.PageRows)
    (("q4_0", "q8_0"), 7, 1, 64, _DECODE), (("float16", "q8_0"), 7, 1, 64, _PREFILL)]


@pytest.mark.parametrize("pair,heads,kv_heads,d,case", ATTENTION_CASES,
                         ids=[f"{_ids(c[0])}-d{c[3]}-kvh{c[2]}-held{c[4][0]}-new{c[4][1]}-w{c[4][2]}"
                              for c in ATTENTION_CASES])
def test_attention_reads_the_dequantized_cache(pair, heads, kv_heads, d, case, rng):
    """Prefill's tiled kernel and decode's split one over a quantized pool give numpy's attention over the
    dequantized keys and values."""
    held, new, window = case
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    layer = 0
    pages = (held + new + PAGE - 1) // PAGE
    table = np.asarray([list(np.random.default_rng(2).permutation(pages) + 1)], np.int32)
    k_all = (2 * rng.standard_normal((held + new, kv_heads, d))).astype(np.float32)
    v_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    pool, lens = _append_all(fmt, k_all, v_all, held, table, layer)
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((new, heads, d), np.float32))
    _kernel(make_paged_attention, heads, kv_heads, d, PAGE, d ** -0.5, 1 if new == 1 else None, kv_dtype=fmt,
            window=window)(_t(q), pool, _t(table), _t(lens), layer, out)
    k_seen, v_seen = _decoded(fmt, k_all, v_all)
    np.testing.assert_allclose(out.numpy(), _attention_reference(q, k_seen, v_seen, held, window), rtol=1e-4,
                               atol=1e-5)


def three_sequences(fmt, layers, layer, rng):
    """A pool holding three sequences of 5, 16 and 33 slots in `layer` (each appended in one call), and one more
    token of each to append: (pool, page tables [3, layers, 4], kv_lens [3, layers], keys and values [held + 1,
    kvh, d] a sequence)."""
    held, max_pages = [5, 16, 33], 4
    tables = np.zeros((3, layers, max_pages), np.int32)
    pool = _t(np.zeros(fmt.pool_shape(14), fmt.pool_dtype))
    ks, vs = [], []
    append = _kernel(make_kv_append, fmt.kv_heads, fmt.head_dim, PAGE, kv_dtype=fmt)
    for b, h in enumerate(held):
        tables[b, layer] = [1 + b * 4 + i for i in range(max_pages)]
        ks.append(rng.standard_normal((h + 1, fmt.kv_heads, fmt.head_dim)).astype(np.float32))
        vs.append(rng.standard_normal((h + 1, fmt.kv_heads, fmt.head_dim)).astype(np.float32))
        append(pool, _t(ks[b][:h]), _t(vs[b][:h]), _t(tables[b]), _t(np.zeros(layers, np.int32)), layer)
    lens = np.zeros((3, layers), np.int32)
    lens[:, layer] = held
    return pool, tables, lens, ks, vs


@pytest.mark.parametrize("pair", FORMATS[:3], ids=_ids)
def test_batched_append_and_attention(pair, rng):
    """decode_batch's kernels: token b appended at sequence b's slot and attending over that sequence only."""
    heads, kv_heads, d, layers, layer = 4, 2, 64, 2, 1
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    pool, tables, lens, ks, vs = three_sequences(fmt, layers, layer, rng)
    held = list(lens[:, layer])
    k_new = np.stack([k[-1] for k in ks])
    v_new = np.stack([v[-1] for v in vs])
    _build(make_kv_append_batch(kv_heads, d, PAGE, kv_dtype=fmt))(pool, _t(k_new), _t(v_new), _t(tables), _t(lens),
                                                                 layer)
    stored = pool.numpy()
    for b, h in enumerate(held):
        np.testing.assert_array_equal(_stored_rows(fmt, stored, tables[b, layer], h + 1), encode_rows(fmt, ks[b], vs[b]))
    q = rng.standard_normal((3, heads, d)).astype(np.float32)
    out = _t(np.zeros((3, heads, d), np.float32))
    _build(make_paged_attention_batch(heads, kv_heads, d, PAGE, d ** -0.5, kv_dtype=fmt))(
        _t(q), pool, _t(tables), _t(lens), layer, out)
    for b, h in enumerate(held):
        k_seen, v_seen = _decoded(fmt, ks[b], vs[b])
        np.testing.assert_allclose(out.numpy()[b:b + 1], _attention_reference(q[b:b + 1], k_seen, v_seen, h),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pair", FORMATS[:3], ids=_ids)
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_snapkv_scores_read_the_dequantized_keys(pair, reduce, rng):
    heads, kv_heads, d, held, new, window, max_pages = 4, 2, 64, 20, 30, 8, 5
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    table = np.asarray([[5, 2, 9, 1, 7]], np.int32)
    keys = (2 * rng.standard_normal((held + new, kv_heads, d))).astype(np.float32)
    values = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    pool, lens = _append_all(fmt, keys, values, held, table, 0)
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((kv_heads, max_pages * PAGE), np.float32))
    signed = window if reduce == "sum" else -window
    _kernel(make_snapkv_score, heads, kv_heads, d, PAGE, max_pages, d ** -0.5, kv_dtype=fmt)(
        _t(q), pool, _t(table), _t(lens), 0, _t(np.array([signed], np.int32)), out)
    k_seen, _ = _decoded(fmt, keys, values)
    np.testing.assert_allclose(out.numpy()[:, :held + new], score_reference(q[-window:], k_seen, held, d ** -0.5,
                                                                            reduce), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pair", FORMATS[:3], ids=_ids)
def test_compaction_moves_whole_rows(pair, rng):
    """snapkv_compact moves a kept slot's row (quants and scales of key and value) byte for byte."""
    kv_heads, d, layers, max_pages = 2, 64, 2, 3
    fmt = KVFormat(*pair, kv_heads, PAGE, d)
    table = np.asarray([[1, 4, 2], [3, 5, 6]], np.int32)
    total = 40
    pool = np.zeros(fmt.pool_shape(7), np.uint8)
    for l in range(layers):
        rows = encode_rows(fmt, *(rng.standard_normal((2, total, kv_heads, d)).astype(np.float32)))
        for s in range(total):
            pool[table[l, s // PAGE], 0, :, s % PAGE] = rows[s]
    keep = np.zeros((layers, kv_heads, max_pages * PAGE), np.int32)
    count = np.asarray([11, 0], np.int32)         # layer 1 keeps everything (count 0: left alone)
    for h in range(kv_heads):
        keep[0, h, :11] = np.sort(rng.choice(total, 11, replace=False))
    before = pool.copy()
    tvm_pool = _t(pool)
    _build(make_kv_compact(layers, kv_heads, d, PAGE, max_pages, kv_dtype=fmt))(tvm_pool, _t(table), _t(keep),
                                                                                _t(count))
    after = tvm_pool.numpy()
    for h in range(kv_heads):
        for i, src in enumerate(keep[0, h, :11]):
            np.testing.assert_array_equal(after[table[0, i // PAGE], 0, h, i % PAGE],
                                          before[table[0, src // PAGE], 0, h, src % PAGE])
    np.testing.assert_array_equal(after[table[1]], before[table[1]])


def test_formats_refuse_head_dims_that_are_not_whole_blocks():
    from sharpi.common.errors import ConfigError
    with pytest.raises(ConfigError, match="multiple of 32"):
        KVFormat("q8_0", "q8_0", 2, PAGE, 48)


def test_packed_rows_are_what_the_bytes_per_token_promise():
    """q8_0 is 34 bytes a 32-block and q4_0 18, as ggml's (a head_dim of 128: 136 and 72 bytes, f16's 256)."""
    assert KVFormat("q8_0", "q8_0", 1, PAGE, 128).row_bytes == 2 * 136
    assert KVFormat("q4_0", "q4_0", 1, PAGE, 128).row_bytes == 2 * 72
    assert KVFormat("q8_0", "q4_0", 1, PAGE, 64).row_bytes == 68 + 36
    assert KVFormat("float16", "float16", 1, PAGE, 64).pool_shape(3) == (3, 2, 1, PAGE, 64)


# -- end to end on a tiny model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("kvq") / "tiny.gguf", matrix_type="Q8_0", layers=2, heads=4,
                            kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def tiny_artifacts(tiny_path, tmp_path_factory):
    """One artifact per KV format (float matmuls: exact to the numpy reference but for the cache's rounding)."""
    import sharpi
    out = tmp_path_factory.mktemp("kvq-artifacts")
    made = {}

    def get(k, v):
        if (k, v) not in made:
            made[k, v] = sharpi.load(sharpi.compile(str(tiny_path), output=out / f"{k}-{v}", matmuls="float",
                                                    kv_dtype_k=k, kv_dtype_v=v, use_cache=False))
        return made[k, v]
    return get


def check_against_the_reference(model, gguf, pair):
    """Logits of prefill, decode, a batched decode of two forks, and decode after SnapKV compaction equal the
    float32 numpy forward whose keys and values are rounded as the cache stores them (testing.reference.
    kv_roundtrip), within the float32 tolerance; a fork decodes as its parent (forks copy whole pages of rows)."""
    from sharpi.common.compile_options import kv_dtype_of
    from sharpi.runtime.session import decode_batch
    from sharpi.testing.reference import NumpyReference
    types = tuple(kv_dtype_of(t) for t in pair)
    assert model.manifest.kv_types == types
    ref = NumpyReference(gguf)
    ref.kv_types = types
    ids = list(np.random.default_rng(3).integers(0, model.config.vocab_size, 40))
    expected = ref.forward(ids)
    np.testing.assert_allclose(model.score(ids), expected, rtol=1e-3, atol=1e-3)
    with model.session() as s:
        np.testing.assert_allclose(s.prefill(ids[:30]), expected[29], rtol=1e-3, atol=1e-3)
        for i in range(30, 33):
            np.testing.assert_allclose(s.decode(ids[i]), expected[i], rtol=1e-3, atol=1e-3)
        with s.fork() as a, s.fork() as b:
            np.testing.assert_allclose(decode_batch([a, b], [ids[33]] * 2), expected[[33, 33]], rtol=1e-3, atol=1e-3)
    with model.session(snapkv_budget=24, snapkv_window=8, snapkv_recency=4) as s:
        s.prefill(ids[:36])
        assert s.kv_length == [24, 24]
        kept = s.kept_positions
        np.testing.assert_allclose(s.decode(ids[36]), ref.decode_after_compaction(ids[:36], kept, ids[36]),
                                   rtol=1e-3, atol=1e-3)
        with s.fork() as f:
            np.testing.assert_array_equal(f.decode(ids[37]), s.decode(ids[37]))


@pytest.mark.parametrize("pair", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("f16", "q8_0")], ids=_ids)
def test_tiny_model_matches_the_reference_with_the_same_cache_rounding(pair, tiny_path, tiny_artifacts):
    check_against_the_reference(tiny_artifacts(*pair), tiny_path, pair)


def test_quantized_cache_memory_and_what_the_host_reads(tiny_artifacts):
    """A q8_0 pool's pages are 36/64 of f16's (head_dim 32: a block and its scale, 34 bytes, padded to 4-byte
    rows), q4_0's 20/64 (18 padded); the host's view of the keys (KeyDiff's input) is the dequantized cache."""
    from sharpi.common.kv_format import dequantize_kv, quantize_kv
    q8, q4 = (tiny_artifacts(t, t) for t in ("q8_0", "q4_0"))
    cfg = q8.config
    f16_page_bytes = cfg.n_kv_heads * q8.manifest.page_size * 2 * cfg.head_dim * 2     # keys and values, 2 bytes each
    assert q8.engine.pool.page_bytes * 64 == f16_page_bytes * 36
    assert q4.engine.pool.page_bytes * 64 == f16_page_bytes * 20
    ids = list(range(5, 45))
    with tiny_artifacts("f32", "f32").session() as a, q8.session() as b:
        a.prefill(ids), b.prefill(ids)
        exact, quantized = a.cached_keys(), b.cached_keys()
    assert quantized[1].dtype == np.float32 and quantized[1].shape == exact[1].shape
    # layer 0's keys are the same f32 values in both (the layers after read a quantized cache before them)
    np.testing.assert_array_equal(quantized[0], dequantize_kv("q8_0", *quantize_kv("q8_0", exact[0])))


def test_kv_types_are_refused_where_no_kernel_reads_them(tiny_path, tmp_path):
    """What stays refused: bf16 on Vulkan (WGSL has no bfloat16), unknown types, and on every target head
    dimensions that are not whole blocks."""
    import sharpi
    from sharpi.common.errors import ConfigError
    with pytest.raises(ConfigError, match="bf16 is not available on the vulkan target .WGSL has no bfloat16."):
        sharpi.compile(str(tiny_path), target="vulkan", kv_dtype_v="bf16", output=tmp_path / "vulkan")
    with pytest.raises(ConfigError, match="--kv-dtype-v must be one of"):
        sharpi.compile(str(tiny_path), kv_dtype_v="q5_0", output=tmp_path / "x")
    odd = tmp_path / "odd.gguf"
    from tiny_gguf import write_tiny_llama
    write_tiny_llama(odd, head_dim=16)
    for target in ("llvm", "vulkan"):
        with pytest.raises(ConfigError, match="head_dim a multiple of 32"):
            sharpi.compile(str(odd), target=target, kv_dtype="q4_0", output=tmp_path / f"odd-{target}")


@pytest.mark.parametrize("pair", [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_ch", "q8_0")], ids=_ids)
def test_conformance_suite_passes_on_a_quantized_cache(pair, tiny_path, tiny_artifacts):
    """Every check of the suite (kv_bytes from the format's rows, decode after compaction, ...) on a quantized
    cache, under its tolerance."""
    from sharpi.testing import conformance
    suite = conformance.Suite(tiny_artifacts(*pair).path, gguf=str(tiny_path))
    try:
        results = suite.run_all()
    finally:
        suite.close()
    assert [r.status for r in results] == ["PASS"] * len(results), conformance.format_table(results)
    assert "KV" in conformance.tolerance_for(suite.model.manifest).label


def test_cli_kv_flags_refuse_in_one_line(tiny_path, tmp_path, capsys):
    from sharpi.cli import compile as compile_cli
    from test_errors import _assert_clean_failure, _cli
    _assert_clean_failure(*_cli(compile_cli, [str(tiny_path), "--kv-dtype-k", "q3_k", "-o", str(tmp_path / "a")],
                                capsys), "--kv-dtype must be one of f32, f16, bf16, q8_0, q4_0")
    _assert_clean_failure(*_cli(compile_cli, [str(tiny_path), "--target", "vulkan", "--kv-dtype-v", "bf16", "-o",
                                              str(tmp_path / "b")], capsys), "--kv-dtype-v bf16 is not available")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_says_what_q4_0_keys_cost(tiny_path, tmp_path, capsys):
    """A q4_0 key cache compiles, and sharpi-compile says in one note what such keys cost and what to take
    instead; q4_ch keys with q4_0 values compile without it (the SnapKV ops left out: the note is the point)."""
    from sharpi.cli import compile as compile_cli
    for flags, noted in ((["--kv-dtype", "q4_0"], True), (["--kv-dtype-k", "q4_ch", "--kv-dtype-v", "q4_0"], False)):
        out = tmp_path / "-".join(flags[1::2])
        assert compile_cli.main([str(tiny_path), *flags, "--matmuls", "float", "--snapkv", "off", "--no-cache",
                                 "--quiet", "-o", str(out)]) == 0
        err = capsys.readouterr().err
        assert ("note: q4_0 keys" in err) == noted and ("--kv-dtype-k q8_0 --kv-dtype-v q4_0" in err) == noted
        assert ("--kv-dtype-k q4_ch --kv-dtype-v q4_0" in err) == noted
        assert (out / "manifest.json").is_file()


# -- keys stored minus the key bias (qwen2) -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_qwen_path(tmp_path_factory):
    """A tiny qwen2 whose key bias is shaped as Qwen2.5's: a few channels far larger than the keys' spread."""
    import gguf
    from tiny_gguf import write_tiny_llama
    bias = np.random.default_rng(5).normal(0, 0.5, 2 * 32).astype(np.float32)
    bias[[15, 31, 47, 63]] = [40.0, -35.0, 25.0, -30.0]       # NEOX's lowest frequencies, as Qwen2.5's
    large = {f"blk.{l}.attn_k.bias": (bias, gguf.GGMLQuantizationType.F32) for l in range(2)}
    return write_tiny_llama(tmp_path_factory.mktemp("kvq-qwen") / "tiny-qwen2.gguf", arch="qwen2", qkv_bias=True,
                            matrix_type="Q8_0", layers=2, heads=4, kv_heads=2, head_dim=32, override_raw=large)


def test_quantized_keys_are_cached_minus_the_key_bias(tiny_qwen_path, tmp_path_factory):
    """A quantized key cache of a model with a key bias holds k - bias (the manifest says so; float caches hold k
    as it is); attention, batched decode and SnapKV still equal the reference that caches keys so; the host's view
    of the keys adds the bias back, and holds them far closer to the exact keys than the same blocks without the
    offset would (the bias's large channels no longer set their blocks' scales)."""
    import sharpi
    from sharpi.common.kv_format import dequantize_kv, quantize_kv
    from sharpi.frontend.gguf_file import GGUFFile
    out = tmp_path_factory.mktemp("kvq-qwen-artifacts")
    q4, exact = (sharpi.load(sharpi.compile(str(tiny_qwen_path), output=out / kv, matmuls="float", kv_dtype=kv,
                                            use_cache=False)) for kv in ("q4_0", "f32"))
    assert q4.manifest.kv_key_offset == "attn_k.bias" and exact.manifest.kv_key_offset is None
    check_against_the_reference(q4, tiny_qwen_path, ("q4_0", "q4_0"))
    ids = list(range(5, 45))
    with exact.session() as a, q4.session() as b:
        a.prefill(ids), b.prefill(ids)
        keys, cached = a.cached_keys()[0], b.cached_keys()[0]        # layer 0: the same f32 keys in both
    c = np.asarray(GGUFFile(tiny_qwen_path).tensor("blk.0.attn_k.bias").data, np.float32).reshape(2, 1, 32)
    np.testing.assert_allclose(cached, dequantize_kv("q4_0", *quantize_kv("q4_0", keys - c)) + c, atol=1e-5)
    plain = dequantize_kv("q4_0", *quantize_kv("q4_0", keys))
    assert np.abs(cached - keys).max() * 4 < np.abs(plain - keys).max()
