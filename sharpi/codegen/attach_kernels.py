"""Replace the frontend's named ops (sharpi.common.ops) with calls to sharpi's TIR kernels.

Fusions happen here: matmul(x, permute_dims(dequantize(w))) becomes one quantized-matmul kernel and
take(dequantize(w), ids) one embedding kernel, so quantized weights are never expanded in memory.
Kernels are instantiated once per distinct shape; token count 1 (decode) gets specialized kernels. On a GPU, the
decode step's norms, projections, RoPE and GLU go further, into fused GEMVs (decode_fusion finds them).

Two kernel sets share this pass: the CPU's (kernels/*.py, hand-scheduled loop nests) and the GPU's
(kernels/gpu/*.py: the matmul and embedding as TE computes that dlight schedules; attention, RoPE and SnapKV
hand-scheduled with thread bindings). GPU kernels take a quantized weight's scale fields as separate buffers
(zero-copy views of its [S, N, K/32] planes), and SnapKV's score is two calls on a GPU (row statistics, then the
probabilities), since a workgroup cannot wait for the others.
"""
from __future__ import annotations

import re

import tvm
from tvm import relax, s_tir

from ..common import ops
from ..common.config import ModelConfig
from ..common.errors import CompileError
from ..common.kv_format import KVFormat
from ..ir_passes.named_ops import extern_name, prim_constant
from .kernels.paged_attention import (make_kv_append, make_kv_append_batch, make_paged_attention,
                                      make_paged_attention_batch)
from ..common.quant_layout import KERNEL_PARTS, QUANTIZED, SUB_SCALES
from .kernels.quant_matmul_int8 import (INT8_DOT_TYPES, make_gemm_int8, make_gemv_int8, make_moe_gemm_int8,
                                        make_moe_gemv_int8)
from .kernels.quant_matmul_amx import make_gemm_amx, make_moe_gemm_amx
from .kernels.quant_matmul_q8k import (Q8K_TYPES, make_gemm_q8k, make_gemv_q8k, make_moe_gemm_q8k,
                                       make_moe_gemv_q8k)
from .kernels.quant_matmul_vnni512 import make_gemm_vnni512, vnni512_fits
from .kernels.quant_matmul import cpu_quants, make_embedding, make_matmul
from .kernels.moe import make_moe_matmul, make_moe_route
from .kernels.kv_rotate import make_kv_rotate
from .kernels.delta_net import make_delta_conv, make_delta_rule, make_state_copy
from .kernels.gpu import delta_net as gpu_delta_net
from .kernels.rope import make_rope
from .kernels.snapkv import make_kv_compact, make_snapkv_score, make_snapkv_select
from .kernels.gpu import attention as gpu_attention
from .kernels.gpu import elementwise as gpu_elementwise
from .kernels.gpu import kv_rows as gpu_kv_rows
from .kernels.gpu.kv_rotate import make_gpu_kv_rotate
from .kernels.gpu import moe as gpu_moe
from .kernels.gpu import snapkv as gpu_snapkv
from .kernels.gpu.quant_matmul import GPU_LAYOUTS, make_gpu_matmul
from .kernels.gpu.fused_gemv import make_gpu_fused_gemv
from .decode_fusion import DecodeFusion, FusionPlan


def _static_int(dim) -> int | None:
    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else None


