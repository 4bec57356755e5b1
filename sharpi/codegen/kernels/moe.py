"""The mixture-of-experts kernels (sharpi.common.ops' moe_route and moe_matmul) for the CPU, in float32.

moe_route turns each token's router logits into its k experts and their weights; moe_matmul multiplies each
token's input by the rows of its chosen experts only, so a token reads k experts' weights, not E. The experts
of a layer are one [E * N, K] matrix in sharpi's layouts (its rows expert by expert), dequantized on the fly as
quant_matmul's kernels do. group_by_expert sorts a prompt's (token, slot) pairs by expert for the integer
GEMMs (quant_matmul_int8, quant_matmul_q8k), which then share each expert's rows across its tokens.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.ops import MOE_MIN_WEIGHT_SUM
from ...common.quant_layout import BLOCK, LAYOUTS, QUANTIZED
from .common import LANES, NEG_INF, token_count
from .lanes import lane_total
from .quant_matmul import cpu_quants, dense_value, dequant, planar


def make_moe_route(E: int, k: int, normalize: bool, tokens: int | None = None):
    """PrimFunc (logits [n, E] f32, ids [n, k] int32, weights [n, k] f32): per token (in parallel) the softmax,
    then k passes that each take the most probable expert not yet taken (strictly greater: ties go to the lower
    index, as a stable descending sort's)."""
    n = token_count(tokens)
    floor = T.float32(MOE_MIN_WEIGHT_SUM)

    @T.prim_func
    def moe_route(var_logits: T.handle, var_ids: T.handle, var_weights: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        logits = T.match_buffer(var_logits, (n, E), "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        weights = T.match_buffer(var_weights, (n, k), "float32")
        for t in T.parallel(n):
            p = T.decl_buffer((E,), "float32", scope="global")
            taken = T.decl_buffer((E,), "int32", scope="global")
            top = T.decl_buffer((2,), "float32", scope="global")      # the running maximum, then the sums
            best = T.decl_buffer((1,), "int32", scope="global")
            top[0] = T.float32(NEG_INF)
            for e in range(E):
                top[0] = T.max(top[0], logits[t, e])
            top[1] = T.float32(0)
            for e in range(E):
                p[e] = T.exp(logits[t, e] - top[0])
                top[1] = top[1] + p[e]
                taken[e] = 0
            for e in range(E):
                p[e] = p[e] / top[1]
            top[1] = T.float32(0)
            for j in range(k):
                best[0] = 0                        # stays a valid index even if every p is NaN
                top[0] = T.float32(-1)
                for e in range(E):
                    if taken[e] == 0 and p[e] > top[0]:
                        best[0] = e
                        top[0] = p[e]
                taken[best[0]] = 1
                ids[t, j] = best[0]
                weights[t, j] = top[0]
                top[1] = top[1] + top[0]
            if normalize:
                for j in range(k):
                    weights[t, j] = weights[t, j] / T.max(top[1], floor)

    return moe_route


def make_moe_matmul(qtype: str, E: int, N: int, K: int, k: int, per_slot: bool, tokens: int | None = None):
    """PrimFunc (x [n, K] or [n, k, K] (per_slot), ids [n, k] int32, *expert parts ([E * N, K]), y [n, k, N]):
    y[t, j, o] = sum_c x[t(, j), c] * W[ids[t, j] * N + o, c], parallel over the (token, slot) pairs."""
    x_shape = lambda n: (n, k, K) if per_slot else (n, K)     # noqa: E731
    n = token_count(tokens)
    if qtype in QUANTIZED:
        return _quant_moe_matmul(qtype, E, N, K, k, per_slot, n, x_shape(n))
    return _dense_moe_matmul(qtype, E, N, K, k, per_slot, n, x_shape(n))


def _x(x, per_slot, t, j, c):
    return x[t, j, c] if per_slot else x[t, c]


def _expert(ids, t, j, E):
    """The chosen expert, clamped into [0, E): no id reads outside the experts' rows."""
    return T.max(0, T.min(ids[t, j], E - 1))


def grouped_rows(n, k: int, E: int, TT: int):
    """The rows group_by_expert's order can take: the n * k pairs, each expert's run padded to whole tiles of TT."""
    return n * k + E * (TT - 1)


def grouped_input_row(pair, p, k: int, R: int):
    """The input row of group_by_expert's sorted position p: its token's (R = 1) or its (token, slot)'s (R = k, a
    row per slot); a padding position (pair -1) reads row 0, which the kernels then ignore."""
    return T.max(pair[p], 0) // (k // R)


@T.macro
def group_by_expert(ids, n, k, E, TT, bounds, pair, fill):
    """A counting sort of the (token, slot) pairs by their chosen expert. pair[p] is the flat pair index
    t * k + j at sorted position p, or -1 where p pads an expert's run to a whole tile of TT; expert e holds
    positions bounds[e] .. bounds[e + 1] (multiples of TT), and bounds[E] the rows in use. fill [E] is scratch.
    Serial: n * k small integer steps, against the GEMM's n * k * N * K."""
    for e in range(E):
        fill[e] = 0
    for p in range(n * k):
        fill[_expert(ids, p // k, p % k, E)] = fill[_expert(ids, p // k, p % k, E)] + 1
    bounds[0] = 0
    for e in range(E):
        bounds[e + 1] = bounds[e] + (fill[e] + (TT - 1)) // TT * TT
        fill[e] = bounds[e]
    for p in range(grouped_rows(n, k, E, TT)):
        pair[p] = -1
    for p in range(n * k):
        pair[fill[_expert(ids, p // k, p % k, E)]] = T.Cast("int32", p)
        fill[_expert(ids, p // k, p % k, E)] = fill[_expert(ids, p // k, p % k, E)] + 1


def _quant_moe_matmul(qtype, E, N, K, k, per_slot, n, x_shape):
    NB, C = K // BLOCK, BLOCK // LANES
    qs_shape, qs_dtype = cpu_quants(qtype, E * N, K)
    S = LAYOUTS[qtype][1][2](E * N, K)[0]

    @T.prim_func
    def quant_moe_matmul(var_x: T.handle, var_ids: T.handle, qs: T.Buffer(qs_shape, qs_dtype),
                         s: T.Buffer((S, E * N, NB), "float32"), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, x_shape, "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        y = T.match_buffer(var_y, (n, k, N), "float32")
        for tj in T.parallel(n * k):
            acc = T.decl_buffer((C, LANES), "float32", scope="global")
            for o in range(N):
                row = T.meta_var(_expert(ids, tj // k, tj % k, E) * N + o)
                for c in T.unroll(C):
                    for l in T.vectorized(LANES):
                        acc[c, l] = T.float32(0)
                for b in range(NB):
                    for c in T.unroll(C):
                        for l in T.vectorized(LANES):
                            acc[c, l] = acc[c, l] + dequant(qtype, qs, planar(s), row, b, c * LANES + l) * _x(
                                x, per_slot, tj // k, tj % k, b * BLOCK + c * LANES + l)
                for l in T.vectorized(LANES):
                    acc[0, l] = (acc[0, l] + acc[1, l]) + (acc[2, l] + acc[3, l])
                y[tj // k, tj % k, o] = lane_total(acc, 0)

    return quant_moe_matmul


def _dense_moe_matmul(qtype, E, N, K, k, per_slot, n, x_shape):
    wdt = LAYOUTS[qtype][0][1]
    KV = K // LANES

    @T.prim_func
    def dense_moe_matmul(var_x: T.handle, var_ids: T.handle, w: T.Buffer((E * N, K), wdt), var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, x_shape, "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        y = T.match_buffer(var_y, (n, k, N), "float32")
        for tj in T.parallel(n * k):
            acc = T.decl_buffer((1, LANES), "float32", scope="global")
            tail = T.decl_buffer((1,), "float32", scope="global")
            for o in range(N):
                row = T.meta_var(_expert(ids, tj // k, tj % k, E) * N + o)
                tail[0] = T.float32(0)
                for l in T.vectorized(LANES):
                    acc[0, l] = T.float32(0)
                for c in range(KV):
                    for l in T.vectorized(LANES):
                        acc[0, l] = acc[0, l] + dense_value(qtype, w, row, c * LANES + l) * _x(
                            x, per_slot, tj // k, tj % k, c * LANES + l)
                for r in range(K - KV * LANES):
                    tail[0] = tail[0] + dense_value(qtype, w, row, KV * LANES + r) * _x(
                        x, per_slot, tj // k, tj % k, KV * LANES + r)
                y[tj // k, tj % k, o] = lane_total(acc, 0) + tail[0]

    return dense_moe_matmul
