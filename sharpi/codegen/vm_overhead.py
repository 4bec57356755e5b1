"""Less work for the Relax VM's interpreter a generated token: the steps of a small model are bound by the host's
calls (views, tuple accesses, allocations, frees, each one VM builtin call) as much as by its kernels
(benchmarks/gpu.md; counted by sharpi.testing.step_count).

- lift_weight_work: the work of a per-token function that depends on the weights alone (each weight's tuple
  access, each GPU scale field's view) runs once at load instead (TVM's LiftTransformParams).
- kills_except: TVM's KillAfterLastUse, which frees each value after its last use, spared in the functions whose
  intermediates all live in storage planned once a call.
"""
from __future__ import annotations

import tvm
from tvm import relax

from ..common.errors import CompileError

# The functions called once a generated token. Their work that depends on the weights alone (each scale field's
# view, each weight's tuple access: about 900 VM builtin calls a SmolLM2 step) is lifted into a function of its
# own, NAME_transform_params, which the runtime calls once at load; they then take the weights it returns as
# parameters of their own, after their inputs (manifest target "lifted_params").
LIFTED_FUNCTIONS = ("decode", "decode_batch")
# Functions whose intermediates all have static shapes, so StaticPlanBlockMemory plans every one into storage
# allocated once a call: the frees TVM's KillAfterLastUse adds after each value's last use (one VM builtin call
# each, 1,426 a SmolLM2 decode step) release nothing the plan does not reuse anyway.
STATIC_FUNCTIONS = ("decode",)


def lift_weight_work(mod: tvm.IRModule) -> tvm.IRModule:
    """TVM's LiftTransformParams over each of LIFTED_FUNCTIONS (`decode_transform_params`, ...; shared across the
    two it keeps the weight tuple as a parameter). What it lifts must be views and tuple accesses, never a kernel:
    a computed weight would be a second copy of it in GPU memory."""
    names = {gv.name_hint for gv in mod.get_global_vars() if gv.name_hint in LIFTED_FUNCTIONS}
    mod = on_functions(mod, lambda name: name in names, relax.transform.LiftTransformParams())
    for name in names:
        calls = []
        relax.analysis.post_order_visit(mod[f"{name}_transform_params"], lambda e: calls.append(e) if
                                        isinstance(e, relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir") else None)
        if calls:
            raise CompileError(f"lifting {name}'s weight views computed {len(calls)} weight(s) with kernels")
    return mod


def on_functions(mod: tvm.IRModule, chosen, module_pass) -> tvm.IRModule:
    """`module_pass` run over the Relax functions whose names `chosen` accepts (beside every other kind of
    function); the rest are kept as they are."""
    spared = {gv: f for gv, f in mod.functions_items()
              if isinstance(f, relax.Function) and not chosen(gv.name_hint)}
    part = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in spared}, attrs=mod.attrs,
                        global_infos=mod.global_infos)
    functions = dict(module_pass(part).functions_items())
    functions.update(spared)
    return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)


def kills_except(names: tuple[str, ...]) -> tvm.transform.Pass:
    """KillAfterLastUse over every Relax function but `names`, whose var-to-var bindings (each a VM register copy)
    are canonicalized away as KillAfterLastUse does first."""

    @tvm.transform.module_pass(opt_level=0, name="sharpi.KillAfterLastUseExcept")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = on_functions(mod, lambda name: name not in names, relax.transform.KillAfterLastUse())
        return on_functions(mod, lambda name: name in names, relax.transform.CanonicalizeBindings())

    return _pass
