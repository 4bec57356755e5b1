"""What a client asks the serving engine for, and what comes back: a GenerationRequest in, a stream of Events out
through the RequestHandle that submit() returns."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..common.snapkv_settings import SnapKVSettings
from ..common.speculative_settings import SpeculativeSettings
from ..runtime.sampling import SamplingParams

_ids = itertools.count(1)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None          # None: none; k >= 0: the chosen token's and the k most likely
    snapkv: SnapKVSettings | None = None  # the request's SnapKV settings (None: the artifact's and env's)
    special: bool = False                 # show special tokens in the text
    ignore_eos: bool = False
    compress: tuple[str, int] | None = None  # (scorer, prefix tokens): the prefix compressed and cached alone
    # only the compression: the request ends once its prefix is compressed (or found compressed in the cache),
    # nothing generated, and its finish's usage["compression"] says what was kept (sharpi.serve.shares)
    compress_only: bool = False
    # speculative decoding by prompt lookup, where the sequence is decoded on its own (sharpi.serve.engine)
    speculative: SpeculativeSettings = SpeculativeSettings()


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Event:
    """kind "text": text (possibly empty), the ids it came from and their logprobs; kind "finish": the
    finish_reason ("stop", "length", "cancelled" or "error" with a message) and the usage counts. Between a Ray
    replica and its ingress (sharpi.serve.ray), a stream opens with kind "accepted" (message: the replica's name)
    or "refused" (finish_reason: busy, context or config; message: the sentence)."""
    kind: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    message: str | None = None


class RequestHandle:
    """A submitted request: its id, cancel(), and the events, which the engine's thread hands to `on_event`
    (the HTTP layer forwards them to its event loop)."""

    def __init__(self, request: GenerationRequest, on_event: Callable[[Event], None]):
        self.id = next(_ids)
        self.request = request
        self._on_event = on_event
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop generating and free the request's pages (at the engine's next step)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        try:
            self._on_event(event)
        except Exception:   # noqa: BLE001 -- a consumer that fails (its client gone) must not stop the engine
            self.cancel()
