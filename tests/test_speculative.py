"""Speculative decoding (sharpi.runtime.speculative): verification of drafted tokens in one forward, the rollback of
rejected ones, both drafters, and exactness against plain decoding: token for token on the float path, the
conformance rule (equal wherever plain decoding's top two differ by more than the tolerance) on rounded caches
and int8 matmuls, the model's own distribution when sampling."""
from __future__ import annotations

import math

import numpy as np
import pytest

import sharpi
from sharpi.common.errors import ConfigError
from sharpi.runtime.sampling import Sampler, SamplingParams
from sharpi.runtime.speculative import Draft, PromptLookup, accept
from sharpi.testing.conformance import tolerance_for
from sharpi.testing.reference import log_softmax
from tiny_gguf import write_tiny_llama
from vulkan_device import on_vulkan

FORCED = {"max_draft": 4, "adaptive": False}     # every step verifies what the lookup finds (up to 4)
SHAPE = dict(matrix_type="Q8_0", layers=2, dim=128, heads=4, kv_heads=2)   # head_dim 32: every KV type fits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    return write_tiny_llama(folder / "tiny.gguf", **SHAPE)


@pytest.fixture(scope="module")
def compiled(tiny, tmp_path_factory):
    """sharpi.load(compile(tiny, **options)), once per distinct options in this module."""
    models = {}

    def get(**options):
        key = tuple(sorted(options.items()))
        if key not in models:
            out = tmp_path_factory.mktemp("art")
            options.setdefault("matmuls", "float")
            models[key] = on_vulkan(lambda: sharpi.load(sharpi.compile(str(tiny), output=out / "a", **options)))
        return models[key]
    return get


def _prompt(vocab: int, seed: int = 0) -> list[int]:
    """Random ids with a repeated stretch, so that lookups find matches (a random model's greedy text loops too)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, 30).tolist()
    return base + base[:20] + rng.integers(0, vocab, 10).tolist() + base


def _plain_greedy(model, prompt, n, **knobs):
    """Plain greedy decoding's tokens and, per step, the gap between its best and second log-probability."""
    tokens, gaps = [], []
    with model.session(**knobs) as s:
        logits = s.prefill(prompt)
        for _ in range(n):
            lp = log_softmax(logits)
            top = np.sort(lp)[-2:]
            tokens.append(int(np.argmax(lp)))
            gaps.append(top[1] - top[0])
            logits = s.decode(tokens[-1])
    return tokens, gaps


def _assert_same_or_near_tie(model, prompt, got, n, **knobs):
    """Speculative tokens equal plain decoding's up to the first step whose top two are within the tolerance."""
    want, gaps = _plain_greedy(model, prompt, n, **knobs)
    near_tie = tolerance_for(model.manifest).near_tie
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] <= near_tie, f"token {i}: {a} against plain {b}, top-2 gap {gaps[i]:.4f}"
            return
    assert len(got) == len(want)


