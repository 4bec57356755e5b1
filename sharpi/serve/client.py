"""Where the HTTP layer (sharpi.serve.app) sends a request, and what it needs of the model, as two interfaces with
two implementations each: in `sharpi serve`, the model loaded in this process (Model) and its scheduler thread
(LocalEngine); in a Ray Serve ingress (sharpi.serve.ray), the artifact's tokenizer and settings alone (ModelInfo)
and the engine replicas behind a deployment handle.

A request's events arrive on an EventStream: an asyncio queue of engine Events, filled from the engine's thread or
from a replica's stream, and a cancel() that stops the request wherever it runs (its pages freed)."""
from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from ..common.config import ModelConfig
from ..common.snapkv_settings import SnapKVSettings
from ..common.tokenizer import Tokenizer
from .engine import ServeEngine
from .request import Event, GenerationRequest


class ModelFront(Protocol):
    """What the HTTP layer reads of the model: runtime.Model and runtime.model_info.ModelInfo both have it."""
    config: ModelConfig
    tokenizer: Tokenizer

    @property
    def max_context(self) -> int: ...

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False,
                 limit: int | None = None) -> list[int]: ...

    def detokenize(self, ids, special: bool = True) -> str: ...

    def snapkv_settings(self, **knobs) -> tuple[SnapKVSettings, int]: ...


class EventStream:
    """One request's events in order, read with `await next()` on the event loop that opened it. `replica`
    names the engine replica that serves it (None in a single-engine server)."""

    def __init__(self, replica: str | None = None, on_cancel: Callable[[], None] | None = None):
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.replica = replica
        self._on_cancel = on_cancel
        self._finished = False

    async def next(self) -> Event:
        event = await self.queue.get()
        if event.kind == "finish":
            self._finished = True
        return event

    async def next_batch(self, linger: float = 0.0) -> list[Event]:
        """The next event and those that follow it within `linger` seconds (up to the finish): a stream relayed
        to another process sends them as one message."""
        loop = asyncio.get_running_loop()
        batch, deadline = [await self.next()], loop.time() + linger
        while batch[-1].kind != "finish":
            try:
                if self.queue.empty():
                    batch.append(await asyncio.wait_for(self.queue.get(), deadline - loop.time()))
                else:
                    batch.append(self.queue.get_nowait())
            except asyncio.TimeoutError:
                break
        if batch[-1].kind == "finish":
            self._finished = True
        return batch

    def cancel_with(self, on_cancel: Callable[[], None]) -> None:
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        """Stop the request if it is still running (a no-op once its finish was read)."""
        if not self._finished and self._on_cancel is not None:
            on_cancel, self._on_cancel = self._on_cancel, None
            on_cancel()

    @classmethod
    def finished(cls, event: Event) -> "EventStream":
        """A stream holding only `event` (an answer computed without the engine)."""
        stream = cls()
        stream.queue.put_nowait(event)
        return stream


class EngineClient(Protocol):
    """Where requests run. open() raises ServerBusyError (the queue is full), ContextLengthError or ConfigError
    (the request cannot run), which the HTTP layer answers with a 503 or a 400."""

    async def open(self, generation: GenerationRequest) -> EventStream: ...

    def health(self) -> str | None:
        """None while requests can be served, else why not."""

    def metrics(self) -> bytes:
        """The Prometheus exposition of the serving metrics."""


class LocalEngine:
    """The ServeEngine of this process (sharpi serve): its scheduler thread hands each event to the request's
    event loop."""

    def __init__(self, engine: ServeEngine):
        self.engine = engine

    async def open(self, generation: GenerationRequest) -> EventStream:
        return open_local(self.engine, generation)

    def health(self) -> str | None:
        return None if self.engine.fatal is None else f"the engine failed: {self.engine.fatal}"

    def metrics(self) -> bytes:
        return self.engine.render_metrics()

    def stop_intake(self) -> None:
        self.engine.stop_intake()

    def cancel_all(self) -> None:
        self.engine.cancel_all()

    def step_seconds(self) -> float:
        return self.engine.step_seconds()


def open_local(engine: ServeEngine, generation: GenerationRequest, replica: str | None = None) -> EventStream:
    """Submit to an engine of this process; its events go to the calling event loop's stream (a Ray replica
    streams them on to its caller)."""
    loop = asyncio.get_running_loop()
    stream = EventStream(replica)
    handle = engine.submit(generation, lambda event: loop.call_soon_threadsafe(stream.queue.put_nowait, event))

    def cancel() -> None:
        handle.cancel()
        engine.wake()

    stream.cancel_with(cancel)
    return stream
