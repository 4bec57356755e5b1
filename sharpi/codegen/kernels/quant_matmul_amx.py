"""The prefill GEMM of quant_matmul_int8 on AMX tiles (Intel Sapphire Rapids and later, where the operating system
grants the tile state: sharpi.common.cpu.amx_granted; the decode GEMV stays AVX-512 VNNI's, or for a K-quant
quant_matmul_q8k's).

One `tdpbusd` multiplies a tile of 16 weight rows by a tile of 16 tokens over one 32-block: 8192 multiply-adds of
unsigned weight bytes and int8 activations into a 16 x 16 int32 tile, where the 512-bit GEMM's vpdpbusd does 64.
A block's products then need its own scales (every 32-block has one, per row and per token), so the tile goes back
to memory after every block and each row's 16 token sums are converted, scaled by the row's weight scale times the
tokens' activation scales and added to that row's float accumulator (16 zmm registers for the 16 rows), with the
block's offset or minimum term: four vector instructions per row and block where the 512-bit GEMM spends 16 x 2.
q6_k's halves have scales of their own: two tdpbusd of 16 bytes each (AMX_GROUPS puts each half in one piece).

The weights stay in sharpi's layouts: a task unpacks a block of rows once to unsigned bytes (as the other int8
kernels do: nibbles, fifth and sixth bits; q8_0 offset by 128) into a scratch buffer that every token tile then
reads as A tiles; the activations are quantized as everywhere (ggml's q8_0 rule) straight into B tiles' layout.
The integer products are exactly those of the other int8 kernels; only the order of the float sums differs.
A K-quant stored as (qs, ks) (quant_layout's compact form) is unpacked the same way, and each row's per-32 scales
are rebuilt beside it from the integer sub-scales (exact in f32, so the products equal the `s` form's):
make_gemm_amx(sub_scales=True), and make_moe_gemm_amx, which runs these tiles over each expert's rows for the
tokens that chose it.

The tile configuration is per thread, so every parallel task loads it and releases the tiles at its end.

On the Xeon of 2026-12-03 (2 threads, 512 tokens) this is 3.1x the 512-bit GEMM on Q4_K 8960 x 1536 (28 ms) and
2.4x on Q6_K 1536 x 8960 (59 ms). Taken apart, the tile work (loads, tdpbusd, stores) and the drains each take
about half and do not overlap; storing the next block's tiles after this block's drain instead of before it, and
the unpacked weights block-major (an A tile 512 contiguous bytes), measured no faster. Fewer drain instructions
would need activation scales per 256 elements (llama.cpp's q8_K: the weight scales by FMA alone).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.quant_layout import BLOCK, FLOAT_PLANES, K_QUANTS, KS_WORDS, LAYOUTS, SUPER_BLOCK
from .common import ceil_div, token_count
from .moe import group_by_expert, grouped_input_row, grouped_rows
from .quant_matmul import cpu_quants, ks_offset_byte, ks_sub_scale_byte, ks_super_min, ks_super_scale
from .quant_matmul_int8 import (AMX_GROUPS, INT8_DOT_TYPES, TASKS, _unsigned_quants, _wide_offset,
                                quantize_activation_block, tile_offset)

TILE = 16                   # tokens of a B tile, weight rows of an A tile, and both sides of the int32 result
ROW_BLOCK_BYTES = 512 << 10  # unpacked weights a task holds while every token tile passes over them (in L2)
_WORDS = BLOCK // 4          # int32 groups of 4 bytes a block
_BLOCKS = SUPER_BLOCK // BLOCK   # blocks a K-quant super-block
_EVEN, _ODD = list(range(0, 2 * _BLOCKS, 2)), list(range(1, 2 * _BLOCKS, 2))   # q6_k's halves' sub-scales


def _tile_config(halves: int) -> list[int]:
    """The 64-byte tile configuration as 8 little-endian int64 words. Palette 1; per half h: tiles h and 2 + h
    the int32 results of two blocks in flight (16 rows x 64 bytes), tile 4 + h the weights (16 rows x the
    half's bytes), tile 6 + h the activations (the half's groups of 4 bytes as rows x 16 tokens x 4 bytes)."""
    config = bytearray(64)
    config[0] = 1
    width = BLOCK // halves
    for h in range(halves):
        for tile, colsb, rows in ((h, 64, TILE), (2 + h, 64, TILE), (4 + h, width, TILE), (6 + h, 64, width // 4)):
            config[16 + 2 * tile] = colsb
            config[48 + tile] = rows
    return [int.from_bytes(config[8 * i:8 * i + 8], "little") for i in range(8)]


def _pick(values, i):
    """values[i] for a loop variable i (unrolled: each iteration folds to its constant)."""
    expr = T.int64(values[-1])
    for j in range(len(values) - 2, -1, -1):
        expr = T.if_then_else(i == j, T.int64(values[j]), expr)
    return expr


def _amx(name, *args):
    return T.evaluate(T.call_llvm_intrin("void", f"llvm.x86.{name}", *args))


def _unsigned_block(qtype, qs, s, row, b, from_ks=False):
    """int32x8: block b of `row` as unsigned bytes, its groups in AMX_GROUPS' order (q8_0 offset by 128, as in
    the 512-bit kernels: its offset term is _wide_offset's); a K-quant's bit fields from `ks` (passed as s) where
    from_ks."""
    if qtype == "q8_0":
        u = qs[row, T.ramp(b * BLOCK, 1, BLOCK)] ^ T.Broadcast(T.int8(-128), BLOCK)
    else:
        u = _unsigned_quants(qtype, qs, s, row, b, from_ks)
    return T.Shuffle([T.reinterpret("int32x8", u)], AMX_GROUPS)


@T.macro
def _multiply(w, xq, results, g, b, tt, NB, K, halves, slot):
    """Block b of row group g by token tile tt into result tiles `slot` (0 or 1: two blocks are in flight, so
    that the tile unit may multiply block b + 1 while block b drains), then into the task's result buffers."""
    for h in T.unroll(halves):
        _amx("tilezero", T.int8(2 * slot + h))
        _amx("tileloadd64", T.int8(4 + h), T.address_of(w[g * TILE, b * _WORDS + h * (_WORDS // halves)]),
             T.int64(K))
        _amx("tileloadd64", T.int8(6 + h),
             T.address_of(xq[(tt * NB + b) * _WORDS * TILE + h * (_WORDS // halves) * TILE]), T.int64(64))
        _amx("tdpbusd", T.int8(2 * slot + h), T.int8(4 + h), T.int8(6 + h))
    for h in T.unroll(halves):
        _amx("tilestored64", T.int8(2 * slot + h), T.address_of(results[slot, h, 0, 0]), T.int64(64))


@T.macro
def _drain_rows(results, slot, h, acc, first, s, xd, xo, offset, row0, N, b, t0, halves):
    """acc[m] += result row first + m (16 tokens) x that row's scale (of half h) x the tokens' activation scales,
    plus, with the last half, the row's offset or minimum terms."""
    for m in T.unroll(TILE // 2):
        row = T.meta_var(T.min(row0 + first + m, N - 1))
        acc[m, T.ramp(0, 1, TILE)] = acc[m, T.ramp(0, 1, TILE)] + T.Cast(
            "float32x16", results[slot, h, first + m, T.ramp(0, 1, TILE)]) * (
                xd[b, T.ramp(t0, 1, TILE)] * T.Broadcast(s[h, row, b], TILE))
        if h == halves - 1:
            acc[m, T.ramp(0, 1, TILE)] = acc[m, T.ramp(0, 1, TILE)] + tile_offset(offset, s, xo, row, b, t0, TILE)


@T.macro
def _drain(results, slot, acc_low, acc_high, s, xd, xo, offset, row0, N, b, t0, halves):
    """Block b's result tiles (in `slot`) into the accumulators: acc_low holds rows 0-7, acc_high rows 8-15 (a
    stack buffer must be under 1 KB, lanes.py; there LLVM keeps them in registers)."""
    for h in T.unroll(halves):
        _drain_rows(results, slot, h, acc_low, 0, s, xd, xo, offset, row0, N, b, t0, halves)
        _drain_rows(results, slot, h, acc_high, TILE // 2, s, xd, xo, offset, row0, N, b, t0, halves)


@T.macro
def _tile_by_group(w, xq, mine, acc_low, acc_high, s, xd, xo, offset, row0, N, g, tt, NB, K, halves):
    """Token tile tt times the unpacked rows of group g (scale row row0 on), every block, into acc_low and
    acc_high: two blocks in flight, the tile unit multiplying one while the other drains."""
    for m in T.unroll(TILE // 2):
        acc_low[m, T.ramp(0, 1, TILE)] = T.Broadcast(T.float32(0), TILE)
        acc_high[m, T.ramp(0, 1, TILE)] = T.Broadcast(T.float32(0), TILE)
    t0 = T.meta_var(tt * TILE)
    _multiply(w, xq, mine, g, 0, tt, NB, K, halves, 0)
    for bp in range((NB + 1) // 2):
        if 2 * bp + 1 < NB:
            _multiply(w, xq, mine, g, 2 * bp + 1, tt, NB, K, halves, 1)
        _drain(mine, 0, acc_low, acc_high, s, xd, xo, offset, row0, N, 2 * bp, t0, halves)
        if 2 * bp + 1 < NB:
            if 2 * bp + 2 < NB:
                _multiply(w, xq, mine, g, 2 * bp + 2, tt, NB, K, halves, 0)
            _drain(mine, 1, acc_low, acc_high, s, xd, xo, offset, row0, N, 2 * bp + 1, t0, halves)


def make_gemm_amx(qtype: str, N: int, K: int, sub_scales: bool = False):
    """PrimFunc (x [n, K] f32, *weight parts, y [n, N] f32), n symbolic: quant_matmul_int8.make_gemm_int8's
    arithmetic on AMX tiles. Tasks take runs of whole 16-row groups; a task unpacks ROW_BLOCK rows at a time,
    then for each tile of 16 tokens and each group of 16 rows runs a tdpbusd per block (two for q6_k) and drains
    it into the group's float accumulators. sub_scales: the weight is a K-quant stored as (qs, ks), whose per-32
    scales the task rebuilds as it unpacks (_unpack_row)."""
    assert qtype in INT8_DOT_TYPES and K % BLOCK == 0, (qtype, K)
    assert not sub_scales or qtype in K_QUANTS, qtype
    NB, NS = K // BLOCK, K // SUPER_BLOCK
    qs_shape, qs_dtype = cpu_quants(qtype, N, K)
    scales_shape = (N, NS * KS_WORDS[qtype]) if sub_scales else (LAYOUTS[qtype][1][2](N, K)[0], N, NB)
    halves = 2 if qtype == "q6_k" else 1
    offset = _wide_offset(qtype)
    F = max(1, len(offset[0]))
    GROUPS = ceil_div(N, TILE)
    CHUNKS = min(TASKS, GROUPS)
    GROUPS_PER_TASK = ceil_div(GROUPS, CHUNKS)
    BLOCK_GROUPS = max(1, min(GROUPS_PER_TASK, ROW_BLOCK_BYTES // (TILE * K)))
    BLOCK_ROWS = BLOCK_GROUPS * TILE
    # the rebuilt scales of a task's rows (unused without sub_scales)
    LOCAL_SCALES = (FLOAT_PLANES[qtype], BLOCK_ROWS, NB) if sub_scales else (1,)
    CONFIG = _tile_config(halves)
    n = token_count(None)
    tiles = (n + TILE - 1) // TILE

    @T.prim_func
    def quant_gemm_amx(var_x: T.handle, qs: T.Buffer(qs_shape, qs_dtype),
                       s: T.Buffer(scales_shape, "uint32" if sub_scales else "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, K), "float32")
        y = T.match_buffer(var_y, (n, N), "float32")
        xq = T.decl_buffer((tiles * NB * _WORDS * TILE,), "int32")    # B tiles: [tile, block, group, token]
        xd = T.decl_buffer((NB, tiles * TILE), "float32")
        xo = T.decl_buffer((F, NB, tiles * TILE), "float32")
        results = T.decl_buffer((CHUNKS * 2 * halves * TILE * TILE,), "int32")   # each task's result tiles
        for t in T.parallel(tiles * TILE):
            for b in range(NB):
                quantize_activation_block(x, T.min(t, n - 1), t < n, xq, xd, xo, t, b, qtype, F, "tiles")
        for c in T.parallel(CHUNKS):
            cfg = T.decl_buffer((8,), "int64", scope="global")
            mine = T.decl_buffer((2, halves, TILE, TILE), "int32", data=results.data,
                                 elem_offset=c * 2 * halves * TILE * TILE)
            acc_low = T.decl_buffer((TILE // 2, TILE), "float32", scope="global")
            acc_high = T.decl_buffer((TILE // 2, TILE), "float32", scope="global")
            w = T.decl_buffer((BLOCK_ROWS, NB * _WORDS), "int32")   # A tiles: unpacked rows
            sl = T.decl_buffer(LOCAL_SCALES, "float32")
            for i in T.unroll(8):
                cfg[i] = _pick(CONFIG, i)
            _amx("ldtilecfg", T.address_of(cfg[0]))
            groups = T.meta_var(T.min(GROUPS_PER_TASK, GROUPS - c * GROUPS_PER_TASK))
            for gb in range((groups + BLOCK_GROUPS - 1) // BLOCK_GROUPS):
                first = T.meta_var((c * GROUPS_PER_TASK + gb * BLOCK_GROUPS) * TILE)   # the block's first row
                block_groups = T.meta_var(T.min(BLOCK_GROUPS, groups - gb * BLOCK_GROUPS))
                for r in range(block_groups * TILE):
                    _unpack_row(qtype, qs, s, w, sl, r, T.min(first + r, N - 1), NB, NS, sub_scales)
                for tt in range(tiles):
                    for g in range(block_groups):
                        if sub_scales:
                            _tile_by_group(w, xq, mine, acc_low, acc_high, sl, xd, xo, offset, g * TILE, BLOCK_ROWS,
                                           g, tt, NB, K, halves)
                        else:
                            _tile_by_group(w, xq, mine, acc_low, acc_high, s, xd, xo, offset, first + g * TILE, N,
                                           g, tt, NB, K, halves)
                        row0 = T.meta_var(first + g * TILE)
                        for m in range(TILE // 2):
                            for t in range(TILE):
                                if tt * TILE + t < n:
                                    if row0 + m < N:
                                        y[tt * TILE + t, row0 + m] = acc_low[m, t]
                                    if row0 + TILE // 2 + m < N:
                                        y[tt * TILE + t, row0 + TILE // 2 + m] = acc_high[m, t]
            _amx("tilerelease")

    return quant_gemm_amx


@T.macro
def _block_scales(qtype, ks, sl, r, row, sb):
    """Super-block sb's 8 blocks' scale fields of `row` into sl[:, r] as `s` would hold them (quant_layout):
    d_super times the integer sub-scales (q6_k: each half's), and -dmin times the mins; 8 lanes at a time."""
    ks8 = T.decl_buffer((ks.shape[0], ks.shape[1] * 4), "int8", data=ks.data)   # its bytes
    first = T.meta_var(sb * KS_WORDS[qtype])
    d_super = T.meta_var(T.Broadcast(ks_super_scale(qtype, ks, row, first), _BLOCKS))
    if qtype == "q6_k":
        signed = T.meta_var(ks8[row, T.ramp(ks_sub_scale_byte(qtype, first, 0, 0), 1, 2 * _BLOCKS)])
        sl[0, r, T.ramp(sb * _BLOCKS, 1, _BLOCKS)] = T.Cast("float32x8", T.Shuffle([signed], _EVEN)) * d_super
        sl[1, r, T.ramp(sb * _BLOCKS, 1, _BLOCKS)] = T.Cast("float32x8", T.Shuffle([signed], _ODD)) * d_super
    else:    # sub-scales and mins are 0-63: positive as int8
        sl[0, r, T.ramp(sb * _BLOCKS, 1, _BLOCKS)] = T.Cast("float32x8", ks8[
            row, T.ramp(ks_sub_scale_byte(qtype, first, 0, 0), 1, _BLOCKS)]) * d_super
        sl[1, r, T.ramp(sb * _BLOCKS, 1, _BLOCKS)] = T.Cast("float32x8", ks8[
            row, T.ramp(ks_offset_byte(qtype, first, 0, 0), 1, _BLOCKS)]) * T.Broadcast(
                -ks_super_min(ks, row, first), _BLOCKS)


@T.macro
def _unpack_row(qtype, qs, s, w, sl, r, row, NB, NS, sub_scales):
    """Weight row `row` as unsigned bytes into w[r] (A tiles' rows); from a K-quant's (qs, ks) (s is then ks),
    its per-32 scale fields rebuilt into sl[:, r] as well."""
    for b in range(NB):
        w[r, T.ramp(b * _WORDS, 1, _WORDS)] = _unsigned_block(qtype, qs, s, row, b, sub_scales)
    if sub_scales:
        for sb in range(NS):
            _block_scales(qtype, s, sl, r, row, sb)


@T.macro
def _copy_tile_column(xt, xtd, xto, src, valid, xq, xd, xo, p, b, NB, F):
    """Token src's quantized block b (B-tile layout, scale and sums) to position p's place (zeros where not valid:
    a tile's padding)."""
    for j in T.unroll(_WORDS):
        xq[((p // TILE) * NB + b) * _WORDS * TILE + j * TILE + p % TILE] = T.Select(
            valid, xt[((src // TILE) * NB + b) * _WORDS * TILE + j * TILE + src % TILE], 0)
    xd[b, p] = T.Select(valid, xtd[b, src], T.float32(0))
    for f in T.unroll(F):
        xo[f, b, p] = T.Select(valid, xto[f, b, src], T.float32(0))


def make_moe_gemm_amx(qtype: str, E: int, N: int, K: int, k: int, per_slot: bool):
    """PrimFunc (x [n, K] (or [n, k, K] where per_slot), ids [n, k] int32, qs, ks of the experts' [E * N, K],
    y [n, k, N]), n symbolic: ops.MOE_MATMUL for a prompt on AMX, make_gemm_amx on each expert's tokens.

    The experts are K-quants stored as (qs, ks) (a mixture's compact layout). The (token, slot) pairs are sorted by
    expert (moe.group_by_expert, runs padded to whole tiles of 16) and quantized in that order into B tiles. A task
    is one block of an expert's rows (ROW_BLOCK_BYTES unpacked, in L2): it unpacks them to unsigned bytes and their
    per-32 scales (d_super times the sub-scale, as `s` would hold them: exact in f32) once, and that expert's
    token tiles pass over them as make_gemm_amx's tiles pass over a dense matrix's rows. (Tasks that cut across
    the experts, a few rows of each, read every tile once per few rows: the tiles of a prompt, ~9 MB at K = 2048,
    then stream from memory dozens of times a call.) The integer products are make_gemm_amx's (activations per
    32, ggml's q8_0 rule), not the AVX2 kernel's per-256 ones."""
    assert qtype in K_QUANTS and K % SUPER_BLOCK == 0, (qtype, K)
    NB, NS = K // BLOCK, K // SUPER_BLOCK
    qs_shape, qs_dtype = cpu_quants(qtype, E * N, K)
    KS = NS * KS_WORDS[qtype]
    PLANES = FLOAT_PLANES[qtype]      # a K-quant's two: its scale and its minimum (q6_k: its halves' scales)
    assert PLANES == 2, qtype
    halves = 2 if qtype == "q6_k" else 1
    offset = _wide_offset(qtype)
    F = max(1, len(offset[0]))
    BLOCK_GROUPS = max(1, min(ceil_div(N, TILE), ROW_BLOCK_BYTES // (TILE * K)))
    BLOCK_ROWS = BLOCK_GROUPS * TILE
    ROW_BLOCKS = ceil_div(N, BLOCK_ROWS)         # tasks an expert
    CONFIG = _tile_config(halves)
    R = k if per_slot else 1
    n = token_count(None)
    P = grouped_rows(n, k, E, TILE)
    tiles = (P + TILE - 1) // TILE
    token_tiles = (n + TILE - 1) // TILE

    @T.prim_func
    def moe_gemm_amx(var_x: T.handle, var_ids: T.handle, qs: T.Buffer(qs_shape, qs_dtype),
                     ks: T.Buffer((E * N, KS), "uint32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x_data = T.match_buffer(var_x, (n, R, K) if per_slot else (n, K), "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        y_data = T.match_buffer(var_y, (n, k, N), "float32")
        x = T.decl_buffer((n * R, K), "float32", data=x_data.data)
        y = T.decl_buffer((n * k, N), "float32", data=y_data.data)
        bounds = T.decl_buffer((E + 1,), "int32")
        pair = T.decl_buffer((P,), "int32")
        fill = T.decl_buffer((E,), "int32")
        xq = T.decl_buffer((tiles * NB * _WORDS * TILE,), "int32")    # B tiles: [tile, block, group, token]
        xd = T.decl_buffer((NB, tiles * TILE), "float32")
        xo = T.decl_buffer((F, NB, tiles * TILE), "float32")
        results = T.decl_buffer((E * ROW_BLOCKS * 2 * halves * TILE * TILE,), "int32")   # each task's tiles
        group_by_expert(ids, n, k, E, TILE, bounds, pair, fill)
        if per_slot:
            for p in T.parallel(P):
                for b in range(NB):
                    quantize_activation_block(x, grouped_input_row(pair, p, k, R), pair[p] >= 0, xq, xd, xo, p, b,
                                              qtype, F, "tiles")
        else:    # each token quantized once, then copied to its k places
            xt = T.decl_buffer((token_tiles * NB * _WORDS * TILE,), "int32")
            xtd = T.decl_buffer((NB, token_tiles * TILE), "float32")
            xto = T.decl_buffer((F, NB, token_tiles * TILE), "float32")
            for t in T.parallel(n):
                for b in range(NB):
                    quantize_activation_block(x, t, True, xt, xtd, xto, t, b, qtype, F, "tiles")
            for p in T.parallel(P):
                for b in range(NB):
                    _copy_tile_column(xt, xtd, xto, grouped_input_row(pair, p, k, R), pair[p] >= 0, xq, xd, xo, p,
                                      b, NB, F)
        for c in T.parallel(E * ROW_BLOCKS):
            # block-major: the parallel loop hands each thread a contiguous run of tasks, which then holds the
            # same row blocks of every expert rather than every row block of some (whose loads differ)
            e = T.meta_var(c % E)
            first = T.meta_var(c // E * BLOCK_ROWS)                       # the block's first row in the expert
            if bounds[e + 1] > bounds[e]:
                cfg = T.decl_buffer((8,), "int64", scope="global")
                mine = T.decl_buffer((2, halves, TILE, TILE), "int32", data=results.data,
                                     elem_offset=c * 2 * halves * TILE * TILE)
                acc_low = T.decl_buffer((TILE // 2, TILE), "float32", scope="global")
                acc_high = T.decl_buffer((TILE // 2, TILE), "float32", scope="global")
                w = T.decl_buffer((BLOCK_ROWS, NB * _WORDS), "int32")        # A tiles: unpacked rows
                sl = T.decl_buffer((PLANES, BLOCK_ROWS, NB), "float32")      # their scales, as `s` holds them
                for i in T.unroll(8):
                    cfg[i] = _pick(CONFIG, i)
                _amx("ldtilecfg", T.address_of(cfg[0]))
                block_groups = T.meta_var(T.min(BLOCK_GROUPS, (N - first + TILE - 1) // TILE))
                for r in range(block_groups * TILE):
                    _unpack_row(qtype, qs, ks, w, sl, r, e * N + T.min(first + r, N - 1), NB, NS, True)
                for tt in range(bounds[e] // TILE, bounds[e + 1] // TILE):
                    for g in range(block_groups):
                        _tile_by_group(w, xq, mine, acc_low, acc_high, sl, xd, xo, offset, g * TILE, BLOCK_ROWS, g,
                                       tt, NB, K, halves)
                        for m in range(TILE // 2):
                            for t in range(TILE):
                                if pair[tt * TILE + t] >= 0:
                                    if first + g * TILE + m < N:
                                        y[pair[tt * TILE + t], first + g * TILE + m] = acc_low[m, t]
                                    if first + g * TILE + TILE // 2 + m < N:
                                        y[pair[tt * TILE + t], first + g * TILE + TILE // 2 + m] = acc_high[m, t]
                _amx("tilerelease")

    return moe_gemm_amx
