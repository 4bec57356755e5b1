"""The KV page pool's layout for a key type and a value type, and the numpy form of its quantization (what the
runtime decodes on the host and what the kernel tests hold the kernels to).

Float types with keys and values alike keep the plain layout the GPU kernels also read:
    pool [pages, 2 (k, v), kv_heads, page_size, head_dim] of that type.
Quantized types (q8_0, q4_0), or keys and values of different types, take the packed layout:
    pool uint8 [pages, 1, kv_heads, page_size, row], one row of bytes a slot: the key's part, then the value's;
    a part is its quants (a float type's elements, or the blocks' quants) followed by the blocks' f16 scales,
    padded to 4 bytes. Blocks are 32 elements of head_dim, as ggml's:
      q8_0: int8 q [head_dim], f16 d [head_dim / 32]          x = q * d
      q4_0: uint8 [head_dim / 2] (byte j of block b holds elements 32b + j in its low nibble and 32b + j + 16
            in its high one, ggml's order), f16 d [head_dim / 32]          x = (q - 8) * d
      q4_ch (keys only): 4 bits per channel over a page: uint8 [head_dim / 2] in q4_0's nibble order, then this
            row's share of its page's per-channel f16 scales and minimums: row o holds channels
            [o c, (o + 1) c), c = head_dim / page_size, as f16 d [c] then f16 m [c]          x = m + q * d
A q4_ch page's scales belong to the page, not to a row: KIVI's grouping (keys quantized per channel, since a key's
channels differ in range by an order of magnitude while one channel varies little across tokens). Per-token 4-bit
blocks (q4_0) move Qwen2.5-Coder-0.5B's attention logits by 10-19% of their spread and cost 10-15% perplexity at 1024
tokens; per channel over 16 slots, 4-7% and -0.1 to +1.6% on three models, and the 4,000-token suite keeps f16's
score (benchmarks/kv_quant.md). Its rows cost 4 head_dim / page_size bytes more than q4_0's (48 against 36 for
head_dim 64), and a page is written whole: kv_append re-encodes the page's held slots (read back as stored) with the
new ones, compaction re-encodes each destination page from the kept slots' stored values (kv_format.append_page_keys,
compact_page_keys, gather_slots).
A slot's key and value sit side by side (not in planes of their own per page) so that the pool keeps its rank and
its slot axis: compaction and the host's slot moves move a slot's row whole, page copies and forks are unchanged,
and a page's attention reads its rows' key and value parts from the same cache lines. Scales follow the quants
within a part so that the quants of every row start at the part's start (aligned loads of whole blocks).

Quantization (the kernels' rule exactly, computed in float32):
    q8_0: d = max|x| / 127, id = 1/d (0 for an all-zero block), q = round-half-even(x * id); d stored as f16.
    q4_0: m = the block's value of largest magnitude (the positive one on a tie), d = m / -8, id = 1/d (0 if d is
          0), q = min(15, round-half-even(x * id) + 8); d stored as f16. ggml rounds x * id + 8.5 down and takes
          the first of tied values; the two differ only on exact ties, and rounding the product alone leaves the
          kernels no multiply-add for LLVM to fuse (which would round once where numpy rounds twice).
    q4_ch, over the n slots a page holds (the encoded values, not the pool's stale slots past them):
          lo, hi = the channel's min and max, d = (hi - lo) / 15, m = lo, both stored as f16; id = 1/d (0 if d is 0);
          q = min(15, max(0, round-half-even((x - m) * id))) with d and m as stored. Reading back m + q * d is
          exact to fuse or not (q * d has at most 15 significant bits), so a page re-encoded from what it holds
          gets the same bytes from numpy and from the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

KV_BLOCK = 32
FLOAT_KV = {"float32": 4, "float16": 2, "bfloat16": 2}
QUANTIZED_KV = {"q8_0": KV_BLOCK, "q4_0": KV_BLOCK // 2, "q4_ch": KV_BLOCK // 2}     # quant bytes per block
PAGE_SCALED_KV = ("q4_ch",)          # types whose scales belong to a page (keys only)
KV_TYPES = tuple(FLOAT_KV) + tuple(QUANTIZED_KV)
# how many bytes one element of a pool of each type takes in memory (the packed layout's uint8 included)
POOL_ITEMSIZE = dict(FLOAT_KV, uint8=1)


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
    return KEY_OFFSET if key_type in QUANTIZED_KV and has_key_bias else None


# What a user choosing a key type should know before a long prompt (measured: benchmarks/kv_quant.md).
KEY_TYPE_NOTES = {
    "q4_0": ("q4_0 keys cost 10-15% perplexity at 1024 tokens and lose long-context retrieval (4,000-token "
             "RULER-style suite: -22 points on Qwen2.5-Coder-0.5B, -13 on Gemma-3-270M); 4-bit keys per channel "
             "(--kv-dtype-k q4_ch --kv-dtype-v q4_0: +1 point on that suite, 0.33x f16's bytes) or q8_0 keys "
             "(--kv-dtype-k q8_0 --kv-dtype-v q4_0: about 40% of f16's bytes) keep f16's accuracy "
             "(benchmarks/kv_quant.md)."),
}

def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass(frozen=True)
class PartLayout:
    """One of a slot's two parts (key or value) in the packed layout: bytes [offset, offset + nbytes) of the row,
    the quants from `offset`, the f16 block scales (quantized types) from `scale_offset`."""
    dtype: str
    offset: int
    scale_offset: int
    nbytes: int


@dataclass(frozen=True)
class KVFormat:
    """The pool of one artifact: keys' and values' types (KV_TYPES) and the sizes that shape a page."""
    k: str
    v: str
    kv_heads: int
    page_size: int
    head_dim: int

    def __post_init__(self):
        for t in (self.k, self.v):
            if t not in KV_TYPES:
                raise ConfigError(f"Unknown KV cache type {t!r} (known: {', '.join(KV_TYPES)}).")
            if t in QUANTIZED_KV and self.head_dim % KV_BLOCK:
                raise ConfigError(f"A {t} KV cache needs head_dim a multiple of {KV_BLOCK} (its blocks), and this "
                                  f"model's is {self.head_dim}; use --kv-dtype f16.")
        if self.v in PAGE_SCALED_KV:
            raise ConfigError(f"{self.v} is a key type (its scales are per channel over a page's slots); values "
                              f"take q4_0 or q8_0 (--kv-dtype-k {self.v} --kv-dtype-v q4_0).")
        if self.k in PAGE_SCALED_KV and self.head_dim % self.page_size:
            raise ConfigError(f"{self.k} keys need head_dim a multiple of the page size ({self.page_size}), and "
                              f"this model's is {self.head_dim}; use --kv-dtype-k q8_0.")

    @classmethod
    def of(cls, kv_dtype, kv_heads: int, page_size: int, head_dim: int) -> "KVFormat":
        """A format from a KV type (keys and values alike), a (key, value) pair, or a format (returned)."""
        if isinstance(kv_dtype, KVFormat):
            return kv_dtype
        k, v = (kv_dtype, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
        return cls(k, v, kv_heads, page_size, head_dim)

    @property
    def packed(self) -> bool:
        return self.k != self.v or self.k in QUANTIZED_KV

    @property
    def page_scaled_keys(self) -> bool:
        """Whether the keys' scales belong to their page (q4_ch): pages are written and compacted whole."""
        return self.k in PAGE_SCALED_KV

    @property
    def channels_per_row(self) -> int:
        """q4_ch: how many channels' page scales each row of a page holds."""
        return self.head_dim // self.page_size

    @property
    def name(self) -> str:
        """A short name for kernel names and messages: f16, q8_0, or k q8_0 / v q4_0 as "q8_0-q4_0"."""
        k, v = (t.replace("float", "f") for t in (self.k, self.v))
        return k if k == v else f"{k}-{v}"

    # -- the pool -----------------------------------------------------------------------------------------------
    def part(self, which: int) -> PartLayout:
        """The key's (0) or the value's (1) part of a packed row."""
        dtype = (self.k, self.v)[which]
        offset = 0 if which == 0 else self._part_bytes(self.k)
        if dtype in QUANTIZED_KV:
            quants = self.head_dim // KV_BLOCK * QUANTIZED_KV[dtype]
            return PartLayout(dtype, offset, offset + quants, self._part_bytes(dtype))
        return PartLayout(dtype, offset, offset, self._part_bytes(dtype))

    def _part_bytes(self, dtype: str) -> int:
        if dtype in PAGE_SCALED_KV:
            return _round4(self.head_dim // 2 + 4 * self.channels_per_row)
        if dtype in QUANTIZED_KV:
            blocks = self.head_dim // KV_BLOCK
            return _round4(blocks * (QUANTIZED_KV[dtype] + 2))
        return FLOAT_KV[dtype] * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot of one KV head, key and value."""
        return self._part_bytes(self.k) + self._part_bytes(self.v)

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
        raw = np.ascontiguousarray(pages[:, 0, ..., part.offset:part.offset + part.nbytes])
        if part.dtype in FLOAT_KV:
            return _float_elements(raw[..., :FLOAT_KV[part.dtype] * self.head_dim], part.dtype)
        quants = raw[..., :part.scale_offset - part.offset]
        if part.dtype in PAGE_SCALED_KV:
            return dequantize_channels(quants, *self._page_scales(raw[..., part.scale_offset - part.offset:]))
        scales = raw[..., part.scale_offset - part.offset:][..., :2 * (self.head_dim // KV_BLOCK)].view(np.float16)
        return dequantize_kv(part.dtype, quants, scales)

    def _page_scales(self, stats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A q4_ch part's stats bytes [..., page_size, >= 4 c] -> (d, m) f16 [..., head_dim] of each page."""
        c = self.channels_per_row
        halves = np.ascontiguousarray(stats[..., :4 * c]).view(np.float16)        # [..., page_size, 2 c]
        return (halves[..., :c].reshape(*halves.shape[:-2], self.head_dim),
                halves[..., c:].reshape(*halves.shape[:-2], self.head_dim))

    def _page_stats_bytes(self, d: np.ndarray, m: np.ndarray) -> np.ndarray:
        """The inverse: f16 [..., head_dim] each -> uint8 [..., page_size, 4 c]."""
        c = self.channels_per_row
        halves = np.concatenate([d.reshape(*d.shape[:-1], self.page_size, c),
                                 m.reshape(*m.shape[:-1], self.page_size, c)], axis=-1).astype(np.float16)
        return halves.view(np.uint8)


def _float_elements(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.dtype(dtype)).astype(np.float32)


def quantize_kv(dtype: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [..., head_dim] -> (quants uint8 [..., head_dim or head_dim / 2], scales f16 [..., head_dim / 32])
    by the kernels' rule (module doc); q8_0's quants are int8 bits in uint8."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, KV_BLOCK)
    with np.errstate(divide="ignore"):
        if dtype == "q8_0":
            d = np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(127)
            inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
            q = np.rint(blocks * inv).astype(np.int8).view(np.uint8)
        elif dtype == "q4_0":
            top, bottom = blocks.max(axis=-1, keepdims=True), blocks.min(axis=-1, keepdims=True)
            m = np.where(top >= -bottom, top, bottom)
            d = m / np.float32(-8)
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
            q = _pack_nibbles(np.minimum(np.rint(blocks * inv) + np.float32(8), 15).astype(np.uint8))
        else:
            raise ValueError(dtype)
    return q.reshape(*x.shape[:-1], -1), d[..., 0].astype(np.float16)


def dequantize_kv(dtype: str, quants: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The inverse: f32 [..., head_dim]."""
    d = scales.astype(np.float32)[..., None]
    if dtype == "q8_0":
        q = quants.view(np.int8).astype(np.float32).reshape(*d.shape[:-1], KV_BLOCK)
        return (q * d).reshape(*quants.shape[:-1], -1)
    if dtype == "q4_0":
        q = _unpack_nibbles(quants).astype(np.float32).reshape(*d.shape[:-1], KV_BLOCK)
        return ((q - 8) * d).reshape(*quants.shape[:-1], -1)
    raise ValueError(dtype)


def encode_rows(fmt: KVFormat, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Packed rows uint8 [..., row_bytes] holding keys and values f32 [..., head_dim] as kv_append stores them
    (padding bytes zero): the numpy emulation of a packed store. q4_ch keys, whose scales are their page's, are
    left zero here (append_page_keys writes them)."""
    row = np.zeros((*k.shape[:-1], fmt.row_bytes), np.uint8)
    for which, x in ((0, k), (1, v)):
        part = fmt.part(which)
        if part.dtype in PAGE_SCALED_KV:
            continue
        if part.dtype in FLOAT_KV:
            if part.dtype == "bfloat16":     # rounded to nearest even, as TVM's cast
                u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
                bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            else:
                bits = np.asarray(x, np.float32).astype(part.dtype)
            row[..., part.offset:part.offset + bits.itemsize * fmt.head_dim] = bits.view(np.uint8).reshape(
                *x.shape[:-1], -1)
            continue
        q, d = quantize_kv(part.dtype, x)
        row[..., part.offset:part.scale_offset] = q
        row[..., part.scale_offset:part.scale_offset + 2 * d.shape[-1]] = d.view(np.uint8).reshape(*d.shape[:-1], -1)
    return row


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 quants [..., head_dim] in [0, 15] -> [..., head_dim / 2] in q4_0's order (per block of 32: element j
    in byte j's low nibble, element j + 16 in its high one)."""
    blocks = q.reshape(*q.shape[:-1], -1, KV_BLOCK)
    return (blocks[..., :KV_BLOCK // 2] | (blocks[..., KV_BLOCK // 2:] << 4)).reshape(*q.shape[:-1], -1)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    blocks = packed.reshape(*packed.shape[:-1], -1, KV_BLOCK // 2)
    return np.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def quantize_channels(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q4_ch's rule (module doc): x f32 [..., n, head_dim], the n slots a page holds -> (quants uint8 [..., n,
    head_dim / 2], d f16 [..., head_dim], m f16 [..., head_dim])."""
    x = np.asarray(x, np.float32)
    lo, hi = x.min(axis=-2), x.max(axis=-2)
    d, m = ((hi - lo) / np.float32(15)).astype(np.float16), lo.astype(np.float16)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(df != 0, np.float32(1) / df, np.float32(0)).astype(np.float32)
    q = np.rint((x - m.astype(np.float32)[..., None, :]) * inv[..., None, :])
    q = np.minimum(np.maximum(q, np.float32(0)), np.float32(15)).astype(np.uint8)
    return _pack_nibbles(q), d, m


def dequantize_channels(quants: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """quants uint8 [..., n, head_dim / 2], d and m f16 [..., head_dim] -> f32 [..., n, head_dim]."""
    q = _unpack_nibbles(quants).astype(np.float32)
    return q * d.astype(np.float32)[..., None, :] + m.astype(np.float32)[..., None, :]


def append_page_keys(fmt: KVFormat, page: np.ndarray, held: int, keys: np.ndarray) -> np.ndarray:
    """The numpy emulation of kv_append's q4_ch store: a page's rows uint8 [kv_heads, page_size, row] holding
    `held` slots, with keys f32 [n, kv_heads, head_dim] appended at slots held .. held + n - 1 (<= page_size);
    returns the page's new rows (value parts untouched). The held slots are read back as stored and the page is
    encoded again over held + n slots."""
    part, n = fmt.part(0), held + len(keys)
    out = page.copy()
    stored = fmt.decode(page[None, None], 0)[0][:, :held]                    # [kvh, held, d]
    x = np.concatenate([stored, np.asarray(keys, np.float32).transpose(1, 0, 2)], axis=1)
    return _write_page_keys(fmt, out, part, x, n)


def compact_page_keys(fmt: KVFormat, page: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The numpy emulation of compaction's q4_ch store into one destination page: kept keys f32 [kv_heads, n,
    head_dim] (the sources' stored values) encoded over slots 0 .. n - 1 of `page` [kv_heads, page_size, row]."""
    return _write_page_keys(fmt, page.copy(), fmt.part(0), kept, kept.shape[1])


def _write_page_keys(fmt, out, part, x, n):
    q, d, m = quantize_channels(x)
    out[:, :n, part.offset:part.scale_offset] = q
    out[:, :, part.scale_offset:part.scale_offset + 4 * fmt.channels_per_row] = fmt._page_stats_bytes(d, m)
    return out


def gather_slots(fmt: KVFormat | None, pages: np.ndarray, sources) -> np.ndarray:
    """Pages [n, 1 or 2, kv_heads, page_size, width] of one layer with slot sources[h][i] moved to slot i for every
    head h (ascending sources): rows move whole; q4_ch keys are re-encoded per destination page from the sources'
    stored values (the compaction kernel's rule). fmt None: a pool without a format, whose rows move as they are.
    Returns the new pages."""
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
