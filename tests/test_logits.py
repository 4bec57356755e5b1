"""Teacher-forced logits of the compiled model against the exact numpy reference and against llama.cpp."""
import numpy as np

from sharpi.testing.reference import log_softmax


def _next_token_logprobs(lp, ids):
    return np.array([lp[i, ids[i + 1]] for i in range(len(ids) - 1)])


def test_score_matches_numpy_reference(smollm2, golden, reference_logprobs):
    ids = golden["teacher_forced"]["ids"]
    lp = log_softmax(smollm2.score(ids))
    assert lp.shape == (len(ids), smollm2.config.vocab_size)
    top1 = (lp.argmax(-1) == reference_logprobs.argmax(-1)).mean()
    diff = np.abs(_next_token_logprobs(lp, ids) - _next_token_logprobs(reference_logprobs, ids)).mean()
    assert top1 >= 0.995, top1
    assert diff <= 0.01, diff


def test_score_matches_llama_cpp_statistically(smollm2, golden):
    tf = golden["teacher_forced"]
    ids = tf["ids"]
    lp = log_softmax(smollm2.score(ids))
    top1 = (lp.argmax(-1) == np.array([t[0] for t in tf["top5_ids"]])).mean()
    ppl = float(np.exp(-_next_token_logprobs(lp, ids).mean()))
    assert top1 >= 0.96, top1
    assert abs(ppl - tf["perplexity"]) / tf["perplexity"] <= 0.01, (ppl, tf["perplexity"])
