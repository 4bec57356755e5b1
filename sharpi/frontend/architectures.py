"""Which builder builds which GGUF architecture. The llama family is one graph driven by its config
(models/llama.py; sharpi.frontend.config.ARCHITECTURES maps each architecture onto it); an architecture whose graph
truly differs gets a model file of its own composing frontend.blocks, and an entry in BUILDERS."""
from __future__ import annotations

from ..common.config import ModelConfig
from .models.llama import LlamaBuilder, llama_weights
from .models.qwen35 import HybridBuilder, hybrid_weights

# arch -> (load_weights, Builder) where the llama family's graph does not fit
BUILDERS: dict = {arch: (hybrid_weights, HybridBuilder) for arch in ("qwen35", "qwen35moe", "qwen3next")}


def frontend_for(cfg: ModelConfig):
    """(load_weights(gguf, cfg, show_progress) -> WeightTable, Builder(cfg, weights, max_pages, kv_types=...))."""
    return BUILDERS.get(cfg.arch, (llama_weights, LlamaBuilder))
