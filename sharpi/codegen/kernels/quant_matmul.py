"""Matmuls against weights in sharpi's layouts (sharpi.common.quant_layout), dequantizing on the fly,
and the embedding lookup on the same layouts. CPU kernels: parallel over output rows, vectorized over K.

y[t, j] = sum_k x[t, k] * W[j, k]. Tokens are processed in tiles of TILE so a block of 32 weights is
dequantized once per tile and reused across its tokens; decode (one token) gets a tile of 1.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ...common.quant_layout import (BIT_WORDS, BLOCK, FLOAT_PLANES, KS_BITS, KS_WORDS, LAYOUTS, QUANTIZED,
                                   SUPER_BLOCK)
from .common import LANES, token_count
from .lanes import lane_total

TILE = 8


def planar(s):
    """Scale-field accessor over the layout's one [S, N, K/32] buffer (what the CPU kernels take)."""
    return lambda f, row, b: s[f, row, b]


def _f16_half(word, high: bool):
    """f32 value of the f16 in the low (or high) half of a u32 word (one vcvtph2ps where the CPU has F16C)."""
    bits = (word >> T.uint32(16)) if high else (word & T.uint32(0xFFFF))
    return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", bits)))


def ks_super_scale(qtype: str, ks, row, first):
    """d_super of the super-block whose `ks` words start at `first`."""
    if qtype == "q6_k":
        return T.reinterpret("float32", ks[row, first])
    return _f16_half(ks[row, first], False)


def ks_super_min(ks, row, first):
    """dmin of a q4_k or q5_k super-block whose `ks` words start at `first`."""
    return _f16_half(ks[row, first], True)


def ks_sub_scale_byte(qtype: str, first, b, half):
    """Index, in a row of `ks` read as bytes, of the sub-scale of block b (q6_k: of its half `half`) of the
    super-block whose words start at `first`."""
    return first * 4 + 4 + (2 * b + half if qtype == "q6_k" else b)


def ks_offset_byte(qtype: str, first, b, f):
    """Index of the integer that multiplies activation sum f of block b: q4_k's and q5_k's min, q6_k's sub-scale."""
    return ks_sub_scale_byte(qtype, first, b, f) if qtype == "q6_k" else first * 4 + 12 + b


def ks_bit_word(qtype: str, b, i):
    """Index, in a row of `ks`, of word i of block b's bit fields (q5_k's fifth bits; q6_k's h0, h1)."""
    blocks = SUPER_BLOCK // BLOCK
    return b // blocks * KS_WORDS[qtype] + KS_BITS[qtype] + b % blocks * BIT_WORDS[qtype] + i


