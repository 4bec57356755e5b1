"""The llama family as Relax functions: `prefill` (logits of the last token), `prefill_logits` (logits of
every token, for score()), and `decode` (one token, static shapes).

One graph for every architecture of the family, as llama.cpp builds them: what differs is configuration
(sharpi.frontend.config maps each GGUF architecture onto it, from llama.cpp's src/models/*.cpp):
- `qkv_bias` (qwen2): the q, k and v projections add a bias (blk.N.attn_{q,k,v}.bias) before the reshape;
- `qk_norm` (qwen3, gemma3): q and k RMS-normed per head (blk.N.attn_{q,k}_norm.weight) before RoPE;
- `rope_layout`: adjacent pairs (llama) or NEOX halves (qwen, gemma3);
- `post_norms` (gemma3): each sublayer's output RMS-normed (post_attention_norm, post_ffw_norm) before its
  residual add; `ffn_activation`: silu (SwiGLU) or gelu_tanh (gemma3's GeGLU);
- `embed_scale` (gemma3: sqrt(dim)), `attn_scale` (0: 1/sqrt(head_dim)), and sliding-window layers (`is_local`:
  every layer of a mistral-style llama, gemma3's local ones) with their own RoPE base `rope_theta_local`.

Every function has the same signature:
    (ids [n] int32, pos [n] int32, pool, page_table [L, MP] int32, kv_lens [L] int32, params) -> logits
`pos` are the tokens' logical positions (RoPE), `kv_lens` the slots each layer held before the call; the
runtime owns the pool and the page tables. Ops are high level: matmul of a dequantize, rms_norm, the named
RoPE and paged-attention calls of sharpi.common.ops.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax import op as R

from ..common import ops
from ..common.config import ModelConfig
from ..common.kv_format import KVFormat, key_offset_for
from .gguf_file import GGUFFile
from .weights import WeightTable, load_weights

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_VECTORS = ("attn_norm", "ffn_norm")
# a mixture of experts' FFN in place of the dense one: the router and the experts ([E, N, K], read as [E * N, K])
MOE_MATRICES = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_EXPERT_MATRICES = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# per-layer vectors the flags add, by flag, in the order they follow the base ones (after output_norm)
FLAG_VECTORS = {"qkv_bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                "qk_norm": ("attn_q_norm.weight", "attn_k_norm.weight"),
                "post_norms": ("post_attention_norm.weight", "post_ffw_norm.weight"),
                "shared_expert_ffn_dim": ("ffn_gate_inp_shexp.weight",)}
ACTIVATIONS = {"silu": R.nn.silu, "gelu_tanh": R.nn.gelu_tanh}


def layer_vectors(cfg: ModelConfig) -> list[str]:
    """The per-layer f32 tensors (names after `blk.N.`) a config's flags add to the base ones."""
    return [v for flag, names in FLAG_VECTORS.items() if getattr(cfg, flag) for v in names]


def layer_matrices(cfg: ModelConfig) -> tuple[str, ...]:
    """The per-layer matrices (names after `blk.N.`, before `.weight`): attention's, then the FFN's."""
    if not cfg.is_moe:
        return LAYER_MATRICES
    return LAYER_MATRICES[:4] + MOE_MATRICES + (SHARED_EXPERT_MATRICES if cfg.shared_expert_ffn_dim else ())


def llama_weights(gguf: GGUFFile, cfg: ModelConfig, show_progress: bool) -> WeightTable:
    """The weights the config's graph takes, in the order of its parameters."""
    matrices = ["token_embd.weight"] + [f"blk.{l}.{m}.weight" for l in range(cfg.n_layers)
                                        for m in layer_matrices(cfg)]
    if not cfg.tied_embeddings:
        matrices.append("output.weight")
    vectors = [f"blk.{l}.{v}.weight" for l in range(cfg.n_layers) for v in LAYER_VECTORS] + ["output_norm.weight"]
    vectors += [f"blk.{l}.{v}" for l in range(cfg.n_layers) for v in layer_vectors(cfg)]
    return load_weights(gguf, matrices, vectors, show_progress)


