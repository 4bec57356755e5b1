"""The compiler driver: frontend -> ir_passes -> codegen, with a compile cache.

Compiles are cached under $SHARPI_HOME/cache (compile_cache: keyed by the GGUF's sha256, the resolved options and
the compiler's source; bounded by $SHARPI_CACHE_GB); a cached compile is copied to the output directory.
"""
from __future__ import annotations

import contextlib
import errno
import math
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from . import compile_cache
from .common.errors import ConfigError, SharpiWarning
from .common.manifest import (ARTIFACT, FORMAT_VERSION, LIBRARY, MANIFEST_NAME, PLAN, TOKENIZER, WEIGHTS, Manifest,
                              contract_json, file_sha256)
from .common.output_dir import check_output_dir, install, staging_dir, writing_into
from .common.ops import PAGE_SIZE, SELECT_PARAMS
from .common.settings import home_folder, parse_positive_int
from .common.version import __version__

TARGETS = ("llvm", "cuda", "vulkan")
KV_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}    # --kv-dtype names -> element types
MATMULS = ("float", "int8")
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class CompileOptions:
    target: str = "llvm"
    mcpu: str | None = None
    arch: str | None = None                  # cuda: sm_XY
    cuda_graph: bool = False                 # cuda: decode replays one captured CUDA graph
    matmuls: str | None = None               # llvm: "int8" (int8 activations, integer dots) or "float"; None:
                                             # int8 where the CPU has AVX2
    kv_dtype: str = "float32"                # the KV page pool's element type
    max_context: int | None = None
    snapkv: str = "on"                       # whether the SnapKV ops are compiled in
    snapkv_explicit: bool = False            # snapkv was asked for (not the default)
    snapkv_defaults: tuple = ()              # (name, value) pairs: the artifact's run-time defaults

    def snapkv_settings(self):
        from .common.snapkv_settings import settings_from
        return settings_from(env={}, **dict(self.snapkv_defaults))

    def validate(self) -> None:
        if self.snapkv not in ("on", "off"):
            raise ConfigError(f"--snapkv must be 'on' or 'off', got {self.snapkv!r}.")
        settings = self.snapkv_settings()
        from .common.snapkv_settings import check_against
        check_against(settings, settings.budget or 0, settings.window)
        if self.target not in TARGETS:
            raise ConfigError(f"Unknown target {self.target!r}; choose one of {', '.join(TARGETS)}.")
        if self.target != "llvm" and self.mcpu is not None:
            raise ConfigError("--mcpu applies to the llvm target only.")
        if self.arch is not None:
            if self.target != "cuda":
                raise ConfigError("--arch applies to the cuda target only.")
            from .codegen.cuda import check_arch
            check_arch(self.arch)
        if self.cuda_graph and self.target != "cuda":
            raise ConfigError("--cuda-graph applies to the cuda target only.")
        if self.matmuls is not None and self.matmuls not in MATMULS:
            raise ConfigError(f"--matmuls must be one of {', '.join(MATMULS)}, got "
                              f"{self.matmuls!r}.")
        if self.matmuls == "int8" and self.target != "llvm":
            raise ConfigError("--matmuls int8 applies to the llvm target only.")
        if self.kv_dtype not in KV_DTYPES.values():
            raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}.")
        if self.kv_dtype == "bfloat16" and self.target == "vulkan":
            raise ConfigError("--kv-dtype bf16 is not available on the vulkan target (WGSL has no bfloat16); "
                              "use f16 or f32.")
        if self.max_context is not None:
            parse_positive_int(self.max_context, "--max-context")


