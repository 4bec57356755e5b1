"""sharpi serve against llama.cpp's own server (llama-server), side by side in one run: the same GGUF, the same
threads, each server a process of its own, started and stopped here, on 127.0.0.1 only; every load is bounded
(a fixed number of requests, each of max_tokens tokens, ignore_eos so both generate them all).

Scenarios (the serve issue's):
  * 512-token prompts from 1, 4 and 16 concurrent clients (llama-server -np N, a slot each);
  * 4000-token prompts from 1, 4 and 16 clients with the same KV memory for both: a 24,000-slot pool (llama-server
    -np 5 -c 24000: 4,800 tokens a slot; sharpi --pool-tokens 24000 with SnapKV 1024, and without);
  * admission: 4 clients decoding after 512-token prompts when a 4000-token prompt arrives; the inter-token
    latency of the running ones while it is admitted.
For each: aggregate output tok/s (decode: tokens after each request's first / the time any request decodes;
end-to-end: all tokens / the round's wall time), time to first token and inter-token latency p50/p95. At one
client, sharpi serve's decode is put beside `sharpi run`'s (sharpi.cli.bench, a process of its own) in --pairs
alternating pairs (--one-client-only: just those).

    python benchmarks/serve_throughput.py --llama-server PATH [--model smollm2-135m] [--threads 2]
        [--max-tokens 256] [--quick] [--clients N ...] [--short-only] [--pairs 0] [--out benchmarks/serve.md]

llama-server: built from the llama.cpp that the llama-cpp-python sdist vendors (../shared/anchors/README.md:
cmake -DLLAMA_BUILD_SERVER=ON with the anchors' GGML flags). Needs httpx and matplotlib (for the plot).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import sharpi
from sharpi.cli.bench import artifact_info, find_gguf, time_in_process

HOST = "127.0.0.1"
SENTENCES = ["The river bends twice before it reaches the old mill.", "A quiet market opens at dawn on Tuesdays.",
             "Seven lanterns hang above the narrow bridge.", "The archive keeps letters from every harbour town.",
             "Children race paper boats along the canal.", "The lighthouse keeper counts ships each night."]


@dataclass
class RequestTiming:
    start: float
    first: float | None = None
    end: float | None = None
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


@dataclass
class Round:
    engine: str
    scenario: str
    clients: int
    prompt_tokens: int
    timings: list[RequestTiming]
    note: str = ""

    @property
    def ok(self) -> list[RequestTiming]:
        return [t for t in self.timings if t.error is None and t.first is not None]

    def decode_tok_s(self) -> float:
        """Tokens after each request's first, over the time during which any request was decoding."""
        spans = sorted((t.first, t.end) for t in self.ok)
        busy, cur_start, cur_end = 0.0, None, None
        for a, b in spans:
            if cur_end is None or a > cur_end:
                busy += (cur_end - cur_start) if cur_end is not None else 0.0
                cur_start, cur_end = a, b
            else:
                cur_end = max(cur_end, b)
        busy += (cur_end - cur_start) if cur_end is not None else 0.0
        return sum(t.tokens - 1 for t in self.ok) / busy if busy else 0.0

    def peak_decode_tok_s(self) -> float:
        """The most tokens a second the requests decoding together emit: each request's rate is one over its
        median inter-token gap, summed over the requests decoding at the same time, at the busiest moment."""
        events = []
        for t in self.ok:
            gaps = [b - a for a, b in zip(t.chunks, t.chunks[1:])]
            if gaps:
                rate = 1 / statistics.median(gaps)
                events += [(t.first, rate), (t.end, -rate)]
        best = cur = 0.0
        for _, step in sorted(events):
            cur += step
            best = max(best, cur)
        return best

    def end_to_end_tok_s(self) -> float:
        ok = self.ok
        wall = max(t.end for t in ok) - min(t.start for t in ok) if ok else 0.0
        return sum(t.tokens for t in ok) / wall if wall else 0.0

    def ttft(self) -> list[float]:
        return [t.first - t.start for t in self.ok]

    def itl(self, window: tuple[float, float] | None = None) -> list[float]:
        gaps = []
        for t in self.ok:
            for a, b in zip(t.chunks, t.chunks[1:]):
                if window is None or window[0] <= b <= window[1]:
                    gaps.append(b - a)
        return gaps


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# -- the servers -------------------------------------------------------------------------------------------------
class ServerProcess:
    def __init__(self, name: str, command: list[str], port: int, log: Path, extra_body: dict | None = None):
        self.name, self.port, self.extra_body = name, port, extra_body or {}
        self.url = f"http://{HOST}:{port}"
        self._log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"{name} exited with {self.process.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} did not become healthy; see {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


