"""The read bandwidth one process gets on N threads (the decode floor's denominator in cpu_vs_llama_cpp.py): a
TVM kernel sums 1 GiB of float32 in 256 parallel tasks, 4 chains of 16-lane adds each; best of 5 runs of 3.

    python benchmarks/read_bandwidth.py THREADS      # prints bytes per second
"""
from __future__ import annotations

import os
import sys

import numpy as np
import tvm
from tvm.script import tirx as T

N, TASKS = 1 << 28, 256
SPAN = N // TASKS


@T.prim_func
def total(x: T.Buffer((N,), "float32"), y: T.Buffer((TASKS, 16), "float32")):
    T.func_attr({"tirx.noalias": True})
    for c in T.parallel(TASKS):
        acc = T.decl_buffer((4, 16), "float32", scope="global")
        for a in range(4):
            acc[a, T.ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
        for i in range(SPAN // 64):
            for a in T.unroll(4):
                acc[a, T.ramp(0, 1, 16)] = acc[a, T.ramp(0, 1, 16)] + x[T.ramp(c * SPAN + i * 64 + a * 16, 1, 16)]
        y[c, T.ramp(0, 1, 16)] = (acc[0, T.ramp(0, 1, 16)] + acc[1, T.ramp(0, 1, 16)]
                                  + acc[2, T.ramp(0, 1, 16)] + acc[3, T.ramp(0, 1, 16)])


def main(argv) -> int:
    threads = int(argv[0])
    # as sharpi's runtime does (loader.configure_threads): config_threadpool alone left TVM's pool at one worker on
    # a 2-core Xeon VM (15 GB/s where 2 threads read 29)
    os.environ["TVM_NUM_THREADS"] = str(threads)
    tvm.get_global_func("runtime.config_threadpool")(1, threads)
    target = tvm.target.Target({"kind": "llvm", "mcpu": str(tvm.target.codegen.llvm_get_system_cpu())})
    kernel = tvm.compile(tvm.IRModule({"main": total}), target=target)
    x, y = tvm.runtime.tensor(np.ones(N, np.float32)), tvm.runtime.tensor(np.zeros((TASKS, 16), np.float32))
    seconds = min(kernel.mod.time_evaluator("main", tvm.cpu(), number=3, repeat=5)(x, y).results)
    assert float(y.numpy().sum()) == N      # every element read
    print(N * 4 / seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
