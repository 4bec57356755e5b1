"""A KV type is one codec module (sharpi.common.kv_codecs): a toy codec defined here, in the test file alone, runs a
tiny model on the CPU and on Vulkan (lavapipe) through every kernel that touches the cache (kv_append, attention,
batched decode, SnapKV's score and compaction, forks), equal to the float32 reference whose cache rounds as the
toy's numpy rule does. Nothing else in sharpi names it."""
import numpy as np
import pytest

from sharpi.common import kv_codecs
from sharpi.common.errors import ConfigError
from sharpi.common.kv_codecs import Field, KVCodec
from sharpi.common.kv_codecs.gpu_words import WORD, or_bytes
from sharpi.common.kv_codecs.tir import T, macro
from test_kv_quant import check_against_the_reference


class RowInt8(KVCodec):
    """int8 codes with one f32 scale a row: d = max|x| / 127, q = round(x / d); x = q * d."""
    name = flag = "toy_i8row"
    tolerance = (4.0, 1.0)

    def fields(self, head_dim, page_size):
        return Field("int8", head_dim), Field("float32", 1)

    def check(self, head_dim, page_size):
        if head_dim % WORD:
            raise ConfigError(f"toy_i8row needs head_dim a multiple of {WORD}.")

    # numpy: the rule the kernels are held to
    def quantize(self, part, x):
        d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
        return np.rint(x * inv).astype(np.int8), d.astype(np.float32)

    def dequantize(self, part, q, s):
        return q.astype(np.float32) * s

    # CPU
    def cpu_load(self, rows, which, page, h, slot, d):
        return T.Cast("float32", rows.quants[which][page, h, slot, d]) * rows.scales[which][page, h, slot, 0]

    @macro
    def cpu_store(self, rows, which, page, h, slot, x, t):
        q = T.meta_var(rows.quants[which])
        s = T.meta_var(rows.scales[which])
        stats = T.decl_buffer((2,), "float32", scope="global")       # max |x|, then 1 / d
        stats[0] = T.abs(x[t, h, 0])
        for d in range(1, rows.fmt.head_dim):
            stats[0] = T.max(stats[0], T.abs(x[t, h, d]))
        s[page, h, slot, 0] = stats[0] / T.float32(127)
        stats[1] = T.Select(s[page, h, slot, 0] > T.float32(0), T.float32(1) / s[page, h, slot, 0], T.float32(0))
        for d in T.vectorized(rows.fmt.head_dim):
            q[page, h, slot, d] = T.Cast("int8", T.round(x[t, h, d] * stats[1]))

    # GPU: the row as 32-bit words
    def gpu_load(self, rows, pool, which, page, h, slot, d):
        part = rows.fmt.part(which)
        word = pool[page, 0, h, slot, part.offset // WORD + d // WORD]
        code = T.shift_right(T.shift_left(T.reinterpret("int32", word), T.Cast("int32", 24 - d % WORD * 8)), 24)
        return T.Cast("float32", code) * T.reinterpret("float32", pool[page, 0, h, slot, part.scale_offset // WORD])

    def gpu_blocks(self, part):
        return 1

    @macro
    def gpu_block_scale(self, rows, which, x, t, h, b, scales, inverse, stats):
        stats[0] = T.abs(x[t, h, 0])
        for d in range(1, rows.fmt.head_dim):
            stats[0] = T.max(stats[0], T.abs(x[t, h, d]))
        stats[2] = stats[0] / T.float32(127)
        inverse[b] = T.Select(stats[2] > T.float32(0), T.float32(1) / stats[2], T.float32(0))
        scales[b] = stats[2]

    def gpu_quant_word(self, rows, which, x, t, h, i, scales, inverse):
        return or_bytes([T.Cast("uint32", T.bitwise_and(T.Cast("int32", T.round(x[t, h, WORD * i + e] * inverse[0])),
                                                        255)) for e in range(WORD)])

    def gpu_scale_word(self, rows, which, i, scales):
        return T.reinterpret("uint32", scales[0])


@pytest.fixture(scope="module")
def toy():
    codec = kv_codecs.register(RowInt8())
    yield codec
    kv_codecs.unregister(codec.name)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("toy-codec") / "tiny.gguf", matrix_type="Q8_0", layers=2,
                            heads=4, kv_heads=2, head_dim=32)


def test_the_toy_codec_is_one_more_kv_type(toy):
    from sharpi.common.compile_options import CompileOptions, kv_dtype_of
    from sharpi.common.kv_format import KVFormat, encode_rows
    assert kv_dtype_of("toy_i8row") == "toy_i8row" and "toy_i8row" in kv_codecs.available_on("vulkan")
    CompileOptions(kv_dtype="toy_i8row").validate()
    fmt = KVFormat("toy_i8row", "q8_0", 2, 16, 32)
    assert fmt.packed and fmt.part(0).nbytes == 36 and fmt.row_bytes == 36 + 36
    x = np.random.default_rng(0).standard_normal((5, 2, 32)).astype(np.float32)
    rows = encode_rows(fmt, x, x)
    np.testing.assert_allclose(fmt.decode(rows.reshape(1, 1, 5, 2, -1).transpose(0, 1, 3, 2, 4), 0)[0]
                               .transpose(1, 0, 2), x, atol=np.abs(x).max() / 254 + 1e-7)
    with pytest.raises(ValueError, match="taken"):
        kv_codecs.register(type("Clash", (RowInt8,), {"name": "other", "flag": "toy_i8row"})())


def test_a_tiny_model_runs_the_toy_codec_on_the_cpu(toy, tiny_gguf, tmp_path):
    import sharpi
    artifact = sharpi.compile(str(tiny_gguf), output=tmp_path / "cpu", matmuls="float", kv_dtype="toy_i8row",
                              use_cache=False)
    check_against_the_reference(sharpi.load(artifact), tiny_gguf, ("toy_i8row", "toy_i8row"))


def test_a_tiny_model_runs_the_toy_codec_on_vulkan(toy, tiny_gguf, tmp_path):
    import sharpi
    from vulkan_device import on_vulkan
    artifact = sharpi.compile(str(tiny_gguf), target="vulkan", output=tmp_path / "vk", kv_dtype_k="toy_i8row",
                              kv_dtype_v="q8_0", use_cache=False)
    check_against_the_reference(on_vulkan(lambda: sharpi.load(artifact)), tiny_gguf, ("toy_i8row", "q8_0"))
