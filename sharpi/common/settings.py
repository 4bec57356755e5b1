"""Settings read from the environment, parsed strictly: a bad value is a ConfigError, never a silent default."""
from __future__ import annotations

import numbers
import os
import re
from pathlib import Path

from .errors import ConfigError


def sharpi_home() -> Path:
    """Where fetched models and the compile cache live ($SHARPI_HOME, default ~/.cache/sharpi)."""
    value = os.environ.get("SHARPI_HOME")
    if value is not None and not value.strip():
        raise ConfigError("SHARPI_HOME is set but empty; unset it or give it a directory.")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "sharpi"


def home_folder(name: str) -> Path:
    """$SHARPI_HOME/name, created if needed; a SHARPI_HOME that is not a writable folder (a file, read-only, no
    permission) is a ConfigError naming it."""
    home = sharpi_home()
    folder = home / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise ConfigError(f"SHARPI_HOME ({home}) must be a folder sharpi can write to ({folder}: "
                          f"{exc.strerror or exc}); set SHARPI_HOME to another folder.") from None
    return folder


# Worker threads: TVM's pool starts one OS thread each, and more than this helps no CPU sharpi runs on.
MAX_THREADS = 1024
# The largest integer any count knob takes (int32 on the device; far more than any context or generation).
MAX_COUNT = 2**31 - 1


def parse_int(value, name: str, lo: int, hi: int, *, text: bool = True) -> int:
    """An integer knob in [lo, hi]: an integer (not a bool or a float) or, with `text`, a string of one (flags
    and env vars); `name` is how the user spelled it. Anything else is a ConfigError giving the range."""
    number = None if isinstance(value, str) and not text else _as_int(value)
    if number is None or not lo <= number <= hi:
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}.")
    return number


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        return int(text) if re.fullmatch(r"[+-]?[0-9]{1,40}", text) else None
    return int(value) if isinstance(value, numbers.Integral) else None


def parse_positive_int(value, name: str, *, allow_zero: bool = False, highest: int = MAX_COUNT) -> int:
    """An integer knob >= 1 (>= 0 with allow_zero) and <= highest."""
    return parse_int(value, name, 0 if allow_zero else 1, highest)


def env_int(name: str, *, allow_zero: bool = False, highest: int = MAX_COUNT) -> int | None:
    """An integer environment variable, or None when unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    return parse_positive_int(value, name, allow_zero=allow_zero, highest=highest)


def resolve_threads(threads: int | None) -> int:
    """Worker threads for CPU kernels: the argument, else SHARPI_NUM_THREADS, else the CPUs this process may use."""
    if threads is not None:
        return parse_positive_int(threads, "threads", highest=MAX_THREADS)
    from_env = env_int("SHARPI_NUM_THREADS", highest=MAX_THREADS)
    if from_env is not None:
        return from_env
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
