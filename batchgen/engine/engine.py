"""The step loop: schedule → swap and copy blocks → lay out → run → advance → sample → apply.

Serial by default; overlapped (async scheduling, engine/overlap.py) with a ForwardQueue: there
a step's rows advance first and its block moves, forward and sampler run on the queue."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from operator import attrgetter
from typing import Protocol

import numpy as np
import torch

from batchgen.attention.metadata import StepRows
from batchgen.engine.beam_step import BeamSpans
from batchgen.engine.layout import LogitsLayout, PromptRows, first_scored, step_layout
from batchgen.engine.output_processor import (
    OutputProcessor,
    PromptScores,
    SampleSlots,
    StepStats,
)
from batchgen.engine.overlap import Feed, Overlap, TokenFeed
from batchgen.engine.scheduler import Scheduler, StepPlan
from batchgen.engine.sequence import RowSpec, SequenceGroup
from batchgen.model.forward_queue import ForwardQueue
from batchgen.sampling.grammar import mask_beams
from batchgen.sampling.logprobs_mode import RAW_LOGPROBS, is_processed, reported
from batchgen.sampling.named_logprobs import gather_ids
from batchgen.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingColumns,
    apply_warpers,
    ranked_logprobs,
)
from batchgen.transfer import to_device

_CONSTRAINT = attrgetter("constraint")  # a group's structured-outputs matcher (or None)


class Runner(Protocol):
    """What the engine needs of a model runner (tests use a fake one, without weights)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...

    def swap_blocks(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]
                    ) -> None: ...

    def execute(self, rows: StepRows) -> torch.Tensor: ...


class SpecStep(Protocol):
    """What the engine needs of a speculative decoder (batchgen/speculative): run a plan with
    drafts, or None to run it plainly."""

    def step(self, engine: Engine, plan: StepPlan) -> StepStats | None: ...

    def counters(self) -> tuple[int, int, int]:
        """Drafts, draft tokens and accepted tokens so far."""
        ...


