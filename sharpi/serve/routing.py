"""Which engine replica should serve a prompt: the one that served its longest page-aligned prefix, while that
replica is not much busier than the least busy one; otherwise the least busy. This keeps a conversation's turns
(each prompt extends the last) and a shared document's questions on the replica whose prefix cache holds their
pages, as vLLM's and llama-server's prefix caches want, without letting one hot prefix starve the rest.

Pure bookkeeping, no Ray: sharpi.serve.ray's request router calls it with the replicas it sees."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class AffinitySettings:
    page_size: int = 16          # the engine's KV page: its prefix cache holds whole pages only
    min_share: float = 0.1       # follow a match covering at least this share of the prompt (Ray's LLM router's)
    max_excess: int = 8          # ... unless its replica has this many more requests than the least busy one
    capacity: int = 1 << 16      # prefixes remembered (least recently used out first)


class PrefixIndex:
    """Page-aligned prefixes of routed prompts, each with the replica it went to last. A prefix is named by a
    hash chain over its pages (a page's key hashes its parent's key and its own tokens), so a prompt's keys are
    those of every prompt it extends. Python hashes ints and tuples the same in every process, and a collision
    only routes a request to a replica without its pages, never changes an answer."""

    def __init__(self, settings: AffinitySettings = AffinitySettings()):
        self.settings = settings
        self._replica_of: OrderedDict[int, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replica_of)

    def keys(self, ids: Sequence[int]) -> list[int]:
        """The keys of the prompt's full pages, shortest prefix first."""
        size, key, out = self.settings.page_size, 0, []
        for end in range(size, len(ids) + 1, size):
            key = hash((key, tuple(ids[end - size:end])))
            out.append(key)
        return out

    def record(self, ids: Sequence[int], replica: Hashable) -> None:
        for key in self.keys(ids):
            self._replica_of[key] = replica
            self._replica_of.move_to_end(key)
        while len(self._replica_of) > self.settings.capacity:
            self._replica_of.popitem(last=False)

    def longest_match(self, ids: Sequence[int], replicas: set) -> tuple[Hashable | None, int]:
        """The replica (among `replicas`) that last served the longest of the prompt's prefixes, and that
        prefix's tokens; (None, 0) if none did."""
        keys = self.keys(ids)
        for pages in range(len(keys), 0, -1):
            replica = self._replica_of.get(keys[pages - 1])
            if replica is not None and replica in replicas:
                self._replica_of.move_to_end(keys[pages - 1])
                return replica, pages * self.settings.page_size
        return None, 0

    def forget(self, replica: Hashable) -> None:
        """Drop a replica that died: its pages died with it."""
        for key in [k for k, r in self._replica_of.items() if r == replica]:
            del self._replica_of[key]

    def preferred(self, ids: Sequence[int], queue_lengths: dict) -> Hashable | None:
        """The replica this prompt should go to for its cached prefix, or None to balance by load.
        queue_lengths: each live replica's requests in flight (None where unknown)."""
        replica, matched = self.longest_match(ids, set(queue_lengths))
        if replica is None or matched < self.settings.min_share * len(ids):
            return None
        known = [q for q in queue_lengths.values() if q is not None]
        mine = queue_lengths[replica]
        if mine is not None and known and mine - min(known) > self.settings.max_excess:
            return None
        return replica
