"""The whole pipeline on tiny random llama GGUFs of each weight type, against the exact numpy reference."""
import numpy as np
import pytest

import sharpi
from sharpi.testing.reference import NumpyReference
from tiny_gguf import write_tiny_llama
from vulkan_device import on_vulkan


@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "F16", "F32"])
def test_tiny_llama_matches_reference(matrix_type, tmp_path):
    path = write_tiny_llama(tmp_path / f"tiny-{matrix_type}.gguf", matrix_type=matrix_type, layers=2, heads=4,
                            kv_heads=2)
    model = sharpi.load(sharpi.compile(str(path), output=tmp_path / "art", matmuls="float"))
    ids = list(np.random.default_rng(0).integers(0, model.config.vocab_size, 37))
    got = model.score(ids)
    expected = NumpyReference(path).forward(ids)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
    with model.session() as s:                       # decode through the cache agrees too
        last = s.prefill(ids[:20])
        np.testing.assert_allclose(last, expected[19], rtol=1e-3, atol=1e-3)
        for i in range(20, 25):
            np.testing.assert_allclose(s.decode(ids[i]), expected[i], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_tiny_llama_int8_matmuls_near_reference(matrix_type, tmp_path):
    """The default CPU artifact (int8 matmuls where the CPU has AVX2): prefill and decode steps within the
    conformance tolerance for int8 matmuls of the reference log-probs, and not equal to them."""
    from sharpi.testing.conformance import tolerance_for
    from sharpi.testing.reference import log_softmax
    path = write_tiny_llama(tmp_path / f"tiny-{matrix_type}.gguf", matrix_type=matrix_type, layers=2, heads=4,
                            kv_heads=2)
    model = sharpi.load(sharpi.compile(str(path), output=tmp_path / "art"))
    if model.manifest.target["matmuls"] != "int8":
        pytest.skip("this CPU has no AVX2: the default matmuls are float32 (tested above)")
    ids = list(np.random.default_rng(0).integers(0, model.config.vocab_size, 37))
    expected = log_softmax(NumpyReference(path).forward(ids))
    tol = tolerance_for(model.manifest)
    with model.session() as s:
        rows = [s.prefill(ids[:20])] + [s.decode(ids[i]) for i in range(20, 25)]
    got = log_softmax(np.stack(rows))
    want = expected[19:25]
    assert np.abs(got - want).max() <= tol.logprob_atol
    assert np.abs(got[0] - want[0]).max() > 1e-5                     # the prefill ran the int8 kernels too
    assert (want.max(-1) - want[np.arange(6), got.argmax(-1)] <= tol.near_tie).all()


@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q5_0", "F16", "F32"])
def test_tiny_llama_on_vulkan_matches_reference(matrix_type, tmp_path):
    """The Vulkan pipeline end to end for the weight types SmolLM2 does not have (it is Q4_1 and Q8_0)."""
    path = write_tiny_llama(tmp_path / f"tiny-{matrix_type}.gguf", matrix_type=matrix_type, layers=2, heads=4,
                            kv_heads=2)
    artifact = sharpi.compile(str(path), target="vulkan", output=tmp_path / "vk")
    model = on_vulkan(lambda: sharpi.load(artifact))
    ids = list(np.random.default_rng(0).integers(0, model.config.vocab_size, 37))
    expected = NumpyReference(path).forward(ids)
    np.testing.assert_allclose(model.score(ids), expected, rtol=1e-3, atol=1e-3)
    with model.session() as s:
        np.testing.assert_allclose(s.prefill(ids[:20]), expected[19], rtol=1e-3, atol=1e-3)
        for i in range(20, 23):
            np.testing.assert_allclose(s.decode(ids[i]), expected[i], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("target,kv_dtype,tolerance", [("llvm", "f16", 2e-2), ("vulkan", "f16", 2e-2),
                                                       ("llvm", "bf16", 5e-2)])   # bf16: 8 bits of mantissa
def test_half_precision_kv_cache(target, kv_dtype, tolerance, tmp_path):
    """--kv-dtype f16 / bf16: half the KV bytes, logits within their rounding of the reference, eviction and
    forks still work."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", matrix_type="Q8_0", layers=2, heads=4, kv_heads=2)
    half = on_vulkan(lambda: sharpi.load(sharpi.compile(str(path), target=target, kv_dtype=kv_dtype,
                                                        output=tmp_path / kv_dtype, matmuls="float")))
    full = sharpi.load(sharpi.compile(str(path), target=target, output=tmp_path / "f32", matmuls="float"))
    assert half.manifest.kv_dtype == {"f16": "float16", "bf16": "bfloat16"}[kv_dtype]
    assert half.engine.pool.page_bytes * 2 == full.engine.pool.page_bytes
    ids = list(np.random.default_rng(1).integers(0, half.config.vocab_size, 40))
    expected = NumpyReference(path).forward(ids)
    np.testing.assert_allclose(half.score(ids), expected, rtol=tolerance, atol=tolerance)
    with half.session(snapkv_budget=24, snapkv_window=8, snapkv_recency=4) as s, \
            full.session(snapkv_budget=24, snapkv_window=8, snapkv_recency=4) as f:
        s.prefill(ids[:36]), f.prefill(ids[:36])
        assert s.kv_length == [24, 24] and s.kv_bytes * 2 == f.kv_bytes
        np.testing.assert_allclose(s.decode(ids[36]), f.decode(ids[36]), rtol=tolerance, atol=tolerance)
        with s.fork() as g:            # a fork copies pages through the pool's numpy view (bf16: no DLPack type)
            np.testing.assert_array_equal(g.decode(ids[37]), s.decode(ids[37]))
