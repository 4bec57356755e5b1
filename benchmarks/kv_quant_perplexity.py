"""Perplexity with quantized KV caches, sharpi beside llama.cpp with the same cache types (-ctk / -ctv, flash
attention on: llama.cpp's quantized V cache needs it), on the golden text (tests/data: llama.cpp's teacher-forced
ids) and on the first --long tokens of sharpi's Alice text (a longer context, where a cache's rounding has more
keys to spoil).

    python benchmarks/kv_quant_perplexity.py [--models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b]
        [--types f16,q8_0,q4_0,q8_0/q4_0] [--long 1024] [--out benchmarks/kv_quant.md] [--no-llama]

A type "K/V" gives keys and values their own; llama.cpp's column is left empty for types it lacks (q4_ch keys) and
with --no-llama. Each llama.cpp run is a process of its own (its model and logits
freed between runs); sharpi compiles one artifact per type (int8 matmuls, the CPU default) through the compile
cache. Needs llama-cpp-python.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from importlib import resources
from pathlib import Path

import numpy as np

import sharpi
from sharpi.common.tokenizer import build_from_gguf_metadata
from sharpi.frontend.fetch import fetch
from sharpi.frontend.gguf_file import GGUFFile
from sharpi.testing.reference import log_softmax

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
GOLDEN = {"smollm2-135m": "smollm2-135m-instruct-q4_1.json", "gemma3-270m": "gemma3-270m-q4_k_m.json",
          "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.json"}
GGML_TYPE = {"f16": 1, "q4_0": 2, "q8_0": 8}


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    lp = log_softmax(logits)
    return float(np.exp(-lp[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean()))


def sharpi_perplexity(model: str, kv: str, texts: dict[str, list[int]]) -> dict[str, float]:
    k, v = kv.split("/") if "/" in kv else (kv, kv)
    artifact = sharpi.load(sharpi.compile(model, output=Path(f"/tmp/sharpi-kvq/{model}-{k}-{v}"), kv_dtype_k=k,
                                          kv_dtype_v=v))
    return {name: perplexity(artifact.score(ids), ids) for name, ids in texts.items()}


def _llama_worker(gguf: str, kv: str, texts: dict, out) -> None:
    from llama_cpp import Llama
    k, v = kv.split("/") if "/" in kv else (kv, kv)
    longest = max(len(ids) for ids in texts.values())
    llm = Llama(model_path=gguf, n_ctx=longest + 8, n_threads=2, n_batch=512, logits_all=True, verbose=False,
                flash_attn=True, type_k=GGML_TYPE[k], type_v=GGML_TYPE[v], seed=0)
    result = {}
    for name, ids in texts.items():
        llm.reset()
        llm.eval(ids)
        result[name] = perplexity(np.asarray(llm.scores[:len(ids)], np.float32), ids)
    out.put(result)


def llama_perplexity(gguf: str, kv: str, texts: dict) -> dict[str, float]:
    queue = multiprocessing.get_context("spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(target=_llama_worker, args=(gguf, kv, texts, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def texts_for(model: str, long: int) -> dict[str, list[int]]:
    golden = json.loads((DATA / GOLDEN[model]).read_text())["teacher_forced"]["ids"]
    # the GGUF's own tokenizer: compiling an artifact for it wrote one into the working directory
    tokenizer, _ = build_from_gguf_metadata(GGUFFile(fetch(model, show_progress=False)).metadata)
    alice = resources.files("sharpi.eval").joinpath("data/alice.txt").read_text(encoding="utf-8")
    ids = tokenizer.tokenize(alice)[:long]
    return {"golden": golden, f"alice {long}": ids}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    p.add_argument("--types", default="f16,q8_0,q4_0,q8_0/q4_0")
    p.add_argument("--long", type=int, default=1024)
    p.add_argument("--out", default=None)
    p.add_argument("--no-llama", action="store_true", help="sharpi's column alone (no llama-cpp-python needed)")
    args = p.parse_args(argv)
    rows = ["| model | text | cache (K/V) | sharpi ppl | vs sharpi f16 | llama.cpp ppl | vs llama.cpp f16 |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for model in args.models.split(","):
        gguf = str(fetch(model, show_progress=False))
        texts = texts_for(model, args.long)
        ours = {kv: sharpi_perplexity(model, kv, texts) for kv in args.types.split(",")}
        theirs = {kv: llama_perplexity(gguf, kv, texts) for kv in args.types.split(",")
                  if not args.no_llama and all(t in GGML_TYPE for t in kv.split("/"))}
        for name in texts:
            base_ours = ours["f16"][name]
            for kv in args.types.split(","):
                a = ours[kv][name]
                b = f"{theirs[kv][name]:.3f} | {100 * (theirs[kv][name] / theirs['f16'][name] - 1):+.2f}%" \
                    if kv in theirs and "f16" in theirs else " | "
                rows.append(f"| {model} | {name} ({len(texts[name])} tokens) | {kv} | {a:.3f} | "
                            f"{100 * (a / base_ours - 1):+.2f}% | {b} |")
                print(rows[-1], flush=True)
    table = "\n".join(rows) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
