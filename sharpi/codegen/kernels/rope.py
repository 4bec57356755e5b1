"""Rotary position embedding at given logical positions (llama.cpp's NORM layout, adjacent pairs, or NEOX, halves).

Angles are computed in float64, as the reference does, so positions deep in a 32k context keep their precision.
A prompt's positions are consecutive, so a token's cos and sin come from the previous token's by one rotation
(cos(a + f) = cos a cos f - sin a sin f; four float64 multiplies, vectorized) rather than one libm sincos per
frequency: each task of ROTATION_RUN tokens calls sincos for its first token only (and for any token whose position
does not follow the one before). The run is short enough that the rotations' rounding (~1e-16 a step) never
reaches float32. On gemma3's 512-token prefill the sincos calls were 5% of the time.
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


ROTATION_RUN = 16   # tokens a task takes, the first by sincos and the rest by rotation


def make_rope(heads: int, head_dim: int, theta: float, layout: str = "norm", tokens: int | None = None):
    """PrimFunc (x [n, H, D] f32, pos [n] int32, y [n, H, D] f32); layout "norm" or "neox" (rope_pairs)."""
    step, partner = rope_pairs(layout, head_dim)
    half = head_dim // 2
    n = token_count(tokens)

    runs = (n + ROTATION_RUN - 1) // ROTATION_RUN

    @T.prim_func
    def rope(var_x: T.handle, var_pos: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, heads, head_dim), "float32")
        pos = T.match_buffer(var_pos, (n,), "int32")
        y = T.match_buffer(var_y, (n, heads, head_dim), "float32")
        freq = T.decl_buffer((half,), "float64")   # theta^(-2i/D), once per call rather than per token
        step_cos = T.decl_buffer((half,), "float64")
        step_sin = T.decl_buffer((half,), "float64")
        for i in range(half):
            freq[i] = T.pow(T.float64(theta), T.Cast("float64", i * 2) / T.float64(head_dim) * T.float64(-1))
            step_cos[i] = T.cos(freq[i])
            step_sin[i] = T.sin(freq[i])
        for r in T.parallel(runs):
            cs = T.decl_buffer((half,), "float64")
            sn = T.decl_buffer((half,), "float64")
            rotated = T.decl_buffer((half,), "float64")
            for j in range(T.min(ROTATION_RUN, n - r * ROTATION_RUN)):
                t = T.meta_var(r * ROTATION_RUN + j)
                if j == 0 or pos[t] != pos[t - 1] + 1:
                    for i in range(half):
                        angle = T.Cast("float64", pos[t]) * freq[i]
                        cs[i] = T.cos(angle)
                        sn[i] = T.sin(angle)
                else:
                    for i in T.vectorized(half):
                        rotated[i] = cs[i] * step_cos[i] - sn[i] * step_sin[i]
                        sn[i] = sn[i] * step_cos[i] + cs[i] * step_sin[i]
                        cs[i] = rotated[i]
                for h in range(heads):
                    for i in range(half):
                        c32 = T.meta_var(T.Cast("float32", cs[i]))
                        s32 = T.meta_var(T.Cast("float32", sn[i]))
                        y[t, h, step * i] = x[t, h, step * i] * c32 - x[t, h, step * i + partner] * s32
                        y[t, h, step * i + partner] = x[t, h, step * i] * s32 + x[t, h, step * i + partner] * c32

    return rope
