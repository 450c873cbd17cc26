"""The step loop: schedule → COW copies → step metadata → packed forward → sample → update."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.attention.metadata import SeqChunk, StepMetadata
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus, sample_seed
from batchgen.kv.block_manager import BlockManager
from batchgen.kv.cache import KVCache
from batchgen.model.runner import ModelRunner
from batchgen.sampling.sampler import Sampler, SamplingRow
from batchgen.sampling.stop import StopChecker


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

    # ---- sequences ----------------------------------------------------------------------------
    def new_sequence(self, group: SequenceGroup, index: int, token_ids: list[int]) -> Sequence:
        """Sample `index` of a group, with its own stop state and (if seeded) generator."""
        p = group.params
        gen = None
        if p.seed is not None:
            gen = torch.Generator().manual_seed(sample_seed(p.seed, index))
        stop = StopChecker(p, self.eos_token_ids, self.tokenizer, group.prompt_token_ids,
                           group.max_tokens)
        seq = Sequence(group=group, index=index, token_ids=list(token_ids), stop=stop,
                       generator=gen, logprobs=[] if p.logprobs is not None else None)
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
        chunks, input_ids, sampled = [], [], []
        prompt_tokens = 0
        for item in sched.scheduled:
            seq, n = item.seq, item.num_new
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            prompt_tokens += max(0, min(start + n, seq.num_prompt_tokens) - start)
            done = start + n == len(seq.token_ids)
            rows = 0
            if done:
                rows = seq.group.params.n if not seq.group.forked else 1
                sampled.append(seq)
            chunks.append(SeqChunk(self.bm.block_tables[seq.seq_id], start, n, rows))
        meta = StepMetadata.build(chunks, self.bm.block_size)
        logits = self.runner.execute(input_ids, meta) if meta.num_tokens else None
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new
        finished, new_tokens = self._sample_and_update(sampled, logits) if sampled else ([], 0)
        return StepStats(prompt_tokens, new_tokens, finished)

    def _sample_and_update(self, sampled: list[Sequence], logits: torch.Tensor
                           ) -> tuple[list[SequenceGroup], int]:
        """Sample one token per row; fork n-sample groups whose prompt was just computed."""
        targets: list[Sequence] = []
        for seq in sampled:
            group = seq.group
            if not group.forked:  # prompt done: fork the n-1 siblings (they share its blocks)
                for i in range(1, group.params.n):
                    child = self.new_sequence(group, i, seq.token_ids)
                    self.bm.fork(seq.seq_id, child.seq_id)
                    child.num_computed_tokens = seq.num_computed_tokens
                    child.status = SequenceStatus.RUNNING
                targets.extend(group.seqs)
            else:
                targets.append(seq)
        rows = [SamplingRow(params=s.group.params, token_ids=s.token_ids,
                            num_prompt_tokens=s.num_prompt_tokens, generator=s.generator,
                            eos_token_id=self.eos_token_ids) for s in targets]
        out = self.sampler(logits, rows)
        for i, seq in enumerate(targets):
            self._append(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
        return self.scheduler.drop_finished_groups(), len(targets)

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
