"""Shared fixtures: the real SmolLM2 model (fetched once into $SHARPI_HOME by the project's own fetch), one compiled
llvm artifact per test session (the compile cache makes reruns fast), and the numpy reference."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def golden():
    return json.loads((DATA / "smollm2-135m-instruct-q4_1.json").read_text())


@pytest.fixture(scope="session")
def smollm2_gguf():
    from sharpi.frontend.fetch import fetch
    return fetch("smollm2-135m", show_progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf():
    from sharpi.frontend.fetch import fetch
    return fetch("gemma3-270m", show_progress=False)


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2_gguf, tmp_path_factory):
    """SmolLM2 for this CPU with float32 matmuls: the tests that hold prefill, the KV cache, SnapKV and decode to
    the exact numpy reference need them; the default int8 matmuls are tested in test_int8_matmuls.py."""
    import sharpi
    return sharpi.compile(str(smollm2_gguf), target="llvm", output=tmp_path_factory.mktemp("art") / "smollm2",
                          matmuls="float")


@pytest.fixture(scope="session")
def smollm2_vulkan_artifact(smollm2_gguf, tmp_path_factory):
    """SmolLM2 compiled for Vulkan, once per session (test_vulkan_model.py, test_conformance_plugin.py)."""
    import sharpi
    return sharpi.compile(str(smollm2_gguf), target="vulkan", output=tmp_path_factory.mktemp("vk") / "smollm2")


@pytest.fixture(scope="session")
def smollm2_cuda_artifact(smollm2_gguf, tmp_path_factory):
    """SmolLM2 compiled for cuda (sm_80; nvcc, no GPU), once per session (test_cuda_build.py, test_step_count.py)."""
    import sharpi
    return sharpi.compile(str(smollm2_gguf), target="cuda", output=tmp_path_factory.mktemp("cuda") / "smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_artifact):
    import sharpi
    return sharpi.load(smollm2_artifact)


@pytest.fixture(scope="session")
def reference(smollm2_gguf):
    from sharpi.testing.reference import NumpyReference
    return NumpyReference(smollm2_gguf)


@pytest.fixture(scope="session")
def reference_logprobs(reference, golden):
    from sharpi.testing.reference import log_softmax
    return log_softmax(reference.forward(golden["teacher_forced"]["ids"]))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 2-layer llama with random weights (tests/tiny_gguf.py): for tests of the artifact's life, not numerics."""
    from tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_artifact(tiny_gguf, tmp_path_factory) -> Path:
    import sharpi
    return sharpi.compile(str(tiny_gguf), output=tmp_path_factory.mktemp("art") / "tiny")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def gemma3(gemma3_gguf, tmp_path_factory):
    """Gemma 3 270M compiled for this CPU (SnapKV ops included, float32 matmuls as smollm2_artifact),
    once per test session."""
    import sharpi
    return sharpi.load(sharpi.compile(str(gemma3_gguf), output=tmp_path_factory.mktemp("g3") / "gemma3",
                                      matmuls="float"))


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_gguf):
    """The exact float32 numpy reference of Gemma 3 (opening and dequantizing the GGUF takes ~20 s: once)."""
    from sharpi.testing.reference import NumpyReference
    return NumpyReference(gemma3_gguf)
