"""Everything else composes unchanged on a mixture of experts, shown on a tiny qwen2moe (routed experts and a shared
one, Q8_0): the conformance suite (teacher-forced logits, greedy decode through the KV cache, SnapKV's invariants
and decode after compaction against the numpy reference, the KV bytes after compaction) on the default artifact and
with a q8_0 KV cache; session forks and decode_batch; SnapKV's scorers; and `sharpi serve`'s prefix cache through
the unmodified openai client (127.0.0.1 only)."""
from __future__ import annotations

import numpy as np
import pytest

import sharpi
from sharpi.runtime.session import decode_batch
from sharpi.testing import conformance
from sharpi.testing.reference import NumpyReference, log_softmax
from tiny_gguf import write_tiny_moe

ARCH = "qwen2moe"


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """Heads of 32 (a quantized KV cache's block), routing far from ties."""
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / f"{ARCH}.gguf", ARCH, heads=2, kv_heads=1, seed=3,
                          router_scale=4.0, matrix_type="Q8_0", shared_ffn=64, context=1024)


@pytest.fixture(scope="module")
def moe_artifact(moe_gguf):
    return sharpi.compile(str(moe_gguf), output=moe_gguf.parent / "art")


@pytest.fixture(scope="module")
def moe_model(moe_artifact):
    return sharpi.load(moe_artifact)


@pytest.mark.parametrize("kv", [None, "q8_0"])
def test_the_conformance_suite_passes(kv, moe_gguf, moe_artifact, capsys):
    """Every check of sharpi.testing.conformance passes, none skipped (the SnapKV checks ran: the artifact has
    SnapKV and the prompt is longer than its budget)."""
    artifact = moe_artifact if kv is None else sharpi.compile(str(moe_gguf), output=moe_gguf.parent / f"art-{kv}",
                                                              kv_dtype=kv)
    suite = conformance.Suite(artifact, gguf=moe_gguf)
    results = suite.run_all()
    table = conformance.format_table(results)
    assert all(r.status == "PASS" for r in results), table
    assert {r.name for r in results} == set(conformance.CHECKS)


def test_forks_and_decode_batch_follow_the_reference(moe_model, moe_gguf):
    """A session forked after a shared prefill and decoded on two branches, the branches then decoded together
    (decode_batch): each step's log-probs within the int8 tolerance of the reference's for its own sequence."""
    tol = conformance.tolerance_for(moe_model.manifest)
    ref = NumpyReference(moe_gguf)
    ids = moe_model.tokenize(conformance.DEFAULT_PROMPT)[:40]
    a_ids, b_ids = ids + [5, 9], ids + [7, 3]
    want_a, want_b = log_softmax(ref.forward(a_ids)), log_softmax(ref.forward(b_ids))
    with moe_model.session() as base:
        base.prefill(ids)
        with base.fork() as a, base.fork() as b:
            got = [log_softmax(a.decode(5)), log_softmax(b.decode(7))]
            pair = decode_batch([a, b], [9, 3])
            got += [log_softmax(pair[0]), log_softmax(pair[1])]
    want = [want_a[len(ids)], want_b[len(ids)], want_a[len(ids) + 1], want_b[len(ids) + 1]]
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= tol.logprob_atol


@pytest.mark.parametrize("scorer", ["snapkv", "keydiff"])
def test_snapkv_scorers_keep_the_budget(scorer, moe_model):
    """Each scorer compacts a MoE model's cache to the budget on every layer and KV head, and decoding goes on
    from the compacted cache with finite logits."""
    ids = moe_model.tokenize(conformance.DEFAULT_PROMPT * 4)[:200]
    with moe_model.session(snapkv_budget=128, compress=scorer) as s:
        s.prefill(ids)
        assert s.evicted
        assert all(layer.shape[-1] == 128 for layer in s.kept_positions), [p.shape for p in s.kept_positions]
        assert np.isfinite(s.decode(ids[-1])).all()


def test_serve_reuses_a_shared_prefix(moe_artifact):
    """Two completions sharing a 256-token prefix through sharpi serve: the second reuses the cached pages
    (cached_tokens) and answers as the runtime API does without the cache."""
    from openai_server import Server, complete
    model = sharpi.load(moe_artifact, pool_tokens=4096)
    server = Server(model, parallel=2)
    try:
        doc = list(np.random.default_rng(0).integers(3, 200, 256))
        doc = [int(t) for t in doc]
        first, second = doc + [11, 12, 13], doc + [21, 22, 23]
        a = complete(server.client, first, 6)
        b = complete(server.client, second, 6)
        assert a.usage.prompt_tokens_details.cached_tokens == 0
        assert b.usage.prompt_tokens_details.cached_tokens == 256
        assert b.choices[0].text == model.generate(second, 6).text
    finally:
        server.close()
