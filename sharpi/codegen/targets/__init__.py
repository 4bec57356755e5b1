"""One file per target (llvm.py, cuda.py, vulkan.py), each with a TARGET object (base.Target) for the name in
sharpi.common.targets' table; `target_for` finds it."""
from __future__ import annotations

import importlib

from ...common.targets import target_spec
from .base import Target


def target_for(name: str) -> Target:
    """The target object of a target name (a ConfigError for an unknown one); its module is imported only now, so
    compiling for the CPU never loads the CUDA toolchain's code."""
    spec = target_spec(name)
    return importlib.import_module(f"{__name__}.{spec.name}").TARGET
