"""Speculative decoding: a drafter proposes the next few tokens cheaply, one forward of the model verifies them all
(Session.verify: the logits after each), the longest run the model agrees with is kept with the model's own next
token, and the rest is rolled back (Session.rollback). Greedy output is the plain loop's; sampled output follows the
model's distribution exactly (Leviathan et al., arXiv 2211.17192, the rejection rule in `accept`).

Drafters: PromptLookup copies what followed the last few tokens where they occurred before (in the prompt or the
output: llama.cpp's lookup decoding, vLLM's ngram proposer); DraftModel decodes a smaller model of the same
vocabulary. DraftLength decides how many drafted tokens a step verifies: as many as pay, by the acceptance rate
measured so far and the measured forward times, so that where drafts miss the loop decodes plainly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..common.errors import ConfigError
from ..common.speculative_settings import SpeculativeSettings
from .engine import ForwardTimes
from .sampling import Sampler, SamplingParams
from .session import Session


@dataclass
class Draft:
    tokens: list[int]
    probs: list[np.ndarray] | None = None   # the drafter's distribution each token was sampled from (None: chosen)
    kind: int = 0                           # what DraftLength keeps acceptance statistics by (a match's length)
    probe: int | None = None                # a draft not verified: its first token, to compare with the model's


class Drafter(Protocol):
    """Proposes up to k tokens to follow `tokens` (the prompt and every token generated so far). A free drafter
    (a lookup) proposes all it can and the step takes what pays; a costly one (a model) is asked for that many."""

    free: bool

    def propose(self, tokens: list[int], k: int) -> Draft: ...

    def seconds(self, k: int) -> float:
        """What proposing k tokens costs (0 where it is a lookup)."""

    def close(self) -> None: ...


class PromptLookup:
    """Drafts by n-gram match: the longest run of the last n tokens (ngram_max down to ngram_min) that occurred
    before, and the tokens that followed its latest earlier occurrence. An index of every n-gram's latest end,
    grown with the tokens, makes a proposal a few dictionary lookups."""

    free = True

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._latest: dict[tuple, int] = {}     # n-gram -> the index of its last token, latest occurrence
        self._indexed = 0                       # n-grams ending before this index are in _latest

    def propose(self, tokens: list[int], k: int) -> Draft:
        last = len(tokens) - 1
        self._index(tokens, last)           # every n-gram ending before the last token, not the suffix itself
        for n in range(min(self.ngram_max, last), self.ngram_min - 1, -1):
            end = self._latest.get(tuple(tokens[last - n + 1:]))
            if end is not None:
                return Draft(list(tokens[end + 1:end + 1 + k]), kind=n)
        return Draft([])

    def _index(self, tokens: list[int], upto: int) -> None:
        for end in range(self._indexed, upto):
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                self._latest[tuple(tokens[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def seconds(self, k: int) -> float:
        return 0.0

    def close(self) -> None:
        pass


class DraftModel:
    """Drafts by decoding a smaller model (a Model of the same vocabulary) k steps, greedy or sampled as the
    generation is (its own generator, seeded from the generation's seed). Its session follows the generated
    tokens: what it drafted and the target rejected is rolled back before the next proposal."""

    free = False

    def __init__(self, model, params: SamplingParams, max_draft: int):
        self.model = model
        seed = None if params.seed is None else (params.seed + 0x9E3779B97F4A7C15) % 2**64
        self.sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        self.session = model.session(snapkv_budget=0)
        self.session.cache.slack = max_draft + 1       # its sliding-window layers keep what a rollback needs
        self._fed: list[int] = []

    def propose(self, tokens: list[int], k: int) -> Draft:
        session = self.session
        common = _common_prefix(self._fed, tokens)
        if common < len(self._fed):
            session.rollback(len(self._fed) - common)
            del self._fed[common:]
        rest = tokens[common:]
        if len(tokens) + k > self.model.max_context:
            return Draft([])
        logits = session.decode(rest[0]) if len(rest) == 1 else session.prefill(rest)
        self._fed += rest
        drafted, probs = [], []
        for i in range(k):
            history = tokens + drafted
            output = history[len(tokens):]
            if self.sampler.greedy:
                token = self.sampler(logits, history, output)
            else:
                q = self.sampler.distribution(logits, history, output)
                token = int(self.sampler.rng.choice(q.size, p=q))
                probs.append(q)
            drafted.append(token)
            if i + 1 < k:
                logits = session.decode(token)
                self._fed.append(token)
        return Draft(drafted, probs or None)

    def seconds(self, k: int) -> float:
        step = self.model.engine.times.get("decode", 1)
        return k * (step or 0.0)

    def close(self) -> None:
        self.session.close()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0]) if mismatch.size else n


class DraftLength:
    """How many drafted tokens a step verifies: the k that maximises the expected tokens a step yields per second,
    (1 + a + ... + a^k) / (verify(k + 1) + draft(k)), against one token per decode step (k = 0). `a`, the chance
    that a drafted token is accepted after the ones before it were, is counted per draft kind with a decay (the
    recent past weighs most), and also from proposals that were not verified: a plain step checks the first
    drafted token against the token it decodes, so a drafter that starts hitting again is noticed. Forward times
    are the engine's measurements (ForwardTimes); a size not yet measured is guessed from its neighbours."""

    DECAY = 0.9
    GUESS_SLOPE = 0.1      # per extra token, of a decode step: what a size never measured is assumed to cost

    def __init__(self, times: ForwardTimes, max_draft: int, adaptive: bool = True):
        self.times, self.max_draft, self.adaptive = times, max_draft, adaptive
        self._hits: dict[int, list[float]] = {}     # kind -> [accepted, tried], decayed

    def acceptance(self, kind: int) -> float:
        accepted, tried = self._hits.get(kind, (0.0, 0.0))
        return (accepted + 1) / (tried + 2)

    def observe(self, kind: int, drafted: int, accepted: int) -> None:
        tried = accepted + (1 if accepted < drafted else 0)
        counts = self._hits.setdefault(kind, [0.0, 0.0])
        counts[0] = self.DECAY * counts[0] + accepted
        counts[1] = self.DECAY * counts[1] + tried

    def choose(self, available: int, kind: int, drafter: Drafter) -> int:
        """The drafted tokens worth verifying out of `available` (0: decode plainly)."""
        k_max = min(available, self.max_draft)
        if not self.adaptive or k_max <= 0:
            return max(k_max, 0)
        step = self.times.get("decode", 1)
        if step is None:         # the first step decodes plainly: then there is a step time to weigh drafts by
            return 0
        a = self.acceptance(kind)
        # a verification is a prefill_logits call (one sequence) or entries of a decode_batch call (a server's)
        measured = self.times.measured("prefill_logits", "decode_batch")
        best, best_rate, expected = 0, 1.0 / step, 1.0
        for k in range(1, k_max + 1):
            expected += a ** k
            rate = expected / (self.verify_seconds(k + 1, step, measured) + drafter.seconds(k))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def verify_seconds(self, n: int, step: float, measured: dict[int, float]) -> float:
        """A verification of n tokens: as measured, else between the sizes measured around it, else the nearest
        below it (or a decode step) plus GUESS_SLOPE steps a token."""
        if n in measured:
            return measured[n]
        below = [m for m in measured if m < n]
        above = [m for m in measured if m > n]
        if below and above:
            lo, hi = max(below), min(above)
            return measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo)
        lo, base = (max(below), measured[max(below)]) if below else (1, step)
        return base + self.GUESS_SLOPE * step * (n - lo)


