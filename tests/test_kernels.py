"""Each kernel family against numpy on random data, with awkward sizes."""
import re

import numpy as np
import pytest
import tvm

from sharpi.codegen.kernels.paged_attention import make_kv_append, make_paged_attention
from sharpi.codegen.kernels.quant_matmul import make_embedding, make_matmul
from sharpi.codegen.kernels.rope import make_rope
from sharpi.codegen.targets.llvm import make_target
from sharpi.frontend.gguf_file import GGUFTensor
from sharpi.common.quant_layout import dequantize_layout
from sharpi.frontend.quant import repack
from sharpi.testing.reference import rms_norm, rope_adjacent

DEV = tvm.cpu()
TARGET = make_target(None)


def _as_cpu_kernel_takes(qtype, parts, n, k, sub_scales=False):
    """The quants as the CPU kernels take them (codegen inserts the same zero-copy view), then a K-quant's `ks`
    part for the kernels that read it (`sub_scales`: quant_matmul_q8k's), its `s` part for the others."""
    from sharpi.codegen.kernels.quant_matmul import cpu_quants
    if "qs" not in parts:
        return list(parts.values())
    shape, dtype = cpu_quants(qtype, n, k)
    rest = [parts["ks"] if sub_scales else parts["s"]]
    return [parts["qs"].view(dtype).reshape(shape)] + rest


def _build(prim, target=TARGET):
    return tvm.compile(tvm.IRModule({"main": prim}), target=target)


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


def workspace_requests(prim) -> list:
    """The sizes a compiled kernel asks TVMBackendAllocWorkspace for (ints, or the LLVM value of a size known only
    at run time). TVM serves a scratch buffer that way when it is not a "global" one under 1 KB, every time its
    scope is entered: in a parallel loop's body that is a call pair per task."""
    ir = _build(prim).mod.inspect_source("ll")
    callees = set(re.findall(r"(%[\w.]+) = load ptr, ptr @__TVMBackendAllocWorkspace", ir))
    sizes = []
    for callee, size in re.findall(r"call ptr (%[\w.]+)\(i32 \d+, i32 %[\w.]+, i64 ([\w%.]+)", ir):
        if callee in callees:
            sizes.append(int(size) if size.isdigit() else size)
    return sizes


def _weight(qtype_name, n, k, rng):
    import gguf
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    if qtype_name == "F32":
        return "f32", {"w": w}
    if qtype_name == "F16":
        return "f16", {"w": w.astype(np.float16)}
    if qtype_name == "BF16":
        return "bf16", {"w": (w.view(np.uint32) >> 16).astype(np.uint16)}
    qt = gguf.GGMLQuantizationType[qtype_name]
    raw = gguf.quants.quantize(w, qt)
    t = GGUFTensor(name="w", type_name=qtype_name, type_id=int(qt), shape=(n, k), data=raw)
    return qtype_name.lower(), repack(t)


def test_repack_matches_gguf_dequantize(rng):
    import gguf
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        w = rng.standard_normal((5, 96)).astype(np.float32)
        qt = gguf.GGMLQuantizationType[name]
        raw = gguf.quants.quantize(w, qt)
        t = GGUFTensor(name="w", type_name=name, type_id=int(qt), shape=(5, 96), data=raw)
        expected = gguf.quants.dequantize(raw, qt).reshape(5, 96)
        np.testing.assert_array_equal(dequantize_layout(name.lower(), repack(t)), expected)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "F32", "F16", "BF16"])
@pytest.mark.parametrize("n_out,k_in,tokens,static", [(70, 96, 1, True), (70, 96, 1, False), (33, 64, 13, False)])
def test_matmul(qtype, n_out, k_in, tokens, static, rng):
    if qtype in ("F32", "F16", "BF16"):
        k_in += 3   # dense kernels handle a K that is not a multiple of the vector width
    q, parts = _weight(qtype, n_out, k_in, rng)
    w = dequantize_layout(q, parts)
    f = _build(make_matmul(q, n_out, k_in, tokens if static else None))
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    y = _t(np.zeros((tokens, n_out), np.float32))
    f(_t(x), *[_t(p) for p in _as_cpu_kernel_takes(q, parts, n_out, k_in)], y)
    np.testing.assert_allclose(y.numpy(), x @ w.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "F16"])
