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
