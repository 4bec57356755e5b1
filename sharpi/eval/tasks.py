"""Long-context prompts built in tokens: passkey (llama.cpp's examples/passkey), needle (a fact hidden in prose,
RULER's single needle) and the rest of a RULER-style suite (arXiv 2404.06654): multikey (several key/value
sentences, one asked for), multivalue (one key, several values, all asked for), multiquery (several keys, all
asked for), vartrack (a chain of variable assignments, every name holding the value asked for) and commonwords
(a numbered word list, its ten most frequent words asked for).

Every builder returns a `Prompt` of (about, never more than) the asked number of tokens with the asked needle
at the asked depth, both measured with the model's own tokenizer. Depth d (percent) puts the needle's first
token d of the way from its earliest place (right after the task's intro) to its latest (right before the
question), counted in tokens; it is placed at the nearest sentence boundary, so it lands within a sentence of
the target. A trial's content (key, names, haystack offset) depends on (seed, task, trial) only, so one trial
differs across lengths and depths by placement alone.
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Callable

from ..common.errors import ConfigError

TASKS = ("passkey", "needle", "multikey", "multivalue", "multiquery", "vartrack", "commonwords")
RULER_TASKS = ("needle", "multikey", "multivalue", "multiquery", "vartrack", "commonwords")
DEPTHLESS = ("commonwords",)     # no needle: its depths only draw more prompts
Tokenize = Callable[[str], list]

# llama.cpp's examples/passkey prompt, word for word (its sentences are joined with single spaces).
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                  "There and back again.")
PASSKEY_QUESTION = "What is the pass key? The pass key is"

NEEDLE_INTRO = ("Below is a long passage from a book. One sentence in it states a fact about a person. "
                "Read the passage, then answer the question after it.")
NAMES = ("Amelia", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
         "Lorenzo", "Marisol", "Nikolai", "Olga", "Pablo", "Quentin", "Rosa", "Stefan", "Tamsin", "Ulrich",
         "Valeria", "Walter", "Ximena", "Yusuf", "Zora")

MULTIKEY_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                  "I will quiz you about the numbers afterwards.")
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "kind",
              "lively", "misty", "noble", "odd", "proud", "quiet", "rusty", "silent", "tidy", "upbeat", "vivid",
              "wary", "young", "zesty")
NOUNS = ("anchor", "basket", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "mirror", "needle", "orchard", "pillow", "quarry", "rocket", "saddle", "tunnel",
         "umbrella", "violin", "wagon", "yacht", "zipper")
MULTIKEY_KEYS = 4          # the asked needle and three distractors, as in RULER's niah_multikey_1
MULTI_ANSWERS = 4          # values of multivalue, keys of multiquery (RULER's niah_multivalue / niah_multiquery)

VARTRACK_INTRO = "Memorize and track the chain of variable assignments hidden in the following text."
VARTRACK_HOPS = 4          # RULER's vt: one chain, four hops, so five names hold the value

COMMONWORDS_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
                     "Memorize the ones that appear most often.")
COMMONWORDS = 10           # RULER's cwe: ten common words, each 30 times; the others 3 times
COMMON_FREQUENCY, RARE_FREQUENCY = 30, 3
COMMONWORDS_QUESTION = (f"Question: What are the {COMMONWORDS} most common words in the above list? "
                        f"Answer: The top {COMMONWORDS} words that appear most often in the list are:")


@dataclass(frozen=True)
class Content:
    """What one trial hides: the asked needle (first), the other needles with their haystack fractions, the
    question that ends the prompt and the strings string-matched in the output (all of them expected), and
    follow-up questions about the same context (asked after one compression by the agnostic protocol)."""
    intro: str
    needle: str
    question: str
    answers: tuple[str, ...]
    sentences: tuple[str, ...]              # the haystack, in order; cycled as far as the length needs
    cut_inside_sentences: bool = False      # prose may end mid-sentence to hit the length; passkey filler not
    distractors: tuple[str, ...] = ()       # the other needles (answers too, for multivalue and multiquery)
    distractor_fractions: tuple[float, ...] = ()
    followups: tuple[tuple[str, tuple[str, ...]], ...] = ()     # (question, answers)

    @property
    def answer(self) -> str:
        return ", ".join(self.answers)

    @property
    def questions(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return ((self.question, self.answers), *self.followups)


@dataclass(frozen=True)
class Prompt:
    """A built prompt: its text and token ids, the expected strings, and where the needles sit (token spans
    [start, end)). `questions` are (token ids, answers) of the prompt's own question and its follow-ups, each
    the tokens that follow the context when that question ends the prompt."""
    task: str
    text: str
    ids: list
    answers: tuple[str, ...]
    depth: float                                    # asked, percent
    needle: tuple[int, int]                         # the asked needle's token span
    needle_depth: float                             # where it landed, percent (same scale as depth)
    distractors: tuple[tuple[int, int], ...] = field(default=())
    question_start: int = 0                         # the question's first token: ids[:question_start] the context
    followups: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...] = field(default=())

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def answer(self) -> str:
        return ", ".join(self.answers)

    @property
    def questions(self) -> list[tuple[list, tuple[str, ...]]]:
        return [(self.question_ids, self.answers), *((list(ids), answers) for ids, answers in self.followups)]

    @property
    def context_ids(self) -> list:
        return self.ids[:self.question_start]

    @property
    def question_ids(self) -> list:
        return self.ids[self.question_start:]


# -- content per task ----------------------------------------------------------------------------------------
def trial_rng(seed: int, task: str, trial: int) -> random.Random:
    # A string seed is hashed with sha512 by random.Random: stable across runs and Python versions.
    return random.Random(f"sharpi-eval:{seed}:{task}:{trial}")


def passkey_content(rng: random.Random) -> Content:
    key = rng.randint(10000, 99999)
    return Content(intro=PASSKEY_INTRO, needle=f"The pass key is {key}. Remember it. {key} is the pass key.",
                   question=PASSKEY_QUESTION, answers=(str(key),), sentences=PASSKEY_FILLER)


def needle_content(rng: random.Random) -> Content:
    name, number = rng.choice(NAMES), rng.randint(100000, 999999)
    return Content(intro=NEEDLE_INTRO, needle=f"{name}'s favourite number is {number}.",
                   question=f"Question: what is {name}'s favourite number? Answer: {name}'s favourite number is",
                   answers=(str(number),), sentences=_prose_from(rng), cut_inside_sentences=True)


def _magic_keys(rng: random.Random, count: int) -> list[str]:
    return rng.sample([f"{a}-{n}" for a in ADJECTIVES for n in NOUNS], count)


def _magic_values(rng: random.Random, count: int) -> list[str]:
    return [str(rng.randint(1000000, 9999999)) for _ in range(count)]


def _magic_needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _magic_question(keys: list[str]) -> str:
    if len(keys) == 1:
        return (f"What is the special magic number for {keys[0]} mentioned in the provided text? "
                f"The special magic number for {keys[0]} mentioned in the provided text is")
    named = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return (f"What are all the special magic numbers for {named} mentioned in the provided text? "
            f"The special magic numbers for {named} mentioned in the provided text are")


def _magic_content(rng: random.Random, needles: list[str], question: str, answers, followups=()) -> Content:
    return Content(intro=MULTIKEY_INTRO, needle=needles[0], question=question, answers=tuple(answers),
                   sentences=_prose_from(rng), cut_inside_sentences=True, distractors=tuple(needles[1:]),
                   distractor_fractions=tuple(rng.random() for _ in needles[1:]), followups=tuple(followups))


def multikey_content(rng: random.Random, keys: int = MULTIKEY_KEYS) -> Content:
    """One key asked for among `keys`; the follow-ups ask for each other key in turn."""
    names = _magic_keys(rng, keys)
    values = _magic_values(rng, keys)
    needles = [_magic_needle(k, v) for k, v in zip(names, values)]
    followups = [(_magic_question([k]), (v,)) for k, v in zip(names[1:], values[1:])]
    return _magic_content(rng, needles, _magic_question(names[:1]), values[:1], followups)


def multivalue_content(rng: random.Random) -> Content:
    """One key with several values, all asked for."""
    name = _magic_keys(rng, 1)[0]
    values = _magic_values(rng, MULTI_ANSWERS)
    needles = [_magic_needle(name, v) for v in values]
    question = (f"What are all the special magic numbers for {name} mentioned in the provided text? "
                f"The special magic numbers for {name} mentioned in the provided text are")
    return _magic_content(rng, needles, question, values)


def multiquery_content(rng: random.Random) -> Content:
    """Several keys, all asked for in one question; the follow-ups ask for each key alone."""
    names = _magic_keys(rng, MULTI_ANSWERS)
    values = _magic_values(rng, MULTI_ANSWERS)
    needles = [_magic_needle(k, v) for k, v in zip(names, values)]
    followups = [(_magic_question([k]), (v,)) for k, v in zip(names, values)]
    return _magic_content(rng, needles, _magic_question(names), values, followups)


def vartrack_content(rng: random.Random) -> Content:
    """RULER's variable tracking: VAR A = value, VAR B = VAR A, ...; every name in the chain is expected."""
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(VARTRACK_HOPS + 1)]
    value = str(rng.randint(10000, 99999))
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    fractions = sorted(rng.random() for _ in needles[1:])     # the chain in order after the first assignment
    question = (f"Question: Find all variables that are assigned the value {value} in the text above. Answer: "
                f"According to the chain of variable assignments in the text above, {len(names)} variables are "
                f"assigned the value {value}, they are:")
    return Content(intro=VARTRACK_INTRO, needle=needles[0], question=question, answers=tuple(names),
                   sentences=_prose_from(rng), cut_inside_sentences=True, distractors=tuple(needles[1:]),
                   distractor_fractions=tuple(fractions))


