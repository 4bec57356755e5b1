"""Opening GGUF files: a bounded parser over the memory-mapped file, every failure a GGUFError.

The `gguf` package's GGUFReader trusts the counts and lengths a file declares: a huge array length makes it loop
past the end of the file for ever (reads past the end return empty views and never fail), and it builds one numpy
object per array element (a 260k-token vocabulary takes seconds). So the file is parsed here, with every count
checked against the bytes left before anything is read or allocated; the `gguf` package still supplies the
tensor types, their block sizes and the dequantizers. What is checked follows llama.cpp's gguf.cpp: version 2 or 3,
known value types, no nested arrays, no duplicate keys or tensor names, at most 4 dimensions, element counts
that fit in int64 and rows that are whole blocks, tensor data aligned, inside the file and not overlapping, and
valid UTF-8 in every string.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.errors import GGUFError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                    # GGML_MAX_DIMS
MAX_TENSOR_NAME_BYTES = 64      # the GGUF spec's limit on tensor names
INT64_MAX = 2**63 - 1
# Every metadata array element becomes a Python object; this bounds that memory on a hostile file. The largest
# real tokenizers hold about 1M elements (Gemma 3: 262144 tokens, scores and types; Llama 3: 128k tokens and
# 280k merges).
MAX_ARRAY_ELEMENTS = 1 << 23
# SentencePiece vocabularies are turned into merges by trying every split of every token (quadratic in a token's
# length); real tokens are under 200 characters, so this bounds that work without refusing a real model.
MAX_SPM_TOKEN_CHARS = 1024

# GGUF value types (gguf.GGUFValueType): struct format of the scalar ones
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_FLOAT_TYPES = {6, 12}
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# numpy element types of tensor data that is not block-quantized (the others are raw bytes), as GGUFReader has them
_TYPED_TENSORS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


@dataclass
class GGUFTensor:
    name: str
    type_name: str            # GGMLQuantizationType name, e.g. "Q4_1"
    type_id: int
    shape: tuple[int, ...]    # logical shape, outermost first (numpy order): (rows, cols) for a matrix
    data: np.ndarray          # raw bytes (uint8) for quantized types, typed array otherwise; memory-mapped
    span: tuple[int, int] = (0, 0)   # (offset in the file, bytes)


@dataclass
class _TensorInfo:
    name: str
    dims: tuple[int, ...]     # as stored: innermost first
    type_id: int
    offset: int               # relative to the start of the data section


class GGUFFile:
    """Metadata (as Python values) and tensors of one GGUF file. `value_types` holds each metadata key's GGUF
    value type: (type,) or, for an array, (ARRAY, item type), with gguf.GGUFValueType's numbers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"{self.path} does not exist or is not a file.")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with the GGUF magic bytes).")
        with open(self.path, "rb") as f:     # the mapping outlives the descriptor
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._mmap, dtype=np.uint8)
        parser = _Parser(memoryview(self._data), self.path.name)
        self.metadata, self.value_types, infos, data_start = parser.parse()
        self.tensors = _map_tensors(self._data, infos, data_start, parser.alignment, self.path.name)
        check_known_fields(self.metadata, self.value_types, self.path.name)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture field.")
        return arch

    def require(self, key: str):
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name} lacks the metadata field {key}.")
        return self.metadata[key]

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's resident memory; they stay in the page cache, and a later
        read maps them again. The compiler releases each tensor once it is repacked, so a large GGUF is never
        resident whole (its mapped pages would count as the process's memory until unmapped)."""
        start, nbytes = self.tensor(name).span
        first, end = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED, first, end - first)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path.name} lacks the tensor {name}.")
        return self.tensors[name]


