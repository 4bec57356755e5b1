"""sharpi vs llama.cpp on the CPU, side by side in one run (the CPU speed issue's benchmark): the same GGUF, the
same thread count, prefill at 512 and 4096 tokens and decode after each, sharpi also with SnapKV (budget 1024)
after the long prompt. Every engine runs in a process of its own (sharpi.cli.bench.time_in_process: TVM's and
llama.cpp's thread pools in one process spin against each other), one run each per round, --repeats rounds,
medians; a Markdown table with the ratios (sharpi / llama.cpp) is printed and, with --out, written with a
description of the machine, and a bar chart of the ratios beside it (--plot, needs matplotlib).

    python benchmarks/cpu_vs_llama_cpp.py [--models smollm2-135m,gemma3-270m,FILE.gguf] [--prompts 512,4096]
        [--gen 64] [--repeats 3] [--budget 1024] [--matmuls float,int8] [--threads N] [--out benchmarks/cpu.md]
        [--plot P]

Each decode figure comes with its bandwidth floor: the bytes a decode step reads (every weight but the embedding
table's unread rows, plus the KV slots each layer holds half-way through the decode) over a read bandwidth
measured in a process of its own on the same threads (a TVM kernel summing 1 GiB); "floor %" is the measured
speed as a share of that bound. Models may be GGUF paths (benchmarks/synthetic_gguf.py writes 1.5B and 7B shapes).

--matmuls compiles one artifact per value (sharpi-compile --matmuls) and times each beside the same llama.cpp
run. Needs llama-cpp-python (built as ../shared/anchors/README.md says). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import sharpi
from sharpi.cli.bench import artifact_info, find_gguf, prompt_ids, rounds
from sharpi.common.config import ModelConfig
from sharpi.common.settings import resolve_threads


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
               platform.processor())
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    isa = "AVX-512 + VNNI" if {"avx512f", "avx512_vnni"} <= flags else "AVX2" if "avx2" in flags else "no AVX2"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu} ({isa}; LLVM's name for it: {sharpi_cpu()}), {os.cpu_count()} logical CPUs, load average "
            f"{load:.1f} at the start, Python {platform.python_version()}")


def sharpi_cpu() -> str:
    from sharpi.codegen.targets.llvm import host_cpu
    return host_cpu()


def llama_cpp_info() -> str:
    import llama_cpp
    system = llama_cpp.llama_print_system_info().decode()
    return f"llama-cpp-python {llama_cpp.__version__}: {system.strip()}"


def read_bandwidth(threads: int) -> float:
    """Bytes per second a process of its own reads on `threads` threads (benchmarks/read_bandwidth.py)."""
    import subprocess
    script = Path(__file__).with_name("read_bandwidth.py")
    done = subprocess.run([sys.executable, str(script), str(threads)], capture_output=True, text=True, check=True,
                          env={**os.environ, "TVM_NUM_THREADS": str(threads)})
    return float(done.stdout.split()[-1])


def decode_bytes(manifest, context: int, budget: int = 0, gguf: Path | None = None, cache: str = "f16") -> int:
    """Bytes one decode step reads at `context` tokens: the weights (the embedding table's only one row unless it
    is also the output matrix; of a mixture's experts the k chosen of E), the KV slots of every layer (a window's at
    most; SnapKV's budget at most) and a hybrid's recurrent state, read and written.
    With `gguf`, llama.cpp's: the GGUF's tensors (sharpi's layouts hold f32 scales, ~1.2-1.3x the K-quants'
    bytes) and its cache of `cache` types."""
    from sharpi.common.config import ModelConfig
    from sharpi.frontend.gguf_file import GGUFFile

    cfg = ModelConfig.from_dict(manifest.config)
    if gguf is None:
        sizes = weight_read_bytes(manifest)
    else:
        sizes = {name: t.span[1] for name, t in GGUFFile(gguf).tensors.items()}
    weights = sum(_read_share(cfg, name) * size for name, size in sizes.items())
    weights -= 0 if cfg.tied_embeddings else sizes["token_embd.weight"]
    kv = held_slots(cfg, context, budget) * slot_bytes(manifest, cfg, None if gguf is None else cache)
    return int(weights) + kv + 2 * cfg.state_bytes   # a hybrid's recurrent state: read and written


def _read_share(cfg, tensor: str) -> float:
    """The share of a weight tensor a decode step reads: a mixture's experts only the chosen ones'."""
    return cfg.n_experts_used / cfg.n_experts if cfg.n_experts and tensor.endswith("_exps.weight") else 1.0


def weight_read_bytes(manifest) -> dict[str, int]:
    """Per weight tensor, the bytes its decode matmul reads: every part it is stored as ((qs, s), or a K-quant's
    (qs, ks) where the kernels read its integer sub-scales: quant_layout)."""
    sizes: dict[str, int] = {}
    for p in manifest.params:
        tensor = p.name.rpartition(":")[0]
        sizes[tensor] = sizes.get(tensor, 0) + p.nbytes
    return sizes


def held_slots(cfg, context: int, budget: int = 0) -> int:
    """Slots every layer together holds at `context` tokens (a window's at most; SnapKV's budget at most)."""
    slots = 0
    for layer in range(cfg.kv_layers):        # a hybrid's DeltaNet layers hold no slots
        held = min(context, cfg.sliding_window) if cfg.sliding_window and cfg.is_local(layer) else context
        slots += min(held, budget) if budget else held
    return slots


def slot_bytes(manifest, cfg, llama_cache: str | None = None) -> int:
    """One layer's slot, keys and values of every KV head: sharpi's (its format's rows) or, with llama_cache
    ("f16", "q8_0", "K/V"), llama.cpp's (ggml's blocks: q8_0 34 bytes a 32, q4_0 18)."""
    if llama_cache is None:
        return manifest.kv_format(cfg).row_bytes * cfg.n_kv_heads
    per_element = {"f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}
    k, _, v = llama_cache.partition("/")
    return int(cfg.n_kv_heads * cfg.head_dim * (per_element[k] + per_element[v or k]))


def rows_for(name: str, prompts: list[int], gen: int, repeats: int, budget: int, matmuls: list[str],
             threads: int, bandwidth: float, kv_types: list[str], llama_caches: list[str],
             warmup: int = 0, mlock: bool = False) -> list[dict]:
    label_of = Path(name).stem if name.endswith(".gguf") else name
    artifacts = {}
    arms = dict(kv_arms(entry) for entry in kv_types)
    for variant in matmuls:       # "int8", "float", or one for another CPU: "int8@znver3" (AVX2 only)
        m, _, mcpu = variant.partition("@")
        for kv in arms:           # "default" (the target's), or f16, q8_0, "q8_0/q4_0" (keys/values)
            k, _, v = kv.partition("/")
            types = {} if kv == "default" else {"kv_dtype_k": k, "kv_dtype_v": v or k}
            suffix = "" if kv == "default" else "-" + kv.replace("/", "-")
            artifacts[variant, kv] = sharpi.compile(
                name, target="llvm", matmuls=m, mcpu=mcpu or None, **types,
                output=f"/tmp/sharpi-cpu-bench-{label_of}-{m}{'-' + mcpu if mcpu else ''}{suffix}")
    first = next(iter(artifacts.values()))
    tokenizer = artifact_info(first)
    manifest = tokenizer.manifest
    cfg = ModelConfig.from_dict(manifest.config)
    gguf = find_gguf(manifest, name if Path(name).is_file() else None)
    rows = []
    for n in prompts:
        print(f"{name}: {n}-token prompt", file=sys.stderr, flush=True)
        tokens = prompt_ids(tokenizer, n)
        common = {"tokens": tokens, "gen": gen, "threads": threads, "warmup": warmup}
        specs = {}
        for cache in llama_caches:
            label = "llama.cpp" if cache == "default" else f"llama.cpp, {cache} KV, -fa"
            specs[label] = {"engine": "llama.cpp", "gguf": str(gguf), **common,
                            **({} if cache == "default" else {"cache": cache})}
        for (variant, kv), path in artifacts.items():
            m, _, mcpu = variant.partition("@")
            label = "sharpi" if m == "float" else f"sharpi, {m} matmuls"
            types = artifact_info(path).manifest.kv_types
            if types != ("float32", "float32"):
                label += f", {'/'.join(t.replace('float', 'f') for t in dict.fromkeys(types))} KV"
            if mcpu:
                label += f", --mcpu {mcpu}"
            sharpi_spec = {"engine": "sharpi", "artifact": str(path), "mlock": mlock, **common}
            if "full" in arms[kv]:
                specs[label] = {**sharpi_spec, "snapkv": {"snapkv_budget": 0}}
            if budget and n > budget and "snapkv" in arms[kv]:
                specs[f"{label}, SnapKV {budget}"] = {**sharpi_spec, "snapkv": {"snapkv_budget": budget}}
        medians = rounds(specs, repeats)
        for label, spec in specs.items():     # llama.cpp's cache: its slots times ggml's bytes for them
            if spec["engine"] == "llama.cpp":
                medians[label]["kv_bytes"] = held_slots(cfg, n + gen) * slot_bytes(manifest, cfg,
                                                                                   spec.get("cache", "f16")) \
                    + cfg.state_bytes
        baseline = next(label for label in specs if label.startswith("llama.cpp"))
        theirs = medians[baseline]
        for label, m in medians.items():
            spec = specs[label]
            if spec["engine"] == "llama.cpp":
                floor = bandwidth / decode_bytes(manifest, n + gen // 2, gguf=gguf, cache=spec.get("cache", "f16"))
            else:
                kept = budget if "SnapKV" in label else 0
                floor = bandwidth / decode_bytes(artifact_info(spec["artifact"]).manifest, n + gen // 2, kept)
            rows.append({"model": label_of, "prompt": n, "engine": label, **m, "vs": theirs, "floor": floor,
                         "baseline": label == baseline})
        print(table([r for r in rows if r["prompt"] == n]), file=sys.stderr, flush=True)   # kept if cut short
    return rows


def kv_arms(entry: str) -> tuple[str, tuple[str, ...]]:
    """"q8_0" -> ("q8_0", ("full", "snapkv")): a KV type's artifact timed with the full cache and with SnapKV at
    --budget; "q8_0:full" or "q4_0:snapkv" times one of the two (a 16k-token arm takes minutes)."""
    kv, _, arm = entry.partition(":")
    if arm not in ("", "full", "snapkv"):
        raise SystemExit(f"--kv {entry}: the part after ':' is full or snapkv")
    return kv, (arm,) if arm else ("full", "snapkv")


def table(rows: list[dict]) -> str:
    lines = ["| model | prompt | engine | prefill tok/s | decode tok/s | prefill ratio | decode ratio | "
             "decode floor tok/s | floor % | KV MB | KV / llama.cpp's |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = ("", "", "") if r["baseline"] else (f"{r['prefill_tok_s'] / r['vs']['prefill_tok_s']:.2f}x",
                                                    f"{r['decode_tok_s'] / r['vs']['decode_tok_s']:.2f}x",
                                                    f"1/{r['vs']['kv_bytes'] / r['kv_bytes']:.1f}")
        lines.append(f"| {r['model']} | {r['prompt']} | {r['engine']} | {r['prefill_tok_s']:.1f} | "
                     f"{r['decode_tok_s']:.1f} | {ratio[0]} | {ratio[1]} | {r['floor']:.1f} | "
                     f"{100 * r['decode_tok_s'] / r['floor']:.0f}% | {r['kv_bytes'] / 2**20:.1f} | {ratio[2]} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if not r["baseline"]]
    labels = [f"{r['model']} {r['prompt']}\n{r['engine'].replace('sharpi, ', '')}" for r in ours]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(ours)), 5), sharey=True)
    for ax, key, title in zip(axes, ("prefill_tok_s", "decode_tok_s"), ("prefill", "decode")):
        ratios = [r[key] / r["vs"][key] for r in ours]
        ax.barh(range(len(ours)), ratios, color=["tab:green" if x >= 1 else "tab:red" for x in ratios])
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(range(len(ours)), labels, fontsize=7)
        ax.set_xlabel("sharpi / llama.cpp (higher is faster)")
        ax.set_title(title)
        for i, x in enumerate(ratios):
            ax.text(x, i, f" {x:.2f}x", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--prompts", default="512,4096")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--matmuls", default="float,int8",
                   help="sharpi artifacts to time: float, int8, and either for another CPU (int8@znver3: its AVX2 "
                        "kernels on this one)")
    p.add_argument("--kv", default="default",
                   help="sharpi's KV cache types, an artifact each: default (the target's), f16, q8_0, q4_0, or K/V "
                        "(e.g. q8_0/q4_0); each timed with the full cache and with SnapKV at --budget, "
                        "or only one of the two with TYPE:full or TYPE:snapkv")
    p.add_argument("--llama-caches", default="default",
                   help="llama.cpp's cache types, a run each: default (f16, llama.cpp's defaults), or f16, q8_0, K/V "
                        "(-ctk/-ctv with -fa on); the first is the ratios' baseline")
    p.add_argument("--threads", type=int, default=None, help="both engines (default: all this process may use)")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="a PNG of the ratios")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed prefills in each engine's process first (a model too large for both engines' files "
                        "in the page cache is otherwise timed reading its weights from disk)")
    p.add_argument("--mlock", action="store_true",
                   help="sharpi's artifacts lock their weights in memory at load (sharpi's --mlock): where the "
                        "OS drops idle pages (a VM's proactive reclaim), a mixture's rarely chosen experts are "
                        "otherwise read from disk mid-decode. llama.cpp runs as it is: its CPU build repacks most "
                        "weights into memory of its own at load, and its --mlock would hold them twice")
    args = p.parse_args(argv)
    threads = resolve_threads(args.threads)
    started, about = time.strftime("%Y-%m-%d %H:%M"), machine()
    rows, bandwidths = [], []
    for name in args.models.split(","):
        bandwidths.append(read_bandwidth(threads))    # again for each model: a shared machine's varies by the hour
        rows += rows_for(name, [int(n) for n in args.prompts.split(",")], args.gen, args.repeats, args.budget,
                         args.matmuls.split(","), threads, bandwidths[-1], args.kv.split(","),
                         args.llama_caches.split(","), args.warmup, args.mlock)
    measured = ", ".join(f"{b / 1e9:.1f}" for b in bandwidths)
    text = (f"# sharpi vs llama.cpp on the CPU, {started}\n\n{about}; {llama_cpp_info()}.\n\nSame GGUF, prompt and "
            f"{threads} threads for both; decode of {args.gen} tokens after the prompt; every engine in a process of "
            f"its own, one run each per round, median of {args.repeats} rounds"
            f"{f', each after {args.warmup} untimed prefill(s)' if args.warmup else ''}"
            f"{', sharpi with --mlock' if args.mlock else ''}. Read bandwidth on {threads} threads, "
            f"measured before each model (its decode floor's): {measured} GB/s.\n\n"
            f"`python benchmarks/cpu_vs_llama_cpp.py {' '.join(argv or sys.argv[1:])}`\n\n{table(rows)}\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