def compile(model: str | Path, target: str = "llvm", output: str | Path | None = None, *, mcpu: str | None = None,
            arch: str | None = None, cuda_graph: bool = False, matmuls: str | None = None, kv_dtype: str | None = None,
            max_context: int | None = None,
            snapkv: str | bool | None = None, snapkv_budget=None, snapkv_window=None, snapkv_recency=None,
            snapkv_pooling=None, snapkv_kernel=None, snapkv_granularity=None, snapkv_sinks=None,
            dump_ir: str | Path | None = None, use_cache: bool = True, show_progress: bool = False,
            emit: str | None = None) -> Path:
    """Compile a GGUF (path or known model name) into an artifact directory; returns its path.

    target: llvm (mcpu: the CPU, default this one; matmuls: "int8" (the default where the CPU has AVX2):
    the quantized matmuls multiply int8-quantized activations with integer dot products as llama.cpp does, or
    "float": float32 throughout, exact to the numpy reference), vulkan, or cuda (arch: sm_XY, default sm_80;
    cuda_graph: decode as one captured CUDA graph); kv_dtype: the KV cache's element type, "f32", "f16" or "bf16"
    (not on vulkan; default f16 for cuda and for llvm with int8 matmuls, else f32).

    snapkv decides whether the SnapKV ops exist; snapkv_window is also the largest window allowed at run time;
    the other snapkv_* values become the artifact's run-time defaults. dump_ir writes the Relax IR after the
    passes (before kernels are attached) to a file. emit="onnx" exports ONNX graphs instead (export_onnx; the
    target options do not apply)."""
    if emit is not None:                   # issue #9: ONNX interchange
        if emit != "onnx":
            raise ConfigError(f"emit must be 'onnx' (or None for a compiled artifact), got {emit!r}.")
        used = [name for name, on in (("target", target != "llvm"), ("mcpu", mcpu), ("arch", arch),
                                      ("cuda_graph", cuda_graph),
                                      ("matmuls", matmuls is not None),
                                      ("kv_dtype", kv_dtype)) if on]
        if used:
            raise ConfigError(f"{', '.join(used)} {'does' if len(used) == 1 else 'do'} not apply to emit='onnx'.")
        return export_onnx(model, output, max_context=max_context, snapkv=snapkv, snapkv_budget=snapkv_budget,
                           snapkv_window=snapkv_window, snapkv_recency=snapkv_recency, snapkv_pooling=snapkv_pooling,
                           snapkv_kernel=snapkv_kernel, snapkv_granularity=snapkv_granularity,
                           snapkv_sinks=snapkv_sinks, dump_ir=dump_ir, show_progress=show_progress)
    from .frontend.fetch import resolve_model
    from .frontend.gguf_file import GGUFFile

    snapkv_fields = _snapkv_fields(snapkv, budget=snapkv_budget, window=snapkv_window, recency=snapkv_recency,
                                   pooling=snapkv_pooling, kernel=snapkv_kernel, granularity=snapkv_granularity,
                                   sinks=snapkv_sinks)
    kv_default = kv_dtype is None
    if kv_default:                         # f16 on CUDA GPUs, f32 elsewhere (Vulkan: f32 until measured); on the
        kv_dtype = "f16" if target == "cuda" else "f32"   # CPU, f16 with int8 matmuls (resolved below)
    options = CompileOptions(target=target, mcpu=mcpu, arch=arch, cuda_graph=bool(cuda_graph),
                             matmuls=matmuls, kv_dtype=KV_DTYPES.get(kv_dtype, kv_dtype),
                             max_context=max_context, **snapkv_fields)
    options.validate()
    gguf_path = resolve_model(model, show_progress=show_progress)
    output = Path(output) if output is not None else Path(gguf_path.stem + f"-{target}")
    check_output_dir(output, ARTIFACT, _artifact_files(target))    # before any work: never a user's files
    resolved = options
    if target == "llvm":
        from .codegen.llvm import host_cpu, int8_dot_available, make_target
        llvm_target = make_target(mcpu)    # an unknown --mcpu fails here, before any hashing or compiling
        has_int8_dot = int8_dot_available(llvm_target)
        if matmuls == "int8" and not has_int8_dot:
            raise ConfigError(f"--matmuls int8 needs x86 AVX2, which {llvm_target.attrs['mcpu']} does not "
                              f"have; use --matmuls float.")
        resolved = replace(options, mcpu=mcpu or host_cpu(),
                           matmuls=matmuls or ("int8" if has_int8_dot else "float"))
        if kv_default and resolved.matmuls == "int8":
            # llama.cpp's arithmetic is int8 activations and an f16 KV cache: half the cache's memory, and decode
            # and prefill after 4096 tokens ~9% faster (their K/V reads are bound by memory bandwidth);
            # --matmuls float keeps the exact float32 path, KV included
            resolved = replace(resolved, kv_dtype=KV_DTYPES["f16"])
    elif target == "cuda":
        from .codegen.cuda import DEFAULT_ARCH, nvcc_path
        nvcc_path()                        # no nvcc: say so before any work
        resolved = replace(options, arch=arch or DEFAULT_ARCH)
    if use_cache:
        home_folder("cache")               # SHARPI_HOME unusable: one sentence now, not after the compile
    gguf_sha256 = file_sha256(gguf_path)   # the cache key needs only the bytes, not a parse of the GGUF
    cached = compile_cache.entry_dir(gguf_path, gguf_sha256, resolved) if use_cache else None
    if cached is not None and (cached / MANIFEST_NAME).is_file() and dump_ir is None:
        _log(show_progress, f"sharpi: using the cached compile {cached.name}")
        compile_cache.mark_used(cached)
        _copy_artifact(cached, output)
        return output
    # the cache's bound, read once: a bad SHARPI_CACHE_GB fails now, not after the compile
    limit = compile_cache.limit_bytes() if cached is not None else None
    gguf = GGUFFile(gguf_path)
    built = _compile_uncached(gguf, gguf_sha256, resolved, output if cached is None else cached, show_progress,
                              dump_ir)
    if cached is not None:
        _copy_artifact(built, output)
        for entry in compile_cache.prune(keep=cached, limit=limit):
            _log(show_progress, f"sharpi: compile cache over {limit / 2**30:g} GiB "
                                f"(SHARPI_CACHE_GB); deleted the least recently used {entry.path.name}")
    return output


