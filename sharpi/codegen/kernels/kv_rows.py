"""How the CPU kernels read and write the KV pool's slots, for every KVFormat (sharpi.common.kv_format), through
the codecs' CPU pieces (sharpi.common.kv_codecs).

A kernel wraps its body in `with_pool_rows(pool, fmt, body, *args)`: that declares four typed views of the pool's
memory (the key's and the value's quants, and their side data: the fields of kv_codecs.base.Part) and calls
`body(rows, *args)`, where `rows` is a SlotRows; the body reads elements as float32 with rows.load(which, page,
head, slot, d) (which: 0 keys, 1 values) and writes a token's key or value with store_slot. For the plain float
layout the quants views are the pool's [:, 0] and [:, 1] and the side-data views are never read. A fifth view,
the pool's bytes, serves prefetch_head_page.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.kv_codecs.base import ITEMSIZE
from ...common.kv_format import KVFormat
from .common import ceil_div, prefetch

_NO_SCALES = {"shape": (1,), "dtype": "float16", "elem_offset": 0}    # a part without side data: never read


def view_spec(fmt: KVFormat, pages, which: int, scales: bool) -> dict:
    """decl_buffer's arguments (but `data`) for a view [pages, kv_heads, page_size, width] of one part's field."""
    H, P = fmt.kv_heads, fmt.page_size
    if not fmt.packed:
        if scales:
            return _NO_SCALES
        D = fmt.head_dim
        return {"shape": (pages, H, P, D), "dtype": fmt.k, "strides": (2 * H * P * D, P * D, D, 1),
                "elem_offset": which * H * P * D}
    part = fmt.part(which)
    field = part.scales if scales else part.quants
    if field is None:
        return _NO_SCALES
    size = ITEMSIZE[field.dtype]
    row = fmt.row_bytes // size
    offset = (part.scale_offset if scales else part.offset) // size
    return {"shape": (pages, H, P, field.count), "dtype": field.dtype, "strides": (H * P * row, P * row, row, 1),
            "elem_offset": offset}


class SlotRows:
    """The views of one kernel's pool, and element reads through the codecs."""

    def __init__(self, fmt: KVFormat, kq, ks, vq, vs, pool_bytes):
        self.fmt = fmt
        self.quants, self.scales = (kq, vq), (ks, vs)
        self.pool_bytes = pool_bytes

    def dtype(self, which: int) -> str:
        return (self.fmt.k, self.fmt.v)[which]

    def codec(self, which: int):
        return self.fmt.codec(which)

    def load(self, which: int, page, h, slot, d):
        """Element d of the key (0) or value (1) in a slot, as float32."""
        return self.codec(which).cpu_load(self, which, page, h, slot, d)

    def head_page_run(self, page, h, half: int):
        """The first byte of one of the two runs that hold a KV head's slots in a page: the keys' and the values'
        (float layouts), or the two halves of the head's packed rows."""
        fmt = self.fmt
        start = T.Cast("int64", page) * fmt.page_bytes
        if fmt.packed:
            return start + h * fmt.page_size * fmt.row_bytes + half * self.head_page_run_bytes()
        return start + (half * fmt.kv_heads + h) * self.head_page_run_bytes()

    def head_page_run_bytes(self) -> int:
        return self.fmt.page_size * self.fmt.row_bytes // 2


class PageRows:
    """One page of one KV head unpacked into float32 buffers [page_size, head_dim] (unpack_page), read as
    SlotRows reads the pool. Attention walks a page once per block of query heads (Qwen2.5's 7 heads per KV head
    go one at a time, and a prefill block's 8 tokens each again): reading a quantized pool directly unpacked every
    element once per pass, which made a q8_0 cache decode slower than an f16 one."""

    def __init__(self, keys, values):
        self.buffers = (keys, values)

    def load(self, which, page, h, slot, d):
        return self.buffers[which][slot, d]


def page_source(unpack: bool, rows: SlotRows, keys, values):
    """What attention reads a page through: its unpacked buffers, or the pool's rows."""
    return PageRows(keys, values) if unpack else rows


def unpacked_shape(unpack: bool, page_size: int, head_dim: int) -> tuple[int, int]:
    """The page buffers' shape: a page's, or a placeholder where attention reads the pool directly."""
    return (page_size, head_dim) if unpack else (1, 1)


