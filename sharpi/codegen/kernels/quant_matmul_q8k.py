"""K-quant matmuls on AVX2 with the sub-scales applied as integers: llama.cpp's q4_K / q5_K / q6_K x q8_K dot
products, on sharpi's layouts.

quant_matmul_int8's kernels give every 32-block its own f32 weight scale and activation scale, so each block-token
product ends in a convert and an FMA (and the quantized activations of a block carry a scale each). A K-quant's
block scales are one f16 per super-block of 256 times small integers (6-bit sub-scales for q4_K and q5_K, int8 per
16 for q6_K), so here the activations are quantized per 256 (ggml's q8_K: d = max|x| / 127 over the super-block),
the sub-scale multiplies the block's pair sums inside `vpmaddwd` (in place of the int8 kernels' multiply by ones),
and the 8 blocks of a super-block sum in int32: one convert and one FMA a super-block, not a block. The weights'
integer sub-scales and super-block scales are the `ks` part (quant_layout); the minimum or zero-point term goes
per super-block through the activation sums (times the activation scale) of each block (q6_K: of each 16):

    sum_e w_e x_e = dx * (d_super * sum_b sc_b * sum_(e in b) u_e xq_e  +  coefficient * sum_b m_b * xsum_b)

with u the unsigned quants and, for q4_K and q5_K, m_b = min_b and coefficient = -dmin; for q6_K, m_b the 16-part
sub-scales and coefficient = -32 d_super. The quants are unpacked as quant_matmul_int8 unpacks them (its lane
order). Every K-quant's matmuls are these on AVX2 hosts; on AMX hosts the decode GEMVs (whose speed is the
bytes they stream: `ks` is ~0.75x `s`), the prompt's going through AMX tiles; elsewhere a mixture's experts'.

The prefill GEMM unpacks a group of GROUP_ROWS rows' quants once into scratch, a span of K (SPAN_BYTES) at a time,
and every tile of tokens passes over it; per token the kernel then does one load, `vpmaddubsw`, `vpmaddwd` and
`vpaddd` a block. Every kernel here reads the quants and `ks` only (which holds the bit fields too: the layout
without `s`, within 1.03x of the GGUF's bytes).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.quant_layout import BLOCK, K_QUANTS, KS_WORDS, SUPER_BLOCK
from .common import prefetch, token_count
from .lanes import lane_max, lane_total
from .moe import group_by_expert, grouped_input_row, grouped_rows
from .quant_matmul import (cpu_quants, ks_bit_word, ks_offset_byte, ks_sub_scale_byte, ks_super_min,
                           ks_super_scale)
from .quant_matmul_int8 import (GEMM_TILE, PREFETCH_BYTES, TASKS, _abs_max8, _activation_sums, _bit_lanes, _byte_vector,
                                _half_sum8, _intrin, _quantized_block, _unsigned_quants, lane_element,
                                q6_k_fields_to_bits_4_5)

Q8K_TYPES = K_QUANTS
BLOCKS = SUPER_BLOCK // BLOCK   # blocks of 32 a super-block
GROUP_ROWS = 32        # rows a GEMM task unpacks together
# unpacked quants a GEMM task keeps (in L2) while every tile of tokens passes over them: each tile and row reduces
# a span's sums and adds them to y once, so longer spans amortize that (spans of 16 KB, which stay in L1, measured
# 2-11% slower on the 1.5B and 8B shapes; 64-256 KB about level)
SPAN_BYTES = 65536
def _sub_scale_byte(qtype, sb, b, half):
    """Index, in a row of `ks` read as bytes, of the sub-scale of block b's half `half` of super-block sb."""
    return ks_sub_scale_byte(qtype, sb * KS_WORDS[qtype], b, half)


def _offset_byte(qtype, sb, b, f):
    """Index of the integer that multiplies activation sum f of block b: q4_K's and q5_K's min, q6_K's sub-scale."""
    return ks_offset_byte(qtype, sb * KS_WORDS[qtype], b, f)


def _lane_sub_scales(qtype, first, second):
    """int16x16: the sub-scale of each 16-bit lane of `vpmaddubsw`'s sums of a block in lane order. Lane j sums
    bytes 2j and 2j + 1, elements 4j, 4j + 2 (j < 8) or 4(j - 8) + 1, + 3: the block's first 16 elements where
    j % 8 < 4. q4_K and q5_K have one sub-scale a block (`first`)."""
    if qtype != "q6_k":
        return T.Broadcast(first, 16)
    return T.Select(T.ramp(0, 1, 16) % 8 < T.Broadcast(4, 16), T.Broadcast(first, 16), T.Broadcast(second, 16))


