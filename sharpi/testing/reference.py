"""The exact float32 numpy forward pass for the llama family, gemma3 and the mixtures of experts (olmoe, qwen2moe,
qwen3moe, granitemoe): an independent reference for sharpi's kernels.

Weights come from `gguf.quants.dequantize` (not from sharpi's repacking), attention is materialized in full,
so nothing here shares code with the compiled path except the GGUF reader. One graph, as the frontend's, whose
variants are the config's flags: `qkv_bias` (qwen2), `qk_norm` (qwen3, gemma3), `rope_layout`, `post_norms` and
`ffn_activation` (gemma3), `embed_scale`, `attn_scale`, and sliding-window layers (`sliding_window`, `swa_pattern`,
`rope_theta_local`: a mistral-style llama's every layer, gemma3's local ones), the FFN's blocks (`gated_ffn`,
`moe_ffn` with `n_experts_used`, `expert_weights_norm`, a shared expert), `qk_norm_full` (olmoe) and Granite's
`residual_scale` and `logit_scale`. The config comes from
`config_from_gguf`, except Gemma 3's, which `_gemma3_config` reads here on its own from the GGUF's metadata.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..common.config import ModelConfig
from ..common.errors import GGUFError
from ..common import kv_codecs
from ..common.kv_format import key_offset_for
from ..common.ops import PAGE_SIZE
# Gemma 3's layer pattern and local RoPE base are constants llama.cpp hard-codes rather than reads from the GGUF
from ..frontend.config import GEMMA3_LOCAL_ROPE_BASE, GEMMA3_SWA_PATTERN, config_from_gguf
from ..frontend.gguf_file import GGUFFile


class NumpyReference:
    """Exact float32 forward pass. `sliding_window` (from the GGUF; 0: none) may be reassigned on an instance, e.g.
    to a tiny value in a test: a query of a local layer at position p sees keys p - sliding_window + 1 .. p. So
    may `config` (e.g. `dataclasses.replace(ref.config, qkv_bias=False)`, to see what a flag changes), and
    `kv_types` (keys', values' types of sharpi.common.kv_format; None: float32): attention then reads keys and
    values rounded as a KV cache of those types stores them (the emulation a quantized cache is held to)."""

    def __init__(self, gguf_path: str | Path):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        gguf = GGUFFile(gguf_path)
        self.arch = gguf.architecture
        # Gemma 3's config is read here on its own (not through the frontend's mapping), so that the reference
        # checks that mapping too; both drive the same flags of one graph
        self.config: ModelConfig = _gemma3_config(gguf) if self.arch == "gemma3" else config_from_gguf(gguf)
        cfg = self.config
        self.sliding_window = cfg.sliding_window
        self.swa_pattern = cfg.swa_pattern
        self.kv_types: tuple[str, str] | None = None
        self.router_capture: list | None = None          # a list: each MoE layer's router probabilities [T, E]
        # parts of a hybrid left out, to show that each moves the logits: "q_gate", "conv", "decay", "head_map"
        self.left_out: frozenset = frozenset()
        self.page_size = PAGE_SIZE                      # how page-scaled keys are grouped (kv_roundtrip)
        self.local_rope_theta = cfg.rope_theta_local   # 0: local layers keep the model's RoPE base
        self.embed_scale = np.float32(cfg.embed_scale)
        self.attn_scale = cfg.attn_scale or None
        # Linear RoPE scaling (the larger Gemma 3 models) applies to the global layers only; none on 270M.
        md = gguf.metadata
        factor = md.get(f"{self.arch}.rope.scaling.factor")
        linear = md.get(f"{self.arch}.rope.scaling.type", "linear" if factor else "none") == "linear"
        self.global_pos_scale = 1.0 / float(factor) if (factor and linear) else 1.0
        self.weights = {name: _dequantize(t, GGMLQuantizationType(t.type_id), dequantize)
                        for name, t in gguf.tensors.items()}

    def is_local(self, l: int) -> bool:
        """Whether layer l uses sliding-window attention (gemma3's local layers; every layer of a llama with a
        window; none without one)."""
        if not self.sliding_window:
            return False
        return not self.swa_pattern or l % self.swa_pattern != self.swa_pattern - 1

    def forward(self, ids, positions=None, capture: list | None = None, states: dict | None = None) -> np.ndarray:
        """Logits [len(ids), vocab] for a fresh sequence (causal attention over ids; for local layers also within
        the sliding window).

        With `capture` (a list), each attention layer's post-RoPE (q [T, H, D], k [T, KVH, D], v [T, KVH, D]) is
        appended (after any biases and per-head q/k norms, before any query scaling); a hybrid's DeltaNet layers
        append nothing. With `states` (a dict), each DeltaNet layer's state after the last token is stored under
        its layer index."""
        cfg = self.config
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos = np.arange(T) if positions is None else np.asarray(positions)
        x = self._embed(ids)
        visible = np.tril(np.ones((T, T), dtype=bool))
        masks = {}
        for l in range(cfg.n_layers):
            if cfg.is_recurrent(l):
                out, state = self.delta_net(l, x, self.empty_state())
                if states is not None:
                    states[l] = state
                x = self._after_mixer(l, x, out)
                continue
            q, k, v = self._qkv(l, x, pos)
            k, v = self._as_cached(l, k, v)
            if capture is not None:
                capture.append((q, k, v))
            local = self.is_local(l)
            if local not in masks:
                masks[local] = visible & self._window(l, pos, pos)
            x = self._finish_layer(l, x, _attention(q, k, v, masks[local], self._scale()))
        return self._logits(x)

    def attend(self, l: int, q, k, v, q_pos, k_pos) -> np.ndarray:
        """Layer l's attention of q [T, H, D] at q_pos over k/v [S, KVH, D] at k_pos, with its causal and (for
        a local layer) sliding-window masks -> [T, H, D]."""
        q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
        visible = (k_pos[None, :] <= q_pos[:, None]) & self._window(l, q_pos, k_pos)
        return _attention(q, k, v, visible, self._scale())

    def decode_after_compaction(self, prompt_ids, kept_positions: list[np.ndarray], token: int,
                                position: int | None = None) -> np.ndarray:
        """Logits [vocab] of `token` fed after prompt_ids whose cache kept, per attention layer and KV head, only
        the slots of kept_positions ([KVH, k] logical positions; a hybrid's DeltaNet layers keep their state): the
        new token is at position len(prompt_ids) (or `position`, to model a wrong implementation) and attends over
        the kept keys/values (RoPE'd at their original positions) and itself (and, on local layers, only those
        inside the sliding window)."""
        cfg = self.config
        captured, states = [], {}
        self.forward(prompt_ids, capture=captured, states=states)
        n = len(prompt_ids) if position is None else position
        x = self._embed(np.array([token]))
        rep = cfg.n_heads // cfg.n_kv_heads
        for l in range(cfg.n_layers):
            if cfg.is_recurrent(l):                    # the state is never evicted
                x = self._after_mixer(l, x, self.delta_net(l, x, states[l])[0])
                continue
            q, k, v = self._qkv(l, x, np.array([n]))
            k, v = self._as_cached(l, k, v)
            a = cfg.attention_layers.index(l)
            _, pk, pv = captured[a]
            out = np.empty((1, cfg.n_heads, cfg.head_dim), np.float32)
            for kvh in range(cfg.n_kv_heads):
                keep = kept_positions[a][kvh]
                keys = np.concatenate([pk[keep, kvh], k[:, kvh]])[:, None]
                values = np.concatenate([pv[keep, kvh], v[:, kvh]])[:, None]
                heads = slice(kvh * rep, (kvh + 1) * rep)
                visible = self._window(l, np.array([n]), np.concatenate([np.asarray(keep), [n]]))
                out[:, heads] = _attention(q[:, heads], keys, values, visible, self._scale())
            x = self._finish_layer(l, x, out)
        return self._logits(x)[0]

    def _as_cached(self, l, k, v):
        """Layer l's k, v [T, KVH, D] as the KV cache holds them (kv_types): quantized keys rounded as stored,
        minus the layer's key offset where the model has one (kv_format.key_offset_for), and read back plus it."""
        if self.kv_types is None:
            return k, v
        key_type, value_type = self.kv_types
        c = self.cache_offset(l, k.shape[1:])
        return kv_roundtrip(key_type, k - c, self.page_size) + c, kv_roundtrip(value_type, v)

    def cache_offset(self, l: int, shape) -> np.ndarray:
        """The vector layer l's cached keys are stored minus (kv_format.key_offset_for), or 0."""
        offset = key_offset_for(self.kv_types[0], self.config.qkv_bias) if self.kv_types else None
        return self.weights[f"blk.{l}.{offset}"].reshape(shape) if offset else np.float32(0)

    # -- the two graphs --------------------------------------------------------------------------------------

    def _embed(self, ids):
        x = self.weights["token_embd.weight"][ids]
        return (x * self.embed_scale).astype(np.float32) if self.embed_scale != 1 else x

    def _scale(self):
        return self.attn_scale

    def _window(self, l, q_pos, k_pos):
        """[Tq, Tk] bool: True where the sliding window (if layer l has one) lets q_pos see k_pos."""
        q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
        if not self.is_local(l):
            return np.ones((len(q_pos), len(k_pos)), dtype=bool)
        return (q_pos[:, None] - k_pos[None, :]) < self.sliding_window

    def _qkv(self, l, x, pos):
        cfg, W, p = self.config, self.weights, f"blk.{l}."
        T, hd = x.shape[0], cfg.head_dim
        h = rms_norm(x, W[p + "attn_norm.weight"], cfg.rms_eps)
        q, k, v = (h @ W[p + "attn_q.weight"].T, h @ W[p + "attn_k.weight"].T, h @ W[p + "attn_v.weight"].T)
        if cfg.attn_q_gate:                                # qwen35, qwen3next: each head's queries, then its gate
            q = q.reshape(T, cfg.n_heads, 2, hd)[:, :, 0].reshape(T, cfg.q_dim)
        if cfg.qkv_bias:                                   # qwen2
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        if cfg.qk_norm and cfg.qk_norm_full:               # olmoe: over the whole projection, before the heads
            q = rms_norm(q, W[p + "attn_q_norm.weight"], cfg.rms_eps)
            k = rms_norm(k, W[p + "attn_k_norm.weight"], cfg.rms_eps)
        q = q.reshape(T, cfg.n_heads, hd)
        k, v = k.reshape(T, cfg.n_kv_heads, hd), v.reshape(T, cfg.n_kv_heads, hd)
        if cfg.qk_norm and not cfg.qk_norm_full:           # qwen3, gemma3: per head, before RoPE
            q = rms_norm(q, W[p + "attn_q_norm.weight"].reshape(-1, hd), cfg.rms_eps)
            k = rms_norm(k, W[p + "attn_k_norm.weight"].reshape(-1, hd), cfg.rms_eps)
        rope, theta, pos_scale = self.rope_for(l)
        rpos = np.asarray(pos) * pos_scale
        return rope(q, rpos, theta), rope(k, rpos, theta), v

    def _q_gate(self, l, x):
        """Layer l's attention gate [T, q_dim] (attn_q_gate): the second half of each head's q projection."""
        cfg, W, p = self.config, self.weights, f"blk.{l}."
        h = rms_norm(x, W[p + "attn_norm.weight"], cfg.rms_eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(len(x), cfg.n_heads, 2, cfg.head_dim)
        return q[:, :, 1].reshape(len(x), cfg.q_dim)

    def rope_for(self, l: int):
        """Layer l's RoPE as (rope function, base, position scale): a position p rotates as rope(x, p * scale, base)."""
        rope = rope_neox if self.config.rope_layout == "neox" else rope_adjacent
        if self.config.rotary_dim < self.config.head_dim:
            rope = _partial(rope, self.config.rotary_dim)
        if self.is_local(l):
            return rope, self.local_rope_theta or self.config.rope_theta, 1.0
        return rope, self.config.rope_theta, self.global_pos_scale

    def _finish_layer(self, l, x, attn):
        """The attention's output projection (gated by sigmoid of the q projection's gate where the model has
        one) and the gated FFN, each joining the residual (RMS-normed first with post_norms)."""
        cfg, W, p = self.config, self.weights, f"blk.{l}."
        out = attn.reshape(x.shape[0], cfg.q_dim)
        if cfg.attn_q_gate and "q_gate" not in self.left_out:
            out = out * sigmoid(self._q_gate(l, x))
        return self._after_mixer(l, x, out @ W[p + "attn_output.weight"].T)

    def _after_mixer(self, l, x, out):
        """The mixer's (attention's or DeltaNet's) projected output joining the residual, then the FFN. A hybrid's
        pre-FFN norm is its post_attention_norm."""
        cfg, W, p = self.config, self.weights, f"blk.{l}."

        def joined(out, post_norm):
            out = rms_norm(out, W[p + post_norm], cfg.rms_eps) if cfg.post_norms else out
            return out * np.float32(cfg.residual_scale) if cfg.residual_scale != 1 else out

        x = x + joined(out, "post_attention_norm.weight")
        ffn_norm = "post_attention_norm.weight" if cfg.is_hybrid else "ffn_norm.weight"
        h = rms_norm(x, W[p + ffn_norm], cfg.rms_eps)
        return x + joined(self._ffn(l, h), "post_ffw_norm.weight")

    # -- Gated DeltaNet (hybrid models) ----------------------------------------------------------------------

    def empty_state(self) -> "DeltaState":
        cfg = self.config
        d = cfg.ssm_state_size
        return DeltaState(np.zeros((cfg.ssm_conv_kernel - 1, cfg.ssm_conv_channels), np.float32),
                          np.zeros((cfg.ssm_v_heads, d, d), np.float32))

    def delta_net(self, l, x, state: "DeltaState"):
        """Layer l's Gated DeltaNet over x [T, dim] from `state` -> (its projected output [T, dim], the state
        after the last token), as llama.cpp's qwen35/qwen3next build_layer_attn_linear computes it, one token at a
        time (its sequential form)."""
        cfg, W, p = self.config, self.weights, f"blk.{l}."
        T, d, Hk, Hv = len(x), cfg.ssm_state_size, cfg.ssm_k_heads, cfg.ssm_v_heads
        h = rms_norm(x, W[p + "attn_norm.weight"], cfg.rms_eps)
        mixed = h @ W[p + "attn_qkv.weight"].T                                   # [T, C]: q, k, v
        z = (h @ W[p + "attn_gate.weight"].T).reshape(T, Hv, d)
        if cfg.ssm_fused_ba:                    # qwen3next: per k-head, its v-heads' betas then their alphas
            ba = (h @ W[p + "ssm_ba.weight"].T).reshape(T, Hk, 2, Hv // Hk)
            b, a = ba[:, :, 0].reshape(T, Hv), ba[:, :, 1].reshape(T, Hv)
        else:
            b, a = h @ W[p + "ssm_beta.weight"].T, h @ W[p + "ssm_alpha.weight"].T
        beta = sigmoid(b)
        g = softplus(a + W[p + "ssm_dt.bias"]) * W[p + "ssm_a"]                  # log of the decay, <= 0
        if "decay" in self.left_out:
            g = np.zeros_like(g)
        window = np.concatenate([state.conv, mixed])                             # [K - 1 + T, C]
        if "conv" in self.left_out:
            conv = mixed
        else:
            conv = causal_conv(window, W[p + "ssm_conv1d.weight"])
        conv = silu(conv).astype(np.float32)
        q = l2_norm(conv[:, :Hk * d].reshape(T, Hk, d), cfg.rms_eps)
        k = l2_norm(conv[:, Hk * d:2 * Hk * d].reshape(T, Hk, d), cfg.rms_eps)
        v = conv[:, 2 * Hk * d:].reshape(T, Hv, d)
        heads = np.arange(Hv)
        if "head_map" in self.left_out:          # the other architecture's mapping
            k_head = heads % Hk if cfg.ssm_head_map == "grouped" else heads // (Hv // Hk)
        else:
            k_head = heads // (Hv // Hk) if cfg.ssm_head_map == "grouped" else heads % Hk
        out, matrix = delta_rule(q[:, k_head], k[:, k_head], v, g, beta, state.matrix)
        out = rms_norm(out, W[p + "ssm_norm.weight"], cfg.rms_eps) * silu(z)
        new_state = DeltaState(window[len(window) - (cfg.ssm_conv_kernel - 1):].copy(), matrix)
        return (out.reshape(T, Hv * d).astype(np.float32) @ W[p + "ssm_out.weight"].T), new_state

    def _ffn(self, l, h):
        """Layer l's FFN of the normed h [T, dim]: the dense gated FFN, or the mixture of experts (plus a shared
        expert where the model has one)."""
        cfg, W, p = self.config, self.weights, f"blk.{l}."
        act = gelu_tanh if cfg.ffn_activation == "gelu_tanh" else silu
        if not cfg.is_moe:
            return gated_ffn(h, W[p + "ffn_gate.weight"], W[p + "ffn_up.weight"], W[p + "ffn_down.weight"], act)
        out, probs = moe_ffn(h, W[p + "ffn_gate_inp.weight"], W[p + "ffn_gate_exps.weight"],
                             W[p + "ffn_up_exps.weight"], W[p + "ffn_down_exps.weight"], cfg.n_experts_used,
                             cfg.expert_weights_norm, act)
        if self.router_capture is not None:
            self.router_capture.append(probs)
        if cfg.shared_expert_ffn_dim:                   # qwen2moe
            shared = gated_ffn(h, W[p + "ffn_gate_shexp.weight"], W[p + "ffn_up_shexp.weight"],
                               W[p + "ffn_down_shexp.weight"], act)
            out = out + shared * sigmoid(h @ W[p + "ffn_gate_inp_shexp.weight"])[:, None]
        return out

    def _logits(self, x):
        W = self.weights
        x = rms_norm(x, W["output_norm.weight"], self.config.rms_eps)
        logits = x @ W.get("output.weight", W["token_embd.weight"]).T
        if self.config.logit_scale != 1:             # granite
            logits = logits / np.float32(self.config.logit_scale)
        return logits.astype(np.float32)


def _dequantize(t, qtype, dequantize, rows_per_chunk: int = 16384) -> np.ndarray:
    """float32 array of t.shape; a large matrix (gemma3's 262144-row embedding) is dequantized a block of rows at
    a time into one preallocated array, which keeps the peak memory near the result's own size (quant blocks
    never span rows, so the values are those of one whole-tensor call)."""
    if len(t.shape) < 2 or t.shape[0] <= rows_per_chunk or t.data.shape[0] != t.shape[0]:
        return np.asarray(dequantize(t.data, qtype), dtype=np.float32).reshape(t.shape)
    out = np.empty(t.shape, dtype=np.float32)
    for i in range(0, t.shape[0], rows_per_chunk):
        rows = out[i:i + rows_per_chunk]
        rows[...] = np.asarray(dequantize(t.data[i:i + rows_per_chunk], qtype), dtype=np.float32).reshape(rows.shape)
    return out


def _gemma3_config(gguf: GGUFFile) -> ModelConfig:
    """Gemma 3's shape from its GGUF metadata. RMSNorm weights are used as stored (the converter folds Gemma's
    +1 into them); the output is tied to token_embd unless output.weight exists."""
    def get(key, default=None):
        full = f"gemma3.{key}"
        if full in gguf.metadata:
            return gguf.metadata[full]
        if default is None:
            raise GGUFError(f"{gguf.path.name} lacks the metadata field {full}.")
        return default

    n_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    head_dim = int(get("attention.key_length"))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{gguf.path.name}: key and value head sizes differ.")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if f"gemma3.{key}" in gguf.metadata:
            raise GGUFError(f"{gguf.path.name}: gemma3.{key} is set; the reference does no soft-capping.")
    n_layers = int(get("block_count"))
    # llama.cpp's f_attention_scale: 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(dim/heads).
    attn_scale = (dim / n_heads if n_layers == 62 else head_dim) ** -0.5
    return ModelConfig(
        arch="gemma3", n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)), head_dim=head_dim, dim=dim,
        ffn_dim=int(get("feed_forward_length")), vocab_size=int(gguf.tensor("token_embd.weight").shape[0]),
        context_length=int(get("context_length")), rope_theta=float(get("rope.freq_base", 1000000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")), rope_layout="neox", qk_norm=True,
        tied_embeddings="output.weight" not in gguf.tensors,
        sliding_window=int(gguf.require("gemma3.attention.sliding_window")), swa_pattern=GEMMA3_SWA_PATTERN,
        rope_theta_local=GEMMA3_LOCAL_ROPE_BASE, attn_scale=attn_scale,
        embed_scale=float(np.sqrt(np.float32(dim))), post_norms=True, ffn_activation="gelu_tanh")


def _attention(q, k, v, visible, scale=None):
    """q [T, H, D], k/v [S, KVH, D] (KVH divides H), visible [T, S] -> [T, H, D]; scores times `scale`
    (default 1/sqrt(D))."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    if scale is None:
        s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(q.shape[-1]))
    else:
        s = np.einsum("thd,shd->hts", q, k) * np.float32(scale)
    s = np.where(visible[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", s, v).astype(np.float32)


def rms_norm(x, w, eps):
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * w).astype(np.float32)


def gated_ffn(h, gate, up, down, act):
    """act(h gate^T) * (h up^T), times down^T: the gated FFN (SwiGLU, GeGLU) of h [T, dim]."""
    return (act(h @ gate.T) * (h @ up.T)) @ down.T


def moe_ffn(h, router, gate_exps, up_exps, down_exps, k: int, normalize: bool, act=None):
    """llama.cpp's build_moe_ffn for h [T, dim] -> (out [T, dim], router probabilities [T, E]): softmax over
    all E experts of h router^T; the k most probable experts (ties: the lower index); their probabilities as
    weights, divided by their sum (at least 2^-14) when `normalize`; the weighted sum of their gated FFNs
    (experts [E, rows, cols])."""
    act = act or silu
    logits = h @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    if normalize:
        weights = weights / np.maximum(weights.sum(-1, keepdims=True), np.float32(6.103515625e-5))
    out = np.zeros_like(h)
    for t in range(len(h)):
        for e, w in zip(chosen[t], weights[t]):
            out[t] += w * gated_ffn(h[t:t + 1], gate_exps[e], up_exps[e], down_exps[e], act)[0]
    return out, probs


class DeltaState(NamedTuple):
    """One sequence's state in one Gated DeltaNet layer: the conv's last K - 1 inputs [K - 1, C] and the delta
    rule's matrix per v-head [H_v, d_k, d_v]."""
    conv: np.ndarray
    matrix: np.ndarray


def causal_conv(window, weight):
    """Depthwise causal conv (ggml_ssm_conv): window [K - 1 + T, C] (the state's K - 1 inputs, then T new ones),
    weight [C, K] -> [T, C]; output t is sum_w window[t + w] * weight[:, w]."""
    K = weight.shape[1]
    T = len(window) - (K - 1)
    return sum(window[w:w + T] * weight[:, w] for w in range(K)).astype(np.float32)


def l2_norm(x, eps):
    """x / sqrt(sum x^2 + eps) over the last axis: llama.cpp's build_gdn_l2_norm (an RMS norm with eps / n,
    scaled by 1 / sqrt(n))."""
    return (x / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(eps))).astype(np.float32)


def delta_rule(q, k, v, g, beta, matrix):
    """The gated delta rule, one token at a time (ggml_gated_delta_net): q, k [T, H, d_k] (L2-normed), v [T, H,
    d_v], g and beta [T, H], matrix [H, d_k, d_v] (not changed) -> (out [T, H, d_v], the matrix after the last
    token). Per token and head: S <- exp(g) S; d = beta (v - S^T k); S <- S + k d^T; out = S^T q / sqrt(d_k)."""
    S = matrix.astype(np.float32).copy()
    out = np.empty(v.shape, np.float32)
    scale = np.float32(1 / np.sqrt(q.shape[-1]))
    for t in range(len(q)):
        S *= np.exp(g[t]).astype(np.float32)[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hij,hi->hj", S, k[t]))
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, q[t]) * scale
    return out, S


def softplus(x):
    """log(1 + e^x), as ggml_softplus (x itself above 20)."""
    x = np.asarray(x, np.float32)
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    """GELU, tanh approximation (gemma's gelu_pytorch_tanh; llama.cpp's ggml_gelu)."""
    x = np.asarray(x, dtype=np.float32)
    c = np.float32(np.sqrt(2.0 / np.pi))
    return (np.float32(0.5) * x * (1 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))).astype(np.float32)


def _rope_angles(pos, D, theta):
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.asarray(pos)[:, None].astype(np.float64) * inv[None, :]
    return np.cos(ang)[:, None, :].astype(np.float32), np.sin(ang)[:, None, :].astype(np.float32)


def rope_adjacent(x, pos, theta):
    """RoPE with llama.cpp's NORM layout (rotate adjacent pairs); x: [T, H, D]."""
    c, s = _rope_angles(pos, x.shape[-1], theta)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def _partial(rope, rotary_dim: int):
    """`rope` over the first rotary_dim of each head, the rest as it is (llama.cpp's n_rot < head size)."""
    def turned(x, pos, theta):
        out = x.copy()
        out[..., :rotary_dim] = rope(x[..., :rotary_dim], pos, theta)
        return out
    return turned


def rope_neox(x, pos, theta):
    """RoPE with llama.cpp's NEOX layout (rotate pairs (i, i + D/2)); x: [T, H, D]."""
    D = x.shape[-1]
    c, s = _rope_angles(pos, D, theta)
    x0, x1 = x[..., : D // 2], x[..., D // 2:]
    out = np.empty_like(x)
    out[..., : D // 2] = x0 * c - x1 * s
    out[..., D // 2:] = x0 * s + x1 * c
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def quantize_activations_q8(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_0 on float32 rows as its x86 AVX2 path computes it: per block of 32, d = max|x| / 127
    and q = x * (1 / d) rounded to nearest, halves to even (the scalar reference's roundf sends halves away from zero;
    an exact half does occur, about once in 10^5 values); an all-zero block gets d = 0, q = 0. Returns (q int8
    [..., K], d float32 [..., K / 32]): what sharpi's integer-dot matmuls (and llama.cpp's CPU matmuls) multiply the
    weights with."""
    xb = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, block)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d > 0)
    v = xb * inv[..., None]
    q = np.rint(v).astype(np.int8)   # halves to even, as the kernels and ggml's AVX2 path (_MM_ROUND_NEAREST) round
    return q.reshape(x.shape), d


def kv_roundtrip(dtype: str, x: np.ndarray, page_size: int = PAGE_SIZE) -> np.ndarray:
    """x (f32, last axis head_dim) stored in a KV cache of `dtype` and read back as f32, by its codec's numpy rule.
    Page-scaled keys (q4_ch; x [T, KVH, D] of positions 0 .. T - 1) are encoded a page of `page_size` positions at a
    time, as one prefill stores them."""
    codec = kv_codecs.codec(dtype)
    if not codec.page_scaled:
        return codec.roundtrip(x, x.shape[-1], page_size)
    out = np.empty_like(x)
    for p in range(0, len(x), page_size):
        page = x[p:p + page_size].transpose(1, 0, 2)                      # [KVH, n, D]
        out[p:p + page_size] = codec.roundtrip(page, x.shape[-1], page_size).transpose(1, 0, 2)
    return out


class ReferenceSession:
    """The float32 forward fed as a Session feeds the engine: call by call (prefill chunks, decode steps), with each
    layer's keys and values kept as the cache holds them after every call (NumpyReference.kv_types), and compaction
    as the engine's. Where a page's keys are encoded whole (q4_ch), a call re-encodes the page it continues from
    what that page held, and compaction each destination page from its kept slots: what one whole-sequence forward
    cannot model."""

    def __init__(self, ref: NumpyReference):
        self.ref = ref
        cfg = ref.config
        self.length = 0                                   # tokens fed (the next position)
        empty = np.zeros((cfg.n_kv_heads, 0, cfg.head_dim), np.float32)
        self.keys = [empty] * cfg.n_layers                # per layer [KVH, S, D], stored minus the key offset
        self.values = [empty] * cfg.n_layers
        self.positions = [np.zeros((cfg.n_kv_heads, 0), np.int64)] * cfg.n_layers
        self.states = {l: ref.empty_state() for l in cfg.recurrent_layers}    # a hybrid's DeltaNet layers

    def feed(self, ids) -> np.ndarray:
        """Logits [len(ids), vocab] of one call."""
        ref, cfg = self.ref, self.ref.config
        n = len(ids)
        pos = np.arange(self.length, self.length + n)
        x = ref._embed(np.asarray(ids, np.int64))
        rep = cfg.n_heads // cfg.n_kv_heads
        for l in range(cfg.n_layers):
            if cfg.is_recurrent(l):
                out, self.states[l] = ref.delta_net(l, x, self.states[l])
                x = ref._after_mixer(l, x, out)
                continue
            q, k, v = ref._qkv(l, x, pos)
            c = ref.cache_offset(l, k.shape[1:])
            self._append(l, (k - c).transpose(1, 0, 2), v.transpose(1, 0, 2), pos)
            out = np.empty((n, cfg.n_heads, cfg.head_dim), np.float32)
            for h in range(cfg.n_kv_heads):
                keys = (self.keys[l][h] + (c[h] if np.ndim(c) else c))[:, None]
                k_pos = self.positions[l][h]
                visible = (k_pos[None, :] <= pos[:, None]) & ref._window(l, pos, k_pos)
                heads = slice(h * rep, (h + 1) * rep)
                out[:, heads] = _attention(q[:, heads], keys, self.values[l][h][:, None], visible, ref._scale())
            x = ref._finish_layer(l, x, out)
        self.length += n
        return ref._logits(x)

    def compact(self, kept: list[np.ndarray]) -> None:
        """Keep, per attention layer, the slots of kept [KVH, k] (slot indices, ascending), gathered to the front:
        rows move as they are; keys encoded by page are encoded again per destination page. DeltaNet states stay."""
        for l, rows in zip(self.ref.config.attention_layers, kept):
            rows = np.asarray(rows)
            self.keys[l], self.values[l] = (np.take_along_axis(a, rows[..., None], axis=1)
                                            for a in (self.keys[l], self.values[l]))
            self.positions[l] = np.take_along_axis(self.positions[l], rows, axis=1)
            if self._page_keys:
                self.keys[l] = self._paged(self.keys[l])

    @property
    def _page_keys(self) -> bool:
        return bool(self.ref.kv_types) and kv_codecs.codec(self.ref.kv_types[0]).page_scaled

    def _paged(self, keys):
        """Keys [KVH, n, D] at slots 0 .. n - 1 as page-encoded keys store them."""
        return kv_roundtrip(self.ref.kv_types[0], keys.transpose(1, 0, 2), self.ref.page_size).transpose(1, 0, 2)

    def _append(self, l, k, v, pos):
        """Keys and values [KVH, n, D] of positions pos appended at the layer's next slots."""
        key_type, value_type = self.ref.kv_types or ("float32", "float32")
        held = self.keys[l].shape[1]
        self.values[l] = np.concatenate([self.values[l], kv_roundtrip(value_type, v)], axis=1)
        self.positions[l] = np.concatenate([self.positions[l], np.broadcast_to(pos, (len(k), len(pos)))], axis=1)
        if not self._page_keys:
            self.keys[l] = np.concatenate([self.keys[l], kv_roundtrip(key_type, k)], axis=1)
            return
        start = held // self.ref.page_size * self.ref.page_size       # the page this call continues
        self.keys[l] = np.concatenate([self.keys[l][:, :start], self._paged(
            np.concatenate([self.keys[l][:, start:], k], axis=1))], axis=1)
