"""A readable summary of a GGUF file (for `sharpi inspect`)."""
from __future__ import annotations

from collections import Counter

from ..common.errors import SharpiError
from .fetch import resolve_model
from .gguf_file import GGUFFile


def describe(model: str) -> dict:
    path = resolve_model(model)
    gguf = GGUFFile(path)
    types = Counter(t.type_name for t in gguf.tensors.values())
    info = {"file": str(path), "size_bytes": path.stat().st_size, "architecture": gguf.architecture,
            "name": gguf.metadata.get("general.name"), "tensors": len(gguf.tensors),
            "tensor_types": dict(sorted(types.items())),
            "tokenizer": f"{gguf.metadata.get('tokenizer.ggml.model')} (pre: {gguf.metadata.get('tokenizer.ggml.pre')})",
            "chat_template": bool(gguf.metadata.get("tokenizer.chat_template"))}
    try:
        from .config import config_from_gguf
        info["config"] = config_from_gguf(gguf).to_dict()
        info["supported"] = True
    except SharpiError as exc:
        info["supported"] = f"no: {exc}"
    return info
