"""The CPU decode attention kernel alone, per KV cache type: one layer's call over a cache of --slots slots holding
encoded random keys and values (a pool of random bytes would time NaN and subnormal scales instead), Qwen2.5-Coder-
0.5B's shape by default (14 query heads, 2 KV heads, head_dim 64). Run with TVM_NUM_THREADS set to the threads the
comparison wants. With --layers L the pool holds L layers' pages and the calls cycle through them, so that a call
reads its keys and values from memory (as decode does: a model's layers together outgrow the caches) rather than
from the L2/L3 its previous call filled.

    TVM_NUM_THREADS=2 python benchmarks/kv_attention_kernel.py [--types q4_0/q4_0,q8_0/q4_0,tq4/q4_0,tq4/tq4]
        [--slots 1056] [--heads 14] [--kv-heads 2] [--head-dim 64] [--calls 300] [--layers 1]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import tvm

from sharpi.codegen.kernels.paged_attention import make_paged_attention
from sharpi.codegen.targets.llvm import make_target
from sharpi.common.kv_format import KVFormat, encode_rows
from sharpi.common.ops import PAGE_SIZE


def time_type(pair, heads: int, kv_heads: int, head_dim: int, slots: int, calls: int, layers: int = 1) -> float:
    """Microseconds a call, the calls cycling through `layers` layers' pages."""
    fmt = KVFormat(*pair, kv_heads, PAGE_SIZE, head_dim)
    prim = make_paged_attention(heads, kv_heads, head_dim, PAGE_SIZE, head_dim ** -0.5, 1, kv_dtype=fmt)
    kernel = tvm.compile(tvm.IRModule({"main": prim}), target=make_target(None))        # this CPU
    pages = (slots + PAGE_SIZE - 1) // PAGE_SIZE * layers
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, pages * PAGE_SIZE, kv_heads, head_dim)).astype(np.float32)
    rows = encode_rows(fmt, k, v) if fmt.packed else np.stack([k, v], 1).astype(fmt.pool_dtype)
    pool = (rows.reshape(pages, PAGE_SIZE, kv_heads, -1).transpose(0, 2, 1, 3)[:, None] if fmt.packed
            else rows.reshape(pages, PAGE_SIZE, 2, kv_heads, head_dim).transpose(0, 2, 3, 1, 4))
    args = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in
            (rng.standard_normal((1, heads, head_dim)).astype(np.float32), pool,
             np.arange(pages, dtype=np.int32).reshape(layers, -1), np.full(layers, slots - 1, np.int32))]
    out = tvm.runtime.tensor(np.zeros((1, heads, head_dim), np.float32))
    for call in range(20):
        kernel(*args, call % layers, out)
    start = time.perf_counter()
    for call in range(calls):
        kernel(*args, call % layers, out)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="q4_0/q4_0,q8_0/q4_0,q4_ch/q4_0,tq4/q4_0,tq3/q4_0,q8_0/tq4,tq4/tq4")
    p.add_argument("--slots", type=int, default=1056)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--layers", type=int, default=1, help="pages of this many layers, the calls cycling through them")
    args = p.parse_args()
    print(f"| K/V | us a call ({args.slots} slots) |\n| --- | ---: |")
    for pair in args.types.split(","):
        k, _, v = pair.partition("/")
        us = time_type((k, v or k), args.heads, args.kv_heads, args.head_dim, args.slots, args.calls,
                       args.layers)
        print(f"| {pair} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
