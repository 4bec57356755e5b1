"""Elementwise kernels for GPU targets (WGSL on Vulkan), twins of CPU kernels one folder up.

rope: llama.cpp's NORM RoPE (adjacent pairs) at given positions, twin of ..rope.make_rope. Hand-scheduled: one
    invocation per (token, head, pair), 128 per workgroup. WGSL has no f64, and an f32 angle pos * inv_freq is off
    by up to ~pos * 1e-7 rad before any range reduction (0.01 rad deep in a 32k context), so the angle is
    computed in fixed point instead: each frequency is stored as F_i = round(frac(inv_freq_i / 2pi) * 2^32), a
    u32 built in Python from the float64 inv_freq the CPU kernel uses; pos * F_i in wrapping u32 arithmetic is
    the angle in turns, already reduced mod 1, and read as an i32 it lies in [-1/2, 1/2) turns, i.e. [-pi, pi),
    where Vulkan's cos and sin are accurate. Error: pos * 2^-33 turns from rounding F_i (1e-4 rad at position
    131072; 6e-6 rad at 8191) plus 2^-24 relative from the i32 -> f32 conversion.
embedding: y[t, :] = dequantized row ids[t] of the table, twin of ..quant_matmul.make_embedding but taking the
    weight parts as the GPU matmul does (quants, then each scale field as an [N, K/32] buffer of its own). A TE
    compute left unscheduled: dlight's Fallback rule binds it to threads like any elementwise op.
"""
from __future__ import annotations

import math

from tvm import te, tirx
from tvm.script import tirx as T

from ....common.errors import CompileError
from ..common import token_count
from ..rope import rope_pairs
from .quant_matmul import GPU_LAYOUTS, gpu_weight_parts, i64

ROPE_THREADS = 128


def rope_turns(head_dim: int, theta: float) -> list[int]:
    """Per rotated pair i, the angle advanced per position as a 32-bit fraction of a turn (see the module doc)."""
    fractions = [math.fmod(theta ** (-(2 * i) / head_dim) / (2 * math.pi), 1.0) for i in range(head_dim // 2)]
    return [round(f * 2.0 ** 32) % 2 ** 32 for f in fractions]


def lookup_u32(values: list[int], i, lo: int = 0, hi: int | None = None):
    """values[i] for a symbolic i as a balanced tree of selects over constants (WGSL codegen has no constant
    arrays): about log2(len) comparisons deep, no memory traffic."""
    hi = len(values) if hi is None else hi
    if hi - lo == 1:
        return T.uint32(values[lo])
    mid = (lo + hi) // 2
    return T.if_then_else(i < mid, lookup_u32(values, i, lo, mid), lookup_u32(values, i, mid, hi))


def make_gpu_rope(heads: int, head_dim: int, theta: float, layout: str = "norm",
                  tokens: int | None = None) -> tirx.PrimFunc:
    """PrimFunc (x [n, H, D] f32, pos [n] int32, y [n, H, D] f32). Layout "norm" rotates adjacent pairs
    (2i, 2i+1), "neox" the halves (i, i + D/2)."""
    half = head_dim // 2
    step, partner = rope_pairs(layout, head_dim)
    n = token_count(tokens)
    turns = rope_turns(head_dim, theta)
    rad_per_unit = 2 * math.pi / 2.0 ** 32

    @T.prim_func
    def gpu_rope(var_x: T.handle, var_pos: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True})
        x = T.match_buffer(var_x, (n, heads, head_dim), "float32")
        pos = T.match_buffer(var_pos, (n,), "int32")
        y = T.match_buffer(var_y, (n, heads, head_dim), "float32")
        for b in T.thread_binding((n * heads * half + ROPE_THREADS - 1) // ROPE_THREADS, thread="blockIdx.x"):
            for tx in T.thread_binding(ROPE_THREADS, thread="threadIdx.x"):
                cs = T.alloc_buffer((2,), "float32", scope="local")
                e = T.meta_var(b * ROPE_THREADS + tx)
                t = T.meta_var(e // (heads * half))
                h = T.meta_var(e // half % heads)
                i = T.meta_var(e % half)
                if e < n * heads * half:
                    # the angle in turns, reduced mod 1 by the wrap-around of u32 multiplication
                    phase = T.meta_var(T.reinterpret("int32", T.Cast("uint32", pos[t]) * lookup_u32(turns, i)))
                    cs[0] = T.Cast("float32", phase) * T.float32(rad_per_unit)
                    cs[1] = T.sin(cs[0])
                    cs[0] = T.cos(cs[0])
                    y[t, h, step * i] = x[t, h, step * i] * cs[0] - x[t, h, step * i + partner] * cs[1]
                    y[t, h, step * i + partner] = x[t, h, step * i] * cs[1] + x[t, h, step * i + partner] * cs[0]

    name = f"gpu_rope_{layout}_{heads}_{head_dim}" + ("" if tokens is None else f"_{tokens}")
    return gpu_rope.with_attr("global_symbol", name)


def make_gpu_embedding(qtype: str, vocab: int, dim: int, scale_prefixes: bool = False) -> tirx.PrimFunc:
    """PrimFunc (ids [n] int32, qs, scale fields (scale_fields(prefixes=scale_prefixes)), y [n, dim] f32) for quantized
    types, (ids, w, y) for dense ones; unscheduled (dlight's Fallback rule schedules it)."""
    if qtype not in GPU_LAYOUTS:
        raise CompileError(f"Weights of type {qtype} have no GPU embedding kernel yet (GPU layouts: "
                           f"{', '.join(GPU_LAYOUTS)}).")
    n = tirx.Var("n", "int64")
    ids = te.placeholder((n,), "int32", name="ids")
    parts, value = gpu_weight_parts(qtype, vocab, dim, scale_prefixes)
    y = te.compute((n, i64(dim)), lambda t, d: value(T.Cast("int64", ids[t]), d), name="embedding")
    func = te.create_prim_func([ids, *parts, y])
    return (func.with_attr("dlight.do_not_tensorize", True)
            .with_attr("global_symbol", f"gpu_embedding_{qtype}_{vocab}_{dim}"))
