"""q4_ch (keys only): 4 bits per channel over a page, KIVI's grouping. A key's channels differ in range by an order
of magnitude while one channel varies little across tokens, so each channel of a page takes its own scale and
minimum. Per-token 4-bit blocks (q4_0) move Qwen2.5-Coder-0.5B's attention logits by 10-19% of their spread and cost
10-15% perplexity at 1024 tokens; per channel over 16 slots, 4-7% and -0.1 to +1.6% on three models, and the
4,000-token suite keeps f16's score (benchmarks/kv_quant.md).

A part is the row's codes, uint8 [head_dim / 2] in q4_0's nibble order, then this row's share of its page's
per-channel f16 scales and minimums: row o holds channels [o c, (o + 1) c), c = head_dim / page_size, as f16 d [c]
then f16 m [c]; x = m + q * d. Its rows cost 4 head_dim / page_size bytes more than q4_0's (48 against 36 for
head_dim 64), and a page is written whole: kv_append re-encodes the page's held slots (read back as stored) with the
new ones, compaction re-encodes each destination page from the kept slots' stored values.

The rule, over the n slots a page holds (the encoded values, not the pool's stale slots past them): lo, hi = the
channel's min and max, d = (hi - lo) / 15, m = lo, both stored as f16; id = 1/d (0 if d is 0);
q = min(15, max(0, round-half-even((x - m) * id))) with d and m as stored. Reading back m + q * d is exact to fuse
or not (q * d has at most 15 significant bits), so a page re-encoded from what it holds gets the same bytes from
numpy and from the kernels.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from . import nibbles
from .base import Field, KVCodec
from .gpu_words import WORD, float_to_half, half_pair_word, half_to_float, low_half, or_bytes, u32
from .tir import T, macro

BLOCK, HALF = nibbles.BLOCK, nibbles.HALF


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# (the helpers come before the macros that call them: a macro resolves names when it is defined)
class _PageKeys:
    """A page's keys read through its scales and minimums copied into channel order (rows 0 and 1 of `scales`)."""

    def __init__(self, rows, scales):
        self.rows, self.scales = rows, scales

    def load(self, which, page, h, slot, d):
        return T.Cast("float32", nibbles.cpu_nibble(self.rows.quants[0], page, h, slot, d)) * self.scales[0, d] \
            + self.scales[1, d]


def _cpu_code(values, stats, o, d):
    """The code of values[o, d]: min(15, max(0, round((x - m) / d))) as uint8."""
    scaled = (values[o, d] - stats[2, d]) * stats[3, d]
    return T.Cast("uint8", T.min(T.max(T.round(scaled), T.float32(0)), T.float32(15)))


def _stats_word(bits, channel, which):
    """The halves of channels `channel` and `channel` + 1's scale (which 0) or minimum (1), low half first."""
    return half_pair_word(bits[which, channel], bits[which, channel + 1])


def _code_word(staged, coding, o, w):
    """Word w of row o's codes: bytes 4w .. 4w + 3 of q4_0's order, each min(15, max(0, round((x - m) / d))) of
    staged[o, :] with m and 1 / d as stored."""
    block, first = w // (HALF // WORD), w % (HALF // WORD) * WORD

    def code(e):
        d = block * BLOCK + e
        q = T.round((staged[o, d] - coding[0, d]) * coding[1, d])
        return T.Cast("uint32", T.min(T.max(q, T.float32(0)), T.float32(15)))
    return or_bytes([T.bitwise_or(code(first + e), T.shift_left(code(first + e + HALF), u32(4)))
                     for e in range(WORD)])