def commonwords_content(rng: random.Random) -> Content:
    """The ten common words (the answers) and the pool the rare ones are drawn from, in order; the list itself
    is built to the length (`_build_commonwords`)."""
    pool = list(word_pool())
    rng.shuffle(pool)
    return Content(intro=COMMONWORDS_INTRO, needle="", question=COMMONWORDS_QUESTION,
                   answers=tuple(pool[:COMMONWORDS]), sentences=tuple(pool[COMMONWORDS:]))


CONTENT = {"passkey": passkey_content, "needle": needle_content, "multikey": multikey_content,
           "multivalue": multivalue_content, "multiquery": multiquery_content, "vartrack": vartrack_content,
           "commonwords": commonwords_content}


@lru_cache(maxsize=1)
def corpus_sentences() -> tuple[str, ...]:
    """The shipped prose (Alice's Adventures in Wonderland, public domain; see data/README.md), one sentence
    per item."""
    text = resources.files("sharpi.eval").joinpath("data/alice.txt").read_text(encoding="utf-8")
    sentences = []
    for paragraph in text.splitlines():
        sentences += [s for s in re.split(r"(?<=[.!?])\s+(?=[\"'A-Z(])", paragraph.strip()) if s]
    return tuple(sentences)


@lru_cache(maxsize=1)
def word_pool() -> tuple[str, ...]:
    """Distinct lower-case words of four letters or more from the shipped prose, sorted: commonwords' list."""
    text = resources.files("sharpi.eval").joinpath("data/alice.txt").read_text(encoding="utf-8")
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,}\b", text))))


