"""How the CPU kernels read and write the KV pool's slots, for every KVFormat (sharpi.common.kv_format).

A kernel wraps its body in `with_pool_rows(pool, fmt, body, *args)`: that declares four typed views of the pool's
memory (the key's and the value's quants, and their f16 block scales) and calls `body(rows, *args)`, where `rows`
is a SlotRows; the body reads elements as float32 with rows.load(which, page, head, slot, d) (which: 0 keys, 1
values) and writes a token's key or value with store_slot. For the plain float layout the quants views are the
pool's [:, 0] and [:, 1] and the scale views are never read.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ...common.kv_format import FLOAT_KV, KV_BLOCK, PAGE_SCALED_KV, QUANTIZED_KV, KVFormat

_QUANT_DTYPE = {"q8_0": "int8", "q4_0": "uint8", "q4_ch": "uint8"}
_NO_SCALES = {"shape": (1,), "dtype": "float16", "elem_offset": 0}    # a float part's scale view: never read


def _itemsize(dtype: str) -> int:
    return FLOAT_KV.get(dtype, 1)


def view_spec(fmt: KVFormat, pages, which: int, scales: bool) -> dict:
    """decl_buffer's arguments (but `data`) for a view [pages, kv_heads, page_size, width] of one part."""
    H, P = fmt.kv_heads, fmt.page_size
    if not fmt.packed:
        if scales:
            return _NO_SCALES
        D = fmt.head_dim
        return {"shape": (pages, H, P, D), "dtype": fmt.k, "strides": (2 * H * P * D, P * D, D, 1),
                "elem_offset": which * H * P * D}
    part = fmt.part(which)
    quantized = part.dtype in _QUANT_DTYPE
    if scales and not quantized:
        return _NO_SCALES
    dtype = "float16" if scales else _QUANT_DTYPE.get(part.dtype, part.dtype)
    size = _itemsize(dtype)
    row = fmt.row_bytes // size
    if scales:     # q4_ch: this row's share of the page's scales and minimums
        width = 2 * fmt.channels_per_row if part.dtype in PAGE_SCALED_KV else fmt.head_dim // KV_BLOCK
    elif quantized:
        width = (part.scale_offset - part.offset) // size     # the quants' bytes
    else:
        width = fmt.head_dim
    offset = (part.scale_offset if scales else part.offset) // size
    return {"shape": (pages, H, P, width), "dtype": dtype, "strides": (H * P * row, P * row, row, 1),
            "elem_offset": offset}


