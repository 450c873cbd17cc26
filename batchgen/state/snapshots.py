"""Prefix caching for state mixers: a sequence's state at a block boundary, kept in a state
slot and keyed with that block's chained hash (which covers every token before it), so a
later prompt with the same prefix starts from the snapshot instead of the first token. The
KV manager drives it; the runner takes the snapshots during the forward (StateOps.snaps).

Bits: a mixer's state after [0, a) then [a, b) rounds differently from one forward over
[0, b). So every prompt's mixer prefill is cut at the same points whatever the cache holds,
the step budget or the other requests: the multiples of one grid (`prefill_grid`); chunks end
on it, snapshots sit on it, and a prompt that starts from a snapshot computes the very
pieces a cold prefill does (outputs bit-identical with the cache on or off). One more cut
per prompt, wherever it falls: its resume point (the last block end an identical prompt can
hit), so repeated prompts resume from there, again on the pieces of their cold run."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

from batchgen.state.slots import StateSlots

GRID_TOKENS = 256  # about how many tokens one piece of a mixer's prefill holds


def prefill_grid(block_size: int, max_num_batched_tokens: int) -> int:
    """Tokens between the points every mixer prefill is cut at: a multiple of the block size
    near GRID_TOKENS, at most half the step budget (a piece fits beside the decodes)."""
    blocks = min(-(-GRID_TOKENS // block_size), max_num_batched_tokens // 2 // block_size)
    return max(1, blocks) * block_size


def grid_cuts(starts: np.ndarray, num_new: np.ndarray, grid: int,
              own: np.ndarray | None = None) -> np.ndarray:
    """The grid points strictly inside each row's chunk, and each row's `own` point (its
    prompt's resume point, 0: none) when inside it: [3, m] (row, tokens into its chunk, -1:
    no snapshot), the cuts StateOps.snaps carries."""
    first = starts // grid + 1  # the first grid index past each row's start
    count = np.maximum((starts + num_new - 1) // grid - first + 1, 0)
    row = np.repeat(np.arange(len(starts)), count)
    k = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    offset = (first[row] + k) * grid - starts[row]
    if own is not None:
        inside = np.flatnonzero((own > starts) & (own < starts + num_new) & (own % grid != 0))
        row = np.concatenate([row, inside])
        offset = np.concatenate([offset, own[inside] - starts[inside]])
    return np.stack([row, offset, np.full(len(row), -1)]).astype(np.int64)


def merge_cuts(snaps: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Snapshots and plain cuts in one [3, m]: a cut where a snapshot already is goes."""
    taken = set(zip(snaps[0].tolist(), snaps[1].tolist()))
    keep = [j for j, rc in enumerate(zip(cuts[0].tolist(), cuts[1].tolist()))
            if rc not in taken]
    return np.concatenate([snaps, cuts[:, keep]], axis=1)


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

    def longest(self, hashes: list[bytes], num_blocks: int,
                ok: Callable[[int], bool] | None = None) -> tuple[int, int | None]:
        """The most of the first `num_blocks` blocks (those `ok` allows) whose end has a
        snapshot, and its slot (0, None: none)."""
        for k in range(num_blocks, 0, -1):
            if ok is not None and not ok(k):
                continue
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
