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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

KV_BLOCK = 32
FLOAT_KV = {"float32": 4, "float16": 2, "bfloat16": 2}
QUANTIZED_KV = {"q8_0": KV_BLOCK, "q4_0": KV_BLOCK // 2}     # quant bytes per block
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
             "RULER-style suite: -22 points on Qwen2.5-Coder-0.5B, -13 on Gemma-3-270M); --kv-dtype-k q8_0 "
             "--kv-dtype-v q4_0 keeps f16's accuracy in about 40% of its bytes (benchmarks/kv_quant.md)."),
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
        scales = raw[..., part.scale_offset - part.offset:][..., :2 * (self.head_dim // KV_BLOCK)].view(np.float16)
        return dequantize_kv(part.dtype, quants, scales)


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
            q = np.minimum(np.rint(blocks * inv) + np.float32(8), 15).astype(np.uint8)
            q = q[..., :16] | (q[..., 16:] << 4)
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
        packed = quants.reshape(*d.shape[:-1], KV_BLOCK // 2)
        q = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.float32)
        return ((q - 8) * d).reshape(*quants.shape[:-1], -1)
    raise ValueError(dtype)


def encode_rows(fmt: KVFormat, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Packed rows uint8 [..., row_bytes] holding keys and values f32 [..., head_dim] as kv_append stores them
    (padding bytes zero): the numpy emulation of a packed store."""
    row = np.zeros((*k.shape[:-1], fmt.row_bytes), np.uint8)
    for which, x in ((0, k), (1, v)):
        part = fmt.part(which)
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
