"""The named operations the frontend emits and codegen implements: the contract between the two.

The frontend writes them as `R.call_dps_packed(NAME, args, out)`; scalar attributes travel as PrimValue
arguments so the IR says everything (passes and the ONNX export read them). Codegen replaces each with its
kernel (`call_tir`, or `call_tir_inplace` for writes into the KV pool); the rest of the graph is plain Relax.
"""

# sharpi.dequantize.<qtype>(*parts) -> f32 [N, K]; parts and qtypes as in sharpi.common.quant_layout.
# Used as matmul(x, permute_dims(dequantize(...))) and take(dequantize(...), ids), which codegen fuses.
DEQUANTIZE = "sharpi.dequantize."
# sharpi.rope.<layout>(x [n, H, D], pos [n] int32, theta: f64) -> [n, H, D]; layout "norm" or "neox".
ROPE = "sharpi.rope."
# sharpi.kv_append(pool, k [n, KVH, D], v [n, KVH, D], page_table [L, MP], kv_lens [L], layer: i64) -> pool
KV_APPEND = "sharpi.kv_append"
# sharpi.paged_attention(q [n, H, D], pool, page_table, kv_lens, layer: i64, scale: f32) -> [n, H, D]
PAGED_ATTENTION = "sharpi.paged_attention"

PAGE_SIZE = 16


def dequantize_op(qtype: str) -> str:
    return DEQUANTIZE + qtype


def rope_op(layout: str) -> str:
    return ROPE + layout
