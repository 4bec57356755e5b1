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

    def forward(self, ids, positions=None) -> np.ndarray:
        """Logits [len(ids), vocab] for a fresh sequence (causal attention over ids)."""
        cfg, W = self.config, self.weights
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos = np.arange(T) if positions is None else np.asarray(positions)
        x = W["token_embd.weight"][ids]
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        hd, rep = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        for l in range(cfg.n_layers):
            p = f"blk.{l}."
            h = rms_norm(x, W[p + "attn_norm.weight"], cfg.rms_eps)
            q = (h @ W[p + "attn_q.weight"].T).reshape(T, cfg.n_heads, hd)
            k = (h @ W[p + "attn_k.weight"].T).reshape(T, cfg.n_kv_heads, hd)
            v = (h @ W[p + "attn_v.weight"].T).reshape(T, cfg.n_kv_heads, hd)
            q, k = rope_adjacent(q, pos, cfg.rope_theta), rope_adjacent(k, pos, cfg.rope_theta)
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(hd)) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", s, v).reshape(T, cfg.q_dim)
            x = x + o @ W[p + "attn_output.weight"].T
            h = rms_norm(x, W[p + "ffn_norm.weight"], cfg.rms_eps)
            g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
            x = x + (silu(g) * u) @ W[p + "ffn_down.weight"].T
        x = rms_norm(x, W["output_norm.weight"], cfg.rms_eps)
        return (x @ W.get("output.weight", W["token_embd.weight"]).T).astype(np.float32)


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
