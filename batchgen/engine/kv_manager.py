"""KVManager: where every sequence's K/V lives, and the one writer of that state.

It sits over the chapter's BlockManager (free list, block tables, reference counts, COW, the
prefix cache's hash table, the host pool's tables), the prefix-hash memo of each sequence
(chained hashes of its full blocks, and how many of them are published) and the persistent
batch's membership: every sequence holding a device block table holds a batch slot, whose
table row, `num_computed`, `cow_check` and `fork_pending` columns it alone writes. A
sequence's `status` says where its K/V is, so it is written here too.

Callers decide, this executes: the Scheduler admits, reserves (PoolExhausted: it picks a
victim and evicts or swaps it out) and swaps in; the OutputProcessor advances a step's rows,
forks and finishes sequences. `num_computed(seq)` is the one place to read a sequence's
progress: its batch column while it holds a slot, the count kept here while it is swapped
out, else 0.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter

import numpy as np

from batchgen.engine.batch import PersistentBatch
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus, slots_of
from batchgen.kv.block_manager import BlockManager, PoolExhausted, blocks_for, chain_hashes
from batchgen.state.slots import StateOps, StateSlots
from batchgen.state.snapshots import StateSnapshots, grid_cuts, merge_cuts

_SEQS = attrgetter("seqs")


def request_peak_blocks(num_prompt_tokens: int, width: int, max_tokens: int,
                        block_size: int) -> int:
    """The most blocks one request can hold at once, running alone: the prompt's full blocks
    are shared; each of its `width` sequences (samples or beams) owns the rest of its blocks,
    the partial prompt block included (copied on first write), up to the K/V of its last
    computed token (token max_tokens - 1: the last token is sampled, never computed). With one
    token to generate nothing is written after the prompt."""
    if max_tokens == 1:
        return blocks_for(num_prompt_tokens, block_size)
    shared = num_prompt_tokens // block_size
    own = blocks_for(num_prompt_tokens + max_tokens - 1, block_size) - shared
    return shared + width * own


class KVManager:
    """Block tables, their batch rows and prefix-cache memos of the running sequences."""

    def __init__(self, block_manager: BlockManager, batch: PersistentBatch,
                 state: StateSlots | None = None, grid: int = 0) -> None:
        self.block_manager = block_manager
        self.batch = batch
        self.state = state  # models with state mixers: each sequence's state slot
        self._state_of: dict[Sequence, int] = {}
        self._state_saved: dict[Sequence, int] = {}  # swapped out: the key of its saved state
        # prefix caching with state: snapshots at block ends (as many as the batch's slots,
        # and at least 8: a prompt leaves up to four)
        self.snapshots = (StateSnapshots(state, max(batch.capacity, 8)) if state is not None
                          and block_manager.enable_prefix_caching else None)
        self._kv_hits: dict[Sequence, int] = {}  # blocks the KV cache had at the last lookup
        self.block_size = block_manager.block_size
        # state mixers: prompts' prefills are cut (chunks end, snapshots sit) on multiples of
        # `grid` tokens, so their bits never depend on the cache or the step (0: no grid)
        self.grid = grid
        self._swapped: dict[Sequence, int] = {}  # swapped out: tokens computed
        self._hashes: dict[Sequence, list[bytes]] = {}  # the prefix-hash memo (runs ahead)
        self._published: dict[Sequence, int] = {}  # full blocks published to the cache

    # ---- reading ------------------------------------------------------------------------------
    def num_computed(self, seq: Sequence) -> int:
        """Tokens of `seq` whose K/V is in a pool (0 without a table)."""
        if seq.slot >= 0:
            return self.batch.ints.item(seq.slot, 0)
        return self._swapped.get(seq, 0)

    def table(self, seq: Sequence) -> list[int]:
        """The device blocks of a running sequence (a copy; empty without a table)."""
        bm = self.block_manager
        return list(bm.table(seq)) if bm.has_table(seq) else []

    def decoding_units(self, groups: list[SequenceGroup]) -> tuple[list[Sequence], np.ndarray]:
        """The sequences of every group whose running sequences all have exactly one token to
        compute (a beam group's decode unit), in the groups' order, and their slots; by vector
        ops over their slots (the groups waiting for a fork have none)."""
        groups = [g for g in groups if g.seqs and not g.fork_pending]
        seqs = [s for g in groups for s in g.seqs]
        slots = slots_of(seqs, len(seqs))
        c, at = self.batch.cols, np.maximum(slots, 0)
        ready = (slots >= 0) & (c["num_tokens"][at] - c["num_computed"][at] == 1)
        sizes = np.fromiter(map(len, map(_SEQS, groups)), np.int64, len(groups))
        whole = np.logical_and.reduceat(ready, np.cumsum(sizes) - sizes) if seqs else ready
        if whole.all():  # the usual step: every beam decodes
            return seqs, slots
        keep = np.repeat(whole, sizes)
        return [s for s, ok in zip(seqs, keep.tolist()) if ok], slots[keep]

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    # ---- admission ----------------------------------------------------------------------------
    def prefix_hit(self, leader: Sequence, limit: int) -> tuple[list[bytes], list[int]]:
        """Hashes of the leader's full blocks within its first `limit` tokens, and the cached
        blocks of their longest prefix. At least two tokens are left to compute (one would run
        as a decode row, whose bits differ from a prefill tile's), or the one a one-token
        prompt has; with prompt logprobs (or named prompt ids), every position from
        `prompt_logprobs_start - 1` on is computed (and only the blocks before it are hashed:
        admission waits for no block the hit cannot use); none with vLLM's
        skip_reading_prefix_cache=True."""
        bm, bs, group = self.block_manager, self.block_size, leader.group
        if not bm.enable_prefix_caching or group.params.skip_reading_prefix_cache:
            return [], []
        hashes = self._hashes_of(leader, limit)[:limit // bs]
        usable = max(limit - 2, 0)
        if group.scores_prompt:  # the logprob of token s needs token s-1
            usable = min(usable, max(group.params.prompt_logprobs_start - 1, 0))
            hashes = hashes[:usable // bs]
        hit = bm.lookup(hashes[:usable // bs])
        if self.snapshots is not None:  # state mixers: only as far as a state snapshot
            self._kv_hits[leader] = len(hit)  # on the grid, or the prompt's own resume point
            own, g = self._resume_point(group) // bs, max(self.grid // bs, 1)
            hit = hit[:self.snapshots.longest(hashes, len(hit),
                                              lambda k: k % g == 0 or k == own)[0]]
        return hashes, hit

    def inflight_hashes(self) -> set[bytes]:
        """Hashes of full blocks that admitted sequences have yet to compute."""
        if not self.block_manager.enable_prefix_caching:
            return set()
        pending: set[bytes] = set()
        c, n = self.batch.cols, self.batch.num_seqs
        for i in np.flatnonzero(c["num_tokens"][:n] - c["num_computed"][:n] > 1).tolist():
            seq = self.batch.seqs[i]
            done = int(c["num_computed"][i]) // self.block_size
            pending.update(self._hashes_of(seq, len(seq.token_ids))[done:])
        return pending

    def can_admit(self, num_tokens: int, hit: list[int], headroom: int) -> bool:
        return self.block_manager.can_allocate(num_tokens, hit, headroom)

    def admit(self, group: SequenceGroup, num_tokens: int, hit: list[int]) -> None:
        """The group's leader starts: a table for `num_tokens` tokens from its prefix-cache
        `hit`, a batch slot with those tokens computed. Its other unfinished sequences wait
        for its prompt's K/V (`fork_pending`)."""
        leader = group.leader
        self.block_manager.allocate(leader, num_tokens, hit)
        group.fork_pending = len(group.unfinished()) > 1
        leader.status = SequenceStatus.RUNNING
        self._published[leader] = len(hit)
        self.batch.enter(leader, self.block_manager.table(leader), len(hit) * self.block_size)
        if self.state is not None:
            self._set_state(leader, self._leader_state(leader, len(hit)))

    # ---- reservation --------------------------------------------------------------------------
    def reserve(self, seqs: list[Sequence], counts: list[int]) -> list[tuple[int, int]]:
        """Make each sequence's next `counts[i]` positions writable (all or none: PoolExhausted
        changes nothing); returns the COW copies to make first."""
        bm, b, bs = self.block_manager, self.batch, self.block_size
        starts = [self.num_computed(s) for s in seqs]
        copies = bm.reserve(list(zip(seqs, starts, counts)))
        cow = b.cols["cow_check"]
        for seq, start in zip(seqs, starts):
            b.write_table(seq, bm.table(seq), start // bs)
            cow[seq.slot] = False
        return copies

    def blocks_needed(self, seqs: list[Sequence], counts: list[int]) -> int:
        """New blocks `reserve(seqs, counts)` would take."""
        return self.block_manager.blocks_needed(
            [(s, self.num_computed(s), n) for s, n in zip(seqs, counts)])

    def grow_decodes(self, slots: np.ndarray, copies: list[tuple[int, int]]) -> None:
        """A block for each of these decoding slots' next token: a copy where a fork left it
        sharing one (appended to `copies`), a new one where it opens a block (the chapter's
        append_token for all of them at once; their table rows written at once).
        PoolExhausted leaves what was reserved, and the copies made, in place."""
        bm, b, c, bs = self.block_manager, self.batch, self.batch.cols, self.block_size
        cow = c["cow_check"][slots]
        checked = slots[cow]
        pos = c["num_computed"][checked]
        done, at, blocks, made = bm.write_heads([b.seqs[s] for s in checked.tolist()],
                                                pos.tolist())
        copies += made
        if at:
            rows, k = checked[at], pos[at] // bs
            b.block_table[rows, k] = blocks
            opened = pos[at] % bs == 0
            c["num_blocks"][rows[opened]] = k[opened] + 1
        c["cow_check"][checked[:done]] = False
        if done < len(checked):
            raise PoolExhausted("KV pool exhausted: no block for the next token")
        opening = slots[~cow]  # each opens exactly one block: its table's next
        if len(opening):
            blocks = bm.append_tokens([b.seqs[i] for i in opening.tolist()],
                                      c["num_computed"][opening].tolist())
            at = c["num_blocks"][opening]
            b.block_table[opening, at] = blocks
            c["num_blocks"][opening] = at + 1

    def stage_decodes(self, opening: np.ndarray) -> np.ndarray | None:
        """The blocks `grow_decodes(opening)` will give these slots (each opens one) if
        nothing is freed or taken before, written into their table rows past `num_blocks`
        (read by nobody but a step launched before the reservation, which addresses them);
        None when they would evict cached blocks. Reserves nothing."""
        if not len(opening):
            return np.zeros(0, np.int64)
        blocks = self.block_manager.next_free(len(opening))
        if blocks is None:
            return None
        staged = np.array(blocks, np.int64)
        self.batch.block_table[opening, self.batch.cols["num_blocks"][opening]] = staged
        return staged

    # ---- after the forward --------------------------------------------------------------------
    def computed(self, seqs: tuple[Sequence, ...], slots: np.ndarray, starts: np.ndarray,
                 num_new: np.ndarray) -> None:
        """A step's forward wrote these rows' K/V: advance their computed tokens (one vector
        op) and publish the full blocks they completed to the prefix cache."""
        self.batch.cols["num_computed"][self.batch.rows(slots)] += num_new
        if self.block_manager.enable_prefix_caching:  # only rows that completed a block
            ends, bs = starts + num_new, self.block_size
            for j in np.flatnonzero(ends // bs > starts // bs).tolist():
                self._publish(seqs[j])

    def truncate(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's computed tokens (positions a speculative step
        reserved and wrote for drafts it rejected): its table ends where a decode's does."""
        left = self.block_manager.truncate(seq, self.num_computed(seq))
        self.batch.cols["num_blocks"][seq.slot] = left

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """`child` shares the blocks holding the parent's first `num_tokens` tokens (and their
        hashes) and takes a slot; both may now write into a shared block (cow_check)."""
        self.block_manager.fork(parent, child, num_tokens)
        shared = num_tokens // self.block_size
        self._hashes[child] = self._hashes.get(parent, [])[:shared]
        self._published[child] = min(self._published.get(parent, 0), shared)
        child.status = SequenceStatus.RUNNING
        self.batch.enter(child, self.block_manager.table(child), num_tokens)
        if self.state is not None:  # state is overwritten each step: a copy, not a share
            self._set_state(child, self.state.fork(self._state_of[parent]))
        cow = self.batch.cols["cow_check"]
        cow[parent.slot] = cow[child.slot] = True

    def adopt(self, pairs: list[tuple[Sequence, Sequence]]) -> list[int]:
        """Each `(seq, parent)`: running beam `seq` gives up its blocks and continues
        `parent` (the blocks of all its computed tokens shared, their hashes too): what a
        fork to a new child and freeing `seq` would do, without a slot changing hands. The
        block tables change here, pair by pair; the batch rows follow in `adopt_rows`.
        Returns, per pair, the leading tokens the two shared already (in shared blocks)."""
        bm, bs = self.block_manager, self.block_size
        same = [n * bs for n in bm.adopt_many(pairs)]
        if bm.enable_prefix_caching:  # the hash memo follows the blocks
            for seq, parent in pairs:
                shared = len(parent.token_ids) // bs  # all computed: the fork's count
                self._hashes[seq] = self._hashes.get(parent, [])[:shared]
                self._published[seq] = min(self._published.get(parent, 0), shared)
        if self.state is not None:  # the parent's state, copied (as a fork, then a free)
            for seq, parent in pairs:
                slot = self.state.fork(self._state_of[parent])
                self.state.free(self._state_of[seq])
                self._state_of[seq] = slot
        return same

    def adopt_rows(self, pairs: list[tuple[Sequence, Sequence]]) -> None:
        """The batch rows of adopted beams (`adopt`) become their parents', in one copy;
        both may now write into a shared block (cow_check)."""
        dst = slots_of(map(itemgetter(0), pairs), len(pairs))
        src = slots_of(map(itemgetter(1), pairs), len(pairs))
        self.batch.copy_rows(dst, src)
        if self.state is not None:  # each keeps its own state slot (`adopt` copied the state)
            self.batch.cols["state_slot"][dst] = [self._state_of[s] for s, _ in pairs]
        cow = self.batch.cols["cow_check"]
        cow[dst] = cow[src] = True

    def fork_siblings(self, group: SequenceGroup) -> None:
        """The leader has the prompt's K/V: every waiting sibling shares its prompt blocks and
        computes only its own tokens from here."""
        leader = group.leader
        group.fork_pending = False
        self.batch.cols["fork_pending"][leader.slot] = False
        for seq in group.seqs:
            if seq is not leader and not seq.finished:
                self.fork(leader, seq, group.num_prompt_tokens)

    # ---- leaving ------------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """The sequence ends: its slot and blocks go back now (the next step can reuse them)
        and its memo is dropped."""
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        self._hashes.pop(seq, None)
        self._published.pop(seq, None)

    def evict(self, group: SequenceGroup) -> set[int]:
        """Preemption by recompute: every sequence of the group gives its slot and blocks
        back and will recompute its tokens (the hash memo stays: the tokens are unchanged).
        Returns the blocks freed."""
        freed: set[int] = set()
        for seq in group.seqs:
            freed.update(self._release(seq))
            self._published[seq] = 0
            if not seq.finished:
                seq.status = SequenceStatus.WAITING
        return freed

    def _release(self, seq: Sequence) -> list[int]:
        """Free the sequence's slot and block table if it has them; returns its blocks."""
        if seq.slot >= 0:
            self.batch.remove(seq)
        if self.state is not None and seq in self._state_of:
            self.state.free(self._state_of.pop(seq))
        self._state_saved.pop(seq, None)
        if self.snapshots is not None:
            self.snapshots.drop(seq)
        bm = self.block_manager
        if not bm.has_table(seq):
            return []
        table = bm.table(seq)
        bm.free_seq(seq)
        return table

    def abort_all(self) -> None:
        """Every table dropped and the batch emptied (an aborted call): the pool comes back
        whole, the prefix cache consistent."""
        self.batch.clear()
        self.block_manager.free_all()
        self._swapped.clear()
        self._hashes.clear()
        self._published.clear()
        if self.snapshots is not None:
            self.snapshots.clear(free=False)
            self._kv_hits.clear()
        if self.state is not None:
            self.state.clear()
            self._state_of.clear()
            self._state_saved.clear()

    # ---- swapping -----------------------------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self.block_manager.can_swap_out(seqs)

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """The sequences leave the batch keeping their computed tokens; their tables move to
        the host pool (shared blocks once). Returns the (device, host) copies."""
        for seq in seqs:
            self._swapped[seq] = self.num_computed(seq)
            self.batch.remove(seq)
            seq.status = SequenceStatus.SWAPPED
            if self.state is not None:  # its state goes to host memory with its blocks
                self._state_saved[seq] = self.state.save(self._state_of.pop(seq))
        return self.block_manager.swap_out(seqs)

    def swapped_seqs(self, group: SequenceGroup) -> list[Sequence]:
        """The group's sequences whose tables are in the host pool."""
        return [s for s in group.seqs if self.block_manager.is_swapped(s)]

    def can_swap_in(self, seqs: list[Sequence], headroom: int) -> bool:
        return self.block_manager.can_swap_in(seqs, headroom)

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Swapped tables come back to device blocks and the sequences to the batch, each
        with cow_check set (its blocks may be shared). Returns the (host, device) copies."""
        pairs = self.block_manager.swap_in(seqs)
        cow = self.batch.cols["cow_check"]
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
            self.batch.enter(seq, self.block_manager.table(seq), self._swapped.pop(seq))
            if self.state is not None:  # its state comes back from host memory
                self._set_state(seq, self.state.restore(self._state_saved.pop(seq)))
            cow[seq.slot] = True
        return pairs

    # ---- mixer state ----------------------------------------------------------------------------
    def _leader_state(self, leader: Sequence, hit_blocks: int) -> int:
        """The admitted leader's state slot: a copy of the snapshot its prefix hit ends on,
        else a fresh one; and (prefix caching) the block ends its prefill should snapshot: on
        the grid, at or before the prompt's last full block and the end of the prefix the KV
        cache held without a snapshot (so the next prompt sharing it hits); and the prompt's
        resume point (the last block an identical prompt can hit). None past the resume point:
        the state there has passed its cut, which other prompts' cold runs do not make."""
        assert self.state is not None
        snaps, bs = self.snapshots, self.block_size
        if snaps is None:
            return self.state.alloc()
        n = leader.group.num_prompt_tokens
        hashes = self._hashes_of(leader, n)
        own, g = self._resume_point(leader.group) // bs, max(self.grid // bs, 1)
        ends = {k // g * g for k in (n // bs, self._kv_hits.pop(leader, 0))}
        ends = {k for k in ends if k <= own} | {own}
        snaps.want(leader, {k * bs: hashes[k - 1] for k in ends if hit_blocks < k})
        if not hit_blocks:
            return self.state.alloc()
        k, slot = snaps.longest(hashes, hit_blocks)
        assert k == hit_blocks and slot is not None
        return self.state.fork(slot)

    def _set_state(self, seq: Sequence, slot: int) -> None:
        """The sequence holds state slot `slot` (its batch column says so to the runner)."""
        self._state_of[seq] = slot
        self.batch.cols["state_slot"][seq.slot] = slot

    def take_state_ops(self, seqs: tuple[Sequence, ...], starts: np.ndarray,
                       num_new: np.ndarray) -> StateOps | None:
        """The state moves owed before the next forward and where its rows' mixers cut
        (snapshots, grid points), or None without state or rows (a plan without rows runs no
        forward: the moves wait)."""
        if self.state is None or not seqs:
            return None
        snaps = np.zeros((3, 0), np.int64)
        if self.snapshots is not None and self.snapshots.wanting:
            snaps = self.snapshots.take({s: i for i, s in enumerate(seqs)}, starts, num_new)
        if self.grid:
            own = np.zeros(len(seqs), np.int64)
            for i in np.flatnonzero(num_new > 1).tolist():  # prefill rows only
                own[i] = self._resume_point(seqs[i].group)
            snaps = merge_cuts(snaps, grid_cuts(starts, num_new, self.grid, own))
        return self.state.take_ops(snaps)

    def _resume_point(self, group: SequenceGroup) -> int:
        """The last block end an identical prompt can resume from (two tokens are always
        computed): every prefill of the prompt cuts there too, so resuming keeps the bits."""
        return max(group.num_prompt_tokens - 2, 0) // self.block_size * self.block_size

    # ---- prefix caching -----------------------------------------------------------------------
    def _hashes_of(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The sequence's block-hash memo, extended to the full blocks of `num_tokens` tokens
        (each block is hashed once in the sequence's life)."""
        memo = self._hashes.get(seq, [])
        if num_tokens // self.block_size > len(memo):
            memo = chain_hashes(seq.token_ids, self.block_size, memo, num_tokens,
                                seq.group.block_key)
            self._hashes[seq] = memo
        return memo

    def _publish(self, seq: Sequence) -> None:
        """After a step: publish the hashes of the sequence's newly completed full blocks."""
        done = self.num_computed(seq) // self.block_size
        if done > self._published.get(seq, 0):
            self.block_manager.register(seq, self._hashes_of(seq, done * self.block_size)[:done])
            self._published[seq] = done

    # ---- statistics ---------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and state snapshot (False, doing nothing, while a
        sequence holds blocks)."""
        done = self.block_manager.reset_prefix_cache()
        if done and self.snapshots is not None:
            self.snapshots.clear()
        return done

    def reset_stats(self) -> None:
        """A new measurement window for peak usage, COW copies, prefix hits and swaps."""
        self.block_manager.reset_stats()
        if self.state is not None:
            self.state.reset_peak()
