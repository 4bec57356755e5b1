"""String-match scoring, as llama.cpp's passkey and RULER do: the expected strings must appear in the greedy
output; a prompt's score is the share of them that do (RULER's string_match_all), a cell's the mean over its
prompts, and the gap to the full cache comes with a paired bootstrap interval."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_SAMPLES = 2000


def is_hit(output: str, answer: str) -> bool:
    """Whether `answer` appears in `output` as a whole token: not inside a longer number or word (so a model
    that writes 604941 for the key 60494 misses), case-insensitive for words."""
    pattern = r"(?<![0-9A-Za-z])" + re.escape(answer.strip()) + r"(?![0-9A-Za-z])"
    return bool(answer.strip()) and re.search(pattern, output, flags=re.IGNORECASE) is not None


def match_score(output: str, answers) -> float:
    """The share of the expected strings present in the output (1.0 or 0.0 for a single answer)."""
    answers = list(answers)
    return sum(is_hit(output, a) for a in answers) / len(answers) if answers else 0.0


def row_score(row: dict) -> float:
    """A result row's score; rows written before scores existed have only their hit."""
    return float(row.get("score", float(bool(row["hit"]))))


@dataclass(frozen=True)
class Accuracy:
    hits: float           # the sum of the rows' scores (a count of hits when every prompt has one answer)
    total: int

    @property
    def fraction(self) -> float:
        return self.hits / self.total if self.total else float("nan")

    @property
    def tally(self) -> str:
        hits = f"{self.hits:.2f}".rstrip("0").rstrip(".")
        return f"{hits}/{self.total}"

    def __str__(self) -> str:
        return f"{100 * self.fraction:.0f}% ({self.tally})" if self.total else "-"


def accuracy(rows) -> Accuracy:
    """Scores summed over the rows (result dicts with a "score", or a boolean "hit")."""
    rows = list(rows)
    return Accuracy(sum(row_score(r) for r in rows), len(rows))


@dataclass(frozen=True)
class Gap:
    """A line's mean score minus the full cache's on the same prompts, in points, with its 95% interval."""
    points: float
    low: float
    high: float
    prompts: int

    def __str__(self) -> str:
        if not self.prompts:
            return "-"
        return f"{self.points:+.1f} [{self.low:+.1f}, {self.high:+.1f}]"


def paired_gap(pairs_by_task: dict[str, list[tuple[float, float]]], samples: int = BOOTSTRAP_SAMPLES,
               seed: int = 0) -> Gap:
    """The suite's score (mean over tasks of the mean over prompts) of a line minus the full cache's, from
    (line score, full-cache score) pairs per task; the interval resamples each task's prompts with replacement,
    pairs kept together (a paired, stratified percentile bootstrap)."""
    tasks = [np.asarray(p, dtype=np.float64).reshape(-1, 2) for p in pairs_by_task.values() if p]
    if not tasks:
        return Gap(float("nan"), float("nan"), float("nan"), 0)
    diffs = [t[:, 0] - t[:, 1] for t in tasks]
    point = float(np.mean([d.mean() for d in diffs]))
    rng = np.random.default_rng(seed)
    boot = np.zeros(samples)
    for d in diffs:
        boot += d[rng.integers(0, len(d), size=(samples, len(d)))].mean(axis=1)
    boot /= len(diffs)
    low, high = np.percentile(boot, [2.5, 97.5])
    return Gap(100 * point, 100 * float(low), 100 * float(high), sum(len(d) for d in diffs))
