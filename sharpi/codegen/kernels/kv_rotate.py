"""A rotated KV type's rotation of every head's row (ops.KV_ROTATE): queries before attention over keys stored
rotated, attention's output over values stored rotated. The arithmetic is the codec's (rotate_row)."""
from __future__ import annotations

from tvm.script import tirx as T

from ...common import kv_codecs
from .common import token_count


def make_kv_rotate(heads: int, head_dim: int, kv_type: str, inverse: bool, tokens: int | None = None):
    """PrimFunc (x [n, H, D] f32, y [n, H, D] f32): y = Pi x per head (inverse: Pi^T x)."""
    codec = kv_codecs.codec(kv_type)
    n = token_count(tokens)

    @T.prim_func
    def kv_rotate(var_x: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        x = T.match_buffer(var_x, (n, heads, head_dim), "float32")
        y = T.match_buffer(var_y, (n, heads, head_dim), "float32")
        for th in T.parallel(n * heads):
            scratch = T.decl_buffer((2 * head_dim,), "float32", scope="global")
            codec.rotate_row(x, th // heads, th % heads, y, scratch, inverse)

    return kv_rotate
