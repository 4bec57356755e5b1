"""The engine: one loaded artifact's execution state that its sessions share.

It holds the backend (sharpi.runtime.backend), the KV page pool, the lock that makes forwards and pool changes one
at a time (TVM's VM and the pool are not thread-safe), and what a session needs to know of the artifact. Sessions
are given an engine; they never reach into the Model.
"""
from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np

from ..common.config import ModelConfig
from ..common.errors import ArtifactError, ConfigError, NonFiniteLogitsError, SharpiNote
from ..common.manifest import Manifest
from ..common.ops import SELECT_PARAMS, SELECT_PARAMS_BEFORE_SINKS
from ..common.snapkv_settings import ENV, SnapKVSettings, auto_budget, check_against, fit_recency, settings_from
from .backend import Backend
from .kv_cache import PagePool, SequenceCache
from .state_pool import StatePool


class Engine:
    def __init__(self, backend: Backend, manifest: Manifest, config: ModelConfig, pool_sequences: int,
                 pool_tokens: int | None = None, state_snapshots: int = 0, key_offsets: list | None = None):
        """key_offsets: per layer what its cached keys are stored minus (loader.key_offsets), or None; a hybrid
        model's state pool holds pool_sequences sequences and state_snapshots snapshots."""
        self.backend, self.manifest, self.config = backend, manifest, config
        self.key_offsets = key_offsets
        self.pool = self._make_pool(pool_sequences, pool_tokens)
        self.states = self._make_states(pool_sequences + state_snapshots) if config.is_hybrid else None
        # Reentrant: eviction (select, compact) runs inside a prefill.
        self.lock = threading.RLock()
        self.times = ForwardTimes()

    def _make_pool(self, sequences: int, tokens: int | None) -> PagePool:
        """Room for `sequences` full-context sequences (sessions and forks share it), or for `tokens` slots in
        every layer when given (a server's pool: llama.cpp's -c), or as many pages as the backend can hold in one
        buffer (Vulkan's storage-binding limit) if that is less."""
        cfg, m = self.config, self.manifest
        fmt = m.kv_format(cfg)
        pages_per_layer = -(-tokens // m.page_size) if tokens else sequences * m.max_pages
        pages = self.backend.allocate_pool(fmt.pool_shape(cfg.kv_layers * pages_per_layer), fmt.pool_dtype)
        return PagePool(self.backend, pages, m.page_size, fmt.page_bytes, fmt)

    def _make_states(self, slots: int) -> StatePool:
        """A hybrid's recurrent-state slots: one per sequence it runs at once, and its snapshots'."""
        cfg = self.config
        return StatePool(self.backend, slots, len(cfg.recurrent_layers), cfg.ssm_state_width)

    # -- what sessions read of the artifact -------------------------------------------------------------------
    @property
    def prefill_chunk(self) -> int:
        return self.manifest.prefill_chunk

    @property
    def select_params(self) -> int:
        """The length of the artifact's snapkv_select params (6 in artifacts compiled before sinks)."""
        return select_params(self.manifest)

    def has(self, function: str) -> bool:
        return function in self.backend.functions

    @property
    def score_max(self) -> bool:
        """Whether the artifact's score op takes a negative window as the maximum reduction."""
        return bool((self.manifest.snapkv or {}).get("score_max"))

    @property
    def batch_from(self) -> int:
        """The fewest sequences forward_batch runs as one decode_batch call; fewer run one decode each. The CPU
        int8 GEMM computes whole tiles of 8 tokens, so 2 tokens cost nearly what 8 do: measured on SmolLM2 int8
        (znver5), 2 decodes give 241 tok/s and one decode_batch of 2 gives 179; from 3 on the batch is as fast
        or faster (8: 477 against 231). The float GEMMs and the GPU kernels win from 2."""
        target = self.manifest.target
        return 3 if target.get("kind") == "llvm" and target.get("matmuls") == "int8" else 2

    def new_cache(self) -> SequenceCache:
        cfg = self.config
        windows = [cfg.sliding_window if cfg.is_local(l) else 0 for l in range(cfg.kv_layers)]
        return SequenceCache(self.pool, cfg.kv_layers, cfg.n_kv_heads, self.manifest.max_pages, windows, self.states)

    def _slots(self, caches, counts) -> dict:
        """A hybrid's forward takes each token's state slot: `counts[i]` tokens of caches[i], in order."""
        if self.states is None:
            return {}
        return {"slots": np.repeat([c.state_slot() for c in caches], counts).astype(np.int32)}

    # -- calls ------------------------------------------------------------------------------------------------
    def forward(self, function: str, ids: np.ndarray, cache: SequenceCache, extra: tuple = ()):
        """Feed `ids` (checked by the caller) to one of the artifact's forward functions through `cache`: its
        pages reserved, the tokens at positions logical_length.., the cache advanced; the logits checked."""
        with self.lock:
            cache.reserve(len(ids))
            positions = np.arange(cache.logical_length, cache.logical_length + len(ids), dtype=np.int32)
            started = time.perf_counter()
            out = self.backend.forward(function, ids, positions, cache.page_table(), cache.kv_lens(), extra,
                                       **self._slots([cache], [len(ids)]))
            self.times.record(function, len(ids), time.perf_counter() - started)
            cache.advance(len(ids))
        _check_finite(out[0] if function == "prefill_snapkv" else out, positions)
        return out

    def forward_batch(self, ids: np.ndarray, caches: list[SequenceCache]) -> np.ndarray:
        """One new token for each of several sequences (ids [B], checked by the caller) in one decode_batch call
        when the artifact has it and the batch is large enough to win (else one decode each: batch_from); logits [B, vocab]. The pages every sequence needs
        are reserved first, so a full pool refuses the step before anything is written."""
        with self.lock:
            for cache in caches:
                cache.reserve(1)
            positions = np.array([c.logical_length for c in caches], np.int32)
            started = time.perf_counter()
            if self.has("decode_batch") and len(caches) >= self.batch_from:
                out = self.backend.forward("decode_batch", ids, positions, np.stack([c.page_table() for c in caches]),
                                           np.stack([c.kv_lens() for c in caches]),
                                           **self._slots(caches, [1] * len(caches)))
                self.times.record("decode_batch", len(caches), time.perf_counter() - started)
            else:
                out = np.concatenate([self.backend.forward("decode", ids[i:i + 1], positions[i:i + 1],
                                                           c.page_table(), c.kv_lens(), **self._slots([c], [1]))
                                      for i, c in enumerate(caches)])
                self.times.record("decode", 1, (time.perf_counter() - started) / len(caches))
            for cache in caches:
                cache.advance(1)
        _check_finite(out, positions)
        return out

    def forward_ragged(self, ids: list[np.ndarray], caches: list[SequenceCache]) -> list[np.ndarray]:
        """Several tokens for each of several sequences in one decode_batch call (every token one entry of the
        batch: its sequence's page table, the slots before it as its length, so the entries of one sequence
        write their keys and values before any of them attends, as a prefill's tokens do); the logits of every
        token, [len(ids[i]), vocab] per sequence. Not for page-scaled keys (q4_ch): a page is encoded whole, and
        entries of one page would encode it at once."""
        assert not self.pool.kv_format.page_scaled_keys
        with self.lock:
            for cache, tokens in zip(caches, ids, strict=True):
                cache.reserve(len(tokens))
            tables, lens, positions = [], [], []
            for cache, tokens in zip(caches, ids):
                base = cache.kv_lens()
                for i in range(len(tokens)):
                    tables.append(cache.page_table())
                    lens.append(base + i)
                    positions.append(cache.logical_length + i)
            started = time.perf_counter()
            out = self.backend.forward("decode_batch", np.concatenate(ids).astype(np.int32),
                                       np.asarray(positions, np.int32), np.stack(tables),
                                       np.stack(lens).astype(np.int32),
                                       **self._slots(caches, [len(t) for t in ids]))
            self.times.record("decode_batch", len(positions), time.perf_counter() - started)
            for cache, tokens in zip(caches, ids):
                cache.advance(len(tokens))
        _check_finite(out, np.asarray(positions))
        return np.split(out, np.cumsum([len(t) for t in ids])[:-1])

    def select(self, scores, params: np.ndarray):
        return self.backend.select(scores, params)

    def compact(self, cache: SequenceCache, keep, counts: np.ndarray) -> None:
        self.backend.compact(cache.page_table(), keep, counts)

    # -- SnapKV settings --------------------------------------------------------------------------------------
    def resolve_snapkv(self, **knobs) -> tuple[SnapKVSettings, int]:
        return resolve_snapkv(self.manifest, self.config, **knobs)


def exponential_average(old: float | None, new: float, weight: float = 0.25) -> float:
    """An average of the latest times that follows drift (the newest weighs `weight`); `new` where none yet."""
    return new if old is None else old + weight * (new - old)


class ForwardTimes:
    """How long a forward of n tokens took lately, per function (an exponential average of the last few): what
    speculative decoding weighs a verification of k drafted tokens against a decode step with."""

    def __init__(self):
        self._seconds: dict[tuple[str, int], float] = {}

    def record(self, function: str, n: int, seconds: float) -> None:
        key = (function, n)
        self._seconds[key] = exponential_average(self._seconds.get(key), seconds)

    def get(self, function: str, n: int) -> float | None:
        return self._seconds.get((function, n))

    def measured(self, *functions: str) -> dict[int, float]:
        """{n: seconds} of the sizes measured so far (of several functions of the same work: their mean)."""
        found: dict[int, list[float]] = {}
        for (f, n), t in self._seconds.items():
            if f in functions:
                found.setdefault(n, []).append(t)
        return {n: sum(ts) / len(ts) for n, ts in found.items()}


def select_params(manifest: Manifest) -> int:
    """The length of the artifact's snapkv_select params (6 in artifacts compiled before sinks)."""
    return int((manifest.snapkv or {}).get("select_params", SELECT_PARAMS_BEFORE_SINKS))


def resolve_snapkv(manifest: Manifest, config: ModelConfig, **knobs) -> tuple[SnapKVSettings, int]:
    """The SnapKV settings for these knobs (argument > SHARPI_SNAPKV_* env > the artifact's defaults) and the
    effective budget (0: no eviction; auto resolved for this artifact), checked against what the artifact was
    compiled with. The manifest alone decides, so a server's HTTP front checks a request's knobs as its engine
    would, without loading the model. A budget too small for the default recency shrinks the recency, with a
    SharpiNote (snapkv_settings.fit_recency); a recency that was given and does not fit is a ConfigError."""
    info = manifest.snapkv or {}
    settings = settings_from(info.get("defaults"), **knobs)
    budget = settings.budget
    if budget is None:
        full = manifest.kv_format(config).page_bytes * config.kv_layers * manifest.max_pages  # one full sequence
        budget = auto_budget(manifest.max_context, full, manifest.target.get("kind"), config.is_hybrid)
    if budget and not info.get("enabled"):
        raise ConfigError("This artifact was compiled with --snapkv off; recompile with --snapkv on to evict.")
    settings, note = fit_recency(settings, budget, knobs.get("recency") is not None or ENV["recency"] in os.environ)
    if note:
        warnings.warn(note, SharpiNote, stacklevel=2)
    check_against(settings, budget, info.get("max_window", settings.window))
    params = select_params(manifest)
    if budget and settings.sinks and params < SELECT_PARAMS:
        raise ArtifactError(f"This artifact was compiled before SnapKV sinks existed (its snapkv_select takes "
                            f"{params} parameters); compile it again with this sharpi to use sinks "
                            f"{settings.sinks}.")
    return settings, budget


def kv_slot_bytes(manifest: Manifest, config: ModelConfig) -> int:
    """The KV cache's bytes for one token in every layer (keys and values, block scales included)."""
    return manifest.kv_format(config).row_bytes * config.n_kv_heads * config.kv_layers


def _check_finite(logits: np.ndarray, positions: np.ndarray) -> None:
    """A NonFiniteLogitsError if the model computed NaN or infinite logits: sampling or scoring them would give
    garbage (or numpy's own errors), and the cause lies in the model, which a user should hear about."""
    if np.isfinite(logits).all():
        return
    rows = np.flatnonzero(~np.isfinite(logits).reshape(len(logits), -1).all(axis=1))
    at = positions[-len(logits):][rows[0]]
    raise NonFiniteLogitsError(f"The model's logits are not finite (NaN or infinite) at position {at}: its weights "
                               f"hold NaN or infinite values, or a tensor's type in the GGUF is mislabelled "
                               f"(sharpi-compile warns of non-finite weights).")
