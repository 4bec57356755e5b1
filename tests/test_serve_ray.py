"""sharpi serve --ray: two engine replicas of SmolLM2 (exact float path) on a local Ray cluster that listens on
loopback only, against the unmodified `openai` client. The cluster is the CLI's own (a subprocess, stopped by
SIGTERM at the end, killed if it does not stop); every wait is bounded."""
from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import requires
from pathlib import Path

import httpx
import openai
import pytest

import sharpi
from sharpi.serve.routing import AffinitySettings, PrefixIndex

from openai_server import NAME as SOLO_NAME
from openai_server import PROMPTS, Server, assert_same_greedy, complete

NAME = "smollm2-ray"
START_S = 240                   # Ray's start and two replicas' loads (~20 s here), with room for a slow machine
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
CHAT_TURNS = [[{"role": "user", "content": "Tell me a story about a cat called Tom who lived in Paris and "
                                           "loved to eat fish every day of the week."}],
              [{"role": "user", "content": "List five colours of the rainbow and say why the sky is blue, in "
                                           "simple words for a child of six."}],
              [{"role": "user", "content": "Write a short poem about the sea, the wind and an old lighthouse "
                                           "keeper who never slept."}]]


class RayCli:
    """`sharpi serve ART --ray` in a subprocess: its URL, output lines, and the processes it started."""

    def __init__(self, artifact: Path, *flags: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "sharpi.cli.main", "serve", str(artifact), "--ray",
                                         "--port", "0", "--model-name", NAME, *flags],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self._wait_for(r"(http://\S+)/v1 serves", START_S).group(1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def _wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.process.poll() is None, "sharpi serve --ray exited:\n" + "".join(self.log[-40:])
                continue
            self.log.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + "".join(self.log[-40:]))

    def stop(self) -> int:
        """SIGTERM (the CLI takes the deployment and its cluster down); whatever of the process tree is left
        after 90 s is killed, so that no Ray process outlives the test."""
        tree = {pid: _start_time(pid) for pid in descendants(self.process.pid)}
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=90)
        finally:
            for pid, started in tree.items():
                if started is not None and _start_time(pid) == started:     # the same process, not a reused id
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


