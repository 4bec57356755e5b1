"""The decode step's fused GEMV (kernels.gpu.fused_gemv): RMSNorm, several matrices of mixed types, biases, RoPE and
the GLU in one kernel, built to WGSL and run on Vulkan (lavapipe in CI) against numpy."""
import numpy as np
import pytest
from tvm import relax

import test_kquants
from sharpi.codegen.kernels.gpu.fused_gemv import FusedGemv, Matrix, Rope, make_gpu_fused_gemv
from sharpi.common.quant_layout import dequantize_layout
from sharpi.testing.reference import gelu_tanh, rms_norm, rope_adjacent, rope_neox, silu
from test_gpu_kernels import _gpu_parts
from test_kernels import _weight
from vulkan_device import plan_runner

POS = 37


ROPES = {"norm": rope_adjacent, "neox": rope_neox}
ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def _rope(y, rope: Rope):
    """The numpy reference's RoPE of each head of y [1, rows] at POS."""
    return ROPES[rope.layout](y.reshape(1, -1, rope.head_dim), [POS], rope.theta).reshape(1, -1)


def _inputs_and_expected(spec: FusedGemv, rng):
    """The kernel's arguments and numpy's outputs."""
    K = spec.k_in
    x = rng.standard_normal((1, K)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    args = [x] + ([g] if spec.norm_eps is not None else []) + ([np.array([POS], np.int32)] if spec.rope else [])
    h = rms_norm(x, g, spec.norm_eps) if spec.norm_eps is not None else x
    ys = []
    for m in spec.matrices:
        make = test_kquants._weight if m.qtype in ("q4_k", "q5_k", "q6_k") else _weight
        qtype, parts = make(m.qtype.upper(), m.rows, K, rng)
        bias = rng.standard_normal(m.rows).astype(np.float32) if m.bias else None
        args += _gpu_parts(parts) + ([bias] if m.bias else [])
        ys.append(h @ dequantize_layout(qtype, parts).T + (bias if m.bias else 0))
    if spec.rope:
        ys[:spec.rope.matrices] = [_rope(y, spec.rope) for y in ys[:spec.rope.matrices]]
    if spec.epilogue == "glu":
        return args, [ACTIVATIONS[spec.activation](ys[0]) * ys[1]]
    return args, [y.reshape(m.out_shape()) for y, m in zip(ys, spec.matrices)]


def _module(spec: FusedGemv, args, expected):
    bb = relax.BlockBuilder()
    gv = bb.add_func(make_gpu_fused_gemv(spec), spec.name())
    params = [relax.Var(f"a{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(args)]
    out_ty = [relax.TensorType(y.shape, "float32") for y in expected]
    with bb.function("decode", params):
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(gv, params, out_ty if len(out_ty) > 1 else out_ty[0]))
        bb.emit_func_output(out)
    return bb.get()


SPECS = {
    # SmolLM2's attention: q, k, v (NORM pairs), here of three types, two with biases, outputs as heads
    "qkv-norm-rope": FusedGemv(128, (Matrix("q4_1", 64, True, 16), Matrix("q8_0", 32, False, 16),
                                     Matrix("f16", 32, True, 16)), norm_eps=1e-5, rope=Rope("norm", 16, 1e4, 2)),
    # Qwen2.5's: NEOX pairs, K-quants (q6_k values beside q4_k), a large RoPE base
    "qkv-neox-kquants": FusedGemv(256, (Matrix("q4_k", 128, True, 32), Matrix("q4_k", 64, True, 32),
                                        Matrix("q6_k", 64, True, 32)), norm_eps=1e-6, rope=Rope("neox", 32, 1e6, 2)),
    # a matrix without heads or RoPE (an output head after the final norm)
    "plain": FusedGemv(96, (Matrix("q5_0", 80),), norm_eps=1e-5),
    "glu-silu": FusedGemv(96, (Matrix("q5_0", 48), Matrix("q4_0", 48)), "glu", norm_eps=1e-5, activation="silu"),
    # Gemma's GeGLU; no norm (the kernel without its prologue)
    "glu-gelu": FusedGemv(64, (Matrix("q8_0", 40), Matrix("f32", 40)), "glu", activation="gelu_tanh"),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_fused_gemv_matches_numpy_on_vulkan(name, tmp_path, rng):
    spec = SPECS[name]
    args, expected = _inputs_and_expected(spec, rng)
    runner = plan_runner(_module(spec, args, expected), tmp_path)
    got = runner.run("decode", *args)
    got = got if isinstance(got, (list, tuple)) else [got]
    assert len(got) == len(expected)
    for out, want in zip(got, expected):
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_unsupported_shapes_are_refused():
    from sharpi import CompileError
    with pytest.raises(CompileError, match="rows in pairs"):
        make_gpu_fused_gemv(FusedGemv(64, (Matrix("q8_0", 33),)))
    with pytest.raises(CompileError, match="glu"):
        make_gpu_fused_gemv(FusedGemv(64, (Matrix("q8_0", 32), Matrix("q8_0", 64)), "glu", activation="silu"))
