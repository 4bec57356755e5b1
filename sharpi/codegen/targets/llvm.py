"""The llvm target: this CPU (or --mcpu). Attach sharpi's kernels (int8 integer-dot matmuls where the CPU has
AVX2, with AVX-512 VNNI's or AVX-VNNI's dot where it has one and a prefill GEMM on AMX tiles where the OS grants
them; float32 ones otherwise or with --matmuls float),
legalize the rest, fuse elementwise chains, schedule what is not hand-written (cpu_schedule), build one library
with the Relax VM's code and the kernels."""
from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import tvm
from tvm import relax

from ...common.compile_options import CompileOptions, resolved_kv_types
from ...common.config import ModelConfig
from ...common.cpu import usable_cpu_flags
from ...common.errors import ConfigError
from ...common.manifest import LIBRARY
from ...common.targets import TARGETS
from ..artifact import with_contract
from ..attach_kernels import attach_kernels
from ..cpu_schedule import fast_math_legalizations, schedule_generic
from ..reproducible import relax_build_pipeline
from ..vm_overhead import LIFTED_FUNCTIONS, lift_weight_work
from .base import kernel_names

# CPU features an artifact may need, by the name /proc/cpuinfo uses; LLVM's names map onto these.
_LLVM_TO_CPUINFO = {"sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
                    "bmi2": "bmi2", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl",
                    "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni",
                    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile",
                    "amx-int8": "amx_int8"}
# Features a CPU name may be extended by (`--mcpu NAME+amx-tile+amx-int8`): AMX's, which LLVM's name for a
# virtual machine's CPU can lack (the Xeon of 2026-12-03 reads as rocketlake) although the OS grants the tiles.
_EXTRA_FEATURES = ("amx-tile", "amx-int8")
_AMX_FLAGS = frozenset(_LLVM_TO_CPUINFO[feature] for feature in _EXTRA_FEATURES)   # what the AMX GEMM needs


@functools.cache
def host_cpu() -> str:
    """LLVM's name for this CPU, with AMX's features added where the OS grants the tiles and the name lacks them."""
    name = str(tvm.target.codegen.llvm_get_system_cpu())
    if _AMX_FLAGS <= usable_cpu_flags() and not _AMX_FLAGS <= set(required_cpu_features(make_target(name))):
        name += "".join(f"+{feature}" for feature in _EXTRA_FEATURES)
    return name


def make_target(mcpu: str | None) -> tvm.target.Target:
    """The LLVM target for a CPU name, optionally extended by features (`NAME+amx-tile+amx-int8`; default: this
    machine's); an unknown name is a ConfigError, not LLVM's silent fallback to generic x86-64."""
    triple = "x86_64-linux-gnu"
    if mcpu is None:
        mcpu = host_cpu()
    name, *extra = mcpu.split("+")
    known = [str(c) for c in tvm.target.codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm",
                                                                                       "mtriple": triple}))]
    if name not in known:
        close = ", ".join(sorted(c for c in known if c.startswith(name[:3]))[:8]) or ", ".join(known[:8])
        raise ConfigError(f"--mcpu {name!r} is not a CPU LLVM knows; for example: {close}.")
    unknown = [feature for feature in extra if feature not in _EXTRA_FEATURES]
    if unknown:
        raise ConfigError(f"--mcpu {mcpu!r}: a CPU name may be extended by {', '.join(_EXTRA_FEATURES)} only, not "
                          f"{', '.join(unknown)}.")
    spec = {"kind": "llvm", "mtriple": triple, "mcpu": name}
    if extra:
        spec["mattr"] = [f"+{feature}" for feature in extra]
    return tvm.target.Target(spec)


def cpu_name(target: tvm.target.Target) -> str:
    """The --mcpu that makes `target` again: its CPU name and any features added to it."""
    extra = [str(a).lstrip("+") for a in target.attrs.get("mattr", [])]
    return "+".join([str(target.attrs["mcpu"]), *extra])


def required_cpu_features(target: tvm.target.Target) -> list[str]:
    """The /proc/cpuinfo flags the code built for `target` relies on."""
    try:
        features = tvm.target.codegen.llvm_get_cpu_features(target)
    except Exception:  # older or newer wheels spell this differently; then the mcpu alone is recorded
        return []
    names = {str(f) for f in features}
    return sorted(flag for llvm_name, flag in _LLVM_TO_CPUINFO.items() if llvm_name in names)


def int8_dot_isa(target: tvm.target.Target) -> str | None:
    """The best instruction set for the integer-dot matmuls that code built for `target` may use: "amx" (the
    prefill GEMM on AMX tiles, quant_matmul_amx; the decode GEMV AVX-512 VNNI's), "avx512-vnni" (512-bit
    vpdpbusd), "avx-vnni" (its 256-bit form without AVX-512), "avx2" (vpmaddubsw + vpmaddwd), or None. Code for
    AMX loads only where the OS grants the tiles (sharpi.common.cpu.amx_granted, the loader's CPU check)."""
    features = set(required_cpu_features(target))
    if {"avx512_vnni", "avx512bw", "avx512vl"} <= features:
        return "amx" if _AMX_FLAGS <= features else "avx512-vnni"
    if {"avx_vnni", "avx2"} <= features:
        return "avx-vnni"
    return "avx2" if "avx2" in features else None


