"""A scheduling step: the frozen StepPlan the scheduler hands the engine, and the Draft it
fills while deciding (preemption can still take rows out of a draft)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchgen.engine.sequence import Sequence, SequenceGroup
from batchgen.state.slots import StateOps


@dataclass(frozen=True)
class StepPlan:
    """One step as the scheduler decided it, frozen: the rows (sequences, their batch slots,
    tokens already computed and query lengths, in row order; the first `decode_rows` are
    sample decodes found by vector ops) and the block moves to make before the forward:
    swaps in, swaps out, then copy-on-write copies."""

    seqs: tuple[Sequence, ...] = ()
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_new: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    decode_rows: int = 0
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst) device blocks
    swap_in: tuple[tuple[int, int], ...] = ()  # (host, device)
    swap_out: tuple[tuple[int, int], ...] = ()  # (device, host)
    state_ops: StateOps | None = None  # state moves (swaps, forks, beams); None: no state

    @property
    def scheduled(self) -> bool:
        return bool(self.seqs)


@dataclass
class Draft:
    """The step while it is being decided (preemption can still take rows out of it)."""

    tokens: int  # budget left
    num_seqs: int
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    decode_rows: int = 0
    decode_slots: np.ndarray | None = None  # valid while the batch's `moves`...
    moves: int = -1  # ...is still this
    beam_slots: np.ndarray | None = None  # the beams' decode rows (right after), likewise

    def fits(self, tokens: int, seqs: int) -> bool:
        return tokens <= self.tokens and seqs <= self.num_seqs

    def fits_decode(self, rows: int) -> bool:
        """Whether a decode unit of `rows` one-token rows fits what is left of the step. A
        unit wider than a whole step (a beam group wider than max_num_seqs: its beams decode
        together) fits an empty step, which it then fills alone (the budgets go below 0)."""
        return self.fits(rows, rows) or not self.seqs

    @property
    def full(self) -> bool:
        """No token or sequence budget left (below 0 after a unit wider than the step)."""
        return self.tokens <= 0 or self.num_seqs <= 0

    def take(self, seq: Sequence, n: int) -> None:
        """Schedule `n` query tokens of `seq` in this step."""
        self.seqs.append(seq)
        self.num_new.append(n)
        self.tokens -= n
        self.num_seqs -= 1

    def drop(self, group: SequenceGroup) -> None:
        """Take the group's sequences out of this step, refunding the budget they held."""
        self.decode_rows -= sum(s.group is group for s in self.seqs[:self.decode_rows])
        keep = [(s, n) for s, n in zip(self.seqs, self.num_new) if s.group is not group]
        self.tokens += sum(self.num_new) - sum(n for _, n in keep)
        self.num_seqs += len(self.seqs) - len(keep)
        self.seqs, self.num_new = [s for s, _ in keep], [n for _, n in keep]