def descendants(root: int) -> set[int]:
    """root and every process below it (Ray's GCS and raylet are the CLI's children, its workers theirs)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _start_time(pid: int) -> int | None:
    """When the process started (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def listening_addresses(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that these processes hold (from /proc)."""
    listening = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":           # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            listening[fields[9]] = (_address(bytes.fromhex(address), width), int(port, 16))
    found = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            inode = target[8:-1] if target.startswith("socket:[") else None
            if inode in listening:
                found.append((pid, *listening[inode]))
    return found


def _address(raw: bytes, width: int) -> str:
    import ipaddress
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))      # /proc prints host-order words
    address = ipaddress.ip_address(words)
    if address.version == 6 and address.ipv4_mapped:
        return f"::ffff:{address.ipv4_mapped}"
    return str(address)


def replica_of(raw) -> str:
    return raw.headers["x-sharpi-replica"]


def pid_of(replica: str) -> int:
    return int(replica.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def cli(smollm2_artifact):
    server = RayCli(smollm2_artifact, "--replicas", "2", "--threads", "1", "--pool-tokens", "4096",
                    "--parallel", "8")
    yield server
    assert server.stop() == 0, "".join(server.log[-40:])


@pytest.fixture(scope="module")
def solo(smollm2_artifact):
    """The single-engine answers (a server in this process, one request at a time)."""
    s = Server(sharpi.load(smollm2_artifact, pool_tokens=4096), parallel=8)
    yield s
    s.close()


def test_a_local_cluster_listens_on_loopback_only(cli):
    sockets = listening_addresses(descendants(cli.process.pid))
    assert len(sockets) >= 5, sockets                    # the GCS, raylet, proxy, replicas... were found
    assert all(address in LOOPBACK for _, address, _ in sockets), sockets


def test_sixteen_concurrent_requests_equal_one_engine_and_use_both_replicas(cli, solo):
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    alone = [complete(solo.client, p, 12) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        raw = list(pool.map(lambda p: cli.client.completions.with_raw_response.create(
            model=NAME, prompt=p, max_tokens=12, temperature=0, logprobs=2), prompts))
    for prompt, one, r in zip(prompts, alone, raw):
        assert_same_greedy(one, r.parse(), prompt)
    served = {replica_of(r) for r in raw}
    assert len(served) == 2, served
    metrics = httpx.get(cli.url + "/metrics").text
    for replica in served:
        assert re.search(rf'^sharpi_replica_requests_total{{replica="{re.escape(replica)}"}} [1-9]', metrics,
                         re.M), metrics


def test_a_chats_next_turn_goes_to_the_replica_that_holds_its_first(cli, solo):
    for messages in CHAT_TURNS:
        first = cli.client.chat.completions.with_raw_response.create(model=NAME, messages=messages,
                                                                    max_tokens=16, temperature=0)
        answer = first.parse()
        follow = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                             {"role": "user", "content": "And then what happened?"}]
        second = cli.client.chat.completions.with_raw_response.create(model=NAME, messages=follow,
                                                                     max_tokens=16, temperature=0)
        assert replica_of(second) == replica_of(first)
        usage = second.parse().usage
        assert usage.prompt_tokens_details.cached_tokens >= 48, usage       # the first turn's full pages
        alone = solo.client.chat.completions.create(model=SOLO_NAME, messages=follow, max_tokens=16, temperature=0)
        assert second.parse().choices[0].message.content == alone.choices[0].message.content


def test_bad_requests_are_openai_errors_through_the_ingress(cli):
    r = httpx.post(cli.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(cli.url + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(cli.url + "/v1/completions", json={"model": NAME, "prompt": "x", "snapkv": {"budget": -3}})
    assert r.status_code == 400
    assert httpx.get(cli.url + "/health").json() == {"status": "ok"}


def test_hostile_requests_through_the_ingress_are_refused(cli):
    """The ingress runs the same HTTP guard (Ray's proxy parses the request and streams its body on): framing that
    disagrees with itself, a chunked body past the bound, a prompt far over the context."""
    host, port = cli.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
    chunk = b"x" * (1 << 16)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(48 * 16):               # 48 MiB, three times the bound, unless the connection closes
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sock.recv(100).startswith(b"HTTP/1.1 413"), sent
    r = httpx.post(cli.url + "/v1/completions", json={"model": NAME, "prompt": "word " * 400_000}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert httpx.get(cli.url + "/health").json() == {"status": "ok"}


def test_killing_a_replica_mid_run_fails_only_its_requests_and_it_comes_back(cli):
    """Six streams of 300 tokens; once each has streamed, one replica's process is killed: the streams on it end
    with an error naming the replica, the others finish; Ray starts a new replica, which then serves."""
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    streaming = {p: threading.Event() for p in prompts}
    where, results = {}, {}

    def stream(prompt: str) -> None:
        r = cli.client.completions.with_raw_response.create(
            model=NAME, prompt=prompt, max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True})
        where[prompt] = replica_of(r)
        chunk = None
        try:
            for i, chunk in enumerate(r.parse()):
                if i == 1:
                    streaming[prompt].set()
            results[prompt] = ("ok", chunk.choices[0].finish_reason)
        except openai.APIError as error:
            results[prompt] = ("error", str(error))
        streaming[prompt].set()

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for prompt in prompts:            # one at a time, so that the router sees each replica's load
            futures.append(pool.submit(stream, prompt))
            assert streaming[prompt].wait(60), f"{prompt!r} did not start streaming"
        victim = max(set(where.values()), key=list(where.values()).count)
        os.kill(pid_of(victim), signal.SIGKILL)
        for f in futures:
            f.result(timeout=180)
    survivors = set(where.values()) - {victim}
    assert survivors, f"every stream went to one replica: {where}"
    for prompt, replica in where.items():
        kind, detail = results[prompt]
        if replica == victim:
            assert kind == "error" and "stopped" in detail and victim in detail, (prompt, results[prompt])
        else:
            assert (kind, detail) == ("ok", "length"), (prompt, results[prompt])
    # Ray starts a new replica: within a bounded wait, a process never seen before serves requests too
    deadline, seen = time.monotonic() + 120, set()
    while time.monotonic() < deadline and not seen - survivors - {victim}:
        with ThreadPoolExecutor(8) as pool:
            raw = list(pool.map(lambda i: cli.client.completions.with_raw_response.create(
                model=NAME, prompt=f"Hello {i}", max_tokens=2, temperature=0), range(8)))
        seen |= {replica_of(r) for r in raw}
        time.sleep(1)
    assert seen - survivors - {victim}, f"no new replica served within 120 s: {seen}"
    assert cli.client.completions.create(model=NAME, prompt="Hi", max_tokens=3).usage.completion_tokens == 3


def test_prefix_index_prefers_the_longest_served_prefix_unless_its_replica_is_far_busier():
    index = PrefixIndex(AffinitySettings(page_size=4, min_share=0.25, max_excess=2, capacity=6))
    conversation = list(range(20))
    assert index.keys(conversation[:3]) == []                    # no full page, nothing to follow
    index.record(conversation[:8], "a")
    assert index.longest_match(conversation, {"a", "b"}) == ("a", 8)
    index.record(conversation[:12], "b")                         # b computed a's two pages again, and one more
    assert index.longest_match(conversation, {"a", "b"}) == ("b", 12)
    assert index.longest_match(conversation, {"a"}) == (None, 0)  # a page goes with the replica that served it last
    assert index.longest_match([9] + conversation[1:], {"a", "b"}) == (None, 0)   # keys chain from the start
    index.record(conversation[:8], "a")
    assert index.preferred(conversation, {"a": 0, "b": 2}) == "b"
    assert index.preferred(conversation, {"a": 0, "b": 3}) is None               # 3 more than the least busy
    assert index.preferred(conversation, {"a": None, "b": 5}) == "b"             # nothing known to compare
    assert index.preferred(conversation[:4] + [99] * 16, {"a": 0, "b": 0}) is None  # 4 of 20 tokens < 25%
    index.forget("b")
    assert index.preferred(conversation, {"a": 0, "b": 0}) == "a"
    index.record(list(range(100, 124)), "c")                      # 6 more pages: the oldest keys go
    assert len(index) == 6 and index.longest_match(conversation, {"a"}) == (None, 0)


def test_the_cli_refuses_bad_replica_flags_and_says_how_to_get_ray(smollm2_artifact):
    def run(*flags: str, code: str | None = None) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", code, str(smollm2_artifact), *flags] if code else \
            [sys.executable, "-m", "sharpi.cli.main", "serve", str(smollm2_artifact), *flags]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    for flags, words in [(["--ray", "--replicas", "0"], "--replicas"),
                         (["--ray", "--min-replicas", "2"], "--max-replicas"),
                         (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas"),
                         (["--replicas", "2"], "--ray")]:
        done = run(*flags)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and words in done.stderr, (flags, done.stderr)
    # as if Ray were not installed: one sentence naming the extra
    without_ray = ("import sys; sys.modules['ray'] = None; from sharpi.cli.main import main; "
                   "sys.exit(main(['serve', sys.argv[1], '--ray']))")
    done = run(code=without_ray)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and '.[ray]' in done.stderr, done.stderr
    # nor FastAPI (part of the plain install, so a broken one): the sentence says to install the clone again
    done = run(code=without_ray.replace("sys.modules['ray'] = None", "sys.modules['fastapi'] = None"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "needs fastapi" in done.stderr and "pip install . in the sharpi clone" in done.stderr, done.stderr
    # and the package without the extra does not pull Ray
    plain = [r for r in requires("sharpi") if "extra ==" not in r]
    assert not any(r.lower().startswith("ray") for r in plain), plain


class _FakeStream:
    """A replica's stream as the deployment handle gives it: events, then possibly the replica's death."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class _FakeHandle:
    """A deployment handle whose successive calls return the given streams."""

    def __init__(self, *streams):
        self.streams, self.sent = list(streams), 0
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, generation):
        self.sent += 1
        return _FakeStream(self.streams.pop(0))


def _events(engine, generation):
    async def collect():
        stream = await engine.open(generation)
        out = []
        while not out or out[-1].kind != "finish":
            out.append(await asyncio.wait_for(stream.next(), 5))
        return stream, out
    return asyncio.run(collect())


def test_a_request_whose_replica_dies_before_streaming_is_sent_again_and_after_it_ends_clearly():
    from ray.exceptions import ActorDiedError
    from sharpi.common.errors import ServerBusyError
    from sharpi.serve.ray import RayEngine
    from sharpi.serve.request import Event, GenerationRequest

    generation = GenerationRequest([1, 2, 3], max_tokens=2)
    done = Event("finish", finish_reason="length", usage={"prompt_tokens": 3, "completion_tokens": 2,
                                                          "cached_tokens": 0})
    # dies before accepting; accepted elsewhere, dies after an empty event; sent again, answers
    handle = _FakeHandle([ActorDiedError()],
                         [Event("accepted", message="r1@h:1"), [Event("text")], ActorDiedError()],
                         [Event("accepted", message="r2@h:2"), [Event("text", text="a", token_ids=[5]), done]])
    engine = RayEngine(handle)
    stream, out = _events(engine, generation)
    assert handle.sent == 3 and stream.replica == "r2@h:2"
    assert [e.kind for e in out] == ["text", "text", "finish"] and out[-1].finish_reason == "length"
    assert b"sharpi_replica_resent_total 2.0" in engine.metrics()
    # dies after streaming text: the client's stream ends with an error naming the replica
    handle = _FakeHandle([Event("accepted", message="r3@h:3"), [Event("text", text="b", token_ids=[6])],
                          ActorDiedError()])
    engine = RayEngine(handle)
    _, out = _events(engine, generation)
    assert handle.sent == 1 and out[-1].finish_reason == "error" and "r3@h:3" in out[-1].message
    assert b"sharpi_replica_lost_total 1.0" in engine.metrics()
    # a replica's refusal is sharpi's error, for the HTTP layer's 503
    engine = RayEngine(_FakeHandle([Event("refused", finish_reason="busy", message="The queue is full.")]))
    with pytest.raises(ServerBusyError, match="queue is full"):
        _events(engine, generation)
