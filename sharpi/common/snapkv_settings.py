"""SnapKV's knobs: parsing, validation, precedence (API argument > SHARPI_SNAPKV_* env > artifact defaults)
and the auto budget. Compile time decides whether the ops exist and the largest window; the rest is run time."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import numpy as np

from .config import MAX_SIZE
from .errors import ConfigError
from .settings import parse_int
from .targets import target_spec

POOLINGS = ("max", "avg", "none")
GRANULARITIES = ("kv-head", "shared")
# How the budget spreads over the layers: the same everywhere; PyramidKV's (Cai et al., arXiv 2406.02069)
# arithmetic sequence, most in the first layer, budget / PYRAMID_BETA in the last; or from the scores, as KVzip
# does (one threshold over every layer's scores, each layer keeping what passes it); the same mean each time.
ALLOCATIONS = ("uniform", "pyramid", "scores")
PYRAMID_BETA = 20
CHOICES = {"pooling": POOLINGS, "granularity": GRANULARITIES, "allocation": ALLOCATIONS}
AUTO_MIN_CACHE_BYTES = 256 * 2**20
# Ranges the kernels honour: positions, budgets and counts are int32 there and never exceed a context (MAX_SIZE);
# the window's queries are captured in one prefill chunk, so it stays a chunk's size; the select kernel pools each
# position over `kernel` neighbours (O(prompt x kernel)), and the measured useful kernels are 5-31.
MAX_WINDOW = 4096
MAX_KERNEL = 255
RANGES = {"budget": (0, MAX_SIZE), "window": (1, MAX_WINDOW), "recency": (0, MAX_SIZE), "sinks": (0, MAX_SIZE),
          "kernel": (1, MAX_KERNEL)}
ENV = {"budget": "SHARPI_SNAPKV_BUDGET", "window": "SHARPI_SNAPKV_WINDOW", "recency": "SHARPI_SNAPKV_RECENCY",
       "pooling": "SHARPI_SNAPKV_POOLING", "kernel": "SHARPI_SNAPKV_KERNEL",
       "granularity": "SHARPI_SNAPKV_GRANULARITY", "sinks": "SHARPI_SNAPKV_SINKS",
       "allocation": "SHARPI_SNAPKV_ALLOCATION"}


@dataclass(frozen=True)
class SnapKVSettings:
    budget: int | None = None      # None = auto, 0 = off, N = keep N slots per layer and KV head
    window: int = 64               # last queries that score the prompt
    recency: int = 64              # last positions always kept
    pooling: str = "max"
    kernel: int = 31               # odd pooling kernel; 1 with pooling "none" (31: benchmarks/longcontext.md)
    granularity: str = "kv-head"
    sinks: int = 0                 # first positions always kept (attention sinks)
    allocation: str = "uniform"    # the budget per layer: uniform, or pyramid (PyramidKV)

    def to_dict(self) -> dict:
        return asdict(self)

    def manifest_dict(self) -> dict:
        """The settings as an artifact records them: uniform allocation left out, so the manifests of artifacts
        that do not ask for another stay byte for byte as they were."""
        settings = self.to_dict()
        if settings["allocation"] == "uniform":
            del settings["allocation"]
        return settings


KNOBS = tuple(ENV)               # budget, window, recency, pooling, kernel, granularity, sinks, allocation
PREFIX = "snapkv_"              # how the API and the CLI spell them: snapkv_budget=..., --snapkv-budget


def knobs_from_keywords(keywords: dict) -> dict:
    """The SnapKV knobs of keyword arguments named snapkv_<knob> ({"budget": ...}; None values are "not given");
    any other name is a ConfigError."""
    knobs = {}
    for key, value in keywords.items():
        knob = key[len(PREFIX):] if key.startswith(PREFIX) else None
        if knob not in ENV:
            raise ConfigError(f"Unknown option {key!r}; the SnapKV options are "
                              f"{', '.join(PREFIX + k for k in KNOBS)}.")
        if value is not None:
            knobs[knob] = value
    return knobs


def auto_budget(max_seq_len: int, full_cache_bytes: int, target: str, hybrid: bool = False) -> int:
    """min(max_seq_len/4, 4096), raised to min(1024, max_seq_len); on only where the full KV cache would exceed
    256 MiB, and then for GPU targets, or on any target for a hybrid model (Gated DeltaNet beside attention: the
    attention layers' cache is all that grows with the prompt, as the reference engine has it), else 0 (off)."""
    if not (hybrid or target_spec(target).is_gpu) or full_cache_bytes <= AUTO_MIN_CACHE_BYTES:
        return 0
    return max(min(max_seq_len // 4, 4096), min(1024, max_seq_len))


def parse_budget(value, source: str) -> int | None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    lo, hi = RANGES["budget"]
    try:
        return parse_int(value, source, lo, hi)
    except ConfigError:
        raise ConfigError(f"{source} must be 'auto', 0 (off) or an integer in [1, {hi}], got {value!r}.") from None


def parse_knob(field: str, value, source: str):
    """One SnapKV knob's value (`source`: how the user spelled it), or a ConfigError giving its range."""
    if field == "budget":
        return parse_budget(value, source)
    if field in RANGES:
        number = parse_int(value, source, *RANGES[field])
        if field == "kernel" and number % 2 == 0:
            raise ConfigError(f"{source} must be odd (the pooling window is centred), got {number}.")
        return number
    if not isinstance(value, str):
        raise ConfigError(f"{source} must be a string, got {value!r}.")
    choices = CHOICES[field]
    text = str(value).strip().lower()
    if text not in choices:
        raise ConfigError(f"{source} must be one of {', '.join(choices)}, got {value!r}.")
    return text


def settings_from(defaults: dict | None = None, env: dict | None = None, **arguments) -> SnapKVSettings:
    """Resolve each knob: an argument that is not None wins, then the env var, then the artifact default."""
    env = os.environ if env is None else env
    settings = SnapKVSettings(**(defaults or {}))
    changes = {}
    for field, var in ENV.items():
        if var in env:
            changes[field] = parse_knob(field, env[var], var)
    for field, value in arguments.items():
        if field not in ENV:
            raise ConfigError(f"Unknown SnapKV option {field!r}; options are {', '.join(ENV)}.")
        if value is not None:
            changes[field] = parse_knob(field, value, f"snapkv_{field}")
    settings = replace(settings, **changes)
    if settings.pooling == "none" and "kernel" not in changes:
        settings = replace(settings, kernel=1)
    return settings


def fit_recency(settings: SnapKVSettings, budget: int, recency_given: bool) -> tuple[SnapKVSettings, str | None]:
    """A budget too small for a recency nobody asked for (the artifact's default, or SnapKVSettings'): recency +
    sinks must stay below the budget, so the recency shrinks to half of what the sinks leave of it (the other half
    is chosen by the scores: a recency of budget - 1 would leave SnapKV one slot to select). Returns the settings
    and a note saying so, or the settings unchanged and None: when they fit, when the recency was given (argument,
    flag or SHARPI_SNAPKV_RECENCY: then check_against refuses it), or when the sinks alone fill the budget."""
    room = budget - settings.sinks
    if recency_given or not budget or settings.recency < room or room < 1:
        return settings, None
    recency = room // 2
    sinks = f" and sinks ({settings.sinks})" if settings.sinks else ""
    note = (f"SnapKV budget {budget} is too small for the default recency ({settings.recency}){sinks}; using "
            f"recency {recency}, half of the {'room the sinks leave' if settings.sinks else 'budget'} "
            f"(snapkv_recency / --snapkv-recency chooses another).")
    return replace(settings, recency=recency), note


def check_against(settings: SnapKVSettings, budget: int, max_window: int) -> None:
    """The checks that need the effective budget and the compiled window."""
    if settings.window > max_window:
        raise ConfigError(f"SnapKV window {settings.window} exceeds the window this artifact was compiled for "
                          f"({max_window}); compile with --snapkv-window {settings.window}.")
    if budget and settings.recency >= budget:
        raise ConfigError(f"SnapKV recency ({settings.recency}) must be smaller than the budget ({budget}).")
    if budget and settings.recency + settings.sinks >= budget:
        raise ConfigError(f"SnapKV recency + sinks ({settings.recency} + {settings.sinks}) must be smaller than "
                          f"the budget ({budget}).")
    if settings.pooling == "none" and settings.kernel != 1:
        raise ConfigError("SnapKV pooling 'none' takes kernel 1.")


def layer_budgets(budget: int, layers: int, settings: SnapKVSettings, scores=None) -> list[int]:
    """Slots each of `layers` (the layers that take keep sets, in order) keeps, `budget` on average: `budget` each
    with uniform allocation; with pyramid, from 2 * budget - low in the first layer down to low = budget /
    PYRAMID_BETA in the last, in equal steps; with scores ([layers, kv_heads, slots] on the host, the prompt's
    slots only), what passes one threshold over all of them, a layer's count averaged over its KV heads (the
    cache is rectangular within a layer). Never fewer than recency + sinks + 1 (every keep set holds them)."""
    floor = settings.recency + settings.sinks + 1
    if settings.allocation == "uniform" or layers < 2:
        return [budget] * layers
    if settings.allocation == "scores":
        if scores is None:
            raise ConfigError("SnapKV allocation 'scores' needs the prompt's scores.")
        flat = np.sort(np.asarray(scores, np.float32).reshape(-1))[::-1]
        threshold = flat[min(layers * scores.shape[1] * budget, flat.size) - 1]
        counts = (np.asarray(scores) >= threshold).sum(axis=(1, 2)) / scores.shape[1]
        budgets = np.clip(np.round(counts), floor, scores.shape[2]).astype(np.int64)
        return _within_mean(budgets, budget, floor).tolist()
    low = min(max(budget // PYRAMID_BETA, floor), budget)
    high = 2 * budget - low
    return [round(high - (high - low) * layer / (layers - 1)) for layer in range(layers)]


def _within_mean(budgets: np.ndarray, budget: int, floor: int) -> np.ndarray:
    """Budgets whose mean is at most `budget`: what the floor added (and ties at the threshold) is taken back
    from the layers above the floor, in proportion to what they hold above it."""
    excess = int(budgets.sum()) - budget * len(budgets)
    above = budgets - floor
    if excess <= 0 or above.sum() <= 0:
        return budgets
    cut = np.floor(above * min(excess / above.sum(), 1.0)).astype(np.int64)
    for i in np.argsort(-above)[:max(0, excess - int(cut.sum()))]:   # the rounding's remainder, largest first
        cut[i] += 1 if budgets[i] - cut[i] > floor else 0
    return budgets - cut
