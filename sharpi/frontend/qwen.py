"""Qwen 2 and Qwen 3 as Relax functions, on the llama family's skeleton (same function signatures, cache and named
ops; the config's rope_layout is NEOX for both, as llama.cpp's llama_model_rope_type says).

What differs from llama (llama.cpp's src/models/qwen2.cpp and qwen3.cpp):
- qwen2: the q, k and v projections add a bias (blk.N.attn_{q,k,v}.bias) before the reshape into heads.
- qwen3: no biases; q and k are RMS-normed per head (blk.N.attn_{q,k}_norm.weight, [head_dim], the model's
  rms epsilon) before RoPE; head_dim is the GGUF's key_length, which may differ from dim / heads.
Queries are scaled by 1/sqrt(head_dim) in both, as in llama.
"""
from __future__ import annotations

from tvm.relax import op as R

from ..common.config import ModelConfig
from .gguf_file import GGUFFile
from .llama import LlamaBuilder, llama_weights
from .weights import WeightTable

QWEN2_LAYER_VECTORS = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
QWEN3_LAYER_VECTORS = ("attn_q_norm.weight", "attn_k_norm.weight")


def qwen2_weights(gguf: GGUFFile, cfg: ModelConfig, show_progress: bool) -> WeightTable:
    return llama_weights(gguf, cfg, show_progress, extra_layer_vectors=QWEN2_LAYER_VECTORS)


def qwen3_weights(gguf: GGUFFile, cfg: ModelConfig, show_progress: bool) -> WeightTable:
    return llama_weights(gguf, cfg, show_progress, extra_layer_vectors=QWEN3_LAYER_VECTORS)


class Qwen2Builder(LlamaBuilder):
    def _qkv(self, p: str, h, n):
        cfg, bb = self.cfg, self.bb

        def project(name, heads):
            y = bb.emit(R.add(self._linear(h, p + f"{name}.weight"), self._vector(p + f"{name}.bias")))
            return bb.emit(R.reshape(y, (n, heads, cfg.head_dim)))

        return project("attn_q", cfg.n_heads), project("attn_k", cfg.n_kv_heads), project("attn_v", cfg.n_kv_heads)


class Qwen3Builder(LlamaBuilder):
    def _qkv(self, p: str, h, n):
        q, k, v = super()._qkv(p, h, n)
        eps = self.cfg.rms_eps
        q = self.bb.emit(R.nn.rms_norm(q, self._vector(p + "attn_q_norm.weight"), axes=[-1], epsilon=eps))
        k = self.bb.emit(R.nn.rms_norm(k, self._vector(p + "attn_k_norm.weight"), axes=[-1], epsilon=eps))
        return q, k, v
