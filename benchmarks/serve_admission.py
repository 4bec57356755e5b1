"""What a long prompt's admission does to the streams already running: their inter-token latency without it (p50)
and while it is prefilled (p99), with the prefill budget in tokens alone and in cost (ServeSettings.prefill_share).

    python benchmarks/serve_admission.py ARTIFACT [--threads 2] [--streams 4] [--long 4000] [--shares 0 1]

In-process ServeEngine, no HTTP: `streams` requests generate without end (ignore_eos) from short prompts; once each
has given 24 tokens, their gaps are recorded for `--quiet` seconds (the p50 without), then a `long`-token prompt
(the shipped Alice text) is submitted and their gaps are recorded until its first token (the p99 during its
admission, and its time to first token). One engine after the other, each share in turn, in this process.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

import sharpi
from sharpi.runtime.sampling import SamplingParams
from sharpi.serve.engine import ServeEngine, ServeSettings
from sharpi.serve.request import GenerationRequest

ALICE = Path(__file__).resolve().parents[1] / "sharpi" / "eval" / "data" / "alice.txt"


def run(model, share: float | None, streams: int, long_tokens: int, quiet: float) -> dict:
    engine = ServeEngine(model, ServeSettings(parallel=streams + 1, prefill_share=share)).start()
    stamps: list[list[float]] = [[] for _ in range(streams)]
    phase = {"name": "warm"}
    gaps = {"quiet": [], "admission": []}
    first = threading.Event()
    lock = threading.Lock()

    def on_stream(i):
        def on_event(event):
            if event.kind != "text":
                return
            now = time.monotonic()
            with lock:
                if stamps[i] and phase["name"] in gaps:
                    gaps[phase["name"]].append(now - stamps[i][-1])
                stamps[i].append(now)
        return on_event

    handles = []
    for i in range(streams):
        ids = model.tokenize(f"Story {i}: once upon a time, in a land far away,")
        handles.append(engine.submit(GenerationRequest(ids, max_tokens=100_000, sampling=SamplingParams(),
                                                       ignore_eos=True), on_stream(i)))
    deadline = time.monotonic() + 300
    while min(len(s) for s in stamps) < 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    with lock:
        phase["name"] = "quiet"
    time.sleep(quiet)
    long_ids = model.tokenize(ALICE.read_text())[:long_tokens]
    submitted = time.monotonic()
    with lock:
        phase["name"] = "admission"
    engine.submit(GenerationRequest(long_ids, max_tokens=1, sampling=SamplingParams()),
                  lambda e: first.set() if e.kind in ("text", "finish") else None)
    first.wait(timeout=600)
    ttft = time.monotonic() - submitted
    with lock:
        phase["name"] = "done"
    for h in handles:
        h.cancel()
    engine.shutdown(cancel=True, timeout=30)
    quiet_p50 = statistics.median(gaps["quiet"])
    during = np.array(gaps["admission"] or [0.0])     # none: admitted within one step
    return {"share": share, "quiet_p50_ms": quiet_p50 * 1e3, "admission_p50_ms": float(np.median(during)) * 1e3,
            "admission_p99_ms": float(np.percentile(during, 99)) * 1e3,
            "p99_over_p50": float(np.percentile(during, 99)) / quiet_p50, "ttft_s": ttft, "gaps": len(during)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--long", type=int, default=4000)
    p.add_argument("--quiet", type=float, default=4.0, help="seconds of gaps recorded before the long prompt")
    p.add_argument("--shares", type=float, nargs="+", default=[0, 1], help="prefill_share values (0: tokens alone)")
    args = p.parse_args()
    model = sharpi.load(args.artifact, threads=args.threads, pool_tokens=args.long + args.streams * 2048)
    print(f"{model.backend}; {args.streams} streams, a {args.long}-token prompt admitted beside them")
    print(f"{'prefill budget':<22} {'p50 without':>12} {'p50 during':>11} {'p99 during':>11} {'p99/p50':>8} "
          f"{'long TTFT':>10}")
    for share in args.shares:
        r = run(model, share or None, args.streams, args.long, args.quiet)
        label = "tokens (chunk)" if not share else f"cost, share {share:g}"
        print(f"{label:<22} {r['quiet_p50_ms']:>10.1f}ms {r['admission_p50_ms']:>9.1f}ms "
              f"{r['admission_p99_ms']:>9.1f}ms {r['p99_over_p50']:>7.2f}x {r['ttft_s']:>9.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
