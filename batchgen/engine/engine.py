"""The step loop: schedule → swap and copy blocks → run → advance → sample → update."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from batchgen.attention.metadata import StepRows
from batchgen.engine.scheduler import Scheduler, SchedulerOutput, StepStats
from batchgen.engine.sequence import SequenceGroup
from batchgen.sampling.grammar import mask_beams
from batchgen.sampling.sampler import RankedLogprobs, Sampler, ranked_logprobs
from batchgen.transfer import to_device


class Runner(Protocol):
    """What the engine needs of a model runner (tests use a fake one, without weights)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...

    def swap_blocks(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]
                    ) -> None: ...

    def execute(self, rows: StepRows) -> torch.Tensor: ...


class Engine:
    """Runs sequence groups to completion: the scheduler decides and applies, the runner
    computes, the sampler draws. Results reach the scheduler keyed by sequence (sampled
    tokens) or by group (beams' log-probabilities): it never sees logits. The engine holds
    no request state of its own."""

    def __init__(self, scheduler: Scheduler, runner: Runner, sampler: Sampler) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler

    def run(self, groups: list[SequenceGroup],
            on_step: Callable[[StepStats], None] | None = None) -> None:
        """Run the groups to completion (all queued at once)."""
        for _ in self.stream(groups, max(sum(len(g.seqs) for g in groups), 1), on_step):
            pass

    def stream(self, groups: Iterable[SequenceGroup], max_waiting_seqs: int,
               on_step: Callable[[StepStats], None] | None = None) -> Iterator[SequenceGroup]:
        """Run groups pulled lazily from `groups`, yielding each as it finishes. Before every
        step the waiting queue is topped up to `max_waiting_seqs` sequences (so the batch
        stays full while only a bounded window of requests is held). An error, an interrupt
        (Ctrl-C) or closing the stream early aborts every group and frees every block."""
        source = iter(groups)
        more, idle = True, 0
        try:
            while True:
                if more:
                    more = self._top_up(source, max_waiting_seqs)
                if not self.scheduler.has_unfinished():
                    return
                out = self.scheduler.schedule()
                if not out.scheduled:
                    self._block_ops(out)  # swaps and copies must not wait for a forward
                    idle += 1
                    if idle > 2:  # a scheduling bug, never a silent spin
                        raise RuntimeError(
                            f"batchgen scheduler made no progress ({len(self.scheduler.waiting)}"
                            f" waiting, {self.scheduler.bm.num_free_blocks()} free blocks)")
                    continue
                idle = 0
                stats = self.step(out)
                if on_step is not None:
                    on_step(stats)
                yield from stats.finished
        except BaseException:  # GeneratorExit too: a stream closed early frees its blocks
            self.scheduler.abort_all()
            raise

    def _top_up(self, source: Iterator[SequenceGroup], max_waiting_seqs: int) -> bool:
        """Queue groups from `source` until `max_waiting_seqs` sequences wait (at least one
        group when none does); False once `source` is exhausted."""
        queue = self.scheduler.waiting
        if len(queue) >= max_waiting_seqs:  # enough already, without counting (every step)
            return True
        waiting = sum(len(g.seqs) for g in queue)
        while waiting < max_waiting_seqs or not self.scheduler.has_unfinished():
            group = next(source, None)
            if group is None:
                return False
            self.scheduler.add(group)
            waiting += len(group.seqs)
        return True

    def _block_ops(self, out: SchedulerOutput) -> None:
        """The step's block moves before anything writes: swaps in, swaps out, then the
        copy-on-write copies (one batched copy each)."""
        self.runner.swap_blocks(out.swap_in, out.swap_out)
        self.runner.copy_blocks(out.copies)

    def step(self, out: SchedulerOutput) -> StepStats:
        """Execute one scheduled step and hand its results back to the scheduler."""
        self._block_ops(out)
        logits = self.runner.execute(out.rows)
        self.scheduler.computed(out)
        sampled = None
        if out.samplers:
            rows = logits
            if out.sample_rows is not None:
                rows = logits[to_device(out.sample_rows, logits.device)]
            cols = self.scheduler.batch.sampling_columns(out.sample_slots, out.sample_index)
            sampled = self.sampler(rows, cols)
        beams = beam_logprobs(logits, out.beam_rows) if out.beam_rows else {}
        prompt = prompt_logprobs(logits, out.prompt_rows) if out.prompt_rows else []
        return self.scheduler.update(out, sampled, beams, prompt)


def beam_logprobs(logits: torch.Tensor, beam_rows: dict[SequenceGroup, dict[Any, int]]
                  ) -> dict[SequenceGroup, torch.Tensor]:
    """Each beam group's float32 log-probabilities, rows in its beam order (one log_softmax
    for the step's beams); a constrained beam's forbidden tokens at -inf."""
    rows = [beam_rows[g][s] for g in beam_rows for s in g.seqs]
    lp = torch.log_softmax(logits[to_device(np.array(rows, np.int64), logits.device)].float(),
                           dim=-1)
    constrained = [s.constraint for g in beam_rows for s in g.seqs]
    if any(c is not None for c in constrained):  # each beam's grammar, after the log_softmax
        at = np.array([j for j, c in enumerate(constrained) if c is not None], np.int64)
        mask_beams(lp, [constrained[j] for j in at.tolist()], at)
    out, at = {}, 0
    for g in beam_rows:
        out[g] = lp[at:at + len(g.seqs)]
        at += len(g.seqs)
    return out


def prompt_logprobs(logits: torch.Tensor, prompt_rows: list[tuple[SequenceGroup, int, int, int]]
                    ) -> list[RankedLogprobs | None]:
    """Raw logprobs of prompt tokens (each row scores the next prompt token), with the top
    `prompt_logprobs` and ranks; all rows of the step in one call."""
    rows, targets, ks = [], [], []
    for group, first, row, count in prompt_rows:
        rows += range(row, row + count)
        targets += group.prompt_token_ids[first:first + count]
        ks += [group.params.prompt_logprobs] * count
    lp = torch.log_softmax(logits[to_device(np.array(rows, np.int64), logits.device)], dim=-1)
    return ranked_logprobs(lp, to_device(np.array(targets, np.int64), lp.device), ks)
