"""ONNX translations of the ops the frontend and the SnapKV pass emit (used by export.py).

Each translation takes the translator `tr` (its graph builder `tr.gb`, its value helpers), the Relax call and the
call's result type, and returns the value of the binding: an ONNX tensor name, or one of export.py's symbolic
values (a KVCache for the paged pool, a WeightRef for a parameter). Two tables: RELAX_OPS by Relax op name, and
NAMED_OPS by the name of the project's `call_dps_packed` externs (sharpi.common.ops), whose arguments arrive
already translated.

The paged-cache ops become their plain-cache equivalents: the pool is one (past_key, past_value) pair per layer,
[kv_heads, slots, head_dim]; kv_append concatenates the new keys and values behind the layer's slots, paged
attention is a masked softmax attention over the layer's slots (causal: query i of n sits at slot S - n + i and
sees slots <= its own; a sliding window also hides slots more than `window - 1` before it), and kv_compact is a
GatherElements of the kept slots. Only standard ONNX ops (default domain, opset onnx_export.OPSET) are used.
"""
from __future__ import annotations

import math

import numpy as np
from tvm import relax

from ...common import ops
from ...common.errors import CompileError
from ...common.quant_layout import LAYOUTS

NEG_INF = np.float32(-np.inf)


# -- helpers ----------------------------------------------------------------------------------------------------
def _static_shape(ty) -> list:
    """The dims of a Relax tensor type: ints, None where a dim is symbolic."""
    try:
        values = list(ty.shape.values)
    except AttributeError:
        raise CompileError(f"ONNX export: expected a tensor of known rank, got {ty}.") from None
    return [int(d.value) if type(d).__name__ == "IntImm" else None for d in values]


def _static_dims(ty, *axes) -> list[int]:
    """The dims at `axes`, which must be static."""
    shape = _static_shape(ty)
    dims = [shape[a] for a in axes]
    if None in dims:
        raise CompileError(f"ONNX export: expected static dims {list(axes)} in {ty}.")
    return dims


def _arg_ty(call, i):
    """The Relax type of argument i of a call_dps_packed (its args tuple) or of a plain call."""
    args = call.args[1].fields if _is_dps(call) else call.args
    expr = args[i]
    return expr.ty if not isinstance(expr, relax.Tuple) else None


def _is_dps(call) -> bool:
    return getattr(call.op, "name", None) == "relax.call_dps_packed"


def _int_list(values) -> list[int]:
    return [int(v) for v in values] if values is not None else None


# -- relax ops ----------------------------------------------------------------------------------------------------
def _elementwise(onnx_op: str):
    def translate(tr, call, ty):
        return tr.gb.op(onnx_op, [tr.tensor(tr.visit(a)) for a in call.args])
    return translate


def _matmul(tr, call, ty):
    if call.attrs.out_dtype is not None and str(call.attrs.out_dtype) not in ("", "void"):
        return tr.gb.op("Cast", [tr.gb.op("MatMul", [tr.tensor(tr.visit(a)) for a in call.args])],
                        to=tr.onnx_dtype(str(call.attrs.out_dtype)))
    return tr.gb.op("MatMul", [tr.tensor(tr.visit(a)) for a in call.args])


def _permute_dims(tr, call, ty):
    value = tr.visit(call.args[0])
    axes = _int_list(call.attrs.axes)
    if axes in (None, [1, 0]):
        folded = tr.transposed_weight(value)        # a dequantized weight, transposed at export time
        if folded is not None:
            return folded
    x = tr.tensor(value)
    return tr.gb.op("Transpose", [x]) if axes is None else tr.gb.op("Transpose", [x], perm=axes)


def _reshape(tr, call, ty):
    x = tr.tensor(tr.visit(call.args[0]))
    return tr.gb.op("Reshape", [x, tr.shape_tensor(call.args[1].values)])


def _take(tr, call, ty):
    x, idx = tr.tensor(tr.visit(call.args[0])), tr.tensor(tr.visit(call.args[1]))
    return tr.gb.op("Gather", [x, idx], axis=int(call.attrs.axis))


