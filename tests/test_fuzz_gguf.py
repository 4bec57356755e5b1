"""Hostile GGUF files: every input ends in a SharpiError with a one-line message or a valid model, never another
exception, a hang, an unbounded allocation or a read outside the file (issue #10). The harness and the mutators
are benchmarks/fuzz_gguf.py's; this runs a short deterministic hypothesis search, a table of hand-made hostile
files, and the corpus of inputs that broke the reader before (tests/data/fuzz_corpus/)."""
from __future__ import annotations

import functools
import math
import random
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharpi
from sharpi.frontend.gguf_file import MAX_ARRAY_ELEMENTS, GGUFFile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fuzz_gguf as fz  # noqa: E402

CORPUS = Path(__file__).parent / "data" / "fuzz_corpus"


@functools.lru_cache(maxsize=None)
def _seeds() -> tuple[bytes, ...]:
    with tempfile.TemporaryDirectory(prefix="sharpi-fuzz-seeds-") as directory:
        return tuple(p.read_bytes() for p in fz.make_seeds(Path(directory)))


@pytest.fixture
def scratch(tmp_path) -> Path:
    return tmp_path / "input.gguf"


def test_seeds_are_valid_models(scratch):
    assert [fz.check_input(seed, scratch) for seed in _seeds()] == ["valid"] * len(_seeds())


@settings(max_examples=200, deadline=5000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed_index=st.integers(0, 5), rng_seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 4))
def test_mutated_ggufs_end_in_sharpi_error_or_valid_model(scratch, seed_index, rng_seed, steps):
    rng = random.Random(rng_seed)
    data = _seeds()[seed_index]
    for _ in range(steps):
        data = fz.mutate(data, rng)
    fz.check_input(data, scratch)       # raises Finding for anything but a SharpiError or a valid model


# -- hand-made hostile files ------------------------------------------------------------------------------------
# Each builder returns a function that writes the file when the test runs (the seeds are made on first use).
def _layout(index: int = 0) -> fz.Layout:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "seed.gguf"
        path.write_bytes(_seeds()[index])
        return fz.layout_of(path)


def field(key, value_type, value, item_type=fz.U8, seed=0):
    """The seed with one metadata field set (added, or replaced with this type and value)."""
    def build():
        layout = _layout(seed)
        fz._set_field(layout, key, value_type, value, item_type)
        return fz.serialize(layout)
    return build


def tensors(change, seed=0):
    """The seed with change(tensor infos) applied, every tensor at an explicit offset."""
    def build():
        layout = _layout(seed)
        fz._place_all(layout)
        change(layout.tensors)
        return fz.serialize(layout)
    return build


def layout(change, seed=0):
    def build():
        value = _layout(seed)
        change(value)
        return fz.serialize(value)
    return build


def raw(data: bytes):
    return lambda: data


def _header(version=3, tensor_count=0, kv_count=0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensor_count, kv_count)


def _dims(i, dims):
    def change(infos):
        infos[i].dims = dims
    return change


def _q8_0_dims(dims):
    def change(infos):
        next(t for t in infos if t.type_id == 8).dims = dims       # 8: Q8_0, blocks of 32
    return change


def _offset(i, offset_of):
    def change(infos):
        infos[i].offset = offset_of(infos)
    return change


def _set(i, name, value_of):
    def change(infos):
        setattr(infos[i], name, value_of(infos))
    return change


def _rename_field(old: bytes, new: bytes):
    def change(value):
        next(f for f in value.fields if f.key == old).key = new
    return change


def _big_u8_array() -> bytes:
    count = MAX_ARRAY_ELEMENTS + 1
    return _header(kv_count=1) + fz._string("big") + struct.pack("<IIQ", fz.ARRAY, fz.U8, count) + bytes(count)


