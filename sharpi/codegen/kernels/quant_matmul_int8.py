"""Matmuls with integer dot products on x86 AVX2, as llama.cpp multiplies on CPUs: the decode GEMV (one token) and
the prefill GEMM (tiles of tokens).

The float kernels in quant_matmul.py dequantize every weight to f32 first: ~11 vector instructions per 8 weights for
q5_0, so the 4-6 bit GEMVs run compute-bound at 5-7 GB/s. Here each activation row is quantized once per call to
int8 in blocks of 32 (ggml's q8_0 rule: d = max|x| / 127, q = round(x / d)), and each block of 32 weights is
multiplied as 32 bytes: `vpmaddubsw` (u8 x i8 -> pairs summed to i16) and `vpmaddwd` against ones (-> 8 i32
lanes), then one convert and one FMA with the two blocks' scales. The weights stay in sharpi's layouts
(quant_layout.py); each type's quants are unpacked to unsigned bytes u, and its offset or minimum is applied once
per block through the block's activation sum:

    sum_e w_e x_e  ~=  dx * (d * sum_e u_e xq_e + (m - off * d) * sum_e xq_e)

Nibbles come out of the u32 words in the order (even elements, odd elements) - one AND and one shift per 16
bytes - so the activation block is quantized in that lane order too and no weight is shuffled. q8_0 is signed:
its bytes go through the sign trick (|w| as unsigned, x with w's sign), as llama.cpp's AVX2 path does.

Activation quantization costs accuracy llama.cpp also pays: the kernel tests hold it to an exact numpy emulation of
the same arithmetic, the model tests hold its log-probs to float32 recomputation within the conformance suite's
int8 tolerance.

On this project's 2-core znver3 the prefill GEMM is 1.1-1.5x the float kernel's speed (which shares each
dequantized block across 8 tokens too): both are bound by the multiply pipes, 4 float FMAs against maddubs, maddwd,
a scale multiply and an FMA per 32 multiply-adds per token; the integer form saves the float dequantize.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.quant_layout import BLOCK, LAYOUTS
from .quant_matmul import cpu_quants, token_count

INT8_DOT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
_ZERO = {"q4_0": 8, "q5_0": 16, "q6_k": 32}     # the quant value meaning zero (w = (u - zero) * d)
_HAS_MIN = ("q4_1", "q4_k", "q5_1", "q5_k")
_QH_FIELD = {"q5_0": 1, "q5_1": 2, "q5_k": 2}   # the scale field holding the 32 fifth bits


def lane_element(lane, qtype: str):
    """The element of a 32-block that byte lane `lane` holds once unpacked (the activations use the same order);
    an int or a TIR expression."""
    if qtype == "q8_0":
        return lane
    return 2 * (lane % 16) + lane // 16


def element_lane(e, qtype: str):
    if qtype == "q8_0":
        return e
    return (e % 2) * 16 + e // 2


def _byte_vector(values) -> "T.Expr":
    """uint8x32 constant from a per-lane int32 expression of the lane index (LLVM folds it to one constant)."""
    return T.Cast("uint8x32", values(T.ramp(0, 1, 32)))


def _intrin(dtype, name, *args):
    return T.call_llvm_pure_intrin(dtype, name, *args)


def _bit_lanes(words, byte_of, bit_of, value):
    """uint8x32: `value` in lane l where bit bit_of(l) of byte byte_of(l) of `words` is set, else 0; `words` is
    a uint32x8 whose bytes repeat within each 16-byte half. llama.cpp's bytes_from_bits_32: vpshufb picks each
    lane's byte, OR-ing every other bit in and comparing with 0xFF tests the one bit (4 instructions for 32 lanes,
    where per-lane variable shifts of u32 vectors and packing back to bytes took 15)."""
    picked = T.reinterpret("uint8x32", _intrin("int8x32", "llvm.x86.avx2.pshuf.b", T.reinterpret("int8x32", words),
                                               T.reinterpret("int8x32", _byte_vector(byte_of))))
    others = _byte_vector(lambda l: 255 - T.shift_left(T.Broadcast(1, 32), bit_of(l)))
    return T.Select((picked | others) == T.Broadcast(T.uint8(255), 32), T.Broadcast(T.uint8(value), 32),
                    T.Broadcast(T.uint8(0), 32))


def _unsigned_quants(qtype, qs, s, row, b):
    """The block's quants as unsigned bytes (int8x32 bits), in lane order."""
    if qtype == "q8_0":
        w = qs[row, T.ramp(b * BLOCK, 1, BLOCK)]
        return _intrin("int8x32", "llvm.x86.avx2.psign.b", w, w)    # |w| (-128 stays 0x80 = 128 unsigned)
    packed = T.reinterpret("uint8x16", qs[row, T.ramp(b * 4, 1, 4)])
    u = T.Shuffle([packed & T.Broadcast(T.uint8(15), 16), packed >> T.Broadcast(T.uint8(4), 16)], list(range(32)))
    element = lambda l: lane_element(l, qtype)   # noqa: E731
    if qtype in _QH_FIELD:   # the fifth bit of element e is bit e of qh
        qh = T.Broadcast(T.reinterpret("uint32", s[_QH_FIELD[qtype], row, b]), 8)
        u = u | _bit_lanes(qh, lambda l: element(l) // 8, lambda l: element(l) % 8, 16)
    elif qtype == "q6_k":   # bits 4-5 of element e: bits 2(e%16), +1 of h0 (e < 16) or h1; h0 in bytes 0-3, h1 4-7
        h01 = T.Shuffle([T.Broadcast(T.reinterpret("uint32", s[2, row, b]), 4),
                         T.Broadcast(T.reinterpret("uint32", s[3, row, b]), 4)], [0, 4, 0, 4, 0, 4, 0, 4])
        byte = lambda l: (element(l) // 16) * 4 + (element(l) % 16) // 4   # noqa: E731
        bit = lambda l: (element(l) % 4) * 2   # noqa: E731
        u = u | _bit_lanes(h01, byte, bit, 16) | _bit_lanes(h01, byte, lambda l: bit(l) + 1, 32)
    return T.reinterpret("int8x32", u)


def _signed_activations(qtype, qs, xq, row, b):
    x = xq[T.ramp(b * BLOCK, 1, BLOCK)]
    if qtype == "q8_0":
        return _intrin("int8x32", "llvm.x86.avx2.psign.b", x, qs[row, T.ramp(b * BLOCK, 1, BLOCK)])
    return x


def _block_dot(qtype, qs, s, xq, row, b):
    """int32x8: partial sums of u_e * xq_e, lane i over the block's bytes 4i..4i+3."""
    pairs = _intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", _unsigned_quants(qtype, qs, s, row, b),
                    _signed_activations(qtype, qs, xq, row, b))
    return _intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, T.Broadcast(T.int16(1), 16))


