"""The numpy reference's hybrid linear-attention models (qwen35, qwen35moe, qwen3next: Gated DeltaNet layers beside
gated attention layers) against llama.cpp's logits on tiny random GGUFs (tests/data/make_hybrid_golden.py made them
once with llama-cpp-python 0.3.36; tests/data/README.md), and the frontend's reading of their configs.

Tolerance: both sides compute in float32 and differ in summation order only (at most 1.8e-5 of the logits' scale
when the data was made: llama.cpp's delta rule sums its dot products in another order), so 1e-4 of the scale is
~5x that margin; every part the hybrids add moves the logits by at least 1e-2 of the scale
(test_each_part_moves_the_logits), so the comparison can fail."""
import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sharpi.common.config import ModelConfig
from sharpi.common.errors import GGUFError, SharpiError, UnsupportedArchitectureError
from sharpi.common.schema import SchemaError
from sharpi.frontend.config import config_from_gguf
from sharpi.frontend.gguf_file import GGUFFile
from sharpi.testing.reference import NumpyReference, ReferenceSession
from tiny_gguf import HYBRID_ARCHS, write_golden_hybrid, write_tiny_hybrid

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "hybrid_golden.json").read_text())
RTOL = 1e-4
FEATURE_MOVES = 1e-2


@pytest.fixture(scope="module")
def golden_logits():
    with np.load(DATA / "hybrid_golden.npz") as data:
        return {arch: data[arch] for arch in HYBRID_ARCHS}


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def tiny_hybrid(request, tmp_path_factory):
    """(arch, GGUF path, reference) of the golden data's tiny model, written again and checked byte for byte."""
    arch = request.param
    path = write_golden_hybrid(tmp_path_factory.mktemp(arch), arch)
    return arch, path, NumpyReference(path)


def _err(got, expected) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def test_reference_equals_llama_cpp(tiny_hybrid, golden_logits):
    arch, _, ref = tiny_hybrid
    assert _err(ref.forward(GOLDEN["ids"]), golden_logits[arch]) < RTOL


def test_router_choices_are_far_from_ties(tiny_hybrid):
    _, _, ref = tiny_hybrid
    ref.router_capture = []
    ref.forward(GOLDEN["ids"])
    if not ref.config.is_moe:                       # qwen35's FFN is dense
        assert ref.router_capture == []
        return
    k = ref.config.n_experts_used
    assert len(ref.router_capture) == ref.config.n_layers
    for probs in ref.router_capture:
        ranked = -np.sort(-probs, axis=-1)
        assert (ranked[:, k - 1] - ranked[:, k]).min() >= GOLDEN["min_gap"]


def _without(ref, part):
    other = copy.copy(ref)
    other.left_out = frozenset({part})
    return other


@pytest.mark.parametrize("part", ["q_gate", "conv", "decay", "head_map"])
def test_each_part_moves_the_logits(tiny_hybrid, part):
    _, _, ref = tiny_hybrid
    ids = GOLDEN["ids"]
    assert _err(_without(ref, part).forward(ids), ref.forward(ids)) > FEATURE_MOVES


def test_partial_rope_moves_the_logits(tiny_hybrid):
    """RoPE over rope.dimension_count, a quarter of each head, not the whole head."""
    _, _, ref = tiny_hybrid
    other = copy.copy(ref)
    other.config = replace(ref.config, rope_dim=0)
    assert _err(other.forward(GOLDEN["ids"]), ref.forward(GOLDEN["ids"])) > FEATURE_MOVES


def test_feeding_in_pieces_equals_one_forward(tiny_hybrid):
    """The state carried from call to call: prefill 30, then 10 single tokens, equals a forward of all 40; and a
    copied session (a fork) goes on exactly as its parent."""
    _, _, ref = tiny_hybrid
    ids = GOLDEN["ids"][:40]
    whole = ref.forward(ids)
    session = ReferenceSession(ref)
    rows = [session.feed(ids[:30])]
    fork = copy.deepcopy(session)
    rows += [session.feed([t]) for t in ids[30:]]
    np.testing.assert_allclose(np.concatenate(rows), whole, rtol=0, atol=1e-5 * np.abs(whole).max())
    np.testing.assert_array_equal(np.concatenate([fork.feed([t]) for t in ids[30:]]), np.concatenate(rows[1:]))


