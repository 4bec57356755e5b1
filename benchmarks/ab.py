"""A/B speed of several artifacts in one process. Decode (the default): each prefills the same prompt once, then the
artifacts take turns, a round of --steps greedy decode steps each (on a fork of the prefilled session), for --rounds
rounds; prints min and median ms per step. --prefill: the artifacts take turns prefilling the prompt in a fresh
session; prints min and median ms per prefill and tokens/s. Turns make a noisy neighbour slow every artifact alike,
so a few percent show. Each later artifact's time over the first's, per round, with a 95% bootstrap interval of
their median: an interval below 1.03 excludes a loss of more than 3%.

    python benchmarks/ab.py ART_A ART_B [...] [--prefill] [--prompt-tokens 512] [--steps 24] [--rounds 7] [--threads 2]
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
    p.add_argument("--prefill", action="store_true", help="time prefills of the prompt instead of decode steps")
    args = p.parse_args(argv)
    models = [sharpi.load(a, threads=args.threads) for a in args.artifacts]
    ids = np.random.default_rng(0).integers(100, 2000, args.prompt_tokens).tolist()
    if args.prefill:
        return _prefill_ab(args, models, ids)
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
    _print_ratios(times)
    return 0


def _prefill_ab(args, models, ids) -> int:
    for model in models:                      # warm-up: first-touch pages, thread pool
        with model.session(snapkv_budget=0) as s:
            s.prefill(ids[:64])
    times = {a: [] for a in args.artifacts}
    for _ in range(args.rounds):
        for name, model in zip(args.artifacts, models):
            with model.session(snapkv_budget=0) as s:
                t0 = time.perf_counter()
                s.prefill(ids)
                times[name].append((time.perf_counter() - t0) * 1e3)
    for name, v in times.items():
        median = statistics.median(v)
        print(f"{name}: prefill of {len(ids)} tokens min {min(v):.1f} ms, median {median:.1f} ms "
              f"({len(ids) / median * 1e3:.1f} tok/s)")
    _print_ratios(times)
    return 0


def _print_ratios(times: dict[str, list[float]], resamples: int = 4000) -> None:
    """Each later artifact's time over the first's in the same round: the median ratio and its 95% bootstrap
    interval (rounds resampled with replacement)."""
    names = list(times)
    base = np.array(times[names[0]])
    rng = np.random.default_rng(0)
    for name in names[1:]:
        ratios = np.array(times[name]) / base
        medians = np.median(rng.choice(ratios, (resamples, len(ratios))), axis=1)
        low, high = np.percentile(medians, [2.5, 97.5])
        print(f"{name} / {names[0]}: time ratio median {np.median(ratios):.3f}, 95% interval [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    sys.exit(main())
