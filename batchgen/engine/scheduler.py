"""Continuous batching: which sequences run this step and how many query tokens each.

Decodes first, then chunked prefills, within `max_num_seqs` and `max_num_batched_tokens`;
new groups are admitted in input order while free blocks allow; when a running sequence
cannot get a block, the newest running group is preempted by recompute (its blocks freed, its
tokens recomputed later), which never changes outputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.kv.block_manager import BlockManager


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
        self._stamp = 0
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

    def drop_finished_groups(self) -> list[SequenceGroup]:
        done = [g for g in self.running if g.finished]
        if done:
            self.running = [g for g in self.running if not g.finished]
        return done

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.max_num_batched_tokens, self.max_num_seqs]
        decoding = [s for g in self.running for s in g.unfinished() if s.num_uncomputed == 1]
        prefilling = [s for g in self.running for s in g.unfinished() if s.num_uncomputed > 1]
        preempted = False
        for seq in decoding + prefilling:
            if seq.status is not SequenceStatus.RUNNING or budget[0] == 0 or budget[1] == 0:
                continue
            n = min(seq.num_uncomputed, budget[0])
            while not self._reserve(seq, n, out):
                victim = self.running[-1]
                self._preempt(victim, out, budget)
                preempted = True
                if victim is seq.group:
                    break
            else:
                self._take(seq, n, out, budget)
        if not preempted:  # a group just preempted would only thrash back in
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: list[int]) -> None:
        """Admit waiting groups in order while tokens, sequence slots and blocks allow."""
        while self.waiting and budget[0] > 0:
            group = self.waiting[0]
            seqs = group.unfinished()
            if len(seqs) > budget[1]:
                return
            plan = []
            tokens, blocks = budget[0], 0
            for seq in seqs:
                n = min(seq.num_uncomputed, tokens)
                if n == 0:
                    break
                tokens -= n
                blocks += self.bm.blocks_needed(seq.seq_id, seq.num_computed_tokens + n)
                plan.append((seq, n))
            if blocks > self.bm.num_free_blocks() - self.watermark_blocks and self.running:
                return
            if blocks > self.bm.num_free_blocks():
                return
            self.waiting.popleft()
            group.admitted_at = self._stamp
            self._stamp += 1
            self.running.append(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            for seq, n in plan:
                reserved = self._reserve(seq, n, out)
                assert reserved, "admission checked the free blocks"
                self._take(seq, n, out, budget)

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput, budget: list[int]) -> None:
        out.scheduled.append(ScheduledSeq(seq, n))
        budget[0] -= n
        budget[1] -= 1

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for positions [computed, computed+n), copying a shared partial block first."""
        bm, sid, start = self.bm, seq.seq_id, seq.num_computed_tokens
        table = bm.block_tables.get(sid)
        shared = (table is not None and start % bm.block_size != 0
                  and bm.ref_count[table[start // bm.block_size]] > 1)
        if bm.blocks_needed(sid, start + n) + shared > bm.num_free_blocks():
            return False
        if shared:
            src, dst = bm.cow_append(sid, start // bm.block_size)
            out.copies.append((src, dst))
        bm.ensure_capacity(sid, start + n)
        return True

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, budget: list[int]) -> None:
        """Recompute preemption: free the group's blocks and requeue it at the front."""
        self.running.remove(group)
        ids = set()
        for seq in group.seqs:
            if seq.seq_id in self.bm.block_tables:
                ids.update(self.bm.block_tables[seq.seq_id])
                self.bm.free_seq(seq.seq_id)
            seq.num_computed_tokens = 0
            if not seq.finished:
                seq.status = SequenceStatus.WAITING
        dropped = [s for s in out.scheduled if s.seq.group is group]
        for s in dropped:  # refund the step budget they held
            budget[0] += s.num_new
            budget[1] += 1
        out.scheduled = [s for s in out.scheduled if s.seq.group is not group]
        out.copies = [(s, d) for s, d in out.copies if d not in ids]
        self.waiting.appendleft(group)
        self.num_preemptions += 1
