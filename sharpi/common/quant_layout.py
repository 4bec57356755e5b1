"""The weight layouts sharpi's kernels read, shared by the frontend (which repacks GGUF blocks into them)
and codegen (whose kernels dequantize them). Blocks are 32 weights along K, the input dimension.

Quantized types have two parts: `qs` (the quants) and `s` (f32 [S, N, K/32]: S planes of per-block scale fields;
field-major, so one field is a contiguous [N, K/32] slice, which GPU kernels take as a buffer of its own):
  q4_0:  qs uint32 [N, K/8] (8 nibbles a word, in element order)   s = (d,)        w = (q - 8) * d
  q4_1:  qs uint32 [N, K/8]                                          s = (d, m)      w = q * d + m
  q5_0:  qs uint32 [N, K/8] (low 4 bits)                             s = (d, qh)     w = (q + 16 * bit_e(qh) - 16) * d
         (qh, the 32 fifth bits of the block, is stored as the bits of an f32: one scale buffer for every type)
  q5_1:  qs uint32 [N, K/8] (low 4 bits)                             s = (d, m, qh)  w = (q + 16 * bit_e(qh)) * d + m
  q8_0:  qs uint32 [N, K/4] (4 int8 a word, little-endian)           s = (d,)        w = q * d
The K-quants (super-blocks of 256) are expanded to the same per-32 form at repack time: each 32-block gets its
own f32 scale (and offset), products of the super-block's f16 d (dmin) and its 6- or 8-bit sub-scales (mins),
which are exact in f32, so the weights are bit-identical to ggml's dequantization:
  q4_k:  qs uint32 [N, K/8]                                          s = (d, m)      w = q * d + m
         (d = d_super * scale_6bit, m = -dmin_super * min_6bit: the q4_1 formula)
  q5_k:  qs uint32 [N, K/8] (low 4 bits)                             s = (d, m, qh)  w = (q + 16 * bit_e(qh)) * d + m
  q6_k:  qs uint32 [N, K/8] (low 4 bits)                             s = (d0, d1, h0, h1)
         w = (q + 16 * hi_e - 32) * (d0 if e < 16 else d1), hi_e = 2-bit field e % 16 of (h0 if e < 16 else h1)
         (d0, d1: d_super * the int8 scales of the block's two 16-halves; h0, h1: the 2-bit high parts of
         elements 0-15 and 16-31, 16 a word, stored as the bits of an f32 like q5_0's qh)
The K-quants have a third part, `ks`: per super-block, its scales as integers and its bit fields, all a kernel
that multiplies by the 6- and 8-bit sub-scales in integer arithmetic needs besides the quants (quant_matmul_q8k,
llama.cpp's q8_K dot products). A target whose kernels read it stores the K-quants as (qs, ks), without `s`: within
1.03x of the GGUF's bytes (q4_k 148/144, q5_k 180/176, q6_k 212/210), where (qs, s) is 1.2-1.33x; the others store
(qs, s) (WeightTable.choose_scales). uint32 [N, K/256 * KS_WORDS], per super-block:
  q4_k:  d_super | dmin << 16 (their f16 bits, as the GGUF block starts), then 8 sub-scales and 8 mins (uint8,
         0-63)                                                                     d = d_super * sc, m = -dmin * mn
  q5_k:  as q4_k, then the 8 blocks' qh words (s's qh plane)
  q6_k:  d_super (f32 bits), then 16 sub-scales (int8), one per 16 weights, then the 8 blocks' (h0, h1) word pairs
Quants are always in u32 words: WGSL (the Vulkan path) has no 8- or 16-bit storage types.
Dense types have one part `w` [N, K]: f32, f16, or bf16 kept as uint16 (the upper half of an f32).
Every other GGUF type is expanded to f16 at load. Scales are f32 rather than GGUF's f16: one conversion per
block saved on CPUs, at 4 bytes more per 32 weights (the artifact stays within 1.2x of the GGUF for the 32-block
types; per tensor q5_1 is 28/24 = 1.17x, q4_k 24/18 = 1.33x, q5_k 28/22 = 1.27x, q6_k 32/26.25 = 1.22x).
"""
from __future__ import annotations

import numpy as np

BLOCK = 32

