"""Writing an artifact directory: kernels library, weights in kernel layout, tokenizer, manifest.

Everything is written into a staging folder beside the output and moved into place at the end (common.output_dir:
only an earlier artifact's own files are replaced, never a user's), so an interrupted compile never leaves a half
artifact behind that would load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from ..common.manifest import (ARTIFACT, CONTRACT_FUNCTION, LIBRARY, PLAN, TOKENIZER, WEIGHT_ALIGN, WEIGHTS, Manifest,
                               ParamEntry, file_sha256)
from ..common.output_dir import install

__all__ = ["LIBRARY", "PLAN", "TOKENIZER", "WEIGHTS", "write_weights", "finalize", "with_contract"]


def write_weights(weights: Iterable[tuple[str, np.ndarray]], path: Path) -> list[ParamEntry]:
    """(name, array) pairs into one file, each at a WEIGHT_ALIGN offset; taken one at a time, so a stream of
    repacked tensors never sits in memory whole."""
    entries, offset = [], 0
    with open(path, "wb") as f:
        for name, array in weights:
            pad = (-offset) % WEIGHT_ALIGN
            f.write(b"\0" * pad)
            offset += pad
            data = np.ascontiguousarray(array)
            f.write(data.tobytes())
            entries.append(ParamEntry(name=name, dtype=str(data.dtype), shape=list(data.shape), offset=offset,
                                      nbytes=data.nbytes))
            offset += data.nbytes
    return entries


def finalize(staging: Path, output: Path, manifest: Manifest) -> None:
    """Hash every file, write the manifest last, and move the artifact into place (common.output_dir.install)."""
    manifest.files = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    manifest.write(staging)
    install(staging, output, ARTIFACT)


def with_contract(mod, contract: str):
    """`mod` (changed in place) plus a Relax function CONTRACT_FUNCTION() -> str returning `contract` (the manifest's
    kernel_contract as JSON): the runtime compares it with the manifest it loads, so a manifest that no longer
    describes these kernels is refused before they run."""
    from tvm import relax

    bb = relax.BlockBuilder()
    with bb.function(CONTRACT_FUNCTION, []):
        bb.emit_func_output(relax.expr.String(contract))
    mod[CONTRACT_FUNCTION] = bb.get()[CONTRACT_FUNCTION]
    return mod
