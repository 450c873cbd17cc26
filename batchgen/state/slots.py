"""StateSlots: which state-pool slot each sequence holds, and the state copies owed before
the next forward. Host-only bookkeeping, driven by the KV manager (the one owner of where a
sequence's memory lives); the runner's StatePool holds the tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def _pairs() -> np.ndarray:
    return np.zeros((2, 0), np.int64)


@dataclass(frozen=True)
class StateOps:
    """The state moves owed before a step's forward, in this order: `saves` (slot, key): a
    swapped-out sequence's state to host memory under `key`; `copies` (src, dst): forks, as
    one simultaneous gather; `restores` (key, slot): a swapped-in sequence's state back."""

    copies: np.ndarray = field(default_factory=_pairs)
    saves: np.ndarray = field(default_factory=_pairs)
    restores: np.ndarray = field(default_factory=_pairs)
    # prefix caching: [3, m] (row, tokens into its chunk, slot): after that many of the row's
    # tokens, its state is copied to the slot (a snapshot at a block boundary)
    snaps: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.int64))

    @property
    def empty(self) -> bool:
        return not (self.copies.shape[1] or self.saves.shape[1] or self.restores.shape[1])


class StateSlots:
    """A free list of slots and the pending (src, dst) copies of forks, composed so that one
    simultaneous gather before the forward gives every destination its source's state as it
    was when the fork happened."""

    def __init__(self, bytes_per_seq: int = 0) -> None:
        self.bytes_per_seq = bytes_per_seq  # the pool's, for the figures
        self._free: list[int] = []
        self._next = 0
        self._pending: dict[int, int] = {}  # dst -> src (src never a pending dst)
        self._saves: list[tuple[int, int]] = []  # (slot, key)
        self._restores: list[tuple[int, int]] = []  # (key, slot)
        self._keys = 0
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

    def save(self, slot: int) -> int:
        """A swapped-out sequence's state leaves for host memory (read before any copy: a slot
        still owed a fork's copy is saved from that copy's source); its slot is free.
        Returns the key that restores it."""
        self._keys += 1
        self._saves.append((self._pending.pop(slot, slot), self._keys))
        self._free.append(slot)
        self.in_use -= 1
        return self._keys

    def restore(self, key: int) -> int:
        """A slot for a swapped-in sequence, its saved state written back after the copies."""
        slot = self.alloc()
        self._restores.append((key, slot))
        return slot

    def take_ops(self, snaps: np.ndarray | None = None) -> StateOps:
        """The owed moves (emptied here), with the step's snapshots."""
        ops = StateOps(_array(list(zip(self._pending.values(), self._pending))),
                       _array(self._saves), _array(self._restores),
                       np.zeros((3, 0), np.int64) if snaps is None else snaps)
        self._pending.clear()
        self._saves.clear()
        self._restores.clear()
        return ops

    def reset_peak(self) -> None:
        """A new measurement window: the peak restarts from the slots held now."""
        self.peak = self.in_use

    @property
    def capacity(self) -> int:
        """Slots ever handed out (the pool must hold them)."""
        return self._next

    def clear(self) -> None:
        self._free.clear()
        self._next = 0
        self._pending.clear()
        self._saves.clear()
        self._restores.clear()
        self.in_use = 0


def _array(pairs: list[tuple[int, int]]) -> np.ndarray:
    """Pairs as [2, n] int64."""
    return np.array(pairs, np.int64).reshape(-1, 2).T.copy()
