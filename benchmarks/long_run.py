"""One long generation, watched: python benchmarks/long_run.py MODEL [--prompt-tokens 2000] [--budget 1024]
[--max-tokens N] [--every 500] [--json FILE]

MODEL is a known model name or a GGUF (compiled for this CPU, through the compile cache) or an artifact
directory. A prompt of --prompt-tokens filler tokens is prefilled in a session with SnapKV budget --budget (so
the cache is compacted at the start), then the model generates through the public stream API until it stops:
at the end of the context, or after --max-tokens (default: as many as the context allows). Stop tokens are
masked out of the logits so that the run is not cut short by an end-of-turn token (this measures the cache and
the loop, not the text); sampling is greedy.

Every --every steps it records the logical length, the slots held per layer, the KV bytes the session holds,
the process's resident memory (VmRSS) and the decode speed, and checks that every logits vector so far was
finite. At the end: the finish reason (expected: "length"), RSS growth beside KV growth (a leak would show as
RSS growing faster than the pages held), and the slowest interval.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import sharpi
from sharpi.cli.bench import prompt_ids


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Watch:
    """Stands in for the generation's sampler: checks each logits vector, masks stop tokens, samples greedily
    with the real sampler, and records the session's state every `every` steps."""

    def __init__(self, generation, stop_ids, every: int):
        self.inner, self.session = generation.sampler, generation.session
        self.stop_ids = sorted(stop_ids)
        self.every = every
        self.steps = 0
        self.nonfinite_steps = 0
        self.samples: list[dict] = []
        self.final: dict | None = None
        self._last = (time.perf_counter(), 0)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        if not np.isfinite(logits).all():
            self.nonfinite_steps += 1
        if self.steps % self.every == 0:
            self.record()
        else:
            self.final = self.state()          # the session closes when the loop ends: keep its last state
        self.steps += 1
        masked = np.array(logits, copy=True)
        masked[self.stop_ids] = -np.inf
        return self.inner(masked, history)

    def state(self) -> dict:
        now = time.perf_counter()
        then, steps = self._last
        s = self.session
        return {"step": self.steps, "logical_length": s.logical_length, "max_slots": max(s.kv_length),
                "min_slots": min(s.kv_length), "kv_bytes": s.kv_bytes, "rss_bytes": rss_bytes(),
                "tok_s": (self.steps - steps) / (now - then) if self.steps > steps else None, "time": now}

    def record(self) -> None:
        self.final = self.state()
        self.samples.append(self.final)
        self._last = (self.final["time"], self.steps)

    def finish(self) -> None:
        if self.final is not self.samples[-1]:
            self.samples.append(self.final)


def artifact_for(model: str) -> Path:
    path = Path(model)
    if (path / "manifest.json").is_file():
        return path
    return sharpi.compile(model, output=Path("/tmp") / f"sharpi-long-run-{Path(model).stem}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    rss_before_load = rss_bytes()
    model = sharpi.load(artifact_for(args.model))
    ids = prompt_ids(model, args.prompt_tokens)
    max_tokens = args.max_tokens or model.max_context
    rss_loaded = rss_bytes()
    started = time.perf_counter()
    generation = model.stream(ids, max_tokens, snapkv_budget=args.budget)
    watch = Watch(generation, model.tokenizer.info.stop_ids, args.every)
    generation.sampler = watch
    pieces = sum(1 for _ in generation)
    watch.finish()
    elapsed = time.perf_counter() - started
    result = generation.result
    samples = watch.samples
    first, last = samples[0], samples[-1]      # first: right after prefill and eviction
    report = {
        "model": model.manifest.source["name"], "backend": model.backend, "context": model.max_context,
        "prompt_tokens": len(ids), "budget": args.budget, "max_tokens": max_tokens,
        "finish_reason": result.finish_reason, "generated_tokens": len(result.token_ids), "text_pieces": pieces,
        "evicted": result.stats["evicted"], "kv_slots_after_prefill": result.stats["kv_slots_after_prefill"],
        "final_logical_length": last["logical_length"], "nonfinite_logits_steps": watch.nonfinite_steps,
        "prefill_s": round(result.stats["prefill_s"], 1), "decode_s": round(result.stats["decode_s"], 1),
        "decode_tok_s": round(result.stats["decode_tok_s"], 1), "wall_s": round(elapsed, 1),
        "rss_before_load_mib": rss_before_load / 2**20, "rss_loaded_mib": rss_loaded / 2**20,
        "rss_after_prefill_mib": first["rss_bytes"] / 2**20, "rss_end_mib": last["rss_bytes"] / 2**20,
        "kv_after_prefill_mib": first["kv_bytes"] / 2**20, "kv_end_mib": last["kv_bytes"] / 2**20,
        "rss_growth_mib": (last["rss_bytes"] - first["rss_bytes"]) / 2**20,
        "kv_growth_mib": (last["kv_bytes"] - first["kv_bytes"]) / 2**20,
        "slowest_interval_tok_s": min((s["tok_s"] for s in samples if s["tok_s"]), default=None),
        "samples": samples,
    }
    summary = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    print(f"{'step':>7} {'logical':>8} {'slots':>11} {'KV MiB':>8} {'RSS MiB':>8} {'tok/s':>6}")
    for s in samples:
        tok_s = f"{s['tok_s']:.1f}" if s["tok_s"] else "-"
        print(f"{s['step']:>7} {s['logical_length']:>8} {s['min_slots']:>5}-{s['max_slots']:<5} "
              f"{s['kv_bytes'] / 2**20:>8.1f} {s['rss_bytes'] / 2**20:>8.1f} {tok_s:>6}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
