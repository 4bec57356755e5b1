"""Many sessions on one model (issue #10): sessions may be driven from several threads (each forward holds the
model's lock: the VM and the page pool are not thread-safe, so forwards run one at a time, in any interleaving);
an exhausted page pool is a clear PoolExhaustedError (a ContextLengthError) that changes nothing, so the other
sessions go on exactly as before; closing a session gives every page back."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import sharpi
from sharpi.runtime.kv_cache import PoolExhaustedError

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colours are"]
DECODE_STEPS = 6


def _run(model, prompt: str, barrier: threading.Barrier | None = None) -> list[np.ndarray]:
    """Prefill, then greedy decode; every step's logits. With a barrier, every thread's forwards interleave."""
    ids = model.tokenize(prompt)
    out = []
    with model.session() as s:
        if barrier is not None:
            barrier.wait()
        out.append(s.prefill(ids))
        for _ in range(DECODE_STEPS):
            out.append(s.decode(int(out[-1].argmax())))
    return out


@pytest.fixture(scope="module")
def sequential(smollm2) -> list[list[np.ndarray]]:
    return [_run(smollm2, p) for p in PROMPTS]


def test_sessions_on_several_threads_match_sequential_runs(smollm2, sequential):
    barrier = threading.Barrier(len(PROMPTS))
    results: dict[int, list[np.ndarray]] = {}
    errors = []

    def worker(i):
        try:
            results[i] = _run(smollm2, PROMPTS[i], barrier)
        except BaseException as exc:          # reported below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i in range(len(PROMPTS)):
        for step, (got, want) in enumerate(zip(results[i], sequential[i])):
            np.testing.assert_array_equal(got, want, err_msg=f"prompt {i}, step {step}")
    assert smollm2.engine.pool.free_count == smollm2.engine.pool.num_pages


def test_tokenize_from_several_threads(smollm2):
    """Tokenizing without special-token parsing flips a flag on the shared tokenizer; threads must not see each
    other's setting."""
    text = "<|im_start|>user hi"
    plain, special = smollm2.tokenize(text), smollm2.tokenize(text, special=True)
    assert plain != special
    mismatches = []

    def worker(flag):
        for _ in range(200):
            if smollm2.tokenize(text, special=flag) != (special if flag else plain):
                mismatches.append(flag)

    threads = [threading.Thread(target=worker, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert mismatches == []


def _prompt(model) -> list[int]:
    """100 tokens: 7 pages a layer, 210 in all, the last one part full."""
    return model.tokenize("Once upon a time there was a cat. " * 20)[:100]


def _fill_with_forks(session, token: int) -> tuple[list, np.ndarray]:
    """Fork `session` and decode `token` in each fork until the pool runs out. A fork shares every page; its
    decode copies the shared, part-full last page of each layer (copy-on-write), so each fork costs n_layers
    pages. Returns the forks (the last one's decode was refused) and the first fork's logits."""
    pool = session._engine.pool
    forks, first = [], None
    with pytest.raises(PoolExhaustedError, match="KV page pool is exhausted") as info:
        for _ in range(pool.num_pages):                                   # bounded: each round takes pages
            forks.append(session.fork())
            logits = forks[-1].decode(token)
            first = logits if first is None else first
    assert isinstance(info.value, sharpi.ContextLengthError) and "\n" not in str(info.value)
    return forks, first


@pytest.fixture(scope="module")
def small_pool(smollm2_artifact):
    """SmolLM2 with a pool for one full-context sequence (30 layers x 512 pages of 16 tokens)."""
    return sharpi.load(smollm2_artifact, pool_sequences=1)


def test_pool_exhaustion_is_clear_and_harms_no_other_session(small_pool, smollm2):
    model, pool = small_pool, small_pool.engine.pool
    n_layers = model.config.n_layers
    ids = _prompt(model)
    other_ids = model.tokenize("The capital of France is")
    with smollm2.session() as reference:                                             # what `other` must give
        reference.prefill(other_ids)
        expected = reference.decode(11)
    big, other = model.session(), model.session()
    big.prefill(ids)
    other.prefill(other_ids)
    page = pool.page_bytes
    own = (big.kv_bytes + other.kv_bytes) // page
    assert pool.used_count == own
    forks, first = _fill_with_forks(big, 11)
    assert len(forks) - 1 == (pool.num_pages - own) // n_layers                    # a fork: one page a layer
    assert pool.used_count == own + (len(forks) - 1) * n_layers                    # the refused decode took none
    refused = forks[-1]
    assert refused.logical_length == big.logical_length and refused.kv_length == big.kv_length
    free = pool.free_count
    with pytest.raises(PoolExhaustedError):
        model.session().prefill(ids)                                               # a prefill fails the same way
    assert pool.free_count == free                                                 # nothing leaked
    np.testing.assert_array_equal(other.decode(11), expected)                      # the others are intact
    forks[0].close()
    np.testing.assert_array_equal(refused.decode(11), first)                       # it runs once pages are back
    for s in [big, other, *forks]:
        s.close()
        assert s.kv_bytes == 0
    assert pool.free_count == pool.num_pages


def test_a_fork_shares_pages_until_it_writes(small_pool):
    """A fork takes no page; each side's first write into the shared last page copies that page, once; the two
    sides then go on as separate sequences (the same logits as sequences that never shared)."""
    model, pool = small_pool, small_pool.engine.pool
    n_layers = model.config.n_layers
    ids = _prompt(model)
    with model.session() as solo:
        solo.prefill(ids)
        want = [solo.decode(t) for t in (11, 12, 13)]
    with model.session() as s:
        s.prefill(ids)
        used = pool.used_count
        f = s.fork()
        assert pool.used_count == used and f.kv_bytes == s.kv_bytes
        got_s = [s.decode(t) for t in (11, 12, 13)]                                # s copies the tail, once
        assert pool.used_count == used + n_layers
        got_f = [f.decode(t) for t in (11, 12, 13)]                                # f now owns the original
        assert pool.used_count == used + n_layers
        f.close()
        assert pool.used_count == used
    for a, b, c in zip(want, got_s, got_f):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert pool.free_count == pool.num_pages


def test_refused_prefill_leaves_the_session_empty_and_usable(small_pool):
    """A prefill refused for lack of pages changes nothing; once another session releases pages it runs and
    gives the logits it would have given before."""
    model, pool = small_pool, small_pool.engine.pool
    ids = _prompt(model)
    with model.session() as s:
        expected = s.prefill(ids)
    first = model.session()
    first.prefill(ids)
    forks, _ = _fill_with_forks(first, 11)
    waiting = model.session()
    with pytest.raises(PoolExhaustedError):
        waiting.prefill(ids)
    assert (waiting.logical_length, waiting.kv_bytes, max(waiting.kv_length)) == (0, 0, 0)
    for f in forks[:8]:                                                            # 8 x 30 pages > the 210 it needs
        f.close()
    np.testing.assert_array_equal(waiting.prefill(ids), expected)
    for s in [first, waiting, *forks]:
        s.close()
    assert pool.free_count == pool.num_pages
