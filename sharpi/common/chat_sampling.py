"""The sampling a chat starts from: the GGUF's own recommendation (`general.sampling.*`, written by model
authors since llama.cpp added the keys), else llama.cpp's defaults (common/common.h: temp 0.8, top-k 40, top-p 0.95,
min-p 0.05, no repetition penalty), so that `sharpi chat` samples as `llama-cli` does on the same file.

The compiler records what the GGUF says in the manifest (`sampling`, absent when it says nothing); the runtime
merges it over llama.cpp's defaults. Completion (`sharpi run`) stays greedy unless flags say otherwise.
"""
from __future__ import annotations

from . import schema

LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}

GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repeat_penalty"}

MAX_TOP_K = 1 << 24
MAX_TEMPERATURE = 100.0

CHECKS = {"temperature": schema.number(0, MAX_TEMPERATURE), "top_k": schema.integer(0, MAX_TOP_K),
          "top_p": schema.number(0, 1, lo_open=True), "min_p": schema.number(0, 1),
          "repeat_penalty": schema.number(0, MAX_TEMPERATURE, lo_open=True)}

check_manifest_sampling = schema.optional(schema.record(CHECKS, optional_keys=tuple(CHECKS)))


def from_gguf_metadata(meta: dict) -> dict | None:
    """The sampling settings a GGUF's metadata recommends, by SamplingParams' names; None when it has none. A
    value out of its range is left out (the file's mistake should not stop a compile: llama.cpp's default
    stands for it)."""
    found = {}
    for key, name in GGUF_KEYS.items():
        value = meta.get(key)
        if name == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif name != "top_k" and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = round(float(value), 6)       # GGUF stores float32: 0.95 reads 0.949999988
        try:
            CHECKS[name](value, key)
        except schema.SchemaError:
            continue
        found[name] = value
    return found or None


def chat_defaults(recorded: dict | None) -> tuple[dict, str]:
    """(the sampling settings a chat uses when none are given, where they came from in words)."""
    if not recorded:
        return dict(LLAMA_CPP_DEFAULTS), "llama.cpp's defaults (the GGUF recommends none)"
    return {**LLAMA_CPP_DEFAULTS, **recorded}, f"the GGUF's general.sampling ({', '.join(sorted(recorded))})"
