"""The model's weights in sharpi's layouts, in the order the Relax functions take them as parameters.

A WeightTable knows every parameter's name, shape and dtype from the GGUF's tensor infos alone (the layouts'
shapes, common.quant_layout), which is all the graph builder needs; the arrays themselves are repacked from the
mapped GGUF one tensor at a time when the artifact's weights file is written (`repacked`). A compile therefore
holds one repacked tensor at a time, not the model: an 8B model's 5 GB of weights would otherwise be 5 GB of
numpy arrays beside the GGUF's mapped pages.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from ..common.errors import CompileError
from ..common.progress import progress_bar
from ..common.quant_layout import FLOAT_PLANES, K_QUANTS, LAYOUTS, SUB_SCALES, parts as layout_parts
from .gguf_file import GGUFFile, GGUFTensor
from .quant import check_repackable, layout_of, repack


@dataclass(frozen=True)
class ParamSpec:
    name: str                 # "tensor:part"
    shape: tuple[int, ...]
    dtype: str


@dataclass
class WeightTable:
    """Per parameter (one per layout part) its spec; per GGUF tensor its qtype and part indices. `non_finite`
    grows as tensors are repacked: those holding NaN or infinite weights or scales."""
    gguf: GGUFFile | None = None
    specs: list[ParamSpec] = field(default_factory=list)
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)     # logical (dequantized) shape
    non_finite: list[str] = field(default_factory=list)
    vectors: set[str] = field(default_factory=set)                         # tensors kept as f32 vectors
    experts: set[str] = field(default_factory=set)                         # a mixture's stacked [E, N, K]
    # a tensor made of others' rows expert by expert (gate's and up's: one matmul reads both), by its sources
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _last: tuple[str, dict] | None = field(default=None, repr=False)      # the tensor repacked last (see array())

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def add_matrix(self, gguf: GGUFFile, name: str) -> None:
        stacked = gguf.tensor(name)
        t = as_matrix(stacked)
        if len(stacked.shape) == 3:
            self.experts.add(name)
        qtype = layout_of(t)
        check_repackable(t, qtype)
        n, k = t.shape
        self._add(gguf, name, qtype, [(part, dtype, shape) for part, dtype, shape in layout_parts(qtype, n, k)])
        self.shapes[name] = tuple(t.shape)

    def add_stacked_experts(self, gguf: GGUFFile, name: str, sources: tuple[str, ...]) -> None:
        """`name`: the experts of `sources` (of one type, [E, N_i, K] each) as one [E, sum N_i, K], each expert's
        rows of the first source, then of the next."""
        tensors = [gguf.tensor(source) for source in sources]
        experts, _, k = tensors[0].shape
        n = experts * sum(t.shape[1] for t in tensors)
        qtype = layout_of(as_matrix(tensors[0]))
        for t in tensors:
            check_repackable(as_matrix(t), qtype)
        self._add(gguf, name, qtype, list(layout_parts(qtype, n, k)))
        self.shapes[name] = (n, k)
        self.experts.add(name)
        self.stacked[name] = tuple(sources)

    def add_vector(self, gguf: GGUFFile, name: str) -> None:
        t = gguf.tensor(name)
        self._add(gguf, name, "f32", [("w", "float32", tuple(t.shape))])
        self.vectors.add(name)
        self.shapes[name] = tuple(t.shape)

    def _add(self, gguf: GGUFFile, name: str, qtype: str, parts: list[tuple[str, str, tuple]]) -> None:
        self.gguf = gguf
        start = len(self.specs)
        self.specs += [ParamSpec(f"{name}:{part}", tuple(int(d) for d in shape), dtype) for part, dtype, shape in parts]
        self.tensors[name] = (qtype, list(range(start, len(self.specs))))

    def choose_scales(self, sub_scales) -> None:
        """Keep each K-quant's `ks` part where sub_scales(name) (its kernels read the integer sub-scales), its `s`
        part elsewhere (quant_layout), leaving the other out: the graph does not take it and the artifact does
        not store it."""
        specs, self.specs = self.specs, []
        for name, (qtype, indices) in self.tensors.items():
            dropped = "s" if qtype in K_QUANTS and sub_scales(name) else SUB_SCALES
            kept = [specs[i] for i in indices if not specs[i].name.endswith(f":{dropped}")]
            self.tensors[name] = (qtype, list(range(len(self.specs), len(self.specs) + len(kept))))
            self.specs += kept

    def repacked(self, name: str) -> dict[str, np.ndarray]:
        """The parts of one tensor in its layout (repacked from the GGUF now; matrices stay quantized, vectors
        become f32), checked against the specs the graph was built with; a non-finite tensor is recorded."""
        qtype, indices = self.tensors[name]
        if name in self.stacked:
            repacked = self._stacked_parts(name, qtype)
        elif name in self.vectors:
            t = self.gguf.tensor(name)
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            data = np.asarray(dequantize(t.data, GGMLQuantizationType(t.type_id)), dtype=np.float32)
            repacked = {"w": np.ascontiguousarray(data.reshape(t.shape))}
        else:
            repacked = repack(as_matrix(self.gguf.tensor(name)))
        for source in self.stacked.get(name, (name,)):
            self.gguf.release(source)
        kept = {self.specs[i].name.rsplit(":", 1)[1] for i in indices}
        parts = {part: array for part, array in repacked.items() if part in kept}
        for (part, array), index in zip(parts.items(), indices, strict=True):
            spec = self.specs[index]
            if spec.name != f"{name}:{part}" or tuple(array.shape) != spec.shape or str(array.dtype) != spec.dtype:
                raise CompileError(f"{name}:{part} repacked to {array.dtype}{list(array.shape)}, not the "
                                   f"{spec.dtype}{list(spec.shape)} the graph was built for.")
        if not all_finite(qtype, repacked) and name not in self.non_finite:     # `s` read, stored or not
            self.non_finite.append(name)
        return parts

    def _stacked_parts(self, name: str, qtype: str) -> dict[str, np.ndarray]:
        """The parts of a stacked tensor: each source's, joined expert by expert along each part's row axis
        (the axis that grows with the rows: `s` is [planes, rows, blocks])."""
        tensors = [self.gguf.tensor(source) for source in self.stacked[name]]
        experts, k = tensors[0].shape[0], tensors[0].shape[2]
        sources = [repack(as_matrix(t)) for t in tensors]
        joined = {}
        for part, _, shape in LAYOUTS[qtype]:
            axis = next(a for a, (one, two) in enumerate(zip(shape(experts, k), shape(2 * experts, k))) if one != two)
            blocks = [np.moveaxis(parts[part], axis, 0) for parts in sources]
            by_expert = [b.reshape(experts, -1, *b.shape[1:]) for b in blocks]
            rows = np.concatenate(by_expert, axis=1).reshape(-1, *blocks[0].shape[1:])
            joined[part] = np.ascontiguousarray(np.moveaxis(rows, 0, axis))
        return joined

    def stream(self, show_progress: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """(parameter name, array) in parameter order, one tensor repacked at a time."""
        with progress_bar(len(self.tensors), "repacking weights", show_progress, unit="tensor") as bar:
            for name in self.tensors:         # added in parameter order
                for part, array in self.repacked(name).items():
                    yield f"{name}:{part}", array
                bar.update(1)

    def array(self, index: int) -> np.ndarray:
        """One parameter's array (the ONNX export reads them one by one; the tensor repacked last is kept, since
        its parts are read together)."""
        name = self.specs[index].name.rsplit(":", 1)[0]
        if self._last is None or self._last[0] != name:
            self._last = (name, self.repacked(name))
        return self._last[1][self.specs[index].name.rsplit(":", 1)[1]]


def as_matrix(t: GGUFTensor) -> GGUFTensor:
    """A stack of matrices (a mixture's experts, [E, N, K]) as one [E * N, K] matrix, its rows expert by expert
    (quant blocks never span rows, so the bytes are the same); a matrix as it is."""
    if len(t.shape) != 3:
        return t
    experts, rows, cols = t.shape
    return replace(t, shape=(experts * rows, cols), data=t.data.reshape(experts * rows, *t.data.shape[2:]))


def all_finite(qtype: str, parts: dict[str, np.ndarray]) -> bool:
    """Whether a repacked tensor's weights are all finite: its float planes (scales and offsets of the quantized
    types; every weight of the dense ones; bf16's bits by their exponent)."""
    if qtype in FLOAT_PLANES:
        return bool(np.isfinite(parts["s"][:FLOAT_PLANES[qtype]]).all())
    w = parts["w"]
    if qtype == "bf16":
        return not bool(((w & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(w).all())


# A mixture's gate and up experts of one type are stored stacked, each expert's gate rows then its up rows (as
# llama.cpp's fused ffn_gate_up_exps): one matmul reads the chosen experts' rows of both, where two calls each paid
# a call's start and end (a decode GEMV's streams ramp up and its threads wait for the last task).
GATE_EXPS, UP_EXPS, GATE_UP_EXPS = "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight"


def _same_layout(gguf: GGUFFile, *names: str) -> bool:
    return len({layout_of(as_matrix(gguf.tensor(name))) for name in names}) == 1


def load_weights(gguf: GGUFFile, matrices: list[str], vectors: list[str], show_progress: bool) -> WeightTable:
    """The table of the named GGUF tensors (matrices stay quantized; vectors become f32); nothing is repacked
    yet."""
    table = WeightTable()
    for name in matrices:
        prefix = name.removesuffix(GATE_EXPS).removesuffix(UP_EXPS)
        gate, up = prefix + GATE_EXPS, prefix + UP_EXPS
        if gate in matrices and up in matrices and _same_layout(gguf, gate, up):
            if name == gate:
                table.add_stacked_experts(gguf, prefix + GATE_UP_EXPS, (gate, up))
        else:
            table.add_matrix(gguf, name)
    for name in vectors:
        table.add_vector(gguf, name)
    return table