class Engine:
    """Runs sequence groups to completion. Each step the scheduler decides (a frozen plan),
    the runner computes what `step_layout` lays out, the sampler draws, and the output
    processor applies the results; the KVManager carries out every block change. The engine
    holds no request state of its own. With a `queue` (async scheduling) the forward and the
    sampler run on the queue's thread while the host plans the next step (engine/overlap.py);
    the outputs are the same, bit for bit."""

    def __init__(self, scheduler: Scheduler, runner: Runner, sampler: Sampler,
                 outputs: OutputProcessor, queue: ForwardQueue | None = None) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.runner = runner
        self.sampler = sampler
        self.outputs = outputs
        self.overlap = None if queue is None else Overlap(self, queue)
        self.spec: SpecStep | None = None  # speculative decoding (batchgen/speculative), off

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
        (Ctrl-C) or closing the stream early aborts every group and frees every block (once
        the forward in flight, if any, is done)."""
        feed = Feed(iter(groups))
        self.outputs.beams.reset()
        try:
            if self.overlap is None or self.spec is not None:  # speculation runs serially
                yield from self._serial(feed, max_waiting_seqs, on_step)
            else:
                yield from self.overlap.steps(feed, max_waiting_seqs, on_step)
        except BaseException:  # GeneratorExit too: a stream closed early frees its blocks
            try:
                if self.overlap is not None:
                    self.overlap.queue.drain()
            finally:  # (a second Ctrl-C while draining still frees them)
                self.scheduler.abort_all()
            raise

    def _serial(self, feed: Feed, max_waiting_seqs: int,
                on_step: Callable[[StepStats], None] | None) -> Iterator[SequenceGroup]:
        """One step at a time: plan, run, apply."""
        while (plan := self.next_plan(feed, max_waiting_seqs)) is not None:
            stats = self.step(plan)
            if on_step is not None:
                on_step(stats)
            yield from stats.finished

    def next_plan(self, feed: Feed, max_waiting_seqs: int) -> StepPlan | None:
        """Top the queue up, then the scheduler's next step with rows; None once every group
        is done. A plan without rows makes its block moves at once (swaps and copies must
        not wait for a forward); three in a row are a scheduling bug, never a silent spin."""
        for _ in range(3):
            if feed.more:
                feed.more = self._top_up(feed.source, max_waiting_seqs)
            if not self.scheduler.has_unfinished():
                return None
            plan = self.scheduler.schedule()
            if plan.scheduled:
                return plan
            self.block_ops(plan)
        raise RuntimeError(f"batchgen scheduler made no progress ({len(self.scheduler.waiting)}"
                           f" waiting, {self.kv.num_free_blocks()} free blocks)")

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

    def would_top_up(self, feed: Feed, max_waiting_seqs: int) -> bool:
        """Whether the next `next_plan` would pull groups from the source (an overlapped step
        plans ahead only when it would not: the pull waits for this step's results)."""
        queue = self.scheduler.waiting
        if not feed.more or len(queue) >= max_waiting_seqs:
            return False
        return (sum(len(g.seqs) for g in queue) < max_waiting_seqs
                or not self.scheduler.has_unfinished())

    def block_ops(self, plan: StepPlan) -> None:
        """The step's block moves before anything writes: swaps in, swaps out, then the
        copy-on-write copies (one batched copy each)."""
        self.runner.swap_blocks(list(plan.swap_in), list(plan.swap_out))
        self.runner.copy_blocks(list(plan.copies))

    def step(self, plan: StepPlan) -> StepStats:
        """Execute one planned step and apply its results. The rows' bookkeeping (`advance`)
        runs while a GPU's forward does (its kernels are queued by then)."""
        if self.spec is not None and (stats := self.spec.step(self, plan)) is not None:
            return stats  # a pure decode step verified drafts
        rows, layout = step_layout(plan, self.kv.batch)
        self.block_ops(plan)
        logits = self.runner.execute(rows)
        at = self.outputs.advance(plan, layout)
        sampled = self.sample(logits, layout, self.columns(layout, at))
        return self.finish(layout, at, logits, sampled)

    def columns(self, layout: LogitsLayout, at: SampleSlots) -> SamplingColumns | None:
        """What the step's sampler reads (None when no sequence samples)."""
        return self.kv.batch.sampling_columns(at.slots, at.index) if layout.samplers else None

    def sample(self, logits: torch.Tensor, layout: LogitsLayout, cols: SamplingColumns | None
               ) -> SamplerOutput | None:
        """The samplers' draws from their logits rows."""
        if cols is None:
            return None
        picked = logits
        if layout.sample_rows is not None:
            picked = logits[to_device(layout.sample_rows, logits.device)]
        return self.sampler(picked, cols)

    def device_step(self, plan: StepPlan, rows: StepRows, layout: LogitsLayout,
                    cols: SamplingColumns | None, feed: TokenFeed | None = None
                    ) -> tuple[torch.Tensor, SamplerOutput | None]:
        """What the device does for a step of the overlapped loop (its rows advanced before):
        block moves, the forward, the samplers' draws (`feed`: the decode rows' input tokens
        are the previous step's draws)."""
        if feed is not None:
            feed.fill(rows.token_ids)
        self.block_ops(plan)
        logits = self.runner.execute(rows)
        return logits, self.sample(logits, layout, cols)

    def finish(self, layout: LogitsLayout, at: SampleSlots, logits: torch.Tensor,
               sampled: SamplerOutput | None, codes: np.ndarray | None = None) -> StepStats:
        """Score beams and prompt rows, apply the step's results (`codes`: the samplers'
        tokens are settled already) and retire the groups it finished."""
        beams = beam_logprobs(logits, layout.beam_rows) if layout.beam_rows else None
        prompt = (prompt_logprobs(logits, layout.prompt_rows, self.sampler.logprobs_mode)
                  if layout.prompt_rows else ([], []))
        stats = self.outputs.apply(layout, at, sampled, beams, prompt, codes)
        self.scheduler.retire(stats.finished)
        return stats


def beam_logprobs(logits: torch.Tensor, beam_rows: BeamSpans) -> tuple[torch.Tensor, BeamSpans]:
    """The beam groups' float32 log-probabilities (one log_softmax for the step's beams), each
    group's rows in its beam order (its first row and count there); a constrained beam's
    forbidden tokens at -inf."""
    first, count = np.fromiter(chain.from_iterable(beam_rows.values()), np.int64,
                               2 * len(beam_rows)).reshape(-1, 2).T
    at = np.cumsum(count) - count  # each group's first row in the result
    total = int(count.sum())
    lead = bool((first == at).all())
    if lead:  # the beams lead the step's rows, in order: a view, the spans as they are
        picked = logits[:total]
    else:
        picked = logits[to_device(np.repeat(first - at, count) + np.arange(total), logits.device)]
    lp = torch.log_softmax(picked.float(), dim=-1)
    if [*map(_CONSTRAINT, beam_rows)].count(None) < len(beam_rows):  # a group's matcher:
        constrained = [s.constraint for g in beam_rows for s in g.seqs]  # its beams' forks
        idx = np.array([j for j, c in enumerate(constrained) if c is not None], np.int64)
        mask_beams(lp, [constrained[j] for j in idx.tolist()], idx)
    return lp, beam_rows if lead else dict(zip(beam_rows, zip(at.tolist(), count.tolist())))


def prompt_logprobs(logits: torch.Tensor, prompt_rows: tuple[PromptRows, ...],
                    mode: str = RAW_LOGPROBS) -> PromptScores:
    """Logprobs of prompt tokens (each row scores the next prompt token) as `mode` says, with
    the top `prompt_logprobs` and ranks; all rows of the step in one call. Then, per
    PromptRows, the same scores of the ids its request names (vLLM's
    prompt_logprob_token_ids), or None."""
    rows, targets, ks, specs = [], [], [], []
    for p in prompt_rows:
        rows += range(p.row, p.row + p.count)
        targets += p.group.prompt_token_ids[p.first:p.first + p.count]
        ks += [p.group.params.prompt_logprobs] * p.count
        specs += [p.group.spec] * p.count
    picked = logits[to_device(np.array(rows, np.int64), logits.device)]
    if mode == RAW_LOGPROBS:
        scores = torch.log_softmax(picked, dim=-1)
    else:
        raw = picked.float()
        processed = processed_prompt_logits(raw, specs) if is_processed(mode) else None
        values, norm = reported(mode, raw, processed)
        scores = values - norm[:, None]
    return (ranked_logprobs(scores, to_device(np.array(targets, np.int64), picked.device), ks),
            _named_prompt_scores(scores, prompt_rows))


def _named_prompt_scores(scores: torch.Tensor, prompt_rows: tuple[PromptRows, ...]
                         ) -> list[np.ndarray | None]:
    """Per PromptRows (its rows consecutive in `scores`), the scores [count, ids] of the ids
    its request names for those positions (-inf at a pad), or None."""
    out: list[np.ndarray | None] = []
    at = 0
    for p in prompt_rows:
        table = p.group.params.prompt_logprob_token_ids
        first = p.first - first_scored(p.group)
        out.append(None if table is None else gather_ids(
            scores, np.arange(at, at + p.count), table[first:first + p.count]))
        at += p.count
    return out


def processed_prompt_logits(raw: torch.Tensor, specs: list[RowSpec]) -> torch.Tensor:
    """Prompt rows' logits after their request's temperature, top-k, top-p and min-p (the
    distribution a token there would be drawn from; greedy requests' rows stay raw). Penalties
    and logit controls act on generated tokens only, so they are not applied here."""
    sampled = np.array([not s.greedy for s in specs], bool)
    if not sampled.any():
        return raw
    at = np.flatnonzero(sampled)
    p = np.stack([specs[i].params for i in at.tolist()])
    idx = to_device(at, raw.device)
    out = raw.clone()
    out[idx] = apply_warpers(raw[idx], p, to_device(p, raw.device))
    return out