NAN, INF = math.nan, math.inf
TOKENS, MERGES, SCORES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores"
EPS = "llama.attention.layer_norm_rms_epsilon"
HOSTILE = {
    # header and counts
    "empty after magic": (raw(b"GGUF"), "needs 4 bytes"),
    "truncated counts": (raw(_header()[:12]), "truncated or malformed"),
    "version 1": (raw(_header(version=1)), "GGUF version 1"),
    "big-endian": (raw(_header(version=3 << 24)), "big-endian"),
    "huge metadata count": (raw(_header(kv_count=2**64 - 1)), "declares 18446744073709551615 metadata fields"),
    "huge tensor count": (raw(_header(tensor_count=2**63)), "declares 9223372036854775808 tensors"),
    "truncated mid-metadata": (lambda: _seeds()[0][:300], "truncated or malformed"),
    "truncated mid-tensor-data": (lambda: _seeds()[0][:-100], "ends past the end of the file"),
    # metadata encoding
    "huge string length": (raw(_header(kv_count=1) + struct.pack("<Q", 2**63) + bytes(11)),
                           "needs 9223372036854775808 bytes"),
    "huge array length": (raw(_header(kv_count=1) + fz._string("a") + struct.pack("<IIQ", fz.ARRAY, fz.U8, 2**40)
                              + bytes(64)), "declares 1099511627776 items"),
    "too many array items": (_big_u8_array, "more than 8388608 metadata array items"),
    "unknown value type": (raw(_header(kv_count=1) + fz._string("a") + struct.pack("<I", 13) + bytes(8)),
                           "unknown value type 13"),
    "nested array": (field("general.tags", fz.ARRAY, [[1]], fz.ARRAY), "array of arrays"),
    "duplicate key": (layout(lambda value: value.fields.append(value.fields[0])), "two metadata fields named"),
    "invalid UTF-8 key": (layout(_rename_field(b"general.architecture", b"general.\xff")), "not valid UTF-8"),
    "invalid UTF-8 value": (field("general.name", fz.STRING, b"sm\xc3\x28ol"), "not valid UTF-8"),
    "surrogate in a token": (field(TOKENS, fz.ARRAY, [b"\xed\xa0\x80"] * 257, fz.STRING), "not valid UTF-8"),
    "alignment 0": (field("general.alignment", fz.U32, 0), "power of two"),
    "alignment 3": (field("general.alignment", fz.U32, 3), "power of two"),
    "alignment as uint64": (field("general.alignment", fz.U64, 64), "uint32 power of two"),
    # tensor infos
    "tensor past the end": (tensors(_offset(0, lambda t: 1 << 40)), "ends past the end of the file"),
    "tensor offset overflows": (tensors(_offset(0, lambda t: 2**64 - 32)), "ends past the end of the file"),
    "overlapping tensors": (tensors(_offset(1, lambda t: t[0].offset)), "overlap"),
    "misaligned tensor": (tensors(_offset(1, lambda t: t[1].offset + 4)), "not a multiple of the alignment"),
    "shape overflows int64": (tensors(_dims(0, [2**32, 2**32, 2**32])), "overflows int64"),
    "zero dimension beside a huge one": (tensors(_dims(0, [2**63 + 32, 0])), "overflows int64"),
    "five dimensions": (tensors(_dims(0, [1, 1, 1, 1, 1])), "at most 4"),
    "huge dimension": (tensors(_dims(0, [2**40])), "ends past the end of the file"),
    "row not whole blocks": (tensors(_q8_0_dims([33, 32]), seed=1), "not a whole number of Q8_0 blocks"),
    "unknown tensor type": (tensors(_set(0, "type_id", lambda t: 4)), "unknown tensor type 4"),
    "duplicate tensor": (tensors(_set(1, "name", lambda t: t[0].name)), "two tensors named"),
    "long tensor name": (tensors(_set(0, "name", lambda t: b"x" * 65)), "longer than 64 bytes"),
    "invalid UTF-8 tensor name": (tensors(_set(0, "name", lambda t: b"blk.\xff")), "not valid UTF-8"),
    "declared fewer fields": (layout(lambda value: setattr(value, "declared_kv", len(value.fields) - 1)), "GGUF"),
    # model metadata (config_from_gguf)
    "NaN rope base": (field("llama.rope.freq_base", fz.F32, NAN), "positive finite number, got nan"),
    "Inf rope base": (field("llama.rope.freq_base", fz.F32, INF), "positive finite number, got inf"),
    "negative rms epsilon": (field(EPS, fz.F64, -1e-5), "positive finite number"),
    "-Inf rms epsilon as f64": (field(EPS, fz.F64, -INF), "positive finite number"),
    "block_count as string": (field("llama.block_count", fz.STRING, "2"), "must be an integer, got '2'"),
    "head_count as bool": (field("llama.attention.head_count", fz.BOOL, True), "must be an integer"),
    "embedding_length as float": (field("llama.embedding_length", fz.F32, 32.0), "must be an integer"),
    "huge block_count": (field("llama.block_count", fz.U64, 2**62), "outside [1, 16777216]"),
    "block_count past the tensors": (field("llama.block_count", fz.U32, 100), "lacks the tensor blk."),
    "block_count out of range": (field("llama.block_count", fz.U32, 1 << 20), "n_layers should be an integer in"),
    "huge context": (field("llama.context_length", fz.U64, 2**40), "outside [1, 16777216]"),
    "zero heads": (field("llama.attention.head_count", fz.U32, 0), "outside [1, 16777216]"),
    "negative sliding window": (field("llama.attention.sliding_window", fz.I32, -1), "outside [0, 16777216]"),
    "gemma3 zero key length": (field("gemma3.attention.key_length", fz.U32, 0, seed=3), "outside"),
    "odd head dimension": (field("llama.attention.key_length", fz.U32, 15), "odd"),
    # tokenizer metadata
    "tokens as integers": (field(TOKENS, fz.ARRAY, [1, 2], fz.I32), "array of strings"),
    "merges as integers": (field(MERGES, fz.ARRAY, [1, 2], fz.U32), "array of strings"),
    "merge of unknown tokens": (field(MERGES, fz.ARRAY, ["a \u4e00"], fz.STRING), "not two of its tokens"),
    "merge without a space": (field(MERGES, fz.ARRAY, ["ab"], fz.STRING), "not two of its tokens"),
    "bos id as string": (field("tokenizer.ggml.bos_token_id", fz.STRING, "1"), "must be an integer"),
    "add_bos_token as int": (field("tokenizer.ggml.add_bos_token", fz.U32, 1), "must be a bool"),
    "scores as strings": (field(SCORES, fz.ARRAY, ["x"], fz.STRING, seed=5), "array of numbers"),
    "SentencePiece token too long": (field(TOKENS, fz.ARRAY, ["x" * 5000] * 257, fz.STRING, seed=5),
                                     "longer than 1024 characters"),
    "unknown tokenizer model": (field("tokenizer.ggml.model", fz.STRING, "bert"), "not supported"),
    "architecture as integer": (field("general.architecture", fz.U32, 7), "must be a string"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_file_is_a_clear_sharpi_error(case, scratch):
    build, fragment = HOSTILE[case]
    data = build()
    scratch.write_bytes(data)
    with pytest.raises(sharpi.SharpiError) as info:
        fz._frontend(scratch)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    assert fz.check_input(data, scratch) == type(info.value).__name__     # and in time, with in-file views


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.gguf")), ids=lambda p: p.name)
def test_corpus_inputs_that_broke_the_reader_are_sharpi_errors(path, scratch):
    outcome = fz.check_input(path.read_bytes(), scratch)
    assert outcome != "valid" and issubclass(getattr(sharpi, outcome), sharpi.SharpiError)


def test_reader_agrees_with_the_gguf_package(tmp_path):
    """On valid files the bounded reader returns what gguf.GGUFReader does: same metadata values and types, same
    tensor names, types, shapes and bytes."""
    from gguf import GGUFReader

    for i, seed in enumerate(_seeds()):
        path = tmp_path / f"{i}.gguf"
        path.write_bytes(seed)
        ours, theirs = GGUFFile(path), GGUFReader(str(path))
        assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items()}
        assert list(ours.tensors) == [t.name for t in theirs.tensors]
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.type_name, mine.shape) == (t.tensor_type.name, tuple(reversed(t.shape.tolist())))
            assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
            assert np.array_equal(mine.data.view(np.uint8), t.data.view(np.uint8))
