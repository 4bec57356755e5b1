"""The Qwen hybrid linear-attention family (qwen35, qwen35moe, qwen3next; llama.cpp's src/models/<arch>.cpp) as
Relax functions: the llama family's `prefill`, `prefill_logits`, `decode` and `decode_batch`, whose layers are
Gated DeltaNet layers (a recurrent state per sequence) or gated attention layers (a KV cache), and `state_copy`.

A DeltaNet layer keeps no pages: its conv window and delta-rule matrices live in a state pool beside the KV pool
(sharpi.common.ops' delta ops), one slot per sequence. The KV pool's page tables and lengths cover the attention
layers only, in order, so the attention blocks, SnapKV and the runtime's KV bookkeeping see a model of
cfg.kv_layers layers. Every forward function takes two inputs more than the llama family's, after the KV ones:

    (ids [n], pos [n], pool, page_table [L_kv, MP], kv_lens [L_kv], states [S, R, W] f32, slots [n] int32, params)

`slots[t]` is token t's sequence's slot (a prompt's tokens all name one; decode_batch's one each). The layer:
x + mixer(attn_norm(x)), then x + ffn(post_attention_norm(x)), the FFN dense (qwen35) or a mixture of experts
with a sigmoid-gated shared expert (qwen35moe, qwen3next).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import op as R

from ...common import ops
from ...common.config import ModelConfig
from ..blocks import tensor_type
from ..gguf_file import GGUFFile
from ..weights import WeightTable, load_weights
from .llama import LlamaBuilder, MOE_MATRICES, SHARED_EXPERT_MATRICES

ATTENTION_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output")
ATTENTION_VECTORS = ("attn_q_norm.weight", "attn_k_norm.weight")
DELTA_MATRICES = ("attn_qkv", "attn_gate", "ssm_out")
DELTA_VECTORS = ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight")
DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")


def hybrid_weights(gguf: GGUFFile, cfg: ModelConfig, show_progress: bool) -> WeightTable:
    """The weights the hybrid graph takes, in the order of its parameters; the MTP blocks are not read."""
    matrices, vectors = ["token_embd.weight"], []
    for l in range(cfg.n_layers):
        p = f"blk.{l}."
        if cfg.is_recurrent(l):
            mixer = DELTA_MATRICES + (("ssm_ba",) if cfg.ssm_fused_ba else ("ssm_beta", "ssm_alpha"))
            vectors += [p + v for v in DELTA_VECTORS]
        else:
            mixer = ATTENTION_MATRICES
            vectors += [p + v for v in ATTENTION_VECTORS]
        ffn = MOE_MATRICES + SHARED_EXPERT_MATRICES if cfg.is_moe else DENSE_FFN
        matrices += [f"{p}{m}.weight" for m in mixer + ffn]
        vectors += [p + "attn_norm.weight", p + "post_attention_norm.weight"]
        if cfg.is_moe:
            vectors.append(p + "ffn_gate_inp_shexp.weight")
    if not cfg.tied_embeddings:
        matrices.append("output.weight")
    vectors.append("output_norm.weight")
    return load_weights(gguf, matrices, vectors, show_progress)


class HybridBuilder(LlamaBuilder):
    def build(self) -> tvm.IRModule:
        super().build()
        self._state_copy()
        return self.bb.get()

    def _function(self, name: str, tokens: int | None, all_logits: bool, batched: bool = False) -> None:
        cfg, bb = self.cfg, self.bb
        n, (ids, pos, pool, page_table, kv_lens), params = self._inputs(tokens, batched)
        states = relax.Var("states", self._states_type())
        slots = relax.Var("slots", tensor_type((n,), "int32"))
        with bb.function(name, [ids, pos, pool, page_table, kv_lens, states, slots, params],
                         attrs={"num_input": 7}, pure=False):
            with bb.dataflow():
                self.params = params
                x = self.embedding(ids)
                for l in range(cfg.n_layers):
                    p = f"blk.{l}."
                    h = self.norm(x, p + "attn_norm.weight")
                    if cfg.is_recurrent(l):
                        out, states = self.delta_net(p, h, n, states, slots, cfg.recurrent_layers.index(l))
                    else:
                        out, pool = self._gated_attention(l, h, pos, pool, page_table, kv_lens, n)
                    x = bb.emit(R.add(x, out))
                    h = self.norm(x, p + "post_attention_norm.weight")
                    ffn = self.moe_ffn(p, h, n) if cfg.is_moe else self.gated_ffn(h, p + "ffn_{}.weight")
                    x = bb.emit(R.add(x, ffn))
                logits = bb.emit_output(self._head(x, n, all_logits))
            bb.emit_func_output(logits)

    def _gated_attention(self, l, h, pos, pool, page_table, kv_lens, n):
        """qwen35's build_layer_attn: per-head normed q and k, partial RoPE, attention over the KV cache (the
        layer's index among the attention layers), its output times sigmoid(gate), through attn_output."""
        cfg, bb, p = self.cfg, self.bb, f"blk.{l}."
        q, gate, k, v = self.qkv_gated(p, h, n)
        q, k = self.rope(q, pos), self.rope(k, pos)
        attn, pool = self.attention(cfg.attention_layers.index(l), q, k, v, pool, page_table, kv_lens, n,
                                    scale=cfg.attn_scale or None)
        attn = bb.emit(R.multiply(attn, R.sigmoid(gate)))
        return self.linear(attn, p + "attn_output.weight"), pool

    def _states_type(self):
        cfg = self.cfg
        return tensor_type((tvm.tirx.Var("slots", "int64"), len(cfg.recurrent_layers), cfg.ssm_state_width), "float32")

    def _state_copy(self) -> None:
        """state_copy(states, pair [2] int32) -> states: a fork's state, or a new sequence's (from slot 0)."""
        states = relax.Var("states", self._states_type())
        pair = relax.Var("pair", tensor_type((2,), "int32"))
        with self.bb.function("state_copy", [states, pair], attrs={"num_input": 2}, pure=False):
            with self.bb.dataflow():
                out = self.bb.emit_output(relax.call_dps_packed(ops.STATE_COPY, [states, pair], states.ty))
            self.bb.emit_func_output(out)
