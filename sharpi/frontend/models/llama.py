"""The llama family as Relax functions: `prefill` (logits of the last token), `prefill_logits` (logits of
every token, for score()), `decode` (one token, static shapes) and `decode_batch` (one token of each of n sequences).

One graph for every architecture of the family, composed of frontend.blocks as llama.cpp builds them: what differs
is configuration (sharpi.frontend.config maps each GGUF architecture onto it, from llama.cpp's src/models/*.cpp):
- `qkv_bias` (qwen2): the q, k and v projections add a bias (blk.N.attn_{q,k,v}.bias) before the reshape;
- `qk_norm` (qwen3, gemma3): q and k RMS-normed per head (blk.N.attn_{q,k}_norm.weight) before RoPE
  (`qk_norm_full`, olmoe: over the whole projection);
- `rope_layout`: adjacent pairs (llama) or NEOX halves (qwen, gemma3);
- `post_norms` (gemma3): each sublayer's output RMS-normed (post_attention_norm, post_ffw_norm) before its
  residual add; `ffn_activation`: silu (SwiGLU) or gelu_tanh (gemma3's GeGLU);
- `embed_scale` (gemma3: sqrt(dim)), `attn_scale` (0: 1/sqrt(head_dim)), and sliding-window layers (`is_local`:
  every layer of a mistral-style llama, gemma3's local ones) with their own RoPE base `rope_theta_local`;
- `n_experts` (olmoe, qwen2moe, qwen3moe, granitemoe): the mixture-of-experts FFN in place of the dense one, with a
  shared expert where `shared_expert_ffn_dim`; granite's `residual_scale` and `logit_scale`.

Every function has the same signature:
    (ids [n] int32, pos [n] int32, pool, page_table [L, MP] int32, kv_lens [L] int32, params) -> logits
`pos` are the tokens' logical positions (RoPE), `kv_lens` the slots each layer held before the call; the
runtime owns the pool and the page tables.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import op as R

from ...common import ops
from ...common.config import ModelConfig
from ..blocks import GraphBlocks, tensor_type
from ..gguf_file import GGUFFile
from ..weights import WeightTable, load_weights

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


class LlamaBuilder(GraphBlocks):
    def __init__(self, cfg: ModelConfig, weights: WeightTable, max_pages: int, page_size: int = ops.PAGE_SIZE,
                 kv_types: tuple[str, str] = ("float32", "float32")):
        super().__init__(cfg, weights, kv_types, page_size)
        self.max_pages, self.page_size = max_pages, page_size

    def build(self) -> tvm.IRModule:
        self._function("prefill", tokens=None, all_logits=False)
        self._function("prefill_logits", tokens=None, all_logits=True)
        self._function("decode", tokens=1, all_logits=False)
        self._function("decode_batch", tokens=None, all_logits=True, batched=True)
        return self.bb.get()

    def _function(self, name: str, tokens: int | None, all_logits: bool, batched: bool = False) -> None:
        """One Relax function; batched: decode_batch, n tokens of n sequences (page tables [n, L, MP], lengths
        [n, L]; every token's logits)."""
        n, (ids, pos, pool, page_table, kv_lens), params = self._inputs(tokens, batched)
        bb = self.bb
        with bb.function(name, [ids, pos, pool, page_table, kv_lens, params], attrs={"num_input": 5}, pure=False):
            with bb.dataflow():
                self.params = params
                x = self.embedding(ids)
                for layer in range(self.cfg.n_layers):
                    x, pool = self._layer(layer, x, pos, pool, page_table, kv_lens, n)
                logits = bb.emit_output(self._head(x, n, all_logits))
            bb.emit_func_output(logits)

    def _inputs(self, tokens: int | None, batched: bool):
        """(n, the KV inputs (ids, pos, pool, page_table, kv_lens), the weights' tuple) of a function of `tokens`
        tokens (None: any number); the page tables and lengths cover the layers with a KV cache."""
        cfg = self.cfg
        n = tvm.tirx.Var("n", "int64") if tokens is None else tokens
        pages = tvm.tirx.Var("pages", "int64")
        ids = relax.Var("ids", tensor_type((n,), "int32"))
        pos = relax.Var("pos", tensor_type((n,), "int32"))
        pool = relax.Var("pool", tensor_type(self.kv_format.pool_shape(pages), self.kv_format.pool_dtype))
        per_sequence = (n,) if batched else ()
        page_table = relax.Var("page_table", tensor_type((*per_sequence, cfg.kv_layers, self.max_pages), "int32"))
        kv_lens = relax.Var("kv_lens", tensor_type((*per_sequence, cfg.kv_layers), "int32"))
        self.batched = batched
        params = relax.Var("params", relax.TupleType([tensor_type(spec.shape, spec.dtype)
                                                      for spec in self.weights.specs]))
        return n, (ids, pos, pool, page_table, kv_lens), params

    def _head(self, x, n, all_logits: bool):
        """The final norm and the output matrix: every token's logits, or the last token's."""
        cfg, bb = self.cfg, self.bb
        x = bb.emit(R.nn.rms_norm(x, self.vector("output_norm.weight"), axes=[-1], epsilon=cfg.rms_eps))
        if not all_logits:
            # in bounds (a prompt has a token), which keeps the row count 1 rather than an expression
            # of n that Relax's GPU fusion cannot type
            x = bb.emit(R.strided_slice(x, axes=[0], begin=[n - 1], end=[n], assume_inbound=True))
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        logits = self.linear(x, head)
        if cfg.logit_scale != 1.0:          # granite
            logits = bb.emit(R.divide(logits, relax.const(cfg.logit_scale, "float32")))
        return logits

    def _layer(self, l, x, pos, pool, page_table, kv_lens, n):
        """One transformer block: attention, then the dense or the mixture's FFN, each with its residual."""
        cfg, bb, p = self.cfg, self.bb, f"blk.{l}."
        h = self.norm(x, p + "attn_norm.weight")
        q, k, v = self.qkv(p, h, n)
        local = cfg.is_local(l)
        theta = cfg.rope_theta_local if local and cfg.rope_theta_local else cfg.rope_theta
        q, k = self.rope(q, pos, theta), self.rope(k, pos, theta)
        attn, pool = self.attention(l, q, k, v, pool, page_table, kv_lens, n, scale=cfg.attn_scale or None,
                                    window=cfg.sliding_window if local else 0)
        x = bb.emit(R.add(x, self.sublayer_out(self.linear(attn, p + "attn_output.weight"),
                                                p + "post_attention_norm.weight")))
        h = self.norm(x, p + "ffn_norm.weight")
        ffn = self.moe_ffn(p, h, n) if cfg.is_moe else self.gated_ffn(h, p + "ffn_{}.weight")
        x = bb.emit(R.add(x, self.sublayer_out(ffn, p + "post_ffw_norm.weight")))
        return x, pool
