"""The weight layouts sharpi's kernels read, shared by the frontend (which repacks GGUF blocks into them)
and codegen (whose kernels dequantize them). Blocks are 32 weights along K, the input dimension.

Quantized types have two parts: `qs` (the quants) and `s` (f32 [S, N, K/32]: S planes of per-block scale fields;
field-major, so one field is a contiguous [N, K/32] slice, which GPU kernels take as a buffer of its own):
  q4_0:  qs uint32 [N, K/8] (8 nibbles a word, in element order)   s = (d,)        w = (q - 8) * d
  q4_1:  qs uint32 [N, K/8]                                          s = (d, m)      w = q * d + m
  q5_0:  qs uint32 [N, K/8] (low 4 bits)                             s = (d, qh)     w = (q + 16 * bit_e(qh) - 16) * d
         (qh, the 32 fifth bits of the block, is stored as the bits of an f32: one scale buffer for every type)
  q8_0:  qs uint32 [N, K/4] (4 int8 a word, little-endian)           s = (d,)        w = q * d
Quants are always in u32 words: WGSL (the Vulkan path) has no 8- or 16-bit storage types.
Dense types have one part `w` [N, K]: f32, f16, or bf16 kept as uint16 (the upper half of an f32).
Every other GGUF type is expanded to f16 at load. Scales are f32 rather than GGUF's f16: one conversion per
block saved on CPUs, at 4 bytes more per 32 weights (the artifact stays within 1.2x of the GGUF).
"""
from __future__ import annotations

BLOCK = 32

# qtype -> list of (part name, dtype, shape as a function of (N, K))
LAYOUTS = {
    "q4_0": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (1, n, k // BLOCK))],
    "q4_1": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (2, n, k // BLOCK))],
    "q5_0": [("qs", "uint32", lambda n, k: (n, k // 8)), ("s", "float32", lambda n, k: (2, n, k // BLOCK))],
    "q8_0": [("qs", "uint32", lambda n, k: (n, k // 4)), ("s", "float32", lambda n, k: (1, n, k // BLOCK))],
    "f32": [("w", "float32", lambda n, k: (n, k))],
    "f16": [("w", "float16", lambda n, k: (n, k))],
    "bf16": [("w", "uint16", lambda n, k: (n, k))],
}
QUANTIZED = ("q4_0", "q4_1", "q5_0", "q8_0")

# GGUF tensor type name -> sharpi layout kept as is (quantized in memory)
NATIVE_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q8_0": "q8_0", "F32": "f32", "F16": "f16",
                "BF16": "bf16"}
EXPANDED_TYPE = "f16"


def parts(qtype: str, n: int, k: int) -> list[tuple[str, str, tuple[int, int]]]:
    return [(name, dtype, shape(n, k)) for name, dtype, shape in LAYOUTS[qtype]]
