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
# sharpi.paged_attention(q [n, H, D], pool, page_table, kv_lens, layer: i64, scale: f32, window: i64) -> [n, H, D]
#   window > 0: a sliding window, query t sees only the last `window` of its slots (0: all of them)
PAGED_ATTENTION = "sharpi.paged_attention"

PAGE_SIZE = 16


def dequantize_op(qtype: str) -> str:
    return DEQUANTIZE + qtype


def rope_op(layout: str) -> str:
    return ROPE + layout

# SnapKV (inserted by sharpi.ir_passes.snapkv):
# sharpi.snapkv.score(q, pool, page_table, kv_lens, layer: i64, window [1] int32, scale: f32) -> f32 [KVH, slots]
#   the last `window` queries of the chunk attend (causally) over the layer's slots; probabilities summed over
#   those queries and averaged over each KV head's query heads.
SNAPKV_SCORE = "sharpi.snapkv.score"
# sharpi.snapkv.select(scores f32 [L, KVH, slots], params int32 [7]) -> keep int32 [L, KVH, slots]
#   params: total, budget, recency, pooling kernel, pooling (0 none, 1 max, 2 avg), shared (0/1), sinks
#   (sharpi.codegen.kernels.snapkv.P_*; artifacts compiled before sinks existed take the first 6);
#   keep[l, h, :budget] is the ascending keep set.
SNAPKV_SELECT = "sharpi.snapkv.select"
SELECT_PARAMS = 7              # the params' length; an artifact compiled before sinks existed has 6 (no sinks)
SELECT_PARAMS_BEFORE_SINKS = 6
# sharpi.kv_compact(pool, page_table, keep int32 [L, KVH, slots], count [L] int32) -> pool (written in place)
KV_COMPACT = "sharpi.kv_compact"
SNAPKV_POOLING_CODES = {"none": 0, "max": 1, "avg": 2}
