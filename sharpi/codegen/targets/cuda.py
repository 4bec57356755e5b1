"""The cuda target (NVIDIA GPUs): the GPU kernels (the same as Vulkan's: sharpi.codegen.kernels.gpu), TVM's generic GPU
passes (legalize, fuse, dlight's GPU rules with tensorization off: `sch.tensorize` crashes this wheel), CUDA C++
from TVM's codegen, and nvcc, which builds one fatbin per module holding SASS for the chosen architecture plus its
PTX, so newer GPUs JIT the PTX. The artifact is a Relax VM library that TVM's CUDA runtime loads on the GPU
machine; compiling needs nvcc, not a GPU.
"""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
from dataclasses import replace
from pathlib import Path

import tvm
from tvm import relax

from ...common.compile_options import CompileOptions, resolved_kv_types
from ...common.config import ModelConfig
from ...common.errors import CompileError, ConfigError
from ...common.manifest import LIBRARY
from ...common.settings import sharpi_home
from ...common.targets import TARGETS
from ...common.tvm_cuda import load_tvm_cuda_runtime
from ..artifact import with_contract
from ..attach_kernels import attach_kernels
from ..reproducible import relax_build_pipeline
from ..vm_overhead import LIFTED_FUNCTIONS, STATIC_FUNCTIONS, kills_except, lift_weight_work
from ..tvm_seams import cuda_compiler
from .base import kernel_names

DEFAULT_ARCH = "sm_80"
_ARCH = re.compile(r"sm_(\d{2,3})a?$")


def check_arch(arch: str) -> str:
    """`sm_XY` (compute capability X.Y, 5.0 or later), or a ConfigError naming the form."""
    m = _ARCH.match(str(arch))
    if not m or int(m.group(1)) < 50:
        raise ConfigError(f"--arch {arch!r} is not a CUDA architecture sharpi builds for; use sm_XY with XY >= 50 "
                          f"(sm_80 for A100, sm_89 for L4/RTX 40, sm_90 for H100/H200).")
    return arch


def make_target(arch: str) -> tvm.target.Target:
    # the host code only launches kernels: a generic x86-64 host runs on any GPU machine's CPU
    host = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"}
    # every CUDA GPU since sm_50 has these limits; said here, TVM does not warn (and assume) them per kernel
    limits = {"max_shared_memory_per_block": 49152, "max_threads_per_block": 1024, "thread_warp_size": 32}
    return tvm.target.Target({"kind": "cuda", "arch": check_arch(arch), **limits}, host=host)


def nvcc_path() -> str:
    path = shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))
    if path is None:
        raise CompileError("Compiling for cuda needs nvcc (the CUDA toolkit) on the PATH; no GPU is needed.")
    return path


def fatbin_flags(arch: str) -> list[str]:
    """nvcc -gencode pairs: SASS for `arch` and PTX of the same compute capability."""
    cc = arch[3:]
    return ["-gencode", f"arch=compute_{cc},code=sm_{cc}", "-gencode", f"arch=compute_{cc},code=compute_{cc}"]


# TVM's nvcc call adds --use_fast_math, whose approximate division (div.approx, up to 2 ulp) and square root would
# make the quantized KV cache's block scales (q8_0's max / 127, q4_ch's range / 15, TurboQuant's norm) and their
# reciprocals differ from the codecs' numpy rules now and then; IEEE division and square root keep the stores equal
# to the numpy emulation byte for byte, as on Vulkan. The rest of fast math (approximate exp, flushed subnormals,
# fused multiply-adds) stays.
NVCC_OPTIONS = ["--prec-div=true", "--prec-sqrt=true"]


# The driver entry points TVM's CUDA runtime library links against (nm -D --undefined-only); see
# ensure_cuda_runtime_library.
_DRIVER_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString", "cuLaunchKernelEx",
                   "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload", "cuTensorMapEncodeTiled")


def _driver_stub(directory: Path) -> Path:
    """A libcuda.so.1 whose every entry point returns CUDA_ERROR_NO_DEVICE, built once with the C compiler: the
    CUDA toolkit's stubs/ folder, which exists for exactly this, is missing from this toolkit."""
    stub = directory / "libcuda.so.1"
    if not stub.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        source = directory / "libcuda_stub.c"
        source.write_text("".join(f"int {name}(void) {{ return 100; }}\n" for name in _DRIVER_SYMBOLS))
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise CompileError("Compiling for cuda on a machine without an NVIDIA driver needs a C compiler (cc).")
        tmp = directory / f"libcuda.so.1.{id(source)}"
        subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(source)],
                       check=True, capture_output=True)
        tmp.rename(stub)
    return stub


def ensure_cuda_runtime_library() -> None:
    """Load TVM's CUDA runtime library, which registers the CUDA module type the codegen needs to embed compiled
    kernels: without it TVM keeps only the CUDA source and calls no compiler. The library links against the
    driver (libcuda.so.1); on a machine with no NVIDIA driver a stub stands in, which is never called, since
    nothing runs on a GPU here."""
    try:
        load_tvm_cuda_runtime()
    except OSError:
        try:
            load_tvm_cuda_runtime(driver=_driver_stub(sharpi_home() / "cuda-stub"))
        except OSError as exc:
            raise CompileError(f"Compiling for cuda needs TVM's CUDA runtime library: {exc}") from None


FATBIN_MAGIC = 0xBA55ED50


