"""The prefill GEMM of quant_matmul_int8 on AVX-512 VNNI: the same arithmetic on 512-bit registers (the decode
GEMV's 512-bit form is quant_matmul_int8's, a unit of two blocks).

One `vpdpbusd` multiplies two 32-blocks' 64 unsigned weight bytes with their 64 int8 activations and sums each
4 adjacent products into 16 int32 lanes (AVX2 needs vpmaddubsw and vpmaddwd for one block's 32); each lane is
converted and scaled by its own block's scales as in the AVX2 kernels, the two blocks interleaved every 4 bytes
(_INTERLEAVE). Per two blocks and token that is one dot, one convert, one multiply and one FMA, where AVX2 takes
ten instructions; with 32 vector registers a tile holds 16 tokens' accumulators (AVX2: 8 of 16).

The integer products are exactly the AVX2 kernels' (neither saturates on these quants), so the two differ only in
the order of the float sums. q8_0's signed bytes have no vpsignb on 512 bits: they are offset to unsigned
(w + 128, one XOR) and the offset goes out through the activation sums, as q4_0's 8 does. Block counts must be
even (every model sharpi knows has them so); odd ones take the 256-bit kernels.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.quant_layout import BLOCK, LAYOUTS
from .common import token_count
from .quant_matmul import cpu_quants
from .quant_matmul_int8 import (INT8_DOT_TYPES, TASKS, _wide_offset, pair_quants, pair_scales,
                                quantize_activation_block, tile_offset, unsigned_dot)

PAIR = 2 * BLOCK      # the bytes of one 512-bit dot: two blocks
GEMM_TILE = 16        # tokens per prefill tile: 16 float32x16 accumulators of the 32 registers
ROW_BLOCK_BYTES = 256 << 10   # a task takes as many rows' weights through every tile before the next: they stay in
                              # L2 while the tiles pass, so a call reads its weights from memory once, not once a
                              # tile (a 7B's 4096 x 14336 q6_k GEMM: 412 -> 202 ms at 512 tokens); the tiles'
                              # activations come from L3 once a block
K_SPAN = 24           # pairs of blocks a row takes before the next row: the tile's activations for them (16 tokens x
                      # 24 x 72 bytes, 27 KB) stay in L1 while every row of a task passes over them


def vnni512_fits(K: int) -> bool:
    """Whether a matmul of K inputs takes these kernels (whole pairs of blocks)."""
    return K % PAIR == 0


# The GEMM's pairs interleave their two blocks every 4 bytes (int32 lane i of a dot is block 2p + i % 2's), so a
# pair's two activation scales are one 8-byte broadcast ([d0, d1, d0, d1, ...]) instead of 64 bytes in memory:
# with 16 tokens a tile's activations then stay within what L1 and L2 serve (the 64-byte form made the K = 8960
# GEMMs of a 1.5B model ~1.7x slower per multiply than the K = 1536 ones, their activations streaming from L2).
# (Unpacking a pair's nibbles in one permute, shift and AND instead of per block measured no faster: the dots, not
# the unpacking, bound it.)
_INTERLEAVE = [i // 2 + 8 * (i % 2) for i in range(16)]


def _tile_totals(acc, tokens: int):
    """float32 x tokens: lane t is the sum of the 16 lanes of acc[t] (tokens = 16). A transposing tree: two
    vectors of 2^L tokens (16 / 2^L lanes each) become one of 2^(L+1) by adding their segments' halves, so 15
    adds and 30 two-source permutes sum the tile, where summing each row on its own took ~30 instructions a token
    (for K = 640, 10 pairs a row, a third of the GEMM's work)."""
    vectors = [acc[t, T.ramp(0, 1, 16)] for t in range(tokens)]
    width = 16
    while len(vectors) > 1:
        half = width // 2
        lows = [seg * width + j for seg in range(16 // width) for j in range(half)]
        low = lows + [16 + i for i in lows]
        high = [i + half for i in low]
        vectors = [T.Shuffle([a, b], low) + T.Shuffle([a, b], high) for a, b in zip(vectors[0::2], vectors[1::2])]
        width = half
    return vectors[0]


@T.macro
def _pairs(qtype, qs, s, xq, xd_pairs, xo, acc, off, u, row, span, SPAN, NP, tt, n, short):
    """A row's span of pairs (SPAN a span) for tile tt: per pair the 64 quants unpacked once into u, then a dot per
    token of the tile (short: only the tokens < n, so that a batch of a few sequences, padded to a tile, costs its
    own dots rather than a whole tile's)."""
    # (a loop from span * SPAN, not from 0, came out wrong: TVM 0.27 miscompiled it here)
    for pp in range(T.min(SPAN, NP - span * SPAN)):
        p = T.meta_var(span * SPAN + pp)
        u[T.ramp(0, 1, PAIR)] = pair_quants(qtype, qs, s, row, p, _INTERLEAVE)
        for t in T.unroll(GEMM_TILE):
            if not short or tt * GEMM_TILE + t < n:
                acc[t, T.ramp(0, 1, 16)] = acc[t, T.ramp(0, 1, 16)] + T.Cast("float32x16", unsigned_dot(
                    u[T.ramp(0, 1, PAIR)], T.reinterpret("int8x64", xq[tt * GEMM_TILE + t, T.ramp(p * 16, 1, 16)]), 16,
                    "avx512-vnni")) * (pair_scales(qtype, s, row, p, _INTERLEAVE)
                                       * T.reinterpret("float32x16", T.Broadcast(xd_pairs[tt * GEMM_TILE + t, p], 8)))
        for h in range(2):
            off[T.ramp(0, 1, GEMM_TILE)] = off[T.ramp(0, 1, GEMM_TILE)] + tile_offset(
                _wide_offset(qtype), s, xo, row, 2 * p + h, tt * GEMM_TILE, GEMM_TILE)


def make_gemm_vnni512(qtype: str, N: int, K: int):
    """PrimFunc (x [n, K] f32, *weight parts, y [n, N] f32), n symbolic: quant_matmul_int8.make_gemm_int8 on 512
    bits. Tiles of GEMM_TILE tokens; per row and pair of blocks the 64 quants are unpacked once into a register
    (interleaved: pair_quants with _INTERLEAVE) and multiplied with the tile's 16 activation pairs, laid out the
    same way. The activation scales are stored token-major (a pair's two side by side), the offsets' sums
    token-minor (one FMA adds a block's offset term to a whole tile)."""
    assert qtype in INT8_DOT_TYPES and vnni512_fits(K), (qtype, K)
    NB, NP = K // BLOCK, K // PAIR
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    S = LAYOUTS[qtype][1][2](N, K)[0]
    TT = GEMM_TILE
    CHUNKS = min(TASKS, N)
    ROWS = (N + CHUNKS - 1) // CHUNKS
    F = max(1, len(_wide_offset(qtype)[0]))
    n = token_count(None)
    tiles = (n + TT - 1) // TT
    row_bytes = qs_shape[1] * (1 if qs_dtype == "int8" else 4) + S * NB * 4
    ROW_BLOCK = max(1, min(ROWS, ROW_BLOCK_BYTES // row_bytes))
    SPAN = min(NP, K_SPAN)
    SPANS = (NP + SPAN - 1) // SPAN

    @T.prim_func
    def quant_gemm_vnni512(var_x: T.handle, qs: T.Buffer(qs_shape, qs_dtype), s: T.Buffer((S, N, NB), "float32"),
                           var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, K), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        xq = T.decl_buffer((tiles * TT, K // 4), "int32")
        xd = T.decl_buffer((tiles * TT, NB), "float32")
        xd_blocks = T.decl_buffer((NB, tiles * TT), "float32", data=xd.data, strides=(1, NB))  # as written
        xd_pairs = T.decl_buffer((tiles * TT, NP), "float64", data=xd.data)                    # as read
        xo = T.decl_buffer((F, NB, tiles * TT), "float32")
        for t in T.parallel(tiles * TT):
            for b in range(NB):
                quantize_activation_block(x, T.min(t, n - 1), t < n, xq, xd_blocks, xo, t, b, qtype, F, "pairs")
        for c in T.parallel(CHUNKS):
            acc = T.decl_buffer((TT, 16), "float32", scope="global")
            off = T.decl_buffer((TT,), "float32", scope="global")
            u = T.decl_buffer((PAIR,), "int8", scope="global")
            rows = T.meta_var(T.min(ROWS, N - c * ROWS))     # the last task's may be short
            for rb in range((rows + ROW_BLOCK - 1) // ROW_BLOCK):
                for tt in range(tiles):
                    for span in range(SPANS):
                        for ii in range(T.min(ROW_BLOCK, rows - rb * ROW_BLOCK)):
                            i = T.meta_var(rb * ROW_BLOCK + ii)
                            row = T.meta_var(c * ROWS + i)
                            for t in T.unroll(TT):
                                acc[t, T.ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
                            off[T.ramp(0, 1, TT)] = T.Broadcast(T.float32(0), TT)
                            if (tt + 1) * TT <= n:
                                _pairs(qtype, qs, s, xq, xd_pairs, xo, acc, off, u, row, span, SPAN, NP, tt, n, False)
                            else:     # the last tile, short: its missing tokens' dots are not computed
                                _pairs(qtype, qs, s, xq, xd_pairs, xo, acc, off, u, row, span, SPAN, NP, tt, n, True)
                            off[T.ramp(0, 1, TT)] = off[T.ramp(0, 1, TT)] + _tile_totals(acc, TT)
                            for t in T.unroll(TT):
                                if tt * TT + t < n:
                                    if span == 0:
                                        y[tt * TT + t, row] = off[t]
                                    else:     # a later span of K adds to the row's sums
                                        y[tt * TT + t, row] = y[tt * TT + t, row] + off[t]

    return quant_gemm_vnni512
