"""What stands between a socket and the routes: the request's framing checked, its body counted as it arrives and
bounded in size and time, the connection's headers bounded in time, and one escaped log line a request telling
how it ended.

- Framing: a request with both Content-Length and Transfer-Encoding, several of either, or a length that is not
  a number is refused before its body is read (h11 would read a chunked body whatever Content-Length said).
- Body: the bytes are counted as the app receives them, whatever the headers said; past the bound the request is
  refused (413) and its connection closed, so the rest is never read. A body must arrive within body_timeout.
- Headers: a connection must send a request's headers within header_timeout of opening or of its last response
  (uvicorn bounds only the idle time between requests, and only until a first byte arrives).
- Memory: after a request that read a large body, glibc is asked to give its freed arenas back (malloc_trim),
  which it otherwise keeps for the process's life.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..common.errors import ConfigError
from ..common.settings import parse_positive_int

log = logging.getLogger("sharpi.serve")
TRIM_AFTER_BYTES = 1 << 20           # a body at least this large: give freed memory back when its request ends
MAX_LOGGED_PATH = 200


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP layer's bounds (sharpi serve's --max-body-mib, --header-timeout, --body-timeout)."""
    max_body_bytes: int = 16 << 20   # a 100k-token prompt as JSON is well under 1 MiB
    header_timeout: float = 10.0     # seconds for a request's headers to arrive
    body_timeout: float = 60.0       # seconds for its whole body to arrive once the headers did
    idle_timeout: float = 5.0        # seconds a kept-alive connection may wait for its next request

    def validate(self) -> None:
        parse_positive_int(self.max_body_bytes, "max_body_bytes", highest=1 << 34)
        for name in ("header_timeout", "body_timeout", "idle_timeout"):
            check_seconds(getattr(self, name), name)


def check_seconds(value, name: str) -> float:
    """A timeout in seconds, in (0, 86400] (NaN refused), or a ConfigError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
        raise ConfigError(f"{name} must be a number of seconds in (0, 86400], got {value!r}.")
    return value


class RequestRefused(Exception):
    """A request the guard refuses: the app's error handler answers it (status, message, code) and closes the
    connection, whose unread body is then never read."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class RequestNote:
    """What the request's log line tells, filled in as it runs: the body bytes read, the status sent, how it
    ended (the error's code, or a generation's counts)."""
    start: float
    body_bytes: int = 0
    body_done: bool = False
    status: int = 0
    outcome: str = ""


def framing_problem(headers: list[tuple[bytes, bytes]], max_body_bytes: int) -> RequestRefused | None:
    """Why a request's framing headers are refused, before any of its body is read (None: they are fine)."""
    lengths = [value for name, value in headers if name == b"content-length"]
    encodings = [value for name, value in headers if name == b"transfer-encoding"]
    if lengths and encodings:
        return RequestRefused(400, "The request has both Content-Length and Transfer-Encoding; send one.",
                              "ambiguous_framing")
    if len(lengths) > 1 or len(encodings) > 1:
        return RequestRefused(400, "The request repeats its Content-Length or Transfer-Encoding header.",
                              "ambiguous_framing")
    if encodings and encodings[0].strip().lower() != b"chunked":
        return RequestRefused(400, "The only Transfer-Encoding taken is chunked.", "unsupported_framing")
    if lengths:
        value = lengths[0].strip()
        if not value.isdigit():
            return RequestRefused(400, "The Content-Length is not a number.", "invalid_framing")
        if int(value) > max_body_bytes:
            return body_too_large(max_body_bytes)
    return None


def body_too_large(max_body_bytes: int) -> RequestRefused:
    return RequestRefused(413, f"The request body is over {max_body_bytes / (1 << 20):g} MiB.", "body_too_large")


class GuardMiddleware:
    """Pure ASGI middleware (a BaseHTTPMiddleware would hide client disconnects from the routes): the framing and
    body checks above, and the log line. A refusal raised while the app reads the body reaches the app's error
    handler (`answer_refusal`), which answers it in the app's error format."""

    def __init__(self, app, limits: HttpLimits, answer_refusal):
        self.app, self.limits, self.answer_refusal = app, limits, answer_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        note = RequestNote(time.monotonic())
        scope["sharpi_note"] = note
        headers = scope.get("headers") or []
        expects_body = any(name in (b"content-length", b"transfer-encoding") for name, _ in headers)
        note.body_done = not expects_body
        deadline = note.start + self.limits.body_timeout

        async def receive_counted():
            if note.body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise RequestRefused(408, f"The request body did not arrive within "
                                          f"{self.limits.body_timeout:g} s.", "body_timeout") from None
            if message["type"] == "http.request":
                note.body_bytes += len(message.get("body", b""))
                if note.body_bytes > self.limits.max_body_bytes:
                    raise body_too_large(self.limits.max_body_bytes)
                note.body_done = not message.get("more_body", False)
            else:
                note.body_done = True
            return message

        async def send_noted(message):
            if message["type"] == "http.response.start":
                note.status = message["status"]
                if not note.body_done:        # answered before its body was read: never read the rest
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            problem = framing_problem(headers, self.limits.max_body_bytes)
            if problem is not None:
                note.outcome = f"refused={problem.code}"
                await self.answer_refusal(problem)(scope, receive, send_noted)
            else:
                await self.app(scope, receive_counted, send_noted)
        finally:
            if note.body_bytes >= TRIM_AFTER_BYTES:
                await asyncio.to_thread(release_free_memory)
            log.info("%s %s %d %.3fs body=%d%s", scope["method"], loggable(scope["path"]), note.status,
                     time.monotonic() - note.start, note.body_bytes, f" {note.outcome}" if note.outcome else "")


def loggable(text: str, limit: int = MAX_LOGGED_PATH) -> str:
    """`text` fit for one log line: backslashes, control and other unprintable characters escaped (a request path
    like /v1/models/%0aFORGED must not start a line of its own), cut at `limit` characters."""
    shown = "".join(_escaped(c) for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


def _escaped(char: str) -> str:
    if char == "\\":
        return "\\\\"
    return char if char.isprintable() else char.encode("unicode_escape").decode("ascii")


_libc = None


def release_free_memory() -> None:
    """Ask glibc to return its freed heap memory to the system (a no-op where malloc_trim does not exist)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head: from the connection's opening, and from
    each response's end, the client has header_timeout seconds to send a whole request head, else the connection
    is closed. (uvicorn's keep-alive timer stops at the first byte, so a client sending a byte every few seconds
    held a connection forever.) `guarded_h11` makes the class for a given deadline, as uvicorn takes a class."""
    header_timeout = HttpLimits.header_timeout

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:           # a request's head arrived
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        self._arm_header_timer()              # before: a pipelined request handled inside disarms it
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline_passed)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            self.transport.close()


def guarded_h11(header_timeout: float) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})
