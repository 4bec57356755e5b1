"""Gemma 3 270M (Q4_K_M) compiled for the CPU: teacher-forced logits against the exact numpy reference and against
llama.cpp's golden data, greedy decode through the cache, and the sliding-window layers in the cache."""
import json
from pathlib import Path

import numpy as np
import pytest

import sharpi
from sharpi.testing.reference import log_softmax

DATA = Path(__file__).parent / "data" / "gemma3-270m-q4_k_m.json"


@pytest.fixture(scope="module")
def gemma3_golden():
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def gemma3_reference_logprobs(gemma3_reference, gemma3_golden):
    return log_softmax(gemma3_reference.forward(gemma3_golden["teacher_forced"]["ids"]))


def _next(lp, ids):
    return lp[np.arange(len(ids) - 1), ids[1:]]


def test_gemma3_config(gemma3):
    cfg = gemma3.config
    assert (cfg.arch, cfg.n_layers, cfg.head_dim, cfg.n_kv_heads, cfg.sliding_window) == ("gemma3", 18, 256, 1, 512)
    assert [l for l in range(cfg.n_layers) if not cfg.is_local(l)] == [5, 11, 17]
    assert gemma3.manifest.snapkv["enabled"]              # the global layers evict; see test_sliding_window.py


def test_gemma3_logits_match_reference_and_llama_cpp(gemma3, gemma3_golden, gemma3_reference_logprobs):
    tf = gemma3_golden["teacher_forced"]
    ids = tf["ids"]
    lp = log_softmax(gemma3.score(ids))
    ref = gemma3_reference_logprobs
    assert (lp.argmax(-1) == ref.argmax(-1)).mean() >= 0.995
    ppl, ref_ppl = np.exp(-_next(lp, ids).mean()), np.exp(-_next(ref, ids).mean())
    assert abs(ppl - ref_ppl) / ref_ppl <= 0.005, (ppl, ref_ppl)
    assert (lp.argmax(-1) == np.array([t[0] for t in tf["top5_ids"]])).mean() >= 0.95
    assert abs(ppl - tf["perplexity"]) / tf["perplexity"] <= 0.02, (ppl, tf["perplexity"])


def test_gemma3_greedy_through_the_cache(gemma3, gemma3_golden):
    g = gemma3_golden["greedy"][0]
    out = gemma3.generate(g["prompt_ids"], max_tokens=12)
    full = gemma3.score(g["prompt_ids"] + out.token_ids)          # the same tokens by full recomputation
    assert [int(t) for t in full[len(g["prompt_ids"]) - 1:-1].argmax(-1)] == out.token_ids
    assert g["output_text"].startswith(out.text)                  # and llama.cpp's continuation begins the same
