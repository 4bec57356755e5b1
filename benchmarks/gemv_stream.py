"""How fast the decode GEMVs stream their weights, with and without prefetching them (quant_matmul_int8's
PREFETCH_BYTES): each kernel alone on random weights of a model's shape, cycling through enough copies that they
come from memory rather than from the L3 (--working-set, 1.2 GB by default), beside the read bandwidth of one
process on the same threads (read_bandwidth.py, in a process of its own). GB/s counts the weight bytes a call reads.

    python benchmarks/gemv_stream.py [--threads 2] [--isa avx512-vnni,avx2] [--shapes q4_k:8960:1536,...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# a 1.5B qwen2's decode GEMVs (gate/up, down, q/o) and the output layer's, with the rows scaled up: a call of
# a real shape (10 MB) is too short to time alone
SHAPES = "q4_k:71680:1536,q4_k:15360:8960,q6_k:15360:8960,q6_k:71680:1536,q8_0:61440:1536,q4_0:71680:1536"


def _weights(qtype: str, N: int, K: int, rng, device):
    import tvm
    from sharpi.codegen.kernels.quant_matmul import cpu_quants
    from sharpi.common.quant_layout import BLOCK, LAYOUTS
    shape, dtype = cpu_quants(qtype, N, K)
    if dtype == "int8":
        qs = rng.integers(-127, 128, shape, dtype=np.int8)
    else:
        qs = rng.integers(0, 1 << 32, shape, dtype=np.uint64).astype(dtype)
    planes = LAYOUTS[qtype][1][2](N, K)[0]
    s = rng.uniform(1e-3, 1e-2, (planes, N, K // BLOCK)).astype(np.float32)
    return tvm.runtime.tensor(qs, device), tvm.runtime.tensor(s, device)


def stream(qtype: str, N: int, K: int, isa: str, prefetch_bytes: int, working_set: float, calls: int) -> float:
    """Weight GB/s of the GEMV over `calls` calls cycling through copies of its weights."""
    import tvm
    from sharpi.codegen.kernels.quant_matmul_int8 import make_gemv_int8
    from sharpi.codegen.targets.llvm import make_target
    kernel = tvm.compile(tvm.IRModule({"main": make_gemv_int8(qtype, N, K, isa, prefetch_bytes)}),
                         target=make_target(None))["main"]
    rng, device = np.random.default_rng(0), tvm.cpu()
    first = _weights(qtype, N, K, rng, device)
    nbytes = sum(p.numpy().nbytes for p in first)
    copies = [first] + [_weights(qtype, N, K, rng, device) for _ in range(max(1, int(working_set / nbytes)) - 1)]
    x = tvm.runtime.tensor(rng.standard_normal((1, K)).astype(np.float32), device)
    y = tvm.runtime.tensor(np.zeros((1, N), np.float32), device)
    for weights in copies:
        kernel(x, *weights, y)
    start = time.perf_counter()
    for i in range(calls):
        kernel(x, *copies[i % len(copies)], y)
    return nbytes * calls / (time.perf_counter() - start) / 1e9


def main(argv=None) -> int:
    import tvm
    from sharpi.codegen.kernels.quant_matmul_int8 import PREFETCH_BYTES
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", default="avx512-vnni,avx2")
    p.add_argument("--shapes", default=SHAPES, help="qtype:N:K, comma-separated")
    p.add_argument("--working-set", type=float, default=1.2e9, help="bytes of weight copies cycled through")
    p.add_argument("--calls", type=int, default=60)
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)     # before the pool starts (read_bandwidth.py says why)
    tvm.get_global_func("runtime.config_threadpool")(1, args.threads)
    read = float(subprocess.run([sys.executable, str(Path(__file__).with_name("read_bandwidth.py")),
                                 str(args.threads)], capture_output=True, text=True, check=True).stdout) / 1e9
    print(f"read bandwidth on {args.threads} threads: {read:.1f} GB/s; prefetch distance {PREFETCH_BYTES} bytes\n")
    print("| kernel | isa | GB/s, no prefetch | GB/s, prefetch | of the read, no prefetch | of the read, prefetch |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for isa in args.isa.split(","):
        for spec in args.shapes.split(","):
            qtype, N, K = spec.split(":")
            plain, ahead = (stream(qtype, int(N), int(K), isa, b, args.working_set, args.calls)
                            for b in (0, PREFETCH_BYTES))
            print(f"| {qtype} {N} x {K} | {isa} | {plain:.1f} | {ahead:.1f} | {plain / read:.0%} | {ahead / read:.0%} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
