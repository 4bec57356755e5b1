"""Generated text as it may be shown: ids fed one at a time become text pieces, with an incomplete UTF-8 character
and any tail that could begin a stop string held back until the next id settles it, and the text cut before the
first stop string found. sharpi run/chat and the server stream through it, so both stop at the same place."""
from __future__ import annotations

from ..common.errors import ConfigError
from ..common.tokenizer import Tokenizer

MAX_STOP_CHARS = 16384        # all stop strings together: the matcher's automaton has a node a character


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, special: bool = False):
        self._tokenizer = tokenizer
        self._stream = tokenizer.stream(special=special)
        self._special = special
        self._ids: list[int] = []
        self.stop = stop_strings(stop)
        self._matcher = StopMatcher(self.stop)
        self._scanned = 0                 # characters of the stream's text the matcher has read
        self.emitted = ""                 # the text shown so far
        self.stopped = False              # a stop string was found: nothing more is shown

    def feed(self, token: int) -> str:
        """One more generated id; returns the text it lets us show (possibly empty). Sets .stopped when the text
        now holds a stop string (the text is cut before it)."""
        self._ids.append(token)
        self._stream.step(token)
        text = self._stream.text
        cut = self._matcher.feed(text, self._scanned)
        self._scanned = len(text)
        if cut is not None:
            self.stopped = True
            return self._show(text, cut)
        end = len(text) - self._matcher.held
        while end > 0 and text[end - 1] == "\ufffd":    # an incomplete character: wait for its other bytes
            end -= 1
        return self._show(text, end)

    def finish(self) -> str:
        """The rest, once generation ended without a stop string: what was held back, an unfinished character
        included (detokenized once, as the replacement character)."""
        if self.stopped:
            return ""
        text = self._tokenizer.detokenize(self._ids, special=self._special)
        return self._show(text, len(text))

    def _show(self, text: str, end: int) -> str:
        if end <= len(self.emitted):
            return ""
        piece = text[len(self.emitted):end]
        self.emitted += piece
        return piece


class StopMatcher:
    """Finds stop strings in a growing text in time linear in its length, whatever the stops: an Aho-Corasick
    automaton fed each new character once (searching the whole text, or checking every prefix of every stop
    against its tail, at each token is quadratic: long stops slowed the server's scheduler for everyone). Its
    state is the longest tail of the text that begins some stop, which is what must be held back. Written here
    rather than taken from pyahocorasick, which matches whole strings and does not expose that state."""

    def __init__(self, stops: list[str]):
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]                 # a node's characters: the prefix of a stop it stands for
        self._longest = [0]               # the longest stop that ends at the node (through its suffix links)
        for stop in stops:
            node = 0
            for char in stop:
                node = self._child(node, char)
            self._longest[node] = len(stop)
        self._fail = self._suffix_links()
        self._node = 0

    def _child(self, node: int, char: str) -> int:
        child = self._next[node].get(char)
        if child is None:
            child = self._next[node][char] = len(self._next)
            self._next.append({})
            self._depth.append(self._depth[node] + 1)
            self._longest.append(0)
        return child

    def _suffix_links(self) -> list[int]:
        fail = [0] * len(self._next)
        queue = list(self._next[0].values())
        for node in queue:                # breadth first: a node's link is settled before its children's
            for char, child in self._next[node].items():
                link = fail[node]
                while link and char not in self._next[link]:
                    link = fail[link]
                fail[child] = self._next[link].get(char, 0)
                self._longest[child] = max(self._longest[child], self._longest[fail[child]])
                queue.append(child)
        return fail

    @property
    def held(self) -> int:
        """Characters at the end of the text read so far that could begin a stop."""
        return self._depth[self._node]

    def feed(self, text: str, start: int) -> int | None:
        """Read text[start:]; returns where the earliest-starting stop that ends in it begins, or None."""
        node, cut = self._node, None
        nxt, fail, longest = self._next, self._fail, self._longest
        for i in range(start, len(text)):
            char = text[i]
            while node and char not in nxt[node]:
                node = fail[node]
            node = nxt[node].get(char, 0)
            if longest[node]:
                begin = i + 1 - longest[node]
                cut = begin if cut is None else min(cut, begin)
        self._node = node
        return cut


def stop_strings(stop) -> list[str]:
    """A stop string or a list of them, checked (None: none)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
    stops = [s for s in stops if s]
    if sum(map(len, stops)) > MAX_STOP_CHARS:
        raise ConfigError(f"The stop strings have {sum(map(len, stops))} characters together; at most "
                          f"{MAX_STOP_CHARS} are allowed.")
    return stops
