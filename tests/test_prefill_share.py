"""A prefill fed in chunks whose size changes between steps (PrefillJob.chunk), and the server's prefill budget in
cost (ServeSettings.prefill_share): while sequences decode, a step computes only the prompt tokens that take about
prefill_share decode steps, so a long prompt's admission slows running streams by a bounded factor."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

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


@pytest.fixture(scope="module")
def tiny_float(tiny_gguf, tmp_path_factory):
    """The float path: a batched step's tokens equal a lone decode's (int8's GEMM and GEMV sum in other orders)."""
    return sharpi.load(sharpi.compile(str(tiny_gguf), output=tmp_path_factory.mktemp("f") / "a", matmuls="float"))


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
    """For a prompt longer than the token budget while fewer requests wait than sequences decode, a step's
    prompt tokens are prefill_share decode steps' worth at the measured cost (a line through the chunks' times:
    a fixed part and a part a token), within [MIN_PREFILL, the token budget]; otherwise (none decoding, a short
    prompt, or a burst waiting), the token budget. (The engine's scheduler is not started: the measurements are
    set as if taken.)"""
    engine = ServeEngine(tiny, ServeSettings(prefill_share=2.0, prefill_budget=128))
    long = SimpleNamespace(jobs=[("prompt", None, list(range(300)))])   # a prompt longer than the budget
    engine._decode_step_s = 0.1
    engine._prefill_chunks.extend([(100, 0.3), (100, 0.3)])              # one length: 3 ms a token
    assert engine._prefill_limit(long) == 128                             # nothing decoding
    engine._active.append(SimpleNamespace(pending=5, jobs=[]))            # a sequence waiting for its next token
    engine._active.append(SimpleNamespace(pending=6, jobs=[]))
    assert engine._prefill_limit(long) == 66                              # 2 x 0.1 / 0.003
    engine._prefill_chunks.extend([(20, 0.1), (60, 0.2)])                 # a line: 50 ms + 2.5 ms a token
    assert engine._prefill_cost() == pytest.approx((0.05, 0.0025))
    assert engine._prefill_limit(long) in (59, 60)                        # (2 x 0.1 - 0.05) / 0.0025
    engine._prefill_chunks.extend([(16, 1.0), (17, 1.0)])
    assert engine._prefill_limit(long) == MIN_PREFILL
    engine._prefill_chunks.clear()
    engine._prefill_chunks.append((100, 1e-4))
    assert engine._prefill_limit(long) == 128
    engine._prefill_chunks.clear()
    engine._prefill_chunks.append((20, 1e-4))                             # cheap, but only 20 tokens seen
    assert engine._prefill_limit(long) == 40
    engine._prefill_chunks.clear()
    engine._prefill_chunks.extend([(20, 0.1), (60, 0.2)])
    assert engine._share(long) == 2.0 and engine._prefill_limit(long) in (59, 60)     # the fit's rounding
    short = SimpleNamespace(jobs=[("prompt", None, list(range(100)))])
    assert engine._share(short) is None and engine._prefill_limit(short) == 128   # a chunk: at full speed
    engine._waiting.extend([SimpleNamespace(), SimpleNamespace()])      # as many waiting as decoding: a burst
    assert engine._share(long) is None and engine._prefill_limit(long) == 128
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(ConfigError, match="prefill_share"):
            ServeSettings(prefill_share=bad).validate()


def test_a_long_prompt_beside_decoding_streams_is_shared_and_right(tiny_float):
    """Two streams decode while a prompt longer than the token budget arrives: its prefill is shared (a step
    gives it prefill_share decode steps, its plain chunks in the decode step's own call), and its answer and
    the streams' are their solo answers."""
    from sharpi.serve.engine import generate

    def request(ids, n, eos=False):
        return GenerationRequest(list(ids), max_tokens=n, sampling=SamplingParams(), ignore_eos=eos)

    rng = np.random.default_rng(3)
    streams = [rng.integers(0, tiny_float.config.vocab_size, 8).tolist() for _ in range(2)]
    long = rng.integers(0, tiny_float.config.vocab_size, 150).tolist()
    solo_engine = ServeEngine(tiny_float, ServeSettings(prefill_budget=32)).start()
    try:
        solo = [generate(solo_engine, request(ids, n, eos))[0] for ids, n, eos in
                [(streams[0], 90, True), (streams[1], 90, True), (long, 8, False)]]
    finally:
        solo_engine.shutdown(cancel=True, timeout=30)
    engine = ServeEngine(tiny_float, ServeSettings(prefill_budget=32, prefill_share=0.5)).start()
    texts, done = [[], []], [threading.Event(), threading.Event()]

    def on_event(i):
        def record(event):
            texts[i].append(event.text)
            if event.kind == "finish":
                done[i].set()
        return record

    try:
        for i, ids in enumerate(streams):
            engine.submit(request(ids, 90, True), on_event(i))
        deadline = time.monotonic() + 60
        while min(len(t) for t in texts) < 4 and time.monotonic() < deadline:
            time.sleep(0.002)
        answer, finish, _ = generate(engine, request(long, 8))
        assert all(d.wait(60) for d in done)
    finally:
        engine.shutdown(cancel=True, timeout=60)
    assert engine.fatal is None and finish.finish_reason == "length"
    assert engine._mixed_token_s is not None                   # a chunk went with a decode step
    assert answer == solo[2] and ["".join(t) for t in texts] == solo[:2]
