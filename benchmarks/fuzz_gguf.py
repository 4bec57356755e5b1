"""Fuzzing sharpi's GGUF reader and frontend: every input must end in a SharpiError or a valid model.

    python benchmarks/fuzz_gguf.py [--seconds 600] [--work DIR] [--engine atheris|random]
    python benchmarks/fuzz_gguf.py --target manifest|template [--seconds 600] [--work DIR] [--seed N]

--target manifest fuzzes the artifact's manifest (benchmarks/fuzz_manifest.py: every mutant loaded in a worker
process, with its digest recomputed and with verify=False, and run if it loads), --target template the chat
template renderer (benchmarks/fuzz_template.py); the default, gguf, is this file's harness.

The harness (`check_input`) writes the bytes to a file and runs what `sharpi-compile` runs before any weights are
touched: GGUFFile (the reader), config_from_gguf and build_from_gguf_metadata (the tokenizer). Any exception that
is not a SharpiError is a finding, as is an input that takes longer than SLOW_SECONDS (a hang in the making), a
SharpiError whose message is not one line, or a tensor whose view reaches outside the mapped file. Memory is
bounded by an address-space limit on the fuzzing process (MEMORY_LIMIT), so an unbounded allocation is a
MemoryError, reported as a finding.

Engines: `atheris` (coverage-guided libFuzzer, when `pip install atheris` works for this Python; sharpi and gguf
are instrumented) with this file's structure-aware mutator mixed into libFuzzer's byte mutations; `random` (no
atheris needed) runs the same mutators in a loop. Seeds are tiny valid GGUFs (tests/tiny_gguf.py): llama, qwen2,
qwen3, gemma3, a SentencePiece tokenizer, quantized and float tensors.

Mutations: byte-level (flips, truncation, inserted or deleted chunks, interesting 4- and 8-byte words) and
structural (the seed is parsed into fields and tensor infos, one is changed, the file is written again): huge
counts and lengths, wrong value types, NaN/Inf floats, invalid UTF-8 in keys, values and tensor names, nested
arrays, duplicate keys and tensors, tensor offsets past the end, misaligned or overlapping tensors, shapes that
overflow, unknown tensor types, bad alignments, declared counts that differ from the contents.

Findings are written to WORK/findings/ (the input, and a .txt with the traceback); tests/test_fuzz_gguf.py keeps
the ones worth keeping, minimized, in tests/data/fuzz_corpus/.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import struct
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW_SECONDS = 2.0             # an input slower than this is reported (a hang in the making)
HANG_SECONDS = 20.0            # and one still running after this is interrupted and reported as a hang
WATCHDOG = True                # off under atheris: libFuzzer's -timeout owns SIGALRM there
MEMORY_LIMIT = 4 << 30
MAX_DATA_BYTES = 1 << 22       # serialize() writes tensor data only this far into the data section

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_PACK = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
         F64: "d"}


# -- a GGUF model of the file, and a writer that may break every rule --------------------------------------------
@dataclass
class Field:
    key: bytes
    type: int
    value: object                  # a scalar, bytes / str for STRING, a list for ARRAY
    item_type: int = U8            # for ARRAY


@dataclass
class Tensor:
    name: bytes
    dims: list[int]                # innermost first, as stored
    type_id: int
    offset: int | None = None      # None: the next aligned position
    data: bytes = b""


@dataclass
class Layout:
    fields: list[Field]
    tensors: list[Tensor]
    version: int = 3
    declared_kv: int | None = None        # counts written to the header; None: the true ones
    declared_tensors: int | None = None
    alignment: int = 32
    trailing: bytes = b""

    def copy(self) -> "Layout":
        return replace(self, fields=[replace(f) for f in self.fields], tensors=[replace(t) for t in self.tensors])


def _string(value) -> bytes:
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
    return struct.pack("<Q", len(raw)) + raw


def _value(value_type: int, value, item_type: int = U8) -> bytes:
    if value_type == STRING:
        return _string(value)
    if value_type == ARRAY:
        items = b"".join(_value(item_type, v) for v in value)
        return struct.pack("<IQ", item_type, len(value)) + items
    fmt = "<" + _PACK[value_type]
    if value_type in (F32, F64):
        try:
            return struct.pack(fmt, float(value))
        except OverflowError:                       # beyond float32: the same infinity a converter would write
            return struct.pack(fmt, math.copysign(math.inf, value))
    if value_type == BOOL:
        return struct.pack(fmt, bool(value))
    bits = struct.calcsize(fmt) * 8
    signed = _PACK[value_type].islower()
    value = int(value) % (1 << bits)
    if signed and value >= 1 << (bits - 1):
        value -= 1 << bits
    return struct.pack(fmt, value)


def serialize(layout: Layout) -> bytes:
    """The GGUF bytes of `layout`, exactly as described (counts, offsets and types are not corrected)."""
    out = bytearray(b"GGUF")
    kv = len(layout.fields) if layout.declared_kv is None else layout.declared_kv
    nt = len(layout.tensors) if layout.declared_tensors is None else layout.declared_tensors
    out += struct.pack("<IQQ", layout.version, nt % (1 << 64), kv % (1 << 64))
    for f in layout.fields:
        out += _string(f.key) + struct.pack("<I", f.type % (1 << 32)) + _value(f.type, f.value, f.item_type)
    offsets, cursor = [], 0
    for t in layout.tensors:
        offset = cursor if t.offset is None else t.offset
        offsets.append(offset)
        if offset + len(t.data) <= MAX_DATA_BYTES:        # a tensor placed further away keeps its data unwritten
            cursor = max(cursor, _align(offset + len(t.data), layout.alignment))
    data = bytearray(cursor)
    for t, offset in zip(layout.tensors, offsets):
        out += _string(t.name) + struct.pack("<I", len(t.dims))
        out += b"".join(struct.pack("<Q", d % (1 << 64)) for d in t.dims)
        out += struct.pack("<IQ", t.type_id % (1 << 32), offset % (1 << 64))
    out += bytes(_align(len(out), layout.alignment) - len(out))
    for t, offset in zip(layout.tensors, offsets):
        if offset + len(t.data) <= len(data):
            data[offset:offset + len(t.data)] = t.data
    return bytes(out + data) + layout.trailing


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 0 else n


def layout_of(path: Path) -> Layout:
    """A valid GGUF (a seed) as a Layout, read with sharpi's reader."""
    from sharpi.frontend.gguf_file import GGUFFile

    g = GGUFFile(path)
    fields = []
    for key, value in g.metadata.items():
        if key.startswith("GGUF."):
            continue
        types = g.value_types[key]
        fields.append(Field(key.encode(), types[0], value, types[-1]))
    tensors = [Tensor(t.name.encode(), list(reversed(t.shape)), t.type_id, None, t.data.tobytes())
               for t in g.tensors.values()]
    alignment = g.metadata.get("general.alignment", 32)
    return Layout(fields, tensors, alignment=alignment if 0 < alignment <= 4096 else 32)


