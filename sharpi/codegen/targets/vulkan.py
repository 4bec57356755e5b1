"""The vulkan target: TVM builds the Relax module for WebGPU (WGSL), and we record what a wgpu runtime needs
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
from dataclasses import dataclass, field, replace
from pathlib import Path

import tvm
from tvm import ir, relax, tirx

from ...common.compile_options import CompileOptions, resolved_kv_types
from ...common.config import ModelConfig
from ...common.manifest import PLAN
from ...common.plan import Plan
from ...common.targets import TARGETS
from ..attach_kernels import attach_kernels
from ..tvm_seams import device_module_capture

WGSL_SCALAR = {"int32": "i32", "int64": "i32", "uint32": "u32", "float32": "f32", "float16": "f16"}


def webgpu_target() -> tvm.target.Target:
    return tvm.target.Target("webgpu", host="llvm")


@dataclass
class VulkanPlan(Plan):
    """The plan (sharpi.common.plan, what plan.json holds) and the WGSL of its kernels."""
    sources: dict = field(default_factory=dict)       # kernel -> WGSL text


# Binary TIR nodes written infix: arithmetic (shapes are non-negative, so truncating == flooring), comparisons
# and the logical connectives
_INFIX = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%", tirx.Div: "//",
          tirx.Mod: "%", tirx.LT: "<", tirx.LE: "<=", tirx.GT: ">", tirx.GE: ">=", tirx.EQ: "==", tirx.NE: "!=",
          tirx.And: "and", tirx.Or: "or"}


def shape_expr(e, names=None) -> str:
    """A TIR integer expression as a shape-expression string (sharpi.common.shape_expr evaluates it); `names`
    gives variables unique names (TVMScript calls every anonymous T.int64() "v")."""
    if isinstance(e, int):
        return str(e)
    if isinstance(e, tirx.IntImm):
        return str(int(e.value))
    if isinstance(e, tirx.Var):
        return names(e) if names is not None else e.name
    for cls, op in _INFIX.items():
        if isinstance(e, cls):
            return f"({shape_expr(e.a, names)} {op} {shape_expr(e.b, names)})"
    if isinstance(e, (tirx.Min, tirx.Max)):
        return f"{'min' if isinstance(e, tirx.Min) else 'max'}({shape_expr(e.a, names)}, {shape_expr(e.b, names)})"
    if isinstance(e, tirx.Cast):
        return shape_expr(e.value, names)
    if isinstance(e, tirx.Not):
        return f"(not {shape_expr(e.a, names)})"
    if isinstance(e, tirx.Select):
        return (f"({shape_expr(e.true_value, names)} if {shape_expr(e.condition, names)} "
                f"else {shape_expr(e.false_value, names)})")
    op_name = getattr(getattr(e, "op", None), "name", "")
    if op_name.endswith("if_then_else"):
        cond, a, b = (shape_expr(x, names) for x in e.args)
        return f"({a} if {cond} else {b})"
    for name, op in (("RShift", ">>"), ("LShift", "<<")):
        if hasattr(tirx, name) and isinstance(e, getattr(tirx, name)):
            return f"({shape_expr(e.a, names)} {op} {shape_expr(e.b, names)})"
    if op_name.endswith(("shift_right", "shift_left")):
        op = ">>" if e.op.name.endswith("right") else "<<"
        return f"({shape_expr(e.args[0], names)} {op} {shape_expr(e.args[1], names)})"
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

    prim_funcs = ir.IRModule({gv: f for gv, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)})
    with device_module_capture(target.kind.name) as device, tvm.transform.PassContext(instruments=[CaptureSplit()]):
        tvm.tirx.build(prim_funcs, target=target)
    return captured["split"], device["device"]


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
        names = _Names()
        params = [names(p) for p in f.params]
        lets, launches = {}, []
        body = list(f.body.seq) if isinstance(f.body, tirx.SeqStmt) else [f.body]
        for stmt in body:
            if isinstance(stmt, tirx.Bind):
                lets[names(stmt.var)] = shape_expr(stmt.value, names)
            elif isinstance(stmt, tirx.Evaluate) and getattr(stmt.value.op, "name", "") == "tirx.call_ffi_kernel":
                launches.append(_launch(stmt.value, plan.kernels, f.params, names))
            elif not isinstance(stmt, tirx.DeclBuffer):
                raise NotImplementedError(f"{gv.name_hint}: host statement {type(stmt).__name__}")
        plan.prim_funcs[gv.name_hint] = {
            "params": params, "lets": lets, "launches": launches,
            # a buffer's dims (shape expressions), or None for a scalar parameter (bound by value)
            "param_shapes": [[shape_expr(d, names) for d in p.ty.shape] if hasattr(p.ty, "shape") else None
                             for p in f.params]}


def _launch(call, kernels, params, names) -> dict:
    kernel = kernels[call.args[0].value]
    n_buf, n_pod = len(kernel["buffers"]), len(kernel["pod"])
    buffers = []
    for arg in call.args[1:1 + n_buf]:
        var = arg.args[0]                                  # tirx.buffer_data(param)
        buffers.append([p.name for p in params].index(var.name))   # the data var is named as its parameter
    pods = [shape_expr(x, names) for x in call.args[1 + n_buf:1 + n_buf + n_pod]]
    extents = [shape_expr(x, names) for x in call.args[1 + n_buf + n_pod:]]
    return {"kernel": call.args[0].value, "buffer_args": buffers, "pod_args": pods,
            "launch": dict(zip([str(p) for p in call.attrs.launch_params], extents))}


class _Names:
    """Unique plan names for Relax variables: lowering reuses name hints (two `lv2`s in one function), and the
    plan refers to values by name."""

    def __init__(self):
        self.by_var, self.used = {}, set()

    def __call__(self, var) -> str:
        if var in self.by_var:
            return self.by_var[var]
        name, i = var.name, 1
        while name in self.used:
            name, i = f"{var.name}_{i}", i + 1
        self.used.add(name)
        self.by_var[var] = name
        return name


def _function_plan(func: relax.Function, plan: VulkanPlan) -> dict:
    names, sym_vars = _Names(), {}
    inputs = [_input_spec(names(p), p.ty, [i], sym_vars) for i, p in enumerate(func.params)]
    ops = []
    for block in func.body.blocks:
        for b in block.bindings:
            op = _op(b.value, plan, names)    # operands are named before the bound variable
            if op is not None:
                if op["op"] not in ("call", "kill"):
                    op["out"] = names(b.var)
                ops.append(op)
    return {"inputs": inputs, "sym_vars": sym_vars, "ops": ops, "output": names(func.body.body)}


def _input_spec(name: str, ty, path: list, sym_vars: dict) -> dict:
    """An input's shape and dtype, or for a tuple (the weights) its fields; symbolic dims are recorded in
    sym_vars as [input path..., dim] so the runner can bind them from the tensors it is given."""
    if isinstance(ty, relax.TupleType):
        return {"name": name, "fields": [_input_spec(f"{name}.{i}", t, path + [i], sym_vars)
                                         for i, t in enumerate(ty.fields)]}
    dims = list(ty.shape.values)
    for j, d in enumerate(dims):
        if isinstance(d, tirx.Var) and d.name not in sym_vars:
            sym_vars[d.name] = path + [j]
    return {"name": name, "shape": [shape_expr(d) for d in dims], "dtype": str(ty.dtype)}


def _arg(a, names) -> dict:
    """A call argument: a variable, or a scalar constant (a prim_value such as the layer index)."""
    if isinstance(a, relax.Var):
        return {"var": names(a)}
    if isinstance(a, (tirx.IntImm, tirx.FloatImm)):      # relax.prim_value(...) is a plain immediate here
        return {"const": a.value}
    raise NotImplementedError(f"Vulkan plan: call argument {a}")


def _op(value, plan: VulkanPlan, names) -> dict | None:
    op_name = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, ir.Op) else None
    if op_name == "relax.vm.alloc_storage":
        return {"op": "alloc_storage", "nbytes": shape_expr(value.args[0].values[0])}
    if op_name == "relax.vm.alloc_tensor":
        return {"op": "alloc_tensor", "storage": names(value.args[0]), "offset": shape_expr(value.args[1].value),
                "shape": [shape_expr(d) for d in value.args[2].values], "dtype": str(value.args[3].value)}
    if op_name == "relax.vm.kill_object":
        return None                  # a buffer lives as long as a tensor refers to it (Python's GC frees it)
    if isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc):
        return _packed(value, names)
    if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar) and value.op.name_hint in plan.prim_funcs:
        return {"op": "call", "func": value.op.name_hint, "args": [_arg(a, names) for a in value.args]}
    if isinstance(value, relax.Var):
        return {"op": "alias", "src": names(value)}
    if isinstance(value, relax.TupleGetItem):
        return {"op": "get_item", "src": names(value.tuple_value), "index": int(value.index)}
    if isinstance(value, relax.Tuple):
        return {"op": "tuple", "fields": [names(f) for f in value.fields]}
    raise NotImplementedError(f"Vulkan plan: Relax binding {value}")


def _packed(call, names) -> dict:
    """The runtime builtins the GPU pipeline leaves in a function: zero-copy reshapes and views."""
    func, args = call.op.global_symbol, call.args
    if func == "vm.builtin.reshape":
        return {"op": "view", "src": names(args[0]), "shape": [shape_expr(d) for d in args[1].values],
                "dtype": None, "byte_offset": "0"}
    if func == "runtime.TVMTensorCreateView":
        return {"op": "view", "src": names(args[0]), "shape": [shape_expr(d) for d in args[1].values],
                "dtype": str(args[2].value), "byte_offset": shape_expr(args[3])}
    raise NotImplementedError(f"Vulkan plan: packed call {func}")


def write_plan(plan: VulkanPlan, directory, contract: str | None = None) -> None:
    """plan.json and one .wgsl file per kernel into `directory`; `contract` (the manifest's kernel contract as
    JSON) is recorded in the plan, which the runtime compares with the manifest it loads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in plan.sources.items():
        (directory / plan.kernels[name]["wgsl"]).write_text(source)
    Plan(plan.functions, plan.prim_funcs, plan.kernels, contract).write(directory)


class VulkanTarget:
    spec = TARGETS["vulkan"]
    code_files = (PLAN,)

    def resolve(self, options: CompileOptions) -> CompileOptions:
        return replace(options, **resolved_kv_types(options, "float32"))   # f16 on Vulkan: not yet measured

    def sub_scales_for(self, options: CompileOptions) -> str:
        return "none"

    def describe(self, options: CompileOptions) -> dict:
        return {"kind": self.spec.name, "shader": "wgsl", "activations": "float32"}

    def build(self, mod, cfg: ModelConfig, options: CompileOptions, staging: Path, progress, contract: str):
        progress.set_postfix_str("attach GPU kernels")
        mod = attach_kernels(mod, cfg, gpu=True, kv_types=options.kv_types)
        progress.update(1)
        progress.set_postfix_str("dlight schedules, WGSL codegen, plan")
        plan = build_plan(mod)
        write_plan(plan, staging, contract)
        progress.update(1)
        return sorted(plan.kernels)

    def finish(self, staging: Path, target: dict) -> None:
        pass


TARGET = VulkanTarget()
