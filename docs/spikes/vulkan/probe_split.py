import sys, tvm
from model_def import Mod
captured = {}
@tvm.instrument.pass_instrument
class Cap:
    def run_after_pass(self, mod, info):
        if info.name in ("tirx.SplitHostDevice", "tirx.LowerDeviceKernelLaunch", "tirx.MakePackedAPI"):
            captured.setdefault(info.name, mod)
with tvm.transform.PassContext(instruments=[Cap()]):
    ex = tvm.compile(Mod, target=tvm.target.Target("webgpu", host="llvm"))
print(captured.keys())
m = captured["tirx.SplitHostDevice"]
for gv, f in m.functions_items():
    if "kernel" not in gv.name_hint:
        print(f.script()[:2500])
m = captured.get("tirx.LowerDeviceKernelLaunch")
if m:
  for gv, f in m.functions_items():
    if gv.name_hint=="rms_norm": print(f.script()[:2500])
