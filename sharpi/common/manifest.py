"""The artifact's manifest: what was compiled, for which CPU or GPU, and the content hash of every file.

Reading one is the single place where an artifact's numbers enter the runtime, so `Manifest.read` checks all of
it before anything is sized or indexed from it: its own digest (a sha256 over the manifest without the digest
field, so a damaged or edited manifest is caught like any other damaged file), the schema (every field of its type
and in range, every id inside the vocabulary, the parameter table laid out as `write_weights` lays it out), and
the kernel contract: the fields the compiled kernels were built for (`kernel_contract`) are compiled into the
kernel library (or the Vulkan plan), and the loader compares the two, so even an edit whose digest was recomputed,
or one loaded with verify=False, is one ArtifactError sentence instead of a read past a buffer.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import schema
from .config import MAX_SIZE, ModelConfig
from .errors import ArtifactError, ConfigError
from .kv_format import KEY_OFFSET, KVFormat, kv_types, rotation_seed_for
from .output_dir import MAX_MANIFEST_BYTES, OutputKind, plain_file_name
from .plan import PLAN_FILE
from .chat_sampling import check_manifest_sampling
from .snapkv_settings import CHOICES as SNAPKV_CHOICES, KNOBS as SNAPKV_KNOBS
from .snapkv_settings import MAX_WINDOW, check_against, parse_knob, settings_from
from .targets import check_manifest_entry
from .tokenizer import TokenizerInfo

FORMAT = "sharpi-artifact"    # the format marker: a folder whose manifest says this is sharpi's to replace
FORMAT_VERSION = 2            # 2: format marker, manifest digest, kernel contract
MANIFEST_NAME = "manifest.json"
LIBRARY = "model.so"          # the compiled kernels (llvm, cuda)
WEIGHTS = "weights.bin"       # every parameter, in manifest order, WEIGHT_ALIGN-byte aligned
PLAN = PLAN_FILE              # vulkan: the plan of calls (common.plan); one .wgsl file per kernel beside it
TOKENIZER = "tokenizer.json"
WEIGHT_ALIGN = 64
CONTRACT_FUNCTION = "sharpi_contract"   # the library's function returning kernel_contract() as JSON
FUNCTIONS = ("prefill", "prefill_logits", "decode", "decode_batch", "prefill_snapkv", "snapkv_select",
             "snapkv_compact", "state_copy")
REQUIRED_FUNCTIONS = FUNCTIONS[:3]
MAX_PREFILL_CHUNK = 8192

PARAM_ITEMSIZE = {"float32": 4, "float16": 2, "uint32": 4, "uint16": 2, "int32": 4, "uint8": 1, "int8": 1}


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
    target: dict                 # {"kind", ...}: see common.targets
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
    kv_dtype: str = "float32"    # the KV cache's type (kv_codecs' names): the keys', and the values' unless
    kv_dtype_v: str | None = None    # gives theirs (absent in artifacts compiled before K and V could differ)
    kv_key_offset: str | None = None     # keys cached minus blk.N.<this> (kv_format.key_offset_for); absent: none
    kv_rotation_seed: int | None = None  # a rotated KV type's rotation (kv_format.rotation_seed_for); absent: none
    sampling: dict | None = None         # the GGUF's recommended sampling (chat_sampling); absent: none
    format: str = FORMAT
    digest: str = ""             # sha256 of the manifest's canonical JSON without this field (set by to_json)

    def to_json(self) -> str:
        content = asdict(self)
        content["digest"] = self.digest = content_digest(content)
        return json.dumps(content, indent=1)

    def write(self, directory: Path) -> None:
        (Path(directory) / MANIFEST_NAME).write_text(self.to_json())

    @property
    def kv_types(self) -> tuple[str, str]:
        """(keys' type, values' type)."""
        return self.kv_dtype, self.kv_dtype_v or self.kv_dtype

    def kv_format(self, config: ModelConfig) -> KVFormat:
        """The pool's layout (sharpi.common.kv_format) for this artifact's model config."""
        return KVFormat(*self.kv_types, config.n_kv_heads, self.page_size, config.head_dim)

    def kernel_contract(self) -> dict:
        """What the compiled kernels were built for; compiled into them and compared at load."""
        return kernel_contract(asdict(self))

    @classmethod
    def read(cls, directory: Path, *, verify_digest: bool = True, expect_sha256: str | None = None) -> "Manifest":
        """Read and check a manifest (see the module doc); ArtifactError with one sentence for any problem.
        expect_sha256: the sha256 of the manifest file's bytes the caller pinned (see manifest_sha256)."""
        path = Path(directory) / MANIFEST_NAME
        data = _read_bytes(Path(directory), path)
        if expect_sha256 is not None:
            actual = hashlib.sha256(data).hexdigest()
            if actual != check_pin(expect_sha256):
                raise ArtifactError(f"{path} has sha256 {actual}, not the pinned {expect_sha256.lower()}: this is "
                                    f"not the artifact you pinned (changed, replaced or another build); nothing "
                                    f"of it was loaded.")
        raw = _parse(data, path)
        if verify_digest and raw.get("digest") != content_digest(raw):
            raise ArtifactError(f"{path} does not match its own digest (corrupted or changed); compile it again.")
        try:
            check_manifest_dict(raw)
        except schema.SchemaError as exc:
            raise ArtifactError(f"{path} is corrupted: {exc}; compile it again.") from None
        raw = dict(raw, params=[ParamEntry(**p) for p in raw["params"]])
        return cls(**raw)