def fatbin_entries(blob: bytes) -> list[tuple[str, int]]:
    """(kind, architecture) of every image in the first CUDA fatbin inside `blob` (a library or a fatbin):
    ("elf", 80) is SASS for sm_80, ("ptx", 80) PTX for compute_80. Parsed from the fatbin container format
    (a 16-byte header, then entries with kind 1 = PTX, 2 = ELF at offset 0, architecture at offset 28)."""
    start = blob.find(struct.pack("<I", FATBIN_MAGIC))
    if start < 0:
        return []
    _, header, size = struct.unpack_from("<HHQ", blob, start + 4)
    offset, end, entries = start + header, start + header + size, []
    while offset + 32 <= end:
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", blob, offset)
        arch = struct.unpack_from("<I", blob, offset + 28)[0]
        entries.append(({1: "ptx", 2: "elf"}.get(kind, str(kind)), arch))
        offset += entry_header + payload
    return entries


# Workgroups per query head of a one-token step's attention (decode, and each sequence of decode_batch): its heads
# alone (9 for SmolLM2) leave most of a big GPU's multiprocessors (132 on an H200) idle while each walks thousands
# of slots; a split without slots costs next to nothing. Vulkan's (lavapipe, a CPU) keeps one workgroup a head.
DECODE_SPLITS = 32


def lower(mod: tvm.IRModule, cfg: ModelConfig, cuda_graph: bool = False,
          kv_types: tuple[str, str] | None = None) -> tvm.IRModule:
    mod = attach_kernels(mod, cfg, gpu=True, kv_types=kv_types, scale_prefixes=True, decode_splits=DECODE_SPLITS)
    mod = lift_weight_work(mod)
    if cuda_graph:
        mod = mark_decode_inputs_static(mod)
    return mod


def cuda_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's CUDA pipeline with KillAfterLastUse left out of STATIC_FUNCTIONS."""
    from tvm.relax.backend.cuda import pipeline as cuda_passes

    finalize = [kills_except(STATIC_FUNCTIONS) if p.info.name == "KillAfterLastUse" else p
                for p in cuda_passes.finalize_passes(target)]
    passes = (cuda_passes.library_dispatch_passes(target) + cuda_passes.legalize_passes(target)
              + cuda_passes.dataflow_lower_passes(target) + finalize)

    @tvm.transform.module_pass(opt_level=0, name="sharpi.CUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def mark_decode_inputs_static(mod: tvm.IRModule) -> tvm.IRModule:
    """Let TVM's RewriteCUDAGraph capture the whole decode step as one CUDA graph. It captures only kernels whose
    inputs are "static" (the same device buffers at every call): by default just the weights after `num_input`.
    With num_input = 0 every parameter counts as static, so the runtime must pass the same tensors at every decode
    call (it does: TVMBackend keeps persistent ids/positions/page-table/length buffers and copies each step's
    values into them). Only the lm_head, whose output is the function's result, stays outside the graph."""
    decode = mod.get_global_var("decode")
    mod.update_func(decode, mod[decode].with_attr("num_input", 0))
    return mod


def build(mod: tvm.IRModule, target: tvm.target.Target, library_path: Path, cuda_graph: bool = False) -> None:
    """Compile the Relax module for CUDA and export the VM library; CUDA sources go through nvcc (our callback,
    for the SASS + PTX fatbin) rather than NVRTC (which needs the cuda-bindings package). With cuda_graph, TVM's
    RewriteCUDAGraph lifts static regions (with mark_decode_inputs_static: all of decode) into captured graphs."""
    from tvm.support import nvcc

    arch = str(target.attrs["arch"])
    nvcc_path()
    ensure_cuda_runtime_library()

    def compile_fatbin(code, *_):
        return nvcc.compile_cuda(code, target_format="fatbin", arch=fatbin_flags(arch), options=NVCC_OPTIONS,
                                 compiler="nvcc")

    with cuda_compiler(compile_fatbin):
        with target, tvm.transform.PassContext(opt_level=3, config={"relax.backend.use_cuda_graph": cuda_graph}):
            # TVM's GPU pipeline plus the fix for its run-to-run different shape functions (codegen.reproducible)
            executable = tvm.compile(mod, target=target,
                                     relax_pipeline=relax_build_pipeline(target, cuda_pipeline(target)))
        executable.export_library(str(library_path))


class CUDATarget:
    spec = TARGETS["cuda"]
    code_files = (LIBRARY,)

    def resolve(self, options: CompileOptions) -> CompileOptions:
        if options.arch is not None:
            check_arch(options.arch)
        nvcc_path()                            # no nvcc: say so before any work
        return replace(options, arch=options.arch or DEFAULT_ARCH, **resolved_kv_types(options, "float16"))

    def sub_scales_for(self, options: CompileOptions) -> str:
        return "none"

    def describe(self, options: CompileOptions) -> dict:
        return {"kind": self.spec.name, "arch": options.arch, "images": [], "cuda_graph": options.cuda_graph,
                "lifted_params": list(LIFTED_FUNCTIONS)}

    def build(self, mod, cfg: ModelConfig, options: CompileOptions, staging: Path, progress, contract: str):
        target = make_target(options.arch)
        progress.set_postfix_str("attach GPU kernels")
        lowered = lower(mod, cfg, cuda_graph=options.cuda_graph, kv_types=options.kv_types)
        progress.update(1)
        progress.set_postfix_str("dlight schedules, CUDA codegen, nvcc")
        kernels = kernel_names(lowered)
        build(with_contract(lowered, contract), target, staging / LIBRARY, cuda_graph=options.cuda_graph)
        progress.update(1)
        return kernels

    def finish(self, staging: Path, target: dict) -> None:
        """The images the fatbin holds, read back from the library ("elf:90" is SASS for sm_90)."""
        target["images"] = [f"{kind}:{arch}" for kind, arch in fatbin_entries((staging / LIBRARY).read_bytes())]


TARGET = CUDATarget()
