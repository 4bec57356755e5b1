"""The cuda target: compiled here with nvcc (no GPU needed), checked by parsing the fatbin the library embeds;
run and compared with the CPU artifact only where a CUDA device exists."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import sharpi
from sharpi.codegen.targets.cuda import fatbin_entries
from tiny_gguf import write_tiny_llama


@pytest.fixture(autouse=True)
def _nvcc():
    """Skip where nvcc is missing, except in CI, which installs it (.ci/run) and must fail without it."""
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        if os.environ.get("CI"):
            pytest.fail("CI has no nvcc: .ci/run installs NVIDIA's nvcc wheel where the machine lacks the toolkit")
        pytest.skip("the cuda target compiles with nvcc, which this machine lacks")


def _cuda_device() -> bool:
    import tvm
    return bool(tvm.cuda(0).exist)


def test_smollm2_cuda_artifact_holds_sass_and_ptx(smollm2_cuda_artifact):
    from sharpi.common.manifest import Manifest
    m = Manifest.read(smollm2_cuda_artifact)
    assert m.target["kind"] == "cuda" and m.target["arch"] == "sm_80"
    images = set(fatbin_entries((smollm2_cuda_artifact / "model.so").read_bytes()))
    assert images == {("elf", 80), ("ptx", 80)}, images
    assert set(m.target["images"]) == {"elf:80", "ptx:80"}
    assert {"prefill", "decode", "prefill_snapkv", "snapkv_select", "snapkv_compact"} <= set(m.functions)


def test_decode_batch_is_compiled_for_cuda(smollm2_cuda_artifact):
    """The serving engine's batched decode: its own kernels (B sequences' page tables and lengths), in the fatbin."""
    from sharpi.common.manifest import Manifest
    m = Manifest.read(smollm2_cuda_artifact)
    assert "decode_batch" in m.functions
    batch_kernels = [k for k in m.kernels if "_batch" in k]
    assert any(k.startswith("paged_attention_batch") for k in batch_kernels), m.kernels
    assert any(k.startswith("kv_append_batch") for k in batch_kernels), m.kernels
    library = (smollm2_cuda_artifact / "model.so").read_bytes()
    assert b"paged_attention_batch" in library


def test_arch_and_cuda_graph_are_chosen_and_validated(tmp_path, capsys, smollm2_cuda_artifact):
    """--arch picks the SASS and PTX; --cuda-graph makes TVM's RewriteCUDAGraph lift decode into one captured region
    (all but the lm_head, whose output is the result); without it (the SmolLM2 artifact) nothing is captured."""
    from sharpi.cli import compile as compile_cli
    from sharpi.common.manifest import Manifest
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    artifact = sharpi.compile(str(path), target="cuda", arch="sm_90", cuda_graph=True, output=tmp_path / "c90")
    library = (artifact / "model.so").read_bytes()
    assert set(fatbin_entries(library)) == {("elf", 90), ("ptx", 90)}
    assert b"decode_cuda_graph_capture" in library and b"decode_cuda_graph_capture1" not in library
    assert Manifest.read(artifact).target["cuda_graph"] is True
    assert b"cuda_graph_capture" not in (smollm2_cuda_artifact / "model.so").read_bytes()
    with pytest.raises(sharpi.ConfigError, match="--cuda-graph applies to the cuda target only"):
        sharpi.compile(str(path), target="llvm", cuda_graph=True, output=tmp_path / "bad")
    with pytest.raises(sharpi.ConfigError, match="not a CUDA architecture"):
        sharpi.compile(str(path), target="cuda", arch="compute_90", output=tmp_path / "bad")
    assert compile_cli.main([str(path), "--target", "llvm", "--arch", "sm_90", "-o", str(tmp_path / "x")]) == 2
    assert "--arch applies to the cuda target only" in capsys.readouterr().err


def test_loading_without_a_cuda_device_says_so(smollm2_cuda_artifact):
    if _cuda_device():
        pytest.skip("this machine has a CUDA device")
    # which reason depends on whether TVM's CUDA runtime is loaded yet (a compile in this process loads it over a
    # driver stub; an artifact from the compile cache does not): no device, or no libcuda to look for one with
    with pytest.raises(sharpi.SharpiError, match="has no CUDA device|has no usable CUDA runtime"):
        sharpi.load(smollm2_cuda_artifact)


def test_cuda_logits_match_cpu(smollm2_cuda_artifact, smollm2, golden):
    if not _cuda_device():
        pytest.skip("no CUDA device on this machine (benchmarks/gpu_check.py runs this on a GPU machine)")
    gpu = sharpi.load(smollm2_cuda_artifact)
    ids = golden["teacher_forced"]["ids"]
    lg, lc = gpu.score(ids), smollm2.score(ids)
    assert (lg.argmax(-1) == lc.argmax(-1)).mean() >= 0.99
    with gpu.session(snapkv_budget=64) as a, smollm2.session(snapkv_budget=64) as b:
        a.prefill(ids[:200]), b.prefill(ids[:200])
        same = sum(np.intersect1d(x, y).size for pa, pb in zip(a.kept_positions, b.kept_positions)
                   for x, y in zip(pa, pb))
        assert same / sum(p.size for p in b.kept_positions) >= 0.99



@pytest.mark.parametrize("kv_k,kv_v,kernel_part", [("bf16", "bf16", "kvbf16"), ("q4_0", "q8_0", "kvq4_0_q8_0"),
                                                  ("q4_ch", "q4_0", "kvq4_ch_q4_0")])
def test_kv_cache_types_build_for_cuda(kv_k, kv_v, kernel_part, tmp_path):
    """--kv-dtype bf16, and q4_0 keys with q8_0 values (both quantized readers and writers in one build), on the
    cuda target: nvcc builds the attention (prefill, split decode, batched), append, compaction and SnapKV kernels
    for the pool (a quantized one read and written as 32-bit words, the same TIR the Vulkan tests run on lavapipe with
    every pairing of types); run only on a GPU machine, with the rest of the CUDA checks. The prompt's
    attention is the tiled flash kernel."""
    from sharpi.common.manifest import Manifest
    path = write_tiny_llama(tmp_path / "tiny.gguf", head_dim=32)
    artifact = sharpi.compile(str(path), target="cuda", kv_dtype_k=kv_k, kv_dtype_v=kv_v, output=tmp_path / kv_k)
    m = Manifest.read(artifact)
    assert m.kv_dtype == {"bf16": "bfloat16"}.get(kv_k, kv_k)
    from sharpi.codegen.targets.cuda import DECODE_SPLITS
    kernels = {f"{name}_{kernel_part}" for name in ("flash_attention", f"paged_attention_split_{DECODE_SPLITS}",
                                                    f"paged_attention_batch_split_{DECODE_SPLITS}",
                                                    "kv_append", "kv_append_batch", "kv_compact", "snapkv_row_stats",
                                                    "snapkv_score")}
    assert kernels <= set(m.kernels), m.kernels
    assert set(fatbin_entries((artifact / "model.so").read_bytes())) == {("elf", 80), ("ptx", 80)}


def test_nvcc_divides_correctly_rounded_under_tvms_fast_math():
    """TVM's nvcc call adds --use_fast_math; sharpi's options put back IEEE division (the quantized KV stores'
    scales equal kv_format's numpy rule only so), while exp stays approximate."""
    from tvm.support import nvcc
    from sharpi.codegen.targets.cuda import NVCC_OPTIONS, make_target
    code = ('extern "C" __global__ void f(float* a, float* b) '
            '{ b[threadIdx.x] = a[threadIdx.x] / 15.0f + 1.0f / a[threadIdx.x] + __expf(a[threadIdx.x]); }')
    with make_target("sm_80"):
        ptx = nvcc.compile_cuda(code, target_format="ptx", arch="sm_80", options=NVCC_OPTIONS,
                                compiler="nvcc").decode()
    assert "div.rn" in ptx and "rcp.rn" in ptx and "approx.ftz.f32" in ptx     # ex2.approx: fast exp kept
    assert "div.approx" not in ptx and "div.full" not in ptx and "rcp.approx" not in ptx


@pytest.mark.parametrize("qtype", ["q4_1", "q4_k", "q6_k"])
def test_scale_prefixes_read_the_same_as_views_of_their_planes(qtype):
    """CUDA's weight kernels take scale field f as planes 0..f of the [S, N, K/32] scale buffer (a view of plane f
    at a nonzero byte offset is refused by TVM's argument checks: seen on an H200); Vulkan's take the planes.
    Built unscheduled for the CPU, the two read the same scales: equal outputs, for the matmul and the embedding."""
    import tvm

    from sharpi.codegen.kernels.gpu.elementwise import make_gpu_embedding
    from sharpi.codegen.kernels.gpu.quant_matmul import make_gpu_matmul
    from sharpi.common.quant_layout import KERNEL_PARTS, LAYOUTS

    rows, cols, tokens = 64, 256, 3
    rng = np.random.default_rng(0)
    (_, qs_dtype, qs_shape), (_, _, scale_shape) = LAYOUTS[qtype][:KERNEL_PARTS]
    fields = scale_shape(rows, cols)[0]
    qs = tvm.runtime.tensor(rng.integers(0, 2**31, qs_shape(rows, cols)).astype(qs_dtype))
    scales = rng.normal(size=(fields, rows, cols // 32)).astype("float32")
    planes = [tvm.runtime.tensor(np.ascontiguousarray(plane)) for plane in scales]
    prefixes = [tvm.runtime.tensor(np.ascontiguousarray(scales[:f + 1])) for f in range(fields)]
    x = tvm.runtime.tensor(rng.normal(size=(tokens, cols)).astype("float32"))
    ids = tvm.runtime.tensor(np.array([5, 0, rows - 1], "int32"))
    for make, first, width in ((make_gpu_matmul, x, rows), (make_gpu_embedding, ids, cols)):
        outputs = []
        for scale_prefixes, given in ((False, planes), (True, prefixes)):
            kernel = tvm.compile(make(qtype, rows, cols, scale_prefixes=scale_prefixes), target="llvm")
            out = tvm.runtime.empty((tokens, width), "float32", tvm.cpu())
            kernel(first, qs, *given, out)
            outputs.append(out.numpy())
        assert fields >= 2 and np.array_equal(*outputs) and np.abs(outputs[0]).max() > 0


def _offset_views(mod) -> list:
    """memory.view calls in `mod`'s Relax functions with a nonzero byte offset."""
    import tvm
    from tvm import relax

    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.memory.view")):
            offset = getattr(expr.args[3], "value", None)     # an IntImm; R.null_value() when none was given
            if offset is not None and int(offset) != 0:
                found.append(expr)
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return found


def test_cuda_lowering_passes_no_weight_view_at_an_offset(tmp_path):
    """The cuda target's Relax module hands its kernels no view at a nonzero byte offset (TVM fuses the weight
    kernels with what follows, so every fused kernel would inherit an offset parameter); Vulkan's does (q4_1's
    second scale field), which shows the walk finds them."""
    from sharpi.codegen.targets import cuda, vulkan
    from sharpi.common.compile_options import CompileOptions
    from sharpi.compiler import front_half
    from tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tiny.gguf", matrix_type="Q4_1")
    front = front_half(path, CompileOptions(), ("float16", "float16"), False, None)
    assert not _offset_views(cuda.lower(front.mod, front.cfg))
    front = front_half(path, CompileOptions(), ("float16", "float16"), False, None)
    assert _offset_views(vulkan.attach_kernels(front.mod, front.cfg, gpu=True))


def test_a_moe_model_builds_for_cuda(tmp_path):
    """A tiny Q8_0 qwen2moe (routed experts, a shared expert) on the cuda target: nvcc builds the route and gathered
    matmul kernels (the ones tests/test_moe_models.py runs on Vulkan); on a CUDA device its logits equal the
    reference's within the float path's bound."""
    from sharpi.common.manifest import Manifest
    from sharpi.testing.reference import NumpyReference
    from tiny_gguf import write_tiny_moe
    path = write_tiny_moe(tmp_path / "moe.gguf", "qwen2moe", matrix_type="Q8_0", shared_ffn=64, router_scale=4.0)
    artifact = sharpi.compile(str(path), target="cuda", output=tmp_path / "cuda")
    kernels = Manifest.read(artifact).kernels
    assert any(k.startswith("gpu_moe_route") for k in kernels) and any(k.startswith("gpu_moe_matmul") for k in kernels)
    library = (artifact / "model.so").read_bytes()
    assert b"gpu_moe_matmul_q8_0" in library and set(fatbin_entries(library)) == {("elf", 80), ("ptx", 80)}
    if not _cuda_device():
        return
    ids = list(range(1, 41))
    expected = NumpyReference(path).forward(ids)
    got = sharpi.load(artifact).score(ids)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4
