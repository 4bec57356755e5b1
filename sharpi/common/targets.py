"""The targets sharpi compiles for, in one table: what each is called and what it is (a CPU or a GPU), which runtime
runs its artifacts, which compile options it takes, what its manifest entry looks like. (Which KV types it takes
is each KV codec's to say: kv_codecs' `unavailable`.)

This and sharpi/codegen/targets/ (one file per target: how it is lowered and built) are the only modules that name
a target; everything else asks this table. A new target is a TargetSpec here plus its file there (plus a runtime
backend where neither TVM's VM nor the wgpu plan runner can run it).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import schema
from .errors import ConfigError

TARGET_OPTIONS = ("mcpu", "matmuls", "arch", "cuda_graph")    # the CompileOptions fields some targets take alone


@dataclass(frozen=True)
class TargetSpec:
    name: str
    about: str                     # for --target's help
    device: str                    # "cpu" or "gpu" (the auto SnapKV budget and the conformance tolerances differ)
    runtime: str                   # "tvm-vm": TVM's Relax VM on tvm_device; "wgpu-plan": the plan on wgpu
    tvm_device: str | None         # "cpu" or "cuda" for the tvm-vm runtime
    options: tuple[str, ...]       # the TARGET_OPTIONS it takes
    manifest_entry: schema.Check   # the manifest's "target" object

    @property
    def is_gpu(self) -> bool:
        return self.device == "gpu"


_CPU_FEATURE = schema.text(32, r"[a-z0-9_.]+")
# the functions that take the weights their NAME_transform_params returns (codegen.vm_overhead)
_LIFTED = schema.array(schema.one_of("decode", "decode_batch"), 2, unique=True)
TARGETS = {spec.name: spec for spec in (
    TargetSpec(
        name="llvm", about="this CPU, or --mcpu", device="cpu", runtime="tvm-vm", tvm_device="cpu",
        options=("mcpu", "matmuls"),
        manifest_entry=schema.record({"kind": schema.one_of("llvm"), "mcpu": schema.text(64, r"[A-Za-z0-9_.+-]+"),
                                      "cpu_features": schema.array(_CPU_FEATURE, 64, unique=True),
                                      "matmuls": schema.one_of("float", "int8"),
                                      "int8_isa": schema.one_of("avx2", "avx-vnni", "avx512-vnni", "amx"),
                                      "lifted_params": _LIFTED},
                                     optional_keys=("int8_isa", "lifted_params"))),
    TargetSpec(
        name="cuda", about="NVIDIA GPUs; needs nvcc", device="gpu", runtime="tvm-vm", tvm_device="cuda",
        options=("arch", "cuda_graph"),
        manifest_entry=schema.record({"kind": schema.one_of("cuda"), "arch": schema.text(8, r"sm_[0-9]{2,3}a?"),
                                      "images": schema.array(schema.text(32, r"[a-z]+:[0-9]+"), 64),
                                      "cuda_graph": schema.boolean,
                                      "lifted_params": _LIFTED},
                                     optional_keys=("lifted_params",))),
    TargetSpec(
        name="vulkan", about="WGSL run through wgpu", device="gpu", runtime="wgpu-plan", tvm_device=None,
        options=(),
        manifest_entry=schema.record({"kind": schema.one_of("vulkan"), "shader": schema.one_of("wgsl"),
                                      "activations": schema.one_of("float32")})),
)}
DEFAULT_TARGET = "llvm"


def target_spec(name) -> TargetSpec:
    """The spec of a target by name, or a ConfigError listing the known ones."""
    if not isinstance(name, str) or name not in TARGETS:
        raise ConfigError(f"Unknown target {name!r}; choose one of {', '.join(TARGETS)}.")
    return TARGETS[name]


def targets_taking(option: str) -> list[str]:
    return [spec.name for spec in TARGETS.values() if option in spec.options]


def check_manifest_entry(value, path: str) -> None:
    """The manifest's "target": an object whose "kind" names a target and whose fields are that target's."""
    kind = value.get("kind") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in TARGETS:
        raise schema.SchemaError(f"{path}.kind", f"one of {', '.join(TARGETS)}", kind)
    TARGETS[kind].manifest_entry(value, path)
