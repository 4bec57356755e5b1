"""Requests per second of `sharpi serve` alone and of `sharpi serve --ray` with 1 and 2 engine replicas, side by
side in one run: the same artifact and the same cores in every arm (one replica of all the threads, or two of half
each), each server a process of its own, started and stopped here, on 127.0.0.1 only; every load is bounded (a
fixed number of requests of max_tokens tokens each, ignore_eos).

    python benchmarks/serve_ray.py [--model smollm2-135m] [--threads 2] [--requests 32] [--clients 16]
        [--prompt-tokens 128] [--max-tokens 64] [--rounds 2] [--out benchmarks/serve.md]

Replicas add throughput only where they add cores (or GPUs): on one machine, two replicas of half the threads
each decode batches half the size at about half the speed, so the figure to expect here is about 1x, less Ray's
proxy and ingress hops. The arms alternate round by round, so drift in the machine's speed spreads over all.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_throughput import HOST, ServerProcess, make_prompts, machine, percentile, run_clients  # noqa: E402

import sharpi  # noqa: E402
from sharpi.cli.bench import artifact_info  # noqa: E402
from sharpi.runtime.model_info import ModelInfo  # noqa: E402

SECTION = "## Replicas on Ray Serve"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def start(arm: str, artifact: Path, threads: int, parallel: int, port: int, log: Path) -> ServerProcess:
    command = [sys.executable, "-m", "sharpi.cli.main", "serve", str(artifact), "--host", HOST, "--port",
               str(port), "--parallel", str(parallel), "--pool-tokens", "16384"]
    if arm == "serve":
        command += ["--threads", str(threads)]
    else:
        replicas = int(arm.split("x")[1])
        command += ["--ray", "--replicas", str(replicas), "--threads", str(max(1, threads // replicas))]
    return ServerProcess(arm, command, port, log)


def measure(arm: str, args, artifact: Path, prompts: list[str], log_dir: Path) -> dict:
    port = free_port()
    server = start(arm, artifact, args.threads, args.parallel, port, log_dir / f"{arm}.log")
    try:
        asyncio.run(run_clients(server, prompts[:2], 4))                      # warm the kernels and the routes
        batches = [prompts[i:i + args.clients] for i in range(0, len(prompts), args.clients)]
        start_s = time.monotonic()
        timings = []
        for batch in batches:
            timings += asyncio.run(run_clients(server, batch, args.max_tokens))
        wall = time.monotonic() - start_s
    finally:
        server.stop()
    ok = [t for t in timings if t.error is None]
    return {"arm": arm, "requests": len(ok), "failed": len(timings) - len(ok), "wall_s": wall,
            "requests_per_s": len(ok) / wall, "tokens_per_s": sum(t.tokens for t in ok) / wall,
            "ttft_p50_s": percentile([t.first - t.start for t in ok if t.first], 50),
            "ttft_p95_s": percentile([t.first - t.start for t in ok if t.first], 95)}


def report(results: list[dict], args, info: ModelInfo) -> str:
    best = {}
    for r in results:
        if r["arm"] not in best or r["requests_per_s"] > best[r["arm"]]["requests_per_s"]:
            best[r["arm"]] = r
    base = best["serve"]["requests_per_s"]
    lines = [SECTION, "", f"{time.strftime('%Y-%m-%d')}, {machine()}; `python benchmarks/serve_ray.py "
             f"--threads {args.threads} --requests {args.requests} --clients {args.clients} --prompt-tokens "
             f"{args.prompt_tokens} --max-tokens {args.max_tokens} --rounds {args.rounds}` on "
             f"{info.manifest.source.get('name')} (the CPU's default arithmetic); "
             f"best of {args.rounds} alternating rounds; every arm uses {args.threads} threads in all.", "",
             "| arm | requests/s | vs sharpi serve | output tok/s | time to first token p50 / p95 (s) | failed |",
             "| --- | --- | --- | --- | --- | --- |"]
    names = {"serve": "sharpi serve (no Ray)", "ray-x1": "--ray, 1 replica", "ray-x2": "--ray, 2 replicas"}
    for arm in ("serve", "ray-x1", "ray-x2"):
        r = best[arm]
        lines.append(f"| {names[arm]} | {r['requests_per_s']:.2f} | {r['requests_per_s'] / base:.2f}x | "
                     f"{r['tokens_per_s']:.0f} | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['failed']} |")
    lines += ["", "Replicas add requests per second only with cores (or GPUs) they do not share: here every arm has the "
              "same cores, so two replicas of half the threads each decode batches half the size, each at about "
              "half the speed, and Ray's own processes (its HTTP proxy, the ingress, the controller, the GCS and "
              "raylet) take their CPU from the kernels' threads, whose parallel loops wait for the slowest. What "
              "scales is the count of machines (or cores) behind one endpoint; one request's speed never does. "
              "A replica sends a stream's tokens in messages of up to 50 ms (each crosses two processes); a "
              "profile of the one-replica arm (py-spy, 5 s under this load) found two thirds of the replica's "
              "samples in the kernels.", "", "![requests per second](serve_ray.png)"]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = ["serve", "ray-x1", "ray-x2"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, arm in enumerate(arms):
        values = [r["requests_per_s"] for r in results if r["arm"] == arm]
        ax.scatter([i] * len(values), values, color="C0")
        ax.bar(i, max(values), alpha=0.3, color="C0")
    ax.set_xticks(range(len(arms)), ["sharpi serve", "Ray, 1 replica", "Ray, 2 replicas"])
    ax.set_ylabel("requests / s")
    ax.set_title("Same cores in every arm: replicas scale with cores, not within them", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_section(out: Path, section: str) -> None:
    """Replace this benchmark's section of `out` (or append it), leaving the rest as it is."""
    text = out.read_text() if out.is_file() else ""
    if SECTION in text:
        head, _, tail = text.partition(SECTION)
        rest = tail.split("\n## ", 1)
        text = head + section + ("\n## " + rest[1] if len(rest) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    out.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="a Markdown file whose Ray section to write")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sharpi-serve-ray"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    artifact = Path(sharpi.compile(args.model, target="llvm", output=args.work / "artifact"))
    info = artifact_info(artifact)
    results = []
    for round_ in range(args.rounds):
        arms = ["serve", "ray-x1", "ray-x2"]
        for arm in arms if round_ % 2 == 0 else arms[::-1]:
            prompts = make_prompts(info, args.requests, args.prompt_tokens, salt=10 * round_ + len(results))
            result = measure(arm, args, artifact, prompts, args.work)
            print(json.dumps(result), flush=True)
            results.append(result)
    section = report(results, args, info)
    print(section)
    if args.out:
        write_section(args.out, section)
        args.out.with_name("serve_ray.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(results, args.out.with_name("serve_ray.png"))


if __name__ == "__main__":
    main()