def _compile_uncached(gguf, gguf_sha256: str, options: CompileOptions, output: Path, show_progress: bool,
                      dump_ir: str | Path | None = None) -> Path:
    from .codegen import artifact
    from .common.tokenizer import build_from_gguf_metadata
    from .frontend.config import config_from_gguf
    from .frontend.architectures import frontend_for

    started = time.perf_counter()
    cfg = config_from_gguf(gguf)
    max_context = _max_context(options, cfg)
    tokenizer, tok_info = build_from_gguf_metadata(gguf.metadata)
    load_weights, builder = frontend_for(cfg)
    options = _without_snapkv_if_all_local(options, cfg, show_progress)
    weights = load_weights(gguf, cfg, show_progress)
    _warn_non_finite(weights, gguf.path.name)
    max_pages = math.ceil(max_context / PAGE_SIZE)
    mod = builder(cfg, weights, max_pages, kv_dtype=options.kv_dtype).build()
    functions = ["prefill", "prefill_logits", "decode"]
    settings = options.snapkv_settings()
    if options.snapkv == "on":
        from .ir_passes.snapkv import SNAPKV_FUNCTIONS, snapkv_pass
        mod = snapkv_pass(mod)
        functions += list(SNAPKV_FUNCTIONS)
    if dump_ir is not None:
        _write_ir(dump_ir, mod)
    from .common.progress import progress_bar
    staging = staging_dir(output)
    with _writing(staging, output):
        # the weights first: the kernel contract compiled into the library names every parameter
        params = artifact.write_weights(weights.arrays, weights.names, staging / WEIGHTS)
        tokenizer.save(staging)
        manifest = Manifest(
            format_version=FORMAT_VERSION, sharpi_version=__version__,
            source={"name": gguf.path.name, "sha256": gguf_sha256, "size": gguf.path.stat().st_size},
            config=cfg.to_dict(), target=_target_info(options),
            tokenizer=tok_info.to_dict(), page_size=PAGE_SIZE, max_context=max_context, max_pages=max_pages,
            prefill_chunk=PREFILL_CHUNK, functions=functions, kernels=[], params=params,
            snapkv={"enabled": options.snapkv == "on", "max_window": settings.window,
                    "defaults": settings.to_dict(), "select_params": SELECT_PARAMS}, kv_dtype=options.kv_dtype)
        contract = contract_json(manifest.kernel_contract())
        with progress_bar(2, "compiling", show_progress, unit="step") as bar:
            build = {"vulkan": _build_vulkan, "cuda": _build_cuda}.get(options.target, _build_llvm)
            manifest.kernels = build(mod, cfg, options, staging, bar, contract)
        if options.target == "cuda":       # what the fatbin holds, read back from the build
            manifest.target["images"] = [f"{kind}:{arch}" for kind, arch in
                                         _cuda_images(staging / LIBRARY)]
        artifact.finalize(staging, output, manifest)
    detail = {"llvm": f" (mcpu {manifest.target.get('mcpu')})", "cuda": f" ({manifest.target.get('arch')})"}.get(
        options.target, "")
    _log(show_progress, f"sharpi: compiled {gguf.path.name} for {options.target}{detail} in "
                        f"{time.perf_counter() - started:.1f} s -> {output}")
    return output