def _prose_from(rng: random.Random) -> tuple[str, ...]:
    """The corpus rotated to a random sentence, so trials hide their needles in different passages."""
    sentences = corpus_sentences()
    start = rng.randrange(len(sentences))
    return sentences[start:] + sentences[:start]


# -- building in tokens --------------------------------------------------------------------------------------
def build_prompt(task: str, tokenize: Tokenize, length: int, depth: float, seed: int = 0,
                 trial: int = 0) -> Prompt:
    """The prompt of `task` for this trial: at most `length` tokens (as close as a word allows), the asked needle
    at `depth` percent."""
    if task not in CONTENT:
        raise ConfigError(f"Unknown eval task {task!r}; tasks are {', '.join(TASKS)}.")
    if not 0 <= depth <= 100:
        raise ConfigError(f"Depth must be a percentage between 0 and 100, got {depth}.")
    if task in DEPTHLESS:       # its content draws on the depth too, so each (trial, depth) is another prompt
        content = CONTENT[task](trial_rng(seed, task, f"{trial}@{depth:g}"))
        return _build_commonwords(content, tokenize, length, depth, order=f"{seed}:{trial}@{depth:g}")
    content = CONTENT[task](trial_rng(seed, task, trial))
    return _Builder(task, content, tokenize).build(length, depth)


def minimum_length(task: str, tokenize: Tokenize, seed: int = 0) -> int:
    """Tokens of the intro, needles and question alone: no prompt of this task can be shorter."""
    content = CONTENT[task](trial_rng(seed, task, 0))
    if task in DEPTHLESS:
        return len(tokenize(_commonwords_text(content, 0, RARE_FREQUENCY + 1, "")))
    return len(tokenize(" ".join([content.intro, content.needle, *content.distractors, content.question])))


