"""The KV page pool's layout for a key type and a value type (each a codec: sharpi.common.kv_codecs), and the numpy
form of its stores (what the runtime decodes on the host and what the kernel tests hold the kernels to).

Float types with keys and values alike keep the plain layout the GPU kernels also read:
    pool [pages, 2 (k, v), kv_heads, page_size, head_dim] of that type.
Quantized types, or keys and values of different types, take the packed layout:
    pool uint8 [pages, 1, kv_heads, page_size, row], one row of bytes a slot: the key's part, then the value's;
    a part is laid out by its codec (kv_codecs.base.Part: its quants, then its side data, padded to 4 bytes).
A slot's key and value sit side by side (not in planes of their own per page) so that the pool keeps its rank and
its slot axis: compaction and the host's slot moves move a slot's row whole, page copies and forks are unchanged,
and a page's attention reads its rows' key and value parts from the same cache lines. Side data follows the quants
within a part so that the quants of every row start at the part's start (aligned loads of whole blocks).

Keys whose codec is page_scaled (q4_ch) are encoded a page at a time: kv_append re-encodes the page's held slots
(read back as stored) with the new ones, compaction re-encodes each destination page from the kept slots' stored
values (append_page_keys, compact_page_keys, gather_slots here; the kernels' twins in codegen/kernels).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kv_codecs
from .errors import ConfigError
from .kv_codecs import KVCodec, Part
from .kv_codecs.q4_ch import dequantize_channels, quantize_channels  # noqa: F401 (the numpy rule's names)

# how many bytes one element of a pool of each type takes in memory (the packed layout's uint8 included)
POOL_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}


def kv_types() -> tuple[str, ...]:
    """The KV types known now (kv_codecs' registry)."""
    return kv_codecs.names()


# Quantized keys are stored minus a constant vector per layer and KV head where the model has one: qwen2's key bias
# (blk.N.attn_k.bias). Its few large channels (Qwen2.5-Coder-0.5B's first layer: |b| up to 145 where the keys
# vary by about 0.5) would take their 32-element block's one scale and leave the rest of the block a level or
# two; without them the scale serves the part of the key that varies (q4_0 keys: golden-text perplexity 51.7 ->
# 22.4 against f16's 21.6, benchmarks/kv_quant.md). Attention is unchanged: every key a query sees moves by the
# same q.c, which its softmax removes; so is every score built on softmaxed q.k (SnapKV's), and only readers of
# the keys themselves (Session.cached_keys, for KeyDiff) add it back. The bias is the key's offset before RoPE;
# its large channels are RoPE's lowest frequencies (0.06 rad in 16k positions), so as it stands it fits the keys
# of every position the context holds.
KEY_OFFSET = "attn_k.bias"


def key_offset_for(key_type: str, has_key_bias: bool) -> str | None:
    """The per-layer vector (blk.N.<name>) a cache of `key_type` keys stores them minus, or None."""
    return KEY_OFFSET if kv_codecs.codec(key_type).element_type is None and has_key_bias else None


def rotation_seed_for(kv_types) -> int | None:
    """The seed of the rotation a cache of these (keys', values') types stores vectors in, or None: the manifest
    records it, and an artifact whose seed differs from this sharpi's codec is refused."""
    seeds = {kv_codecs.codec(t).rotation_seed for t in kv_types if kv_codecs.codec(t).rotated}
    return seeds.pop() if seeds else None


def key_type_note(key_type: str | None) -> str | None:
    """What a user choosing a key type should know before a long prompt (measured: benchmarks/kv_quant.md)."""
    return kv_codecs.codec(key_type).key_note if key_type in kv_codecs.names() else None


@dataclass(frozen=True)
class KVFormat:
    """The pool of one artifact: keys' and values' types (kv_codecs' names) and the sizes that shape a page."""
    k: str
    v: str
    kv_heads: int
    page_size: int
    head_dim: int

    def __post_init__(self):
        key, value = kv_codecs.codec(self.k), kv_codecs.codec(self.v)
        if value.keys_only:
            others = [c.flag for c in map(kv_codecs.codec, kv_codecs.names())
                      if c.element_type is None and not c.keys_only]
            raise ConfigError(f"{self.v} is a key type ({value.keys_only_why}); values take {' or '.join(others)} "
                              f"(--kv-dtype-k {value.flag} --kv-dtype-v {others[-1] if others else 'f16'}).")
        for c in (key, value):
            c.check(self.head_dim, self.page_size)

    @classmethod
    def of(cls, kv_dtype, kv_heads: int, page_size: int, head_dim: int) -> "KVFormat":
        """A format from a KV type (keys and values alike), a (key, value) pair, or a format (returned)."""
        if isinstance(kv_dtype, KVFormat):
            return kv_dtype
        k, v = (kv_dtype, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
        return cls(k, v, kv_heads, page_size, head_dim)

    def codec(self, which: int) -> KVCodec:
        """The keys' (0) or the values' (1) codec."""
        return kv_codecs.codec((self.k, self.v)[which])

    @property
    def packed(self) -> bool:
        return self.k != self.v or self.codec(0).element_type is None

    @property
    def page_scaled_keys(self) -> bool:
        """Whether the keys' side data belongs to their page (q4_ch): pages are written and compacted whole."""
        return self.codec(0).page_scaled

    @property
    def name(self) -> str:
        """A short name for kernel names and messages: f16, q8_0, or k q8_0 / v q4_0 as "q8_0-q4_0"."""
        k, v = (t.replace("float", "f") for t in (self.k, self.v))
        return k if k == v else f"{k}-{v}"

    # -- the pool -----------------------------------------------------------------------------------------------
    def part(self, which: int) -> Part:
        """The key's (0) or the value's (1) part of a packed row."""
        offset = 0 if which == 0 else self.part(0).nbytes
        return self.codec(which).part(self.head_dim, self.page_size, offset)

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot of one KV head, key and value."""
        return self.part(0).nbytes + self.part(1).nbytes

    @property
    def pool_dtype(self) -> str:
        return "uint8" if self.packed else self.k

    def pool_shape(self, pages) -> tuple:
        if self.packed:
            return (pages, 1, self.kv_heads, self.page_size, self.row_bytes)
        return (pages, 2, self.kv_heads, self.page_size, self.head_dim)

    @property
    def page_bytes(self) -> int:
        return self.kv_heads * self.page_size * self.row_bytes

    # -- the host's view of pages ---------------------------------------------------------------------------------
    def decode(self, pages: np.ndarray, which: int) -> np.ndarray:
        """Keys (0) or values (1) of pages as read from the pool ([n, *pool_shape[1:]]): f32 [n, kv_heads,
        page_size, head_dim]."""
        if not self.packed:
            return np.asarray(pages[:, which], np.float32)
        part = self.part(which)
        return part.codec.decode(part, pages[:, 0, ..., part.offset:part.offset + part.nbytes])


def quantize_kv(dtype: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [..., head_dim] -> (quants uint8 [..., head_dim or head_dim / 2], scales f16 [..., head_dim / 32]) by a
    block codec's rule (q8_0, q4_0); q8_0's quants are int8 bits in uint8."""
    c = kv_codecs.codec(dtype)
    return c.quantize(c.part(x.shape[-1], 1, 0), x)


def dequantize_kv(dtype: str, quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The inverse: f32 [..., head_dim]."""
    c = kv_codecs.codec(dtype)
    return c.dequantize(None, quants, scales)


def encode_rows(fmt: KVFormat, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Packed rows uint8 [..., row_bytes] holding keys and values f32 [..., head_dim] as kv_append stores them
    (padding bytes zero): the numpy emulation of a packed store. Page-scaled keys, whose side data is their page's,
    are left zero here (append_page_keys writes them)."""
    row = np.zeros((*k.shape[:-1], fmt.row_bytes), np.uint8)
    for which, x in ((0, k), (1, v)):
        part = fmt.part(which)
        if not part.codec.page_scaled:
            row[..., part.offset:part.offset + part.nbytes] = part.codec.encode(part, x)
    return row


def append_page_keys(fmt: KVFormat, page: np.ndarray, held: int, keys: np.ndarray) -> np.ndarray:
    """The numpy emulation of kv_append's store of page-scaled keys: a page's rows uint8 [kv_heads, page_size, row]
    holding `held` slots, with keys f32 [n, kv_heads, head_dim] appended at slots held .. held + n - 1
    (<= page_size); returns the page's new rows (value parts untouched). The held slots are read back as stored
    and the page is encoded again over held + n slots."""
    stored = fmt.decode(page[None, None], 0)[0][:, :held]                    # [kvh, held, d]
    x = np.concatenate([stored, np.asarray(keys, np.float32).transpose(1, 0, 2)], axis=1)
    return compact_page_keys(fmt, page, x)


def compact_page_keys(fmt: KVFormat, page: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The numpy emulation of compaction's store of page-scaled keys into one destination page: kept keys f32
    [kv_heads, n, head_dim] (the sources' stored values) encoded over slots 0 .. n - 1 of `page` [kv_heads,
    page_size, row]."""
    part, out = fmt.part(0), page.copy()
    span = slice(part.offset, part.offset + part.nbytes)
    out[..., span] = part.codec.encode_page(part, page[..., span], kept)
    return out


def gather_slots(fmt: KVFormat | None, pages: np.ndarray, sources) -> np.ndarray:
    """Pages [n, 1 or 2, kv_heads, page_size, width] of one layer with slot sources[h][i] moved to slot i for every
    head h (ascending sources): rows move whole; page-scaled keys are re-encoded per destination page from the
    sources' stored values (the compaction kernel's rule). fmt None: a pool without a format, whose rows move as
    they are. Returns the new pages."""
    P = pages.shape[3]
    slots = pages.transpose(0, 3, 1, 2, 4).reshape(-1, *pages.shape[1:3], pages.shape[4])   # [slot, parts, kvh, w]
    moved = slots.copy()
    for h, src in enumerate(sources):
        moved[:len(src), :, h] = slots[src, :, h]
    out = moved.reshape(len(pages), P, *pages.shape[1:3], pages.shape[4]).transpose(0, 2, 3, 1, 4).copy()
    if fmt is not None and fmt.page_scaled_keys:
        keys = fmt.decode(pages, 0).transpose(1, 0, 2, 3).reshape(fmt.kv_heads, -1, fmt.head_dim)
        for h, src in enumerate(sources):
            for p in range((len(src) + P - 1) // P):
                kept = keys[h, src[p * P:(p + 1) * P]][None]
                out[p, 0, h:h + 1] = compact_page_keys(fmt, out[p, 0, h:h + 1], kept)
    return out
