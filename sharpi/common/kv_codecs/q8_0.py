"""q8_0: ggml's 8-bit blocks. Per block of 32: d = max|x| / 127 (stored as f16), id = 1/d (0 for an all-zero
block), q = round-half-even(x * id) as int8; read back x = q * d."""
from __future__ import annotations

import numpy as np

from .blocks import BLOCK, BlockCodec
from .gpu_words import WORD, or_bytes
from .tir import T, macro


class Q8_0(BlockCodec):
    name = flag = "q8_0"
    code_dtype = "int8"
    # conformance: max |d log-prob| and top-1 bound against the float32 reference (testing/conformance.py)
    tolerance = (4.0, 1.0)

    def quantize_blocks(self, blocks):
        d = np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(127)
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        return np.rint(blocks * inv).astype(np.int8).view(np.uint8), d

    def dequantize(self, part, q, s):
        d = s.astype(np.float32)[..., None]
        codes = q.view(np.int8).astype(np.float32).reshape(*d.shape[:-1], BLOCK)
        return (codes * d).reshape(*q.shape[:-1], -1)

    # -- CPU ----------------------------------------------------------------------------------------------------------
    def scale_of(self, hi, lo):
        return T.max(hi, T.float32(0) - lo) / T.float32(127)

    def inverse_of(self, d):
        return T.Select(d > T.float32(0), T.float32(1) / d, T.float32(0))

    @macro
    def cpu_store_block(self, q, page, h, slot, b, x, t, inv):
        for e in T.vectorized(BLOCK):
            q[page, h, slot, b * BLOCK + e] = T.Cast("int8", T.round(x[t, h, b * BLOCK + e] * inv))

    def cpu_load(self, rows, which, page, h, slot, d):
        return T.Cast("float32", rows.quants[which][page, h, slot, d]) * self.cpu_scale(rows, which, page, h, slot, d)

    # -- GPU ----------------------------------------------------------------------------------------------------------
    def gpu_load(self, rows, pool, which, page, h, slot, d):
        scale = self.gpu_scale(rows, pool, which, page, h, slot, d)
        # byte d % 4 of the word, sign-extended by an arithmetic shift of the word as int32
        word = pool[page, 0, h, slot, rows.fmt.part(which).offset // WORD + d // 4]
        signed = T.shift_right(T.shift_left(T.reinterpret("int32", word), T.Cast("int32", 24 - d % 4 * 8)), 24)
        return T.Cast("float32", signed) * scale

    @macro
    def gpu_block_scale(self, rows, which, x, t, h, b, scales, inverse, stats):
        """scales[b] = block b's d of x[t, h, :] and inverse[b] = 1 / d, computed in local memory. The maximum of
        absolute values, so an all-zero block's d is +0 as numpy's (a GPU's max of +0 and the -0 of negating the
        minimum may be either)."""
        stats[0] = T.abs(x[t, h, b * BLOCK])
        for e in range(1, BLOCK):
            stats[0] = T.max(stats[0], T.abs(x[t, h, b * BLOCK + e]))
        stats[2] = stats[0] / T.float32(127)
        inverse[b] = T.Select(stats[2] > T.float32(0), T.float32(1) / stats[2], T.float32(0))
        scales[b] = stats[2]

    def gpu_quant_word(self, rows, which, x, t, h, i, scales, inverse):
        """Word i of the codes: 4 int8 codes of x[t, h, :] * inverse[block], rounded half to even (T.round:
        WGSL's round, CUDA's nearbyintf)."""
        inv = inverse[i // (BLOCK // WORD)]
        return or_bytes([T.Cast("uint32", T.bitwise_and(T.Cast("int32", T.round(x[t, h, 4 * i + e] * inv)), 255))
                         for e in range(WORD)])


CODEC = Q8_0()
