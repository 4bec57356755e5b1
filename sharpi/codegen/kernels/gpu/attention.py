"""Paged-KV-cache kernels for GPU targets (WGSL on Vulkan; written against WebGPU's limits: 256 invocations and
32 KiB of workgroup memory per workgroup, no 64-bit or 8/16-bit integers, no f64). Each is the twin of a CPU
kernel in ..paged_attention, with the same parameters and buffer shapes, so codegen can pick per target.

kv_append: pool[page_table[l, s // P], {0, 1}, h, s % P, :] = k/v[t, h, :] for slot s = kv_lens[l] + t; the
    pool is written in place. One workgroup per (token, KV head), one invocation per element of the head (a
    packed pool, quantized or of mixed types: per word of the slot's row, after the blocks' scales; kv_rows);
    q4_ch keys, whose scales belong to their page, one workgroup per (page written, KV head).
paged_attention: out[t, h] = softmax(q[t, h] . K[s] * scale) V over the slots s <= kv_lens[l] + t of KV head
    h // (H / KVH) (the CPU kernel's causal rule and GQA mapping). One workgroup per (token, query head) with
    TX = min(head_dim, 256) invocations; the visible slots are walked in tiles of TX:
      1. invocation i computes the score of slot tile*TX + i (a dot product with q, which the workgroup staged
         in shared memory, pre-scaled), and stores it with the slot's page in shared memory;
      2. every invocation reduces the tile's max redundantly (TX broadcast reads of shared memory: cheaper than
         a tree of barriers), rescales its running state (online softmax), and invocation i stores exp of its
         own slot's score;
      3. every invocation accumulates p * v over the tile for the output dims it owns (d = i, i + TX, ...).
    The tile loop's trip count depends only on the workgroup (kv_lens and the token), so the barriers stay in
    uniform control flow, as WGSL requires. Slots past the visible range get probability 0 and are never read.
    Split (CUDA's one-token decode): the tiles are shared among several workgroups a head, each writing its
    unnormalised output, max and sum, and attention_combine merges them (flash-decoding).
flash_attention (a prompt's attention): one workgroup per (block of BQ consecutive tokens, query head), which
    stages each tile of BK slots' keys, then values, in workgroup memory once for its BQ queries (where
    paged_attention reads every visible slot once a query): invocation (i, j) scores query i against slot j of
    the tile, keeps query i's running max and sum, and accumulates the dims j, j + BK, ... of its output.

All three are hand-scheduled (explicit thread bindings) and marked "tirx.is_scheduled" so dlight leaves them be.
Shape variables carry names: the Vulkan plan binds each kernel's scalar arguments by the name of the shape
variable they come from, and TVMScript's anonymous T.int64() vars are all called "v".
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..paged_attention import visible
from ..common import GPU_KERNEL_ATTRS as ATTRS
from ..common import NEG_INF, token_count
from .kv_rows import GpuRows, store_page_keys, store_row

MAX_THREADS = 256           # WebGPU's maxComputeInvocationsPerWorkgroup default


def _pool_vars():
    """Named shape variables of the pool (pages) and the page table (layers, max_pages)."""
    return tirx.Var("pages", "int64"), tirx.Var("layers", "int64"), tirx.Var("max_pages", "int64")


def _named(func: tirx.PrimFunc, name: str, tokens: int | None) -> tirx.PrimFunc:
    """Give the kernel a global symbol of its own (TVMScript names it after the Python function, and a module
    holding the prefill and decode variants needs two)."""
    return func.with_attr("global_symbol", name + ("" if tokens is None else f"_{tokens}"))


def first_tile(total, window: int, tx: int):
    """The first tile of `tx` slots holding a slot the query sees (0 without a window)."""
    if not window:
        return T.int64(0)
    return T.truncdiv(T.max(total - window, T.int64(0)), tx)


def _threads(head_dim: int) -> tuple[int, int]:
    """(invocations per workgroup, head dims each invocation owns) for a head of `head_dim`."""
    tx = min(head_dim, MAX_THREADS)
    return tx, (head_dim + tx - 1) // tx


def _tables(batched: bool, n, layers, max_pages):
    """The page table's and kv_lens' shapes, and a token's slot count and page by index: one sequence's
    ([L, MP], [L]: token t after the held slots) or, batched, one per token ([n, L, MP], [n, L])."""
    if batched:
        return ((n, layers, max_pages), (n, layers), lambda lens, layer, t: T.Cast("int64", lens[t, layer]),
                lambda table, layer, t, p: table[t, layer, p])
    return ((layers, max_pages), (layers,), lambda lens, layer, t: T.Cast("int64", lens[layer]) + t,
            lambda table, layer, t, p: table[layer, p])


def make_gpu_kv_append(kv_heads: int, head_dim: int, page_size: int, tokens: int | None = None,
                       kv_dtype="float32", batched: bool = False) -> tirx.PrimFunc:
    """PrimFunc (pool, k [n, KVH, D], v [n, KVH, D], page_table, kv_lens, layer) writing the pool in place;
    batched: token t is sequence t's, written at its slot kv_lens[t, layer] (page_tables [n, L, MP]). kv_dtype:
    a KV type, a (key, value) pair of types or a KVFormat (a packed pool is taken as words: kv_rows).

    q4_ch keys, whose scales belong to their page, are written a page at a time (kv_rows.store_page_keys: the
    page's keys encoded again, held slots and new ones, then the new slots' values): one workgroup per (page the
    call writes, KV head), at most n // P + 2 pages for n tokens after kv_lens[layer] held slots (workgroups past
    the last do nothing); batched, each token's own page, continued by one slot."""
    n = token_count(tokens)
    rows = GpuRows.of(kv_dtype, kv_heads, page_size, head_dim)
    page_keys = rows.fmt.page_scaled_keys
    pages, layers, max_pages = _pool_vars()
    TX, _ = _threads(head_dim)
    table_shape, lens_shape, slot_of, page_of = _tables(batched, n, layers, max_pages)
    jobs = n // page_size + 2 if page_keys and not batched else n

    @T.prim_func
    def gpu_kv_append(var_pool: T.handle, var_k: T.handle, var_v: T.handle, var_pt: T.handle, var_lens: T.handle,
                      layer: T.int64):
        T.func_attr(ATTRS)
        pool = T.match_buffer(var_pool, rows.pool_shape(pages), rows.pool_dtype)
        k = T.match_buffer(var_k, (n, kv_heads, head_dim), "float32")
        v = T.match_buffer(var_v, (n, kv_heads, head_dim), "float32")
        page_table = T.match_buffer(var_pt, table_shape, "int32")
        kv_lens = T.match_buffer(var_lens, lens_shape, "int32")
        for b in T.thread_binding(jobs * kv_heads, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                h = T.meta_var(b % kv_heads)
                if not page_keys or batched:            # a workgroup a token
                    t = T.meta_var(b // kv_heads)
                    slot = T.meta_var(slot_of(kv_lens, layer, t))
                    page = T.meta_var(T.Cast("int64", page_of(page_table, layer, t, slot // page_size)))
                    if page_keys:
                        store_page_keys(rows, pool, k, v, page, h, slot % page_size, slot % page_size + 1, t, tx, TX)
                    else:
                        store_row(rows, pool, k, v, t, h, page, slot % page_size, tx, TX)
                else:                                   # a workgroup a page
                    first = T.meta_var(slot_of(kv_lens, layer, 0))
                    i = T.meta_var(first // page_size + b // kv_heads)         # the page's index in the table
                    held = T.meta_var(T.max(first - i * page_size, T.int64(0)))
                    end = T.meta_var(T.min(first + n - i * page_size, T.int64(page_size)))
                    if held < end:
                        store_page_keys(rows, pool, k, v, T.Cast("int64", page_of(page_table, layer, 0, i)), h,
                                        held, end, T.max(i * page_size - first, T.int64(0)), tx, TX)

    return _named(gpu_kv_append, f"gpu_kv_append{'_batch' if batched else ''}_{kv_heads}_{head_dim}_{page_size}",
                  tokens)


def make_gpu_paged_attention(heads: int, kv_heads: int, head_dim: int, page_size: int, scale: float,
                             tokens: int | None = None, kv_dtype="float32", window: int = 0,
                             batched: bool = False, splits: int = 0) -> tirx.PrimFunc:
    """PrimFunc (q [n, H, D], pool, page_table, kv_lens, layer, out [n, H, D]): causal attention per query head.
    Workgroup memory: (D + 3 * TX) * 4 bytes, at most 4 KiB for D <= 256. With a sliding `window` (> 0) query t
    sees only the last `window` of its slots, and tiles wholly before them are skipped. batched: token t is
    sequence t's and sees its slots [0, kv_lens[t, layer]] (page_tables [n, L, MP]). kv_dtype as kv_append's.

    splits > 0 (flash-decoding, for decode: one token's workgroups alone leave a large GPU idle, H of them for
    thousands of slots): the visible tiles are shared among `splits` workgroups per query head, and the kernel
    writes each one's unnormalised output, running max and sum into partial [n, H, splits, D + 2] (out's place
    in the signature) for make_gpu_attention_combine."""
    n = token_count(tokens)
    rows = GpuRows.of(kv_dtype, kv_heads, page_size, head_dim)
    pages, layers, max_pages = _pool_vars()
    group = heads // kv_heads
    TX, DPT = _threads(head_dim)
    table_shape, lens_shape, slot_of, page_of = _tables(batched, n, layers, max_pages)
    ways = max(splits, 1)
    out_shape = (n, heads, splits, head_dim + 2) if splits else (n, heads, head_dim)

    @T.macro
    def attend(q, pool, page_table, layer, t, h, kvh, total, first, last,
               q_sh, score, prob, page_sh, acc, dot, st, tx):
        """Online softmax over the tiles [first, last) of the query's visible slots: acc holds the unnormalised
        output of the dims this invocation owns, st[0] the running max and st[1] the running sum."""
        for c in T.unroll(DPT):
            if c * TX + tx < head_dim:
                q_sh[c * TX + tx] = q[t, h, c * TX + tx] * T.float32(scale)
            acc[c] = T.float32(0)
        st[0] = T.float32(NEG_INF)
        st[1] = T.float32(0)
        T.tvm_storage_sync("shared")
        for tile in range(first, last):
            # 1. this invocation's slot: its page (read by every slot the query sees, so masked slots of the
            # tile still name a page the layer holds), and its score
            if tile * TX + tx < total:
                page_sh[tx] = page_of(page_table, layer, t, (tile * TX + tx) // page_size)
            if visible(tile * TX + tx, total, window):
                dot[0] = T.float32(0)
                for d in range(head_dim // rows.dot_step):
                    for e in T.unroll(rows.dot_step):
                        dot[0] = dot[0] + q_sh[d * rows.dot_step + e] * rows.load(
                            pool, 0, T.Cast("int64", page_sh[tx]), kvh, (tile * TX + tx) % page_size,
                            d * rows.dot_step + e)
                score[tx] = dot[0]
            else:
                score[tx] = T.float32(NEG_INF)
            T.tvm_storage_sync("shared")
            # 2. online softmax: the tile max (redundantly in every invocation), then p of own slot
            st[2] = st[0]
            for j in range(TX):
                st[2] = T.max(st[2], score[j])
            st[3] = T.exp(st[0] - st[2])
            st[0] = st[2]
            prob[tx] = T.exp(score[tx] - st[0])     # masked slots: exp(-3e38 - m) == 0
            T.tvm_storage_sync("shared")
            # 3. rescale and accumulate p * v for the dims this invocation owns
            st[1] = st[1] * st[3]
            for c in T.unroll(DPT):
                acc[c] = acc[c] * st[3]
            for j in range(T.min(T.int64(TX), total - tile * TX)):
                st[1] = st[1] + prob[j]
                for c in T.unroll(DPT):
                    if c * TX + tx < head_dim:
                        acc[c] = acc[c] + prob[j] * rows.load(pool, 1, T.Cast("int64", page_sh[j]), kvh,
                                                              (tile * TX + j) % page_size, c * TX + tx)
            # the next tile overwrites score, prob and page_sh
            T.tvm_storage_sync("shared")

    @T.prim_func
    def gpu_paged_attention(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                            layer: T.int64, var_out: T.handle):
        T.func_attr(ATTRS)
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, rows.pool_shape(pages), rows.pool_dtype)
        page_table = T.match_buffer(var_pt, table_shape, "int32")
        kv_lens = T.match_buffer(var_lens, lens_shape, "int32")
        out = T.match_buffer(var_out, out_shape, "float32")
        for b in T.thread_binding(n * heads * ways, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                q_sh = T.alloc_buffer((head_dim,), "float32", scope="shared")
                score = T.alloc_buffer((TX,), "float32", scope="shared")
                prob = T.alloc_buffer((TX,), "float32", scope="shared")
                page_sh = T.alloc_buffer((TX,), "int32", scope="shared")
                acc = T.alloc_buffer((DPT,), "float32", scope="local")
                dot = T.alloc_buffer((1,), "float32", scope="local")
                # running max, running sum, tile max, correction of the previous tiles
                st = T.alloc_buffer((4,), "float32", scope="local")
                t = T.meta_var(b // ways // heads)
                h = T.meta_var(b // ways % heads)
                kvh = T.meta_var(b // ways % heads // group)
                total = T.meta_var(slot_of(kv_lens, layer, t) + 1)   # visible slots
                # truncdiv: total is positive, but TVM cannot know (it comes from kv_lens), and its floordiv by a
                # divisor that is no power of two lowers with an offset of 2^31 that overflows WGSL's i32
                start = T.meta_var(first_tile(total, window, TX))
                end = T.meta_var(T.truncdiv(total + TX - 1, TX))
                if splits > 0:
                    # split b % ways takes its share of the tiles (a trip count uniform in the workgroup)
                    share = T.meta_var(T.truncdiv(end - start + ways - 1, ways))
                    lo = T.meta_var(T.min(start + b % ways * share, end))
                    attend(q, pool, page_table, layer, t, h, kvh, total, lo, T.min(lo + share, end),
                           q_sh, score, prob, page_sh, acc, dot, st, tx)
                    for c in T.unroll(DPT):
                        if c * TX + tx < head_dim:
                            out[t, h, b % ways, c * TX + tx] = acc[c]
                    if tx == 0:
                        out[t, h, b % ways, head_dim] = st[0]
                        out[t, h, b % ways, head_dim + 1] = st[1]
                else:
                    attend(q, pool, page_table, layer, t, h, kvh, total, start, end,
                           q_sh, score, prob, page_sh, acc, dot, st, tx)
                    for c in T.unroll(DPT):
                        if c * TX + tx < head_dim:
                            out[t, h, c * TX + tx] = acc[c] / st[1]

    return _named(gpu_paged_attention, f"gpu_paged_attention{'_batch' if batched else ''}"
                  f"{f'_split{splits}' if splits else ''}_{heads}_{kv_heads}_{head_dim}_{page_size}", tokens)


def make_gpu_attention_combine(heads: int, head_dim: int, splits: int, tokens: int | None = None) -> tirx.PrimFunc:
    """PrimFunc (partial [n, H, splits, D + 2], out [n, H, D]): the splits of make_gpu_paged_attention(splits=)
    merged, out = sum_s acc_s e^(m_s - m) / sum_s l_s e^(m_s - m) with m the largest m_s (a split without slots
    has m_s = -3e38 and l_s = 0, and weighs nothing). One workgroup per (token, query head)."""
    n = token_count(tokens)
    TX, DPT = _threads(head_dim)

    @T.prim_func
    def gpu_attention_combine(var_partial: T.handle, var_out: T.handle):
        T.func_attr(ATTRS)
        partial = T.match_buffer(var_partial, (n, heads, splits, head_dim + 2), "float32")
        out = T.match_buffer(var_out, (n, heads, head_dim), "float32")
        for b in T.thread_binding(n * heads, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                st = T.alloc_buffer((3,), "float32", scope="local")        # max, sum, a split's weight
                acc = T.alloc_buffer((DPT,), "float32", scope="local")
                t = T.meta_var(b // heads)
                h = T.meta_var(b % heads)
                st[0] = partial[t, h, 0, head_dim]
                for s in range(1, splits):
                    st[0] = T.max(st[0], partial[t, h, s, head_dim])
                st[1] = T.float32(0)
                for c in T.unroll(DPT):
                    acc[c] = T.float32(0)
                for s in range(splits):
                    st[2] = T.exp(partial[t, h, s, head_dim] - st[0])
                    st[1] = st[1] + partial[t, h, s, head_dim + 1] * st[2]
                    for c in T.unroll(DPT):
                        if c * TX + tx < head_dim:
                            acc[c] = acc[c] + partial[t, h, s, c * TX + tx] * st[2]
                for c in T.unroll(DPT):
                    if c * TX + tx < head_dim:
                        out[t, h, c * TX + tx] = acc[c] / st[1]

    return _named(gpu_attention_combine, f"gpu_attention_combine_{heads}_{head_dim}_{splits}", tokens)


def _flash_blocks(head_dim: int) -> tuple[int, int]:
    """(BQ, BK): tokens a flash workgroup takes, slots a tile; BQ * BK invocations, and a tile of f32 keys or
    values (BK x (head_dim + 1)) with the tile's scores and weights within WebGPU's 16 KiB of workgroup
    memory."""
    return 16, (16 if head_dim <= 128 else 8)


def make_gpu_flash_attention(heads: int, kv_heads: int, head_dim: int, page_size: int, scale: float,
                             tokens: int | None = None, kv_dtype="float32", window: int = 0) -> tirx.PrimFunc:
    """PrimFunc (q [n, H, D], pool, page_table, kv_lens, layer, out [n, H, D]): make_gpu_paged_attention's
    prompt attention (same signature and causal, windowed rule), tiled: the workgroup of tokens t0 .. t0 + BQ - 1
    and query head h walks the tiles of BK slots that any of its queries sees, each tile's keys and then values
    staged once in workgroup memory (decoded from the pool's type) and used by all BQ queries.

    Slots outside what the block's queries see together (before the first query's window, after the last
    query's own slot) are staged as zeros, so a slot a query does not see weighs exactly 0 against a finite
    value (its pool bytes may be anything). A query's weights of a tile are 0 where it does not see the slot,
    exp(score - running max) where it does; a tile that a windowed query sees none of leaves its state as it
    was. Rows past the last token compute on the last token's query and write nothing."""
    n = token_count(tokens)
    rows = GpuRows.of(kv_dtype, kv_heads, page_size, head_dim)
    pages, layers, max_pages = _pool_vars()
    group = heads // kv_heads
    BQ, BK = _flash_blocks(head_dim)
    TX = BQ * BK
    DPT = (head_dim + BK - 1) // BK          # output dims an invocation owns
    LOADS = (BK * head_dim + TX - 1) // TX   # tile elements an invocation stages
    table_shape, lens_shape, slot_of, page_of = _tables(False, n, layers, max_pages)

    def first_seen(kv_lens, layer, t0):
        """The first slot token t0 sees: 0, or with a window the first of its last `window`."""
        if not window:
            return T.int64(0)
        return T.max(slot_of(kv_lens, layer, t0) + 1 - window, T.int64(0))

    @T.macro
    def stage(tile_sh, pool, page_sh, which, kvh, tile, lo, hi, tx):
        """The tile's keys (which 0) or values (1) into tile_sh [BK, D + 1]; slots outside [lo, hi) as zeros."""
        for r in T.unroll(LOADS):
            e = T.meta_var(r * TX + tx)
            if e < BK * head_dim:
                slot = T.meta_var(tile * BK + e // head_dim)
                if T.And(slot >= lo, slot < hi):
                    tile_sh[e // head_dim, e % head_dim] = rows.load(
                        pool, which, T.Cast("int64", page_sh[e // head_dim]), kvh, slot % page_size, e % head_dim)
                else:
                    tile_sh[e // head_dim, e % head_dim] = T.float32(0)

    @T.prim_func
    def gpu_flash_attention(var_q: T.handle, var_pool: T.handle, var_pt: T.handle, var_lens: T.handle,
                            layer: T.int64, var_out: T.handle):
        T.func_attr(ATTRS)
        q = T.match_buffer(var_q, (n, heads, head_dim), "float32")
        pool = T.match_buffer(var_pool, rows.pool_shape(pages), rows.pool_dtype)
        page_table = T.match_buffer(var_pt, table_shape, "int32")
        kv_lens = T.match_buffer(var_lens, lens_shape, "int32")
        out = T.match_buffer(var_out, (n, heads, head_dim), "float32")
        for b in T.thread_binding((n + BQ - 1) // BQ * heads, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                # a row of padding: the BK invocations of a query read one element of each slot's row at once,
                # which an unpadded row length (a multiple of 32 words) would put in one bank of shared memory
                tile_sh = T.alloc_buffer((BK, head_dim + 1), "float32", scope="shared")
                score = T.alloc_buffer((BQ, BK), "float32", scope="shared")
                prob = T.alloc_buffer((BQ, BK), "float32", scope="shared")
                page_sh = T.alloc_buffer((BK,), "int32", scope="shared")
                acc = T.alloc_buffer((DPT,), "float32", scope="local")
                dot = T.alloc_buffer((1,), "float32", scope="local")
                # running max, running sum, new max, correction of the previous tiles
                st = T.alloc_buffer((4,), "float32", scope="local")
                h = T.meta_var(b % heads)
                kvh = T.meta_var(h // group)
                t0 = T.meta_var(b // heads * BQ)
                i = T.meta_var(tx // BK)
                j = T.meta_var(tx % BK)
                t = T.meta_var(T.min(t0 + i, n - 1))          # rows past the last token repeat it, unwritten
                total = T.meta_var(slot_of(kv_lens, layer, t) + 1)          # the slots query i sees
                # what the block sees together: from the first query's first visible slot to the last's own
                lo = T.meta_var(first_seen(kv_lens, layer, t0))
                hi = T.meta_var(slot_of(kv_lens, layer, T.min(t0 + BQ, n) - 1) + 1)
                for c in T.unroll(DPT):
                    acc[c] = T.float32(0)
                st[0] = T.float32(NEG_INF)
                st[1] = T.float32(0)
                for tile in range(T.truncdiv(lo, BK), T.truncdiv(hi + BK - 1, BK)):
                    if tx < BK:
                        if T.And(tile * BK + tx >= lo, tile * BK + tx < hi):
                            page_sh[tx] = page_of(page_table, layer, t, (tile * BK + tx) // page_size)
                    T.tvm_storage_sync("shared")
                    stage(tile_sh, pool, page_sh, 0, kvh, tile, lo, hi, tx)
                    T.tvm_storage_sync("shared")
                    # 1. query i's score of slot j
                    dot[0] = T.float32(0)
                    for d in range(head_dim):
                        dot[0] = dot[0] + q[t, h, d] * tile_sh[j, d]
                    score[i, j] = T.if_then_else(visible(tile * BK + j, total, window), dot[0] * T.float32(scale),
                                                 T.float32(NEG_INF))
                    T.tvm_storage_sync("shared")
                    # 2. query i's new max (each of its invocations alike) and its weight of slot j
                    st[2] = st[0]
                    for jj in range(BK):
                        st[2] = T.max(st[2], score[i, jj])
                    st[3] = T.exp(st[0] - st[2])
                    st[0] = st[2]
                    prob[i, j] = T.if_then_else(visible(tile * BK + j, total, window),
                                                T.exp(score[i, j] - st[0]), T.float32(0))
                    stage(tile_sh, pool, page_sh, 1, kvh, tile, lo, hi, tx)   # the keys are read: values now
                    T.tvm_storage_sync("shared")
                    # 3. rescale, then add the tile's weighted values to the dims this invocation owns
                    st[1] = st[1] * st[3]
                    for c in T.unroll(DPT):
                        acc[c] = acc[c] * st[3]
                    for jj in range(BK):
                        st[1] = st[1] + prob[i, jj]
                        for c in T.unroll(DPT):
                            if c * BK + j < head_dim:
                                acc[c] = acc[c] + prob[i, jj] * tile_sh[jj, c * BK + j]
                    # the next tile overwrites page_sh, tile_sh, score and prob
                    T.tvm_storage_sync("shared")
                if t0 + i < n:
                    for c in T.unroll(DPT):
                        if c * BK + j < head_dim:
                            out[t0 + i, h, c * BK + j] = acc[c] / st[1]

    return _named(gpu_flash_attention, f"gpu_flash_attention_{heads}_{kv_heads}_{head_dim}_{page_size}", tokens)
