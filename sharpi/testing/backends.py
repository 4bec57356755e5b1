"""Comparing one artifact against another (a GPU backend against the CPU one): the rules the backend issues
state, as functions tests and benchmark scripts share."""
from __future__ import annotations

import numpy as np

NEAR_TIE = 1e-3       # a step whose reference top-2 logit margin is below this may go either way


def greedy_agrees(ref_logits, got_logits, ref_tokens) -> tuple[bool, int]:
    """Whether argmax(got) equals the reference's token at every step, up to the first step where the
    reference's top-2 margin is below NEAR_TIE; returns (agrees, steps compared)."""
    for step, (r, g, token) in enumerate(zip(ref_logits, got_logits, ref_tokens)):
        top2 = np.sort(r)[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            return True, step
        if int(np.argmax(g)) != token:
            return False, step
    return True, len(ref_tokens)


def snapkv_agreement(model, reference, prompt, budget: int, steps: int = 16, **knobs) -> dict:
    """Prefill `prompt` with a SnapKV budget on both models, then decode greedily (the reference's tokens fed to
    both): evicted flags, per-layer lengths, logical lengths, the overlap of kept positions (fraction of the
    reference's kept slots that `model` kept too), and whether decode agrees under the near-tie rule."""
    with model.session(snapkv_budget=budget, **knobs) as a, reference.session(snapkv_budget=budget, **knobs) as b:
        la, lb = a.prefill(prompt), b.prefill(prompt)
        same = sum(np.intersect1d(x, y).size for pa, pb in zip(a.kept_positions, b.kept_positions)
                   for x, y in zip(pa, pb))
        result = {"evicted": (a.evicted, b.evicted), "kv_length": (a.kv_length, b.kv_length),
                  "logical_length": (a.logical_length, b.logical_length),
                  "overlap": same / max(1, sum(p.size for p in b.kept_positions))}
        ref_tokens, ref_logits, got_logits = [], [], []
        for _ in range(steps):
            token = int(np.argmax(lb))
            ref_tokens.append(token)
            ref_logits.append(lb)
            got_logits.append(la)
            la, lb = a.decode(token), b.decode(token)
        result["decode_agrees"], result["steps_compared"] = greedy_agrees(ref_logits, got_logits, ref_tokens)
    return result
