"""One file's bytes under two names without two copies on disk: how a cached compile's weights reach an output
folder (sharpi.compile), so that the compile cache and the folder hold the model's weights once.

Written by hand because Python's standard library has no reflink: shutil.copy2 copies the bytes (copy_file_range
may clone them on some file systems, silently and not on ext4), and os.link gives a second name to one inode,
which an in-place edit through either name would change for both. The order:

1. a reflink (Linux's FICLONE ioctl: Btrfs, XFS, bcachefs, OCFS2, ...): a copy-on-write clone; from then on the two
   files are independent, so nothing done to one reaches the other.
2. a hard link, made read-only (its write bits cleared on the shared inode): a program that edits a read-only file
   writes a new one and renames it over, which breaks the link and leaves the other name as it was; an in-place
   write is refused to everyone but the superuser. Root can still write it in place, which changes both names:
   the compile cache therefore checks an entry's hashes before it hands it out (compile_cache.lookup), and a
   load checks an output folder's, so such a write is caught at both ends, never run on.
3. a plain copy, where neither works (another file system, FAT, a link count at its limit).
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:              # not on Windows: no reflinks there
    fcntl = None

FICLONE = 0x40049409             # _IOW(0x94, 9, int) of linux/fs.h: clone all of the source into the target
READ_ONLY = ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)

REFLINK, HARDLINK, COPY = "reflink", "hardlink", "copy"


def share_file(source: Path, target: Path) -> str:
    """Put `source`'s content at `target` (a new name, beside `source` or not) by the first of a reflink, a
    read-only hard link or a copy that the file systems allow; returns which (REFLINK, HARDLINK or COPY). A hard
    link leaves `source` read-only too: it is the same file."""
    if _reflink(Path(source), Path(target)):
        return REFLINK
    if _read_only_hard_link(Path(source), Path(target)):
        return HARDLINK
    shutil.copy2(source, target)
    return COPY


def _reflink(source: Path, target: Path) -> bool:
    """A copy-on-write clone of `source` at `target` (its mode and times copied, as copy2 would); False (and no
    `target`) where the file system or the platform has none, or the two are on different file systems."""
    if fcntl is None or not sys.platform.startswith("linux"):
        return False
    with open(source, "rb") as src, open(target, "xb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
            cloned = True
        except OSError:          # EOPNOTSUPP (ext4, tmpfs), EXDEV, EINVAL, ENOTTY: no clone here; a full disk
            cloned = False       # shows again in the copy
    if not cloned:
        target.unlink()
        return False
    shutil.copystat(source, target)
    return True


def _read_only_hard_link(source: Path, target: Path) -> bool:
    """`target` as a second name of `source`'s inode, whose write bits are cleared; False (and no `target`) where
    no link can be made (another file system, a link count at its limit, protected_hardlinks) or the mode cannot
    be changed (a writable shared inode would let an edit through one name reach the other)."""
    try:
        os.link(source, target)
    except OSError:
        return False
    try:
        os.chmod(target, stat.S_IMODE(os.stat(target).st_mode) & READ_ONLY)
    except OSError:
        target.unlink()
        return False
    return True
