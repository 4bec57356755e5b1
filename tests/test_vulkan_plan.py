"""The Vulkan path's foundation: a Relax module built to WGSL, its plan recorded, replayed through wgpu on Vulkan
(lavapipe in CI), against numpy."""

import numpy as np
import pytest
from tvm import relax
from tvm.relax import op as R

import sharpi
from sharpi.codegen.targets.vulkan import build_plan
from sharpi.common.shape_expr import evaluate
from vulkan_device import plan_runner


def _small_module():
    import tvm
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 64), "float32"))
    g = relax.Var("g", relax.TensorType((64,), "float32"))
    w = relax.Var("w", relax.TensorType((64, 96), "float32"))
    b = relax.Var("b", relax.TensorType((96,), "float32"))
    with bb.function("main", [x, g, w, b]):
        with bb.dataflow():
            h = bb.emit(R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
            y = bb.emit(R.add(R.matmul(h, w), b))
            out = bb.emit_output(R.nn.silu(y))
        bb.emit_func_output(out)
    return bb.get()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return plan_runner(_small_module(), tmp_path_factory.mktemp("vk"))


def test_shape_expressions_are_arithmetic_only():
    assert evaluate("((n + 31) // 32)", {"n": 70}) == 3
    assert evaluate("max(min(n, 4), 2) * 8 % 5", {"n": 9}) == 2
    with pytest.raises(sharpi.ArtifactError):
        evaluate("__import__('os').system('true')", {})


def test_plan_records_kernels_and_geometry():
    plan = build_plan(_small_module())
    fplan = plan.functions["main"]
    assert fplan["sym_vars"] == {"n": [0, 0]}
    calls = [op for op in fplan["ops"] if op["op"] == "call"]
    assert len(calls) >= 2
    for k in plan.kernels.values():
        assert "@compute" in plan.sources[k["entry"]] and k["buffers"][0]["access"] == "read_write"


@pytest.mark.parametrize("n", [1, 3, 70])
def test_replay_on_vulkan_matches_numpy(runner, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    g = rng.standard_normal(64).astype(np.float32)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32)
    out = runner.run("main", x, g, w, b)
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
    y = h @ w + b
    np.testing.assert_allclose(out, y / (1 + np.exp(-y)), rtol=1e-4, atol=1e-4)


def test_adapter_is_reported(runner):
    assert runner.adapter_name


def _norm_module(dim):
    import tvm
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, dim), "float32"))
    g = relax.Var("g", relax.TensorType((dim,), "float32"))
    with bb.function("main", [x, g]):
        with bb.dataflow():
            out = bb.emit_output(R.nn.rms_norm(x, g, axes=[-1], epsilon=1e-5))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("dim", [576, 1000])
def test_rms_norm_on_vulkan_matches_numpy(tmp_path, dim):
    """The model's norm as the GPU pipeline schedules it (legalized, dlight's reduction rule), at awkward sizes."""
    runner = plan_runner(_norm_module(dim), tmp_path)
    rng = np.random.default_rng(dim)
    g = rng.standard_normal(dim).astype(np.float32)
    for n in (1, 37):
        x = (rng.standard_normal((n, dim)) * 3).astype(np.float32)
        want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * g
        np.testing.assert_allclose(runner.run("main", x, g), want, rtol=1e-5, atol=1e-5)
