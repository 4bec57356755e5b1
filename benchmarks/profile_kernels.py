"""Where a prefill and a decode step spend their time, per kernel (CPU/CUDA artifacts run by TVM's VM).

    python benchmarks/profile_kernels.py ARTIFACT [--tokens 512] [--function prefill|decode|prefill_snapkv] [--top 25]
        [--steps N]

The VM's instrument hook times every call it makes (kernels and VM builtins) during one call of the chosen
function, after a warm-up prompt; the table sums them by name. The hook costs a little per call, so builtins
(allocation, tuple access) look larger than they are; kernel times are accurate to a few microseconds. On a GPU
the hook waits for the device before and after each call (`sync`), so a kernel's time is its launch and run.
With --steps N, decode profiles N steps after an untimed first one (which touches a fresh KV page) and the table
gives a step's average.
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

import sharpi


def profile(model, tokens: int, function: str, sync=None, steps: int = 1) -> tuple[dict, float]:
    """{name: [seconds, calls]} of one `function` call after `tokens` random prompt tokens, and its wall time;
    for decode with steps > 1, the sums over `steps` decode steps after an untimed one.
    `sync`: waits for the device (a GPU's kernels run asynchronously), called around every instrumented call."""
    backend = model.engine.backend    # the TVM backend: its VM and forward()
    vm = backend._vm
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    started: dict[str, float] = {}

    def instrument(func, name, before, ret, *args):
        if sync is not None:
            sync()
        if before:
            started[name] = time.perf_counter()
        else:
            totals[name][0] += time.perf_counter() - started[name]
            totals[name][1] += 1
        return 0

    forward = backend.forward
    walls: list[float] = []
    skipped = [function != "decode" or steps == 1]      # the untimed first decode step, once taken

    def timed_forward(name, *args, **kwargs):
        if name != function or len(walls) == steps:
            return forward(name, *args, **kwargs)
        if not skipped[0]:
            skipped[0] = True
            return forward(name, *args, **kwargs)
        vm.set_instrument(instrument)
        t = time.perf_counter()
        try:
            return forward(name, *args, **kwargs)
        finally:
            walls.append(time.perf_counter() - t)
            vm.set_instrument(None)

    ids = np.random.default_rng(0).integers(100, 20000, tokens).tolist()
    with model.session(snapkv_budget=0) as warm:        # compile caches, first-touch pages
        warm.prefill(ids[:32])
    backend.forward = timed_forward
    options = {"snapkv_budget": max(65, tokens // 2)} if function == "prefill_snapkv" else {"snapkv_budget": 0}
    with model.session(**options) as s:
        last = s.prefill(ids)
        if function == "decode":
            token = int(np.argmax(last))
            for _ in range(steps + (steps > 1)):
                token = int(np.argmax(s.decode(token)))
    backend.forward = forward
    return dict(totals), sum(walls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--function", default="decode", choices=["prefill", "decode", "prefill_snapkv"])
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--steps", type=int, default=1, help="decode: average over this many steps")
    args = p.parse_args()
    steps = args.steps if args.function == "decode" else 1
    totals, wall = profile(sharpi.load(args.artifact), args.tokens, args.function, steps=steps)
    totals = {name: [t / steps, n // steps] for name, (t, n) in totals.items()}
    wall /= steps
    total = sum(t for t, _ in totals.values())
    kernels = sum(n for name, (_, n) in totals.items() if not name.startswith(("vm.", "runtime.")))
    print(f"{args.function} after {args.tokens} tokens{f', a step of {steps}' if steps > 1 else ''}: "
          f"{wall * 1e3:.1f} ms wall (instrumented), "
          f"{kernels} kernel calls, {sum(n for _, n in totals.values()) - kernels} VM builtin calls")
    print(f"{'ms':>9} {'share':>6} {'calls':>6}  name")
    for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{t * 1e3:9.2f} {100 * t / total:5.1f}% {n:6d}  {name}")


if __name__ == "__main__":
    main()
