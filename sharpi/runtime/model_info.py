"""What an artifact tells without loading its kernels or weights: the model's configuration, its tokenizer and
chat template, its context, and the SnapKV settings a request's knobs resolve to. A Model holds one; a server's
HTTP front on a machine (or in a process) without the model uses one alone."""
from __future__ import annotations

from pathlib import Path

from ..common.config import ModelConfig
from ..common.errors import ArtifactError
from ..common.manifest import Manifest
from ..common.snapkv_settings import SnapKVSettings
from ..common.tokenizer import Tokenizer, TokenizerInfo
from .engine import resolve_snapkv


class ModelInfo:
    def __init__(self, directory: str | Path, manifest: Manifest | None = None):
        self.path = Path(directory)
        self.manifest = manifest if manifest is not None else Manifest.read(self.path, verify_digest=False)
        self.config = ModelConfig.from_dict(self.manifest.config)
        self.tokenizer = Tokenizer.load(self.path, TokenizerInfo.from_dict(self.manifest.tokenizer))
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise ArtifactError(f"{self.path}/tokenizer.json has {self.tokenizer.vocab_size} tokens, more than the "
                                f"model's {self.config.vocab_size}; compile it again.")

    @property
    def max_context(self) -> int:
        return self.manifest.max_context

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False,
                 limit: int | None = None) -> list[int]:
        return self.tokenizer.tokenize(text, add_bos=add_bos, special=special, limit=limit)

    def detokenize(self, ids, special: bool = True) -> str:
        return self.tokenizer.detokenize(ids, special=special)

    def snapkv_settings(self, **knobs) -> tuple[SnapKVSettings, int]:
        """The resolved SnapKV settings and effective budget (0 = no eviction) for these knobs (budget=...,
        window=..., ...: runtime.engine.resolve_snapkv)."""
        return resolve_snapkv(self.manifest, self.config, **knobs)
