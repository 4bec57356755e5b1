"""Quantized KV pools on the GPU kernels (sharpi.codegen.kernels.gpu, reading a packed pool as words through
gpu/kv_rows.py), built to WGSL and run on Vulkan (lavapipe in CI), against kv_format's numpy emulation: stores and
compaction byte for byte, attention and SnapKV scores within float tolerance of numpy on the dequantized values, a
tiny model equal to the numpy reference with the same cache rounding. One plan holds every kernel (lavapipe and
the WGSL builds are slow); head_dim 96 gives 3 blocks, so each part's scales end in padding."""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from sharpi.codegen.kernels.common import GPU_KERNEL_ATTRS
from sharpi.codegen.kernels.gpu.attention import (make_gpu_attention_combine, make_gpu_flash_attention,
                                                  make_gpu_kv_append, make_gpu_paged_attention)
from sharpi.codegen.kernels.gpu.kv_rows import GpuRows, float_to_half, half_to_float
from sharpi.codegen.kernels.gpu.snapkv import make_gpu_kv_compact, make_gpu_snapkv_row_stats, make_gpu_snapkv_score
from sharpi.common.kv_format import KVFormat, encode_rows
from sharpi.testing.snapkv import score_reference
from test_gpu_snapkv import compacted
from test_kernels import _attention_reference
from test_kv_quant import PAGE, _decoded, _ids, check_against_the_reference
from vulkan_device import plan_runner

HEADS, KV_HEADS, D, LAYERS, LAYER, MAX_PAGES, POOL_PAGES = 4, 2, 96, 2, 1, 4, 12
SCALE = D ** -0.5
SPLITS = 4          # decode_batch's split attention: sequences of 6 to 34 slots leave some splits without any
READ_FORMATS = [("q8_0", "q4_0"), ("q4_0", "q8_0")]                    # every kernel, both codecs on both sides
STORE_FORMATS = READ_FORMATS + [("float16", "q8_0"), ("bfloat16", "float32")]   # float parts of a packed row


def _fmt(pair) -> KVFormat:
    return KVFormat(*pair, KV_HEADS, PAGE, D)


