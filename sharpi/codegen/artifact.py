"""Writing an artifact directory: kernels library, weights in kernel layout, tokenizer, manifest.

Everything is written into a temporary sibling directory and renamed into place at the end, so an
interrupted compile never leaves a half artifact behind that would load.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..common.manifest import LIBRARY, WEIGHTS, Manifest, ParamEntry, file_sha256
ALIGN = 64


def write_weights(arrays: list[np.ndarray], names: list[str], path: Path) -> list[ParamEntry]:
    entries, offset = [], 0
    with open(path, "wb") as f:
        for name, array in zip(names, arrays):
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            data = np.ascontiguousarray(array)
            f.write(data.tobytes())
            entries.append(ParamEntry(name=name, dtype=str(data.dtype), shape=list(data.shape), offset=offset,
                                      nbytes=data.nbytes))
            offset += data.nbytes
    return entries


def staging_dir(output: Path) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))


def finalize(staging: Path, output: Path, manifest: Manifest) -> None:
    """Hash every file, write the manifest last, and move the directory into place."""
    manifest.files = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    manifest.write(staging)
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)
