"""Reading the frontend's named ops (sharpi.common.ops) in Relax: shared by the passes and codegen."""
from __future__ import annotations

import tvm
from tvm import relax


def extern_name(expr) -> str | None:
    """The op name of a `call_dps_packed` to a named op, else None."""
    if isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.call_dps_packed")):
        func = expr.args[0]
        if isinstance(func, relax.ExternFunc):
            return str(func.global_symbol)
    return None


def prim_constant(prim_value):
    """The Python value of a named op's constant argument (a relax.PrimValue of an IntImm or FloatImm)."""
    value = prim_value.value
    return value.value if hasattr(value, "value") else value
