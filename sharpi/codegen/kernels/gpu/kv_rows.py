"""How the GPU kernels read and write the KV pool's slots, for every KVFormat (sharpi.common.kv_format): the twin
of ..kv_rows for kernels that must also compile to WGSL.

The plain float layout is read and written as its element type, as before. The packed layout (one row of bytes a
slot: the key's part, then the value's; a quantized part is its quants, then its blocks' f16 scales, padded to 4
bytes) is taken as 32-bit words: the kernels' pool parameter is a uint32 [pages, 1, kv_heads, page_size,
row_bytes / 4] view of the runtime's uint8 pool (attach_kernels makes the view). WGSL has no 8- or 16-bit integer
types, so the bytes, nibbles and f16 halves of a word are taken apart with shifts and masks, and an f16 scale is
turned into f32 (and back, when stored) by bit arithmetic: the same TIR then runs on Vulkan, where the tests hold
it to kv_format's numpy emulation, and on CUDA.

A store composes whole words: a slot's row is written by the invocations of its (token, KV head) workgroup, each
owning whole words (no two write one word, so no byte or sub-word write is ever needed). First the invocations
owning a block (one per quantized block of the key and of the value) compute its scale d and 1 / d into
workgroup memory (the rule of kv_format: max and min over the block, in float32); after a barrier every word of
the row is composed from the source floats and those scales. Float -> f16 rounds to nearest even on the bits
(as numpy's float16 cast: subnormals, overflow to infinity, NaN), so the stored scales equal the emulation's bit
for bit wherever the device's f32 division is correctly rounded (lavapipe's is; CUDA's is under the
--prec-div=true that targets/cuda.py adds to TVM's --use_fast_math). A subnormal f32 block scale (blocks below
~1e-36) may be flushed to zero by a GPU; the emulation keeps it.

q4_ch keys, whose scales belong to their page, are written a page at a time by one workgroup (store_page_keys,
encode_staged_keys: the page staged as f32 in workgroup memory, a channel's min and max per invocation, then every
word of the page's keys by one invocation); kv_append runs a workgroup per page it writes and KV head, compaction
one per layer and KV head, walking its destination pages in order.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ....common.errors import ConfigError
from ..common import ceil_div
from ....common.kv_format import FLOAT_KV, KV_BLOCK, PAGE_SCALED_KV, QUANTIZED_KV, KVFormat

WORD = 4                      # bytes in a word of the packed pool
_Q4_HALF = KV_BLOCK // 2      # q4_0: byte j of a block holds elements j (low nibble) and j + 16 (high)


def _u32(value: int):
    return T.uint32(value)


def _shift(amount):
    """A shift amount as uint32 (TVM's shifts want both operands of one type; WGSL wants u32 amounts)."""
    return T.Cast("uint32", amount)


# -- f16 and bf16 bits ------------------------------------------------------------------------------------------
def half_to_float(bits):
    """The f32 value of an IEEE half whose bits are the low 16 of a uint32 expression, built as f32 bits: normals
    by moving exponent and significand into place and rebiasing (15 -> 127); subnormals as the significand
    converted to f32 (exact) with 24 taken off its exponent (no float constant: TVM's WGSL prints floats with 7
    digits, and 2^-24 is not one of them); infinities and NaNs with exponent 255."""
    exponent = T.bitwise_and(T.shift_right(bits, _u32(10)), _u32(31))
    significand = T.bitwise_and(bits, _u32(0x3FF))
    normal = T.shift_left(T.bitwise_and(bits, _u32(0x7FFF)), _u32(13)) + _u32(0x38000000)
    subnormal = T.Select(significand == _u32(0), _u32(0),
                         T.reinterpret("uint32", T.Cast("float32", significand)) - _u32(24 << 23))
    special = T.bitwise_or(_u32(0x7F800000), T.shift_left(significand, _u32(13)))
    magnitude = T.Select(exponent == _u32(0), subnormal, T.Select(exponent == _u32(31), special, normal))
    sign = T.shift_left(T.bitwise_and(bits, _u32(0x8000)), _u32(16))
    return T.reinterpret("float32", T.bitwise_or(sign, magnitude))


def float_to_half(x):
    """The bits (uint32, low 16) of f32 x rounded to the nearest half, ties to even, as numpy's float16 cast:
    normals by rebiasing the exponent and rounding away the 13 low significand bits; results below 2^-14 by
    shifting the significand (implicit bit included) right by 14..24 places and rounding what falls off;
    overflow to infinity; NaN to the quiet NaN 0x7E00."""
    u = T.reinterpret("uint32", x)
    sign = T.bitwise_and(T.shift_right(u, _u32(16)), _u32(0x8000))
    a = T.bitwise_and(u, _u32(0x7FFFFFFF))
    lsb = T.bitwise_and(T.shift_right(a, _u32(13)), _u32(1))
    normal = T.min(T.shift_right(a - _u32(0x38000000) + _u32(0xFFF) + lsb, _u32(13)), _u32(0x7C00))
    # below 2^-14: value * 2^24 = significand >> (126 - exponent), for exponents 102 .. 112
    exponent = T.shift_right(a, _u32(23))
    places = T.max(T.min(_u32(126) - exponent, _u32(24)), _u32(14))     # unsigned: exponents > 126 wrap to 24
    significand = T.bitwise_or(T.bitwise_and(a, _u32(0x7FFFFF)), _u32(0x800000))
    kept = T.shift_right(significand, places)
    rest = T.bitwise_and(significand, T.shift_left(_u32(1), places) - _u32(1))
    half = T.shift_left(_u32(1), places - _u32(1))
    round_up = T.Or(rest > half, T.And(rest == half, T.bitwise_and(kept, _u32(1)) == _u32(1)))
    small = T.Select(a <= _u32(0x33000000), _u32(0), kept + T.Select(round_up, _u32(1), _u32(0)))
    magnitude = T.Select(a >= _u32(0x7F800000), T.Select(a > _u32(0x7F800000), _u32(0x7E00), _u32(0x7C00)),
                         T.Select(a >= _u32(0x38800000), normal, small))
    return T.bitwise_or(sign, magnitude)


def float_to_bfloat(x):
    """The bits (uint32, low 16) of f32 x rounded to bfloat16, ties to even (TVM's cast, encode_rows' rule)."""
    u = T.reinterpret("uint32", x)
    return T.shift_right(u + _u32(0x7FFF) + T.bitwise_and(T.shift_right(u, _u32(16)), _u32(1)), _u32(16))


def _float_bits(dtype: str, x):
    return float_to_half(x) if dtype == "float16" else float_to_bfloat(x)


def _low_half(word, index):
    """Half `index % 2` (0: low) of a word, as uint32."""
    return T.bitwise_and(T.shift_right(word, _shift(index % 2 * 16)), _u32(0xFFFF))


class GpuRows:
    """One kernel's view of the pool: its parameter's shape and type, element reads, and (store_row) writes."""

    def __init__(self, fmt: KVFormat):
        self.fmt = fmt
        if fmt.packed and fmt.row_bytes % WORD:
            raise ConfigError(f"The GPU kernels read a {fmt.name} KV cache as 32-bit words, and its rows of "
                              f"{fmt.row_bytes} bytes (head_dim {fmt.head_dim}) are not whole words; use an even "
                              f"head_dim or --kv-dtype f16.")
        self.words = fmt.row_bytes // WORD

    @classmethod
    def of(cls, kv_dtype, kv_heads: int, page_size: int, head_dim: int) -> "GpuRows":
        """From a KV type name (keys and values alike), a (key, value) pair, or a KVFormat."""
        return cls(KVFormat.of(kv_dtype, kv_heads, page_size, head_dim))

    # -- the pool parameter -----------------------------------------------------------------------------------
    @property
    def pool_dtype(self) -> str:
        return "uint32" if self.fmt.packed else self.fmt.k

    def pool_shape(self, pages) -> tuple:
        fmt = self.fmt
        if fmt.packed:
            return (pages, 1, fmt.kv_heads, fmt.page_size, self.words)
        return fmt.pool_shape(pages)

    @property
    def row_units(self) -> tuple[int, int]:
        """(parts, elements a part) of a slot's row in the pool's elements: (2, head_dim) plain, (1, words)
        packed; a compaction moves these."""
        return (1, self.words) if self.fmt.packed else (2, self.fmt.head_dim)

    def dtype(self, which: int) -> str:
        return (self.fmt.k, self.fmt.v)[which]

    @property
    def dot_step(self) -> int:
        """Elements a dot product over a key takes per (unrolled) step: a packed row's 4 that share a word (a
        q8_0 or q4_0 word's 4 quants, two f16 words), so that the compiler loads the word and its block's scale
        once for them; 1 for the plain layout."""
        return 4 if self.fmt.packed and self.fmt.head_dim % 4 == 0 else 1

    # -- reads ------------------------------------------------------------------------------------------------
    def load(self, pool, which: int, page, h, slot, d):
        """Element d of the key (0) or value (1) in a slot, as float32."""
        if not self.fmt.packed:
            return T.Cast("float32", pool[page, which, h, slot, d])
        part, dtype = self.fmt.part(which), self.dtype(which)
        base = part.offset // WORD

        def word(i):
            return pool[page, 0, h, slot, base + i]

        if dtype == "float32":
            return T.reinterpret("float32", word(d))
        if dtype == "float16":
            return half_to_float(_low_half(word(d // 2), d))
        if dtype == "bfloat16":
            return T.reinterpret("float32", T.shift_left(_low_half(word(d // 2), d), _u32(16)))
        if dtype in PAGE_SCALED_KV:       # m + q * d: q * d is exact, so fused or not it rounds as numpy's
            return T.Cast("float32", self.nibble(pool, which, page, h, slot, d)) * self.page_scale(pool, page, h, d, 0) \
                + self.page_scale(pool, page, h, d, 1)
        scale = half_to_float(_low_half(pool[page, 0, h, slot, part.scale_offset // WORD + d // KV_BLOCK // 2],
                                        d // KV_BLOCK))
        if dtype == "q8_0":
            # byte d % 4 of the word, sign-extended by an arithmetic shift of the word as int32
            signed = T.shift_right(T.shift_left(T.reinterpret("int32", word(d // 4)), T.Cast("int32", 24 - d % 4 * 8)),
                                   24)
            return T.Cast("float32", signed) * scale
        return (T.Cast("float32", self.nibble(pool, which, page, h, slot, d)) - T.float32(8)) * scale

    def nibble(self, pool, which: int, page, h, slot, d):
        """A 4-bit part's (q4_0, q4_ch) quant of element d as uint32: byte j % 16 of d's block of 32, nibble
        j // 16 (j = d % 32)."""
        j = d % KV_BLOCK
        byte = d // KV_BLOCK * _Q4_HALF + j % _Q4_HALF
        word = pool[page, 0, h, slot, self.fmt.part(which).offset // WORD + byte // 4]
        return T.bitwise_and(T.shift_right(word, _shift(byte % 4 * 8 + j // _Q4_HALF * 4)), _u32(15))

    def page_scale(self, pool, page, h, d, minimum: int):
        """q4_ch keys: channel d's scale (minimum 0) or minimum (1) in its page, as float32: half d % c (of the
        scales, or of the minimums after them) in row d // c's stats (c = channels_per_row, even)."""
        c = self.fmt.channels_per_row
        index = minimum * c + d % c
        return half_to_float(_low_half(pool[page, 0, h, d // c, self.fmt.part(0).scale_offset // WORD + index // 2],
                                       index))

    # -- the store's pieces -----------------------------------------------------------------------------------
    def blocks(self, which: int) -> int:
        """Quantized blocks of a part (0 for a float part)."""
        return self.fmt.head_dim // KV_BLOCK if self.dtype(which) in QUANTIZED_KV else 0

    def regions(self, which: int) -> tuple[int, int, int]:
        """A part's words: (first word, quant or element words, scale words incl. padding)."""
        part = self.fmt.part(which)
        if self.dtype(which) in FLOAT_KV:
            return part.offset // WORD, part.nbytes // WORD, 0
        quant_words = (part.scale_offset - part.offset) // WORD
        return part.offset // WORD, quant_words, part.nbytes // WORD - quant_words

    def element_word(self, which: int, x, t, h, i):
        """Word i of a float part holding x[t, h, :] (f32 [n, kv_heads, head_dim])."""
        dtype = self.dtype(which)
        if dtype == "float32":
            return T.reinterpret("uint32", x[t, h, i])
        return T.bitwise_or(_float_bits(dtype, x[t, h, 2 * i]),
                            T.shift_left(_float_bits(dtype, x[t, h, 2 * i + 1]), _u32(16)))

    def quant_word(self, which: int, x, t, h, i, inverse):
        """Word i of a quantized part's quants: 4 int8 quants (q8_0) or 4 bytes of two nibbles (q4_0) of
        x[t, h, :] * inverse[block], rounded half to even (T.round: WGSL's round, CUDA's nearbyintf)."""
        if self.dtype(which) == "q8_0":
            inv = inverse[i // (KV_BLOCK // WORD)]
            return _or_bytes([T.Cast("uint32", T.bitwise_and(T.Cast("int32", T.round(x[t, h, 4 * i + e] * inv)), 255))
                              for e in range(WORD)])
        block, first = i // (_Q4_HALF // WORD), i % (_Q4_HALF // WORD) * WORD
        inv = inverse[block]

        def nibble(e):
            # min(15, round(x / d) + 8): x / d lies in [-8, 8]
            return T.Cast("uint32", T.min(T.round(x[t, h, block * KV_BLOCK + e] * inv) + T.float32(8), T.float32(15)))
        return _or_bytes([T.bitwise_or(nibble(first + e), T.shift_left(nibble(first + e + _Q4_HALF), _u32(4)))
                          for e in range(WORD)])

    def scale_word(self, which: int, i, scales):
        """Word i of a part's scales: the f16 scales of blocks 2i and 2i + 1 (0 past the last block)."""
        upper = T.Select(2 * i + 1 < self.blocks(which), float_to_half(scales[2 * i + 1]), _u32(0))
        return T.bitwise_or(float_to_half(scales[2 * i]), T.shift_left(upper, _u32(16)))


def _even(blocks: int) -> int:
    """A per-block array's size: the block count rounded up to even, at least 2."""
    return max(2, blocks + blocks % 2)


def _or_bytes(values):
    """One word from four byte values (uint32 < 256), the first in the low byte."""
    word = values[0]
    for e in range(1, WORD):
        word = T.bitwise_or(word, T.shift_left(values[e], _u32(8 * e)))
    return word


@T.macro
def _block_scale(rows, which, x, t, h, b, scales, inverse, stats):
    """scales[b] = block b's d of x[t, h, :] and inverse[b] = 1 / d (0 for d == 0), by kv_format's rule; d is
    computed in local memory (reading back a shared value just written would want a barrier in this branch)."""
    if rows.dtype(which) == "q8_0":
        # max |x| / 127: the maximum of absolute values, so an all-zero block's d is +0 as numpy's (a GPU's max of
        # +0 and the -0 of negating the minimum may be either)
        stats[0] = T.abs(x[t, h, b * KV_BLOCK])
        for e in range(1, KV_BLOCK):
            stats[0] = T.max(stats[0], T.abs(x[t, h, b * KV_BLOCK + e]))
        stats[2] = stats[0] / T.float32(127)
        inverse[b] = T.Select(stats[2] > T.float32(0), T.float32(1) / stats[2], T.float32(0))
    else:
        # the value of largest magnitude (the positive one on a tie) / -8
        stats[0] = x[t, h, b * KV_BLOCK]
        stats[1] = x[t, h, b * KV_BLOCK]
        for e in range(1, KV_BLOCK):
            stats[0] = T.max(stats[0], x[t, h, b * KV_BLOCK + e])
            stats[1] = T.min(stats[1], x[t, h, b * KV_BLOCK + e])
        stats[2] = T.Select(stats[0] >= T.float32(0) - stats[1], stats[0], stats[1]) / T.float32(-8)
        inverse[b] = T.Select(stats[2] != T.float32(0), T.float32(1) / stats[2], T.float32(0))
    scales[b] = stats[2]


@T.macro
def _store_part(rows, which, pool, x, t, h, page, slot, scales, inverse, tx, threads):
    """The words of one part of a slot's row, each by one invocation (word i by invocation i % threads)."""
    first = T.meta_var(rows.regions(which)[0])
    count = T.meta_var(rows.regions(which)[1])
    scale_words = T.meta_var(rows.regions(which)[2])
    if rows.blocks(which) == 0:
        for c in T.unroll((count + threads - 1) // threads):
            if c * threads + tx < count:
                pool[page, 0, h, slot, first + c * threads + tx] = rows.element_word(which, x, t, h,
                                                                                     c * threads + tx)
    else:
        for c in T.unroll((count + threads - 1) // threads):
            if c * threads + tx < count:
                pool[page, 0, h, slot, first + c * threads + tx] = rows.quant_word(which, x, t, h, c * threads + tx,
                                                                                   inverse)
        for c in T.unroll((scale_words + threads - 1) // threads):
            if c * threads + tx < scale_words:
                pool[page, 0, h, slot, first + count + c * threads + tx] = rows.scale_word(which, c * threads + tx,
                                                                                           scales)


@T.macro
def store_row(rows, pool, k, v, t, h, page, slot, tx, threads):
    """A slot's key k[t, h, :] and value v[t, h, :] (f32 [n, kv_heads, head_dim]) into the pool, by the
    `threads` invocations (tx) of one workgroup, which every one of them must reach (it holds a barrier when
    a part is quantized). The numpy emulation is kv_format.encode_rows. Page-scaled keys (q4_ch) are left to
    store_page_keys: only the value is stored."""
    if not rows.fmt.packed:
        for c in T.unroll((rows.fmt.head_dim + threads - 1) // threads):
            if c * threads + tx < rows.fmt.head_dim:
                pool[page, 0, h, slot, c * threads + tx] = T.Cast(rows.fmt.k, k[t, h, c * threads + tx])
                pool[page, 1, h, slot, c * threads + tx] = T.Cast(rows.fmt.k, v[t, h, c * threads + tx])
    else:
        keys = T.meta_var(not rows.fmt.page_scaled_keys)
        kb = T.meta_var(rows.blocks(0) if keys else 0)
        vb = T.meta_var(rows.blocks(1))
        if kb + vb > 0:
            # the blocks' d (f32, rounded to f16 when stored) and 1 / d, keys' then values'; scales in an even
            # count, so that scale_word's read of block 2i + 1 stays inside its array (and none of size 0). One
            # invocation a block: head_dim / 16 blocks in all, fewer than the workgroup's min(head_dim, 256)
            k_scales = T.alloc_buffer((_even(kb),), "float32", scope="shared")
            k_inverse = T.alloc_buffer((_even(kb),), "float32", scope="shared")
            v_scales = T.alloc_buffer((_even(vb),), "float32", scope="shared")
            v_inverse = T.alloc_buffer((_even(vb),), "float32", scope="shared")
            stats = T.alloc_buffer((3,), "float32", scope="local")       # block max, block min, d
            if tx < kb:
                _block_scale(rows, 0, k, t, h, tx, k_scales, k_inverse, stats)
            elif tx < kb + vb:
                _block_scale(rows, 1, v, t, h, tx - kb, v_scales, v_inverse, stats)
            T.tvm_storage_sync("shared")
            if keys:
                _store_part(rows, 0, pool, k, t, h, page, slot, k_scales, k_inverse, tx, threads)
            _store_part(rows, 1, pool, v, t, h, page, slot, v_scales, v_inverse, tx, threads)
        else:
            if keys:
                _store_part(rows, 0, pool, k, t, h, page, slot, None, None, tx, threads)
            _store_part(rows, 1, pool, v, t, h, page, slot, None, None, tx, threads)


# -- q4_ch keys: a page at a time -------------------------------------------------------------------------------
# A q4_ch page's keys share per-channel scales, so a page is encoded whole by one workgroup (a page and a KV head):
# its keys as f32 are staged in workgroup memory ([page_size, head_dim]: 16 KiB at head_dim 256), then invocation d
# takes channel d's minimum and maximum over the page's slots and its stored scale and minimum, and after a barrier
# every word of the page's keys (the rows' nibbles, and the head_dim words of per-channel stats the rows share) is
# composed by one invocation. kv_format's rule and the numpy emulation are kv_format.quantize_channels.
def _stats_word(bits, channel, which):
    """The halves of channels `channel` and `channel` + 1's scale (which 0) or minimum (1), low half first."""
    return T.bitwise_or(bits[which, channel], T.shift_left(bits[which, channel + 1], _u32(16)))


def _nibble_word(staged, coding, o, w):
    """Word w of row o's q4_ch nibbles: bytes 4w .. 4w + 3 of q4_0's order, each quant min(15, max(0,
    round((x - m) / d))) of staged[o, :] with m and 1 / d as stored."""
    block, first = w // (_Q4_HALF // WORD), w % (_Q4_HALF // WORD) * WORD

    def nibble(e):
        d = block * KV_BLOCK + e
        q = T.round((staged[o, d] - coding[0, d]) * coding[1, d])
        return T.Cast("uint32", T.min(T.max(q, T.float32(0)), T.float32(15)))
    return _or_bytes([T.bitwise_or(nibble(first + e), T.shift_left(nibble(first + e + _Q4_HALF), _u32(4)))
                      for e in range(WORD)])


@T.macro
def stage_page_keys(rows, pool, page, h, held, end, x, t0, staged, tx, threads):
    """staged[o, :] = the key slot o holds, read back as stored, for o < held, and x[t0 + o - held, h, :] for
    held <= o < end (f32 [n, kv_heads, head_dim]): the page as kv_append encodes it."""
    P = T.meta_var(rows.fmt.page_size)
    D = T.meta_var(rows.fmt.head_dim)
    for c in T.unroll(ceil_div(P * D, threads)):
        o = T.meta_var(T.Cast("int64", (c * threads + tx) // D))
        d = T.meta_var(T.Cast("int64", (c * threads + tx) % D))
        if c * threads + tx < P * D:
            if o < T.Cast("int64", held):
                staged[o, d] = rows.load(pool, 0, page, h, o, d)
            elif o < T.Cast("int64", end):
                staged[o, d] = x[T.Cast("int64", t0) + o - T.Cast("int64", held), h, d]


@T.macro
def encode_staged_keys(rows, pool, page, h, end, staged, tx, threads):
    """Slots 0 .. end - 1 of a page take the q4_ch encoding of staged[0 .. end - 1, :] (f32 [page_size, head_dim]
    in workgroup memory, complete: the caller's barrier), and every row of the page its share of the per-channel
    stats. Every invocation of the workgroup must reach it (it holds a barrier)."""
    P = T.meta_var(rows.fmt.page_size)
    D = T.meta_var(rows.fmt.head_dim)
    c = T.meta_var(rows.fmt.channels_per_row)
    first = T.meta_var(rows.fmt.part(0).offset // WORD)
    stats_first = T.meta_var(rows.fmt.part(0).scale_offset // WORD)
    # per channel: the f16 bits of its scale (0) and minimum (1); the minimum as f32 (0) and 1 / scale (1)
    bits = T.alloc_buffer((2, D), "uint32", scope="shared")
    coding = T.alloc_buffer((2, D), "float32", scope="shared")
    range_ = T.alloc_buffer((2,), "float32", scope="local")     # the channel's min and max, then m and d as stored
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
    # the stats, D words: word k of row o holds two channels' halves, of its c scales (k < c / 2), then of its c
    # minimums (c is even: head_dim and the page size are multiples of 32 and 16)
    for i in T.unroll(ceil_div(D, threads)):
        o = T.meta_var((i * threads + tx) // c)
        k = T.meta_var((i * threads + tx) % c)
        if i * threads + tx < D:
            pool[page, 0, h, o, stats_first + k] = _stats_word(bits, o * c + k % (c // 2) * 2, k // (c // 2))
    # the nibbles, D / 8 words a row: word w of row o (bytes 4w .. 4w + 3, all in one block of 32 elements)
    for i in T.unroll(ceil_div(P * D // 8, threads)):
        o = T.meta_var((i * threads + tx) // (D // 8))
        w = T.meta_var((i * threads + tx) % (D // 8))
        if T.Cast("int64", o) < T.Cast("int64", end):
            pool[page, 0, h, o, first + w] = _nibble_word(staged, coding, o, w)


@T.macro
def store_page_keys(rows, pool, k, v, page, h, held, end, t0, tx, threads):
    """q4_ch keys: slots held .. end - 1 of a page take keys k[t0 + (o - held), h, :] and values v[...] (f32 [n,
    kv_heads, head_dim]); the page's keys are encoded again over slots 0 .. end - 1, the held ones read back as
    stored (the numpy emulation is kv_format.append_page_keys; the values', encode_rows). By one workgroup, every
    invocation of which must reach it (held and end the same for all)."""
    staged = T.alloc_buffer((rows.fmt.page_size, rows.fmt.head_dim), "float32", scope="shared")
    stage_page_keys(rows, pool, page, h, held, end, k, t0, staged, tx, threads)
    T.tvm_storage_sync("shared")
    encode_staged_keys(rows, pool, page, h, end, staged, tx, threads)
    for o in range(end - held):
        store_row(rows, pool, k, v, t0 + o, h, page, held + o, tx, threads)
        T.tvm_storage_sync("shared")      # the value blocks' scales are written again for the next slot