def unpacks_pages(fmt: KVFormat) -> bool:
    """Whether attention unpacks each page once (PageRows) rather than reading the pool on every walk over it: for
    parts whose codec asks (cpu_unpack: the quantized ones). f16 and bf16 pools are read directly: converting them
    is one instruction a vector, and unpacking them measured no faster (Qwen2.5-Coder-0.5B at 4096 tokens, prefill
    and decode alike)."""
    return fmt.codec(0).cpu_unpack or fmt.codec(1).cpu_unpack


@T.macro
def unpack_page(page_rows, rows, page, h, page_size, head_dim):
    """Every slot of a page's key and value rows as float32 into page_rows' buffers (slots past the sequence's
    end too: they hold whatever the pool held, and attention masks them as it masks them in the pool)."""
    keys = T.meta_var(page_rows.buffers[0])
    values = T.meta_var(page_rows.buffers[1])
    if rows.codec(0).page_scaled:
        # the page's side data first, into the values' buffer (overwritten below): each key element then reads it
        # in channel order rather than from the row that holds it
        rows.codec(0).cpu_read_page(rows, values, page, h)
        scaled = T.meta_var(rows.codec(0).cpu_page_keys(rows, values))
        for o in range(page_size):
            for d in T.vectorized(head_dim):
                keys[o, d] = scaled.load(0, page, h, o, d)
        for o in range(page_size):
            for d in T.vectorized(head_dim):
                values[o, d] = rows.load(1, page, h, o, d)
    else:
        for o in range(page_size):
            for d in T.vectorized(head_dim):
                keys[o, d] = rows.load(0, page, h, o, d)
            for d in T.vectorized(head_dim):
                values[o, d] = rows.load(1, page, h, o, d)


@T.macro
def prefetch_head_page(rows, page, h):
    """Ask for a KV head's keys and values in a page before reading them, a cache line at a time. A head's share
    of a page is two runs of 1-4 KB in a page of all heads, so each page starts new streams that the hardware
    prefetchers, which stop at 4 KB boundaries, pick up late: the decode attention of a 16-head model read its
    f16 cache at 13 GB/s of 29 (benchmarks/kv_attention_kernel.py --layers)."""
    for half in T.unroll(2):
        for line in range(ceil_div(rows.head_page_run_bytes(), 64)):
            prefetch(rows.pool_bytes, rows.head_page_run(page, h, half) + line * 64)


@T.macro
def with_pool_rows(pool, fmt, body, *args):
    """body(SlotRows, *args) with the pool's views declared."""
    pages = T.meta_var(pool.shape[0])
    kq = T.decl_buffer(**view_spec(fmt, pages, 0, False), data=pool.data)
    ks = T.decl_buffer(**view_spec(fmt, pages, 0, True), data=pool.data)
    vq = T.decl_buffer(**view_spec(fmt, pages, 1, False), data=pool.data)
    vs = T.decl_buffer(**view_spec(fmt, pages, 1, True), data=pool.data)
    flat = T.decl_buffer((pages * fmt.page_bytes,), "uint8", data=pool.data)
    body(SlotRows(fmt, kq, ks, vq, vs, flat), *args)


@T.macro
def store_slot(rows, which, page, h, slot, x, t):
    """Row x[t, h, :] (f32 [n, kv_heads, head_dim]) into a slot's key (0) or value (1), by its codec's rule (the
    numpy emulation is kv_format.encode_rows)."""
    rows.codec(which).cpu_store(rows, which, page, h, slot, x, t)


@T.macro
def store_page_keys(rows, page, h, held, end, x, t0):
    """Page-scaled keys: slots held .. end - 1 of a page take keys x[t0 + (o - held), h, :] (f32 [n, kv_heads,
    head_dim]), and the page is encoded again over slots 0 .. end - 1: the held slots read back as stored, then the
    codec's rule (the numpy emulation is kv_format.append_page_keys)."""
    P = T.meta_var(rows.fmt.page_size)
    D = T.meta_var(rows.fmt.head_dim)
    values = T.decl_buffer((P, D), "float32", scope="global")
    for o in range(held):
        for d in T.vectorized(D):
            values[o, d] = rows.load(0, page, h, o, d)
    for o in range(end - held):
        for d in T.vectorized(D):
            values[held + o, d] = x[t0 + o, h, d]
    rows.codec(0).cpu_encode_page(rows, page, h, values, end)
