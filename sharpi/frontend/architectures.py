"""Which builder builds which GGUF architecture. The llama family is one graph driven by its config
(models/llama.py; sharpi.frontend.config.ARCHITECTURES maps each architecture onto it); an architecture whose graph
truly differs gets a model file of its own composing frontend.blocks, and an entry in BUILDERS."""
from __future__ import annotations

from ..common.config import ModelConfig
from ..common.errors import UnsupportedArchitectureError
from .models.llama import LlamaBuilder, llama_weights

BUILDERS: dict = {}        # arch -> (load_weights, Builder) where the llama family's graph does not fit


def frontend_for(cfg: ModelConfig):
    """(load_weights(gguf, cfg, show_progress) -> WeightTable, Builder(cfg, weights, max_pages, kv_types=...))."""
    if cfg.is_hybrid and cfg.arch not in BUILDERS:
        raise UnsupportedArchitectureError(
            f"{cfg.arch}: sharpi reads this hybrid model (its numpy reference runs it) but cannot compile its Gated "
            f"DeltaNet layers yet.")
    return BUILDERS.get(cfg.arch, (llama_weights, LlamaBuilder))
