"""Attention over the paged KV cache, and the append of new keys/values into it.

Pool layout: [pages, 2 (k, v), kv_heads, page_size, head_dim] f32, f16 or bf16, shared by all layers and sessions,
or with quantized keys or values the packed layout of sharpi.common.kv_format (a row of bytes a slot), which the
kernels read and write through kv_rows' views.
page_table [layers, max_pages] int32 maps a layer's slot s to pool page page_table[l, s // page_size].
kv_lens [layers] int32 = slots a layer held before this call; the n new tokens go to slots kv_lens[l] + t.
Query t sees slots [0, kv_lens[l] + t]: all held slots (whatever logical positions they came from, e.g. after
SnapKV compaction) plus the new tokens up to itself. Softmax is online, one page at a time, so no n x n matrix.

The batch variants (decode_batch: one new token for each of B sequences) take page_tables [B, layers, max_pages]
and kv_lens [B, layers]: token b is sequence b's, appended at its slot kv_lens[b, l], and attends over that
sequence's slots [0, kv_lens[b, l]] only.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.kv_format import KVFormat
from .common import LANES, NEG_INF, token_count
from .kv_rows import (page_source, prefetch_head_page, store_page_keys, store_slot, unpack_page, unpacked_shape,
                      unpacks_pages, with_pool_rows)
from .lanes import lane_total


def fast_exp(x):
    """exp(x) for float32 in TIR, vectorizable (Cephes' expf: range reduction by ln 2, degree-6 polynomial,
    2^n built in the exponent bits); within ~2 ulp of expf, and exactly 0 below -88.37."""
    x = T.max(T.min(x, T.float32(88.3762626647949)), T.float32(-88.3762626647949))
    fx = T.floor(x * T.float32(1.44269504088896341) + T.float32(0.5))
    r = x - fx * T.float32(0.693359375) + fx * T.float32(2.12194440e-4)
    poly = T.float32(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        poly = poly * r + T.float32(coef)
    y = poly * r * r + r + T.float32(1)
    pow2n = T.reinterpret("float32", T.shift_left(T.Cast("int32", fx) + 127, 23))
    return y * pow2n




def f32(value):
    """A pool element as float32 (the pool may hold float16)."""
    return T.Cast("float32", value)


def visible(slot, total, window: int):
    """Whether a query that sees slots [0, total) attends to `slot`: all of them, or with a sliding window the
    last `window`."""
    if not window:
        return slot < total
    return T.And(slot < total, slot + window >= total)


def first_page(total, window: int, page_size: int):
    """The first page holding a visible slot (0 without a window)."""
    if not window:
        return T.int64(0)
    return T.max(total - window, T.int64(0)) // page_size


@T.macro
def online_softmax_page(stats, score, i, first_slot, total, window, page_size):
    """Fold a page's scores (row i of `score`, slot o at first_slot + o) into query i's running softmax: stats[i]
    = (running max, running sum, page max, new max, correction exp(old max - new max)); leaves the page's weights
    exp(score - new max), 0 where not visible, in score[i]. The caller rescales its output accumulator by
    stats[i, 4] and adds the weighted V rows."""
    stats[i, 2] = T.float32(NEG_INF)
    for o in range(page_size):
        stats[i, 2] = T.max(stats[i, 2], score[i, o])
    stats[i, 3] = T.max(stats[i, 0], stats[i, 2])
    stats[i, 4] = T.exp(stats[i, 0] - stats[i, 3])
    for o in T.vectorized(page_size):
        score[i, o] = T.if_then_else(visible(first_slot + o, total, window), fast_exp(score[i, o] - stats[i, 3]),
                                     T.float32(0))
    stats[i, 1] = stats[i, 1] * stats[i, 4]
    for o in range(page_size):
        stats[i, 1] = stats[i, 1] + score[i, o]
    stats[i, 0] = stats[i, 3]


@T.macro
def page_scores(score, i0, sacc, q, t, h0, rows, page, kvh, first_slot, total, window, page_size, QP, OS, DC,
                LANES, scale):
    """q . k of query heads h0 .. h0 + QP of token t with every slot of a page (its first slot `first_slot`) into
    score rows i0 .. i0 + QP, register-blocked as a small GEMM: QP heads x OS slots in 8 accumulators (QP + OS
    loads per 8 FMAs, where one head and one slot at a time took two loads per FMA). Slots not visible score
    NEG_INF (their contents may be anything: a select never propagates them)."""
    for o0 in range(page_size // OS):
        for a in T.unroll(QP * OS):
            for l in T.vectorized(LANES):
                sacc[a, l] = T.float32(0)
        for dc in range(DC):
            for qq in T.unroll(QP):
                for ss in T.unroll(OS):
                    for l in T.vectorized(LANES):
                        sacc[qq * OS + ss, l] = sacc[qq * OS + ss, l] + q[t, h0 + qq, dc * LANES + l] \
                            * rows.load(0, page, kvh, o0 * OS + ss, dc * LANES + l)
        for qq in T.unroll(QP):
            for ss in T.unroll(OS):
                score[i0 + qq, o0 * OS + ss] = T.if_then_else(
                    visible(first_slot + o0 * OS + ss, total, window),
                    lane_total(sacc, qq * OS + ss) * T.float32(scale), T.float32(NEG_INF))


@T.macro
def add_page_values(acc, a0, vacc, score, stats, i0, rows, page, kvh, slots, head_dim, QP, VC, LANES):
    """acc rows a0 .. a0 + QP, rescaled by their queries' softmax corrections (stats rows i0 .., column 4), plus
    the page's first `slots` V rows weighted by score rows i0 ..: VC lanes at a time held in registers over the
    slots, each V row loaded once for the QP queries."""
    for dc in range(head_dim // VC):
        for qq in T.unroll(QP):
            for c in T.unroll(VC // LANES):
                for l in T.vectorized(LANES):
                    vacc[qq, c, l] = acc[a0 + qq, dc * VC + c * LANES + l] * stats[i0 + qq, 4]
        for o in range(slots):
            for qq in T.unroll(QP):
                for c in T.unroll(VC // LANES):
                    for l in T.vectorized(LANES):
                        vacc[qq, c, l] = vacc[qq, c, l] + score[i0 + qq, o] * rows.load(
                            1, page, kvh, o, dc * VC + c * LANES + l)
        for qq in T.unroll(QP):
            for c in T.unroll(VC // LANES):
                for l in T.vectorized(LANES):
                    acc[a0 + qq, dc * VC + c * LANES + l] = vacc[qq, c, l]


def _register_blocks(group: int, DC: int, LANES: int, page_size: int) -> tuple[int, int, int]:
    """(QP, OS, VC): query heads walked together (heads of one token share the causal mask), slots per q . k step
    (QP x OS accumulators), V lanes per p . V pass (QP x VC / LANES accumulators)."""
    QP = max(c for c in (1, 2, 3, 4) if group % c == 0)
    if QP == 1 and group <= 8:
        # a prime group (Qwen2.5-0.5B's 7 query heads a KV head) walked one head at a time would read every K slot
        # once per head; all its heads at once read it once (QP x OS = 7 accumulators)
        QP = group
    OS = max(1, 8 // QP)
    VC = LANES * max(c for c in (1, 2, 4, 8) if DC % c == 0 and c * QP <= 8)
    assert page_size % OS == 0
    return QP, OS, VC


def make_kv_append(kv_heads: int, head_dim: int, page_size: int, tokens: int | None = None,
                   kv_dtype="float32"):
    """PrimFunc (pool, k [n, KVH, D], v [n, KVH, D], page_table, kv_lens, layer) writing the pool in place.
    kv_dtype: the pool's element type, or a KVFormat (kv_format.KVFormat.of)."""
    return _kv_append(KVFormat.of(kv_dtype, kv_heads, page_size, head_dim), token_count(tokens), batched=False)