def _scaled_dot(u, x, scales):
    """int32x8: pairs of u_e * x_e (`vpmaddubsw`, at most 2 * 63 * 127 < 2^15), then pairs of those times their
    sub-scales (`vpmaddwd`)."""
    pairs = _intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u, x)
    return _intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, scales)


# The decode GEMVs' order of a pair of blocks (2P, 2P + 1), in the quants and the activations alike: 64 bytes,
# lanes 0-15 of block 2P, lanes 0-15 of block 2P + 1, then lanes 16-31 of each (lanes in quant_matmul_int8's
# order: a block's 16 bytes of nibbles give lanes 0-15 as their low nibbles, 16-31 as their high ones). Then one
# 32-byte load of the two blocks' nibbles, one shift and two masks unpack both halves, each 128-bit half of a
# vector belongs to one block (so a byte shuffle within halves gives every lane its sub-scale and bit fields),
# and both halves of a pair share one vector of sub-scales. A block at a time took a cross-half insert and a
# broadcast for each block's sub-scale: shuffle-port work that left the MoE GEMVs waiting on the dots rather than
# on memory (q4_K ~10 weights a cycle a core).
def _pair_offset(b, half):
    """The first byte, in a row of pair-ordered activations, of block b's lanes 16 * half .. 16 * half + 15."""
    return b // 2 * 2 * BLOCK + half * BLOCK + b % 2 * (BLOCK // 2)


def _repeat(vector, lanes: int, times: int):
    """A vector of `lanes` lanes `times` times over (LLVM makes a broadcast load of it)."""
    return T.Shuffle([vector] * times, list(range(lanes * times)))


def _shuffle_bytes(table, control):
    """vpshufb: byte l of the result is byte control(l) of `table`'s 128-bit half holding l (0 where control(l)
    has its top bit set); control is a function of the lane index, folded to a constant."""
    return T.reinterpret("uint8x32", _intrin("int8x32", "llvm.x86.avx2.pshuf.b", T.reinterpret("int8x32", table),
                                             T.reinterpret("int8x32", _byte_vector(control))))


def _pair_quants(qtype, qs, ks, row, P):
    """(A, B), int8x32 each: the unsigned quants of blocks 2P and 2P + 1 in pair order, A their lanes 0-15 (the
    low nibbles and, for q5_K and q6_K, those elements' high bits), B their lanes 16-31."""
    packed = T.reinterpret("uint8x32", qs[row, T.ramp(P * 8, 1, 8)])
    halves = [packed & T.Broadcast(T.uint8(15), 32), packed >> T.Broadcast(T.uint8(4), 32)]
    # the element of byte l of half h: lane 16 h + l % 16 of block 2P + l // 16
    element = lambda h: lambda l: lane_element(l % 16 + 16 * h, qtype)   # noqa: E731
    if qtype == "q5_k":      # the fifth bit of element e is bit e of its block's qh word
        qh = _repeat(ks[row, T.ramp(ks_bit_word(qtype, 2 * P, 0), 1, 2)], 2, 4)
        halves = [u | _bit_lanes(qh, lambda l, h=h: l // 16 * 4 + element(h)(l) // 8,
                                 lambda l, h=h: element(h)(l) % 8, 16) for h, u in enumerate(halves)]
    elif qtype == "q6_k":    # bits 4-5 of element e: bits 2(e % 16), +1 of its block's h0 (e < 16) or h1
        h01 = _repeat(ks[row, T.ramp(ks_bit_word(qtype, 2 * P, 0), 1, 4)], 4, 2)
        halves = [u | _pair_q6_k_high_bits(h01, element(h), h) for h, u in enumerate(halves)]
    return [T.reinterpret("int8x32", u) for u in halves]


