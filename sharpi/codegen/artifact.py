"""Writing an artifact directory: kernels library, weights in kernel layout, tokenizer, manifest.

Everything is written into a temporary sibling directory and renamed into place at the end, so an
interrupted compile never leaves a half artifact behind that would load.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..common.errors import ConfigError
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
    """A fresh hidden folder beside `output` (same file system, so the final rename is atomic)."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    except OSError as exc:
        raise ConfigError(f"Cannot write the artifact into {output.parent}: {exc.strerror or exc}.") from None


def finalize(staging: Path, output: Path, manifest: Manifest) -> None:
    """Hash every file, write the manifest last, and move the directory into place. An earlier artifact at
    `output` is renamed aside first and deleted only once the new one is in place (deleting it in place could be
    interrupted half-way and leave a half artifact there); if the move fails it is put back."""
    manifest.files = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    manifest.write(staging)
    previous = None
    try:
        if output.exists():
            previous = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            output.rename(previous / output.name)
        staging.rename(output)
    except BaseException:
        if previous is not None and (previous / output.name).exists() and not output.exists():
            (previous / output.name).rename(output)
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        raise
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
