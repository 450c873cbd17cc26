"""Continuous batching, decisions only: the Scheduler owns the queues and decides each step.

Each step it picks which sequences run and how many query tokens each: decodes first (a beam
group's live beams all together or not at all, since one beam step needs all their rows),
then chunked prefills, within `max_num_seqs` and `max_num_batched_tokens` (a beam group wider
than `max_num_seqs` decodes in a step of its own, where vLLM would run its beams in waves); then it admits
waiting groups in input order while free blocks allow (prefix-cache hits shorten their
prompts). When a running sequence cannot get a block, the newest running group is preempted:
swapped out to the host pool when `preemption_mode="swap"` and the pool has room for all its
blocks (its samples or beams as a unit; they come back, before any new admission, once the
device pool has room), else by recompute (its blocks freed, its tokens recomputed later).
Neither changes outputs.

The KVManager carries out what the scheduler decides (admit, reserve, evict, swap); the
step's result is a frozen StepPlan (rows, query lengths, block copies and swaps), which the
engine turns into runner rows and a logits layout (engine/layout.py) and nothing changes
after the forward. Decoding samples, the bulk of every step, are found and reserved by
vector ops over the persistent batch's columns; Python runs per group or row only for beams,
prefill chunks, admissions, preemption, and when the decodes do not all fit the step.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from operator import attrgetter

import numpy as np

from batchgen.engine.chunking import chunk_size
from batchgen.engine.kv_manager import KVManager
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus, slots_of
from batchgen.engine.step_plan import Draft, StepPlan
from batchgen.kv.block_manager import PoolExhausted


class Scheduler:
    """Owns the waiting queue, the running list (admission order) and the swapped groups."""

    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", by_priority: bool = False) -> None:
        if preemption_mode == "swap" and not kv.block_manager.num_host_blocks:
            raise ValueError("preemption_mode 'swap' needs a host pool (swap_space > 0)")
        self.kv = kv
        self.batch = kv.batch  # read here; written through the KVManager
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        # vLLM's priority policy: waiting groups (new or preempted) in (priority, index)
        # order, and the victim of a preemption the running group last in that order
        self.by_priority = by_priority
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []  # swapped out, in admission order
        self.num_preemptions = self.num_swap_outs = self.num_swap_ins = 0
        # LoRA (batchgen/lora): whether a group may run beside the running ones (max_loras)
        self.lora_gate: Callable[[SequenceGroup, list[SequenceGroup]], bool] | None = None
        self.num_lora_loads = 0  # adapters loaded into a device slot (by the gate)
        self._preempted_now: set[SequenceGroup] = set()
        self._order = 0  # admissions so far: a group's place in the running order
        # Admission leaves a little room so running sequences can grow without preemption.
        self.watermark_blocks = max(1, kv.num_blocks // 100)

    def add(self, group: SequenceGroup) -> None:
        """Queue a new group (behind the others; under the priority policy, at its place)."""
        self._requeue(group, self.waiting.append)

    def _requeue(self, group: SequenceGroup, fcfs: Callable[[SequenceGroup], None]) -> None:
        """Into the waiting queue: by `fcfs` (back for new groups, front for preempted ones),
        or under the priority policy at the group's place in (priority, index) order."""
        if self.by_priority:
            bisect.insort(self.waiting, group, key=_PRIORITY)
        else:
            fcfs(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def retire(self, finished: Iterable[SequenceGroup]) -> None:
        """Finished groups leave the running list."""
        gone = set(finished)
        if gone:
            self.running = [g for g in self.running if g not in gone]

    def abort_all(self) -> None:
        """Drop every group (a failed or interrupted call) and every block table, so the next
        call starts from a whole pool."""
        self.running.clear()
        self.waiting.clear()
        self.swapped.clear()
        self.kv.abort_all()

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step: swapped groups back, decodes, then prefill chunks, then admission.
        Decoding samples are selected and reserved by vector ops over the batch's columns
        when they all fit the step; beams, and every decode when they do not, go through the
        groups in order."""
        d = Draft(self.max_num_batched_tokens, self.max_num_seqs)
        self._preempted_now = set()
        self._swap_in(d)
        beams = [g for g in self.running if g.spec.beam]
        ready, slots = self.kv.decoding_units(beams)
        if self._decode_samples(d, len(ready), len(beams) < len(self.running)):
            preempted = (not self._decode_beams(d, ready, slots)
                         and self._schedule_decodes(d, beams))
        else:
            preempted = self._schedule_decodes(d, list(self.running))
        preempted |= self._schedule_prefills(d)
        if not preempted and not self.swapped:  # swapped groups come back first
            self._admit(d)
        return self._freeze(d)

    def _freeze(self, d: Draft) -> StepPlan:
        """The plan: rows' slots (the decodes' as found, unless a removal moved slots since)
        and the tokens each has computed."""
        k, c = d.decode_rows, self.batch.cols
        fresh = d.moves == self.batch.moves
        found = [a for a in (d.decode_slots, d.beam_slots) if a is not None] if fresh else []
        first = sum(map(len, found))
        rest = slots_of(d.seqs[first:], len(d.seqs) - first)
        slots = np.concatenate((*found, rest)) if found else rest
        starts = c["num_computed"][slots]  # a row without a slot: (swapped) its own count
        for i in np.flatnonzero(slots < 0).tolist():
            starts[i] = self.kv.num_computed(d.seqs[i])
        seqs, num_new = tuple(d.seqs), np.array(d.num_new, np.int64)
        return StepPlan(seqs, slots, starts, num_new, k, tuple(d.copies), tuple(d.swap_in),
                        tuple(d.swap_out), self.kv.take_state_ops(seqs, starts, num_new))

    def _ready(self, group: SequenceGroup) -> list[Sequence]:
        """The group's running sequences with exactly one token left to compute."""
        return [s for s in group.seqs if s.status is SequenceStatus.RUNNING
                and len(s.token_ids) - self.kv.num_computed(s) == 1]

    def _decode_beams(self, d: Draft, seqs: list[Sequence], slots: np.ndarray) -> bool:
        """The ready beams (at `slots`) at once, in order, when they fit the step and the pool
        has a block for every row that opens or shares one (no preemption); else False,
        doing nothing."""
        n, c = len(seqs), self.batch.cols
        if self._preempted_now or not d.fits(n, n):
            return False
        needy = slots[(c["num_computed"][slots] // self.block_size >= c["num_blocks"][slots])
                      | c["cow_check"][slots]]
        if len(needy) > self.kv.num_free_blocks():
            return False
        if len(needy):
            self.kv.grow_decodes(needy, d.copies)
        if len(d.seqs) == d.decode_rows:  # right after the samples: their slots follow
            d.beam_slots = slots
        d.seqs += seqs
        d.num_new += [1] * n
        d.tokens, d.num_seqs = d.tokens - n, d.num_seqs - n
        return True

    def _decode_samples(self, d: Draft, units: int, samples: bool = True) -> bool:
        """Every decoding sample at once, when all of them and the beams' decodes fit the
        step: candidates from the columns, a block reserved only for rows that open one or
        may share one (after a fork). False (nothing scheduled; what was reserved stays, and
        the copies made stay in the draft) to go through the groups in order instead: when
        the pool runs short, their order decides who is preempted. `samples`: False when
        only beam groups run (no row to look for)."""
        b, c, n = self.batch, self.batch.cols, self.batch.num_seqs
        rows = np.zeros(0, np.int64)
        if samples:
            computed = c["num_computed"][:n]
            ready = ((c["num_tokens"][:n] - computed == 1) & ~c["beam"][:n]
                     & ~c["fork_pending"][:n])
            rows = np.flatnonzero(ready)
        if not d.fits(len(rows) + units, len(rows) + units):
            return False
        needy = rows[(c["num_computed"][rows] // self.block_size >= c["num_blocks"][rows])
                     | c["cow_check"][rows]] if len(rows) else rows
        if len(needy):
            try:
                self.kv.grow_decodes(needy, d.copies)
            except PoolExhausted:
                return False
        d.seqs += [b.seqs[i] for i in rows.tolist()]
        d.decode_slots, d.moves = rows, b.moves
        d.num_new += [1] * len(rows)
        d.decode_rows = len(rows)
        d.tokens -= len(rows)
        d.num_seqs -= len(rows)
        return True

    def _schedule_decodes(self, d: Draft, groups: list[SequenceGroup]) -> bool:
        """One token for every sequence of these groups that is decoding (a beam group's
        live beams together), in order; returns whether any group was preempted for room."""
        preempted = False
        for group in groups:
            if group in self._preempted_now or group.fork_pending:
                continue
            for unit in group.policy.decode_units(group, self._ready(group)):
                if not d.fits_decode(len(unit)):
                    continue
                ok, hit = self._schedule_unit(group, unit, [1] * len(unit), d)
                preempted |= hit
                if not ok:
                    break
        return preempted

    def _schedule_prefills(self, d: Draft) -> bool:
        """Chunks of running sequences with several tokens to compute (prompts, recomputes,
        a leader before its fork), in the groups' order; returns whether any group was
        preempted for room."""
        preempted = False
        for seq in self._prefilling():
            group = seq.group
            if (group in self._preempted_now or d.full
                    or seq.status is not SequenceStatus.RUNNING):
                continue
            done = self.kv.num_computed(seq)
            n = chunk_size(done, self._chunk_limit(group, seq, done, group.fork_pending),
                           d.tokens, self.max_num_batched_tokens, self.kv.grid, group.chunk_cut)
            if n > 0:
                preempted |= self._schedule_unit(group, [seq], [n], d)[1]
        return preempted

    def _prefilling(self) -> list[Sequence]:
        """Running sequences with more than one token to compute, or leading a pending fork,
        in the groups' order (found on the columns: no Python per decoding row)."""
        c, n = self.batch.cols, self.batch.num_seqs
        rows = np.flatnonzero((c["num_tokens"][:n] - c["num_computed"][:n] > 1)
                              | c["fork_pending"][:n])
        seqs = [self.batch.seqs[i] for i in rows.tolist()]
        seqs.sort(key=lambda s: (s.group.order, s.index))
        return seqs

    @staticmethod
    def _chunk_limit(group: SequenceGroup, seq: Sequence, computed: int, fork_pending: bool
                     ) -> int:
        """Tokens `seq` may compute from `computed` on: while a fork is pending only the
        leader runs, and only up to the end of the prompt; beams leave their last token to
        the group's decode step."""
        if fork_pending:
            return group.num_prompt_tokens - computed if seq is group.leader else 0
        return len(seq.token_ids) - computed - group.policy.held_tokens(group)

    def _schedule_unit(self, group: SequenceGroup, seqs: list[Sequence], counts: list[int],
                       d: Draft) -> tuple[bool, bool]:
        """Reserve the sequences' next slots (all or none; copy-on-write included) and schedule
        them, preempting the newest groups while the blocks are not there. Returns (scheduled,
        preempted anything)."""
        preempted = False
        while True:
            try:
                copies = self.kv.reserve(seqs, counts)
                break
            except PoolExhausted:
                victim = (max(self.running, key=_PRIORITY) if self.by_priority
                          else self.running[-1])
                if victim is group and len(self.running) == 1:
                    raise RuntimeError(
                        f"request {group.index} needs {self.kv.blocks_needed(seqs, counts)} "
                        f"more KV blocks while running alone and only "
                        f"{self.kv.num_free_blocks()} of {self.kv.num_blocks} are free: it "
                        "would preempt itself forever (its admission bound is wrong)") from None
                self._preempt(victim, d)
                preempted = True
                if victim is group:
                    return False, True
        d.copies += copies
        for seq, n in zip(seqs, counts):
            d.take(seq, n)
        return True, preempted

    # ---- admission ----------------------------------------------------------------------------
    def _admit(self, d: Draft) -> None:
        """Admit waiting groups in order while tokens, sequence slots and blocks allow: the
        leader starts, from its cached prefix blocks if prefix caching has them."""
        inflight: set[bytes] | None = None
        while self.waiting and d.tokens > 0 and d.num_seqs > 0:
            if inflight is None:
                inflight = self.kv.inflight_hashes()
            group = self.waiting[0]
            plan = self._admission(group, d, inflight)
            if plan is None:
                break
            hashes, hit, start, n = plan
            self.waiting.popleft()
            self.running.append(group)
            group.order, self._order = self._order, self._order + 1
            self.kv.admit(group, start + n, hit)
            if group.num_cached_tokens is None:
                group.num_cached_tokens = start
            inflight.update(hashes[len(hit):])
            d.take(group.leader, n)

    def _admission(self, group: SequenceGroup, d: Draft, inflight: set[bytes]
                   ) -> tuple[list[bytes], list[int], int, int] | None:
        """Whether the group's leader can start now: (its block hashes, its prefix-cache hit,
        its first position, its first chunk's length), or None. A group waits one step when
        the next block it needs is being computed by a group admitted before. With several
        unfinished sequences only the leader starts, up to the end of the prompt."""
        leader = group.leader
        limit = self._chunk_limit(group, leader, 0, len(group.unfinished()) > 1)
        hashes, hit = self.kv.prefix_hit(leader, limit)
        if len(hit) < len(hashes) and hashes[len(hit)] in inflight:
            return None  # computed this step by an earlier request: hit it next step instead
        start = len(hit) * self.block_size
        n = chunk_size(start, limit - start, d.tokens, self.max_num_batched_tokens, self.kv.grid,
                       group.chunk_cut)
        headroom = self.watermark_blocks if self.running else 0
        if n == 0 or not self.kv.can_admit(start + n, hit, headroom):
            return None
        if self.lora_gate is not None and not self.lora_gate(group, self.running):
            return None
        return hashes, hit, start, n

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, d: Draft) -> None:
        """Preempt a running group for room: swap it out when the mode is "swap" and the host
        pool has a block for each of its blocks, else recompute it later. Either way it
        leaves this step's plan."""
        self.running.remove(group)
        self._preempted_now.add(group)
        d.drop(group)
        held = [s for s in group.seqs if s.status is SequenceStatus.RUNNING]
        if self.preemption_mode == "swap" and self.kv.can_swap_out(held):
            self._swap_out(group, held, d)
        else:
            freed = self.kv.evict(group)
            d.copies = [(s, t) for s, t in d.copies if t not in freed]
            self._requeue(group, self.waiting.appendleft)
        self.num_preemptions += 1
        group.num_preemptions += 1

    def _swap_out(self, group: SequenceGroup, held: list[Sequence], d: Draft) -> None:
        """Swap preemption: the sequences' tables move to the host pool, shared blocks once. A
        copy-on-write this step made into one of their blocks is dropped, and that block is
        swapped out from the copy's source instead (the copy would only run after the swap)."""
        cow = {t: s for s, t in d.copies}
        moved = self.kv.swap_out(held)
        d.swap_out += [(cow.get(blk, blk), h) for blk, h in moved]
        gone = {blk for blk, _ in moved}
        d.copies = [(s, t) for s, t in d.copies if t not in gone]
        bisect.insort(self.swapped, group, key=_admission_order)
        self.num_swap_outs += 1

    def _swap_in(self, d: Draft) -> None:
        """Swapped groups come back, oldest admission first and before any new one, while the
        device pool has room for all their blocks (beside running groups, also a block per
        sequence to grow and the admission watermark); none overtakes one that does not fit.
        They rejoin the running list at their old place and can decode this step."""
        while self.swapped:
            group = self.swapped[0]
            held = self.kv.swapped_seqs(group)
            headroom = self.watermark_blocks + len(held) if self.running else 0
            if not self.kv.can_swap_in(held, headroom) or (
                    self.lora_gate is not None and not self.lora_gate(group, self.running)):
                return
            self.swapped.pop(0)
            d.swap_in += self.kv.swap_in(held)
            bisect.insort(self.running, group, key=_admission_order)
            self.num_swap_ins += 1


_PRIORITY = attrgetter("priority", "index")  # vLLM's order: lower first, ties by arrival


def _admission_order(group: SequenceGroup) -> int:
    return group.order
