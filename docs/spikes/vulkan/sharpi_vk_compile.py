# Q2+Q3: compile a Relax module for webgpu and emit a replayable "Vulkan plan" artifact (JSON + per-kernel WGSL).
# Structured extraction: Relax main after LowerRuntimeBuiltin (VM-level allocs + PrimFunc calls),
# host PrimFuncs after tirx.SplitHostDevice (T.call_ffi_kernel: buffers, scalars, launch extents),
# device PrimFuncs (params) and per-kernel WGSL from target.build.webgpu on a 1-function IRModule.
import json, re, sys, tvm
from tvm import relax, tirx, ir
from tvm.relax.backend import gpu_generic as gg

def pexpr(e):
    """PrimExpr -> Python expression string over symbolic var names (evaluated by the runtime)."""
    if isinstance(e, int): return str(e)
    if isinstance(e, tirx.IntImm): return str(int(e.value))
    if isinstance(e, tirx.FloatImm): return repr(float(e.value))
    if isinstance(e, tirx.Var): return e.name
    binops = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%",
              tirx.Div: "//", tirx.Mod: "%"}   # Div/Mod are truncating; equal to floor for the nonneg shapes here
    for cls, op in binops.items():
        if isinstance(e, cls): return f"({pexpr(e.a)} {op} {pexpr(e.b)})"
    if isinstance(e, tirx.Min): return f"min({pexpr(e.a)}, {pexpr(e.b)})"
    if isinstance(e, tirx.Max): return f"max({pexpr(e.a)}, {pexpr(e.b)})"
    if isinstance(e, tirx.Cast): return pexpr(e.value)
    if isinstance(e, tirx.Call) and e.op.name == "tirx.shift_right": return f"({pexpr(e.args[0])} >> {pexpr(e.args[1])})"
    if isinstance(e, tirx.Call) and e.op.name == "tirx.shift_left": return f"({pexpr(e.args[0])} << {pexpr(e.args[1])})"
    raise NotImplementedError(f"expr {type(e).__name__}: {e}")

WGSL_TY = {"int32": "i32", "int64": "i32", "uint32": "u32", "float32": "f32", "float16": "f16"}

