"""StateSlots: which state-pool slot each sequence holds, and the state copies owed before
the next forward. Host-only bookkeeping, driven by the KV manager (the one owner of where a
sequence's memory lives); the runner's StatePool holds the tensors."""

from __future__ import annotations

import numpy as np


class StateSlots:
    """A free list of slots and the pending (src, dst) copies of forks, composed so that one
    simultaneous gather before the forward gives every destination its source's state as it
    was when the fork happened."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0
        self._pending: dict[int, int] = {}  # dst -> src (src never a pending dst)
        self.in_use = 0
        self.peak = 0

    def alloc(self) -> int:
        """A free slot (its content is stale: a sequence's first forward overwrites it)."""
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._next = self._next, self._next + 1
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        return slot

    def free(self, slot: int) -> None:
        self._pending.pop(slot, None)
        self._free.append(slot)
        self.in_use -= 1

    def fork(self, src: int) -> int:
        """A new slot that takes `src`'s state (as of now) before the next forward."""
        dst = self.alloc()
        self._pending[dst] = self._pending.get(src, src)
        return dst

    def take_copies(self) -> np.ndarray:
        """The owed copies as [2, n] int64 (sources, destinations); the list is emptied."""
        pairs = np.array([list(self._pending.values()), list(self._pending)], np.int64
                         ).reshape(2, -1)
        self._pending.clear()
        return pairs

    @property
    def capacity(self) -> int:
        """Slots ever handed out (the pool must hold them)."""
        return self._next

    def clear(self) -> None:
        self._free.clear()
        self._next = 0
        self._pending.clear()
        self.in_use = 0