class _Parser:
    """Reads the header, metadata and tensor infos; each read checks that the bytes it needs are in the file."""

    def __init__(self, buffer: memoryview, name: str):
        self.buffer = buffer
        self.size = len(buffer)
        self.name = name
        self.pos = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.array_elements = 0

    def parse(self) -> tuple[dict, dict, list[_TensorInfo], int]:
        self.pos = 4                                    # the magic, checked by the caller
        version = self._scalar(4)
        if version not in SUPPORTED_VERSIONS:
            swapped = version & 0xFFFF == 0
            raise GGUFError(f"{self.name} is a big-endian GGUF, which sharpi does not read." if swapped else
                            f"{self.name} has GGUF version {version}; sharpi reads versions 2 and 3.")
        tensor_count, kv_count = self._scalar(10), self._scalar(10)
        self._check_count(kv_count, 13, "metadata fields")       # key length, type, a one-byte value
        self._check_count(tensor_count, 24, "tensors")           # name length, dimension count, type, offset
        metadata = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
        types = {}
        for _ in range(kv_count):
            key, value, value_type = self._field()
            if key in metadata:
                raise GGUFError(f"{self.name} is malformed: it holds two metadata fields named {key!r}.")
            metadata[key], types[key] = value, value_type
        self._read_alignment(metadata, types)
        infos = self._tensor_infos(tensor_count)
        data_start = -(-self.pos // self.alignment) * self.alignment
        if infos and data_start > self.size:
            raise GGUFError(f"{self.name} is truncated: its tensor data would start past the end of the file.")
        return metadata, types, infos, data_start

    # -- primitive reads --------------------------------------------------------------------------------------
    def _take(self, count: int, what: str) -> memoryview:
        if count > self.size - self.pos:
            raise GGUFError(f"{self.name} is truncated or malformed: {what} at byte {self.pos} needs {count} bytes "
                            f"but {self.size - self.pos} are left.")
        chunk = self.buffer[self.pos:self.pos + count]
        self.pos += count
        return chunk

    def _scalar(self, value_type: int):
        fmt = "<" + _SCALARS[value_type]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), f"a {_TYPE_NAMES[value_type]}"))[0]

    def _text(self, what: str) -> str:
        length = self._scalar(10)
        raw = self._take(length, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.name}: {what} at byte {self.pos - length} is not valid UTF-8.") from None

    def _check_count(self, count: int, min_bytes: int, what: str) -> None:
        if count * min_bytes > self.size - self.pos:
            raise GGUFError(f"{self.name} is truncated or malformed: it declares {count} {what}, more than its "
                            f"remaining {self.size - self.pos} bytes can hold.")

    def _value_type(self, what: str) -> int:
        value_type = self._scalar(4)
        if value_type not in _TYPE_NAMES:
            raise GGUFError(f"{self.name} is malformed: {what} has unknown value type {value_type}.")
        return value_type

    # -- metadata ---------------------------------------------------------------------------------------------
    def _field(self) -> tuple[str, object, tuple[int, ...]]:
        key = self._text("a metadata key")
        value_type = self._value_type(f"metadata field {key!r}")
        if value_type != _ARRAY:
            return key, self._value(value_type, key), (value_type,)
        item_type = self._value_type(f"the items of metadata field {key!r}")
        if item_type == _ARRAY:
            raise GGUFError(f"{self.name}: metadata field {key!r} is an array of arrays, which GGUF readers do not "
                            f"support.")
        return key, self._array(item_type, key), (_ARRAY, item_type)

    def _value(self, value_type: int, key: str):
        if value_type == _STRING:
            return self._text(f"the value of metadata field {key!r}")
        return self._scalar(value_type)

    def _array(self, item_type: int, key: str) -> list:
        length = self._scalar(10)
        item_bytes = 8 if item_type == _STRING else struct.calcsize(_SCALARS[item_type])
        self._check_count(length, item_bytes, f"items in metadata field {key!r}")
        self.array_elements += length
        if self.array_elements > MAX_ARRAY_ELEMENTS:
            raise GGUFError(f"{self.name} holds more than {MAX_ARRAY_ELEMENTS} metadata array items, more than "
                            f"any real model; sharpi does not read it.")
        if item_type == _STRING:
            return [self._text(f"an item of metadata field {key!r}") for _ in range(length)]
        raw = self._take(length * item_bytes, f"metadata field {key!r}")
        return np.frombuffer(raw, dtype="<" + _SCALARS[item_type]).tolist()

    def _read_alignment(self, metadata: dict, types: dict) -> None:
        if "general.alignment" not in metadata:
            return
        value = metadata["general.alignment"]
        if types["general.alignment"] != (4,) or value == 0 or value & (value - 1):
            raise GGUFError(f"{self.name}: general.alignment must be a uint32 power of two, got {value!r}.")
        self.alignment = value

    # -- tensor infos -----------------------------------------------------------------------------------------
    def _tensor_infos(self, count: int) -> list[_TensorInfo]:
        infos, names = [], set()
        for _ in range(count):
            info = self._tensor_info()
            if info.name in names:
                raise GGUFError(f"{self.name} is malformed: it holds two tensors named {info.name!r}.")
            names.add(info.name)
            infos.append(info)
        return infos

    def _tensor_info(self) -> _TensorInfo:
        name = self._text("a tensor name")
        if len(name.encode()) > MAX_TENSOR_NAME_BYTES:
            raise GGUFError(f"{self.name}: tensor name {name[:80]!r} is longer than {MAX_TENSOR_NAME_BYTES} bytes.")
        n_dims = self._scalar(4)
        if n_dims > MAX_DIMS:
            raise GGUFError(f"{self.name}: tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}.")
        dims = tuple(self._scalar(10) for _ in range(n_dims))
        type_id = self._scalar(4)
        offset = self._scalar(10)
        return _TensorInfo(name=name, dims=dims, type_id=type_id, offset=offset)


def _map_tensors(data: np.ndarray, infos: list[_TensorInfo], data_start: int, alignment: int,
                 name: str) -> dict[str, GGUFTensor]:
    """Views into the mapped file, after checking that each tensor's bytes are aligned, inside the file and
    not shared with another tensor."""
    spans = []
    tensors = {}
    for info in infos:
        qtype, nbytes = _tensor_type_and_size(info, name)
        start = data_start + info.offset
        if info.offset % alignment:
            raise GGUFError(f"{name}: tensor {info.name!r} starts at offset {info.offset}, which is not a multiple "
                            f"of the alignment {alignment}.")
        if start + nbytes > len(data):
            raise GGUFError(f"{name} is truncated or malformed: tensor {info.name!r} ends past the end of the file.")
        spans.append((start, start + nbytes, info.name))
        tensors[info.name] = _tensor_view(data, info, qtype, start, nbytes)
    _check_no_overlap(spans, name)
    return tensors