def export_onnx(model: str | Path, output: str | Path | None = None, *, weights: str = "f32",
                functions=None, max_context: int | None = None, snapkv: str | bool | None = None,
                snapkv_budget=None, snapkv_window=None, snapkv_recency=None, snapkv_pooling=None, snapkv_kernel=None,
                snapkv_granularity=None, snapkv_sinks=None, dump_ir: str | Path | None = None,
                show_progress: bool = False) -> Path:
    """Export a GGUF (path or known model name) as ONNX graphs into a directory; returns its path (issue #9).

    The same Relax module the targets compile (SnapKV pass included) is translated to ONNX, binding by binding
    (sharpi.codegen.onnx_export): prefill.onnx and decode.onnx (functions may add "prefill_logits"), plus
    prefill_snapkv.onnx (score, select and compact after the prompt) unless snapkv is off; weights f32 or f16 in
    one shared weights.onnx.data; sharpi-onnx.json records the graphs' signatures; tokenizer.json the tokenizer."""
    from .codegen import onnx_export
    from .common.tokenizer import build_from_gguf_metadata
    from .frontend.architectures import frontend_for
    from .frontend.config import config_from_gguf
    from .frontend.fetch import resolve_model
    from .frontend.gguf_file import GGUFFile

    started = time.perf_counter()
    options = CompileOptions(max_context=max_context, **_snapkv_fields(
        snapkv, budget=snapkv_budget, window=snapkv_window, recency=snapkv_recency, pooling=snapkv_pooling,
        kernel=snapkv_kernel, granularity=snapkv_granularity, sinks=snapkv_sinks))
    options.validate()
    if weights not in onnx_export.WEIGHT_DTYPES:
        raise ConfigError(f"ONNX weights must be one of {', '.join(onnx_export.WEIGHT_DTYPES)}, got {weights!r}.")
    gguf_path = resolve_model(model, show_progress=show_progress)
    output = Path(output) if output is not None else Path(gguf_path.stem + "-onnx")
    check_output_dir(output, onnx_export.EXPORT, [onnx_export.WEIGHTS_FILE, TOKENIZER, onnx_export.EXPORT_FILE])
    gguf = GGUFFile(gguf_path)
    cfg = config_from_gguf(gguf)
    if cfg.arch not in onnx_export.ARCHITECTURES:
        from .common.errors import UnsupportedArchitectureError
        raise UnsupportedArchitectureError(f"ONNX export does not support the {cfg.arch} architecture yet "
                                           f"(supported: {', '.join(onnx_export.ARCHITECTURES)}).")
    max_context = _max_context(options, cfg)
    options = _without_snapkv_if_all_local(options, cfg, show_progress)
    load_weights, builder = frontend_for(cfg)
    table = load_weights(gguf, cfg, show_progress)
    _warn_non_finite(table, gguf.path.name)
    mod = builder(cfg, table, math.ceil(max_context / PAGE_SIZE), kv_dtype="float32").build()
    settings = options.snapkv_settings()
    if functions is None:
        functions = list(onnx_export.DEFAULT_FUNCTIONS) + (["prefill_snapkv"] if options.snapkv == "on" else [])
    if options.snapkv == "on":
        from .ir_passes.snapkv import snapkv_pass
        mod = snapkv_pass(mod)
    if dump_ir is not None:
        _write_ir(dump_ir, mod)
    staging = staging_dir(output)
    with _writing(staging, output):
        _log(show_progress, "sharpi: translating the Relax module to ONNX")
        signature = onnx_export.export_module(mod, cfg, table, staging, functions=tuple(functions),
                                              snapkv_settings=settings, weight_dtype=weights,
                                              metadata={"sharpi.source": gguf.path.name})
        tokenizer, tok_info = build_from_gguf_metadata(gguf.metadata)
        tokenizer.save(staging)
        onnx_export.write_export_manifest(
            staging, signature, sharpi_version=__version__, weights_dtype=weights,
            source={"name": gguf.path.name, "sha256": file_sha256(gguf_path)}, config=cfg.to_dict(),
            tokenizer=tok_info.to_dict(), snapkv={"enabled": options.snapkv == "on", "defaults": settings.to_dict()})
        install(staging, output, onnx_export.EXPORT)
    _log(show_progress, f"sharpi: exported {gguf.path.name} to ONNX ({', '.join(functions)}) in "
                        f"{time.perf_counter() - started:.1f} s -> {output}")
    return output