def _pair_q6_k_high_bits(h01, element, half):
    """uint8x32: the 2 high bits of each lane's element at bits 4-5, from h01 (uint32x8: h0, h1 of block 2P, then
    of 2P + 1, in both 128-bit halves) as quant_matmul_int8._q6_k_high_bits finds them: a byte shuffle, then a
    shift (the even elements of A lie at bits 0-1 or 4-5 of their bytes, the odd ones of B at 2-3 or 6-7) and two
    masks."""
    picked = T.reinterpret("uint32x8", _shuffle_bytes(
        h01, lambda l: l // 16 * 8 + element(l) // 16 * 4 + element(l) % 16 // 4))
    left, right = (4, 0) if half == 0 else (2, 2)
    return q6_k_fields_to_bits_4_5(picked, T.Broadcast(T.uint32(left), 8), T.Broadcast(T.uint32(right), 8))


def _pair_sub_scales(qtype, ks8, row, sb, p):
    """int16x16: the sub-scale of each 16-bit lane of _pair_quants' A and B (the same for both) for pair p of
    super-block sb: lanes 0-7 are block 2p's, 8-15 block 2p + 1's; q6_K's 16-element halves: int16 lane j of
    a block's half-vector covers its elements < 16 where j % 8 < 4."""
    first = _sub_scale_byte(qtype, sb, 0, 0)
    if qtype != "q6_k":      # 8 unsigned sub-scales (0-63), zero-extended into each lane's low byte
        table = T.reinterpret("uint8x32", _repeat(T.reinterpret("uint32x2", ks8[row, T.ramp(first, 1, 8)]), 2, 4))
        return T.reinterpret("int16x16", _shuffle_bytes(table, lambda l: l % 2 * 128 + (1 - l % 2) * (2 * p + l // 16)))
    # 16 signed sub-scales into each lane's high byte, then an arithmetic shift sign-extends them
    table = T.reinterpret("uint8x32", _repeat(T.reinterpret("uint32x4", ks8[row, T.ramp(first, 1, 16)]), 4, 2))
    high = _shuffle_bytes(table, lambda l: (1 - l % 2) * 128 + l % 2 * (2 * (2 * p + l // 16) + l % 16 // 8))
    return T.shift_right(T.reinterpret("int16x16", high), T.Broadcast(T.int16(8), 16))


@T.macro
def quantize_activation_superblock(x, src, valid, xq, xd, xo, t, sb, qtype, F, pairs=False):
    """Super-block sb of row `src` of x as int8 into row t of xq, each block in the lanes' element order
    (quant_matmul_int8), or with `pairs` in the GEMV's pair order (_pair_quants), with one scale d = max|x| / 127
    over its 256 values (ggml's quantize_row_q8_K) into xd[sb, t]; the quants' sums times d into xo[f, block, t],
    per block (F = 1) or per half (F = 2). Rows not `valid` (a GEMM tile's padding) come out zero."""
    lanes8 = T.decl_buffer((8,), "float32", scope="global")
    sums8 = T.decl_buffer((2, 8), "float32", scope="global")
    amax = T.decl_buffer((1,), "float32", scope="global")
    amax[0] = T.float32(0)
    if valid:
        lanes8[T.ramp(0, 1, 8)] = _abs_max8(x, src, sb * BLOCKS, qtype)
        for b in range(1, BLOCKS):
            lanes8[T.ramp(0, 1, 8)] = T.max(lanes8[T.ramp(0, 1, 8)], _abs_max8(x, src, sb * BLOCKS + b, qtype))
        amax[0] = lane_max(lanes8)
    d = T.decl_buffer((1,), "float32", scope="global")
    d[0] = amax[0] / T.float32(127)
    xd[sb, t] = d[0]
    inv = T.decl_buffer((1,), "float32", scope="global")
    inv[0] = T.Select(amax[0] > T.float32(0), T.float32(1) / d[0], T.float32(0))
    for b in range(BLOCKS):
        quants = T.meta_var(_quantized_block(x, src, sb * BLOCKS + b, qtype, inv[0]))
        if pairs:
            xq[t, T.ramp(_pair_offset(sb * BLOCKS + b, 0), 1, BLOCK // 2)] = T.Shuffle(
                [quants], list(range(BLOCK // 2)))
            xq[t, T.ramp(_pair_offset(sb * BLOCKS + b, 1), 1, BLOCK // 2)] = T.Shuffle(
                [quants], list(range(BLOCK // 2, BLOCK)))
        else:
            xq[t, T.ramp((sb * BLOCKS + b) * BLOCK, 1, BLOCK)] = quants
        sums8[0, T.ramp(0, 1, 8)] = _half_sum8(x, src, sb * BLOCKS + b, qtype, inv[0], 0)
        sums8[1, T.ramp(0, 1, 8)] = _half_sum8(x, src, sb * BLOCKS + b, qtype, inv[0], 1)
        if F == 2:
            xo[0, sb * BLOCKS + b, t] = lane_total(sums8, 0) * d[0]
            xo[1, sb * BLOCKS + b, t] = lane_total(sums8, 1) * d[0]
        else:
            xo[0, sb * BLOCKS + b, t] = (lane_total(sums8, 0) + lane_total(sums8, 1)) * d[0]


def _weight_buffers(qtype, N, K):
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    return qs_shape, qs_dtype, K // SUPER_BLOCK * KS_WORDS[qtype]


def make_gemm_q8k(qtype: str, N: int, K: int):
    """PrimFunc (x [n, K] f32, qs, ks, y [n, N] f32), n symbolic: the AVX2 prefill matmul of a K-quant.

    Every token's row is quantized per super-block (parallel over tokens) into a buffer padded to whole tiles of
    GEMM_TILE tokens. Each task takes a group of GROUP_ROWS rows and walks K in spans of SPAN super-blocks: it
    unpacks the span of its rows (quants in lane order, sub-scales as int16, offset multipliers as f32), then for
    every tile and row sums the span's blocks in int32 per super-block, converting once a super-block, and adds
    the span's products to y."""
    assert qtype in Q8K_TYPES, qtype
    NB, NS, W = K // BLOCK, K // SUPER_BLOCK, KS_WORDS[qtype]
    qs_shape, qs_dtype, KS = _weight_buffers(qtype, N, K)
    GR = min(GROUP_ROWS, N)
    GROUPS = (N + GR - 1) // GR
    SPAN = max(1, min(NS, SPAN_BYTES // (GR * SUPER_BLOCK)))    # super-blocks unpacked at a time
    SPANS = (NS + SPAN - 1) // SPAN
    F = _activation_sums(qtype)   # q6_K: one a 16-element half, which has its own sub-scale
    TT = GEMM_TILE
    n = token_count(None)
    tiles = (n + TT - 1) // TT

    @T.prim_func
    def quant_gemm_q8k(var_x: T.handle, qs: T.Buffer(qs_shape, qs_dtype), ks: T.Buffer((N, KS), "uint32"),
                       var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, K), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        ks8 = T.decl_buffer((N, KS * 4), "int8", data=ks.data)
        xq = T.decl_buffer((tiles * TT, K), "int8")
        xd = T.decl_buffer((NS, tiles * TT), "float32")
        xo = T.decl_buffer((F, NB, tiles * TT), "float32")       # activation sums x scale, token-minor
        for t in T.parallel(tiles * TT):
            for sb in range(NS):
                quantize_activation_superblock(x, T.min(t, n - 1), t < n, xq, xd, xo, t, sb, qtype, F)
        for g in T.parallel(GROUPS):
            w = T.decl_buffer((GR, SPAN * SUPER_BLOCK), "int8", scope="global")
            sc = T.decl_buffer((GR, SPAN * BLOCKS * 2), "int16", scope="global")
            om = T.decl_buffer((GR, SPAN * BLOCKS * F), "float32", scope="global")
            acc = T.decl_buffer((TT, 8), "float32", scope="global")
            dot = T.decl_buffer((TT, 8), "int32", scope="global")
            off = T.decl_buffer((TT,), "float32", scope="global")
            off_sb = T.decl_buffer((TT,), "float32", scope="global")
            for c in range(SPANS):
                unpack_span(qtype, qs, ks, ks8, w, sc, om, g * GR, T.min(GR, N - g * GR), c, SPAN, NS, F)
                for tt in range(tiles):
                    for r in range(T.min(GR, N - g * GR)):
                        span_tile_row(qtype, w, sc, om, ks, xq, xd, xo, acc, dot, off, off_sb, r, g * GR + r, tt, c,
                                      SPAN, NS, W, F, TT)
                        for t in T.unroll(TT):
                            if tt * TT + t < n:
                                y[tt * TT + t, g * GR + r] = T.Select(c == 0, T.float32(0), y[tt * TT + t, g * GR + r]) + (
                                    lane_total(acc, t) + off[t])

    return quant_gemm_q8k


def _offset_coefficient(qtype, ks, row, first_word):
    """What multiplies a super-block's sum of offset multipliers times activation sums: -dmin (q4_K, q5_K) or
    -32 d_super (q6_K)."""
    if qtype == "q6_k":
        return T.float32(-32) * ks_super_scale(qtype, ks, row, first_word)
    return -ks_super_min(ks, row, first_word)


@T.macro
def unpack_span(qtype, qs, ks, ks8, w, sc, om, first, rows, c, SPAN, NS, F):
    """Span c (SPAN super-blocks of K) of rows first .. first + rows into the GEMM's scratch: the quants in lane
    order into w, the sub-scales as int16 into sc, the offset multipliers as f32 into om."""
    for r in range(rows):
        for j in range(T.min(SPAN, NS - c * SPAN) * BLOCKS):
            w[r, T.ramp(j * BLOCK, 1, BLOCK)] = _unsigned_quants(qtype, qs, ks, first + r, c * SPAN * BLOCKS + j,
                                                                 True)
            for h in T.unroll(2):
                sc[r, j * 2 + h] = T.Cast("int16", ks8[first + r, _sub_scale_byte(
                    qtype, c * SPAN + j // BLOCKS, j % BLOCKS, h if qtype == "q6_k" else 0)])
            for f in T.unroll(F):
                om[r, j * F + f] = T.Cast("float32", ks8[first + r, _offset_byte(
                    qtype, c * SPAN + j // BLOCKS, j % BLOCKS, f)])


@T.macro
def span_tile_row(qtype, w, sc, om, ks, xq, xd, xo, acc, dot, off, off_sb, r, row, tt, c, SPAN, NS, W, F, TT):
    """Unpacked row r (the weights' row `row`) times tile tt's TT tokens over span c: the products into acc
    [TT, 8] (a token's 8 lanes, still to be summed), the offset terms into off [TT]; dot and off_sb hold a
    super-block's integer sums and offsets."""
    for t in T.unroll(TT):
        acc[t, T.ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
    off[T.ramp(0, 1, TT)] = T.Broadcast(T.float32(0), TT)
    for sbl in range(T.min(SPAN, NS - c * SPAN)):
        sb = T.meta_var(c * SPAN + sbl)
        for t in T.unroll(TT):
            dot[t, T.ramp(0, 1, 8)] = T.Broadcast(T.int32(0), 8)
        off_sb[T.ramp(0, 1, TT)] = T.Broadcast(T.float32(0), TT)
        for b in range(BLOCKS):
            j = T.meta_var(sbl * BLOCKS + b)
            for t in T.unroll(TT):
                dot[t, T.ramp(0, 1, 8)] = dot[t, T.ramp(0, 1, 8)] + _scaled_dot(
                    w[r, T.ramp(j * BLOCK, 1, BLOCK)],
                    xq[tt * TT + t, T.ramp((sb * BLOCKS + b) * BLOCK, 1, BLOCK)],
                    _lane_sub_scales(qtype, sc[r, j * 2], sc[r, j * 2 + 1]))
            for f in T.unroll(F):
                off_sb[T.ramp(0, 1, TT)] = off_sb[T.ramp(0, 1, TT)] + T.Broadcast(
                    om[r, j * F + f], TT) * xo[f, sb * BLOCKS + b, T.ramp(tt * TT, 1, TT)]
        d_super = T.meta_var(ks_super_scale(qtype, ks, row, sb * W))
        for t in T.unroll(TT):
            acc[t, T.ramp(0, 1, 8)] = acc[t, T.ramp(0, 1, 8)] + T.Cast(
                "float32x8", dot[t, T.ramp(0, 1, 8)]) * T.Broadcast(d_super * xd[sb, tt * TT + t], 8)
        off[T.ramp(0, 1, TT)] = off[T.ramp(0, 1, TT)] + T.Broadcast(
            _offset_coefficient(qtype, ks, row, sb * W), TT) * off_sb[T.ramp(0, 1, TT)]


def make_moe_gemm_q8k(qtype: str, E: int, N: int, K: int, k: int, per_slot: bool):
    """PrimFunc (x [n, K] (or [n, k, K] where per_slot), ids [n, k] int32, qs, ks of the experts' [E * N, K],
    y [n, k, N]), n symbolic: ops.MOE_MATMUL for a prompt on AVX2, make_gemm_q8k on each expert's tokens (sorted
    by expert as quant_matmul_int8.make_moe_gemm_int8 sorts them): a task unpacks a span of its group of each
    chosen expert's rows once, and that expert's tiles pass over it."""
    assert qtype in Q8K_TYPES, qtype
    NB, NS, W = K // BLOCK, K // SUPER_BLOCK, KS_WORDS[qtype]
    qs_shape, qs_dtype, KS = _weight_buffers(qtype, E * N, K)
    GR = min(GROUP_ROWS, N)
    GROUPS = (N + GR - 1) // GR
    SPAN = max(1, min(NS, SPAN_BYTES // (GR * SUPER_BLOCK)))
    SPANS = (NS + SPAN - 1) // SPAN
    F = _activation_sums(qtype)
    TT = GEMM_TILE
    R = k if per_slot else 1
    n = token_count(None)
    P = grouped_rows(n, k, E, TT)

    @T.prim_func
    def moe_gemm_q8k(var_x: T.handle, var_ids: T.handle, qs: T.Buffer(qs_shape, qs_dtype),
                     ks: T.Buffer((E * N, KS), "uint32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x_data = T.match_buffer(var_x, (n, R, K) if per_slot else (n, K), "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        y_data = T.match_buffer(var_y, (n, k, N), "float32")
        x = T.decl_buffer((n * R, K), "float32", data=x_data.data)
        y = T.decl_buffer((n * k, N), "float32", data=y_data.data)
        ks8 = T.decl_buffer((E * N, KS * 4), "int8", data=ks.data)
        bounds = T.decl_buffer((E + 1,), "int32")
        pair = T.decl_buffer((P,), "int32")
        fill = T.decl_buffer((E,), "int32")
        xq = T.decl_buffer((P, K), "int8")
        xd = T.decl_buffer((NS, P), "float32")
        xo = T.decl_buffer((F, NB, P), "float32")
        group_by_expert(ids, n, k, E, TT, bounds, pair, fill)
        for p in T.parallel(P):
            for sb in range(NS):
                quantize_activation_superblock(x, grouped_input_row(pair, p, k, R), pair[p] >= 0, xq, xd, xo, p,
                                               sb, qtype, F)
        for g in T.parallel(GROUPS):
            w = T.decl_buffer((GR, SPAN * SUPER_BLOCK), "int8", scope="global")
            sc = T.decl_buffer((GR, SPAN * BLOCKS * 2), "int16", scope="global")
            om = T.decl_buffer((GR, SPAN * BLOCKS * F), "float32", scope="global")
            acc = T.decl_buffer((TT, 8), "float32", scope="global")
            dot = T.decl_buffer((TT, 8), "int32", scope="global")
            off = T.decl_buffer((TT,), "float32", scope="global")
            off_sb = T.decl_buffer((TT,), "float32", scope="global")
            for e in range(E):
                if bounds[e + 1] > bounds[e]:
                    for c in range(SPANS):
                        unpack_span(qtype, qs, ks, ks8, w, sc, om, e * N + g * GR, T.min(GR, N - g * GR), c, SPAN,
                                    NS, F)
                        for tt in range(bounds[e] // TT, bounds[e + 1] // TT):
                            for r in range(T.min(GR, N - g * GR)):
                                span_tile_row(qtype, w, sc, om, ks, xq, xd, xo, acc, dot, off, off_sb, r,
                                              e * N + g * GR + r, tt, c, SPAN, NS, W, F, TT)
                                for t in T.unroll(TT):
                                    if pair[tt * TT + t] >= 0:
                                        y[pair[tt * TT + t], g * GR + r] = T.Select(
                                            c == 0, T.float32(0), y[pair[tt * TT + t], g * GR + r]) + (
                                                lane_total(acc, t) + off[t])

    return moe_gemm_q8k


def make_gemv_q8k(qtype: str, N: int, K: int, prefetch_bytes: int = PREFETCH_BYTES):
    """PrimFunc (x [1, K] f32, qs, ks, y [1, N] f32): the AVX2 decode matmul of a K-quant. The row x is
    quantized once per super-block; each task takes a chunk of output rows and per row and super-block sums the
    blocks' scaled dots in two int32 chains, converts once, and adds the offset term as 8 lanes (one a block;
    q6_K: two vectors, one per half). Weights are prefetched prefetch_bytes of quants ahead, with the same
    super-blocks' `ks`."""
    g = _GemvRowsQ8K(qtype, N, K, prefetch_bytes)
    NB, NS, F = g.NB, g.NS, g.F
    CHUNKS = min(TASKS, N)
    ROWS = (N + CHUNKS - 1) // CHUNKS

    @T.prim_func
    def quant_gemv_q8k(x: T.Buffer((1, K), "float32"), qs: T.Buffer(g.qs_shape, g.qs_dtype),
                       ks: T.Buffer((N, g.KS), "uint32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        xq = T.decl_buffer((1, K), "int8")
        xd = T.decl_buffer((NS, 1), "float32")
        xo = T.decl_buffer((F, NB, 1), "float32")
        xo_blocks = T.decl_buffer((F, NB), "float32", data=xo.data)
        for sb in range(NS):
            quantize_activation_superblock(x, 0, True, xq, xd, xo, 0, sb, qtype, F, True)
        for c in T.parallel(CHUNKS):
            acc = T.decl_buffer((8,), "float32", scope="global")
            off = T.decl_buffer((8,), "float32", scope="global")
            dot = T.decl_buffer((2, 8), "int32", scope="global")
            for i in range(T.min(ROWS, N - c * ROWS)):
                g.row_dot(qs, ks, xq, xd, xo_blocks, acc, off, dot, c * ROWS + i, y, (0, c * ROWS + i))

    return quant_gemv_q8k


def make_moe_gemv_q8k(qtype: str, E: int, N: int, K: int, k: int, per_slot: bool, tokens: int | None = None):
    """PrimFunc (x [n, K] (or [n, k, K] where per_slot), ids [n, k] int32, qs, ks of the experts' [E * N, K],
    y [n, k, N]): ops.MOE_MATMUL on AVX2 for a K-quant, make_gemv_q8k's rows over each token's k chosen experts
    only (as quant_matmul_int8.make_moe_gemv_int8: inputs quantized first, (token, slot, chunk) tasks, ids
    clamped into the experts)."""
    g = _GemvRowsQ8K(qtype, E * N, K, PREFETCH_BYTES)
    NB, NS, F = g.NB, g.NS, g.F
    CHUNKS = max(1, min(TASKS // k, N))
    ROWS = (N + CHUNKS - 1) // CHUNKS
    R = k if per_slot else 1
    n = token_count(tokens)

    @T.prim_func
    def moe_gemv_q8k(var_x: T.handle, var_ids: T.handle, qs: T.Buffer(g.qs_shape, g.qs_dtype),
                     ks: T.Buffer((E * N, g.KS), "uint32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x_data = T.match_buffer(var_x, (n, R, K) if per_slot else (n, K), "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        y = T.match_buffer(var_y, (n, k, N), "float32")
        x = T.decl_buffer((n * R, K), "float32", data=x_data.data)
        xq = T.decl_buffer((n * R, K), "int8")
        xd = T.decl_buffer((n * R, NS, 1), "float32")
        xo = T.decl_buffer((n * R, F, NB, 1), "float32")
        for r in T.parallel(n * R):
            xq_r = T.decl_buffer((1, K), "int8", data=xq.data, elem_offset=r * K)
            xd_r = T.decl_buffer((NS, 1), "float32", data=xd.data, elem_offset=r * NS)
            xo_r = T.decl_buffer((F, NB, 1), "float32", data=xo.data, elem_offset=r * F * NB)
            for sb in range(NS):
                quantize_activation_superblock(x, r, True, xq_r, xd_r, xo_r, 0, sb, qtype, F, True)
        for c in T.parallel(n * k * CHUNKS):
            t = T.meta_var(c // (k * CHUNKS))
            j = T.meta_var(c // CHUNKS % k)
            r = T.meta_var(t * R + (j if per_slot else 0))
            first = T.meta_var(T.max(0, T.min(ids[t, j], E - 1)) * N)     # the expert's first row, clamped
            xq_r = T.decl_buffer((1, K), "int8", data=xq.data, elem_offset=r * K)
            xd_r = T.decl_buffer((NS, 1), "float32", data=xd.data, elem_offset=r * NS)
            xo_r = T.decl_buffer((F, NB), "float32", data=xo.data, elem_offset=r * F * NB)
            acc = T.decl_buffer((8,), "float32", scope="global")
            off = T.decl_buffer((8,), "float32", scope="global")
            dot = T.decl_buffer((2, 8), "int32", scope="global")
            for i in range(T.min(ROWS, N - c % CHUNKS * ROWS)):
                g.row_dot(qs, ks, xq_r, xd_r, xo_r, acc, off, dot, first + c % CHUNKS * ROWS + i, y,
                          (t, j, c % CHUNKS * ROWS + i))

    return moe_gemv_q8k


class _GemvRowsQ8K:
    """The q8k decode GEMV's work for one output row of a matrix of N rows (make_gemv_q8k, make_moe_gemv_q8k)."""

    def __init__(self, qtype: str, N: int, K: int, prefetch_bytes: int):
        assert qtype in Q8K_TYPES, qtype
        self.NB, self.NS, W = K // BLOCK, K // SUPER_BLOCK, KS_WORDS[qtype]
        self.qs_shape, self.qs_dtype, self.KS = _weight_buffers(qtype, N, K)
        self.F = _activation_sums(qtype)
        NS, KS, qs_shape, qs_dtype = self.NS, self.KS, self.qs_shape, self.qs_dtype
        QS_SB = qs_shape[1] // NS                                  # u32 words of quants a super-block
        AHEAD = max(1, prefetch_bytes // (QS_SB * 4))              # super-blocks
        QS_LINES = (QS_SB * 4 + 63) // 64 if prefetch_bytes else 0
        KS_LINES = 2 if prefetch_bytes else 0                      # a super-block's first and last words of `ks`

        @T.macro
        def row_dot(qs, ks, xq, xd, xo_blocks, acc, off, dot, row, y, out):
            ks8 = T.decl_buffer((N, KS * 4), "int8", data=ks.data)
            qs_flat = T.decl_buffer((N * NS * QS_SB,), qs_dtype, data=qs.data)
            ks_flat = T.decl_buffer((N * KS,), "uint32", data=ks.data)
            acc[T.ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
            off[T.ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
            for sb in range(NS):
                ahead = T.meta_var(T.min(row * NS + sb + AHEAD, N * NS - 1))    # a super-block
                for line in T.unroll(QS_LINES):
                    prefetch(qs_flat, T.min(ahead * QS_SB + line * 16, N * NS * QS_SB - 1))
                for line in T.unroll(KS_LINES):
                    prefetch(ks_flat, ahead * W + line * (W - 1))
                for h in T.unroll(2):
                    dot[h, T.ramp(0, 1, 8)] = T.Broadcast(T.int32(0), 8)
                for p in T.unroll(BLOCKS // 2):     # the pair's lanes 0-15 into dot[0], 16-31 into dot[1]
                    quants = T.meta_var(_pair_quants(qtype, qs, ks, row, sb * BLOCKS // 2 + p))
                    scales = T.meta_var(_pair_sub_scales(qtype, ks8, row, sb, p))
                    dot[0, T.ramp(0, 1, 8)] = dot[0, T.ramp(0, 1, 8)] + _scaled_dot(
                        quants[0], xq[0, T.ramp(_pair_offset(sb * BLOCKS + 2 * p, 0), 1, BLOCK)], scales)
                    dot[1, T.ramp(0, 1, 8)] = dot[1, T.ramp(0, 1, 8)] + _scaled_dot(
                        quants[1], xq[0, T.ramp(_pair_offset(sb * BLOCKS + 2 * p, 1), 1, BLOCK)], scales)
                acc[T.ramp(0, 1, 8)] = acc[T.ramp(0, 1, 8)] + T.Cast(
                    "float32x8", dot[0, T.ramp(0, 1, 8)] + dot[1, T.ramp(0, 1, 8)]) * T.Broadcast(
                        ks_super_scale(qtype, ks, row, sb * W) * xd[sb, 0], 8)
                off[T.ramp(0, 1, 8)] = off[T.ramp(0, 1, 8)] + T.Broadcast(
                    _offset_coefficient(qtype, ks, row, sb * W), 8) * _block_offsets(qtype, ks8, xo_blocks, row, sb)
            y[out] = lane_total(acc) + lane_total(off)

        self.row_dot = row_dot


def _block_offsets(qtype, ks8, xo_blocks, row, sb):
    """float32x8: lane b holds block b's offset multipliers times its activation sums (q6_K: both halves')."""
    blocks = T.ramp(sb * BLOCKS, 1, BLOCKS)
    first = _offset_byte(qtype, sb, 0, 0)
    if qtype != "q6_k":
        return T.Cast("float32x8", ks8[row, T.ramp(first, 1, BLOCKS)]) * xo_blocks[0, blocks]
    return (T.Cast("float32x8", ks8[row, T.ramp(first, 2, BLOCKS)]) * xo_blocks[0, blocks]
            + T.Cast("float32x8", ks8[row, T.ramp(first + 1, 2, BLOCKS)]) * xo_blocks[1, blocks])
