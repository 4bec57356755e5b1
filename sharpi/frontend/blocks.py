"""The graph's building blocks, as llama.cpp's shared graph builders (build_norm, build_attn, build_ffn,
build_moe_ffn): each method emits one block's Relax ops into the BlockBuilder, reading the model's weights by their
GGUF tensor names. A model file (frontend/models/*.py) composes them into its Relax functions; what differs within
a family is configuration (ModelConfig's flags, frontend/config.py).

Ops are high level: matmul of a dequantize, rms_norm, and the named calls of sharpi.common.ops (RoPE, the paged KV
cache's append and attention, the mixture's route and expert matmul), which codegen replaces with kernels.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax import op as R

from ..common import ops
from ..common.config import ModelConfig
from ..common.kv_format import KVFormat, key_offset_for
from .weights import GATE_UP_EXPS, WeightTable

ACTIVATIONS = {"silu": R.nn.silu, "gelu_tanh": R.nn.gelu_tanh}


def tensor_type(shape, dtype):
    return relax.TensorType(shape, dtype)


class GraphBlocks:
    """The blocks over one model's weights and KV cache format. A model sets `params` (the function's weight tuple)
    and `batched` (decode_batch's per-sequence page tables) before it emits each function's blocks."""

    def __init__(self, cfg: ModelConfig, weights: WeightTable, kv_types: tuple[str, str], page_size: int):
        self.cfg, self.weights = cfg, weights
        self.kv_format = KVFormat(*kv_types, cfg.n_kv_heads, page_size, cfg.head_dim)
        self.key_offset = key_offset_for(kv_types[0], cfg.qkv_bias)
        self.bb = relax.BlockBuilder()
        self.params = None
        self.batched = False

    # -- weights ----------------------------------------------------------------------------------------------
    def param(self, index: int):
        return self.bb.emit(relax.TupleGetItem(self.params, index))

    def vector(self, name: str):
        _, (index,) = self.weights.tensors[name]
        return self.param(index)

    def dequantize(self, name: str):
        qtype, indices = self.weights.tensors[name]
        n_out, k_in = self.weights.shapes[name]
        parts = [self.param(i) for i in indices]
        return self.bb.emit(relax.call_dps_packed(ops.dequantize_op(qtype), parts,
                                                  tensor_type((n_out, k_in), "float32")))

    def linear(self, x, name: str):
        w = self.dequantize(name)
        return self.bb.emit(R.matmul(x, R.permute_dims(w)))

    # -- norms, embedding, residual ---------------------------------------------------------------------------
    def norm(self, x, name: str):
        return self.bb.emit(R.nn.rms_norm(x, self.vector(name), axes=[-1], epsilon=self.cfg.rms_eps))

    def embedding(self, ids):
        x = self.bb.emit(R.take(self.dequantize("token_embd.weight"), ids, axis=0))
        if self.cfg.embed_scale != 1.0:
            x = self.bb.emit(R.multiply(x, relax.const(self.cfg.embed_scale, "float32")))
        return x

    def sublayer_out(self, out, post_norm: str):
        """A sublayer's output as it joins the residual: RMS-normed first with post_norms, times residual_scale
        (granite)."""
        out = self.norm(out, post_norm) if self.cfg.post_norms else out
        if self.cfg.residual_scale != 1.0:
            out = self.bb.emit(R.multiply(out, relax.const(self.cfg.residual_scale, "float32")))
        return out

    # -- attention --------------------------------------------------------------------------------------------
    def qkv(self, p: str, h, n):
        """Layer `p`'s ("blk.N.") q [n, H, D], k and v [n, KVH, D] from the normed input h, before RoPE."""
        cfg = self.cfg
        q, k, v = (self.project(h, p + name, heads, n) for name, heads in
                   (("attn_q", cfg.n_heads), ("attn_k", cfg.n_kv_heads), ("attn_v", cfg.n_kv_heads)))
        if cfg.qk_norm and not cfg.qk_norm_full:
            q, k = self.norm(q, p + "attn_q_norm.weight"), self.norm(k, p + "attn_k_norm.weight")
        return q, k, v

    def project(self, h, name: str, heads: int, n):
        """h times `name`'s matrix (plus its bias), RMS-normed over its whole width where qk_norm_full (olmoe's
        q and k), as [n, heads, head_dim]."""
        cfg = self.cfg
        y = self.linear(h, name + ".weight")
        if cfg.qkv_bias:
            y = self.bb.emit(R.add(y, self.vector(name + ".bias")))
        if cfg.qk_norm and cfg.qk_norm_full and name.endswith(("attn_q", "attn_k")):
            y = self.norm(y, name + "_norm.weight")
        return self.bb.emit(R.reshape(y, (n, heads, cfg.head_dim)))

    def qkv_gated(self, p: str, h, n):
        """A gated attention layer's (attn_q_gate) q [n, H, D], its gate [n, q_dim], k and v [n, KVH, D]: the q
        projection holds each head's queries, then its gate."""
        cfg, bb = self.cfg, self.bb
        both = bb.emit(R.reshape(self.linear(h, p + "attn_q.weight"), (n, cfg.n_heads, 2, cfg.head_dim)))
        half = [bb.emit(R.reshape(R.strided_slice(both, axes=[2], begin=[i], end=[i + 1]),
                                  (n, cfg.n_heads, cfg.head_dim))) for i in (0, 1)]
        q, gate = half[0], bb.emit(R.reshape(half[1], (n, cfg.q_dim)))
        k, v = (self.project(h, p + name, cfg.n_kv_heads, n) for name in ("attn_k", "attn_v"))
        q, k = self.norm(q, p + "attn_q_norm.weight"), self.norm(k, p + "attn_k_norm.weight")
        return q, gate, k, v

    def rope(self, x, pos, theta: float | None = None):
        """RoPE over the first rotary_dim of each head (all of it unless the model turns only part)."""
        cfg, bb = self.cfg, self.bb
        theta = relax.prim_value(tvm.tirx.FloatImm("float64", theta or cfg.rope_theta))
        if cfg.rotary_dim == cfg.head_dim:
            return bb.emit(relax.call_dps_packed(ops.rope_op(cfg.rope_layout), [x, pos, theta], x.ty))
        n, heads, _ = x.ty.shape
        turned = bb.emit(R.strided_slice(x, axes=[2], begin=[0], end=[cfg.rotary_dim]))
        rest = bb.emit(R.strided_slice(x, axes=[2], begin=[cfg.rotary_dim], end=[cfg.head_dim]))
        turned = bb.emit(relax.call_dps_packed(ops.rope_op(cfg.rope_layout), [turned, pos, theta], turned.ty))
        return bb.emit(R.concat([turned, rest], axis=2))

    def attention(self, l, q, k, v, pool, page_table, kv_lens, n, scale: float | None = None, window: int = 0):
        """Append k and v to layer l's cache, attend; returns (attention output [n, q_dim], the pool)."""
        cfg, bb = self.cfg, self.bb
        layer = relax.prim_value(tvm.tirx.IntImm("int64", l))
        append, attend = ((ops.KV_APPEND_BATCH, ops.PAGED_ATTENTION_BATCH) if self.batched else
                          (ops.KV_APPEND, ops.PAGED_ATTENTION))
        if self.key_offset:           # cached as k - c (common.kv_format.KEY_OFFSET): attention is unchanged
            offset = bb.emit(R.reshape(self.vector(f"blk.{l}.{self.key_offset}"), (cfg.n_kv_heads, cfg.head_dim)))
            k = bb.emit(R.subtract(k, offset))
        pool = bb.emit(relax.call_dps_packed(append, [pool, k, v, page_table, kv_lens, layer], pool.ty))
        scale = relax.prim_value(tvm.tirx.FloatImm("float32", scale or 1.0 / math.sqrt(cfg.head_dim)))
        window = relax.prim_value(tvm.tirx.IntImm("int64", window))
        # keys and values a codec stores rotated: attention runs in the rotated space (dot products are the same)
        key_codec, value_codec = self.kv_format.codec(0), self.kv_format.codec(1)
        if key_codec.rotated:
            q = bb.emit(relax.call_dps_packed(ops.kv_rotate_op(key_codec.name, False), [q], q.ty))
        out_ty = tensor_type((n, cfg.n_heads, cfg.head_dim), "float32")
        attn = bb.emit(relax.call_dps_packed(attend, [q, pool, page_table, kv_lens, layer, scale, window], out_ty))
        if value_codec.rotated:
            attn = bb.emit(relax.call_dps_packed(ops.kv_rotate_op(value_codec.name, True), [attn], out_ty))
        return bb.emit(R.reshape(attn, (n, cfg.q_dim))), pool

    # -- Gated DeltaNet --------------------------------------------------------------------------------------
    def delta_net(self, p: str, h, n, states, slots, layer: int):
        """llama.cpp's build_layer_attn_linear (qwen35, qwen3next) on the normed h [n, dim]: the q, k, v
        projection through the causal conv (its window in the state pool) and SiLU; q and k L2-normed; beta =
        sigmoid(b), g = softplus(a + dt_bias) * ssm_a; the gated delta rule (its matrix in the state pool); its
        output RMS-normed per head, times silu(attn_gate h), through ssm_out. Returns (output [n, dim], states)."""
        cfg, bb = self.cfg, self.bb
        Hk, Hv, d = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state_size
        index = relax.prim_value(tvm.tirx.IntImm("int64", layer))
        mixed = self.linear(h, p + "attn_qkv.weight")
        z = bb.emit(R.reshape(self.linear(h, p + "attn_gate.weight"), (n, Hv, d)))
        if cfg.ssm_fused_ba:            # qwen3next: per k-head, its v-heads' betas, then their alphas
            ba = bb.emit(R.reshape(self.linear(h, p + "ssm_ba.weight"), (n, Hk, 2, Hv // Hk)))
            b, a = (bb.emit(R.reshape(R.strided_slice(ba, axes=[2], begin=[i], end=[i + 1]), (n, Hv))) for i in (0, 1))
        else:
            b, a = self.linear(h, p + "ssm_beta.weight"), self.linear(h, p + "ssm_alpha.weight")
        beta = bb.emit(R.sigmoid(b))
        g = bb.emit(R.multiply(R.nn.softplus(R.add(a, self.vector(p + "ssm_dt.bias")), threshold=20.0),
                               self.vector(p + "ssm_a")))
        conv = bb.emit(relax.call_dps_packed(
            ops.DELTA_CONV, [states, mixed, self.vector(p + "ssm_conv1d.weight"), slots, index],
            [tensor_type((n, cfg.ssm_conv_channels), "float32"), states.ty]))
        states = bb.emit(relax.TupleGetItem(conv, 1))
        conv = bb.emit(R.nn.silu(relax.TupleGetItem(conv, 0)))
        q, k, v = (bb.emit(R.reshape(R.strided_slice(conv, axes=[1], begin=[lo * d], end=[hi * d]), (n, hi - lo, d)))
                   for lo, hi in ((0, Hk), (Hk, 2 * Hk), (2 * Hk, 2 * Hk + Hv)))
        q, k = self.l2_norm(q), self.l2_norm(k)
        rule = bb.emit(relax.call_dps_packed(ops.DELTA_RULE, [states, q, k, v, g, beta, slots, index],
                                             [tensor_type((n, Hv, d), "float32"), states.ty]))
        states = bb.emit(relax.TupleGetItem(rule, 1))
        out = self.norm(bb.emit(relax.TupleGetItem(rule, 0)), p + "ssm_norm.weight")
        out = bb.emit(R.reshape(R.multiply(out, R.nn.silu(z)), (n, Hv * d)))
        return self.linear(out, p + "ssm_out.weight"), states

    def l2_norm(self, x):
        """x / sqrt(sum x^2 + eps) over the last axis (llama.cpp's build_gdn_l2_norm)."""
        bb = self.bb
        total = bb.emit(R.sum(R.multiply(x, x), axis=[-1], keepdims=True))
        return bb.emit(R.multiply(x, R.rsqrt(R.add(total, relax.const(self.cfg.rms_eps, "float32")))))

    # -- feed-forward -----------------------------------------------------------------------------------------
    def gated_ffn(self, h, name: str):
        """act(h gate^T) * (h up^T), times down^T; `name` formats to the gate's, up's and down's tensor names."""
        act = ACTIVATIONS[self.cfg.ffn_activation]
        gate, up = self.linear(h, name.format("gate")), self.linear(h, name.format("up"))
        return self.linear(self.bb.emit(R.multiply(act(gate), up)), name.format("down"))

    def moe_ffn(self, p: str, h, n):
        """llama.cpp's build_moe_ffn: the router's k experts per token (ops.MOE_ROUTE), each expert's gated FFN
        on its tokens (ops.MOE_MATMUL reads the chosen experts' rows only), their outputs summed with the
        router's weights; plus a shared expert scaled by sigmoid(h . ffn_gate_inp_shexp) where the model has one."""
        cfg, bb = self.cfg, self.bb
        k = cfg.n_experts_used
        logits = self.linear(h, p + "ffn_gate_inp.weight")
        route = bb.emit(relax.call_dps_packed(
            ops.MOE_ROUTE, [logits, relax.prim_value(tvm.tirx.IntImm("int64", k)),
                            relax.prim_value(tvm.tirx.IntImm("int64", int(cfg.expert_weights_norm)))],
            [tensor_type((n, k), "int32"), tensor_type((n, k), "float32")]))
        ids, weights = bb.emit(relax.TupleGetItem(route, 0)), bb.emit(relax.TupleGetItem(route, 1))
        act = ACTIVATIONS[cfg.ffn_activation]
        if p + GATE_UP_EXPS in self.weights.stacked:     # one matmul of both: [n, k, 2 F]
            both = self.expert_linear(h, ids, p + GATE_UP_EXPS, n)
            width = cfg.expert_ffn_dim
            gate, up = (bb.emit(R.strided_slice(both, axes=[2], begin=[lo], end=[lo + width])) for lo in (0, width))
        else:
            gate = self.expert_linear(h, ids, p + "ffn_gate_exps.weight", n)
            up = self.expert_linear(h, ids, p + "ffn_up_exps.weight", n)
        down = self.expert_linear(bb.emit(R.multiply(act(gate), up)), ids, p + "ffn_down_exps.weight", n)
        out = bb.emit(R.sum(R.multiply(down, R.expand_dims(weights, [-1])), axis=[1]))
        if cfg.shared_expert_ffn_dim:
            shared = self.gated_ffn(h, p + "ffn_{}_shexp.weight")
            gate_in = bb.emit(R.matmul(h, self.vector(p + "ffn_gate_inp_shexp.weight")))
            out = bb.emit(R.add(out, R.multiply(shared, R.expand_dims(R.sigmoid(gate_in), [-1]))))
        return out

    def expert_linear(self, x, ids, name: str, n):
        """[n, k, N]: x [n, K] (or [n, k, K], one row per chosen expert) times the chosen experts of `name`."""
        experts, rows = self.cfg.n_experts, self.weights.shapes[name][0]
        k = self.cfg.n_experts_used
        return self.bb.emit(relax.call_dps_packed(ops.MOE_MATMUL, [x, ids, self.dequantize(name)],
                                                  tensor_type((n, k, rows // experts), "float32")))
