"""The SnapKV pass: from `prefill`, derive `prefill_snapkv`, which also scores every prompt position from the
last `window` queries of each attention layer, and add `snapkv_select` and `snapkv_compact`.

    prefill_snapkv(ids, pos, pool, page_table, kv_lens, params, window) -> (logits, scores [L, KVH, slots])
    snapkv_select(scores, select_params [SELECT_PARAMS]) -> keep [L, KVH, slots]
    snapkv_compact(pool, page_table, keep, count [L]) -> pool (in place; layer l keeps count[l] slots)

The score op is inserted right after each attention call, reading the same post-RoPE queries the attention
read, so no query capture buffer is needed: the layer's keys are final once its attention ran. Plain `prefill`
is left untouched, so a prompt that is not evicted pays nothing. The pass knows nothing of targets: it emits the
named ops of sharpi.common.ops and codegen attaches kernels.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import op as R

from ..common import ops
from ..common.ops import SELECT_PARAMS
from .named_ops import extern_name

SNAPKV_FUNCTIONS = ("prefill_snapkv", "snapkv_select", "snapkv_compact")


@relax.expr_functor.mutator
class _InsertScores(relax.PyExprMutator):
    """Emit a score op after every paged-attention binding, and make the function's output
    (logits, stacked scores)."""

    def __init__(self, window: relax.Var):
        super().__init__()
        self.window = window
        self.scores: list[relax.Var] = []

    def visit_var_binding_(self, binding):
        value = self.visit_expr(binding.value)
        name = binding.var.name
        if isinstance(binding.var, relax.DataflowVar):
            new_var = self.builder_.emit(value, name_hint=name)
        else:                                       # the function's output: return the scores beside it
            logits = self.builder_.emit(value, name_hint=name)
            stacked = self.builder_.emit(R.stack(self.scores, axis=0), name_hint="snapkv_scores")
            new_var = self.builder_.emit_output(relax.Tuple([logits, stacked]), name_hint=name)
        self.set_var_remap(binding.var, new_var)
        if extern_name(value) == ops.PAGED_ATTENTION:
            self._emit_score(value)

    def _emit_score(self, attention) -> None:
        q, pool, page_table, kv_lens, layer, scale, _ = attention.args[1].fields
        kv_heads = pool.ty.shape[2]
        slots = page_table.ty.shape[1] * pool.ty.shape[3]
        score = relax.call_dps_packed(ops.SNAPKV_SCORE, [q, pool, page_table, kv_lens, layer, self.window, scale],
                                      relax.TensorType((kv_heads, slots), "float32"))
        self.scores.append(self.builder_.emit(score, name_hint=f"snapkv_score{len(self.scores)}"))


def derive_prefill_snapkv(prefill: relax.Function) -> relax.Function:
    """prefill with a `window` parameter and the stacked per-layer scores as a second output.

    Every variable of the new function is fresh (Relax forbids sharing one between functions): parameters are
    re-created and remapped, bindings are re-emitted by the mutator, symbolic shape vars are rebound."""
    window = relax.Var("window", relax.TensorType((1,), "int32"))
    mutator = _InsertScores(window)
    params = []
    for old in prefill.params:
        new = relax.Var(old.name, old.ty)
        mutator.set_var_remap(old, new)
        params.append(new)
    body = mutator.visit_expr(prefill.body)
    if not mutator.scores:
        raise ValueError("prefill has no paged-attention calls for SnapKV to score.")
    func = relax.Function(params + [window], body, is_pure=False, attrs=prefill.attrs)
    fresh_shape_vars = {v: tvm.tirx.Var(v.name, "int64") for v in relax.analysis.defined_symbolic_vars(prefill)}
    return func.bind_symbolic_vars(fresh_shape_vars).with_attr("global_symbol", "prefill_snapkv")


def _select_and_compact(bb: relax.BlockBuilder, layers: int, kv_heads: int, slots: int, pool_ty) -> None:
    scores = relax.Var("scores", relax.TensorType((layers, kv_heads, slots), "float32"))
    params = relax.Var("select_params", relax.TensorType((SELECT_PARAMS,), "int32"))
    keep_ty = relax.TensorType((layers, kv_heads, slots), "int32")
    with bb.function("snapkv_select", [scores, params], attrs={"num_input": 2}):
        with bb.dataflow():
            keep = bb.emit_output(relax.call_dps_packed(ops.SNAPKV_SELECT, [scores, params], keep_ty))
        bb.emit_func_output(keep)
    pool_ty = relax.TensorType([tvm.tirx.Var("pages", "int64")] + list(pool_ty.shape)[1:], str(pool_ty.dtype))
    pool = relax.Var("pool", pool_ty)
    page_table = relax.Var("page_table", relax.TensorType((layers, slots // int(pool_ty.shape[3])), "int32"))
    keep = relax.Var("keep", keep_ty)
    count = relax.Var("count", relax.TensorType((layers,), "int32"))
    with bb.function("snapkv_compact", [pool, page_table, keep, count], attrs={"num_input": 4}, pure=False):
        with bb.dataflow():
            out = bb.emit_output(relax.call_dps_packed(ops.KV_COMPACT, [pool, page_table, keep, count], pool_ty))
        bb.emit_func_output(out)


def snapkv_pass(mod: tvm.IRModule) -> tvm.IRModule:
    """Add prefill_snapkv, snapkv_select and snapkv_compact to a module that has `prefill`."""
    prefill = mod["prefill"]
    derived = derive_prefill_snapkv(prefill)
    pool_ty = prefill.params[2].ty
    page_table_ty = prefill.params[3].ty
    layers, max_pages = (int(d) for d in page_table_ty.shape)
    kv_heads, page_size = int(pool_ty.shape[2]), int(pool_ty.shape[3])
    mod = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(dict(mod.functions_items()))
    mod["prefill_snapkv"] = derived
    bb = relax.BlockBuilder(mod)
    _select_and_compact(bb, layers, kv_heads, max_pages * page_size, pool_ty)
    return relax.transform.Normalize()(bb.get())
