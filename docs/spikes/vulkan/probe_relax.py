import sys, tvm
from tvm import relax
from model_def import Mod
captured = {}
@tvm.instrument.pass_instrument
class Cap:
    def run_after_pass(self, mod, info):
        if info.name in ("CallTIRRewrite", "StaticPlanBlockMemory", "LowerAllocTensor", "KillAfterLastUse", "VMShapeLower", "LowerRuntimeBuiltin"):
            captured.setdefault(info.name, mod)
with tvm.transform.PassContext(instruments=[Cap()]):
    ex = tvm.compile(Mod, target=tvm.target.Target("webgpu", host="llvm"))
print(list(captured))
for k in ("StaticPlanBlockMemory", "LowerRuntimeBuiltin", "VMShapeLower"):
    print("=======", k); print(captured[k]["main"].script())
print("======= VM bytecode"); print(ex.as_text())
