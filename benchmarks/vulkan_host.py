"""What a Vulkan decode step costs the host: the wgpu calls it makes and the host's time to make them, on this
machine's Vulkan device (lavapipe on a CPU machine, where the GPU's own time is the CPU's too, so the host part is
timed apart from it).

    python benchmarks/vulkan_host.py ARTIFACT [ARTIFACT ...] [--prompt-tokens 64] [--steps 32] [--json FILE]

For each artifact (a vulkan one), in a process of its own: prefill a prompt, then --steps greedy decode steps.
Each step is timed two ways: `host`, from the call until its commands are submitted (the session's bookkeeping
and the plan runner's work: the recording's lookup, the input writes, encoding every dispatch), and `step`, the
whole call with the logits read back; the wgpu calls of a replayed step are counted by a proxy in front of the
runner's device (its methods and those of the encoders, passes and queue they hand out). Prints medians and
writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter

import numpy as np


class _Probe:
    """A wgpu object whose method calls are counted (and the time of the last submit kept); with `deep`, the queue
    and the encoders and compute passes its calls return are probed too. The deep probe's own Python costs about
    as much as a call, so steps are timed under a shallow one (the submit's time only) and counted under a deep one."""
    WRAPPED = ("create_command_encoder", "begin_compute_pass")

    def __init__(self, target, log: dict, deep: bool):
        self._target, self._log, self._deep = target, log, deep

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if name == "queue":
            return _Probe(value, self._log, self._deep)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self._log["calls"][name] += 1
            if name == "submit":
                self._log["submitted"] = time.perf_counter()
            out = value(*args, **kwargs)
            return _Probe(out, self._log, True) if self._deep and name in self.WRAPPED else out

        return call


def measure(artifact: str, prompt_tokens: int, steps: int) -> dict:
    import sharpi

    model = sharpi.load(artifact)
    runner = model.engine.backend.runner
    log = {"calls": Counter(), "submitted": None}
    ids = np.random.default_rng(0).integers(100, 2000, prompt_tokens).tolist()
    device = runner.device
    host, whole = [], []
    with model.session(snapkv_budget=0) as s:
        token = int(np.argmax(s.prefill(ids)))
        runner.device = _Probe(device, log, deep=True)
        for _ in range(2):                      # the second step replays the first one's recording
            log["calls"].clear()
            token = int(np.argmax(s.decode(token)))
        calls = dict(log["calls"])
        runner.device = _Probe(device, log, deep=False)
        for _ in range(steps):
            start = time.perf_counter()
            logits = s.decode(token)
            end = time.perf_counter()
            host.append(log["submitted"] - start)
            whole.append(end - start)
            token = int(np.argmax(logits))
        runner.device = device
    return {"artifact": artifact, "device": model.engine.backend.description,
            "dispatches": calls.get("dispatch_workgroups", 0), "wgpu_calls": sum(calls.values()), "calls": calls,
            "host_ms": 1e3 * statistics.median(host), "step_ms": 1e3 * statistics.median(whole)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--json")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)     # the child process's mode
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.artifacts[0], args.prompt_tokens, args.steps)))
        return 0
    rows = []
    for artifact in args.artifacts:     # each in a process of its own
        out = subprocess.run([sys.executable, __file__, artifact, "--one", "--prompt-tokens", str(args.prompt_tokens),
                              "--steps", str(args.steps)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{rows[0]['device']}, median of {args.steps} decode steps after {args.prompt_tokens} tokens")
    print("| artifact | dispatches | wgpu calls a step | host ms a step | whole step ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['artifact']} | {r['dispatches']} | {r['wgpu_calls']} | {r['host_ms']:.2f} | {r['step_ms']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
