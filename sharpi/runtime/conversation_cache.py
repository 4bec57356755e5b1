"""The conversation cache: SnapKV-compressed sequences kept after they finish, so that a prompt continuing one
exactly (a chat's next turn: the earlier turns, the answer, then the new message) goes on from the compressed
cache and computes only its new tokens, as `sharpi chat` does within one session.

A compressed cache holds the positions its prompt's own last queries chose, so it is never the prefix of a
different prompt (the prefix cache shares only caches that hold every position): an entry serves a prompt only
when the entry's tokens are the prompt's first tokens and the SnapKV settings are the same. Each entry is a
session the cache owns; a hit gets a fork of it (the pages shared, copied on write), so the entry serves again (a
regenerated answer) until it is the least recently used and either the pool needs its pages or the entry bound is
reached.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .kv_cache import PagePool
from .session import Session


@dataclass
class Continuation:
    tokens: tuple[int, ...]         # every token the cache has seen, from position 0
    session: Session                # owned by the cache: fork it to continue
    prompt_tokens: int              # the compressed first prompt's length

    def pages(self) -> list[int]:
        return [p for layer in self.session.cache.pages for p in layer]


class ConversationCache:
    def __init__(self, pool: PagePool, max_entries: int = 64):
        self.pool, self.max_entries = pool, max_entries
        self._entries: OrderedDict[tuple, Continuation] = OrderedDict()    # least recently used first
        self._page_array: np.ndarray | None = None    # every entry's pages, each once; rebuilt after a change

    def __len__(self) -> int:
        return len(self._entries)

    def page_set(self) -> set[int]:
        """Every page the entries hold (a continuation of a continuation shares most of its pages)."""
        return set(self._pages().tolist())

    def _pages(self) -> np.ndarray:
        # An entry's session is never written (a hit continues a fork of it), so its pages change only when
        # entries come and go.
        if self._page_array is None:
            self._page_array = np.unique(np.fromiter((p for e in self._entries.values() for p in e.pages()),
                                                     np.int64))
        return self._page_array

    @staticmethod
    def _key(tokens, session: Session) -> tuple:
        scorer = session.scorer.name if session.scorer is not None else "snapkv"
        return tuple(tokens), session.snapkv, session.snapkv_budget, scorer

    def insert(self, tokens: list[int], session: Session, prompt_tokens: int) -> bool:
        """Keep a finished compressed `session` that has seen `tokens` (taking it over: the cache closes it when
        the entry goes). Returns False, and leaves the session to the caller, when it was not compressed."""
        if not session.evicted or session.closed or len(tokens) != session.logical_length:
            return False
        key = self._key(tokens, session)
        old = self._entries.pop(key, None)
        if old is not None:
            old.session.close()
        self._entries[key] = Continuation(tuple(tokens), session, prompt_tokens)
        self._page_array = None
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
        return True

    def lookup(self, tokens: list[int], like: Session) -> Continuation | None:
        """The longest entry whose tokens begin `tokens` and leave at least one to compute, with `like`'s SnapKV
        settings; it becomes the most recently used."""
        best, settings = None, self._key((), like)[1:]
        for key, entry in self._entries.items():
            n = len(entry.tokens)
            if key[1:] == settings and n < len(tokens) and (best is None or n > len(best.tokens)) \
                    and tuple(tokens[:n]) == entry.tokens:
                best = entry
        if best is not None:
            self._entries.move_to_end(self._key(best.tokens, best.session))
        return best

    def reclaimable(self) -> int:
        """Pages only the cache holds: what reclaim() can give back now."""
        return int((self.pool.refs[self._pages()] == 1).sum())

    def reclaim(self, wanted: int) -> int:
        """Drop least recently used entries until `wanted` pages are free again (or none is left); returns the
        pages freed."""
        freed = 0
        while freed < wanted and self._entries:
            key = next(iter(self._entries))
            before = self.pool.free_count
            self._drop(key)
            freed += self.pool.free_count - before
        return freed

    def clear(self) -> None:
        while self._entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple) -> None:
        self._entries.pop(key).session.close()
        self._page_array = None