@relax.expr_functor.mutator
class KernelAttacher(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, cfg: ModelConfig, gpu: bool = False, int8_isa: str | None = None,
                 kv_types: tuple[str, str] | None = None, scale_prefixes: bool = False, decode_splits: int = 0):
        super().__init__(mod)
        self.mod_, self.cfg, self.gpu, self.int8_isa = mod, cfg, gpu, int8_isa
        self.kv_types, self.scale_prefixes, self.decode_splits = kv_types, scale_prefixes, decode_splits
        self.kernels: dict[tuple, tvm.ir.GlobalVar] = {}
        self.fusion: DecodeFusion | None = None
        self.absorbed: set = set()

    def run(self) -> tvm.IRModule:
        for gv, func in self.mod_.functions_items():
            if isinstance(func, relax.Function):
                # a GPU's one-token step: its matmuls with the norms, RoPE and GLU around them as fused GEMVs
                self.fusion = DecodeFusion(func, self.scale_prefixes) if self.gpu and gv.name_hint == "decode" else None
                self.absorbed = set()
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.absorbed:        # computed by a fused GEMV already
            return
        plan = self.fusion.plan(binding.var) if self.fusion is not None else None
        if plan is None:
            super().visit_var_binding_(binding)
            return
        self._fused_gemv(plan)

    def _fused_gemv(self, plan: FusionPlan) -> None:
        """Emit the plan's fused GEMV and stand its outputs in for the bindings it replaces."""
        spec, bb = plan.spec, self.builder_
        gv = self.kernel((spec.name(),), lambda: make_gpu_fused_gemv(spec))
        args = [self.visit_expr(plan.x), self._weight_item(plan.g)]
        if plan.pos is not None:
            args.append(self.visit_expr(plan.pos))
        for use, m in zip(plan.uses, spec.matrices):
            args += self._gpu_parts(m.qtype, [self._weight_item(p) for p in use.parts], m.rows, spec.k_in)
            if use.bias is not None:
                args.append(self._weight_item(use.bias))
        out_ty = [relax.TensorType(m.out_shape(), "float32") for m in spec.matrices]
        fused = bb.emit(relax.call_tir(gv, args, out_ty if spec.epilogue == "split" else out_ty[0]))
        outputs = [bb.emit(relax.TupleGetItem(fused, i)) for i in range(len(out_ty))] if spec.epilogue == "split" \
            else [fused]
        for var, out in zip(plan.outputs, outputs):
            self.set_var_remap(var, out)
        self.absorbed |= plan.absorbed

    def _weight_item(self, var):
        """A weight (an item of the weight tuple) read from the tuple here: the original graph may bind it only
        after the norm the fused call stands in for (a second read of an item costs nothing; DCE drops unused)."""
        value = self.fusion.values[var]
        return self.builder_.emit(relax.TupleGetItem(self.visit_expr(value.tuple_value), value.index))

    def _kv(self, pool) -> KVFormat:
        """The pool's format: the KV kernels take it (a packed pool's uint8 elements do not say its types)."""
        cfg = self.cfg
        return KVFormat.of(self.kv_types or str(pool.ty.dtype), cfg.n_kv_heads, ops.PAGE_SIZE, cfg.head_dim)

    def _gpu_pool(self, pool, fmt: KVFormat):
        """The pool as the GPU kernels take it: a packed pool as a zero-copy uint32 view (gpu.kv_rows reads and
        writes its rows as words; WGSL has no 8-bit integers), the plain one as it is."""
        if not fmt.packed:
            return pool
        rows = gpu_kv_rows.GpuRows(fmt)
        return self.builder_.emit(relax.op.memory.view(pool, shape=rows.pool_shape(pool.ty.shape[0]),
                                                       dtype=rows.pool_dtype))

    def _kv_call(self, gv, fmt: KVFormat, args: list, index: int, ty, in_place: bool):
        """A KV kernel's call with the pool (args[index]) as its kernels take it; an in-place call's result (the
        written pool) is given back in the frontend's type."""
        pool = args[index]
        words = self._gpu_pool(pool, fmt) if self.gpu else pool
        args = [words if i == index else a for i, a in enumerate(args)]
        if not in_place:
            return relax.call_tir(gv, args, ty)
        if words is pool:
            return relax.call_tir_inplace(gv, args, [index], ty)
        written = self.builder_.emit(relax.call_tir_inplace(gv, args, [index], words.ty))
        return relax.op.memory.view(written, shape=pool.ty.shape, dtype=pool.ty.dtype)

    def kernel(self, key: tuple, make) -> tvm.ir.GlobalVar:
        if key not in self.kernels:
            # a C identifier: CUDA C and WGSL declare kernels by this name (a RoPE base prints as "1e+06")
            name = re.sub(r"\W", "_", "_".join(str(k) for k in key if k is not None).replace("+", "p"))
            prim = make()
            if not self.gpu:
                prim = prim.with_attr("tirx.is_scheduled", True)
            elif prim.attrs is not None and "tirx.is_scheduled" in prim.attrs:
                prim = _with_root_block(prim)
            prim = prim.with_attr("global_symbol", name)
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
        if name.startswith(ops.KV_ROTATE):
            return self._kv_rotate(*name[len(ops.KV_ROTATE):].rsplit(".", 1), args, call.ty)
        if name in (ops.KV_APPEND, ops.KV_APPEND_BATCH):
            return self._kv_append(args, call.ty, batched=name == ops.KV_APPEND_BATCH)
        if name in (ops.PAGED_ATTENTION, ops.PAGED_ATTENTION_BATCH):
            return self._attention(args, call.ty, batched=name == ops.PAGED_ATTENTION_BATCH)
        if name == ops.SNAPKV_SCORE:
            return self._snapkv_score(args, call.ty)
        if name == ops.SNAPKV_SELECT:
            return self._snapkv_select(args, call.ty)
        if name == ops.KV_COMPACT:
            return self._kv_compact(args, call.ty)
        if name == ops.MOE_ROUTE:
            return self._moe_route(args, call.ty)
        if name == ops.MOE_MATMUL:
            return self._moe_matmul(args, call.ty)
        if name in (ops.DELTA_CONV, ops.DELTA_RULE, ops.STATE_COPY):
            return self._delta_net(name, args, call.ty)
        if name.startswith(ops.DEQUANTIZE):
            return call  # consumed by a fused matmul or embedding; dead code after this pass
        raise CompileError(f"The frontend emitted {name}, which the {'GPU' if self.gpu else 'CPU'} codegen has "
                           f"no kernel for.")

    def _delta_net(self, name, args, ty):
        """The Gated DeltaNet ops: each writes the state pool (args[0]) in place; conv and rule also return a
        fresh output."""
        cfg = self.cfg
        states = args[0]
        layers, width = int(states.ty.shape[1]), int(states.ty.shape[2])
        gpu = "gpu_" if self.gpu else ""
        if name == ops.STATE_COPY:
            make = gpu_delta_net.make_gpu_state_copy if self.gpu else make_state_copy
            gv = self.kernel((gpu + "state_copy", layers, width), lambda: make(layers, width))
            return relax.call_tir_inplace(gv, args, [0], ty)
        out_ty = ty.fields[0]
        tokens = _static_int(out_ty.shape[0])
        if name == ops.DELTA_CONV:
            channels, kernel = (int(d) for d in args[2].ty.shape)
            make = gpu_delta_net.make_gpu_delta_conv if self.gpu else make_delta_conv
            gv = self.kernel((gpu + "delta_conv", channels, kernel, layers, width, tokens),
                             lambda: make(channels, kernel, layers, width, tokens))
        else:
            offset = cfg.ssm_conv_floats
            grouped = cfg.ssm_head_map == "grouped"
            make = gpu_delta_net.make_gpu_delta_rule if self.gpu else make_delta_rule
            gv = self.kernel((gpu + "delta_rule", cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state_size, layers,
                              width, int(grouped), tokens),
                             lambda: make(cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state_size, layers, width,
                                          offset, grouped, tokens))
        return relax.call_tir_inplace(gv, args, [-1, 0], list(ty.fields))

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
        if self.gpu:
            gv = self.kernel(("gpu_matmul", qtype, n_out, k_in, tokens),
                             lambda: make_gpu_matmul(qtype, n_out, k_in, tokens, self.scale_prefixes))
            return relax.call_tir(gv, [call.args[0], *self._gpu_parts(qtype, parts, n_out, k_in)], call.ty)
        sub_scales = self._reads_sub_scales(qtype, parts)
        if sub_scales and tokens != 1 and self.int8_isa == "amx":
            gv = self.kernel(("gemm_amx", qtype, n_out, k_in, "ks"),
                             lambda: make_gemm_amx(qtype, n_out, k_in, sub_scales=True))
        elif sub_scales:
            make = make_gemv_q8k if tokens == 1 else make_gemm_q8k
            gv = self.kernel((f"{'gemv' if tokens == 1 else 'gemm'}_q8k", qtype, n_out, k_in),
                             lambda: make(qtype, n_out, k_in))
        elif self.int8_isa is not None and qtype in INT8_DOT_TYPES:
            gv = self._int8_matmul(qtype, n_out, k_in, decode=tokens == 1)
        else:
            gv = self.kernel(("matmul", qtype, n_out, k_in, tokens), lambda: make_matmul(qtype, n_out, k_in, tokens))
        return relax.call_tir(gv, [call.args[0], *self._cpu_parts(qtype, parts, n_out, k_in)], call.ty)

    # The decode GEMV's unpacking of 4-bit quants into 64 lanes costs what the wider dot saves: on a znver5, 2
    # threads, a 32768 x 2048 GEMV took 1-3% longer in 512 bits than AVX-VNNI's 256 for q4_0 and q4_k, 3-10%
    # less for q5_0, q6_k and q8_0; the prefill GEMM is ~1.6-2x AVX2's for every type (tiles share the unpacking)
    _GEMV_512 = ("q5_0", "q5_1", "q5_k", "q6_k", "q8_0")

    def _int8_matmul(self, qtype, n_out, k_in, decode: bool) -> tvm.ir.GlobalVar:
        """The integer-dot kernel for the CPU's instruction set: AMX's GEMM where the OS grants the tiles (its
        decode GEMV is AVX-512 VNNI's); AVX-512 VNNI's 512-bit kernels where the block count is even (and, for the
        decode GEMV, the type gains by them), else the 256-bit ones (vpdpbusd on AVX-VNNI and AVX-512 VNNI,
        vpmaddubsw + vpmaddwd on AVX2)."""
        if self.int8_isa == "amx" and not decode:
            return self.kernel(("gemm_amx", qtype, n_out, k_in), lambda: make_gemm_amx(qtype, n_out, k_in))
        if decode and self._gemv_isa(qtype, k_in) == "avx512-vnni":
            return self.kernel(("gemv_vnni512", qtype, n_out, k_in),
                               lambda: make_gemv_int8(qtype, n_out, k_in, "avx512-vnni"))
        wide = self.int8_isa in ("avx512-vnni", "amx") and vnni512_fits(k_in) and not decode
        if wide:
            return self.kernel(("gemm_vnni512", qtype, n_out, k_in), lambda: make_gemm_vnni512(qtype, n_out, k_in))
        isa = "avx2" if self.int8_isa == "avx2" else "avx-vnni"
        make = make_gemv_int8 if decode else make_gemm_int8
        return self.kernel((f"{'gemv' if decode else 'gemm'}_int8", None if isa == "avx2" else "vnni", qtype, n_out,
                            k_in), lambda: make(qtype, n_out, k_in, isa))

    def _moe_route(self, args, ty):
        logits, k, normalize = args
        experts, tokens = int(logits.ty.shape[1]), _static_int(logits.ty.shape[0])
        k, normalize = int(prim_constant(k)), bool(prim_constant(normalize))
        if self.gpu:
            gv = self.kernel(("gpu_moe_route", experts, k, int(normalize), tokens),
                             lambda: _with_root_block(gpu_moe.make_gpu_moe_route(experts, k, normalize, tokens)))
            return relax.call_tir(gv, [logits], list(ty.fields))
        # a call_tir of one input is a reshape candidate to RewriteDataflowReshape, whose check needs a root block
        gv = self.kernel(("moe_route", experts, k, int(normalize), tokens),
                         lambda: _with_root_block(make_moe_route(experts, k, normalize, tokens)))
        return relax.call_tir(gv, [logits], list(ty.fields))

    def _moe_matmul(self, args, ty):
        """The gathered matmul of the chosen experts, fused with the experts' dequantize as a matmul is: with
        integer dots where the CPU has them for the type (a K-quant stored as (qs, ks), as every x86 target stores
        experts, through quant_matmul_q8k's kernels, or a prompt's through quant_matmul_amx's tiles where the CPU
        has them), a prompt's tokens grouped by expert through a GEMM, a decode step's each through the GEMV of
        its experts' rows; float32 otherwise; the GPU kernels on a GPU."""
        x, ids, experts = args
        source = self._dequantize_source(experts)
        if source is None:
            raise CompileError("sharpi.moe_matmul takes the experts as a dequantize, which the frontend did not emit.")
        qtype, parts, w_ty = source
        rows, k_in = (int(d) for d in w_ty.shape)
        tokens, slots, n_out = _static_int(ty.shape[0]), int(ty.shape[1]), int(ty.shape[2])
        per_slot, n_experts = len(x.ty.shape) == 3, rows // n_out
        shape = (n_experts, n_out, k_in, slots, per_slot)
        if self.gpu:
            gv = self.kernel(("gpu_moe_matmul", qtype, *shape, tokens),
                             lambda: gpu_moe.make_gpu_moe_matmul(qtype, *shape, tokens, self.scale_prefixes))
            return relax.call_tir(gv, [x, ids, *self._gpu_parts(qtype, parts, rows, k_in)], ty)
        sub_scales = self._reads_sub_scales(qtype, parts)
        if sub_scales and tokens is None and self.int8_isa == "amx":
            gv = self.kernel(("moe_gemm_amx", qtype, *shape), lambda: make_moe_gemm_amx(qtype, *shape))
        elif sub_scales and tokens is None:
            gv = self.kernel(("moe_gemm_q8k", qtype, *shape), lambda: make_moe_gemm_q8k(qtype, *shape))
        elif sub_scales:
            gv = self.kernel(("moe_gemv_q8k", qtype, *shape, tokens), lambda: make_moe_gemv_q8k(qtype, *shape, tokens))
        elif self.int8_isa is not None and qtype in INT8_DOT_TYPES and tokens is None:
            isa = "avx2" if self.int8_isa == "avx2" else "avx-vnni"
            gv = self.kernel(("moe_gemm_int8", isa, qtype, *shape), lambda: make_moe_gemm_int8(qtype, *shape, isa))
        elif self.int8_isa is not None and qtype in INT8_DOT_TYPES:
            isa = self._gemv_isa(qtype, k_in)
            gv = self.kernel(("moe_gemv_int8", isa, qtype, *shape, tokens),
                             lambda: make_moe_gemv_int8(qtype, *shape, isa, tokens))
        else:
            gv = self.kernel(("moe_matmul", qtype, *shape, tokens), lambda: make_moe_matmul(qtype, *shape, tokens))
        return relax.call_tir(gv, [x, ids, *self._cpu_parts(qtype, parts, rows, k_in)], ty)

    def _gemv_isa(self, qtype, k_in) -> str:
        """The instruction set of the dense decode GEMV's integer dots (_int8_matmul's choice, q8k aside)."""
        if self.int8_isa in ("avx512-vnni", "amx") and vnni512_fits(k_in) and qtype in self._GEMV_512:
            return "avx512-vnni"
        return "avx2" if self.int8_isa == "avx2" else "avx-vnni"

    def _fuse_embedding(self, call):
        source = self._dequantize_source(call.args[0])
        if source is None:
            return None
        qtype, parts, w_ty = source
        vocab, dim = (int(d) for d in w_ty.shape)
        if self.gpu:
            gv = self.kernel(("gpu_embedding", qtype, vocab, dim),
                             lambda: gpu_elementwise.make_gpu_embedding(qtype, vocab, dim, self.scale_prefixes))
            return relax.call_tir(gv, [call.args[1], *self._gpu_parts(qtype, parts, vocab, dim)], call.ty)
        sub_scales = _holds_sub_scales(parts)
        gv = self.kernel(("embedding", qtype, vocab, dim) + (("ks",) if sub_scales else ()),
                         lambda: make_embedding(qtype, vocab, dim, sub_scales))
        return relax.call_tir(gv, [call.args[1], *self._cpu_parts(qtype, parts, vocab, dim)], call.ty)

    def _reads_sub_scales(self, qtype, parts) -> bool:
        """Whether a matmul's weight is a K-quant stored as (qs, ks), which quant_matmul_q8k's integer-dot kernels
        read (the compiler stores that form where the target's kernels read it: Target.sub_scales_for)."""
        if not _holds_sub_scales(parts):
            return False
        if self.int8_isa is None or qtype not in Q8K_TYPES:
            raise CompileError(f"The graph holds a {qtype} weight as its {SUB_SCALES!r} part, which only the "
                               f"integer-dot kernels read; this compile has none.")
        return True

    def _cpu_parts(self, qtype, parts, n_out, k_in):
        """The weight parts as the CPU kernels take them: quants through a zero-copy view where their dtype
        differs from the stored layout (q8_0's u32 words read as int8); the scales as the graph has them, `s`,
        or a K-quant's `ks` (quant_layout)."""
        if not parts or qtype not in QUANTIZED:
            return parts
        shape, dtype = cpu_quants(qtype, n_out, k_in)
        if str(parts[0].ty.dtype) == dtype:
            return parts
        view = self.builder_.emit(relax.op.memory.view(parts[0], shape=shape, dtype=dtype))
        return [view, *parts[1:]]

    def _gpu_parts(self, qtype, parts, n_out, k_in):
        """The weight parts as the GPU kernels take them (kernels.gpu.quant_matmul.scale_fields): the quants, then
        each scale field as a zero-copy view of its plane of the [S, N, K/32] buffer, or with scale_prefixes a view
        of planes 0..f at offset 0."""
        if qtype not in QUANTIZED:
            return parts
        qs, scales = parts[:KERNEL_PARTS]
        fields, plane = int(scales.ty.shape[0]), (n_out, k_in // 32)
        if self.scale_prefixes:
            return [qs, *[self.builder_.emit(relax.op.memory.view(scales, shape=(f + 1, *plane), dtype="float32"))
                          for f in range(fields)]]
        views = [self.builder_.emit(relax.op.memory.view(scales, shape=plane, dtype="float32",
                                                         relative_byte_offset=f * n_out * (k_in // 32) * 4))
                 for f in range(fields)]
        return [qs, *views]

    def _rope(self, layout, args, ty):
        x, pos, theta = args
        _, heads, head_dim = (d for d in ty.shape)
        tokens = _static_int(ty.shape[0])
        theta = prim_constant(theta)
        make = gpu_elementwise.make_gpu_rope if self.gpu else make_rope
        gv = self.kernel(("rope", layout, int(heads), int(head_dim), tokens, f"{theta:g}".replace(".", "p")),
                         lambda: make(int(heads), int(head_dim), theta, layout, tokens))
        return relax.call_tir(gv, [x, pos], ty)

    def _kv_rotate(self, kv_type, direction, args, ty):
        heads, head_dim = ty.shape[1], ty.shape[2]
        tokens = _static_int(ty.shape[0])
        inverse = direction == "inverse"
        if self.gpu:
            def make():
                return make_gpu_kv_rotate(int(heads), int(head_dim), kv_type, inverse, tokens)
        else:       # one input: RewriteDataflowReshape's check wants a root block (_with_root_block)
            def make():
                return _with_root_block(make_kv_rotate(int(heads), int(head_dim), kv_type, inverse, tokens))
        gv = self.kernel(("kv_rotate", kv_type, direction, int(heads), int(head_dim), tokens), make)
        return relax.call_tir(gv, args, ty)

    def _kv_append(self, args, ty, batched: bool = False):
        pool, k, v, page_table, kv_lens, layer = args
        tokens = _static_int(k.ty.shape[0])
        cfg = self.cfg
        kv = self._kv(pool)
        if self.gpu:
            def make():
                return gpu_attention.make_gpu_kv_append(cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, tokens,
                                                        kv_dtype=kv, batched=batched)
        elif batched:
            def make():
                return make_kv_append_batch(cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, kv_dtype=kv)
        else:
            def make():
                return make_kv_append(cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, tokens, kv_dtype=kv)
        gv = self.kernel(("kv_append_batch" if batched else "kv_append", tokens, _kv_key(kv)), make)
        return self._kv_call(gv, kv, [pool, k, v, page_table, kv_lens, layer], 0, ty, in_place=True)

    def _attention(self, args, ty, batched: bool = False):
        q, pool, page_table, kv_lens, layer, scale, window = args
        tokens = _static_int(ty.shape[0])
        window = int(prim_constant(window))
        cfg = self.cfg
        scale = prim_constant(scale)
        kv = self._kv(pool)
        shape = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, scale)
        if self.gpu and self.decode_splits and (tokens == 1 or batched):
            return self._split_decode_attention(shape, kv, window, [q, pool, page_table, kv_lens, layer], ty,
                                                batched)
        if self.gpu and not batched and tokens != 1:     # a prompt: query blocks share each K/V tile
            kind, make = "flash_attention", lambda: gpu_attention.make_gpu_flash_attention(
                *shape, tokens, kv_dtype=kv, window=window)
        elif self.gpu:
            kind, make = "paged_attention", lambda: gpu_attention.make_gpu_paged_attention(
                *shape, tokens, kv_dtype=kv, window=window, batched=batched)
        elif batched:
            kind, make = "paged_attention", lambda: make_paged_attention_batch(*shape, kv_dtype=kv, window=window)
        else:
            kind, make = "paged_attention", lambda: make_paged_attention(*shape, tokens, kv_dtype=kv, window=window)
        gv = self.kernel((kind + ("_batch" if batched else ""), tokens, _kv_key(kv), f"w{window}" if window else None),
                         make)
        return self._kv_call(gv, kv, [q, pool, page_table, kv_lens, layer], 1, ty, in_place=False)

    def _split_decode_attention(self, shape, kv, window: int, args: list, ty, batched: bool):
        """A one-token step's attention (one sequence's decode, or decode_batch's token of each sequence) by
        decode_splits workgroups a query head, then their combination (kernels.gpu.attention's flash-decoding
        pair)."""
        splits, cfg = self.decode_splits, self.cfg
        tokens = None if batched else 1
        gv = self.kernel(("paged_attention" + ("_batch" if batched else "") + "_split", splits, _kv_key(kv),
                          f"w{window}" if window else None),
                         lambda: gpu_attention.make_gpu_paged_attention(*shape, tokens, kv_dtype=kv, window=window,
                                                                        batched=batched, splits=splits))
        partial_ty = relax.TensorType((ty.shape[0], cfg.n_heads, splits, cfg.head_dim + 2), "float32")
        partial = self.builder_.emit(self._kv_call(gv, kv, args, 1, partial_ty, in_place=False))
        combine = self.kernel(("attention_combine", splits, tokens),
                              lambda: gpu_attention.make_gpu_attention_combine(cfg.n_heads, cfg.head_dim, splits,
                                                                               tokens))
        return relax.call_tir(combine, [partial], ty)

    def _snapkv_score(self, args, ty):
        q, pool, page_table, kv_lens, layer, window, scale = args
        cfg = self.cfg
        max_pages = int(page_table.ty.shape[1])
        scale = prim_constant(scale)
        shape = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, max_pages, scale)
        kv = self._kv(pool)
        if self.gpu:
            stats_gv = self.kernel(("snapkv_row_stats", _kv_key(kv)),
                                   lambda: gpu_snapkv.make_gpu_snapkv_row_stats(*shape, kv_dtype=kv))
            stats_ty = relax.TensorType((q.ty.shape[0], cfg.n_heads, 2), "float32")
            words = self._gpu_pool(pool, kv)
            stats = self.builder_.emit(relax.call_tir(stats_gv, [q, words, page_table, kv_lens, layer, window],
                                                      stats_ty))
            gv = self.kernel(("snapkv_score", _kv_key(kv)),
                             lambda: gpu_snapkv.make_gpu_snapkv_score(*shape, kv_dtype=kv))
            return relax.call_tir(gv, [q, words, page_table, kv_lens, layer, window, stats], ty)
        gv = self.kernel(("snapkv_score", _kv_key(kv)), lambda: make_snapkv_score(*shape, kv_dtype=kv))
        return relax.call_tir(gv, [q, pool, page_table, kv_lens, layer, window], ty)

    def _snapkv_select(self, args, ty):
        scores, params = args
        layers, kv_heads, slots = (int(d) for d in ty.shape)
        make = gpu_snapkv.make_gpu_snapkv_select if self.gpu else make_snapkv_select
        gv = self.kernel(("snapkv_pool_topk", None), lambda: make(layers, kv_heads, slots))
        scratch = relax.TensorType(ty.shape, "float32")
        outputs = self.builder_.emit(relax.call_tir(gv, [scores, params], [ty, scratch, scratch]))
        return relax.TupleGetItem(outputs, 0)

    def _kv_compact(self, args, ty):
        pool, page_table, keep, count = args
        cfg = self.cfg
        layers, max_pages = (int(d) for d in page_table.ty.shape)
        make = gpu_snapkv.make_gpu_kv_compact if self.gpu else make_kv_compact
        kv = self._kv(pool)
        gv = self.kernel(("kv_compact", _kv_key(kv)),
                         lambda: make(layers, cfg.n_kv_heads, cfg.head_dim, ops.PAGE_SIZE, max_pages, kv_dtype=kv))
        return self._kv_call(gv, kv, [pool, page_table, keep, count], 0, ty, in_place=True)


def _kv_key(kv: KVFormat) -> str | None:
    """Kernel-name part for the KV types: none for float32, so f32 kernel names stay as they were."""
    return None if kv.name == "f32" else "kv" + kv.name


def _holds_sub_scales(parts) -> bool:
    """Whether a quantized weight's parts are a K-quant's (qs, ks), not (qs, s): quant_layout's two forms."""
    return len(parts) == KERNEL_PARTS and str(parts[1].ty.dtype) == "uint32"


def _with_root_block(prim: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """Wrap a hand-scheduled kernel's body in a root block, the form Relax's GPU passes expect of every PrimFunc
    (RewriteDataflowReshape's pattern check asserts it of a kernel called with one input, on every target);
    TVMScript does not let a thread-bound body have one."""
    return prim.with_body(s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", prim.body)))


def _check_gpu_support(mod: tvm.IRModule) -> None:
    """Refuse weight types and ops the GPU kernels lack before the mutator runs (an exception raised inside it reaches
    Python through TVM's FFI as a plain RuntimeError)."""
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                name = extern_name(binding.value) or ""
                qtype = name[len(ops.DEQUANTIZE):] if name.startswith(ops.DEQUANTIZE) else None
                if qtype is not None and qtype not in GPU_LAYOUTS:
                    raise CompileError(f"Weights of type {qtype} have no GPU kernel yet (GPU layouts: "
                                       f"{', '.join(GPU_LAYOUTS)}); compile for llvm instead.")


def attach_kernels(mod: tvm.IRModule, cfg: ModelConfig, gpu: bool = False, int8_isa: str | None = None,
                   kv_types: tuple[str, str] | None = None, scale_prefixes: bool = False,
                   decode_splits: int = 0) -> tvm.IRModule:
    """Replace the named ops with the CPU kernels, or with the GPU kernels when `gpu`; `int8_isa` ("avx2",
    "avx-vnni", "avx512-vnni", "amx"): the CPU's quantized matmuls multiply int8 activations with that instruction
    set's integer dots (quant_matmul_int8, quant_matmul_vnni512, quant_matmul_amx); None: the float kernels. `kv_types`: the KV cache's
    (keys', values') types, which a packed pool's uint8 elements do not say (None: the pool's element type).
    `scale_prefixes`: the GPU weight kernels take scale field f as a view of planes 0..f at offset 0, not of plane
    f at its offset (kernels.gpu.quant_matmul.scale_fields says why CUDA needs it). `decode_splits` > 0: a
    one-token step's attention (decode's, and decode_batch's of each sequence) by that many workgroups a query
    head and a combining kernel."""
    if gpu:
        _check_gpu_support(mod)
    mod = KernelAttacher(mod, cfg, gpu, int8_isa, kv_types, scale_prefixes, decode_splits).run()
    return relax.transform.DeadCodeElimination()(mod)
