"""Planning step t+1 before step t's tokens are known (the overlapped engine's scheduler side).

While step t's forward runs, every sequence sampling in it counts one token pending. When, with
that token in, the synchronous scheduler would schedule exactly one decode per running sequence
and nothing else (nothing swapped or prefilling, no beam, fork or copy-on-write, no admission
possible, every row sampling in step t), step t+1 depends on step t's outcome only through
whether a sequence ends. `plan_ahead` decides that and changes nothing; `commit`, once the tokens
are in the columns and no row ended, makes the plan exactly as `Scheduler.schedule` would (the
same block reservation, the same rows, in batch order). Otherwise the engine takes the
synchronous path. Rows whose end only their token decides by Python (stop strings, grammars),
and logits-processor rows (they read the token lists, filled after the launch), are not planned
ahead.

When moreover no row can end in step t at all (no row reaches its max_tokens, none can stop
on a token: ignore_eos and no stop ids) and none is penalised (its counts would miss t's
token), step t+1 can be launched before t's tokens are known: `stage` makes its plan with the
blocks the reservation will hand out (written past the rows' tables, reserving nothing), the
device feeds t's tokens into it, and `confirm` reserves them once t's tokens are in; a step
it refuses (some row did end) is waited for and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchgen.engine.scheduler import Scheduler, StepPlan

_NOT_AHEAD = ("beam", "fork_pending", "cow_check", "stop_strings", "constrained", "controls")


@dataclass(frozen=True)
class Ahead:
    """Step t+1 decided during step t: a decode for each of the batch's `num_rows` rows, valid
    while the batch's `moves` is unchanged (no sequence left)."""

    num_rows: int
    moves: int


def plan_ahead(scheduler: Scheduler, samplers: np.ndarray, beams: bool) -> Ahead | None:
    """Step t+1 as one decode per running sequence, if the scheduler would plan exactly that
    once step t's tokens (of the batch slots `samplers`) are in and no sequence ended; None
    when it might plan anything else. `beams`: step t scores beams (their operations change
    blocks)."""
    b, c, n = scheduler.batch, scheduler.batch.cols, scheduler.batch.num_seqs
    if beams or scheduler.swapped or n == 0 or len(samplers) != n:
        return None  # slots are distinct: every row samples in step t
    pending = c["num_tokens"][:n] + 1 - c["num_computed"][:n]  # one token pending per row
    if not (pending == 1).all():
        return None
    if any(c[name][:n].any() for name in _NOT_AHEAD):
        return None
    tokens, seqs = scheduler.max_num_batched_tokens - n, scheduler.max_num_seqs - n
    if tokens < 0 or seqs < 0 or (scheduler.waiting and tokens > 0 and seqs > 0):
        return None  # not every decode fits, or the scheduler would try an admission
    return Ahead(n, b.moves)


def commit(scheduler: Scheduler, ahead: Ahead, codes: np.ndarray) -> StepPlan | None:
    """The planned step, now that step t's tokens are in the columns with their stop `codes`:
    None if a sequence ends (the scheduler decides then) or a block would be missing (its
    preemption order decides); else the decode rows' blocks are reserved (the scheduler's own
    `grow_decodes`) and the plan made."""
    b, c, kv = scheduler.batch, scheduler.batch.cols, scheduler.kv
    n = ahead.num_rows
    if codes.any() or b.moves != ahead.moves or b.num_seqs != n:
        return None
    computed = c["num_computed"][:n]
    opening = np.flatnonzero(computed // scheduler.block_size >= c["num_blocks"][:n])
    copies: list[tuple[int, int]] = []
    if len(opening):
        if len(opening) > kv.num_free_blocks():
            return None
        kv.grow_decodes(opening, copies)
    return StepPlan(tuple(b.seqs[:n]), np.arange(n, dtype=np.int64), computed.copy(),
                    np.ones(n, np.int64), n, tuple(copies))


@dataclass(frozen=True)
class Staged:
    """Step t+1 planned before step t's tokens: its plan (decode inputs to be fed from t's
    tokens), the slots that open a block and the blocks staged for them."""

    ahead: Ahead
    plan: StepPlan
    opening: np.ndarray = field(repr=False)
    blocks: np.ndarray = field(repr=False)


def stage(scheduler: Scheduler, ahead: Ahead) -> Staged | None:
    """The planned step, before step t's tokens are known, when no row can end in step t
    and none is penalised; None otherwise (or when its blocks would evict cached ones)."""
    b, c, n = scheduler.batch, scheduler.batch.cols, ahead.num_rows
    if c["penalized"][:n].any() or may_end(scheduler, n):
        return None
    computed = c["num_computed"][:n]
    opening = np.flatnonzero(computed // scheduler.block_size >= c["num_blocks"][:n])
    blocks = scheduler.kv.stage_decodes(opening)
    if blocks is None:
        return None
    plan = StepPlan(tuple(b.seqs[:n]), np.arange(n, dtype=np.int64), computed.copy(),
                    np.ones(n, np.int64), n)
    return Staged(ahead, plan, opening, blocks)


def may_end(scheduler: Scheduler, n: int) -> bool:
    """Whether a row of the batch's first `n` can end with the token it is drawing (stop.py's
    rules: its max_tokens, or from min_tokens on EOS unless ignore_eos, or a stop id)."""
    b, c = scheduler.batch, scheduler.batch.cols
    generated = c["num_tokens"][:n] - c["num_prompt"][:n] + 1  # counting that token
    by_token = (b.stop_ids[:n] >= 0).any(axis=1)
    if len(b.eos_ids):
        by_token |= ~c["ignore_eos"][:n]
    return bool(((generated >= c["max_tokens"][:n])
                 | ((generated >= c["min_tokens"][:n]) & by_token)).any())


def confirm(scheduler: Scheduler, staged: Staged, codes: np.ndarray) -> bool:
    """Step t's tokens are in (stop `codes`): if no row ended, reserve the staged step's
    blocks (the scheduler's own `grow_decodes`, which hands out the staged ones) and keep
    it; False to drop it."""
    b, n = scheduler.batch, staged.ahead.num_rows
    if codes.any() or b.moves != staged.ahead.moves or b.num_seqs != n:
        return False
    if len(staged.opening):
        scheduler.kv.grow_decodes(staged.opening, [])
        got = b.block_table[staged.opening, b.cols["num_blocks"][staged.opening] - 1]
        if not np.array_equal(got, staged.blocks):
            raise RuntimeError("a step launched ahead addressed blocks the reservation did "
                               "not give (a scheduling bug)")
    return True
