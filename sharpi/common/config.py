"""The model configuration every layer shares (frontend fills it, codegen and the runtime read it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    arch: str                  # GGUF general.architecture
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int                   # embedding length
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    rope_layout: str = "norm"  # "norm": adjacent pairs (llama.cpp NORM); "neox": halves
    tied_embeddings: bool = True

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)