def test_compaction_leaves_the_state(tiny_hybrid):
    """decode_after_compaction keeps every DeltaNet state: keeping all slots changes nothing; keeping few changes
    the logits (so the attention layers' eviction is modelled) without touching the recurrent layers."""
    _, _, ref = tiny_hybrid
    cfg, ids = ref.config, GOLDEN["ids"][:32]
    full = ref.forward(ids + [7])[-1]
    everything = [np.tile(np.arange(len(ids)), (cfg.n_kv_heads, 1)) for _ in cfg.attention_layers]
    np.testing.assert_allclose(ref.decode_after_compaction(ids, everything, 7), full, rtol=0,
                               atol=1e-5 * np.abs(full).max())
    few = [np.tile(np.arange(len(ids) - 4, len(ids)), (cfg.n_kv_heads, 1)) for _ in cfg.attention_layers]
    assert _err(ref.decode_after_compaction(ids, few, 7), full) > FEATURE_MOVES


def test_config_reads_the_layers(tiny_hybrid):
    arch, path, ref = tiny_hybrid
    cfg = ref.config
    assert cfg.n_layers == 4 and cfg.n_mtp_layers == 1            # block_count 5: one MTP block, not run
    assert cfg.recurrent_layers == ((0, 1, 2) if arch == "qwen3next" else (0, 2))
    assert cfg.attention_layers == ([3] if arch == "qwen3next" else [1, 3])
    assert (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state_size, cfg.ssm_conv_kernel) == (2, 4, 16, 4)
    assert cfg.ssm_head_map == ("grouped" if arch == "qwen3next" else "tiled")
    assert cfg.rope_dim == 8 and cfg.attn_q_gate and cfg.is_hybrid
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg      # the manifest's round trip


def test_recurrent_layers_array_overrides_the_interval(tmp_path):
    """attention.recurrent_layers (one flag per block, MTP blocks included) wins over full_attention_interval's
    default of 4, which would make layer 1 recurrent too."""
    reader = GGUFFile(write_tiny_hybrid(tmp_path / "a.gguf", "qwen35", interval=2))
    del reader.metadata["qwen35.full_attention_interval"]
    reader.metadata["qwen35.attention.recurrent_layers"] = [True, False, True, False, False]
    assert config_from_gguf(reader).recurrent_layers == (0, 2)
    reader.metadata["qwen35.attention.recurrent_layers"] = [True, False]
    with pytest.raises(GGUFError, match="recurrent_layers"):
        config_from_gguf(reader)


@pytest.mark.parametrize("sections", [[1, 1, 1, 1], [4, 0, 0, 0]])
def test_rope_sections_that_leave_pairs_unturned_are_refused(tmp_path, sections):
    reader = GGUFFile(write_tiny_hybrid(tmp_path / "a.gguf", "qwen35"))
    reader.metadata["qwen35.rope.dimension_sections"] = sections
    with pytest.raises(UnsupportedArchitectureError, match="dimension_sections"):
        config_from_gguf(reader)


@pytest.mark.parametrize("key, value", [("ssm.group_count", 3), ("ssm.conv_kernel", 1), ("ssm.state_size", 0),
                                        ("ssm.inner_size", 100), ("nextn_predict_layers", 5)])
def test_bad_ssm_sizes_are_refused(tmp_path, key, value):
    """Sizes the DeltaNet kernels cannot run: one sentence naming the field, no crash."""
    reader = GGUFFile(write_tiny_hybrid(tmp_path / "a.gguf", "qwen35"))
    reader.metadata[f"qwen35.{key}"] = value
    with pytest.raises(SharpiError, match=key.split(".")[-1] if key != "ssm.inner_size" else "inner_size"):
        config_from_gguf(reader)
    bad = ModelConfig.from_dict({**config_from_gguf(GGUFFile(tmp_path / "a.gguf")).to_dict(), "ssm_conv_kernel": 1})
    with pytest.raises(SchemaError, match="ssm_conv_kernel"):
        ModelConfig.check_dict(bad.to_dict())
