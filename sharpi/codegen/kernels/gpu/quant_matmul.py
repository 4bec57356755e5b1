"""Quantized matmul for GPU targets: y[t, j] = sum_k x[t, k] * W[j, k], W dequantized on the fly from sharpi's
layouts. Written as a TE reduction over one dequantize expression, so dlight's GEMV rule (decode, one token)
and Matmul rule (prefill, symbolic token count) schedule it; weights stay quantized in device memory."""
from __future__ import annotations

from tvm import te, tirx

from ....common.errors import CompileError
from ....common.quant_layout import BLOCK, LAYOUTS, QUANTIZED
from ..quant_matmul import dense_value, dequant

# Layouts this kernel builds for. bf16 needs its uint16 words packed in pairs first (WGSL has no 16-bit integer
# storage types).
GPU_LAYOUTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "f32", "f16")


def placeholder(name: str, shape: tuple, dtype: str):
    """A TE placeholder: the default way the GPU weight kernels declare a weight part."""
    return te.placeholder(shape, dtype, name=name)


def scale_fields(qtype: str, rows: int, cols: int, prefixes: bool = False, declare=placeholder):
    """The scale fields of a quantized weight as a GPU kernel's parameters, and read(f, row, block) -> f32.
    `declare(name, shape, dtype)` makes each parameter (a TE placeholder, or an IR builder's buffer).

    Each field is a buffer of its own: dlight's rules need every read region to be one element per block
    iterator, which two fields read from one buffer are not. `prefixes` False: field f is [rows, cols/32], the
    f-th plane of the layout's [S, rows, cols/32] scale buffer, passed as a zero-copy view at the plane's offset
    (Vulkan's runtime binds it there). `prefixes` True: field f is [f + 1, rows, cols/32], planes 0..f, a view at
    offset 0, and reads its last plane (CUDA: TVM's argument checks refuse a view at a nonzero byte offset, in
    the kernels TVM fuses from these too; the whole buffer once per field would not do, since fusion merges
    identical arguments into one buffer)."""
    (_, _, s_shape) = LAYOUTS[qtype][1]
    count = s_shape(rows, cols)[0]
    plane = (i64(rows), i64(cols // BLOCK))
    fields = [declare(f"scale{f}", ((i64(f + 1),) if prefixes else ()) + plane, "float32") for f in range(count)]
    if prefixes:
        return fields, lambda f, row, b: fields[f][i64(f), row, b]
    return fields, lambda f, row, b: fields[f][row, b]


def i64(v):
    """Every index int64: dlight's Matmul rule breaks on int32 constants beside an int64 dim."""
    return tirx.IntImm("int64", v) if isinstance(v, int) else v


def gpu_weight_parts(qtype: str, rows: int, cols: int, scale_prefixes: bool = False, declare=placeholder):
    """The weight parts as the GPU weight kernels (matmul, embedding, the fused GEMV) take them (each made by
    `declare(name, shape, dtype)`; the scale fields as scale_fields declares them), and value(row, col) -> the f32
    weight expression."""
    if qtype in QUANTIZED:
        (_, qs_dtype, qs_shape) = LAYOUTS[qtype][0]
        qs = declare("qs", tuple(i64(d) for d in qs_shape(rows, cols)), qs_dtype)
        fields, read_scale = scale_fields(qtype, rows, cols, scale_prefixes, declare)

        def value(row, col):
            return dequant(qtype, qs, read_scale, row, col // i64(BLOCK), col % i64(BLOCK))

        return [qs, *fields], value
    parts = [declare(name, tuple(i64(d) for d in shape(rows, cols)), dtype) for name, dtype, shape in LAYOUTS[qtype]]
    return parts, lambda row, col: dense_value(qtype, parts[0], row, col)


def make_gpu_matmul(qtype: str, n_out: int, k_in: int, tokens: int | None = None,
                    scale_prefixes: bool = False) -> tirx.PrimFunc:
    """PrimFunc (x [n, K] f32, qs, scale fields 0..S-1, y [n, N] f32) for quantized types, (x, w, y) for dense
    ones; unscheduled (dlight schedules it). The fields as scale_fields(prefixes=scale_prefixes) declares them."""
    if qtype not in GPU_LAYOUTS:
        raise CompileError(f"Weights of type {qtype} have no GPU matmul kernel yet (GPU layouts: "
                           f"{', '.join(GPU_LAYOUTS)}).")
    n = tirx.Var("n", "int64") if tokens is None else i64(tokens)
    x = te.placeholder((n, i64(k_in)), "float32", name="x")
    parts, weight = gpu_weight_parts(qtype, n_out, k_in, scale_prefixes)
    k = te.reduce_axis((i64(0), i64(k_in)), name="k")
    # dequantize as its own stage (dlight inlines it into the matmul as a prologue, as MLC-LLM's kernels do)
    # (the lambda names the loops j and kk: TE names them after its parameters)
    w_f32 = te.compute((i64(n_out), i64(k_in)), lambda j, kk: weight(j, kk), name="dequantize")
    y = te.compute((n, i64(n_out)), lambda t, j: te.sum(x[t, k] * w_f32[j, k], axis=k), name="matmul")
    func = te.create_prim_func([x, *parts, y])
    name = f"gpu_matmul_{qtype}_{n_out}_{k_in}" + ("" if tokens is None else f"_{tokens}")
    return func.with_attr("dlight.do_not_tensorize", True).with_attr("global_symbol", name)