def _lane_scales(qtype, s, row, b):
    """float32x8: the weight scale of each int32 lane of _block_dot."""
    if qtype != "q6_k":
        return T.Broadcast(s[0, row, b], 8)
    # lanes 0,1 and 4,5 hold elements < 16 (scale d0), lanes 2,3 and 6,7 the rest (d1)
    first = (T.ramp(0, 1, 8) // 2) % 2 == T.Broadcast(0, 8)
    return T.Select(first, T.Broadcast(s[0, row, b], 8), T.Broadcast(s[1, row, b], 8))


def _offset_term(qtype, s, xs, row, b):
    """Scalar: what the offset or minimum adds to the block's dot, before the activation scale."""
    if qtype in _HAS_MIN:
        return s[1, row, b] * (xs[0, b] + xs[1, b])
    if qtype == "q6_k":
        return T.float32(-32) * (s[0, row, b] * xs[0, b] + s[1, row, b] * xs[1, b])
    if qtype in _ZERO:
        return T.float32(-_ZERO[qtype]) * s[0, row, b] * (xs[0, b] + xs[1, b])
    return T.float32(0)   # q8_0


TASKS = 64   # parallel tasks per GEMV: enough to balance two to a few dozen threads; a task per row would
             # allocate its accumulators per row


def make_gemv_int8(qtype: str, N: int, K: int):
    """PrimFunc (x [1, K] f32, *weight parts as the CPU kernels take them, y [1, N] f32)."""
    assert qtype in INT8_DOT_TYPES, qtype
    NB = K // BLOCK
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    S = LAYOUTS[qtype][1][2](N, K)[0]
    CHUNKS = min(TASKS, N)
    ROWS = (N + CHUNKS - 1) // CHUNKS   # the last chunk may be short
    A = 4 if NB % 4 == 0 else 2 if NB % 2 == 0 else 1   # independent accumulator chains (FMA latency)
    has_offset = qtype != "q8_0"

    @T.prim_func
    def quant_gemv_int8(x: T.Buffer((1, K), "float32"), qs: T.Buffer(qs_shape, qs_dtype),
                        s: T.Buffer((S, N, NB), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        xq = T.decl_buffer((K,), "int8")
        xd = T.decl_buffer((NB,), "float32")
        xs = T.decl_buffer((2, NB), "float32")
        for b in range(NB):   # quantize the activations (serial: K values, well under a microsecond)
            amax = T.decl_buffer((1,), "float32", scope="local")
            amax[0] = T.float32(0)
            for e in range(BLOCK):
                amax[0] = T.max(amax[0], T.abs(x[0, b * BLOCK + e]))
            xd[b] = amax[0] / T.float32(127)
            inv = T.decl_buffer((1,), "float32", scope="local")
            inv[0] = T.Select(amax[0] > T.float32(0), T.float32(1) / xd[b], T.float32(0))
            for l in T.unroll(BLOCK):
                xq[b * BLOCK + l] = T.Cast("int8", T.round(x[0, b * BLOCK + lane_element(l, qtype)] * inv[0]))
            for h in T.unroll(2):
                tot = T.decl_buffer((1,), "int32", scope="local")
                tot[0] = 0
                for e in T.unroll(16):
                    tot[0] = tot[0] + T.Cast("int32", xq[b * BLOCK + element_lane(h * 16 + e, qtype)])
                xs[h, b] = T.Cast("float32", tot[0])
        for c in T.parallel(CHUNKS):
            # one task per chunk of rows, not per row: the accumulators are allocated once per task
            acc = T.decl_buffer((A, 8), "float32", scope="local")
            off = T.decl_buffer((A,), "float32", scope="local")
            for i in range(T.min(ROWS, N - c * ROWS)):
                for a in T.unroll(A):
                    acc[a, T.ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
                    off[a] = T.float32(0)
                for bb in range(NB // A):
                    for a in T.unroll(A):
                        acc[a, T.ramp(0, 1, 8)] = acc[a, T.ramp(0, 1, 8)] + T.Cast("float32x8", _block_dot(
                            qtype, qs, s, xq, c * ROWS + i, bb * A + a)) * (
                                _lane_scales(qtype, s, c * ROWS + i, bb * A + a) * T.Broadcast(xd[bb * A + a], 8))
                        if has_offset:
                            off[a] = off[a] + _offset_term(qtype, s, xs, c * ROWS + i, bb * A + a) * xd[bb * A + a]
                for a in T.unroll(1, A):
                    acc[0, T.ramp(0, 1, 8)] = acc[0, T.ramp(0, 1, 8)] + acc[a, T.ramp(0, 1, 8)]
                    off[0] = off[0] + off[a]
                y[0, c * ROWS + i] = (((acc[0, 0] + acc[0, 1]) + (acc[0, 2] + acc[0, 3]))
                                      + ((acc[0, 4] + acc[0, 5]) + (acc[0, 6] + acc[0, 7])) + off[0])

    return quant_gemv_int8


GEMM_TILE = 8   # tokens per tile: 8 float accumulators + the block's unpacked quants stay in the 16 AVX2 registers


def _offset_sums(qtype) -> int:
    """How many activation sums per block the GEMM keeps for the offset term: one per half-block for q6_k (its
    halves have their own scales), else one for the block."""
    return 2 if qtype == "q6_k" else 1


def _tile_offset(qtype, s, xo, row, b, t0, TT):
    """float32 x TT: what block b's offset or minimum adds to row `row` for tokens t0.. t0 + TT (_offset_term, with
    the activation sums x scales xo stored token-minor)."""
    sums = lambda f: xo[f, b, T.ramp(t0, 1, TT)]   # noqa: E731
    if qtype in _HAS_MIN:
        return T.Broadcast(s[1, row, b], TT) * sums(0)
    if qtype == "q6_k":
        return T.Broadcast(T.float32(-32) * s[0, row, b], TT) * sums(0) + \
            T.Broadcast(T.float32(-32) * s[1, row, b], TT) * sums(1)
    return T.Broadcast(T.float32(-_ZERO[qtype]) * s[0, row, b], TT) * sums(0)


def make_gemm_int8(qtype: str, N: int, K: int):
    """PrimFunc (x [n, K] f32, *weight parts, y [n, N] f32), n symbolic: the prefill matmul on int8 activations.

    Every token's row is quantized once (parallel over tokens) into a buffer padded to whole tiles of GEMM_TILE
    tokens (padding rows are zeros, so the inner loop needs no guard). Then each task takes a chunk of output rows;
    per tile, per row, per block, the 32 quants are unpacked once into a register and multiplied with the tile's
    8 activation blocks. The offsets go 8 tokens at a time: the activation sums (times the activation scale) are
    stored token-minor, so one FMA per block adds a row's offset term to the whole tile."""
    assert qtype in INT8_DOT_TYPES, qtype
    NB = K // BLOCK
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    S = LAYOUTS[qtype][1][2](N, K)[0]
    TT = GEMM_TILE
    CHUNKS = min(TASKS, N)
    ROWS = (N + CHUNKS - 1) // CHUNKS
    F = _offset_sums(qtype)
    has_offset = qtype != "q8_0"
    n = token_count(None)
    tiles = (n + TT - 1) // TT

    @T.prim_func
    def quant_gemm_int8(var_x: T.handle, qs: T.Buffer(qs_shape, qs_dtype), s: T.Buffer((S, N, NB), "float32"),
                        var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, K), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        xq = T.decl_buffer((tiles * TT, K), "int8")
        xd8 = T.decl_buffer((NB, tiles * TT, 8), "float32")    # each scale in 8 lanes: one vmulps from memory
        xo = T.decl_buffer((F, NB, tiles * TT), "float32")     # activation sums x scale, token-minor
        for t in T.parallel(tiles * TT):
            for b in range(NB):
                amax = T.decl_buffer((1,), "float32", scope="local")
                amax[0] = T.float32(0)
                if t < n:
                    for e in range(BLOCK):
                        amax[0] = T.max(amax[0], T.abs(x[t, b * BLOCK + e]))
                d = T.decl_buffer((1,), "float32", scope="local")
                d[0] = amax[0] / T.float32(127)
                xd8[b, t, T.ramp(0, 1, 8)] = T.Broadcast(d[0], 8)
                inv = T.decl_buffer((1,), "float32", scope="local")
                inv[0] = T.Select(amax[0] > T.float32(0), T.float32(1) / d[0], T.float32(0))
                for l in T.unroll(BLOCK):
                    xq[t, b * BLOCK + l] = T.Cast("int8", T.round(
                        x[T.min(t, n - 1), b * BLOCK + lane_element(l, qtype)] * inv[0]))
                for h in T.unroll(2):
                    tot = T.decl_buffer((1,), "int32", scope="local")
                    tot[0] = 0
                    for e in T.unroll(16):
                        tot[0] = tot[0] + T.Cast("int32", xq[t, b * BLOCK + element_lane(h * 16 + e, qtype)])
                    if F == 2:
                        xo[h, b, t] = T.Cast("float32", tot[0]) * d[0]
                    elif h == 0:
                        xo[0, b, t] = T.Cast("float32", tot[0]) * d[0]
                    else:
                        xo[0, b, t] = xo[0, b, t] + T.Cast("float32", tot[0]) * d[0]
        for c in T.parallel(CHUNKS):
            acc = T.decl_buffer((TT, 8), "float32", scope="local")
            off = T.decl_buffer((TT,), "float32", scope="local")
            u = T.decl_buffer((BLOCK,), "int8", scope="local")
            for tt in range(tiles):
                for i in range(T.min(ROWS, N - c * ROWS)):
                    row = c * ROWS + i
                    for t in T.unroll(TT):
                        acc[t, T.ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
                    off[T.ramp(0, 1, TT)] = T.Broadcast(T.float32(0), TT)
                    for b in range(NB):
                        u[T.ramp(0, 1, BLOCK)] = _unsigned_quants(qtype, qs, s, row, b)
                        for t in T.unroll(TT):
                            acc[t, T.ramp(0, 1, 8)] = acc[t, T.ramp(0, 1, 8)] + T.Cast("float32x8", _tile_dot(
                                qtype, qs, u, xq, tt * TT + t, row, b)) * (
                                    _lane_scales(qtype, s, row, b) * xd8[b, tt * TT + t, T.ramp(0, 1, 8)])
                        if has_offset:
                            off[T.ramp(0, 1, TT)] = off[T.ramp(0, 1, TT)] + _tile_offset(qtype, s, xo, row, b,
                                                                                         tt * TT, TT)
                    for t in T.unroll(TT):
                        if tt * TT + t < n:
                            y[tt * TT + t, row] = (((acc[t, 0] + acc[t, 1]) + (acc[t, 2] + acc[t, 3]))
                                                   + ((acc[t, 4] + acc[t, 5]) + (acc[t, 6] + acc[t, 7])) + off[t])

    return quant_gemm_int8


def _tile_dot(qtype, qs, u, xq, t, row, b):
    """int32x8: _block_dot for token t of the tile, the block's unsigned quants already in `u`."""
    x = xq[t, T.ramp(b * BLOCK, 1, BLOCK)]
    if qtype == "q8_0":
        x = _intrin("int8x32", "llvm.x86.avx2.psign.b", x, qs[row, T.ramp(b * BLOCK, 1, BLOCK)])
    pairs = _intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u[T.ramp(0, 1, BLOCK)], x)
    return _intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, T.Broadcast(T.int16(1), 16))
