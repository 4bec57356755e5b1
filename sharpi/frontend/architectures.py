"""Which frontend module builds which GGUF architecture: (weights loader, Relax builder) by `general.architecture`."""
from __future__ import annotations

from ..common.config import ModelConfig


def frontend_for(cfg: ModelConfig):
    """(load_weights(gguf, cfg, show_progress) -> WeightTable, Builder(cfg, weights, max_pages, kv_dtype=...))."""
    if cfg.arch == "gemma3":
        from .gemma3 import Gemma3Builder, gemma3_weights
        return gemma3_weights, Gemma3Builder
    from .llama import LlamaBuilder, llama_weights
    return llama_weights, LlamaBuilder
