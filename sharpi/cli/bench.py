"""`sharpi bench`: prefill and decode speed, optionally beside llama.cpp on the same GGUF, prompt and threads.

Each engine is timed in a process of its own (`time_in_process`, which runs this module as a child): in one
process TVM's worker threads and llama.cpp's OpenMP threads spin against each other (llama.cpp's SmolLM2 decode
read 7 tok/s right after a sharpi run in the same process, 66-78 tok/s alone). With --compare-llama-cpp the
engines take turns, one run each per round, so a slow spell of the machine lands on both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..common.errors import ConfigError, SharpiError
from ..common.manifest import Manifest
from ..common.settings import resolve_threads
from ..frontend.fetch import models_dir
from ..runtime.model import Model
from ..runtime.model_info import ModelInfo
from .common import load_model, resolve_model_arg, snapkv_keywords, snapkv_knobs, speculative_options

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def prompt_ids(model, n_tokens: int) -> list[int]:
    """n_tokens of filler text; `model` is anything with tokenize() (a Model, or a runtime.model_info.ModelInfo)."""
    ids = model.tokenize(FILLER * (n_tokens // 10 + 2))
    return ids[:n_tokens]


def artifact_info(directory: Path) -> ModelInfo:
    """An artifact's tokenizer and manifest (its digest checked) without loading its kernels: the timing happens
    in other processes."""
    return ModelInfo(directory, Manifest.read(Path(directory)))


def bench_sharpi(model, tokens: list[int], n_gen: int, repeats: int, snapkv: dict | None = None,
                 warmup: int = 0, speculative: dict | None = None) -> dict:
    """Median prefill and decode speeds over `repeats` runs, after `warmup` untimed ones (a model larger than the
    page cache's room for two engines is read from disk by its first run). speculative: generate()'s speculative
    and draft options: greedy decoding through them (the acceptance rate reported too)."""
    prefill, decode = [], []
    for _ in range(warmup):
        with model.session(**(snapkv or {})) as s:
            s.prefill(tokens)
    if speculative:
        return _bench_speculative(model, tokens, n_gen, repeats, snapkv, speculative)
    for _ in range(repeats):
        with model.session(**(snapkv or {})) as s:
            t0 = time.perf_counter()
            logits = s.prefill(tokens)
            t1 = time.perf_counter()
            token = int(np.argmax(logits))
            for _ in range(n_gen):
                token = int(np.argmax(s.decode(token)))
            t2 = time.perf_counter()
            kv_bytes = s.kv_bytes
        prefill.append(len(tokens) / (t1 - t0))
        decode.append(n_gen / (t2 - t1) if n_gen else 0.0)
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "kv_bytes": kv_bytes}


def _bench_speculative(model, tokens, n_gen, repeats, snapkv, speculative) -> dict:
    runs = [model.generate(tokens, n_gen + 1, **(snapkv or {}), **speculative).stats for _ in range(repeats)]
    return {"prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "acceptance_rate": statistics.median(r["acceptance_rate"] for r in runs)}


# llama.cpp's cache types (ggml's type ids), for -ctk / -ctv
LLAMA_CACHE_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}


def bench_llama_cpp(gguf: Path, tokens: list[int], n_gen: int, threads: int, repeats: int,
                    cache: str | None = None, warmup: int = 0) -> dict:
    """cache: "f16", "q8_0", ... or "K/V" (llama.cpp's -ctk/-ctv, with flash attention on, which its quantized
    V cache needs); None: llama.cpp's defaults (an f16 cache). `warmup` untimed prefills first, as bench_sharpi."""
    from llama_cpp import Llama

    kv = {}
    if cache is not None:
        k, _, v = cache.partition("/")
        kv = {"type_k": LLAMA_CACHE_TYPES[k], "type_v": LLAMA_CACHE_TYPES[v or k], "flash_attn": True}
    llm = Llama(model_path=str(gguf), n_ctx=max(2048, len(tokens) + n_gen + 16), n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False, logits_all=False, **kv)
    for _ in range(warmup):
        llm.reset()
        llm.eval(tokens)
    prefill, decode = [], []
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        t1 = time.perf_counter()
        for _ in range(n_gen):
            token = int(np.argmax(llm._scores[-1]))   # without logits_all only the last row is kept
            llm.eval([token])
        t2 = time.perf_counter()
        prefill.append(len(tokens) / (t1 - t0))
        decode.append(n_gen / (t2 - t1) if n_gen else 0.0)
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}


