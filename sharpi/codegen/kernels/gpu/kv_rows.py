"""How the GPU kernels read and write the KV pool's slots, for every KVFormat (sharpi.common.kv_format), through
the codecs' GPU pieces (sharpi.common.kv_codecs): the twin of ..kv_rows for kernels that must also compile to WGSL.

The plain float layout is read and written as its element type. The packed layout (one row of bytes a slot: the
key's part, then the value's, each laid out by its codec) is taken as 32-bit words: the kernels' pool parameter is
a uint32 [pages, 1, kv_heads, page_size, row_bytes / 4] view of the runtime's uint8 pool (attach_kernels makes the
view). WGSL has no 8- or 16-bit integer types, so the codecs take a word's bytes, nibbles and f16 halves apart with
shifts and masks (kv_codecs.gpu_words): the same TIR then runs on Vulkan, where the tests hold it to the codecs'
numpy rules, and on CUDA.

A store composes whole words: a slot's row is written by the invocations of its (token, KV head) workgroup, each
owning whole words (no two write one word, so no byte or sub-word write is ever needed). First the invocations
owning a block (one per block statistic of the key and of the value: codec.gpu_blocks) compute it into workgroup
memory (codec.gpu_block_scale); after a barrier every word of the row is composed from the source floats and those
statistics (codec.gpu_quant_word, gpu_scale_word). A subnormal f32 block scale (blocks below ~1e-36) may be flushed
to zero by a GPU; the emulation keeps it.

Page-scaled keys (q4_ch), whose side data belongs to their page, are written a page at a time by one workgroup
(store_page_keys: the page staged as f32 in workgroup memory, then codec.gpu_encode_page); kv_append runs a
workgroup per page it writes and KV head, compaction one per layer and KV head, walking its destination pages in
order.
"""
from __future__ import annotations

from tvm.script import tirx as T

from ....common.errors import ConfigError
from ....common.kv_codecs.blocks import even
from ....common.kv_codecs.gpu_words import WORD, float_to_half, half_to_float  # noqa: F401 (tests use them)
from ....common.kv_format import KVFormat
from ..common import ceil_div


class GpuRows:
    """One kernel's view of the pool: its parameter's shape and type, element reads, and (store_row) writes."""

    def __init__(self, fmt: KVFormat):
        self.fmt = fmt
        if fmt.packed and fmt.row_bytes % WORD:
            raise ConfigError(f"The GPU kernels read a {fmt.name} KV cache as 32-bit words, and its rows of "
                              f"{fmt.row_bytes} bytes (head_dim {fmt.head_dim}) are not whole words; use an even "
                              f"head_dim or --kv-dtype f16.")
        self.words = fmt.row_bytes // WORD

    @classmethod
    def of(cls, kv_dtype, kv_heads: int, page_size: int, head_dim: int) -> "GpuRows":
        """From a KV type name (keys and values alike), a (key, value) pair, or a KVFormat."""
        return cls(KVFormat.of(kv_dtype, kv_heads, page_size, head_dim))

    # -- the pool parameter -----------------------------------------------------------------------------------
    @property
    def pool_dtype(self) -> str:
        return "uint32" if self.fmt.packed else self.fmt.k

    def pool_shape(self, pages) -> tuple:
        fmt = self.fmt
        if fmt.packed:
            return (pages, 1, fmt.kv_heads, fmt.page_size, self.words)
        return fmt.pool_shape(pages)

    @property
    def row_units(self) -> tuple[int, int]:
        """(parts, elements a part) of a slot's row in the pool's elements: (2, head_dim) plain, (1, words)
        packed; a compaction moves these."""
        return (1, self.words) if self.fmt.packed else (2, self.fmt.head_dim)

    def dtype(self, which: int) -> str:
        return (self.fmt.k, self.fmt.v)[which]

    def codec(self, which: int):
        return self.fmt.codec(which)

    @property
    def dot_step(self) -> int:
        """Elements a dot product over a key takes per (unrolled) step: a packed row's 4 that share a word (a
        q8_0 or q4_0 word's 4 quants, two f16 words), so that the compiler loads the word and its block's scale
        once for them; 1 for the plain layout."""
        return 4 if self.fmt.packed and self.fmt.head_dim % 4 == 0 else 1

    # -- reads ------------------------------------------------------------------------------------------------
    def load(self, pool, which: int, page, h, slot, d):
        """Element d of the key (0) or value (1) in a slot, as float32."""
        if not self.fmt.packed:
            return T.Cast("float32", pool[page, which, h, slot, d])
        return self.codec(which).gpu_load(self, pool, which, page, h, slot, d)

    # -- the store's pieces -----------------------------------------------------------------------------------
    def blocks(self, which: int) -> int:
        """Block statistics a store of a part computes first (0 for a float part)."""
        return self.codec(which).gpu_blocks(self.fmt.part(which))

    def scratch(self, which: int) -> int:
        """The f32 workgroup slots a store of a part fills before its words (its block statistics; more where a
        codec stages the whole row: codec.gpu_scratch)."""
        return self.codec(which).gpu_scratch(self.fmt.part(which))

    def regions(self, which: int) -> tuple[int, int, int]:
        """A part's words: (first word, quant or element words, side-data words incl. padding)."""
        part = self.fmt.part(which)
        quant_words = (part.quants.nbytes + WORD - 1) // WORD
        return part.offset // WORD, quant_words, part.nbytes // WORD - quant_words


