"""Rotary position embedding at given logical positions (llama.cpp's NORM layout: adjacent pairs).

Angles are computed in float64, as the reference does, so positions deep in a 32k context keep their precision.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .quant_matmul import token_count


def make_rope(heads: int, head_dim: int, theta: float, layout: str = "norm", tokens: int | None = None):
    """PrimFunc (x [n, H, D] f32, pos [n] int32, y [n, H, D] f32)."""
    if layout != "norm":
        raise NotImplementedError(f"RoPE layout {layout!r}")
    half = head_dim // 2
    n = token_count(tokens)

    @T.prim_func
    def rope(var_x: T.handle, var_pos: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, heads, head_dim), "float32")
        pos = T.match_buffer(var_pos, (n,), "int32")
        y = T.match_buffer(var_y, (n, heads, head_dim), "float32")
        for t in T.parallel(n):
            cs = T.decl_buffer((half,), "float32", scope="global")
            sn = T.decl_buffer((half,), "float32", scope="global")
            for i in range(half):
                angle = T.Cast("float64", pos[t]) * T.pow(T.float64(theta), T.Cast("float64", i * 2) / T.float64(head_dim) * T.float64(-1))
                cs[i] = T.Cast("float32", T.cos(angle))
                sn[i] = T.Cast("float32", T.sin(angle))
            for h in range(heads):
                for i in range(half):
                    y[t, h, 2 * i] = x[t, h, 2 * i] * cs[i] - x[t, h, 2 * i + 1] * sn[i]
                    y[t, h, 2 * i + 1] = x[t, h, 2 * i] * sn[i] + x[t, h, 2 * i + 1] * cs[i]

    return rope
