"""The server under hostile requests, on a tiny random model (its answers do not matter, only the server's): framing
that disagrees with itself, bodies over the bound or too slow, prompts far over the context, blocking work, log
lines, ambiguous authorization, slow headers, stop strings, and the tokenizer from several threads. Everything
runs on 127.0.0.1 and is bounded in count; nothing asserts a time (the 2-core CI machines are loaded): the
statuses, the bytes the server read before refusing, which calls ran and on which thread, and memory after
repeats. The times go in benchmarks/soak.py."""
from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import sharpi
from sharpi.runtime.text_output import MAX_STOP_CHARS, StopMatcher
from sharpi.serve.http_guard import HttpLimits, loggable

from openai_server import NAME, Server

KEY = "hostile-test-key"
BOUND = 1 << 20              # the test server's body bound (the default is 16 MiB; the logic is the same)


@pytest.fixture(scope="module")
def tiny(tiny_artifact):
    return sharpi.load(tiny_artifact)


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, parallel=2, api_key=KEY,
               limits=HttpLimits(max_body_bytes=BOUND, header_timeout=1.0, body_timeout=3.0, idle_timeout=1.0))
    yield s
    s.close()


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _head(path: str, *headers: str, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}", *headers, "", ""]
    return "\r\n".join(lines).encode()


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and everything the server sent until it closed the connection (or 10 s of silence)."""
    data = b""
    sock.settimeout(10)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


def _json_body(data: bytes) -> dict:
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (within 30 s)."""
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _log_lines(caplog, path: str, wanted: int = 1) -> list[str]:
    """The server's log lines for `path`, once `wanted` of them are there (a line is written after the response
    is sent, so it may come just after the client has read it)."""
    for _ in range(300):
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "sharpi.serve" and f" {path} " in r.getMessage()]
        if len(lines) >= wanted:
            return lines
        time.sleep(0.1)
    return lines


# -- framing and bodies -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers, code", [
    (["Content-Length: 10", "Transfer-Encoding: chunked"], "ambiguous_framing"),
    (["Transfer-Encoding: chunked", "Content-Length: 10"], "ambiguous_framing"),
    (["Content-Length: 10", "Content-Length: 12"], None),  # h11 refuses these first: a plain 400
    (["Content-Length: 1e3"], None),
    (["Transfer-Encoding: gzip, chunked"], None),
])
def test_conflicting_framing_is_refused_before_any_body_is_read(server, headers, code):
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(_head("/tokenize", "Content-Type: application/json", *headers))   # no body sent at all
        status, data = _response(sock)
    assert status == 400, data[:300]
    if code is not None:
        assert _json_body(data)["error"]["code"] == code
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_chunked_body_past_the_bound_is_cut_off_and_its_connection_closed(server, caplog):
    caplog.set_level(logging.INFO, logger="sharpi.serve")
    chunk = b"x" * 65536
    sent = 0
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(_head("/v1/completions", "Transfer-Encoding: chunked", "Content-Type: application/json"))
        try:
            for _ in range(8 * BOUND // len(chunk)):          # 8x the bound, unless the server stops reading
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, data = _response(sock)
    assert status == 413 and _json_body(data)["error"]["code"] == "body_too_large"
    [line] = _log_lines(caplog, "/v1/completions")
    read = int(line.split("body=")[1].split()[0])
    # one receive holds what uvicorn read from the socket before pausing: asyncio reads up to 256 KiB at once
    assert BOUND < read <= min(BOUND + (512 << 10), sent) and "error=body_too_large" in line, (line, sent)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_declared_length_past_the_bound_is_refused_unread(server):
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(_head("/v1/completions", f"Content-Length: {BOUND + 1}"))
        status, data = _response(sock)
    assert status == 413


def test_a_chunked_body_within_the_bound_is_read(server, tiny):
    body = json.dumps({"prompt": "hello there"}).encode()
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(_head("/tokenize", "Transfer-Encoding: chunked", "Connection: close")
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        status, data = _response(sock)
    assert status == 200 and _json_body(data)["tokens"] == tiny.tokenize("hello there")


def test_a_body_that_does_not_arrive_is_refused_and_health_answers_meanwhile(server, caplog):
    caplog.set_level(logging.INFO, logger="sharpi.serve")
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(_head("/v1/completions", "Content-Length: 1000") + b'{"prompt": ')   # and then nothing
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}              # while it waits
        status, data = _response(sock)
    assert status == 408 and _json_body(data)["error"]["code"] == "body_timeout"
    assert any("error=body_timeout" in line for line in _log_lines(caplog, "/v1/completions"))


# -- prompts far over the context ---------------------------------------------------------------------------------
class _TokenizerSpy:
    """Counts the characters the model's tokenizer encodes, and the threads that tokenize or detokenize."""

    def __init__(self, monkeypatch, tokenizer):
        self.characters, self.threads = 0, set()
        encoder, detokenize = tokenizer._encoder, tokenizer.detokenize

        def counting_encoder(special):
            inner = encoder(special)
            spy = self

            class Counting:
                def encode(self, text, **kw):
                    spy.characters += len(text)
                    spy.threads.add(threading.current_thread().name)
                    return inner.encode(text, **kw)
            return Counting()

        def spied_detokenize(*args, **kw):
            self.threads.add(threading.current_thread().name)
            return detokenize(*args, **kw)
        monkeypatch.setattr(tokenizer, "_encoder", counting_encoder)
        monkeypatch.setattr(tokenizer, "detokenize", spied_detokenize)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"),
                                         ("/tokenize", "prompt")])
