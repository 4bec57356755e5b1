"""Rotary position embedding at given logical positions (llama.cpp's NORM layout, adjacent pairs, or NEOX, halves).

Angles are computed in float64, as the reference does, so positions deep in a 32k context keep their precision.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .common import token_count


def rope_pairs(layout: str, head_dim: int) -> tuple[int, int]:
    """(step, partner): pair i rotates elements (step*i, step*i + partner). llama.cpp's NORM layout pairs
    neighbours (2i, 2i+1); NEOX (GPT-NeoX, Gemma, Qwen) pairs the halves (i, i + D/2)."""
    if layout == "norm":
        return 2, 1
    if layout == "neox":
        return 1, head_dim // 2
    raise NotImplementedError(f"RoPE layout {layout!r}")


def make_rope(heads: int, head_dim: int, theta: float, layout: str = "norm", tokens: int | None = None):
    """PrimFunc (x [n, H, D] f32, pos [n] int32, y [n, H, D] f32); layout "norm" or "neox" (rope_pairs)."""
    step, partner = rope_pairs(layout, head_dim)
    half = head_dim // 2
    n = token_count(tokens)

    @T.prim_func
    def rope(var_x: T.handle, var_pos: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, heads, head_dim), "float32")
        pos = T.match_buffer(var_pos, (n,), "int32")
        y = T.match_buffer(var_y, (n, heads, head_dim), "float32")
        freq = T.decl_buffer((half,), "float64")   # theta^(-2i/D), once per call rather than per token
        for i in range(half):
            freq[i] = T.pow(T.float64(theta), T.Cast("float64", i * 2) / T.float64(head_dim) * T.float64(-1))
        for t in T.parallel(n):
            cs = T.decl_buffer((half,), "float32", scope="global")
            sn = T.decl_buffer((half,), "float32", scope="global")
            for i in range(half):
                angle = T.Cast("float64", pos[t]) * freq[i]
                cs[i] = T.Cast("float32", T.cos(angle))
                sn[i] = T.Cast("float32", T.sin(angle))
            for h in range(heads):
                for i in range(half):
                    y[t, h, step * i] = x[t, h, step * i] * cs[i] - x[t, h, step * i + partner] * sn[i]
                    y[t, h, step * i + partner] = x[t, h, step * i] * sn[i] + x[t, h, step * i + partner] * cs[i]

    return rope
