"""decode_batch (one new token for each of B sequences in one call) against B separate decode calls: the same
logits within the path's tolerance, for B in {1, 3, 8}, sequences of different lengths, one evicted by SnapKV,
and sliding-window layers past their window; tiny models on llvm and Vulkan (lavapipe), SmolLM2 on llvm."""
from __future__ import annotations

import numpy as np
import pytest

import sharpi
from sharpi.runtime.session import decode_batch
from tiny_gguf import write_tiny_llama
from vulkan_device import on_vulkan

LENGTHS = [5, 40, 17, 100, 64, 3, 33, 80]        # the 4th is evicted to 32 slots
EVICTED = 3


def _sessions(model, rng, lengths=LENGTHS, budget=32):
    sessions = []
    for i, n in enumerate(lengths):
        s = model.session(snapkv_budget=budget if i == EVICTED else 0, snapkv_window=8, snapkv_recency=4)
        s.prefill(rng.integers(1, model.config.vocab_size, n).tolist())
        sessions.append(s)
    return sessions


def _batch_logits(sessions, tokens) -> np.ndarray:
    """decode_batch's own logits, also for B = 1 (where decode_batch() would take decode)."""
    if len(sessions) > 1:
        return decode_batch(sessions, tokens)
    engine, cache = sessions[0]._engine, sessions[0]._cache
    cache.reserve(1)
    out = engine.backend.forward("decode_batch", np.array(tokens, np.int32), np.array([cache.logical_length],
                                 np.int32), cache.page_table()[None], cache.kv_lens()[None])
    cache.advance(1)
    return out


def _check(model, rng, atol, lengths=LENGTHS, budget=32):
    sessions = _sessions(model, rng, lengths, budget)
    if budget:
        assert sessions[EVICTED].evicted and max(sessions[EVICTED].kv_length) == budget
    tokens = rng.integers(1, model.config.vocab_size, len(sessions)).tolist()
    for b in (1, 3, len(sessions)):
        batch_sessions = [s.fork() for s in sessions[:b]]
        solo_sessions = [s.fork() for s in sessions[:b]]
        got = _batch_logits(batch_sessions, tokens[:b])
        want = np.stack([s.decode(t) for s, t in zip(solo_sessions, tokens[:b])])
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)
        assert [s.logical_length for s in batch_sessions] == [s.logical_length for s in solo_sessions]
        assert [s.kv_length for s in batch_sessions] == [s.kv_length for s in solo_sessions]
        # and a second step from there agrees too (the batch wrote each token into its own sequence's pages)
        nxt = [int(np.argmax(row)) for row in want]
        np.testing.assert_allclose(_batch_logits(batch_sessions, nxt),
                                   np.stack([s.decode(t) for s, t in zip(solo_sessions, nxt)]), atol=atol, rtol=0)
        for s in batch_sessions + solo_sessions:
            s.close()
    for s in sessions:
        s.close()
    assert model.engine.pool.free_count == model.engine.pool.num_pages


@pytest.fixture(scope="module")
def tiny_float(tiny_gguf, tmp_path_factory):
    return sharpi.load(sharpi.compile(str(tiny_gguf), output=tmp_path_factory.mktemp("db") / "tiny",
                                      matmuls="float"), pool_sequences=24)


def test_tiny_llama_exact_path(tiny_float):
    _check(tiny_float, np.random.default_rng(0), atol=1e-4)


def test_tiny_llama_int8_matmuls(tiny_artifact):
    """The default arithmetic: the batch's GEMM quantizes each row as the GEMV does."""
    _check(sharpi.load(tiny_artifact, pool_sequences=24), np.random.default_rng(1), atol=2e-2)


@pytest.fixture(scope="module")
def sliding_gguf(tmp_path_factory):
    """A mistral-style tiny llama: every layer attends within a 16-token window."""
    return write_tiny_llama(tmp_path_factory.mktemp("swa") / "swa.gguf", sliding_window=16)


def test_sliding_window_layers(sliding_gguf, tmp_path):
    model = sharpi.load(sharpi.compile(str(sliding_gguf), output=tmp_path / "swa", matmuls="float"),
                        pool_sequences=24)
    _check(model, np.random.default_rng(2), atol=1e-4, budget=0)      # all-local: SnapKV has nothing to evict


def test_on_vulkan(tiny_gguf, sliding_gguf, tmp_path):
    for name, gguf, budget in (("tiny", tiny_gguf, 32), ("swa", sliding_gguf, 0)):
        art = sharpi.compile(str(gguf), target="vulkan", output=tmp_path / name)
        model = on_vulkan(lambda: sharpi.load(art, pool_sequences=24))
        _check(model, np.random.default_rng(3), atol=2e-3, lengths=LENGTHS[:4], budget=budget)


def test_smollm2(smollm2):
    _check(smollm2, np.random.default_rng(4), atol=2e-3, lengths=[9, 130, 64], budget=0)
    sessions = _sessions(smollm2, np.random.default_rng(5), lengths=[40, 130, 70], budget=64)
    sessions = [sessions[0], sessions[1], sessions[2]]
    tokens = [11, 22, 33]
    solo = [s.fork() for s in sessions]
    np.testing.assert_allclose(decode_batch(sessions, tokens), np.stack([s.decode(t) for s, t in zip(solo, tokens)]),
                               atol=2e-3, rtol=0)
    for s in sessions + solo:
        s.close()


def test_refuses_mixed_models_and_repeats(tiny_float, tiny_artifact):
    other = sharpi.load(tiny_artifact)
    with tiny_float.session() as a, other.session() as b:
        a.prefill([1, 2])
        b.prefill([1, 2])
        with pytest.raises(sharpi.ConfigError, match="sessions of one model"):
            decode_batch([a, b], [3, 4])
        with pytest.raises(sharpi.ConfigError, match="each session once"):
            decode_batch([a, a], [3, 4])
        with pytest.raises(sharpi.ConfigError, match="Token ids must be in"):
            decode_batch([a], [10**6])
