"""The GPU twin of ..kv_rotate: a rotated KV type's rotation of every head's row, one invocation a row (the
codec's rotate_row over a private scratch)."""
from __future__ import annotations

from tvm.script import tirx as T

from ....common import kv_codecs
from ..common import ceil_div, token_count

THREADS = 64


def make_gpu_kv_rotate(heads: int, head_dim: int, kv_type: str, inverse: bool, tokens: int | None = None):
    """PrimFunc (x [n, H, D] f32, y [n, H, D] f32): y = Pi x per head (inverse: Pi^T x)."""
    codec = kv_codecs.codec(kv_type)
    n = token_count(tokens)

    @T.prim_func
    def gpu_kv_rotate(var_x: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True})
        x = T.match_buffer(var_x, (n, heads, head_dim), "float32")
        y = T.match_buffer(var_y, (n, heads, head_dim), "float32")
        for b in T.thread_binding((n * heads + THREADS - 1) // THREADS, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                scratch = T.alloc_buffer((2 * head_dim,), "float32", scope="local")
                if b * THREADS + tx < n * heads:
                    codec.rotate_row(x, (b * THREADS + tx) // heads, (b * THREADS + tx) % heads, y, scratch,
                                     inverse)

    name = f"gpu_kv_rotate_{kv_type}_{'inverse' if inverse else 'forward'}_{heads}_{head_dim}"
    return gpu_kv_rotate.with_attr("global_symbol", name + ("" if tokens is None else f"_{tokens}"))
