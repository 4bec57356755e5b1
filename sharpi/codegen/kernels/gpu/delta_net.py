"""The Gated DeltaNet kernels for GPU targets (CUDA, and WGSL on Vulkan), twins of ..delta_net's CPU kernels:
the same state pool [slots, R, W] f32, each token naming its slot, tokens of one sequence in order.

delta_rule: one invocation per (v-head, column j of the head's matrix). Every step of the rule reads and writes
column j alone (S <- exp(g) S; sk_j = sum_i S[i, j] k_i; delta_j = beta (v_j - sk_j); S[:, j] += k delta_j;
out_j = sum_i S[i, j] q_i), so the invocations never wait for one another; neighbouring invocations touch
neighbouring floats of each row, so the pool is read coalesced. delta_conv: one invocation per channel.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from ..common import GPU_KERNEL_ATTRS, ceil_div, token_count
from ..delta_net import _slot

THREADS = 64


def make_gpu_delta_conv(channels: int, kernel: int, layers: int, width: int, tokens: int | None = None):
    """PrimFunc (states [S, R, W], mixed [n, C], weight [C, K], slots [n] int32, layer: int64, out [n, C])."""
    n = token_count(tokens)
    S = tirx.Var("slots", "int64")
    C, K = channels, kernel

    @T.prim_func
    def gpu_delta_conv(var_states: T.handle, var_mixed: T.handle, var_weight: T.handle, var_slots: T.handle,
                       layer: T.int64, var_out: T.handle):
        T.func_attr(GPU_KERNEL_ATTRS)
        states = T.match_buffer(var_states, (S, layers, width), "float32")
        mixed = T.match_buffer(var_mixed, (n, C), "float32")
        weight = T.match_buffer(var_weight, (C, K), "float32")
        slots = T.match_buffer(var_slots, (n,), "int32")
        out = T.match_buffer(var_out, (n, C), "float32")
        for b in T.thread_binding(ceil_div(C, THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                acc = T.alloc_buffer((1,), "float32", scope="local")
                c = T.meta_var(b * THREADS + tx)
                if c < C:
                    for t in range(n):
                        s = T.meta_var(_slot(slots, t, S))
                        acc[0] = mixed[t, c] * weight[c, K - 1]
                        for w in range(K - 1):
                            acc[0] = acc[0] + states[s, layer, w * C + c] * weight[c, w]
                        out[t, c] = acc[0]
                        for w in range(K - 2):
                            states[s, layer, w * C + c] = states[s, layer, (w + 1) * C + c]
                        states[s, layer, (K - 2) * C + c] = mixed[t, c]

    return gpu_delta_conv


def make_gpu_delta_rule(k_heads: int, v_heads: int, head_dim: int, layers: int, width: int, offset: int,
                        grouped: bool, tokens: int | None = None):
    """PrimFunc (states [S, R, W], q [n, H_k, d], k [n, H_k, d], v [n, H_v, d], g [n, H_v], beta [n, H_v],
    slots [n] int32, layer: int64, out [n, H_v, d]); the head map as ..delta_net.make_delta_rule's."""
    n = token_count(tokens)
    S = tirx.Var("slots", "int64")
    d = head_dim
    ratio = v_heads // k_heads
    scale = 1.0 / math.sqrt(d)
    columns = v_heads * d

    @T.prim_func
    def gpu_delta_rule(var_states: T.handle, var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle,
                       var_beta: T.handle, var_slots: T.handle, layer: T.int64, var_out: T.handle):
        T.func_attr(GPU_KERNEL_ATTRS)
        states = T.match_buffer(var_states, (S, layers, width), "float32")
        q = T.match_buffer(var_q, (n, k_heads, d), "float32")
        k = T.match_buffer(var_k, (n, k_heads, d), "float32")
        v = T.match_buffer(var_v, (n, v_heads, d), "float32")
        g = T.match_buffer(var_g, (n, v_heads), "float32")
        beta = T.match_buffer(var_beta, (n, v_heads), "float32")
        slots = T.match_buffer(var_slots, (n,), "int32")
        out = T.match_buffer(var_out, (n, v_heads, d), "float32")
        for b in T.thread_binding(ceil_div(columns, THREADS), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                acc = T.alloc_buffer((3,), "float32", scope="local")     # decay, sk then out, delta
                e = T.meta_var(b * THREADS + tx)
                h = T.meta_var(e // d)
                j = T.meta_var(e % d)
                kh = T.meta_var(h // ratio if grouped else h % k_heads)
                base = T.meta_var(offset + h * d * d + j)
                if e < columns:
                    for t in range(n):
                        s = T.meta_var(_slot(slots, t, S))
                        acc[0] = T.exp(g[t, h])
                        acc[1] = T.float32(0)
                        for i in range(d):
                            states[s, layer, base + i * d] = states[s, layer, base + i * d] * acc[0]
                            acc[1] = acc[1] + states[s, layer, base + i * d] * k[t, kh, i]
                        acc[2] = beta[t, h] * (v[t, h, j] - acc[1])
                        acc[1] = T.float32(0)
                        for i in range(d):
                            states[s, layer, base + i * d] = states[s, layer, base + i * d] + k[t, kh, i] * acc[2]
                            acc[1] = acc[1] + states[s, layer, base + i * d] * q[t, kh, i]
                        out[t, h, j] = acc[1] * T.float32(scale)

    return gpu_delta_rule


def make_gpu_state_copy(layers: int, width: int):
    """PrimFunc (states [S, R, W], pair [2] int32): slot pair[1] becomes a copy of slot pair[0]."""
    S = tirx.Var("slots", "int64")
    total = layers * width

    @T.prim_func
    def gpu_state_copy(var_states: T.handle, var_pair: T.handle):
        T.func_attr(GPU_KERNEL_ATTRS)
        states = T.match_buffer(var_states, (S, layers, width), "float32")
        pair = T.match_buffer(var_pair, (2,), "int32")
        for b in T.thread_binding(ceil_div(total, 256), thread="blockIdx.x"):
            for tx in T.thread_binding(256, thread="threadIdx.x"):
                e = T.meta_var(b * 256 + tx)
                if e < total:
                    states[_slot(pair, 1, S), e // width, e % width] = states[_slot(pair, 0, S), e // width,
                                                                               e % width]

    return gpu_state_copy
