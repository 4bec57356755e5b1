"""Which frontend module builds which GGUF architecture: (weights loader, Relax builder) by `general.architecture`."""
from __future__ import annotations

from ..common.config import ModelConfig


def frontend_for(cfg: ModelConfig):
    """(load_weights(gguf, cfg, show_progress) -> WeightTable, Builder(cfg, weights, max_pages, kv_dtype=...)).
    "llama" covers mistral-style GGUFs too (general.architecture llama, optionally with a sliding window)."""
    if cfg.arch == "gemma3":
        from .gemma3 import Gemma3Builder, gemma3_weights
        return gemma3_weights, Gemma3Builder
    if cfg.arch == "qwen2":
        from .qwen import Qwen2Builder, qwen2_weights
        return qwen2_weights, Qwen2Builder
    if cfg.arch == "qwen3":
        from .qwen import Qwen3Builder, qwen3_weights
        return qwen3_weights, Qwen3Builder
    from .llama import LlamaBuilder, llama_weights
    return llama_weights, LlamaBuilder
