"""The conformance suite: what every compiled artifact must satisfy, as plain functions.

`sharpi check DIR` (sharpi/cli/check.py), the pytest plugin (`python -m pytest --sharpi-artifact DIR`,
sharpi/testing/pytest_plugin.py) and `sharpi-compile --check` all run these checks; each `check_*` function
returns a one-line detail when it passes and raises `CheckFailed` (an AssertionError whose message starts with the
check's name) when it does not, or `CheckSkipped` when it does not apply to the artifact (e.g. SnapKV checks on an
artifact compiled with `--snapkv off`).

    from sharpi.testing import conformance
    results = conformance.Suite("smollm2-llvm").run_all()      # [CheckResult(name, status, detail, seconds)]
    print(conformance.format_table(results))

The checks, in order (CHECKS):
  loads                          the manifest reads, every file matches its hash, the backend opens
  tokenizer_round_trip           detokenize(tokenize(s)) == s on fixed strings; EOS as a special token
  teacher_forced_logits          one model.score over the prompt and the greedy tokens against the reference: max
                                 |d log-prob| over every position and vocabulary entry <= the target's tolerance,
                                 and the same argmax wherever the reference's top-2 margin exceeds twice that
  greedy_kv_cache                N greedy tokens through the KV cache (prefill, decode, ...) are the argmax of that
                                 teacher-forced score (a token within the near-tie margin of the maximum counts),
                                 and the cached logits equal the recomputed ones within tolerance
  snapkv_invariants              after an evicting prefill: evicted, kv_length == budget in every layer,
                                 logical_length == prompt length, kept_positions [kv_heads, budget] strictly
                                 ascending, in range, ending with the recency positions; after one decode the new
                                 token sits at the true position
  snapkv_decode_after_compaction the logits before eviction and of the token decoded after it equal the reference's
                                 (decode over exactly the kept positions, RoPE'd at their true positions)
  kv_bytes_after_compaction      kv_bytes == sum over layers of ceil(kv_length / page_size) * page bytes after
                                 SnapKV's compaction and the decode after it (an explicit compact() without the ops)

The suite shares work between checks (one greedy run, one teacher-forced score, one SnapKV run), because a
software Vulkan device takes tens of seconds per prefill.

References (`reference=`): "numpy" is sharpi.testing.reference.NumpyReference on the artifact's source GGUF (exact
float32; llama family and gemma3); "cpu" is an llvm artifact of the same GGUF compiled with sharpi.compile (cached).
The GGUF is found from the manifest's source record (name, sha256, size): the paths given (`gguf=`,
`--sharpi-gguf`), then the known models in $SHARPI_HOME/models, then the artifact's own directory and its parent.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..common import kv_codecs
from ..common.targets import DEFAULT_TARGET, target_spec
from .backends import NEAR_TIE
from .options import REFERENCES
from .reference import log_softmax

CHECKS = ("loads", "tokenizer_round_trip", "teacher_forced_logits", "greedy_kv_cache", "snapkv_invariants",
          "snapkv_decode_after_compaction", "kv_bytes_after_compaction")

# About 24 tokens: short enough for the numpy reference and for lavapipe, longer than a KV page (16 slots), so a
# compaction to half of it frees a page in every layer.
DEFAULT_PROMPT = ("The quick brown fox jumps over the lazy dog. Water boils at 100 degrees. "
                  "The capital of France is")
DECODE_TOKENS = 16

ROUND_TRIP_STRINGS = (
    "Hello, world!", " leading space", "two  spaces and\ttab", "line one\nline two\n\n",
    "Numbers: 3.14159, 2048, -7", "Ünïcödé: café, naïve, Straße", "日本語のテキスト", "emoji 🦙🚀",
    "def f(x):\n    return x ** 2  # code", "   ", "a", DEFAULT_PROMPT,
)


# -- results ---------------------------------------------------------------------------------------------------
class CheckFailed(AssertionError):
    """A check that did not hold; str() is "<check>: <what was wrong>"."""

    def __init__(self, check: str, detail: str):
        super().__init__(f"{check}: {detail}")
        self.check, self.detail = check, detail


class CheckSkipped(Exception):
    """A check that does not apply to this artifact; str() says why."""


@dataclass
class CheckResult:
    name: str
    status: str                  # "PASS", "FAIL" or "SKIP"
    detail: str
    seconds: float = 0.0
    error: BaseException | None = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.status == "PASS"


def _require(condition, check: str, detail: str) -> None:
    if not condition:
        raise CheckFailed(check, detail)


# -- tolerances ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """logprob_atol: max |log_softmax(got) - log_softmax(reference)| over every position and vocabulary entry;
    near_tie: a greedy token whose logit is within this of the maximum counts as the argmax."""
    logprob_atol: float
    near_tie: float
    label: str


# Artifacts compiled with --matmuls int8 quantize each quantized matmul's activations to int8 as llama.cpp does.
# Against the float32 reference, the log-probs of ~100 teacher-forced tokens (the default prompt repeated) measured
# up to 1.56 apart over the whole vocabulary on SmolLM2 and 2.83 on Gemma 3 (0.86 on both for the golden text's
# first 100, benchmarks/matmul_accuracy.py) (the far tail moves most: among the top 20 tokens 0.74 and 1.24; the
# median position's worst entry 0.6); 16 greedy decode steps up to 1.0, every greedy token the reference's argmax or
# a near-tie. The golden text's perplexity (SmolLM2) lands within 1% of llama.cpp's 12.749 (12.671-12.753 across
# summation orders of the same arithmetic; 12.765 with the default's f16 KV cache; float32 12.711).
# (log-prob atol, near-tie):
INT8_MATMULS = (4.0, 1.0)

# Quantized KV caches (kv_format), against the float32 reference, max |d log-prob| over the golden texts' ~310
# teacher-forced tokens and the whole vocabulary (benchmarks/kv_quant.md; float matmuls, int8 in brackets): q8_0
# keys and values 0.78 (1.31) SmolLM2, 1.24 (2.62) Gemma 3, 1.66 (1.87) Qwen2.5-Coder-0.5B; q4_0 9.8 (11.1), 21.4
# (15.5), 18.6 (18.0); q8_0 keys with q4_0 values 2.6 (3.3), 4.6 (6.6), 1.87 (2.34). A bound of a few nats still
# checks q8_0; q4_0 moves the far tail so much that a log-prob bound checks little more than that the model runs
# (its perplexity is the measure that counts). q4_ch keys (4 bits per channel over a page) with q8_0 values, int8
# matmuls: 2.55, 8.45 and 1.15 (top 20: 1.58, 2.20, 1.13; top-1 94-96%, q8_0's 95-99%); with q4_0 values 3.53, 5.23,
# 1.75. Each codec holds its (log-prob atol, near-tie) as `tolerance` (q8_0 (4, 1), q4_ch (12, 3), q4_0 (32, 4)); the
# coarser of the two sides' types decides.


def tolerance_for(manifest) -> Tolerance:
    base = _tolerance_for_target(manifest)
    if manifest.target.get("matmuls") == "int8":
        atol, near_tie = INT8_MATMULS
        return Tolerance(max(atol, base.logprob_atol), max(near_tie, base.near_tie), f"{base.label}, int8 matmuls")
    return base


def _tolerance_for_target(manifest) -> Tolerance:
    """The tolerance for an artifact: tight on the CPU (llvm, f32 KV: measured ~1e-4 on SmolLM2 and Gemma 3),
    looser on GPUs (the bound tests/test_vulkan_model.py holds Vulkan to against the CPU), looser still with an f16
    KV cache (measured 0.018 on SmolLM2's 318-token golden text on llvm; tests/test_tiny_models.py allows 2e-2 on
    tiny models)."""
    kind = manifest.target["kind"]
    quantized = [kv_codecs.codec(t).tolerance for t in manifest.kv_types if kv_codecs.codec(t).tolerance]
    if quantized:
        atol, near_tie = max(quantized)
        return Tolerance(atol, near_tie, f"{kind}, {'/'.join(dict.fromkeys(manifest.kv_types))} KV")
    half_kv = str(manifest.kv_dtype) in ("float16", "bfloat16")
    if half_kv:
        return Tolerance(5e-2, 5e-2, f"{kind}, {manifest.kv_dtype} KV")
    if not target_spec(kind).is_gpu:
        return Tolerance(1e-3, NEAR_TIE, f"{kind}, float32 KV")
    return Tolerance(2e-2, 2e-2, f"{kind}, {manifest.kv_dtype} KV")


# -- the reference -------------------------------------------------------------------------------------------------
class ArtifactReference:
    """What the checks compare against: logits(ids) -> float32 [len(ids), vocab] of a fresh sequence, and
    decode_after_compaction(prompt_ids, kept_positions, token) -> float32 [vocab], the logits of `token` fed at
    position len(prompt_ids) after a cache that kept, per layer, only kept_positions ([kv_heads, k])."""
    name = "reference"

    def logits(self, ids) -> np.ndarray:
        raise NotImplementedError

    def decode_after_compaction(self, prompt_ids, kept_positions, token: int) -> np.ndarray:
        raise NotImplementedError


class NumpyArtifactReference(ArtifactReference):
    """The exact float32 numpy forward pass (sharpi.testing.reference.NumpyReference) of the GGUF."""
    name = "numpy"

    def __init__(self, gguf: Path):
        self.gguf = Path(gguf)
        self.numpy = _numpy_reference(str(self.gguf), self.gguf.stat().st_size, self.gguf.stat().st_mtime_ns)

    def logits(self, ids):
        return self.numpy.forward(list(ids))

    def decode_after_compaction(self, prompt_ids, kept_positions, token):
        return self.numpy.decode_after_compaction(list(prompt_ids), kept_positions, int(token))


class CpuArtifactReference(ArtifactReference):
    """An llvm artifact of the same GGUF (compiled with sharpi.compile, so the compile cache makes it cheap
    after the first time); compaction is an explicit compact() of its cache."""
    name = "cpu"

    def __init__(self, gguf: Path):
        import sharpi
        from ..common.settings import sharpi_home

        self.gguf = Path(gguf)
        output = sharpi_home() / "cache" / "conformance-reference" / f"{self.gguf.stem}-{DEFAULT_TARGET}"
        self.artifact = sharpi.compile(str(self.gguf), target=DEFAULT_TARGET, output=output)   # the CPU
        self.model = sharpi.load(self.artifact, pool_sequences=1)

    def logits(self, ids):
        return self.model.score(list(ids))

    def decode_after_compaction(self, prompt_ids, kept_positions, token):
        cfg = self.model.config
        with self.model.session(snapkv_budget=0) as s:
            s.prefill(list(prompt_ids))
            # slots == positions before any eviction; sliding-window layers keep their window as they are
            s.compact([None if cfg.is_local(layer) else np.asarray(keep) for layer, keep in enumerate(kept_positions)])
            return s.decode(int(token))


@functools.lru_cache(maxsize=2)
def _numpy_reference(path: str, size: int, mtime_ns: int):
    from .reference import NumpyReference
    return NumpyReference(path)


def make_reference(kind: str, gguf: Path) -> ArtifactReference:
    if kind == "numpy":
        return NumpyArtifactReference(gguf)
    if kind == "cpu":
        return CpuArtifactReference(gguf)
    from ..common.errors import ConfigError
    raise ConfigError(f"Unknown reference {kind!r}; choose one of {', '.join(REFERENCES)}.")


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    from ..common.manifest import file_sha256
    return file_sha256(Path(path))


def _same_file(path: Path, source: dict) -> bool:
    st = path.stat()
    if source.get("size") is not None and st.st_size != source["size"]:
        return False
    return _sha256(str(path), st.st_size, st.st_mtime_ns) == source.get("sha256")


def find_gguf(artifact: Path, manifest, candidates=()) -> Path:
    """The GGUF the artifact was compiled from (same sha256 as its manifest records): one of `candidates`, a
    known model in $SHARPI_HOME/models, or a file of the recorded name beside the artifact; else a ConfigError
    that says what to pass."""
    from ..common.errors import ConfigError
    from ..frontend.fetch import KNOWN_MODELS, models_dir

    source = manifest.source or {}
    name, sha = source.get("name", "?"), source.get("sha256", "?")
    given = [Path(c).expanduser() for c in candidates if c]
    for path in given:
        if path.is_file() and _same_file(path, source):
            return path
    for known in KNOWN_MODELS.values():
        if known.sha256 == sha:
            path = models_dir() / known.filename
            if path.is_file() and _same_file(path, source):
                return path
    for folder in (Path(artifact), Path(artifact).parent, Path.cwd()):
        path = folder / name
        if path.is_file() and _same_file(path, source):
            return path
    tried = "; ".join(f"{p} ({'missing' if not p.is_file() else 'a different file'})" for p in given)
    raise ConfigError(f"No reference GGUF for {artifact}: it was compiled from {name} (sha256 {sha[:16]}...), "
                      f"which is not in {models_dir()} nor beside the artifact"
                      + (f"; given: {tried}" if tried else "")
                      + "; pass its path with --gguf PATH (sharpi check), --sharpi-gguf PATH (pytest) or "
                      "Suite(gguf=...).")


# -- the checks ------------------------------------------------------------------------------------------------
def check_loads(artifact, **load_options):
    """The manifest reads, every file matches the hash the manifest records, and the backend opens it; returns
    (model, detail)."""
    import sharpi
    from ..common.errors import SharpiError

    started = time.perf_counter()
    try:
        model = sharpi.load(artifact, **load_options)
    except SharpiError as exc:
        raise CheckFailed("loads", str(exc)) from None
    return model, f"{model.backend} in {time.perf_counter() - started:.1f} s"


def check_tokenizer_round_trip(model, strings=ROUND_TRIP_STRINGS) -> str:
    """Every string comes back from detokenize(tokenize(s)); ids are in the vocabulary; EOS, written as text,
    tokenizes to its one id with special=True."""
    name, vocab = "tokenizer_round_trip", model.config.vocab_size
    for text in strings:
        ids = model.tokenize(text, add_bos=False)
        _require(all(0 <= i < vocab for i in ids), name, f"{text!r} tokenized to ids outside [0, {vocab})")
        back = model.detokenize(ids, special=True)
        _require(back == text, name, f"{text!r} -> {ids[:12]}{'...' if len(ids) > 12 else ''} -> {back!r}")
    info = model.tokenizer.info
    extra = ""
    if info.eos_token and info.eos_id is not None:
        ids = model.tokenize(info.eos_token, add_bos=False, special=True)
        _require(ids == [info.eos_id], name, f"EOS {info.eos_token!r} tokenized to {ids}, expected [{info.eos_id}]")
        back = model.detokenize([info.eos_id], special=True)
        _require(back == info.eos_token, name, f"EOS id {info.eos_id} detokenized to {back!r}")
        extra = f" and EOS {info.eos_token!r}"
    return f"{len(strings)} strings{extra}"


def compare_logits(got, expected, tolerance: Tolerance, check: str, what: str) -> str:
    """max |d log-prob| over every row and vocabulary entry <= tolerance.logprob_atol, and the same argmax in
    every row whose reference top-2 margin exceeds twice that; returns the measured numbers."""
    got, expected = np.atleast_2d(np.asarray(got)), np.atleast_2d(np.asarray(expected))
    _require(got.shape == expected.shape, check, f"{what}: shape {got.shape}, reference {expected.shape}")
    bad = int((~np.isfinite(got)).any(-1).sum())
    _require(bad == 0, check, f"{what}: logits are not finite at {bad} of {len(got)} positions")
    diff = np.abs(log_softmax(got) - log_softmax(expected)).max(-1)
    worst = int(diff.argmax())
    top2 = np.sort(expected, -1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * tolerance.logprob_atol
    same = got.argmax(-1) == expected.argmax(-1)
    wrong = np.flatnonzero(decisive & ~same)
    _require(diff[worst] <= tolerance.logprob_atol, check,
             f"{what}: max |d log-prob| {diff[worst]:.3g} at position {worst} > {tolerance.logprob_atol:g} "
             f"({tolerance.label}); top-1 agrees at {int(same.sum())}/{len(same)} positions")
    _require(wrong.size == 0, check, f"{what}: the argmax differs from the reference's at positions "
                                     f"{wrong[:8].tolist()} (margins > {2 * tolerance.logprob_atol:g})")
    return f"max |d log-prob| {diff[worst]:.1e} <= {tolerance.logprob_atol:g}, top-1 {int(same.sum())}/{len(same)}"


def check_teacher_forced_logits(model, reference: ArtifactReference, ids, tolerance: Tolerance | None = None,
                                logits=None) -> str:
    """model.score(ids) (or `logits`, already computed) against reference.logits(ids) (see compare_logits)."""
    tolerance = tolerance or tolerance_for(model.manifest)
    logits = model.score(ids) if logits is None else logits
    detail = compare_logits(logits, reference.logits(ids), tolerance, "teacher_forced_logits",
                            f"{len(ids)} teacher-forced tokens")
    return f"{len(ids)} tokens vs {reference.name}: {detail}"


def greedy_through_cache(model, ids, steps: int):
    """`steps` greedy tokens from a session (prefill, then decode one at a time, never stopping at EOS) and the
    logits each was the argmax of: (tokens, float32 [steps, vocab])."""
    tokens, logits = [], []
    with model.session(snapkv_budget=0) as s:
        last = s.prefill(ids)
        for step in range(steps):
            logits.append(last)
            tokens.append(int(np.argmax(last)))
            if step + 1 < steps:
                last = s.decode(tokens[-1])
    return tokens, np.stack(logits)


def check_greedy_kv_cache(model, ids, steps: int = DECODE_TOKENS, tolerance: Tolerance | None = None, *,
                          generated=None, full=None) -> str:
    """Greedy decode through the KV cache equals greedy over full recomputation: one teacher-forced score of
    prompt + generated must put each generated token within tolerance.near_tie of its row's maximum (the
    near-tie rule of sharpi.testing.backends.greedy_agrees, applied at every step since the tokens are forced),
    and the cached logits must equal the recomputed ones within tolerance.logprob_atol.

    generated: (tokens, cached logits) of greedy_through_cache, and full: model.score(ids + tokens[:-1]), when
    already computed (the suite shares them with teacher_forced_logits)."""
    name = "greedy_kv_cache"
    tolerance = tolerance or tolerance_for(model.manifest)
    ids = list(ids)
    if generated is None:
        steps = max(1, min(steps, model.max_context - len(ids)))
        generated = greedy_through_cache(model, ids, steps)
    tokens, cached = generated
    steps = len(tokens)
    full = (model.score(ids + tokens[:-1]) if full is None else full)[len(ids) - 1:]
    gaps = full.max(-1) - full[np.arange(steps), tokens]
    near_tie = tolerance.near_tie
    off = np.flatnonzero(gaps > near_tie)
    if off.size:
        step = int(off[0])
        raise CheckFailed(name, f"step {step}: the KV cache chose token {tokens[step]}, full recomputation "
                                f"{int(full[step].argmax())} (by {gaps[step]:.3g} > near-tie {near_tie:g}); "
                                f"generated {model.detokenize(tokens)!r}")
    ties = int(((gaps > 0) & (gaps <= near_tie)).sum())
    compare_logits(cached[:1], full[:1], tolerance, name, "prefill vs recomputed logits")
    if steps > 1:
        compare_logits(cached[1:], full[1:], tolerance, name, "decoded vs recomputed logits")
    worst = float(np.abs(log_softmax(cached) - log_softmax(full)).max())
    return (f"{steps} tokens = recomputed argmax" + (f" ({ties} near-ties)" if ties else "")
            + f"; logits {worst:.1e} apart (<= {tolerance.logprob_atol:g})")


def has_snapkv(model) -> bool:
    return bool((model.manifest.snapkv or {}).get("enabled")) and "prefill_snapkv" in model.manifest.functions


def snapkv_knobs(model, n: int) -> dict:
    """Small SnapKV settings that evict a prompt of n tokens to about half: budget n//2, window <= 8 (and
    <= the compiled window), recency <= 4."""
    if n < 4:
        raise CheckSkipped(f"the prompt has {n} tokens; SnapKV checks need at least 4")
    budget = n // 2
    window = min(8, n - 1, int((model.manifest.snapkv or {}).get("max_window", 8)))
    recency = max(1, min(4, budget - 1))
    return {"snapkv_budget": budget, "snapkv_window": window, "snapkv_recency": recency}


@dataclass
class SnapKVRun:
    """What an evicting prefill of `ids` and one decode after it left behind."""
    ids: list
    knobs: dict
    prefill_logits: np.ndarray
    evicted: bool
    kv_length: list
    logical_length: int
    kept_positions: list
    kv_bytes: int
    token: int
    decode_logits: np.ndarray
    after_decode: dict


def snapkv_run(model, ids) -> SnapKVRun:
    """Prefill `ids` with SnapKV settings that evict (snapkv_knobs), record the state, decode the greedy token."""
    if not has_snapkv(model):
        raise CheckSkipped("the artifact has no SnapKV ops (compiled with --snapkv off or for a model SnapKV "
                           "does not handle yet)")
    ids = list(ids)
    knobs = snapkv_knobs(model, len(ids))
    with model.session(**knobs) as s:
        logits = s.prefill(ids)
        state = dict(evicted=s.evicted, kv_length=s.kv_length, logical_length=s.logical_length,
                     kept_positions=s.kept_positions, kv_bytes=s.kv_bytes)
        token = int(np.argmax(logits))
        decoded = s.decode(token)
        after = dict(kv_length=s.kv_length, logical_length=s.logical_length, kept_positions=s.kept_positions,
                     kv_bytes=s.kv_bytes)
    return SnapKVRun(ids=ids, knobs=knobs, prefill_logits=logits, token=token, decode_logits=decoded,
                     after_decode=after, **state)


def _window_slots(cfg, layer: int, n: int) -> int | None:
    """Slots a sliding-window layer holds after n tokens (its last window - 1: all a later query sees), or None
    for a layer that attends to everything. SnapKV leaves window layers alone."""
    return min(n, cfg.sliding_window - 1) if cfg.is_local(layer) else None


def check_snapkv_invariants(model, ids, run: SnapKVRun | None = None) -> str:
    """The state an evicting prefill of n tokens leaves: evicted; logical_length == n; in every layer that
    attends to everything kv_length == budget and kept_positions [kv_heads, budget] strictly ascending, in [0, n),
    ending with the last `recency` positions (a sliding-window layer holds its window's last positions, untouched);
    after one decode: logical_length n + 1, one slot more per layer (window layers: up to the window), the new slot
    at position n. (A hybrid model's layers here are its attention layers: its DeltaNet layers hold no slots.)"""
    name = "snapkv_invariants"
    run = run or snapkv_run(model, ids)
    cfg, n = model.config, len(run.ids)
    budget, recency = run.knobs["snapkv_budget"], run.knobs["snapkv_recency"]
    _require(run.evicted, name, f"a {n}-token prompt with budget {budget} was not evicted")
    expect = [_window_slots(cfg, l, n) or budget for l in range(cfg.kv_layers)]
    _require(run.kv_length == expect, name, f"kv_length {run.kv_length}, expected {expect}")
    _require(run.logical_length == n, name, f"logical_length {run.logical_length}, expected {n}")
    _require(len(run.kept_positions) == cfg.kv_layers, name,
             f"kept_positions has {len(run.kept_positions)} layers, expected {cfg.kv_layers}")
    for layer, p in enumerate(run.kept_positions):
        p, held = np.asarray(p), expect[layer]
        _require(p.shape == (cfg.n_kv_heads, held), name,
                 f"layer {layer}: kept_positions shape {p.shape}, expected ({cfg.n_kv_heads}, {held})")
        _require(bool((np.diff(p, axis=1) > 0).all()), name, f"layer {layer}: kept_positions not ascending: {p}")
        _require(p.min() >= 0 and p.max() < n, name, f"layer {layer}: kept_positions outside [0, {n}): {p}")
        tail = held if _window_slots(cfg, layer, n) else recency
        _require(bool((p[:, -tail:] == np.arange(n - tail, n)).all()), name,
                 f"layer {layer}: the last {tail} positions were not all kept: {p[:, -tail:]}")
    after = run.after_decode
    expect = [_window_slots(cfg, l, n + 1) or budget + 1 for l in range(cfg.kv_layers)]
    _require(after["kv_length"] == expect, name, f"after one decode kv_length {after['kv_length']}, expected {expect}")
    _require(after["logical_length"] == n + 1, name,
             f"after one decode logical_length {after['logical_length']}, expected {n + 1}")
    last = {int(x) for p in after["kept_positions"] for x in np.asarray(p)[:, -1]}
    _require(last == {n}, name, f"the decoded token's slot records positions {sorted(last)}, expected {n}")
    window = sum(cfg.is_local(l) for l in range(cfg.kv_layers))
    return (f"{n} tokens -> {budget} slots/layer (window {run.knobs['snapkv_window']}, recency {recency})"
            + (f", {window} sliding-window layers untouched" if window else "") + f"; decode at {n}")


def check_snapkv_decode_after_compaction(model, reference: ArtifactReference, ids, run: SnapKVRun | None = None,
                                         tolerance: Tolerance | None = None) -> str:
    """The prefill's logits (computed before eviction) equal the reference's last row, and the token decoded
    after eviction equals the reference's decode over exactly the kept positions at their true positions."""
    name = "snapkv_decode_after_compaction"
    tolerance = tolerance or tolerance_for(model.manifest)
    run = run or snapkv_run(model, ids)
    full = reference.logits(run.ids)
    compare_logits(run.prefill_logits, full[-1], tolerance, name, "prefill logits (before eviction)")
    expected = reference.decode_after_compaction(run.ids, run.kept_positions, run.token)
    detail = compare_logits(run.decode_logits, expected, tolerance, name,
                            f"decode at position {len(run.ids)} over the {run.knobs['snapkv_budget']} kept slots")
    return f"vs {reference.name}: {detail}"


def expected_kv_bytes(model, kv_length, kept_positions=None) -> int:
    """The pages the held slots need times the page's bytes (from the manifest): ceil(length / page_size) per
    layer; a sliding-window layer's slots start at its first held position's offset in its first page. A hybrid
    model's sequence holds its recurrent state besides: every DeltaNet layer's conv window and matrices, f32."""
    m, cfg = model.manifest, model.config
    page_bytes = m.kv_format(cfg).page_bytes
    pages = 0
    for layer, length in enumerate(kv_length):
        offset = 0
        if length and kept_positions is not None and cfg.is_local(layer):
            offset = int(np.asarray(kept_positions[layer])[0, 0]) % m.page_size
        pages += math.ceil((offset + length) / m.page_size)
    return pages * page_bytes + cfg.state_bytes


def check_kv_bytes_after_compaction(model, ids, run: SnapKVRun | None = None) -> str:
    """kv_bytes equals the pages the held slots need times the page size in bytes (expected_kv_bytes): after
    SnapKV's compaction and after the decode that follows it; without SnapKV ops, after a plain prefill and after
    compact() to every other slot (sliding-window layers left alone)."""
    name = "kv_bytes_after_compaction"
    ids = list(ids)
    if run is None and not has_snapkv(model):
        cfg = model.config
        with model.session(snapkv_budget=0) as s:
            s.prefill(ids)
            full, want = s.kv_bytes, expected_kv_bytes(model, s.kv_length, s.kept_positions)
            _require(full == want, name, f"after a {len(ids)}-token prefill kv_bytes {full}, expected {want}")
            s.compact([None if cfg.is_local(layer) else list(range(0, length, 2))
                       for layer, length in enumerate(s.kv_length)])
            got, want = s.kv_bytes, expected_kv_bytes(model, s.kv_length, s.kept_positions)
            _require(got == want, name, f"after compact() to {s.kv_length} slots kv_bytes {got}, expected {want}")
        return f"{full} -> {got} bytes after compact() to every other slot"
    run = run or snapkv_run(model, ids)
    want = expected_kv_bytes(model, run.kv_length, run.kept_positions)
    _require(run.kv_bytes == want, name, f"after eviction to {run.kv_length} slots kv_bytes {run.kv_bytes}, "
                                         f"expected {want} (page size {model.manifest.page_size})")
    after = run.after_decode
    want_after = expected_kv_bytes(model, after["kv_length"], after["kept_positions"])
    _require(after["kv_bytes"] == want_after, name, f"after eviction and one decode kv_bytes {after['kv_bytes']}, "
                                                    f"expected {want_after}")
    return (f"{run.kv_bytes} bytes for {run.knobs['snapkv_budget']} slots/layer after eviction, "
            f"{after['kv_bytes']} after a decode")


# -- the suite -------------------------------------------------------------------------------------------------
class Suite:
    """The checks on one artifact, sharing one loaded model, one reference and one SnapKV run.

    reference: "numpy" or "cpu"; gguf: a path (or paths) to try for the source GGUF; prompt: the text whose
    tokens every check feeds; decode_tokens: greedy steps through the cache."""

    def __init__(self, artifact, reference: str = "numpy", gguf=None, prompt: str = DEFAULT_PROMPT,
                 decode_tokens: int = DECODE_TOKENS, **load_options):
        if reference not in REFERENCES:
            from ..common.errors import ConfigError
            raise ConfigError(f"Unknown reference {reference!r}; choose one of {', '.join(REFERENCES)}.")
        self.artifact = Path(artifact)
        self.reference_kind = reference
        self.gguf_candidates = [gguf] if isinstance(gguf, (str, Path)) else list(gguf or [])
        self.prompt = prompt
        self.decode_tokens = decode_tokens
        self.load_options = {"pool_sequences": 1, **load_options}
        self._model = self._load_error = self._reference = self._reference_error = None
        self._load_detail = ""
        self._snapkv = self._ids = self._greedy = self._scored = None
        self.results: list[CheckResult] = []      # every run() so far, in order

    # lazily built, each once: a failure is remembered and re-raised
    @property
    def model(self):
        if self._model is None and self._load_error is None:
            try:
                self._model, self._load_detail = check_loads(self.artifact, **self.load_options)
            except CheckFailed as exc:
                self._load_error = exc
            except Exception as exc:      # not a SharpiError: still this check's failure, named by its type
                self._load_error = CheckFailed("loads", f"{type(exc).__name__}: {exc}")
        if self._load_error is not None:
            raise CheckSkipped("the artifact did not load (see check 'loads')")
        return self._model

    @property
    def reference(self) -> ArtifactReference:
        if self._reference is None and self._reference_error is None:
            try:
                from ..common.manifest import Manifest
                gguf = find_gguf(self.artifact, Manifest.read(self.artifact), self.gguf_candidates)
                self._reference = make_reference(self.reference_kind, gguf)
            except Exception as exc:
                self._reference_error = exc
        if self._reference_error is not None:
            raise self._reference_error
        return self._reference

    @property
    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = self.model.tokenize(self.prompt)
        return self._ids

    def greedy(self):
        """(tokens, cached logits): decode_tokens greedy steps through the cache, once."""
        if self._greedy is None:
            steps = max(1, min(self.decode_tokens, self.model.max_context - len(self.ids)))
            self._greedy = greedy_through_cache(self.model, self.ids, steps)
        return self._greedy

    def scored(self):
        """(ids, model.score(ids)) for the prompt plus the greedy tokens but the last (just the prompt if the greedy
        run fails): one teacher-forced pass that both teacher_forced_logits and greedy_kv_cache use."""
        if self._scored is None:
            try:
                ids = self.ids + self.greedy()[0][:-1]
            except Exception:
                ids = self.ids
            self._scored = ids, self.model.score(ids)
        return self._scored

    def snapkv(self) -> SnapKVRun:
        if self._snapkv is None:
            self._snapkv = snapkv_run(self.model, self.ids)
        return self._snapkv

    def _check(self, name: str) -> str:
        if name == "loads":
            try:
                self.model
            except CheckSkipped:
                raise self._load_error from None
            return self._load_detail
        model = self.model
        if name == "tokenizer_round_trip":
            return check_tokenizer_round_trip(model)
        if name == "teacher_forced_logits":
            ids, logits = self.scored()
            return check_teacher_forced_logits(model, self._reference_for(name), ids, logits=logits)
        if name == "greedy_kv_cache":
            generated = self.greedy()
            ids, logits = self.scored()
            if len(ids) != len(self.ids) + len(generated[0]) - 1:
                logits = None
            return check_greedy_kv_cache(model, self.ids, generated=generated, full=logits)
        if name == "snapkv_invariants":
            return check_snapkv_invariants(model, self.ids, self.snapkv())
        if name == "snapkv_decode_after_compaction":
            run = self.snapkv()
            return check_snapkv_decode_after_compaction(model, self._reference_for(name), self.ids, run)
        if name == "kv_bytes_after_compaction":
            return check_kv_bytes_after_compaction(model, self.ids, self.snapkv() if has_snapkv(model) else None)
        raise KeyError(f"unknown check {name!r}; the checks are {', '.join(CHECKS)}")

    def _reference_for(self, check: str) -> ArtifactReference:
        try:
            return self.reference
        except Exception as exc:
            raise CheckFailed(check, f"no {self.reference_kind} reference: {exc}") from exc

    def run(self, name: str) -> CheckResult:
        """One check as a CheckResult: PASS with its detail, FAIL with what was wrong (any exception, named by
        its type unless it is a CheckFailed), SKIP with why."""
        started = time.perf_counter()
        try:
            detail, status, error = self._check(name), "PASS", None
        except CheckSkipped as exc:
            detail, status, error = str(exc), "SKIP", exc
        except CheckFailed as exc:
            detail, status, error = exc.detail, "FAIL", exc
        except Exception as exc:          # a crash in a check is a failure of that check, reported by type
            detail, status, error = f"{type(exc).__name__}: {exc}", "FAIL", exc
        result = CheckResult(name, status, detail, time.perf_counter() - started, error)
        self.results.append(result)
        return result

    def run_all(self, checks=CHECKS) -> list[CheckResult]:
        return [self.run(name) for name in checks]

    def close(self) -> None:
        """Drop the model and the SnapKV run (the numpy reference stays cached for the next suite on its GGUF)."""
        self._model = self._snapkv = self._reference = self._greedy = self._scored = None

    def describe(self) -> str:
        try:
            from ..common.manifest import Manifest
            m = Manifest.read(self.artifact)
            target = f"{m.target.get('kind')}, {m.kv_dtype} KV, from {m.source.get('name')}"
        except Exception:
            target = "unreadable manifest"
        return f"{self.artifact} ({target}) against the {self.reference_kind} reference"


def format_table(results, title: str = "", artifact=None) -> str:
    """One line per check: status, name, detail (cut to fit about 120 columns), and a summary line. Paths inside
    `artifact` are shown relative to it (the title names it), so that a long directory does not push the reason
    out of the column."""
    width = max(len(r.name) for r in results)
    lines = [title] if title else []
    for r in results:
        detail = " ".join(r.detail.split())
        if artifact is not None:
            detail = detail.replace(f"{artifact}/", "")
        if len(detail) > 78:
            detail = detail[:75] + "..."
        lines.append(f"  {r.status:4}  {r.name:<{width}}  {detail}  ({r.seconds:.1f} s)")
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{len(results)} checks: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return "\n".join(lines)


def run_and_report(artifact, reference: str = "numpy", gguf=None, out=None, **options) -> int:
    """Run the whole suite on an artifact and print the table to `out` (stdout); 0 if nothing failed, else 1."""
    import sys
    suite = Suite(artifact, reference=reference, gguf=gguf, **options)
    results = suite.run_all()
    print(format_table(results, f"sharpi conformance: {suite.describe()}", suite.artifact), file=out or sys.stdout)
    return 1 if any(r.status == "FAIL" for r in results) else 0