# -- seeds --------------------------------------------------------------------------------------------------------
def make_seeds(directory: Path) -> list[Path]:
    """Small valid GGUFs of every architecture sharpi reads, float and quantized, gpt2 and SentencePiece
    tokenizers (a few KB to ~40 KB each)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_gguf import write_tiny_llama

    directory.mkdir(parents=True, exist_ok=True)
    small = dict(layers=1, dim=32, heads=2, kv_heads=1, ffn=32, context=64)
    seeds = [write_tiny_llama(directory / "llama-f32.gguf", **small),
             write_tiny_llama(directory / "qwen2-q8_0.gguf", arch="qwen2", qkv_bias=True, matrix_type="Q8_0", **small),
             write_tiny_llama(directory / "qwen3-f16.gguf", arch="qwen3", qk_norm=True, matrix_type="F16", **small),
             write_tiny_llama(directory / "gemma3-q4_0.gguf", arch="gemma3", qk_norm=True, post_norms=True,
                              sliding_window=8, matrix_type="Q4_0", **small),
             write_tiny_llama(directory / "mistral-bf16.gguf", sliding_window=16, matrix_type="BF16", **small)]
    spm = layout_of(seeds[0])
    _set_field(spm, "tokenizer.ggml.model", STRING, "llama")
    tokens = next(f.value for f in spm.fields if f.key == b"tokenizer.ggml.tokens")
    _set_field(spm, "tokenizer.ggml.scores", ARRAY, [float(-i) for i in range(len(tokens))], F32)
    spm.fields = [f for f in spm.fields if f.key != b"tokenizer.ggml.merges"]
    path = directory / "llama-spm.gguf"
    path.write_bytes(serialize(spm))
    return seeds + [path]


def _set_field(layout: Layout, key: str, value_type: int, value, item_type: int = U8) -> None:
    new = Field(key.encode(), value_type, value, item_type)
    for i, f in enumerate(layout.fields):
        if f.key == new.key:
            layout.fields[i] = new
            return
    layout.fields.append(new)


# -- the harness ------------------------------------------------------------------------------------------------
class Finding(Exception):
    """An input that broke the contract; `signature` (the exception and where it was raised) groups repeats."""

    def __init__(self, signature: str, detail: str = ""):
        super().__init__(f"{signature}: {detail}"[:400] if detail else signature)
        self.signature = signature


def check_input(data: bytes, path: Path) -> str:
    """Run the reader, the config and the tokenizer builder on `data`; returns "valid" or the SharpiError's class
    name. Raises Finding for anything else."""
    from sharpi.common.errors import SharpiError

    path.write_bytes(data)
    started = time.perf_counter()
    out_of_memory = None
    try:
        with _watchdog(HANG_SECONDS if WATCHDOG else 0):
            outcome = _frontend(path)
    except InputTimeout:
        raise Finding("hang", f"still running after {HANG_SECONDS} s") from None
    except SharpiError as exc:
        message = str(exc)
        if not message or "\n" in message:
            raise Finding(f"{type(exc).__name__} without a one-line message", repr(message)) from exc
        outcome = type(exc).__name__
    except MemoryError as exc:
        # raised below, outside this block, so that the frames holding the memory are gone first
        out_of_memory = f"MemoryError at {_where(exc)}"
    except Exception as exc:
        raise Finding(f"{type(exc).__name__} at {_where(exc)}", str(exc)) from exc
    if out_of_memory:
        raise Finding(out_of_memory, f"more than {MEMORY_LIMIT >> 20} MiB of address space")
    elapsed = time.perf_counter() - started
    if elapsed > SLOW_SECONDS:
        raise Finding(f"slow input ({outcome})", f"took {elapsed:.1f} s, more than {SLOW_SECONDS} s")
    return outcome


class InputTimeout(BaseException):
    """Raised by the watchdog; a BaseException so that no `except Exception` in the code under test takes it."""


@contextlib.contextmanager
def _watchdog(seconds: float):
    """Interrupt the input after `seconds` (SIGALRM: main thread only; elsewhere no watchdog)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise InputTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame in sharpi, gguf or tokenizers code (else the innermost one)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if any(part in f.filename for part in ("sharpi", "gguf", "tokenizers"))]
    frame = (ours or frames or [None])[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"


def _frontend(path: Path) -> str:
    from sharpi.common.tokenizer import build_from_gguf_metadata
    from sharpi.frontend.config import config_from_gguf
    from sharpi.frontend.gguf_file import GGUFFile

    g = GGUFFile(path)
    _check_views_inside(g)
    config_from_gguf(g)
    build_from_gguf_metadata(g.metadata)
    return "valid"


def _check_views_inside(g) -> None:
    """Every tensor's data is the size its type and shape say, and lies inside the mapped file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    base, size = g._data.ctypes.data, g._data.nbytes
    for t in g.tensors.values():
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
        expected = math.prod(t.shape) // block * type_size
        if t.data.nbytes != expected:
            raise Finding("tensor view of the wrong size", f"{t.name}: {t.data.nbytes} bytes, not {expected}")
        if expected and not base <= t.data.ctypes.data <= base + size - expected:
            raise Finding("tensor view outside the file", t.name)


# -- mutators ---------------------------------------------------------------------------------------------------
INT32_VALUES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 64, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF,
                0x80000000, 0xFFFFFFFF]
INT64_VALUES = [0, 1, 2, 16, 255, 1 << 31, 1 << 32, (1 << 32) + 1, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63,
                (1 << 64) - 1, (1 << 64) - 8]
FLOAT_VALUES = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 3.4e38, 1e308]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82"]
WELL_KNOWN_KEYS = ["general.architecture", "general.alignment", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                   "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
                   "tokenizer.ggml.add_space_prefix"]
ARCH_KEYS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.freq_base",
             "attention.layer_norm_rms_epsilon", "attention.sliding_window", "vocab_size",
             "final_logit_softcapping"]


def mutate(data: bytes, rng: random.Random, max_size: int = 1 << 20) -> bytes:
    """One mutation of a GGUF: structural when the input parses, else (and sometimes anyway) byte-level."""
    if rng.random() < 0.6:
        layout = _try_layout(data)
        if layout is not None:
            try:
                for _ in range(1 + (rng.random() < 0.3)):
                    rng.choice(STRUCTURAL)(layout, rng)
                out = serialize(layout)
            except Exception:      # a mutation the writer cannot express (e.g. a value of another field's type)
                out = None
            if out is not None and len(out) <= max_size:
                return out
    return bytes(rng.choice(BYTE_LEVEL)(bytearray(data), rng)[:max_size])


_LAYOUT_CACHE: dict[int, Layout] = {}


def _try_layout(data: bytes) -> Layout | None:
    key = hash(data)
    if key not in _LAYOUT_CACHE:
        path = Path(tempfile.gettempdir()) / f"fuzz-layout-{os.getpid()}.gguf"
        path.write_bytes(data)
        try:
            _LAYOUT_CACHE[key] = layout_of(path)
        except Exception:          # not parseable (or a reader bug, which the harness reports when it runs it)
            _LAYOUT_CACHE[key] = None
        finally:
            path.unlink(missing_ok=True)     # the reader is done with it (the layout holds no file)
        if len(_LAYOUT_CACHE) > 64:
            _LAYOUT_CACHE.pop(next(iter(_LAYOUT_CACHE)))
    layout = _LAYOUT_CACHE[key]
    return layout.copy() if layout is not None else None


def _flip_bytes(buf: bytearray, rng: random.Random) -> bytearray:
    for _ in range(rng.randint(1, 8)):
        if buf:
            buf[_header_biased(buf, rng)] ^= 1 << rng.randrange(8)
    return buf


def _truncate(buf: bytearray, rng: random.Random) -> bytearray:
    return buf[:_header_biased(buf, rng)] if buf else buf


def _insert_or_delete(buf: bytearray, rng: random.Random) -> bytearray:
    at = _header_biased(buf, rng) if buf else 0
    if rng.random() < 0.5:
        return buf[:at] + bytearray(rng.randbytes(rng.randint(1, 64))) + buf[at:]
    return buf[:at] + buf[at + rng.randint(1, 64):]


def _overwrite_word(buf: bytearray, rng: random.Random) -> bytearray:
    width = rng.choice([4, 8])
    if len(buf) < width:
        return buf
    at = min(_header_biased(buf, rng), len(buf) - width)
    value = rng.choice(INT32_VALUES if width == 4 else INT64_VALUES)
    buf[at:at + width] = value.to_bytes(width, "little")
    return buf


def _header_biased(buf: bytearray, rng: random.Random) -> int:
    """A position, most often in the first 4 KiB (header, metadata, tensor infos) where the parsing happens."""
    end = len(buf) if rng.random() < 0.2 else min(len(buf), 4096)
    return rng.randrange(max(end, 1))


BYTE_LEVEL = [_flip_bytes, _truncate, _insert_or_delete, _overwrite_word]


def _hostile_value(rng: random.Random) -> tuple[int, object, int]:
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice([U8, I8, U16, I16, U32, I32, U64, I64]), rng.choice(INT64_VALUES + [-1, -2**31]), U8
    if kind == 1:
        return rng.choice([F32, F64]), rng.choice(FLOAT_VALUES), U8
    if kind == 2:
        return BOOL, rng.random() < 0.5, U8
    if kind == 3:
        return STRING, rng.choice(["", "x", "llama", "gemma3", "gpt2", "12", "a b"]), U8
    if kind == 4:
        return STRING, b"ok" + rng.choice(BAD_UTF8) + b"ok", U8
    if kind == 5:
        return ARRAY, [rng.choice(INT32_VALUES) for _ in range(rng.randint(0, 5))], rng.choice([U32, I32, U8])
    if kind == 6:
        return ARRAY, [rng.choice(["a", "b", "a b", "", "\u0120"]) for _ in range(rng.randint(0, 5))], STRING
    if kind == 7:
        return ARRAY, [rng.choice(FLOAT_VALUES) for _ in range(rng.randint(0, 5))], F32
    return ARRAY, [[1, 2]], ARRAY                                 # an array of arrays (ill-formed on purpose)


def _mutate_field_value(layout: Layout, rng: random.Random) -> None:
    arch = next((f.value for f in layout.fields if f.key == b"general.architecture"), "llama")
    arch = arch if isinstance(arch, str) else "llama"
    keys = [f.key.decode("utf-8", "replace") for f in layout.fields]
    key = rng.choice(keys + WELL_KNOWN_KEYS + [f"{arch}.{k}" for k in ARCH_KEYS])
    value_type, value, item_type = _hostile_value(rng)
    _set_field(layout, key, value_type, value, item_type)


def _mutate_same_type(layout: Layout, rng: random.Random) -> None:
    """Keep a field's type, change its value to an edge of that type (sizes, NaN rope bases, odd ids)."""
    if not layout.fields:
        return
    f = rng.choice(layout.fields)
    if f.type in (F32, F64):
        f.value = rng.choice(FLOAT_VALUES)
    elif f.type in _PACK and f.type != BOOL:
        f.value = rng.choice(INT64_VALUES + [0, 1, 2, 3, 5, 1000, 1 << 24, (1 << 24) + 1])
    elif f.type == STRING:
        f.value = rng.choice([b"", b"x" * rng.randint(1, 300), f.value.encode() + rng.choice(BAD_UTF8)
                              if isinstance(f.value, str) else b"\xff"])
    elif f.type == ARRAY and f.value:
        items = list(f.value)
        action = rng.randrange(4)
        if action == 0:
            items = items[:rng.randrange(len(items))]
        elif action == 1 and f.item_type == STRING:
            items[rng.randrange(len(items))] = rng.choice([b"\xff", b"", b"a  b", b"x" * 2000])
        elif action == 2:
            items = items + items[:rng.randint(1, 8)]
        else:
            items[rng.randrange(len(items))] = (rng.choice(FLOAT_VALUES) if f.item_type in (F32, F64) else
                                                rng.choice(INT32_VALUES) if f.item_type != STRING else "\u0120")
        f.value = items


def _mutate_structure(layout: Layout, rng: random.Random) -> None:
    action = rng.randrange(7)
    if action == 0 and layout.fields:
        layout.fields.pop(rng.randrange(len(layout.fields)))
    elif action == 1 and layout.fields:
        layout.fields.append(replace(rng.choice(layout.fields)))          # a duplicate key
    elif action == 2:
        layout.declared_kv = rng.choice(INT64_VALUES + [len(layout.fields) + rng.randint(-3, 3)])
    elif action == 3:
        layout.declared_tensors = rng.choice(INT64_VALUES + [len(layout.tensors) + rng.randint(-3, 3)])
    elif action == 4:
        layout.version = rng.choice([0, 1, 2, 4, 3 << 24, 0xFFFFFFFF])
    elif action == 5 and layout.fields:
        f = rng.choice(layout.fields)
        f.key = rng.choice([f.key + rng.choice(BAD_UTF8), b"", b"k" * 70000])
    else:
        alignment = rng.choice([0, 1, 3, 16, 64, 1 << 31])
        _set_field(layout, "general.alignment", rng.choice([U32, U64, I32]), alignment)
        layout.alignment = alignment if alignment & (alignment - 1) == 0 and 0 < alignment <= 4096 else 32


def _mutate_tensor(layout: Layout, rng: random.Random) -> None:
    if not layout.tensors:
        return
    t = rng.choice(layout.tensors)
    action = rng.randrange(9)
    if action == 0:
        t.dims[rng.randrange(len(t.dims))] = rng.choice(INT64_VALUES + [0, 3, 33])
    elif action == 1:
        t.dims = [rng.choice([1 << 32, 1 << 31, 1 << 21, 7]) for _ in range(rng.randint(0, 6))]
    elif action == 2:
        t.type_id = rng.choice([2, 3, 4, 5, 31, 39, 40, 100, 0xFFFFFFFF] + list(range(0, 42, 7)))
    elif action == 3:
        other = rng.choice(layout.tensors)
        _place_all(layout)
        t.offset = other.offset + rng.choice([0, 32, layout.alignment])          # overlapping tensors
    elif action == 4:
        t.offset = rng.choice(INT64_VALUES + [sum(len(x.data) for x in layout.tensors) + 64])   # past the end
    elif action == 5:
        _place_all(layout)
        t.offset += rng.choice([1, 2, 4, 8, 16])                                  # misaligned
    elif action == 6:
        t.name = rng.choice([b"", b"x" * 65, t.name + rng.choice(BAD_UTF8), layout.tensors[0].name])
    elif action == 7:
        layout.tensors.remove(t)
    else:
        t.data = t.data[:rng.randrange(len(t.data) + 1)]                          # short data (file ends early)
        layout.trailing = b""


def _place_all(layout: Layout) -> None:
    """Give every tensor its explicit offset as serialize() would place it."""
    cursor = 0
    for t in layout.tensors:
        if t.offset is None:
            t.offset = cursor
        cursor = max(cursor, _align(t.offset + len(t.data), layout.alignment))


STRUCTURAL = [_mutate_field_value, _mutate_same_type, _mutate_same_type, _mutate_structure, _mutate_tensor,
              _mutate_tensor]


# -- engines ------------------------------------------------------------------------------------------------------
@dataclass
class Stats:
    executions: int = 0
    outcomes: dict = field(default_factory=dict)
    findings: dict = field(default_factory=dict)     # signature -> count
    started: float = field(default_factory=time.time)
    slowest: float = 0.0
    run_seconds: float = 0.0
    mutate_seconds: float = 0.0

    def record(self, outcome: str) -> None:
        self.executions += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def to_dict(self) -> dict:
        return {"executions": self.executions, "seconds": round(time.time() - self.started, 1),
                "outcomes": dict(sorted(self.outcomes.items(), key=lambda kv: -kv[1])),
                "findings": self.findings, "slowest_input_s": round(self.slowest, 3),
                "checking_s": round(self.run_seconds, 1), "mutating_s": round(self.mutate_seconds, 1)}


class Runner:
    """Runs inputs through check_input, keeps findings (one file per distinct signature) and the stats."""

    def __init__(self, work: Path):
        self.work = work
        self.findings = work / "findings"
        self.findings.mkdir(parents=True, exist_ok=True)
        self.scratch = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / \
            f"sharpi-fuzz-{os.getpid()}.gguf"
        self.stats = Stats()
        self._last_save = 0.0

    def run(self, data: bytes) -> None:
        started = time.perf_counter()
        try:
            outcome = check_input(data, self.scratch)
        except Finding as exc:
            outcome = "FINDING"
            self._keep(data, exc)
        elapsed = time.perf_counter() - started
        self.stats.slowest = max(self.stats.slowest, elapsed)
        self.stats.run_seconds += elapsed
        self.stats.record(outcome)
        if time.time() - self._last_save > 10:
            self.save()

    def _keep(self, data: bytes, finding: Finding) -> None:
        count = self.stats.findings.get(finding.signature, 0)
        self.stats.findings[finding.signature] = count + 1
        if count == 0:
            name = f"finding-{len(self.stats.findings):03d}"
            (self.findings / f"{name}.gguf").write_bytes(data)
            cause = finding.__cause__ or finding
            (self.findings / f"{name}.txt").write_text(
                f"{finding}\n\n" + "".join(traceback.format_exception(cause)))

    def save(self) -> None:
        self._last_save = time.time()
        (self.work / "stats.json").write_text(json.dumps(self.stats.to_dict(), indent=1))


def run_random(runner: Runner, seeds: list[bytes], seconds: float, seed: int) -> None:
    """The fallback engine: mutation chains from the seeds (no coverage feedback)."""
    rng = random.Random(seed)
    deadline = time.time() + seconds
    while time.time() < deadline:
        data = rng.choice(seeds)
        started = time.perf_counter()
        for _ in range(rng.choice([1, 1, 2, 3, 5])):
            data = mutate(data, rng)
        runner.stats.mutate_seconds += time.perf_counter() - started
        runner.run(data)


def run_atheris(runner: Runner, corpus: Path, seconds: float, extra: list[str]) -> None:
    import atheris

    global WATCHDOG
    WATCHDOG = False

    def test_one_input(data: bytes) -> None:
        runner.run(data)

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        started = time.perf_counter()
        rng = random.Random(seed)
        out = atheris.Mutate(data, max_size) if rng.random() < 0.5 else mutate(data, rng, max_size)
        runner.stats.mutate_seconds += time.perf_counter() - started
        return out

    argv = [sys.argv[0], str(corpus), f"-max_total_time={int(seconds)}", "-max_len=262144", "-timeout=30",
            "-rss_limit_mb=4096", "-print_final_stats=1", f"-artifact_prefix={runner.findings}/"] + extra
    atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


def _limit_memory() -> None:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--work", type=Path, default=parser_default_work())
    parser.add_argument("--engine", choices=("atheris", "random"), default=None,
                        help="default: atheris when it is installed, else random")
    parser.add_argument("--seed", type=int, default=0, help="random engine: the RNG seed")
    parser.add_argument("--target", choices=("gguf", "manifest", "template"), default="gguf")
    args, extra = parser.parse_known_args(argv)
    if args.target != "gguf":
        return _other_target(args)
    engine = args.engine or ("atheris" if _has_atheris() else "random")
    if engine == "atheris":
        import atheris
        with atheris.instrument_imports(include=["sharpi", "gguf", "tokenizers"]):
            import sharpi.common.tokenizer  # noqa: F401
            import sharpi.frontend.config  # noqa: F401
            import sharpi.frontend.gguf_file  # noqa: F401
    corpus = args.work / "corpus"
    seed_paths = make_seeds(corpus)
    _limit_memory()
    runner = Runner(args.work)
    print(f"fuzzing with {engine} for {args.seconds:.0f} s; {len(seed_paths)} seeds in {corpus}; findings in "
          f"{runner.findings}", file=sys.stderr)
    try:
        if engine == "atheris":
            run_atheris(runner, corpus, args.seconds, extra)
        else:
            run_random(runner, [p.read_bytes() for p in seed_paths], args.seconds, args.seed)
    finally:
        runner.save()
        runner.scratch.unlink(missing_ok=True)
        print(json.dumps(runner.stats.to_dict(), indent=1))
    return 0


def _other_target(args) -> int:
    """The manifest and chat-template fuzzers (random structure-aware mutation; their inputs run in child
    processes, where libFuzzer's coverage would not reach)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    module = __import__("fuzz_manifest" if args.target == "manifest" else "fuzz_template")
    work = args.work
    if work == parser_default_work():
        work = Path(tempfile.gettempdir()) / f"sharpi-fuzz-{args.target}"
    print(f"fuzzing the {args.target} for {args.seconds:.0f} s; findings in {work / 'findings'}", file=sys.stderr)
    stats = module.run(work, args.seconds, args.seed)
    print(json.dumps(stats, indent=1))
    return 1 if stats["findings"] else 0


def parser_default_work() -> Path:
    return Path(tempfile.gettempdir()) / "sharpi-fuzz-gguf"


def _has_atheris() -> bool:
    try:
        import atheris  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
