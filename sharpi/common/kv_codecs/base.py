"""What a KV cache type (a codec) is: the interface every codec module implements, and the layout of its part of
a slot's row.

A slot of the packed pool is one row of bytes per KV head: the key's part, then the value's (kv_format). A codec
owns its part: how many bytes it takes, its numpy rule (the reference the kernels are held to, bit for bit), and
the pieces the CPU and GPU kernels compose to read an element and to store a row. The kernels are written once
against these pieces (codegen/kernels/kv_rows.py and gpu/kv_rows.py); the package's register() and codec()
make a codec known and pick it by name. Slot moves (compaction of slot codecs, forks, prefix-cache pages, a
shorter sequence) move or keep bytes and ask nothing of a codec.

A part is two fields: its quants (a float type's elements, or a quantized type's codes) from the part's start,
then its side data (block scales, a page's per-channel scales, a norm) from `scale_offset`, padded to 4 bytes.
The CPU kernels read each field through a typed view of the pool (SlotRows.quants / .scales); the GPU kernels
read the row as 32-bit words (gpu_words.py), since WGSL has no 8- or 16-bit types.

Slot codecs encode each row alone. Page codecs (page_scaled: q4_ch) share side data across a page's slots, so a
page is encoded whole: their store pieces are cpu_encode_page and gpu_encode_page, and kv_append and compaction
stage a page's keys as f32 first (kv_rows.store_page_keys, gpu/kv_rows.store_page_keys).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

# numpy's form of a field's element type (numpy has no bfloat16: its bits travel as uint16)
_NUMPY = {"bfloat16": np.uint16}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4, "uint32": 4}


def round4(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass(frozen=True)
class Field:
    """count elements of dtype, as a CPU kernel's view reads them."""
    dtype: str
    count: int

    @property
    def nbytes(self) -> int:
        return ITEMSIZE[self.dtype] * self.count

    @property
    def numpy_dtype(self):
        return _NUMPY.get(self.dtype, np.dtype(self.dtype))


