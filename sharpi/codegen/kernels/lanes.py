"""Horizontal reductions over the lanes of a vector register kept in a small buffer row: written as pairwise trees
of scalar reads, which LLVM turns into shuffles and adds (TIR has no vector-reduce op of its own).

CPU kernels declare such scratch buffers with scope "global": TVM places a global allocation under 1 KB on the
stack (and LLVM then keeps it in registers), where a "local" one costs a TVMBackendAllocWorkspace call every
time its scope is entered - every task of a parallel loop; ~16,000 calls and ~1 ms of a gemma3 decode step."""
from __future__ import annotations

from tvm.script import tirx as T


def _tree(values, combine):
    while len(values) > 1:
        pairs = [combine(values[j], values[j + 1]) for j in range(0, len(values) - 1, 2)]
        values = pairs + values[len(pairs) * 2:]
    return values[0]


def lane_total(buf, *index, lanes: int = 8):
    """buf[index..., 0] + ... + buf[index..., lanes - 1]."""
    return _tree([buf[(*index, j)] for j in range(lanes)], lambda a, b: a + b)


def lane_max(buf, *index, lanes: int = 8):
    return _tree([buf[(*index, j)] for j in range(lanes)], T.max)