def test_lookup_greedy_is_plain_decoding_token_for_token(compiled):
    model = compiled()
    prompt = _prompt(model.config.vocab_size)
    plain = model.generate(prompt, 60)
    for speculative in ("lookup", FORCED, {"max_draft": 16, "ngram_min": 1, "adaptive": False}):
        spec = model.generate(prompt, 60, speculative=speculative)
        assert spec.token_ids == plain.token_ids, speculative
    assert spec.stats["verifications"] > 0 and 0 < spec.stats["accepted_tokens"] < spec.stats["drafted_tokens"]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A one-layer random model of the same vocabulary: a draft model whose drafts are sometimes right."""
    folder = tmp_path_factory.mktemp("draft")
    path = write_tiny_llama(folder / "draft.gguf", seed=7, **{**SHAPE, "layers": 1})
    return sharpi.load(sharpi.compile(str(path), output=folder / "a", matmuls="float"))


@pytest.mark.parametrize("kv", [("f16", "q8_0"), ("bf16", "q4_0"), ("q4_ch", "q8_0"), ("tq3", "tq4")],
                         ids="/".join)
def test_both_drafters_on_every_cache_type(compiled, drafter, kv):
    model = compiled(kv_dtype=kv[0], kv_dtype_v=kv[1])
    prompt = _prompt(model.config.vocab_size, seed=1)
    spec = model.generate(prompt, 48, speculative=FORCED)
    assert spec.stats["accepted_tokens"] > 0 and spec.stats["accepted_tokens"] < spec.stats["drafted_tokens"]
    _assert_same_or_near_tie(model, prompt, spec.token_ids, 48)
    drafted = model.generate(prompt, 48, draft=drafter, speculative={"max_draft": 3, "adaptive": False})
    assert drafted.stats["verifications"] > 0
    _assert_same_or_near_tie(model, prompt, drafted.token_ids, 48)


def test_lookup_with_int8_matmuls(tiny_artifact):
    model = sharpi.load(tiny_artifact)
    prompt = _prompt(model.config.vocab_size, seed=2)
    spec = model.generate(prompt, 48, speculative=FORCED)
    assert spec.stats["verifications"] > 0
    _assert_same_or_near_tie(model, prompt, spec.token_ids, 48)


@pytest.mark.parametrize("compress", ["snapkv", "keydiff"])
def test_both_drafters_after_compaction(compiled, compress):
    """On a cache SnapKV compacted (or a query-agnostic scorer's keep set): drafts append after the kept slots and
    their rollback leaves the kept ones alone."""
    model = compiled()
    knobs = dict(snapkv_budget=48, snapkv_window=8, snapkv_recency=8, compress=compress)
    drafted = accepted = 0
    for seed in (3, 6):
        prompt = _prompt(model.config.vocab_size, seed=seed)
        spec = model.generate(prompt, 40, speculative=FORCED, **knobs)
        assert spec.stats["evicted"] and spec.stats["kv_slots_after_prefill"] == 48
        plain = model.generate(prompt, 40, **knobs).token_ids
        assert spec.token_ids == plain
        assert model.generate(prompt, 40, draft=model, speculative={"max_draft": 4, "adaptive": False},
                              **knobs).token_ids == plain
        drafted, accepted = drafted + spec.stats["drafted_tokens"], accepted + spec.stats["accepted_tokens"]
    assert 0 < accepted < drafted


def test_lookup_with_sliding_window_layers(tmp_path):
    """A sliding-window model: its window layers keep the slots a rollback needs (SequenceCache.slack)."""
    path = write_tiny_llama(tmp_path / "swa.gguf", sliding_window=8, **SHAPE)
    model = sharpi.load(sharpi.compile(str(path), output=tmp_path / "swa", matmuls="float"))
    prompt = _prompt(model.config.vocab_size, seed=4)
    spec = model.generate(prompt, 48, speculative=FORCED)
    assert spec.stats["accepted_tokens"] < spec.stats["drafted_tokens"]
    assert spec.token_ids == model.generate(prompt, 48).token_ids


def _held(pool, pages: list[int], held: int) -> np.ndarray:
    """What a layer's pages hold that matters: the rows of its first `held` slots, and with page-scaled keys the
    last page's key rows whole (its scales are spread over every row)."""
    data = pool.read_pages(pages)                                       # [pages, parts, kv_heads, page, row]
    rows = data.transpose(0, 3, 1, 2, 4).reshape(-1, *data.shape[1:3], data.shape[4])[:held]
    return np.concatenate([rows.ravel(), data[-1, 0].ravel() if pool.kv_format.page_scaled_keys else []])


@pytest.mark.parametrize("kv", [("f32", "f32"), ("q4_ch", "q8_0")], ids="/".join)
def test_rollback_returns_pages_and_bytes(compiled, kv):
    """verify() then rollback() of every verified token: the pool's pages, the cache's lengths and the bytes of
    every held slot (q4_ch's page-scaled keys: the whole last page) are as before, and the next decode is the
    same; the verification's first row is that decode's logits (within the cache type's tolerance)."""
    model = compiled(kv_dtype=kv[0], kv_dtype_v=kv[1])
    pool = model.engine.pool
    prompt = _prompt(model.config.vocab_size, seed=5)[:37]       # the last page part full
    with model.session() as s:
        s.prefill(prompt)
        used, lengths, pages = pool.used_count, s.kv_length, [list(p) for p in s.cache.pages]
        before = [_held(pool, p, len(prompt)) for p in pages]
        with s.fork() as reference:
            want = reference.decode(7)
        rows = s.verify([7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])        # crosses into a new page
        assert rows.shape == (12, model.config.vocab_size) and pool.used_count > used
        s.rollback(12)
        assert pool.used_count == used and s.kv_length == lengths and s.logical_length == len(prompt)
        for layer, layer_pages in enumerate(s.cache.pages):
            assert layer_pages == pages[layer]
            np.testing.assert_array_equal(_held(pool, layer_pages, len(prompt)), before[layer])
        np.testing.assert_allclose(s.decode(7), want, rtol=1e-5, atol=1e-5)
        tolerance = tolerance_for(model.manifest).logprob_atol
        assert np.abs(log_softmax(rows[0]) - log_softmax(want)).max() <= tolerance
        with pytest.raises(ConfigError, match="roll back"):
            s.rollback(len(prompt) + 5)


@pytest.mark.parametrize("kv", [("f32", "f32"), ("q4_ch", "q8_0")], ids="/".join)
def test_feed_batch_verifies_each_sessions_own_drafts(compiled, kv):
    """Several sessions, each its own count of tokens, in one call (q4_ch: one verify each, its pages encoded
    whole): every session's rows are those of its own verify, and each rolls back as after it."""
    from sharpi.runtime.session import feed_batch
    model = compiled(kv_dtype=kv[0], kv_dtype_v=kv[1])
    rng = np.random.default_rng(12)
    sessions = [model.session() for _ in range(3)]
    drafts = [rng.integers(0, model.config.vocab_size, k).tolist() for k in (5, 1, 8)]
    forks = []
    try:
        for s, n in zip(sessions, (37, 20, 50)):
            s.prefill(rng.integers(0, model.config.vocab_size, n).tolist())
        forks = [s.fork() for s in sessions]
        want = [f.verify(d) for f, d in zip(forks, drafts)]
        got = feed_batch(sessions, drafts)
        tolerance = tolerance_for(model.manifest).logprob_atol
        for g, w in zip(got, want):
            assert np.abs(log_softmax(g) - log_softmax(w)).max() <= tolerance
        for s, d in zip(sessions + forks, drafts + drafts):
            s.rollback(len(d) - 1)
        assert [s.logical_length for s in sessions] == [f.logical_length for f in forks] == [38, 21, 51]
    finally:
        for s in sessions + forks:
            s.close()


def test_rollback_refuses_what_an_eviction_dropped(compiled):
    model = compiled()
    prompt = _prompt(model.config.vocab_size, seed=6)
    with model.session(snapkv_budget=48, snapkv_window=8, snapkv_recency=8) as s:
        s.prefill(prompt)
        s.verify([1, 2, 3])
        s.rollback(2)
        s.rollback(3)              # the recency kept the last prompt positions: they roll back too
        with pytest.raises(ConfigError, match="no longer holds"):
            s.rollback(20)


def test_draft_model_greedy_is_plain_decoding(compiled, drafter):
    """A draft model of the same vocabulary (another random model, given by its directory): greedy output is plain
    decoding's; the model drafting for itself has every draft accepted."""
    model = compiled()
    prompt = _prompt(model.config.vocab_size, seed=8)
    plain = model.generate(prompt, 40)
    spec = model.generate(prompt, 40, draft=str(drafter.path), speculative={"max_draft": 3, "adaptive": False})
    assert spec.token_ids == plain.token_ids and spec.stats["verifications"] > 0
    itself = model.generate(prompt, 40, draft=model, speculative={"max_draft": 5, "adaptive": False})
    assert itself.token_ids == plain.token_ids
    assert itself.stats["accepted_tokens"] == itself.stats["drafted_tokens"] > 30


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square test of observed counts against probabilities (categories expected < 5 pooled), its p
    by the Wilson-Hilferty approximation of the chi-square distribution (within ~1e-3 of the exact p from 3
    degrees of freedom; scipy is not a dependency)."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic, df = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("drafter", ["chosen", "sampled"])
def test_sampling_follows_the_models_distribution(compiled, drafter):
    """The rejection rule on a verification's real logits: over 2,000 seeded trials the first token that comes out
    (a kept draft or the resampled one) is distributed as the model's sampler is (chi-square p > 0.01), for a
    draft chosen (a lookup's, q one-hot) and one sampled from a draft distribution q."""
    model = compiled()
    prompt = _prompt(model.config.vocab_size, seed=9)
    params = SamplingParams(temperature=1.5, top_k=12, seed=0)
    with model.session() as s:
        s.prefill(prompt)
        rows = s.verify([5, 6, 7])
    target = Sampler(params).distribution(rows[0], prompt + [5], [5])
    likely = int(np.argsort(target)[-2])                   # a plausible draft: kept about as often as refused
    q = np.roll(target, 1) * 0.5 + target * 0.5 if drafter == "sampled" else None
    counts = np.zeros(target.size)
    for seed in range(2000):
        sampler = Sampler(SamplingParams(temperature=1.5, top_k=12, seed=seed))
        d = int(sampler.rng.choice(q.size, p=q)) if q is not None else likely
        draft = Draft([d, 6], None if q is None else [q, q])
        kept, following = accept(sampler, rows, draft, prompt + [5], [5])
        counts[d if kept else following] += 1
    assert _chi_square_p(counts, target) > 0.01
    assert counts[target == 0].sum() == 0


def test_prompt_lookup_finds_the_latest_longest_match():
    lookup = PromptLookup(ngram_min=2, ngram_max=3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert lookup.propose(tokens, 3).tokens == [4, 5, 7]          # "2 3" last ended at index 7
    assert lookup.propose(tokens + [4], 2).tokens == [5, 7]       # "2 3 4" (3 tokens) wins over shorter ones
    assert lookup.propose([1, 2, 3, 4], 3).tokens == []


def test_bad_speculative_values(compiled, tmp_path):
    model = compiled()
    with pytest.raises(ConfigError, match="max_draft"):
        model.generate([1, 2, 3], 4, speculative={"max_draft": 0})
    with pytest.raises(ConfigError, match="speculative must be one of"):
        model.generate([1, 2, 3], 4, speculative="medusa")
    with pytest.raises(ConfigError, match="needs a draft model"):
        model.generate([1, 2, 3], 4, speculative="draft")
    with pytest.raises(ConfigError, match="not a directory"):
        model.generate([1, 2, 3], 4, draft=str(tmp_path / "missing"))
    other = write_tiny_llama(tmp_path / "vocab.gguf", seed=3, merges=("a b",), **SHAPE)
    foreign = sharpi.compile(str(other), output=tmp_path / "foreign", matmuls="float")
    with pytest.raises(ConfigError, match="another vocabulary"):
        model.generate([1, 2, 3], 4, draft=str(foreign))
    with model.session() as s:
        with pytest.raises(ConfigError, match="prefill"):
            s.verify([1, 2])


def test_both_drafters_on_vulkan(compiled, drafter):
    model = compiled(target="vulkan")
    prompt = _prompt(model.config.vocab_size, seed=10)
    spec = model.generate(prompt, 40, speculative=FORCED)
    assert spec.stats["accepted_tokens"] < spec.stats["drafted_tokens"]
    _assert_same_or_near_tie(model, prompt, spec.token_ids, 40)
    drafted = model.generate(prompt, 40, draft=drafter, speculative={"max_draft": 3, "adaptive": False})
    assert drafted.stats["verifications"] > 0
    _assert_same_or_near_tie(model, prompt, drafted.token_ids, 40)


def test_adaptive_lookup_stops_drafting_where_drafts_miss(compiled):
    """Where the lookup's drafts are never right (every proposal made wrong), the adaptive length soon verifies one
    at most (on this tiny model a verification of two tokens costs what a decode step does, so one still pays:
    DraftLength's arithmetic is tested below with a real model's costs); the output is plain decoding's."""
    from sharpi.common.speculative_settings import SpeculativeSettings
    from sharpi.runtime.speculative import Stepper

    class Wrong(PromptLookup):
        def propose(self, tokens, k):
            draft = super().propose(tokens, k)
            draft.tokens = [(t + 1) % 7 for t in draft.tokens]
            return draft

    model = compiled()
    prompt = _prompt(model.config.vocab_size, seed=11)
    with model.session() as s:
        out = [int(np.argmax(s.prefill(prompt)))]
        stepper = Stepper(s, Sampler(SamplingParams()), SpeculativeSettings(method="lookup"), Wrong())
        while len(out) < 60:
            out += [t for t, _ in stepper.step(out[-1], prompt + out, out, 60 - len(out))]
    assert out == model.generate(prompt, 60).token_ids
    assert stepper.stats.accepted == 0 and stepper.stats.drafted <= stepper.stats.verifications + 6


def test_draft_length_weighs_acceptance_against_forward_times():
    """With Qwen2.5-Coder-0.5B's measured costs on a CPU (a verification ~2.6x a decode step): no drafts at an
    acceptance of 0.3, the most at 0.97; with GPU-like costs (verification ~1.1x) drafts pay at 0.3."""
    from sharpi.runtime.engine import ForwardTimes
    from sharpi.runtime.speculative import DraftLength

    def chosen(verify_cost: float, acceptance: float) -> int:
        times = ForwardTimes()
        times.record("decode", 1, 1.0)
        for n in (2, 9, 17):
            times.record("prefill_logits", n, verify_cost + 0.06 * (n - 2))
        length = DraftLength(times, 16)
        for i in range(100):                  # one drafted token a step, accepted `acceptance` of the time
            length.observe(3, 1, int((i + 1) * acceptance) - int(i * acceptance))   # evenly spread
        assert length.acceptance(3) == pytest.approx(acceptance, abs=0.1)
        return length.choose(16, 3, PromptLookup())

    assert chosen(2.6, 0.3) == 0 and chosen(2.6, 0.6) == 0
    assert chosen(2.6, 0.97) >= 12 and chosen(1.1, 0.3) >= 1


def test_cli_run_speculative_and_bad_flags(tiny_artifact, tmp_path, capsys):
    """`sharpi run --speculative lookup` prints plain decoding's text (the tiny model's float32 matmuls where the
    CPU lacks AVX2, else int8: the same either way here) and what it accepted; bad values exit 2 in one line."""
    from sharpi.cli import main as main_cli

    def run(*argv):
        code = main_cli.main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    prompt = "abcdefgh abcdefgh abcdefgh abcdefgh abcdefgh abcd"
    code, plain, _ = run("run", tiny_artifact, "-p", prompt, "--raw", "-n", "40")
    assert code == 0
    code, spec, err = run("run", tiny_artifact, "-p", prompt, "--raw", "-n", "40", "--speculative", "lookup",
                          "--draft-max", "6", "--verbose")
    assert code == 0 and "[speculative lookup:" in err
    assert spec == plain
    for argv, words in ((["--speculative", "medusa"], "speculative must be one of"),
                        (["--draft-max", "0"], "--draft-max must be"),
                        (["--draft", tmp_path / "none"], "is not a sharpi artifact")):
        code, out, err = run("run", tiny_artifact, "-p", prompt, *argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
