"""Retrieval survives eviction: seeded passkey prompts of ~1000 tokens, one prefill each, forked per budget (the
full sweeps over length, depth and budget are `sharpi eval`'s, in benchmarks/longcontext.md)."""
import numpy as np

from sharpi.testing.passkey import passkey_trials

BUDGETS = (256, 128)
TRIALS, FILLER = 6, 40          # ~1000-token prompts: ~1/4 of the prefill work of 10 x 2000, which CI time needed
SEED_SETTING = {"granularity": "shared", "pooling": "none", "kernel": 1}   # the seed's plain selection


def _answer(session, logits, model, steps=8) -> str:
    token, out = int(np.argmax(logits)), []
    for _ in range(steps):
        out.append(token)
        token = int(np.argmax(session.decode(token)))
    return model.detokenize(out)


def _run(base, logits, model, budget=None, **knobs) -> str:
    with base.fork() as fork:
        if budget is not None:
            assert fork.evict(budget, **knobs)
            assert fork.kv_length == [budget] * model.config.n_layers
        return _answer(fork, logits, model)


def test_passkey_survives_eviction(smollm2, record_property):
    hits = {"full": 0, **{f"default@{b}": 0 for b in BUDGETS}, **{f"seed@{b}": 0 for b in BUDGETS}}
    trials = passkey_trials(TRIALS, FILLER, seed=0)
    for key, prompt in trials:
        ids = smollm2.tokenize(prompt)
        assert 900 <= len(ids) <= 1200
        with smollm2.session(snapkv_budget=0) as base:
            logits = base.prefill(ids, keep_scores=True)
            hits["full"] += str(key) in _run(base, logits, smollm2)
            for b in BUDGETS:
                hits[f"default@{b}"] += str(key) in _run(base, logits, smollm2, b)
                hits[f"seed@{b}"] += str(key) in _run(base, logits, smollm2, b, **SEED_SETTING)
    record_property(f"passkey_hits_of_{TRIALS}", hits)
    print(f"passkey hits of {TRIALS}:", hits)
    assert hits["full"] >= TRIALS - 1
    for b in BUDGETS:
        assert hits[f"default@{b}"] >= hits["full"] - 1, hits
    assert hits[f"seed@{BUDGETS[-1]}"] < hits[f"default@{BUDGETS[-1]}"], hits   # what pooling + per-head sets buy
