"""Gemma 3 as Relax functions, on the llama family's skeleton (same function signatures, cache and named ops).

What differs from llama (facts from llama.cpp's gemma3 graph, checked by sharpi.testing's reference against
llama.cpp's logits): embeddings times sqrt(dim); q and k RMS-normed per head before NEOX RoPE; local layers
(index % 6 != 5) attend within a sliding window with RoPE base 10000, global ones over everything with the GGUF's
base; queries scaled by 1/sqrt(head_dim); post-attention and post-FFN RMSNorms on each sublayer's output before
its residual add; FFN = down(gelu_tanh(gate(x)) * up(x)). RMSNorm weights are used as stored (the converter folded
Gemma's +1 into them).
"""
from __future__ import annotations

from tvm import relax
from tvm.relax import op as R

from ..common.config import ModelConfig
from .gguf_file import GGUFFile
from .llama import LAYER_MATRICES, LlamaBuilder
from .weights import WeightTable, load_weights

LAYER_VECTORS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


def gemma3_weights(gguf: GGUFFile, cfg: ModelConfig, show_progress: bool) -> WeightTable:
    matrices = ["token_embd.weight"] + [f"blk.{l}.{m}.weight" for l in range(cfg.n_layers) for m in LAYER_MATRICES]
    if not cfg.tied_embeddings:
        matrices.append("output.weight")
    vectors = [f"blk.{l}.{v}.weight" for l in range(cfg.n_layers) for v in LAYER_VECTORS] + ["output_norm.weight"]
    return load_weights(gguf, matrices, vectors, show_progress)


class Gemma3Builder(LlamaBuilder):
    def _embedding(self, ids):
        x = super()._embedding(ids)
        return self.bb.emit(R.multiply(x, relax.const(self.cfg.embed_scale, "float32")))

    def _norm(self, x, name: str):
        return self.bb.emit(R.nn.rms_norm(x, self._vector(name), axes=[-1], epsilon=self.cfg.rms_eps))

    def _layer(self, l, x, pos, pool, page_table, kv_lens, n):
        cfg, bb, p = self.cfg, self.bb, f"blk.{l}."
        h = self._norm(x, p + "attn_norm.weight")
        q = bb.emit(R.reshape(self._linear(h, p + "attn_q.weight"), (n, cfg.n_heads, cfg.head_dim)))
        k = bb.emit(R.reshape(self._linear(h, p + "attn_k.weight"), (n, cfg.n_kv_heads, cfg.head_dim)))
        v = bb.emit(R.reshape(self._linear(h, p + "attn_v.weight"), (n, cfg.n_kv_heads, cfg.head_dim)))
        q, k = self._norm(q, p + "attn_q_norm.weight"), self._norm(k, p + "attn_k_norm.weight")
        local = cfg.is_local(l)
        theta = cfg.rope_theta_local if local else cfg.rope_theta
        q, k = self._rope(q, pos, theta), self._rope(k, pos, theta)
        attn, pool = self._attention(l, q, k, v, pool, page_table, kv_lens, n, scale=cfg.attn_scale,
                                     window=cfg.sliding_window if local else 0)
        out = self._linear(attn, p + "attn_output.weight")
        x = bb.emit(R.add(x, self._norm(out, p + "post_attention_norm.weight")))
        h = self._norm(x, p + "ffn_norm.weight")
        gate, up = self._linear(h, p + "ffn_gate.weight"), self._linear(h, p + "ffn_up.weight")
        act = bb.emit(R.multiply(R.nn.gelu_tanh(gate), up))
        down = self._linear(act, p + "ffn_down.weight")
        return bb.emit(R.add(x, self._norm(down, p + "post_ffw_norm.weight"))), pool
