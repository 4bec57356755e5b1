"""sharpi serve under hostile requests: how fast each is refused, how /health answers meanwhile, and a soak of
clients mixing normal streams, disconnects and hostile requests. The server is `sharpi serve` in a process of its
own on 127.0.0.1 (its RSS read from /proc); every load is bounded in count and time and stops by itself.

Parts:
  * refusals: each hostile case of issue #45, --repeats times: the time from the first byte sent to the refusal,
    the slowest /health answer while it ran (a poller every 50 ms), and the server's RSS after it;
  * drain: SIGTERM while a long prompt prefills, with --drain-seconds 2: the time to the request's end and the
    server's exit;
  * soak: --clients clients for --minutes: normal streams (completion and chat), streams cut after two chunks,
    and hostile cases; every response's status, every normal answer checked whole ([DONE] and a finish reason),
    RSS every 10 s, and at the end the KV pages sequences still hold.

    python benchmarks/soak.py ARTIFACT [--minutes 20] [--clients 16] [--repeats 3] [--out benchmarks/soak]

Writes OUT.json, OUT.md (the tables) and OUT.png (RSS and /health latency over the soak).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

HOST = "127.0.0.1"
KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MIB = 1 << 20
WORDS = "the river bends twice before it reaches the old mill and a quiet market opens at dawn".split()


# -- the server ----------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, artifact: str, log: Path, *extra: str):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self._log = open(log, "w")
        command = [sys.executable, "-m", "sharpi.cli.main", "serve", artifact, "--host", HOST, "--port",
                   str(self.port), "--api-key", KEY, *extra]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        deadline = time.monotonic() + 600
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; see {log}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", headers=AUTH, timeout=30).text
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(match.group(1)) if match else float("nan")

    def stop(self, timeout: float = 60) -> float:
        """SIGTERM; the seconds until the process exited."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        return time.monotonic() - start


class HealthPoller:
    """/health every 50 ms from a thread of its own: the slowest answer, and any that failed."""

    def __init__(self, url: str):
        self.url, self.latencies, self.failures = url, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        with httpx.Client(timeout=120) as client:
            while not self.latencies or not self._stop.is_set():      # one answer at least
                start = time.monotonic()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.monotonic() - start)
                self.failures += not ok
                self._stop.wait(0.05)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=float("nan"))


# -- the hostile cases -----------------------------------------------------------------------------------------------
def raw(url: str, head: bytes, body_parts=(), read: bool = True) -> int:
    """Send a request over a socket of its own (the body parts as they go, stopping where the server closes);
    returns the response's status (0: none)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        try:
            sock.sendall(head)
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if not read:
            return 0
        data = b""
        try:
            while b"\r\n" not in data and (chunk := sock.recv(4096)):
                data += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return int(data.split(b" ")[1]) if data.startswith(b"HTTP/1.1 ") else 0


def head(path: str, *headers: str, method: str = "POST", auth: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", *(["Authorization: Bearer " + KEY] if auth else []),
             *headers, "", ""]
    return "\r\n".join(lines).encode()


def chunked(total: int, size: int = 1 << 16):
    chunk = b"x" * size
    for _ in range(total // size):
        yield b"%x\r\n%s\r\n" % (size, chunk)


def post(url: str, path: str, body: bytes) -> int:
    return httpx.post(url + path, content=body, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=300).status_code


def big_text_body(field_name: str, chat: bool = False) -> bytes:
    """A body just under 16 MiB whose text prompt is ~16 MB."""
    text = "word " * ((16 * MIB - 4096) // 5)
    value = [{"role": "user", "content": text}] if chat else text
    return json.dumps({field_name: value}).encode()


def big_ids_body(field_name: str) -> bytes:
    """A body just under 16 MiB of token ids: ~5.6M of them."""
    return json.dumps({field_name: [1] * ((16 * MIB - 4096) // 3)}, separators=(",", ":")).encode()


def case_cl_te(url):
    return raw(url, head("/v1/completions", "Content-Length: 10", "Transfer-Encoding: chunked"), chunked(60 * MIB))


def case_chunked_over(url):
    return raw(url, head("/v1/completions", "Transfer-Encoding: chunked"), chunked(60 * MIB))


def case_length_over(url):
    return raw(url, head("/v1/completions", f"Content-Length: {64 * MIB}"))


def case_text_completion(url):
    return post(url, "/v1/completions", big_text_body("prompt"))


def case_text_chat(url):
    return post(url, "/v1/chat/completions", big_text_body("messages", chat=True))


def case_text_tokenize(url):
    return post(url, "/tokenize", big_text_body("prompt"))


def case_ids_completion(url):
    return post(url, "/v1/completions", big_ids_body("prompt"))


def case_ids_detokenize(url):
    return post(url, "/detokenize", big_ids_body("tokens"))


def case_long_stops(url):
    return post(url, "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 8,
                                                    "stop": ["x" * MIB] * 15}).encode())


def case_log_injection(url):
    return httpx.get(url + "/v1/models/%0aINJECTED%20LINE", headers=AUTH, timeout=30).status_code


def case_two_keys(url):
    return raw(url, head("/v1/models", "Authorization: Bearer wrong", "Connection: close", method="GET"))


def case_slow_headers(url):
    """A header byte every 0.5 s: the connection is closed at the header deadline (the time measured)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        try:
            for _ in range(240):
                sock.sendall(b"X")
                time.sleep(0.5)
                sock.settimeout(0.01)
                try:
                    if sock.recv(1) == b"":
                        return 0
                except socket.timeout:
                    pass
                sock.settimeout(60)
        except (BrokenPipeError, ConnectionResetError):
            return 0
    return -1                                   # never closed: a failure


