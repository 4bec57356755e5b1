"""The mixture-of-experts kernels for GPU targets (WGSL on Vulkan, CUDA), twins of ..moe's CPU kernels.

route: one thread a token. The softmax's maximum and sum first, then k passes that each take the most probable
    expert not yet taken (strictly greater: ties to the lower index, as on the CPU); a thread has no array of E
    probabilities (WGSL's function-scope arrays would be private memory), so each pass recomputes them from the
    logits and tells the taken experts by the ids it has already written.
matmul: y[t, j, o] = sum_c x[t(, j), c] * W[ids[t, j] * N + o, c], the experts dequantized on the fly, as a TE
    reduction over the gathered rows. dlight's GEMV and Matmul rules do not take a data-dependent row, so its
    Fallback rule schedules it: one thread an output, the reduction in the thread. Correct everywhere and tested
    on lavapipe; fast GPU MoE kernels (a warp a row for decode, a grouped GEMM for prompts) are still to come.
"""
from __future__ import annotations

from tvm import te, tirx
from tvm.script import tirx as T

from ....common.errors import CompileError
from ....common.ops import MOE_MIN_WEIGHT_SUM
from ..common import GPU_KERNEL_ATTRS, NEG_INF, token_count
from .quant_matmul import GPU_LAYOUTS, gpu_weight_parts, i64

ROUTE_THREADS = 64


def make_gpu_moe_route(E: int, k: int, normalize: bool, tokens: int | None = None) -> tirx.PrimFunc:
    """PrimFunc (logits [n, E] f32, ids [n, k] int32, weights [n, k] f32): ops.MOE_ROUTE, one thread a token."""
    n = token_count(tokens)
    floor = T.float32(MOE_MIN_WEIGHT_SUM)

    @T.prim_func
    def gpu_moe_route(var_logits: T.handle, var_ids: T.handle, var_weights: T.handle):
        T.func_attr(GPU_KERNEL_ATTRS)
        logits = T.match_buffer(var_logits, (n, E), "float32")
        ids = T.match_buffer(var_ids, (n, k), "int32")
        weights = T.match_buffer(var_weights, (n, k), "float32")
        for b in T.thread_binding((n + ROUTE_THREADS - 1) // ROUTE_THREADS, thread="blockIdx.x"):
            for tx in T.thread_binding(ROUTE_THREADS, thread="threadIdx.x"):
                s = T.alloc_buffer((4,), "float32", scope="local")     # max, sum, the pass's best p, sum of weights
                best = T.alloc_buffer((2,), "int32", scope="local")    # the pass's best expert, "e is taken"
                t = T.meta_var(b * ROUTE_THREADS + tx)
                if t < n:
                    s[0] = T.float32(NEG_INF)
                    for e in range(E):
                        s[0] = T.max(s[0], logits[t, e])
                    s[1] = T.float32(0)
                    for e in range(E):
                        s[1] = s[1] + T.exp(logits[t, e] - s[0])
                    s[3] = T.float32(0)
                    for j in range(k):
                        best[0] = 0                    # stays a valid index even if every p is NaN
                        s[2] = T.float32(-1)
                        for e in range(E):
                            best[1] = 0
                            for i in range(j):
                                if ids[t, i] == e:
                                    best[1] = 1
                            if best[1] == 0 and T.exp(logits[t, e] - s[0]) / s[1] > s[2]:
                                best[0] = e
                                s[2] = T.exp(logits[t, e] - s[0]) / s[1]
                        ids[t, j] = best[0]
                        weights[t, j] = s[2]
                        s[3] = s[3] + s[2]
                    if normalize:
                        for j in range(k):
                            weights[t, j] = weights[t, j] / T.max(s[3], floor)

    return gpu_moe_route.with_attr("global_symbol", f"gpu_moe_route_{E}_{k}_{int(normalize)}"
                                   + ("" if tokens is None else f"_{tokens}"))


def make_gpu_moe_matmul(qtype: str, E: int, N: int, K: int, k: int, per_slot: bool, tokens: int | None = None,
                        scale_prefixes: bool = False) -> tirx.PrimFunc:
    """PrimFunc (x [n, K] (or [n, k, K] where per_slot), ids [n, k] int32, *the experts' [E * N, K] parts as the
    GPU matmul takes them, y [n, k, N]): ops.MOE_MATMUL, ids clamped into [0, E); unscheduled (dlight's
    Fallback rule schedules it)."""
    if qtype not in GPU_LAYOUTS:
        raise CompileError(f"Weights of type {qtype} have no GPU kernel yet (GPU layouts: {', '.join(GPU_LAYOUTS)}).")
    n = tirx.Var("n", "int64") if tokens is None else i64(tokens)
    x = te.placeholder((n, i64(k), i64(K)) if per_slot else (n, i64(K)), "float32", name="x")
    ids = te.placeholder((n, i64(k)), "int32", name="ids")
    parts, weight = gpu_weight_parts(qtype, E * N, K, scale_prefixes)
    c = te.reduce_axis((i64(0), i64(K)), name="c")

    def row(t, j, o):
        return tirx.Cast("int64", tirx.max(0, tirx.min(ids[t, j], E - 1))) * i64(N) + o

    def value(t, j, c):
        return x[t, j, c] if per_slot else x[t, c]

    y = te.compute((n, i64(k), i64(N)), lambda t, j, o: te.sum(value(t, j, c) * weight(row(t, j, o), c), axis=c),
                   name="moe_matmul")
    func = te.create_prim_func([x, ids, *parts, y])
    name = f"gpu_moe_matmul_{qtype}_{E}_{N}_{K}_{k}_{int(per_slot)}" + ("" if tokens is None else f"_{tokens}")
    return func.with_attr("dlight.do_not_tensorize", True).with_attr("global_symbol", name)