SHARPI_FLAGS: list[str] = []    # more `sharpi serve` flags (--sharpi-flags)


def start_sharpi(artifact: Path, threads: int, parallel: int, pool_tokens: int, budget: int, port: int,
                 log: Path) -> ServerProcess:
    command = [sys.executable, "-m", "sharpi.cli.main", "serve", str(artifact), "--host", HOST, "--port",
               str(port), "--threads", str(threads), "--parallel", str(parallel), "--pool-tokens", str(pool_tokens),
               "--snapkv-budget", str(budget), *SHARPI_FLAGS]
    return ServerProcess("sharpi serve", command, port, log)


def start_llama(binary: Path, gguf: Path, threads: int, parallel: int, context: int, port: int,
                log: Path) -> ServerProcess:
    command = [str(binary), "-m", str(gguf), "--host", HOST, "--port", str(port), "-t", str(threads), "-tb",
               str(threads), "-np", str(parallel), "-c", str(context), "--no-webui", "--cache-ram", "0",
               "-ub", "512", "-b", "2048"]
    return ServerProcess("llama-server", command, port, log, extra_body={"cache_prompt": False})


# -- the load ----------------------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, body: dict, delay: float = 0.0) -> RequestTiming:
    await asyncio.sleep(delay)
    timing = RequestTiming(time.monotonic())
    try:
        async with client.stream("POST", url, json=body, timeout=1800) as r:
            if r.status_code != 200:
                timing.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return timing
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                choices = data.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.monotonic()
                    timing.first = timing.first or now
                    timing.chunks.append(now)
                    timing.tokens += 1
    except httpx.HTTPError as error:
        timing.error = f"{type(error).__name__}: {error}"
    timing.end = time.monotonic()
    return timing


async def run_clients(server: ServerProcess, prompts: list[str], max_tokens: int,
                      delays: list[float] | None = None) -> list[RequestTiming]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        url = server.url + "/v1/completions"
        delays = delays or [0.0] * len(prompts)
        bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                   **server.extra_body} for p in prompts]
        return await asyncio.gather(*(one_request(client, url, b, d) for b, d in zip(bodies, delays)))


