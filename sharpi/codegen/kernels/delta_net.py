"""The Gated DeltaNet kernels (sharpi.common.ops' delta_conv, delta_rule and state_copy) for the CPU, in float32.

A hybrid model's recurrent state lives in one pool, [slots, recurrent layers, width] f32: per sequence (slot) and
DeltaNet layer, the conv's last K - 1 inputs ([K - 1, C], row by row) and then the delta rule's matrix per v-head
([H_v, d_k, d_v], d_v contiguous). Each token names its slot, so one call serves a prompt (every token the same
slot, in order) and a decode batch (one token of each of n sequences) alike; the tokens of one sequence must come
together and in order. Slots are clamped into the pool: a bad slot reads and writes a wrong sequence's state, never
memory outside the pool.
"""
from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from .common import LANES, token_count


def _slot(slots, t, count):
    """Token t's slot, clamped into the pool's `count` slots (the GPU kernels' too)."""
    return T.min(T.max(T.Cast("int64", slots[t]), T.int64(0)), count - 1)


CONV_BLOCK = 64      # channels a task takes: its tokens' rows are read as contiguous vectors of this many


def make_delta_conv(channels: int, kernel: int, layers: int, width: int, tokens: int | None = None):
    """PrimFunc (states [S, R, W], mixed [n, C], weight [C, K], slots [n] int32, layer: int64, out [n, C]): the
    causal depthwise conv (ggml_ssm_conv) of each token over its sequence's last K - 1 inputs and itself,
    out[t, c] = sum_w window[w, c] * weight[c, w]; then every sequence's window moves on to its last K - 1 inputs.

    A token's earlier inputs are the tokens before it in the call with the same slot (a prompt's run) and, past
    those, its slot's window; so outputs read the windows as they were, and the windows are written after, each
    from the last token of its run. Parallel over blocks of CONV_BLOCK channels, the channels in vectors."""
    n = token_count(tokens)
    S = tirx.Var("slots", "int64")
    C, K = channels, kernel
    block = CONV_BLOCK if C % CONV_BLOCK == 0 else 1
    lanes = min(block, 16)

    @T.prim_func
    def delta_conv(var_states: T.handle, var_mixed: T.handle, var_weight: T.handle, var_slots: T.handle,
                   layer: T.int64, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        states = T.match_buffer(var_states, (S, layers, width), "float32")
        mixed = T.match_buffer(var_mixed, (n, C), "float32")
        weight = T.match_buffer(var_weight, (C, K), "float32")
        slots = T.match_buffer(var_slots, (n,), "int32")
        out = T.match_buffer(var_out, (n, C), "float32")
        for cb in T.parallel(C // block):
            run = T.decl_buffer((n,), "int32", scope="global")         # earlier tokens of the token's run
            w_t = T.decl_buffer((K, block), "float32", scope="global")  # this block's weights, tap by tap
            keep = T.decl_buffer((K - 1, block), "float32", scope="global")
            for t in range(n):
                run[t] = T.if_then_else(t > 0, T.if_then_else(slots[t] == slots[T.max(t - 1, 0)],
                                                              run[T.max(t - 1, 0)] + 1, 0), 0)
            for w in range(K):
                for ci in range(block):
                    w_t[w, ci] = weight[cb * block + ci, w]
            for t in range(n):
                s = T.meta_var(_slot(slots, t, S))
                for co in range(block // lanes):
                    for cv in T.vectorized(lanes):
                        ci = T.meta_var(co * lanes + cv)
                        c = T.meta_var(cb * block + ci)
                        out[t, c] = mixed[t, c] * w_t[K - 1, ci]
                for w in range(K - 1):
                    back = T.meta_var(K - 1 - w)           # how many inputs back tap w reads
                    for co in range(block // lanes):
                        for cv in T.vectorized(lanes):
                            ci = T.meta_var(co * lanes + cv)
                            c = T.meta_var(cb * block + ci)
                            out[t, c] = out[t, c] + w_t[w, ci] * T.if_then_else(
                                back <= run[t], mixed[T.max(t - back, 0), c],
                                states[s, layer, (K - 1 - (back - run[t])) * C + c])
            for t in range(n):
                if t == n - 1 or slots[T.min(t + 1, n - 1)] != slots[t]:       # the last token of its run
                    s = T.meta_var(_slot(slots, t, S))
                    for j in range(K - 1):
                        back = T.meta_var(K - 2 - j)      # the window's row j: this many inputs before t
                        for ci in range(block):
                            c = T.meta_var(cb * block + ci)
                            keep[j, ci] = T.if_then_else(back <= run[t], mixed[T.max(t - back, 0), c],
                                                         states[s, layer, (K - 1 - (back - run[t])) * C + c])
                    for j in range(K - 1):
                        for ci in range(block):
                            states[s, layer, j * C + cb * block + ci] = keep[j, ci]

    return delta_conv


def make_delta_rule(k_heads: int, v_heads: int, head_dim: int, layers: int, width: int, offset: int,
                    grouped: bool, tokens: int | None = None):
    """PrimFunc (states [S, R, W], q [n, H_k, d], k [n, H_k, d], v [n, H_v, d], g [n, H_v], beta [n, H_v],
    slots [n] int32, layer: int64, out [n, H_v, d]): the gated delta rule (ggml_gated_delta_net) per v-head, token
    by token, on the matrix at `offset` of the token's slot: S <- exp(g) S; delta = beta (v - S^T k);
    S <- S + k delta^T; out = S^T q / sqrt(d). v-head h reads k-head h // (H_v / H_k) when `grouped` (qwen3next),
    else h % H_k (qwen35). Parallel over v-heads; each pass over S runs along d_v in vectors."""
    n = token_count(tokens)
    S = tirx.Var("slots", "int64")
    d = head_dim
    ratio = v_heads // k_heads
    scale = 1.0 / math.sqrt(d)
    lanes = LANES if d % LANES == 0 else 1

    def k_head(h):
        return h // ratio if grouped else h % k_heads

    @T.prim_func
    def delta_rule(var_states: T.handle, var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle,
                   var_beta: T.handle, var_slots: T.handle, layer: T.int64, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        states = T.match_buffer(var_states, (S, layers, width), "float32")
        q = T.match_buffer(var_q, (n, k_heads, d), "float32")
        k = T.match_buffer(var_k, (n, k_heads, d), "float32")
        v = T.match_buffer(var_v, (n, v_heads, d), "float32")
        g = T.match_buffer(var_g, (n, v_heads), "float32")
        beta = T.match_buffer(var_beta, (n, v_heads), "float32")
        slots = T.match_buffer(var_slots, (n,), "int32")
        out = T.match_buffer(var_out, (n, v_heads, d), "float32")
        for h in T.parallel(v_heads):
            sk = T.decl_buffer((d,), "float32", scope="global")
            delta = T.decl_buffer((d,), "float32", scope="global")
            acc = T.decl_buffer((d,), "float32", scope="global")
            for t in range(n):
                s = T.meta_var(_slot(slots, t, S))
                base = T.meta_var(offset + h * d * d)
                decay = T.meta_var(T.exp(g[t, h]))
                kh = T.meta_var(k_head(h))
                for jo in range(d // lanes):
                    for ji in T.vectorized(lanes):
                        sk[jo * lanes + ji] = T.float32(0)
                        acc[jo * lanes + ji] = T.float32(0)
                for i in range(d):
                    for jo in range(d // lanes):
                        for ji in T.vectorized(lanes):
                            j = T.meta_var(jo * lanes + ji)
                            states[s, layer, base + i * d + j] = states[s, layer, base + i * d + j] * decay
                            sk[j] = sk[j] + states[s, layer, base + i * d + j] * k[t, kh, i]
                for jo in range(d // lanes):
                    for ji in T.vectorized(lanes):
                        j = T.meta_var(jo * lanes + ji)
                        delta[j] = beta[t, h] * (v[t, h, j] - sk[j])
                for i in range(d):
                    for jo in range(d // lanes):
                        for ji in T.vectorized(lanes):
                            j = T.meta_var(jo * lanes + ji)
                            states[s, layer, base + i * d + j] = (states[s, layer, base + i * d + j]
                                                                  + k[t, kh, i] * delta[j])
                            acc[j] = acc[j] + states[s, layer, base + i * d + j] * q[t, kh, i]
                for jo in range(d // lanes):
                    for ji in T.vectorized(lanes):
                        j = T.meta_var(jo * lanes + ji)
                        out[t, h, j] = acc[j] * T.float32(scale)

    return delta_rule


def make_state_copy(layers: int, width: int):
    """PrimFunc (states [S, R, W], pair [2] int32): slot pair[1] becomes a copy of slot pair[0] (a fork's state;
    slot 0, never written, is the empty state a new sequence starts from). Parallel over layers."""
    S = tirx.Var("slots", "int64")

    @T.prim_func
    def state_copy(var_states: T.handle, var_pair: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        states = T.match_buffer(var_states, (S, layers, width), "float32")
        pair = T.match_buffer(var_pair, (2,), "int32")
        for r in T.parallel(layers):
            for w in range(width):
                states[_slot(pair, 1, S), r, w] = states[_slot(pair, 0, S), r, w]

    return state_copy
