"""TurboQuant's KV types (tq3, tq4: sharpi.common.kv_codecs.turboquant) in the kernels: stores bit-exact against the
numpy codec on the CPU and on Vulkan (lavapipe), the graph's rotation kernels against numpy's, attention reading the
rotated cache, and a tiny model through prefill, decode, forks, SnapKV compaction and decode after it equal to the
float32 reference whose cache rounds as the codec does, on the CPU and on Vulkan."""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from sharpi.codegen.kernels.gpu.attention import make_gpu_kv_append
from sharpi.codegen.kernels.gpu.kv_rotate import make_gpu_kv_rotate
from sharpi.codegen.kernels.gpu.kv_rows import GpuRows
from sharpi.codegen.kernels.kv_rotate import make_kv_rotate
from sharpi.codegen.kernels.paged_attention import make_paged_attention
from sharpi.common import kv_codecs
from sharpi.common.kv_codecs.turboquant import rotate, unrotate
from sharpi.common.kv_format import KVFormat, encode_rows
from test_kernels import _attention_reference, _t
from test_kv_quant import PAGE, _append_all, _ids, _kernel, _stored_rows, check_against_the_reference

PAIRS = [("tq4", "tq4"), ("tq3", "q8_0"), ("float16", "tq3")]
KV_HEADS, LAYERS, LAYER, MAX_PAGES, POOL_PAGES = 2, 2, 1, 4, 12


def _rows(rng, n, d):
    """Keys or values [n, KV_HEADS, d] over many magnitudes, a zero row and a constant one."""
    x = rng.standard_normal((n, KV_HEADS, d)) * 10.0 ** rng.uniform(-6, 3, (n, KV_HEADS, 1))     # f16 parts too
    x[0, 0] = 0
    x[1, 1] = -2.5
    return x.astype(np.float32)


def _rotated_decode(fmt, k, v):
    """What the kernels read of keys and values [n, kvh, d] stored by fmt: rotated-space values for rotated
    codecs, the decoded values for the others."""
    out = []
    for which, x in ((0, k), (1, v)):
        part = fmt.part(which)
        raw = encode_rows(fmt, k, v)[..., part.offset:part.offset + part.nbytes]
        codec = part.codec
        out.append(codec.dequantize_rotated(part, *part.fields(raw)) if codec.rotated
                   else codec.decode(part, raw))
    return out


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_cpu_append_stores_the_codecs_bytes(pair, d, rng):
    fmt = KVFormat(*pair, KV_HEADS, PAGE, d)
    table = np.zeros((3, 4), np.int32)
    table[1] = [6, 2, 9, 4]
    k, v = _rows(rng, 38, d), _rows(rng, 38, d)
    pool, _ = _append_all(fmt, k, v, 21, table, 1)
    np.testing.assert_array_equal(_stored_rows(fmt, pool.numpy(), table[1], 38), encode_rows(fmt, k, v))


@pytest.mark.parametrize("d", [64, 128])
def test_cpu_rotation_kernels_equal_numpys(d, rng):
    x = rng.standard_normal((5, 3, d)).astype(np.float32)
    for inverse, rule in ((False, rotate), (True, unrotate)):
        kernel = _kernel(make_kv_rotate, 3, d, "tq4", inverse)
        y = _t(np.zeros_like(x))
        kernel(_t(x), y)
        np.testing.assert_array_equal(y.numpy(), rule(x))


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_cpu_attention_reads_the_rotated_cache(pair, rng):
    """Prefill after held slots and decode: numpy's attention over what the codecs' kernels read (keys and values
    in the rotated space where the codec rotates: the graph rotates queries and output around the kernel)."""
    d, heads = 64, 4
    fmt = KVFormat(*pair, KV_HEADS, PAGE, d)
    for held, new in ((20, 17), (40, 1)):
        table = np.zeros((3, 4), np.int32)
        table[1] = [6, 2, 9, 4]
        k, v = (2 * rng.standard_normal((2, held + new, KV_HEADS, d))).astype(np.float32)
        pool, lens = _append_all(fmt, k, v, held, table, 1)
        q = rng.standard_normal((new, heads, d)).astype(np.float32)
        attend = _kernel(make_paged_attention, heads, KV_HEADS, d, PAGE, d ** -0.5, None, kv_dtype=fmt)
        out = _t(np.zeros((new, heads, d), np.float32))
        attend(_t(q), pool, _t(table), _t(lens), 1, out)
        k_seen, v_seen = _rotated_decode(fmt, k, v)
        np.testing.assert_allclose(out.numpy(), _attention_reference(q, k_seen, v_seen, held), rtol=1e-4,
                                   atol=2e-5)


def _gpu_module(fmts, d):
    """kv_append per format and the two rotations, as Relax functions for the plan runner."""
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")

    def tensor(shape, dtype="float32"):
        return relax.TensorType(shape, dtype)

    def add(prim, name):
        return bb.add_func(prim.with_attr("global_symbol", f"k_{name}"), f"k_{name}")

    for fmt in fmts:
        rows = GpuRows(fmt)
        pool_ty = tensor(rows.pool_shape(POOL_PAGES), rows.pool_dtype)
        name = f"append_{fmt.name}".replace("-", "_")
        gv = add(make_gpu_kv_append(KV_HEADS, d, PAGE, kv_dtype=fmt), name)
        args = [relax.Var("pool", pool_ty), relax.Var("k", tensor((n, KV_HEADS, d))),
                relax.Var("v", tensor((n, KV_HEADS, d))), relax.Var("table", tensor((LAYERS, MAX_PAGES), "int32")),
                relax.Var("lens", tensor((LAYERS,), "int32"))]
        with bb.function(name, args, pure=False):
            layer = relax.prim_value(tirx.IntImm("int64", LAYER))
            bb.emit_func_output(bb.emit(relax.call_tir_inplace(gv, [*args, layer], [0], pool_ty)))
    for inverse in (False, True):
        name = f"rotate_{int(inverse)}"
        gv = add(make_gpu_kv_rotate(3, d, "tq4", inverse), name)
        x = relax.Var("x", tensor((n, 3, d)))
        with bb.function(name, [x]):
            bb.emit_func_output(bb.emit(relax.call_tir(gv, [x], tensor((n, 3, d)))))
    return bb.get()


