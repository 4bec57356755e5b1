"""A prefill fed in chunks whose size changes between steps (PrefillJob.chunk), and the server's prefill budget in
cost (ServeSettings.prefill_share): while sequences decode, a step computes only the prompt tokens that take about
prefill_share decode steps, so a long prompt's admission slows running streams by a bounded factor."""
from __future__ import annotations

import time

import numpy as np
import pytest

import sharpi
from sharpi.common.errors import ConfigError
from sharpi.runtime.sampling import SamplingParams
from sharpi.serve.engine import MIN_PREFILL, ServeEngine, ServeSettings
from sharpi.serve.request import GenerationRequest


@pytest.fixture(scope="module")
def tiny(tiny_artifact):
    return sharpi.load(tiny_artifact)


@pytest.mark.parametrize("budget", [0, 48])
def test_chunks_of_changing_size_give_the_same_prefill(tiny, budget):
    """Logits, held lengths and kept positions (a scored, evicted prompt: its last chunk still holds the window)
    are those of the default chunking, whatever sizes the steps take."""
    ids = np.random.default_rng(0).integers(0, tiny.config.vocab_size, 150)
    knobs = dict(snapkv_budget=budget, snapkv_window=16, snapkv_recency=8)
    with tiny.session(**knobs) as whole, tiny.session(**knobs) as pieces:
        want = whole.prefill(ids)
        job = pieces.start_prefill(ids)
        fed = []
        for size in (7, 30, 1, 64, 5, 200):
            if job.done:
                break
            job.chunk = size
            fed.append(job.next_tokens)
            job.step()
        while not job.done:
            job.step()
        assert sum(fed) <= len(ids) and fed[:3] == [7, 30, 1]
        np.testing.assert_allclose(job.logits, want, rtol=1e-4, atol=1e-4)
        assert pieces.kv_length == whole.kv_length
        for a, b in zip(pieces.kept_positions, whole.kept_positions):
            np.testing.assert_array_equal(a, b)


def test_prefill_limit_follows_the_measured_costs(tiny):
    """With a sequence decoding, a step's prompt tokens are prefill_share decode steps' worth at the measured
    per-token cost, within [MIN_PREFILL, the token budget]; with none decoding, the token budget."""
    engine = ServeEngine(tiny, ServeSettings(prefill_share=2.0, prefill_budget=128)).start()
    try:
        assert engine._prefill_limit() == 128
        handle = engine.submit(GenerationRequest(tiny.tokenize("abc abc abc"), max_tokens=10_000,
                                                 sampling=SamplingParams(), ignore_eos=True), lambda e: None)
        deadline = time.monotonic() + 60
        while not any(s.pending is not None and not s.jobs for s in engine._active) and time.monotonic() < deadline:
            time.sleep(0.01)
        engine._decode_step_s, engine._prefill_token_s = 0.1, 0.004      # as if measured
        assert engine._prefill_limit() == 50
        engine._prefill_token_s = 0.1
        assert engine._prefill_limit() == MIN_PREFILL
        engine._prefill_token_s = 1e-5
        assert engine._prefill_limit() == 128
        handle.cancel()
    finally:
        engine.shutdown(cancel=True, timeout=30)
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(ConfigError, match="prefill_share"):
            ServeSettings(prefill_share=bad).validate()
