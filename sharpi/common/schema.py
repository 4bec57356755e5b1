"""A small schema checker for the JSON sharpi reads back (the artifact's manifest, the Vulkan plan's contract).

Written by hand rather than with pydantic or jsonschema: the runtime must load an artifact with the TVM runtime,
numpy and the tokenizer alone (a GPU machine may carry just those), and what is needed here is strict types
(a bool is not an integer, NaN is not a number), closed ranges and exact key sets, with one sentence for the
first problem found.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

Check = Callable[[Any, str], None]
SHA256 = re.compile(r"[0-9a-f]{64}")


class SchemaError(ValueError):
    """`path` (e.g. config.vocab_size) is not what the schema says; `expected` says what it should be."""

    def __init__(self, path: str, expected: str, value: Any, sentence: str | None = None):
        self.path, self.expected, self.value = path, expected, value
        super().__init__(sentence or f"{path or 'the top level'} should be {expected}, got {shown(value)}")


def shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def integer(lo: int, hi: int) -> Check:
    def check(value, path):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise SchemaError(path, f"an integer in [{lo}, {hi}]", value)
    return check


def number(lo: float, hi: float, *, lo_open: bool = False) -> Check:
    def check(value, path):
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
              and (lo < value if lo_open else lo <= value) and value <= hi)
        if not ok:
            raise SchemaError(path, f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", value)
    return check


def boolean(value, path) -> None:
    if not isinstance(value, bool):
        raise SchemaError(path, "true or false", value)


def text(max_len: int = 256, pattern: str | None = None) -> Check:
    compiled = re.compile(pattern) if pattern else None

    def check(value, path):
        if not isinstance(value, str) or len(value) > max_len or (compiled and not compiled.fullmatch(value)):
            what = f"a string of at most {max_len} characters" + (f" matching {pattern}" if pattern else "")
            raise SchemaError(path, what, value)
    return check


def one_of(*choices) -> Check:
    def check(value, path):
        if isinstance(value, bool) or value not in choices or type(value) is not type(choices[0]):
            raise SchemaError(path, f"one of {', '.join(map(repr, choices))}", value)
    return check


def sha256_hex(value, path) -> None:
    if not isinstance(value, str) or not SHA256.fullmatch(value):
        raise SchemaError(path, "a sha256 (64 lowercase hex digits)", value)


def optional(inner: Check) -> Check:
    def check(value, path):
        if value is not None:
            inner(value, path)
    return check


def array(item: Check, max_len: int, *, unique: bool = False) -> Check:
    def check(value, path):
        if not isinstance(value, list) or len(value) > max_len:
            raise SchemaError(path, f"a list of at most {max_len} items", value)
        for i, v in enumerate(value):
            item(v, f"{path}[{i}]")
        if unique and len({repr(v) for v in value}) != len(value):
            raise SchemaError(path, "a list without repeated items", value)
    return check


def mapping(key: Check, item: Check, max_len: int) -> Check:
    def check(value, path):
        if not isinstance(value, dict) or len(value) > max_len:
            raise SchemaError(path, f"an object of at most {max_len} entries", value)
        for k, v in value.items():
            key(k, f"{path} key")
            item(v, f"{path}.{k}")
    return check


def record(fields: dict[str, Check], optional_keys: tuple[str, ...] = ()) -> Check:
    """An object with exactly these keys (those in optional_keys may be missing)."""
    def check(value, path):
        if not isinstance(value, dict):
            raise SchemaError(path, "an object", value)
        where = f"{path}." if path else ""
        missing = [k for k in fields if k not in value and k not in optional_keys]
        if missing:
            raise SchemaError(f"{where}{missing[0]}", "present", "nothing")
        extra = [k for k in value if k not in fields]
        if extra:
            raise SchemaError(f"{where}{extra[0]}", "absent (not a field sharpi writes)", value[extra[0]])
        for k, inner in fields.items():
            if k in value:
                inner(value[k], f"{where}{k}")
    return check


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first (path, value in a, value in b) where two JSON values differ, or None if they are equal (1 and
    1.0 differ, as do true and 1: what was compiled is compared exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}" if path else str(k), a.get(k), b.get(k)
            found = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None if len(a) == len(b) else (f"{path} length", len(a), len(b))
    return None if type(a) is type(b) and a == b else (path, a, b)
