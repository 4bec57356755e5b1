"""What one call of a compiled function costs the host, counted statically from the artifact: its kernel launches
and the Relax VM's builtin calls (views, tuple accesses, allocations, frees), one entry per instruction. A decode
step of a small model on a GPU is bound by these, not by the GPU's arithmetic (benchmarks/gpu.md).

cuda artifacts: the instructions of the function in the VM executable's bytecode (model.so, read with TVM's CUDA
runtime library; no GPU needed). vulkan artifacts: the launches of the function's plan (plan.json); the plan runner
has no VM, so it reports no builtins.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..common.manifest import LIBRARY, Manifest
from ..common.plan import Plan

_CALL = re.compile(r"^\s*call\s+(\S+)")
_HOST_CALLS = ("shape_func",)       # VMShapeLower's shape functions: host code, not kernels


@dataclass
class StepCount:
    kernels: Counter        # kernel -> launches a call
    builtins: Counter       # VM builtin -> calls a call

    def kernels_total(self) -> int:
        return sum(self.kernels.values())

    def builtins_total(self) -> int:
        return sum(self.builtins.values())

    def by_family(self) -> Counter:
        """Launches by kernel family: the name up to its first shape number (gpu_matmul_q4_1_576_576_1 ->
        gpu_matmul_q4_1)."""
        families = Counter()
        for name, count in self.kernels.items():
            families[re.sub(r"_\d.*$", "", name)] += count
        return families


def step_count(artifact: Path, function: str = "decode") -> StepCount:
    """The launches (and, on the Relax VM, builtin calls) of one call of `function` in a cuda or vulkan artifact."""
    kind = Manifest.read(artifact).target["kind"]
    if kind == "vulkan":
        return _plan_count(Plan.read(artifact), function)
    if kind == "cuda":
        return _bytecode_count(_vm_text(Path(artifact) / LIBRARY), function)
    raise ValueError(f"step counts are for cuda and vulkan artifacts; {artifact} targets {kind}")


def _vm_text(library: Path) -> str:
    """The executable's bytecode as text (VMExecutable.as_text)."""
    import tvm
    from tvm import relax

    from ..codegen.targets.cuda import ensure_cuda_runtime_library

    ensure_cuda_runtime_library()              # the library embeds a CUDA module: its loader must be registered
    return relax.VMExecutable(tvm.runtime.load_module(str(library))).as_text()


def _bytecode_count(text: str, function: str) -> StepCount:
    kernels, builtins = Counter(), Counter()
    inside = False
    for line in text.splitlines():
        if line.startswith("@"):
            inside = line.rstrip() == f"@{function}:"
            continue
        match = _CALL.match(line) if inside else None
        if match is None:
            continue
        callee = match.group(1)
        if "." in callee or callee.startswith(_HOST_CALLS):
            builtins[callee] += 1
        else:
            kernels[callee] += 1
    if not kernels and not builtins:
        raise ValueError(f"the executable has no function {function!r}")
    return StepCount(kernels, builtins)


def _plan_count(plan: Plan, function: str) -> StepCount:
    kernels = Counter()
    for op in plan.functions[function]["ops"]:
        if op["op"] == "call":
            for launch in plan.prim_funcs[op["func"]]["launches"]:
                kernels[launch["kernel"]] += 1
    return StepCount(kernels, Counter())
