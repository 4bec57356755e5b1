"""The Vulkan pipeline: TVM builds the Relax module for WebGPU (WGSL), and we record what a wgpu runtime needs
to replay it: per kernel its WGSL, buffer bindings and POD arguments; per Relax function the ordered plan of
storage allocations and kernel launches with their launch geometry as shape expressions.

The TVM wheel has no SPIR-V codegen and no Vulkan runtime; wgpu-native translates the WGSL to SPIR-V and runs it
on Vulkan (lavapipe in CI). Everything is read from TVM's IR (the host function after SplitHostDevice, the
finalized device functions, the Relax function after LowerRuntimeBuiltin); only each buffer's read/write access
is read from the WGSL text, since TVM records it nowhere else that Python can reach.
See docs/spikes/vulkan/README.md for how this was worked out.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

import tvm
from tvm import ir, relax, tirx

WGSL_SCALAR = {"int32": "i32", "int64": "i32", "uint32": "u32", "float32": "f32", "float16": "f16"}


def webgpu_target() -> tvm.target.Target:
    return tvm.target.Target("webgpu", host="llvm")


@dataclass
class VulkanPlan:
    functions: dict = field(default_factory=dict)     # Relax function -> {"inputs", "sym_vars", "ops", "output"}
    prim_funcs: dict = field(default_factory=dict)    # host PrimFunc -> {"params", "param_shapes", "launches"}
    kernels: dict = field(default_factory=dict)       # device kernel -> {"wgsl", "buffers", "pod", ...}
    sources: dict = field(default_factory=dict)       # kernel -> WGSL text

    def to_json(self) -> dict:
        return {"functions": self.functions, "prim_funcs": self.prim_funcs, "kernels": self.kernels}


def shape_expr(e) -> str:
    """A TIR integer expression as a shape-expression string (sharpi.common.shape_expr evaluates it)."""
    if isinstance(e, int):
        return str(e)
    if isinstance(e, tirx.IntImm):
        return str(int(e.value))
    if isinstance(e, tirx.Var):
        return e.name
    binary = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%",
              tirx.Div: "//", tirx.Mod: "%"}    # shapes are non-negative, so truncating == flooring
    for cls, op in binary.items():
        if isinstance(e, cls):
            return f"({shape_expr(e.a)} {op} {shape_expr(e.b)})"
    if isinstance(e, (tirx.Min, tirx.Max)):
        return f"{'min' if isinstance(e, tirx.Min) else 'max'}({shape_expr(e.a)}, {shape_expr(e.b)})"
    if isinstance(e, tirx.Cast):
        return shape_expr(e.value)
    if isinstance(e, tirx.Call) and e.op.name in ("tirx.shift_right", "tirx.shift_left"):
        op = ">>" if e.op.name.endswith("right") else "<<"
        return f"({shape_expr(e.args[0])} {op} {shape_expr(e.args[1])})"
    raise NotImplementedError(f"shape expression {type(e).__name__}: {e}")


def lower_relax(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """TVM's GPU pipeline (legalize, fuse, dlight), stopped after LowerRuntimeBuiltin: each Relax function is then
    a flat list of storage allocations and PrimFunc calls with readable symbolic shapes."""
    from tvm.relax.backend import gpu_generic

    passes = (gpu_generic.library_dispatch_passes(target) + gpu_generic.legalize_passes(target)
              + gpu_generic.dataflow_lower_passes(target)
              + [relax.transform.StaticPlanBlockMemory(), relax.transform.LowerAllocTensor(),
                 relax.transform.KillAfterLastUse(), relax.transform.LowerRuntimeBuiltin(),
                 relax.transform.AttachGlobalSymbol()])
    with target:
        return tvm.transform.Sequential(passes)(mod)


def build_plan(mod: tvm.IRModule, target: tvm.target.Target | None = None) -> VulkanPlan:
    target = target or webgpu_target()
    lowered = lower_relax(mod, target)
    split, device = _build_tir(lowered, target)
    plan = VulkanPlan()
    _collect_kernels(device, target, plan)
    _collect_launches(split, plan)
    for gv, func in lowered.functions_items():
        if isinstance(func, relax.Function):
            plan.functions[gv.name_hint] = _function_plan(func, plan)
    return plan


def _build_tir(lowered: tvm.IRModule, target):
    """Build the PrimFuncs, capturing the host module after SplitHostDevice and the finalized device module."""
    captured = {}

    @tvm.instrument.pass_instrument
    class CaptureSplit:
        def run_after_pass(self, mod, info):
            if info.name == "tirx.SplitHostDevice":
                captured["split"] = mod

    build_module = sys.modules["tvm.tirx.build"]
    original = build_module.codegen_build

    def capture_device(mod, tgt):
        if tgt.kind.name == "webgpu":
            captured["device"] = mod
        return original(mod, tgt)

    prim_funcs = ir.IRModule({gv: f for gv, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)})
    build_module.codegen_build = capture_device     # the wheel offers no hook for the finalized device module
    try:
        with tvm.transform.PassContext(instruments=[CaptureSplit()]):
            tvm.tirx.build(prim_funcs, target=target)
    finally:
        build_module.codegen_build = original
    return captured["split"], captured["device"]


def _collect_kernels(device: tvm.IRModule, target, plan: VulkanPlan) -> None:
    build_webgpu = tvm.get_global_func("target.build.webgpu")
    for gv, f in device.functions_items():
        if f.attrs is None or "tirx.kernel_launch_params" not in f.attrs:
            continue
        name = gv.name_hint
        source = build_webgpu(ir.IRModule({gv: f}), target).inspect_source("")
        access = {var: acc for acc, var in re.findall(r"var<storage, (read|read_write)> (\w+) :", source)}
        workgroup = [int(x) for x in re.search(r"@workgroup_size\((\d+), (\d+), (\d+)\)", source).groups()]
        plan.sources[name] = source
        plan.kernels[name] = {
            "wgsl": f"{name}.wgsl", "entry": name, "workgroup_size": workgroup,
            "buffers": [{"name": p.name, "access": access.get(p.name, "read"), "dtype": str(p.ty.element_type.dtype)}
                        for p in f.params if isinstance(p.ty, ir.PointerType)],
            "pod": [{"name": p.name, "wgsl": WGSL_SCALAR[str(p.ty.dtype)]}
                    for p in f.params if isinstance(p.ty, ir.PrimType)],
        }


def _collect_launches(split: tvm.IRModule, plan: VulkanPlan) -> None:
    for gv, f in split.functions_items():
        if gv.name_hint in plan.kernels or not isinstance(f, tirx.PrimFunc):
            continue
        params = [p.name for p in f.params]
        lets, launches = {}, []
        body = list(f.body.seq) if isinstance(f.body, tirx.SeqStmt) else [f.body]
        for stmt in body:
            if isinstance(stmt, tirx.Bind):
                lets[stmt.var.name] = shape_expr(stmt.value)
            elif isinstance(stmt, tirx.Evaluate) and getattr(stmt.value.op, "name", "") == "tirx.call_ffi_kernel":
                launches.append(_launch(stmt.value, plan.kernels, params))
            elif not isinstance(stmt, tirx.DeclBuffer):
                raise NotImplementedError(f"{gv.name_hint}: host statement {type(stmt).__name__}")
        plan.prim_funcs[gv.name_hint] = {
            "params": params, "param_shapes": [[shape_expr(d) for d in p.ty.shape] for p in f.params],
            "lets": lets, "launches": launches}


def _launch(call, kernels, params) -> dict:
    kernel = kernels[call.args[0].value]
    n_buf, n_pod = len(kernel["buffers"]), len(kernel["pod"])
    buffers = []
    for arg in call.args[1:1 + n_buf]:
        var = arg.args[0]                                  # tirx.buffer_data(param)
        buffers.append(params.index(var.name))
    pods = [shape_expr(x) for x in call.args[1 + n_buf:1 + n_buf + n_pod]]
    extents = [shape_expr(x) for x in call.args[1 + n_buf + n_pod:]]
    return {"kernel": call.args[0].value, "buffer_args": buffers, "pod_args": pods,
            "launch": dict(zip([str(p) for p in call.attrs.launch_params], extents))}


def _function_plan(func: relax.Function, plan: VulkanPlan) -> dict:
    sym_vars, inputs = {}, []
    for i, p in enumerate(func.params):
        dims = list(p.ty.shape.values)
        for j, d in enumerate(dims):
            if isinstance(d, tirx.Var) and d.name not in sym_vars:
                sym_vars[d.name] = [i, j]
        inputs.append({"name": p.name, "shape": [shape_expr(d) for d in dims], "dtype": str(p.ty.dtype)})
    ops = []
    for block in func.body.blocks:
        for b in block.bindings:
            ops.append(_op(b.var.name, b.value, plan))
    return {"inputs": inputs, "sym_vars": sym_vars, "ops": ops, "output": func.body.body.name}


def _op(out: str, value, plan: VulkanPlan) -> dict:
    op_name = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, ir.Op) else None
    if op_name == "relax.vm.alloc_storage":
        return {"op": "alloc_storage", "out": out, "nbytes": shape_expr(value.args[0].values[0])}
    if op_name == "relax.vm.alloc_tensor":
        return {"op": "alloc_tensor", "out": out, "storage": value.args[0].name,
                "offset": shape_expr(value.args[1].value), "shape": [shape_expr(d) for d in value.args[2].values],
                "dtype": str(value.args[3].value)}
    if op_name == "relax.vm.kill_object":
        return {"op": "kill", "var": value.args[0].name}
    if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar) and value.op.name_hint in plan.prim_funcs:
        return {"op": "call", "func": value.op.name_hint, "args": [a.name for a in value.args]}
    if isinstance(value, relax.Var):
        return {"op": "alias", "out": out, "src": value.name}
    raise NotImplementedError(f"Vulkan plan: Relax binding {out} = {value}")


def write_plan(plan: VulkanPlan, directory) -> None:
    """plan.json and one .wgsl file per kernel into `directory`."""
    import json
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in plan.sources.items():
        (directory / plan.kernels[name]["wgsl"]).write_text(source)
    (directory / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
