# Q2: build for webgpu, capture device IRModule, extract per-kernel WGSL/bindings/POD/launch geometry
import sys, json, tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from model_def import Mod

target = tvm.target.Target("webgpu", host="llvm")
build_mod = sys.modules["tvm.tirx.build"]; captured = {}
_orig = build_mod.codegen_build
def _capture(mod, tgt):
    captured.setdefault(tgt.kind.name, mod); return _orig(mod, tgt)
build_mod.codegen_build = _capture

ex = tvm.compile(Mod, target=target)   # default GPU pipeline (legalize+fuse+dlight Matmul/GEMV/Reduction/GeneralReduction/Fallback)
dmod = captured["webgpu"]
print("device kernels:", [g.name_hint for g in dmod.get_global_vars()])
for gv, f in dmod.functions_items():
    print("=====", gv.name_hint, "attrs:", {k: str(v) for k, v in f.attrs.items()})
    print(f.script()[:3000])
devlib = ex.mod.imports[0]
print("ex.mod kind", ex.mod.kind, "imports", [m.kind for m in ex.mod.imports], [[mm.kind for mm in m.imports] for m in ex.mod.imports])
wgsl = ex.mod.imports[0].imports[0].inspect_source("")
open("q2_module.wgsl", "w").write(wgsl)
print("WGSL chars", len(wgsl))
