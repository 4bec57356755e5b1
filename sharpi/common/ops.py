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
# decode_batch's pair (one new token for each of B sequences; token b is sequence b's):
# sharpi.kv_append_batch(pool, k [B, KVH, D], v, page_tables [B, L, MP], kv_lens [B, L], layer: i64) -> pool
# sharpi.paged_attention_batch(q [B, H, D], pool, page_tables, kv_lens, layer, scale, window) -> [B, H, D]
#   token b sees its sequence's slots [0, kv_lens[b, l]] (its own written last)
KV_APPEND_BATCH = "sharpi.kv_append_batch"
PAGED_ATTENTION_BATCH = "sharpi.paged_attention_batch"
# sharpi.kv_rotate.<type>.<forward|inverse>(x [n, H, D]) -> [n, H, D]: a rotated KV type's rotation of each head's
#   row (kv_codecs: TurboQuant's Pi = H S / sqrt(D)): forward, Pi x, for queries before attention over keys of that
#   type; inverse, Pi^T y, for attention's output over values of that type
KV_ROTATE = "sharpi.kv_rotate."

# The mixture-of-experts FFN (llama.cpp's build_moe_ffn):
# sharpi.moe_route(logits [n, E] f32, k: i64, normalize: i64) -> (ids [n, k] int32, weights [n, k] f32)
#   softmax over the E experts, the k most probable in descending order (ties: the lower index), their
#   probabilities as weights, divided by their sum (at least MOE_MIN_WEIGHT_SUM) when normalize is 1
MOE_ROUTE = "sharpi.moe_route"
MOE_MIN_WEIGHT_SUM = 6.103515625e-5
# sharpi.moe_matmul(x [n, K] or [n, k, K], ids [n, k] int32, experts f32 [E * N, K]) -> [n, k, N]
#   y[t, j] = experts[ids[t, j]] @ x[t] (or x[t, j]); experts is a dequantize (of the experts' [E, N, K]
#   stored as [E * N, K]), which codegen fuses as it fuses a matmul's; ids are clamped into [0, E)
MOE_MATMUL = "sharpi.moe_matmul"

# Gated DeltaNet (hybrid models): each sequence's recurrent state lives in a state pool [slots, R, W] f32 beside the
# KV pool (R: the DeltaNet layers; W: the conv's last K - 1 inputs [K - 1, C], then the delta rule's matrices
# [H_v, d, d]); every token names its sequence's slot, and the tokens of one sequence come together, in order.
# sharpi.delta_conv(states, mixed [n, C], weight [C, K], slots [n] int32, layer: i64) -> (out [n, C], states)
#   the causal depthwise conv of each token over its sequence's last K - 1 inputs; the token joins them
DELTA_CONV = "sharpi.delta_conv"
# sharpi.delta_rule(states, q [n, H_k, d], k [n, H_k, d], v [n, H_v, d], g [n, H_v], beta [n, H_v], slots [n],
#   layer: i64) -> (out [n, H_v, d], states): the gated delta rule, token by token (the config's head map)
DELTA_RULE = "sharpi.delta_rule"
# sharpi.state_copy(states, pair [2] int32) -> states: slot pair[1] becomes a copy of slot pair[0]
STATE_COPY = "sharpi.state_copy"

PAGE_SIZE = 16


def dequantize_op(qtype: str) -> str:
    return DEQUANTIZE + qtype


def rope_op(layout: str) -> str:
    return ROPE + layout


def kv_rotate_op(kv_type: str, inverse: bool) -> str:
    return f"{KV_ROTATE}{kv_type}.{'inverse' if inverse else 'forward'}"

# SnapKV (inserted by sharpi.ir_passes.snapkv):
# sharpi.snapkv.score(q, pool, page_table, kv_lens, layer: i64, window [1] int32, scale: f32) -> f32 [KVH, slots]
#   the last `window` queries of the chunk attend (causally) over the layer's slots; probabilities summed over
#   those queries and averaged over each KV head's query heads.
SNAPKV_SCORE = "sharpi.snapkv.score"
# sharpi.snapkv.select(scores f32 [L, KVH, slots], params int32 [SELECT_PARAMS]) -> keep int32 [L, KVH, slots]
#   params (select_params() packs them; the kernels index them by P_*): total, budget, recency, pooling kernel,
#   pooling code (POOLING_CODES), shared (0/1), sinks (last, so that the other indices are those of the 6-entry
#   tensor of artifacts compiled before sinks existed); keep[l, h, :budget] is the ascending keep set.
SNAPKV_SELECT = "sharpi.snapkv.select"
SELECT_PARAMS = 7              # the params' length; an artifact compiled before sinks existed has 6 (no sinks)
SELECT_PARAMS_BEFORE_SINKS = 6
P_TOTAL, P_BUDGET, P_RECENCY, P_KERNEL, P_POOLING, P_SHARED, P_SINKS = range(SELECT_PARAMS)
POOLING_CODES = {"none": 0, "max": 1, "avg": 2}
POOL_NONE, POOL_MAX, POOL_AVG = (POOLING_CODES[p] for p in ("none", "max", "avg"))
# sharpi.kv_compact(pool, page_table, keep int32 [L, KVH, slots], count [L] int32) -> pool (written in place)
KV_COMPACT = "sharpi.kv_compact"


def select_params(total: int, budget: int, settings, length: int = SELECT_PARAMS) -> list[int]:
    """snapkv_select's params for a prompt of `total` slots kept to `budget` with SnapKVSettings `settings`;
    `length` 6 for an artifact compiled before sinks existed (it takes no sinks)."""
    params = [0] * SELECT_PARAMS
    params[P_TOTAL], params[P_BUDGET], params[P_RECENCY] = total, budget, settings.recency
    params[P_KERNEL], params[P_POOLING] = settings.kernel, POOLING_CODES[settings.pooling]
    params[P_SHARED], params[P_SINKS] = int(settings.granularity == "shared"), settings.sinks
    return params[:length]
