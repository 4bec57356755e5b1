"""sharpi-compile MODEL --target llvm -o DIR: compile a GGUF file or a known model name into an artifact."""
from __future__ import annotations

import sys

from ..common.compile_options import kv_types_of
from ..common.errors import ConfigError
from ..common.kv_format import key_type_note
from ..common.manifest import manifest_sha256
from ..common.targets import DEFAULT_TARGET, TARGETS, targets_taking
from ..frontend.fetch import KNOWN_MODELS, resolve_model
from .common import ArgumentParser, add_snapkv_flags, snapkv_keywords, user_errors_exit_2


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="sharpi-compile", description=__doc__)
    p.add_argument("model", help=f"a .gguf path or a known model name ({', '.join(KNOWN_MODELS)})")
    targets = ", ".join(f"{name} ({spec.about}{', the default' if name == DEFAULT_TARGET else ''})"
                        for name, spec in TARGETS.items())
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"what to compile for: {targets}")
    p.add_argument("--arch", default=None, help=f"{_taking('arch')}: the GPU architecture, sm_XY (PTX included)")
    p.add_argument("--cuda-graph", action="store_true",
                   help=f"{_taking('cuda_graph')}: run each decode step as one captured CUDA graph (fewer launches)")
    p.add_argument("-o", "--output", default=None, help="artifact directory (default: <gguf name>-<target>)")
    p.add_argument("--mcpu", default=None, help=f"{_taking('mcpu')}: the CPU to compile for (default: this "
                                                 f"machine's, e.g. znver3); NAME+amx-tile+amx-int8 adds AMX's "
                                                 f"prefill GEMM to a CPU LLVM names without it")
    p.add_argument("--matmuls", default=None, choices=["int8", "float"],
                   help=f"{_taking('matmuls')}: int8 (the default on CPUs with AVX2): the quantized matmuls multiply "
                        "int8-quantized activations with integer dot products, as llama.cpp does; float: float32 "
                        "throughout, exact to the numpy reference")
    p.add_argument("--max-context", type=int, default=None, help="context length (default: the GGUF's)")
    p.add_argument("--kv-dtype", default=None, help="the KV cache's type: f32, f16 (half the memory), bf16 (half "
                                                     "the memory, f32's range), q8_0 or q4_0 (blocks of 32 with an "
                                                     "f16 scale, as ggml's: 0.53x and 0.28x f16's memory), tq4 or "
                                                     "tq3 (TurboQuant: a Hadamard rotation, then 4 or 3 bits a value "
                                                     "and a norm a row; head_dim a power of two); default f16 for "
                                                     "GPUs and for int8 matmuls, else f32")
    p.add_argument("--kv-dtype-k", default=None, help="the keys' type alone (over --kv-dtype), as llama.cpp's -ctk; "
                                                       "keys are the sensitive side: q8_0 keys keep long-context "
                                                       "retrieval, q4_0 keys lose it; q4_ch (keys only) is 4 "
                                                       "bits per channel over a page's 16 tokens with an f16 scale "
                                                       "and minimum, 0.38x f16's bytes at head_dim 64")
    p.add_argument("--kv-dtype-v", default=None, help="the values' type alone (over --kv-dtype), as llama.cpp's -ctv")
    p.add_argument("--snapkv", default=None, help="on (default) or off: whether the SnapKV ops are compiled in")
    add_snapkv_flags(p)
    p.add_argument("--dump-ir", default=None, metavar="FILE", help="write the Relax IR after the passes to FILE")
    p.add_argument("--no-cache", action="store_true", help="compile even if the cache has this artifact")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    # --check: the conformance suite on the new artifact
    p.add_argument("--check", action="store_true",
                   help="then run the conformance suite on the artifact (against the numpy reference) and print a "
                        "pass/fail table; exit code 1 if a check failed")
    # --emit onnx: ONNX graphs (prefill, decode, SnapKV) instead of a compiled artifact
    p.add_argument("--emit", default=None, choices=["onnx"],
                   help="onnx: export the lowered model as ONNX graphs into -o DIR instead of compiling for a target")
    p.add_argument("--onnx-weights", default="f32", choices=["f32", "f16"],
                   help="with --emit onnx: the weights' element type in the export (default f32)")
    return p


def _taking(option: str) -> str:
    return "/".join(targets_taking(option))


@user_errors_exit_2
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.emit == "onnx":
        from ..compiler import export_onnx
        used = [flag for flag, on in (("--mcpu", args.mcpu), ("--arch", args.arch), ("--cuda-graph", args.cuda_graph),
                                      ("--matmuls", args.matmuls), ("--kv-dtype", args.kv_dtype),
                                      ("--kv-dtype-k", args.kv_dtype_k), ("--kv-dtype-v", args.kv_dtype_v),
                                      ("--check", args.check),
                                      ("--target", args.target != DEFAULT_TARGET)) if on]
        if used:
            raise ConfigError(f"{', '.join(used)} {'does' if len(used) == 1 else 'do'} not apply to --emit onnx.")
        print(export_onnx(args.model, output=args.output, weights=args.onnx_weights, max_context=args.max_context,
                          snapkv=args.snapkv, dump_ir=args.dump_ir, show_progress=not args.quiet,
                          **snapkv_keywords(args)))
        return 0
    from ..compiler import compile as compile_model
    out = compile_model(args.model, target=args.target, output=args.output, mcpu=args.mcpu, arch=args.arch,
                        cuda_graph=args.cuda_graph, matmuls=args.matmuls, kv_dtype=args.kv_dtype,
                        kv_dtype_k=args.kv_dtype_k, kv_dtype_v=args.kv_dtype_v,
                        max_context=args.max_context, snapkv=args.snapkv, dump_ir=args.dump_ir,
                        use_cache=not args.no_cache, show_progress=not args.quiet, **snapkv_keywords(args))
    print(out)
    key_note = key_type_note(kv_types_of(args.kv_dtype, args.kv_dtype_k, args.kv_dtype_v)["kv_dtype"])
    if key_note:
        print(f"sharpi: note: {key_note}", file=sys.stderr)
    print(f"sharpi: manifest sha256 {manifest_sha256(out)} (an artifact is code: whoever loads this copy can pin it "
          f"with --expect-sha256 or sharpi.load(..., expect_sha256=...))", file=sys.stderr)
    if args.check:        # exit code 1 if a check failed
        from ..testing.conformance import run_and_report
        return run_and_report(out, gguf=resolve_model(args.model, show_progress=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
