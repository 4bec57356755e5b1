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
from .lanes import lane_max, lane_total
from .common import prefetch, token_count
from .moe import group_by_expert, grouped_input_row, grouped_rows
from .quant_matmul import cpu_quants, ks_bit_word

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


def _bit_word(qtype, s, row, b, i, from_ks):
    """Word i of block b's bit fields (q5's fifth bits; q6_k's h0, h1): from the `s` planes after the scales, or,
    from_ks, from the K-quant's `ks` part (then `s` is that part)."""
    if from_ks:
        return s[row, ks_bit_word(qtype, b, i)]
    return T.reinterpret("uint32", s[_QH_FIELD.get(qtype, 2 + i), row, b])


def _unsigned_quants(qtype, qs, s, row, b, from_ks=False):
    """The block's quants as unsigned bytes (int8x32 bits), in lane order; their bit fields from `s` (or, from_ks,
    from `ks` passed as `s`: _bit_word)."""
    if qtype == "q8_0":
        w = qs[row, T.ramp(b * BLOCK, 1, BLOCK)]
        return _intrin("int8x32", "llvm.x86.avx2.psign.b", w, w)    # |w| (-128 stays 0x80 = 128 unsigned)
    packed = T.reinterpret("uint8x16", qs[row, T.ramp(b * 4, 1, 4)])
    u = T.Shuffle([packed & T.Broadcast(T.uint8(15), 16), packed >> T.Broadcast(T.uint8(4), 16)], list(range(32)))
    element = lambda l: lane_element(l, qtype)   # noqa: E731
    if qtype in _QH_FIELD:   # the fifth bit of element e is bit e of qh
        qh = T.Broadcast(_bit_word(qtype, s, row, b, 0, from_ks), 8)
        u = u | _bit_lanes(qh, lambda l: element(l) // 8, lambda l: element(l) % 8, 16)
    elif qtype == "q6_k":   # bits 4-5 of element e: bits 2(e%16), +1 of h0 (e < 16) or h1; h0 in bytes 0-3, h1 4-7
        h01 = T.Shuffle([T.Broadcast(_bit_word(qtype, s, row, b, 0, from_ks), 4),
                         T.Broadcast(_bit_word(qtype, s, row, b, 1, from_ks), 4)], [0, 4, 0, 4, 0, 4, 0, 4])
        u = u | _q6_k_high_bits(h01)
    return T.reinterpret("int8x32", u)


def _q6_k_high_bits(h01):
    """uint8x32: each lane's element's 2 high bits at bits 4-5 (16 * hi), from h01 (uint32x8: h0, h1 repeated).
    vpshufb gives lane l the byte of h0 or h1 holding its element's field: at bits 0-1 or 4-5 of that byte for the
    even elements (lanes 0-15: even bytes of a word, odd bytes), at bits 2-3 or 6-7 for the odd ones (lanes 16-31).
    One variable left shift per 32-bit lane (4, or 2 for the odd elements) moves the even bytes' fields to bits 4-5,
    one right shift (0, or 2) the odd bytes'; two masks and an OR join them (6 instructions where testing each bit
    of the 32 lanes took 14)."""
    byte = lambda l: (lane_element(l, "q6_k") // 16) * 4 + (lane_element(l, "q6_k") % 16) // 4   # noqa: E731
    picked = T.reinterpret("uint32x8", _intrin("int8x32", "llvm.x86.avx2.pshuf.b", T.reinterpret("int8x32", h01),
                                               T.reinterpret("int8x32", _byte_vector(byte))))
    odd_elements = T.ramp(0, 1, 8) >= T.Broadcast(4, 8)
    left = T.Cast("uint32x8", T.Select(odd_elements, T.Broadcast(2, 8), T.Broadcast(4, 8)))
    right = T.Cast("uint32x8", T.Select(odd_elements, T.Broadcast(2, 8), T.Broadcast(0, 8)))
    return q6_k_fields_to_bits_4_5(picked, left, right)


def q6_k_fields_to_bits_4_5(picked, left, right):
    """uint8x32: the 2-bit fields of `picked` (uint32x8) moved to bits 4-5 of their bytes: the even bytes' by a
    left shift of `left`, the odd bytes' by a right shift of `right` (uint32x8 each), then masked and joined."""
    even_bytes, odd_bytes = T.Broadcast(T.uint32(0x00300030), 8), T.Broadcast(T.uint32(0x30003000), 8)
    return T.reinterpret("uint8x32", (T.shift_left(picked, left) & even_bytes)
                         | (T.shift_right(picked, right) & odd_bytes))


ISAS = ("avx2", "avx-vnni", "avx512-vnni")   # the GEMV's; the GEMM here takes the first two (AVX-512 VNNI's is
                                            # quant_matmul_vnni512.py's)


def unsigned_dot(u, x, lanes: int, isa: str):
    """int32 x lanes: sums of 4 adjacent products u_j * x_j (u unsigned bytes, x signed; both int8 x 4 lanes).
    VNNI's vpdpbusd does it in one instruction; AVX2 takes vpmaddubsw (pairs to i16) and vpmaddwd against ones.
    Both are exact here: a pair sum is at most 2 * 128 * 127 < 2^15 (no i16 saturation)."""
    if isa == "avx2":
        pairs = _intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u, x)
        return _intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pairs, T.Broadcast(T.int16(1), 16))
    name = "llvm.x86.avx512.vpdpbusd.256" if lanes == 8 else "llvm.x86.avx512.vpdpbusd.512"   # AVX-VNNI's too
    return _intrin(f"int32x{lanes}", name, T.Broadcast(T.int32(0), lanes), u, x)


