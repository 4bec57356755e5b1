"""TVMScript for the codecs' kernel pieces, where the compiler is installed.

A codec module holds its numpy rule and the TIR pieces the kernels compose, and the runtime imports it for the
numpy half alone, also where only TVM's runtime is installed (benchmarks/gpu_check.py's device machine). There
tvm.script cannot be imported: `macro` then leaves a piece a plain function that nothing calls, and `T` is None.
"""
from __future__ import annotations

try:
    from tvm.script import tirx as T
except ImportError:          # TVM's runtime alone: no kernels are built here
    T = None


def macro(fn):
    """T.macro, or the function itself where TVMScript is not installed."""
    return T.macro(fn) if T is not None else fn
