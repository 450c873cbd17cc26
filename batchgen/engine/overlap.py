"""The overlapped step loop (async scheduling): the device never waits for the host's planning.

Each step's block moves, forward and sampler run on the engine's ForwardQueue. While step t
runs there, the host advances its rows and asks engine/lookahead.py whether step t+1 can be
planned before t's tokens are known. If no row can end in t, t+1 is launched at once (blind:
the device feeds t's tokens into it) and confirmed when they arrive, so the device goes from
step to step without waiting for the host; else, if t+1 was planned ahead and no row ended
once t's tokens are settled into the columns (vector ops, stop codes), it is committed and
launched then. Either way t's results are applied (token lists, logprob records, stop strings,
finishes) while t+1 runs. In any other case t is applied first and the scheduler plans t+1 as
the serial loop does. Every path makes the serial loop's decisions, block operations and
draws, so the outputs are the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol

import numpy as np
import torch

from batchgen.attention.metadata import StepRows
from batchgen.engine.layout import LogitsLayout, step_layout
from batchgen.engine.lookahead import Ahead, Staged, commit, confirm, plan_ahead, stage
from batchgen.engine.output_processor import OutputProcessor, SampleSlots, StepStats
from batchgen.engine.scheduler import Scheduler, StepPlan
from batchgen.engine.sequence import SequenceGroup
from batchgen.model.forward_queue import ForwardQueue
from batchgen.sampling.sampler import SamplerOutput, SamplingColumns

DeviceResult = tuple[torch.Tensor, SamplerOutput | None]


@dataclass(frozen=True)
class TokenFeed:
    """A step's decode inputs from the previous step's draws, read on the device side (the
    previous step is done there by then): its row for slot s reads the token drawn for s."""

    previous: Future[DeviceResult] = field(repr=False)
    slots: np.ndarray = field(repr=False)

    def fill(self, token_ids: np.ndarray) -> None:
        """Write the drawn tokens into a decode-only step's input ids (row i is slot i)."""
        sampled = self.previous.result()[1]
        assert sampled is not None, "a fed step follows a sampling step"
        token_ids[self.slots] = sampled.token_ids


@dataclass
class Feed:
    """Where a stream's groups come from, and whether it may have more."""

    source: Iterator[SequenceGroup]
    more: bool = True


class StepEngine(Protocol):
    """What the loop needs of the engine (engine/engine.py's Engine)."""

    scheduler: Scheduler
    outputs: OutputProcessor

    def next_plan(self, feed: Feed, max_waiting_seqs: int) -> StepPlan | None: ...

    def would_top_up(self, feed: Feed, max_waiting_seqs: int) -> bool: ...

    def columns(self, layout: LogitsLayout, at: SampleSlots) -> SamplingColumns | None: ...

    def device_step(self, plan: StepPlan, rows: StepRows, layout: LogitsLayout,
                    cols: SamplingColumns | None, feed: TokenFeed | None = None
                    ) -> DeviceResult: ...

    def finish(self, layout: LogitsLayout, at: SampleSlots, logits: torch.Tensor,
               sampled: SamplerOutput | None, codes: np.ndarray | None = None) -> StepStats: ...


@dataclass
class InFlight:
    """A launched step: its plan and layout, the samplers' slots, the device's result, and
    whether its rows' bookkeeping (`OutputProcessor.advance`) is done."""

    plan: StepPlan
    layout: LogitsLayout
    at: SampleSlots
    result: Future[DeviceResult] = field(repr=False)
    advanced: bool


