"""The artifact's manifest: what was compiled, for which CPU, and the content hash of every file."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ArtifactError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LIBRARY = "model.so"          # the compiled kernels (llvm, cuda)
WEIGHTS = "weights.bin"       # every parameter, in manifest order, 64-byte aligned
PLAN = "plan.json"            # vulkan: the plan of calls; one .wgsl file per kernel beside it
_JSON_NAMES = {dict: "object", int: "integer", list: "array", str: "string"}


# bytes of a KV pool element (numpy itself knows "bfloat16" only once ml_dtypes is imported)
KV_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class ParamEntry:
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class Manifest:
    format_version: int
    sharpi_version: str
    source: dict                 # {"name", "sha256", "size"}
    config: dict                 # ModelConfig.to_dict()
    target: dict                 # {"kind", "mcpu", "cpu_features"}
    tokenizer: dict              # TokenizerInfo.to_dict()
    page_size: int
    max_context: int
    max_pages: int               # page-table width: pages one layer of one sequence may hold
    prefill_chunk: int
    functions: list[str]
    kernels: list[str]
    params: list[ParamEntry]
    files: dict[str, str] = field(default_factory=dict)   # file name -> sha256
    snapkv: dict = field(default_factory=dict)
    kv_dtype: str = "float32"    # the KV page pool's element type (float32, float16 or bfloat16)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def write(self, directory: Path) -> None:
        (Path(directory) / MANIFEST_NAME).write_text(self.to_json())

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise ArtifactError(f"{directory} is not a sharpi artifact (it has no {MANIFEST_NAME}).")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{path} is not valid JSON: {exc}.") from None
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version != FORMAT_VERSION:
            raise ArtifactError(f"{directory} has artifact format version {version}, but this sharpi reads "
                                f"version {FORMAT_VERSION}; compile it again with this sharpi.")
        try:
            raw["params"] = [ParamEntry(**p) for p in raw["params"]]
            manifest = cls(**raw)
        except (TypeError, KeyError) as exc:
            raise ArtifactError(f"{path} is missing or has unexpected fields: {exc}.") from None
        manifest._check_types(path)
        return manifest

    def _check_types(self, path: Path) -> None:
        """The JSON types of the fields the runtime reads without further checks (a hand-edited or damaged
        manifest would otherwise fail deep inside the loader)."""
        kinds = {"source": dict, "config": dict, "target": dict, "tokenizer": dict, "files": dict, "snapkv": dict,
                 "page_size": int, "max_context": int, "max_pages": int, "prefill_chunk": int, "functions": list,
                 "kernels": list, "kv_dtype": str}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ArtifactError(f"{path} is corrupted: {name} should be a JSON {_JSON_NAMES[kind]}.")
        if not all(isinstance(k, str) and isinstance(v, str) and "/" not in k and k not in ("", ".", "..")
                   for k, v in self.files.items()):
            raise ArtifactError(f"{path} is corrupted: files should map plain file names to sha256 strings.")


def file_sha256(path: Path, progress=None) -> str:
    """sha256 of a file, read in 4 MiB chunks; `progress` (a progress bar) is told of each chunk."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()
