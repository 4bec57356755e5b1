"""The compile cache: one artifact per (GGUF bytes, compile options, compiler source) under $SHARPI_HOME/cache.

A key changes with every compiler edit or upgrade, so without a bound the entries of old versions pile up (a
gemma3 CPU artifact is ~290 MB; a CI machine reached 9 GB in a day). After each new entry the least recently used
ones are deleted until the cache fits $SHARPI_CACHE_GB (default 5). An entry's directory mtime is its last use.

Sizes count each file once however many names it has (its device and inode): an output folder written from an
entry shares its weights and kernel library with it (common.file_share: a read-only hard link where the file system
has no reflinks), and those bytes are on the disk once. A new entry that alone is larger than the limit is kept as
the cache's only entry (the caller warns: see `over_limit`), so the model it holds still loads at once, until the
next compile needs the room.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from .common.errors import ArtifactError, ConfigError, SharpiWarning
from .common.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, verify_files
from .common.output_dir import abandoned
from .common.settings import sharpi_home
from .common.version import __version__

DEFAULT_LIMIT_GB = 5.0
MAX_LIMIT_GB = 1 << 20          # a PiB: a bound any disk fits in


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    nbytes: int
    last_used: float             # seconds since the epoch
    finished: bool = True        # False: the staging folder of a compile that was killed (no process holds it)
    shared: int = 0              # of nbytes, those of files also linked from elsewhere (an output folder)


def cache_root() -> Path:
    return sharpi_home() / "cache"


def code_fingerprint() -> str:
    """A hash of the compiler's own source, so a changed kernel or pass never reuses a stale cached compile (the
    runtime, CLI, test and evaluation code do not shape an artifact)."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.py") if not {"runtime", "cli", "testing", "eval"} & set(p.parts)):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def entry_dir(gguf_path: Path, gguf_sha256: str, options) -> Path:
    """Where the compile of this GGUF with these (resolved) CompileOptions is cached."""
    key = json.dumps({"gguf": gguf_sha256, "options": asdict(options), "sharpi": __version__,
                      "format": FORMAT_VERSION, "code": code_fingerprint()}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_root() / f"{gguf_path.stem}-{options.target}-{digest}"


def lookup(entry: Path) -> bool:
    """Whether `entry` holds a whole, unchanged cached compile: its manifest's digest and every file's sha256
    checked, so that a damaged entry (a shared weights file the superuser wrote in place through an output folder,
    a bad disk) is never copied into an output folder or loaded. A damaged one is deleted, with a warning, so the
    caller compiles it again."""
    if not (entry / MANIFEST_NAME).is_file():
        return False
    try:
        verify_files(entry, Manifest.read(entry))
    except (ArtifactError, OSError) as exc:
        reason = exc if isinstance(exc, ArtifactError) else f"{exc.filename}: {exc.strerror or exc}."
        warnings.warn(f"The compile cache's entry {entry.name} failed its check, so it was deleted and is compiled "
                      f"again: {reason}", SharpiWarning, stacklevel=2)
        shutil.rmtree(entry, ignore_errors=True)
        return False
    return True


def mark_used(entry: Path) -> None:
    try:
        os.utime(entry)
    except OSError:              # a read-only cache still serves its entries
        pass


def limit_bytes() -> int:
    """$SHARPI_CACHE_GB as bytes (a positive number of GiB; fractions allowed)."""
    value = os.environ.get("SHARPI_CACHE_GB")
    if value is None:
        return int(DEFAULT_LIMIT_GB * 2**30)
    try:
        gib = float(value)
    except ValueError:
        gib = float("nan")
    if not 0 < gib <= MAX_LIMIT_GB:
        raise ConfigError(f"SHARPI_CACHE_GB must be a positive number of GiB, in (0, {MAX_LIMIT_GB}], got {value!r}.")
    return int(gib * 2**30)


def entries(*, unfinished: bool = False) -> list[CacheEntry]:
    """The cached artifacts, least recently used first (folders the cache did not write are not listed); with
    unfinished, also the staging folders of compiles that were killed (a compile under way holds a lock on its
    folder and is never listed)."""
    root = cache_root()
    if not root.is_dir():
        return []
    found, seen = [], set()          # seen: the (device, inode) of every file counted, across the entries
    for path in root.iterdir():
        try:
            if path.is_dir() and (path / MANIFEST_NAME).is_file() and not path.name.startswith("."):
                found.append(_entry(path, seen))
            elif unfinished and path.name.startswith(".") and ".partial-" in path.name and abandoned(path):
                found.append(_entry(path, seen, finished=False))
        except OSError:            # removed meanwhile by another process
            continue
    return sorted(found, key=lambda e: e.last_used)


def prune(keep: Path, limit: int | None = None) -> list[CacheEntry]:
    """Delete least recently used entries (never `keep`) until the cache fits `limit` bytes, and staging folders
    of compiles that died; returns the entries deleted. An entry's files that an output folder shares stay there
    (a hard link is a name of its own; a reflink, a file of its own), and their bytes with them."""
    limit = limit_bytes() if limit is None else limit
    listed = entries(unfinished=True)
    removed = [e for e in listed if not e.finished]
    listed = [e for e in listed if e.finished]
    total = sum(e.nbytes for e in listed)
    for entry in listed:
        if total <= limit:
            break
        if entry.path == keep:
            continue
        removed.append(entry)
        total -= entry.nbytes
    for entry in removed:
        shutil.rmtree(entry.path, ignore_errors=True)
    return removed


def over_limit(entry: Path, limit: int) -> int | None:
    """The bytes of `entry` when it alone is larger than `limit` (prune kept it as the only entry), else None."""
    nbytes = _tree_bytes(entry, set())[0]
    return nbytes if nbytes > limit else None


def clear() -> list[CacheEntry]:
    """Delete every cached artifact and every killed compile's staging folder; returns what was deleted."""
    listed = entries(unfinished=True)
    for entry in listed:
        shutil.rmtree(entry.path, ignore_errors=True)
    return listed


def _entry(path: Path, seen: set, finished: bool = True) -> CacheEntry:
    nbytes, shared = _tree_bytes(path, seen)
    return CacheEntry(path, nbytes, path.stat().st_mtime, finished=finished, shared=shared)


def _tree_bytes(path: Path, seen: set) -> tuple[int, int]:
    """(bytes, of them those of files with more than one name) of the files under `path` not in `seen` (their
    (device, inode): a file with several names counts once), which it then holds too."""
    total = shared = 0
    for p in path.rglob("*"):
        try:
            st = p.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_size
        shared += st.st_size if st.st_nlink > 1 else 0
    return total, shared
