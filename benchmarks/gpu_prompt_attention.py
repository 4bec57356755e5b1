"""A prompt's attention on a Vulkan device (lavapipe without a GPU): the kernel with a workgroup per (token, query
head) against the tiled flash kernel (kernels.gpu.attention), on the same random queries and f32 cache of one
layer, Qwen2.5-0.5B's shape by default, for each prompt length; prints their largest difference and the median
seconds a call (the two alternating), with --plot a chart of both against the prompt length (needs matplotlib).

    python benchmarks/gpu_prompt_attention.py [--tokens 128,512] [--heads 14] [--kv-heads 2] [--head-dim 64]
        [--rounds 3] [--plot P]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
import tvm
from tvm import relax

from sharpi.codegen.kernels.gpu.attention import make_gpu_flash_attention, make_gpu_paged_attention
from sharpi.codegen.targets.vulkan import build_plan, write_plan
from sharpi.common.ops import PAGE_SIZE
from sharpi.runtime.vulkan import VulkanPlanRunner

KERNELS = {"per_token": make_gpu_paged_attention, "flash": make_gpu_flash_attention}


def attention_module(heads: int, kv_heads: int, head_dim: int, pages: int) -> tvm.IRModule:
    """One Relax function per kernel: (q [n, H, D], pool, page_table [1, pages], kv_lens [1]) -> out."""
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    layer = relax.prim_value(tvm.tirx.IntImm("int64", 0))
    for name, make in KERNELS.items():
        gv = bb.add_func(make(heads, kv_heads, head_dim, PAGE_SIZE, head_dim ** -0.5), name)
        params = [relax.Var("q", relax.TensorType((n, heads, head_dim), "float32")),
                  relax.Var("pool", relax.TensorType((pages, 2, kv_heads, PAGE_SIZE, head_dim), "float32")),
                  relax.Var("table", relax.TensorType((1, pages), "int32")),
                  relax.Var("lens", relax.TensorType((1,), "int32"))]
        with bb.function(name, params):
            with bb.dataflow():
                out = bb.emit_output(relax.call_tir(gv, [*params, layer],
                                                    relax.TensorType((n, heads, head_dim), "float32")))
            bb.emit_func_output(out)
    return bb.get()


def time_kernels(args, tokens: int) -> dict[str, float]:
    """Median seconds a call of each kernel over a prompt of `tokens` (after an untimed call that also checks
    the two agree)."""
    pages = tokens // PAGE_SIZE + 1
    directory = tempfile.mkdtemp(prefix="sharpi-prompt-attention-")
    write_plan(build_plan(attention_module(args.heads, args.kv_heads, args.head_dim, pages)), directory)
    runner = VulkanPlanRunner(directory)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((tokens, args.heads, args.head_dim)).astype(np.float32),
              rng.standard_normal((pages, 2, args.kv_heads, PAGE_SIZE, args.head_dim)).astype(np.float32),
              np.arange(pages, dtype=np.int32)[None], np.zeros(1, np.int32)]
    outs = {name: runner.run(name, *inputs) for name in KERNELS}
    print(f"{tokens} tokens: largest |per_token - flash| {np.abs(outs['per_token'] - outs['flash']).max():.2e}",
          file=sys.stderr)
    seconds = {name: [] for name in KERNELS}
    for _ in range(args.rounds):
        for name in KERNELS:
            start = time.perf_counter()
            runner.run(name, *inputs)
            seconds[name].append(time.perf_counter() - start)
    return {name: float(np.median(times)) for name, times in seconds.items()}


def plot(results: dict[int, dict[str, float]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in KERNELS:
        ax.plot(tokens, [results[n][name] for n in tokens], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds a call (one layer)")
    ax.set_title("A prompt's attention on lavapipe: per-token vs flash kernel")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,512", help="prompt lengths, comma-separated")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plot", help="write a chart of the seconds against the prompt length here")
    args = p.parse_args()
    results = {}
    print("| tokens | per-token s | flash s | ratio |\n| ---: | ---: | ---: | ---: |")
    for tokens in (int(t) for t in args.tokens.split(",")):
        results[tokens] = times = time_kernels(args, tokens)
        print(f"| {tokens} | {times['per_token']:.3f} | {times['flash']:.3f} | "
              f"{times['per_token'] / times['flash']:.2f}x |", flush=True)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
