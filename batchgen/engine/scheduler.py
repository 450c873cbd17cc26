"""Continuous batching: the Scheduler owns every request from admission to finish.

Each step it picks which sequences run and how many query tokens each: decodes first (a beam
group's live beams all together or not at all, since one beam step needs all their logits),
then chunked prefills, within `max_num_seqs` and `max_num_batched_tokens`; then it admits
waiting groups in input order while free blocks allow. When a running sequence cannot get a
block, the newest running group is preempted by recompute (its blocks freed, its tokens
recomputed later), which never changes outputs. After the step it applies the results
(`update_from_output`): progress, prefix-cache publishing, forks, and the operations the
groups' policies return. It is the only writer of Sequence state and the only caller of the
BlockManager.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from batchgen.attention.metadata import SeqChunk
from batchgen.engine.policy import Append, Fork, Free, Op, Sample, SetSeqs
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.kv.block_manager import BlockManager, blocks_for, chain_hashes
from batchgen.sampling.sampler import RankedLogprobs


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


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # query tokens this step


@dataclass
class SchedulerOutput:
    """The step's work: sequences with their query lengths, the COW block copies to make first,
    and (once scheduling is done) the runner's chunks and who reads which logits row."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids
    chunks: list[SeqChunk] = field(default_factory=list)
    samplers: list[Sequence] = field(default_factory=list)  # sequences that draw a token...
    sample_rows: list[int] = field(default_factory=list)  # ...from these logits rows
    beam_rows: dict[SequenceGroup, dict[Sequence, int]] = field(default_factory=dict)
    # prompt logprobs: (group, first position scored, its logits row, how many rows)
    prompt_rows: list[tuple[SequenceGroup, int, int, int]] = field(default_factory=list)
    num_prompt_tokens: int = 0


@dataclass
class StepStats:
    """Tokens computed in one step, for the progress bar."""

    prompt_tokens: int
    output_tokens: int
    finished: list[SequenceGroup]