def tensor_type(shape, dtype):
    return relax.TensorType(shape, dtype)


class LlamaBuilder:
    def __init__(self, cfg: ModelConfig, weights: WeightTable, max_pages: int, page_size: int = ops.PAGE_SIZE,
                 kv_types: tuple[str, str] = ("float32", "float32")):
        self.cfg, self.weights = cfg, weights
        self.kv_format = KVFormat(*kv_types, cfg.n_kv_heads, page_size, cfg.head_dim)
        self.key_offset = key_offset_for(kv_types[0], cfg.qkv_bias)
        self.max_pages, self.page_size = max_pages, page_size
        self.bb = relax.BlockBuilder()

    def build(self) -> tvm.IRModule:
        self._function("prefill", tokens=None, all_logits=False)
        self._function("prefill_logits", tokens=None, all_logits=True)
        self._function("decode", tokens=1, all_logits=False)
        self._function("decode_batch", tokens=None, all_logits=True, batched=True)
        return self.bb.get()

    # -- function skeleton -------------------------------------------------------------------------------------
    def _function(self, name: str, tokens: int | None, all_logits: bool, batched: bool = False) -> None:
        """One Relax function; batched: decode_batch, n tokens of n sequences (page tables [n, L, MP], lengths
        [n, L]; every token's logits)."""
        cfg = self.cfg
        n = tvm.tirx.Var("n", "int64") if tokens is None else tokens
        pages = tvm.tirx.Var("pages", "int64")
        ids = relax.Var("ids", tensor_type((n,), "int32"))
        pos = relax.Var("pos", tensor_type((n,), "int32"))
        pool = relax.Var("pool", tensor_type(self.kv_format.pool_shape(pages), self.kv_format.pool_dtype))
        per_sequence = (n,) if batched else ()
        page_table = relax.Var("page_table", tensor_type((*per_sequence, cfg.n_layers, self.max_pages), "int32"))
        kv_lens = relax.Var("kv_lens", tensor_type((*per_sequence, cfg.n_layers), "int32"))
        self._batched = batched
        params = relax.Var("params", relax.TupleType([tensor_type(spec.shape, spec.dtype)
                                                      for spec in self.weights.specs]))
        bb = self.bb
        with bb.function(name, [ids, pos, pool, page_table, kv_lens, params], attrs={"num_input": 5}, pure=False):
            with bb.dataflow():
                self._params = params
                x = self._embedding(ids)
                for layer in range(cfg.n_layers):
                    x, pool = self._layer(layer, x, pos, pool, page_table, kv_lens, n)
                x = bb.emit(R.nn.rms_norm(x, self._vector("output_norm.weight"), axes=[-1], epsilon=cfg.rms_eps))
                if not all_logits:
                    # in bounds (a prompt has a token), which keeps the row count 1 rather than an expression
                    # of n that Relax's GPU fusion cannot type
                    x = bb.emit(R.strided_slice(x, axes=[0], begin=[n - 1], end=[n], assume_inbound=True))
                head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
                logits = self._linear(x, head)
                if cfg.logit_scale != 1.0:          # granite
                    logits = bb.emit(R.divide(logits, relax.const(cfg.logit_scale, "float32")))
                logits = bb.emit_output(logits)
            bb.emit_func_output(logits)

    # -- weights ----------------------------------------------------------------------------------------------
    def _param(self, index: int):
        return self.bb.emit(relax.TupleGetItem(self._params, index))

    def _vector(self, name: str):
        _, (index,) = self.weights.tensors[name]
        return self._param(index)

    def _dequantize(self, name: str):
        qtype, indices = self.weights.tensors[name]
        n_out, k_in = self.weights.shapes[name]
        parts = [self._param(i) for i in indices]
        return self.bb.emit(relax.call_dps_packed(ops.dequantize_op(qtype), parts,
                                                  tensor_type((n_out, k_in), "float32")))

    def _linear(self, x, name: str):
        w = self._dequantize(name)
        return self.bb.emit(R.matmul(x, R.permute_dims(w)))

    def _norm(self, x, name: str):
        return self.bb.emit(R.nn.rms_norm(x, self._vector(name), axes=[-1], epsilon=self.cfg.rms_eps))

    def _embedding(self, ids):
        x = self.bb.emit(R.take(self._dequantize("token_embd.weight"), ids, axis=0))
        if self.cfg.embed_scale != 1.0:
            x = self.bb.emit(R.multiply(x, relax.const(self.cfg.embed_scale, "float32")))
        return x

    # -- one transformer block ------------------------------------------------------------------------------
    def _layer(self, l, x, pos, pool, page_table, kv_lens, n):
        cfg, bb, p = self.cfg, self.bb, f"blk.{l}."
        h = self._norm(x, p + "attn_norm.weight")
        q, k, v = self._qkv(p, h, n)
        local = cfg.is_local(l)
        theta = cfg.rope_theta_local if local and cfg.rope_theta_local else cfg.rope_theta
        q, k = self._rope(q, pos, theta), self._rope(k, pos, theta)
        attn, pool = self._attention(l, q, k, v, pool, page_table, kv_lens, n, scale=cfg.attn_scale or None,
                                     window=cfg.sliding_window if local else 0)
        x = bb.emit(R.add(x, self._sublayer_out(self._linear(attn, p + "attn_output.weight"),
                                                 p + "post_attention_norm.weight")))
        h = self._norm(x, p + "ffn_norm.weight")
        ffn = self._moe_ffn(p, h, n) if cfg.is_moe else self._gated_ffn(h, p + "ffn_{}.weight")
        x = bb.emit(R.add(x, self._sublayer_out(ffn, p + "post_ffw_norm.weight")))
        return x, pool

    def _sublayer_out(self, out, post_norm: str):
        """A sublayer's output as it joins the residual: RMS-normed first with post_norms, times residual_scale
        (granite)."""
        out = self._norm(out, post_norm) if self.cfg.post_norms else out
        if self.cfg.residual_scale != 1.0:
            out = self.bb.emit(R.multiply(out, relax.const(self.cfg.residual_scale, "float32")))
        return out

    # -- the FFN blocks ---------------------------------------------------------------------------------------
    def _gated_ffn(self, h, name: str):
        """act(h gate^T) * (h up^T), times down^T; `name` formats to the gate's, up's and down's tensor names."""
        act = ACTIVATIONS[self.cfg.ffn_activation]
        gate, up = self._linear(h, name.format("gate")), self._linear(h, name.format("up"))
        return self._linear(self.bb.emit(R.multiply(act(gate), up)), name.format("down"))

    def _moe_ffn(self, p: str, h, n):
        """llama.cpp's build_moe_ffn: the router's k experts per token (ops.MOE_ROUTE), each expert's gated FFN
        on its tokens (ops.MOE_MATMUL reads the chosen experts' rows only), their outputs summed with the
        router's weights; plus a shared expert scaled by sigmoid(h . ffn_gate_inp_shexp) where the model has one."""
        cfg, bb = self.cfg, self.bb
        k = cfg.n_experts_used
        logits = self._linear(h, p + "ffn_gate_inp.weight")
        route = bb.emit(relax.call_dps_packed(
            ops.MOE_ROUTE, [logits, relax.prim_value(tvm.tirx.IntImm("int64", k)),
                            relax.prim_value(tvm.tirx.IntImm("int64", int(cfg.expert_weights_norm)))],
            [tensor_type((n, k), "int32"), tensor_type((n, k), "float32")]))
        ids, weights = bb.emit(relax.TupleGetItem(route, 0)), bb.emit(relax.TupleGetItem(route, 1))
        act = ACTIVATIONS[cfg.ffn_activation]
        gate = self._expert_linear(h, ids, p + "ffn_gate_exps.weight", n)
        up = self._expert_linear(h, ids, p + "ffn_up_exps.weight", n)
        down = self._expert_linear(bb.emit(R.multiply(act(gate), up)), ids, p + "ffn_down_exps.weight", n)
        out = bb.emit(R.sum(R.multiply(down, R.expand_dims(weights, [-1])), axis=[1]))
        if cfg.shared_expert_ffn_dim:
            shared = self._gated_ffn(h, p + "ffn_{}_shexp.weight")
            gate_in = bb.emit(R.matmul(h, self._vector(p + "ffn_gate_inp_shexp.weight")))
            out = bb.emit(R.add(out, R.multiply(shared, R.expand_dims(R.sigmoid(gate_in), [-1]))))
        return out

    def _expert_linear(self, x, ids, name: str, n):
        """[n, k, N]: x [n, K] (or [n, k, K], one row per chosen expert) times the chosen experts of `name`."""
        experts, rows = self.cfg.n_experts, self.weights.shapes[name][0]
        k = self.cfg.n_experts_used
        return self.bb.emit(relax.call_dps_packed(ops.MOE_MATMUL, [x, ids, self._dequantize(name)],
                                                  tensor_type((n, k, rows // experts), "float32")))

    def _qkv(self, p: str, h, n):
        """Layer `p`'s ("blk.N.") q [n, H, D], k and v [n, KVH, D] from the normed input h, before RoPE."""
        cfg = self.cfg
        q, k, v = (self._project(h, p + name, heads, n) for name, heads in
                   (("attn_q", cfg.n_heads), ("attn_k", cfg.n_kv_heads), ("attn_v", cfg.n_kv_heads)))
        if cfg.qk_norm and not cfg.qk_norm_full:
            q, k = self._norm(q, p + "attn_q_norm.weight"), self._norm(k, p + "attn_k_norm.weight")
        return q, k, v

    def _project(self, h, name: str, heads: int, n):
        """h times `name`'s matrix (plus its bias), RMS-normed over its whole width where qk_norm_full (olmoe's
        q and k), as [n, heads, head_dim]."""
        cfg = self.cfg
        y = self._linear(h, name + ".weight")
        if cfg.qkv_bias:
            y = self.bb.emit(R.add(y, self._vector(name + ".bias")))
        if cfg.qk_norm and cfg.qk_norm_full and name.endswith(("attn_q", "attn_k")):
            y = self._norm(y, name + "_norm.weight")
        return self.bb.emit(R.reshape(y, (n, heads, cfg.head_dim)))

    def _attention(self, l, q, k, v, pool, page_table, kv_lens, n, scale: float | None = None, window: int = 0):
        """Append k and v to layer l's cache, attend; returns (attention output [n, q_dim], the pool)."""
        cfg, bb = self.cfg, self.bb
        layer = relax.prim_value(tvm.tirx.IntImm("int64", l))
        append, attend = ((ops.KV_APPEND_BATCH, ops.PAGED_ATTENTION_BATCH) if self._batched else
                          (ops.KV_APPEND, ops.PAGED_ATTENTION))
        if self.key_offset:           # cached as k - c (common.kv_format.KEY_OFFSET): attention is unchanged
            offset = bb.emit(R.reshape(self._vector(f"blk.{l}.{self.key_offset}"), (cfg.n_kv_heads, cfg.head_dim)))
            k = bb.emit(R.subtract(k, offset))
        pool = bb.emit(relax.call_dps_packed(append, [pool, k, v, page_table, kv_lens, layer], pool.ty))
        scale = relax.prim_value(tvm.tirx.FloatImm("float32", scale or 1.0 / math.sqrt(cfg.head_dim)))
        window = relax.prim_value(tvm.tirx.IntImm("int64", window))
        attn = bb.emit(relax.call_dps_packed(attend, [q, pool, page_table, kv_lens, layer, scale, window],
                                             tensor_type((n, cfg.n_heads, cfg.head_dim), "float32")))
        return bb.emit(R.reshape(attn, (n, cfg.q_dim))), pool

    def _rope(self, x, pos, theta: float | None = None):
        theta = relax.prim_value(tvm.tirx.FloatImm("float64", theta or self.cfg.rope_theta))
        return self.bb.emit(relax.call_dps_packed(ops.rope_op(self.cfg.rope_layout), [x, pos, theta],
                                                  x.ty))