def make_kv_append_batch(kv_heads: int, head_dim: int, page_size: int, kv_dtype="float32"):
    """PrimFunc (pool, k [B, KVH, D], v [B, KVH, D], page_tables [B, L, MP], kv_lens [B, L], layer) writing token
    b at sequence b's slot kv_lens[b, layer], in place."""
    return _kv_append(KVFormat.of(kv_dtype, kv_heads, page_size, head_dim), token_count(None), batched=True)


def _kv_append(fmt: KVFormat, n, batched: bool):
    """batched: token t is sequence t's (page_tables [n, L, MP], kv_lens [n, L]), appended at its slot
    kv_lens[t, layer]; else all are one sequence's, at slots kv_lens[layer] + t."""
    pages, layers, max_pages = T.int64(), T.int64(), T.int64()
    kv_heads, page_size, head_dim = fmt.kv_heads, fmt.page_size, fmt.head_dim
    tables_shape = (n, layers, max_pages) if batched else (layers, max_pages)
    lens_shape = (n, layers) if batched else (layers,)

    def slot_of(kv_lens, t, layer):
        return T.Cast("int64", kv_lens[t, layer]) if batched else T.Cast("int64", kv_lens[layer]) + t

    def page_of(page_table, t, layer, index):
        return T.Cast("int64", page_table[t, layer, index] if batched else page_table[layer, index])

    page_keys = fmt.page_scaled_keys

    @T.macro
    def append(rows, k, v, page_table, kv_lens, layer):
        for t in range(n):
            slot = slot_of(kv_lens, t, layer)
            page = page_of(page_table, t, layer, slot // page_size)
            for h in range(kv_heads):
                if not page_keys:
                    store_slot(rows, 0, page, h, slot % page_size, k, t)
                elif batched:
                    store_page_keys(rows, page, h, slot % page_size, slot % page_size + 1, k, t)
                store_slot(rows, 1, page, h, slot % page_size, v, t)
        if page_keys and not batched:
            # one encoding a page: its held slots and every new one it takes (kv_format.append_page_keys)
            first = T.meta_var(T.Cast("int64", kv_lens[layer]))
            # counted from 0: the same loop from kv_lens // page_size wrote wrong pages under TVM 0.27 whenever it
            # started past 0 (test_kv_page_keys' appends at slot 16 and 32)
            for p in range((first + n - 1) // page_size + 1 - first // page_size):
                i = T.meta_var(first // page_size + p)
                page = page_of(page_table, 0, layer, i)
                for h in range(kv_heads):
                    store_page_keys(rows, page, h, T.max(first - i * page_size, 0),
                                    T.min(first + n - i * page_size, page_size), k,
                                    T.max(i * page_size - first, 0))

    @T.prim_func
    def kv_append(var_pool: T.handle, var_k: T.handle, var_v: T.handle, var_pt: T.handle, var_lens: T.handle,
                  layer: T.int64):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        pool = T.match_buffer(var_pool, fmt.pool_shape(pages), fmt.pool_dtype)
        k = T.match_buffer(var_k, (n, kv_heads, head_dim), "float32")
        v = T.match_buffer(var_v, (n, kv_heads, head_dim), "float32")
        page_table = T.match_buffer(var_pt, tables_shape, "int32")
        kv_lens = T.match_buffer(var_lens, lens_shape, "int32")
        with_pool_rows(pool, fmt, append, k, v, page_table, kv_lens, layer)

    return kv_append


def make_paged_attention(heads: int, kv_heads: int, head_dim: int, page_size: int, scale: float,
                         tokens: int | None = None, kv_dtype: str = "float32", window: int = 0):
    """PrimFunc (q [n, H, D], pool, page_table, kv_lens, layer, out [n, H, D]): causal attention per query head;
    with a sliding `window` (> 0), query t sees only the last `window` slots up to its own (slots are positions
    while a layer's cache is contiguous, which is how sliding-window layers are kept)."""
    n = token_count(tokens)
    group = heads // kv_heads
    fmt = KVFormat.of(kv_dtype, kv_heads, page_size, head_dim)
    if head_dim % LANES:
        return _paged_attention_scalar(heads, kv_heads, head_dim, page_size, scale, n, group, fmt, window)
    if tokens == 1:
        return _paged_attention_split(heads, kv_heads, head_dim, page_size, scale, None, group, LANES, fmt, window)
    return _paged_attention_tiled(heads, kv_heads, head_dim, page_size, scale, n, group, LANES, fmt, window)


def _paged_attention_tiled(heads, kv_heads, head_dim, page_size, scale, n, group, LANES, fmt, window):
    """Several tokens: one task per (block of TB consecutive tokens, KV head). The block's TB x group queries walk
    the KV head's pages together, so each page of K and V is read once per block (from L1) instead of once per
    query: with one query per task the K/V re-reads made an 8000-token SmolLM2 prefill take ~115 s.

    Within a page the queries go QP at a time (query heads of one token, so they share the causal mask), and both
    products are register-blocked as small GEMMs: q . k for QP queries x OS slots in 8 accumulators (QP + OS loads
    per 8 FMAs, where one query and one slot at a time took two loads per FMA), and p . V for QP queries x VC
    lanes, each V row loaded once for the QP queries.

    Causal work grows with the token, so blocks are handed out zigzag (first, last, second, second-to-last, ...):
    TVM splits a parallel loop into contiguous ranges, and each range then holds short and long blocks alike."""
    pages, layers, max_pages = T.int64(), T.int64(), T.int64()
    DC = head_dim // LANES
    TB = max(1, min(8, 4096 // (group * head_dim)))    # the block's accumulators stay within 16 KB
    Q = TB * group
    QP, OS, VC = _register_blocks(group, DC, LANES, page_size)
    unpack = unpacks_pages(fmt)
    unpacked = unpacked_shape(unpack, page_size, head_dim)

    @T.macro
    def attend(rows, q, page_table, kv_lens, layer, out):
        for task in T.parallel((n + TB - 1) // TB * kv_heads):
            kvh = T.meta_var(task % kv_heads)
            z = T.meta_var(task // kv_heads)
            nb = T.meta_var((n + TB - 1) // TB)
            blk = T.meta_var(T.if_then_else(z % 2 == 0, z // 2, nb - 1 - z // 2))
            held = T.meta_var(T.Cast("int64", kv_lens[layer]))
            acc = T.decl_buffer((Q, head_dim), "float32", scope="global")
            score = T.decl_buffer((Q, page_size), "float32", scope="global")
            sacc = T.decl_buffer((QP * OS, LANES), "float32", scope="global")
            vacc = T.decl_buffer((QP, VC // LANES, LANES), "float32", scope="global")
            # per query: running max, running sum, block max, new max, correction
            stats = T.decl_buffer((Q, 5), "float32", scope="global")
            unpacked_k = T.decl_buffer(unpacked, "float32", scope="global")
            unpacked_v = T.decl_buffer(unpacked, "float32", scope="global")
            src = T.meta_var(page_source(unpack, rows, unpacked_k, unpacked_v))
            for i in range(Q):
                stats[i, 0] = T.float32(NEG_INF)
                stats[i, 1] = T.float32(0)
                for d in T.vectorized(head_dim):
                    acc[i, d] = T.float32(0)
            for p in range(first_page(held + blk * TB + 1, window, page_size),
                           (held + T.min(blk * TB + TB, n) + page_size - 1) // page_size):
                page = T.meta_var(T.Cast("int64", page_table[layer, p]))
                if unpack:
                    unpack_page(src, rows, page, kvh, page_size, head_dim)
                for ip in range(Q // QP):
                    t = T.meta_var(blk * TB + ip * QP // group)
                    h0 = T.meta_var(kvh * group + ip * QP % group)
                    total = T.meta_var(held + t + 1)
                    if t < n and p * page_size < total and p >= first_page(total, window, page_size):
                        page_scores(score, ip * QP, sacc, q, t, h0, src, page, kvh, p * page_size, total, window,
                                    page_size, QP, OS, DC, LANES, scale)
                        for qq in range(QP):
                            online_softmax_page(stats, score, ip * QP + qq, p * page_size, total, window, page_size)
                        add_page_values(acc, ip * QP, vacc, score, stats, ip * QP, src, page, kvh,
                                        T.min(T.Cast("int64", page_size), total - p * page_size), head_dim, QP, VC,
                                        LANES)
            for i in range(Q):
                if blk * TB + i // group < n:
                    for d in T.vectorized(head_dim):
                        out[blk * TB + i // group, kvh * group + i % group, d] = acc[i, d] / stats[i, 1]

    @T.prim_func
    def paged_attention(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                        layer: T.int64, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, fmt.pool_shape(pages), fmt.pool_dtype)
        page_table = T.match_buffer(var_pt, (layers, max_pages), "int32")
        kv_lens = T.match_buffer(var_lens, (layers,), "int32")
        out = T.match_buffer(var_out, (n, heads, head_dim), "float32")
        with_pool_rows(pool, fmt, attend, q, page_table, kv_lens, layer, out)

    return paged_attention


def decode_splits(kv_heads: int) -> int:
    """How many ranges of pages each KV head's decode attention is split into: enough tasks (>= 8) to keep a
    few threads busy when a model has one to three KV heads."""
    return max(1, 8 // kv_heads)


def _paged_attention_split(heads, kv_heads, head_dim, page_size, scale, n, group, LANES, fmt, window):
    """One new token per sequence, split-K (flash-decoding); n None: decode (one sequence: page_table [L, MP],
    kv_lens [L]), else decode_batch (n sequences: page_tables [n, L, MP], kv_lens [n, L]). One task per (token, KV
    head, range of its visible pages) computes all `group` query heads of that KV head over its range, so each K/V
    row is read once in all; a second parallel loop merges the ranges' partial softmaxes. One task per query head
    instead read gemma3's single 256-wide KV head four times and left a 2-thread CPU with 4 tasks to balance.
    Within a page the products are register-blocked as in prefill (page_scores, add_page_values): one K row at a
    time for all heads kept q in registers that spilled (gemma3: 4 heads x 256 dims), and each V row was loaded
    once per head."""
    pages, layers, max_pages = T.int64(), T.int64(), T.int64()
    DC = head_dim // LANES
    SP = decode_splits(kv_heads)
    QP, OS, VC = _register_blocks(group, DC, LANES, page_size)
    unpack = unpacks_pages(fmt)
    unpacked = unpacked_shape(unpack, page_size, head_dim)
    batched = n is not None
    B = n if batched else 1
    tables_shape = (B, layers, max_pages) if batched else (layers, max_pages)
    lens_shape = (B, layers) if batched else (layers,)

    def part_row(t, h, sp):
        """The row of part / part_stats holding token t's query head h's partial result over range sp."""
        return ((t * kv_heads + h // group) * SP + sp) * group + h % group

    def held(kv_lens, t, layer):
        return kv_lens[t, layer] if batched else kv_lens[layer]

    def page_of(page_tables, t, layer, p):
        return page_tables[t, layer, p] if batched else page_tables[layer, p]

    @T.macro
    def attend(rows, q, page_tables, kv_lens, layer, out):
        part = T.decl_buffer((B * kv_heads * SP * group, head_dim), "float32")
        part_stats = T.decl_buffer((B * kv_heads * SP * group, 2), "float32")
        for task in T.parallel(B * kv_heads * SP):
            t = T.meta_var(task // (kv_heads * SP))
            kvh = T.meta_var(task // SP % kv_heads)
            sp = T.meta_var(task % SP)
            total = T.meta_var(T.Cast("int64", held(kv_lens, t, layer)) + 1)
            first = T.meta_var(first_page(total, window, page_size))
            count = T.meta_var((total + page_size - 1) // page_size - first)
            score = T.decl_buffer((group, page_size), "float32", scope="global")
            sacc = T.decl_buffer((QP * OS, LANES), "float32", scope="global")
            vacc = T.decl_buffer((QP, VC // LANES, LANES), "float32", scope="global")
            # per query head: running max, running sum, page max, new max, correction
            stats = T.decl_buffer((group, 5), "float32", scope="global")
            unpacked_k = T.decl_buffer(unpacked, "float32", scope="global")
            unpacked_v = T.decl_buffer(unpacked, "float32", scope="global")
            src = T.meta_var(page_source(unpack, rows, unpacked_k, unpacked_v))
            for g in T.unroll(group):
                stats[g, 0] = T.float32(NEG_INF)
                stats[g, 1] = T.float32(0)
                for d in T.vectorized(head_dim):
                    part[task * group + g, d] = T.float32(0)
            lo = T.meta_var(first + count * sp // SP)
            hi = T.meta_var(first + count * (sp + 1) // SP)
            if lo < hi:
                prefetch_head_page(rows, page_of(page_tables, t, layer, lo), kvh)
            for p in range(lo, hi):
                page = T.meta_var(T.Cast("int64", page_of(page_tables, t, layer, p)))
                # the next page's rows arrive while this one is read (the last page asks for itself again)
                prefetch_head_page(rows, page_of(page_tables, t, layer, T.min(p + 1, hi - 1)), kvh)
                if unpack:
                    unpack_page(src, rows, page, kvh, page_size, head_dim)
                for ip in range(group // QP):
                    page_scores(score, ip * QP, sacc, q, t, kvh * group + ip * QP, src, page, kvh, p * page_size,
                                total, window, page_size, QP, OS, DC, LANES, scale)
                    for qq in range(QP):
                        online_softmax_page(stats, score, ip * QP + qq, p * page_size, total, window, page_size)
                    add_page_values(part, task * group + ip * QP, vacc, score, stats, ip * QP, src, page, kvh,
                                    T.min(T.Cast("int64", page_size), total - p * page_size), head_dim, QP, VC,
                                    LANES)
            for g in T.unroll(group):
                part_stats[task * group + g, 0] = stats[g, 0]
                part_stats[task * group + g, 1] = stats[g, 1]
        for th in T.parallel(B * heads):
            t = T.meta_var(th // heads)
            h = T.meta_var(th % heads)
            # merge the ranges: rescale each to the common max (an empty range has max -3e38 and weight 0)
            m = T.decl_buffer((2,), "float32", scope="global")
            m[0] = T.float32(NEG_INF)
            for sp in range(SP):
                m[0] = T.max(m[0], part_stats[part_row(t, h, sp), 0])
            m[1] = T.float32(0)
            for sp in range(SP):
                m[1] = m[1] + part_stats[part_row(t, h, sp), 1] * T.exp(part_stats[part_row(t, h, sp), 0] - m[0])
            for d in T.vectorized(head_dim):
                out[t, h, d] = T.float32(0)
            for sp in range(SP):
                for d in T.vectorized(head_dim):
                    out[t, h, d] = out[t, h, d] + part[part_row(t, h, sp), d] * (
                        T.exp(part_stats[part_row(t, h, sp), 0] - m[0]) / m[1])

    @T.prim_func
    def paged_attention(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                        layer: T.int64, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        q = T.match_buffer(var_q, (B, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, fmt.pool_shape(pages), fmt.pool_dtype)
        page_tables = T.match_buffer(var_pt, tables_shape, "int32")
        kv_lens = T.match_buffer(var_lens, lens_shape, "int32")
        out = T.match_buffer(var_out, (B, heads, head_dim), "float32")
        with_pool_rows(pool, fmt, attend, q, page_tables, kv_lens, layer, out)

    return paged_attention


def make_paged_attention_batch(heads: int, kv_heads: int, head_dim: int, page_size: int, scale: float,
                               kv_dtype: str = "float32", window: int = 0):
    """PrimFunc (q [B, H, D], pool, page_tables [B, L, MP], kv_lens [B, L], layer, out [B, H, D]): one new token per
    sequence, token b over sequence b's slots [0, kv_lens[b, layer]] (its own appended last), as decode's kernel
    does for one sequence."""
    n = token_count(None)
    group = heads // kv_heads
    fmt = KVFormat.of(kv_dtype, kv_heads, page_size, head_dim)
    if head_dim % LANES:
        return _paged_attention_scalar(heads, kv_heads, head_dim, page_size, scale, n, group, fmt, window,
                                       batched=True)
    return _paged_attention_split(heads, kv_heads, head_dim, page_size, scale, n, group, LANES, fmt, window)


def _paged_attention_scalar(heads, kv_heads, head_dim, page_size, scale, n, group, fmt, window,
                            batched: bool = False):
    """One task per (token, query head), one slot at a time: for head sizes the vector kernels cannot tile.
    batched: token t is sequence t's (page_tables [n, L, MP], kv_lens [n, L]); else all are one sequence's. (The
    plain float layout only: quantized KV types need head_dim a multiple of 32, which the vector kernels take.)"""
    assert not fmt.packed, fmt
    kv_dtype = fmt.k
    pages, layers, max_pages = T.int64(), T.int64(), T.int64()
    table_shape = (n, layers, max_pages) if batched else (layers, max_pages)
    lens_shape = (n, layers) if batched else (layers,)

    def held(kv_lens, layer, t):
        """The slots token t sees, its own included."""
        return T.Cast("int64", kv_lens[t, layer]) + 1 if batched else T.Cast("int64", kv_lens[layer]) + t + 1

    def page_of(page_table, layer, t, p):
        return T.Cast("int64", page_table[t, layer, p] if batched else page_table[layer, p])

    @T.prim_func
    def paged_attention(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                        layer: T.int64, var_out: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, (pages, 2, kv_heads, page_size, head_dim), kv_dtype)
        page_table = T.match_buffer(var_pt, table_shape, "int32")
        kv_lens = T.match_buffer(var_lens, lens_shape, "int32")
        out = T.match_buffer(var_out, (n, heads, head_dim), "float32")
        for th in T.parallel(n * heads):
            t = th // heads
            h = th % heads
            kvh = h // group
            total = held(kv_lens, layer, t)
            acc = T.decl_buffer((head_dim,), "float32", scope="global")
            score = T.decl_buffer((page_size,), "float32", scope="global")
            stats = T.decl_buffer((3,), "float32", scope="global")  # running max, running sum, block max
            stats[0] = T.float32(NEG_INF)
            stats[1] = T.float32(0)
            for d in T.vectorized(head_dim):
                acc[d] = T.float32(0)
            for p in range(first_page(total, window, page_size), (total + page_size - 1) // page_size):
                page = page_of(page_table, layer, t, p)
                stats[2] = T.float32(NEG_INF)
                for o in range(page_size):
                    score[o] = T.float32(NEG_INF)
                    if visible(p * page_size + o, total, window):
                        dot = T.decl_buffer((1,), "float32", scope="global")
                        dot[0] = T.float32(0)
                        for d in range(head_dim):
                            dot[0] = dot[0] + q[t, h, d] * f32(pool[page, 0, kvh, o, d])
                        score[o] = dot[0] * T.float32(scale)
                        stats[2] = T.max(stats[2], score[o])
                new_max = T.max(stats[0], stats[2])
                correction = T.exp(stats[0] - new_max)
                for o in T.vectorized(page_size):
                    score[o] = T.if_then_else(visible(p * page_size + o, total, window),
                                              fast_exp(score[o] - new_max), T.float32(0))
                stats[1] = stats[1] * correction
                for o in range(page_size):
                    stats[1] = stats[1] + score[o]
                for d in T.vectorized(head_dim):
                    acc[d] = acc[d] * correction
                for o in range(T.min(T.Cast("int64", page_size), total - p * page_size)):
                    for d in T.vectorized(head_dim):
                        acc[d] = acc[d] + score[o] * f32(pool[page, 1, kvh, o, d])
                stats[0] = new_max
            for d in T.vectorized(head_dim):
                out[t, h, d] = acc[d] / stats[1]

    return paged_attention
