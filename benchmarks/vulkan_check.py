"""The Vulkan backend issue's acceptance at full size, against the CPU artifact of the same GGUF, in one run:
teacher-forced logits over the golden text, greedy generation of 32 tokens from each golden prompt (generated on
both backends), SnapKV with budget 256 on a 1040-token prompt, and speed. On lavapipe this takes about half an
hour (a software device: ~0.3 GFLOP/s); the tests check the same properties on smaller inputs.

    python benchmarks/vulkan_check.py [--model smollm2-135m] [--adapter NAME] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import sharpi
from sharpi.cli.bench import prompt_ids
from sharpi.testing.backends import greedy_agrees, snapkv_agreement
from sharpi.testing.reference import log_softmax

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2-135m-instruct-q4_1.json"


def teacher_forced(vk, cpu, ids) -> dict:
    lv, lc = log_softmax(vk.score(ids)), log_softmax(cpu.score(ids))
    steps = np.arange(len(ids) - 1)
    return {"tokens": len(ids), "top1_agreement": float((lv.argmax(-1) == lc.argmax(-1)).mean()),
            "max_abs_logprob_diff": float(np.abs(lv[steps, ids[1:]] - lc[steps, ids[1:]]).max())}


def greedy(vk, cpu, prompts, tokens=32) -> list[dict]:
    """Both backends generate; the comparison may stop at a step where the CPU's top-2 margin is < 1e-3."""
    rows = []
    for ids in prompts:
        mine, theirs = vk.generate(ids, max_tokens=tokens), cpu.generate(ids, max_tokens=tokens)
        seq = ids + theirs.token_ids
        cpu_logits = cpu.score(seq)[len(ids) - 1:]
        n = min(len(mine.token_ids), len(theirs.token_ids))
        first_diff = next((i for i in range(n) if mine.token_ids[i] != theirs.token_ids[i]), None)
        agrees, compared = greedy_agrees(cpu_logits, cpu_logits, theirs.token_ids)   # where the near-tie rule stops
        rows.append({"prompt_tokens": len(ids), "equal": mine.token_ids == theirs.token_ids,
                     "first_difference": first_diff, "near_tie_at": None if compared == len(theirs.token_ids)
                     else compared, "vulkan_text": mine.text, "cpu_text": theirs.text})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--adapter", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    golden = json.loads(GOLDEN.read_text())
    vk = sharpi.load(sharpi.compile(args.model, target="vulkan", output="/tmp/sharpi-check-vk"), adapter=args.adapter)
    cpu = sharpi.load(sharpi.compile(args.model, target="llvm", output="/tmp/sharpi-check-cpu"))
    print(f"vulkan: {vk.backend}; reference: {cpu.backend}", flush=True)
    results = {"adapter": vk.backend}
    t = time.perf_counter()
    results["teacher_forced"] = teacher_forced(vk, cpu, golden["teacher_forced"]["ids"])
    print("teacher-forced:", results["teacher_forced"], f"({time.perf_counter() - t:.0f} s)", flush=True)
    t = time.perf_counter()
    results["greedy"] = greedy(vk, cpu, [g["prompt_ids"] for g in golden["greedy"]])
    print("greedy:", [(r["equal"], r["first_difference"], r["near_tie_at"]) for r in results["greedy"]],
          f"({time.perf_counter() - t:.0f} s)", flush=True)
    t = time.perf_counter()
    snap = snapkv_agreement(vk, cpu, prompt_ids(cpu, 1040), budget=256)
    results["snapkv"] = {**snap, "kv_length": [snap["kv_length"][0][0], snap["kv_length"][1][0]]}
    print("snapkv:", results["snapkv"], f"({time.perf_counter() - t:.0f} s)", flush=True)
    gen = vk.generate(prompt_ids(cpu, 64), max_tokens=16)
    results["speed"] = {k: gen.stats[k] for k in ("prompt_tokens", "prefill_tok_s", "generated_tokens", "decode_tok_s")}
    print("speed:", results["speed"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