# qtype -> list of (part name, dtype, shape as a function of (N, K))
LAYOUTS = {
    "q4_0": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (1, n, k // BLOCK))],
    "q4_1": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (2, n, k // BLOCK))],
    "q5_0": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (2, n, k // BLOCK))],
    "q5_1": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (3, n, k // BLOCK))],
    "q8_0": [("qs", "uint32", lambda n, k: (n, k // 4)), ("s", "float32", lambda n, k: (1, n, k // BLOCK))],
    "q4_k": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (2, n, k // BLOCK)),
             ("ks", "uint32", lambda n, k: (n, k // SUPER_BLOCK * KS_WORDS["q4_k"]))],
    "q5_k": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (3, n, k // BLOCK)),
             ("ks", "uint32", lambda n, k: (n, k // SUPER_BLOCK * KS_WORDS["q5_k"]))],
    "q6_k": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (4, n, k // BLOCK)),
             ("ks", "uint32", lambda n, k: (n, k // SUPER_BLOCK * KS_WORDS["q6_k"]))],
    "f32": [("w", "float32", lambda n, k: (n, k))],
    "f16": [("w", "float16", lambda n, k: (n, k))],
    "bf16": [("w", "uint16", lambda n, k: (n, k))],
}
# How many leading planes of a quantized type's `s` part hold float values (scales, offsets); the planes after them
# hold bit fields stored as f32 bits (qh, h0, h1), which are not numbers.
FLOAT_PLANES = {"q4_0": 1, "q4_1": 2, "q5_0": 1, "q5_1": 2, "q8_0": 1, "q4_k": 2, "q5_k": 2, "q6_k": 2}
QUANTIZED = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
K_QUANTS = ("q4_k", "q5_k", "q6_k")
SUPER_BLOCK = 256   # the K-quants' super-block: their tensors need K % 256 == 0
KS_WORDS = {"q4_k": 5, "q5_k": 13, "q6_k": 21}   # u32 words of `ks` a super-block
KS_BITS = {"q4_k": 5, "q5_k": 5, "q6_k": 5}      # the word of `ks` where a super-block's bit fields start
BIT_WORDS = {"q4_k": 0, "q5_k": 1, "q6_k": 2}    # bit-field words a 32-block (s's planes after FLOAT_PLANES)
SUB_SCALES = "ks"
KERNEL_PARTS = 2    # the parts every kernel takes: (qs, s), or a K-quant's (qs, ks) for quant_matmul_q8k's

# GGUF tensor type name -> sharpi layout kept as is (quantized in memory)
NATIVE_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
                "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "F32": "f32", "F16": "f16", "BF16": "bf16"}
EXPANDED_TYPE = "f16"


def parts(qtype: str, n: int, k: int) -> list[tuple[str, str, tuple[int, int]]]:
    return [(name, dtype, shape(n, k)) for name, dtype, shape in LAYOUTS[qtype]]


def sub_scales(qtype: str, ks: np.ndarray) -> tuple[np.ndarray, ...]:
    """A K-quant's `ks` part [N, K/256 * KS_WORDS] -> (d_super [N, NS], dmin [N, NS], sub-scales [N, NS, 8],
    mins [N, NS, 8]) for q4_k and q5_k, (d_super [N, NS], sub-scales [N, NS, 16]) for q6_k; integers as int32."""
    words = np.ascontiguousarray(ks).reshape(ks.shape[0], -1, KS_WORDS[qtype])
    ints = np.ascontiguousarray(words[..., 1:KS_BITS[qtype]])
    if qtype == "q6_k":
        return words[..., 0].view(np.float32), ints.view(np.int8).astype(np.int32)
    halves = np.ascontiguousarray(words[..., 0]).view(np.float16).reshape(*words.shape[:2], 2).astype(np.float32)
    sc_mn = ints.view(np.uint8).astype(np.int32)
    return halves[..., 0], halves[..., 1], sc_mn[..., :8], sc_mn[..., 8:]


def scale_planes(qtype: str, ks: np.ndarray) -> np.ndarray:
    """A K-quant's `s` part [S, N, K/32] rebuilt from its `ks` part (the products are exact in f32, so equal to the
    repacked planes bit for bit)."""
    n = ks.shape[0]
    words = np.ascontiguousarray(ks).reshape(n, -1, KS_WORDS[qtype])
    bits = words[..., KS_BITS[qtype]:].reshape(n, -1, BIT_WORDS[qtype]) if BIT_WORDS[qtype] else None
    if qtype == "q6_k":
        d_super, sc = sub_scales(qtype, ks)
        d = (d_super[..., None] * sc).astype(np.float32).reshape(n, -1, 2)
        planes = [d[..., 0], d[..., 1], bits[..., 0].view(np.float32), bits[..., 1].view(np.float32)]
    else:
        d_super, dmin, sc, mn = sub_scales(qtype, ks)
        planes = [(d_super[..., None] * sc).astype(np.float32).reshape(n, -1),
                  (-(dmin[..., None] * mn)).astype(np.float32).reshape(n, -1)]
        if bits is not None:
            planes.append(bits[..., 0].view(np.float32))
    return np.ascontiguousarray(np.stack(planes))      # all f32: a bit field's NaN pattern is never converted


def dequantize_layout(qtype: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """numpy dequantization of a sharpi layout (a K-quant's without `s` too): the reference the kernel tests compare
    against."""
    if qtype in ("f32", "f16"):
        return parts["w"].astype(np.float32)
    if qtype == "bf16":
        return (parts["w"].astype(np.uint32) << 16).view(np.float32)
    s = parts["s"] if "s" in parts else scale_planes(qtype, parts["ks"])
    d = s[0][..., None]
    if qtype == "q8_0":
        quants = np.ascontiguousarray(parts["qs"]).view(np.int8)
        n, k = quants.shape
        return (quants.astype(np.float32).reshape(n, k // BLOCK, BLOCK) * d).reshape(n, k)
    words = parts["qs"]
    n = words.shape[0]
    q = ((words[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF).reshape(n, -1, BLOCK).astype(np.float32)
    if qtype == "q4_0":
        w = (q - 8) * d
    elif qtype in ("q4_1", "q4_k"):
        w = q * d + s[1][..., None]
    elif qtype == "q5_0":
        w = (q + 16 * _bit_planes(s[1], 1) - 16) * d
    elif qtype in ("q5_1", "q5_k"):
        w = (q + 16 * _bit_planes(s[2], 1)) * d + s[1][..., None]
    elif qtype == "q6_k":
        hi = np.concatenate([_bit_planes(s[2], 2), _bit_planes(s[3], 2)], axis=-1)
        d = np.repeat(np.stack([s[0], s[1]], axis=-1), 16, axis=-1)
        w = (q + 16 * hi - 32) * d
    else:
        raise AssertionError(qtype)
    return w.reshape(n, -1)


def _bit_planes(field: np.ndarray, width: int) -> np.ndarray:
    """An f32 field holding packed bits [N, NB] -> its 32 / width values of `width` bits [N, NB, 32 / width]."""
    words = np.ascontiguousarray(field).view(np.uint32)
    shifts = np.arange(0, 32, width, dtype=np.uint32)
    return ((words[..., None] >> shifts) & ((1 << width) - 1)).astype(np.float32)