class Overlap:
    """The overlapped loop over an engine and its queue."""

    def __init__(self, engine: StepEngine, queue: ForwardQueue) -> None:
        self.engine = engine
        self.queue = queue
        self.batch = engine.scheduler.batch
        self.steps_ahead = 0  # steps launched before the previous one was applied...
        self.steps_blind = 0  # ...of them before its tokens were on the host
        self.steps_dropped = 0  # launched blind, then dropped (a row had ended)

    def steps(self, feed: Feed, max_waiting_seqs: int,
              on_step: Callable[[StepStats], None] | None) -> Iterator[SequenceGroup]:
        """Run every group, yielding each as it finishes, with the next step in flight
        while the host applies this one when it can be planned before this one's tokens
        (launched before them when no row can end)."""
        e, cur = self.engine, None
        while True:
            if cur is None:
                plan = e.next_plan(feed, max_waiting_seqs)
                if plan is None:
                    return
                cur = self.launch(plan)
            elif not cur.advanced:  # its bookkeeping waited for the previous step's tokens
                e.outputs.advance(cur.plan, cur.layout)
            ahead = staged = blind = None
            if not e.would_top_up(feed, max_waiting_seqs):
                ahead = plan_ahead(e.scheduler, cur.at.slots, bool(cur.layout.beam_rows))
            if ahead is not None and (staged := stage(e.scheduler, ahead)) is not None:
                blind = self.launch_blind(staged.plan, cur)
            logits, sampled = cur.result.result()
            codes = e.outputs.settle(cur.at, sampled) if sampled is not None else None
            nxt = self.follow(ahead, staged, blind, codes)
            stats = e.finish(cur.layout, cur.at, logits, sampled, codes)
            if on_step is not None:
                on_step(stats)
            yield from stats.finished
            cur = nxt

    def follow(self, ahead: Ahead | None, staged: Staged | None, blind: InFlight | None,
               codes: np.ndarray | None) -> InFlight | None:
        """The next step once this one's tokens are settled: the blind one if confirmed
        (else waited for and dropped), or the one planned ahead, committed and launched now;
        None for the serial path."""
        scheduler = self.engine.scheduler
        if staged is not None and blind is not None:
            if codes is not None and confirm(scheduler, staged, codes):
                return blind
            blind.result.result()  # it writes K/V: done before anything changes blocks
            self.steps_dropped += 1
            return None
        if ahead is None or codes is None:
            return None
        planned = commit(scheduler, ahead, codes)
        return None if planned is None else self.launch_ahead(planned)

    def launch(self, plan: StepPlan) -> InFlight:
        """Lay out a scheduled step, advance its rows, and queue its device work."""
        e = self.engine
        rows, layout = step_layout(plan, self.batch)
        at = e.outputs.advance(plan, layout)
        cols = e.columns(layout, at)
        return InFlight(plan, layout, at, self.queue.submit(
            partial(e.device_step, plan, rows, layout, cols)), True)

    def launch_ahead(self, plan: StepPlan) -> InFlight:
        """Queue a step planned ahead (decodes only: each row samples its own logits row);
        its rows advance once the previous step is applied (publishing a completed block
        hashes the sequence's token list, which is filled then)."""
        e = self.engine
        self.steps_ahead += 1
        rows, layout = step_layout(plan, self.batch)
        at = SampleSlots(plan.slots, self.batch.rows(plan.slots))
        cols = e.columns(layout, at)
        return InFlight(plan, layout, at, self.queue.submit(
            partial(e.device_step, plan, rows, layout, cols)), False)

    def launch_blind(self, plan: StepPlan, cur: InFlight) -> InFlight:
        """Queue a staged step before `cur`'s tokens are known: the device feeds them into
        its decode rows (no host round trip), and its draws count them (one more token
        generated per row than the columns say yet)."""
        e = self.engine
        self.steps_ahead += 1
        self.steps_blind += 1
        rows, layout = step_layout(plan, self.batch)
        at = SampleSlots(plan.slots, self.batch.rows(plan.slots))
        cols = e.columns(layout, at)
        assert cols is not None, "a staged step samples every row"
        cols = replace(cols, num_generated=cols.num_generated + 1)
        return InFlight(plan, layout, at, self.queue.submit(partial(
            e.device_step, plan, rows, layout, cols, TokenFeed(cur.result, cur.at.slots))),
            False)
