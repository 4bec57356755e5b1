"""Sampling, streaming, stop strings, chat, threads, and the runtime running on the TVM runtime library alone."""
import os
import subprocess
import sys

import numpy as np
import pytest

import sharpi
from sharpi.runtime.sampling import Sampler, SamplingParams


def test_sampler_greedy_and_limits():
    logits = np.array([0.0, 3.0, 2.9, -1.0], np.float32)
    assert Sampler(SamplingParams())(logits, []) == 1
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))(logits, []) == 1
    assert Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=0))(logits, []) == 1
    assert Sampler(SamplingParams(temperature=1.0, min_p=0.99, seed=0))(logits, []) == 1
    # a repetition penalty pushes the seen token below its rival
    assert Sampler(SamplingParams(repeat_penalty=1.5))(logits, [1]) == 2


def test_sampler_seed_is_reproducible_and_follows_probabilities():
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float64))
    draws = [Sampler(SamplingParams(temperature=1.0, seed=s))(logits, []) for s in range(2000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.04)
    a = Sampler(SamplingParams(temperature=0.8, seed=7))
    b = Sampler(SamplingParams(temperature=0.8, seed=7))
    assert [a(logits, []) for _ in range(20)] == [b(logits, []) for _ in range(20)]


def test_stream_pieces_add_up_to_generate(smollm2):
    prompt = "Once upon a time, in a small village by the sea,"
    stream = smollm2.stream(prompt, 20)
    pieces = list(stream)
    result = smollm2.generate(prompt, max_tokens=20)
    assert "".join(pieces) == result.text == stream.result.text
    assert result.token_ids == stream.result.token_ids and len(result.token_ids) == 20
    assert result.finish_reason == "length"
    assert result.stats["prompt_tokens"] == len(smollm2.tokenize(prompt))


def test_stop_string_cuts_the_text(smollm2):
    full = smollm2.generate("The capital of France is", max_tokens=12)
    word = full.text.strip().split()[0]            # e.g. "Paris."
    stopped = smollm2.generate("The capital of France is", max_tokens=12, stop=[word[-2:]])
    assert stopped.finish_reason == "stop"
    assert word[-2:] not in stopped.text and full.text.startswith(stopped.text)


def test_chat_uses_the_template_and_stops_at_end_of_turn(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=48)
    assert out.finish_reason in ("stop", "length")
    assert "<|im_end|>" not in out.text and out.text.strip()
    with pytest.raises(sharpi.ConfigError):
        smollm2.chat([{"role": "user"}])


def test_runtime_needs_only_the_tvm_runtime_library(smollm2_artifact):
    code = ("import sys, sharpi; m = sharpi.load(sys.argv[1], threads=1); "
            "print(m.generate('The capital of France is', max_tokens=4).token_ids); "
            "assert 'tvm.relax' not in sys.modules and 'sharpi.compiler' not in sys.modules")
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    done = subprocess.run([sys.executable, "-c", code, str(smollm2_artifact)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("[")