def time_in_process(spec: dict) -> dict:
    """Time one engine in a child process: spec {"engine": "sharpi", "artifact", ...} or {"engine": "llama.cpp",
    "gguf", ...} with "tokens", "gen", "threads", "repeats" (and "snapkv" for sharpi); returns the child's
    {"prefill_tok_s", "decode_tok_s"}. A SharpiError in the child is raised here with its sentence."""

    done = subprocess.run([sys.executable, "-m", "sharpi.cli.bench", "--child"], input=json.dumps(spec),
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SharpiError(f"The {spec['engine']} timing process failed: {last}")
    result = json.loads(lines[-1])
    if "error" in result:
        raise ConfigError(result["error"])
    return result


def _child() -> int:
    """The timing process: one engine, the spec on stdin, the result as the last line of stdout."""

    spec = json.loads(sys.stdin.read())
    try:
        if spec["engine"] == "llama.cpp":
            result = bench_llama_cpp(Path(spec["gguf"]), spec["tokens"], spec["gen"], spec["threads"],
                                     spec["repeats"], spec.get("cache"), spec.get("warmup", 0))
        else:
            model = Model(spec["artifact"], threads=spec["threads"], pool_sequences=1,
                          lock_weights=spec.get("mlock", False))
            speculative = spec.get("speculative")
            if speculative and "draft" in speculative:
                speculative = {**speculative, "draft": model.draft_model(speculative["draft"])}
            result = bench_sharpi(model, spec["tokens"], spec["gen"], spec["repeats"], spec.get("snapkv"),
                                  spec.get("warmup", 0), speculative)
    except SharpiError as exc:
        result = {"error": str(exc)}
    print(json.dumps(result))
    return 0


def rounds(specs: dict[str, dict], repeats: int) -> dict[str, dict]:
    """Each engine of `specs` once per round, `repeats` rounds, each run in its own process; medians per engine.
    Pending writes are flushed first: an artifact compiled just now is written back to disk for minutes after
    (18 GB for a 30B mixture), and both engines run slower meanwhile."""
    if hasattr(os, "sync"):
        os.sync()
    samples = {label: [] for label in specs}
    for _ in range(repeats):
        for label, spec in specs.items():
            samples[label].append(time_in_process({**spec, "repeats": 1}))
    return {label: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
            for label, runs in samples.items()}


def find_gguf(manifest, explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    candidate = models_dir() / manifest.source["name"]
    return candidate if candidate.is_file() else None


def run_bench(args) -> None:
    given = args.artifact                          # a GGUF or a name: its cached compile (the GGUF also llama.cpp's)
    resolve_model_arg(args)
    if args.gguf is None and Path(given).is_file():
        args.gguf = given
    tokenizer = artifact_info(Path(args.artifact))
    manifest = tokenizer.manifest
    threads = resolve_threads(args.threads)
    snapkv = snapkv_keywords(args)
    # here only to check the flags against the artifact before any timing (each child locks its own weights)
    model = load_model(argparse.Namespace(**{**vars(args), "mlock": False}))
    settings, budget = model.snapkv_settings(**snapkv_knobs(args))
    speculative = speculative_options(model, args)
    if "draft" in speculative:       # the child process loads it again, by its directory
        speculative["draft"] = str(speculative["draft"].path.resolve())
    print(f"sharpi bench: {manifest.source['name']} on {model.backend}, prompt {args.prompt_tokens} tokens, "
          f"{args.gen_tokens} generated, median of {args.repeats}, each engine in a process of its own")
    del model
    if budget:
        sinks = f", sinks {settings.sinks}" if settings.sinks else ""
        print(f"SnapKV: budget {budget}, window {settings.window}, recency {settings.recency}{sinks}, "
              f"{settings.pooling} pooling (kernel {settings.kernel}), {settings.granularity} keep sets")
    tokens = prompt_ids(tokenizer, args.prompt_tokens)
    common = {"tokens": tokens, "gen": args.gen_tokens, "threads": threads}
    # --mlock is sharpi's alone: llama.cpp's CPU build repacks most weights into memory of its own at load, and
    # locking its mapped GGUF besides would hold a large model twice
    specs = {"sharpi": {"engine": "sharpi", "artifact": str(Path(args.artifact).resolve()), "snapkv": snapkv,
                        "speculative": speculative, "mlock": args.mlock, **common}}
    if args.compare_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise ConfigError("--compare-llama-cpp needs llama-cpp-python (pip install llama-cpp-python).") from None
        gguf = find_gguf(manifest, args.gguf)
        if gguf is None:
            raise ConfigError("--compare-llama-cpp could not find the GGUF; pass it with --gguf.")
        specs["llama.cpp"] = {"engine": "llama.cpp", "gguf": str(gguf), **common}
    rows = rounds(specs, args.repeats)
    print(f"{'engine':<10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, r in rows.items():
        print(f"{name:<10} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
    if speculative:
        print(f"speculative {speculative['speculative'].get('method', 'draft')}: "
              f"{rows['sharpi']['acceptance_rate']:.0%} of the drafted tokens accepted (median run)")
    if len(rows) == 2:
        ours, theirs = rows["sharpi"], rows["llama.cpp"]
        decode = ours["decode_tok_s"] / theirs["decode_tok_s"] if theirs["decode_tok_s"] else float("nan")
        print(f"{'ratio':<10} {ours['prefill_tok_s'] / theirs['prefill_tok_s']:>13.2f}x {decode:>12.2f}x   "
              f"(sharpi / llama.cpp)")
    sys.stdout.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    sys.exit(_child())
