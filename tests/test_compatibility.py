"""Artifacts outlive the code that compiled them: an artifact compiled before the pipeline, target and backend
consolidation (tests/data/pre-consolidation, see tests/data/README.md) loads and gives the logits it gave then, bit
for bit, and compiling the same GGUF the same way today gives them too."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import sharpi

DATA = Path(__file__).parent / "data" / "pre-consolidation"
IDS = [1, 2, 3, 50, 100, 200, 256, 7]


def _logits(model) -> np.ndarray:
    scored = model.score(IDS)
    with model.session(snapkv_budget=0) as s:
        last = s.prefill(IDS)
        step = s.decode(int(np.argmax(last)))
    return np.concatenate([scored, step[None]])


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    return np.load(DATA / "logits.npy")


def test_an_artifact_compiled_before_loads_and_gives_the_same_logits(expected):
    model = sharpi.load(DATA / "artifact", threads=2)
    assert model.manifest.target["mcpu"] == "x86-64-v3"
    np.testing.assert_array_equal(_logits(model), expected)


def test_compiling_the_same_gguf_the_same_way_gives_the_same_logits(expected, tmp_path):
    art = sharpi.compile(str(DATA / "tiny.gguf"), output=tmp_path / "again", mcpu="x86-64-v3")
    np.testing.assert_array_equal(_logits(sharpi.load(art, threads=2)), expected)
