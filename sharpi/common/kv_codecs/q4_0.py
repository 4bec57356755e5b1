"""q4_0: ggml's 4-bit blocks. Per block of 32: m = the value of largest magnitude (the positive one on a tie),
d = m / -8 (stored as f16), id = 1/d (0 if d is 0), q = min(15, round-half-even(x * id) + 8) in q4_0's nibble
order (nibbles.py); read back x = (q - 8) * d. ggml rounds x * id + 8.5 down and takes the first of tied values;
the two differ only on exact ties, and rounding the product alone leaves the kernels no multiply-add for LLVM to
fuse (which would round once where numpy rounds twice)."""
from __future__ import annotations

import numpy as np

from . import nibbles
from .blocks import BLOCK, BlockCodec
from .gpu_words import WORD, or_bytes, u32
from .tir import T, macro

HALF = BLOCK // 2


# (defined before the macros that call it: a macro resolves names when it is defined)
def _code(scaled):
    """min(15, round(x / d) + 8) as uint8 (x / d lies in [-8, 8])."""
    return T.Cast("uint8", T.min(T.round(scaled) + T.float32(8), T.float32(15)))


class Q4_0(BlockCodec):
    name = flag = "q4_0"
    code_bytes = HALF
    # q4_0 moves the far tail so much that a log-prob bound checks little more than that the model runs (its
    # perplexity is the measure that counts: testing/conformance.py)
    tolerance = (32.0, 4.0)
    key_note = ("q4_0 keys cost 10-15% perplexity at 1024 tokens and lose long-context retrieval (4,000-token "
                "RULER-style suite: -22 points on Qwen2.5-Coder-0.5B, -13 on Gemma-3-270M); 4-bit keys per channel "
                "(--kv-dtype-k q4_ch --kv-dtype-v q4_0: +1 point on that suite, 0.33x f16's bytes) or q8_0 keys "
                "(--kv-dtype-k q8_0 --kv-dtype-v q4_0: about 40% of f16's bytes) keep f16's accuracy "
                "(benchmarks/kv_quant.md).")

    def quantize_blocks(self, blocks):
        top, bottom = blocks.max(axis=-1, keepdims=True), blocks.min(axis=-1, keepdims=True)
        d = np.where(top >= -bottom, top, bottom) / np.float32(-8)
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        return nibbles.pack(np.minimum(np.rint(blocks * inv) + np.float32(8), 15).astype(np.uint8)), d

    def dequantize(self, part, q, s):
        d = s.astype(np.float32)[..., None]
        codes = nibbles.unpack(q).astype(np.float32).reshape(*d.shape[:-1], BLOCK)
        return ((codes - 8) * d).reshape(*q.shape[:-1], -1)

    # -- CPU ----------------------------------------------------------------------------------------------------------
    def scale_of(self, hi, lo):
        return T.Select(hi >= T.float32(0) - lo, hi, lo) / T.float32(-8)

    def inverse_of(self, d):
        return T.Select(d != T.float32(0), T.float32(1) / d, T.float32(0))

    @macro
    def cpu_store_block(self, q, page, h, slot, b, x, t, inv):
        for j in T.vectorized(HALF):
            q[page, h, slot, b * HALF + j] = _code(x[t, h, b * BLOCK + j] * inv) | (
                _code(x[t, h, b * BLOCK + HALF + j] * inv) << T.uint8(4))

    def cpu_load(self, rows, which, page, h, slot, d):
        return (T.Cast("float32", nibbles.cpu_nibble(rows.quants[which], page, h, slot, d)) - T.float32(8)) \
            * self.cpu_scale(rows, which, page, h, slot, d)

    # -- GPU ----------------------------------------------------------------------------------------------------------
    def gpu_load(self, rows, pool, which, page, h, slot, d):
        scale = self.gpu_scale(rows, pool, which, page, h, slot, d)
        code = nibbles.gpu_nibble(pool, rows.fmt.part(which).offset // WORD, page, h, slot, d)
        return (T.Cast("float32", code) - T.float32(8)) * scale

    @macro
    def gpu_block_scale(self, rows, which, x, t, h, b, scales, inverse, stats):
        """scales[b] = block b's d of x[t, h, :] and inverse[b] = 1 / d, computed in local memory (reading back a
        shared value just written would want a barrier in this branch)."""
        stats[0] = x[t, h, b * BLOCK]
        stats[1] = x[t, h, b * BLOCK]
        for e in range(1, BLOCK):
            stats[0] = T.max(stats[0], x[t, h, b * BLOCK + e])
            stats[1] = T.min(stats[1], x[t, h, b * BLOCK + e])
        stats[2] = T.Select(stats[0] >= T.float32(0) - stats[1], stats[0], stats[1]) / T.float32(-8)
        inverse[b] = T.Select(stats[2] != T.float32(0), T.float32(1) / stats[2], T.float32(0))
        scales[b] = stats[2]

    def gpu_quant_word(self, rows, which, x, t, h, i, scales, inverse):
        """Word i of the codes: 4 bytes of two nibbles of x[t, h, :] * inverse[block]."""
        block, first = i // (HALF // WORD), i % (HALF // WORD) * WORD
        inv = inverse[block]

        def nibble(e):
            # min(15, round(x / d) + 8): x / d lies in [-8, 8]
            return T.Cast("uint32", T.min(T.round(x[t, h, block * BLOCK + e] * inv) + T.float32(8), T.float32(15)))
        return or_bytes([T.bitwise_or(nibble(first + e), T.shift_left(nibble(first + e + HALF), u32(4)))
                         for e in range(WORD)])


CODEC = Q4_0()
