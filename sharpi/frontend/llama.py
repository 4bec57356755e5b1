"""The llama family as Relax functions: `prefill` (logits of the last token), `prefill_logits` (logits of
every token, for score()), and `decode` (one token, static shapes).

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
from .gguf_file import GGUFFile
from .weights import WeightTable, load_weights

LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_VECTORS = ("attn_norm", "ffn_norm")


def llama_weights(gguf: GGUFFile, cfg: ModelConfig, show_progress: bool,
                  extra_layer_vectors: tuple[str, ...] = ()) -> WeightTable:
    """The llama weights; extra_layer_vectors are further per-layer f32 tensors by their name after `blk.N.`
    (e.g. "attn_q.bias")."""
    matrices = ["token_embd.weight"] + [f"blk.{l}.{m}.weight" for l in range(cfg.n_layers) for m in LAYER_MATRICES]
    if not cfg.tied_embeddings:
        matrices.append("output.weight")
    vectors = [f"blk.{l}.{v}.weight" for l in range(cfg.n_layers) for v in LAYER_VECTORS] + ["output_norm.weight"]
    vectors += [f"blk.{l}.{v}" for l in range(cfg.n_layers) for v in extra_layer_vectors]
    return load_weights(gguf, matrices, vectors, show_progress)


def tensor_type(shape, dtype):
    return relax.TensorType(shape, dtype)


class LlamaBuilder:
    def __init__(self, cfg: ModelConfig, weights: WeightTable, max_pages: int, page_size: int = ops.PAGE_SIZE,
                 kv_dtype: str = "float32"):
        self.cfg, self.weights, self.kv_dtype = cfg, weights, kv_dtype
        self.max_pages, self.page_size = max_pages, page_size
        self.bb = relax.BlockBuilder()

    def build(self) -> tvm.IRModule:
        self._function("prefill", tokens=None, all_logits=False)
        self._function("prefill_logits", tokens=None, all_logits=True)
        self._function("decode", tokens=1, all_logits=False)
        return self.bb.get()

    # -- function skeleton -------------------------------------------------------------------------------------
    def _function(self, name: str, tokens: int | None, all_logits: bool) -> None:
        cfg = self.cfg
        n = tvm.tirx.Var("n", "int64") if tokens is None else tokens
        pages = tvm.tirx.Var("pages", "int64")
        ids = relax.Var("ids", tensor_type((n,), "int32"))
        pos = relax.Var("pos", tensor_type((n,), "int32"))
        pool = relax.Var("pool", tensor_type((pages, 2, cfg.n_kv_heads, self.page_size, cfg.head_dim), self.kv_dtype))
        page_table = relax.Var("page_table", tensor_type((cfg.n_layers, self.max_pages), "int32"))
        kv_lens = relax.Var("kv_lens", tensor_type((cfg.n_layers,), "int32"))
        params = relax.Var("params", relax.TupleType([tensor_type(a.shape, str(a.dtype))
                                                      for a in self.weights.arrays]))
        bb = self.bb
        with bb.function(name, [ids, pos, pool, page_table, kv_lens, params], attrs={"num_input": 5}, pure=False):
            with bb.dataflow():
                self._params = params
                x = self._embedding(ids)
                for layer in range(cfg.n_layers):
                    x, pool = self._layer(layer, x, pos, pool, page_table, kv_lens, n)
                x = bb.emit(R.nn.rms_norm(x, self._vector("output_norm.weight"), axes=[-1], epsilon=cfg.rms_eps))
                if not all_logits:
                    x = bb.emit(R.strided_slice(x, axes=[0], begin=[n - 1], end=[n]))
                head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
                logits = bb.emit_output(self._linear(x, head))
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

    def _embedding(self, ids):
        return self.bb.emit(R.take(self._dequantize("token_embd.weight"), ids, axis=0))

    # -- one transformer block ------------------------------------------------------------------------------
    def _layer(self, l, x, pos, pool, page_table, kv_lens, n):
        cfg, bb, p = self.cfg, self.bb, f"blk.{l}."
        h = bb.emit(R.nn.rms_norm(x, self._vector(p + "attn_norm.weight"), axes=[-1], epsilon=cfg.rms_eps))
        q, k, v = self._qkv(p, h, n)
        q, k = self._rope(q, pos), self._rope(k, pos)
        attn, pool = self._attention(l, q, k, v, pool, page_table, kv_lens, n,
                                     window=cfg.sliding_window if cfg.is_local(l) else 0)
        x = bb.emit(R.add(x, self._linear(attn, p + "attn_output.weight")))
        h = bb.emit(R.nn.rms_norm(x, self._vector(p + "ffn_norm.weight"), axes=[-1], epsilon=cfg.rms_eps))
        gate, up = self._linear(h, p + "ffn_gate.weight"), self._linear(h, p + "ffn_up.weight")
        act = bb.emit(R.multiply(R.nn.silu(gate), up))
        x = bb.emit(R.add(x, self._linear(act, p + "ffn_down.weight")))
        return x, pool

    def _qkv(self, p: str, h, n):
        """Layer `p`'s ("blk.N.") q [n, H, D], k and v [n, KVH, D] from the normed input h, before RoPE."""
        cfg, bb = self.cfg, self.bb
        q = bb.emit(R.reshape(self._linear(h, p + "attn_q.weight"), (n, cfg.n_heads, cfg.head_dim)))
        k = bb.emit(R.reshape(self._linear(h, p + "attn_k.weight"), (n, cfg.n_kv_heads, cfg.head_dim)))
        v = bb.emit(R.reshape(self._linear(h, p + "attn_v.weight"), (n, cfg.n_kv_heads, cfg.head_dim)))
        return q, k, v

    def _attention(self, l, q, k, v, pool, page_table, kv_lens, n, scale: float | None = None, window: int = 0):
        """Append k and v to layer l's cache, attend; returns (attention output [n, q_dim], the pool)."""
        cfg, bb = self.cfg, self.bb
        layer = relax.prim_value(tvm.tirx.IntImm("int64", l))
        pool = bb.emit(relax.call_dps_packed(ops.KV_APPEND, [pool, k, v, page_table, kv_lens, layer], pool.ty))
        scale = relax.prim_value(tvm.tirx.FloatImm("float32", scale or 1.0 / math.sqrt(cfg.head_dim)))
        window = relax.prim_value(tvm.tirx.IntImm("int64", window))
        attn = bb.emit(relax.call_dps_packed(ops.PAGED_ATTENTION, [q, pool, page_table, kv_lens, layer, scale, window],
                                             tensor_type((n, cfg.n_heads, cfg.head_dim), "float32")))
        return bb.emit(R.reshape(attn, (n, cfg.q_dim))), pool

    def _rope(self, x, pos, theta: float | None = None):
        theta = relax.prim_value(tvm.tirx.FloatImm("float64", theta or self.cfg.rope_theta))
        return self.bb.emit(relax.call_dps_packed(ops.rope_op(self.cfg.rope_layout), [x, pos, theta],
                                                  x.ty))