class _Budget:
    """Tokens and sequence slots left in this step."""

    def __init__(self, tokens: int, seqs: int) -> None:
        self.tokens = tokens
        self.seqs = seqs

    def fits(self, tokens: int, seqs: int) -> bool:
        return tokens <= self.tokens and seqs <= self.seqs

    def take(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Schedule `n` query tokens of `seq` in this step."""
        out.scheduled.append(ScheduledSeq(seq, n))
        self.tokens -= n
        self.seqs -= 1


class Scheduler:
    """Owns the waiting queue, the running list (admission order) and their sequences."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prompt positions the model ran (recomputes too)
        self._preempted_now: set[SequenceGroup] = set()
        # Admission leaves a little room so running sequences can grow without preemption.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    def add(self, group: SequenceGroup) -> None:
        """Queue a new group; with several sequences they wait for the leader's prompt."""
        group.fork_pending = len(group.seqs) > 1
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> None:
        """Drop every group (a failed or interrupted call) and free every block table the
        block manager holds, so the next call starts from a whole pool."""
        self.running.clear()
        self.waiting.clear()
        self.bm.free_all()

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.max_num_batched_tokens, self.max_num_seqs)
        self._preempted_now = set()
        preempted = self._schedule_decodes(out, budget)
        preempted |= self._schedule_prefills(out, budget)
        if not preempted:  # a preemption just freed room: admit nothing over it this step
            self._admit(out, budget)
        self._describe(out)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: _Budget) -> bool:
        """One token for every sequence that is decoding; returns whether any group was
        preempted for room."""
        preempted = False
        for group in list(self.running):
            if group in self._preempted_now or group.fork_pending:
                continue
            for unit in group.policy.decode_units(group):
                if not budget.fits(len(unit), len(unit)):
                    continue
                ok, hit = self._schedule_unit(group, unit, [1] * len(unit), out, budget)
                preempted |= hit
                if not ok:
                    break
        return preempted

    def _schedule_prefills(self, out: SchedulerOutput, budget: _Budget) -> bool:
        """Chunks of running sequences with several tokens to compute (prompts, recomputes)."""
        preempted = False
        for group in list(self.running):
            for seq in group.seqs:
                if group in self._preempted_now or budget.tokens == 0 or budget.seqs == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or (
                        not group.fork_pending and seq.num_uncomputed <= 1):
                    continue  # waiting for a fork, or decoding (scheduled above)
                n = self._chunk_size(self._chunk_limit(group, seq), budget.tokens)
                if n > 0:
                    preempted |= self._schedule_unit(group, [seq], [n], out, budget)[1]
        return preempted

    def _chunk_limit(self, group: SequenceGroup, seq: Sequence, computed: int | None = None
                     ) -> int:
        """Tokens `seq` may compute from `computed` on: while a fork is pending only the
        leader runs, and only up to the end of the prompt; beams leave their last token to
        the group's decode step."""
        if computed is None:
            computed = seq.num_computed_tokens
        if group.fork_pending:
            return group.num_prompt_tokens - computed if seq is group.leader else 0
        return len(seq.token_ids) - computed - group.policy.held_tokens(group)

    def _chunk_size(self, left: int, budget: int) -> int:
        """Tokens of a prefill chunk with `left` tokens to go: as many as the budget allows, but
        never a lone token out of a longer run (a one-query chunk runs as a decode row, whose
        bits differ from the same position inside a prefill tile). Budgets under 3 tokens
        cannot always avoid it, so they don't try."""
        n = min(left, budget)
        if n < left and self.max_num_batched_tokens >= 3:
            if left - n == 1:
                n -= 1
            if n == 1:
                n = 0
        return n

    def _schedule_unit(self, group: SequenceGroup, seqs: list[Sequence], counts: list[int],
                       out: SchedulerOutput, budget: _Budget) -> tuple[bool, bool]:
        """Reserve blocks for the sequences' next tokens (all or none) and schedule them,
        preempting the newest groups while the blocks are not there. Returns (scheduled,
        preempted anything)."""
        if len(seqs) == 1 and self.bm.writable(seqs[0], seqs[0].num_computed_tokens, counts[0]):
            budget.take(out, seqs[0], counts[0])  # the decode fast path: nothing to reserve
            return True, False
        preempted = False
        appends = [(s, s.num_computed_tokens, n) for s, n in zip(seqs, counts)]
        while (need := self.bm.blocks_needed(appends)) > self.bm.num_free_blocks():
            victim = self.running[-1]
            if victim is group and len(self.running) == 1:
                raise RuntimeError(
                    f"request {group.index} needs {need} more KV blocks while running alone "
                    f"and only {self.bm.num_free_blocks()} of {self.bm.num_blocks} are free: "
                    "it would preempt itself forever (its admission bound is wrong)")
            self._preempt(victim, out, budget)
            preempted = True
            if victim is group:
                return False, True
        for seq, n in zip(seqs, counts):
            if need:
                copy = self.bm.append_slots(seq, seq.num_computed_tokens, n)
                if copy is not None:
                    out.copies.append(copy)
            budget.take(out, seq, n)
        return True, preempted

    def _admit(self, out: SchedulerOutput, budget: _Budget) -> None:
        """Admit waiting groups in order while tokens, sequence slots and blocks allow: the
        leader starts, from its cached prefix blocks if prefix caching has them. A group waits
        one step when the next block it needs is being computed by a group admitted before."""
        inflight = self._inflight_hashes()
        while self.waiting and budget.tokens > 0 and budget.seqs > 0:
            group = self.waiting[0]
            leader = group.leader
            limit = self._chunk_limit(group, leader, computed=0)
            hashes, hit = self._prefix_hit(leader, limit)
            if len(hit) < len(hashes) and hashes[len(hit)] in inflight:
                return  # computed this step by an earlier request: hit it next step instead
            start = len(hit) * self.block_size
            n = self._chunk_size(limit - start, budget.tokens)
            if n == 0:
                return
            headroom = self.watermark_blocks if self.running else 0
            if not self.bm.can_allocate(start + n, hit, headroom):
                return
            self.waiting.popleft()
            self.running.append(group)
            self.bm.allocate(leader, start + n, hit)
            if group.num_cached_tokens is None:
                group.num_cached_tokens = start
            leader.status = SequenceStatus.RUNNING
            leader.num_computed_tokens = start
            leader.cached_blocks = len(hit)
            inflight.update(hashes[len(hit):])
            budget.take(out, leader, n)

    def _describe(self, out: SchedulerOutput) -> None:
        """The runner's chunks and who reads each logits row: samplers draw from a chunk's last
        row (an n > 1 leader's last prompt row serves every sample), beams hand theirs to their
        policy, and a request with prompt logprobs keeps every row of its prompt chunks."""
        row = 0
        tables = self.bm.block_tables
        for item in out.scheduled:
            seq, n = item.seq, item.num_new
            group, tokens = seq.group, seq.token_ids
            start = seq.num_computed_tokens
            end = start + n
            want = end == len(tokens)
            p = group.num_prompt_tokens
            rows = int(want)
            if group.prompt_logprobs is not None and start < p - 1:
                rows = n  # every position scores the next prompt token
                out.prompt_rows.append((group, start + 1, row, min(end, p - 1) - start))
            out.chunks.append(SeqChunk(tokens[start:end], tables[seq], start, rows))
            if start < p:
                out.num_prompt_tokens += min(end, p) - start
            row += rows
            if not want:
                continue
            samplers = group.policy.samples_from(group, seq)
            if samplers:
                out.samplers += samplers
                out.sample_rows += [row - 1] * len(samplers)
            else:
                out.beam_rows.setdefault(group, {})[seq] = row - 1
        self.prompt_tokens_computed += out.num_prompt_tokens

    # ---- after the step -------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, logits: torch.Tensor,
                           sampled: list[Sample],
                           prompt_logprobs: list[RankedLogprobs | None] = ()) -> StepStats:
        """Apply one step's results: progress and prefix-cache publishing, prompt logprobs
        (`prompt_logprobs`: the entries of `out.prompt_rows`, in order), pending forks, then
        each group's policy operations; finished groups leave the running list."""
        entries = iter(prompt_logprobs)
        for group, first, _, count in out.prompt_rows:
            for pos in range(first, first + count):
                entry = next(entries)
                if group.prompt_logprobs[pos] is None:  # a recompute scores them again
                    group.prompt_logprobs[pos] = entry
        touched: dict[SequenceGroup, None] = {}
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new
            self._publish(seq)
            touched[seq.group] = None
        for group in touched:
            if group.fork_pending and group.leader.num_computed_tokens >= group.num_prompt_tokens:
                self._fork_siblings(group)
        ops: list[Op] = []
        samples: dict[SequenceGroup, list[tuple[Sequence, Sample]]] = {}
        for seq, sample in zip(out.samplers, sampled):
            samples.setdefault(seq.group, []).append((seq, sample))
        for group, rows in samples.items():
            ops += group.policy.update(group, rows)
        for group, rows in out.beam_rows.items():  # the rows in the group's beam order
            ops += group.policy.update(group, logits[[rows[s] for s in group.seqs]])
        new_tokens = self._apply(ops)
        finished = [g for g in touched if g.finished]
        if finished:
            done = set(finished)
            self.running = [g for g in self.running if g not in done]
        return StepStats(out.num_prompt_tokens, new_tokens, finished)

    def _apply(self, ops: list[Op]) -> int:
        """Carry out the policies' operations; returns the number of tokens appended."""
        appended = 0
        for op in ops:
            match op:
                case Append(seq, token, logprob, top):
                    self._append(seq, token, logprob, top)
                    appended += 1
                case Fork(parent, child, num_tokens):
                    self._fork(parent, child, num_tokens)
                case Free(seq):
                    self._finish(seq, None, None)
                case SetSeqs(group, seqs):
                    group.seqs = seqs
                    for j, s in enumerate(seqs):
                        s.index = j
        return appended

    def _append(self, seq: Sequence, token: int, logprob: float,
                top: RankedLogprobs | None) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            seq.logprobs.append(top if top is not None else {token: (logprob, None)})
        if seq.stop is not None:
            reason, stop_reason = seq.stop.append(token, seq.num_generated)
            if reason is not None:
                self._finish(seq, reason, stop_reason)

    def _finish(self, seq: Sequence, reason: str | None, stop_reason: int | str | None) -> None:
        """The sequence ends: its blocks go back now, so the next step can reuse them."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        self._free_blocks(seq)

    def _free_blocks(self, seq: Sequence) -> list[int]:
        """Free the sequence's block table if it has one; returns its blocks."""
        table = self.bm.block_tables.get(seq)
        if table is None:
            return []
        self.bm.free_seq(seq)
        return table

    def _fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """`child` shares the parent's blocks (and block hashes) for `num_tokens` tokens."""
        self.bm.fork(parent, child, num_tokens)
        shared = num_tokens // self.block_size
        child.num_computed_tokens = num_tokens
        child.block_hashes = parent.block_hashes[:shared]
        child.cached_blocks = min(parent.cached_blocks, shared)
        child.status = SequenceStatus.RUNNING

    def _fork_siblings(self, group: SequenceGroup) -> None:
        """The leader has the prompt's K/V: every waiting sibling shares its prompt blocks
        and computes only its own tokens from here."""
        leader = group.leader
        for seq in group.seqs:
            if seq is not leader and not seq.finished:
                self._fork(leader, seq, group.num_prompt_tokens)
        group.fork_pending = False

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, budget: _Budget) -> None:
        """Recompute preemption: free the group's blocks and requeue it at the front; its
        sequences will wait for the leader to recompute the prompt and fork again."""
        self.running.remove(group)
        self._preempted_now.add(group)
        freed: set[int] = set()
        for seq in group.seqs:
            freed.update(self._free_blocks(seq))
            seq.num_computed_tokens = 0
            seq.cached_blocks = 0  # the memo of hashes stays valid: the tokens are unchanged
            if not seq.finished:
                seq.status = SequenceStatus.WAITING
        for s in out.scheduled:  # refund the step budget they held
            if s.seq.group is group:
                budget.tokens += s.num_new
                budget.seqs += 1
        out.scheduled = [s for s in out.scheduled if s.seq.group is not group]
        out.copies = [(s, d) for s, d in out.copies if d not in freed]
        group.fork_pending = len(group.unfinished()) > 1
        self.waiting.appendleft(group)
        self.num_preemptions += 1

    # ---- prefix caching -----------------------------------------------------------------------
    def _prefix_hit(self, leader: Sequence, limit: int) -> tuple[list[bytes], list[int]]:
        """Hashes of the leader's full blocks within its first `limit` tokens, and the cached
        blocks of their longest prefix. At least two tokens are left to compute (one would run
        as a decode row; see _chunk_size), or the one a one-token prompt has."""
        if not self.bm.enable_prefix_caching or leader.group.prompt_logprobs is not None:
            return [], []  # prompt logprobs need every prompt position computed
        hashes = self._hashes(leader, limit)[:limit // self.block_size]
        return hashes, self.bm.lookup(hashes[:max(limit - 2, 0) // self.block_size])

    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The sequence's block-hash memo, extended to the full blocks of `num_tokens` tokens
        (each block is hashed once in the sequence's life)."""
        if num_tokens // self.block_size > len(seq.block_hashes):
            seq.block_hashes = chain_hashes(seq.token_ids, self.block_size, seq.block_hashes,
                                            num_tokens)
        return seq.block_hashes

    def _inflight_hashes(self) -> set[bytes]:
        """Hashes of full blocks that admitted sequences have yet to compute."""
        if not self.bm.enable_prefix_caching:
            return set()
        pending: set[bytes] = set()
        for group in self.running:
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING and seq.num_uncomputed > 1:
                    done = seq.num_computed_tokens // self.block_size
                    pending.update(self._hashes(seq, len(seq.token_ids))[done:])
        return pending

    def _publish(self, seq: Sequence) -> None:
        """After a step: publish the hashes of the sequence's newly completed full blocks."""
        done = seq.num_computed_tokens // self.block_size
        if self.bm.enable_prefix_caching and done > seq.cached_blocks:
            self.bm.register(seq, self._hashes(seq, seq.num_computed_tokens)[:done])
            seq.cached_blocks = done
