"""Settings read from the environment, parsed strictly: a bad value is a ConfigError, never a silent default."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError


def sharpi_home() -> Path:
    """Where fetched models and the compile cache live ($SHARPI_HOME, default ~/.cache/sharpi)."""
    value = os.environ.get("SHARPI_HOME")
    if value is not None and not value.strip():
        raise ConfigError("SHARPI_HOME is set but empty; unset it or give it a directory.")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "sharpi"


def parse_positive_int(value, name: str, *, allow_zero: bool = False) -> int:
    """Parse an integer knob; `name` is how the user spelled it (a flag or an env var)."""
    try:
        number = int(str(value).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}.") from None
    lowest = 0 if allow_zero else 1
    if number < lowest:
        raise ConfigError(f"{name} must be >= {lowest}, got {number}.")
    return number


def env_int(name: str, *, allow_zero: bool = False) -> int | None:
    """An integer environment variable, or None when unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    return parse_positive_int(value, name, allow_zero=allow_zero)


def resolve_threads(threads: int | None) -> int:
    """Worker threads for CPU kernels: the argument, else SHARPI_NUM_THREADS, else the CPUs this process may use."""
    if threads is not None:
        return parse_positive_int(threads, "threads")
    from_env = env_int("SHARPI_NUM_THREADS")
    if from_env is not None:
        return from_env
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