class Q4Ch(KVCodec):
    name = flag = "q4_ch"
    keys_only = True
    keys_only_why = "its scales are per channel over a page's slots"
    page_scaled = True
    page_scratch_rows = 2        # cpu_read_page's scales and minimums
    # with q8_0 values, int8 matmuls: max |d log-prob| 2.55, 8.45 and 1.15 on the three models (testing/conformance.py)
    tolerance = (12.0, 3.0)

    def fields(self, head_dim, page_size):
        return Field("uint8", head_dim // 2), Field("float16", 2 * self.channels_per_row(head_dim, page_size))

    @staticmethod
    def channels_per_row(head_dim: int, page_size: int) -> int:
        """How many channels' page scales each row of a page holds."""
        return head_dim // page_size

    def check(self, head_dim, page_size):
        if head_dim % BLOCK:
            raise ConfigError(f"A {self.name} KV cache needs head_dim a multiple of {BLOCK} (its blocks), and this "
                              f"model's is {head_dim}; use --kv-dtype f16.")
        if head_dim % page_size:
            raise ConfigError(f"{self.name} keys need head_dim a multiple of the page size ({page_size}), and this "
                              f"model's is {head_dim}; use --kv-dtype-k q8_0.")

    # -- numpy ----------------------------------------------------------------------------------------------------
    def quantize_page(self, part, x):
        """x f32 [..., n, head_dim] -> (codes uint8 [..., n, head_dim / 2], (d, m) f16 [..., head_dim])."""
        q, d, m = quantize_channels(x)
        return q, (d, m)

    def dequantize_page(self, part, q, side):
        return dequantize_channels(q, *side)

    def page_side_rows(self, part, side):
        """(d, m) f16 [..., head_dim] -> every row's share f16 [..., page_size, 2 c]."""
        d, m = side
        c = self.channels_per_row(part.head_dim, part.page_size)
        return np.concatenate([d.reshape(*d.shape[:-1], part.page_size, c),
                               m.reshape(*m.shape[:-1], part.page_size, c)], axis=-1).astype(np.float16)

    def page_side_of(self, part, s):
        """The inverse: rows' shares f16 [..., page_size, 2 c] -> (d, m) f16 [..., head_dim]."""
        c = self.channels_per_row(part.head_dim, part.page_size)
        return (s[..., :c].reshape(*s.shape[:-2], part.head_dim), s[..., c:].reshape(*s.shape[:-2], part.head_dim))

    def dequantize(self, part, q, s):
        return dequantize_channels(q, *self.page_side_of(part, s))

    # -- CPU ----------------------------------------------------------------------------------------------------------
    def cpu_load(self, rows, which, page, h, slot, d):
        # m + q * d: q * d is exact, so a fused multiply-add rounds as numpy does
        return T.Cast("float32", nibbles.cpu_nibble(rows.quants[which], page, h, slot, d)) \
            * self.cpu_page_scale(rows, which, page, h, d, 0) + self.cpu_page_scale(rows, which, page, h, d, 1)

    def cpu_page_scale(self, rows, which, page, h, d, minimum: int):
        """Channel d's scale (minimum 0) or minimum (1) in its page, as float32."""
        c = self.channels_per_row(rows.fmt.head_dim, rows.fmt.page_size)
        return T.Cast("float32", rows.scales[which][page, h, d // c, minimum * c + d % c])

    @macro
    def cpu_read_page(self, rows, scales, page, h):
        """The page's key scales into scales[0, :] and its minimums into scales[1, :], in channel order (a buffer
        f32 [>= 2, head_dim]): a loop over a page's slots then reads them (cpu_page_keys) as contiguous lanes,
        where cpu_load gathers them from the rows that hold them for every element."""
        c = T.meta_var(self.channels_per_row(rows.fmt.head_dim, rows.fmt.page_size))
        for o in range(rows.fmt.page_size):
            for j in T.vectorized(c):
                scales[0, o * c + j] = self.cpu_page_scale(rows, 0, page, h, o * c + j, 0)
                scales[1, o * c + j] = self.cpu_page_scale(rows, 0, page, h, o * c + j, 1)

    def cpu_page_keys(self, rows, scales):
        """A reader of one page's keys through the scales cpu_read_page copied."""
        return _PageKeys(rows, scales)

    @macro
    def cpu_encode_page(self, rows, page, h, values, end):
        """The keys f32 values[0 .. end - 1, :] (a buffer [page_size, head_dim]) into slots 0 .. end - 1 of a
        page, and the page's per-channel scales and minimums."""
        q = T.meta_var(rows.quants[0])
        s = T.meta_var(rows.scales[0])
        D = T.meta_var(rows.fmt.head_dim)
        c = T.meta_var(self.channels_per_row(rows.fmt.head_dim, rows.fmt.page_size))
        # per channel: min, max, then the stored minimum and 1 / the stored scale
        stats = T.decl_buffer((4, D), "float32", scope="global")
        for d in T.vectorized(D):
            stats[0, d] = values[0, d]
            stats[1, d] = values[0, d]
        for o in range(1, end):
            for d in T.vectorized(D):
                stats[0, d] = T.min(stats[0, d], values[o, d])
                stats[1, d] = T.max(stats[1, d], values[o, d])
        for d in range(D):
            s[page, h, d // c, d % c] = T.Cast("float16", (stats[1, d] - stats[0, d]) / T.float32(15))
            s[page, h, d // c, c + d % c] = T.Cast("float16", stats[0, d])
            stats[2, d] = T.Cast("float32", s[page, h, d // c, c + d % c])
            stats[3, d] = T.Cast("float32", s[page, h, d // c, d % c])
            stats[3, d] = T.Select(stats[3, d] != T.float32(0), T.float32(1) / stats[3, d], T.float32(0))
        for o in range(end):
            for b in range(D // BLOCK):
                for j in T.vectorized(HALF):
                    q[page, h, o, b * HALF + j] = _cpu_code(values, stats, o, b * BLOCK + j) | (
                        _cpu_code(values, stats, o, b * BLOCK + HALF + j) << T.uint8(4))

    # -- GPU ----------------------------------------------------------------------------------------------------------
    def gpu_load(self, rows, pool, which, page, h, slot, d):
        # m + q * d: q * d is exact, so fused or not it rounds as numpy's
        code = nibbles.gpu_nibble(pool, rows.fmt.part(which).offset // WORD, page, h, slot, d)
        return T.Cast("float32", code) * self.gpu_page_scale(rows, pool, page, h, d, 0) \
            + self.gpu_page_scale(rows, pool, page, h, d, 1)

    def gpu_page_scale(self, rows, pool, page, h, d, minimum: int):
        """Channel d's scale (minimum 0) or minimum (1) in its page, as float32: half d % c (of the scales, or of
        the minimums after them) in row d // c's share (c = channels_per_row, even)."""
        c = self.channels_per_row(rows.fmt.head_dim, rows.fmt.page_size)
        index = minimum * c + d % c
        return half_to_float(low_half(pool[page, 0, h, d // c, rows.fmt.part(0).scale_offset // WORD + index // 2],
                                      index))

    @macro
    def gpu_encode_page(self, rows, pool, page, h, end, staged, tx, threads):
        """Slots 0 .. end - 1 of a page take the encoding of staged[0 .. end - 1, :] (f32 [page_size, head_dim] in
        workgroup memory, complete: the caller's barrier), and every row of the page its share of the per-channel
        stats: invocation d takes channel d's minimum and maximum and its stored scale and minimum, and after a
        barrier every word of the page's keys is composed by one invocation. Every invocation of the workgroup
        must reach it."""
        P = T.meta_var(rows.fmt.page_size)
        D = T.meta_var(rows.fmt.head_dim)
        c = T.meta_var(self.channels_per_row(rows.fmt.head_dim, rows.fmt.page_size))
        first = T.meta_var(rows.fmt.part(0).offset // WORD)
        stats_first = T.meta_var(rows.fmt.part(0).scale_offset // WORD)
        # per channel: the f16 bits of its scale (0) and minimum (1); the minimum as f32 (0) and 1 / scale (1)
        bits = T.alloc_buffer((2, D), "uint32", scope="shared")
        coding = T.alloc_buffer((2, D), "float32", scope="shared")
        range_ = T.alloc_buffer((2,), "float32", scope="local")     # the channel's min and max, then m and d
        halves = T.alloc_buffer((2,), "uint32", scope="local")      # the f16 bits of d and m
        for i in T.unroll(ceil_div(D, threads)):
            if i * threads + tx < D:
                range_[0] = staged[0, i * threads + tx]
                range_[1] = staged[0, i * threads + tx]
                for o in range(1, T.Cast("int64", end)):
                    range_[0] = T.min(range_[0], staged[o, i * threads + tx])
                    range_[1] = T.max(range_[1], staged[o, i * threads + tx])
                halves[0] = float_to_half((range_[1] - range_[0]) / T.float32(15))
                halves[1] = float_to_half(range_[0])
                range_[0] = half_to_float(halves[1])
                range_[1] = half_to_float(halves[0])
                bits[0, i * threads + tx] = halves[0]
                bits[1, i * threads + tx] = halves[1]
                coding[0, i * threads + tx] = range_[0]
                coding[1, i * threads + tx] = T.Select(range_[1] != T.float32(0), T.float32(1) / range_[1],
                                                       T.float32(0))
        T.tvm_storage_sync("shared")
        # the stats, D words: word k of row o holds two channels' halves, of its c scales (k < c / 2), then of its
        # c minimums (c is even: head_dim and the page size are multiples of 32 and 16)
        for i in T.unroll(ceil_div(D, threads)):
            o = T.meta_var((i * threads + tx) // c)
            k = T.meta_var((i * threads + tx) % c)
            if i * threads + tx < D:
                pool[page, 0, h, o, stats_first + k] = _stats_word(bits, o * c + k % (c // 2) * 2, k // (c // 2))
        # the codes, D / 8 words a row: word w of row o (bytes 4w .. 4w + 3, all in one block of 32 elements)
        for i in T.unroll(ceil_div(P * D // 8, threads)):
            o = T.meta_var((i * threads + tx) // (D // 8))
            w = T.meta_var((i * threads + tx) % (D // 8))
            if T.Cast("int64", o) < T.Cast("int64", end):
                pool[page, 0, h, o, first + w] = _code_word(staged, coding, o, w)


def quantize_channels(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule: x f32 [..., n, head_dim], the n slots a page holds -> (codes uint8 [..., n, head_dim / 2], d f16
    [..., head_dim], m f16 [..., head_dim])."""
    x = np.asarray(x, np.float32)
    lo, hi = x.min(axis=-2), x.max(axis=-2)
    d, m = ((hi - lo) / np.float32(15)).astype(np.float16), lo.astype(np.float16)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(df != 0, np.float32(1) / df, np.float32(0)).astype(np.float32)
    q = np.rint((x - m.astype(np.float32)[..., None, :]) * inv[..., None, :])
    q = np.minimum(np.maximum(q, np.float32(0)), np.float32(15)).astype(np.uint8)
    return nibbles.pack(q), d, m


def dequantize_channels(quants: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """codes uint8 [..., n, head_dim / 2], d and m f16 [..., head_dim] -> f32 [..., n, head_dim]."""
    q = nibbles.unpack(quants).astype(np.float32)
    return q * d.astype(np.float32)[..., None, :] + m.astype(np.float32)[..., None, :]


CODEC = Q4Ch()
