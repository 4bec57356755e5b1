"""The paged KV cache: decode through a session equals recomputation, continuation prefill, fork, release."""
import numpy as np
import pytest

import sharpi

NEAR_TIE = 1e-3


def _greedy_by_rescoring(model, prompt_ids, steps):
    """Greedy decoding by scoring the whole sequence again at each step; stops at a near tie."""
    ids, out = list(prompt_ids), []
    for _ in range(steps):
        last = model.score(ids)[-1]
        top2 = np.sort(last)[-2:]
        out.append(int(np.argmax(last)))
        if top2[1] - top2[0] < NEAR_TIE:
            return out, True
        ids.append(out[-1])
    return out, False


def test_session_decode_equals_full_rescoring(smollm2, golden):
    for g in golden["greedy"]:
        reference, stopped_at_tie = _greedy_by_rescoring(smollm2, g["prompt_ids"], 32)
        with smollm2.session() as s:
            logits = s.prefill(g["prompt_ids"])
            got = []
            for _ in range(len(reference)):
                got.append(int(np.argmax(logits)))
                logits = s.decode(got[-1])
        if stopped_at_tie:   # the last step was a near tie: either token is right
            got, reference = got[:-1], reference[:-1]
        assert got == reference, g["prompt"]


def test_continuation_prefill_equals_scoring_whole_conversation(smollm2):
    first = smollm2.tokenize("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n", special=True)
    reply = smollm2.generate(first, max_tokens=8).token_ids
    second = smollm2.tokenize("<|im_end|>\n<|im_start|>user\nAnd another?<|im_end|>\n", special=True)
    with smollm2.session() as s:
        s.prefill(first + reply)
        continued = s.prefill(second)
        assert s.logical_length == len(first + reply + second)
    whole = smollm2.score(first + reply + second)[-1]
    np.testing.assert_allclose(continued, whole, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_chunk(smollm2, golden):
    ids = golden["teacher_forced"]["ids"][:100]
    manifest = smollm2.manifest
    saved = manifest.prefill_chunk
    try:
        with smollm2.session() as s:
            whole = s.prefill(ids)
        manifest.prefill_chunk = 37     # not a multiple of the page size
        with smollm2.session() as s:
            chunked = s.prefill(ids)
    finally:
        manifest.prefill_chunk = saved
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-4)


def test_fork_gives_independent_sessions(smollm2):
    ids = smollm2.tokenize("One two three four five six seven")
    with smollm2.session() as a:
        a.prefill(ids)
        b = a.fork()
        la, lb = a.decode(ids[0]), b.decode(ids[0])
        np.testing.assert_array_equal(la, lb)
        a.decode(ids[1])
        assert a.logical_length == b.logical_length + 1
        b.close()


def test_release_returns_every_page(smollm2):
    pool = smollm2.engine.pool
    free_before = pool.free_count
    s = smollm2.session()
    s.prefill(list(range(100, 150)))   # 50 tokens: 4 pages a layer
    assert s.kv_bytes == 4 * smollm2.config.n_layers * pool.page_bytes
    assert s.kv_length == [50] * smollm2.config.n_layers
    assert [p.shape for p in s.kept_positions] == [(smollm2.config.n_kv_heads, 50)] * smollm2.config.n_layers
    s.close()
    assert pool.free_count == free_before


def test_generation_stops_at_context_end(smollm2_gguf, tmp_path):
    model = sharpi.load(sharpi.compile(str(smollm2_gguf), output=tmp_path / "ctx64", max_context=64))
    prompt = model.tokenize("The grass is green. " * 20)[:60]
    assert len(prompt) == 60
    out = model.generate(prompt, max_tokens=50)
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 60 + 1  # the last one needs no slot
    with pytest.raises(sharpi.ContextLengthError):
        model.generate(model.tokenize("The grass is green. " * 20), max_tokens=1)
    # after an eviction, slots are free but logical positions still end at the context
    evicted = model.generate(prompt, max_tokens=50, snapkv_budget=32, snapkv_window=16, snapkv_recency=8)
    assert evicted.stats["evicted"] and evicted.stats["kv_slots_after_prefill"] == 32
    assert evicted.finish_reason == "length" and len(evicted.token_ids) == 64 - 60 + 1
