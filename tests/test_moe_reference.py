"""The numpy reference's mixtures of experts (olmoe, qwen2moe, qwen3moe, granitemoe) against llama.cpp's logits
on tiny random GGUFs (tests/data/make_moe_golden.py made them once with llama-cpp-python 0.3.36 and an f32 KV
cache; tests/data/README.md), and the frontend's reading of their configs.

Tolerance: both sides compute in float32 and differ in summation order only (7.8e-7 of the logits' scale when the
data was made), so 1e-4 of the scale, as tests/test_architectures.py, is ~100x that margin; every feature the
architectures add moves the logits by at least 1e-2 of the scale (test_each_feature_moves_the_logits), so the
comparison can fail. The golden data's routers are never near a tie: the k-th and (k+1)-th router probabilities
are at least `min_gap` apart at every position and layer."""
import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sharpi.common.errors import GGUFError
from sharpi.testing.reference import NumpyReference
from tiny_gguf import GRANITE_SCALES, MOE_ARCHS, write_golden_moe, write_tiny_moe

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "moe_golden.json").read_text())
RTOL = 1e-4
FEATURE_MOVES = 1e-2


@pytest.fixture(scope="module")
def golden_logits():
    with np.load(DATA / "moe_golden.npz") as data:
        return {arch: data[arch] for arch in MOE_ARCHS}


@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny_moe(request, tmp_path_factory):
    """(arch, GGUF path, reference) of the golden data's tiny model, written again and checked byte for byte."""
    arch = request.param
    path = write_golden_moe(tmp_path_factory.mktemp(arch), arch)
    return arch, path, NumpyReference(path)


def _err(got, expected) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def test_reference_equals_llama_cpp(tiny_moe, golden_logits):
    arch, _, ref = tiny_moe
    assert _err(ref.forward(GOLDEN["ids"]), golden_logits[arch]) < RTOL


def test_router_choices_are_far_from_ties(tiny_moe):
    _, _, ref = tiny_moe
    ref.router_capture = []
    ref.forward(GOLDEN["ids"])
    k = ref.config.n_experts_used
    assert len(ref.router_capture) == ref.config.n_layers
    for probs in ref.router_capture:
        ranked = -np.sort(-probs, axis=-1)
        assert (ranked[:, k - 1] - ranked[:, k]).min() >= GOLDEN["min_gap"]
        np.testing.assert_allclose(probs.sum(-1), 1, rtol=1e-5)


def _variants(arch, ref):
    """(what is switched off, a copy of the reference without it)."""
    def with_config(**changes):
        other = copy.copy(ref)
        other.config = replace(ref.config, **changes)
        return other

    def with_attr(name, value):
        other = copy.copy(ref)
        setattr(other, name, value)
        return other

    yield "top-1 instead of top-2", with_config(n_experts_used=1)
    if arch == "olmoe":
        yield "per-head q/k norms", with_config(qk_norm_full=False)
    if arch == "qwen2moe":
        yield "no shared expert", with_config(shared_expert_ffn_dim=0)
        yield "renormalized weights", with_config(expert_weights_norm=True)
    if arch in ("qwen3moe", "granitemoe"):
        yield "weights not renormalized", with_config(expert_weights_norm=False)
    if arch == "granitemoe":
        yield "no embedding scale", with_attr("embed_scale", np.float32(1))
        yield "no attention scale", with_attr("attn_scale", None)
        yield "no residual scale", with_config(residual_scale=1.0)
        yield "no logit scale", with_config(logit_scale=1.0)


def test_each_feature_moves_the_logits(tiny_moe, golden_logits):
    arch, _, ref = tiny_moe
    for what, variant in _variants(arch, ref):
        assert _err(variant.forward(GOLDEN["ids"]), golden_logits[arch]) > FEATURE_MOVES, what


def test_config_of_each_architecture(tiny_moe):
    arch, _, ref = tiny_moe
    cfg = ref.config
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim) == (8, 2, 32)
    assert cfg.is_moe and cfg.expert_weights_norm == (arch in ("qwen3moe", "granitemoe"))
    assert cfg.shared_expert_ffn_dim == (48 if arch == "qwen2moe" else 0)
    assert (cfg.qk_norm, cfg.qk_norm_full) == {"olmoe": (True, True), "qwen3moe": (True, False)}.get(arch,
                                                                                              (False, False))
    assert cfg.rope_layout == ("norm" if arch == "granitemoe" else "neox")
    if arch == "granitemoe":
        assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logit_scale) == pytest.approx(
            tuple(GRANITE_SCALES[k] for k in ("embedding_scale", "attention.scale", "residual_scale",
                                              "logit_scale")))
    type(cfg).check_dict(cfg.to_dict())


def test_expert_counts_are_checked(tmp_path):
    """expert_used_count above expert_count is refused with the field's name, not an index error later."""
    import gguf
    path = write_tiny_moe(tmp_path / "bad.gguf", "qwen3moe")
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["qwen3moe.expert_used_count"].parts[-1][0] = 9        # of 8 experts
    with pytest.raises(GGUFError, match="n_experts_used"):
        NumpyReference(path)
