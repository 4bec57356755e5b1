"""GPU twins of the KV-append, paged-attention, RoPE and embedding kernels, built to WGSL and run on Vulkan
(lavapipe in CI) via the plan runner, against numpy on random data with awkward sizes."""
import math

import numpy as np
import pytest
import tvm
from tvm import relax

import sharpi
from sharpi.codegen.kernels.gpu.attention import (make_gpu_attention_combine, make_gpu_flash_attention,
                                                  make_gpu_kv_append, make_gpu_paged_attention)
from sharpi.codegen.kernels.gpu.elementwise import make_gpu_embedding, make_gpu_rope, rope_turns
from sharpi.codegen.targets.vulkan import build_plan
from sharpi.common.quant_layout import dequantize_layout
from sharpi.testing.reference import rope_adjacent
from test_gpu_kernels import _gpu_parts
from test_kernels import _attention_reference, _weight
from vulkan_device import plan_runner

HEADS, KV_HEADS, PAGE, LAYERS, LAYER = 6, 2, 16, 3, 1
SPLITS = 4      # the split decode's workgroups per head: more than some cases' tiles, so some splits see no slot




def _tensor(shape, dtype="float32"):
    return relax.TensorType(shape, dtype)


def _layer():
    return relax.prim_value(tvm.tirx.IntImm("int64", LAYER))


# -- KV append + paged attention ---------------------------------------------------------------------------------

def _attention_module(head_dim, pages, max_pages, window=0):
    """Relax functions append_{prefill,decode}(pool, k, v, page_table, kv_lens) -> pool (written in place) and
    attend_{prefill,flash,decode,split}(q, pool, page_table, kv_lens) -> out; prefill and flash (the tiled
    prompt kernel) have a symbolic token count, split is decode by SPLITS workgroups a head and the combining
    kernel."""
    bb = relax.BlockBuilder()
    pool_ty = _tensor((pages, 2, KV_HEADS, PAGE, head_dim))
    scale = head_dim ** -0.5
    for name, tokens in (("prefill", None), ("decode", 1)):
        n = tvm.tirx.Var("n", "int64") if tokens is None else tokens
        append = bb.add_func(make_gpu_kv_append(KV_HEADS, head_dim, PAGE, tokens), f"kv_append_{name}")
        attend = bb.add_func(make_gpu_paged_attention(HEADS, KV_HEADS, head_dim, PAGE, scale, tokens,
                                                      window=window), f"attention_{name}")
        def cache_vars():
            return (relax.Var("pool", pool_ty), relax.Var("page_table", _tensor((LAYERS, max_pages), "int32")),
                    relax.Var("kv_lens", _tensor((LAYERS,), "int32")))

        pool, table, lens = cache_vars()
        k, v = (relax.Var(x, _tensor((n, KV_HEADS, head_dim))) for x in "kv")
        with bb.function(f"append_{name}", [pool, k, v, table, lens]):
            out = bb.emit(relax.call_tir_inplace(append, [pool, k, v, table, lens, _layer()], [0], pool_ty))
            bb.emit_func_output(out)
        q = relax.Var("q", _tensor((n, HEADS, head_dim)))
        pool, table, lens = cache_vars()
        with bb.function(f"attend_{name}", [q, pool, table, lens]):
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir(attend, [q, pool, table, lens, _layer()],
                                                    _tensor((n, HEADS, head_dim))))
            bb.emit_func_output(out)
    flash = bb.add_func(make_gpu_flash_attention(HEADS, KV_HEADS, head_dim, PAGE, scale, window=window),
                        "attention_flash")
    n = tvm.tirx.Var("n", "int64")
    q = relax.Var("q", _tensor((n, HEADS, head_dim)))
    pool, table, lens = (relax.Var("pool", pool_ty), relax.Var("page_table", _tensor((LAYERS, max_pages), "int32")),
                         relax.Var("kv_lens", _tensor((LAYERS,), "int32")))
    with bb.function("attend_flash", [q, pool, table, lens]):
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(flash, [q, pool, table, lens, _layer()],
                                                _tensor((n, HEADS, head_dim))))
        bb.emit_func_output(out)
    split = bb.add_func(make_gpu_paged_attention(HEADS, KV_HEADS, head_dim, PAGE, scale, 1, window=window,
                                                 splits=SPLITS), "attention_split")
    combine = bb.add_func(make_gpu_attention_combine(HEADS, head_dim, SPLITS, 1), "attention_combine")
    q = relax.Var("q", _tensor((1, HEADS, head_dim)))
    pool, table, lens = (relax.Var("pool", pool_ty), relax.Var("page_table", _tensor((LAYERS, max_pages), "int32")),
                         relax.Var("kv_lens", _tensor((LAYERS,), "int32")))
    with bb.function("attend_split", [q, pool, table, lens]):
        with bb.dataflow():
            partial = bb.emit(relax.call_tir(split, [q, pool, table, lens, _layer()],
                                             _tensor((1, HEADS, SPLITS, head_dim + 2))))
            out = bb.emit_output(relax.call_tir(combine, [partial], _tensor((1, HEADS, head_dim))))
        bb.emit_func_output(out)
    return bb.get()