def test_a_prompt_far_over_the_context_is_refused_untokenized(server, tiny, monkeypatch, path, field):
    spy = _TokenizerSpy(monkeypatch, tiny.tokenizer)
    text = "word " * (BOUND // 6)            # ~0.9 MB: thousands of times the tiny model's context
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    r = _post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == field
    assert spy.characters == 0


def test_a_long_prompt_is_tokenized_only_until_it_passes_the_limit(smollm2):
    tok = smollm2.tokenizer
    spy = []
    encoder = tok._encoder

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def encode(self, text, **kw):
            spy.append(len(text))
            return self.inner.encode(text, **kw)
    tok._encoder = lambda special: Counting(encoder(special))
    try:
        text = " ".join(random.Random(0).choice(["alpha", "beta", "gamma", "delta"]) for _ in range(200_000))
        with pytest.raises(sharpi.ContextLengthError):
            tok.tokenize(text, limit=8000)
        assert sum(spy) < len(text) // 4           # a piece or two of the 1.2M characters
        # a text that fits is never refused by the piecewise check, and its ids are the unbounded ones
        fits = text[:300_000]
        ids = tok.tokenize(fits)
        assert len(fits) > 4 * len(ids) or len(ids) > 0
        assert tok.tokenize(fits, limit=len(ids)) == ids
        with pytest.raises(sharpi.ContextLengthError):
            tok.tokenize(fits, limit=len(ids) - 1)
    finally:
        del tok._encoder


def test_an_id_list_over_the_context_is_refused_by_its_length(server, tiny, monkeypatch):
    spy = _TokenizerSpy(monkeypatch, tiny.tokenizer)
    for path, body in [("/v1/completions", {"prompt": [1] * 100_000}), ("/detokenize", {"tokens": [1] * 100_000})]:
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert not spy.threads                           # not detokenized either
    r = _post(server, "/detokenize", {"tokens": tiny.tokenize("hi there")})
    assert r.status_code == 200 and r.json()["content"] == "hi there"


def test_tokenizing_and_detokenizing_run_off_the_event_loop(server, tiny, monkeypatch):
    spy = _TokenizerSpy(monkeypatch, tiny.tokenizer)
    for path, body in [("/tokenize", {"prompt": "a b c"}), ("/detokenize", {"tokens": [65, 66]}),
                       ("/v1/completions", {"prompt": "a b", "max_tokens": 1})]:
        assert _post(server, path, body).status_code == 200, path
    assert spy.threads and "sharpi-http" not in spy.threads, spy.threads


def test_memory_is_given_back_after_repeated_hostile_requests(server):
    """RSS after the first of each case and after ten more: growth bounded (the refused prompt was tokenized
    whole before, ~2 GB a request, and glibc kept the arenas)."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    text = "word " * (BOUND // 6)
    cases = [("/v1/completions", {"prompt": text}), ("/v1/chat/completions",
                                                     {"messages": [{"role": "user", "content": text}]}),
             ("/detokenize", {"tokens": [1] * (BOUND // 8)})]
    for path, body in cases:
        assert _post(server, path, body).status_code == 400
    first = rss()
    for _ in range(10):
        for path, body in cases:
            assert _post(server, path, body).status_code == 400
    assert rss() - first < 48 << 20, f"RSS grew by {(rss() - first) >> 20} MiB over 10 repeats"


# -- logs, auth, headers ------------------------------------------------------------------------------------------
def test_log_lines_escape_the_path_and_tell_the_true_outcome(server, tiny, caplog):
    caplog.set_level(logging.INFO, logger="sharpi.serve")
    httpx.get(server.url + "/v1/models/%0aINJECTED%20LINE", headers={"Authorization": f"Bearer {KEY}"})
    [line] = _log_lines(caplog, "/v1/models/\\nINJECTED")
    assert "\n" not in line and "\\nINJECTED LINE" in line and " 404 " in line and "error=not_found" in line
    assert loggable("a\x1b[31mb\\") == "a\\x1b[31mb\\\\"
    busy = Server(tiny, parallel=1, max_queue=0)          # refuses every request: the queue holds none
    try:
        caplog.clear()
        r = httpx.post(busy.url + "/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503
        [line] = _log_lines(caplog, "/v1/completions")
        assert " 503 " in line and "error=overloaded" in line and "went away" not in line, line
    finally:
        busy.close()


def test_several_authorization_headers_are_refused(server):
    with socket.create_connection(_address(server)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nAuthorization: Bearer wrong\r\nConnection: close\r\n\r\n")
        status, data = _response(sock)
    assert status == 400 and _json_body(data)["error"]["code"] == "ambiguous_authorization"
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_silent_and_slow_header_connections_are_closed(server):
    host_port = _address(server)
    silent = [socket.create_connection(host_port) for _ in range(20)]
    slow = socket.create_connection(host_port)
    slow.sendall(b"GET /health HTTP/1.1\r\n")
    try:
        for _ in range(100):                    # a header byte every 0.1 s: never a whole head within 1 s
            slow.sendall(b"X")
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        assert all(_closed(s) for s in silent)
        assert _closed(slow)
    finally:
        for s in [*silent, slow]:
            s.close()
    assert httpx.get(server.url + "/health").status_code == 200


# -- stop strings and the tokenizer -------------------------------------------------------------------------------
def test_stop_matching_equals_a_plain_search_on_random_texts():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        matcher, text = StopMatcher(stops), ""
        while len(text) < 40:
            start = len(text)
            text += "".join(rng.choice("abc d") for _ in range(rng.randint(1, 4)))
            hits = [text.find(s) for s in stops if s in text]
            got = matcher.feed(text, start)
            assert got == (min(hits) if hits else None), (stops, text)
            if got is not None:
                break
            held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            assert matcher.held == held, (stops, text)


def test_stop_strings_are_bounded_in_total_length(server):
    r = _post(server, "/v1/completions", {"prompt": "a", "stop": ["x" * (MAX_STOP_CHARS // 2 + 1)] * 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    with pytest.raises(sharpi.SharpiError):
        from sharpi.runtime.text_output import stop_strings
        stop_strings(["y" * (MAX_STOP_CHARS + 1)])


def test_the_tokenizer_is_safe_from_several_threads(smollm2):
    """special=True and special=False calls at once each give their own ids (a flag toggled on the shared
    tokenizer made the special=True calls read chat markers as text)."""
    tok = smollm2.tokenizer
    text = "<|im_start|>user\nHello there<|im_end|>\n"
    special, plain = tok.tokenize(text, special=True), tok.tokenize(text, special=False)
    assert special != plain

    def run(flag: bool) -> int:
        want = special if flag else plain
        return sum(tok.tokenize(text, special=flag) != want for _ in range(3000))
    with ThreadPoolExecutor(4) as pool:
        wrong = list(pool.map(run, [True, False, True, False]))
    assert wrong == [0, 0, 0, 0]


def test_serve_cli_refuses_bad_http_limits(tiny_artifact, capsys):
    from sharpi.cli.main import main
    for flags, word in [(["--max-body-mib", "0"], "--max-body-mib"), (["--header-timeout", "-1"], "--header-timeout"),
                        (["--body-timeout", "nan"], "--body-timeout")]:
        try:
            rc = main(["serve", str(tiny_artifact), "--port", "0", *flags])
        except SystemExit as exit_info:
            rc = exit_info.code
        assert rc == 2
        err = capsys.readouterr().err
        assert word in err and "Traceback" not in err, err


def test_a_prefill_budget_below_the_chunk_prefills_in_steps_of_it(tiny):
    """The server's --prefill-budget is the most a prefill step computes, so cancellations (a drain, a client gone)
    wait at most that many tokens' time."""
    ids = [3 + i % 200 for i in range(100)]
    with tiny.session() as whole:
        want = whole.prefill(ids)
    with tiny.session() as session:
        job = session.start_prefill(ids, chunk=16)
        sizes = []
        while not job.done:
            sizes.append(job.next_tokens)
            job.step()
        assert sizes == [16] * 6 + [4]
        assert abs(job.logits - want).max() < 1e-3 * abs(want).max()
