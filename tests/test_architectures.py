"""qwen2, qwen3 and a mistral-style llama (sliding window on every layer), each a tiny random GGUF compiled for
llvm once, against the exact float32 numpy reference.

Tolerance: both sides compute in float32 and differ only in summation order (and the reference's float64 RoPE
angles), which leaves about 1e-6 of the logits' scale here; 1e-4 of the scale is ~100x that margin, while each
architecture's own feature (a bias, a q/k norm, the NEOX layout, the window) moves the logits by O(1), which
test_reference_depends_on_the_feature checks so that the comparisons can fail.
"""
import copy
from dataclasses import replace

import numpy as np
import pytest

import sharpi
from sharpi.testing.reference import NumpyReference
from tiny_gguf import write_tiny_llama

WINDOW = 12                 # < the 40-token prompt and < the page size (16): the window drops whole pages too
ARCHS = {
    "qwen2": dict(arch="qwen2", qkv_bias=True, rope_base=1e6),
    "qwen3": dict(arch="qwen3", qk_norm=True, head_dim=32, rope_base=1e6),    # q_dim 128 != dim 64
    "mistral": dict(arch="llama", sliding_window=WINDOW),
}
RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    name = request.param
    d = tmp_path_factory.mktemp(name)
    path = write_tiny_llama(d / f"{name}.gguf", layers=2, dim=64, heads=4, kv_heads=2, **ARCHS[name])
    model = sharpi.load(sharpi.compile(str(path), target="llvm", output=d / "art", matmuls="float"))   # the exact path
    ids = [int(i) for i in np.random.default_rng(0).integers(0, model.config.vocab_size, 40)]
    ref = NumpyReference(path)
    return name, model, ref, ids, ref.forward(ids)


def _close(got, expected):
    err = np.abs(got - expected).max() / np.abs(expected).max()
    assert err < RTOL, f"max |diff| is {err:.2e} of the logits' scale"


def test_config(tiny):
    name, model, ref, _, _ = tiny
    cfg = model.config                                          # as the artifact's manifest stored it
    assert cfg == ref.config
    if name == "qwen2":
        assert (cfg.arch, cfg.rope_layout, cfg.qkv_bias, cfg.qk_norm) == ("qwen2", "neox", True, False)
    elif name == "qwen3":
        assert (cfg.arch, cfg.rope_layout, cfg.qkv_bias, cfg.qk_norm) == ("qwen3", "neox", False, True)
        assert cfg.head_dim == 32 and cfg.q_dim == 128 and cfg.dim == 64
    else:
        assert (cfg.arch, cfg.rope_layout, cfg.sliding_window) == ("llama", "norm", WINDOW)
        assert all(cfg.is_local(l) for l in range(cfg.n_layers))
    assert cfg.sliding_window == (WINDOW if name == "mistral" else 0)


def test_teacher_forced_logits(tiny):
    _, model, _, ids, expected = tiny
    _close(model.score(ids), expected)


def test_decode_through_cache(tiny):
    """Prefill 30 tokens, then decode 10 through the paged cache: each step equals the reference at its position
    (for mistral the window then starts past the first page, so the kernel skips it)."""
    _, model, _, ids, expected = tiny
    with model.session() as s:
        _close(s.prefill(ids[:30]), expected[29])
        for i in range(30, 40):
            _close(s.decode(ids[i]), expected[i])


def test_reference_depends_on_the_feature(tiny):
    """The reference without the architecture's feature is far from itself with it (so the tests above can fail),
    and for the window, identical on the first WINDOW tokens (no query sees farther back yet)."""
    name, _, ref, ids, expected = tiny
    variants = []
    if name == "qwen2":
        variants = [replace(ref.config, qkv_bias=False), replace(ref.config, rope_layout="norm")]
    elif name == "qwen3":
        variants = [replace(ref.config, qk_norm=False), replace(ref.config, rope_layout="norm")]
    for cfg in variants:
        other = copy.copy(ref)
        other.config = cfg
        assert np.abs(other.forward(ids) - expected).max() > 100 * RTOL * np.abs(expected).max()
    if name == "mistral":
        other = copy.copy(ref)
        other.sliding_window = 0
        full = other.forward(ids)
        np.testing.assert_array_equal(full[:WINDOW], expected[:WINDOW])
        assert np.abs(full[WINDOW:] - expected[WINDOW:]).max(axis=-1).min() > 100 * RTOL * np.abs(expected).max()


@pytest.mark.parametrize("arch, missing", [("qwen2", "attn_q.bias"), ("qwen3", "attn_q_norm.weight")])
def test_missing_tensor_is_a_clear_error(arch, missing, tmp_path):
    path = write_tiny_llama(tmp_path / "bad.gguf", arch=arch)        # no biases, no q/k norms
    with pytest.raises(sharpi.SharpiError, match=missing):
        sharpi.compile(str(path), output=tmp_path / "out")


# SmolLM2 (tests/test_vulkan_model.py) is the NORM layout without biases; a window changes only the attention
VULKAN_ARCHS = {"qwen2": ARCHS["qwen2"], "qwen3": ARCHS["qwen3"],
                "gemma3": dict(arch="gemma3", qk_norm=True, post_norms=True, sliding_window=WINDOW, head_dim=16)}


@pytest.mark.parametrize("name", sorted(VULKAN_ARCHS))
def test_vulkan_decode_matches_reference(name, tmp_path):
    """A GPU's decode step runs fused GEMVs (codegen.decode_fusion: the norm, q, k and v with their biases and
    RoPE in one kernel; the norm, gate and up with the GLU in another) where its prompt runs the ops one by one:
    both through the Vulkan pipeline against the reference, for each architecture's variant of the pattern (a
    bias, NEOX pairs, q/k norms that keep the RoPE out of the kernel, GeGLU, post-norms)."""
    from vulkan_device import on_vulkan
    path = write_tiny_llama(tmp_path / f"{name}.gguf", layers=2, dim=64, heads=4, kv_heads=2, **VULKAN_ARCHS[name])
    model = on_vulkan(lambda: sharpi.load(sharpi.compile(str(path), target="vulkan", output=tmp_path / "vk")))
    assert any(k.startswith("gpu_gemv_split") for k in model.manifest.kernels)
    assert any(k.startswith("gpu_gemv_glu") for k in model.manifest.kernels)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, model.config.vocab_size, 40)]
    expected = NumpyReference(path).forward(ids)
    with model.session() as s:
        _close(s.prefill(ids[:24]), expected[23])
        for i in range(24, 32):                         # past the window and a page boundary
            _close(s.decode(ids[i]), expected[i])
