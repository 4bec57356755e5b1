"""SmolLM2 compiled with the default decode matmuls on an AVX2 CPU, int8 (decode multiplies int8-quantized
activations, quant_gemv_int8): the kernels are in the artifact, the conformance checks pass at its decode tolerance, its decode log-probs stay
close to the float artifact's (and are not identical: the int8 path really runs), and bad combinations are
refused before any work."""
import numpy as np
import pytest

import sharpi
from sharpi.codegen.llvm import int8_dot_available, make_target
from sharpi.common.errors import ConfigError
from sharpi.testing import conformance
from sharpi.testing.reference import log_softmax

pytestmark = pytest.mark.skipif(not int8_dot_available(make_target(None)), reason="int8 decode needs x86 AVX2")


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_gguf, tmp_path_factory):
    return sharpi.load(sharpi.compile(str(smollm2_gguf), output=tmp_path_factory.mktemp("i8") / "smollm2"))


def test_artifact_records_and_uses_int8_decode(smollm2_int8, smollm2):
    assert smollm2_int8.manifest.target["decode_matmuls"] == "int8"
    assert smollm2.manifest.target["decode_matmuls"] == "float"
    assert any(k.startswith("gemv_int8_q4_1") for k in smollm2_int8.manifest.kernels)
    assert not any(k.startswith("gemv_int8") for k in smollm2.manifest.kernels)
    tol = conformance.tolerance_for(smollm2_int8.manifest)
    assert tol.logprob_atol == conformance.tolerance_for(smollm2.manifest).logprob_atol   # prefill: unchanged
    assert tol.for_decode().logprob_atol == conformance.INT8_DECODE[0]


def test_conformance_decode_checks_pass(smollm2_int8, smollm2_gguf):
    ids = smollm2_int8.tokenize(conformance.DEFAULT_PROMPT)
    conformance.check_greedy_kv_cache(smollm2_int8, ids)
    conformance.check_snapkv_decode_after_compaction(smollm2_int8, conformance.make_reference("numpy", smollm2_gguf),
                                                     ids)


def _forced_decode_logprobs(model, prompt, tokens):
    with model.session(snapkv_budget=0) as s:
        rows = [s.prefill(prompt)] + [s.decode(t) for t in tokens[:-1]]
    return log_softmax(np.stack(rows))


def test_decode_close_to_the_float_artifact(smollm2_int8, smollm2, golden):
    g = golden["greedy"][0]
    tokens = smollm2.generate(g["prompt_ids"], max_tokens=16).token_ids
    exact = _forced_decode_logprobs(smollm2, g["prompt_ids"], tokens)
    got = _forced_decode_logprobs(smollm2_int8, g["prompt_ids"], tokens)
    np.testing.assert_allclose(got[0], exact[0], atol=1e-3)          # the prefill row: float matmuls in both
    top = np.argsort(exact, axis=-1)[:, -20:]
    diff = np.abs(np.take_along_axis(got - exact, top, axis=-1))[1:]
    assert diff.max() <= 0.75, diff.max()                            # measured 0.42 (int8 activations)
    assert diff.max() >= 1e-3                                        # not the float kernels (they agree to 1e-5)
    gaps = exact.max(-1) - exact[np.arange(len(tokens)), got.argmax(-1)]
    assert (gaps <= conformance.INT8_DECODE[1]).all()                 # int8's greedy choice: best or near-tie


def test_int8_decode_refused_where_it_cannot_run(smollm2_gguf, tmp_path):
    with pytest.raises(ConfigError, match="llvm target only"):
        sharpi.compile(str(smollm2_gguf), target="vulkan", output=tmp_path / "vk", decode_matmuls="int8")
    with pytest.raises(ConfigError, match="needs x86 AVX2"):
        sharpi.compile(str(smollm2_gguf), output=tmp_path / "old", mcpu="x86-64", decode_matmuls="int8")
    with pytest.raises(ConfigError, match="must be one of"):
        sharpi.compile(str(smollm2_gguf), output=tmp_path / "bad", decode_matmuls="int4")
    assert not any(tmp_path.iterdir())                               # refused before writing anything
