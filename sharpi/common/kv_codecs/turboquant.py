"""TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874): tq3 and tq4, keys and values at 3 and 4 bits
a coordinate, and the inner-product variant (TurboQuantProd, numpy).

A random rotation makes every coordinate of a unit vector follow one known distribution (that of a coordinate of
a uniform point on the sphere: density proportional to (1 - y^2)^((d - 3) / 2) on [-1, 1], close to N(0, 1/d)), so
one scalar codebook, Lloyd-Max's for that distribution at b bits, quantizes every coordinate of every vector; the
vector's norm is kept apart. The rotation here is a randomized Hadamard transform, Pi = H S / sqrt(d) (S: diagonal
random signs, seeded and fixed per head size; H: the Walsh-Hadamard matrix), so head_dim must be a power of two.

The rule (float32, in this order, which the kernels follow to the bit):
    u = H (s * x)               the unnormalized transform, butterflies h = 1, 2, 4, .. d / 2 (fwht)
    n = sqrt(sum_i u_i^2)       the squares summed in index order, each rounded before it is added
    y_i = u_i * (1 / n)         (0 where n is 0)
    code_i = #{j : y_i > t_j}   t: the 2^b - 1 midpoints between the codebook's neighbouring centroids
Stored: the codes as b bit planes a block of 32 coordinates (word p of block k holds bit p of coordinates 32k ..
32k + 31, the first in the lowest bit), then n as f32. Read back in the rotated space, coordinate i is
    v_i = (c[code_i] / sqrt(d)) * n          = (Pi x)_i approximately
which is what the kernels read: attention runs in the rotated space (the query rotated once, Pi q, the output
rotated back once, Pi^T o: dot products are preserved), and so do the SnapKV scores. The numpy decode
(dequantize) returns Pi^T v, the vector in the model's own space.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..errors import ConfigError
from .base import Field, KVCodec
from .gpu_words import WORD, u32
from .tir import T, macro

BLOCK = 32                   # coordinates a bit plane's word holds
ROTATION_SEED = 0x7B0       # the rotation's signs: np.random.default_rng((ROTATION_SEED, head_dim))


@functools.lru_cache(maxsize=None)
def codebook(bits: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max's centroids (f32, ascending, 2^bits) for a coordinate of a uniform unit vector in R^dim, and the
    thresholds between them (f32 midpoints, 2^bits - 1). Computed in float64 on a fine grid of the density."""
    grid = np.linspace(-1.0, 1.0, 1 << 17)[1:-1]
    density = np.power(1.0 - grid * grid, (dim - 3) / 2.0)
    density /= density.sum()
    mass, moment = np.cumsum(density), np.cumsum(density * grid)
    levels = 1 << bits
    sd = 1.0 / math.sqrt(dim)
    centroids = np.linspace(-2.0 * sd, 2.0 * sd, levels)
    for _ in range(400):
        edges = np.searchsorted(grid, (centroids[:-1] + centroids[1:]) / 2.0)
        lo, hi = np.concatenate([[0], edges]), np.concatenate([edges, [len(grid)]])
        m = np.concatenate([[0.0], mass])[hi] - np.concatenate([[0.0], mass])[lo]
        s = np.concatenate([[0.0], moment])[hi] - np.concatenate([[0.0], moment])[lo]
        centroids = np.where(m > 0, s / np.where(m > 0, m, 1.0), centroids)
    c = centroids.astype(np.float32)
    return c, ((c[:-1] + c[1:]) / np.float32(2)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def rotation_signs(dim: int) -> np.ndarray:
    """The rotation's diagonal, f32 +-1 [dim], fixed per head size."""
    rng = np.random.default_rng((ROTATION_SEED, dim))
    return np.where(rng.integers(0, 2, dim) == 1, np.float32(1), np.float32(-1)).astype(np.float32)


def fwht(u: np.ndarray) -> np.ndarray:
    """The unnormalized Walsh-Hadamard transform over the last axis (a power of two), float32, butterflies of
    span 1, 2, 4, ..: the kernels' order."""
    u = np.array(u, np.float32)
    d, h = u.shape[-1], 1
    while h < d:
        v = u.reshape(*u.shape[:-1], d // (2 * h), 2, h)
        a, b = v[..., 0, :].copy(), v[..., 1, :].copy()
        v[..., 0, :], v[..., 1, :] = a + b, a - b
        h *= 2
    return u


def rotate(x: np.ndarray) -> np.ndarray:
    """Pi x = H (s * x) / sqrt(d) over the last axis (float32; not the store's rounding)."""
    d = x.shape[-1]
    return fwht(np.asarray(x, np.float32) * rotation_signs(d)) / np.float32(math.sqrt(d))


def unrotate(y: np.ndarray) -> np.ndarray:
    """Pi^T y = s * H y / sqrt(d) (H H = d I)."""
    d = y.shape[-1]
    return fwht(y) * rotation_signs(d) / np.float32(math.sqrt(d))


def _squares_in_order(u: np.ndarray) -> np.ndarray:
    """sum_i u_i^2 over the last axis, in index order, each square rounded to f32 before it is added."""
    squares = (u * u).astype(np.float32)
    total = np.zeros(u.shape[:-1], np.float32)
    for i in range(u.shape[-1]):
        total = (total + squares[..., i]).astype(np.float32)
    return total


def pack_planes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes uint8 [..., d] (< 2^bits) -> uint32 [..., d / 32 * bits]: word p of block k holds bit p of codes
    32k .. 32k + 31."""
    blocks = codes.reshape(*codes.shape[:-1], -1, BLOCK).astype(np.uint32)
    weights = np.left_shift(np.uint32(1), np.arange(BLOCK, dtype=np.uint32))
    planes = [((blocks >> np.uint32(p)) & np.uint32(1)) @ weights for p in range(bits)]
    return np.stack(planes, axis=-1).astype(np.uint32).reshape(*codes.shape[:-1], -1)


def unpack_planes(words: np.ndarray, bits: int) -> np.ndarray:
    """The inverse: uint32 [..., d / 32 * bits] -> codes uint8 [..., d]."""
    planes = words.reshape(*words.shape[:-1], -1, bits)
    lanes = np.arange(BLOCK, dtype=np.uint32)
    codes = sum(((planes[..., p, None] >> lanes) & np.uint32(1)) << np.uint32(p) for p in range(bits))
    return codes.astype(np.uint8).reshape(*words.shape[:-1], -1)


# -- kernel helpers (before the macros that call them: a macro resolves names when it is defined) -------------------
def f32_constant(value) -> "T.PrimExpr":
    """An f32 constant by its bits: TVM's WGSL prints float literals with 7 digits, too few for every f32. (+0 as
    itself: TVM takes a reinterpret of the integer 0 for a null pointer.)"""
    if int(np.float32(value).view(np.uint32)) == 0:
        return T.float32(0)
    return T.reinterpret("float32", u32(int(np.float32(value).view(np.uint32))))


def sign_of(dim: int, d):
    """The rotation's sign of coordinate d (an expression) as f32 +-1: a bit of one of the dim / 32 words whose
    set bits mark the negative signs."""
    negative = rotation_signs(dim) < 0
    words = [int(sum(1 << i for i in range(BLOCK) if negative[k * BLOCK + i])) for k in range(dim // BLOCK)]
    word = u32(words[-1])
    for k in range(len(words) - 2, -1, -1):
        word = T.Select(d // BLOCK == k, u32(words[k]), word)
    bit = T.bitwise_and(T.shift_right(word, T.Cast("uint32", d % BLOCK)), u32(1))
    return T.Select(bit == u32(1), T.float32(-1), T.float32(1))


def centroid_of(values, bits):
    """The f32 value of a code given as its bits (expressions, bits[p] of weight 2^p, each 0 or 1) among
    `values` (2^len(bits) f32 numbers): a tree of selects on the bits, the highest first."""
    if not bits:
        return f32_constant(values[0])
    half = len(values) // 2
    return T.Select(bits[-1] == 1, centroid_of(values[half:], bits[:-1]), centroid_of(values[:half], bits[:-1]))


def code_of(y, thresholds):
    """#{j : y > t_j} as int32."""
    count = T.Select(y > f32_constant(thresholds[0]), 1, 0)
    for t in thresholds[1:]:
        count = count + T.Select(y > f32_constant(t), 1, 0)
    return count


def log2(n: int) -> int:
    return n.bit_length() - 1


class TurboQuant(KVCodec):
    """tq<bits>: the MSE quantizer at `bits` bits a coordinate, keys and values."""
    rotated = True              # the kernels read Pi x: the graph rotates the query and attention's output
    rotation_seed = ROTATION_SEED

    key_note = ("TurboQuant keys cost golden-text perplexity on the three test models (int8 matmuls: +12% to +24% at "
                "tq4, +40% to +98% at tq3; benchmarks/kv_quant.md): the rotation spreads the keys' few large channels "
                "over every coordinate. q4_ch keys keep f16's accuracy; TurboQuant suits values "
                "(--kv-dtype-k q4_ch --kv-dtype-v tq3).")

    def __init__(self, bits: int):
        self.bits = bits
        self.name = self.flag = f"tq{bits}"
        # as q4_0's: tq keys move the far tail so much that a log-prob bound checks little more than that the model
        # runs; perplexity is their measure (benchmarks/kv_quant.md)
        self.tolerance = (32.0, 4.0)

    def fields(self, head_dim, page_size):
        return Field("uint32", head_dim // BLOCK * self.bits), Field("float32", 1)

    def check(self, head_dim, page_size):
        if head_dim < BLOCK or head_dim & (head_dim - 1):
            raise ConfigError(f"A {self.name} KV cache needs head_dim a power of two of at least {BLOCK} (its "
                              f"Hadamard rotation), and this model's is {head_dim}; use --kv-dtype q8_0.")

    # -- numpy ----------------------------------------------------------------------------------------------------
    def codes_and_norm(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x f32 [..., d] -> (codes uint8 [..., d], n f32 [...]) by the rule (module doc)."""
        x = np.asarray(x, np.float32)
        d = x.shape[-1]
        u = fwht(x * rotation_signs(d))
        n = np.sqrt(_squares_in_order(u)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(n > 0, np.float32(1) / n, np.float32(0)).astype(np.float32)
        y = (u * inv[..., None]).astype(np.float32)
        _, thresholds = codebook(self.bits, d)
        codes = (y[..., None] > thresholds).sum(axis=-1).astype(np.uint8)
        return codes, n

    def quantize(self, part, x):
        codes, n = self.codes_and_norm(x)
        return pack_planes(codes, self.bits), n[..., None]

    def rotated_values(self, codes: np.ndarray, n: np.ndarray) -> np.ndarray:
        """What the kernels read: v_i = (c[code_i] / sqrt(d)) * n, f32 [..., d]."""
        scaled = self.scaled_centroids(codes.shape[-1])
        return (scaled[codes] * np.asarray(n, np.float32)[..., None]).astype(np.float32)

    def dequantize_rotated(self, part, q, s) -> np.ndarray:
        """The rotated-space values the kernels read, from the stored fields."""
        return self.rotated_values(unpack_planes(q, self.bits), s[..., 0])

    def dequantize(self, part, q, s):
        return unrotate(self.dequantize_rotated(part, q, s))

    def scaled_centroids(self, dim: int) -> np.ndarray:
        """c / sqrt(d), f32: what a code reads as, times the row's n."""
        return (codebook(self.bits, dim)[0] / np.float32(math.sqrt(dim))).astype(np.float32)

    def centroid_at(self, plane_word, d, dim: int):
        """c[code] / sqrt(dim) of coordinate d (an expression), its code's bits read from plane_word(p): the word
        of bit plane p of d's block. The CPU and GPU loads alike."""
        bits = [T.Cast("int32", T.bitwise_and(T.shift_right(plane_word(p), T.Cast("uint32", d % BLOCK)), u32(1)))
                for p in range(self.bits)]
        return centroid_of(self.scaled_centroids(dim), bits)

    @macro
    def rotate_for_store(self, x, t, h, u, stats):
        """The rule's first half for row x[t, h, :], through u (f32 [2 head_dim]): the transform in u's half
        log2(head_dim) % 2, n in stats[1], 1 / n in stats[2] (0 where n is 0). The squares are written out to the
        other half before they are summed, so that no compiler fuses a square into its sum. CPU and GPU alike."""
        D = T.meta_var(int(x.shape[2]))
        last = T.meta_var(log2(int(x.shape[2])) % 2 * int(x.shape[2]))
        spare = T.meta_var((1 - log2(int(x.shape[2])) % 2) * int(x.shape[2]))
        for d in range(D):
            u[d] = x[t, h, d] * sign_of(D, d)
        self.fwht(u, D)
        for d in range(D):
            u[spare + d] = u[last + d] * u[last + d]
        stats[0] = T.float32(0)
        for d in range(D):
            stats[0] = stats[0] + u[spare + d]
        stats[1] = T.sqrt(stats[0])
        stats[2] = T.Select(stats[1] > T.float32(0), T.float32(1) / stats[1], T.float32(0))

    # -- CPU ----------------------------------------------------------------------------------------------------------
    def cpu_load(self, rows, which, page, h, slot, d):
        words = rows.quants[which]
        base = d // BLOCK * self.bits
        return self.centroid_at(lambda p: words[page, h, slot, base + p], d, rows.fmt.head_dim) \
            * rows.scales[which][page, h, slot, 0]

    @macro
    def fwht(self, u, dim):
        """The unnormalized Walsh-Hadamard transform of u[0 .. dim - 1] (a buffer f32 [>= 2 dim]), butterflies of
        span 1, 2, 4, .. alternating between u's halves [0, dim) and [dim, 2 dim): the result is in half
        log2(dim) % 2. (CPU and GPU alike.)"""
        for stage in range(log2(dim)):
            for i in range(dim // 2):
                a = T.meta_var(T.shift_right(i, stage) * T.shift_left(2, stage) + T.bitwise_and(i, T.shift_left(1, stage) - 1))
                b = T.meta_var(a + T.shift_left(1, stage))
                u[(stage + 1) % 2 * dim + a] = u[stage % 2 * dim + a] + u[stage % 2 * dim + b]
                u[(stage + 1) % 2 * dim + b] = u[stage % 2 * dim + a] - u[stage % 2 * dim + b]

    @macro
    def rotate_row(self, x, t, h, y, u, inverse: bool):
        """y[t, h, :] = Pi x[t, h, :] (inverse: Pi^T), through u (f32 [2 head_dim] scratch); rotate() and
        unrotate()'s arithmetic. The graph's rotation of queries and of attention's output (kernels/kv_rotate.py);
        CPU and GPU alike."""
        D = T.meta_var(int(x.shape[2]))
        last = T.meta_var(log2(int(x.shape[2])) % 2 * int(x.shape[2]))
        for d in range(D):
            u[d] = x[t, h, d] if inverse else x[t, h, d] * sign_of(D, d)
        self.fwht(u, D)
        for d in range(D):
            y[t, h, d] = (u[last + d] * sign_of(D, d) if inverse else u[last + d]) / f32_constant(math.sqrt(D))

    @macro
    def cpu_store(self, rows, which, page, h, slot, x, t):
        """The rule (module doc): the row rotated, its norm, its codes as bit planes."""
        D = T.meta_var(rows.fmt.head_dim)
        last = T.meta_var(log2(rows.fmt.head_dim) % 2 * rows.fmt.head_dim)
        q = T.meta_var(rows.quants[which])
        u = T.decl_buffer((2 * D,), "float32", scope="global")
        stats = T.decl_buffer((3,), "float32", scope="global")     # the sum of squares, n, 1 / n
        codes = T.decl_buffer((D,), "int32", scope="global")
        word = T.decl_buffer((1,), "uint32", scope="global")
        self.rotate_for_store(x, t, h, u, stats)
        rows.scales[which][page, h, slot, 0] = stats[1]
        for d in range(D):
            codes[d] = code_of(u[last + d] * stats[2], codebook(self.bits, D)[1])
        for w in range(D // BLOCK * self.bits):
            word[0] = u32(0)
            for i in range(BLOCK):
                word[0] = T.bitwise_or(word[0], T.shift_left(T.bitwise_and(
                    T.shift_right(T.Cast("uint32", codes[w // self.bits * BLOCK + i]), T.Cast("uint32", w % self.bits)),
                    u32(1)), T.Cast("uint32", i)))
            q[page, h, slot, w] = word[0]

    # -- GPU ----------------------------------------------------------------------------------------------------------
    def gpu_load(self, rows, pool, which, page, h, slot, d):
        part = rows.fmt.part(which)
        base = part.offset // WORD + d // BLOCK * self.bits
        norm = T.reinterpret("float32", pool[page, 0, h, slot, part.scale_offset // WORD])
        return self.centroid_at(lambda p: pool[page, 0, h, slot, base + p], d, rows.fmt.head_dim) * norm

    def gpu_blocks(self, part):
        return 1                 # one invocation rotates the row

    def gpu_scratch(self, part):
        return part.head_dim + 1          # y, then n

    @macro
    def gpu_block_scale(self, rows, which, x, t, h, b, scales, inverse, stats):
        """By one invocation: the row rotated in its own memory, then y into scales[0 .. D) and n into scales[D]
        (workgroup memory only written here: read after the store's barrier)."""
        D = T.meta_var(rows.fmt.head_dim)
        last = T.meta_var(log2(rows.fmt.head_dim) % 2 * rows.fmt.head_dim)
        u = T.alloc_buffer((2 * D,), "float32", scope="local")
        self.rotate_for_store(x, t, h, u, stats)
        scales[D] = stats[1]
        for d in range(D):
            scales[d] = u[last + d] * stats[2]

    def gpu_quant_word(self, rows, which, x, t, h, i, scales, inverse):
        """Word i: bit plane i % bits of block i // bits, from the y the rotation left in workgroup memory."""
        thresholds = codebook(self.bits, rows.fmt.head_dim)[1]
        word = None
        for lane in range(BLOCK):
            code = code_of(scales[i // self.bits * BLOCK + lane], thresholds)
            bit = T.shift_left(T.bitwise_and(T.shift_right(T.Cast("uint32", code), T.Cast("uint32", i % self.bits)),
                                             u32(1)), u32(lane))
            word = bit if word is None else T.bitwise_or(word, bit)
        return word

    def gpu_scale_word(self, rows, which, i, scales):
        return T.reinterpret("uint32", scales[rows.fmt.head_dim])


TQ3, TQ4 = TurboQuant(3), TurboQuant(4)

class TurboQuantProd:
    """The inner-product variant (numpy): the MSE quantizer at bits - 1, then a 1-bit QJL sketch of the residual
    r = x - x_mse: z = sign(G r) for a Gaussian G [d, d] (seeded), and <q, x> is estimated as
    <q, x_mse> + |r| sqrt(pi / 2) / d <G q, z>, unbiased over G."""

    def __init__(self, bits: int, dim: int, seed: int = 0):
        self.bits, self.dim = bits, dim
        self.mse = TurboQuant(bits - 1) if bits > 1 else None
        self.sketch = np.random.default_rng(seed).standard_normal((dim, dim)).astype(np.float32)

    def quantize(self, x: np.ndarray):
        """x f32 [..., d] -> (x_mse f32 [..., d], signs int8 [..., d], |r| f32 [...])."""
        x = np.asarray(x, np.float32)
        if self.mse is None:
            approx = np.zeros_like(x)
        else:
            codes, n = self.mse.codes_and_norm(x)
            approx = unrotate(self.mse.rotated_values(codes, n))
        residual = x - approx
        signs = np.where(residual @ self.sketch.T >= 0, 1, -1).astype(np.int8)
        return approx, signs, np.linalg.norm(residual, axis=-1).astype(np.float32)

    def inner_products(self, q: np.ndarray, quantized) -> np.ndarray:
        """<q, x> estimated from quantize(x)'s output, for rows q [..., d] beside x's."""
        approx, signs, norms = quantized
        correction = norms * np.float32(math.sqrt(math.pi / 2) / self.dim) * ((q @ self.sketch.T) * signs).sum(-1)
        return (q * approx).sum(-1) + correction
