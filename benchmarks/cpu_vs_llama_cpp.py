"""sharpi vs llama.cpp on the CPU, side by side in one run (the CPU speed issue's benchmark): the same GGUF, the
same thread count, prefill at 512 and 4096 tokens and decode after each, sharpi also with SnapKV (budget 1024)
after the long prompt. Medians of --repeats runs; a Markdown table with the ratios (sharpi / llama.cpp) is
printed and, with --out, written with a description of the machine.

    python benchmarks/cpu_vs_llama_cpp.py [--models smollm2-135m,gemma3-270m] [--prompts 512,4096] [--gen 64]
        [--repeats 3] [--budget 1024] [--matmuls float,int8] [--out benchmarks/cpu.md]

--matmuls compiles one artifact per value (sharpi-compile --matmuls) and times each beside the
same llama.cpp run.

Needs llama-cpp-python. Run it on a quiet machine: the engines are timed in the same process, taking turns (one
run each per round), so a noisy neighbour hurts all of them, if not always equally.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import sharpi
from sharpi.cli.bench import bench_llama_cpp, bench_sharpi, find_gguf, prompt_ids


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} logical CPUs, load average {load:.1f} at the start, Python {platform.python_version()}"


def rows_for(name: str, prompts: list[int], gen: int, repeats: int, budget: int, matmuls: list[str]) -> list[dict]:
    """Every engine once per round, `repeats` rounds, medians per engine: a slow spell of the shared machine then
    lands on all engines alike instead of on whichever ran its repeats during it."""
    models = {m: sharpi.load(sharpi.compile(name, target="llvm", output=f"/tmp/sharpi-cpu-bench-{name}-{m}",
                                            matmuls=m)) for m in matmuls}
    first = models[matmuls[0]]
    gguf = find_gguf(first, None)
    rows = []
    for n in prompts:
        print(f"{name}: {n}-token prompt", file=sys.stderr, flush=True)
        engines = {"llama.cpp": lambda: bench_llama_cpp(gguf, n, gen, first.threads, 1, prompt_ids(first, n))}
        for d, model in models.items():
            label = "sharpi" if d == "float" else f"sharpi, {d} matmuls"
            if str(model.manifest.kv_dtype) == "float16":   # the int8 default's KV cache, as llama.cpp's
                label += ", f16 KV"
            engines[label] = lambda m=model: bench_sharpi(m, n, gen, 1, {"snapkv_budget": 0})
            if budget and n > budget:
                engines[f"{label}, SnapKV {budget}"] = lambda m=model: bench_sharpi(m, n, gen, 1,
                                                                                     {"snapkv_budget": budget})
        samples = {label: [] for label in engines}
        for _ in range(repeats):
            for label, run in engines.items():
                samples[label].append(run())
        medians = {label: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
                   for label, runs in samples.items()}
        theirs = medians.pop("llama.cpp")
        rows += [{"model": name, "prompt": n, "engine": label, **m, "vs": theirs} for label, m in medians.items()]
        rows.append({"model": name, "prompt": n, "engine": "llama.cpp", **theirs, "vs": theirs})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | prompt | engine | prefill tok/s | decode tok/s | prefill ratio | decode ratio |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = ("", "") if r["engine"] == "llama.cpp" else (
            f"{r['prefill_tok_s'] / r['vs']['prefill_tok_s']:.2f}x", f"{r['decode_tok_s'] / r['vs']['decode_tok_s']:.2f}x")
        lines.append(f"| {r['model']} | {r['prompt']} | {r['engine']} | {r['prefill_tok_s']:.1f} | "
                     f"{r['decode_tok_s']:.1f} | {ratio[0]} | {ratio[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--prompts", default="512,4096")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--matmuls", default="float,int8", help="sharpi artifacts to time: float, int8 or both")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    started, about = time.strftime("%Y-%m-%d %H:%M"), machine()
    rows = []
    for name in args.models.split(","):
        rows += rows_for(name, [int(n) for n in args.prompts.split(",")], args.gen, args.repeats, args.budget,
                         args.matmuls.split(","))
    text = (f"# sharpi vs llama.cpp on the CPU, {started}\n\n{about}; same GGUF and thread count for both; decode "
            f"of {args.gen} tokens after the prompt; median of {args.repeats} rounds (each engine once a round).\n\n"
            f"`python benchmarks/cpu_vs_llama_cpp.py {' '.join(argv or sys.argv[1:])}`\n\n{table(rows)}\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