def _block_dot(qtype, qs, u, xq, t, row, b, isa):
    """int32x8: partial sums of u_e * xq_e for token t's activation block, lane i over the block's bytes 4i..4i+3;
    `u` is the block's unsigned quants (an int8x32 expression: unpacked here or loaded from a register buffer)."""
    x = xq[t, T.ramp(b * BLOCK, 1, BLOCK)]
    if qtype == "q8_0":   # x takes w's sign, as |w| did
        x = _intrin("int8x32", "llvm.x86.avx2.psign.b", x, qs[row, T.ramp(b * BLOCK, 1, BLOCK)])
    return unsigned_dot(u, x, 8, isa)


def _lane_scales(qtype, s, row, b):
    """float32x8: the weight scale of each int32 lane of _block_dot."""
    if qtype != "q6_k":
        return T.Broadcast(s[0, row, b], 8)
    # lanes 0,1 and 4,5 hold elements < 16 (scale d0), lanes 2,3 and 6,7 the rest (d1)
    first = (T.ramp(0, 1, 8) // 2) % 2 == T.Broadcast(0, 8)
    return T.Select(first, T.Broadcast(s[0, row, b], 8), T.Broadcast(s[1, row, b], 8))


def _offset_fields(qtype) -> tuple[tuple[int, ...], float]:
    """What a block's offset or minimum adds to its dot product, before the activation scale dx:
    coefficient * sum_f s[field_f] * xsum_f, where xsum_f is the activation sum of the block (one field) or of
    its half f (q6_k, whose halves have their own scales). Returns (fields, coefficient); q8_0 has none."""
    if qtype in _HAS_MIN:
        return (1,), 1.0
    if qtype == "q6_k":
        return (0, 1), -32.0
    if qtype in _ZERO:
        return (0,), -float(_ZERO[qtype])
    return (), 0.0


def _activation_sums(qtype) -> int:
    """How many activation sums per block the kernels keep for the offset term (at least one buffer row)."""
    return max(1, len(_offset_fields(qtype)[0]))


def _lane_chunks(qtype):
    """The activation block in lane order as four float32x8 loads: (first element, stride, half) of lanes 8k ..
    8k + 7 (lane_element: even elements then odd ones, or q8_0's natural order)."""
    if qtype == "q8_0":
        return [(0, 1, 0), (8, 1, 0), (16, 1, 1), (24, 1, 1)]
    return [(0, 2, 0), (16, 2, 1), (1, 2, 0), (17, 2, 1)]


def _chunk(x, src, b, first, stride):
    return x[src, T.ramp(b * BLOCK + first, stride, 8)]


def _abs_max8(x, src, b, qtype):
    """float32x8: lane-wise max of |x| over the block's four chunks."""
    m = [T.abs(_chunk(x, src, b, first, stride)) for first, stride, _ in _lane_chunks(qtype)]
    return T.max(T.max(m[0], m[1]), T.max(m[2], m[3]))


def _rounded(x, src, b, first, stride, inv):
    return T.round(_chunk(x, src, b, first, stride) * T.Broadcast(inv, 8))


def _quantized_block(x, src, b, qtype, inv):
    """int8x32: the block's quants in lane order."""
    chunks = [_rounded(x, src, b, first, stride, inv) for first, stride, _ in _lane_chunks(qtype)]
    return T.Cast("int8x32", T.Shuffle(chunks, list(range(BLOCK))))


def _half_sum8(x, src, b, qtype, inv, half):
    """float32x8 whose lanes add up to the sum of the quants of elements 16 * half .. 16 * half + 15."""
    first_a, first_b = [(first, stride) for first, stride, h in _lane_chunks(qtype) if h == half]
    return _rounded(x, src, b, *first_a, inv) + _rounded(x, src, b, *first_b, inv)


# The order in which the AMX GEMM (quant_matmul_amx) keeps a block's 8 groups of 4 lanes, in its weights and its
# activations alike: the groups of elements 0-15 first (lane_element puts them in groups 0, 1, 4 and 5), so that
# q6_k's two 16-element halves, which have scales of their own, are each one contiguous tile of 16 bytes a row.
# It is its own inverse: position j holds group AMX_GROUPS[j], and group g lies at position AMX_GROUPS[g].
AMX_GROUPS = [0, 1, 4, 5, 2, 3, 6, 7]


@T.macro
def quantize_activation_block(x, src, valid, xq, xd8, xo, t, b, qtype, F, layout="rows"):
    """Block b of row `src` of x as int8 into row t of xq, in the lanes' element order (ggml's quantize_row_q8_0:
    d = max|x| / 127, q = round(x / d), halves to even); d in the 8 lanes of xd8[b, t] (one vmulps from memory);
    the activation sums times d into xo[f, b, t], per half (F = 2) or per block (F = 1). Rows not `valid`
    (a GEMM tile's padding) come out zero. Vectorized in float32x8 chunks: the scalar form was ~0.1 us a block,
    serial before every decode matmul's parallel loop.

    `layout` "pairs" (the 512-bit GEMM's, quant_matmul_vnni512): xq is an int32 view, and the blocks of a pair
    alternate in it every 4 bytes (block 2p's group g at int32 16p + 2g, block 2p + 1's at 16p + 2g + 1); d goes
    to xd8[b, t] once. "tiles" (quant_matmul_amx's): xq is flat int32, a tile of 16 tokens' block b as 8 rows of
    16 tokens' groups (an AMX B tile), the groups in AMX_GROUPS' order; d to xd8[b, t] once."""
    lanes8 = T.decl_buffer((8,), "float32", scope="global")
    sums8 = T.decl_buffer((2, 8), "float32", scope="global")
    amax = T.decl_buffer((1,), "float32", scope="global")
    amax[0] = T.float32(0)
    if valid:
        lanes8[T.ramp(0, 1, 8)] = _abs_max8(x, src, b, qtype)
        amax[0] = lane_max(lanes8)
    d = T.decl_buffer((1,), "float32", scope="global")
    d[0] = amax[0] / T.float32(127)
    if layout != "rows":
        xd8[b, t] = d[0]
    else:
        xd8[b, t, T.ramp(0, 1, 8)] = T.Broadcast(d[0], 8)
    inv = T.decl_buffer((1,), "float32", scope="global")
    inv[0] = T.Select(amax[0] > T.float32(0), T.float32(1) / d[0], T.float32(0))
    if layout == "pairs":
        xq[t, T.ramp((b // 2) * 16 + b % 2, 2, 8)] = T.reinterpret("int32x8", _quantized_block(x, src, b, qtype,
                                                                                              inv[0]))
    elif layout == "tiles":
        xq[T.ramp(((t // 16) * xd8.shape[0] + b) * 128 + t % 16, 16, 8)] = T.Shuffle(
            [T.reinterpret("int32x8", _quantized_block(x, src, b, qtype, inv[0]))], AMX_GROUPS)
    else:
        xq[t, T.ramp(b * BLOCK, 1, BLOCK)] = _quantized_block(x, src, b, qtype, inv[0])
    sums8[0, T.ramp(0, 1, 8)] = _half_sum8(x, src, b, qtype, inv[0], 0)
    sums8[1, T.ramp(0, 1, 8)] = _half_sum8(x, src, b, qtype, inv[0], 1)
    xo[0, b, t] = lane_total(sums8, 0) * d[0]
    if F == 2:
        xo[1, b, t] = lane_total(sums8, 1) * d[0]
    else:
        # each half scaled, then added (not (sum0 + sum1) * d): one rounding fewer would be as good, but the int8
        # path amplifies any 1-ulp change (see tests/test_int8_matmuls.py) and this keeps prefill's results
        # those of the evaluations already committed
        xo[0, b, t] = xo[0, b, t] + lane_total(sums8, 1) * d[0]


def _span(start, lanes):
    return start if lanes == 1 else T.ramp(start, 1, lanes)


TASKS = 64   # parallel tasks per GEMV and GEMM: enough to balance two to a few dozen threads, few enough that a
             # task's setup (its accumulators, the parallel loop's bookkeeping) does not count


def _wide_offset(qtype) -> tuple[tuple[int, ...], float]:
    """_offset_fields for the 512-bit kernels: q8_0's bytes are offset there (w + 128; AVX-512 has no vpsignb),
    so it has an offset term of its own: -128 d times the activation sum."""
    return ((0,), -128.0) if qtype == "q8_0" else _offset_fields(qtype)


PAIR_ORDER = list(range(16))   # a pair's int32 lanes: block 2p's 8, then block 2p + 1's (the 512-bit GEMV's)


def pair_quants(qtype, qs, s, row, p, order=PAIR_ORDER):
    """int8x64: blocks 2p and 2p + 1 as unsigned bytes, each in its lane order, their 16 groups of 4 bytes
    placed by `order` (int32 lane i takes group order[i] of the two blocks' 16)."""
    if qtype == "q8_0":
        words = T.reinterpret("int32x16", qs[row, T.ramp(p * 2 * BLOCK, 1, 2 * BLOCK)])
        return T.reinterpret("int8x64", T.Shuffle([words], order)) ^ T.Broadcast(T.int8(-128), 2 * BLOCK)
    first, second = (T.reinterpret("int32x8", _unsigned_quants(qtype, qs, s, row, 2 * p + h)) for h in (0, 1))
    return T.reinterpret("int8x64", T.Shuffle([first, second], order))


def pair_scales(qtype, s, row, p, order=PAIR_ORDER):
    """float32x16: the weight scale of each int32 lane of pair_quants(..., order)'s dot."""
    return T.Shuffle([_lane_scales(qtype, s, row, 2 * p), _lane_scales(qtype, s, row, 2 * p + 1)], order)


def _unit_term(qtype, qs, s, xq, xd, row, j, isa):
    """float32 x lanes: unit j's products for the GEMV, scaled: a block (8 lanes) on AVX2 and AVX-VNNI, a pair of
    blocks (16 lanes: block 2j's sums in 0-7, 2j + 1's in 8-15) on AVX-512 VNNI."""
    if isa != "avx512-vnni":
        return T.Cast("float32x8", _block_dot(qtype, qs, _unsigned_quants(qtype, qs, s, row, j), xq, 0, row, j,
                                              isa)) * (_lane_scales(qtype, s, row, j) * xd[j, T.ramp(0, 1, 8)])
    dot = unsigned_dot(pair_quants(qtype, qs, s, row, j), xq[0, T.ramp(j * 2 * BLOCK, 1, 2 * BLOCK)], 16, isa)
    return T.Cast("float32x16", dot) * (pair_scales(qtype, s, row, j) * xd[j, T.ramp(0, 1, 16)])


# How far ahead of its reads the GEMV asks for its weights (llvm.prefetch: prefetcht0). The hardware prefetchers
# alone left the decode GEMVs streaming at 55-70% of the read bandwidth (a task's several streams, quants and scale
# planes, each restarting at every row); 2 KB ahead of the quants and the same blocks' scales, Q4_K and Q6_K GEMVs of
# a 1.5B model's shapes stream at 24-27 GB/s where they took 15-19, on the Intel Xeon of 2026-12-03 (read 28 GB/s;
# benchmarks/cpu.md). The requests run past a row's end into the next rows, as the task reads on; the last row's
# are clamped to the buffer.
PREFETCH_BYTES = 2048


def make_gemv_int8(qtype: str, N: int, K: int, isa: str = "avx2", prefetch_bytes: int = PREFETCH_BYTES):
    """PrimFunc (x [1, K] f32, *weight parts as the CPU kernels take them, y [1, N] f32); prefetch_bytes: how far
    ahead the weights are prefetched (0: not at all, for benchmarks/gemv_stream.py's comparison).

    The row x is quantized once (serially: K values, about a microsecond); then each task takes a chunk of output
    rows and per row runs A independent chains of dot products (FMA latency) over units of one block (AVX2,
    AVX-VNNI) or two (AVX-512 VNNI: one 512-bit vpdpbusd a pair; K must hold whole pairs), and the offset term as
    one short dot product of the row's offset scales with the activation sums (VO blocks a vector instruction)."""
    g = _GemvRows(qtype, N, K, isa, prefetch_bytes)
    CHUNKS = min(TASKS, N)
    ROWS = (N + CHUNKS - 1) // CHUNKS   # the last chunk may be short
    NB, F, W, NU = g.NB, g.F, g.W, g.NU

    @T.prim_func
    def quant_gemv_int8(x: T.Buffer((1, K), "float32"), qs: T.Buffer(g.qs_shape, g.qs_dtype),
                        s: T.Buffer((g.S, N, NB), "float32"), y: T.Buffer((1, N), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        xq = T.decl_buffer((1, K), "int8")
        xd8 = T.decl_buffer((NB, 1, 8), "float32")
        xd = T.decl_buffer((NU, W), "float32", data=xd8.data)         # a unit's scales, 8 lanes a block
        xo = T.decl_buffer((F, NB, 1), "float32")
        xo_blocks = T.decl_buffer((F, NB), "float32", data=xo.data)   # the same sums, blocks as the last axis
        for b in range(NB):
            quantize_activation_block(x, 0, True, xq, xd8, xo, 0, b, qtype, F)
        for c in T.parallel(CHUNKS):
            acc = T.decl_buffer((g.A, W), "float32", scope="global")
            off = T.decl_buffer((g.VO,), "float32", scope="global")
            for i in range(T.min(ROWS, N - c * ROWS)):
                g.row_dot(qs, s, xq, xd, xo_blocks, acc, off, c * ROWS + i, y, (0, c * ROWS + i))

    return quant_gemv_int8


def make_moe_gemv_int8(qtype: str, E: int, N: int, K: int, k: int, per_slot: bool, isa: str = "avx2",
                       tokens: int | None = None):
    """PrimFunc (x [n, K] (or [n, k, K] where per_slot), ids [n, k] int32, *parts of the experts' [E * N, K],
    y [n, k, N]): ops.MOE_MATMUL as make_gemv_int8's GEMV over each token's k chosen experts' rows only. The input
    rows are quantized first (one a token, or one a token and slot); the tasks are (token, slot, chunk of rows)
    triples, so every chosen expert's rows stream in one parallel loop. A token reads its experts' weights on its
    own: the decode kernel; for a prompt, a GEMM that shares an expert's rows across the tokens routed to it is
    yet to come (a grouped form of this GEMV, each expert's rows kept in cache while its tokens pass, measured
    slower than this one: the work a (row, token) pair does, not the weights' traffic, bounds it)."""
    g = _GemvRows(qtype, E * N, K, isa, PREFETCH_BYTES)
    CHUNKS = max(1, min(TASKS // k, N))
    ROWS = (N + CHUNKS - 1) // CHUNKS
    R = k if per_slot else 1                                    # input rows a token
    NB, F, W, NU = g.NB, g.F, g.W, g.NU
    n = token_count(tokens)

    @T.prim_func
    def moe_gemv_int8(var_x: T.handle, var_ids: T.handle, qs: T.Buffer(g.qs_shape, g.qs_dtype),
                      s: T.Buffer((g.S, E * N, NB), "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x_data = T.match_buffer(var_x, (n, R, K) if per_slot else (n, K), "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        y = T.match_buffer(var_y, (n, k, N), "float32")
        x = T.decl_buffer((n * R, K), "float32", data=x_data.data)
        xq = T.decl_buffer((n * R, K), "int8")
        xd8 = T.decl_buffer((n * R, NB, 1, 8), "float32")
        xo = T.decl_buffer((n * R, F, NB, 1), "float32")
        quantize_rows(x, xq, xd8, xo, n * R, qtype, NB, F, K)
        for c in T.parallel(n * k * CHUNKS):
            t = T.meta_var(c // (k * CHUNKS))
            j = T.meta_var(c // CHUNKS % k)
            r = T.meta_var(t * R + (j if per_slot else 0))
            first = T.meta_var(T.max(0, T.min(ids[t, j], E - 1)) * N)     # the expert's first row, clamped
            xq_r = T.decl_buffer((1, K), "int8", data=xq.data, elem_offset=r * K)
            xd_r = T.decl_buffer((NU, W), "float32", data=xd8.data, elem_offset=r * NB * 8)
            xo_r = T.decl_buffer((F, NB), "float32", data=xo.data, elem_offset=r * F * NB)
            acc = T.decl_buffer((g.A, W), "float32", scope="global")
            off = T.decl_buffer((g.VO,), "float32", scope="global")
            for i in range(T.min(ROWS, N - c % CHUNKS * ROWS)):
                g.row_dot(qs, s, xq_r, xd_r, xo_r, acc, off, first + c % CHUNKS * ROWS + i, y,
                          (t, j, c % CHUNKS * ROWS + i))

    return moe_gemv_int8


@T.macro
def quantize_rows(x, xq, xd8, xo, rows, qtype, NB, F, K):
    """Rows 0 .. rows - 1 of x [rows, K] quantized per block (in parallel over rows) into xq [rows, K], their
    scales into xd8 [rows, NB, 1, 8] and their activation sums into xo [rows, F, NB, 1]: each row as the GEMV's
    one input row."""
    for r in T.parallel(rows):
        xq_r = T.decl_buffer((1, K), "int8", data=xq.data, elem_offset=r * K)
        xd8_r = T.decl_buffer((NB, 1, 8), "float32", data=xd8.data, elem_offset=r * NB * 8)
        xo_r = T.decl_buffer((F, NB, 1), "float32", data=xo.data, elem_offset=r * F * NB)
        for b in range(NB):
            quantize_activation_block(x, r, True, xq_r, xd8_r, xo_r, 0, b, qtype, F)


class _GemvRows:
    """The decode GEMV's work for one output row of a matrix of N rows (make_gemv_int8, make_moe_gemv_int8):
    A chains of unit dots with prefetches ahead, then the offset term."""

    def __init__(self, qtype: str, N: int, K: int, isa: str, prefetch_bytes: int):
        assert qtype in INT8_DOT_TYPES and isa in ISAS, (qtype, isa)
        NB = self.NB = K // BLOCK
        W = self.W = 16 if isa == "avx512-vnni" else 8          # lanes of a unit's sums
        NU = self.NU = NB // (W // 8)
        assert NU * (W // 8) == NB, (K, isa)
        self.qs_shape, self.qs_dtype = cpu_quants(qtype, N, K)
        self.S = LAYOUTS[qtype][1][2](N, K)[0]
        self.A = 4 if NU % 4 == 0 else 2 if NU % 2 == 0 else 1
        self.VO = 16 if NB % 16 == 0 and W == 16 else 8 if NB % 8 == 0 else 4 if NB % 4 == 0 else 2 if NB % 2 == 0 else 1
        self.fields, self.coefficient = _wide_offset(qtype) if W == 16 else _offset_fields(qtype)
        self.F = max(1, len(self.fields))
        self.qtype, self.isa, self.N = qtype, isa, N
        # the prefetches of one step of the row's loop (A units: A * W / 8 blocks): the quants' cache lines and
        # each scale plane's, prefetch_bytes of quants ahead
        self.STEP_BLOCKS = self.A * (W // 8)
        self.QS_BLOCK = self.qs_shape[1] // NB                        # qs elements a block
        qs_item = 1 if self.qs_dtype == "int8" else 4
        self.AHEAD = max(1, prefetch_bytes // (self.QS_BLOCK * qs_item))   # blocks
        self.QS_LINES = (self.STEP_BLOCKS * self.QS_BLOCK * qs_item + 63) // 64 if prefetch_bytes else 0
        self.PLANES = self.S if prefetch_bytes else 0
        self.LINE = 64 // qs_item                                 # qs elements a cache line

        self.row_dot = self._row_dot_macro()

    def _row_dot_macro(self):
        """A macro (qs, s, xq, xd, xo_blocks, acc, off, row, y, out): y[out] = row `row`'s output, acc and off
        the task's accumulators."""
        qtype, isa, N, NB, W, NU, A, VO = self.qtype, self.isa, self.N, self.NB, self.W, self.NU, self.A, self.VO
        fields, coefficient, QS_BLOCK, LINE = self.fields, self.coefficient, self.QS_BLOCK, self.LINE
        S, qs_dtype, STEP_BLOCKS, AHEAD = self.S, self.qs_dtype, self.STEP_BLOCKS, self.AHEAD
        QS_LINES, PLANES = self.QS_LINES, self.PLANES

        @T.macro
        def row_dot(qs, s, xq, xd, xo_blocks, acc, off, row, y, out):
            qs_flat = T.decl_buffer((N * NB * QS_BLOCK,), qs_dtype, data=qs.data)
            s_flat = T.decl_buffer((S, N * NB), "float32", data=s.data)
            for a in T.unroll(A):
                acc[a, T.ramp(0, 1, W)] = T.Broadcast(T.float32(0), W)
            for jj in range(NU // A):
                ahead = T.meta_var(T.min(row * NB + jj * STEP_BLOCKS + AHEAD, N * NB - 1))   # a block
                for line in T.unroll(QS_LINES):
                    prefetch(qs_flat, T.min(ahead * QS_BLOCK + line * LINE, N * NB * QS_BLOCK - 1))
                for f in T.unroll(PLANES):
                    prefetch(s_flat, (f, ahead))
                for a in T.unroll(A):
                    acc[a, T.ramp(0, 1, W)] = acc[a, T.ramp(0, 1, W)] + _unit_term(qtype, qs, s, xq, xd, row,
                                                                                   jj * A + a, isa)
            for a in T.unroll(1, A):
                acc[0, T.ramp(0, 1, W)] = acc[0, T.ramp(0, 1, W)] + acc[a, T.ramp(0, 1, W)]
            if len(fields) == 0:
                y[out] = lane_total(acc, 0, lanes=W)
            else:
                off[_span(0, VO)] = T.Broadcast(T.float32(0), VO) if VO > 1 else T.float32(0)
                for ob in range(NB // VO):
                    off[_span(0, VO)] = off[_span(0, VO)] + _offset_scales_by_sums(s, xo_blocks, fields, row,
                                                                                   _span(ob * VO, VO))
                y[out] = lane_total(acc, 0, lanes=W) + T.float32(coefficient) * lane_total(off, lanes=VO)

        return row_dot


def _offset_scales_by_sums(s, sums, fields, row, blocks):
    """sum_f s[field_f, row, blocks] * sums[f, blocks]: the offset scales of a span of blocks times the activation
    sums (the GEMV's offset term, without the coefficient)."""
    total = None
    for f, field in enumerate(fields):
        term = s[field, row, blocks] * sums[f, blocks]
        total = term if total is None else total + term
    return total


GEMM_TILE = 8   # tokens per tile: 8 float accumulators + the block's unpacked quants stay in the 16 AVX2 registers


def tile_offset(offset, s, xo, row, b, t0, TT):
    """float32 x TT: what block b's offset or minimum adds to row `row` for tokens t0 .. t0 + TT; `offset` is
    _offset_fields' (fields, coefficient), the activation sums x scales xo are stored token-minor."""
    fields, coefficient = offset
    total = None
    for f, field in enumerate(fields):
        scale = s[field, row, b] if coefficient == 1.0 else T.float32(coefficient) * s[field, row, b]
        term = T.Broadcast(scale, TT) * xo[f, b, T.ramp(t0, 1, TT)]
        total = term if total is None else total + term
    return total


def make_gemm_int8(qtype: str, N: int, K: int, isa: str = "avx2"):
    """PrimFunc (x [n, K] f32, *weight parts, y [n, N] f32), n symbolic: the prefill matmul on int8 activations.

    Every token's row is quantized once (parallel over tokens) into a buffer padded to whole tiles of GEMM_TILE
    tokens (padding rows are zeros, so the inner loop needs no guard). Then each task takes a chunk of output rows;
    per tile, per row, per block, the 32 quants are unpacked once into a register and multiplied with the tile's
    8 activation blocks. The offsets go 8 tokens at a time: the activation sums (times the activation scale) are
    stored token-minor, so one FMA per block adds a row's offset term to the whole tile."""
    assert qtype in INT8_DOT_TYPES and isa in ISAS[:2], (qtype, isa)
    NB = K // BLOCK
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    S = LAYOUTS[qtype][1][2](N, K)[0]
    TT = GEMM_TILE
    CHUNKS = min(TASKS, N)
    ROWS = (N + CHUNKS - 1) // CHUNKS
    F = _activation_sums(qtype)
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
                quantize_activation_block(x, T.min(t, n - 1), t < n, xq, xd8, xo, t, b, qtype, F)
        for c in T.parallel(CHUNKS):
            acc = T.decl_buffer((TT, 8), "float32", scope="global")
            off = T.decl_buffer((TT,), "float32", scope="global")
            u = T.decl_buffer((BLOCK,), "int8", scope="global")
            for tt in range(tiles):
                for i in range(T.min(ROWS, N - c * ROWS)):
                    gemm_tile_row(qtype, qs, s, xq, xd8, xo, acc, off, u, c * ROWS + i, tt, isa, NB, TT)
                    for t in T.unroll(TT):
                        if tt * TT + t < n:
                            y[tt * TT + t, c * ROWS + i] = lane_total(acc, t) + off[t]

    return quant_gemm_int8


@T.macro
def gemm_tile_row(qtype, qs, s, xq, xd8, xo, acc, off, u, row, tt, isa, NB, TT):
    """Row `row` of the weights times tile tt's TT quantized tokens: the integer dots into acc [TT, 8] (a token's
    8 lanes, still to be summed), the offset terms into off [TT]; u [BLOCK] holds a block's unpacked quants."""
    for t in T.unroll(TT):
        acc[t, T.ramp(0, 1, 8)] = T.Broadcast(T.float32(0), 8)
    off[T.ramp(0, 1, TT)] = T.Broadcast(T.float32(0), TT)
    for b in range(NB):
        u[T.ramp(0, 1, BLOCK)] = _unsigned_quants(qtype, qs, s, row, b)
        for t in T.unroll(TT):
            acc[t, T.ramp(0, 1, 8)] = acc[t, T.ramp(0, 1, 8)] + T.Cast("float32x8", _block_dot(
                qtype, qs, u[T.ramp(0, 1, BLOCK)], xq, tt * TT + t, row, b, isa)) * (
                    _lane_scales(qtype, s, row, b) * xd8[b, tt * TT + t, T.ramp(0, 1, 8)])
        if qtype != "q8_0":
            off[T.ramp(0, 1, TT)] = off[T.ramp(0, 1, TT)] + tile_offset(
                _offset_fields(qtype), s, xo, row, b, tt * TT, TT)


def make_moe_gemm_int8(qtype: str, E: int, N: int, K: int, k: int, per_slot: bool, isa: str = "avx2"):
    """PrimFunc (x [n, K] (or [n, k, K] where per_slot), ids [n, k] int32, *parts of the experts' [E * N, K],
    y [n, k, N]), n symbolic: ops.MOE_MATMUL for a prompt, make_gemm_int8's GEMM on each expert's tokens.

    The (token, slot) pairs are sorted by expert (moe.group_by_expert), each expert's run padded to whole tiles;
    their input rows are quantized in that order. Each task takes a chunk of every expert's output rows and
    runs the tiles of that expert's tokens past them, so an expert's rows are read once a tile, not once a token;
    the outputs go back to their (token, slot) places."""
    assert qtype in INT8_DOT_TYPES and isa in ISAS[:2], (qtype, isa)
    NB = K // BLOCK
    qs_shape, qs_dtype = cpu_quants(qtype, E * N, K)
    S = LAYOUTS[qtype][1][2](E * N, K)[0]
    TT = GEMM_TILE
    CHUNKS = min(TASKS, N)
    ROWS = (N + CHUNKS - 1) // CHUNKS
    F = _activation_sums(qtype)
    R = k if per_slot else 1                                    # input rows a token
    n = token_count(None)
    P = grouped_rows(n, k, E, TT)

    @T.prim_func
    def moe_gemm_int8(var_x: T.handle, var_ids: T.handle, qs: T.Buffer(qs_shape, qs_dtype),
                      s: T.Buffer((S, E * N, NB), "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x_data = T.match_buffer(var_x, (n, R, K) if per_slot else (n, K), "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        y_data = T.match_buffer(var_y, (n, k, N), "float32")
        x = T.decl_buffer((n * R, K), "float32", data=x_data.data)
        y = T.decl_buffer((n * k, N), "float32", data=y_data.data)
        bounds = T.decl_buffer((E + 1,), "int32")
        pair = T.decl_buffer((P,), "int32")
        fill = T.decl_buffer((E,), "int32")
        xq = T.decl_buffer((P, K), "int8")
        xd8 = T.decl_buffer((NB, P, 8), "float32")
        xo = T.decl_buffer((F, NB, P), "float32")
        group_by_expert(ids, n, k, E, TT, bounds, pair, fill)
        for p in T.parallel(P):
            for b in range(NB):
                quantize_activation_block(x, grouped_input_row(pair, p, k, R), pair[p] >= 0, xq, xd8, xo, p, b,
                                          qtype, F)
        for c in T.parallel(CHUNKS):
            acc = T.decl_buffer((TT, 8), "float32", scope="global")
            off = T.decl_buffer((TT,), "float32", scope="global")
            u = T.decl_buffer((BLOCK,), "int8", scope="global")
            for e in range(E):
                for tt in range(bounds[e] // TT, bounds[e + 1] // TT):
                    for i in range(T.min(ROWS, N - c * ROWS)):
                        gemm_tile_row(qtype, qs, s, xq, xd8, xo, acc, off, u, e * N + c * ROWS + i, tt, isa, NB,
                                      TT)
                        for t in T.unroll(TT):
                            if pair[tt * TT + t] >= 0:
                                y[pair[tt * TT + t], c * ROWS + i] = lane_total(acc, t) + off[t]

    return moe_gemm_int8