def test_embedding(qtype, rng):
    q, parts = _weight(qtype, 50, 64, rng)
    w = dequantize_layout(q, parts)
    ids = np.array([0, 49, 7, 7], np.int32)
    y = _t(np.zeros((4, 64), np.float32))
    _build(make_embedding(q, 50, 64))(_t(ids), *[_t(p) for p in _as_cpu_kernel_takes(q, parts, 50, 64)], y)
    np.testing.assert_array_equal(y.numpy(), w[ids])


def test_rope_at_arbitrary_positions(rng):
    x = rng.standard_normal((5, 3, 16)).astype(np.float32)
    pos = np.array([0, 1, 15, 16, 8191], np.int32)
    y = _t(np.zeros_like(x))
    _build(make_rope(3, 16, 10000.0))(_t(x), _t(pos), y)
    np.testing.assert_allclose(y.numpy(), rope_adjacent(x, pos, 10000.0), rtol=1e-5, atol=1e-5)


def rope_halves(x, pos, theta):
    """NEOX RoPE in float64 numpy: pair i rotates elements i and i + D/2."""
    half = x.shape[-1] // 2
    angle = pos[:, None].astype(np.float64) * theta ** (-np.arange(half) * 2 / x.shape[-1])
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1).astype(np.float32)


def test_rope_neox_layout(rng):
    x = rng.standard_normal((5, 2, 24)).astype(np.float32)
    pos = np.array([0, 3, 511, 512, 20000], np.int32)
    y = _t(np.zeros_like(x))
    _build(make_rope(2, 24, 1e6, layout="neox"))(_t(x), _t(pos), y)
    np.testing.assert_allclose(y.numpy(), rope_halves(x, pos, 1e6), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError):
        make_rope(2, 24, 1e6, layout="glm")


@pytest.mark.parametrize("layout,theta", [("norm", 10000.0), ("neox", 1e6)])
def test_rope_over_runs_of_consecutive_positions(layout, theta, rng):
    """A prompt's consecutive positions take the rotation path (sincos once per run of ROTATION_RUN tokens):
    runs cut mid-way by a jump, a run starting deep in the context, a repeated position; as exact as sincos."""
    from sharpi.codegen.kernels.rope import ROTATION_RUN

    pos = np.concatenate([np.arange(0, 37), [36], np.arange(30000, 30000 + 2 * ROTATION_RUN + 5)]).astype(np.int32)
    x = rng.standard_normal((len(pos), 2, 32)).astype(np.float32)
    y = _t(np.zeros_like(x))
    _build(make_rope(2, 32, theta, layout=layout))(_t(x), _t(pos), y)
    want = rope_adjacent(x, pos, theta) if layout == "norm" else rope_halves(x, pos, theta)
    np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=2e-6)


def _attention_reference(q, k_all, v_all, held, window=0):
    """Causal GQA attention: query t sees the `held` old slots and the new ones up to itself (with a window,
    only the last `window` of them)."""
    n, heads, d = q.shape
    rep = heads // k_all.shape[1]
    k, v = np.repeat(k_all, rep, 1), np.repeat(v_all, rep, 1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    last = (held + np.arange(n))[:, None]
    visible = np.arange(len(k_all))[None, :] <= last
    if window:
        visible &= np.arange(len(k_all))[None, :] > last - window
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


@pytest.mark.parametrize("held,new,static,window", [(0, 1, False, 0), (0, 23, False, 0), (15, 1, True, 0),
                                                    (16, 1, True, 0), (21, 17, False, 0), (40, 1, True, 19),
                                                    (30, 17, False, 19), (0, 23, False, 5), (9, 1, False, 64)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1)])   # one KV head: decode splits its query heads
