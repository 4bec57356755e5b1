"""String-match scoring, as llama.cpp's passkey and RULER do: the answer must appear in the greedy output."""
from __future__ import annotations

import re
from dataclasses import dataclass


def is_hit(output: str, answer: str) -> bool:
    """Whether `answer` appears in `output` as a whole token: not inside a longer number or word (so a model
    that writes 604941 for the key 60494 misses), case-insensitive for words."""
    pattern = r"(?<![0-9A-Za-z])" + re.escape(answer.strip()) + r"(?![0-9A-Za-z])"
    return bool(answer.strip()) and re.search(pattern, output, flags=re.IGNORECASE) is not None


@dataclass(frozen=True)
class Accuracy:
    hits: int
    total: int

    @property
    def fraction(self) -> float:
        return self.hits / self.total if self.total else float("nan")

    def __str__(self) -> str:
        if not self.total:
            return "-"
        return f"{100 * self.fraction:.0f}% ({self.hits}/{self.total})"


def accuracy(rows) -> Accuracy:
    """Hits over the rows (result dicts with a boolean "hit")."""
    rows = list(rows)
    return Accuracy(sum(bool(r["hit"]) for r in rows), len(rows))