def _tensor_type_and_size(info: _TensorInfo, name: str):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(info.type_id)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GGUFError(f"{name}: tensor {info.name!r} has unknown tensor type {info.type_id}.") from None
    # numpy refuses a shape whose non-zero dimensions multiply past int64 even when another one is 0
    if math.prod(max(d, 1) for d in info.dims) * type_size > INT64_MAX:
        raise GGUFError(f"{name}: tensor {info.name!r} has shape {list(info.dims)}, whose size overflows int64.")
    elements = math.prod(info.dims)
    row = info.dims[0] if info.dims else 1
    if row % block_size:
        raise GGUFError(f"{name}: tensor {info.name!r} has rows of {row} elements, not a whole number of "
                        f"{qtype.name} blocks of {block_size}.")
    return qtype, elements // block_size * type_size


def _tensor_view(data: np.ndarray, info: _TensorInfo, qtype, start: int, nbytes: int) -> GGUFTensor:
    from gguf.quants import quant_shape_to_byte_shape

    shape = tuple(reversed(info.dims))
    item = _TYPED_TENSORS.get(qtype.name)
    view_shape = shape if item is not None else quant_shape_to_byte_shape(shape or (1,), qtype)
    array = data[start:start + nbytes].view(item or np.uint8).reshape(view_shape)
    return GGUFTensor(name=info.name, type_name=qtype.name, type_id=int(qtype), shape=shape, data=array,
                      span=(start, nbytes))


def _check_no_overlap(spans: list[tuple[int, int, str]], name: str) -> None:
    previous_end, previous = 0, None
    for start, end, tensor in sorted(s for s in spans if s[1] > s[0]):
        if start < previous_end:
            raise GGUFError(f"{name} is malformed: the data of tensors {previous!r} and {tensor!r} overlap.")
        previous_end, previous = end, tensor


# -- well-known fields ----------------------------------------------------------------------------------------
# The types the GGUF spec gives the fields sharpi reads outside a model's own config (the frontend checks those):
# a field of another type would reach the tokenizer builder or the tokenizers library as the wrong Python type.
_STRING_FIELDS = ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def check_known_fields(metadata: dict, types: dict, name: str) -> None:
    """Raise GGUFError for a well-known field of the wrong type, or tokenizer fields the tokenizer could not be
    built from (merges of unknown tokens, SentencePiece tokens too long to split)."""
    for key, value_type in types.items():
        expected = _expected_kind(key)
        if expected is not None and not _is_kind(value_type, expected):
            got = " of ".join(_TYPE_NAMES[t] + ("s" if i else "") for i, t in enumerate(value_type))
            raise GGUFError(f"{name}: metadata field {key} must be {expected}, but it is {got}.")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        _check_merges(metadata.get("tokenizer.ggml.merges") or [], tokens, name)
        if metadata.get("tokenizer.ggml.model") == "llama":
            _check_token_lengths(tokens, name)


def _expected_kind(key: str) -> str | None:
    if key in _STRING_FIELDS:
        return "a string"
    if key in _STRING_ARRAYS:
        return "an array of strings"
    if key == "tokenizer.ggml.scores":
        return "an array of numbers"
    if key == "tokenizer.ggml.token_type":
        return "an array of integers"
    if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
        return "an integer"
    if key.startswith("tokenizer.ggml.add_"):
        return "a bool"
    return None


def _is_kind(value_type: tuple[int, ...], kind: str) -> bool:
    head, item = value_type[0], value_type[-1]
    return {"a string": head == _STRING, "an array of strings": head == _ARRAY and item == _STRING,
            "an array of numbers": head == _ARRAY and item in _INTEGER_TYPES | _FLOAT_TYPES,
            "an array of integers": head == _ARRAY and item in _INTEGER_TYPES,
            "an integer": head in _INTEGER_TYPES, "a bool": head == 7}[kind]


def _check_merges(merges: list[str], tokens: list[str], name: str) -> None:
    """Each merge is "left right", both tokens of the vocabulary (the tokenizers library refuses others)."""
    vocab = set(tokens)
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space or left not in vocab or right not in vocab:
            raise GGUFError(f"{name}: tokenizer.ggml.merges item {i} ({merge[:80]!r}) is not two of its tokens "
                            f"separated by a space.")


def _check_token_lengths(tokens: list[str], name: str) -> None:
    for i, token in enumerate(tokens):
        if len(token) > MAX_SPM_TOKEN_CHARS:
            raise GGUFError(f"{name}: token {i} is longer than {MAX_SPM_TOKEN_CHARS} characters, more than sharpi's "
                            f"SentencePiece tokenizer accepts.")
