"""4-bit codes in ggml q4_0's byte order, shared by the 4-bit codecs (q4_0, q4_ch): per block of 32 elements, byte
j of the block holds element j in its low nibble and element j + 16 in its high one."""
from __future__ import annotations

import numpy as np

from .gpu_words import WORD, shift, u32
from .tir import T

BLOCK = 32
HALF = BLOCK // 2


def pack(q: np.ndarray) -> np.ndarray:
    """uint8 codes [..., head_dim] in [0, 15] -> [..., head_dim / 2]."""
    blocks = q.reshape(*q.shape[:-1], -1, BLOCK)
    return (blocks[..., :HALF] | (blocks[..., HALF:] << 4)).reshape(*q.shape[:-1], -1)


def unpack(packed: np.ndarray) -> np.ndarray:
    blocks = packed.reshape(*packed.shape[:-1], -1, HALF)
    return np.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def cpu_nibble(quants, page, h, slot, d):
    """Element d's code from a uint8 view of the codes [pages, kv_heads, page_size, head_dim / 2]."""
    j = d % BLOCK
    byte = quants[page, h, slot, d // BLOCK * HALF + j % HALF]
    return (byte >> T.Cast("uint8", j // HALF * 4)) & T.uint8(15)


def gpu_nibble(pool, first_word, page, h, slot, d):
    """Element d's code as uint32, from the codes starting at word `first_word` of a slot's row of words."""
    j = d % BLOCK
    byte = d // BLOCK * HALF + j % HALF
    word = pool[page, 0, h, slot, first_word + byte // WORD]
    return T.bitwise_and(T.shift_right(word, shift(byte % WORD * 8 + j // HALF * 4)), u32(15))