def case_silent_connections(url):
    """200 connections that send nothing: the time until the server has closed them all."""
    host, port = url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port)), timeout=120) for _ in range(200)]
    try:
        closed = 0
        for sock in socks:
            try:
                closed += sock.recv(1) == b""
            except (ConnectionResetError, socket.timeout):
                closed += 1
        return 0 if closed == len(socks) else -1
    finally:
        for sock in socks:
            sock.close()


CASES = {
    "Content-Length and chunked (60 MiB sent)": (case_cl_te, 400),
    "chunked body past the bound (60 MiB sent)": (case_chunked_over, 413),
    "Content-Length 64 MiB": (case_length_over, 413),
    "16 MB text prompt, /v1/completions": (case_text_completion, 400),
    "16 MB text message, /v1/chat/completions": (case_text_chat, 400),
    "16 MB text, /tokenize": (case_text_tokenize, 400),
    "5.6M-id prompt, /v1/completions": (case_ids_completion, 400),
    "5.6M ids, /detokenize": (case_ids_detokenize, 400),
    "15 stop strings of 1 MB": (case_long_stops, 400),
    "newline in the path (log injection)": (case_log_injection, 404),
    "two Authorization headers": (case_two_keys, 400),
    "slow headers (a byte every 0.5 s)": (case_slow_headers, 0),
    "200 silent connections": (case_silent_connections, 0),
}


@dataclass
class Refusal:
    case: str
    status: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    worst_health: list[float] = field(default_factory=list)
    health_failures: int = 0
    rss_mib: list[float] = field(default_factory=list)
    expected: int = 0


def refusals(server: Server, repeats: int) -> list[Refusal]:
    results = []
    for name, (case, expected) in CASES.items():
        result = Refusal(name, expected=expected)
        for _ in range(repeats):
            with HealthPoller(server.url) as poller:
                start = time.monotonic()
                result.status.append(case(server.url))
                result.seconds.append(time.monotonic() - start)
            result.worst_health.append(poller.worst)
            result.health_failures += poller.failures
            result.rss_mib.append(server.rss_mib())
        print(f"  {name}: status {result.status}, {statistics.median(result.seconds):.2f} s, /health at worst "
              f"{max(result.worst_health):.3f} s, RSS {result.rss_mib[-1]:.0f} MiB", flush=True)
        results.append(result)
    return results


# -- the drain -------------------------------------------------------------------------------------------------------
def drain(artifact: str, log: Path, drain_seconds: float = 2.0) -> dict:
    """A long prompt prefilling when SIGTERM arrives: how long until its stream ends and the server exits."""
    server = Server(artifact, log, "--drain-seconds", str(drain_seconds))
    prompt = " ".join(random.Random(1).choice(WORDS) for _ in range(6000))
    ended = {}

    def stream():
        body = {"prompt": prompt, "max_tokens": 64, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=300) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass
        ended["at"] = time.monotonic()
    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(1.5)                              # the prefill under way
    signalled = time.monotonic()
    exit_seconds = server.stop()
    thread.join()
    result = {"drain_seconds": drain_seconds, "request_ended_after": ended["at"] - signalled,
              "process_exited_after": exit_seconds}
    print(f"  drain {drain_seconds} s: the request ended {result['request_ended_after']:.2f} s after SIGTERM, the "
          f"server exited after {exit_seconds:.2f} s", flush=True)
    return result


