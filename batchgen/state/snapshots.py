"""Prefix caching for state mixers: a sequence's state at a block boundary, kept in a state
slot and keyed with that block's chained hash (which covers every token before it), so a
later prompt with the same prefix starts from the snapshot instead of the first token. The
KV manager drives it; the runner takes the snapshots during the forward (StateOps.snaps)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from batchgen.state.slots import StateSlots


class StateSnapshots:
    """Snapshots by block hash (LRU, at most `capacity`), and the boundaries each prefilling
    sequence should leave one at."""

    def __init__(self, slots: StateSlots, capacity: int) -> None:
        self.slots = slots
        self.capacity = capacity
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()
        self._wanted: dict[Hashable, dict[int, bytes]] = {}  # seq -> {position: hash}

    def __len__(self) -> int:
        return len(self._by_hash)

    @property
    def wanting(self) -> bool:
        """Some sequence has a snapshot to leave."""
        return bool(self._wanted)

    def longest(self, hashes: list[bytes], num_blocks: int) -> tuple[int, int | None]:
        """The most of the first `num_blocks` blocks whose end has a snapshot, and its slot
        (0, None: none)."""
        for k in range(num_blocks, 0, -1):
            slot = self._by_hash.get(hashes[k - 1])
            if slot is not None:
                self._by_hash.move_to_end(hashes[k - 1])
                return k, slot
        return 0, None

    def want(self, seq: Hashable, points: dict[int, bytes]) -> None:
        """`seq` should leave a snapshot at each of these positions (keyed with the hash of
        the block ending there) as its prefill passes them; already kept ones are skipped."""
        points = {p: h for p, h in points.items() if h not in self._by_hash}
        if points:
            self._wanted[seq] = points
        else:
            self._wanted.pop(seq, None)

    def drop(self, seq: Hashable) -> None:
        self._wanted.pop(seq, None)

    def take(self, rows: dict[Hashable, int], starts: np.ndarray, num_new: np.ndarray
             ) -> np.ndarray:
        """The snapshots a step's rows pass: [3, m] (row, tokens into its chunk, slot); each is
        kept from now on (the step that fills it runs before any later admission reads it)."""
        out: list[tuple[int, int, int]] = []
        for seq in [s for s in self._wanted if s in rows]:
            i, points = rows[seq], self._wanted[seq]
            start, end = int(starts[i]), int(starts[i] + num_new[i])
            for pos in sorted(p for p in points if start < p <= end):
                out.append((i, pos - start, self._keep(points.pop(pos))))
            if not points:
                del self._wanted[seq]
        return np.array(out, np.int64).reshape(-1, 3).T.copy()

    def _keep(self, block_hash: bytes) -> int:
        """A slot for the snapshot of `block_hash` (the least recently used one leaves when
        full)."""
        if len(self._by_hash) >= self.capacity:
            _, old = self._by_hash.popitem(last=False)
            self.slots.free(old)
        slot = self.slots.alloc()
        self._by_hash[block_hash] = slot
        return slot

    def clear(self, free: bool = True) -> None:
        """Forget every snapshot (their slots freed unless the allocator is being cleared)."""
        if free:
            for slot in self._by_hash.values():
                self.slots.free(slot)
        self._by_hash.clear()
        self._wanted.clear()