def int8_dot_available(target: tvm.target.Target) -> bool:
    """Whether the integer-dot matmuls (x86 AVX2 at least) can be built for `target`."""
    return int8_dot_isa(target) is not None


def lower(mod: tvm.IRModule, cfg: ModelConfig, target: tvm.target.Target, int8_isa: str | None = None,
          kv_types: tuple[str, str] | None = None) -> tvm.IRModule:
    """int8_isa: the quantized matmuls multiply int8-quantized activations with this instruction set's integer
    dots (int8_dot_isa); None: the float kernels. kv_types: the KV cache's (keys', values') types (None: the
    pool's element type for both)."""
    with target:
        mod = lift_weight_work(attach_kernels(mod, cfg, int8_isa=int8_isa, kv_types=kv_types))
        mod = relax.transform.LegalizeOps(fast_math_legalizations())(mod)
        mod = relax.transform.AnnotateTIROpPattern()(mod)
        mod = relax.transform.FuseOps()(mod)
        mod = relax.transform.FuseTIR()(mod)
        mod = relax.transform.DeadCodeElimination()(mod)
        mod = schedule_generic(mod, target)
    return mod


def build_executable(mod: tvm.IRModule, target: tvm.target.Target):
    # TVM's default Relax pipeline plus the fix for its run-to-run different shape functions (codegen.reproducible)
    with tvm.transform.PassContext(opt_level=3, config={"tirx.disable_cse_tir": True}):
        return tvm.compile(mod, target=target, relax_pipeline=relax_build_pipeline(target))


def build(mod: tvm.IRModule, target: tvm.target.Target, library_path: Path) -> None:
    build_executable(mod, target).export_library(str(library_path))


class LLVMTarget:
    spec = TARGETS["llvm"]
    code_files = (LIBRARY,)

    def resolve(self, options: CompileOptions) -> CompileOptions:
        target = make_target(options.mcpu)    # an unknown --mcpu fails here, before any hashing or compiling
        has_int8_dot = int8_dot_available(target)
        if options.matmuls == "int8" and not has_int8_dot:
            raise ConfigError(f"--matmuls int8 needs x86 AVX2, which {target.attrs['mcpu']} does not have; use "
                              f"--matmuls float.")
        matmuls = options.matmuls or ("int8" if has_int8_dot else "float")
        # llama.cpp's arithmetic is int8 activations and an f16 KV cache: half the cache's memory, and decode and
        # prefill after 4096 tokens ~9% faster (their K/V reads are bound by memory bandwidth); --matmuls float
        # keeps the exact float32 path, KV included
        kv_types = resolved_kv_types(options, "float16" if matmuls == "int8" else "float32")
        return replace(options, mcpu=options.mcpu or host_cpu(), matmuls=matmuls, **kv_types)

    def describe(self, options: CompileOptions) -> dict:
        target = make_target(options.mcpu)
        entry = {"kind": self.spec.name, "mcpu": cpu_name(target),
                 "cpu_features": required_cpu_features(target), "matmuls": options.matmuls,
                 "lifted_params": list(LIFTED_FUNCTIONS)}
        if options.matmuls == "int8":
            entry["int8_isa"] = int8_dot_isa(target)
        return entry

    def sub_scales_for(self, options: CompileOptions) -> str:
        """Which K-quants read `ks` (~1.03x the GGUF's bytes where `s` is ~1.3x): on AVX2 and AMX all of them
        (quant_matmul_q8k's kernels; a prompt's through quant_matmul_amx on AMX, whose tiles rebuild the per-32
        scales as they unpack); with AVX-VNNI or AVX-512 alone the dense ones read `s` (their 512-bit prompt GEMM
        is faster than the AVX2 q8k one) and a mixture's experts `ks`, which is what lets a 30B-A3B fit in 24 GB."""
        isa = int8_dot_isa(make_target(options.mcpu)) if options.matmuls == "int8" else None
        return "all" if isa in ("avx2", "amx") else "experts" if isa is not None else "none"

    def build(self, mod, cfg: ModelConfig, options: CompileOptions, staging: Path, progress, contract: str):
        target = make_target(options.mcpu)
        progress.set_postfix_str("attach kernels, legalize, fuse")
        lowered = lower(mod, cfg, target, int8_isa=int8_dot_isa(target) if options.matmuls == "int8" else None,
                        kv_types=options.kv_types)
        progress.update(1)
        progress.set_postfix_str("LLVM codegen")
        kernels = kernel_names(lowered)
        build(with_contract(lowered, contract), target, staging / LIBRARY)
        progress.update(1)
        return kernels

    def finish(self, staging: Path, target: dict) -> None:
        pass


TARGET = LLVMTarget()