def compile_plan(mod, target, out_dir):
    # ---- Relax: default GPU pipeline, stopped before VMShapeLower (keeps symbolic shapes readable)
    seq = tvm.transform.Sequential(gg.library_dispatch_passes(target) + gg.legalize_passes(target) +
        gg.dataflow_lower_passes(target) + [relax.transform.StaticPlanBlockMemory(), relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(), relax.transform.LowerRuntimeBuiltin(), relax.transform.AttachGlobalSymbol()])
    with target:
        lowered = seq(mod)
    # ---- TIR: build all PrimFuncs; capture host/device split
    cap = {}
    @tvm.instrument.pass_instrument
    class Cap:
        def run_after_pass(self, m, info):
            if info.name == "tirx.SplitHostDevice": cap["split"] = m
    tir_mod = ir.IRModule({gv: f for gv, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)})
    bm = sys.modules["tvm.tirx.build"]; orig = bm.codegen_build
    def codegen_capture(m, tgt):                    # device module after finalize_device_passes (LowerIntrin ...)
        if tgt.kind.name == "webgpu": cap["device"] = m
        return orig(m, tgt)
    bm.codegen_build = codegen_capture
    try:
        with tvm.transform.PassContext(instruments=[Cap()]):
            tvm.tirx.build(tir_mod, target=target)     # the built lib itself is not needed
    finally:
        bm.codegen_build = orig
    split = cap["split"]
    build_webgpu = tvm.get_global_func("target.build.webgpu")
    kernels, prim = {}, {}
    for gv, f in cap["device"].functions_items():
        if f.attrs is not None and "tirx.kernel_launch_params" in f.attrs:     # device kernel
            src = build_webgpu(ir.IRModule({gv: f}), target).inspect_source("")
            open(f"{out_dir}/{gv.name_hint}.wgsl", "w").write(src)
            access = {nm: acc for acc, nm in re.findall(r"var<storage, (read|read_write)> (\w+) :", src)}
            pod_fields = re.findall(r"^\s+(\w+): (\w+),?$", re.search(r"struct PODArgs \{(.*?)\}", src, re.S).group(1), re.M)
            kernels[gv.name_hint] = {
                "wgsl": f"{gv.name_hint}.wgsl", "entry": gv.name_hint,
                "buffers": [{"name": p.name, "access": access[p.name], "dtype": str(p.ty.element_type.dtype)}
                            for p in f.params if isinstance(p.ty, ir.PointerType)],
                "pod": [{"name": p.name, "dtype": str(p.ty.dtype), "wgsl": WGSL_TY[str(p.ty.dtype)]}
                        for p in f.params if isinstance(p.ty, ir.PrimType)] + [{"name": "packGridDimX", "dtype": "uint32", "wgsl": "u32"}],
                "pod_fields_from_wgsl": pod_fields,
                "launch_params": list(f.attrs["tirx.kernel_launch_params"]),
                "workgroup_size": [int(x) for x in re.search(r"@workgroup_size\((\d+), (\d+), (\d+)\)", src).groups()],
            }
    for gv, f in split.functions_items():   # host PrimFuncs: ordered kernel launches
        if gv.name_hint in kernels or not isinstance(f, tirx.PrimFunc) or f.attrs is None or "tirx.is_scheduled" not in f.attrs:
            continue
        params = [p.name for p in f.params]
        decl = []  # (decl buffer var, param var)
        launches = []
        stmts = list(f.body.seq) if isinstance(f.body, tirx.SeqStmt) else [f.body]
        lets = {}
        for s in stmts:
            if isinstance(s, tirx.DeclBuffer):
                decl.append((s.buffer.data if hasattr(s.buffer, "data") else None, s))
            elif isinstance(s, tirx.Bind):
                lets[s.var.name] = pexpr(s.value)
            elif isinstance(s, tirx.Evaluate) and s.value.op.name == "tirx.call_ffi_kernel":
                c = s.value; kname = c.args[0].value; k = kernels[kname]
                nb, npod = len(k["buffers"]), len(k["pod"]) - 1
                bufs = []
                for a in c.args[1:1 + nb]:
                    assert a.op.name == "tirx.buffer_data", a
                    v = a.args[0]
                    bufs.append(params.index(v.name) if v.name in params else v.name)
                pods = [pexpr(x) for x in c.args[1 + nb:1 + nb + npod]]
                ext = [pexpr(x) for x in c.args[1 + nb + npod:]]
                launches.append({"kernel": kname, "buffer_args": bufs, "pod_args": pods,
                                 "launch": dict(zip(list(c.attrs.launch_params), ext))})
            else:
                raise NotImplementedError(f"host stmt {type(s).__name__} in {gv.name_hint}")
        # each PrimFunc binds its own symbolic vars from its argument shapes (as MakePackedAPI does)
        pshapes = [[pexpr(d) for d in p.ty.shape] for p in f.params]
        prim[gv.name_hint] = {"params": params, "param_shapes": pshapes, "lets": lets, "launches": launches}
    # ---- Relax main after LowerRuntimeBuiltin -> ordered op list
    main = lowered["main"]
    sym = {}
    inputs = []
    for i, p in enumerate(main.params):
        shp = [pexpr(d) for d in p.ty.shape.values] if hasattr(p.ty, "shape") else None
        for j, d in enumerate(p.ty.shape.values):
            if isinstance(d, tirx.Var) and d.name not in sym: sym[d.name] = [i, j]   # bind symbolic var from input i dim j
        inputs.append({"name": p.name, "shape": shp, "dtype": str(p.ty.dtype)})
    ops = []
    body = main.body
    for block in body.blocks:
        for b in block.bindings:
            v, val = b.var.name, b.value
            opname = val.op.name if isinstance(val, relax.Call) and isinstance(val.op, ir.Op) else None
            if opname == "relax.vm.alloc_storage":
                ops.append({"op": "alloc_storage", "out": v, "nbytes": pexpr(val.args[0].values[0])})
            elif opname == "relax.vm.alloc_tensor":
                ops.append({"op": "alloc_tensor", "out": v, "storage": val.args[0].name,
                            "offset": pexpr(val.args[1].value), "shape": [pexpr(d) for d in val.args[2].values],
                            "dtype": str(val.args[3].value)})
            elif opname == "relax.vm.kill_object":
                ops.append({"op": "kill", "var": val.args[0].name})
            elif isinstance(val, relax.Call) and isinstance(val.op, relax.GlobalVar) and val.op.name_hint in prim:
                ops.append({"op": "call", "func": val.op.name_hint, "args": [a.name for a in val.args]})
            elif isinstance(val, relax.Var):
                ops.append({"op": "alias", "out": v, "src": val.name})
            else:
                raise NotImplementedError(f"relax binding {v} = {val}")
    plan = {"sym_vars": sym, "inputs": inputs, "ops": ops, "output": body.body.name,
            "prim_funcs": prim, "kernels": kernels}
    json.dump(plan, open(f"{out_dir}/plan.json", "w"), indent=1)
    return plan, lowered, split

if __name__ == "__main__":
    import os
    from model_def import Mod
    os.makedirs("artifact", exist_ok=True)
    plan, lowered, split = compile_plan(Mod, tvm.target.Target("webgpu", host="llvm"), "artifact")
    print(json.dumps(plan, indent=1))