def content_digest(content: dict) -> str:
    """sha256 of a manifest's canonical JSON (sorted keys, no spaces) without its digest field."""
    body = {k: v for k, v in content.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def kernel_contract(content: dict) -> dict:
    """The manifest fields the compiled kernels depend on, from a manifest dict: sizes, types, the parameter
    table's names, dtypes and shapes, the functions, the target (without the CUDA images, which describe the
    build's output), the SnapKV ops' shape."""
    snapkv = content.get("snapkv") or {}
    return {"format_version": content["format_version"], "config": content["config"],
            "target": {k: v for k, v in content["target"].items() if k != "images"},
            "page_size": content["page_size"], "max_context": content["max_context"],
            "max_pages": content["max_pages"], "functions": content["functions"], "kv_dtype": content["kv_dtype"],
            "params": [[p["name"], p["dtype"], p["shape"]] for p in content["params"]],
            "snapkv": {k: snapkv.get(k) for k in ("enabled", "max_window", "select_params")},
            # only where set: the contracts compiled into earlier artifacts have no such key
            **({"kv_dtype_v": content["kv_dtype_v"]} if content.get("kv_dtype_v") else {}),
            **({"kv_key_offset": content["kv_key_offset"]} if content.get("kv_key_offset") else {}),
            **({"kv_rotation_seed": content["kv_rotation_seed"]} if content.get("kv_rotation_seed") is not None
               else {})}


def contract_json(contract: dict) -> str:
    return json.dumps(contract, sort_keys=True, separators=(",", ":"))


def check_contract(directory: Path, manifest: Manifest, compiled: str | None, where: str) -> None:
    """ArtifactError unless the contract compiled into `where` (a JSON string; None: it has none) equals the
    manifest's."""
    if compiled is None:
        raise ArtifactError(f"{directory}/{where} has no kernel contract ({CONTRACT_FUNCTION}); compile it again.")
    try:
        theirs = json.loads(compiled)
    except ValueError:
        raise ArtifactError(f"{directory}/{where} holds a damaged kernel contract; compile it again.") from None
    found = schema.first_difference(manifest.kernel_contract(), theirs)
    if found:
        at, mine, built = found
        raise ArtifactError(f"{directory}/{MANIFEST_NAME} does not match the kernels it describes: {at} is "
                            f"{schema.shown(mine)} there but {schema.shown(built)} in {where} (edited or "
                            f"damaged); compile it again.")


def manifest_sha256(directory: Path) -> str:
    """The sha256 of an artifact's manifest file: the value to pin with sharpi.load(..., expect_sha256=...). The
    manifest holds the sha256 of every other file, so pinning it pins the whole artifact."""
    path = Path(directory) / MANIFEST_NAME
    return hashlib.sha256(_read_bytes(Path(directory), path)).hexdigest()


def check_pin(value) -> str:
    if not isinstance(value, str) or not schema.SHA256.fullmatch(value.strip().lower()):
        raise ConfigError(f"expect_sha256 must be a sha256 (64 hex digits), got {schema.shown(value)}.")
    return value.strip().lower()


def listed_files(raw: dict) -> list[str] | None:
    """The files a sharpi manifest (of this or an earlier format version) lists, or None if `raw` is not one."""
    marked = raw.get("format") == FORMAT or (raw.get("format_version") == 1 and isinstance(raw.get("sharpi_version"),
                                                                                           str))
    files = raw.get("files")
    return sorted(files) if marked and isinstance(files, dict) else None


ARTIFACT = OutputKind("sharpi artifact", MANIFEST_NAME, listed_files)


def file_sha256(path: Path, progress=None) -> str:
    """sha256 of a file, read in 4 MiB chunks; `progress` (a progress bar) is told of each chunk."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def verify_files(directory: Path, manifest: Manifest, needed=()) -> None:
    """An ArtifactError unless each file the manifest lists has the sha256 it records, and each of `needed` is
    listed: a changed, damaged or replaced file is caught before any of it is used (the files must exist)."""
    for name in needed:
        if name not in manifest.files:
            raise ArtifactError(f"{directory}/{MANIFEST_NAME} has no hash for {name}, so it cannot be verified; "
                                f"compile it again.")
    for name, expected in manifest.files.items():
        if file_sha256(Path(directory) / name) != expected:
            raise ArtifactError(f"{directory}/{name} does not match the hash in the manifest (corrupted or changed); "
                                f"compile it again.")


# -- reading and the schema ---------------------------------------------------------------------------------------
def _read_bytes(directory: Path, path: Path) -> bytes:
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a sharpi artifact (it has no {MANIFEST_NAME}).")
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path} is {size >> 20} MiB, far larger than any manifest sharpi writes; it is "
                                f"not one.")
        return path.read_bytes()
    except OSError as exc:
        raise ArtifactError(f"{path} cannot be read: {exc.strerror or exc}.") from None


def _parse(data: bytes, path: Path) -> dict:
    try:
        raw = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        reason = (exc.msg if isinstance(exc, json.JSONDecodeError) else
                  "nested too deeply" if isinstance(exc, RecursionError) else str(exc))
        raise ArtifactError(f"{path} is not valid JSON ({reason}).") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"{path} is not a sharpi manifest (not a JSON object).")
    version = raw.get("format_version")
    if raw.get("format") != FORMAT and version != 1:
        raise ArtifactError(f"{path} is not a sharpi manifest (its format marker is "
                            f"{schema.shown(raw.get('format'))}, not {FORMAT!r}).")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ArtifactError(f"{path} is corrupted: format_version should be an integer, got "
                            f"{schema.shown(version)}; compile it again.")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path.parent} has artifact format version {version}, but this sharpi reads version "
                            f"{FORMAT_VERSION}; compile it again with this sharpi.")
    return raw


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _plain_name(value, path):
    if not plain_file_name(value) or len(value) > 255:
        raise schema.SchemaError(path, "a plain file name (no folder in it)", value)


_PARAM = schema.record({"name": schema.text(256), "dtype": schema.one_of(*PARAM_ITEMSIZE),
                        "shape": schema.array(schema.integer(0, 1 << 40), 4),
                        "offset": schema.integer(0, 1 << 50), "nbytes": schema.integer(0, 1 << 50)})


def _snapkv_defaults(value, path):
    """The artifact's run-time SnapKV defaults: the knobs sharpi-compile took, each in its range."""
    if not isinstance(value, dict) or set(value) - set(SNAPKV_KNOBS):
        raise schema.SchemaError(path, f"an object of SnapKV settings ({', '.join(SNAPKV_KNOBS)})", value)
    for knob, setting in value.items():
        where = f"{path}.{knob}"
        if knob == "budget" and setting is None:
            continue
        named = knob in SNAPKV_CHOICES
        if named and not isinstance(setting, str) or \
                not named and (isinstance(setting, bool) or not isinstance(setting, int)):
            raise schema.SchemaError(where, "a SnapKV setting of its type", setting)
        try:
            parse_knob(knob, setting, where)
        except ConfigError as exc:
            raise schema.SchemaError(where, "", setting, str(exc).rstrip(".")) from None
    try:
        settings_from(defaults={}, env={}, **value)
    except ConfigError as exc:
        raise schema.SchemaError(path, "", value, f"{path}: {str(exc).rstrip('.')}") from None


def _kv_type(value, path) -> None:
    """A KV type the registry knows now (kv_codecs: a codec registered at run time counts)."""
    schema.one_of(*kv_types())(value, path)


# score_max: the score op takes a negative window as the maximum reduction (absent in artifacts compiled before)
_SNAPKV = schema.record({"enabled": schema.boolean, "max_window": schema.integer(1, MAX_WINDOW),
                         "defaults": _snapkv_defaults, "select_params": schema.one_of(6, 7),
                         "score_max": schema.boolean}, optional_keys=("score_max",))
_TOP = schema.record({
    "format": schema.one_of(FORMAT), "format_version": schema.one_of(FORMAT_VERSION),
    "sharpi_version": schema.text(64), "digest": schema.sha256_hex,
    "source": schema.record({"name": _plain_name, "sha256": schema.sha256_hex, "size": schema.integer(0, 1 << 50)}),
    "config": lambda v, p: ModelConfig.check_dict(v, p),
    "target": check_manifest_entry, "tokenizer": lambda v, p: None,          # checked below, against the vocabulary
    "page_size": schema.integer(1, 4096), "max_context": schema.integer(1, MAX_SIZE),
    "max_pages": schema.integer(1, MAX_SIZE), "prefill_chunk": schema.integer(1, MAX_PREFILL_CHUNK),
    "functions": schema.array(schema.one_of(*FUNCTIONS), len(FUNCTIONS), unique=True),
    "kernels": schema.array(schema.text(256), 100_000), "params": schema.array(_PARAM, 1_000_000),
    "files": schema.mapping(_plain_name, schema.sha256_hex, 100_000),
    "snapkv": _SNAPKV, "kv_dtype": _kv_type, "kv_dtype_v": schema.optional(_kv_type),
    "kv_key_offset": schema.optional(schema.one_of(KEY_OFFSET)), "sampling": check_manifest_sampling,
    "kv_rotation_seed": schema.optional(schema.integer(0, 1 << 62))},
    optional_keys=("kv_dtype_v", "kv_key_offset", "sampling", "kv_rotation_seed"))


def check_manifest_dict(raw: dict) -> None:
    """A schema.SchemaError naming the first field of `raw` (a parsed manifest) that sharpi could not have
    written: of the wrong type, out of range, or inconsistent with another field."""
    _TOP(raw, "")
    cfg = raw["config"]
    TokenizerInfo.check_dict(raw["tokenizer"], cfg["vocab_size"])
    if raw["max_context"] > cfg["context_length"]:
        raise schema.SchemaError("max_context", f"at most the model's context_length ({cfg['context_length']})",
                                 raw["max_context"])
    if raw["max_pages"] != math.ceil(raw["max_context"] / raw["page_size"]):
        raise schema.SchemaError("max_pages", "max_context / page_size, rounded up", raw["max_pages"])
    required = REQUIRED_FUNCTIONS + (("state_copy",) if cfg.get("recurrent_layers") else ())
    missing = [f for f in required if f not in raw["functions"]]
    if missing:
        raise schema.SchemaError("functions", f"a list holding {', '.join(missing)}", raw["functions"])
    _check_snapkv(raw["snapkv"], "prefill_snapkv" in raw["functions"])
    _check_params(raw["params"])
    kv_types = (raw["kv_dtype"], raw.get("kv_dtype_v") or raw["kv_dtype"])
    if raw.get("kv_rotation_seed") != rotation_seed_for(kv_types):
        raise schema.SchemaError("kv_rotation_seed", f"{rotation_seed_for(kv_types)} (the rotation this sharpi's "
                                 f"{'/'.join(kv_types)} cache reads and writes)", raw.get("kv_rotation_seed"))


def _check_snapkv(snapkv: dict, compiled: bool) -> None:
    if snapkv["enabled"] != compiled:
        raise schema.SchemaError("snapkv.enabled", f"{str(compiled).lower()} (the functions "
                                 f"{'hold' if compiled else 'lack'} the SnapKV ops)", snapkv["enabled"])
    settings = settings_from(defaults={}, env={}, **snapkv["defaults"])
    if settings.window > snapkv["max_window"]:
        raise schema.SchemaError("snapkv.defaults.window", f"at most max_window ({snapkv['max_window']})",
                                 settings.window)
    try:
        check_against(settings, settings.budget or 0, snapkv["max_window"])
    except ConfigError as exc:       # e.g. a default recency the default budget cannot hold
        raise schema.SchemaError("snapkv.defaults", "", snapkv["defaults"],
                                 f"snapkv.defaults: {str(exc).rstrip('.')}") from None


def _check_params(params: list) -> None:
    """Names unique; each entry's bytes what its shape and dtype need; laid out back to back at WEIGHT_ALIGN
    as write_weights writes them (the file's size is checked against the last one by the loader)."""
    end, seen = 0, set()
    for i, p in enumerate(params):
        where = f"params[{i}]"
        if p["name"] in seen:
            raise schema.SchemaError(f"{where}.name", "unique", p["name"])
        seen.add(p["name"])
        count = math.prod(p["shape"])
        if p["nbytes"] != count * PARAM_ITEMSIZE[p["dtype"]]:
            raise schema.SchemaError(f"{where}.nbytes", f"the bytes of shape {p['shape']} in {p['dtype']}",
                                     p["nbytes"])
        expected = end + (-end) % WEIGHT_ALIGN
        if p["offset"] != expected:
            raise schema.SchemaError(f"{where}.offset", f"{expected} (right after the previous parameter)",
                                     p["offset"])
        end = p["offset"] + p["nbytes"]


def weights_size(manifest: Manifest) -> int:
    """The size weights.bin has: the end of the last parameter."""
    last = manifest.params[-1] if manifest.params else None
    return last.offset + last.nbytes if last else 0
