"""What every kernel family shares: the token dimension, ceil_div, the CPU vector width, the finite minus infinity, the
attributes of a hand-scheduled GPU kernel, a CPU read prefetch."""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

# f32 lanes of the CPU kernels' vectors (AVX2's 256 bits; LLVM splits or joins them for other widths)
LANES = 8
# Finite "minus infinity" for masked scores and empty maxima: exp(NEG_INF - m) underflows to 0, and
# exp(NEG_INF - NEG_INF) = 1 where a query has seen no visible slot yet, without the NaN of inf - inf.
NEG_INF = -3.0e38
# A GPU kernel written with explicit thread bindings: dlight leaves it be, fusion treats it as opaque.
GPU_KERNEL_ATTRS = {"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True}


def prefetch(flat, index):
    """A read prefetch of element `index` of a flat buffer into every cache level (llvm.prefetch: prefetcht0)."""
    return T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(flat[index]), T.int32(0),
                                         T.int32(3), T.int32(1)))


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up (Python ints: loop extents and grid sizes known when the kernel is made)."""
    return (a + b - 1) // b


def token_count(tokens: int | None):
    """The token dimension of a kernel: a symbolic int64 var, or a constant for specialized (decode) kernels."""
    return tirx.Var("n", "int64") if tokens is None else tokens


# SnapKV's score op takes its window as a signed count: |window| scoring queries, summed over them and averaged
# over a KV head's query heads when positive, their maximum when negative (KVzip's reduction). The sign rides
# on the one int32 the op already takes, so the function's signature, and artifacts compiled before, stay as
# they were.
def score_width(window):
    return T.if_then_else(window[0] < 0, -window[0], window[0])


def score_reduce(window, acc, p):
    return T.if_then_else(window[0] < 0, T.max(acc, p), acc + p)
