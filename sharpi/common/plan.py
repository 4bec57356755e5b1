"""The Vulkan artifact's plan (plan.json): what the wgpu runner (sharpi.runtime.plan_runner) replays, as the
vulkan target (sharpi.codegen.targets.vulkan) writes it. The format's one definition: both sides use this class.

Per Relax function, the ordered ops (storage allocations, views, kernel-calling PrimFunc calls) over named values;
per host PrimFunc, its kernel launches with their buffers, scalar arguments and grid as shape expressions
(sharpi.common.shape_expr); per device kernel, its WGSL file, entry point, workgroup size and bindings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from .errors import ArtifactError

PLAN_FILE = "plan.json"


class BufferSpec(TypedDict):
    name: str
    access: str                  # "read" or "read_write"
    dtype: str


class KernelSpec(TypedDict):
    wgsl: str                    # its file beside plan.json
    entry: str
    workgroup_size: list[int]
    buffers: list[BufferSpec]    # bound in this order, then one uniform of the POD arguments
    pod: list[dict]              # {"name", "wgsl": its WGSL scalar type}


class LaunchSpec(TypedDict):
    kernel: str
    buffer_args: list[int]       # indices into the PrimFunc's parameters
    pod_args: list[str]          # shape expressions
    launch: dict[str, str]       # launch parameter (blockIdx.x, threadIdx.x, ...) -> its extent


class PrimFuncSpec(TypedDict):
    params: list[str]
    lets: dict[str, str]         # name -> shape expression, in order
    launches: list[LaunchSpec]
    param_shapes: list           # per parameter its dims (shape expressions), or None for a scalar


class FunctionSpec(TypedDict):
    inputs: list[dict]           # {"name", "shape", "dtype"} or, for a tuple (the weights), {"name", "fields"}
    sym_vars: dict[str, list]    # symbolic dim -> [input index (, field), dim] where it is read from
    ops: list[dict]              # {"op": alloc_storage | alloc_tensor | view | alias | get_item | tuple | call, ...}
    output: str


@dataclass
class Plan:
    functions: dict[str, FunctionSpec] = field(default_factory=dict)
    prim_funcs: dict[str, PrimFuncSpec] = field(default_factory=dict)
    kernels: dict[str, KernelSpec] = field(default_factory=dict)
    contract: str | None = None  # the manifest's kernel contract (JSON) the plan was built for

    def to_json(self) -> dict:
        content = {"functions": self.functions, "prim_funcs": self.prim_funcs, "kernels": self.kernels}
        if self.contract is not None:
            content["contract"] = self.contract
        return content

    def write(self, directory: Path) -> None:
        (Path(directory) / PLAN_FILE).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def read(cls, directory: Path) -> "Plan":
        """plan.json of an artifact; ArtifactError if it cannot be read or is not a plan."""
        path = Path(directory) / PLAN_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise ArtifactError(f"{directory} has no readable {PLAN_FILE}: {exc}.") from None
        kinds = {"functions": dict, "prim_funcs": dict, "kernels": dict}
        if not isinstance(raw, dict) or any(not isinstance(raw.get(k), t) for k, t in kinds.items()) or \
                not isinstance(raw.get("contract", ""), str):
            raise ArtifactError(f"{path} is not a sharpi plan (functions, prim_funcs and kernels objects).")
        return cls(functions=raw["functions"], prim_funcs=raw["prim_funcs"], kernels=raw["kernels"],
                   contract=raw.get("contract"))
