"""Prefill cost of each scorer against a plain prefill, side by side in one process (one engine): SnapKV (its
window scored inside the prefill), kvzip and probe (after it, on forks), keydiff (the cache's keys read once),
each compressing to 512 slots.

    python benchmarks/compression_cost.py [ARTIFACT] [LENGTHS]   # default: the serve benchmark's SmolLM2 int8
                                                                 # artifact, 1000,4000 tokens
"""
import sys
import time

import sharpi
from sharpi.cli.bench import prompt_ids

artifact = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sharpi-serve-bench-smollm2-135m"
m = sharpi.load(artifact, threads=2)
SCORERS = (("plain", {}), ("snapkv", {"snapkv_budget": 512}), ("kvzip", {"compress": "kvzip", "snapkv_budget": 512}),
           ("probe", {"compress": "probe", "snapkv_budget": 512}),
           ("keydiff", {"compress": "keydiff", "snapkv_budget": 512}))
for n in (int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1000,4000").split(",")):
    ids = prompt_ids(m, n)
    for _ in range(2):
        seconds = {}
        for name, knobs in SCORERS:
            with m.session(**knobs) as s:
                start = time.perf_counter()
                s.prefill(ids)
                seconds[name] = time.perf_counter() - start
        print(n, "tokens:", ", ".join(f"{k} {v:.2f} s ({v / seconds['plain']:.2f}x)" for k, v in seconds.items()),
              flush=True)