def from_ks(qtype: str, ks):
    """Scale-field accessor of a K-quant stored as (qs, ks): field f of block b as the `s` plane would hold it,
    computed from the super-block's scales, integer sub-scales and bit fields (quant_layout's `ks`)."""
    W, blocks = KS_WORDS[qtype], SUPER_BLOCK // BLOCK

    def byte(row, index, signed):
        u = (ks[row, index // 4] >> T.Cast("uint32", index % 4 * 8)) & T.uint32(255)
        value = T.Cast("int32", u) - T.Cast("int32", u & T.uint32(128)) * 2 if signed else T.Cast("int32", u)
        return T.Cast("float32", value)

    def field(f, row, b):
        first, j = b // blocks * W, b % blocks
        if f >= FLOAT_PLANES[qtype]:          # a bit-field word, as the f32 bits the plane would hold
            return T.reinterpret("float32", ks[row, ks_bit_word(qtype, b, f - FLOAT_PLANES[qtype])])
        if qtype == "q6_k" or f == 0:
            return ks_super_scale(qtype, ks, row, first) * byte(row, ks_sub_scale_byte(qtype, first, j, f),
                                                                 qtype == "q6_k")
        return -ks_super_min(ks, row, first) * byte(row, ks_offset_byte(qtype, first, j, 0), False)

    return field


def dequant(qtype: str, qs, scale, row, b, e):
    """TIR expression of weight (row, b*32 + e) in `qtype`'s layout (for quantized types); `scale(f, row, b)`
    reads scale field f of the block."""
    if qtype == "q8_0" and str(qs.dtype) == "int8":   # CPU kernels read the words through an int8 view
        return T.Cast("float32", qs[row, b * BLOCK + e]) * scale(0, row, b)
    if qtype == "q8_0":   # byte e%4 of the word, sign-extended (no 8-bit types needed)
        word = qs[row, b * 8 + e // 4]
        # the byte as unsigned, then its sign by arithmetic (no negative unsigned constants: the CUDA build's
        # simplifier rejects the shift-left-then-arithmetic-shift-right form once it folds the shifts)
        u = (word >> T.Cast("uint32", (e % 4) * 8)) & T.uint32(255)
        byte = T.Cast("int32", u) - T.Cast("int32", u & T.uint32(128)) * 2
        return T.Cast("float32", byte) * scale(0, row, b)
    low = (qs[row, b * 4 + e // 8] >> T.Cast("uint32", (e % 8) * 4)) & T.uint32(15)   # the low 4 bits, uint32
    if qtype == "q6_k":
        # high 2 bits from field 2 (elements 0-15) or 3 (16-31), scale from field 0 or 1: all unsigned until the
        # 6-bit value is whole, then the offset in int32
        first = e < 16
        bits = T.Select(first, T.reinterpret("uint32", scale(2, row, b)), T.reinterpret("uint32", scale(3, row, b)))
        hi = (bits >> T.Cast("uint32", (e % 16) * 2)) & T.uint32(3)
        q = T.Cast("int32", low | (hi << T.uint32(4))) - 32
        return T.Cast("float32", q) * T.Select(first, scale(0, row, b), scale(1, row, b))
    nib = T.Cast("float32", low)
    if qtype == "q4_0":
        return (nib - T.float32(8)) * scale(0, row, b)
    if qtype in ("q4_1", "q4_k"):   # q4_k's per-32 d and m are expanded at repack (m = -dmin * min)
        return nib * scale(0, row, b) + scale(1, row, b)
    if qtype == "q5_0":
        hi = T.Cast("float32", (T.reinterpret("uint32", scale(1, row, b)) >> T.Cast("uint32", e)) & T.uint32(1))
        return (nib + hi * T.float32(16) - T.float32(16)) * scale(0, row, b)
    if qtype in ("q5_1", "q5_k"):
        hi = T.Cast("float32", (T.reinterpret("uint32", scale(2, row, b)) >> T.Cast("uint32", e)) & T.uint32(1))
        return (nib + hi * T.float32(16)) * scale(0, row, b) + scale(1, row, b)
    raise AssertionError(qtype)


def dense_value(qtype: str, w, row, k):
    if qtype == "f32":
        return w[row, k]
    if qtype == "f16":
        return T.Cast("float32", w[row, k])
    if qtype == "bf16":
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", w[row, k]), T.uint32(16)))
    raise AssertionError(qtype)


def cpu_quants(qtype: str, n: int, k: int) -> tuple[tuple[int, int], str]:
    """Shape and dtype in which the CPU kernels take the quants: q8_0's u32 words as int8 [N, K] (a zero-copy
    view that codegen inserts), which LLVM widens with one instruction instead of shifts per byte."""
    if qtype == "q8_0":
        return (n, k), "int8"
    _, dtype, shape = LAYOUTS[qtype][0]
    return shape(n, k), dtype


def _part_dtypes(qtype: str):
    return {name: dtype for name, dtype, _ in LAYOUTS[qtype]}


def make_matmul(qtype: str, n_out: int, k_in: int, tokens: int | None = None):
    """PrimFunc (x [n, K] f32, *weight parts, y [n, N] f32); n symbolic unless `tokens` is given."""
    if qtype in QUANTIZED:
        return _quant_matmul(qtype, n_out, k_in, tokens)
    return _dense_matmul(qtype, n_out, k_in, tokens)


def _rows_per_group(N: int, R: int = 4) -> int:
    while R > 1 and N % R:
        R //= 2
    return R


def _quant_gemv(qtype, N, K):
    """Decode (one token): parallel over groups of R rows, one accumulator chain per row, no local buffers
    but the (stack) accumulators."""
    NB = K // BLOCK
    dt = _part_dtypes(qtype)
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    S = LAYOUTS[qtype][1][2](N, K)[0]
    R = _rows_per_group(N)
    G = N // R
    C = BLOCK // LANES

    @T.prim_func
    def quant_gemv(x: T.Buffer((1, K), "float32"), qs: T.Buffer(qs_shape, qs_dtype), s: T.Buffer((S, N, NB), "float32"),
                   y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        for g in T.parallel(G):
            for r in range(R):
                acc = T.decl_buffer((C, LANES), "float32", scope="global")
                for c in T.unroll(C):
                    for l in T.vectorized(LANES):
                        acc[c, l] = T.float32(0)
                for b in range(NB):
                    for c in T.unroll(C):
                        for l in T.vectorized(LANES):
                            acc[c, l] = acc[c, l] + dequant(qtype, qs, planar(s), g * R + r, b, c * LANES + l) * x[0, b * BLOCK + c * LANES + l]
                for l in T.vectorized(LANES):
                    acc[0, l] = (acc[0, l] + acc[1, l]) + (acc[2, l] + acc[3, l])
                y[0, g * R + r] = lane_total(acc, 0)

    return quant_gemv


def _quant_matmul(qtype, N, K, tokens):
    if tokens == 1:
        return _quant_gemv(qtype, N, K)
    NB = K // BLOCK
    dt = _part_dtypes(qtype)
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    S = LAYOUTS[qtype][1][2](N, K)[0]
    TT = 1 if tokens == 1 else TILE
    n = token_count(tokens)

    @T.prim_func
    def quant_matmul(var_x: T.handle, qs: T.Buffer(qs_shape, qs_dtype), s: T.Buffer((S, N, NB), "float32"),
                     var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, K), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        for tt in range((n + TT - 1) // TT):
            for j in T.parallel(N):
                acc = T.decl_buffer((TT, LANES), "float32", scope="global")
                wv = T.decl_buffer((BLOCK,), "float32", scope="global")
                for t in T.unroll(TT):
                    for l in T.vectorized(LANES):
                        acc[t, l] = T.float32(0)
                for b in range(NB):
                    for c in T.unroll(BLOCK // LANES):
                        for l in T.vectorized(LANES):
                            wv[c * LANES + l] = dequant(qtype, qs, planar(s), j, b, c * LANES + l)
                    for t in T.unroll(TT):
                        if tt * TT + t < n:
                            for c in T.unroll(BLOCK // LANES):
                                for l in T.vectorized(LANES):
                                    acc[t, l] = acc[t, l] + wv[c * LANES + l] * x[tt * TT + t, b * BLOCK + c * LANES + l]
                for t in T.unroll(TT):
                    if tt * TT + t < n:
                        y[tt * TT + t, j] = (acc[t, 0] + acc[t, 1] + acc[t, 2] + acc[t, 3]
                                             + acc[t, 4] + acc[t, 5] + acc[t, 6] + acc[t, 7])

    return quant_matmul


def _dense_matmul(qtype, N, K, tokens):
    wdt = _part_dtypes(qtype)["w"]
    TT = 1 if tokens == 1 else TILE
    KV = K // LANES
    KR = K - KV * LANES
    n = token_count(tokens)

    @T.prim_func
    def dense_matmul(var_x: T.handle, w: T.Buffer((N, K), wdt), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, K), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        for tt in range((n + TT - 1) // TT):
            for j in T.parallel(N):
                acc = T.decl_buffer((TT, LANES), "float32", scope="global")
                tail = T.decl_buffer((TT,), "float32", scope="global")
                for t in T.unroll(TT):
                    tail[t] = T.float32(0)
                    for l in T.vectorized(LANES):
                        acc[t, l] = T.float32(0)
                for c in range(KV):
                    for t in T.unroll(TT):
                        if tt * TT + t < n:
                            for l in T.vectorized(LANES):
                                acc[t, l] = acc[t, l] + dense_value(qtype, w, j, c * LANES + l) * x[tt * TT + t, c * LANES + l]
                for t in T.unroll(TT):
                    if tt * TT + t < n:
                        for r in range(KR):
                            tail[t] = tail[t] + dense_value(qtype, w, j, KV * LANES + r) * x[tt * TT + t, KV * LANES + r]
                        y[tt * TT + t, j] = (acc[t, 0] + acc[t, 1] + acc[t, 2] + acc[t, 3]
                                             + acc[t, 4] + acc[t, 5] + acc[t, 6] + acc[t, 7] + tail[t])

    return dense_matmul


def make_embedding(qtype: str, vocab: int, dim: int, sub_scales: bool = False):
    """PrimFunc (ids [n] int32, *weight parts, y [n, dim] f32): rows of the dequantized table; `sub_scales`: a
    K-quant stored as (qs, ks) (quant_layout), read through from_ks."""
    if qtype in QUANTIZED:
        NB = dim // BLOCK
        qs_shape, qs_dtype = cpu_quants(qtype, vocab, dim)
        scales = ((vocab, dim // SUPER_BLOCK * KS_WORDS[qtype]), "uint32") if sub_scales else (
            (LAYOUTS[qtype][1][2](vocab, dim)[0], vocab, NB), "float32")
        n = token_count(None)

        @T.prim_func
        def quant_embedding(var_ids: T.handle, qs: T.Buffer(qs_shape, qs_dtype), s: T.Buffer(*scales),
                            var_y: T.handle):
            T.func_attr({"tirx.noalias": True, "op_pattern": 8})
            ids = T.match_buffer(var_ids, (n,), "int32")
            y = T.match_buffer(var_y, (n, dim), "float32")
            for t in T.parallel(n):
                for b in range(NB):
                    for e in T.vectorized(BLOCK):
                        y[t, b * BLOCK + e] = dequant(qtype, qs, from_ks(qtype, s) if sub_scales else planar(s),
                                                      ids[t], b, e)

        return quant_embedding
    wdt = _part_dtypes(qtype)["w"]
    n = token_count(None)

    @T.prim_func
    def dense_embedding(var_ids: T.handle, w: T.Buffer((vocab, dim), wdt), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        ids = T.match_buffer(var_ids, (n,), "int32")
        y = T.match_buffer(var_y, (n, dim), "float32")
        for t in T.parallel(n):
            for k in range(dim):
                y[t, k] = dense_value(qtype, w, ids[t], k)

    return dense_embedding
