"""Which ops of a one-token decode step a GPU runs as one fused GEMV (kernels.gpu.fused_gemv): found on the
frontend's graph, before its ops become kernels. A plan names the bindings the fused call replaces; attach_kernels
emits the call in place of the RMSNorm that starts the pattern and drops the replaced bindings.

Two patterns, both starting at h = rms_norm(x, g) of one token:
- projections: every use of h is a quantized matmul (q, k and v; the output head), each followed by a bias, a
  reshape to heads and a full-width RoPE where the model has them. "split": one output per matrix.
- gated FFN: h's two uses are matmuls by gate and up, and act(gate) * up is the next matrix's input. "glu".
A matrix's own RMSNorm (qk_norm) or a partial RoPE ends its chain early: the rest stays as it was.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

from ..common import ops
from ..ir_passes.named_ops import extern_name, prim_constant
from .kernels.gpu.fused_gemv import ACTIVATIONS, FusedGemv, Matrix, Rope, supported
from .kernels.gpu.quant_matmul import GPU_LAYOUTS


@dataclass
class MatrixUse:
    qtype: str
    parts: list                 # the dequantize's weight parts (vars bound to the weight tuple's items)
    bias: relax.Var | None
    output: relax.Var           # the last binding the fused call replaces (its value is this matrix's result)
    rotated: bool = False       # the chain ends in a RoPE

    @property
    def rows(self) -> int:
        shape = [int(d) for d in self.output.ty.shape]
        return shape[1] * (shape[2] if len(shape) == 3 else 1)

    @property
    def head_dim(self) -> int:
        """The head size where the output is [1, heads, head_dim], else 0."""
        shape = self.output.ty.shape
        return int(shape[2]) if len(shape) == 3 else 0


@dataclass
class FusionPlan:
    spec: FusedGemv
    x: relax.Var
    g: relax.Var
    pos: relax.Var | None
    uses: list[MatrixUse]       # in the kernel's matrix order
    outputs: list[relax.Var]    # the bindings the kernel's outputs stand for, in order
    absorbed: set               # every binding the fused call makes dead (outputs included)


def _op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get(name))


class DecodeFusion:
    """The fusion plans of one function (the decode step), by the var of the RMSNorm each starts at."""

    def __init__(self, func: relax.Function, scale_prefixes: bool):
        self.values: dict = {}
        self.users: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                self.values[binding.var] = binding.value
                for used in relax.analysis.free_vars(binding.value):
                    self.users.setdefault(used, []).append(binding.var)
        self.scale_prefixes = scale_prefixes

    def plan(self, var: relax.Var) -> FusionPlan | None:
        value = self.values.get(var)
        if not _op(value, "relax.nn.rms_norm") or list(value.attrs.axes) != [-1] or len(value.ty.shape) != 2:
            return None
        rows = value.ty.shape[0]
        if not isinstance(rows, tvm.tirx.IntImm) or int(rows) != 1:
            return None
        plan = self._glu(var, value) or self._projections(var, value)
        return plan if plan is not None and supported(plan.spec) else None

    # -- the patterns -----------------------------------------------------------------------------------------
    def _projections(self, h, norm) -> FusionPlan | None:
        users = self.users.get(h, [])
        matmuls = [self._matmul(u, h) for u in users]
        if not matmuls or any(m is None for m in matmuls):
            return None
        uses, absorbed, ropes = [], {h}, set()
        for var, (qtype, parts, chain) in zip(users, matmuls):
            use, rope = self._follow(var, qtype, parts, chain, absorbed)
            uses.append(use)
            if rope is not None:
                ropes.add(rope)
        if len(ropes) > 1:              # one RoPE (layout, base, head size, positions) for every rotated matrix
            return None
        uses.sort(key=lambda u: not u.rotated)          # the rotated ones first, in their order
        layout, theta, head_dim, pos = ropes.pop() if ropes else (None, None, None, None)
        spec = FusedGemv(int(norm.args[0].ty.shape[1]),
                         tuple(Matrix(u.qtype, u.rows, u.bias is not None, u.head_dim) for u in uses),
                         "split", norm_eps=float(norm.attrs.epsilon),
                         rope=Rope(layout, head_dim, theta, sum(u.rotated for u in uses)) if layout else None,
                         scale_prefixes=self.scale_prefixes)
        return FusionPlan(spec, norm.args[0], norm.args[1], pos, uses, [u.output for u in uses], absorbed)

    def _glu(self, h, norm) -> FusionPlan | None:
        users = self.users.get(h, [])
        if len(users) != 2:
            return None
        gate, up = (self._matmul(u, h) for u in users)
        if gate is None or up is None:
            return None
        act = self._single_user(users[0])
        act_value = self.values.get(act)
        name = next((n for n in ACTIVATIONS if _op(act_value, f"relax.nn.{n}")), None)
        product = self._single_user(act) if name else None
        if product is None or product != self._single_user(users[1]) or not _op(self.values[product], "relax.multiply"):
            return None
        if list(self.values[product].args) != [act, users[1]]:
            return None
        absorbed = {h, act, product, *users, *gate[2], *up[2]}
        uses = [MatrixUse(qtype, parts, None, var) for var, (qtype, parts, _) in zip(users, (gate, up))]
        spec = FusedGemv(int(norm.args[0].ty.shape[1]), tuple(Matrix(u.qtype, u.rows) for u in uses), "glu",
                         norm_eps=float(norm.attrs.epsilon), activation=name, scale_prefixes=self.scale_prefixes)
        return FusionPlan(spec, norm.args[0], norm.args[1], None, uses, [product], absorbed)

    # -- pieces -----------------------------------------------------------------------------------------------
    def _matmul(self, var, h):
        """(qtype, weight parts, [the dequantize and permute bindings]) of var = matmul(h, permute(dequantize))."""
        value = self.values.get(var)
        if not _op(value, "relax.matmul") or value.args[0] != h:
            return None
        permute = value.args[1]
        if not _op(self.values.get(permute), "relax.permute_dims"):
            return None
        dequantize = self.values[permute].args[0]
        name = extern_name(self.values.get(dequantize)) or ""
        if not name.startswith(ops.DEQUANTIZE) or name[len(ops.DEQUANTIZE):] not in GPU_LAYOUTS:
            return None
        if self.users.get(permute) != [var] or self.users.get(dequantize) != [permute]:
            return None
        return name[len(ops.DEQUANTIZE):], list(self.values[dequantize].args[1].fields), [dequantize, permute]

    def _single_user(self, var):
        users = self.users.get(var, [])
        return users[0] if len(users) == 1 else None

    def _follow(self, var, qtype, parts, chain, absorbed):
        """A projection's chain from its matmul: an optional bias add of a weight vector, a reshape to
        [1, heads, head_dim], a full-width RoPE. Returns (its MatrixUse, the RoPE's (layout, theta, head_dim, pos)
        or None)."""
        absorbed.update(chain)
        absorbed.add(var)
        bias, rope = None, None
        last = var
        nxt = self._single_user(last)
        value = self.values.get(nxt)
        if _op(value, "relax.add") and value.args[0] == last and self._is_weight(value.args[1]):
            bias, last = value.args[1], nxt
            absorbed.add(nxt)
            nxt = self._single_user(last)
            value = self.values.get(nxt)
        if _op(value, "relax.reshape") and len(value.ty.shape) == 3:
            last = nxt
            absorbed.add(nxt)
            nxt = self._single_user(last)
            value = self.values.get(nxt)
            name = extern_name(value) or ""
            if name.startswith(ops.ROPE) and value.args[1].fields[0] == last:
                _, pos, theta = value.args[1].fields
                rope = (name[len(ops.ROPE):], float(prim_constant(theta)), int(value.ty.shape[2]), pos)
                last = nxt
                absorbed.add(nxt)
        return MatrixUse(qtype, parts, bias, last, rotated=rope is not None), rope

    def _is_weight(self, var) -> bool:
        value = self.values.get(var)
        return isinstance(value, relax.TupleGetItem)
