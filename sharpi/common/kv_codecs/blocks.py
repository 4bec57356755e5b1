"""What the block codecs (q8_0, q4_0) share: ggml's blocks of 32 elements of head_dim, each with an f16 scale d.
A part is the blocks' codes, then their f16 scales. Each codec module says how a block's d follows from its
maximum and minimum, and how an element is coded and read back."""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .base import Field, KVCodec
from .gpu_words import WORD, float_to_half, half_pair_word, half_to_float, low_half, u32
from .tir import T, macro

BLOCK = 32


def even(blocks: int) -> int:
    """A per-block array's size: the block count rounded up to even, at least 2."""
    return max(2, blocks + blocks % 2)


class BlockCodec(KVCodec):
    code_dtype = "uint8"         # the codes' view type
    code_bytes = BLOCK           # a block's code bytes

    def fields(self, head_dim, page_size):
        blocks = head_dim // BLOCK
        return Field(self.code_dtype, blocks * self.code_bytes), Field("float16", blocks)

    def check(self, head_dim, page_size):
        if head_dim % BLOCK:
            raise ConfigError(f"A {self.name} KV cache needs head_dim a multiple of {BLOCK} (its blocks), and this "
                              f"model's is {head_dim}; use --kv-dtype f16.")

    # -- numpy: quantize_blocks(blocks f32 [..., n, 32]) -> (codes [..., n, code_bytes], d f32 [..., n, 1]) -------
    def quantize(self, part, x):
        x = np.asarray(x, np.float32)
        with np.errstate(divide="ignore"):
            q, d = self.quantize_blocks(x.reshape(*x.shape[:-1], -1, BLOCK))
        return q.reshape(*x.shape[:-1], -1), d[..., 0].astype(np.float16)

    # -- CPU ----------------------------------------------------------------------------------------------------------
    def cpu_scale(self, rows, which, page, h, slot, d):
        return T.Cast("float32", rows.scales[which][page, h, slot, d // BLOCK])

    @macro
    def cpu_store(self, rows, which, page, h, slot, x, t):
        """Per block: its max and min, its d (stored as f16) and 1 / d, then its codes."""
        s = T.meta_var(rows.scales[which])
        stats = T.decl_buffer((3,), "float32", scope="global")    # block max, block min, 1 / scale
        for b in range(rows.fmt.head_dim // BLOCK):
            stats[0] = x[t, h, b * BLOCK]
            stats[1] = x[t, h, b * BLOCK]
            for e in range(1, BLOCK):
                stats[0] = T.max(stats[0], x[t, h, b * BLOCK + e])
                stats[1] = T.min(stats[1], x[t, h, b * BLOCK + e])
            stats[2] = self.scale_of(stats[0], stats[1])
            s[page, h, slot, b] = T.Cast("float16", stats[2])
            stats[2] = self.inverse_of(stats[2])
            self.cpu_store_block(rows.quants[which], page, h, slot, b, x, t, stats[2])

    # -- GPU ----------------------------------------------------------------------------------------------------------
    def gpu_blocks(self, part):
        return part.head_dim // BLOCK

    def gpu_scale(self, rows, pool, which, page, h, slot, d):
        """Block d // 32's d as float32."""
        return half_to_float(low_half(pool[page, 0, h, slot, rows.fmt.part(which).scale_offset // WORD
                                           + d // BLOCK // 2], d // BLOCK))

    def gpu_scale_word(self, rows, which, i, scales):
        """Word i of a part's scales: the f16 scales of blocks 2i and 2i + 1 (0 past the last block)."""
        upper = T.Select(2 * i + 1 < rows.blocks(which), float_to_half(scales[2 * i + 1]), u32(0))
        return half_pair_word(float_to_half(scales[2 * i]), upper)
