"""Running the HTTP app: on a socket bound here (a port in use is one clear sentence, and port 0 picks a free
one), by uvicorn, with a drain on SIGINT/SIGTERM; or in a thread of this process (tests, benchmarks).

uvicorn runs h11 (named, not left to whichever parser is installed: httptools would take over where it is
installed, with other framing rules) through sharpi.serve.http_guard's protocol, which bounds the time a request's
head may take."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from ..common.errors import ConfigError, SharpiError
from .app import ServerState, create_app
from .http_guard import guarded_h11


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"Cannot listen on {host}:{port}: {error.strerror or error}.") from None
    sock.listen(2048)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose exit on SIGINT/SIGTERM first drains the engine: new requests get 503 at once,
    those in flight have drain_seconds to finish and are then cancelled (a stream ends with an error event and
    [DONE]), so that uvicorn's own graceful shutdown, after it, finds every connection done."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_seconds: float):
        super().__init__(config)
        self.state, self.drain_seconds = state, drain_seconds

    def handle_exit(self, sig, frame):
        engine = self.state.engine
        if engine is not None and not self.should_exit:
            engine.stop_intake()
            # the cancellation takes effect at the engine's next step: sent a step early, the drain ends in time
            timer = threading.Timer(max(0.0, self.drain_seconds - engine.step_seconds()), engine.cancel_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def _config(state: ServerState, drain_seconds: float) -> uvicorn.Config:
    limits = state.limits
    limits.validate()
    return uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                          http=guarded_h11(limits.header_timeout), timeout_keep_alive=limits.idle_timeout,
                          timeout_graceful_shutdown=drain_seconds + 5)


def serve(state: ServerState, sock: socket.socket, drain_seconds: float = 10.0) -> None:
    """Serve until SIGINT/SIGTERM (this thread must be the main one)."""
    import signal
    # uvicorn raises a signal it handled again for the handler it found; for SIGTERM let that be a no-op, so
    # that the caller gets to shut the engine down and free its pages.
    signal.signal(signal.SIGTERM, lambda *_: None)
    DrainingServer(_config(state, drain_seconds), state, drain_seconds).run(sockets=[sock])


@contextlib.contextmanager
def serve_in_thread(state: ServerState, host: str = "127.0.0.1", port: int = 0, timeout: float = 30):
    """The app served from a thread of this process; yields its base URL (http://host:port)."""
    sock = bind(host, port)
    server = DrainingServer(_config(state, 1.0), state, 1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="sharpi-http")
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise SharpiError("The HTTP server did not start.")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