def accept(sampler: Sampler, rows: np.ndarray, draft: Draft, history: list[int], output: list[int]) \
        -> tuple[int, int]:
    """(how many drafted tokens to keep, the token after them) from the model's logits rows [k + 1, vocab] of a
    verification (row i follows draft.tokens[:i]). Greedy: the drafts the model's own choice agrees with, then its
    choice. Sampled: draft i is kept with probability min(1, p(d) / q(d)) (q one-hot for a chosen draft), and at
    the first refusal the token comes from p - q where positive, renormalised; after k kept, from the last row: the
    tokens are distributed as the model's own samples are."""
    tokens = draft.tokens
    for i, d in enumerate(tokens):
        h, o = history + tokens[:i], output + tokens[:i]
        if sampler.greedy:
            choice = sampler(rows[i], h, o)
            if choice != d:
                return i, choice
            continue
        p = sampler.distribution(rows[i], h, o)
        q = None if draft.probs is None else draft.probs[i]
        qd = 1.0 if q is None else q[d]
        if sampler.rng.random() < (1.0 if p[d] >= qd else p[d] / qd):
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        if total <= 0:           # p == q within rounding: a refusal had probability ~0
            residual, total = p, p.sum()
        return i, int(sampler.rng.choice(residual.size, p=residual / total))
    k = len(tokens)
    return k, sampler(rows[k], history + tokens, output + tokens)