def _page_table(rng, max_pages, pages):
    """Pages out of order, as a pool hands them out; other layers' rows point elsewhere."""
    table = rng.integers(0, pages, (LAYERS, max_pages)).astype(np.int32)
    table[LAYER] = rng.permutation(pages)[:max_pages]
    return table


def _scatter(pool, table, start, k, v):
    """numpy kv_append: slots start .. start + n of layer LAYER."""
    pool = pool.copy()
    for t in range(len(k)):
        s = start + t
        pool[table[LAYER, s // PAGE], 0, :, s % PAGE] = k[t]
        pool[table[LAYER, s // PAGE], 1, :, s % PAGE] = v[t]
    return pool


@pytest.fixture(scope="module", params=[64, 40, 320], ids=lambda d: f"d{d}")
def attention(request, tmp_path_factory):
    """(head_dim, runner): 64 is the common case; 40 makes attention tiles straddle pages (tile 40, page 16);
    320 exceeds a workgroup (256 invocations), so each owns two dims."""
    head_dim = request.param
    max_pages = 13                              # 208 slots
    pages = 17
    runner = plan_runner(_attention_module(head_dim, pages, max_pages), tmp_path_factory.mktemp("attn"))
    return head_dim, pages, max_pages, runner


CASES = {64: [("prefill", 0, 1), ("prefill", 0, 5), ("prefill", 0, 37), ("prefill", 21, 5),
              ("prefill", 150, 37), ("decode", 0, 1), ("decode", 63, 1), ("decode", 64, 1), ("decode", 130, 1)],
         40: [("prefill", 7, 37), ("decode", 100, 1)],
         320: [("prefill", 0, 5), ("decode", 70, 1)]}


def test_kv_append_and_paged_attention_on_vulkan(attention, rng):
    head_dim, pages, max_pages, runner = attention
    for function, held, new in CASES[head_dim]:
        table = _page_table(rng, max_pages, pages)
        lens = rng.integers(0, 200, LAYERS).astype(np.int32)     # other layers' lengths must not matter
        lens[LAYER] = held
        k_all = rng.standard_normal((held + new, KV_HEADS, head_dim)).astype(np.float32)
        v_all = rng.standard_normal((held + new, KV_HEADS, head_dim)).astype(np.float32)
        pool = _scatter(rng.standard_normal((pages, 2, KV_HEADS, PAGE, head_dim)).astype(np.float32),
                        table, 0, k_all[:held], v_all[:held])
        # the append writes exactly the new slots: everything else in the pool (garbage included) is kept
        appended = runner.run(f"append_{function}", pool, k_all[held:], v_all[held:], table, lens)
        np.testing.assert_array_equal(appended, _scatter(pool, table, held, k_all[held:], v_all[held:]))
        pool = appended
        q = rng.standard_normal((new, HEADS, head_dim)).astype(np.float32)
        for name in ("decode", "split") if function == "decode" else ("prefill", "flash"):
            out = runner.run(f"attend_{name}", q, pool, table, lens)
            np.testing.assert_allclose(out, _attention_reference(q, k_all, v_all, held), rtol=1e-4, atol=2e-5,
                                       err_msg=f"{name} held={held} new={new} head_dim={head_dim}")


def test_kv_append_writes_the_new_slots(attention, rng):
    head_dim, pages, max_pages, runner = attention
    table = _page_table(rng, max_pages, pages)
    lens = np.array([3, 45, 9], np.int32)
    pool = rng.standard_normal((pages, 2, KV_HEADS, PAGE, head_dim)).astype(np.float32)
    k, v = rng.standard_normal((2, 19, KV_HEADS, head_dim)).astype(np.float32)
    got = runner.run("append_prefill", pool, k, v, table, lens)
    np.testing.assert_array_equal(got, _scatter(pool, table, lens[LAYER], k, v))


def test_sliding_window_attention_on_vulkan(tmp_path, rng):
    """A window of 37 slots (tiles of 64 and pages of 16 straddle it): queries ignore older slots, tiles wholly
    before the window are skipped."""
    from test_kernels import _attention_reference as windowed_reference
    head_dim, pages, max_pages, window = 64, 17, 13, 37
    runner = plan_runner(_attention_module(head_dim, pages, max_pages, window), tmp_path)
    for function, held, new in (("prefill", 0, 45), ("prefill", 150, 20), ("prefill", 3, 70), ("decode", 130, 1),
                                ("decode", 10, 1)):
        table = _page_table(rng, max_pages, pages)
        lens = np.zeros(LAYERS, np.int32)
        lens[LAYER] = held
        k_all, v_all = rng.standard_normal((2, held + new, KV_HEADS, head_dim)).astype(np.float32)
        pool = _scatter(np.zeros((pages, 2, KV_HEADS, PAGE, head_dim), np.float32), table, 0, k_all, v_all)
        q = rng.standard_normal((new, HEADS, head_dim)).astype(np.float32)
        for name in ("decode", "split") if function == "decode" else ("prefill", "flash"):
            out = runner.run(f"attend_{name}", q, pool, table, lens)
            np.testing.assert_allclose(out, windowed_reference(q, k_all, v_all, held, window), rtol=1e-4,
                                       atol=2e-5, err_msg=f"{name} held={held} new={new}")


def test_attention_workgroups_fit_webgpu_limits():
    for head_dim in (64, 128, 320):
        plan = build_plan(_attention_module(head_dim, 4, 4))
        for kernel in plan.kernels.values():
            assert math.prod(kernel["workgroup_size"]) <= 256


# -- RoPE --------------------------------------------------------------------------------------------------------

def _rope_module(heads, head_dim, theta, layout="norm"):
    bb = relax.BlockBuilder()
    for name, tokens in (("prefill", None), ("decode", 1)):
        n = tvm.tirx.Var("n", "int64") if tokens is None else tokens
        gv = bb.add_func(make_gpu_rope(heads, head_dim, theta, layout=layout, tokens=tokens), f"rope_{name}")
        x = relax.Var("x", _tensor((n, heads, head_dim)))
        pos = relax.Var("pos", _tensor((n,), "int32"))
        with bb.function(name, [x, pos]):
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir(gv, [x, pos], _tensor((n, heads, head_dim))))
            bb.emit_func_output(out)
    return bb.get()


# Measured on lavapipe (|x| < 5): max abs error 2.3e-5 against the float64 reference for positions up to 8191
# (mostly the rounding of the u32 angle table: 6e-6 rad at 8191), 3.2e-4 at position 131071.
@pytest.mark.parametrize("heads,head_dim,theta", [(6, 64, 10000.0), (5, 80, 500000.0)])
def test_gpu_rope_on_vulkan(heads, head_dim, theta, tmp_path, rng):
    runner = plan_runner(_rope_module(heads, head_dim, theta), tmp_path)
    for function, pos in (("prefill", [0, 1, 15, 16, 1000, 4097, 8191]), ("prefill", [8190]), ("decode", [8191]),
                          ("decode", [0])):
        pos = np.array(pos, np.int32)
        x = rng.standard_normal((len(pos), heads, head_dim)).astype(np.float32)
        got = runner.run(function, x, pos)
        np.testing.assert_allclose(got, rope_adjacent(x, pos, theta), rtol=0, atol=1e-4)


def test_gpu_rope_neox_on_vulkan(tmp_path, rng):
    from test_kernels import rope_halves
    runner = plan_runner(_rope_module(4, 256, 1e6, layout="neox"), tmp_path)
    pos = np.array([0, 1, 511, 512, 8191], np.int32)
    x = rng.standard_normal((len(pos), 4, 256)).astype(np.float32)
    np.testing.assert_allclose(runner.run("prefill", x, pos), rope_halves(x, pos, 1e6), rtol=0, atol=1e-4)


def test_rope_fixed_point_angles_stay_accurate_deep_in_context():
    """The u32 angle table (computed exactly in numpy here) against float64 angles at positions up to 2^20."""
    head_dim, theta = 128, 10000.0
    turns = np.array(rope_turns(head_dim, theta), np.uint64)
    pos = np.array([1, 8191, 32767, 131071, 1 << 20], np.uint64)
    phase = ((pos[:, None] * turns[None]) % (1 << 32)).astype(np.uint32).view(np.int32)
    got = phase.astype(np.float32).astype(np.float64) * (2 * np.pi / 2 ** 32)
    exact = pos[:, None].astype(np.float64) * theta ** (-np.arange(0, head_dim, 2) / head_dim)
    err = np.abs(np.angle(np.exp(1j * (got - exact))))
    assert err[:2].max() < 2e-5 and err.max() < 2e-3


# -- embedding ---------------------------------------------------------------------------------------------------

VOCAB, DIM = 100, 96


def _embedding_module(qtype, parts):
    bb = relax.BlockBuilder()
    gv = bb.add_func(make_gpu_embedding(qtype, VOCAB, DIM), "embedding")
    n = tvm.tirx.Var("n", "int64")
    ids = relax.Var("ids", _tensor((n,), "int32"))
    params = [relax.Var(f"w{i}", _tensor(a.shape, str(a.dtype))) for i, a in enumerate(parts)]
    with bb.function("main", [ids, *params]):
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(gv, [ids, *params], _tensor((n, DIM))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", "F32"])
def test_gpu_embedding_on_vulkan(qtype_name, tmp_path, rng):
    qtype, parts = _weight(qtype_name, VOCAB, DIM, rng)
    gpu_parts = _gpu_parts(parts)
    runner = plan_runner(_embedding_module(qtype, gpu_parts), tmp_path)
    table = dequantize_layout(qtype, parts)
    for ids in ([VOCAB - 1], [0, 5, 99, 5, 42, 17, 63]):
        ids = np.array(ids, np.int32)
        np.testing.assert_array_equal(runner.run("main", ids, *gpu_parts), table[ids])


def test_embedding_layouts_without_a_gpu_kernel_say_so():
    with pytest.raises(sharpi.CompileError, match="no GPU embedding kernel yet"):
        make_gpu_embedding("bf16", VOCAB, DIM)
