"""Token sampling from logits (numpy): greedy, temperature, top-k, top-p, min-p, repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..common.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        checks = [(self.temperature >= 0, "temperature must be >= 0"),
                  (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.repeat_penalty > 0, "repeat_penalty must be > 0")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"{message}.")


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        p = self.params
        z = np.asarray(logits, dtype=np.float64).copy()
        if p.repeat_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            vals = z[seen]
            z[seen] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(z))
        z /= p.temperature
        if p.top_k > 0 and p.top_k < z.size:
            cutoff = np.partition(z, -p.top_k)[-p.top_k]
            z[z < cutoff] = -np.inf
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        if p.min_p > 0:
            probs[probs < p.min_p * probs.max()] = 0
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = cumulative - probs[order] < p.top_p   # keep the smallest prefix reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs[~mask] = 0
        probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))