@dataclass(frozen=True)
class Part:
    """A codec's part of a row for one pool: bytes [offset, offset + nbytes), the quants from `offset`, the side
    data (scales: None for none) from `scale_offset`."""
    codec: "KVCodec"
    head_dim: int
    page_size: int
    offset: int
    quants: Field
    scales: Field | None

    @property
    def dtype(self) -> str:
        return self.codec.name

    @property
    def scale_offset(self) -> int:
        return self.offset + self.quants.nbytes

    @property
    def nbytes(self) -> int:
        """The part's bytes: a float part's elements, or fields padded to 4 bytes."""
        if self.scales is None:
            return self.quants.nbytes
        return round4(self.quants.nbytes + self.scales.nbytes)

    def fields(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A part's bytes uint8 [..., nbytes] -> its quants and scales as numpy arrays of their types."""
        raw = np.ascontiguousarray(raw)
        q = raw[..., :self.quants.nbytes].view(self.quants.numpy_dtype)
        if self.scales is None:
            return q, None
        s0 = self.quants.nbytes
        return q, np.ascontiguousarray(raw[..., s0:s0 + self.scales.nbytes]).view(self.scales.numpy_dtype)

    def bytes_of(self, q: np.ndarray, s: np.ndarray | None) -> np.ndarray:
        """The inverse: a part's bytes (padding zero) from its fields [..., count]."""
        row = np.zeros((*q.shape[:-1], self.nbytes), np.uint8)
        row[..., :self.quants.nbytes] = np.ascontiguousarray(q).view(np.uint8)
        if s is not None:
            row[..., self.quants.nbytes:self.quants.nbytes + self.scales.nbytes] = np.ascontiguousarray(s).view(
                np.uint8)
        return row


class KVCodec:
    """The interface of a KV cache type. A codec module defines a subclass and registers an instance
    (kv_codecs.register). What each member is for:

    Naming and where it applies
        name           the manifest's and KVFormat's name ("float16", "q8_0")
        flag           --kv-dtype's name ("f16", "q8_0")
        element_type   a float type whose pool, keys and values alike, is the plain layout [pages, 2, ...] of that
                       type (the layout the GPU kernels read as elements); None for quantized types
        keys_only      values cannot take it (keys_only_why: why)
        page_scaled    its side data belongs to a page (pages are encoded whole: encode_page)
        rotated        the kernels read the vector rotated (Pi x): the graph rotates queries before attention over
                       such keys (ops.KV_ROTATE, forward) and attention's output over such values back (inverse),
                       through the codec's rotate_row(x, t, h, y, scratch, inverse) macro; rotation_seed
                       names the rotation (the manifest records it)
        unavailable    {target name: why} where its kernels cannot run
        key_note       what a user choosing it for keys should know, or None
        tolerance      (max |d log-prob|, top-1 bound) the conformance suite allows for it, or None: exact
    Layout
        fields(head_dim, page_size) -> (quants Field, scales Field | None); check(head_dim, page_size) refuses
        shapes it cannot hold (ConfigError)
    numpy (the reference)
        quantize(part, x f32 [..., D]) -> (quants, scales) and dequantize(part, quants, scales) -> f32: a slot
        codec's rule; encode/decode (bytes) follow from them. A page codec has quantize_page / dequantize over
        [..., n, D] (the n slots a page holds) instead.
    CPU kernel pieces (rows: codegen/kernels/kv_rows.SlotRows; which: 0 keys, 1 values)
        cpu_load(rows, which, page, h, slot, d)          element d as float32
        cpu_store(rows, which, page, h, slot, x, t)      a macro storing x[t, h, :]
        cpu_unpack: attention unpacks a page once to f32 before walking it (quantized parts)
        page codecs: cpu_encode_page(rows, page, h, values, end) (a macro); cpu_read_page(rows, scratch, page,
        h) (a macro) copies a page's side data into f32 scratch [page_scratch_rows, head_dim] once, and
        cpu_page_keys(rows, scratch) reads the page's keys through it
    GPU kernel pieces (rows: codegen/kernels/gpu/kv_rows.GpuRows; pool: uint32 words)
        gpu_load(rows, pool, which, page, h, slot, d)    element d as float32
        gpu_blocks(part): how many block statistics a store computes first (one invocation each, into workgroup
        memory: scales [gpu_scratch(part)], inverse [gpu_blocks(part)]), then
        gpu_block_scale(rows, which, x, t, h, b, scales, inverse, stats) (a macro) computes block b's,
        gpu_quant_word(rows, which, x, t, h, i, scales, inverse) is word i of the quants and
        gpu_scale_word(rows, which, i, scales) word i of the side data
        page codecs: gpu_encode_page(rows, pool, page, h, end, staged, tx, threads) (a macro)
    """
    name: str = ""
    flag: str = ""
    element_type: str | None = None
    keys_only = False
    keys_only_why = ""
    page_scaled = False
    rotated = False
    rotation_seed: int | None = None
    unavailable: dict = {}
    key_note: str | None = None
    tolerance: tuple[float, float] | None = None
    cpu_unpack = True
    page_scratch_rows = 0

    def __repr__(self) -> str:
        return f"<KV codec {self.name}>"

    # -- layout ---------------------------------------------------------------------------------------------------
    def fields(self, head_dim: int, page_size: int) -> tuple[Field, Field | None]:
        raise NotImplementedError

    def check(self, head_dim: int, page_size: int) -> None:
        """Refuse (ConfigError) a head size or page size the layout cannot hold."""

    def part(self, head_dim: int, page_size: int, offset: int) -> Part:
        quants, scales = self.fields(head_dim, page_size)
        if scales is not None and quants.nbytes % ITEMSIZE[scales.dtype]:
            raise ConfigError(f"The {self.name} KV type's scales would not be aligned (head_dim {head_dim}).")
        return Part(self, head_dim, page_size, offset, quants, scales)

    # -- numpy ----------------------------------------------------------------------------------------------------
    def quantize(self, part: Part, x: np.ndarray):
        raise NotImplementedError

    def dequantize(self, part: Part, q: np.ndarray, s: np.ndarray | None) -> np.ndarray:
        raise NotImplementedError

    def encode(self, part: Part, x: np.ndarray) -> np.ndarray:
        """Rows of f32 [..., head_dim] as this part's bytes uint8 [..., nbytes] (a slot codec's store)."""
        return part.bytes_of(*self.quantize(part, np.asarray(x, np.float32)))

    def decode(self, part: Part, raw: np.ndarray) -> np.ndarray:
        """The part's bytes uint8 [..., page_size, nbytes] of whole pages (a page codec reads its page's side
        data from them) -> f32 [..., page_size, head_dim]."""
        return self.dequantize(part, *part.fields(raw))

    def roundtrip(self, x: np.ndarray, head_dim: int, page_size: int) -> np.ndarray:
        """x f32 [..., head_dim] as stored and read back (a page codec: [..., n, head_dim], n <= page_size slots
        of one page)."""
        part = self.part(head_dim, page_size, 0)
        if self.page_scaled:
            return self.dequantize_page(part, *self.quantize_page(part, np.asarray(x, np.float32)))
        return self.dequantize(part, *self.quantize(part, np.asarray(x, np.float32)))

    # -- page codecs ----------------------------------------------------------------------------------------------
    def quantize_page(self, part: Part, x: np.ndarray):
        """x f32 [..., n, head_dim], the n slots of a page -> (quants [..., n, count], page side data)."""
        raise NotImplementedError

    def dequantize_page(self, part: Part, q: np.ndarray, side) -> np.ndarray:
        """The inverse of quantize_page: f32 [..., n, head_dim]."""
        raise NotImplementedError

    def page_side_rows(self, part: Part, side) -> np.ndarray:
        """A page's side data (quantize_page's) as the scales field of every row [..., page_size, count]."""
        raise NotImplementedError

    def encode_page(self, part: Part, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        """A page's part bytes rows uint8 [..., page_size, >= nbytes] (a copy is returned) with keys f32 [..., n,
        head_dim] encoded over its slots 0 .. n - 1, and the side data in every row."""
        q, side = self.quantize_page(part, np.asarray(x, np.float32))
        out = rows.copy()
        n, s0 = q.shape[-2], part.quants.nbytes
        out[..., :n, :s0] = np.ascontiguousarray(q).view(np.uint8)
        scales = self.page_side_rows(part, side)
        out[..., s0:s0 + scales.shape[-1] * scales.itemsize] = np.ascontiguousarray(scales).view(np.uint8)
        return out

    # -- GPU store pieces shared by the slot codecs ---------------------------------------------------------------
    def gpu_blocks(self, part: Part) -> int:
        return 0

    def gpu_scratch(self, part: Part) -> int:
        return self.gpu_blocks(part)

