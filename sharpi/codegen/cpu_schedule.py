"""Schedules for the CPU functions sharpi does not write by hand: what FuseOps/FuseTIR leave after legalization
(norms, residual adds, GELU/SiLU gates, slices, reshapes).

Left alone, TVM compiles them as written: one thread, scalar, and every fused op writing a whole [n, dim]
intermediate buffer (gemma3's GELU gate was nine such passes, 10% of a 512-token prefill). Here each function
gets its producers inlined into their consumers, its outer loop parallel (unless it runs once) and its inner
loop vectorized; norms (a reduction, then elementwise passes, per row) get the row loop parallel with every
block computed inside it. SiLU and GELU are legalized with topi's polynomial exp/tanh
(`fast_math_legalizations`), since LLVM turns its own exp and tanh into one libm call per element.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func


from .kernels.common import LANES


def schedule_generic(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Every PrimFunc that is not one of sharpi's hand-written kernels, scheduled for `target`."""
    updates = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or _is_hand_written(func):
            continue
        scheduled = _schedule_one(func, target)
        if scheduled is not None:
            updates[gv] = scheduled
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def _is_hand_written(func: tirx.PrimFunc) -> bool:
    """sharpi's kernels (codegen/kernels) are written as loops without blocks: nothing for a rule to match."""
    return "T.sblock(" not in func.script()


def _schedule_one(func: tirx.PrimFunc, target) -> tirx.PrimFunc | None:
    """The function scheduled, or None when no rule fits (it then compiles as written)."""
    for rule in (_schedule_elementwise, _schedule_row_reduction, _schedule_inner_reduction):
        try:
            sch = rule(func, target)
        except Exception:   # a rule that does not fit this function's structure; the next one may
            sch = None
        if sch is not None:
            return sch.mod["main"]
    return None


def _inlined(func: tirx.PrimFunc):
    """A schedule with every elementwise producer inlined into its consumer, and the blocks left."""
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None, None
    return sch, dl.try_inline(sch, infos)


def _schedule_elementwise(func: tirx.PrimFunc, target):
    """One injective block left: parallel over its outer loop (tokens), 8 lanes over the inner one."""
    sch, blocks = _inlined(func)
    if sch is None or len(blocks) != 1 or not blocks[0].is_injective():
        return None
    loops = sch.get_loops(blocks[0].block_rv)
    if len(loops) >= 2:
        _parallel_unless_one(sch, loops[0])
    _vectorize_inner(sch, loops[-1])
    return sch


def _schedule_row_reduction(func: tirx.PrimFunc, target):
    """A norm: per row (the leading spatial loop) reductions, then elementwise passes. The row loop is parallel
    and every block computed inside it; elementwise blocks get 8 lanes. (dlight's CPU Reduction rule does the
    same but always makes the row loop parallel: for decode's single row that is a thread-pool launch per norm,
    which cost 0.27 ms each on a busy 2-core machine.)"""
    sch, blocks = _inlined(func)
    if sch is None or len(blocks) < 2 or not blocks[-1].is_injective():
        return None
    if all(b.is_injective() for b in blocks) or any(not b.dom_kind().startswith("S") for b in blocks):
        return None
    row = sch.get_loops(blocks[-1].block_rv)[0]
    _parallel_unless_one(sch, row)
    _vectorize_inner(sch, sch.get_loops(blocks[-1].block_rv)[-1])
    for block in reversed(blocks[:-1]):
        sch.compute_at(block.block_rv, row, preserve_unit_loops=True)
    for block in blocks[:-1]:
        if block.is_injective():
            _vectorize_inner(sch, sch.get_loops(block.block_rv)[-1])
    return sch


def _schedule_inner_reduction(func: tirx.PrimFunc, target):
    """One block summing over a middle axis into [rows, width] (a mixture's weighted sum of its k experts'
    outputs): parallel over rows, the reduction loop moved outside the width loop, whose contiguous body LLVM's
    loop vectorizer then takes (TIR's vectorize refuses the update once its init is split off; the init gets 8
    lanes). Left as written it was scalar, through a whole [n, k, width] intermediate."""
    sch, blocks = _inlined(func)
    if sch is None or len(blocks) != 1 or blocks[0].is_injective():
        return None
    block = blocks[0].block_rv
    loops = sch.get_loops(block)
    kinds = blocks[0].dom_kind()
    if len(loops) != 3 or kinds != "SSR":
        return None
    row, width, reduce = loops
    sch.reorder(reduce, width)
    _parallel_unless_one(sch, row)
    init = sch.decompose_reduction(block, reduce)
    _vectorize_inner(sch, sch.get_loops(init)[-1])
    return sch


def _parallel_unless_one(sch, loop) -> None:
    """Parallel over `loop` unless it is known to run once (decode's single token)."""
    extent = sch.get(loop).extent
    if not (isinstance(extent, tirx.IntImm) and extent.value == 1):
        sch.parallel(loop)


def _vectorize_inner(sch, loop) -> None:
    extent = sch.get(loop).extent
    if isinstance(extent, tirx.IntImm) and extent.value % LANES == 0 and extent.value >= LANES:
        _, inner = sch.split(loop, factors=[None, LANES])
        sch.vectorize(inner)


def fast_math_legalizations() -> dict:
    """LegalizeOps overrides for the activations: TVM's own lowering calls libm's expf/tanhf per element (LLVM
    cannot vectorize them); topi's fast_exp / fast_tanh are polynomials (a few ulp) that vectorize."""
    from tvm import te, topi

    def silu(bb, call):
        return bb.call_te(lambda x: te.compute(x.shape, lambda *i: x(*i) / (
            tirx.const(1.0, "float32") + topi.fast_exp(te.compute(x.shape, lambda *j: -x(*j)))(*i)), name="silu"),
            call.args[0])

    def gelu_tanh(bb, call):
        def compute(x):
            inner = te.compute(x.shape, lambda *i: tirx.const(0.7978845608028654, "float32") * (
                x(*i) + tirx.const(0.044715, "float32") * x(*i) * x(*i) * x(*i)), name="gelu_inner")
            t = topi.fast_tanh(inner)
            return te.compute(x.shape, lambda *i: tirx.const(0.5, "float32") * x(*i) * (
                tirx.const(1.0, "float32") + t(*i)), name="gelu_tanh")
        return bb.call_te(compute, call.args[0])

    return {"relax.nn.silu": silu, "relax.nn.gelu_tanh": gelu_tanh}
