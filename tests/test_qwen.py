"""Qwen2.5-Coder-0.5B-Instruct Q4_K_M, a real qwen2 GGUF (q/k/v biases, an untied output, a 32k context, Q5_0 /
Q8_0 / Q4_K / Q6_K weights), against llama.cpp's golden data (tests/data/qwen2.5-coder-0.5b-instruct-q4_k_m.json,
see tests/data/README.md): the tokenizer gives llama.cpp's ids on every golden string; with the default arithmetic
(int8 matmuls, f16 KV, as llama.cpp's) the teacher-forced top-1 agrees at >= 96% of the golden text's positions and
the perplexity is within 1% of llama.cpp's. One compile, to keep CI short; the exact float path against the numpy
reference is the conformance suite's (`sharpi-compile qwen2.5-coder-0.5b --matmuls float --check`: 7 of 7 passed,
teacher-forced max |d log-prob| 5.0e-05 <= 1e-3 on 2026-12-01), as tiny qwen2 models are in CI
(tests/test_architectures.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi.testing.reference import log_softmax

DATA = Path(__file__).parent / "data" / "qwen2.5-coder-0.5b-instruct-q4_k_m.json"


@pytest.fixture(scope="module")
def golden():
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    from sharpi.frontend.fetch import fetch
    return fetch("qwen2.5-coder-0.5b", show_progress=False)


@pytest.fixture(scope="module")
def qwen(qwen_gguf, tmp_path_factory):
    return sharpi.load(sharpi.compile(str(qwen_gguf), output=tmp_path_factory.mktemp("qwen") / "qwen"))


def test_it_is_a_qwen2_with_biases_and_an_untied_output(qwen):
    cfg = qwen.config
    assert (cfg.arch, cfg.qkv_bias, cfg.tied_embeddings, cfg.rope_layout) == ("qwen2", True, False, "neox")
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (24, 14, 2, 64, 151936)
    assert qwen.manifest.target["matmuls"] == "int8" and qwen.manifest.kv_dtype == "float16"    # the default


def test_tokenizer_equals_llama_cpp(qwen, golden):
    for case in golden["tokenize"]:
        assert qwen.tokenize(case["text"], add_bos=False, special=True) == case["ids"], case["text"]
        assert qwen.detokenize(case["ids"]) == case["text"]


def test_teacher_forced_top1_and_perplexity_match_llama_cpp(qwen, golden):
    forced = golden["teacher_forced"]
    ids = forced["ids"]
    logp = log_softmax(qwen.score(ids))
    top1 = np.mean(logp.argmax(-1) == np.array(forced["top5_ids"])[:, 0])
    perplexity = float(np.exp(-np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)])))
    assert top1 >= 0.96, top1
    assert abs(perplexity / forced["perplexity"] - 1) <= 0.01, (perplexity, forced["perplexity"])

