"""Replace the frontend's named ops (sharpi.common.ops) with calls to sharpi's TIR kernels.

Fusions happen here: matmul(x, permute_dims(dequantize(w))) becomes one quantized-matmul kernel and
take(dequantize(w), ids) one embedding kernel, so quantized weights are never expanded in memory.
Kernels are instantiated once per distinct shape; token count 1 (decode) gets specialized kernels.
"""
from __future__ import annotations

import tvm
from tvm import relax

from ..common import ops
from ..common.config import ModelConfig
from ..common.errors import CompileError
from ..ir_passes.named_ops import extern_name
from .kernels.paged_attention import make_kv_append, make_paged_attention
from ..common.quant_layout import QUANTIZED
from .kernels.quant_matmul import cpu_quants, make_embedding, make_matmul
from .kernels.rope import make_rope
from .kernels.snapkv import make_kv_compact, make_snapkv_score, make_snapkv_select


def _static_int(dim) -> int | None:
    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else None


def _prim_constant(prim_value):
    value = prim_value.value
    return value.value if hasattr(value, "value") else value


@relax.expr_functor.mutator
class KernelAttacher(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, cfg: ModelConfig):
        super().__init__(mod)
        self.mod_, self.cfg = mod, cfg
        self.kernels: dict[tuple, tvm.ir.GlobalVar] = {}

    def run(self) -> tvm.IRModule:
        for gv, func in self.mod_.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def kernel(self, key: tuple, make) -> tvm.ir.GlobalVar:
        if key not in self.kernels:
            name = "_".join(str(k) for k in key if k is not None)
            prim = make().with_attr("tirx.is_scheduled", True).with_attr("global_symbol", name)
            self.kernels[key] = self.builder_.add_func(prim, name)
        return self.kernels[key]

    def _bound(self, expr):
        """Follow a variable to the call it is bound to (within the dataflow block)."""
        if isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            return value if value is not None else expr
        return expr

    def _dequantize_source(self, expr):
        call = self._bound(expr)
        name = extern_name(call)
        if name and name.startswith(ops.DEQUANTIZE):
            return name[len(ops.DEQUANTIZE):], list(call.args[1].fields), call.ty
        return None

    def visit_call_(self, call):
        call = super().visit_call_(call)
        fused = None
        if call.op.same_as(tvm.ir.Op.get("relax.matmul")):
            fused = self._fuse_matmul(call)
        elif call.op.same_as(tvm.ir.Op.get("relax.take")):
            fused = self._fuse_embedding(call)
        if fused is not None:
            return fused
        name = extern_name(call)
        if name is None:
            return call
        args = list(call.args[1].fields)
        if name.startswith(ops.ROPE):
            return self._rope(name[len(ops.ROPE):], args, call.ty)
        if name == ops.KV_APPEND:
            return self._kv_append(args, call.ty)
        if name == ops.PAGED_ATTENTION:
            return self._attention(args, call.ty)
        if name == ops.SNAPKV_SCORE:
            return self._snapkv_score(args, call.ty)
        if name == ops.SNAPKV_SELECT:
            return self._snapkv_select(args, call.ty)
        if name == ops.KV_COMPACT:
            return self._kv_compact(args, call.ty)
        if name.startswith(ops.DEQUANTIZE):
            return call  # consumed by a fused matmul or embedding; dead code after this pass
        raise CompileError(f"The frontend emitted {name}, which the llvm codegen has no kernel for.")

    def _fuse_matmul(self, call):
        weight = self._bound(call.args[1])
        if not (isinstance(weight, relax.Call) and weight.op.same_as(tvm.ir.Op.get("relax.permute_dims"))):
            return None
        source = self._dequantize_source(weight.args[0])
        if source is None:
            return None
        qtype, parts, w_ty = source
        n_out, k_in = (int(d) for d in w_ty.shape)
        tokens = _static_int(call.ty.shape[0])
        gv = self.kernel(("matmul", qtype, n_out, k_in, tokens), lambda: make_matmul(qtype, n_out, k_in, tokens))
        return relax.call_tir(gv, [call.args[0], *self._cpu_parts(qtype, parts, n_out, k_in)], call.ty)

    def _fuse_embedding(self, call):
        source = self._dequantize_source(call.args[0])
        if source is None:
            return None
        qtype, parts, w_ty = source
        vocab, dim = (int(d) for d in w_ty.shape)
        gv = self.kernel(("embedding", qtype, vocab, dim), lambda: make_embedding(qtype, vocab, dim))
        return relax.call_tir(gv, [call.args[1], *self._cpu_parts(qtype, parts, vocab, dim)], call.ty)

    def _cpu_parts(self, qtype, parts, n_out, k_in):
        """The weight parts as the CPU kernels take them: quants through a zero-copy view where their dtype
        differs from the stored layout (q8_0's u32 words read as int8)."""
        if not parts or qtype not in QUANTIZED:
            return parts
        shape, dtype = cpu_quants(qtype, n_out, k_in)
        if str(parts[0].ty.dtype) == dtype:
            return parts
        view = self.builder_.emit(relax.op.memory.view(parts[0], shape=shape, dtype=dtype))
        return [view, *parts[1:]]

    def _rope(self, layout, args, ty):
        x, pos, theta = args
        _, heads, head_dim = (d for d in ty.shape)
        tokens = _static_int(ty.shape[0])
        theta = _prim_constant(theta)
        gv = self.kernel(("rope", layout, int(heads), int(head_dim), tokens, f"{theta:g}".replace(".", "p")),
                         lambda: make_rope(int(heads), int(head_dim), theta, layout, tokens))
        return relax.call_tir(gv, [x, pos], ty)

    def _kv_append(self, args, ty):
        pool, k, v, page_table, kv_lens, layer = args
        tokens = _static_int(k.ty.shape[0])
        cfg = self.cfg
        gv = self.kernel(("kv_append", tokens),
                         lambda: make_kv_append(cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, tokens))
        return relax.call_tir_inplace(gv, [pool, k, v, page_table, kv_lens, layer], [0], ty)

    def _attention(self, args, ty):
        q, pool, page_table, kv_lens, layer, scale = args
        tokens = _static_int(ty.shape[0])
        cfg = self.cfg
        scale = _prim_constant(scale)
        gv = self.kernel(("paged_attention", tokens),
                         lambda: make_paged_attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE,
                                                      scale, tokens))
        return relax.call_tir(gv, [q, pool, page_table, kv_lens, layer], ty)


    def _snapkv_score(self, args, ty):
        q, pool, page_table, kv_lens, layer, window, scale = args
        cfg = self.cfg
        max_pages = int(page_table.ty.shape[1])
        scale = _prim_constant(scale)
        gv = self.kernel(("snapkv_score", None),
                         lambda: make_snapkv_score(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, max_pages,
                                                   scale))
        return relax.call_tir(gv, [q, pool, page_table, kv_lens, layer, window], ty)

    def _snapkv_select(self, args, ty):
        scores, params = args
        layers, kv_heads, slots = (int(d) for d in ty.shape)
        gv = self.kernel(("snapkv_pool_topk", None), lambda: make_snapkv_select(layers, kv_heads, slots))
        scratch = relax.TensorType(ty.shape, "float32")
        outputs = self.builder_.emit(relax.call_tir(gv, [scores, params], [ty, scratch, scratch]))
        return relax.TupleGetItem(outputs, 0)

    def _kv_compact(self, args, ty):
        pool, page_table, keep, count = args
        cfg = self.cfg
        layers, max_pages = (int(d) for d in page_table.ty.shape)
        gv = self.kernel(("kv_compact", None),
                         lambda: make_kv_compact(layers, cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, max_pages))
        return relax.call_tir_inplace(gv, [pool, page_table, keep, count], [0], ty)


def attach_kernels(mod: tvm.IRModule, cfg: ModelConfig) -> tvm.IRModule:
    mod = KernelAttacher(mod, cfg).run()
    return relax.transform.DeadCodeElimination()(mod)
