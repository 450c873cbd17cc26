"""The step loop: schedule → COW copies → step metadata → packed forward → sample → update."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.attention.metadata import SeqChunk, StepMetadata
from batchgen.engine.beam import BeamStep
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus, sample_seed
from batchgen.kv.block_manager import BlockManager
from batchgen.kv.cache import KVCache
from batchgen.model.runner import ModelRunner
from batchgen.params import SamplingParams
from batchgen.sampling.sampler import Sampler, SamplingRow
from batchgen.sampling.stop import StopChecker

# Steps of fewer tokens (or logits rows) are padded to this many: small-M GEMMs on CPU round
# differently, and padding keeps each row's result independent of what else is in the batch.
MIN_BATCH_ROWS = 16


@dataclass
class StepStats:
    """Tokens computed in one step, for the progress bar."""

    prompt_tokens: int
    output_tokens: int
    finished: list[SequenceGroup]


class Engine:
    """Runs sequence groups to completion on one model, one KV pool and one scheduler."""

    def __init__(self, runner: ModelRunner, cache: KVCache, block_manager: BlockManager,
                 scheduler: Scheduler, sampler: Sampler, tokenizer, eos_token_ids: list[int]
                 ) -> None:
        self.runner = runner
        self.cache = cache
        self.bm = block_manager
        self.scheduler = scheduler
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids or None
        self.prompt_tokens_computed = 0  # prompt positions run through the model (recomputes too)

    # ---- sequences ----------------------------------------------------------------------------
    def new_sequence(self, group: SequenceGroup, index: int, token_ids: list[int]) -> Sequence:
        """Sample `index` of a group, with its own stop state and (if seeded) generator."""
        p = group.params
        gen, stop, logprobs = None, None, None
        if isinstance(p, SamplingParams):
            if p.seed is not None:
                gen = torch.Generator().manual_seed(sample_seed(p.seed, index))
            stop = StopChecker(p, self.eos_token_ids, self.tokenizer, group.prompt_token_ids,
                               group.max_tokens)
            logprobs = [] if p.logprobs is not None else None
        seq = Sequence(group=group, index=index, token_ids=list(token_ids), stop=stop,
                       generator=gen, logprobs=logprobs)
        group.seqs.append(seq)
        return seq

    def add_group(self, group: SequenceGroup) -> None:
        self.new_sequence(group, 0, group.prompt_token_ids)
        self.scheduler.add(group)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, on_step: Callable[[StepStats], None] | None = None) -> None:
        """Step until every added group has finished."""
        idle = 0
        while self.scheduler.has_unfinished():
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                idle += 1
                if idle > 2:  # a scheduling bug, never a silent spin
                    raise RuntimeError("batchgen scheduler made no progress "
                                       f"({len(self.scheduler.waiting)} waiting, "
                                       f"{self.bm.num_free_blocks()} free blocks)")
                continue
            idle = 0
            stats = self.step(sched)
            if on_step is not None:
                on_step(stats)

    def step(self, sched: SchedulerOutput) -> StepStats:
        """Execute one scheduled step and fold its tokens back into the sequences."""
        if sched.copies:
            src, dst = zip(*sched.copies)
            dev = self.cache.pool.device
            self.cache.copy_blocks(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        # Decode rows sorted by context length, then prefill chunks by length: the attention
        # backend's length buckets become contiguous row ranges.
        sched.scheduled.sort(key=lambda s: (s.num_new, s.seq.num_computed_tokens))
        chunks, input_ids, done = [], [], []
        prompt_tokens = 0
        for item in sched.scheduled:
            seq, n = item.seq, item.num_new
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            prompt_tokens += max(0, min(start + n, seq.num_prompt_tokens) - start)
            rows = 0
            if start + n == len(seq.token_ids):  # the chunk reaches the end: sample from it
                group = seq.group
                rows = group.params.n if group.beam is None and not group.forked else 1
                done.append(seq)
            chunks.append(SeqChunk(self.bm.block_tables[seq.seq_id], start, n, rows))
        self.prompt_tokens_computed += prompt_tokens
        meta = StepMetadata.build(chunks, self.bm.block_size, MIN_BATCH_ROWS,
                                  self.cache.scratch_block)
        logits = self.runner.execute(input_ids, meta)
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new
            self.scheduler.cache_computed(item.seq)
        new_tokens = self._update(done, logits) if done else 0
        return StepStats(prompt_tokens, new_tokens, self.scheduler.drop_finished_groups())

    def _update(self, done: list[Sequence], logits: torch.Tensor) -> int:
        """Route each logits row: samples to the sampler, beams to their group's beam step."""
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        beam_rows: dict[SequenceGroup, dict[int, int]] = {}  # group -> {seq_id: logits row}
        row = 0
        for seq in done:
            group = seq.group
            if group.beam is not None:
                beam_rows.setdefault(group, {})[seq.seq_id] = row
                row += 1
            elif not group.forked and group.params.n > 1:  # prompt done: fork the siblings
                sample_seqs.extend(self._fork_samples(seq))
                sample_rows.extend([row] * group.params.n)
                row += group.params.n
            else:
                sample_seqs.append(seq)
                sample_rows.append(row)
                row += 1
        if sample_seqs:
            self._sample(sample_seqs, logits[sample_rows])
        for group, rows in beam_rows.items():  # rows in the group's beam order
            self._beam_step(group, logits[[rows[s.seq_id] for s in group.seqs]])
        return len(sample_seqs) + sum(g.width if not g.done else 0 for g in beam_rows)

    # ---- sampling -----------------------------------------------------------------------------
    def _fork_samples(self, leader: Sequence) -> list[Sequence]:
        """The n-1 siblings share every block of the just-computed prompt (COW on write)."""
        group = leader.group
        for i in range(1, group.params.n):
            child = self.new_sequence(group, i, leader.token_ids)
            self.bm.fork(leader.seq_id, child.seq_id)
            child.num_computed_tokens = leader.num_computed_tokens
            child.block_hashes = list(leader.block_hashes)
            child.cached_blocks = leader.cached_blocks
            child.status = SequenceStatus.RUNNING
        group.forked = True
        return list(group.seqs)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows = [SamplingRow(params=s.group.params, token_ids=s.token_ids,
                            num_prompt_tokens=s.num_prompt_tokens, generator=s.generator,
                            eos_token_id=self.eos_token_ids) for s in seqs]
        out = self.sampler(logits, rows)
        for i, seq in enumerate(seqs):
            self._append(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i])

    def _append(self, seq: Sequence, token: int, logprob: float,
                top: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            seq.logprobs.append(top if top is not None else {token: logprob})
        reason, stop_reason = seq.stop.append(token, seq.num_generated)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.free_seq(seq)

    # ---- beam search --------------------------------------------------------------------------
    def _beam_step(self, group: SequenceGroup, logits: torch.Tensor) -> None:
        """One HF beam step over the group's live beams, then fork / free their block tables."""
        beams = group.seqs
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        step = group.beam.step(logprobs, self._stop_string_fn(group, beams))
        if step.done:
            for seq in beams:
                self.scheduler.free_seq(seq)
            group.done = True
            return
        self._advance_beams(group, beams, step)

    def _advance_beams(self, group: SequenceGroup, beams: list[Sequence], step: BeamStep
                       ) -> None:
        """New beam j = beams[parents[j]] + tokens[j]. The first child of a parent takes over
        its sequence; other children fork its table; parents without children are freed."""
        tokens = [beams[p].token_ids + [t] for p, t in zip(step.parents, step.tokens)]
        taken: set[int] = set()
        new: list[Sequence] = []
        for j, p in enumerate(step.parents):
            parent = beams[p]
            if p in taken:
                child = Sequence(group=group, index=j, token_ids=[], stop=None, generator=None,
                                 status=SequenceStatus.RUNNING,
                                 num_computed_tokens=parent.num_computed_tokens,
                                 block_hashes=list(parent.block_hashes),
                                 cached_blocks=parent.cached_blocks)
                self.bm.fork(parent.seq_id, child.seq_id)
            else:
                taken.add(p)
                child = parent
            new.append(child)
        for p, seq in enumerate(beams):
            if p not in taken:
                self.scheduler.free_seq(seq)
        for j, child in enumerate(new):
            child.index = j
            child.token_ids = tokens[j]
        group.seqs = new
        group.forked = True

    def _stop_string_fn(self, group: SequenceGroup, beams: list[Sequence]):
        """is_stop(parent, token) for stop strings: does the token complete one?"""
        stops = group.params.stop_strings
        if not stops or self.tokenizer is None:
            return None
        p0 = group.num_prompt_tokens
        texts: dict[int, str] = {}

        def is_stop(parent: int, token: int) -> bool:
            gen = beams[parent].token_ids[p0:]
            if parent not in texts:
                texts[parent] = self.tokenizer.decode(gen, skip_special_tokens=True)
            before = texts[parent]
            after = self.tokenizer.decode(gen + [token], skip_special_tokens=True)
            start = max(0, len(before) - max(map(len, stops)) + 1)
            return any(s in after[start:] for s in stops)

        return is_stop