class SlotRows:
    """The views of one kernel's pool, and element reads through them."""

    def __init__(self, fmt: KVFormat, kq, ks, vq, vs):
        self.fmt = fmt
        self.quants, self.scales = (kq, vq), (ks, vs)

    def dtype(self, which: int) -> str:
        return (self.fmt.k, self.fmt.v)[which]

    def load(self, which: int, page, h, slot, d):
        """Element d of the key (0) or value (1) in a slot, as float32."""
        dtype, q = self.dtype(which), self.quants[which]
        if dtype == "q8_0":
            return T.Cast("float32", q[page, h, slot, d]) * self._scale(which, page, h, slot, d)
        if dtype == "q4_0":
            return (T.Cast("float32", self.nibble(which, page, h, slot, d)) - T.float32(8)) * self._scale(
                which, page, h, slot, d)
        if dtype == "q4_ch":      # m + q * d: q * d is exact, so a fused multiply-add rounds as numpy does
            return T.Cast("float32", self.nibble(which, page, h, slot, d)) * self.page_scale(which, page, h, d, 0) \
                + self.page_scale(which, page, h, d, 1)
        return T.Cast("float32", q[page, h, slot, d])

    def nibble(self, which, page, h, slot, d):
        """Element d's 4-bit quant (q4_0's nibble order)."""
        j = d % KV_BLOCK
        byte = self.quants[which][page, h, slot, d // KV_BLOCK * (KV_BLOCK // 2) + j % (KV_BLOCK // 2)]
        return (byte >> T.Cast("uint8", j // (KV_BLOCK // 2) * 4)) & T.uint8(15)

    def page_scale(self, which, page, h, d, minimum: int):
        """q4_ch: channel d's scale (minimum 0) or minimum (1) in its page, as float32."""
        c = self.fmt.channels_per_row
        return T.Cast("float32", self.scales[which][page, h, d // c, minimum * c + d % c])

    def _scale(self, which, page, h, slot, d):
        return T.Cast("float32", self.scales[which][page, h, slot, d // KV_BLOCK])


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
    """Whether attention unpacks each page once (PageRows) rather than reading the pool on every walk over it:
    for quantized parts. f16 and bf16 pools are read directly: converting them is one instruction a vector, and
    unpacking them measured no faster (Qwen2.5-Coder-0.5B at 4096 tokens, prefill and decode alike)."""
    return fmt.k in QUANTIZED_KV or fmt.v in QUANTIZED_KV


class PageScaledKeys:
    """q4_ch keys of one page read through its per-channel scales and minimums copied into channel order (rows 0
    and 1 of `scales`, f32 [>= 2, head_dim], filled by read_page_scales): a loop over a page's slots then reads them
    as contiguous lanes, where SlotRows.load gathers them from the rows that hold them for every element."""

    def __init__(self, rows: SlotRows, scales):
        self.rows, self.scales = rows, scales

    def load(self, which, page, h, slot, d):
        return T.Cast("float32", self.rows.nibble(0, page, h, slot, d)) * self.scales[0, d] + self.scales[1, d]


@T.macro
def read_page_scales(rows, scales, page, h):
    """A q4_ch page's key scales into scales[0, :] and its minimums into scales[1, :], in channel order."""
    c = T.meta_var(rows.fmt.channels_per_row)
    for o in range(rows.fmt.page_size):
        for j in T.vectorized(c):
            scales[0, o * c + j] = rows.page_scale(0, page, h, o * c + j, 0)
            scales[1, o * c + j] = rows.page_scale(0, page, h, o * c + j, 1)


@T.macro
def unpack_page(page_rows, rows, page, h, page_size, head_dim):
    """Every slot of a page's key and value rows as float32 into page_rows' buffers (slots past the sequence's
    end too: they hold whatever the pool held, and attention masks them as it masks them in the pool)."""
    keys = T.meta_var(page_rows.buffers[0])
    values = T.meta_var(page_rows.buffers[1])
    if rows.dtype(0) == "q4_ch":
        # the page's per-channel scales and minimums first, into the values' buffer (rows 0 and 1, overwritten
        # below): each key element then reads them in channel order rather than from the row that holds them
        read_page_scales(rows, values, page, h)
        scaled = T.meta_var(PageScaledKeys(rows, values))
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
def with_pool_rows(pool, fmt, body, *args):
    """body(SlotRows, *args) with the pool's views declared."""
    pages = T.meta_var(pool.shape[0])
    kq = T.decl_buffer(**view_spec(fmt, pages, 0, False), data=pool.data)
    ks = T.decl_buffer(**view_spec(fmt, pages, 0, True), data=pool.data)
    vq = T.decl_buffer(**view_spec(fmt, pages, 1, False), data=pool.data)
    vs = T.decl_buffer(**view_spec(fmt, pages, 1, True), data=pool.data)
    body(SlotRows(fmt, kq, ks, vq, vs), *args)


def _nibble(scaled):
    """q4_0's quant of x / d: min(15, round(x / d) + 8) as uint8 (x / d lies in [-8, 8])."""
    return T.Cast("uint8", T.min(T.round(scaled) + T.float32(8), T.float32(15)))


@T.macro
def store_slot(rows, which, page, h, slot, x, t):
    """Row x[t, h, :] (f32 [n, kv_heads, head_dim]) into a slot's key (0) or value (1), quantized per block of 32
    by kv_format's rule (the block's scale first; the numpy emulation is kv_format.encode_rows)."""
    dtype = T.meta_var(rows.dtype(which))
    q = T.meta_var(rows.quants[which])
    s = T.meta_var(rows.scales[which])
    D = T.meta_var(rows.fmt.head_dim)
    if dtype == "q8_0" or dtype == "q4_0":
        stats = T.decl_buffer((3,), "float32", scope="global")    # block max, block min, 1 / scale
        for b in range(D // KV_BLOCK):
            stats[0] = x[t, h, b * KV_BLOCK]
            stats[1] = x[t, h, b * KV_BLOCK]
            for e in range(1, KV_BLOCK):
                stats[0] = T.max(stats[0], x[t, h, b * KV_BLOCK + e])
                stats[1] = T.min(stats[1], x[t, h, b * KV_BLOCK + e])
            if dtype == "q8_0":
                # d = max|x| / 127
                stats[2] = T.max(stats[0], T.float32(0) - stats[1]) / T.float32(127)
                s[page, h, slot, b] = T.Cast("float16", stats[2])
                stats[2] = T.Select(stats[2] > T.float32(0), T.float32(1) / stats[2], T.float32(0))
                for e in T.vectorized(KV_BLOCK):
                    q[page, h, slot, b * KV_BLOCK + e] = T.Cast("int8", T.round(x[t, h, b * KV_BLOCK + e] * stats[2]))
            else:
                # d = (the value of largest magnitude) / -8
                stats[2] = T.Select(stats[0] >= T.float32(0) - stats[1], stats[0], stats[1]) / T.float32(-8)
                s[page, h, slot, b] = T.Cast("float16", stats[2])
                stats[2] = T.Select(stats[2] != T.float32(0), T.float32(1) / stats[2], T.float32(0))
                for j in T.vectorized(KV_BLOCK // 2):
                    q[page, h, slot, b * (KV_BLOCK // 2) + j] = _nibble(x[t, h, b * KV_BLOCK + j] * stats[2]) | (
                        _nibble(x[t, h, b * KV_BLOCK + KV_BLOCK // 2 + j] * stats[2]) << T.uint8(4))
    else:
        for d in T.vectorized(D):
            q[page, h, slot, d] = T.Cast(dtype, x[t, h, d])


def _channel_nibble(values, stats, o, d):
    """q4_ch's quant of values[o, d]: min(15, max(0, round((x - m) / d))) as uint8."""
    scaled = (values[o, d] - stats[2, d]) * stats[3, d]
    return T.Cast("uint8", T.min(T.max(T.round(scaled), T.float32(0)), T.float32(15)))


@T.macro
def encode_page_keys(rows, page, h, values, end):
    """q4_ch: the keys f32 values[0 .. end - 1, :] (a buffer [page_size, head_dim]) into slots 0 .. end - 1 of a page
    and the page's per-channel scales and minimums (kv_format's rule)."""
    q = T.meta_var(rows.quants[0])
    s = T.meta_var(rows.scales[0])
    D = T.meta_var(rows.fmt.head_dim)
    c = T.meta_var(rows.fmt.channels_per_row)
    # per channel: min, max, then the stored minimum and 1 / the stored scale
    stats = T.decl_buffer((4, D), "float32", scope="global")
    for d in T.vectorized(D):
        stats[0, d] = values[0, d]
        stats[1, d] = values[0, d]
    for o in range(1, end):
        for d in T.vectorized(D):
            stats[0, d] = T.min(stats[0, d], values[o, d])
            stats[1, d] = T.max(stats[1, d], values[o, d])
    for d in range(D):
        s[page, h, d // c, d % c] = T.Cast("float16", (stats[1, d] - stats[0, d]) / T.float32(15))
        s[page, h, d // c, c + d % c] = T.Cast("float16", stats[0, d])
        stats[2, d] = T.Cast("float32", s[page, h, d // c, c + d % c])
        stats[3, d] = T.Cast("float32", s[page, h, d // c, d % c])
        stats[3, d] = T.Select(stats[3, d] != T.float32(0), T.float32(1) / stats[3, d], T.float32(0))
    for o in range(end):
        for b in range(D // KV_BLOCK):
            for j in T.vectorized(KV_BLOCK // 2):
                q[page, h, o, b * (KV_BLOCK // 2) + j] = _channel_nibble(values, stats, o, b * KV_BLOCK + j) | (
                    _channel_nibble(values, stats, o, b * KV_BLOCK + KV_BLOCK // 2 + j) << T.uint8(4))


@T.macro
def store_page_keys(rows, page, h, held, end, x, t0):
    """q4_ch: slots held .. end - 1 of a page take keys x[t0 + (o - held), h, :] (f32 [n, kv_heads, head_dim]), and
    the page is encoded again over slots 0 .. end - 1: the held slots read back as stored, then kv_format's q4_ch
    rule per channel (the numpy emulation is kv_format.append_page_keys)."""
    P = T.meta_var(rows.fmt.page_size)
    D = T.meta_var(rows.fmt.head_dim)
    values = T.decl_buffer((P, D), "float32", scope="global")
    for o in range(held):
        for d in T.vectorized(D):
            values[o, d] = rows.load(0, page, h, o, d)
    for o in range(end - held):
        for d in T.vectorized(D):
            values[held + o, d] = x[t0 + o, h, d]
    encode_page_keys(rows, page, h, values, end)
