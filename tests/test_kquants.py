"""Q4_K, Q5_K, Q6_K and Q5_1 as native sharpi layouts: repacking against the gguf package's dequantizers, the CPU
matmul and embedding kernels (and the GPU matmul on Vulkan) against numpy, and the real gemma3 GGUF's size."""
import time

import numpy as np
import pytest

from sharpi.codegen.kernels.gpu.quant_matmul import GPU_LAYOUTS
from sharpi.codegen.kernels.quant_matmul import make_embedding, make_matmul
from sharpi.frontend.gguf_file import GGUFTensor
from sharpi.common.quant_layout import dequantize_layout, scale_planes, sub_scales
from sharpi.frontend.quant import layout_of, repack
from test_kernels import _as_cpu_kernel_takes, _build, _t

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q5_1"]
# GGUF block: (bytes, weights, offsets of its f16 scale fields)
_BLOCKS = {"Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,)),
           "Q5_1": (24, 32, (0, 2))}


def _raw(name, n, k, rng):
    """GGUF bytes of an [n, k] tensor: random blocks (every bit pattern of quants, sub-scales and mins) with f16
    scales of a size that keeps the weights around 1/sqrt(k); Q5_1 through gguf's own quantizer."""
    import gguf
    qt = gguf.GGMLQuantizationType[name]
    if name == "Q5_1":
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        return qt, gguf.quants.quantize(w, qt)
    nbytes, width, f16_offsets = _BLOCKS[name]
    raw = rng.integers(0, 256, (n, k // width, nbytes), dtype=np.uint8)
    size = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 3e-5}[name] * 16 / np.sqrt(k)
    for off in f16_offsets:
        d = (rng.standard_normal((n, k // width, 1)) * size).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8)
    return qt, raw.reshape(n, -1)


def _tensor(name, n, k, rng):
    qt, raw = _raw(name, n, k, rng)
    return GGUFTensor(name="w", type_name=name, type_id=int(qt), shape=(n, k), data=raw), raw


def _weight(name, n, k, rng):
    t, _ = _tensor(name, n, k, rng)
    return layout_of(t), repack(t)


@pytest.mark.parametrize("name", TYPES)
def test_repack_matches_gguf_dequantize(name, rng):
    import gguf
    for n, k in ((5, 256), (3, 1024)):
        t, raw = _tensor(name, n, k, rng)
        assert layout_of(t) == name.lower()
        parts = repack(t)
        assert {"qs", "s"} <= set(parts) and parts["qs"].dtype == np.uint32 and parts["s"].dtype == np.float32
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(n, k)
        np.testing.assert_array_equal(dequantize_layout(name.lower(), parts), expected)
        if name != "Q5_1":
            _assert_sub_scales_multiply_back(name.lower(), parts)


def _assert_sub_scales_multiply_back(qtype, parts):
    """The integer form of a K-quant's scales (the `ks` part) multiplies back to its f32 scale planes exactly."""
    assert set(parts) == {"qs", "s", "ks"} and parts["ks"].dtype == np.uint32
    n = parts["qs"].shape[0]
    if qtype == "q6_k":
        d_super, sc = sub_scales(qtype, parts["ks"])
        d = (d_super[..., None] * sc).reshape(n, -1, 2)
        np.testing.assert_array_equal(parts["s"][0], d[..., 0])
        np.testing.assert_array_equal(parts["s"][1], d[..., 1])
        return
    d_super, dmin, sc, mn = sub_scales(qtype, parts["ks"])
    assert sc.max() < 64 and mn.max() < 64
    np.testing.assert_array_equal(parts["s"][0], (d_super[..., None] * sc).reshape(n, -1))
    np.testing.assert_array_equal(parts["s"][1], (-(dmin[..., None] * mn)).reshape(n, -1))


def test_ks_holds_everything_the_scale_planes_do(rng):
    """A K-quant's `ks` part (its sub-scales and bit fields) rebuilds its `s` planes bit for bit, so a target that
    stores (qs, ks) loses nothing, and dequantizes to the GGUF's weights without `s`."""
    import gguf
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        t, raw = _tensor(name, 6, 512, rng)
        parts = repack(t)
        np.testing.assert_array_equal(scale_planes(name.lower(), parts["ks"]).view(np.uint32),
                                      parts["s"].view(np.uint32))
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(6, 512)
        np.testing.assert_array_equal(dequantize_layout(name.lower(), {"qs": parts["qs"], "ks": parts["ks"]}),
                                      expected)


def test_the_sub_scale_part_is_stored_only_for_the_kernels_that_read_it(tmp_path, rng):
    """A K-quant's `ks` part is in the weight table as the GGUF is read; a target whose kernels do not read it
    (all but the llvm target's AVX2 integer-dot kernels) has it dropped: the parameters close ranks in order and
    the repacked tensors hold only what the graph takes."""
    from dataclasses import replace

    from sharpi.codegen.targets import target_for
    from sharpi.common.compile_options import CompileOptions
    from sharpi.frontend.gguf_file import GGUFFile
    from sharpi.frontend.weights import load_weights
    from tiny_gguf import write_tiny_llama

    import gguf

    _, blocks = _raw("Q6_K", 256, 256, rng)
    path = write_tiny_llama(tmp_path / "k.gguf", dim=256, ffn=256, layers=1, matrix_type="Q4_0",
                            override_raw={"blk.0.ffn_up.weight": (blocks, gguf.GGMLQuantizationType.Q6_K)})
    table = load_weights(GGUFFile(path), ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"], ["output_norm.weight"],
                         False)
    assert table.names == ["blk.0.attn_q.weight:qs", "blk.0.attn_q.weight:s", "blk.0.ffn_up.weight:qs",
                           "blk.0.ffn_up.weight:s", "blk.0.ffn_up.weight:ks", "output_norm.weight:w"]
    assert set(table.repacked("blk.0.ffn_up.weight")) == {"qs", "s", "ks"}
    table.choose_scales(lambda name: False)
    assert [s.name for s in table.specs] == [n for n in table.names if not n.endswith(":ks")]
    assert table.tensors["blk.0.ffn_up.weight"][1] == [2, 3] and table.tensors["output_norm.weight"][1] == [4]
    assert set(table.repacked("blk.0.ffn_up.weight")) == {"qs", "s"}
    compact = load_weights(GGUFFile(path), ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"], [], False)
    compact.choose_scales(lambda name: True)                 # what a target whose kernels read `ks` stores
    assert compact.names == ["blk.0.attn_q.weight:qs", "blk.0.attn_q.weight:s", "blk.0.ffn_up.weight:qs",
                             "blk.0.ffn_up.weight:ks"]
    assert set(compact.repacked("blk.0.ffn_up.weight")) == {"qs", "ks"}
    llvm = target_for("llvm")
    int8 = CompileOptions(target="llvm", matmuls="int8")
    assert llvm.sub_scales_for(replace(int8, mcpu="x86-64-v3")) == "all"
    assert llvm.sub_scales_for(replace(int8, mcpu="sapphirerapids")) == "all"      # AMX: its GEMM reads ks
    assert llvm.sub_scales_for(replace(int8, mcpu="znver4")) == "experts"          # AVX-512 VNNI, no AMX
    assert llvm.sub_scales_for(replace(int8, mcpu="x86-64-v3", matmuls="float")) == "none"
    assert target_for("vulkan").sub_scales_for(CompileOptions(target="vulkan")) == "none"
    assert target_for("cuda").sub_scales_for(CompileOptions(target="cuda")) == "none"


@pytest.mark.parametrize("name", TYPES)
def test_repack_by_row_chunks_is_the_same(name, rng, monkeypatch):
    """A tensor larger than a repack step is repacked in chunks of rows (7 rows of 40 here, the last one short)
    into the same parts as at once."""
    from sharpi.frontend import quant

    t, _ = _tensor(name, 40, 512, rng)
    whole = repack(t)
    monkeypatch.setattr(quant, "CHUNK_BYTES", 7 * t.data[0].nbytes)
    chunked = repack(t)
    assert chunked.keys() == whole.keys()
    for part in whole:
        np.testing.assert_array_equal(chunked[part], whole[part])


def test_k_quants_need_whole_super_blocks(rng):
    from sharpi.common.errors import UnsupportedTensorTypeError
    import gguf
    raw = np.zeros((3, 144), np.uint8)     # one Q4_K super-block a row, claimed as K = 128
    t = GGUFTensor(name="w", type_name="Q4_K", type_id=int(gguf.GGMLQuantizationType.Q4_K), shape=(3, 128), data=raw)
    with pytest.raises(UnsupportedTensorTypeError, match="multiple of 256"):
        repack(t)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n_out,k_in,tokens,static", [(70, 512, 1, True), (33, 256, 1, False), (33, 256, 13, False)])
def test_matmul(name, n_out, k_in, tokens, static, rng):
    q, parts = _weight(name, n_out, k_in, rng)
    w = dequantize_layout(q, parts)
    f = _build(make_matmul(q, n_out, k_in, tokens if static else None))
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    y = _t(np.zeros((tokens, n_out), np.float32))
    f(_t(x), *[_t(p) for p in _as_cpu_kernel_takes(q, parts, n_out, k_in)], y)
    np.testing.assert_allclose(y.numpy(), x @ w.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,sub_scales", [(t, False) for t in TYPES] + [(t, True) for t in TYPES if "K" in t])
def test_embedding(name, sub_scales, rng):
    """Rows of the table, from (qs, s), and for the K-quants from (qs, ks) too (the layout of the targets whose
    matmuls read `ks`), equal to the GGUF's dequantized weights."""
    q, parts = _weight(name, 50, 512, rng)
    w = dequantize_layout(q, parts)
    ids = np.array([0, 49, 7, 7, 31], np.int32)
    y = _t(np.zeros((5, 512), np.float32))
    taken = _as_cpu_kernel_takes(q, parts, 50, 512, sub_scales)
    _build(make_embedding(q, 50, 512, sub_scales))(_t(ids), *[_t(p) for p in taken], y)
    np.testing.assert_array_equal(y.numpy(), w[ids])


@pytest.mark.parametrize("name", [t for t in TYPES if t.lower() in GPU_LAYOUTS])
def test_gpu_matmul_on_vulkan(name, tmp_path, rng):
    from test_gpu_kernels import _gpu_parts, _matmul_module
    from vulkan_device import plan_runner

    n_out, k_in = 96, 256
    qtype, parts = _weight(name, n_out, k_in, rng)
    gpu_parts = _gpu_parts(parts)
    runner = plan_runner(_matmul_module(qtype, gpu_parts, n_out, k_in), tmp_path)
    w = dequantize_layout(qtype, parts)
    for function, tokens in (("decode", 1), ("prefill", 1), ("prefill", 19)):
        x = rng.standard_normal((tokens, k_in)).astype(np.float32)
        got = runner.run(function, x, *gpu_parts)
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [t for t in TYPES if t.lower() in GPU_LAYOUTS])
def test_gpu_embedding_on_vulkan(name, tmp_path, rng):
    import tvm
    from tvm import relax
    from sharpi.codegen.kernels.gpu.elementwise import make_gpu_embedding
    from test_gpu_kernels import _gpu_parts
    from vulkan_device import plan_runner

    vocab, dim = 100, 256
    qtype, parts = _weight(name, vocab, dim, rng)
    gpu_parts = _gpu_parts(parts)
    bb = relax.BlockBuilder()
    gv = bb.add_func(make_gpu_embedding(qtype, vocab, dim), "embedding")
    n = tvm.tirx.Var("n", "int64")
    ids = relax.Var("ids", relax.TensorType((n,), "int32"))
    params = [relax.Var(f"w{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(gpu_parts)]
    with bb.function("main", [ids, *params]):
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(gv, [ids, *params], relax.TensorType((n, dim), "float32")))
        bb.emit_func_output(out)
    runner = plan_runner(bb.get(), tmp_path)
    table = dequantize_layout(qtype, parts)
    for chosen in ([vocab - 1], [0, 5, 99, 5, 42, 17, 63]):
        chosen = np.array(chosen, np.int32)
        np.testing.assert_allclose(runner.run("main", chosen, *gpu_parts), table[chosen], rtol=1e-6, atol=0)


def test_gemma3_repacks_natively_within_1_35x(gemma3_gguf):
    import warnings
    import gguf
    from sharpi.frontend.gguf_file import GGUFFile

    g = GGUFFile(gemma3_gguf)
    start = time.perf_counter()
    total, by_type = 0, {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no tensor may be expanded to f16
        for t in g.tensors.values():
            if len(t.shape) == 1:              # norms: f32 vectors, as WeightTable.add_vector keeps them
                nbytes = int(np.prod(t.shape)) * 4
            else:
                qtype = layout_of(t)
                assert qtype == t.type_name.lower(), (t.name, t.type_name)
                parts = repack(t)
                nbytes = sum(p.nbytes for p in parts.values())
                if qtype in ("q4_k", "q6_k") and t.name.startswith("blk.0."):    # spot-check real K-quant data
                    rows = t.data.shape[0] if t.data.ndim == 2 else t.shape[0]
                    raw = np.asarray(t.data).reshape(rows, -1)[:4]
                    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.type_id))
                    sub = {"qs": parts["qs"][:4], "s": parts["s"][:, :4]}
                    np.testing.assert_array_equal(dequantize_layout(qtype, sub), expected.reshape(4, -1))
            src = t.data.nbytes
            acc = by_type.setdefault(t.type_name, [0, 0])
            acc[0] += nbytes
            acc[1] += src
            total += nbytes
    seconds = time.perf_counter() - start
    size = gemma3_gguf.stat().st_size
    ratio = total / size
    for name, (ours, theirs) in sorted(by_type.items()):
        print(f"{name}: {ours / 1e6:.1f} MB from {theirs / 1e6:.1f} MB ({ours / theirs:.3f}x)")
    print(f"gemma3-270m: {total / 1e6:.1f} MB of weights from a {size / 1e6:.1f} MB GGUF ({ratio:.3f}x), "
          f"repacked in {seconds:.1f} s")
    assert ratio <= 1.35, ratio