def _snapkv_fields(snapkv, **defaults) -> dict:
    """CompileOptions' SnapKV fields from compile()'s arguments: snapkv on (the default) or off, whether it was
    asked for, and the given run-time defaults."""
    return {"snapkv": {True: "on", False: "off", None: "on"}.get(snapkv, snapkv), "snapkv_explicit": snapkv is not None,
            "snapkv_defaults": tuple((k, v) for k, v in defaults.items() if v is not None)}


def _warn_non_finite(weights, name: str) -> None:
    """Compiled anyway (the file may be what the user wants to study), but its logits will not be finite."""
    bad = weights.non_finite
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        warnings.warn(f"{name}: {len(bad)} tensor{'s' if len(bad) > 1 else ''} hold NaN or infinite values ({shown}): "
                      f"the model's logits will not be finite, and running it will stop with an error.",
                      SharpiWarning, stacklevel=3)


def _max_context(options: CompileOptions, cfg) -> int:
    max_context = options.max_context or cfg.context_length
    if max_context > cfg.context_length:
        raise ConfigError(f"--max-context {max_context} exceeds the model's context of {cfg.context_length}.")
    return max_context


def _without_snapkv_if_all_local(options: CompileOptions, cfg, show_progress: bool) -> CompileOptions:
    """A model whose every layer has a sliding window holds only that window: SnapKV has nothing to evict, so
    it is left out (and asking for it is an error)."""
    if options.snapkv != "on" or not all(cfg.is_local(l) for l in range(cfg.n_layers)):
        return options
    message = (f"every layer of this {cfg.arch} model attends within a sliding window of {cfg.sliding_window} "
               f"and so holds only that window: SnapKV has nothing to evict")
    if options.snapkv_explicit:
        raise ConfigError(f"{message[0].upper()}{message[1:]}; use --snapkv off.")
    _log(show_progress, f"sharpi: {message}; going on without it")
    return replace(options, snapkv="off")


def _artifact_files(target: str) -> list[str]:
    """The files an artifact for `target` is known to hold before it is built (Vulkan adds a .wgsl per kernel)."""
    return [PLAN if target == "vulkan" else LIBRARY, WEIGHTS, TOKENIZER, MANIFEST_NAME]


