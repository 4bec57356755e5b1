"""The recurrent-state pool of a hybrid model (Gated DeltaNet layers): one slot per sequence, beside the KV page
pool. A slot holds the sequence's state in every DeltaNet layer (the conv's window and the delta rule's matrices,
f32, a fixed size whatever the sequence's length); the pool's memory belongs to the backend, which the kernels
write in place. Slot 0 is never written: a new sequence's slot starts as a copy of it (the empty state), a fork's
as a copy of its parent's."""
from __future__ import annotations

from .kv_cache import PoolExhaustedError


class StatePoolExhaustedError(PoolExhaustedError):
    """Every slot of the recurrent-state pool is held: a hybrid model runs at most as many sequences at once as it
    was loaded with (pool_sequences); closing a session makes room."""


class StatePool:
    def __init__(self, backend, slots: int, layers: int, width: int):
        self.backend = backend
        self.slots = slots
        self.slot_bytes = layers * width * 4
        backend.allocate_states((slots + 1, layers, width))
        self.free = list(range(slots, 0, -1))

    @property
    def used_count(self) -> int:
        return self.slots - len(self.free)

    def allocate(self, like: int = 0) -> int:
        """A slot holding a copy of slot `like` (0: the empty state)."""
        if not self.free:
            raise StatePoolExhaustedError(f"All {self.slots} recurrent-state slots of this hybrid model are held; "
                                          f"release a session first (or load it with a larger pool_sequences).")
        slot = self.free.pop()
        self.backend.copy_state(like, slot)
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)
