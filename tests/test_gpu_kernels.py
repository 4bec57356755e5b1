"""GPU kernels (written for dlight's GPU rules), built to WGSL and run on Vulkan (lavapipe in CI) via the plan
runner, against numpy."""

import numpy as np
import pytest
import tvm
from tvm import relax

import sharpi
from sharpi.codegen.kernels.gpu.quant_matmul import GPU_LAYOUTS, make_gpu_matmul
from sharpi.common.quant_layout import dequantize_layout
from test_kernels import _weight
from vulkan_device import plan_runner

N, K = 96, 128


def _matmul_module(qtype, parts, n_out=N, k_in=K):
    """Relax functions `prefill` (symbolic tokens) and `decode` (one token) calling the GPU matmul."""
    bb = relax.BlockBuilder()
    for name, tokens in (("prefill", None), ("decode", 1)):
        n = tvm.tirx.Var("n", "int64") if tokens is None else tokens
        x = relax.Var("x", relax.TensorType((n, k_in), "float32"))
        params = [relax.Var(f"w{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(parts)]
        gv = bb.add_func(make_gpu_matmul(qtype, n_out, k_in, tokens), f"matmul_{name}")
        with bb.function(name, [x, *params]):
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir(gv, [x, *params], relax.TensorType((n, n_out), "float32")))
            bb.emit_func_output(out)
    return bb.get()


def _gpu_parts(parts):
    """The layout's parts as the GPU kernel takes them: each scale plane a buffer of its own."""
    if "s" not in parts:
        return list(parts.values())
    return [parts["qs"], *[np.ascontiguousarray(plane) for plane in parts["s"]]]


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", "F32"])
def test_gpu_matmul_on_vulkan(qtype_name, tmp_path, rng):
    qtype, parts = _weight(qtype_name, N, K, rng)
    gpu_parts = _gpu_parts(parts)
    runner = plan_runner(_matmul_module(qtype, gpu_parts), tmp_path)
    w = dequantize_layout(qtype, parts)
    for function, tokens in (("decode", 1), ("prefill", 1), ("prefill", 19)):
        x = rng.standard_normal((tokens, K)).astype(np.float32)
        got = runner.run(function, x, *gpu_parts)
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-4)


def test_layouts_without_a_gpu_kernel_say_so():
    missing = [q for q in ("bf16",) if q not in GPU_LAYOUTS]
    assert missing
    for qtype in missing:
        with pytest.raises(sharpi.CompileError, match="no GPU matmul kernel yet"):
            make_gpu_matmul(qtype, N, K)