@T.macro
def _store_part(rows, which, pool, x, t, h, page, slot, scales, inverse, tx, threads):
    """The words of one part of a slot's row, each by one invocation (word i by invocation i % threads)."""
    codec = T.meta_var(rows.codec(which))
    first = T.meta_var(rows.regions(which)[0])
    count = T.meta_var(rows.regions(which)[1])
    scale_words = T.meta_var(rows.regions(which)[2])
    for c in T.unroll((count + threads - 1) // threads):
        if c * threads + tx < count:
            pool[page, 0, h, slot, first + c * threads + tx] = codec.gpu_quant_word(rows, which, x, t, h,
                                                                                    c * threads + tx, scales, inverse)
    if scale_words > 0:
        for c in T.unroll((scale_words + threads - 1) // threads):
            if c * threads + tx < scale_words:
                pool[page, 0, h, slot, first + count + c * threads + tx] = codec.gpu_scale_word(
                    rows, which, c * threads + tx, scales)


@T.macro
def store_row(rows, pool, k, v, t, h, page, slot, tx, threads):
    """A slot's key k[t, h, :] and value v[t, h, :] (f32 [n, kv_heads, head_dim]) into the pool, by the
    `threads` invocations (tx) of one workgroup, which every one of them must reach (it holds a barrier when
    a part computes block statistics). The numpy emulation is kv_format.encode_rows. Page-scaled keys are left to
    store_page_keys: only the value is stored."""
    if not rows.fmt.packed:
        for c in T.unroll((rows.fmt.head_dim + threads - 1) // threads):
            if c * threads + tx < rows.fmt.head_dim:
                pool[page, 0, h, slot, c * threads + tx] = T.Cast(rows.fmt.k, k[t, h, c * threads + tx])
                pool[page, 1, h, slot, c * threads + tx] = T.Cast(rows.fmt.k, v[t, h, c * threads + tx])
    else:
        keys = T.meta_var(not rows.fmt.page_scaled_keys)
        kb = T.meta_var(rows.blocks(0) if keys else 0)
        vb = T.meta_var(rows.blocks(1))
        if kb + vb > 0:
            # the blocks' statistics (a scale d, rounded when stored, and 1 / d; a codec may stage more: scratch),
            # keys' then values'; in an even
            # count, so that a scale word's read of block 2i + 1 stays inside its array (and none of size 0). One
            # invocation a block: head_dim / 16 blocks in all, fewer than the workgroup's min(head_dim, 256)
            k_scales = T.alloc_buffer((even(rows.scratch(0) if keys else 0),), "float32", scope="shared")
            k_inverse = T.alloc_buffer((even(kb),), "float32", scope="shared")
            v_scales = T.alloc_buffer((even(rows.scratch(1)),), "float32", scope="shared")
            v_inverse = T.alloc_buffer((even(vb),), "float32", scope="shared")
            stats = T.alloc_buffer((3,), "float32", scope="local")       # block max, block min, d
            if kb > 0 and vb > 0:
                if tx < kb:
                    rows.codec(0).gpu_block_scale(rows, 0, k, t, h, tx, k_scales, k_inverse, stats)
                elif tx < kb + vb:
                    rows.codec(1).gpu_block_scale(rows, 1, v, t, h, tx - kb, v_scales, v_inverse, stats)
            elif kb > 0:
                if tx < kb:
                    rows.codec(0).gpu_block_scale(rows, 0, k, t, h, tx, k_scales, k_inverse, stats)
            elif tx < vb:
                rows.codec(1).gpu_block_scale(rows, 1, v, t, h, tx, v_scales, v_inverse, stats)
            T.tvm_storage_sync("shared")
            if keys:
                _store_part(rows, 0, pool, k, t, h, page, slot, k_scales, k_inverse, tx, threads)
            _store_part(rows, 1, pool, v, t, h, page, slot, v_scales, v_inverse, tx, threads)
        else:
            if keys:
                _store_part(rows, 0, pool, k, t, h, page, slot, None, None, tx, threads)
            _store_part(rows, 1, pool, v, t, h, page, slot, None, None, tx, threads)


# -- page-scaled keys: a page at a time -------------------------------------------------------------------------
@T.macro
def stage_page_keys(rows, pool, page, h, held, end, x, t0, staged, tx, threads):
    """staged[o, :] = the key slot o holds, read back as stored, for o < held, and x[t0 + o - held, h, :] for
    held <= o < end (f32 [n, kv_heads, head_dim]): the page as kv_append encodes it."""
    P = T.meta_var(rows.fmt.page_size)
    D = T.meta_var(rows.fmt.head_dim)
    for c in T.unroll(ceil_div(P * D, threads)):
        o = T.meta_var(T.Cast("int64", (c * threads + tx) // D))
        d = T.meta_var(T.Cast("int64", (c * threads + tx) % D))
        if c * threads + tx < P * D:
            if o < T.Cast("int64", held):
                staged[o, d] = rows.load(pool, 0, page, h, o, d)
            elif o < T.Cast("int64", end):
                staged[o, d] = x[T.Cast("int64", t0) + o - T.Cast("int64", held), h, d]


@T.macro
def store_page_keys(rows, pool, k, v, page, h, held, end, t0, tx, threads):
    """Page-scaled keys: slots held .. end - 1 of a page take keys k[t0 + (o - held), h, :] and values v[...] (f32
    [n, kv_heads, head_dim]); the page's keys are encoded again over slots 0 .. end - 1, the held ones read back as
    stored (the numpy emulation is kv_format.append_page_keys; the values', encode_rows). By one workgroup, every
    invocation of which must reach it (held and end the same for all)."""
    staged = T.alloc_buffer((rows.fmt.page_size, rows.fmt.head_dim), "float32", scope="shared")
    stage_page_keys(rows, pool, page, h, held, end, k, t0, staged, tx, threads)
    T.tvm_storage_sync("shared")
    rows.codec(0).gpu_encode_page(rows, pool, page, h, end, staged, tx, threads)
    for o in range(end - held):
        store_row(rows, pool, k, v, t0 + o, h, page, held + o, tx, threads)
        T.tvm_storage_sync("shared")      # the value blocks' scales are written again for the next slot
