"""The compiler driver, one linear pipeline:

    GGUF -> config, tokenizer, weights (frontend) -> Relax module (frontend) -> IR passes (SnapKV) -> an emitter

The front half is written once (`front_half`); the emitter is a target's build (sharpi.codegen.targets, one file
per target, written into an artifact through the compile cache) or the ONNX export (sharpi.export.onnx).

Compiles are cached under $SHARPI_HOME/cache (compile_cache: keyed by the GGUF's sha256, the resolved options and
the compiler's source; bounded by $SHARPI_CACHE_GB); an output directory gets a cached compile's small files copied
and its weights and kernel library shared with the cache entry (common.file_share), so the disk holds them once.
`compile_into_cache` is what sharpi.load does with a GGUF or a known model name: the cache entry is the artifact.
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

import tvm

from . import compile_cache
from .codegen import artifact
from .codegen.targets import Target, target_for
from .common.compile_options import PREFILL_CHUNK, CompileOptions, kv_types_of
from .common.config import ModelConfig
from .common.errors import ConfigError, SharpiNote, SharpiWarning, UnsupportedArchitectureError
from .common.chat_sampling import from_gguf_metadata as sampling_from_gguf
from .common.kv_format import key_offset_for, rotation_seed_for
from .common.file_share import share_file
from .common.manifest import (ARTIFACT, FORMAT_VERSION, LIBRARY, MANIFEST_NAME, TOKENIZER, WEIGHTS, Manifest,
                              contract_json, file_sha256)
from .common.ops import PAGE_SIZE, SELECT_PARAMS
from .common.output_dir import check_output_dir, install, staging_dir, writing_into
from .common.progress import progress_bar
from .common.settings import home_folder
from .common.snapkv_settings import fit_recency, knobs_from_keywords, settings_from
from .common.targets import DEFAULT_TARGET
from .common.tokenizer import Tokenizer, TokenizerInfo, build_from_gguf_metadata
from .common.version import __version__
from .frontend.architectures import frontend_for
from .frontend.config import config_from_gguf
from .frontend.fetch import resolve_model
from .frontend.gguf_file import GGUFFile
from .frontend.weights import WeightTable
from .ir_passes.snapkv import SNAPKV_FUNCTIONS, snapkv_pass

BASE_FUNCTIONS = ["prefill", "prefill_logits", "decode", "decode_batch"]
SHARED_FILES = (WEIGHTS, LIBRARY)     # an artifact's large files: shared between the cache and an output folder


@dataclass
class FrontHalf:
    """What every emitter starts from: the GGUF read and lowered to Relax, the IR passes run."""
    gguf: GGUFFile
    cfg: ModelConfig
    tokenizer: Tokenizer
    tok_info: TokenizerInfo
    weights: WeightTable
    mod: tvm.IRModule
    options: CompileOptions      # SnapKV turned off for a model whose every layer is local
    max_context: int
    max_pages: int
    functions: list[str]


def compile(model: str | Path, target: str = DEFAULT_TARGET, output: str | Path | None = None, *,
            mcpu: str | None = None, arch: str | None = None, cuda_graph: bool = False, matmuls: str | None = None,
            kv_dtype: str | None = None, kv_dtype_k: str | None = None, kv_dtype_v: str | None = None,
            max_context: int | None = None, snapkv: str | bool | None = None,
            dump_ir: str | Path | None = None, use_cache: bool = True, show_progress: bool = False,
            emit: str | None = None, **snapkv_knobs) -> Path:
    """Compile a GGUF (path or known model name) into an artifact directory; returns its path.

    target: llvm (mcpu: the CPU, default this one; matmuls: "int8" (the default where the CPU has AVX2):
    the quantized matmuls multiply int8-quantized activations with integer dot products as llama.cpp does, or
    "float": float32 throughout, exact to the numpy reference), vulkan, or cuda (arch: sm_XY, default sm_80;
    cuda_graph: decode as one captured CUDA graph); kv_dtype: the KV cache's type, "f32", "f16", "bf16" (not on
    vulkan), "q8_0" or "q4_0" (blocks of 32 with an f16 scale, as ggml's), "q4_ch" (keys only), or any other
    codec registered in sharpi.common.kv_codecs; kv_dtype_k and kv_dtype_v set the keys' or the values' alone
    (llama.cpp's -ctk, -ctv); default f16 for cuda and for llvm with int8 matmuls, else f32.

    snapkv decides whether the SnapKV ops exist; snapkv_window (of the snapkv_* knobs: budget, window, recency,
    pooling, kernel, granularity, sinks) is also the largest window allowed at run time; the knobs become the
    artifact's run-time defaults. dump_ir writes the Relax IR after the passes (before kernels are attached) to a
    file. emit="onnx" exports ONNX graphs instead (export_onnx; the target options do not apply)."""
    if emit is not None:
        return _emit_from_compile(model, output, emit, target=target, mcpu=mcpu, arch=arch, cuda_graph=cuda_graph,
                                  matmuls=matmuls, kv_dtype=kv_dtype or kv_dtype_k or kv_dtype_v,
                                  max_context=max_context, snapkv=snapkv,
                                  dump_ir=dump_ir, show_progress=show_progress, **snapkv_knobs)
    options, emitter = _target_options(target, mcpu=mcpu, arch=arch, cuda_graph=cuda_graph, matmuls=matmuls,
                                       kv_dtype=kv_dtype, kv_dtype_k=kv_dtype_k, kv_dtype_v=kv_dtype_v,
                                       max_context=max_context, snapkv=snapkv, **snapkv_knobs)
    gguf_path = resolve_model(model, show_progress=show_progress)
    output = Path(output) if output is not None else Path(f"{gguf_path.stem}-{options.target}")
    check_output_dir(output, ARTIFACT, [*emitter.code_files, WEIGHTS, TOKENIZER, MANIFEST_NAME])
    if not use_cache:
        return _compile_artifact(gguf_path, file_sha256(gguf_path), options, emitter, output, show_progress, dump_ir)
    entry, hit = _cached_compile(gguf_path, options, emitter, show_progress, dump_ir)
    if hit:
        _log(show_progress, f"sharpi: using the cached compile {entry.name}")
    _share_artifact(entry, output)
    return output


def compile_into_cache(model: str | Path, *, show_progress: bool = False) -> Path:
    """The compile cache's entry (an artifact directory) for a GGUF path or known model name compiled for this
    machine as sharpi-compile's defaults do: an intact cached compile at once, else (one line says so, then the
    compile's progress, with show_progress) compiled now. What sharpi.load does with a GGUF or a name."""
    options, emitter = _target_options(DEFAULT_TARGET)
    gguf_path = resolve_model(model, show_progress=show_progress)
    return _cached_compile(gguf_path, options, emitter, show_progress, None, announce=True)[0]


def _target_options(target: str, *, mcpu=None, arch=None, cuda_graph=False, matmuls=None, kv_dtype=None,
                    kv_dtype_k=None, kv_dtype_v=None, max_context=None, snapkv=None,
                    **snapkv_knobs) -> tuple[CompileOptions, Target]:
    """compile()'s options checked and resolved by the target (its own checks and defaults: this CPU, the
    matmuls and KV types it takes), before any download or work; and the target's emitter."""
    options = CompileOptions(target=target, mcpu=mcpu, arch=arch, cuda_graph=bool(cuda_graph), matmuls=matmuls,
                             **kv_types_of(kv_dtype, kv_dtype_k, kv_dtype_v), max_context=max_context,
                             **_snapkv_fields(snapkv, snapkv_knobs))
    options.validate()
    emitter = target_for(options.target)
    return emitter.resolve(options), emitter


def _cached_compile(gguf_path: Path, options: CompileOptions, emitter: Target, show_progress: bool,
                    dump_ir: str | Path | None, announce: bool = False) -> tuple[Path, bool]:
    """(the cache entry of this GGUF and options, whether it was cached): an intact cached compile (a damaged one
    is dropped: compile_cache.lookup), else a compile into the cache now (`announce`: one line says so first),
    after which the least recently used entries go until the cache fits its bound. dump_ir always compiles."""
    home_folder("cache")                   # SHARPI_HOME unusable: one sentence now, not after the compile
    gguf_sha256 = file_sha256(gguf_path)   # the cache key needs only the bytes, not a parse of the GGUF
    entry = compile_cache.entry_dir(gguf_path, gguf_sha256, options)
    if dump_ir is None and compile_cache.lookup(entry):
        compile_cache.mark_used(entry)
        return entry, True
    # the cache's bound, read once: a bad SHARPI_CACHE_GB fails now, not after the compile
    limit = compile_cache.limit_bytes()
    if announce:
        _log(show_progress, f"sharpi: compiling {gguf_path.name} for {_machine(options)} (first use; cached in "
                            f"{compile_cache.cache_root()})")
    _compile_artifact(gguf_path, gguf_sha256, options, emitter, entry, show_progress, dump_ir)
    _prune_cache(entry, limit, show_progress)
    return entry, False


def _machine(options: CompileOptions) -> str:
    """What a compile of these resolved options runs on, in words."""
    if options.target == "llvm":
        return f"this CPU ({options.mcpu})"
    return options.target + (f" ({options.arch})" if options.arch else "")


def _prune_cache(entry: Path, limit: int, show_progress: bool) -> None:
    """The cache brought within `limit` after `entry` was added: the least recently used entries deleted (said
    with show_progress); an `entry` larger than the limit alone is kept as the only one, with a SharpiWarning
    saying so (its model keeps loading from the cache until the next compile needs the room)."""
    for removed in compile_cache.prune(keep=entry, limit=limit):
        _log(show_progress, f"sharpi: compile cache over {limit / 2**30:g} GiB (SHARPI_CACHE_GB); deleted the least "
                            f"recently used {removed.path.name}")
    nbytes = compile_cache.over_limit(entry, limit)
    if nbytes is not None:
        warnings.warn(f"The compile of {entry.name} takes {nbytes / 2**30:.2f} GiB, more than the compile cache's "
                      f"limit of {limit / 2**30:g} GiB (SHARPI_CACHE_GB): it is kept as the cache's only entry until "
                      f"the next compile needs the room; set SHARPI_CACHE_GB above {nbytes / 2**30:.2f} to keep it "
                      f"beside others.", SharpiWarning, stacklevel=4)


def export_onnx(model: str | Path, output: str | Path | None = None, *, weights: str = "f32",
                functions=None, max_context: int | None = None, snapkv: str | bool | None = None,
                dump_ir: str | Path | None = None, show_progress: bool = False, **snapkv_knobs) -> Path:
    """Export a GGUF (path or known model name) as ONNX graphs into a directory; returns its path.

    The same Relax module the targets compile (SnapKV pass included) is translated to ONNX, binding by binding
    (sharpi.export.onnx): prefill.onnx and decode.onnx (functions may add "prefill_logits"), plus
    prefill_snapkv.onnx (score, select and compact after the prompt) unless snapkv is off; weights f32 or f16 in
    one shared weights.onnx.data; sharpi-onnx.json records the graphs' signatures; tokenizer.json the tokenizer.
    The snapkv_* knobs are the export's SnapKV settings (as compile's)."""
    from .export import onnx as emitter    # the onnx package is heavy: only an export loads it

    started = time.perf_counter()
    options = CompileOptions(max_context=max_context, **_snapkv_fields(snapkv, snapkv_knobs))
    options.validate()
    if weights not in emitter.WEIGHT_DTYPES:
        raise ConfigError(f"ONNX weights must be one of {', '.join(emitter.WEIGHT_DTYPES)}, got {weights!r}.")
    gguf_path = resolve_model(model, show_progress=show_progress)
    output = Path(output) if output is not None else Path(gguf_path.stem + "-onnx")
    check_output_dir(output, emitter.EXPORT, [emitter.WEIGHTS_FILE, TOKENIZER, emitter.EXPORT_FILE])
    front = front_half(gguf_path, options, ("float32", "float32"), show_progress, dump_ir,
                       architectures=emitter.ARCHITECTURES,
                       emitter_name="ONNX export")
    settings = front.options.snapkv_defaults
    if functions is None:
        functions = list(emitter.DEFAULT_FUNCTIONS) + (["prefill_snapkv"] if front.options.snapkv == "on" else [])
    staging = staging_dir(output)
    with _writing(staging, output):
        _log(show_progress, "sharpi: translating the Relax module to ONNX")
        signature = emitter.export_module(front.mod, front.cfg, front.weights, staging, functions=tuple(functions),
                                          snapkv_settings=settings, weight_dtype=weights,
                                          metadata={"sharpi.source": front.gguf.path.name})
        _warn_non_finite(front.weights, front.gguf.path.name)
        front.tokenizer.save(staging)
        emitter.write_export_manifest(
            staging, signature, sharpi_version=__version__, weights_dtype=weights,
            source={"name": front.gguf.path.name, "sha256": file_sha256(gguf_path)}, config=front.cfg.to_dict(),
            tokenizer=front.tok_info.to_dict(),
            snapkv={"enabled": front.options.snapkv == "on", "defaults": settings.manifest_dict()})
        install(staging, output, emitter.EXPORT)
    _log(show_progress, f"sharpi: exported {front.gguf.path.name} to ONNX ({', '.join(functions)}) in "
                        f"{time.perf_counter() - started:.1f} s -> {output}")
    return output


def front_half(gguf_path: Path, options: CompileOptions, kv_types: tuple[str, str], show_progress: bool,
               dump_ir: str | Path | None, architectures=None, emitter_name: str = "",
               sub_scales: str = "none") -> FrontHalf:
    """The GGUF read (config, tokenizer, weights), the model built as Relax functions with a KV pool of
    `kv_types` (keys', values'), the IR passes run (SnapKV unless off), the IR dumped if asked.
    `architectures`: those the emitter supports (None: all the frontend builds); `sub_scales`: which K-quant
    matrices the emitter's kernels read through their `ks` part (Target.sub_scales_for)."""
    gguf = GGUFFile(gguf_path)
    cfg = config_from_gguf(gguf)
    if architectures is not None and cfg.arch not in architectures:
        raise UnsupportedArchitectureError(f"{emitter_name} does not support the {cfg.arch} architecture yet "
                                           f"(supported: {', '.join(architectures)}).")
    max_context = _max_context(options, cfg)
    tokenizer, tok_info = build_from_gguf_metadata(gguf.metadata)
    load_weights, builder = frontend_for(cfg)
    options = _without_snapkv_if_all_local(options, cfg, show_progress)
    weights = load_weights(gguf, cfg, show_progress)
    weights.choose_scales(lambda name: sub_scales == "all" or (sub_scales == "experts" and name in weights.experts))
    max_pages = math.ceil(max_context / PAGE_SIZE)
    mod = builder(cfg, weights, max_pages, kv_types=kv_types).build()
    functions = list(BASE_FUNCTIONS) + (["state_copy"] if cfg.is_hybrid else [])
    if options.snapkv == "on":
        mod = snapkv_pass(mod)
        functions += list(SNAPKV_FUNCTIONS)
    if dump_ir is not None:
        _write_ir(dump_ir, mod)
    return FrontHalf(gguf=gguf, cfg=cfg, tokenizer=tokenizer, tok_info=tok_info, weights=weights, mod=mod,
                     options=options, max_context=max_context, max_pages=max_pages, functions=functions)


def _compile_artifact(gguf_path: Path, gguf_sha256: str, options: CompileOptions, emitter: Target, output: Path,
                      show_progress: bool, dump_ir: str | Path | None) -> Path:
    """The front half, then the target's build into a staging folder, the manifest, the move into place."""
    started = time.perf_counter()
    front = front_half(gguf_path, options, options.kv_types, show_progress, dump_ir,
                       sub_scales=emitter.sub_scales_for(options))
    options, settings = front.options, front.options.snapkv_defaults
    staging = staging_dir(output)
    with _writing(staging, output):
        # the weights first: the kernel contract compiled into the code names every parameter
        params = artifact.write_weights(front.weights.stream(show_progress), staging / WEIGHTS)
        _warn_non_finite(front.weights, front.gguf.path.name)
        front.tokenizer.save(staging)
        manifest = Manifest(
            format_version=FORMAT_VERSION, sharpi_version=__version__,
            source={"name": front.gguf.path.name, "sha256": gguf_sha256, "size": front.gguf.path.stat().st_size},
            config=front.cfg.to_dict(), target=emitter.describe(options), tokenizer=front.tok_info.to_dict(),
            page_size=PAGE_SIZE, max_context=front.max_context, max_pages=front.max_pages,
            prefill_chunk=PREFILL_CHUNK, functions=front.functions, kernels=[], params=params,
            snapkv={"enabled": options.snapkv == "on", "max_window": settings.window, "defaults": settings.to_dict(),
                    "select_params": SELECT_PARAMS,
                    "score_max": True}, kv_dtype=options.kv_dtype, kv_dtype_v=options.kv_dtype_v,
            kv_key_offset=key_offset_for(options.kv_types[0], front.cfg.qkv_bias),
            kv_rotation_seed=rotation_seed_for(options.kv_types),
            sampling=sampling_from_gguf(front.gguf.metadata))
        contract = contract_json(manifest.kernel_contract())
        with progress_bar(2, "compiling", show_progress, unit="step") as bar:
            manifest.kernels = emitter.build(front.mod, front.cfg, options, staging, bar, contract)
        emitter.finish(staging, manifest.target)
        artifact.finalize(staging, output, manifest)
    detail = next((f" ({key} {manifest.target[key]})" for key in ("mcpu", "arch") if key in manifest.target), "")
    _log(show_progress, f"sharpi: compiled {front.gguf.path.name} for {options.target}{detail} in "
                        f"{time.perf_counter() - started:.1f} s -> {output}")
    return output


def _emit_from_compile(model, output, emit: str, *, target, mcpu, arch, cuda_graph, matmuls, kv_dtype, **export):
    """compile(..., emit="onnx"): export_onnx, once it is sure no target option was given."""
    if emit != "onnx":
        raise ConfigError(f"emit must be 'onnx' (or None for a compiled artifact), got {emit!r}.")
    used = [name for name, on in (("target", target != DEFAULT_TARGET), ("mcpu", mcpu), ("arch", arch),
                                  ("cuda_graph", cuda_graph), ("matmuls", matmuls is not None),
                                  ("kv_dtype", kv_dtype)) if on]
    if used:
        raise ConfigError(f"{', '.join(used)} {'does' if len(used) == 1 else 'do'} not apply to emit='onnx'.")
    return export_onnx(model, output, **export)


def _snapkv_fields(snapkv, keywords: dict) -> dict:
    """CompileOptions' SnapKV fields from compile()'s arguments: snapkv on (the default) or off, whether it was
    asked for, and the run-time defaults from the snapkv_* knobs (the environment does not shape an artifact); a
    budget too small for the default recency shrinks it, with a SharpiNote (snapkv_settings.fit_recency)."""
    knobs = knobs_from_keywords(keywords)
    defaults = settings_from(env={}, **knobs)
    defaults, note = fit_recency(defaults, defaults.budget or 0, "recency" in knobs)
    if note:
        warnings.warn(note, SharpiNote, stacklevel=4)
    return {"snapkv": {True: "on", False: "off", None: "on"}.get(snapkv, snapkv), "snapkv_explicit": snapkv is not None,
            "snapkv_defaults": defaults}


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


@contextlib.contextmanager
def _writing(staging: Path, output: Path):
    """Writing an output into `staging` (locked meanwhile, see output_dir.writing_into): on any failure the
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


def _share_artifact(source: Path, output: Path) -> None:
    """A cached compile put at `output`: its large files (SHARED_FILES) shared with the cache entry
    (common.file_share: a reflink, else a read-only hard link, else a copy), its small ones copied, file by file
    into a staging folder beside `output`, then installed as a fresh compile is (a full disk keeps the earlier
    artifact and leaves no half copy)."""
    if output.resolve() == source.resolve():
        return
    staging = staging_dir(output)
    with _writing(staging, output):
        for path in sorted(source.iterdir()):
            if path.name in SHARED_FILES and path.is_file():
                share_file(path, staging / path.name)
            elif path.is_file():
                shutil.copy2(path, staging / path.name)
        install(staging, output, ARTIFACT)


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr)
