"""Token sampling from logits (numpy): greedy, temperature, top-k, top-p, min-p, repetition penalty (llama.cpp's:
over the prompt and the output), frequency and presence penalties (OpenAI's: over the output).

Every accepted value is numerically safe: logits are taken in float64 and shifted so that the largest is 0 before
the temperature divides them (a temperature near zero sends the others to -inf, never to inf - inf = NaN), and a
repetition penalty near zero that lifts a seen token's logit past float64's range is clipped to it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ..common.errors import ConfigError
from ..common.settings import MAX_COUNT

MAX_SEED = 2**64 - 1
_FINITE = float(np.finfo(np.float64).max)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None
    frequency_penalty: float = 0.0        # subtracted once per earlier occurrence in the output
    presence_penalty: float = 0.0         # subtracted once if the token occurs in the output

    def validate(self) -> None:
        """A ConfigError naming the first value outside its range (numbers must be finite; top_k and seed
        integers)."""
        def real(x):
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

        def integer(x, hi):
            return isinstance(x, numbers.Integral) and not isinstance(x, bool) and 0 <= x <= hi

        checks = [(real(self.temperature) and self.temperature >= 0, "temperature must be a finite number >= 0"),
                  (integer(self.top_k, MAX_COUNT), f"top_k must be an integer in [0, {MAX_COUNT}]"),
                  (real(self.top_p) and 0 < self.top_p <= 1, "top_p must be a number in (0, 1]"),
                  (real(self.min_p) and 0 <= self.min_p <= 1, "min_p must be a number in [0, 1]"),
                  (real(self.repeat_penalty) and self.repeat_penalty > 0,
                   "repeat_penalty must be a finite number > 0"),
                  (self.seed is None or integer(self.seed, MAX_SEED), f"seed must be an integer in [0, {MAX_SEED}]"),
                  (real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                   "frequency_penalty must be a number in [-2, 2]"),
                  (real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                   "presence_penalty must be a number in [-2, 2]")]
        names = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "frequency_penalty",
                 "presence_penalty")
        for (ok, message), name in zip(checks, names):
            if not ok:
                raise ConfigError(f"{message}, got {getattr(self, name)!r}.")


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        """Whether the token is the (penalized) logits' argmax: no randomness at all."""
        return self.params.temperature == 0.0

    def __call__(self, logits: np.ndarray, history: list[int], output: list[int] | None = None) -> int:
        """The next token from `logits`; `history` is every token so far (prompt and output: the repetition
        penalty's), `output` the generated ones (the frequency and presence penalties')."""
        p = self.params
        penalized = p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        if p.temperature == 0.0 and not penalized:
            return int(np.argmax(logits))             # exact in float32: no copy of the vocabulary
        z = self._penalized(logits, history, output)
        if p.temperature == 0.0:
            return int(np.argmax(z))
        probs = self._probabilities(z)
        return int(self.rng.choice(probs.size, p=probs))

    def distribution(self, logits: np.ndarray, history: list[int], output: list[int] | None = None) -> np.ndarray:
        """The probabilities __call__ samples from (float64 [vocab], summing to 1; greedy: one-hot on its
        choice), for speculative decoding's acceptance rule."""
        if self.greedy:
            probs = np.zeros(np.asarray(logits).size)
            probs[self(logits, history, output)] = 1.0
            return probs
        return self._probabilities(self._penalized(logits, history, output))

    def _penalized(self, logits: np.ndarray, history: list[int], output: list[int] | None) -> np.ndarray:
        """float64 logits with the repetition, frequency and presence penalties applied."""
        p = self.params
        z = np.asarray(logits, dtype=np.float64).copy()
        if p.repeat_penalty != 1.0 and history:
            seen = np.unique(np.asarray(history, dtype=np.int64))
            vals = z[seen]
            with np.errstate(over="ignore"):
                z[seen] = np.clip(np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty),
                                  -_FINITE, _FINITE)
        if (p.frequency_penalty or p.presence_penalty) and output:
            tokens, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
            z[tokens] -= p.frequency_penalty * counts + p.presence_penalty
        return z

    def _probabilities(self, z: np.ndarray) -> np.ndarray:
        """Temperature, top-k, min-p and top-p over penalized logits (temperature > 0): float64 probabilities."""
        p = self.params
        with np.errstate(over="ignore", under="ignore"):
            z = (z - z.max()) / p.temperature        # <= 0, the largest exactly 0: exp() never overflows
        if p.top_k > 0 and p.top_k < z.size:
            cutoff = np.partition(z, -p.top_k)[-p.top_k]
            z[z < cutoff] = -np.inf
        probs = np.exp(z)                             # the largest is 1, so the sum is >= 1
        if p.min_p > 0:
            probs[probs < p.min_p] = 0                # the largest probability is 1 before normalizing
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = cumulative - probs[order] < p.top_p   # keep the smallest prefix reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs[~mask] = 0
            probs /= probs.sum()
        return probs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The model's log-probabilities (float64) from raw logits: what OpenAI's logprobs report, before any
    sampling setting reshapes the distribution."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens and their log-probabilities, most likely first (ties: the lower id first)."""
    if k <= 0:
        return []
    k = min(k, logprobs.size)
    best = np.argpartition(-logprobs, k - 1)[:k]
    best = best[np.lexsort((best, -logprobs[best]))]
    return [(int(t), float(logprobs[t])) for t in best]
