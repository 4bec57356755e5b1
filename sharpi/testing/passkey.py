"""The passkey retrieval prompt of llama.cpp's examples/passkey, for tests and evaluation."""
from __future__ import annotations

import random

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there. ")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(key: int, n_filler: int, depth: int) -> str:
    """`depth` filler sentences groups before the key, n_filler - depth after it."""
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
