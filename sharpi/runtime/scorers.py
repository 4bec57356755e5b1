"""Scorers that rank a prompt's positions after its prefill, for SnapKV's select and compact to keep the best.

SnapKV's own scorer needs no pass of its own: the prompt's last `window` queries score every position inside the
prefill (prefill_snapkv), so it keeps what the question at the end of the prompt needs. A question asked after
the compression (a chat's follow-up, a second question about one document) needs a scorer that does not depend on
the prompt's end. Such a scorer runs after the prefill, on forks of the session (which share its pages and are
closed again, so the session's cache and positions are exactly as the prefill left them), and returns scores
[layers, kv_heads, slots] in the layout of prefill_snapkv's, which the existing select takes.

KVzip (Kim et al., arXiv 2505.23416): the model is asked to repeat the context, and each position scores by the
most attention it receives from the queries of that repetition. Here the context is repeated chunk by chunk, each
chunk on a fresh fork of the prefilled context after a repeat prompt, so a fork never holds more than the
context, the prompt and one chunk (KVzip's chunked scoring). As in KVzip's own code and kvpress's, the first
chunk follows "Repeat the previous context exactly", every later one "Repeat the part of the previous context
exactly, starting with" and the last ANCHOR tokens before it (so the model knows where to go on from), and a
position takes its score from its own chunk's repetition only (the queries that copy it). The chunk's queries are
scored with the artifact's score op (prefill_snapkv's window = minus the chunk: the maximum over the chunk's
queries and each KV head's query heads); artifacts compiled before the op took a negative window sum them instead
(an approximation that favours diffuse recent attention over the one query that copies an old token). Cost:
about one more prefill of the context, plus the prompts once per chunk.

KeyDiff (Park et al., arXiv 2504.15364; kvpress's KeyDiffPress): no queries at all. A position scores by how
unlike its key is to the mean key of its layer and KV head (one minus their cosine similarity): keys near the
mean are the ones most queries attend to alike, so the distinct ones carry what is particular. Cost: reading the
cache's keys once, nothing fed.

Hybrid: the probe and KeyDiff together, each position ranked by the better of its two ranks (each scorer's
scores replaced by their rank among the prompt's positions, per layer and KV head, then the maximum): what the
probe's queries find and what stands out among the keys both stay. Cost: the probe's.

Probe: the cheap one with queries. A generic instruction about the whole context (PROBE_PROMPT) is fed after it
on one fork, and its queries score every position as SnapKV's last window would; it stands in for a question that
is not known yet. Cost: one prefill of a few tokens.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

SCORERS = ("snapkv", "kvzip", "probe", "keydiff", "hybrid")
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
ANCHOR = 8                 # tokens of the context before a chunk that its prompt repeats (KVzip's prev_postfix_size)
PROBE_PROMPT = ("\n\nList every name, number, key and fact stated in the text above, and say where each "
                "appears.\n")


class ScoringSession(Protocol):
    """What a scorer needs of a session (sharpi.runtime.session.Session)."""

    def score_continuation(self, ids, window: int) -> np.ndarray: ...

    def cached_keys(self) -> list[np.ndarray | None]: ...


class ContextScorer(Protocol):
    name: str

    def scores(self, session: ScoringSession, ids: np.ndarray) -> np.ndarray:
        """Scores [layers, kv_heads, slots] of the `ids` the fresh `session` holds from position 0 (zero past
        them); the session's cache is left as it was."""


class KVzipScorer:
    name = "kvzip"

    def __init__(self, repeat_prompt_ids: list[int], continue_prompt_ids: list[int], chunk: int,
                 reduce_max: bool = True):
        self.repeat_prompt_ids = list(repeat_prompt_ids)
        self.continue_prompt_ids = list(continue_prompt_ids)
        self.chunk = chunk
        self.reduce_max = reduce_max      # False: an artifact whose score op only sums (compiled before)

    def prompt_for(self, ids: np.ndarray, start: int) -> list[int]:
        """What precedes the chunk at `start`: the repeat prompt, or the continue prompt and the context's last
        ANCHOR tokens before the chunk."""
        if start == 0:
            return self.repeat_prompt_ids
        return self.continue_prompt_ids + [int(t) for t in ids[max(0, start - ANCHOR):start]]

    def scores(self, session: ScoringSession, ids: np.ndarray) -> np.ndarray:
        best = None
        for start in range(0, len(ids), self.chunk):
            piece = ids[start:start + self.chunk]
            window = -len(piece) if self.reduce_max else len(piece)
            chunk_scores = session.score_continuation(np.concatenate([self.prompt_for(ids, start), piece]), window)
            if best is None:
                best = np.zeros_like(chunk_scores)
            end = start + len(piece)
            best[..., start:end] = chunk_scores[..., start:end]   # each position from its own chunk's copy
        return best


class ProbeScorer:
    name = "probe"

    def __init__(self, probe_ids: list[int]):
        self.probe_ids = list(probe_ids)

    def scores(self, session: ScoringSession, ids: np.ndarray) -> np.ndarray:
        scores = session.score_continuation(np.asarray(self.probe_ids), len(self.probe_ids))
        scores[..., len(ids):] = 0.0
        return scores


class KeyDiffScorer:
    name = "keydiff"

    def __init__(self, slots: int):
        self.slots = slots                        # the select op's score width: the artifact's context

    def scores(self, session: ScoringSession, ids: np.ndarray) -> np.ndarray:
        keys = session.cached_keys()
        heads = next(k.shape[0] for k in keys if k is not None)
        scores = np.zeros((len(keys), heads, self.slots), np.float32)
        for layer, k in enumerate(keys):
            if k is not None:                     # sliding-window layers keep their window: no scores needed
                scores[layer, :, :len(ids)] = keydiff_scores(k[:, :len(ids)])
        return scores


def keydiff_scores(keys: np.ndarray) -> np.ndarray:
    """1 - cos(key, the mean key) for keys [kv_heads, n, head_dim]: [kv_heads, n], in [0, 2]."""
    keys = keys.astype(np.float32)
    anchor = keys.mean(axis=1, keepdims=True)
    norms = np.linalg.norm(keys, axis=-1) * np.linalg.norm(anchor, axis=-1)
    return (1.0 - (keys * anchor).sum(-1) / np.maximum(norms, 1e-12)).astype(np.float32)


class HybridScorer:
    name = "hybrid"

    def __init__(self, probe: ProbeScorer, keydiff: KeyDiffScorer):
        self.probe, self.keydiff = probe, keydiff

    def scores(self, session: ScoringSession, ids: np.ndarray) -> np.ndarray:
        n = len(ids)
        probe = self.probe.scores(session, ids)
        keydiff = self.keydiff.scores(session, ids)
        scores = np.zeros(keydiff.shape, np.float32)
        scores[..., :n] = np.maximum(rank_fraction(probe[..., :n]), rank_fraction(keydiff[..., :n]))
        return scores


def rank_fraction(scores: np.ndarray) -> np.ndarray:
    """Each score's rank along the last axis as a fraction in (0, 1], the highest 1 (ties by position)."""
    n = scores.shape[-1]
    ranks = np.empty(scores.shape, np.float32)
    np.put_along_axis(ranks, np.argsort(scores, axis=-1, kind="stable"), np.arange(1, n + 1, dtype=np.float32)
                      / n, axis=-1)
    return ranks
