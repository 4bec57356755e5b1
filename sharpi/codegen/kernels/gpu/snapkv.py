"""SnapKV's kernels for GPU targets (WGSL on Vulkan), twins of sharpi.codegen.kernels.snapkv with the same
semantics (sharpi.testing.snapkv holds the numpy reference), hand-scheduled with explicit thread bindings.

- row stats + score: a query's softmax normalizer (max and sum of exp over the slots it sees) must be known
  before its probabilities can be summed per slot, and WGSL has no grid-wide barrier, so scoring is two kernels.
  `snapkv_row_stats` gives one workgroup of 256 threads to each (query, head) of the last W queries: the threads
  stride over the query's causal slots with an online max/sum, then reduce in workgroup memory: the max first,
  then every thread's sum rescaled to it. `snapkv_score_gpu` gives one thread to each (KV head, slot): it loops
  over the W queries and the head's query heads in the CPU kernel's order and adds exp(logit - max) / sum / group.
- select: one PrimFunc with three thread-bound loop nests, i.e. three launches in order, so that every value a
  thread reads from a storage buffer was written by an earlier launch (WGSL's workgroupBarrier orders workgroup
  memory only): (1) the row's raw scores into `base` (the sum over all rows when shared), (2) pooling into
  `pooled`, (3) one workgroup of 256 threads per row: the first `sinks` positions, then a radix select of the
  k-th largest pooled score among the candidates [sinks, total - recency) on its float bits (scores are >= 0, so
  the bits order like the floats), one bit per pass with a workgroup sum of counts, then an ordered compaction:
  each thread owns a contiguous chunk of candidates, counts what it keeps, and a prefix sum in workgroup memory
  gives where it writes (after the sinks); then the last `recency` positions. Ties go to the lower index
  exactly as on the CPU. A shared keep set is selected by every row's workgroup from the one shared pooled row
  (identical work, identical result), which spares a grid-wide copy. Avg pooling divides by K like the CPU; keep sets are bit-identical where the
  device's f32 division is correctly rounded (lavapipe's is; WGSL itself allows 2.5 ULP).
- compact: one thread per (layer, KV head, K/V, d); it walks i = 0 .. count-1 in order, so slot keep[i] >= i is
  always read before slot i is overwritten (keep is strictly increasing).

WGSL has no int64: TVM narrows every index to i32, which bounds the pool at 2^31 floats.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ....common.ops import (P_BUDGET, P_KERNEL, P_POOLING, P_RECENCY, P_SHARED, P_SINKS, P_TOTAL, POOL_AVG,
                            POOL_MAX, SELECT_PARAMS)
from ..common import GPU_KERNEL_ATTRS as ATTRS
from ..common import NEG_INF, ceil_div, score_width, token_count
from .kv_rows import GpuRows

THREADS = 256                 # invocations per workgroup for the reducing kernels (WebGPU's limit)
LOG_THREADS = 8
COMPACT_THREADS = 64
# op_pattern 8: opaque to FuseOps; is_scheduled: dlight leaves the hand-written schedule alone


# -- workgroup collectives (every thread of the workgroup must reach them: they contain barriers) -------------
@T.macro(hygienic=False)
def _tree_sum(red, tx):
    """red[0] = the sum of red[0 .. THREADS), which every thread has written. One statement per step: TVM's
    ThreadSync pass would otherwise want a barrier inside the `tx < stride` branch."""
    T.tvm_storage_sync("shared")
    for step in range(LOG_THREADS):
        if tx < T.shift_right(THREADS // 2, step):
            red[tx] = red[tx] + red[tx + T.shift_right(THREADS // 2, step)]
        T.tvm_storage_sync("shared")


@T.macro(hygienic=False)
def _tree_max(red, tx):
    """red[0] = the max of red[0 .. THREADS), which every thread has written."""
    T.tvm_storage_sync("shared")
    for step in range(LOG_THREADS):
        if tx < T.shift_right(THREADS // 2, step):
            red[tx] = T.max(red[tx], red[tx + T.shift_right(THREADS // 2, step)])
        T.tvm_storage_sync("shared")


@T.macro(hygienic=False)
def _inclusive_scan(a, b, tmp, tx):
    """a and b, which every thread has written, become their inclusive prefix sums (Hillis-Steele, log steps)."""
    T.tvm_storage_sync("shared")
    for step in range(LOG_THREADS):
        tmp[0] = T.if_then_else(tx >= T.shift_left(1, step), a[tx - T.shift_left(1, step)], 0)
        tmp[1] = T.if_then_else(tx >= T.shift_left(1, step), b[tx - T.shift_left(1, step)], 0)
        T.tvm_storage_sync("shared")
        a[tx] = a[tx] + tmp[0]
        b[tx] = b[tx] + tmp[1]
        T.tvm_storage_sync("shared")


# -- score ----------------------------------------------------------------------------------------------------
def make_gpu_snapkv_row_stats(heads: int, kv_heads: int, head_dim: int, page_size: int, max_pages: int,
                              scale: float, kv_dtype="float32"):
    """PrimFunc (q [n, H, D], pool, page_table, kv_lens, layer, window [1] int32, stats [n, H, 2] f32).

    stats[t, h] = (max logit, sum of exp(logit - max)) over the slots query t sees, for the last
    W = min(window[0], n) queries; the other rows are zero. One workgroup per (query, head). kv_dtype: a KV type,
    a (key, value) pair or a KVFormat (gpu.kv_rows)."""
    n = token_count(None)
    rows = GpuRows.of(kv_dtype, kv_heads, page_size, head_dim)
    pages, layers = T.int64(), T.int64()
    group = heads // kv_heads

    @T.prim_func
    def snapkv_row_stats(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                         layer: T.int64, var_window: T.handle, var_stats: T.handle):
        T.func_attr(ATTRS)
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, rows.pool_shape(pages), rows.pool_dtype)
        page_table = T.match_buffer(var_pt, (layers, max_pages), "int32")
        kv_lens = T.match_buffer(var_lens, (layers,), "int32")
        window = T.match_buffer(var_window, (1,), "int32")
        stats = T.match_buffer(var_stats, (n, heads, 2), "float32")
        for b in T.thread_binding(n * heads, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                red_m = T.alloc_buffer((THREADS,), "float32", scope="shared")
                red_l = T.alloc_buffer((THREADS,), "float32", scope="shared")
                st = T.alloc_buffer((4,), "float32", scope="local")   # running max, running sum, logit, dot
                t = T.meta_var(b // heads)
                h = T.meta_var(b % heads)
                seen = T.meta_var(T.Cast("int64", kv_lens[layer]) + t + 1)    # slots 0 .. held + t
                st[0] = T.float32(NEG_INF)
                st[1] = T.float32(0)
                # only the last W queries; the barriers below stay outside this branch (uniform control flow)
                if t >= n - T.min(T.Cast("int64", score_width(window)), n):
                    for i in range((seen + THREADS - 1) // THREADS):
                        if i * THREADS + tx < seen:
                            s = T.meta_var(i * THREADS + tx)
                            st[3] = T.float32(0)
                            for d in range(head_dim // rows.dot_step):
                                for e in T.unroll(rows.dot_step):
                                    st[3] = st[3] + q[t, h, d * rows.dot_step + e] * rows.load(
                                        pool, 0, T.Cast("int64", page_table[layer, s // page_size]), h // group,
                                        s % page_size, d * rows.dot_step + e)
                            st[2] = st[3] * T.float32(scale)
                            st[1] = st[1] * T.exp(st[0] - T.max(st[0], st[2])) + T.exp(st[2] - T.max(st[0], st[2]))
                            st[0] = T.max(st[0], st[2])
                # the row's max first, then every thread's sum rescaled to it
                red_m[tx] = st[0]
                _tree_max(red_m, tx)
                red_l[tx] = st[1] * T.exp(st[0] - red_m[0])
                _tree_sum(red_l, tx)
                if tx == 0:
                    if t >= n - T.min(T.Cast("int64", score_width(window)), n):
                        stats[t, h, 0] = red_m[0]
                        stats[t, h, 1] = red_l[0]
                    else:
                        stats[t, h, 0] = T.float32(0)
                        stats[t, h, 1] = T.float32(0)

    return snapkv_row_stats


def make_gpu_snapkv_score(heads: int, kv_heads: int, head_dim: int, page_size: int, max_pages: int, scale: float,
                          kv_dtype="float32"):
    """PrimFunc (q [n, H, D], pool, page_table, kv_lens, layer, window [1] int32, stats [n, H, 2],
    out [KVH, max_pages*page]); stats from make_gpu_snapkv_row_stats. One thread per (KV head, slot)."""
    n = token_count(None)
    rows = GpuRows.of(kv_dtype, kv_heads, page_size, head_dim)
    pages, layers = T.int64(), T.int64()
    group = heads // kv_heads
    slots = max_pages * page_size
    slot_blocks = ceil_div(slots, THREADS)

    @T.prim_func
    def snapkv_score_gpu(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                         layer: T.int64, var_window: T.handle, var_stats: T.handle, var_out: T.handle):
        T.func_attr(ATTRS)
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, rows.pool_shape(pages), rows.pool_dtype)
        page_table = T.match_buffer(var_pt, (layers, max_pages), "int32")
        kv_lens = T.match_buffer(var_lens, (layers,), "int32")
        window = T.match_buffer(var_window, (1,), "int32")
        stats = T.match_buffer(var_stats, (n, heads, 2), "float32")
        out = T.match_buffer(var_out, (kv_heads, slots), "float32")
        for b in T.thread_binding(kv_heads * slot_blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                acc = T.alloc_buffer((2,), "float32", scope="local")   # probability sum, dot
                kvh = T.meta_var(b // slot_blocks)
                s = T.meta_var(b % slot_blocks * THREADS + tx)
                w_len = T.meta_var(T.min(T.Cast("int64", score_width(window)), n))
                if s < slots:
                    acc[0] = T.float32(0)
                    for w in range(w_len):
                        t = T.meta_var(n - w_len + w)
                        # causal: query t sees slots 0 .. held + t
                        if T.Cast("int64", s) <= T.Cast("int64", kv_lens[layer]) + t:
                            for g in range(group):
                                acc[1] = T.float32(0)
                                for d in range(head_dim // rows.dot_step):
                                    for e in T.unroll(rows.dot_step):
                                        acc[1] = acc[1] + q[t, kvh * group + g, d * rows.dot_step + e] * rows.load(
                                            pool, 0, T.Cast("int64", page_table[layer, s // page_size]), kvh,
                                            s % page_size, d * rows.dot_step + e)
                                p = T.meta_var(T.exp(acc[1] * T.float32(scale) - stats[t, kvh * group + g, 0])
                                               / stats[t, kvh * group + g, 1])
                                acc[0] = T.if_then_else(window[0] < 0, T.max(acc[0], p),
                                                        acc[0] + p / T.float32(group))
                    out[kvh, s] = acc[0]

    return snapkv_score_gpu


# -- select ---------------------------------------------------------------------------------------------------
def make_gpu_snapkv_select(layers: int, kv_heads: int, slots: int):
    """PrimFunc (scores [L, KVH, S] f32, params [SELECT_PARAMS] int32, keep [L, KVH, S] int32, base,
    pooled [L, KVH, S] f32),
    the CPU kernel's signature: keep[l, h, :budget] receives the ascending keep set; base and pooled are scratch
    (when shared only row (0, 0) of them is written). Three launches (see the module docstring)."""
    rows = layers * kv_heads
    slot_blocks = ceil_div(slots, THREADS)

    @T.prim_func
    def snapkv_select_gpu(scores: T.Buffer((layers, kv_heads, slots), "float32"),
                          params: T.Buffer((SELECT_PARAMS,), "int32"),
                          keep: T.Buffer((layers, kv_heads, slots), "int32"),
                          base: T.Buffer((layers, kv_heads, slots), "float32"),
                          pooled: T.Buffer((layers, kv_heads, slots), "float32")):
        T.func_attr(ATTRS)
        # 1. each row's raw scores; when shared, row 0 holds the sum over all rows (in row order, as the CPU)
        for b in T.thread_binding(rows * slot_blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                acc = T.alloc_buffer((1,), "float32", scope="local")
                r = T.meta_var(b // slot_blocks)
                s = T.meta_var(b % slot_blocks * THREADS + tx)
                if s < params[P_TOTAL]:
                    if params[P_SHARED] == 1:
                        if r == 0:
                            acc[0] = T.float32(0)
                            for rr in range(rows):
                                acc[0] = acc[0] + scores[rr // kv_heads, rr % kv_heads, s]
                            base[0, 0, s] = acc[0]
                    else:
                        base[r // kv_heads, r % kv_heads, s] = scores[r // kv_heads, r % kv_heads, s]
        # 2. pooling over neighbours [s - K/2, s + K/2], zero padded, summed in the CPU kernel's order
        for b in T.thread_binding(rows * slot_blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                acc = T.alloc_buffer((1,), "float32", scope="local")
                r = T.meta_var(b // slot_blocks)
                s = T.meta_var(b % slot_blocks * THREADS + tx)
                l = T.meta_var(r // kv_heads)
                h = T.meta_var(r % kv_heads)
                half = T.meta_var(params[P_KERNEL] // 2)
                if s < params[P_TOTAL] and (params[P_SHARED] == 0 or r == 0):
                    acc[0] = T.float32(0)
                    for j in range(params[P_KERNEL]):
                        if s - half + j >= 0 and s - half + j < params[P_TOTAL]:
                            if params[P_POOLING] == POOL_MAX:
                                acc[0] = T.max(acc[0], base[l, h, s - half + j])
                            else:
                                acc[0] = acc[0] + base[l, h, s - half + j]
                    if params[P_POOLING] == POOL_AVG:
                        pooled[l, h, s] = acc[0] / T.Cast("float32", params[P_KERNEL])
                    elif params[P_POOLING] == POOL_MAX:
                        pooled[l, h, s] = acc[0]
                    else:
                        pooled[l, h, s] = base[l, h, s]
        # 3. per row: the sinks, then a radix select of the k-th largest pooled bits among the candidates
        #    [sinks, total - recency) and the ordered compaction (written after the sinks), then the recency tail
        for r in T.thread_binding(rows, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                red = T.alloc_buffer((THREADS,), "int32", scope="shared")
                above = T.alloc_buffer((THREADS,), "int32", scope="shared")
                ties = T.alloc_buffer((THREADS,), "int32", scope="shared")
                # candidate count, k, threshold bits, count, my above, my ties, write position, ties seen
                st = T.alloc_buffer((8,), "int32", scope="local")
                tmp = T.alloc_buffer((2,), "int32", scope="local")
                src = T.meta_var(T.if_then_else(params[P_SHARED] == 1, 0, r))     # the row whose scores select
                sl = T.meta_var(src // kv_heads)
                sh = T.meta_var(src % kv_heads)
                sinks = T.meta_var(params[P_SINKS])                # candidate j is position sinks + j
                st[0] = params[P_TOTAL] - params[P_RECENCY] - sinks
                st[1] = params[P_BUDGET] - params[P_RECENCY] - sinks
                st[2] = 0
                # the first `sinks` positions always
                for i in range((sinks + THREADS - 1) // THREADS):
                    if i * THREADS + tx < sinks:
                        keep[r // kv_heads, r % kv_heads, i * THREADS + tx] = i * THREADS + tx
                # the threshold is built from the top bit down (bit 31, the sign, is 0 for scores >= 0): keep a
                # bit when at least k candidates are >= the threshold with it set
                for bit in range(31):
                    st[3] = 0
                    for i in range((st[0] + THREADS - 1) // THREADS):
                        if i * THREADS + tx < st[0]:
                            if T.reinterpret("int32", pooled[sl, sh, sinks + i * THREADS + tx]) >= (
                                    st[2] | T.shift_left(1, 30 - bit)):
                                st[3] = st[3] + 1
                    red[tx] = st[3]
                    _tree_sum(red, tx)
                    # a select, not a branch: TVM's ThreadSync pass takes no shared-memory read in a condition
                    st[2] = T.if_then_else(red[0] >= st[1], st[2] | T.shift_left(1, 30 - bit), st[2])
                    T.tvm_storage_sync("shared")       # everyone has read red[0] before the next pass writes red
                # each thread's contiguous chunk of candidates: how many lie above the threshold, how many on it
                chunk = T.meta_var((st[0] + THREADS - 1) // THREADS)
                st[4] = 0
                st[5] = 0
                for i in range(chunk):
                    if tx * chunk + i < st[0]:
                        if T.reinterpret("int32", pooled[sl, sh, sinks + tx * chunk + i]) > st[2]:
                            st[4] = st[4] + 1
                        elif T.reinterpret("int32", pooled[sl, sh, sinks + tx * chunk + i]) == st[2]:
                            st[5] = st[5] + 1
                above[tx] = st[4]
                ties[tx] = st[5]
                _inclusive_scan(above, ties, tmp, tx)
                # ties are taken lowest index first: k - (all above) of them
                st[3] = st[1] - above[THREADS - 1]
                st[7] = ties[tx] - st[5]                                   # ties in earlier chunks
                st[6] = sinks + above[tx] - st[4] + T.min(st[7], st[3])    # after the sinks and earlier chunks
                for i in range(chunk):
                    if tx * chunk + i < st[0]:
                        if T.reinterpret("int32", pooled[sl, sh, sinks + tx * chunk + i]) > st[2]:
                            keep[r // kv_heads, r % kv_heads, st[6]] = sinks + tx * chunk + i
                            st[6] = st[6] + 1
                        elif T.reinterpret("int32", pooled[sl, sh, sinks + tx * chunk + i]) == st[2]:
                            if st[7] < st[3]:
                                keep[r // kv_heads, r % kv_heads, st[6]] = sinks + tx * chunk + i
                                st[6] = st[6] + 1
                            st[7] = st[7] + 1
                # the last `recency` positions always
                for i in range((params[P_RECENCY] + THREADS - 1) // THREADS):
                    if i * THREADS + tx < params[P_RECENCY]:
                        keep[r // kv_heads, r % kv_heads, sinks + st[1] + i * THREADS + tx] = \
                            sinks + st[0] + i * THREADS + tx

    return snapkv_select_gpu


# -- compact --------------------------------------------------------------------------------------------------
def make_gpu_kv_compact(layers: int, kv_heads: int, head_dim: int, page_size: int, max_pages: int,
                        kv_dtype="float32"):
    """PrimFunc (pool, page_table [L, max_pages], keep [L, KVH, S] int32, count [L] int32), pool written in place:
    slot keep[l, h, i] -> slot i for i < count[l]. One thread per (layer, KV head, K/V, d) of the plain layout,
    or per (layer, KV head, word) of a packed one (a row moves whole, quants and scales), i in order."""
    pages = T.int64()
    slots = max_pages * page_size
    rows = GpuRows.of(kv_dtype, kv_heads, page_size, head_dim)
    if rows.fmt.page_scaled_keys:
        return _compact_page_keys(rows, layers, max_pages)
    parts, width = rows.row_units
    lanes = layers * kv_heads * parts * width
    blocks = ceil_div(lanes, COMPACT_THREADS)

    @T.prim_func
    def kv_compact_gpu(var_pool: T.handle, page_table: T.Buffer((layers, max_pages), "int32"),
                       keep: T.Buffer((layers, kv_heads, slots), "int32"), count: T.Buffer((layers,), "int32")):
        T.func_attr(ATTRS)
        pool = T.match_buffer(var_pool, rows.pool_shape(pages), rows.pool_dtype)
        for b in T.thread_binding(blocks, thread="blockIdx.x"):
            for tx in T.thread_binding(COMPACT_THREADS, thread="threadIdx.x"):
                lane = T.meta_var(b * COMPACT_THREADS + tx)    # d fastest: neighbouring threads, neighbouring words
                d = T.meta_var(lane % width)
                kv = T.meta_var(lane // width % parts)
                h = T.meta_var(lane // (parts * width) % kv_heads)
                l = T.meta_var(lane // (parts * width * kv_heads))
                if lane < lanes:
                    for i in range(count[l]):
                        pool[T.Cast("int64", page_table[l, i // page_size]), kv, h, i % page_size, d] = pool[
                            T.Cast("int64", page_table[l, keep[l, h, i] // page_size]), kv, h,
                            keep[l, h, i] % page_size, d]

    return kv_compact_gpu


def _compact_page_keys(rows: GpuRows, layers: int, max_pages: int):
    """kv_compact for q4_ch keys, whose scales belong to their page (the twin of the CPU kernel
    snapkv._kv_compact_page_keys; numpy: kv_format.gather_slots): one workgroup per (layer, KV head) walks the
    destination pages in order, stages each page's kept keys (read back through their source pages' scales) and
    its values' words in workgroup memory, and after a barrier writes the values and encodes the keys. keep is
    ascending, so page j's sources lie in pages j and later: staged before page j is written, and never written
    before a later page stages them."""
    pages = T.int64()
    kv_heads, P, D = rows.fmt.kv_heads, rows.fmt.page_size, rows.fmt.head_dim
    slots = max_pages * P
    value_first, value_words, value_scales = rows.regions(1)
    width = value_words + value_scales
    TX = min(D, 256)

    @T.prim_func
    def kv_compact_gpu(var_pool: T.handle, page_table: T.Buffer((layers, max_pages), "int32"),
                       keep: T.Buffer((layers, kv_heads, slots), "int32"), count: T.Buffer((layers,), "int32")):
        T.func_attr(ATTRS)
        pool = T.match_buffer(var_pool, rows.pool_shape(pages), rows.pool_dtype)
        for b in T.thread_binding(layers * kv_heads, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                staged = T.alloc_buffer((P, D), "float32", scope="shared")
                values = T.alloc_buffer((P, width), "uint32", scope="shared")
                l = T.meta_var(b // kv_heads)
                h = T.meta_var(b % kv_heads)
                for j in range((count[l] + P - 1) // P):
                    end = T.meta_var(T.min(count[l] - j * P, P))
                    for c in T.unroll(ceil_div(P * D, TX)):
                        o = T.meta_var((c * TX + tx) // D)
                        if o < end:
                            staged[o, (c * TX + tx) % D] = rows.load(
                                pool, 0, T.Cast("int64", page_table[l, keep[l, h, j * P + o] // P]), h,
                                keep[l, h, j * P + o] % P, (c * TX + tx) % D)
                    for c in T.unroll(ceil_div(P * width, TX)):
                        o = T.meta_var((c * TX + tx) // width)
                        if o < end:
                            values[o, (c * TX + tx) % width] = pool[
                                T.Cast("int64", page_table[l, keep[l, h, j * P + o] // P]), 0, h,
                                keep[l, h, j * P + o] % P, value_first + (c * TX + tx) % width]
                    T.tvm_storage_sync("shared")
                    for c in T.unroll(ceil_div(P * width, TX)):
                        o = T.meta_var((c * TX + tx) // width)
                        if o < end:
                            pool[T.Cast("int64", page_table[l, j]), 0, h, o, value_first + (c * TX + tx) % width] = \
                                values[o, (c * TX + tx) % width]
                    rows.codec(0).gpu_encode_page(rows, pool, T.Cast("int64", page_table[l, j]), h, end, staged, tx,
                                                  TX)
                    T.tvm_storage_sync("shared")      # page j's staging is read before page j + 1's is written

    return kv_compact_gpu
