"""Opening GGUF files (memory-mapped, through the `gguf` package) with every failure turned into a GGUFError."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.errors import GGUFError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFTensor:
    name: str
    type_name: str            # GGMLQuantizationType name, e.g. "Q4_1"
    type_id: int
    shape: tuple[int, ...]    # logical shape, outermost first (numpy order): (rows, cols) for a matrix
    data: np.ndarray          # raw bytes (uint8) for quantized types, typed array otherwise; memory-mapped


class GGUFFile:
    """Metadata (as Python values) and tensors of one GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"{self.path} does not exist or is not a file.")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with the GGUF magic bytes).")
        try:
            from gguf import GGUFReader
            reader = GGUFReader(str(self.path), "r")
            self.metadata = {k: _field_value(v) for k, v in reader.fields.items()}
            self.tensors = {t.name: _tensor(t) for t in reader.tensors}
        except GGUFError:
            raise
        except Exception as exc:  # the gguf package raises many kinds on truncated or malformed files
            raise GGUFError(f"{self.path} is truncated or malformed: {type(exc).__name__}: {exc}".rstrip(": ")
                            + ("" if str(exc).endswith(".") else ".")) from None
        self._reader = reader

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path} has no general.architecture field.")
        return arch

    def require(self, key: str):
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name} lacks the metadata field {key}.")
        return self.metadata[key]

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise GGUFError(f"{self.path.name} lacks the tensor {name}.")
        return self.tensors[name]


def _field_value(field):
    value = field.contents()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def _tensor(t) -> GGUFTensor:
    shape = tuple(int(x) for x in reversed([int(v) for v in t.shape]))
    return GGUFTensor(name=t.name, type_name=t.tensor_type.name, type_id=int(t.tensor_type),
                      shape=shape, data=t.data)