# -- commonwords: a numbered list, not prose with needles --------------------------------------------------
def _commonwords_text(content: Content, rare: int, frequency: int, order: str) -> str:
    words = list(content.answers) * frequency + list(content.sentences[:rare]) * RARE_FREQUENCY
    random.Random(f"sharpi-eval-cwe:{order}:{rare}:{frequency}").shuffle(words)
    listing = " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))
    return f"{content.intro} {listing} {content.question}"


def _most_rare_words(content: Content, tokenize: Tokenize, length: int, frequency: int, order: str) -> int:
    """The most rare words (each RARE_FREQUENCY times) a list with the common ones `frequency` times fits in
    `length` tokens with; -1 when not even none fit."""
    lo, hi = -1, min(len(content.sentences), length // (2 * RARE_FREQUENCY))   # an item is 2 tokens or more
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenize(_commonwords_text(content, mid, frequency, order))) <= length:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _build_commonwords(content: Content, tokenize: Tokenize, length: int, depth: float, order: str) -> Prompt:
    """RULER's frequencies (common words 30 times, rare ones 3) where the length allows at least twice as many
    rare words as common ones; shorter prompts lower the common frequency (never to the rare one's)."""
    most = max(min(COMMON_FREQUENCY, length // (2 * COMMONWORDS)), RARE_FREQUENCY + 1)   # what could fit at all
    for frequency in range(most, RARE_FREQUENCY, -1):
        rare = _most_rare_words(content, tokenize, length, frequency, order)
        if rare >= 2 * COMMONWORDS or (frequency == RARE_FREQUENCY + 1 and rare >= 0):
            break
    else:
        rare = -1
    if rare < 0:
        floor = len(tokenize(_commonwords_text(content, 0, RARE_FREQUENCY + 1, order)))
        raise ConfigError(f"A commonwords prompt needs at least {floor} tokens (intro, the common words and the "
                          f"question); {length} is too short.")
    text = _commonwords_text(content, rare, frequency, order)
    question = len(tokenize(text[:len(text) - len(content.question)].rstrip()))
    return Prompt(task="commonwords", text=text, ids=list(tokenize(text)), answers=content.answers,
                  depth=float(depth), needle=(0, 0), needle_depth=0.0, question_start=question)


@dataclass(frozen=True)
class Haystack:
    """The filler as words, with the word index where each sentence starts: cuts and needle places are word
    indices, so text and positions stay in step."""
    words: list
    starts: list

    def boundaries(self, cut: int) -> list[int]:
        """Where a needle may go in the haystack cut at `cut` words: before each whole sentence, and at the end."""
        return [s for s in self.starts if s < cut] + [cut] if cut else [0]


class _Builder:
    """Renders intro + haystack (needles between sentences) + question, and searches the haystack's cut and the
    needle's boundary with the tokenizer (token counts grow monotonically with both)."""

    def __init__(self, task: str, content: Content, tokenize: Tokenize):
        self.task, self.content, self.tokenize = task, content, tokenize

    def count(self, text: str) -> int:
        return len(self.tokenize(text))

    def build(self, length: int, depth: float) -> Prompt:
        floor = self.count(self._render(Haystack([], []), 0, 0)[0])      # no haystack at all
        if length < floor:
            raise ConfigError(f"A {self.task} prompt needs at least {floor} tokens (intro, needles and question); "
                              f"{length} is too short.")
        hay = self._haystack(length)
        if self.content.cut_inside_sentences:
            cuts = list(range(len(hay.words) + 1))
        else:
            cuts = hay.starts + [len(hay.words)]
        i = self._fit(hay, cuts, length, depth)
        while True:             # moving the needle can shift the count by a token: shrink until it fits
            prompt = self._place(hay, cuts[i], depth)
            if prompt.tokens <= length or i == 0:
                return prompt
            i -= 1

    def _haystack(self, length: int) -> Haystack:
        words, starts = [], []
        for sentence in itertools.cycle(self.content.sentences):
            if len(words) >= length + 64:     # a word is at least one token, so this always suffices
                return Haystack(words, starts)
            starts.append(len(words))
            words += sentence.split()

    def _fit(self, hay: Haystack, cuts: list[int], length: int, depth: float) -> int:
        """Index of the longest cut whose prompt (needle near its depth) fits in `length` tokens."""
        lo, hi = 0, len(cuts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            places = hay.boundaries(cuts[mid])
            text, _ = self._render(hay, cuts[mid], places[round(depth / 100 * (len(places) - 1))])
            if self.count(text) <= length:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _render(self, hay: Haystack, cut: int, at: int) -> tuple[str, dict[str, tuple[int, int]]]:
        """The prompt text with the asked needle before word `at` and the distractors at their fractions;
        returns the text and each needle's character span."""
        places = hay.boundaries(cut)
        inserts: dict[int, list[str]] = {}
        for text, fraction in zip(self.content.distractors, self.content.distractor_fractions):
            inserts.setdefault(places[round(fraction * (len(places) - 1))], []).append(text)
        inserts.setdefault(at, []).append(self.content.needle)
        pieces, spans, offset = [self.content.intro], {}, len(self.content.intro)
        for w in range(cut + 1):
            for needle in inserts.get(w, ()):
                spans[needle] = (offset + 1, offset + 1 + len(needle))
                pieces.append(needle)
                offset += 1 + len(needle)
            if w < cut:
                pieces.append(hay.words[w])
                offset += 1 + len(hay.words[w])
        pieces.append(self.content.question)
        return " ".join(pieces), spans

    def _span(self, text: str, chars: tuple[int, int]) -> tuple[int, int]:
        # Spaces attach to the next word (BPE and SentencePiece alike), so the tokens of the text before a
        # needle, right-stripped, are exactly the prompt's tokens before it.
        return self.count(text[:chars[0]].rstrip()), self.count(text[:chars[1]])

    def _needle_start(self, hay: Haystack, cut: int, at: int) -> int:
        text, spans = self._render(hay, cut, at)
        return self._span(text, spans[self.content.needle])[0]

    def _place(self, hay: Haystack, cut: int, depth: float) -> Prompt:
        """Put the asked needle at the sentence boundary whose first token is nearest the asked depth."""
        places = hay.boundaries(cut)
        first, last = (self._needle_start(hay, cut, b) for b in (places[0], places[-1]))
        target = first + depth / 100 * (last - first)
        lo, hi = 0, len(places) - 1
        while lo < hi:                          # the first place whose needle starts at or after the target
            mid = (lo + hi) // 2
            if self._needle_start(hay, cut, places[mid]) < target:
                lo = mid + 1
            else:
                hi = mid
        best = min({lo, max(lo - 1, 0)},
                   key=lambda i: (abs(self._needle_start(hay, cut, places[i]) - target), i))
        text, spans = self._render(hay, cut, places[best])
        needle = self._span(text, spans[self.content.needle])
        landed = 100.0 * (needle[0] - first) / (last - first) if last > first else 0.0
        context = text[:len(text) - len(self.content.question)]
        question = self.count(context.rstrip())
        followups = tuple((tuple(self.tokenize(context + q)[question:]), answers)
                          for q, answers in self.content.followups)
        return Prompt(task=self.task, text=text, ids=list(self.tokenize(text)), answers=self.content.answers,
                      depth=float(depth), needle=needle, needle_depth=round(landed, 2),
                      distractors=tuple(self._span(text, spans[d]) for d in self.content.distractors),
                      question_start=question, followups=followups)


# -- llama.cpp's passkey prompt by filler groups (kept for tests/test_snapkv_retrieval.py) -----------------
INTRO = PASSKEY_INTRO + " "
FILLER = " ".join(PASSKEY_FILLER) + " "
QUESTION = PASSKEY_QUESTION


def passkey_prompt(key: int, n_filler: int, depth: int) -> str:
    """`depth` filler sentence groups before the key, n_filler - depth after it (llama.cpp's construction)."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return INTRO + FILLER * depth + needle + FILLER * (n_filler - depth) + QUESTION


def passkey_trials(count: int, n_filler: int, seed: int = 0) -> list[tuple[int, str]]:
    """(key, prompt) pairs with keys and depths drawn from a seeded generator."""
    rng = random.Random(seed)
    trials = []
    for _ in range(count):
        key, depth = rng.randint(10000, 99999), rng.randint(0, n_filler)
        trials.append((key, passkey_prompt(key, n_filler, depth)))
    return trials
