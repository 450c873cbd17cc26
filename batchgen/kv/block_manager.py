"""The chapter's BlockManager: a free list of physical KV blocks, per-sequence block tables,
reference counts and copy-on-write, plus prefix caching: full blocks carry a content hash
chained on their parent's, and a freed hashed block stays reusable (LRU) until the pool needs
it. It owns no tensors; the KVCache pool holds the bytes."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence


class PoolExhausted(MemoryError):
    """No free physical block is left for a reservation; nothing was changed. The scheduler
    (through the KVManager) catches it and preempts the newest running group (swap or recompute), then tries again."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def slot_of(block_table, token_pos, block_size: int):
    """Flat pool slot of a logical position: table[pos // B] * B + pos % B. Works on ints and,
    elementwise, on numpy arrays (the runner computes a whole step's slot mapping with it)."""
    return block_table[token_pos // block_size] * block_size + token_pos % block_size


def chain_hashes(token_ids: Sequence[int], block_size: int, parent_hashes: list[bytes],
                 num_tokens: int | None = None,
                 extra: Callable[[int, int], bytes] | None = None) -> list[bytes]:
    """Content hashes of the full blocks among the first `num_tokens` tokens, each chained on
    the previous block's hash (equal hashes mean equal prefixes). `parent_hashes` are the known
    hashes of the leading blocks; only the missing ones are computed. `extra(i, block_size)`:
    more of block i's content than its token ids (the images it overlaps)."""
    end = len(token_ids) if num_tokens is None else num_tokens
    hashes = list(parent_hashes)
    for i in range(len(hashes), end // block_size):
        h = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        if extra is not None:
            h.update(extra(i, block_size))
        hashes.append(h.digest())
    return hashes


class ReadOnlyList(Sequence[int]):
    """A list read through indexing and iteration only (`ref_count` as the chapter reads it:
    `mgr.ref_count[blk]`); the manager alone writes it."""

    def __init__(self, owner: object, name: str) -> None:
        self._owner, self._name = owner, name  # the list is rebound by free_all: look it up

    def __getitem__(self, i):  # type: ignore[override]
        return getattr(self._owner, self._name)[i]

    def __len__(self) -> int:
        return len(getattr(self._owner, self._name))


class TablesView(Mapping[Hashable, tuple[int, ...]]):
    """`block_tables` as the chapter reads it (`mgr.block_tables["s"]`): each sequence's table
    as a tuple; tables change only through the BlockManager's methods."""

    def __init__(self, tables: dict[Hashable, list[int]]) -> None:
        self._tables = tables

    def __getitem__(self, seq_id: Hashable) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)


class BlockManager:
    """Paged KV allocator with the chapter's API and names (vLLM's design).

    Block ids are global to the pool and shared by every layer. A sequence's block table maps
    its logical blocks to physical ones; `ref_count[blk]` counts the table entries that point
    at `blk`, so forked sequences share blocks until one of them writes (copy-on-write). The
    tables are this object's own: others read them (`block_tables`, `table()`) and change
    them only through the methods below. Every change that can fail checks first and then
    changes nothing (all or nothing). The free list, the prefix cache's maps and the host
    pool's lists are private; `ref_count` and `block_tables` are read-only views, and the
    statistics (`peak_blocks_in_use`, `cow_copies`, `prefix_hit_tokens`, `blocks_swapped_*`)
    are read-only counters that `reset_stats` starts again.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False, num_host_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError(f"num_blocks and block_size must be >= 1 and num_host_blocks >= 0, "
                             f"got {num_blocks}, {block_size}, {num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._ref_count: list[int] = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self.peak_blocks_in_use = 0
        self.cow_copies = 0
        # Prefix cache: hash -> block, each hashed block's hash, and the hashed blocks that no
        # sequence references any more, oldest first (evicted only when the free list is empty).
        self.enable_prefix_caching = enable_prefix_caching
        self._cached: dict[bytes, int] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.prefix_hit_tokens = 0
        # Host swap pool: its own free list, reference counts and the swapped sequences' tables
        # (host block ids, a separate numbering: never in the prefix cache, never a hit).
        self.num_host_blocks = num_host_blocks
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_ref_count: list[int] = [0] * num_host_blocks
        self._host_tables: dict[Hashable, list[int]] = {}
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0
        self.block_tables = TablesView(self._tables)  # the chapter's name, read only
        self.ref_count = ReadOnlyList(self, "_ref_count")
        self.host_ref_count = ReadOnlyList(self, "_host_ref_count")

    # ---- reading the tables -------------------------------------------------------------------
    def table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block table (this manager's list: read it, never change it)."""
        return self._tables[seq_id]

    def has_table(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def num_tables(self) -> int:
        """Sequences holding a block table."""
        return len(self._tables)

    def tables(self) -> Iterator[tuple[Hashable, list[int]]]:
        """Every (sequence, block table) pair (read only)."""
        return iter(self._tables.items())

    def audit(self) -> list[str]:
        """What is inconsistent in the bookkeeping (empty when all holds): reference counts
        equal table entries (host ones too); free, evictable and referenced blocks partition
        the pool; each cached hash names a block carrying it; only unreferenced hashed blocks
        are evictable, and no free block carries a hash."""
        problems: list[str] = []
        refs = Counter(b for t in self._tables.values() for b in t)
        problems += [f"ref_count of block {b} is {n}, its table entries {refs.get(b, 0)}"
                     for b, n in enumerate(self._ref_count) if n != refs.get(b, 0)]
        free, lru = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if free & set(refs) or lru & set(refs) or free & lru:
            problems.append("a block is free, evictable and referenced at once")
        if len(free) + len(lru) + len(refs) != self.num_blocks:
            problems.append("free, evictable and referenced blocks do not make up the pool")
        hashed = {b for b, h in enumerate(self._block_hash) if h is not None}
        if any(self._block_hash[b] != h for h, b in self._cached.items()) or (
                hashed != set(self._cached.values())):
            problems.append("the prefix cache and the blocks' hashes disagree")
        if not lru <= hashed or free & hashed:
            problems.append("an evictable block has no hash, or a free block has one")
        return problems + self._audit_host()

    def _audit_host(self) -> list[str]:
        """The host pool's part of `audit`."""
        refs = Counter(b for t in self._host_tables.values() for b in t)
        problems = [f"host ref_count of block {b} is {n}, its table entries {refs.get(b, 0)}"
                    for b, n in enumerate(self._host_ref_count) if n != refs.get(b, 0)]
        free = set(self._host_free)
        if len(free) != len(self._host_free) or free & set(refs) or (
                len(free) + len(refs) != self.num_host_blocks):
            problems.append("host free and referenced blocks do not partition the host pool")
        return problems

    # ---- the chapter's API ------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, num_tokens: int, cached_blocks: Sequence[int] = ()
                 ) -> None:
        """Give a new sequence the blocks for `num_tokens` tokens. With prefix caching its table
        starts with `cached_blocks` (a cache hit: shared, reference counted, never rewritten)."""
        if seq_id in self._tables:
            raise KeyError(f"sequence {seq_id!r} already has a block table")
        if not self.can_allocate(num_tokens, cached_blocks):
            raise PoolExhausted(f"KV pool exhausted: {num_tokens} tokens do not fit "
                                f"{self.num_free_blocks()} free blocks")
        for blk in cached_blocks:  # take the hits first: allocating could evict them
            if self._ref_count[blk] == 0:
                del self._evictable[blk]
            self._ref_count[blk] += 1
        self._tables[seq_id] = list(cached_blocks)
        self.prefix_hit_tokens += len(cached_blocks) * self.block_size
        self._grow(self._tables[seq_id], num_tokens)

    def append_token(self, seq_id: Hashable, cur_len: int) -> None:
        """Before writing position `cur_len`: a new block exactly when it opens one."""
        self.append_tokens([seq_id], [cur_len])

    def append_tokens(self, seq_ids: Sequence[Hashable], cur_lens: Sequence[int]) -> list[int]:
        """`append_token` for many sequences at once (a decode step's rows), all or none
        (PoolExhausted takes nothing); returns the blocks appended, in order."""
        bs = self.block_size
        tables = [self._tables[s] for s in seq_ids]
        needs = [cur // bs + 1 - len(t) for t, cur in zip(tables, cur_lens)]
        if sum(n for n in needs if n > 0) > self.num_free_blocks():
            raise PoolExhausted("KV pool exhausted: no block for the next token")
        new: list[int] = []
        for table, n in zip(tables, needs):
            for _ in range(n):
                blk = self._alloc_block()
                table.append(blk)
                new.append(blk)
        self._track_peak()
        return new

    def next_free(self, k: int) -> list[int] | None:
        """The blocks the next `k` allocations hand out, in order, while the free list has
        them (None when they would evict cached blocks). Reads only."""
        return self._free[len(self._free) - k:][::-1] if k <= len(self._free) else None

    def slot_index(self, seq_id: Hashable, token_pos: int) -> int:
        """Flat pool slot (phys_block * block_size + offset) of a logical token position."""
        return slot_of(self._tables[seq_id], token_pos, self.block_size)

    def free_seq(self, seq_id: Hashable) -> None:
        """Drop a sequence's table; blocks whose last reference this was go back to the pool."""
        for blk in self._tables.pop(seq_id):
            self._release(blk)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> int:
        """Give back the table's blocks past those holding its first `num_tokens` tokens
        (rejected speculative positions); returns the blocks left."""
        table = self._tables[seq_id]
        keep = blocks_for(num_tokens, self.block_size)
        while len(table) > keep:
            self._release(table.pop())
        return len(table)

    def _release(self, blk: int) -> None:
        """One reference to `blk` less; at none it is free, or evictable while it is cached
        (its bytes stay valid until it is handed out again)."""
        self._ref_count[blk] -= 1
        if self._ref_count[blk] == 0:
            if self._block_hash[blk] is not None:
                self._evictable[blk] = None  # most recently used last
            else:
                self._free.append(blk)

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int | None = None
             ) -> None:
        """Share the parent's blocks with a new child: table copy, no KV copy. With
        `num_tokens`, only the blocks holding the first `num_tokens` tokens are shared."""
        parent = self._tables[parent_id]
        if num_tokens is not None:
            parent = parent[:blocks_for(num_tokens, self.block_size)]
        if child_id in self._tables:
            raise KeyError(f"sequence {child_id!r} already has a block table")
        self._tables[child_id] = list(parent)
        for blk in parent:
            self._ref_count[blk] += 1

    def adopt(self, seq_id: Hashable, parent_id: Hashable) -> int:
        """`seq_id` drops its table and shares all of the parent's blocks instead (`free_seq`
        then `fork`, in one); see `adopt_many`."""
        return self.adopt_many([(seq_id, parent_id)])[0]

    def adopt_many(self, pairs: Sequence[tuple[Hashable, Hashable]]) -> list[int]:
        """`adopt` for each pair in order (a beam step's adoptions, in one loop): only the
        blocks past a pair's common prefix change references, the dropped ones in table order
        (the order `free_seq` gives them back). Returns each pair's number of leading blocks
        shared already (their tokens there are the same)."""
        ref, tables, release = self._ref_count, self._tables, self._release
        out = []
        for seq_id, parent_id in pairs:
            old, new = tables[seq_id], tables[parent_id]
            same = min(len(old), len(new))
            while same and old[same - 1] != new[same - 1]:  # a shared block's prefix is shared
                same -= 1
            for blk in new[same:]:
                ref[blk] += 1
            for blk in old[same:]:
                release(blk)
            tables[seq_id] = new.copy()
            out.append(same)
        return out

    def write_heads(self, seq_ids: Sequence[Hashable], positions: Sequence[int]
                    ) -> tuple[int, list[int], list[int], list[tuple[int, int]]]:
        """Make each sequence's position writable (a decode token), in order, until the pool
        runs out: copy-on-write the block holding it where others share it (`cow_append`),
        or open the next block where it starts one (`append_token`). Returns how many were
        made writable (the rest untouched), the indices that got a block, their blocks, and
        the (src, dst) copies."""
        bs, ref, tables, alloc = self.block_size, self._ref_count, self._tables, self._alloc_block
        at, blocks, copies = [], [], []
        done = len(seq_ids)
        for i, (seq_id, pos) in enumerate(zip(seq_ids, positions)):
            table, k = tables[seq_id], pos // bs
            if (ref[table[k]] == 1) if pos % bs else (len(table) > k):
                continue  # its own block already
            if not (self._free or self._evictable):
                done = i
                break
            blk = alloc()
            if pos % bs:
                copies.append((table[k], blk))
                ref[table[k]] -= 1
                table[k] = blk
            else:
                table.append(blk)
            at.append(i)
            blocks.append(blk)
        self.cow_copies += len(copies)
        self._track_peak()
        return done, at, blocks, copies

    def cow_append(self, seq_id: Hashable, logical_block_idx: int) -> tuple[int, int]:
        """Make `seq_id` own the block before writing; returns (src, dst), equal if no copy."""
        table = self._tables[seq_id]
        phys = table[logical_block_idx]
        if self._ref_count[phys] == 1:
            return phys, phys
        new_phys = self._alloc_block()
        self._ref_count[phys] -= 1
        table[logical_block_idx] = new_phys
        self.cow_copies += 1
        self._track_peak()
        return phys, new_phys

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, num_tokens: int, cached_blocks: Sequence[int] = (),
                     headroom: int = 0) -> bool:
        """True iff a new sequence of `num_tokens` tokens (starting with these cached blocks)
        fits in the free blocks now, with `headroom` blocks to spare. Taking an unreferenced
        cached block uses free room too."""
        new = max(0, blocks_for(num_tokens, self.block_size) - len(cached_blocks))
        return new + self.num_evictable(cached_blocks) + headroom <= self.num_free_blocks()

    # ---- a step's reservation (the KVManager's call for the scheduler) ---------------------------
    def reserve(self, appends: Sequence[tuple[Hashable, int, int]]) -> list[tuple[int, int]]:
        """Make positions [cur_len, cur_len + num_new) of each (seq_id, cur_len, num_new)
        writable, in order: copy-on-write the block holding cur_len where it is shared, then
        grow the table. Returns the (src, dst) block copies the KV must get before the step
        writes. All or nothing: PoolExhausted (nothing changed) when the blocks are not there."""
        if len(appends) == 1 and self._writable(*appends[0]):
            return []  # the decode fast path: an owned block with room
        need = self.blocks_needed(appends)
        if need > self.num_free_blocks():
            raise PoolExhausted(f"KV pool exhausted: {need} blocks needed, "
                                f"{self.num_free_blocks()} free")
        copies = []
        for seq_id, cur_len, num_new in appends:
            table = self._tables[seq_id]
            if self._shared_at(table, cur_len):
                copies.append(self.cow_append(seq_id, cur_len // self.block_size))
            self._grow(table, cur_len + num_new)
        return copies

    def blocks_needed(self, appends: Sequence[tuple[Hashable, int, int]]) -> int:
        """New blocks that `reserve(appends)` takes: the growth, plus a copy for each writer of
        a shared block, except that the last writer of a block whose references are all among
        them writes in place (two beams sharing a partial block need one copy, not two)."""
        grow = 0
        writers: dict[int, int] = {}
        for seq_id, cur_len, num_new in appends:
            table = self._tables.get(seq_id, ())
            grow += max(0, blocks_for(cur_len + num_new, self.block_size) - len(table))
            if self._shared_at(table, cur_len):
                blk = table[cur_len // self.block_size]
                writers[blk] = writers.get(blk, 0) + 1
        return grow + sum(k - (k == self._ref_count[b]) for b, k in writers.items())

    def num_blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks()

    def free_all(self) -> None:
        """Drop every block table (an aborted call) and rebuild the free list, the LRU and the
        reference counts from the prefix cache alone: whatever step an interrupt cut short,
        the pool comes back whole and the cache consistent."""
        self._tables.clear()
        self._host_tables.clear()
        self._host_free = list(range(self.num_host_blocks - 1, -1, -1))
        self._host_ref_count = [0] * self.num_host_blocks
        self._cached = {h: b for h, b in self._cached.items() if self._block_hash[b] == h}
        hashed = set(self._cached.values())
        self._block_hash = [h if b in hashed else None for b, h in enumerate(self._block_hash)]
        lru = [b for b in self._evictable if b in hashed]
        lru += sorted(hashed.difference(lru))  # referenced until now: the most recently used
        self._evictable = OrderedDict.fromkeys(lru)
        self._ref_count = [0] * self.num_blocks
        self._free = [b for b in range(self.num_blocks - 1, -1, -1) if b not in hashed]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (their blocks go back to the free list); refused while a
        sequence holds blocks, since its published blocks would lose their hashes under it."""
        if self._tables or self._host_tables:
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    def reset_stats(self) -> None:
        """Start a new measurement window for peak usage, COW copies and prefix hits."""
        self.peak_blocks_in_use = self.num_blocks_in_use()
        self.cow_copies = 0
        self.prefix_hit_tokens = 0
        self.blocks_swapped_out = self.blocks_swapped_in = 0

    def _grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks until the table holds `num_tokens` tokens (room already checked)."""
        for _ in range(blocks_for(num_tokens, self.block_size) - len(table)):
            table.append(self._alloc_block())
        self._track_peak()

    def _writable(self, seq_id: Hashable, cur_len: int, num_new: int) -> bool:
        """Do positions [cur_len, cur_len + num_new) already have blocks this sequence owns
        alone (nothing to reserve)? O(1)."""
        table = self._tables[seq_id]
        return (blocks_for(cur_len + num_new, self.block_size) <= len(table)
                and self._ref_count[table[cur_len // self.block_size]] == 1)

    def _alloc_block(self) -> int:
        if self._free:
            blk = self._free.pop()
        elif self._evictable:  # the least recently used cached block gives up its content
            blk, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_hash[blk]]
            self._block_hash[blk] = None
        else:
            raise PoolExhausted("KV pool exhausted: no free block")
        self._ref_count[blk] = 1
        return blk

    def _shared_at(self, table: Sequence[int], pos: int) -> bool:
        """Would writing position `pos` hit an existing block that others reference too?"""
        i = pos // self.block_size
        return pos % self.block_size != 0 and i < len(table) and self._ref_count[table[i]] > 1

    def _track_peak(self) -> None:
        in_use = self.num_blocks_in_use()
        if in_use > self.peak_blocks_in_use:
            self.peak_blocks_in_use = in_use

    # ---- prefix caching -----------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Cached blocks holding the longest prefix of these chained block hashes."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for h in hashes:
            blk = self._cached.get(h)
            if blk is None:
                break
            hit.append(blk)
        return hit

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of these cached blocks sit unreferenced (taking them uses free room)."""
        return sum(self._ref_count[b] == 0 for b in blocks)

    def register(self, seq_id: Hashable, hashes: list[bytes]) -> None:
        """Publish the hashes of a sequence's computed full blocks (hashes[i] ↔ table[i])."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        for blk, h in zip(table, hashes):
            if self._block_hash[blk] is None and h not in self._cached:
                self._cached[h] = blk
                self._block_hash[blk] = h

    # ---- swapping to the host pool ------------------------------------------------------------
    def is_swapped(self, seq_id: Hashable) -> bool:
        """Does the sequence's table map to host blocks (its group is swapped out)?"""
        return seq_id in self._host_tables

    def host_table(self, seq_id: Hashable) -> list[int]:
        """A swapped sequence's table of host blocks (read only)."""
        return self._host_tables[seq_id]

    def host_tables(self) -> list[tuple[Hashable, list[int]]]:
        """Every (swapped sequence, host block table) pair (read only)."""
        return list(self._host_tables.items())

    def host_blocks_in_use(self) -> int:
        return self.num_host_blocks - len(self._host_free)

    def can_swap_out(self, seq_ids: Sequence[Hashable]) -> bool:
        """Does the host pool have a block for each distinct block of these tables?"""
        distinct = {b for s in seq_ids for b in self._tables[s]}
        return len(distinct) <= len(self._host_free)

    def can_swap_in(self, seq_ids: Sequence[Hashable], headroom: int = 0) -> bool:
        """Do the free device blocks hold these swapped tables, with `headroom` to spare?"""
        distinct = {b for s in seq_ids for b in self._host_tables[s]}
        return len(distinct) + headroom <= self.num_free_blocks()

    def swap_out(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Move these sequences' tables to the host pool: each distinct device block gets one
        host block whose reference count is its references among them (a block shared by k
        of them moves once), and loses those device references. A cached block whose last
        reference this was stays in the prefix cache as evictable: its device bytes are valid
        until it is handed out again. Returns the (device, host) copies, to make before any
        write of this step. All or nothing (PoolExhausted when the host pool is short)."""
        if not self.can_swap_out(seq_ids):
            raise PoolExhausted("host swap pool exhausted")
        moved: dict[int, int] = {}
        for seq_id in seq_ids:
            table = self._tables.pop(seq_id)
            for blk in table:
                if blk not in moved:
                    moved[blk] = self._host_free.pop()
                self._host_ref_count[moved[blk]] += 1
                self._release(blk)
            self._host_tables[seq_id] = [moved[b] for b in table]
        self.blocks_swapped_out += len(moved)
        return list(moved.items())

    def swap_in(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Bring swapped tables back: each distinct host block gets one device block with its
        reference count, and goes back to the host free list. Returns the (host, device)
        copies. All or nothing (PoolExhausted when the device pool is short)."""
        if not self.can_swap_in(seq_ids):
            raise PoolExhausted("KV pool exhausted: no room to swap in")
        moved: dict[int, int] = {}
        for seq_id in seq_ids:
            table = self._host_tables.pop(seq_id)
            for hblk in table:
                if hblk not in moved:
                    moved[hblk] = self._alloc_block()
                else:
                    self._ref_count[moved[hblk]] += 1
                self._host_ref_count[hblk] -= 1
                if self._host_ref_count[hblk] == 0:
                    self._host_free.append(hblk)
            self._tables[seq_id] = [moved[b] for b in table]
        self.blocks_swapped_in += len(moved)
        self._track_peak()
        return list(moved.items())