def _tensor(shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


def _layer():
    return relax.prim_value(tirx.IntImm("int64", LAYER))


def _name(kind: str, fmt: KVFormat) -> str:
    """A function's name: an identifier (WGSL names its kernels after them)."""
    return f"{kind}_{fmt.name}".replace("-", "_")


def _add_kernel(bb, prim, name: str):
    """The kernel under a symbol of its own (the makers name kernels by shape alone, not by format)."""
    return bb.add_func(prim.with_attr("global_symbol", f"k_{name}"), f"k_{name}")


def _conversions():
    """halves(x f32 [n], bits uint32 [n]) -> (float_to_half(x), half_to_float(bits)): kv_rows' bit arithmetic
    alone."""
    n = tirx.Var("n", "int64")

    @T.prim_func
    def halves(var_x: T.handle, var_bits: T.handle, var_to_half: T.handle, var_to_float: T.handle):
        T.func_attr(GPU_KERNEL_ATTRS)
        x = T.match_buffer(var_x, (n,), "float32")
        bits = T.match_buffer(var_bits, (n,), "uint32")
        to_half = T.match_buffer(var_to_half, (n,), "uint32")
        to_float = T.match_buffer(var_to_float, (n,), "float32")
        for b in T.thread_binding((n + 255) // 256, thread="blockIdx.x"):
            for tx in T.thread_binding(256, thread="threadIdx.x"):
                if b * 256 + tx < n:
                    to_half[b * 256 + tx] = float_to_half(x[b * 256 + tx])
                    to_float[b * 256 + tx] = half_to_float(bits[b * 256 + tx])
    return halves


def add_pool_kernels(bb, fmt: KVFormat, n, reads: bool, compact: bool) -> None:
    """A format's kernels as Relax functions named kind_{fmt}: append_; with reads, also append_batch_, attend_
    (prefill kernel: decode is the same kernel with n = 1), attend_flash_ (the tiled prompt kernel),
    attend_batch_ and score_ (row stats, then the score); with compact, compact_. The pools are the kernels'
    uint32 words (the runtime's view of its uint8 pool)."""
    rows = GpuRows(fmt)
    pool_ty = _tensor(rows.pool_shape(POOL_PAGES), rows.pool_dtype)

    def var(name, shape, dtype="float32"):
        return relax.Var(name, _tensor(shape, dtype))

    def tables(per_sequence):
        """The page table and kv_lens: one sequence's, or (batched) one per token's sequence."""
        return [var("table", (*per_sequence, LAYERS, MAX_PAGES), "int32"), var("lens", (*per_sequence, LAYERS), "int32")]

    for batched in (False, True) if reads else (False,):
        kind = "append_batch" if batched else "append"
        per_sequence = (n,) if batched else ()
        gv = _add_kernel(bb, make_gpu_kv_append(KV_HEADS, D, PAGE, kv_dtype=fmt, batched=batched), _name(kind, fmt))
        args = [relax.Var("pool", pool_ty), var("k", (n, KV_HEADS, D)), var("v", (n, KV_HEADS, D)),
                *tables(per_sequence)]
        with bb.function(_name(kind, fmt), args, pure=False):
            bb.emit_func_output(bb.emit(relax.call_tir_inplace(gv, [*args, _layer()], [0], pool_ty)))
        if not reads:
            continue
        kind = "attend_batch" if batched else "attend"
        gv = _add_kernel(bb, make_gpu_paged_attention(HEADS, KV_HEADS, D, PAGE, SCALE, kv_dtype=fmt,
                                                      batched=batched), _name(kind, fmt))
        args = [var("q", (n, HEADS, D)), relax.Var("pool", pool_ty), *tables(per_sequence)]
        with bb.function(_name(kind, fmt), args):
            bb.emit_func_output(bb.emit(relax.call_tir(gv, [*args, _layer()], _tensor((n, HEADS, D)))))
        if not batched:
            gv = _add_kernel(bb, make_gpu_flash_attention(HEADS, KV_HEADS, D, PAGE, SCALE, kv_dtype=fmt),
                             _name("flash", fmt))
            args = [var("q", (n, HEADS, D)), relax.Var("pool", pool_ty), *tables(())]
            with bb.function(_name("attend_flash", fmt), args):
                bb.emit_func_output(bb.emit(relax.call_tir(gv, [*args, _layer()], _tensor((n, HEADS, D)))))
        if batched:         # CUDA's decode_batch: SPLITS workgroups a (sequence, head), then their combination
            split = _add_kernel(bb, make_gpu_paged_attention(HEADS, KV_HEADS, D, PAGE, SCALE, kv_dtype=fmt,
                                                             batched=True, splits=SPLITS), _name("split_batch", fmt))
            combine = _add_kernel(bb, make_gpu_attention_combine(HEADS, D, SPLITS), _name("combine_batch", fmt))
            args = [var("q", (n, HEADS, D)), relax.Var("pool", pool_ty), *tables(per_sequence)]
            with bb.function(_name("attend_batch_split", fmt), args):
                partial = bb.emit(relax.call_tir(split, [*args, _layer()], _tensor((n, HEADS, SPLITS, D + 2))))
                bb.emit_func_output(bb.emit(relax.call_tir(combine, [partial], _tensor((n, HEADS, D)))))
    if reads:
        shape = (HEADS, KV_HEADS, D, PAGE, MAX_PAGES, SCALE)
        stats_gv = _add_kernel(bb, make_gpu_snapkv_row_stats(*shape, kv_dtype=fmt), _name("row_stats", fmt))
        score_gv = _add_kernel(bb, make_gpu_snapkv_score(*shape, kv_dtype=fmt), _name("score", fmt))
        args = [var("q", (n, HEADS, D)), relax.Var("pool", pool_ty), *tables(()), var("window", (1,), "int32")]
        with bb.function(_name("score", fmt), args):
            common = [*args[:4], _layer(), args[4]]
            stats = bb.emit(relax.call_tir(stats_gv, common, _tensor((n, HEADS, 2))))
            bb.emit_func_output(bb.emit(relax.call_tir(score_gv, [*common, stats],
                                                       _tensor((KV_HEADS, MAX_PAGES * PAGE)))))
    if compact:
        gv = _add_kernel(bb, make_gpu_kv_compact(LAYERS, KV_HEADS, D, PAGE, MAX_PAGES, kv_dtype=fmt),
                         _name("compact", fmt))
        args = [relax.Var("pool", pool_ty), var("table", (LAYERS, MAX_PAGES), "int32"),
                var("keep", (LAYERS, KV_HEADS, MAX_PAGES * PAGE), "int32"), var("count", (LAYERS,), "int32")]
        with bb.function(_name("compact", fmt), args, pure=False):
            bb.emit_func_output(bb.emit(relax.call_tir_inplace(gv, args, [0], pool_ty)))


def _module() -> tvm.IRModule:
    """Every store format's kernels (add_pool_kernels; the read formats' all of them) and halves."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    gv = _add_kernel(bb, _conversions(), "halves")
    x, bits = relax.Var("x", _tensor((n,))), relax.Var("bits", _tensor((n,), "uint32"))
    with bb.function("halves", [x, bits]):
        bb.emit_func_output(bb.emit(relax.call_tir(gv, [x, bits], [_tensor((n,), "uint32"), _tensor((n,))])))
    for pair in STORE_FORMATS:
        add_pool_kernels(bb, _fmt(pair), n, reads=pair in READ_FORMATS, compact=pair in READ_FORMATS)
    return bb.get()


@pytest.fixture(scope="module")
def vk(tmp_path_factory):
    return plan_runner(_module(), tmp_path_factory.mktemp("kv-quant-gpu"))


def _words(pool: np.ndarray) -> np.ndarray:
    return pool.view(np.uint32)


def _placed(pool, table_row, rows, start=0):
    """pool (packed, uint8) with rows [n, kv_heads, row_bytes] at slots start.. of a layer's pages."""
    pool = pool.copy()
    for i, row in enumerate(rows):
        s = start + i
        pool[table_row[s // PAGE], 0, :, s % PAGE] = row
    return pool


def _table(rng):
    """The layer's pages out of order; the other layer's elsewhere."""
    table = np.zeros((LAYERS, MAX_PAGES), np.int32)
    order = rng.permutation(POOL_PAGES)
    table[LAYER], table[1 - LAYER] = order[:MAX_PAGES], order[MAX_PAGES:2 * MAX_PAGES]
    return table


def _awkward(rng, n):
    """Keys or values [n, kv_heads, D] whose blocks span f32's range: scales from 1e-9 (f16 scales subnormal or
    zero) to 1e8 (f16 scales infinite), an all-zero block, a constant negative block (q4_0's largest magnitude is
    its minimum) and a block whose largest magnitude is a tie of signs (q4_0 takes the positive)."""
    x = rng.standard_normal((n, KV_HEADS, D)) * 10.0 ** rng.uniform(-9, 8, (n, KV_HEADS, D // 32)).repeat(32, -1)
    x[0, 0, :32] = 0
    x[1, 1, 32:64] = -3.5
    x[2, 0, 64:] = rng.uniform(-1, 1, 32)
    x[2, 0, 70], x[2, 0, 90] = 2.0, -2.0
    return x.astype(np.float32)


# -- bits and stores ----------------------------------------------------------------------------------------------
def test_half_conversions_equal_numpys_cast(vk, rng):
    """float_to_half rounds as numpy's float16 cast bit for bit (every half, every midpoint between neighbouring
    halves: ties to even, the midpoints' neighbours, subnormals, overflow to infinity, random f32 over the whole
    range); half_to_float gives every half's value (NaNs as NaNs)."""
    every = np.arange(1 << 16, dtype=np.uint32)
    halves = every.astype(np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float64)
    finite = np.sort(finite[finite >= 0])
    midpoints = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)
    tail = np.float32(65520)                                             # midpoint of the largest half and 2^16
    near = np.concatenate([midpoints, [tail]])
    x = np.concatenate([halves.astype(np.float32), near, np.nextafter(near, np.float32(0)),
                        np.nextafter(near, np.float32(np.inf)), rng.integers(0, 1 << 32, 100_000, np.uint32)
                        .view(np.float32)])
    x = np.concatenate([x, -x])
    to_half, to_float = vk.run("halves", x, np.resize(every, len(x)))      # one length n for both
    to_float = to_float[:len(every)]
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(np.float16)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(to_half[~nan], expected[~nan].view(np.uint16))
    assert (to_half[nan] & 0x7FFF == 0x7E00).all()
    values = halves.astype(np.float32)
    numbers = ~np.isnan(values)
    np.testing.assert_array_equal(np.isnan(to_float), ~numbers)
    np.testing.assert_array_equal(to_float[numbers].view(np.uint32), values[numbers].view(np.uint32))


@pytest.mark.parametrize("pair", STORE_FORMATS, ids=_ids)
def test_append_stores_the_emulated_bytes(vk, pair, rng):
    """Two appends (the second finishing a page the first started, pages out of order) write exactly
    kv_format.encode_rows' bytes into the new slots and nothing else (the rest of the pool is random bytes)."""
    fmt = _fmt(pair)
    table, held, new = _table(rng), 21, 17
    k, v = _awkward(rng, held + new), _awkward(rng, held + new)
    garbage = rng.integers(0, 256, fmt.pool_shape(POOL_PAGES), np.uint8)
    lens = np.array([7, 7], np.int32)
    lens[LAYER] = 0
    pool = vk.run(_name("append", fmt), _words(garbage), k[:held], v[:held], table, lens)
    lens[LAYER] = held
    pool = vk.run(_name("append", fmt), pool, k[held:], v[held:], table, lens)
    with np.errstate(over="ignore"):
        expected = _placed(garbage, table[LAYER], encode_rows(fmt, k, v))
    np.testing.assert_array_equal(pool.view(np.uint8), expected)


# -- reads ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pair", READ_FORMATS, ids=_ids)
def test_attention_reads_the_dequantized_cache(vk, pair, rng):
    """Prefill from empty, prefill after held slots, decode (the same kernel with one token), and the tiled prompt
    kernel on each: numpy's attention over the dequantized keys and values; the slots past the visible ones
    (random bytes) are never read."""
    fmt = _fmt(pair)
    for held, new in ((0, 23), (20, 17), (40, 1)):
        table = _table(rng)
        k, v = (2 * rng.standard_normal((2, held + new, KV_HEADS, D))).astype(np.float32)
        pool = _placed(rng.integers(0, 256, fmt.pool_shape(POOL_PAGES), np.uint8), table[LAYER], encode_rows(fmt, k, v))
        lens = np.array([50, 50], np.int32)
        lens[LAYER] = held
        q = rng.standard_normal((new, HEADS, D)).astype(np.float32)
        k_seen, v_seen = _decoded(fmt, k, v)
        for kind in ("attend", "attend_flash"):
            out = vk.run(_name(kind, fmt), q, _words(pool), table, lens)
            np.testing.assert_allclose(out, _attention_reference(q, k_seen, v_seen, held), rtol=1e-4, atol=2e-5,
                                       err_msg=f"{kind} held={held} new={new}")


@pytest.mark.parametrize("pair", READ_FORMATS, ids=_ids)
def test_batched_append_and_attention(vk, pair, rng):
    """decode_batch's kernels: token b stored (bit-exact) at sequence b's slot and attending over its sequence, in
    one workgroup a (sequence, head) and split (CUDA's flash-decoding across sequences and splits)."""
    fmt = _fmt(pair)
    held = [5, 16, 33]
    tables = np.stack([_table(np.random.default_rng(b)) for b in range(3)])
    tables[:, LAYER] = np.arange(3 * MAX_PAGES).reshape(3, MAX_PAGES)        # each sequence its own pages
    ks = [rng.standard_normal((h + 1, KV_HEADS, D)).astype(np.float32) for h in held]
    vs = [rng.standard_normal((h + 1, KV_HEADS, D)).astype(np.float32) for h in held]
    pool = np.zeros(fmt.pool_shape(POOL_PAGES), np.uint8)
    for b, h in enumerate(held):
        pool = _placed(pool, tables[b, LAYER], encode_rows(fmt, ks[b][:h], vs[b][:h]))
    lens = np.zeros((3, LAYERS), np.int32)
    lens[:, LAYER] = held
    k_new, v_new = np.stack([k[-1] for k in ks]), np.stack([v[-1] for v in vs])
    stored = vk.run(_name("append_batch", fmt), _words(pool), k_new, v_new, tables, lens)
    for b, h in enumerate(held):
        pool = _placed(pool, tables[b, LAYER], encode_rows(fmt, ks[b][h:], vs[b][h:]), start=h)
    np.testing.assert_array_equal(stored.view(np.uint8), pool)
    q = rng.standard_normal((3, HEADS, D)).astype(np.float32)
    for function in ("attend_batch", "attend_batch_split"):     # the split: ragged lengths, splits with no slot
        out = vk.run(_name(function, fmt), q, stored, tables, lens)
        for b, h in enumerate(held):
            k_seen, v_seen = _decoded(fmt, ks[b], vs[b])
            np.testing.assert_allclose(out[b:b + 1], _attention_reference(q[b:b + 1], k_seen, v_seen, h),
                                       rtol=1e-4, atol=2e-5, err_msg=function)


@pytest.mark.parametrize("pair", READ_FORMATS, ids=_ids)
def test_snapkv_scores_read_the_dequantized_keys(vk, pair, rng):
    """Row stats and score (summed over the window, and its maximum) over the dequantized keys."""
    fmt = _fmt(pair)
    held, new, window = 20, 30, 8
    table = _table(rng)
    k, v = (2 * rng.standard_normal((2, held + new, KV_HEADS, D))).astype(np.float32)
    pool = _words(_placed(np.zeros(fmt.pool_shape(POOL_PAGES), np.uint8), table[LAYER], encode_rows(fmt, k, v)))
    lens = np.zeros(LAYERS, np.int32)
    lens[LAYER] = held
    q = rng.standard_normal((new, HEADS, D)).astype(np.float32)
    k_seen, _ = _decoded(fmt, k, v)
    for reduce, signed in (("sum", window), ("max", -window)):
        out = vk.run(_name("score", fmt), q, pool, table, lens, np.array([signed], np.int32))
        np.testing.assert_allclose(out[:, :held + new], score_reference(q[-window:], k_seen, held, SCALE, reduce),
                                   rtol=1e-4, atol=1e-6, err_msg=reduce)


@pytest.mark.parametrize("pair", READ_FORMATS, ids=_ids)
def test_compaction_moves_whole_rows(vk, pair, rng):
    """A kept slot's row (quants, scales and padding of key and value) moves byte for byte; a layer with count 0
    is left alone."""
    fmt = _fmt(pair)
    pool = rng.integers(0, 256, fmt.pool_shape(POOL_PAGES), np.uint8)
    table = _table(rng)
    keep = np.zeros((LAYERS, KV_HEADS, MAX_PAGES * PAGE), np.int32)
    counts = np.zeros(LAYERS, np.int32)
    counts[LAYER] = 23
    for h in range(KV_HEADS):
        keep[LAYER, h, :23] = np.sort(rng.choice(60, 23, replace=False))
    got = vk.run(_name("compact", fmt), _words(pool), table, keep, counts)
    np.testing.assert_array_equal(got.view(np.uint8), compacted(pool, table, keep, counts))


# -- a tiny model -------------------------------------------------------------------------------------------------
def test_tiny_model_on_vulkan_matches_the_reference_with_the_same_cache_rounding(tmp_path_factory):
    """q8_0 keys and q4_0 values through the whole Vulkan path (the uint32 views, the runtime's uint8 pool, page
    copies of forks, decode_batch, compaction)."""
    import sharpi
    from tiny_gguf import write_tiny_llama
    from vulkan_device import on_vulkan
    directory = tmp_path_factory.mktemp("kvq-vulkan")
    gguf = write_tiny_llama(directory / "tiny.gguf", matrix_type="Q8_0", layers=2, heads=4, kv_heads=2, head_dim=32)
    pair = ("q8_0", "q4_0")
    artifact = sharpi.compile(str(gguf), target="vulkan", output=directory / "vk", kv_dtype_k=pair[0],
                              kv_dtype_v=pair[1], use_cache=False)
    check_against_the_reference(on_vulkan(lambda: sharpi.load(artifact)), gguf, pair)
