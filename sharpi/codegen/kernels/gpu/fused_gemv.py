"""One token's matmuls fused with the work around them, for GPU targets (CUDA, and WGSL on Vulkan): a decode step
of a small model is bound by its launches, not by the arithmetic (benchmarks/gpu.md), so a layer's q, k and v
are one kernel, and its FFN's gate and up another.

make_gpu_fused_gemv(FusedGemv(...)) computes, for one token x [1, K]:
    h = x / sqrt(mean(x^2) + eps) * g           where norm_eps is set (the RMSNorm before the matmuls), else x
    y_m = h W_m^T (+ bias_m)                    for each matrix m, whatever its quant type
and then, by `epilogue`:
    "split": each y_m as an output of its own, the first `rope.matrices` of them turned by RoPE at pos
             (q and k before the cache append: heads of head_dim, llama.cpp's NORM or NEOX pairs);
    "glu":   act(y_0) * y_1, one output (the gated FFN's input to its down matrix).

Schedule: 256 invocations a workgroup, eight groups of 32 lanes; a group computes one unit, two dot products over
K: two rows of one matrix (a RoPE pair, or neighbours), or row j of both matrices for "glu". Lane l takes the
8-element chunks l, l + 32, ... of K (coalesced words of quants; x and g come through the cache), the group's sum
is lane 0's, over the lanes' partial sums in workgroup memory (one barrier, in uniform control flow as WGSL
requires; no subgroup operations, which WebGPU lacks by default; TVM's barrier planner refuses a tree's conditional
halving steps), and lane 0 writes the unit. Every group also sums x^2 over K, so the norm costs no pass
and no launch of its own: the dot products use x * g and are scaled by the norm's factor at the end.

Written with TVM's IR builder (TVMScript's parser underneath) because the parameter list depends on the matrices'
types (a q4_1 matrix has a quants buffer and two scale fields, f16 one buffer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as TS
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from ....common.errors import CompileError
from ....common.quant_layout import BLOCK
from ..common import GPU_KERNEL_ATTRS
from .elementwise import lookup_u32, rope_turns
from .quant_matmul import GPU_LAYOUTS, gpu_weight_parts

LANES = 32
GROUPS = 8
THREADS = LANES * GROUPS
CHUNK = 8                   # elements of K a lane takes at a time


@dataclass(frozen=True)
class Matrix:
    qtype: str
    rows: int
    bias: bool = False
    head_dim: int = 0       # "split": the output as [1, rows / head_dim, head_dim] (heads), not [1, rows]

    def out_shape(self) -> tuple:
        return (1, self.rows // self.head_dim, self.head_dim) if self.head_dim else (1, self.rows)


@dataclass(frozen=True)
class Rope:
    layout: str             # "norm" or "neox" (kernels.rope.rope_pairs)
    head_dim: int
    theta: float
    matrices: int           # the first this many matrices are turned (q and k)


@dataclass(frozen=True)
class FusedGemv:
    k_in: int
    matrices: tuple[Matrix, ...]
    epilogue: str = "split"             # "split" or "glu"
    norm_eps: float | None = None
    activation: str | None = None       # glu: "silu" or "gelu_tanh"
    rope: Rope | None = None
    scale_prefixes: bool = False        # scale fields as kernels.gpu.quant_matmul.scale_fields(prefixes=) takes them

    def name(self) -> str:
        parts = ["gpu_gemv", self.epilogue, *(f"{m.qtype}x{m.rows}{'b' if m.bias else ''}"
                                              f"{f'h{m.head_dim}' if m.head_dim else ''}" for m in self.matrices),
                 str(self.k_in)]
        if self.norm_eps is not None:
            parts.append("norm")
        if self.activation:
            parts.append(self.activation)
        if self.rope:
            parts.append(f"rope{self.rope.layout}{self.rope.matrices}")
        return "_".join(parts)

    def units(self) -> list[int]:
        """Units (a group's work) per matrix ("split": two rows each) or in all ("glu": one a row)."""
        if self.epilogue == "glu":
            return [self.matrices[0].rows]
        return [m.rows // 2 for m in self.matrices]


def supported(spec: FusedGemv) -> bool:
    try:
        check(spec)
    except CompileError:
        return False
    return True


def check(spec: FusedGemv) -> None:
    """A CompileError for what the kernel does not do."""
    for m in spec.matrices:
        if m.qtype not in GPU_LAYOUTS:
            raise CompileError(f"Weights of type {m.qtype} have no GPU kernel yet (GPU layouts: "
                               f"{', '.join(GPU_LAYOUTS)}).")
        if m.rows % 2 or (m.head_dim and m.rows % m.head_dim):
            raise CompileError(f"the fused GEMV takes rows in pairs (and whole heads); a matrix has {m.rows}")
    if spec.k_in % BLOCK:
        raise CompileError(f"the fused GEMV takes K in blocks of {BLOCK}; K is {spec.k_in}")
    if spec.epilogue == "glu" and (len(spec.matrices) != 2 or spec.matrices[0].rows != spec.matrices[1].rows
                                   or spec.activation not in ACTIVATIONS):
        raise CompileError("the fused GEMV's glu takes two matrices of equal rows and silu or gelu_tanh")
    if spec.epilogue not in ("split", "glu"):
        raise CompileError(f"unknown fused GEMV epilogue {spec.epilogue!r}")


def _silu(a):
    return a / (TS.float32(1) + TS.exp(-a))


def _gelu_tanh(a):
    inner = TS.float32(math.sqrt(2 / math.pi)) * (a + TS.float32(0.044715) * a * a * a)
    return TS.float32(0.5) * a * (TS.float32(1) + TS.tanh(inner))


ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh}


class _Weights:
    """One matrix's parameters (gpu_weight_parts', named w{index}_...) and its element (row, k) as a TIR
    expression."""

    def __init__(self, index: int, m: Matrix, k_in: int, prefixes: bool):
        _, self.value = gpu_weight_parts(m.qtype, m.rows, k_in, prefixes,
                                         declare=lambda name, shape, dtype: _arg(f"w{index}_{name}", shape, dtype))
        self.bias = _arg(f"w{index}_bias", (m.rows,), "float32") if m.bias else None


def _arg(name: str, shape, dtype: str):
    """A buffer parameter named `name` (the Vulkan plan matches WGSL bindings to parameters by name)."""
    shape = tuple(TS.int64(d) if isinstance(d, int) else d for d in shape)
    return IRBuilder.name(name, T.match_buffer(T.arg("var_" + name, T.handle()), shape, dtype))


def _store(buf, value, *index):
    T.buffer_store(buf, value, list(index))


def make_gpu_fused_gemv(spec: FusedGemv) -> tirx.PrimFunc:
    """PrimFunc (x [1, K] f32, [g [K] f32,] [pos [1] int32,] then each matrix's parts as the GPU matmul takes them
    and its bias [rows], then the outputs: "split" one [1, rows] per matrix, "glu" one [1, rows])."""
    check(spec)
    K = spec.k_in
    chunks = K // CHUNK
    steps = (chunks + LANES - 1) // LANES
    units = spec.units()
    ends = [sum(units[:i + 1]) for i in range(len(units))]
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(spec.name())
            T.func_attr(GPU_KERNEL_ATTRS)
            x = _arg("x", (1, K), "float32")
            g = _arg("g", (K,), "float32") if spec.norm_eps is not None else None
            pos = _arg("pos", (1,), "int32") if spec.rope else None
            weights = [_Weights(i, m, K, spec.scale_prefixes) for i, m in enumerate(spec.matrices)]
            if spec.epilogue == "glu":
                outs = [_arg("y", (1, spec.matrices[0].rows), "float32")]
            else:
                outs = [_arg(f"y{i}", m.out_shape(), "float32") for i, m in enumerate(spec.matrices)]
            with T.thread_binding(TS.int64(0), TS.int64((ends[-1] + GROUPS - 1) // GROUPS), thread="blockIdx.x") as b:
                with T.thread_binding(TS.int64(0), TS.int64(THREADS), thread="threadIdx.x") as t:
                    red = T.alloc_buffer((3, THREADS), "float32", scope="shared")
                    acc = T.alloc_buffer((3,), "float32", scope="local")
                    lane, unit = t % LANES, b * GROUPS + t // LANES
                    for j in range(3):
                        _store(acc, TS.float32(0), j)
                    _for_units(spec, ends, unit, lambda i, u: _accumulate(
                        spec, x, g, acc, lane, steps, chunks, *_unit_rows(spec, weights, i, u)))
                    for j in range(3):
                        _store(red, acc[j], j, t)
                    T.evaluate(TS.tvm_storage_sync("shared"))
                    with T.If(lane == 0):
                        with T.Then():
                            with T.serial(TS.int64(1), TS.int64(LANES)) as other:
                                for j in range(3):
                                    _store(acc, acc[j] + red[j, t + other], j)
                            _for_units(spec, ends, unit, lambda i, u: _write(spec, weights, outs, pos, acc, i, u))
    return ib.get()


def _for_units(spec: FusedGemv, ends: list[int], unit, body) -> None:
    """body(i, u) under the branch of the unit's matrix i (u its index within the matrix's units); nothing past
    the last unit."""
    def branch(i):
        start = ends[i - 1] if i else 0
        with T.If(unit < ends[i]):
            with T.Then():
                body(i, unit - start)
            if i + 1 < len(ends):
                with T.Else():
                    branch(i + 1)
    branch(0)


def _unit_rows(spec: FusedGemv, weights, i: int, u):
    """(first matrix, its row, second matrix, its row) of unit u of matrix i."""
    if spec.epilogue == "glu":
        return weights[0], u, weights[1], u
    w = weights[i]
    if spec.rope and i < spec.rope.matrices and spec.rope.layout == "neox":
        half = spec.rope.head_dim // 2
        first = u // half * spec.rope.head_dim + u % half
        return w, first, w, first + half
    return w, 2 * u, w, 2 * u + 1


def _accumulate(spec, x, g, acc, lane, steps: int, chunks: int, wa, row_a, wb, row_b) -> None:
    with T.serial(TS.int64(0), TS.int64(steps)) as s:
        chunk = s * LANES + lane
        with T.If(chunk < chunks):
            with T.Then():
                with T.unroll(TS.int64(0), TS.int64(CHUNK)) as e:
                    k = chunk * CHUNK + e
                    xv = x[0, k] * g[k] if g is not None else x[0, k]
                    _store(acc, acc[0] + wa.value(row_a, k) * xv, 0)
                    _store(acc, acc[1] + wb.value(row_b, k) * xv, 1)
                    _store(acc, acc[2] + x[0, k] * x[0, k], 2)


def _write(spec: FusedGemv, weights, outs, pos, acc, i: int, u) -> None:
    """Lane 0's epilogue for unit u of matrix i, from the group's sums: the norm's factor, the biases, then RoPE,
    the GLU or nothing."""
    wa, row_a, wb, row_b = _unit_rows(spec, weights, i, u)
    a, b = acc[0], acc[1]
    if spec.norm_eps is not None:
        r = TS.rsqrt(acc[2] / TS.float32(spec.k_in) + TS.float32(spec.norm_eps))
        a, b = a * r, b * r
    if wa.bias is not None:
        a = a + wa.bias[row_a]
    if wb.bias is not None:
        b = b + wb.bias[row_b]
    if spec.epilogue == "glu":
        _store(outs[0], ACTIVATIONS[spec.activation](a) * b, 0, u)
        return
    if spec.rope and i < spec.rope.matrices:
        a, b = _turn(spec.rope, pos, u, a, b)
    head_dim = spec.matrices[i].head_dim
    for row, value in ((row_a, a), (row_b, b)):
        _store(outs[i], value, 0, *((row // head_dim, row % head_dim) if head_dim else (row,)))


def _turn(rope: Rope, pos, u, a, b):
    """The pair (a, b) of unit u turned by RoPE at pos[0], its angle in fixed point as elementwise's rope kernel
    computes it (same frequencies, same rounding)."""
    pair = u % (rope.head_dim // 2)
    phase = TS.reinterpret("int32", TS.Cast("uint32", pos[0]) * lookup_u32(rope_turns(rope.head_dim, rope.theta),
                                                                              pair))
    angle = TS.Cast("float32", phase) * TS.float32(2 * math.pi / 2.0 ** 32)
    c, s = TS.cos(angle), TS.sin(angle)
    return a * c - b * s, a * s + b * c
