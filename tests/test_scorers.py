"""Scorers beside SnapKV's (sharpi.runtime.scorers): KVzip's and the probe's keep sets against the numpy forward
pass, on a tiny model on llvm and Vulkan (lavapipe) and on SmolLM2; the reconstruction pass leaves the session as
a plain prefill leaves it; bad values are one ConfigError."""
from __future__ import annotations

import numpy as np
import pytest

import sharpi
from sharpi.common.errors import ConfigError
from sharpi.common.snapkv_settings import SnapKVSettings
from sharpi.runtime.scorers import ANCHOR, CONTINUE_PROMPT, REPEAT_PROMPT
from sharpi.testing.reference import NumpyReference
from sharpi.testing.snapkv import (hybrid_reference, keydiff_reference, kvzip_reference, probe_reference,
                                   select_reference)
from vulkan_device import on_vulkan


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    budget = a.shape[-1]
    return float(np.mean([len(np.intersect1d(x, y)) / budget for x, y in zip(a.reshape(-1, budget),
                                                                              b.reshape(-1, budget))]))


def _check_keep_sets(model, reference, ids, budget, recency, scorer="kvzip"):
    with model.session(compress=scorer, snapkv_budget=budget, snapkv_recency=recency) as s:
        s.prefill(ids)
        assert s.evicted and max(s.kv_length) == budget
        kept = np.stack([k for l, k in enumerate(s.kept_positions) if not model.config.is_local(l)])
        used = s.scorer
    scale = model.config.head_dim ** -0.5
    if scorer == "kvzip":
        assert used.reduce_max                     # a fresh compile's score op takes the maximum
        again = model.tokenize(CONTINUE_PROMPT, add_bos=False)
        prompt_for = lambda start: (model.tokenize(REPEAT_PROMPT, add_bos=False) if start == 0 else
                                    again + list(ids[max(0, start - ANCHOR):start]))
        assert [used.prompt_for(np.asarray(ids), s) for s in (0, used.chunk)] == [prompt_for(0), prompt_for(used.chunk)]
        scores = kvzip_reference(reference, ids, prompt_for, used.chunk, scale)
    elif scorer == "keydiff":
        scores = keydiff_reference(reference, ids)
    elif scorer == "hybrid":
        scores = hybrid_reference(reference, ids, used.probe.probe_ids, scale)
    else:
        scores = probe_reference(reference, ids, used.probe_ids, scale)
    globals_ = [l for l in range(model.config.n_layers) if not model.config.is_local(l)]
    expected = select_reference(scores[globals_], budget, recency, "max", SnapKVSettings().kernel, "kv-head")
    print(f"{scorer} keep sets vs the numpy reference: overlap {_overlap(kept, expected):.4f}")
    assert _overlap(kept, expected) >= 0.99


@pytest.mark.parametrize("scorer", ["kvzip", "probe", "keydiff", "hybrid"])
def test_keep_sets_on_smollm2(smollm2, reference, scorer):
    rng = np.random.default_rng(0)
    words = "red green blue cyan magenta yellow black white grey brown".split()
    ids = smollm2.tokenize(" ".join(rng.choice(words, 300)))[:200]
    _check_keep_sets(smollm2, reference, ids, budget=64, recency=8, scorer=scorer)


def test_keep_sets_on_a_tiny_model_on_llvm_and_vulkan(tiny_gguf, tmp_path):
    reference = NumpyReference(tiny_gguf)
    ids = np.random.default_rng(1).integers(1, 200, 110).tolist()    # room for a kvzip chunk and its prompt in 256
    for target in ("llvm", "vulkan"):
        art = sharpi.compile(str(tiny_gguf), target=target, output=tmp_path / target, matmuls="float") \
            if target == "llvm" else sharpi.compile(str(tiny_gguf), target=target, output=tmp_path / target)
        model = on_vulkan(lambda: sharpi.load(art)) if target == "vulkan" else sharpi.load(art)
        for scorer in ("kvzip", "probe", "keydiff"):
            _check_keep_sets(model, reference, ids, budget=48, recency=4, scorer=scorer)


def test_the_reconstruction_leaves_the_session_as_a_plain_prefill(smollm2):
    ids = smollm2.tokenize("The archive keeps letters from every harbour town. " * 12)
    pool = smollm2.engine.pool
    with smollm2.session(snapkv_budget=0) as plain:
        want = plain.prefill(ids)
        used = pool.used_count
        with smollm2.session(compress="kvzip", snapkv_budget=0) as s:
            got = s.prefill(ids, keep_scores=True)                     # scored, not evicted
            assert pool.used_count == 2 * used                        # the forks gave their pages back
            assert not s.evicted and s.kv_length == plain.kv_length and s.logical_length == len(ids)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.stack(s.kept_positions), np.stack(plain.kept_positions))
            with s.fork() as f:                                       # the KVzip scores then evict at any budget
                assert f.evict(48, recency=8) and max(f.kv_length) == 48
            np.testing.assert_array_equal(s.decode(ids[0]), plain.decode(ids[0]))


def test_bad_compress_values_are_config_errors(smollm2, monkeypatch):
    for value in ("zip", 3, ""):
        with pytest.raises(ConfigError, match="compress must be one of snapkv, kvzip, probe, keydiff, hybrid"):
            smollm2.session(compress=value)
    monkeypatch.setenv("SHARPI_COMPRESS", "nope")
    with pytest.raises(ConfigError, match="SHARPI_COMPRESS must be one of"):
        smollm2.session()
    monkeypatch.setenv("SHARPI_COMPRESS", "kvzip")
    assert smollm2.session().scorer.name == "kvzip"
    with pytest.raises(ConfigError, match="unknown|Unknown"):
        smollm2.generate("x", 1, compres="kvzip")


@pytest.mark.parametrize("scorer", ["kvzip", "probe", "keydiff"])
def test_rescore_ranks_as_a_session_of_that_scorer(smollm2, scorer):
    """One SnapKV-scored prefill ranked again on a fork by another scorer keeps what a session of that scorer
    keeps; the fork it was ranked on, and the prefill it came from, stay as they were."""
    ids = smollm2.tokenize("The archive keeps letters from every harbour town, numbered 4821. " * 10)
    with smollm2.session(compress=scorer, snapkv_budget=0) as own:
        own.prefill(ids, keep_scores=True)
        own.evict(64, recency=8)
        want = np.stack(own.kept_positions)
    with smollm2.session(snapkv_budget=0) as base:
        base.prefill(ids, keep_scores=True)
        with base.fork() as snap:
            snap.evict(64, recency=8)
            snapkv = np.stack(snap.kept_positions)
        with base.fork() as ranked:
            ranked.rescore(smollm2.scorer(scorer), ids)
            assert ranked.logical_length == len(ids) and not ranked.evicted
            with ranked.fork() as compressed:
                compressed.evict(64, recency=8)
                np.testing.assert_array_equal(np.stack(compressed.kept_positions), want)
        assert not np.array_equal(snapkv, want)                      # the scorers do differ
        with base.fork() as again:                                   # the base keeps SnapKV's scores
            again.evict(64, recency=8)
            np.testing.assert_array_equal(np.stack(again.kept_positions), snapkv)
        base.decode(ids[0])
        with pytest.raises(ConfigError, match="rescore\\(\\) needs a session right after"):
            base.rescore(smollm2.scorer(scorer), ids)                 # fed since the prefill
