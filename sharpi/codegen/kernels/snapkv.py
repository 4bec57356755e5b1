"""SnapKV's kernels: score prompt positions from the last window of queries, pool and select keep sets, and
gather the kept slots of the paged KV cache to the front.

Semantics (sharpi.testing.snapkv holds the numpy reference):
- score: for each of the last W queries of the chunk (W = min(|window|, n)), softmax over the slots it sees
  (causal), summed over those queries and averaged over the query heads of each KV head -> [kv_heads, slots];
  a negative window takes the maximum over those queries and query heads instead (KVzip's reduction: the most
  attention any one query gives a slot).
- select: per row (one row per layer and KV head, or one shared row = the sum of all rows), pool over
  neighbouring positions (max or avg with odd kernel K, zero-padded: avg divides by K; none = K 1), keep the
  first `sinks` positions (attention sinks, default 0), the last `recency` positions and the top
  (budget - recency - sinks) of the candidates between them ([sinks, total - recency)) by pooled score, ties to
  the lower index, ascending (sinks, then the selected, then the recency tail). Pooling runs over all positions,
  sinks and tail included; only the candidates change. Selection is a radix select on the float bits (scores are
  >= 0), linear in the prompt length.
- compact: slot keep[l, h, i] -> slot i, per layer and KV head, in place (keep is increasing, so a slot is never
  overwritten before it is read).
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.ops import (P_BUDGET, P_KERNEL, P_POOLING, P_RECENCY, P_SHARED, P_SINKS, P_TOTAL, POOL_AVG,
                           POOL_MAX, SELECT_PARAMS)
from ...common.kv_format import KVFormat
from .common import LANES, NEG_INF, score_reduce, score_width, token_count
from .kv_rows import with_pool_rows
from .paged_attention import fast_exp


def make_snapkv_score(heads: int, kv_heads: int, head_dim: int, page_size: int, max_pages: int, scale: float,
                      kv_dtype="float32"):
    """PrimFunc (q [n, H, D], pool, page_table, kv_lens, layer, window [1] int32, out [KVH, max_pages*page]);
    kv_dtype: the pool's element type or a KVFormat.

    One task per query head: for each window query, its logits over the visible slots go to a row buffer
    (q . k eight lanes at a time), then one max, one vectorized exp pass and one sum (each logit computed once: a
    scored prefill is otherwise dominated by these dots). Per-head rows are summed into the KV head's row at the end, in head order, so the result does not depend on threads."""
    fmt = KVFormat.of(kv_dtype, kv_heads, page_size, head_dim)
    if head_dim % LANES:
        assert not fmt.packed, fmt     # quantized KV types need head_dim % 32 == 0
        return _snapkv_score_scalar(heads, kv_heads, head_dim, page_size, max_pages, scale, fmt.k)
    n = token_count(None)
    pages, layers = T.int64(), T.int64()
    group = heads // kv_heads
    slots = max_pages * page_size
    DC = head_dim // LANES
    page_keys = fmt.page_scaled_keys
    key_codec = fmt.codec(0)
    page_scales_shape = (key_codec.page_scratch_rows, head_dim) if page_keys else (1,)

    @T.macro
    def logit(keys, q, t, h, page, kvh, s, dv, row, st):
        """row[s] = q[t, h] . the key of slot s (eight lanes at a time), and the row's running max."""
        for l in T.vectorized(LANES):
            dv[l] = q[t, h, l] * keys.load(0, page, kvh, s % page_size, l)
        for dc in T.unroll(DC - 1):
            for l in T.vectorized(LANES):
                dv[l] = dv[l] + q[t, h, (dc + 1) * LANES + l] \
                    * keys.load(0, page, kvh, s % page_size, (dc + 1) * LANES + l)
        row[s] = (((dv[0] + dv[1]) + (dv[2] + dv[3])) + ((dv[4] + dv[5]) + (dv[6] + dv[7]))) * T.float32(scale)
        st[0] = T.max(st[0], row[s])

    @T.macro
    def score(rows, q, page_table, kv_lens, layer, window, out):
        part = T.decl_buffer((heads, slots), "float32", scope="global")
        for h in T.parallel(heads):
            kvh = T.meta_var(h // group)
            row = T.decl_buffer((slots + LANES,), "float32", scope="global")
            dv = T.decl_buffer((LANES,), "float32", scope="global")
            st = T.decl_buffer((2,), "float32", scope="global")  # row max, row sum
            page_scales = T.decl_buffer(page_scales_shape, "float32", scope="global")
            for s in range(slots):
                part[h, s] = T.float32(0)
            for w in range(T.min(T.Cast("int64", score_width(window)), n)):
                t = T.meta_var(n - T.min(T.Cast("int64", score_width(window)), n) + w)
                total = T.meta_var(T.Cast("int64", kv_lens[layer]) + t + 1)
                st[0] = T.float32(NEG_INF)
                if page_keys:
                    # a page's side data once (the codec's cpu_read_page), for its slots
                    for i in range((total + page_size - 1) // page_size):
                        page = T.meta_var(T.Cast("int64", page_table[layer, i]))
                        key_codec.cpu_read_page(rows, page_scales, page, kvh)
                        keys = T.meta_var(key_codec.cpu_page_keys(rows, page_scales))
                        for o in range(T.min(total - i * page_size, page_size)):
                            logit(keys, q, t, h, page, kvh, i * page_size + o, dv, row, st)
                else:
                    for s in range(total):
                        page = T.meta_var(T.Cast("int64", page_table[layer, s // page_size]))
                        logit(rows, q, t, h, page, kvh, s, dv, row, st)
                for c in range((total + LANES - 1) // LANES):
                    for l in T.vectorized(LANES):
                        row[c * LANES + l] = fast_exp(row[c * LANES + l] - st[0])
                st[1] = T.float32(0)
                for s in range(total):
                    st[1] = st[1] + row[s]
                for s in range(total):
                    part[h, s] = score_reduce(window, part[h, s], row[s] / st[1])
        for kvh in T.parallel(kv_heads):
            for s in range(slots):
                out[kvh, s] = T.float32(0)
            for g in range(group):
                for s in range(slots):
                    out[kvh, s] = score_reduce(window, out[kvh, s], part[kvh * group + g, s])
            for s in range(slots):
                out[kvh, s] = T.if_then_else(window[0] < 0, out[kvh, s], out[kvh, s] / T.float32(group))

    @T.prim_func
    def snapkv_score(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle, layer: T.int64,
                     var_window: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, fmt.pool_shape(pages), fmt.pool_dtype)
        page_table = T.match_buffer(var_pt, (layers, max_pages), "int32")
        kv_lens = T.match_buffer(var_lens, (layers,), "int32")
        window = T.match_buffer(var_window, (1,), "int32")
        out = T.match_buffer(var_out, (kv_heads, slots), "float32")
        with_pool_rows(pool, fmt, score, q, page_table, kv_lens, layer, window, out)

    return snapkv_score


def _snapkv_score_scalar(heads, kv_heads, head_dim, page_size, max_pages, scale, kv_dtype):
    """The scalar form, for head sizes that are not a multiple of the vector width: every dot twice (once for
    the softmax's max and sum, once for the probabilities), one task per KV head."""
    n = token_count(None)
    pages, layers = T.int64(), T.int64()
    group = heads // kv_heads
    slots = max_pages * page_size

    @T.prim_func
    def snapkv_score(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle, layer: T.int64,
                     var_window: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, (pages, 2, kv_heads, page_size, head_dim), kv_dtype)
        page_table = T.match_buffer(var_pt, (layers, max_pages), "int32")
        kv_lens = T.match_buffer(var_lens, (layers,), "int32")
        window = T.match_buffer(var_window, (1,), "int32")
        out = T.match_buffer(var_out, (kv_heads, slots), "float32")
        for kvh in T.parallel(kv_heads):
            st = T.decl_buffer((4,), "float32", scope="global")  # running max, running sum, logit, dot
            for s in range(slots):
                out[kvh, s] = T.float32(0)
            for w in range(T.min(T.Cast("int64", score_width(window)), n)):
                for g in range(group):
                    t = T.meta_var(n - T.min(T.Cast("int64", score_width(window)), n) + w)
                    h = T.meta_var(kvh * group + g)
                    st[0] = T.float32(NEG_INF)
                    st[1] = T.float32(0)
                    for s in range(T.Cast("int64", kv_lens[layer]) + t + 1):
                        st[3] = T.float32(0)
                        for d in range(head_dim):
                            st[3] = st[3] + q[t, h, d] * T.Cast("float32", pool[T.Cast("int64", page_table[layer, s // page_size]),
                                                              0, kvh, s % page_size, d])
                        st[2] = st[3] * T.float32(scale)
                        st[1] = st[1] * T.exp(st[0] - T.max(st[0], st[2])) + T.exp(st[2] - T.max(st[0], st[2]))
                        st[0] = T.max(st[0], st[2])
                    for s in range(T.Cast("int64", kv_lens[layer]) + t + 1):
                        st[3] = T.float32(0)
                        for d in range(head_dim):
                            st[3] = st[3] + q[t, h, d] * T.Cast("float32", pool[T.Cast("int64", page_table[layer, s // page_size]),
                                                              0, kvh, s % page_size, d])
                        out[kvh, s] = T.if_then_else(
                            window[0] < 0, T.max(out[kvh, s], T.exp(st[3] * T.float32(scale) - st[0]) / st[1]),
                            out[kvh, s] + T.exp(st[3] * T.float32(scale) - st[0]) / st[1] / T.float32(group))

    return snapkv_score


def make_snapkv_select(layers: int, kv_heads: int, slots: int):
    """PrimFunc (scores [L, KVH, S], params [SELECT_PARAMS] int32, keep [L, KVH, S] int32, base,
    pooled [L, KVH, S] f32).

    keep[l, h, :budget] receives the ascending keep set; base and pooled are scratch outputs. The caller
    guarantees sinks + recency < budget < total (SnapKVSettings' checks and the session's eviction rule)."""
    rows = layers * kv_heads

    @T.prim_func
    def snapkv_select(scores: T.Buffer((layers, kv_heads, slots), "float32"),
                      params: T.Buffer((SELECT_PARAMS,), "int32"),
                      keep: T.Buffer((layers, kv_heads, slots), "int32"),
                      base: T.Buffer((layers, kv_heads, slots), "float32"),
                      pooled: T.Buffer((layers, kv_heads, slots), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        for r in T.parallel(T.if_then_else(params[P_SHARED] == 1, 1, rows)):
            l = T.meta_var(r // kv_heads)
            h = T.meta_var(r % kv_heads)
            st = T.decl_buffer((8,), "int32", scope="global")
            acc = T.decl_buffer((1,), "float32", scope="global")
            # 1. the row's raw scores (the sum over all layers and heads when shared)
            for s in range(params[P_TOTAL]):
                if params[P_SHARED] == 1:
                    acc[0] = T.float32(0)
                    for rr in range(rows):
                        acc[0] = acc[0] + scores[rr // kv_heads, rr % kv_heads, s]
                    base[l, h, s] = acc[0]
                else:
                    base[l, h, s] = scores[l, h, s]
            # 2. pooling over neighbours [s - K/2, s + K/2], zero padded (over every position, sinks included)
            for s in range(params[P_TOTAL]):
                acc[0] = T.float32(0)
                for j in range(params[P_KERNEL]):
                    if s - params[P_KERNEL] // 2 + j >= 0 and s - params[P_KERNEL] // 2 + j < params[P_TOTAL]:
                        if params[P_POOLING] == 1:
                            acc[0] = T.max(acc[0], base[l, h, s - params[P_KERNEL] // 2 + j])
                        else:
                            acc[0] = acc[0] + base[l, h, s - params[P_KERNEL] // 2 + j]
                if params[P_POOLING] == 2:
                    pooled[l, h, s] = acc[0] / T.Cast("float32", params[P_KERNEL])
                elif params[P_POOLING] == 1:
                    pooled[l, h, s] = acc[0]
                else:
                    pooled[l, h, s] = base[l, h, s]
            # 3. the first `sinks` positions always
            for i in range(params[P_SINKS]):
                keep[l, h, i] = i
            # 4. radix select of the k-th largest pooled score among candidates [sinks, total - recency)
            st[0] = params[P_TOTAL] - params[P_RECENCY]                        # end of the candidates
            st[1] = params[P_BUDGET] - params[P_RECENCY] - params[P_SINKS]     # k
            st[2] = 0                                          # threshold bits, built from the top bit down
            for bit in range(31):
                st[3] = 0
                for s in range(params[P_SINKS], st[0]):
                    if T.reinterpret("int32", pooled[l, h, s]) >= (st[2] | T.shift_left(1, 30 - bit)):
                        st[3] = st[3] + 1
                if st[3] >= st[1]:
                    st[2] = st[2] | T.shift_left(1, 30 - bit)
            st[4] = 0                                          # count strictly above the threshold
            for s in range(params[P_SINKS], st[0]):
                if T.reinterpret("int32", pooled[l, h, s]) > st[2]:
                    st[4] = st[4] + 1
            st[5] = params[P_SINKS]                            # write position (after the sinks)
            st[6] = 0                                          # ties taken
            for s in range(params[P_SINKS], st[0]):
                if T.reinterpret("int32", pooled[l, h, s]) > st[2]:
                    keep[l, h, st[5]] = s
                    st[5] = st[5] + 1
                elif T.reinterpret("int32", pooled[l, h, s]) == st[2] and st[6] < st[1] - st[4]:
                    keep[l, h, st[5]] = s
                    st[5] = st[5] + 1
                    st[6] = st[6] + 1
            # 5. the last `recency` positions always
            for i in range(params[P_RECENCY]):
                keep[l, h, params[P_BUDGET] - params[P_RECENCY] + i] = st[0] + i
        # 6. a shared set is every layer's and head's set
        if params[P_SHARED] == 1:
            for rr in range(1, rows):
                for i in range(params[P_BUDGET]):
                    keep[rr // kv_heads, rr % kv_heads, i] = keep[0, 0, i]

    return snapkv_select


def make_kv_compact(layers: int, kv_heads: int, head_dim: int, page_size: int, max_pages: int,
                    kv_dtype="float32"):
    """PrimFunc (pool, page_table, keep [L, KVH, S] int32, count [L] int32) gathering kept slots, in place:
    slot keep[l, h, i] -> slot i for i < count[l] (a layer with count 0 is left alone). A slot moves whole: its
    key and value rows (the packed layout: its one row of bytes, quants and block scales together)."""
    pages = T.int64()
    slots = max_pages * page_size
    fmt = KVFormat.of(kv_dtype, kv_heads, page_size, head_dim)
    if fmt.page_scaled_keys:
        return _kv_compact_page_keys(fmt, layers, max_pages)
    _, parts, _, _, width = fmt.pool_shape(pages)

    @T.prim_func
    def kv_compact(var_pool: T.handle, page_table: T.Buffer((layers, max_pages), "int32"),
                   keep: T.Buffer((layers, kv_heads, slots), "int32"), count: T.Buffer((layers,), "int32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        pool = T.match_buffer(var_pool, fmt.pool_shape(pages), fmt.pool_dtype)
        for lh in T.parallel(layers * kv_heads):
            l = T.meta_var(lh // kv_heads)
            h = T.meta_var(lh % kv_heads)
            for i in range(count[l]):
                for kv in range(parts):
                    for d in T.vectorized(width):
                        pool[T.Cast("int64", page_table[l, i // page_size]), kv, h, i % page_size, d] = pool[
                            T.Cast("int64", page_table[l, keep[l, h, i] // page_size]), kv, h,
                            keep[l, h, i] % page_size, d]

    return kv_compact


def _kv_compact_page_keys(fmt: KVFormat, layers: int, max_pages: int):
    """kv_compact for page-scaled keys (q4_ch), whose side data belongs to their page: each destination page's keys
    are gathered as stored (read back through their source pages' side data) and the page encoded again
    (kv_format.gather_slots); values move by their bytes. In place, as the row form: keep is ascending, so destination page j reads pages
    j and later only, and page j's sources are all read before page j is written."""
    pages = T.int64()
    P, D = fmt.page_size, fmt.head_dim
    kv_heads, slots = fmt.kv_heads, max_pages * fmt.page_size
    value = fmt.part(1)

    @T.macro
    def compact(rows, pool, page_table, keep, count):
        for lh in T.parallel(layers * kv_heads):
            l = T.meta_var(lh // kv_heads)
            h = T.meta_var(lh % kv_heads)
            gathered = T.decl_buffer((P, D), "float32", scope="global")
            for j in range((count[l] + P - 1) // P):
                dst = T.meta_var(T.Cast("int64", page_table[l, j]))
                for o in range(T.min(count[l] - j * P, P)):
                    src_page = T.meta_var(T.Cast("int64", page_table[l, keep[l, h, j * P + o] // P]))
                    src_slot = T.meta_var(keep[l, h, j * P + o] % P)
                    for d in T.vectorized(D):
                        gathered[o, d] = rows.load(0, src_page, h, src_slot, d)
                    for b in T.vectorized(value.nbytes):
                        pool[dst, 0, h, o, value.offset + b] = pool[src_page, 0, h, src_slot, value.offset + b]
                rows.codec(0).cpu_encode_page(rows, dst, h, gathered, T.min(count[l] - j * P, P))

    @T.prim_func
    def kv_compact(var_pool: T.handle, page_table: T.Buffer((layers, max_pages), "int32"),
                   keep: T.Buffer((layers, kv_heads, slots), "int32"), count: T.Buffer((layers,), "int32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        pool = T.match_buffer(var_pool, fmt.pool_shape(pages), fmt.pool_dtype)
        with_pool_rows(pool, fmt, compact, pool, page_table, keep, count)

    return kv_compact
