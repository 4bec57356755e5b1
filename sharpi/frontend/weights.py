"""The model's weights in sharpi's layouts, in the order the Relax functions take them as parameters."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..common.progress import progress_bar
from ..common.quant_layout import FLOAT_PLANES
from .gguf_file import GGUFFile
from .quant import layout_of, repack


@dataclass
class WeightTable:
    """Flat list of parameter arrays (one per layout part) and, per GGUF tensor, its qtype and part indices."""
    arrays: list[np.ndarray] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)     # logical (dequantized) shape
    non_finite: list[str] = field(default_factory=list)    # tensors holding NaN or infinite weights or scales

    def add_matrix(self, gguf: GGUFFile, name: str) -> None:
        t = gguf.tensor(name)
        qtype = layout_of(t)
        parts = repack(t)
        if not all_finite(qtype, parts):
            self.non_finite.append(name)
        self.tensors[name] = (qtype, self._append(name, parts))
        self.shapes[name] = tuple(t.shape)

    def add_vector(self, gguf: GGUFFile, name: str) -> None:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = gguf.tensor(name)
        data = np.asarray(dequantize(t.data, GGMLQuantizationType(t.type_id)), dtype=np.float32).reshape(t.shape)
        if not np.isfinite(data).all():
            self.non_finite.append(name)
        self.tensors[name] = ("f32", self._append(name, {"w": np.ascontiguousarray(data)}))
        self.shapes[name] = tuple(t.shape)

    def _append(self, name: str, parts: dict[str, np.ndarray]) -> list[int]:
        start = len(self.arrays)
        for part, array in parts.items():
            self.arrays.append(array)
            self.names.append(f"{name}:{part}")
        return list(range(start, len(self.arrays)))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def all_finite(qtype: str, parts: dict[str, np.ndarray]) -> bool:
    """Whether a repacked tensor's weights are all finite: its float planes (scales and offsets of the quantized
    types, every weight of the dense ones; bf16's bits by their exponent)."""
    if qtype in FLOAT_PLANES:
        return bool(np.isfinite(parts["s"][:FLOAT_PLANES[qtype]]).all())
    w = parts["w"]
    if qtype == "bf16":
        return not bool(((w & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(w).all())


def load_weights(gguf: GGUFFile, matrices: list[str], vectors: list[str], show_progress: bool) -> WeightTable:
    """Repack the named GGUF tensors (matrices stay quantized; vectors become f32), with a progress bar."""
    table = WeightTable()
    with progress_bar(len(matrices) + len(vectors), "repacking weights", show_progress, unit="tensor") as bar:
        for name in matrices:
            table.add_matrix(gguf, name)
            bar.update(1)
        for name in vectors:
            table.add_vector(gguf, name)
            bar.update(1)
    return table
