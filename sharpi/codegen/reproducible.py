"""Reproducible builds: the same GGUF, options and sharpi give the same library, byte for byte, so a manifest sha256
pinned by a user (--expect-sha256) survives a rebuild with a cleared compile cache.

The only source of run-to-run differences found in TVM 0.27's Relax build (llvm and cuda) is VMShapeLower (the last pass of the default
pipeline, src/relax/backend/vm/vm_shape_lower.cc). It collects a function's symbolic shape expressions in a
`std::unordered_map<PrimExpr, ..., StructuralHash>`, and a free TIR variable (the `n` of `R.Tensor((n, 576))`)
hashes by its address; iterating that map orders the stores of each generated `shape_func` (`H[5] = 256 * H[0]`)
differently in every process. The order changes nothing at run time (each store reads only variable slots and
writes a slot of its own), but it changes the code, and also which shape functions come out structurally equal and
so are shared (BlockBuilder.AddFunction dedups): of two SmolLM2 builds one had shape_func..shape_func2, the next
shape_func..shape_func3, with other bodies behind the names. Seen as a different model.so in every fresh process;
the kernels, weights.bin, tokenizer.json and the manifest's other fields were identical, and no path, time or
build id of its own is in the library (ld's build id is a hash of the contents).

`relax_build_pipeline` is TVM's default pipeline followed by `CanonicalShapeFuncs`, which puts each shape
function's stores in slot order, shares the functions that are then equal, and names them shape_func, shape_func1,
... in the order the Relax functions first call them (module order, then binding order, both deterministic).
"""
from __future__ import annotations

import itertools

import tvm
import tvm_ffi
from tvm import ir, relax, tirx

SHAPE_FUNC = "shape_func"     # VMShapeLower's name hint for its generated PrimFuncs


def relax_build_pipeline(target: tvm.target.Target, base: tvm.transform.Pass | None = None) -> tvm.transform.Pass:
    """The Relax pipeline tvm.compile would run for `target` (relax.build's choice: the target's own default
    pipeline for a GPU, the generic one otherwise) or `base`, then CanonicalShapeFuncs; for
    tvm.compile(relax_pipeline=...)."""
    if base is None and "gpu" in target.keys:
        try:
            base = relax.get_default_pipeline(target)
        except (ValueError, AttributeError):
            base = None
    if base is None:
        base = relax.get_pipeline("default")
    return tvm.transform.Sequential([base, canonical_shape_funcs(), relax.transform.AttachGlobalSymbol()],
                                    name="sharpi.ReproducibleRelaxBuild")


def canonical_shape_funcs() -> tvm.transform.Pass:
    """The pass described in the module doc. The shape functions it writes carry no global_symbol:
    run relax.transform.AttachGlobalSymbol after it (relax_build_pipeline does)."""

    @tvm.transform.module_pass(opt_level=0, name="sharpi.CanonicalShapeFuncs")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _canonicalize(mod)

    return _pass


def _is_shape_func(gv: ir.GlobalVar, func) -> bool:
    """A PrimFunc VMShapeLower generated: named shape_func[N], one heap parameter, a body of stores into it."""
    if not isinstance(func, tirx.PrimFunc) or not gv.name_hint.startswith(SHAPE_FUNC):
        return False
    if not gv.name_hint[len(SHAPE_FUNC):].isdigit() and gv.name_hint != SHAPE_FUNC:
        return False
    return len(func.params) == 1 and _stores(func) is not None


def _stores(func: tirx.PrimFunc) -> list | None:
    """The body's stores `H[i] = expr` (constant i), or None if the body is anything else."""
    body = func.body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    if not all(isinstance(s, tirx.BufferStore) and len(s.indices) == 1 and isinstance(s.indices[0], tirx.IntImm)
               for s in stmts):
        return None
    return stmts


def _sorted_body(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The stores in slot order: each writes its own slot and reads only slots of variables (set before the call),
    so any order computes the same heap."""
    stores = sorted(_stores(func), key=lambda s: int(s.indices[0].value))
    body = stores[0] if len(stores) == 1 else tirx.SeqStmt(stores)
    return func.with_body(body).without_attr("global_symbol")


def _canonicalize(mod: tvm.IRModule) -> tvm.IRModule:
    shape_funcs = {gv: func for gv, func in mod.functions.items() if _is_shape_func(gv, func)}
    if not shape_funcs:
        return mod
    taken = {gv.name_hint for gv in mod.functions if gv not in shape_funcs}
    names = (name for n in itertools.count() for name in [SHAPE_FUNC + (str(n) if n else "")] if name not in taken)
    replacement: dict = {}              # old GlobalVar -> new GlobalVar
    canonical: list = []                # (new GlobalVar, sorted PrimFunc), in naming order

    def first_use(gv: ir.GlobalVar) -> None:
        if gv in replacement:
            return
        func = _sorted_body(shape_funcs[gv])
        for new_gv, known in canonical:
            if tvm_ffi.structural_equal(func, known):
                replacement[gv] = new_gv
                return
        new_gv = ir.GlobalVar(next(names))
        if gv.ty is not None:           # the callers' normalizer reads the callee's signature from its GlobalVar
            relax.expr._update_type(new_gv, gv.ty)
        replacement[gv] = new_gv
        canonical.append((new_gv, func))

    def visit(expr) -> None:
        if isinstance(expr, ir.GlobalVar) and expr in shape_funcs:
            first_use(expr)

    for func in mod.functions.values():       # in insertion order (tvm-ffi's Map keeps it)
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    for gv in shape_funcs:             # none should be left uncalled; kept (in module order) if one is
        first_use(gv)

    retarget = _Retarget(replacement)
    functions = {}
    for gv, func in mod.functions.items():
        if gv in shape_funcs:
            continue
        functions[gv] = retarget.visit_expr(func) if isinstance(func, relax.Function) else func
    functions.update(canonical)
    return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)


@relax.expr_functor.mutator
class _Retarget(relax.PyExprMutator):
    """Calls of the old shape functions redirected to their canonical GlobalVars."""

    def __init__(self, replacement: dict):
        super().__init__()
        self.replacement = replacement

    def visit_global_var_(self, op: ir.GlobalVar) -> relax.Expr:
        return self.replacement.get(op, op)
