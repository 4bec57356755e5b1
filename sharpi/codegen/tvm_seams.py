"""The two places where sharpi changes TVM's own behaviour for the length of one build, because the wheel offers no
other hook (../shared/tvm-0.27/README.md). Each is set and restored by a context manager; nothing else in sharpi
assigns to a library's attributes.

- `device_module_capture`: the finalized device module of a WebGPU build (the WGSL kernels after every TIR pass),
  which the Vulkan plan needs and which `tvm.tirx.build` keeps to itself: its `codegen_build` is wrapped.
- `cuda_compiler`: TVM's global `tvm_callback_cuda_compile`, through which its CUDA codegen hands the generated
  CUDA C++ to a compiler; sharpi's nvcc callback builds one fatbin (SASS + PTX) instead of NVRTC's PTX.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def device_module_capture(target_kind: str) -> Iterator[dict]:
    """Within the block, the device module every `tvm.tirx.build` generates code for `target_kind` lands in the
    yielded dict under "device"."""
    build_module = sys.modules["tvm.tirx.build"]
    original = build_module.codegen_build
    captured: dict = {}

    def capture(mod, target):
        if target.kind.name == target_kind:
            captured["device"] = mod
        return original(mod, target)

    build_module.codegen_build = capture
    try:
        yield captured
    finally:
        build_module.codegen_build = original


@contextlib.contextmanager
def cuda_compiler(compile_cuda: Callable) -> Iterator[None]:
    """Within the block, TVM compiles generated CUDA C++ with `compile_cuda(code, target) -> bytes`; the callback
    registered before (if any) is put back after."""
    import tvm_ffi

    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", previous, override=True)
