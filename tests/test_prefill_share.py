"""A prefill fed in chunks whose size changes between steps (PrefillJob.chunk), and the server's prefill budget in
cost (ServeSettings.prefill_share): while sequences decode, a step computes only the prompt tokens that take about
prefill_share decode steps, so a long prompt's admission slows running streams by a bounded factor."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import sharpi
from sharpi.common.errors import ConfigError
from sharpi.serve.engine import MIN_PREFILL, ServeEngine, ServeSettings


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
    """With a sequence decoding, a step's prompt tokens are `share` decode steps' worth at the measured cost (a
    line through the chunks' times: a fixed part and a part a token), within [MIN_PREFILL, the token budget];
    share is prefill_share, or the waiting requests per decoding one where more; with none decoding, the token
    budget. (The engine's scheduler is not started: the measurements are
    set as if taken.)"""
    engine = ServeEngine(tiny, ServeSettings(prefill_share=2.0, prefill_budget=128))
    engine._decode_step_s = 0.1
    engine._prefill_chunks.extend([(100, 0.3), (100, 0.3)])              # one length: 3 ms a token
    assert engine._prefill_limit() == 128                                 # nothing decoding
    engine._active.append(SimpleNamespace(pending=5, jobs=[]))            # a sequence waiting for its next token
    assert engine._prefill_limit() == 66                                  # 2 x 0.1 / 0.003
    engine._prefill_chunks.extend([(20, 0.1), (60, 0.2)])                 # a line: 50 ms + 2.5 ms a token
    assert engine._prefill_cost() == pytest.approx((0.05, 0.0025))
    assert engine._prefill_limit() == 60                                  # (2 x 0.1 - 0.05) / 0.0025
    engine._prefill_chunks.extend([(16, 1.0), (17, 1.0)])
    assert engine._prefill_limit() == MIN_PREFILL
    engine._prefill_chunks.clear()
    engine._prefill_chunks.append((100, 1e-4))
    assert engine._prefill_limit() == 128
    engine._prefill_chunks.clear()
    engine._prefill_chunks.append((20, 1e-4))                             # cheap, but only 20 tokens seen
    assert engine._prefill_limit() == 40
    engine._prefill_chunks.extend([(20, 0.1), (60, 0.2)])
    engine._waiting.extend([SimpleNamespace()] * 8)                     # 8 waiting, 1 decoding: share 8
    assert engine._share() == 8.0 and engine._prefill_limit() == 120      # 2x the longest chunk measured
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(ConfigError, match="prefill_share"):
            ServeSettings(prefill_share=bad).validate()
