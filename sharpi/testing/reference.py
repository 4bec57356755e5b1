"""The exact float32 numpy forward pass for the llama family: an independent reference for sharpi's kernels.

Weights come from `gguf.quants.dequantize` (not from sharpi's repacking), attention is materialized in full,
so nothing here shares code with the compiled path except the GGUF reader.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..common.config import ModelConfig
from ..frontend.config import config_from_gguf
from ..frontend.gguf_file import GGUFFile


class NumpyReference:
    def __init__(self, gguf_path: str | Path):
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        gguf = GGUFFile(gguf_path)
        self.config: ModelConfig = config_from_gguf(gguf)
        self.weights = {}
        for name, t in gguf.tensors.items():
            w = np.asarray(dequantize(t.data, GGMLQuantizationType(t.type_id)), dtype=np.float32)
            self.weights[name] = w.reshape(t.shape)

    def forward(self, ids, positions=None, capture: list | None = None) -> np.ndarray:
        """Logits [len(ids), vocab] for a fresh sequence (causal attention over ids).

        With `capture` (a list), each layer's post-RoPE (q [T, H, D], k [T, KVH, D], v [T, KVH, D]) is appended."""
        cfg = self.config
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos = np.arange(T) if positions is None else np.asarray(positions)
        x = self.weights["token_embd.weight"][ids]
        visible = np.tril(np.ones((T, T), dtype=bool))
        for l in range(cfg.n_layers):
            q, k, v = self._qkv(l, x, pos)
            if capture is not None:
                capture.append((q, k, v))
            x = self._finish_layer(l, x, _attention(q, k, v, visible))
        return self._logits(x)

    def decode_after_compaction(self, prompt_ids, kept_positions: list[np.ndarray], token: int,
                                position: int | None = None) -> np.ndarray:
        """Logits [vocab] of `token` fed after prompt_ids whose cache kept, per layer and KV head, only the
        slots of kept_positions ([KVH, k] logical positions): the new token is at position len(prompt_ids)
        (or `position`, to model a wrong implementation) and attends over the kept keys/values (RoPE'd at their
        original positions) and itself."""
        cfg = self.config
        captured = []
        self.forward(prompt_ids, capture=captured)
        n = len(prompt_ids) if position is None else position
        x = self.weights["token_embd.weight"][[token]]
        rep = cfg.n_heads // cfg.n_kv_heads
        for l in range(cfg.n_layers):
            q, k, v = self._qkv(l, x, np.array([n]))
            _, pk, pv = captured[l]
            out = np.empty((1, cfg.n_heads, cfg.head_dim), np.float32)
            for kvh in range(cfg.n_kv_heads):
                keep = kept_positions[l][kvh]
                keys = np.concatenate([pk[keep, kvh], k[:, kvh]])[:, None]
                values = np.concatenate([pv[keep, kvh], v[:, kvh]])[:, None]
                heads = slice(kvh * rep, (kvh + 1) * rep)
                visible = np.ones((1, len(keys)), dtype=bool)
                out[:, heads] = _attention(q[:, heads], keys, values, visible)
            x = self._finish_layer(l, x, out)
        return self._logits(x)[0]

    def _qkv(self, l, x, pos):
        cfg, W, p = self.config, self.weights, f"blk.{l}."
        T, hd = x.shape[0], cfg.head_dim
        h = rms_norm(x, W[p + "attn_norm.weight"], cfg.rms_eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(T, cfg.n_heads, hd)
        k = (h @ W[p + "attn_k.weight"].T).reshape(T, cfg.n_kv_heads, hd)
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, cfg.n_kv_heads, hd)
        return rope_adjacent(q, pos, cfg.rope_theta), rope_adjacent(k, pos, cfg.rope_theta), v

    def _finish_layer(self, l, x, attn):
        cfg, W, p = self.config, self.weights, f"blk.{l}."
        x = x + attn.reshape(x.shape[0], cfg.q_dim) @ W[p + "attn_output.weight"].T
        h = rms_norm(x, W[p + "ffn_norm.weight"], cfg.rms_eps)
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        return x + (silu(g) * u) @ W[p + "ffn_down.weight"].T

    def _logits(self, x):
        W = self.weights
        x = rms_norm(x, W["output_norm.weight"], self.config.rms_eps)
        return (x @ W.get("output.weight", W["token_embd.weight"]).T).astype(np.float32)


def _attention(q, k, v, visible):
    """q [T, H, D], k/v [S, KVH, D] (KVH divides H), visible [T, S] -> [T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(q.shape[-1]))
    s = np.where(visible[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", s, v).astype(np.float32)


def rms_norm(x, w, eps):
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * w).astype(np.float32)


def silu(x):
    return x / (1 + np.exp(-x))


def rope_adjacent(x, pos, theta):
    """RoPE with llama.cpp's NORM layout (rotate adjacent pairs); x: [T, H, D]."""
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.asarray(pos)[:, None].astype(np.float64) * inv[None, :]
    c, s = np.cos(ang)[:, None, :].astype(np.float32), np.sin(ang)[:, None, :].astype(np.float32)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
