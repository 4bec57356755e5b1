"""Writing sharpi's output folders (artifacts, ONNX exports) without ever touching a user's other files.

A folder may receive an output only if it does not exist, is empty, or holds an earlier output of the same kind:
one whose manifest parses as sharpi's, with sharpi's format marker. Then only the files that earlier manifest
lists (and the manifest) are replaced; every other file in the folder stays. Anything else (a web app's folder
with its own `manifest.json`, a folder of the user's files) is refused with one sentence before any work, and a
name the new output needs that the folder already holds as someone else's file is refused the same way.

The output is built in a staging folder beside the target and moved in file by file (renames within one file
system), the manifest last, so an interrupted move leaves no loadable mix of old and new; a failed move puts the
earlier output back.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import ConfigError

MAX_MANIFEST_BYTES = 16 << 20     # a real manifest is < 1 MB; a larger "manifest" is not ours (and is not read)


@dataclass(frozen=True)
class OutputKind:
    what: str                                            # "sharpi artifact", in messages
    manifest: str                                        # the manifest's file name
    listed_files: Callable[[dict], "list[str] | None"]   # the files a parsed manifest lists, None if not ours


def plain_file_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def read_json_object(path: Path) -> dict | None:
    """A JSON object from a file of at most MAX_MANIFEST_BYTES, or None (unreadable, too large, not JSON, not an
    object, nested too deeply for the parser)."""
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) else None


def earlier_output_files(output: Path, kind: OutputKind) -> list[str]:
    """The files of an earlier output of `kind` at `output` (its manifest included); [] if `output` does not exist
    or is an empty folder. Anything else is a ConfigError naming the folder; nothing is touched."""
    if not output.exists() and not output.is_symlink():
        above = next((p for p in output.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise ConfigError(f"{output} cannot be created: {above} is a file, not a folder; choose another output "
                              f"directory.")
        return []
    if not output.is_dir():
        raise ConfigError(f"{output} exists and is not a folder; choose another output directory.")
    try:
        if not any(output.iterdir()):
            return []
    except OSError as exc:
        raise ConfigError(f"{output} cannot be read ({exc.strerror or exc}); choose another output "
                          f"directory.") from None
    manifest = read_json_object(output / kind.manifest) if (output / kind.manifest).is_file() else None
    listed = kind.listed_files(manifest) if manifest is not None else None
    if listed is None or not all(plain_file_name(n) for n in listed):
        raise ConfigError(f"{output} is not empty and is not a {kind.what} (no {kind.manifest} of sharpi's); sharpi "
                          f"writes only into a new or empty folder or over an earlier {kind.what}: choose another "
                          f"output directory.")
    return sorted(set(listed) | {kind.manifest})


def check_output_dir(output: Path, kind: OutputKind, new_files=()) -> list[str]:
    """earlier_output_files, plus a refusal if a file the new output will write (`new_files`, as far as known)
    is in the folder but not part of the earlier output."""
    earlier = earlier_output_files(output, kind)
    foreign = sorted(n for n in new_files if n not in earlier and (output / n).exists())
    if foreign:
        raise ConfigError(f"{output} holds {', '.join(foreign)}, which the earlier {kind.what} there does not list "
                          f"and the new one would overwrite; move {'it' if len(foreign) == 1 else 'them'} away or "
                          f"choose another output directory.")
    return earlier


def staging_dir(output: Path) -> Path:
    """A fresh hidden folder beside `output` (same file system, so the final moves are renames)."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)       # mkdtemp's 0700 would become the output folder's mode
        return staging
    except OSError as exc:
        raise ConfigError(f"Cannot write into {output.parent}: {exc.strerror or exc}.") from None


@contextlib.contextmanager
def writing_into(staging: Path):
    """Hold an exclusive lock on `staging` while it is written, so that a cleanup can tell a compile under way
    from one that was killed (its lock is gone with its process)."""
    fd = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield staging
    finally:
        os.close(fd)


def abandoned(staging: Path, grace_s: float = 10.0) -> bool:
    """Whether a staging folder belongs to no running writer: older than `grace_s` (the writer locks it right
    after creating it) and its lock free."""
    try:
        if time.time() - staging.stat().st_mtime < grace_s:
            return False
        fd = os.open(staging, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def install(staging: Path, output: Path, kind: OutputKind) -> None:
    """Move the finished output in `staging` to `output`: as one rename where `output` is new or empty, else file
    by file over the earlier output's files (the manifest moved away first and in last); the other files of the
    folder stay. On failure the earlier output is put back. `staging` is gone afterwards either way."""
    names = sorted(p.name for p in staging.iterdir())
    if any(not (staging / n).is_file() or (staging / n).is_symlink() for n in names):
        raise AssertionError(f"{staging} should hold plain files only")
    try:
        earlier = check_output_dir(output, kind, names)
        if not earlier:
            if output.is_dir():
                output.rmdir()             # empty: the rename below puts the whole output in its place
            staging.rename(output)
            return
        first_out = [kind.manifest] + [n for n in earlier if n != kind.manifest]
        _replace_files(staging, output, first_out, [n for n in names if n != kind.manifest] + [kind.manifest])
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_files(staging: Path, output: Path, earlier: list[str], names: list[str]) -> None:
    """Move `earlier` (in order: its manifest first, so that while files move the folder is not a loadable
    output) into a hidden folder inside `output`, then `names` (the new manifest last) in from `staging`."""
    aside = Path(tempfile.mkdtemp(prefix=".sharpi-replaced-", dir=output))
    moved_aside, moved_in = [], []
    try:
        for name in earlier:
            if (output / name).exists() or (output / name).is_symlink():
                os.rename(output / name, aside / name)
                moved_aside.append(name)
        for name in names:                  # the new manifest last
            os.rename(staging / name, output / name)
            moved_in.append(name)
    except BaseException:
        for name in moved_in:
            with contextlib.suppress(OSError):
                os.unlink(output / name)
        for name in moved_aside:
            with contextlib.suppress(OSError):
                os.rename(aside / name, output / name)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)

