"""benchmarks/per_head_budgets.py's allocations, which its measurement of per-KV-head budgets rests on: each keeps
the budget on average (the comparison is at equal memory), per-head shares stay within their layer's total, and
the thresholds follow the scores."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from sharpi.common.snapkv_settings import SnapKVSettings, layer_budgets

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "per_head_budgets.py"
_spec = importlib.util.spec_from_file_location("per_head_budgets", _PATH)
per_head = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(per_head)

LAYERS, HEADS, N, BUDGET = 6, 2, 1000, 300


@pytest.fixture
def scores():
    rng = np.random.default_rng(0)
    s = rng.random((LAYERS, HEADS, N)).astype(np.float32)
    s[1, 0] += 1.0                 # one head of one layer scores above everything else
    s[4] *= 0.1                    # one layer scores below everything else
    return s


@pytest.mark.parametrize("allocation", per_head.ALLOCATIONS)
def test_every_allocation_keeps_the_budget_on_average(scores, allocation):
    counts = per_head.head_counts(scores, BUDGET, allocation)
    assert counts.shape == (LAYERS, HEADS)
    assert counts.min() >= per_head.RECENCY + 1 and counts.max() <= N
    assert abs(counts.sum() - BUDGET * LAYERS * HEADS) <= LAYERS * HEADS


def test_heads_share_their_layers_total_and_follow_the_scores(scores):
    counts = per_head.head_counts(scores, BUDGET, "heads")
    assert (np.abs(counts.sum(axis=1) - BUDGET * HEADS) <= HEADS).all()
    assert counts[1, 0] > counts[1, 1]                    # the high-scoring head takes the larger share


def test_layers_are_sharpis_score_allocation_and_global_follows_the_scores(scores):
    settings = SnapKVSettings(allocation="scores", recency=per_head.RECENCY)
    layers = per_head.head_counts(scores, BUDGET, "layers")
    assert (layers == np.asarray(layer_budgets(BUDGET, LAYERS, settings, scores))[:, None]).all()
    both = per_head.head_counts(scores, BUDGET, "layers+heads")
    assert both[4].max() == per_head.RECENCY + 1          # the low layer is cut to the floor
    assert both[1, 0] == both.max() > 0.9 * N             # the high head keeps nearly everything (the floor's
                                                           # slots come back from it in proportion)


def test_keep_sets_hold_each_heads_count_and_the_recent_positions(scores):
    counts = per_head.head_counts(scores, BUDGET, "layers+heads")
    kept = per_head.keep_sets(scores, counts)
    for l in range(LAYERS):
        for h in range(HEADS):
            rows = kept[l][h]
            assert len(rows) == counts[l, h] and (np.diff(rows) > 0).all()
            assert set(range(N - per_head.RECENCY, N)) <= set(rows.tolist())


@pytest.mark.parametrize("query_bias", [True, False])
def test_expected_attention_is_the_gaussian_expectation_of_the_queries_moved_to_the_next_position(
        tmp_path, query_bias):
    """With one future position, Expected Attention's rotation is that position's own: each pre-RoPE query moved
    there is the post-RoPE query rotated on by (n - t), whose mean and covariance give the logits
    scale * mu.k + scale^2 / 2 * k.Sigma.k directly, without the averaged rotation matrix the scorer builds."""
    from tiny_gguf import write_tiny_llama
    from sharpi.testing.reference import NumpyReference, rope_neox

    ref = NumpyReference(write_tiny_llama(tmp_path / "tiny.gguf", arch="qwen2", qkv_bias=True))
    cfg, sinks = ref.config, 4
    assert cfg.qkv_bias and cfg.rope_layout == "neox"
    ids = np.random.default_rng(1).integers(1, cfg.vocab_size, 40)
    session = per_head.RaggedSession(ref)
    session.feed(ids)
    scores = per_head.expected_attention_scores(ref, ids, session, n_future=1, sinks=sinks, query_bias=query_bias)
    n, group, scale = len(ids), cfg.n_heads // cfg.n_kv_heads, cfg.head_dim ** -0.5
    captured = []
    ref.forward(ids, capture=captured)
    for l, (q, _, _) in enumerate(captured):
        q = q[sinks:].astype(np.float64)
        if not query_bias:                    # the bias rotated to each query's position, taken away
            bias = np.broadcast_to(ref.weights[f"blk.{l}.attn_q.bias"].reshape(cfg.n_heads, -1), q.shape)
            q = q - rope_neox(bias.astype(np.float32), np.arange(sinks, n), cfg.rope_theta)
        moved = rope_neox(q.astype(np.float32), n - np.arange(sinks, n), cfg.rope_theta).astype(np.float64)
        mu = moved.mean(0)
        cov = np.einsum("thi,thj->hij", moved - mu, moved - mu) / len(moved)
        for h in range(cfg.n_kv_heads):
            k = session.keys[l][h][sinks:].astype(np.float64)
            heads = slice(h * group, (h + 1) * group)
            logits = scale * mu[heads] @ k.T + scale ** 2 / 2 * np.einsum("si,hij,sj->hs", k, cov[heads], k)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            expected = (p / p.sum(-1, keepdims=True)).mean(0) * np.linalg.norm(session.values[l][h][sinks:], axis=-1)
            np.testing.assert_allclose(scores[l, h, sinks:], expected, rtol=1e-3, atol=1e-7)
            assert (scores[l, h, :sinks] == scores[l, h, sinks:].max()).all()