def test_paged_attention_and_append(held, new, static, window, heads, kv_heads, rng):
    d, page, layers, layer = 32, 16, 3, 1
    append = _build(make_kv_append(kv_heads, d, page, new if static else None))
    attend = _build(make_paged_attention(heads, kv_heads, d, page, d ** -0.5, new if static else None,
                                         window=window))
    pool = _t(np.zeros((12, 2, kv_heads, page, d), np.float32))
    table = np.zeros((layers, 4), np.int32)
    table[layer] = [7, 3, 11, 0]                        # pages out of order, as a pool hands them out
    k_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    v_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    lens = np.zeros(layers, np.int32)
    if held:
        _build(make_kv_append(kv_heads, d, page))(pool, _t(k_all[:held]), _t(v_all[:held]), _t(table), _t(lens), layer)
        lens[layer] = held
    append(pool, _t(k_all[held:]), _t(v_all[held:]), _t(table), _t(lens), layer)
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((new, heads, d), np.float32))
    attend(_t(q), pool, _t(table), _t(lens), layer, out)
    np.testing.assert_allclose(out.numpy(), _attention_reference(q, k_all, v_all, held, window), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("held,new,window", [(0, 40, 0), (20, 37, 24)])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 1, 256), (9, 3, 64), (4, 2, 64), (8, 1, 64), (5, 5, 32),
                                             (14, 2, 64)])
