import tvm
from model_def import Mod
captured = {}
@tvm.instrument.pass_instrument
class Cap:
    def run_after_pass(self, mod, info):
        if info.name == "tirx.SplitHostDevice": captured.setdefault(info.name, mod)
with tvm.transform.PassContext(instruments=[Cap()]):
    ex = tvm.compile(Mod, target=tvm.target.Target("webgpu", host="llvm"))
m = captured["tirx.SplitHostDevice"]
f = m["rms_norm"]
def walk(s, d=0):
    print(" "*d, type(s).__name__, [k for k in dir(s) if not k.startswith("_") and k not in ("script","show","same_as","span","handle","legacy_repr")][:12])
    for k in ("body","seq"):
        v = getattr(s, k, None)
        if v is None: continue
        if isinstance(v, tvm.tirx.Stmt): walk(v, d+2)
        else:
            for x in v: walk(x, d+2)
walk(f.body)
ev = f.body.seq[-1] if hasattr(f.body, "seq") else None
print(type(f.body))
c = f.body.seq[-1].value
print(type(c), c.op, c.op.name, len(c.args), [type(a).__name__ for a in c.args], c.attrs if hasattr(c,"attrs") else None)
print([k for k in dir(c) if not k.startswith("_")])
print([k for k in dir(f) if not k.startswith("_")]); print(f.params)
d = m["rms_norm_kernel"]; print(d.params, [type(p.ty).__name__ for p in d.params], [str(p.ty) for p in d.params], )
a = c.args[1]; print("arg1:", a, a.op.name, [type(x).__name__ for x in a.args], a.args)
p = f.params[0]; print("param0 ty:", type(p.ty).__name__, p.ty, [k for k in dir(p.ty) if not k.startswith("_")])
