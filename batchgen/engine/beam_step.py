"""One step of every beam group of an engine step: HF beam search groups in one pass per
bank (``engine/beam_batch.py``), diverse groups (HF 4.x group beam search) one by one.

The :class:`BeamStepper` owns the banks (one per beam width, stop-id count and device) and
the rows of the groups in them; a group joins its bank at its first step and leaves it when
it is done. The plain steps of a bank's groups come back as one :class:`BeamMoves` (arrays
and flat lists, no object per group); the other groups' policies turn their step into
operations on their sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np
import torch

from batchgen.engine.beam import BeamSearchState, step_many
from batchgen.engine.beam_batch import BeamBank, SelectResult
from batchgen.engine.beam_trace import Tables
from batchgen.engine.policy import BeamPolicy, Op
from batchgen.engine.sequence import Sequence, SequenceGroup

__all__ = ["BeamMoves", "BeamOutcome", "BeamSpans", "BeamStepper"]

#: each beam group's rows in the step's log-probs: (first row, number of rows)
BeamSpans = dict[SequenceGroup, tuple[int, int]]
_ROW, _FIRST = attrgetter("row"), itemgetter(0)  # a state's bank row; a span's first row


@dataclass
class BeamMoves:
    """The plain steps (W live beams before and after; no trace, stop strings or grammar) of
    one bank's groups: the next beams, ``width`` per group in order, and their tokens; the
    beams that give up their blocks to continue another (``(beam, parent)``: a childless
    beam becomes a parent's second or later child), in the order their blocks change, and
    each pair's group position in the step (to keep that order against other groups' ops)."""

    width: int
    groups: list[SequenceGroup]
    beams: list[Sequence]
    tokens: np.ndarray
    adopt: list[tuple[Sequence, Sequence]]
    adopt_at: np.ndarray


@dataclass
class BeamOutcome:
    """A step of the beam groups: the plain ones' moves (a BeamMoves per bank), and the
    others' operations with their group's position in the step, in that order."""

    moves: list[BeamMoves] = field(default_factory=list)
    ops: list[tuple[int, list[Op]]] = field(default_factory=list)


class BeamStepper:
    """Steps the beam groups of a step; the banks of HF beam search state are its own."""

    def __init__(self) -> None:
        self._banks: dict[tuple[int, int, torch.device], BeamBank] = {}

    def reset(self) -> None:
        """A new call: banks of an aborted one are dropped."""
        self._banks.clear()

    def step(self, logprobs: torch.Tensor, spans: BeamSpans, tables: Tables) -> BeamOutcome:
        """Every group's step on its rows of ``logprobs`` (``[rows, V]`` float32)."""
        buckets: dict[tuple[int, int, torch.device], list[int]] = {}
        groups = list(spans)
        out = BeamOutcome()
        for i, group in enumerate(groups):
            state = group.policy.state
            if isinstance(state, BeamSearchState):
                buckets.setdefault(state.bank_key(logprobs.device), []).append(i)
            else:  # diverse groups: their own path, one group at a time
                start, n = spans[group]
                out.ops.append((i, _policy(group).update(group, logprobs[start:start + n],
                                                         tables)))
        for key, at in buckets.items():
            self._step_bank(key, [groups[i] for i in at], np.array(at, np.int64), logprobs,
                            spans, tables, out)
        out.ops.sort(key=lambda pair: pair[0])
        return out

    def _step_bank(self, key: tuple[int, int, torch.device], groups: list[SequenceGroup],
                   at: np.ndarray, logprobs: torch.Tensor, spans: BeamSpans, tables: Tables,
                   out: BeamOutcome) -> None:
        """One pass for the groups sharing a bank (``at``: their positions in the step):
        their rows as ``[G, W, V]`` (a first step's one row repeated), selection, then the
        plain steps as one BeamMoves and the others' operations."""
        bank = self._banks.get(key)
        if bank is None:
            bank = self._banks[key] = BeamBank(key[0], key[1], key[2])
        w, n = key[0], len(groups)
        policies: list[BeamPolicy] = [g.policy for g in groups]  # type: ignore[misc]
        states: list[BeamSearchState] = [p.state for p in policies]  # type: ignore[misc]
        rows = np.fromiter(map(_ROW, states), np.int64, n)
        if (rows < 0).any():  # a first step: the request takes its bank row
            for g in np.flatnonzero(rows < 0).tolist():
                states[g].join(bank)
                rows[g] = states[g].row
        starts = np.fromiter(map(_FIRST, map(spans.__getitem__, groups)), np.int64, n)
        seqs = [g.seqs for g in groups]
        live = np.fromiter(map(len, seqs), np.int64, n)
        singles = (live == 1) & (1 < w)
        # a trace, stop strings or a grammar: the group's step goes through its policy
        special = np.fromiter((p.trace is not None or b[0].stop is not None
                               or b[0].constraint is not None for p, b in zip(policies, seqs)),
                              bool, n)
        stop_fns = {}
        for g in np.flatnonzero(special).tolist():
            if (fn := policies[g].stop_fn(seqs[g])) is not None:
                stop_fns[g] = fn
        result = step_many(states, _bank_rows(logprobs, starts, singles, w), singles,
                           stop_fns, rows)
        plain = ~special & ~result.done & ~singles & (live == w)
        for g in np.flatnonzero(~plain).tolist():
            out.ops.append((int(at[g]), policies[g].ops(groups[g], states[g].step_of(
                result, g, []), tables)))
        if plain.any():
            out.moves.append(_moves(w, plain, groups, seqs, at, result))


