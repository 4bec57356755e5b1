"""Attention over the paged KV cache, and the append of new keys/values into it.

Pool layout: [pages, 2 (k, v), kv_heads, page_size, head_dim] f32, shared by all layers and sessions.
page_table [layers, max_pages] int32 maps a layer's slot s to pool page page_table[l, s // page_size].
kv_lens [layers] int32 = slots a layer held before this call; the n new tokens go to slots kv_lens[l] + t.
Query t sees slots [0, kv_lens[l] + t]: all held slots (whatever logical positions they came from, e.g. after
SnapKV compaction) plus the new tokens up to itself. Softmax is online, one page at a time, so no n x n matrix.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .quant_matmul import token_count


def make_kv_append(kv_heads: int, head_dim: int, page_size: int, tokens: int | None = None):
    """PrimFunc (pool, k [n, KVH, D], v [n, KVH, D], page_table, kv_lens, layer) writing the pool in place."""
    n = token_count(tokens)
    pages, layers, max_pages = T.int64(), T.int64(), T.int64()

    @T.prim_func
    def kv_append(var_pool: T.handle, var_k: T.handle, var_v: T.handle, var_pt: T.handle, var_lens: T.handle,
                  layer: T.int64):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        pool = T.match_buffer(var_pool, (pages, 2, kv_heads, page_size, head_dim), "float32")
        k = T.match_buffer(var_k, (n, kv_heads, head_dim), "float32")
        v = T.match_buffer(var_v, (n, kv_heads, head_dim), "float32")
        page_table = T.match_buffer(var_pt, (layers, max_pages), "int32")
        kv_lens = T.match_buffer(var_lens, (layers,), "int32")
        for t in range(n):
            slot = T.Cast("int64", kv_lens[layer]) + t
            page = T.Cast("int64", page_table[layer, slot // page_size])
            for h in range(kv_heads):
                for d in T.vectorized(head_dim):
                    pool[page, 0, h, slot % page_size, d] = k[t, h, d]
                    pool[page, 1, h, slot % page_size, d] = v[t, h, d]

    return kv_append


def make_paged_attention(heads: int, kv_heads: int, head_dim: int, page_size: int, scale: float,
                         tokens: int | None = None):
    """PrimFunc (q [n, H, D], pool, page_table, kv_lens, layer, out [n, H, D]): causal attention per query head."""
    n = token_count(tokens)
    pages, layers, max_pages = T.int64(), T.int64(), T.int64()
    group = heads // kv_heads
    neg_inf = -3.0e38

    @T.prim_func
    def paged_attention(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                        layer: T.int64, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, (pages, 2, kv_heads, page_size, head_dim), "float32")
        page_table = T.match_buffer(var_pt, (layers, max_pages), "int32")
        kv_lens = T.match_buffer(var_lens, (layers,), "int32")
        out = T.match_buffer(var_out, (n, heads, head_dim), "float32")
        for th in T.parallel(n * heads):
            t = th // heads
            h = th % heads
            kvh = h // group
            total = T.Cast("int64", kv_lens[layer]) + t + 1
            acc = T.decl_buffer((head_dim,), "float32", scope="local")
            score = T.decl_buffer((page_size,), "float32", scope="local")
            stats = T.decl_buffer((3,), "float32", scope="local")  # running max, running sum, block max
            stats[0] = T.float32(neg_inf)
            stats[1] = T.float32(0)
            for d in T.vectorized(head_dim):
                acc[d] = T.float32(0)
            for p in range((total + page_size - 1) // page_size):
                page = T.Cast("int64", page_table[layer, p])
                stats[2] = T.float32(neg_inf)
                for o in range(page_size):
                    score[o] = T.float32(neg_inf)
                    if p * page_size + o < total:
                        dot = T.decl_buffer((1,), "float32", scope="local")
                        dot[0] = T.float32(0)
                        for d in range(head_dim):
                            dot[0] = dot[0] + q[t, h, d] * pool[page, 0, kvh, o, d]
                        score[o] = dot[0] * T.float32(scale)
                        stats[2] = T.max(stats[2], score[o])
                new_max = T.max(stats[0], stats[2])
                correction = T.exp(stats[0] - new_max)
                stats[1] = stats[1] * correction
                for d in T.vectorized(head_dim):
                    acc[d] = acc[d] * correction
                for o in range(page_size):
                    if p * page_size + o < total:
                        weight = T.exp(score[o] - new_max)
                        stats[1] = stats[1] + weight
                        for d in T.vectorized(head_dim):
                            acc[d] = acc[d] + weight * pool[page, 1, kvh, o, d]
                stats[0] = new_max
            for d in T.vectorized(head_dim):
                out[t, h, d] = acc[d] / stats[1]

    return paged_attention
