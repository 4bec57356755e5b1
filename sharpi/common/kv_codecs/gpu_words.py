"""Bit arithmetic on the 32-bit words the GPU kernels read the packed pool as (codegen/kernels/gpu/kv_rows.py).

WGSL has no 8- or 16-bit integer types, so the bytes, nibbles and f16 halves of a word are taken apart with shifts
and masks, and an f16 value is turned into f32 (and back) by bit arithmetic: the same TIR then runs on Vulkan and
on CUDA. Float -> f16 rounds to nearest even on the bits (as numpy's float16 cast: subnormals, overflow to
infinity, NaN), so stored scales equal the numpy rule's bit for bit wherever the device's f32 division is correctly
rounded (lavapipe's is; CUDA's is under the --prec-div=true that targets/cuda.py adds to TVM's --use_fast_math).
"""
from __future__ import annotations

from .tir import T

WORD = 4                      # bytes in a word of the packed pool


def u32(value: int):
    return T.uint32(value)


def shift(amount):
    """A shift amount as uint32 (TVM's shifts want both operands of one type; WGSL wants u32 amounts)."""
    return T.Cast("uint32", amount)


def half_to_float(bits):
    """The f32 value of an IEEE half whose bits are the low 16 of a uint32 expression, built as f32 bits: normals
    by moving exponent and significand into place and rebiasing (15 -> 127); subnormals as the significand
    converted to f32 (exact) with 24 taken off its exponent (no float constant: TVM's WGSL prints floats with 7
    digits, and 2^-24 is not one of them); infinities and NaNs with exponent 255."""
    exponent = T.bitwise_and(T.shift_right(bits, u32(10)), u32(31))
    significand = T.bitwise_and(bits, u32(0x3FF))
    normal = T.shift_left(T.bitwise_and(bits, u32(0x7FFF)), u32(13)) + u32(0x38000000)
    subnormal = T.Select(significand == u32(0), u32(0),
                         T.reinterpret("uint32", T.Cast("float32", significand)) - u32(24 << 23))
    special = T.bitwise_or(u32(0x7F800000), T.shift_left(significand, u32(13)))
    magnitude = T.Select(exponent == u32(0), subnormal, T.Select(exponent == u32(31), special, normal))
    sign = T.shift_left(T.bitwise_and(bits, u32(0x8000)), u32(16))
    return T.reinterpret("float32", T.bitwise_or(sign, magnitude))


def float_to_half(x):
    """The bits (uint32, low 16) of f32 x rounded to the nearest half, ties to even, as numpy's float16 cast:
    normals by rebiasing the exponent and rounding away the 13 low significand bits; results below 2^-14 by
    shifting the significand (implicit bit included) right by 14..24 places and rounding what falls off;
    overflow to infinity; NaN to the quiet NaN 0x7E00."""
    u = T.reinterpret("uint32", x)
    sign = T.bitwise_and(T.shift_right(u, u32(16)), u32(0x8000))
    a = T.bitwise_and(u, u32(0x7FFFFFFF))
    lsb = T.bitwise_and(T.shift_right(a, u32(13)), u32(1))
    normal = T.min(T.shift_right(a - u32(0x38000000) + u32(0xFFF) + lsb, u32(13)), u32(0x7C00))
    # below 2^-14: value * 2^24 = significand >> (126 - exponent), for exponents 102 .. 112
    exponent = T.shift_right(a, u32(23))
    places = T.max(T.min(u32(126) - exponent, u32(24)), u32(14))     # unsigned: exponents > 126 wrap to 24
    significand = T.bitwise_or(T.bitwise_and(a, u32(0x7FFFFF)), u32(0x800000))
    kept = T.shift_right(significand, places)
    rest = T.bitwise_and(significand, T.shift_left(u32(1), places) - u32(1))
    half = T.shift_left(u32(1), places - u32(1))
    round_up = T.Or(rest > half, T.And(rest == half, T.bitwise_and(kept, u32(1)) == u32(1)))
    small = T.Select(a <= u32(0x33000000), u32(0), kept + T.Select(round_up, u32(1), u32(0)))
    magnitude = T.Select(a >= u32(0x7F800000), T.Select(a > u32(0x7F800000), u32(0x7E00), u32(0x7C00)),
                         T.Select(a >= u32(0x38800000), normal, small))
    return T.bitwise_or(sign, magnitude)


def float_to_bfloat(x):
    """The bits (uint32, low 16) of f32 x rounded to bfloat16, ties to even (TVM's cast, the numpy rule's)."""
    u = T.reinterpret("uint32", x)
    return T.shift_right(u + u32(0x7FFF) + T.bitwise_and(T.shift_right(u, u32(16)), u32(1)), u32(16))


def low_half(word, index):
    """Half `index % 2` (0: low) of a word, as uint32."""
    return T.bitwise_and(T.shift_right(word, shift(index % 2 * 16)), u32(0xFFFF))


def or_bytes(values):
    """One word from four byte values (uint32 < 256), the first in the low byte."""
    word = values[0]
    for e in range(1, WORD):
        word = T.bitwise_or(word, T.shift_left(values[e], u32(8 * e)))
    return word


def half_pair_word(first, second):
    """One word from two halves' bits (uint32 < 2^16), the first in the low half."""
    return T.bitwise_or(first, T.shift_left(second, u32(16)))