def _moves(w: int, plain: np.ndarray, groups: list[SequenceGroup], seqs: list[list[Sequence]],
           at: np.ndarray, result: SelectResult) -> BeamMoves:
    """The plain groups' next beams by array ops over the flattened old beams: next beam
    ``j`` of a group is its parent, or, for a parent's second or later child, the childless
    beam that continues it (children in order, childless beams in order: the order the
    per-group path frees them)."""
    idx = np.flatnonzero(plain)
    parents = result.record.next_parents[idx]
    base = np.arange(len(idx))[:, None] * w
    nxt = base + parents
    g, j, u = _adoptions(parents)
    old = list(chain.from_iterable(seqs[i] for i in idx.tolist()))
    children = (g * w + u).tolist()
    pairs = list(zip(_pick(old, children), _pick(old, nxt[g, j].tolist())))
    nxt[g, j] = g * w + u
    return BeamMoves(w, [groups[i] for i in idx.tolist()], _pick(old, nxt.ravel().tolist()),
                     result.record.next_ids[idx].ravel(), pairs, at[idx][g])


def _pick(items: list[Sequence], index: list[int]) -> list[Sequence]:
    """``[items[i] for i in index]``, in C."""
    if len(index) < 2:
        return [items[i] for i in index]
    return list(itemgetter(*index)(items))


def _bank_rows(logprobs: torch.Tensor, starts: np.ndarray, singles: np.ndarray, w: int
               ) -> torch.Tensor:
    """The groups' rows as ``[G, W, V]``: a view when they are the step's rows in order
    (groups past their first step, as ``beam_logprobs`` lays them out), else gathered
    (a first step's one row repeated)."""
    g, first = len(starts), int(starts[0])
    if not singles.any() and int(starts[-1]) - first == (g - 1) * w and (
            g < 3 or (np.diff(starts) == w).all()):
        return logprobs[first:first + g * w].view(g, w, -1)
    idx = starts[:, None] + np.arange(w)[None, :] * ~singles[:, None]
    return logprobs[torch.from_numpy(idx).to(logprobs.device)]


def _adoptions(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of ``parents`` ``[G, W]``: the (g, j, u) triples, next beam ``j`` of row ``g`` (a
    parent's second or later child) continuing in beam ``u`` (a beam without children),
    children in order, childless beams in order, rows in order."""
    w = parents.shape[1]
    earlier = np.tri(w, k=-1, dtype=bool)  # [j, i]: i < j
    again = ((parents[:, :, None] == parents[:, None, :]) & earlier).any(2)
    childless = ~(parents[:, :, None] == np.arange(w)[None, None, :]).any(1)
    g, j = np.nonzero(again)
    _, u = np.nonzero(childless)  # as many per row as its second children: same row order
    return g, j, u


def _policy(group: SequenceGroup) -> BeamPolicy:
    policy = group.policy
    assert isinstance(policy, BeamPolicy), "only beam groups score logits rows"
    return policy