# -- the soak --------------------------------------------------------------------------------------------------------
LIGHT_HOSTILE = [case_cl_te, case_length_over, case_log_injection, case_two_keys, case_long_stops,
                 case_text_completion, case_ids_detokenize, case_chunked_over]


@dataclass
class SoakTally:
    normal: int = 0
    normal_ok: int = 0
    disconnects: int = 0
    hostile: int = 0
    hostile_as_expected: int = 0
    server_errors: int = 0
    failures: list[str] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)
    health: list[tuple[float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, kind: str, ok: bool, status: int, detail: str = "") -> None:
        with self.lock:
            if kind == "normal":
                self.normal += 1
                self.normal_ok += ok
            elif kind == "disconnect":
                self.disconnects += 1
            else:
                self.hostile += 1
                self.hostile_as_expected += ok
            self.server_errors += status >= 500
            if not ok and len(self.failures) < 50:
                self.failures.append(f"{kind} {status} {detail}")


def normal_stream(client: httpx.Client, url: str, rng: random.Random, chat: bool, cut: bool) -> tuple[bool, int]:
    """A streamed request; whole unless `cut` (closed after two chunks). Whole: ok when it ends with a finish
    reason and [DONE]."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300)))
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": words}]}
    else:
        path, body = "/v1/completions", {"prompt": words}
    body.update(max_tokens=rng.randint(8, 48), temperature=0.8, stream=True)
    with client.stream("POST", url + path, json=body, headers=AUTH) as r:
        if r.status_code != 200:
            return False, r.status_code
        finish, done, chunks = None, False, 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            chunks += 1
            if cut and chunks == 2:
                return True, 200
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return False, 200
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return done and finish in ("stop", "length"), 200


def soak(server: Server, minutes: float, clients: int, seed: int = 0) -> SoakTally:
    tally = SoakTally()
    start = time.monotonic()
    end = start + minutes * 60
    stop = threading.Event()

    def client_loop(index: int):
        rng = random.Random(seed * 1000 + index)
        with httpx.Client(timeout=600) as client:
            while time.monotonic() < end:
                roll = rng.random()
                try:
                    if roll < 0.55:
                        ok, status = normal_stream(client, server.url, rng, chat=roll < 0.25, cut=False)
                        tally.note("normal", ok, status)
                    elif roll < 0.75:
                        ok, status = normal_stream(client, server.url, rng, chat=False, cut=True)
                        tally.note("disconnect", ok, status)
                    else:
                        case = rng.choice(LIGHT_HOSTILE)
                        expected = next(e for c, e in CASES.values() if c is case)
                        status = case(server.url)
                        tally.note("hostile", status == expected, status, case.__name__)
                except httpx.HTTPError as error:
                    tally.note("normal", False, 0, type(error).__name__)

    def monitor():
        while not stop.is_set():
            now = time.monotonic() - start
            tally.rss.append((now, server.rss_mib()))
            t = time.monotonic()
            try:
                httpx.get(server.url + "/health", timeout=120)
            except httpx.HTTPError:
                pass
            tally.health.append((now, time.monotonic() - t))
            minute = int(now // 60)
            if now % 60 < 10:
                print(f"  soak minute {minute}: {tally.normal} normal ({tally.normal_ok} ok), {tally.disconnects} "
                      f"cut, {tally.hostile} hostile, {tally.server_errors} 5xx, RSS {tally.rss[-1][1]:.0f} MiB",
                      flush=True)
            stop.wait(10)

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    return tally


def pages_held(server: Server) -> float:
    """KV pages that sequences hold once the server is idle (the prefix caches' pages are not theirs)."""
    for _ in range(120):
        if server.metric("sharpi_running_sequences") == 0 and server.metric("sharpi_queue_depth") == 0:
            break
        time.sleep(0.5)
    return server.metric("sharpi_pool_pages_used") - server.metric("sharpi_prefix_cache_pages")


# -- the report ------------------------------------------------------------------------------------------------------
def report(results: list[Refusal], drained: dict | None, tally: SoakTally | None, held: float | None,
           minutes: float, clients: int) -> str:
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}", ""]
    if results:
        lines += ["| case | status (want) | time to refuse, median [max] | /health at worst | RSS after, MiB |",
                  "| --- | --- | --- | --- | --- |"]
        for r in results:
            lines.append(f"| {r.case} | {','.join(map(str, sorted(set(r.status))))} ({r.expected}) | "
                         f"{statistics.median(r.seconds):.2f} s [{max(r.seconds):.2f}] | "
                         f"{max(r.worst_health):.3f} s{' (' + str(r.health_failures) + ' failed)' if r.health_failures else ''} | "
                         f"{r.rss_mib[-1]:.0f} |")
        lines.append("")
    if drained:
        lines += [f"Drain: SIGTERM during a 6,000-word prompt's prefill with --drain-seconds "
                  f"{drained['drain_seconds']:g}: the request ended after {drained['request_ended_after']:.2f} s, "
                  f"the server exited after {drained['process_exited_after']:.2f} s.", ""]
    if tally:
        growth = rss_growth(tally, minutes)
        lines += [f"Soak: {clients} clients for {minutes:g} minutes: {tally.normal} normal requests "
                  f"({tally.normal_ok} answered whole), {tally.disconnects} cut mid-stream, {tally.hostile} hostile "
                  f"({tally.hostile_as_expected} refused as expected); {tally.server_errors} 5xx; KV pages held by "
                  f"sequences at the end: {held:g}; RSS from minute {minutes / 2:g} to the end: {growth:+.1f}%; "
                  f"/health at worst {max(h for _, h in tally.health):.3f} s.", ""]
        if tally.failures:
            lines += ["Failures (first 50):", *[f"- {f}" for f in tally.failures], ""]
    return "\n".join(lines)


def rss_growth(tally: SoakTally, minutes: float) -> float:
    """RSS growth in percent from the middle of the run (the tenth minute of twenty) to its end."""
    middle = [rss for t, rss in tally.rss if t >= minutes * 30]
    return 100 * (middle[-1] - middle[0]) / middle[0] if len(middle) > 1 else float("nan")


def plot(tally: SoakTally, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot([t / 60 for t, _ in tally.rss], [r for _, r in tally.rss])
    top.set_ylabel("server RSS, MiB")
    top.set_ylim(bottom=0)
    bottom.plot([t / 60 for t, _ in tally.health], [h * 1000 for _, h in tally.health], ".")
    bottom.set_ylabel("/health latency, ms")
    bottom.set_xlabel("minutes")
    top.set_title("sharpi serve soak: normal streams, disconnects and hostile requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="refusals,drain,soak")
    parser.add_argument("--out", default="benchmarks/soak")
    args = parser.parse_args()
    if not 0 < args.minutes <= 120 or not 1 <= args.clients <= 64 or not 1 <= args.repeats <= 20:
        raise SystemExit("--minutes in (0, 120], --clients in [1, 64], --repeats in [1, 20]")
    parts = set(args.parts.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, drained, tally, held = [], None, None, None
    if "refusals" in parts:
        print("refusals:", flush=True)
        server = Server(args.artifact, out.with_suffix(".refusals.log"))
        try:
            results = refusals(server, args.repeats)
        finally:
            server.stop()
    if "drain" in parts:
        print("drain:", flush=True)
        drained = drain(args.artifact, out.with_suffix(".drain.log"))
    if "soak" in parts:
        print(f"soak: {args.clients} clients, {args.minutes:g} minutes", flush=True)
        server = Server(args.artifact, out.with_suffix(".soak.log"), "--parallel", "8")
        try:
            tally = soak(server, args.minutes, args.clients)
            held = pages_held(server)
        finally:
            server.stop()
        plot(tally, out.with_suffix(".png"))
    text = report(results, drained, tally, held, args.minutes, args.clients)
    out.with_suffix(".md").write_text(text)
    record = {"refusals": [asdict(r) for r in results], "drain": drained, "held_pages": held,
              "soak": None if tally is None else {k: v for k, v in vars(tally).items() if k != "lock"}}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(text)


if __name__ == "__main__":
    main()
