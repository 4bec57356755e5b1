"""Float KV types: float32, float16 and bfloat16 elements, no side data. A pool whose keys and values take one of
them is the plain layout [pages, 2 (k, v), kv_heads, page_size, head_dim] of that type; beside a quantized part,
or another float type, it is a packed part of its elements."""
from __future__ import annotations

import numpy as np

from .base import Field, KVCodec
from .gpu_words import float_to_bfloat, float_to_half, half_pair_word, half_to_float, low_half, u32, WORD
from .tir import T, macro


class FloatCodec(KVCodec):
    cpu_unpack = False       # converting f16 or bf16 is one instruction a vector: attention reads the pool

    def __init__(self, name: str, flag: str, unavailable: dict | None = None):
        self.name, self.flag, self.element_type = name, flag, name
        self.unavailable = unavailable or {}

    def fields(self, head_dim, page_size):
        return Field(self.name, head_dim), None

    # -- numpy ------------------------------------------------------------------------------------------------------
    def quantize(self, part, x):
        if self.name == "bfloat16":      # rounded to nearest even, as TVM's cast
            u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16), None
        return np.asarray(x, np.float32).astype(self.name), None

    def dequantize(self, part, q, s):
        if self.name == "bfloat16":
            return (q.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return q.astype(np.float32)

    def roundtrip(self, x, head_dim, page_size):
        if self.name == "float32":
            return x
        return super().roundtrip(x, head_dim, page_size)

    # -- CPU ----------------------------------------------------------------------------------------------------------
    def cpu_load(self, rows, which, page, h, slot, d):
        return T.Cast("float32", rows.quants[which][page, h, slot, d])

    @macro
    def cpu_store(self, rows, which, page, h, slot, x, t):
        q = T.meta_var(rows.quants[which])
        for d in T.vectorized(rows.fmt.head_dim):
            q[page, h, slot, d] = T.Cast(self.name, x[t, h, d])

    # -- GPU ----------------------------------------------------------------------------------------------------------
    def gpu_load(self, rows, pool, which, page, h, slot, d):
        base = rows.fmt.part(which).offset // WORD
        if self.name == "float32":
            return T.reinterpret("float32", pool[page, 0, h, slot, base + d])
        bits = low_half(pool[page, 0, h, slot, base + d // 2], d)
        if self.name == "float16":
            return half_to_float(bits)
        return T.reinterpret("float32", T.shift_left(bits, u32(16)))

    def gpu_quant_word(self, rows, which, x, t, h, i, scales, inverse):
        """Word i of the elements of x[t, h, :]."""
        if self.name == "float32":
            return T.reinterpret("uint32", x[t, h, i])
        bits = float_to_half if self.name == "float16" else float_to_bfloat
        return half_pair_word(bits(x[t, h, 2 * i]), bits(x[t, h, 2 * i + 1]))


FLOAT32 = FloatCodec("float32", "f32")
FLOAT16 = FloatCodec("float16", "f16")
BFLOAT16 = FloatCodec("bfloat16", "bf16", unavailable={"vulkan": "WGSL has no bfloat16"})
