"""numpy reference of SnapKV's score and select (see sharpi.codegen.kernels.snapkv for the semantics)."""
from __future__ import annotations

import numpy as np

POOLINGS = ("none", "max", "avg")


def score_reference(q_window: np.ndarray, keys: np.ndarray, held_before: int, scale: float,
                    reduce: str = "sum") -> np.ndarray:
    """q_window [W, H, D]: the last W queries, which sit at slots total-W .. total-1; keys [total, KVH, D].

    Returns [KVH, total]: softmax probabilities summed over the W queries, averaged over each group's heads
    (reduce "max": their maximum over the queries and the group's heads, the score op's negative window)."""
    w, heads, _ = q_window.shape
    total, kv_heads, _ = keys.shape
    group = heads // kv_heads
    k = np.repeat(keys, group, axis=1).astype(np.float64)
    logits = np.einsum("whd,shd->hws", q_window.astype(np.float64), k) * scale
    query_slot = total - w + np.arange(w)
    visible = np.arange(total)[None, :] <= query_slot[:, None]
    logits = np.where(visible[None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if reduce == "max":
        return p.max(1).reshape(kv_heads, group, total).max(1)
    return p.sum(1).reshape(kv_heads, group, total).mean(1)


def pool_reference(row: np.ndarray, pooling: str, kernel: int) -> np.ndarray:
    """Zero-padded pooling in float32, summing in the kernel's order so that ties come out the same."""
    row = np.asarray(row, np.float32)
    if pooling == "none":
        return row.copy()
    half, total = kernel // 2, len(row)
    padded = np.concatenate([np.zeros(half, np.float32), row, np.zeros(half, np.float32)])
    acc = np.zeros(total, np.float32)
    for j in range(kernel):
        acc = np.maximum(acc, padded[j:j + total]) if pooling == "max" else acc + padded[j:j + total]
    return acc if pooling == "max" else acc / np.float32(kernel)


def select_row(row: np.ndarray, budget: int, recency: int, pooling: str, kernel: int, sinks: int = 0) -> np.ndarray:
    """The keep set of one row: positions 0 .. sinks-1, the top (budget - recency - sinks) of the candidates
    [sinks, total - recency) by pooled score (pooled over the whole row; ties to the lower index), ascending, then
    the last `recency` positions."""
    total = len(row)
    pooled = pool_reference(row, pooling, kernel)
    end = total - recency
    if budget >= total:                                   # nothing to evict
        return np.arange(total, dtype=np.int64)
    if sinks < 0 or recency < 0 or sinks + recency > budget:
        raise ValueError(f"sinks ({sinks}) + recency ({recency}) must not exceed the budget ({budget}).")
    candidates = np.arange(sinks, end)
    order = np.lexsort((candidates, -pooled[sinks:end]))  # by score desc, then index asc
    top = np.sort(candidates[order[:budget - recency - sinks]])
    return np.concatenate([np.arange(sinks), top, np.arange(end, total)]).astype(np.int64)


def select_reference(scores: np.ndarray, budget: int, recency: int, pooling: str, kernel: int,
                     granularity: str, sinks: int = 0) -> np.ndarray:
    """scores [L, KVH, total] -> keep [L, KVH, budget]."""
    layers, kv_heads, _ = scores.shape
    if granularity == "shared":
        total = np.zeros(scores.shape[-1], np.float32)
        for row in np.asarray(scores, np.float32).reshape(-1, scores.shape[-1]):   # the kernel's order
            total = total + row
        one = select_row(total, budget, recency, pooling, kernel, sinks)
        return np.broadcast_to(one, (layers, kv_heads, len(one))).copy()
    return np.stack([np.stack([select_row(scores[l, h], budget, recency, pooling, kernel, sinks)
                               for h in range(kv_heads)]) for l in range(layers)])


def kvzip_reference(reference, ids: list[int], prompt_for, chunk: int, scale: float,
                    reduce: str = "max") -> np.ndarray:
    """KVzip's scores as sharpi.runtime.scorers computes them, from the numpy forward pass (`reference`, a
    NumpyReference): per chunk of `ids` starting at `start`, the sequence ids + prompt_for(start) + chunk, whose
    chunk queries score the chunk's own positions (score_reference). Returns [L, KVH, len(ids)]."""
    n = len(ids)
    out = None
    for start in range(0, n, chunk):
        piece = list(ids[start:start + chunk])
        captured = []
        reference.forward(list(ids) + list(prompt_for(start)) + piece, capture=captured)
        scores = np.stack([score_reference(q[-len(piece):], k, 0, scale, reduce)[:, :n] for q, k, _ in captured])
        out = np.zeros_like(scores) if out is None else out
        out[..., start:start + len(piece)] = scores[..., start:start + len(piece)]
    return out.astype(np.float32)


def probe_reference(reference, ids: list[int], probe: list[int], scale: float) -> np.ndarray:
    """The probe scorer's scores: the probe's queries, fed after `ids`, over the positions of `ids`."""
    captured = []
    reference.forward(list(ids) + list(probe), capture=captured)
    return np.stack([score_reference(q[-len(probe):], k, 0, scale)[:, :len(ids)]
                     for q, k, _ in captured]).astype(np.float32)


def keydiff_reference(reference, ids: list[int]) -> np.ndarray:
    """KeyDiff's scores from the numpy forward pass's post-RoPE keys: 1 - cos(key, the layer and KV head's mean
    key), [L, KVH, len(ids)]."""
    captured = []
    reference.forward(list(ids), capture=captured)
    scores = []
    for _, k, _ in captured:                                   # k [T, KVH, D]
        keys = k.transpose(1, 0, 2).astype(np.float64)
        anchor = keys.mean(axis=1, keepdims=True)
        cos = (keys * anchor).sum(-1) / (np.linalg.norm(keys, axis=-1) * np.linalg.norm(anchor, axis=-1))
        scores.append(1.0 - cos)
    return np.stack(scores).astype(np.float32)


def hybrid_reference(reference, ids: list[int], probe: list[int], scale: float) -> np.ndarray:
    """The hybrid scorer's scores: per layer and KV head the larger of each position's rank fraction under the
    probe's scores and under KeyDiff's (ties ranked by position)."""
    def ranks(x):
        order = np.argsort(x, axis=-1, kind="stable")
        out = np.empty(x.shape, np.float64)
        np.put_along_axis(out, order, np.arange(1, x.shape[-1] + 1) / x.shape[-1], axis=-1)
        return out
    both = np.maximum(ranks(probe_reference(reference, ids, probe, scale)), ranks(keydiff_reference(reference, ids)))
    return both.astype(np.float32)