def _target_info(options: CompileOptions) -> dict:
    """The manifest's target: what the kernels are built for (the CUDA images are added once they exist)."""
    if options.target == "llvm":
        from .codegen.llvm import make_target, required_cpu_features
        target = make_target(options.mcpu)
        return {"kind": "llvm", "mcpu": str(target.attrs["mcpu"]), "cpu_features": required_cpu_features(target),
                "matmuls": options.matmuls}
    if options.target == "cuda":
        return {"kind": "cuda", "arch": options.arch, "images": [], "cuda_graph": options.cuda_graph}
    return {"kind": "vulkan", "shader": "wgsl", "activations": "float32"}


def _build_llvm(mod, cfg, options: CompileOptions, staging: Path, bar, contract: str) -> list[str]:
    from .codegen.artifact import with_contract
    from .codegen.llvm import build, kernel_names, lower, make_target

    target = make_target(options.mcpu)
    bar.set_postfix_str("attach kernels, legalize, fuse")
    lowered = lower(mod, cfg, target, int8_dot=options.matmuls == "int8")
    bar.update(1)
    bar.set_postfix_str("LLVM codegen")
    kernels = kernel_names(lowered)
    build(with_contract(lowered, contract), target, staging / LIBRARY)
    bar.update(1)
    return kernels


def _build_cuda(mod, cfg, options: CompileOptions, staging: Path, bar, contract: str) -> list[str]:
    from .codegen import cuda
    from .codegen.artifact import with_contract
    from .codegen.llvm import kernel_names

    target = cuda.make_target(options.arch)
    bar.set_postfix_str("attach GPU kernels")
    lowered = cuda.lower(mod, cfg, cuda_graph=options.cuda_graph)
    bar.update(1)
    bar.set_postfix_str("dlight schedules, CUDA codegen, nvcc")
    kernels = kernel_names(lowered)
    cuda.build(with_contract(lowered, contract), target, staging / LIBRARY, cuda_graph=options.cuda_graph)
    bar.update(1)
    return kernels


def _cuda_images(library: Path) -> list[tuple[str, int]]:
    from .codegen import cuda
    return cuda.fatbin_entries(library.read_bytes())


def _build_vulkan(mod, cfg, options: CompileOptions, staging: Path, bar, contract: str) -> list[str]:
    from .codegen.attach_kernels import attach_kernels
    from .codegen.vulkan import build_plan, write_plan

    bar.set_postfix_str("attach GPU kernels")
    mod = attach_kernels(mod, cfg, gpu=True)
    bar.update(1)
    bar.set_postfix_str("dlight schedules, WGSL codegen, plan")
    plan = build_plan(mod)
    write_plan(plan, staging, contract)
    bar.update(1)
    return sorted(plan.kernels)


@contextlib.contextmanager
def _writing(staging: Path, output: Path):
    """Writing an artifact into `staging` (locked meanwhile, see output_dir.writing_into): on any failure the
    staging folder goes; a file system that refuses the writes (full, read-only, no permission) is one sentence,
    not a traceback."""
    try:
        with writing_into(staging):
            yield
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in _REFUSED_WRITES:
            raise ConfigError(f"The artifact cannot be written to {output}: {exc.strerror} "
                              f"({exc.filename or output.parent}).") from None
        raise


_REFUSED_WRITES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def _write_ir(path: str | Path, mod) -> None:
    try:
        Path(path).write_text(mod.script())
    except OSError as exc:
        raise ConfigError(f"--dump-ir {path} cannot be written: {exc.strerror or exc}.") from None


def _copy_artifact(source: Path, output: Path) -> None:
    """A cached compile copied into place: file by file into a staging folder beside `output`, then installed as
    a fresh compile is (a full disk keeps the earlier artifact and leaves no half copy)."""
    if output.resolve() == source.resolve():
        return
    staging = staging_dir(output)
    with _writing(staging, output):
        for path in sorted(source.iterdir()):
            if path.is_file():
                shutil.copy2(path, staging / path.name)
        install(staging, output, ARTIFACT)


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr)
