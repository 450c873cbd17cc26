"""Continuous batching: the Scheduler owns every request from admission to finish.

Each step it picks which sequences run and how many query tokens each: decodes first (a beam
group's live beams all together or not at all, since one beam step needs all their rows),
then chunked prefills, within `max_num_seqs` and `max_num_batched_tokens`; then it admits
waiting groups in input order while free blocks allow. When a running sequence cannot get a
block, the newest running group is preempted: swapped out to the host pool when
`preemption_mode="swap"` and the pool has room for all its blocks (its samples or beams as a
unit; they come back, before any new admission, once the device pool has room), else by
recompute (its blocks freed, its tokens recomputed later). Neither changes outputs.

Decoding samples, the bulk of every step, are found, reserved and described by vector ops
over the persistent batch's columns (a block only for rows that open one or may share one
after a fork); Python runs per group or row only for beams, prefill chunks, admissions,
preemption, and when the decodes do not all fit the step (then the groups' order decides).

After the forward, `computed` advances the rows (vector ops), publishes full blocks to the
prefix cache and forks waiting siblings; `update` applies the sampler's tokens to the whole
batch at once (stop checks on columns, per-row Python only for stop strings and finished
rows) and the beam groups' operations. It is the only writer of Sequence state, of the
persistent batch's membership and of the BlockManager.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from batchgen.attention.metadata import StepRows
from batchgen.engine.batch import PersistentBatch
from batchgen.engine.policy import Append, Fork, Free, Op, SetSeqs
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from batchgen.kv.block_manager import BlockManager, PoolExhausted, blocks_for, chain_hashes
from batchgen.log import logger
from batchgen.sampling.sampler import RankedLogprobs, SamplerOutput
from batchgen.sampling.stop import EOS_STOP, GOES_ON, ID_STOP, finish_of


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
class SchedulerOutput:
    """The step's work: scheduled sequences with their query lengths (row order), the COW block
    copies to make first, and (once scheduling is done) the runner's rows and who reads which
    logits row."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), first
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), then
    rows: StepRows | None = None
    samplers: list[Sequence] = field(default_factory=list)  # sequences that draw a token...
    sample_rows: np.ndarray | None = None  # ...from these logits rows (None: row i ↔ i)
    sample_slots: np.ndarray | None = None  # their batch slots (known after forks)...
    sample_index: np.ndarray | slice | None = None  # ...as an index of the batch's columns
    beam_rows: dict[SequenceGroup, dict[Sequence, int]] = field(default_factory=dict)
    # prompt logprobs: (group, first position scored, its logits row, how many rows)
    prompt_rows: list[tuple[SequenceGroup, int, int, int]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    decode_rows: int = 0  # the leading rows scheduled by vector ops: one sample decode each
    decode_slots: np.ndarray | None = None  # their slots, valid while the batch's `moves`...
    moves: int = -1  # ...is still this

    @property
    def scheduled(self) -> bool:
        return bool(self.seqs)


@dataclass
class StepStats:
    """Tokens computed in one step, for the progress bar, and the groups it finished."""

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
        out.seqs.append(seq)
        out.num_new.append(n)
        self.tokens -= n
        self.seqs -= 1


class Scheduler:
    """Owns the waiting queue, the running list (admission order), their sequences and the
    persistent batch's membership."""

    def __init__(self, block_manager: BlockManager, batch: PersistentBatch, max_num_seqs: int,
                 max_num_batched_tokens: int, preemption_mode: str = "recompute") -> None:
        if preemption_mode == "swap" and not block_manager.num_host_blocks:
            raise ValueError("preemption_mode 'swap' needs a host pool (swap_space > 0)")
        self.bm = block_manager
        self.preemption_mode = preemption_mode
        self.swapped: list[SequenceGroup] = []  # swapped out, in admission order
        self.num_swap_outs = self.num_swap_ins = 0
        self.batch = batch
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.prompt_tokens_computed = 0  # prompt positions the model ran (recomputes too)
        self._preempted_now: set[SequenceGroup] = set()
        self._order = 0  # admissions so far: a group's place in the running order
        # Admission leaves a little room so running sequences can grow without preemption.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    def add(self, group: SequenceGroup) -> None:
        """Queue a new group; with several sequences they wait for the leader's prompt."""
        group.fork_pending = len(group.seqs) > 1
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort_all(self) -> None:
        """Drop every group (a failed or interrupted call), empty the batch and free every
        block table, so the next call starts from a whole pool."""
        self.running.clear()
        self.waiting.clear()
        self.swapped.clear()
        self.batch.clear()
        self.bm.free_all()

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step: decodes, then prefill chunks, then admission. Decoding samples are
        selected and reserved by vector ops over the batch's columns when they all fit the
        step; beams, and every decode when they do not, go through the groups in order."""
        out = SchedulerOutput()
        budget = _Budget(self.max_num_batched_tokens, self.max_num_seqs)
        self._preempted_now = set()
        self._swap_in(out)
        beams = [g for g in self.running if g.spec.beam]
        if self._decode_samples(out, budget, beams):
            preempted = self._schedule_decodes(out, budget, beams)
        else:
            preempted = self._schedule_decodes(out, budget, list(self.running))
        preempted |= self._schedule_prefills(out, budget)
        if not preempted and not self.swapped:  # swapped groups come back first
            self._admit(out, budget)
        self._describe(out)
        return out

    def _decode_samples(self, out: SchedulerOutput, budget: _Budget,
                        beams: list[SequenceGroup]) -> bool:
        """Every decoding sample at once, when all of them and the beams' decodes fit the
        step: candidates from the columns, a block reserved only for rows that open one or
        may share one (after a fork). False (nothing scheduled; what was reserved stays, and
        the copies made stay in `out`) to go through the groups in order instead: when the
        pool runs short, their order decides who is preempted."""
        b, c, n = self.batch, self.batch.cols, self.batch.num_seqs
        computed = c["num_computed"][:n]
        ready = (c["num_tokens"][:n] - computed == 1) & ~c["beam"][:n] & ~c["fork_pending"][:n]
        rows = np.flatnonzero(ready)
        units = sum(len(u) for g in beams for u in g.policy.decode_units(g))
        if not budget.fits(len(rows) + units, len(rows) + units):
            return False
        needy = rows[(computed[rows] // self.block_size >= c["num_blocks"][rows])
                     | c["cow_check"][rows]]
        if len(needy) and not self._grow_rows(out, needy):
            return False
        out.seqs += [b.seqs[i] for i in rows.tolist()]
        out.decode_slots, out.moves = rows, b.moves
        out.num_new += [1] * len(rows)
        out.decode_rows = len(rows)
        budget.tokens -= len(rows)
        budget.seqs -= len(rows)
        return True

    def _grow_rows(self, out: SchedulerOutput, needy: np.ndarray) -> bool:
        """A block for each of these slots' next token: a copy where a fork left it sharing
        one, a new one where it opens a block (the chapter's append_token, for all of them
        at once; their table rows written at once). False when the pool runs out (what was
        reserved stays, and the copies made stay in `out`)."""
        b, c, bs = self.batch, self.batch.cols, self.block_size
        cow = c["cow_check"][needy]
        try:
            for slot in needy[cow].tolist():
                seq, pos = b.seqs[slot], int(c["num_computed"][slot])
                out.copies += self.bm.reserve([(seq, pos, 1)])
                b.write_table(seq, self.bm.table(seq), pos // bs)
                c["cow_check"][slot] = False
            opening = needy[~cow]  # each opens exactly one block: its table's next
            if len(opening):
                blocks = self.bm.append_tokens([b.seqs[i] for i in opening.tolist()],
                                               c["num_computed"][opening].tolist())
                at = c["num_blocks"][opening]
                b.block_table[opening, at] = blocks
                c["num_blocks"][opening] = at + 1
        except PoolExhausted:
            return False
        return True

    def _schedule_decodes(self, out: SchedulerOutput, budget: _Budget,
                          groups: list[SequenceGroup]) -> bool:
        """One token for every sequence of these groups that is decoding (a beam group's
        live beams together), in order; returns whether any group was preempted for room."""
        preempted = False
        for group in groups:
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
        """Chunks of running sequences with several tokens to compute (prompts, recomputes,
        a leader before its fork), in the groups' order; returns whether any group was
        preempted for room."""
        preempted = False
        for seq in self._prefilling():
            group = seq.group
            if (group in self._preempted_now or budget.tokens == 0 or budget.seqs == 0
                    or seq.status is not SequenceStatus.RUNNING):
                continue
            n = self._chunk_size(self._chunk_limit(group, seq), budget.tokens)
            if n > 0:
                preempted |= self._schedule_unit(group, [seq], [n], out, budget)[1]
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
        """Reserve the sequences' next slots (all or none; copy-on-write included) and schedule
        them, preempting the newest groups while the blocks are not there. Returns (scheduled,
        preempted anything)."""
        appends = [(s, s.num_computed_tokens, n) for s, n in zip(seqs, counts)]
        preempted = False
        while True:
            try:
                copies = self.bm.reserve(appends)
                break
            except PoolExhausted:
                victim = self.running[-1]
                if victim is group and len(self.running) == 1:
                    raise RuntimeError(
                        f"request {group.index} needs {self.bm.blocks_needed(appends)} more KV "
                        f"blocks while running alone and only {self.bm.num_free_blocks()} of "
                        f"{self.bm.num_blocks} are free: it would preempt itself forever (its "
                        "admission bound is wrong)") from None
                self._preempt(victim, out, budget)
                preempted = True
                if victim is group:
                    return False, True
        out.copies += copies
        for seq, cur, n in appends:
            self.batch.write_table(seq, self.bm.table(seq), cur // self.block_size)
            self.batch.cols["cow_check"][seq.slot] = False
            budget.take(out, seq, n)
        return True, preempted

    def _admit(self, out: SchedulerOutput, budget: _Budget) -> None:
        """Admit waiting groups in order while tokens, sequence slots and blocks allow: the
        leader starts, from its cached prefix blocks if prefix caching has them."""
        inflight: set[bytes] | None = None
        while self.waiting and budget.tokens > 0 and budget.seqs > 0:
            if inflight is None:
                inflight = self._inflight_hashes()
            group = self.waiting[0]
            plan = self._admission(group, budget, inflight)
            if plan is None:
                break
            hashes, hit, start, n = plan
            self.waiting.popleft()
            self.running.append(group)
            group.order, self._order = self._order, self._order + 1
            leader = group.leader
            self.bm.allocate(leader, start + n, hit)
            if group.num_cached_tokens is None:
                group.num_cached_tokens = start
            leader.status = SequenceStatus.RUNNING
            leader.num_computed_tokens = start
            leader.cached_blocks = len(hit)
            self.batch.enter(leader, self.bm.table(leader))
            inflight.update(hashes[len(hit):])
            budget.take(out, leader, n)

    def _admission(self, group: SequenceGroup, budget: _Budget, inflight: set[bytes]
                   ) -> tuple[list[bytes], list[int], int, int] | None:
        """Whether the group's leader can start now: (its block hashes, its prefix-cache hit,
        its first position, its first chunk's length), or None. A group waits one step when
        the next block it needs is being computed by a group admitted before."""
        if budget.tokens <= 0 or budget.seqs <= 0:
            return None
        leader = group.leader
        limit = self._chunk_limit(group, leader, computed=0)
        hashes, hit = self._prefix_hit(leader, limit)
        if len(hit) < len(hashes) and hashes[len(hit)] in inflight:
            return None  # computed this step by an earlier request: hit it next step instead
        start = len(hit) * self.block_size
        n = self._chunk_size(limit - start, budget.tokens)
        headroom = self.watermark_blocks if self.running else 0
        if n == 0 or not self.bm.can_allocate(start + n, hit, headroom):
            return None
        return hashes, hit, start, n

    def _describe(self, out: SchedulerOutput) -> None:
        """The runner's rows and who reads each logits row: the leading decode rows by vector
        ops (each samples its own row); for the others, samplers draw from a row's last
        logits (an n > 1 leader's last prompt row serves every sample), beams hand theirs to
        their policy, and a request with prompt logprobs keeps the rows of its prompt chunks
        that score the prompt tokens it asked for."""
        k, c = out.decode_rows, self.batch.cols
        fresh = out.moves == self.batch.moves  # no slot moved since the decodes were found
        first = k if fresh else 0
        slots = np.fromiter((s.slot for s in out.seqs[first:]), np.int64, len(out.seqs) - first)
        if fresh:
            slots = np.concatenate((out.decode_slots, slots)) if len(slots) else out.decode_slots
        head = slots[:k]
        starts, num_logits = [c["num_computed"][head]], [np.ones(k, np.int64)]
        tokens = [c["last_token"][head]]
        out.num_prompt_tokens = int(np.count_nonzero(starts[0] < c["num_prompt"][head]))
        out.samplers = out.seqs[:k]
        sample_rows: list[int] = []  # of the samplers after the first k
        row = k
        for seq, n in zip(out.seqs[k:], out.num_new[k:]):
            group, token_ids = seq.group, seq.token_ids
            start = seq.num_computed_tokens
            end = start + n
            want = end == len(token_ids)
            p = group.num_prompt_tokens
            rows = int(want)
            if group.prompt_logprobs is not None:
                rows = self._prompt_rows(out, group, start, end, row) or rows
            starts.append([start])
            num_logits.append([rows])
            tokens.append(token_ids[start:end])
            if start < p:
                out.num_prompt_tokens += min(end, p) - start
            row += rows
            if not want:
                continue
            samplers = group.policy.samples_from(group, seq)
            if samplers:
                out.samplers += samplers
                sample_rows += [row - 1] * len(samplers)
            else:
                out.beam_rows.setdefault(group, {})[seq] = row - 1
        out.rows = StepRows(slots, np.concatenate(starts).astype(np.int64, copy=False),
                            np.array(out.num_new, np.int64),
                            np.concatenate(num_logits).astype(np.int64, copy=False),
                            np.concatenate(tokens).astype(np.int64, copy=False),
                            self.batch.block_table)
        identity = row == k and not sample_rows
        out.sample_rows = None if identity else np.concatenate(
            (np.arange(k), np.array(sample_rows, np.int64)))

    @staticmethod
    def _prompt_rows(out: SchedulerOutput, group: SequenceGroup, start: int, end: int, row: int
                     ) -> int:
        """The logits rows a chunk [start, end) of a prompt-logprobs leader keeps: its tail from
        the first position that scores a wanted prompt token (position i scores token i + 1;
        tokens before `prompt_logprobs_start` are not wanted) to its end; 0 if none is."""
        first = max(start, group.params.prompt_logprobs_start - 1)
        last = min(end, group.num_prompt_tokens - 1)  # positions [first, last) score tokens
        if first >= last:
            return 0
        out.prompt_rows.append((group, first + 1, row, last - first))
        return end - first

    # ---- after the forward ----------------------------------------------------------------------
    def computed(self, out: SchedulerOutput) -> None:
        """The step's forward ran: advance the rows' computed tokens (one vector op), publish
        the full blocks they completed to the prefix cache, fork the siblings of leaders that
        finished their prompt, and find the sample rows' slots."""
        rows, k = out.rows, out.decode_rows
        self.batch.cols["num_computed"][self.batch.rows(rows.slots)] += rows.num_new
        self.prompt_tokens_computed += out.num_prompt_tokens
        if self.bm.enable_prefix_caching:  # only rows that completed a block
            ends, bs = rows.starts + rows.num_new, self.block_size
            for j in np.flatnonzero(ends // bs > rows.starts // bs).tolist():
                self._publish(out.seqs[j])
        forking = {s.group: None for s in out.seqs[k:] if s.group.fork_pending
                   and s.group.leader.num_computed_tokens >= s.group.num_prompt_tokens}
        for group in forking:
            self._fork_siblings(group)
        rest = np.fromiter((s.slot for s in out.samplers[k:]), np.int64,
                           len(out.samplers) - k)
        out.sample_slots = rows.slots[:k] if not len(rest) else np.concatenate(
            (rows.slots[:k], rest))
        out.sample_index = self.batch.rows(out.sample_slots)

    def update(self, out: SchedulerOutput, sampled: SamplerOutput | None,
               beam_logprobs: dict[SequenceGroup, torch.Tensor],
               prompt_logprobs: list[RankedLogprobs | None]) -> StepStats:
        """Apply one step's results: prompt logprobs (the entries of `out.prompt_rows`, in
        order), the samplers' tokens, then each beam group's operations; finished groups
        leave the running list."""
        self._store_prompt_logprobs(out, prompt_logprobs)
        done: dict[SequenceGroup, None] = {}
        new_tokens = 0
        if sampled is not None and out.samplers:
            new_tokens = self._apply_samples(out, sampled, done)
        for group, lps in beam_logprobs.items():
            new_tokens += self._apply(group.policy.update(group, lps))
            done[group] = None
        finished = [g for g in done if g.finished]
        if finished:
            gone = set(finished)
            self.running = [g for g in self.running if g not in gone]
        return StepStats(out.num_prompt_tokens, new_tokens, finished)

    def _store_prompt_logprobs(self, out: SchedulerOutput,
                               prompt_logprobs: list[RankedLogprobs | None]) -> None:
        entries = iter(prompt_logprobs)
        for group, first, _, count in out.prompt_rows:
            for pos in range(first, first + count):
                entry = next(entries)
                if group.prompt_logprobs[pos] is None:  # a recompute scores them again
                    group.prompt_logprobs[pos] = entry

    def _apply_samples(self, out: SchedulerOutput, res: SamplerOutput,
                       done: dict[SequenceGroup, None]) -> int:
        """Every sampler's new token at once: the batch's columns by vector ops, the token
        lists in one loop, stop checks on columns (stop-string rows through their checkers);
        per-row Python for rows that finish or asked for logprobs. Returns the tokens added."""
        slots, tokens, index = out.sample_slots, res.token_ids, out.sample_index
        seqs = out.samplers
        self.batch.append(slots, tokens, res.logprobs, index)
        token_list = tokens.tolist()
        for seq, t in zip(seqs, token_list):
            seq.token_ids.append(t)
        codes = self.batch.stop_codes(slots, tokens, index)
        reasons: dict[int, tuple[str, int | str | None]] = {}
        strings = self.batch.cols["stop_strings"][index]
        for j in np.flatnonzero(strings).tolist():  # the checker decides these rows alone
            reason = seqs[j].stop.append(token_list[j], seqs[j].num_generated)
            codes[j] = 0
            if reason[0] is not None:
                reasons[j] = reason
        if res.top is not None:
            for j, row in enumerate(res.top.rows.tolist()):
                seqs[row].logprobs.append((res.top, j))
        constrained = self.batch.cols["constrained"][index]
        if constrained.any():
            self._advance_grammars(seqs, token_list, np.flatnonzero(constrained), codes, reasons)
        for j in sorted([*np.flatnonzero(codes).tolist(), *reasons]):
            seq = seqs[j]
            if j in reasons:
                self._finish(seq, *reasons[j])
            else:
                seq.stop_token = int(codes[j]) in (EOS_STOP, ID_STOP)
                self._finish(seq, *finish_of(int(codes[j]), token_list[j]))
            done[seq.group] = None
        return len(token_list)

    @staticmethod
    def _advance_grammars(seqs: list[Sequence], tokens: list[int], rows: np.ndarray,
                          codes: np.ndarray, reasons: dict[int, tuple[str, int | str | None]]
                          ) -> None:
        """Each constrained sampler's matcher accepts its new token. A matcher that ended on
        its stop token ends the sequence ("stop", also under min_tokens or ignore_eos, and
        before a stop string or max_tokens); a rejected token (a logits processor revived a
        masked one) ends it too, with a warning."""
        for j in rows.tolist():
            c = seqs[j].constraint
            if not c.accept(tokens[j]):
                logger.warning("request %d: its grammar rejected token %d; the sample ends "
                               "there", seqs[j].group.index, tokens[j])
                codes[j], reasons[j] = GOES_ON, ("stop", None)
            elif c.terminated:
                codes[j] = EOS_STOP
                reasons.pop(j, None)

    def _apply(self, ops: list[Op]) -> int:
        """Carry out a beam group's operations; returns the number of tokens appended."""
        slots, tokens = [], []
        for op in ops:
            match op:
                case Append(seq, token):
                    seq.token_ids.append(token)
                    if seq.constraint is not None:  # a rejected token: an impossible beam
                        seq.constraint.accept(token)
                    if seq.stop is not None:  # keeps its text for would_stop
                        seq.stop.append(token, seq.num_generated)
                    slots.append(seq.slot)
                    tokens.append(token)
                case Fork(parent, child, num_tokens):
                    self._fork(parent, child, num_tokens)
                case Free(seq):
                    self._finish(seq, None, None)
                case SetSeqs(group, seqs):
                    group.seqs = seqs
                    for j, s in enumerate(seqs):
                        s.index = j
        if slots:
            self.batch.append(np.array(slots, np.int64), np.array(tokens, np.int64), None)
        return len(tokens)

    def _finish(self, seq: Sequence, reason: str | None, stop_reason: int | str | None) -> None:
        """The sequence ends: its slot and blocks go back now, so the next step can reuse
        them."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        self._free_blocks(seq)

    def _free_blocks(self, seq: Sequence) -> list[int]:
        """Free the sequence's slot and block table if it has them; returns its blocks."""
        if seq.batch is not None:
            self.batch.remove(seq)
        if not self.bm.has_table(seq):
            return []
        table = self.bm.table(seq)
        self.bm.free_seq(seq)
        return table

    def _fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """`child` shares the parent's blocks (and block hashes) for `num_tokens` tokens and
        takes a slot."""
        self.bm.fork(parent, child, num_tokens)
        shared = num_tokens // self.block_size
        child.num_computed_tokens = num_tokens
        child.block_hashes = parent.block_hashes[:shared]
        child.cached_blocks = min(parent.cached_blocks, shared)
        child.status = SequenceStatus.RUNNING
        self.batch.enter(child, self.bm.table(child))
        cow = self.batch.cols["cow_check"]  # both may now write into a shared block
        cow[parent.slot] = cow[child.slot] = True

    def _fork_siblings(self, group: SequenceGroup) -> None:
        """The leader has the prompt's K/V: every waiting sibling shares its prompt blocks
        and computes only its own tokens from here."""
        leader = group.leader
        group.fork_pending = False
        self.batch.cols["fork_pending"][leader.slot] = False
        for seq in group.seqs:
            if seq is not leader and not seq.finished:
                self._fork(leader, seq, group.num_prompt_tokens)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, budget: _Budget) -> None:
        """Preempt a running group for room: swap it out when the mode is "swap" and the host
        pool has a block for each of its blocks, else recompute it later. Either way it
        leaves this step's schedule."""
        self.running.remove(group)
        self._preempted_now.add(group)
        self._unschedule(group, out, budget)
        held = [s for s in group.seqs if self.bm.has_table(s)]
        if self.preemption_mode == "swap" and self.bm.can_swap_out(held):
            self._swap_out(group, held, out)
        else:
            self._recompute(group, out)
        self.num_preemptions += 1

    def _unschedule(self, group: SequenceGroup, out: SchedulerOutput, budget: _Budget) -> None:
        """Take the group's sequences out of this step, refunding the budget they held."""
        out.decode_rows -= sum(s.group is group for s in out.seqs[:out.decode_rows])
        keep = [(s, n) for s, n in zip(out.seqs, out.num_new) if s.group is not group]
        for s, n in zip(out.seqs, out.num_new):
            if s.group is group:
                budget.tokens += n
                budget.seqs += 1
        out.seqs, out.num_new = [s for s, _ in keep], [n for _, n in keep]

    def _recompute(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Recompute preemption: free the group's blocks and requeue it at the front; its
        sequences will wait for the leader to recompute the prompt and fork again."""
        freed: set[int] = set()
        for seq in group.seqs:
            freed.update(self._free_blocks(seq))
            seq.num_computed_tokens = 0
            seq.cached_blocks = 0  # the memo of hashes stays valid: the tokens are unchanged
            if not seq.finished:
                seq.status = SequenceStatus.WAITING
        out.copies = [(s, d) for s, d in out.copies if d not in freed]
        group.fork_pending = len(group.unfinished()) > 1
        self.waiting.appendleft(group)

    def _swap_out(self, group: SequenceGroup, held: list[Sequence], out: SchedulerOutput
                  ) -> None:
        """Swap preemption: the sequences leave the batch (keeping their computed tokens) and
        their tables move to the host pool, shared blocks once. A copy-on-write this step made
        into one of their blocks is dropped, and that block is swapped out from the copy's
        source instead (the copy would only run after the swap)."""
        for seq in held:
            self.batch.remove(seq)
            seq.status = SequenceStatus.SWAPPED
        cow = {d: s for s, d in out.copies}
        moved = self.bm.swap_out(held)
        out.swap_out += [(cow.get(d, d), h) for d, h in moved]
        gone = {d for d, _ in moved}
        out.copies = [(s, d) for s, d in out.copies if d not in gone]
        bisect.insort(self.swapped, group, key=_admission_order)
        self.num_swap_outs += 1

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Swapped groups come back, oldest admission first and before any new one, while the
        device pool has room for all their blocks (beside running groups, also a block per
        sequence to grow and the admission watermark); none overtakes one that does not fit.
        They rejoin the running list at their old place and can decode this step."""
        while self.swapped:
            group = self.swapped[0]
            held = [s for s in group.seqs if self.bm.is_swapped(s)]
            headroom = self.watermark_blocks + len(held) if self.running else 0
            if not self.bm.can_swap_in(held, headroom):
                return
            self.swapped.pop(0)
            out.swap_in += self.bm.swap_in(held)
            cow = self.batch.cols["cow_check"]
            for seq in held:
                seq.status = SequenceStatus.RUNNING
                self.batch.enter(seq, self.bm.table(seq))
                cow[seq.slot] = True  # its blocks may be shared: the next write checks
            bisect.insort(self.running, group, key=_admission_order)
            self.num_swap_ins += 1

    # ---- prefix caching -----------------------------------------------------------------------
    def _prefix_hit(self, leader: Sequence, limit: int) -> tuple[list[bytes], list[int]]:
        """Hashes of the leader's full blocks within its first `limit` tokens, and the cached
        blocks of their longest prefix. At least two tokens are left to compute (one would run
        as a decode row; see _chunk_size), or the one a one-token prompt has; with prompt
        logprobs, every position from `prompt_logprobs_start - 1` on is computed (and only
        the blocks before it are hashed: admission waits for no block the hit cannot use)."""
        if not self.bm.enable_prefix_caching:
            return [], []
        hashes = self._hashes(leader, limit)[:limit // self.block_size]
        usable = max(limit - 2, 0)
        if leader.group.prompt_logprobs is not None:  # the logprob of token s needs token s-1
            usable = min(usable, max(leader.group.params.prompt_logprobs_start - 1, 0))
            hashes = hashes[:usable // self.block_size]  # never waits for a block it can't use
        return hashes, self.bm.lookup(hashes[:usable // self.block_size])

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
        c, n = self.batch.cols, self.batch.num_seqs
        for i in np.flatnonzero(c["num_tokens"][:n] - c["num_computed"][:n] > 1).tolist():
            seq = self.batch.seqs[i]
            done = seq.num_computed_tokens // self.block_size
            pending.update(self._hashes(seq, len(seq.token_ids))[done:])
        return pending

    def _publish(self, seq: Sequence) -> None:
        """After a step: publish the hashes of the sequence's newly completed full blocks."""
        done = seq.num_computed_tokens // self.block_size
        if self.bm.enable_prefix_caching and done > seq.cached_blocks:
            self.bm.register(seq, self._hashes(seq, seq.num_computed_tokens)[:done])
            seq.cached_blocks = done


def _admission_order(group: SequenceGroup) -> int:
    return group.order