def make_prompts(tokenizer, count: int, tokens: int, salt: int = 0) -> list[str]:
    """Distinct prompts of about `tokens` tokens (different from their first sentence on: no shared prefix)."""
    prompts = []
    for i in range(count):
        order = [SENTENCES[(i + salt + k) % len(SENTENCES)] for k in range(len(SENTENCES))]
        text = f"Story {i + 1000 * salt}. " + " ".join(order * (tokens // 50 + 2))
        ids = tokenizer.tokenize(text, add_bos=False)[:tokens - 1]
        prompts.append(tokenizer.detokenize(ids))
    return prompts


# -- the scenarios -----------------------------------------------------------------------------------------------
def scenario_rounds(args, artifact: Path, gguf: Path, tokenizer, port: int, log_dir: Path) -> list[Round]:
    rounds: list[Round] = []
    short_clients = args.clients or ([1, 4] if args.quick else [1, 4, 16])
    long_clients = [1, 4] if args.quick else [1, 4, 16]
    n = args.max_tokens
    for clients in short_clients:
        prompts = make_prompts(tokenizer, clients, 512, salt=clients)
        context = clients * (512 + n + 64)
        for engine in ("sharpi", "llama-server"):
            print(f"512-token prompts, {clients} clients: {engine}", file=sys.stderr, flush=True)
            server = (start_sharpi(artifact, args.threads, clients, context, 0, port, log_dir / "sharpi.log")
                      if engine == "sharpi" else
                      start_llama(args.llama_server, gguf, args.threads, clients, context, port,
                                  log_dir / "llama.log"))
            try:
                asyncio.run(run_clients(server, make_prompts(tokenizer, 1, 64, salt=99), 8))      # warm up
                rounds.append(Round(engine, "512", clients, 512, asyncio.run(run_clients(server, prompts, n))))
            finally:
                server.stop()
    if args.short_only:
        return rounds
    pool = 24000
    for clients in long_clients:
        prompts = make_prompts(tokenizer, clients, 4000, salt=100 + clients)
        for engine, budget in (("sharpi", 1024), ("sharpi", 0), ("llama-server", None)):
            label = f"sharpi (SnapKV {budget})" if engine == "sharpi" and budget else \
                "sharpi (full cache)" if engine == "sharpi" else engine
            print(f"4000-token prompts, {clients} clients: {label}", file=sys.stderr, flush=True)
            server = (start_sharpi(artifact, args.threads, 16, pool, budget, port, log_dir / "sharpi.log")
                      if engine == "sharpi" else
                      start_llama(args.llama_server, gguf, args.threads, 5, pool, port, log_dir / "llama.log"))
            try:
                asyncio.run(run_clients(server, make_prompts(tokenizer, 1, 64, salt=98), 8))
                rounds.append(Round(label, "4000", clients, 4000, asyncio.run(run_clients(server, prompts, n))))
            finally:
                server.stop()
    # admission: 4 decoding, then a 4000-token prompt arrives
    for engine in ("sharpi", "llama-server"):
        print(f"admission of a 4000-token prompt beside 4 decodes: {engine}", file=sys.stderr, flush=True)
        context = 4 * (512 + n + 64) + 4000 + 64
        server = (start_sharpi(artifact, args.threads, 5, context, 0, port, log_dir / "sharpi.log")
                  if engine == "sharpi" else
                  start_llama(args.llama_server, gguf, args.threads, 5, 5 * 4800, port, log_dir / "llama.log"))
        try:
            prompts = make_prompts(tokenizer, 4, 512, salt=200) + make_prompts(tokenizer, 1, 4000, salt=201)
            timings = asyncio.run(run_clients(server, prompts, n, delays=[0, 0, 0, 0, 3.0]))
            long = timings[-1]
            rounds.append(Round(engine, "admission", 4, 512, timings[:4],
                                note=json.dumps({"window": [long.start, long.first or long.end]})))
        finally:
            server.stop()
    return rounds


def one_client_pairs(args, artifact: Path, tokenizer, log_dir: Path) -> list[tuple[float, float]]:
    """One client's decode through sharpi serve and `sharpi run`'s (sharpi.cli.bench, a process of its own) on
    the same 512-token prompt, alternating, `--pairs` times: on a shared VM the speed drifts by more than the 5%
    the target allows, and a ratio within a pair is what drift leaves alone."""
    ids = tokenizer.tokenize(make_prompts(tokenizer, 1, 512, salt=7)[0])
    prompt = tokenizer.detokenize(ids)
    spec = {"engine": "sharpi", "artifact": str(artifact), "tokens": ids, "gen": args.max_tokens,
            "threads": args.threads, "repeats": 2}
    pairs = []
    for i in range(args.pairs):
        print(f"one client, pair {i + 1} of {args.pairs}: sharpi serve, then sharpi run", file=sys.stderr,
              flush=True)
        server = start_sharpi(artifact, args.threads, 1, 512 + args.max_tokens + 64, 0, args.port,
                              log_dir / "sharpi.log")
        try:
            asyncio.run(run_clients(server, make_prompts(tokenizer, 1, 64, salt=99), 8))      # warm up
            served = Round("sharpi", "512", 1, 512, asyncio.run(run_clients(server, [prompt], args.max_tokens)))
        finally:
            server.stop()
        pairs.append((served.decode_tok_s(), time_in_process(spec)["decode_tok_s"]))
    return pairs


def pairs_report(pairs: list[tuple[float, float]]) -> str:
    ratios_ = [serve / run for serve, run in pairs]
    rows = "\n".join(f"| {i + 1} | {serve:.1f} | {run:.1f} | {serve / run:.3f} |" for i, (serve, run) in
                     enumerate(pairs))
    return (f"One client, 512-token prompt, alternating: sharpi serve's decode / `sharpi run`'s = "
            f"**{statistics.median(ratios_):.3f}** (median of {len(pairs)} pairs; target within 5%).\n\n"
            f"| pair | sharpi serve decode tok/s | sharpi run decode tok/s | ratio |\n| --- | --- | --- | --- |\n"
            f"{rows}")


# -- the report --------------------------------------------------------------------------------------------------
def table(rounds: list[Round]) -> str:
    lines = ["| prompt | clients | engine | decode tok/s | peak decode tok/s | end-to-end tok/s | most at once | "
             "TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rounds:
        if r.scenario == "admission":
            continue
        ttft, itl = r.ttft(), r.itl()
        failed = len(r.timings) - len(r.ok)
        lines.append(f"| {r.prompt_tokens} | {r.clients} | {r.engine} | {r.decode_tok_s():.1f} | "
                     f"{r.peak_decode_tok_s():.1f} | {r.end_to_end_tok_s():.1f} | {max_concurrent(r)} | "
                     f"{percentile(ttft, 50):.2f} / {percentile(ttft, 95):.2f} | "
                     f"{1000 * percentile(itl, 50):.1f} / {1000 * percentile(itl, 95):.1f} | {failed} |")
    lines.append("")
    lines.append("Admission of a 4000-token prompt beside 4 running decodes (inter-token latency of the running "
                 "ones while it is admitted, from its arrival to its first token):")
    lines.append("")
    lines.append("| engine | ITL p50 / p95 / max (ms) during admission | ITL p50 / p95 (ms) otherwise | "
                 "admission time (s) |")
    lines.append("| --- | --- | --- | --- |")
    for r in rounds:
        if r.scenario != "admission":
            continue
        window = tuple(json.loads(r.note)["window"])
        during, all_gaps = r.itl(window), r.itl()
        lines.append(f"| {r.engine} | {1000 * percentile(during, 50):.1f} / {1000 * percentile(during, 95):.1f} / "
                     f"{1000 * max(during, default=float('nan')):.1f} | {1000 * percentile(all_gaps, 50):.1f} / "
                     f"{1000 * percentile(all_gaps, 95):.1f} | {window[1] - window[0]:.2f} |")
    return "\n".join(lines)


def ratios(rounds: list[Round]) -> str:
    def find(engine, scenario, clients):
        return max((r for r in rounds if r.engine == engine and r.scenario == scenario and r.clients == clients),
                   key=Round.decode_tok_s, default=None)
    out = []
    a, b = find("sharpi", "512", 16), find("llama-server", "512", 16)
    if a and b:
        out.append(f"- 16 concurrent 512-token requests, aggregate decode: sharpi / llama-server -np 16 = "
                   f"{a.decode_tok_s() / b.decode_tok_s():.2f}x (target >= 1.5x); end-to-end "
                   f"{a.end_to_end_tok_s() / b.end_to_end_tok_s():.2f}x.")
    a, b = find("sharpi (SnapKV 1024)", "4000", 16), find("llama-server", "4000", 16)
    if a and b:
        out.append(f"- 16 requests of 4000 tokens in a 24,000-slot pool: sharpi (SnapKV 1024) / llama-server -np 5 "
                   f"-c 24000: peak decode {a.peak_decode_tok_s() / b.peak_decode_tok_s():.2f}x (target >= 3x), "
                   f"decode {a.decode_tok_s() / b.decode_tok_s():.2f}x, end-to-end "
                   f"{a.end_to_end_tok_s() / b.end_to_end_tok_s():.2f}x; sharpi ran "
                   f"{max_concurrent(a)} at once, llama-server {max_concurrent(b)}.")
    return "\n".join(out)


def max_concurrent(r: Round) -> int:
    """The most requests decoding at one time."""
    events = sorted([(t.first, 1) for t in r.ok] + [(t.end, -1) for t in r.ok])
    best = cur = 0
    for _, step in events:
        cur += step
        best = max(best, cur)
    return best


def plot(rounds: list[Round], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = [r for r in rounds if r.scenario != "admission"]
    keys = sorted({(r.scenario, r.clients) for r in groups}, key=lambda k: (int(k[0]), k[1]))
    engines = list(dict.fromkeys(r.engine for r in groups))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(engines)
    for ax, metric, title in ((axes[0], Round.decode_tok_s, "aggregate decode tok/s"),
                              (axes[1], lambda r: 1000 * percentile(r.ttft(), 50) / 1000, "TTFT p50 (s)")):
        for i, engine in enumerate(engines):
            values = [next((metric(r) for r in groups if r.engine == engine and (r.scenario, r.clients) == k),
                           0.0) for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], values, width, label=engine)
        ax.set_xticks([x + width * (len(engines) - 1) / 2 for x in range(len(keys))])
        ax.set_xticklabels([f"{p} tok\n{c} clients" for p, c in keys])
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
               platform.processor())
    return f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--quick", action="store_true", help="1 and 4 clients only")
    p.add_argument("--clients", type=int, nargs="+", default=None, help="the 512-token scenario's client counts")
    p.add_argument("--short-only", action="store_true", help="the 512-token scenario alone")
    p.add_argument("--sharpi-flags", default="", help="more flags for sharpi serve (\"--prefill-share 0\")")
    p.add_argument("--pairs", type=int, default=3, help="one client: alternating (serve, run) pairs")
    p.add_argument("--one-client-only", action="store_true",
                   help="only the alternating one-client pairs (their own report)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    SHARPI_FLAGS.extend(args.sharpi_flags.split())
    artifact = Path(sharpi.compile(args.model, target="llvm", output=f"/tmp/sharpi-serve-bench-{args.model}"))
    tokenizer = artifact_info(artifact)
    manifest = tokenizer.manifest
    gguf = find_gguf(manifest, None)
    log_dir = Path("/tmp/sharpi-serve-bench-logs")
    log_dir.mkdir(exist_ok=True)
    pairs = one_client_pairs(args, artifact, tokenizer, log_dir) if args.pairs else []
    rounds = [] if args.one_client_only else scenario_rounds(args, artifact, gguf, tokenizer, args.port, log_dir)
    version = subprocess.run([str(args.llama_server), "--version"], capture_output=True, text=True)
    llama_version = (version.stdout + version.stderr).strip().splitlines()[0:1]
    report = "\n".join([
        f"# sharpi serve vs llama-server ({args.model}, {args.threads} threads, max_tokens {args.max_tokens})", "",
        f"Machine: {machine()}. llama-server: {' '.join(llama_version)}. Measured "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `python benchmarks/serve_throughput.py "
        f"{' '.join(sys.argv[1:])}`.", "",
        pairs_report(pairs) if pairs else "", "", ratios(rounds), "", table(rounds) if rounds else "", ""])
    print(report)
    if args.out:
        args.out.write_text(report)
        if rounds:
            plot(rounds, args.out.with_suffix(".png"))
        (args.out.with_suffix(".json")).write_text(json.dumps(
            {"one_client_pairs": pairs, "rounds": [{"engine": r.engine, "scenario": r.scenario, "clients": r.clients, "decode_tok_s": r.decode_tok_s(),
              "end_to_end_tok_s": r.end_to_end_tok_s(), "ttft": r.ttft(), "errors": [t.error for t in r.timings
                                                                                   if t.error]} for r in rounds]},
            indent=1))


if __name__ == "__main__":
    main()
