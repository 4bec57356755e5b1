"""`sharpi bench`: prefill and decode speed, optionally beside llama.cpp on the same GGUF and threads."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def prompt_ids(model, n_tokens: int) -> list[int]:
    ids = model.tokenize(FILLER * (n_tokens // 10 + 2))
    return ids[:n_tokens]


def bench_sharpi(model, n_prompt: int, n_gen: int, repeats: int, snapkv: dict | None = None) -> dict:
    ids = prompt_ids(model, n_prompt)
    prefill, decode = [], []
    for _ in range(repeats):
        with model.session(**(snapkv or {})) as s:
            t0 = time.perf_counter()
            logits = s.prefill(ids)
            t1 = time.perf_counter()
            token = int(np.argmax(logits))
            for _ in range(n_gen):
                token = int(np.argmax(s.decode(token)))
            t2 = time.perf_counter()
        prefill.append(len(ids) / (t1 - t0))
        decode.append(n_gen / (t2 - t1))
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}


def bench_llama_cpp(gguf: Path, n_prompt: int, n_gen: int, threads: int, repeats: int, tokens: list[int]) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=max(2048, n_prompt + n_gen + 16), n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False, logits_all=False)
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
        decode.append(n_gen / (t2 - t1))
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}


def find_gguf(model, explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    from ..frontend.fetch import models_dir
    candidate = models_dir() / model.manifest.source["name"]
    return candidate if candidate.is_file() else None


def run_bench(args) -> None:
    from ..common.errors import ConfigError
    from .common import load_model

    model = load_model(args)
    print(f"sharpi bench: {model.manifest.source['name']} on {model.backend}, "
          f"prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, median of {args.repeats}")
    from .common import snapkv_kwargs
    snapkv = snapkv_kwargs(args)
    settings, budget = model.snapkv_settings(**{k[len("snapkv_"):]: v for k, v in snapkv.items()})
    if budget:
        sinks = f", sinks {settings.sinks}" if settings.sinks else ""
        print(f"SnapKV: budget {budget}, window {settings.window}, recency {settings.recency}{sinks}, "
              f"{settings.pooling} pooling (kernel {settings.kernel}), {settings.granularity} keep sets")
    ours = bench_sharpi(model, args.prompt_tokens, args.gen_tokens, args.repeats, snapkv)
    rows = [("sharpi", ours)]
    if args.compare_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise ConfigError("--compare-llama-cpp needs llama-cpp-python (pip install llama-cpp-python).") from None
        gguf = find_gguf(model, args.gguf)
        if gguf is None:
            raise ConfigError("--compare-llama-cpp could not find the GGUF; pass it with --gguf.")
        theirs = bench_llama_cpp(gguf, args.prompt_tokens, args.gen_tokens, model.threads, args.repeats,
                                 prompt_ids(model, args.prompt_tokens))
        rows.append(("llama.cpp", theirs))
    print(f"{'engine':<10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, r in rows:
        print(f"{name:<10} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
    if len(rows) == 2:
        print(f"{'ratio':<10} {ours['prefill_tok_s'] / rows[1][1]['prefill_tok_s']:>13.2f}x "
              f"{ours['decode_tok_s'] / rows[1][1]['decode_tok_s']:>12.2f}x   (sharpi / llama.cpp)")
    sys.stdout.flush()