def test_prefill_attention_query_passes(held, new, window, heads, kv_heads, d, rng):
    """Prefill attention walks 1-4 query heads of a token together (register-blocked q . k and p . V), or a prime
    group's all at once: each group size's pass shape (1, 2, 3, 4 heads; 8 = two passes of 4; 7, Qwen2.5-0.5B's,
    in one), head_dim 32-256, a block cut by the prompt's end,
    pages out of order, a window starting mid-page."""
    page, layer = 16, 0
    pages = (held + new + page - 1) // page
    table = np.asarray([list(np.random.default_rng(1).permutation(pages) + 1)], np.int32)
    pool = _t(np.full((pages + 1, 2, kv_heads, page, d), np.nan, np.float32))   # unwritten slots are never read
    k_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    v_all = rng.standard_normal((held + new, kv_heads, d)).astype(np.float32)
    lens = np.zeros(1, np.int32)
    _build(make_kv_append(kv_heads, d, page))(pool, _t(k_all), _t(v_all), _t(table), _t(lens), layer)
    lens[0] = held
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((new, heads, d), np.float32))
    _build(make_paged_attention(heads, kv_heads, d, page, d ** -0.5, None, window=window))(
        _t(q), pool, _t(table), _t(lens), layer, out)
    np.testing.assert_allclose(out.numpy(), _attention_reference(q, k_all, v_all, held, window), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("held,new,window", [(0, 23, 0), (30, 1, 0), (20, 17, 19)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (7, 1)])     # 7: a prime group, its heads walked at once
def test_half_precision_kv_pool(kv_dtype, held, new, window, heads, kv_heads, rng):
    """An f16 or bf16 pool: append rounds K and V to nearest (ties to even, as numpy and ml_dtypes do), attention
    reads them back as float32 (decode's split-K path and prefill's)."""
    import ml_dtypes
    half = np.dtype(ml_dtypes.bfloat16) if kv_dtype == "bfloat16" else np.dtype(np.float16)
    d, page, layer = 64, 16, 0
    pages = (held + new + page - 1) // page
    table = np.asarray([list(np.random.default_rng(2).permutation(pages) + 1)], np.int32)
    pool = _t(np.zeros((pages + 1, 2, kv_heads, page, d), half))
    k_all = (4 * rng.standard_normal((held + new, kv_heads, d))).astype(np.float32)
    v_all = (4 * rng.standard_normal((held + new, kv_heads, d))).astype(np.float32)
    lens = np.zeros(1, np.int32)
    append = make_kv_append(kv_heads, d, page, kv_dtype=kv_dtype)
    _build(append)(pool, _t(k_all[:held]), _t(v_all[:held]), _t(table), _t(lens), layer)
    lens[0] = held
    _build(append)(pool, _t(k_all[held:]), _t(v_all[held:]), _t(table), _t(lens), layer)
    stored = pool.numpy()[table[0]].transpose(1, 0, 3, 2, 4).reshape(2, pages * page, kv_heads, d)
    k_half, v_half = (x.astype(half).astype(np.float32) for x in (k_all, v_all))
    np.testing.assert_array_equal(stored[0, :held + new].astype(np.float32), k_half)
    np.testing.assert_array_equal(stored[1, :held + new].astype(np.float32), v_half)
    q = rng.standard_normal((new, heads, d)).astype(np.float32)
    out = _t(np.zeros((new, heads, d), np.float32))
    _build(make_paged_attention(heads, kv_heads, d, page, d ** -0.5, 1 if new == 1 else None, kv_dtype=kv_dtype,
                                window=window))(_t(q), pool, _t(table), _t(lens), layer, out)
    np.testing.assert_allclose(out.numpy(), _attention_reference(q, k_half, v_half, held, window), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("tokens", [1, None])
def test_attention_scratch_stays_on_the_stack(tokens):
    """Only buffers of 1 KB or more may come from the workspace allocator (a call pair per task when declared in a
    parallel loop): the register-blocking accumulators must be stack arrays. Changing their scope back to "local"
    made this fail."""
    sizes = workspace_requests(make_paged_attention(4, 1, 256, 16, 0.0625, tokens, window=512))
    assert all(not isinstance(size, int) or size >= 1024 for size in sizes), sizes


@pytest.mark.parametrize("held,window", [(300, 0), (300, 100), (130, 0)])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 1, 256), (6, 2, 32), (9, 3, 64)])
def test_decode_attention_page_ranges(held, window, heads, kv_heads, d, rng):
    """Decode attention splits each KV head's visible pages into ranges (decode_splits) and merges their partial
    softmaxes: many pages per range, uneven ranges, a window starting mid-cache, pages out of order."""
    from sharpi.codegen.kernels.paged_attention import decode_splits
    page = 16
    n_pages = (held + 1 + page - 1) // page
    assert n_pages > decode_splits(kv_heads) and n_pages % decode_splits(kv_heads)     # uneven ranges
    table = np.zeros((2, n_pages + 3), np.int32)
    table[1, :n_pages] = rng.permutation(n_pages) + 2
    k_all = rng.standard_normal((held + 1, kv_heads, d)).astype(np.float32)
    v_all = rng.standard_normal((held + 1, kv_heads, d)).astype(np.float32)
    pool = np.zeros((n_pages + 2, 2, kv_heads, page, d), np.float32)
    for s in range(held + 1):
        pool[table[1, s // page], 0, :, s % page], pool[table[1, s // page], 1, :, s % page] = k_all[s], v_all[s]
    q = rng.standard_normal((1, heads, d)).astype(np.float32)
    out = _t(np.zeros((1, heads, d), np.float32))
    attend = _build(make_paged_attention(heads, kv_heads, d, page, d ** -0.5, 1, window=window))
    attend(_t(q), _t(pool), _t(table), _t(np.array([0, held], np.int32)), 1, out)
    np.testing.assert_allclose(out.numpy(), _attention_reference(q, k_all, v_all, held, window), rtol=1e-4,
                               atol=1e-5)


def test_rms_norm_as_lowered_for_llvm(rng):
    from tvm import relax
    from tvm.relax import op as R
    from sharpi.codegen.targets.llvm import build_executable

    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 40), "float32"))
    w = relax.Var("w", relax.TensorType((40,), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(R.nn.rms_norm(x, w, axes=[-1], epsilon=1e-5))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(build_executable(bb.get(), TARGET), DEV)
    xs, ws = rng.standard_normal((3, 40)).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    np.testing.assert_allclose(vm["main"](_t(xs), _t(ws)).numpy(), rms_norm(xs, ws, 1e-5), rtol=1e-5, atol=1e-6)
