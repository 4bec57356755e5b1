"""Generated text as it may be shown: ids fed one at a time become text pieces, with an incomplete UTF-8 character
and any tail that could begin a stop string held back until the next id settles it, and the text cut before the
first stop string found. sharpi run/chat and the server stream through it, so both stop at the same place."""
from __future__ import annotations

from ..common.errors import ConfigError
from ..common.tokenizer import Tokenizer


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, special: bool = False):
        self._tokenizer = tokenizer
        self._stream = tokenizer.stream(special=special)
        self._special = special
        self._ids: list[int] = []
        self.stop = stop_strings(stop)
        self.emitted = ""                 # the text shown so far
        self.stopped = False              # a stop string was found: nothing more is shown

    def feed(self, token: int) -> str:
        """One more generated id; returns the text it lets us show (possibly empty). Sets .stopped when the text
        now holds a stop string (the text is cut before it)."""
        self._ids.append(token)
        self._stream.step(token)
        text = self._stream.text
        cut = _find_stop(text, self.stop)
        if cut is not None:
            self.stopped = True
            return self._show(text[:cut])
        return self._show(_safe_prefix(text, self.stop))

    def finish(self) -> str:
        """The rest, once generation ended without a stop string: what was held back, an unfinished character
        included (detokenized once, as the replacement character)."""
        if self.stopped:
            return ""
        return self._show(self._tokenizer.detokenize(self._ids, special=self._special))

    def _show(self, text: str) -> str:
        if len(text) <= len(self.emitted):
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece


def stop_strings(stop) -> list[str]:
    """A stop string or a list of them, checked (None: none)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
    return [s for s in stops if s]


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: list[str]) -> str:
    """Text that can be shown now: hold back an incomplete UTF-8 character and any tail that could start a stop."""
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return text[:end]
