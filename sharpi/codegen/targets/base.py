"""What every target's file provides to the compiler driver (sharpi.compiler): one small interface."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import tvm

from ...common.compile_options import CompileOptions
from ...common.config import ModelConfig
from ...common.targets import TargetSpec


class Target(Protocol):
    spec: TargetSpec
    code_files: tuple[str, ...]        # the artifact files of its code known before the build (the manifest's)

    def resolve(self, options: CompileOptions) -> CompileOptions:
        """The options with the target's defaults filled in (the CPU, the architecture, the KV type, ...), after
        the checks only the target can make (an unknown --mcpu, no nvcc): before any work, they are the compile's
        cache key."""

    def describe(self, options: CompileOptions) -> dict:
        """The manifest's "target" entry for resolved options (before the build)."""

    def sub_scales_for(self, options: CompileOptions) -> str:
        """Which K-quant matrices the kernels for resolved options read through their integer sub-scales
        (quant_layout's `ks` part, which the graph and artifact then hold in place of `s`): "all", "experts" (a
        mixture's expert matrices) or "none" (every K-quant keeps `s`, and `ks` is left out)."""

    def build(self, mod: tvm.IRModule, cfg: ModelConfig, options: CompileOptions, staging: Path, progress,
              contract: str) -> list[str]:
        """Lower and build the Relax module (after the IR passes) into `staging`, compiling `contract` (the
        manifest's kernel contract, JSON) into the code; `progress` a two-step bar. Returns the kernels' names."""

    def finish(self, staging: Path, target: dict) -> None:
        """Complete the manifest's target entry from what the build wrote (e.g. the CUDA images)."""


def kernel_names(mod: tvm.IRModule) -> list[str]:
    """The PrimFuncs of a lowered module: the artifact's kernel list."""
    return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