def _rms_norm(tr, call, ty):
    """x * 1/sqrt(mean(x^2 over axes) + eps) * weight, as TVM's legalization computes it."""
    gb = tr.gb
    x, w = tr.tensor(tr.visit(call.args[0])), tr.tensor(tr.visit(call.args[1]))
    axes = gb.const(np.array(_int_list(call.attrs.axes), np.int64), "axes")
    mean = gb.op("ReduceMean", [gb.op("Mul", [x, x]), axes], keepdims=1)
    eps = gb.const(np.array(float(call.attrs.epsilon), np.float32), "epsilon")
    inv = gb.op("Reciprocal", [gb.op("Sqrt", [gb.op("Add", [mean, eps])])])
    return gb.op("Mul", [gb.op("Mul", [x, inv]), w])


def _silu(tr, call, ty):
    x = tr.tensor(tr.visit(call.args[0]))
    return tr.gb.op("Mul", [x, tr.gb.op("Sigmoid", [x])])


def _gelu_tanh(tr, call, ty):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (ONNX's Gelu op needs opset 20)."""
    gb = tr.gb
    x = tr.tensor(tr.visit(call.args[0]))
    c = gb.const(np.array(math.sqrt(2.0 / math.pi), np.float32), "sqrt_2_over_pi")
    k = gb.const(np.array(0.044715, np.float32), "gelu_k")
    half, one = gb.const(np.array(0.5, np.float32), "half"), gb.const(np.array(1.0, np.float32), "one")
    inner = gb.op("Mul", [c, gb.op("Add", [x, gb.op("Mul", [k, gb.op("Mul", [x, gb.op("Mul", [x, x])])])])])
    return gb.op("Mul", [gb.op("Mul", [half, x]), gb.op("Add", [one, gb.op("Tanh", [inner])])])


def _gelu(tr, call, ty):
    gb = tr.gb
    x = tr.tensor(tr.visit(call.args[0]))
    half, one = gb.const(np.array(0.5, np.float32), "half"), gb.const(np.array(1.0, np.float32), "one")
    erf = gb.op("Erf", [gb.op("Mul", [x, gb.const(np.array(1 / math.sqrt(2.0), np.float32), "inv_sqrt2")])])
    return gb.op("Mul", [gb.op("Mul", [half, x]), gb.op("Add", [one, erf])])


def _softmax(tr, call, ty):
    return tr.gb.op("Softmax", [tr.tensor(tr.visit(call.args[0]))], axis=int(call.attrs.axis))


def _astype(tr, call, ty):
    return tr.gb.op("Cast", [tr.tensor(tr.visit(call.args[0]))], to=tr.onnx_dtype(str(call.attrs.dtype)))


def _strided_slice(tr, call, ty):
    gb = tr.gb
    x = tr.tensor(tr.visit(call.args[0]))
    axes, begin, end = (list(a.fields) for a in call.args[1:4])
    inputs = [x, tr.prim_tensor(begin), tr.prim_tensor(end), tr.prim_tensor(axes)]
    if len(call.args) > 4 and call.args[4] is not None:
        inputs.append(tr.prim_tensor(list(call.args[4].fields)))
    return gb.op("Slice", inputs)


def _stack(tr, call, ty):
    gb = tr.gb
    axis = int(call.attrs.axis)
    items = [gb.op("Unsqueeze", [tr.tensor(v), gb.const(np.array([axis], np.int64), "axes")])
             for v in tr.visit(call.args[0])]
    return gb.op("Concat", items, axis=axis)


def _concat(tr, call, ty):
    axis = int(call.attrs.axis) if call.attrs.axis is not None else 0
    return tr.gb.op("Concat", [tr.tensor(v) for v in tr.visit(call.args[0])], axis=axis)


def _expand_dims(tr, call, ty):
    axes = tr.gb.const(np.array(_int_list(call.attrs.axis), np.int64), "axes")
    return tr.gb.op("Unsqueeze", [tr.tensor(tr.visit(call.args[0])), axes])


def _squeeze(tr, call, ty):
    x = tr.tensor(tr.visit(call.args[0]))
    if call.attrs.axis is None:
        return tr.gb.op("Squeeze", [x])
    return tr.gb.op("Squeeze", [x, tr.gb.const(np.array(_int_list(call.attrs.axis), np.int64), "axes")])


def _reduce(onnx_op: str):
    def translate(tr, call, ty):
        gb = tr.gb
        x = tr.tensor(tr.visit(call.args[0]))
        keep = int(bool(call.attrs.keepdims))
        if call.attrs.axis is None:
            return gb.op(onnx_op, [x], keepdims=keep)
        return gb.op(onnx_op, [x, gb.const(np.array(_int_list(call.attrs.axis), np.int64), "axes")], keepdims=keep)
    return translate


RELAX_OPS = {
    "relax.add": _elementwise("Add"), "relax.subtract": _elementwise("Sub"),
    "relax.multiply": _elementwise("Mul"), "relax.divide": _elementwise("Div"),
    "relax.maximum": _elementwise("Max"), "relax.minimum": _elementwise("Min"),
    "relax.power": _elementwise("Pow"),
    "relax.exp": _elementwise("Exp"), "relax.sqrt": _elementwise("Sqrt"), "relax.tanh": _elementwise("Tanh"),
    "relax.sigmoid": _elementwise("Sigmoid"), "relax.negative": _elementwise("Neg"),
    "relax.matmul": _matmul, "relax.permute_dims": _permute_dims, "relax.reshape": _reshape,
    "relax.take": _take, "relax.strided_slice": _strided_slice, "relax.stack": _stack, "relax.concat": _concat,
    "relax.expand_dims": _expand_dims, "relax.squeeze": _squeeze, "relax.astype": _astype,
    "relax.sum": _reduce("ReduceSum"), "relax.mean": _reduce("ReduceMean"), "relax.max": _reduce("ReduceMax"),
    "relax.nn.rms_norm": _rms_norm, "relax.nn.silu": _silu, "relax.nn.gelu_tanh": _gelu_tanh,
    "relax.nn.gelu": _gelu, "relax.nn.softmax": _softmax,
}


# -- the project's named ops (sharpi.common.ops) -------------------------------------------------------------------
def _dequantize(tr, call, args, ty, qtype):
    """sharpi.dequantize.<qtype>(parts...): the weights are constants, so the op is evaluated at export time (with
    the same numpy dequantization the kernel tests use) and becomes an f32 initializer, or an f16 one and a Cast."""
    if qtype not in LAYOUTS:
        raise CompileError(f"ONNX export: weight layout {qtype!r} has no ONNX translation "
                           f"(known: {', '.join(LAYOUTS)}).")
    return tr.dequantized(qtype, args, _static_dims(ty, 0, 1))


def _rope(tr, call, args, ty, layout):
    """sharpi.rope.<layout>(x [n, H, D], pos [n] int32, theta): angles pos * theta^(-2i/D) in float64 (as the
    kernel), cos/sin cast to f32; "norm" rotates adjacent pairs (2i, 2i+1), "neox" the halves (i, i + D/2)."""
    if layout not in ("norm", "neox"):
        raise CompileError(f"ONNX export: RoPE layout {layout!r} has no ONNX translation (known: norm, neox).")
    gb = tr.gb
    x, pos, theta = args
    n_heads, head_dim = _static_dims(_arg_ty(call, 0), 1, 2)
    half = head_dim // 2
    cos, sin = tr.cached(("rope", pos, float(theta), head_dim), lambda: _rope_tables(tr, pos, float(theta), head_dim))
    # x as [n, H, 2, D/2] (neox: halves) or [n, H, D/2, 2] (norm: pairs); the two members of each pair
    pair_shape = [0, n_heads, 2, half] if layout == "neox" else [0, n_heads, half, 2]
    xr = gb.op("Reshape", [tr.tensor(x), gb.const(np.array(pair_shape, np.int64), "shape")])
    axis = 2 if layout == "neox" else 3
    a, b = gb.op("Split", [xr], outputs=2, axis=axis, num_outputs=2)
    if layout == "norm":                     # [n, H, D/2, 1]: drop the pair axis so cos/sin [n, 1, D/2] broadcast
        axes = gb.const(np.array([3], np.int64), "axes")
        a, b = gb.op("Squeeze", [a, axes]), gb.op("Squeeze", [b, axes])
        c, s = cos, sin
    else:                                    # [n, H, 1, D/2]
        c, s = (gb.op("Unsqueeze", [t, gb.const(np.array([1], np.int64), "axes")]) for t in (cos, sin))
    ya = gb.op("Sub", [gb.op("Mul", [a, c]), gb.op("Mul", [b, s])])
    yb = gb.op("Add", [gb.op("Mul", [a, s]), gb.op("Mul", [b, c])])
    if layout == "norm":
        axes = gb.const(np.array([3], np.int64), "axes")
        ya, yb = gb.op("Unsqueeze", [ya, axes]), gb.op("Unsqueeze", [yb, axes])
    y = gb.op("Concat", [ya, yb], axis=axis)
    return gb.op("Reshape", [y, gb.const(np.array([0, n_heads, head_dim], np.int64), "shape")])


def _rope_tables(tr, pos, theta: float, head_dim: int):
    """cos and sin [n, 1, D/2] f32 of the positions' angles, computed in float64."""
    gb = tr.gb
    with gb.scope("rope_angles"):
        inv_freq = np.power(np.float64(theta), np.arange(head_dim // 2, dtype=np.float64) * 2 / head_dim * -1)
        p = gb.op("Unsqueeze", [gb.op("Cast", [tr.tensor(pos)], to=tr.onnx_dtype("float64")),
                                gb.const(np.array([1], np.int64), "axes")])
        angle = gb.op("Mul", [p, gb.const(inv_freq, "inv_freq")])                         # [n, D/2] f64
        axes = gb.const(np.array([1], np.int64), "axes")
        f32 = tr.onnx_dtype("float32")
        cos = gb.op("Unsqueeze", [gb.op("Cast", [gb.op("Cos", [angle])], to=f32), axes], hint="rope_cos")
        sin = gb.op("Unsqueeze", [gb.op("Cast", [gb.op("Sin", [angle])], to=f32), axes], hint="rope_sin")
    return cos, sin


def _kv_append(tr, call, args, ty):
    """sharpi.kv_append(pool, k [n, KVH, D], v, page_table, kv_lens, layer): the layer's new slots go behind its
    held ones: present = Concat(past, transpose(k)) along the slot axis."""
    gb = tr.gb
    pool, k, v, _, _, layer = args
    cache = tr.expect_cache(pool, "sharpi.kv_append")
    layer = int(layer)
    with gb.scope(f"layer{layer}/kv_append"):
        kt = gb.op("Transpose", [tr.tensor(k)], perm=[1, 0, 2])
        vt = gb.op("Transpose", [tr.tensor(v)], perm=[1, 0, 2])
        new_k = gb.op("Concat", [cache.keys[layer], kt], axis=1, hint=f"present_key.{layer}")
        new_v = gb.op("Concat", [cache.values[layer], vt], axis=1, hint=f"present_value.{layer}")
    return tr.new_cache(cache.with_layer(layer, new_k, new_v))


def _attention_probs(tr, q_rows, keys, heads: int, kv_heads: int, head_dim: int, scale: float, window: int):
    """Softmax probabilities [KVH, G, m, S] of the m queries q_rows [m, H, D], which sit at the layer's last m slots,
    over the layer's S slots keys [KVH, S, D]: causal, and within `window` slots when window > 0."""
    gb = tr.gb
    group = heads // kv_heads
    i64 = lambda values, hint: gb.const(np.array(values, np.int64), hint)   # noqa: E731
    q = gb.op("Reshape", [gb.op("Transpose", [q_rows], perm=[1, 0, 2]),
                          i64([kv_heads, group, -1, head_dim], "shape")])                 # [KVH, G, m, D]
    kt = gb.op("Unsqueeze", [gb.op("Transpose", [keys], perm=[0, 2, 1]), i64([1], "axes")])   # [KVH, 1, D, S]
    logits = gb.op("Mul", [gb.op("MatMul", [q, kt]), gb.const(np.array(scale, np.float32), "scale")])
    # the mask [m, S]: query i at slot S - m + i sees slots s <= S - m + i (and s > S - m + i - window)
    slots = gb.op("Shape", [keys], start=1, end=2)
    m = gb.op("Shape", [q_rows], start=0, end=1)
    last, first = tr.scalar(slots), tr.scalar(gb.op("Sub", [slots, m]))
    one, zero = gb.const(np.array(1, np.int64), "one"), gb.const(np.array(0, np.int64), "zero")
    q_slot = gb.op("Unsqueeze", [gb.op("Range", [first, last, one]), i64([1], "axes")])           # [m, 1]
    k_slot = gb.op("Unsqueeze", [gb.op("Range", [zero, last, one]), i64([0], "axes")])            # [1, S]
    visible = gb.op("LessOrEqual", [k_slot, q_slot])
    if window > 0:
        lowest = gb.op("Sub", [q_slot, gb.const(np.array(window, np.int64), "window")])
        visible = gb.op("And", [visible, gb.op("Greater", [k_slot, lowest])])
    masked = gb.op("Where", [visible, logits, gb.const(np.array(NEG_INF), "neg_inf")])
    return gb.op("Softmax", [masked], axis=-1)


def _layer_attention(tr, call, pool, layer, op: str):
    """What an attention-shaped named op (q [n, H, D] first, the pool second) reads: the plain cache standing for
    the pool, the layer index, and (heads, kv_heads, head_dim) from the static argument types."""
    heads, head_dim = _static_dims(_arg_ty(call, 0), 1, 2)
    kv_heads, = _static_dims(_arg_ty(call, 1), 2)
    return tr.expect_cache(pool, op), int(layer), heads, kv_heads, head_dim


def _paged_attention(tr, call, args, ty):
    """sharpi.paged_attention(q [n, H, D], pool, page_table, kv_lens, layer, scale, window) -> [n, H, D]."""
    gb = tr.gb
    q, pool, _, _, layer, scale, window = args
    cache, layer, heads, kv_heads, head_dim = _layer_attention(tr, call, pool, layer, "sharpi.paged_attention")
    with gb.scope(f"layer{layer}/attention"):
        probs = _attention_probs(tr, tr.tensor(q), cache.keys[layer], heads, kv_heads, head_dim, float(scale),
                                 int(window))
        v = gb.op("Unsqueeze", [cache.values[layer], gb.const(np.array([1], np.int64), "axes")])   # [KVH, 1, S, D]
        out = gb.op("MatMul", [probs, v])                                                        # [KVH, G, n, D]
        out = gb.op("Reshape", [out, gb.const(np.array([heads, -1, head_dim], np.int64), "shape")])
        return gb.op("Transpose", [out], perm=[1, 0, 2])


def _snapkv_score(tr, call, args, ty):
    """sharpi.snapkv.score(q, pool, page_table, kv_lens, layer, window [1], scale) -> [KVH, S]: the last
    min(window, n) queries' softmax over the layer's slots (causal), summed over those queries, averaged over each
    KV head's query heads (the Relax op's output is padded to the page table's slots; here it is S wide)."""
    gb = tr.gb
    q, pool, _, _, layer, window, scale = args
    cache, layer, heads, kv_heads, head_dim = _layer_attention(tr, call, pool, layer, "sharpi.snapkv.score")
    with gb.scope(f"layer{layer}/snapkv_score"):
        q = tr.tensor(q)
        n = gb.op("Shape", [q], start=0, end=1)
        w = gb.op("Min", [gb.op("Cast", [tr.tensor(window)], to=tr.onnx_dtype("int64")), n])
        q_window = gb.op("Slice", [q, gb.op("Sub", [n, w]), n, gb.const(np.array([0], np.int64), "axes")])
        probs = _attention_probs(tr, q_window, cache.keys[layer], heads, kv_heads, head_dim, float(scale), 0)
        summed = gb.op("ReduceSum", [probs, gb.const(np.array([2], np.int64), "axes")], keepdims=0)  # [KVH, G, S]
        return gb.op("ReduceMean", [summed, gb.const(np.array([1], np.int64), "axes")], keepdims=0,
                     hint=f"snapkv_score.{layer}")


def _snapkv_select(tr, call, args, ty):
    """sharpi.snapkv.select(scores [L, KVH, S], params) -> keep [L, KVH, budget] int32: per row (a layer and KV
    head, or one shared row summed over all), max/avg pooling (Pad with zeros, then MaxPool/AveragePool 1-D over
    kernel K: avg divides by K at the edges too, as the kernel does), the first `sinks` positions, the top
    (budget - recency - sinks) of the candidates [sinks, S - recency) (TopK: ties to the lower index), sorted
    ascending (a second TopK, smallest first), then the last `recency` positions. The pooling, its kernel and the
    granularity are fixed when the graph is exported; budget, recency and sinks are graph inputs (params:
    onnx_export.SelectParams)."""
    gb = tr.gb
    scores, params = args
    p = tr.expect_select_params(params)
    layers, kv_heads = _static_dims(_arg_ty(call, 0), 0, 1)
    i64 = lambda values, hint: gb.const(np.array(values, np.int64), hint)   # noqa: E731
    with gb.scope("snapkv_select"):
        scores = tr.tensor(scores)
        if p.shared:                                # one row: the sum over every layer and KV head, [1, 1, S]
            rows = gb.op("ReduceSum", [gb.op("Reshape", [scores, i64([1, layers * kv_heads, -1], "shape")]),
                                       i64([1], "axes")], keepdims=1)
        else:                                       # a row per layer and KV head, [L*KVH, 1, S]
            rows = gb.op("Reshape", [scores, i64([layers * kv_heads, 1, -1], "shape")])
        if p.pooling in ("max", "avg") and p.kernel > 1:     # zero padding, as the kernel: avg divides by K
            half = p.kernel // 2
            rows = gb.op("Pad", [rows, i64([0, 0, half, 0, 0, half], "pads"),
                                 gb.const(np.array(0, np.float32), "zero")], mode="constant")
            pool = "MaxPool" if p.pooling == "max" else "AveragePool"
            rows = gb.op(pool, [rows], kernel_shape=[p.kernel], strides=[1])
        pooled = gb.op("Squeeze", [rows, i64([1], "axes")], hint="snapkv_pooled")                     # [R, S]
        total = gb.op("Shape", [pooled], start=1, end=2)
        budget, recency, sinks = (gb.op("Cast", [v], to=tr.onnx_dtype("int64"))
                                  for v in (p.budget, p.recency, p.sinks))
        candidates = gb.op("Sub", [total, recency])                  # the candidates are [sinks, candidates)
        head = gb.op("Slice", [pooled, sinks, candidates, i64([1], "axes")])
        k = gb.op("Sub", [gb.op("Sub", [budget, recency]), sinks])
        _, top = gb.op("TopK", [head, k], outputs=2, axis=-1, largest=1, sorted=1)
        ascending, _ = gb.op("TopK", [top, k], outputs=2, axis=-1, largest=0, sorted=1)
        ascending = gb.op("Add", [ascending, sinks])                 # indices into the row, not into `head`
        one = gb.const(np.array(1, np.int64), "one")
        row_count = gb.op("Shape", [ascending], start=0, end=1)

        def every_row(first, last, count):                           # Range(first, last) repeated on each row
            span = gb.op("Range", [first, last, one])
            return gb.op("Expand", [gb.op("Unsqueeze", [span, i64([0], "axes")]),
                                    gb.op("Concat", [row_count, count], axis=0)])
        head_part = every_row(gb.const(np.array(0, np.int64), "zero_index"), tr.scalar(sinks), sinks)
        tail = every_row(tr.scalar(candidates), tr.scalar(total), recency)
        keep = gb.op("Concat", [head_part, ascending, tail], axis=1)                              # [R, budget]
        keep = gb.op("Reshape", [keep, i64([1 if p.shared else layers, 1 if p.shared else kv_heads, -1], "shape")])
        if p.shared:
            keep = gb.op("Expand", [keep, gb.op("Concat", [i64([layers, kv_heads], "shape"), budget], axis=0)])
        return gb.op("Cast", [keep], to=tr.onnx_dtype("int32"), hint="snapkv_keep")


def _kv_compact(tr, call, args, ty):
    """sharpi.kv_compact(pool, page_table, keep [L, KVH, budget], count) -> the pool: for each compacted layer,
    slot keep[l, h, i] -> slot i (GatherElements along the slot axis). `count` (onnx_export.CompactLayers) names
    the layers that are compacted; the others (sliding-window layers) are left as they are."""
    gb = tr.gb
    pool, _, keep, count = args
    cache = tr.expect_cache(pool, "sharpi.kv_compact")
    layers = tr.expect_compact_layers(count)
    head_dim, = _static_dims(_arg_ty(call, 0), 4)
    keep = tr.tensor(keep)
    for layer in layers:
        with gb.scope(f"layer{layer}/kv_compact"):
            idx = gb.op("Gather", [keep, gb.const(np.array(layer, np.int64), "layer")], axis=0)        # [KVH, B]
            shape = gb.op("Concat", [gb.op("Shape", [idx]), gb.const(np.array([head_dim], np.int64), "head_dim")],
                          axis=0)
            idx = gb.op("Expand", [gb.op("Unsqueeze", [idx, gb.const(np.array([2], np.int64), "axes")]), shape])
            new_k = gb.op("GatherElements", [cache.keys[layer], idx], axis=1, hint=f"kept_key.{layer}")
            new_v = gb.op("GatherElements", [cache.values[layer], idx], axis=1, hint=f"kept_value.{layer}")
        cache = cache.with_layer(layer, new_k, new_v)
    return tr.new_cache(cache)


def _moe_route(tr, call, args, ty):
    """sharpi.moe_route(logits [n, E], k, normalize) -> (ids [n, k] int32, weights [n, k]): the softmax over the
    experts, TopK (ties to the lower index, as the kernels), the k weights divided by their sum (at least
    MOE_MIN_WEIGHT_SUM) where `normalize`."""
    gb = tr.gb
    logits, k, normalize = args
    probs = gb.op("Softmax", [tr.tensor(logits)], axis=-1)
    weights, ids = gb.op("TopK", [probs, gb.const(np.array([int(k)], np.int64), "k")], outputs=2, axis=-1,
                         largest=1, sorted=1)
    if int(normalize):
        total = gb.op("ReduceSum", [weights, gb.const(np.array([-1], np.int64), "axes")], keepdims=1)
        weights = gb.op("Div", [weights, gb.op("Max", [total, gb.const(np.float32(ops.MOE_MIN_WEIGHT_SUM))])])
    return [gb.op("Cast", [ids], to=tr.onnx_dtype("int32"), hint="expert_ids"), weights]


def _moe_matmul(tr, call, args, ty):
    """sharpi.moe_matmul(x [n, K] or [n, k, K], ids [n, k], experts [E * N, K]) -> [n, k, N]: each token's chosen
    experts gathered ([n, k, N, K]) and multiplied by its row (or its slot's row)."""
    gb = tr.gb
    x, ids, experts = args
    n_out, = _static_dims(ty, 2)
    k_in, = _static_dims(_arg_ty(call, 2), 1)
    stacked = gb.op("Reshape", [tr.tensor(experts), gb.const(np.array([-1, n_out, k_in], np.int64), "shape")])
    chosen = gb.op("Gather", [stacked, tr.tensor(ids)], axis=0)                          # [n, k, N, K]
    per_slot = len(_static_shape(_arg_ty(call, 0))) == 3
    rows = gb.op("Unsqueeze", [tr.tensor(x), gb.const(np.array([-1] if per_slot else [1, 3], np.int64), "axes")])
    y = gb.op("MatMul", [chosen, rows])                                                 # [n, k, N, 1]
    return gb.op("Squeeze", [y, gb.const(np.array([3], np.int64), "axes")])


NAMED_OPS = {
    ops.MOE_ROUTE: _moe_route,
    ops.MOE_MATMUL: _moe_matmul,
    ops.KV_APPEND: _kv_append,
    ops.PAGED_ATTENTION: _paged_attention,
    ops.SNAPKV_SCORE: _snapkv_score,
    ops.SNAPKV_SELECT: _snapkv_select,
    ops.KV_COMPACT: _kv_compact,
}
NAMED_PREFIXES = {ops.DEQUANTIZE: _dequantize, ops.ROPE: _rope}   # the op name's suffix is the qtype / layout


def named_op(name: str):
    """The translation of a named op: (tr, call, args, ty) -> value, or None if there is none."""
    if name in NAMED_OPS:
        return NAMED_OPS[name]
    for prefix, fn in NAMED_PREFIXES.items():
        if name.startswith(prefix):
            suffix = name[len(prefix):]
            return lambda tr, call, args, ty: fn(tr, call, args, ty, suffix)
    return None


def supported_ops() -> list[str]:
    return sorted(RELAX_OPS) + sorted(NAMED_OPS) + [p + "*" for p in NAMED_PREFIXES]