@dataclass
class SpeculationStats:
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    draft_s: float = 0.0

    def to_dict(self) -> dict:
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "verifications": self.verifications,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0}


class Stepper:
    """The generation loop's step: feed the last token, return the tokens that follow it with the logits each was
    chosen from (its sample; with speculation, the accepted drafts too, already in the cache, then the model's next
    token, not yet). A drafter outlives a session (a server recomputes a preempted sequence on a new one)."""

    PROBE_EVERY = 16      # plain steps between two probes of a costly drafter that does not pay

    def __init__(self, session: Session, sampler: Sampler, settings: SpeculativeSettings | None = None,
                 drafter: Drafter | None = None):
        self.session, self.sampler = session, sampler
        self.settings = settings or SpeculativeSettings()
        self.drafter = drafter
        self.length = DraftLength(session._engine.times, self.settings.max_draft, self.settings.adaptive)
        self.stats = SpeculationStats()
        self._plain_steps = 0

    def step(self, token: int, history: list[int], output: list[int], remaining: int) \
            -> list[tuple[int, np.ndarray]]:
        """history: the prompt and output, `token` (the last of output) included; remaining: tokens the
        generation may still emit after `token`."""
        draft = self.plan(history, remaining)
        if draft.tokens:
            rows = self.session.verify([token] + draft.tokens)
        else:
            rows = self.session.decode(token)[None]
        return self.settle(draft, rows, history, output)

    def plan(self, history: list[int], remaining: int) -> Draft:
        """The drafted tokens to feed after the last token (none: a plain step)."""
        return self._draft(history, remaining) if self.drafter is not None else Draft([])

    def settle(self, draft: Draft, rows: np.ndarray, history: list[int], output: list[int]) \
            -> list[tuple[int, np.ndarray]]:
        """The tokens that follow, from the logits `rows` of the last token and the drafts fed after it (the
        rejected drafts rolled back)."""
        if not draft.tokens:
            following = self.sampler(rows[0], history, output)
            if draft.probe is not None:                  # a free look at how the drafter would have done
                self.length.observe(draft.kind, 1, int(draft.probe == following))
            return [(following, rows[0])]
        kept, following = accept(self.sampler, rows, draft, history, output)
        self.session.rollback(len(draft.tokens) - kept)
        self.length.observe(draft.kind, len(draft.tokens), kept)
        self.stats.drafted += len(draft.tokens)
        self.stats.accepted += kept
        self.stats.verifications += 1
        return list(zip(draft.tokens[:kept] + [following], rows[:kept + 1]))

    def _draft(self, history: list[int], remaining: int) -> Draft:
        """The drafted tokens worth verifying now (none: a plain step; then `probe`, the drafter's first guess
        where it had one, and `kind` say how it would have done)."""
        session, drafter = self.session, self.drafter
        available = max(0, min(remaining - 1, session.context_left - 1, session._engine.prefill_chunk - 1))
        if not available:
            return Draft([])
        started = time.perf_counter()
        if drafter.free:
            draft = drafter.propose(history, available)
            k = self.length.choose(len(draft.tokens), draft.kind, drafter)
        else:
            k = self.length.choose(available, 0, drafter)
            self._plain_steps = 0 if k else self._plain_steps + 1
            # while drafting does not pay, one token is drafted every PROBE_EVERY steps to measure it still
            probe = not k and self._plain_steps % self.PROBE_EVERY == 1
            draft = drafter.propose(history, k or 1) if k or probe else Draft([])
        self.stats.draft_s += time.perf_counter() - started
        if k == 0 and draft.tokens:
            return Draft([], kind=draft.kind, probe=draft.tokens[0])
        return Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k], draft.kind)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()


def make_drafter(settings: SpeculativeSettings, params: SamplingParams, draft_model=None) -> Drafter | None:
    if settings.method == "lookup":
        return PromptLookup(settings.ngram_min, settings.ngram_max)
    if settings.method == "draft":
        return DraftModel(draft_model, params, settings.max_draft)
    return None


def check_draft_model(target, draft) -> None:
    """A ConfigError unless `draft` (a Model) can draft for `target`: the same vocabulary, token for token."""
    if draft is target:
        return
    if draft.config.vocab_size != target.config.vocab_size or \
            not draft.tokenizer.same_vocabulary(target.tokenizer):
        raise ConfigError(f"The draft model {draft.path} has another vocabulary than {target.path} "
                          f"({draft.config.vocab_size} and {target.config.vocab_size} tokens, or different "
                          f"tokens): a draft model must share the model's tokenizer.")