@pytest.fixture(scope="module")
def vk(tmp_path_factory):
    from vulkan_device import plan_runner
    return plan_runner(_gpu_module([KVFormat(*p, KV_HEADS, PAGE, 64) for p in PAIRS], 64),
                       tmp_path_factory.mktemp("kv-turboquant-gpu"))


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_vulkan_append_stores_the_codecs_bytes(vk, pair, rng):
    """Two appends (the second finishing a page the first started, pages out of order) write exactly the numpy
    codec's bytes and nothing else."""
    fmt = KVFormat(*pair, KV_HEADS, PAGE, 64)
    table = np.zeros((LAYERS, MAX_PAGES), np.int32)
    order = rng.permutation(POOL_PAGES)
    table[LAYER], table[1 - LAYER] = order[:MAX_PAGES], order[MAX_PAGES:2 * MAX_PAGES]
    k, v = _rows(rng, 38, 64), _rows(rng, 38, 64)
    garbage = rng.integers(0, 256, fmt.pool_shape(POOL_PAGES), np.uint8)
    lens = np.array([7, 7], np.int32)
    lens[LAYER] = 0
    name = f"append_{fmt.name}".replace("-", "_")
    pool = vk.run(name, garbage.view(np.uint32), k[:21], v[:21], table, lens)
    lens[LAYER] = 21
    pool = vk.run(name, pool, k[21:], v[21:], table, lens).view(np.uint8)
    expected = garbage.copy()
    for s, row in enumerate(encode_rows(fmt, k, v)):
        expected[table[LAYER, s // PAGE], 0, :, s % PAGE] = row
    np.testing.assert_array_equal(pool, expected)


def test_vulkan_rotation_kernels_equal_numpys(vk, rng):
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    np.testing.assert_array_equal(vk.run("rotate_0", x), rotate(x))
    np.testing.assert_array_equal(vk.run("rotate_1", x), unrotate(x))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("kv-tq") / "tiny.gguf", matrix_type="Q8_0", layers=2, heads=4,
                            kv_heads=2, head_dim=32)


@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_tiny_model_on_the_cpu_matches_the_reference_with_the_same_cache_rounding(pair, tiny_gguf, tmp_path):
    import sharpi
    artifact = sharpi.compile(str(tiny_gguf), output=tmp_path / "cpu", matmuls="float", kv_dtype_k=pair[0],
                              kv_dtype_v=pair[1], use_cache=False)
    model = sharpi.load(artifact)
    assert model.manifest.kv_types == pair
    check_against_the_reference(model, tiny_gguf, pair)


def test_tiny_model_on_vulkan_matches_the_reference_with_the_same_cache_rounding(tiny_gguf, tmp_path):
    import sharpi
    from vulkan_device import on_vulkan
    pair = ("tq4", "tq3")
    artifact = sharpi.compile(str(tiny_gguf), target="vulkan", output=tmp_path / "vk", kv_dtype_k=pair[0],
                              kv_dtype_v=pair[1], use_cache=False)
    check_against_the_reference(on_vulkan(lambda: sharpi.load(artifact)), tiny_gguf, pair)


def test_turboquant_rows_are_small_and_refuse_other_head_sizes():
    """tq3 a 64-element row: 24 code bytes and a 4-byte norm (3.5 bits a value); tq4: 36 (4.5)."""
    assert KVFormat("tq3", "tq3", 1, PAGE, 64).row_bytes == 2 * 28
    assert KVFormat("tq4", "tq4", 1, PAGE, 128).row_bytes == 2 * 68
    assert kv_codecs.codec("tq3").rotated and not kv_codecs.codec("q8_0").rotated
    from sharpi.common.errors import ConfigError
    with pytest.raises(ConfigError, match="power of two"):
        KVFormat("tq4", "q8_0", 1, PAGE, 96)


def test_turboquant_caches_build_for_cuda(tmp_path):
    """tq4 keys and tq3 values on the cuda target: nvcc builds the store, the readers and the graph's rotations
    (under CI=1 a machine without nvcc fails here, as tests/test_cuda_build.py's do)."""
    import os
    import shutil
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        if os.environ.get("CI"):
            pytest.fail("CI has no nvcc: .ci/run installs NVIDIA's nvcc wheel where the machine lacks the toolkit")
        pytest.skip("the cuda target compiles with nvcc, which this machine lacks")
    import sharpi
    from sharpi.common.manifest import Manifest
    from sharpi.codegen.targets.cuda import fatbin_entries
    from tiny_gguf import write_tiny_llama
    path = write_tiny_llama(tmp_path / "tiny.gguf", head_dim=32)
    artifact = sharpi.compile(str(path), target="cuda", kv_dtype_k="tq4", kv_dtype_v="tq3", output=tmp_path / "cu")
    m = Manifest.read(artifact)
    assert m.kv_types == ("tq4", "tq3")
    names = set(m.kernels)
    assert {"kv_append_kvtq4_tq3", "snapkv_score_kvtq4_tq3"} <= names, names
    assert any(n.startswith("kv_rotate_tq4_forward") for n in names) and any(
        n.startswith("kv_rotate_tq3_inverse") for n in names), names
    assert set(fatbin_entries((artifact / "model.so").read_bytes())) == {("elf", 80), ("ptx", 80)}
