"""Decode speed and KV bytes after a long prompt, SnapKV budget vs no eviction, side by side in one run.

    python benchmarks/snapkv_decode.py ARTIFACT [PROMPT_TOKENS=4096] [BUDGET=1024] [DECODE_TOKENS=64]

One prefill (scored, not evicted); two forks: one keeps the full cache, one is evicted to the budget; each then
decodes the same greedy continuation. Prints tok/s, KV bytes and the ratios.
"""
import sys
import time

import numpy as np

import sharpi
from sharpi.cli.bench import prompt_ids


def decode_rate(session, logits, steps: int) -> float:
    token = int(np.argmax(logits))
    start = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(session.decode(token)))
    return steps / (time.perf_counter() - start)


def main() -> None:
    artifact = sys.argv[1]
    n_prompt, budget, steps = (int(a) for a in (sys.argv[2:] + ["4096", "1024", "64"][len(sys.argv) - 2:])[:3])
    model = sharpi.load(artifact)
    ids = prompt_ids(model, n_prompt)
    with model.session(snapkv_budget=0) as base:
        t0 = time.perf_counter()
        logits = base.prefill(ids, keep_scores=True)
        print(f"prefill {len(ids)} tokens (scored): {time.perf_counter() - t0:.1f} s")
        with base.fork() as full, base.fork() as evicted:
            evicted.evict(budget)
            rows = []
            for name, s in (("full cache", full), (f"SnapKV {budget}", evicted)):
                bytes_before = s.kv_bytes
                rows.append((name, decode_rate(s, logits, steps), bytes_before))
    print(f"{'cache':<14} {'decode tok/s':>12} {'KV MiB':>8}")
    for name, rate, kv in rows:
        print(f"{name:<14} {rate:>12.1f} {kv / 2**20:>8.1f}")
    print(f"ratio: decode {rows[1][1] / rows[0][1]:.2f}x faster, KV {rows[0][2] / rows[1][2]:.2f}x smaller")


if __name__ == "__main__":
    main()
