"""Continuous batching: which sequences run this step and how many query tokens each.

Decodes first, then chunked prefills, within `max_num_seqs` and `max_num_batched_tokens`;
new groups are admitted in input order while free blocks allow; when a running sequence
cannot get a block, the newest running group is preempted by recompute (its blocks freed, its
tokens recomputed later), which never changes outputs. A beam group's live beams decode
together or not at all, because one beam step needs the logits of all of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.kv.block_manager import BlockManager, chain_hashes


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # query tokens this step


@dataclass
class SchedulerOutput:
    """The step's work: sequences with their query lengths, and COW block copies to make first."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class _Budget:
    """Tokens and sequence slots left in this step."""

    def __init__(self, tokens: int, seqs: int) -> None:
        self.tokens = tokens
        self.seqs = seqs

    def fits(self, tokens: int, seqs: int) -> bool:
        return tokens <= self.tokens and seqs <= self.seqs


class Scheduler:
    """Owns the waiting queue and the running list; allocates through the BlockManager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # in admission order
        self.num_preemptions = 0
        self._preempted_now: set[int] = set()  # ids of groups preempted in this schedule()
        # Admission leaves a little room so running sequences can grow without preemption.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def free_seq(self, seq: Sequence) -> None:
        """A sequence finished: its blocks go back now, so this very step can reuse them."""
        seq.status = SequenceStatus.FINISHED
        if seq.seq_id in self.bm.block_tables:
            self.bm.free_seq(seq.seq_id)

    def abort_all(self) -> None:
        """Drop every group (a failed or interrupted call): free their blocks, empty the queues,
        so the next call starts from a clean pool."""
        for group in [*self.running, *self.waiting]:
            for seq in group.seqs:
                if seq.seq_id in self.bm.block_tables:
                    self.bm.free_seq(seq.seq_id)
        self.running.clear()
        self.waiting.clear()

    def drop_finished_groups(self) -> list[SequenceGroup]:
        done = [g for g in self.running if g.finished]
        if done:
            self.running = [g for g in self.running if not g.finished]
        return done

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.max_num_batched_tokens, self.max_num_seqs)
        preempted = False
        self._preempted_now = set()  # a set lookup, not `in self.running` (O(n) per group)
        for group in list(self.running):
            if group.share_pending and id(group) not in self._preempted_now:
                self._refork(group)
        # Decodes first (one token each; a beam group's live beams all together) ...
        for group in list(self.running):
            if id(group) in self._preempted_now:
                continue
            units = self._decode_units(group)
            for unit in units:
                if not budget.fits(len(unit), len(unit)):
                    continue
                ok, hit = self._reserve_or_preempt(unit, [1] * len(unit), out, budget)
                preempted |= hit
                if not ok:
                    break
                for seq in unit:
                    self._take(seq, 1, out, budget)
        # ... then prefill chunks of running sequences ...
        for group in list(self.running):
            for seq in group.unfinished():
                if id(group) in self._preempted_now or budget.tokens == 0 or budget.seqs == 0:
                    break
                if seq.num_uncomputed <= 1:
                    continue
                n = min(group.max_chunk(seq), budget.tokens)
                if n <= 0:
                    continue
                ok, hit = self._reserve_or_preempt([seq], [n], out, budget)
                preempted |= hit
                if ok:
                    self._take(seq, n, out, budget)
        # ... then new (or preempted) groups, unless a preemption just freed room for them.
        if not preempted:
            self._admit(out, budget)
        return out

    def _decode_units(self, group: SequenceGroup) -> list[list[Sequence]]:
        """Sequences that decode this step, as all-or-nothing units."""
        if group.share_pending:
            return []
        ready = [s for s in group.unfinished() if s.num_uncomputed == 1]
        if group.beam is not None and group.forked:
            return [ready] if ready and len(ready) == len(group.unfinished()) else []
        return [[s] for s in ready]

    def _reserve_or_preempt(self, seqs: list[Sequence], counts: list[int],
                            out: SchedulerOutput, budget: _Budget) -> tuple[bool, bool]:
        """Reserve blocks for the sequences, preempting the newest groups while they do not
        fit. Returns (reserved, preempted anything)."""
        if len(seqs) == 1 and counts[0] == 1 and self._in_place(seqs[0]):
            return True, False
        preempted = False
        group = seqs[0].group
        while self._blocks_needed(seqs, counts) > self.bm.num_free_blocks():
            victim = self.running[-1]
            self._preempt(victim, out, budget)
            preempted = True
            if victim is group:
                return False, True
        for seq, n in zip(seqs, counts):
            self._reserve(seq, n, out)
        return True, preempted

    def _admit(self, out: SchedulerOutput, budget: _Budget) -> None:
        """Admit waiting groups in order while tokens, sequence slots and blocks allow. With
        prefix caching a sequence starts from its cached prefix blocks, and a group waits one
        step when the next block it needs is being computed by a group admitted before it."""
        inflight = self._inflight_hashes()
        while self.waiting and budget.tokens > 0:
            group = self.waiting[0]
            seqs = group.unfinished()
            leader = seqs[0]
            hashes, hit = self._prefix_hit(group, leader)
            if len(hit) < len(hashes) and hashes[len(hit)] in inflight:
                return  # computed this step by an earlier request: hit it next step instead
            plan: list[tuple[Sequence, int]] = []
            tokens = budget.tokens
            for seq in seqs:
                skip = len(hit) * self.bm.block_size if seq is leader else 0
                n = min(group.max_chunk(seq) - skip, tokens)
                if n > 0:
                    tokens -= n
                    plan.append((seq, n))
            if not plan or len(plan) > budget.seqs:
                return
            need = sum(self.bm.blocks_for_tokens(s.num_computed_tokens
                                                 + (len(hit) * self.bm.block_size
                                                    if s is leader else 0) + n)
                       for s, n in plan) - len(hit) + self.bm.num_evictable(hit)
            reserve = self.watermark_blocks if self.running else 0
            if need > self.bm.num_free_blocks() - reserve:
                return
            self.waiting.popleft()
            self.running.append(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            if hit:
                self.bm.allocate_cached(leader.seq_id, hit)
                leader.num_computed_tokens = len(hit) * self.bm.block_size
                leader.cached_blocks = len(hit)
            inflight.update(hashes[len(hit):])
            for seq, n in plan:
                self._reserve(seq, n, out)
                self._take(seq, n, out, budget)

    def _prefix_hit(self, group: SequenceGroup, leader: Sequence
                    ) -> tuple[list[bytes], list[int]]:
        """Hashes of the leader's full blocks, and the cached blocks of their longest prefix.
        At least one token is always left to compute (a full hit would be an empty query)."""
        if not self.bm.enable_prefix_caching or leader.seq_id in self.bm.block_tables:
            return [], []
        limit = group.num_prompt_tokens if group.share_pending else len(leader.token_ids)
        hashes = self._hashes(leader, limit)[:limit // self.bm.block_size]
        return hashes, self.bm.lookup(hashes[:(limit - 1) // self.bm.block_size])

    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The sequence's block-hash memo, extended to the full blocks of `num_tokens` tokens
        (each block is hashed once in the sequence's life)."""
        if num_tokens // self.bm.block_size > len(seq.block_hashes):
            seq.block_hashes = chain_hashes(seq.token_ids, self.bm.block_size,
                                            seq.block_hashes, num_tokens)
        return seq.block_hashes

    def _inflight_hashes(self) -> set[bytes]:
        """Hashes of full blocks that admitted sequences have yet to compute."""
        if not self.bm.enable_prefix_caching:
            return set()
        pending: set[bytes] = set()
        for group in self.running:
            for seq in group.unfinished():
                if seq.num_uncomputed > 1:
                    done = seq.num_computed_tokens // self.bm.block_size
                    pending.update(self._hashes(seq, len(seq.token_ids))[done:])
        return pending

    def cache_computed(self, seq: Sequence) -> None:
        """After a step: publish the hashes of the sequence's newly completed full blocks."""
        done = seq.num_computed_tokens // self.bm.block_size
        if self.bm.enable_prefix_caching and not seq.finished and done > seq.cached_blocks:
            self.bm.register(seq.seq_id, self._hashes(seq, seq.num_computed_tokens)[:done])
            seq.cached_blocks = done

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput, budget: _Budget) -> None:
        out.scheduled.append(ScheduledSeq(seq, n))
        budget.tokens -= n
        budget.seqs -= 1

    def _in_place(self, seq: Sequence) -> bool:
        """The decode fast path: the next token goes into an existing block it owns alone."""
        start = seq.num_computed_tokens
        bs = self.bm.block_size
        if start % bs == 0:
            return False
        table = self.bm.block_tables.get(seq.seq_id)
        return table is not None and self.bm.ref_count[table[start // bs]] == 1

    def _shared_partial(self, seq: Sequence) -> bool:
        """Would writing at the sequence's next position hit a block shared with others?"""
        table = self.bm.block_tables.get(seq.seq_id)
        start = seq.num_computed_tokens
        bs = self.bm.block_size
        return (table is not None and start % bs != 0 and start // bs < len(table)
                and self.bm.ref_count[table[start // bs]] > 1)

    def _blocks_needed(self, seqs: list[Sequence], counts: list[int]) -> int:
        return sum(self.bm.blocks_needed(s.seq_id, s.num_computed_tokens + n)
                   + self._shared_partial(s) for s, n in zip(seqs, counts))

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Blocks for positions [computed, computed+n); a shared partial block is copied first
        (copy-on-write), the only block a forked sequence ever copies."""
        if self._shared_partial(seq):
            src, dst = self.bm.cow_append(seq.seq_id, seq.num_computed_tokens // self.bm.block_size)
            out.copies.append((src, dst))
        self.bm.ensure_capacity(seq.seq_id, seq.num_computed_tokens + n)

    def _refork(self, group: SequenceGroup) -> None:
        """After a preemption: once the leader has recomputed the prompt, fork its prompt
        blocks to every sibling, which then recomputes only its own tokens."""
        leader, *siblings = group.unfinished()
        p = group.num_prompt_tokens
        if leader.num_computed_tokens < p:
            return
        for sib in siblings:
            self.bm.fork(leader.seq_id, sib.seq_id, num_tokens=p)
            sib.num_computed_tokens = p
            sib.block_hashes = leader.block_hashes[:p // self.bm.block_size]
            sib.cached_blocks = min(leader.cached_blocks, p // self.bm.block_size)
            sib.status = SequenceStatus.RUNNING
        group.share_pending = False

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, budget: _Budget) -> None:
        """Recompute preemption: free the group's blocks and requeue it at the front."""
        self.running.remove(group)
        self._preempted_now.add(id(group))
        ids = set()
        for seq in group.seqs:
            if seq.seq_id in self.bm.block_tables:
                ids.update(self.bm.block_tables[seq.seq_id])
                self.bm.free_seq(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.cached_blocks = 0  # the memo of hashes stays valid: the tokens are unchanged
            if not seq.finished:
                seq.status = SequenceStatus.WAITING
        for s in out.scheduled:  # refund the step budget they held
            if s.seq.group is group:
                budget.tokens += s.num_new
                budget.seqs += 1
        out.scheduled = [s for s in out.scheduled if s.seq.group is not group]
        out.copies = [(s, d) for s, d in out.copies if d not in ids]
        group.share_pending = group.forked and len(group.unfinished()) > 1
        self.waiting.appendleft(group)
        self.num_preemptions += 1
