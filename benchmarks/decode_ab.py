"""A/B decode speed of several artifacts in one process: each prefills the same prompt once, then the artifacts take
turns, a round of --steps greedy decode steps each (on a fork of the prefilled session), for --rounds rounds; prints
min and median ms per step. Turns make a noisy neighbour slow every artifact alike, so a few percent show.

    python benchmarks/decode_ab.py ART_A ART_B [...] [--prompt-tokens 512] [--steps 24] [--rounds 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import sharpi


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    models = [sharpi.load(a, threads=args.threads) for a in args.artifacts]
    ids = np.random.default_rng(0).integers(100, 2000, args.prompt_tokens).tolist()
    prefilled = []
    for model in models:
        s = model.session(snapkv_budget=0)
        s.prefill(ids)
        prefilled.append(s)
    times = {a: [] for a in args.artifacts}
    for _ in range(args.rounds):
        for name, base in zip(args.artifacts, prefilled):
            with base.fork() as s:
                token, t0 = 5, time.perf_counter()
                for _ in range(args.steps):
                    token = int(np.argmax(s.decode(token)))
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    for name, v in times.items():
        median = statistics.median(v)
        print(f"{name}: min {min(v):.2f} ms, median {median:.2f} ms/step ({1e3 / median:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
