"""One step of every beam group of an engine step: HF beam search groups in one pass per
bank (``engine/beam_batch.py``), diverse groups (HF 4.x group beam search) one by one.

The :class:`BeamStepper` owns the banks (one per beam width, stop-id count and device) and
the rows of the groups in them; a group joins its bank at its first step and leaves it when
it is done. Each group's policy turns its step into operations on its sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.beam import BeamSearchState, step_many
from batchgen.engine.beam_batch import BeamBank
from batchgen.engine.beam_trace import Tables
from batchgen.engine.policy import BeamPolicy, Op
from batchgen.engine.sequence import Sequence, SequenceGroup

__all__ = ["BeamMove", "BeamSpans", "BeamStepper", "Outcome"]

#: each beam group's rows in the step's log-probs: (first row, number of rows)
BeamSpans = dict[SequenceGroup, tuple[int, int]]


@dataclass
class BeamMove:
    """A plain step of one group (W live beams before and after): the next beams in order,
    the beams that give up their blocks to continue another (``(beam, parent)``, in the order
    their blocks change) and each next beam's token."""

    group: SequenceGroup
    beams: list[Sequence]
    adopt: list[tuple[Sequence, Sequence]]
    tokens: list[int]


Outcome = list[Op] | BeamMove


class BeamStepper:
    """Steps the beam groups of a step; the banks of HF beam search state are its own."""

    def __init__(self) -> None:
        self._banks: dict[tuple[int, int, torch.device], BeamBank] = {}

    def reset(self) -> None:
        """A new call: banks of an aborted one are dropped."""
        self._banks.clear()

    def step(self, logprobs: torch.Tensor, spans: BeamSpans, tables: Tables
             ) -> list[Outcome]:
        """Every group's step on its rows of ``logprobs`` (``[rows, V]`` float32), in the
        groups' order: a BeamMove for a plain step, else the group's operations."""
        buckets: dict[tuple[int, int, torch.device], list[SequenceGroup]] = {}
        out: dict[SequenceGroup, Outcome] = {}
        for group, (start, n) in spans.items():
            policy = _policy(group)
            state = policy.state
            if isinstance(state, BeamSearchState):
                buckets.setdefault(state.bank_key(logprobs.device), []).append(group)
            else:  # diverse groups: their own path, one group at a time
                out[group] = policy.update(group, logprobs[start:start + n], tables)
        for key, groups in buckets.items():
            out.update(self._step_bank(key, groups, logprobs, spans, tables))
        return [out[g] for g in spans]

    def _step_bank(self, key: tuple[int, int, torch.device], groups: list[SequenceGroup],
                   logprobs: torch.Tensor, spans: BeamSpans, tables: Tables
                   ) -> dict[SequenceGroup, Outcome]:
        """One pass for the groups sharing a bank: their rows gathered to ``[G, W, V]`` (a
        first step's one row repeated), selection, then each group's outcome."""
        bank = self._banks.get(key)
        if bank is None:
            bank = self._banks[key] = BeamBank(key[0], key[1], key[2])
        w = key[0]
        policies = [_policy(g) for g in groups]
        states: list[BeamSearchState] = [p.state for p in policies]  # type: ignore[misc]
        for s in states:
            if s.bank is None:
                s.join(bank)
        starts = np.fromiter((spans[g][0] for g in groups), np.int64, len(groups))
        singles = [spans[g][1] == 1 < w for g in groups]
        rows = _bank_rows(logprobs, starts, np.array(singles), w)
        stop_fns = [p.stop_fn(g.seqs) for p, g in zip(policies, groups)]
        result = step_many(states, rows, singles, stop_fns)
        plain = np.fromiter((len(g.seqs) == w and p.trace is None and g.seqs[0].stop is None
                             and g.seqs[0].constraint is None
                             for p, g in zip(policies, groups)), bool, len(groups))
        plain &= ~result.done  # the batched path: W beams before and after, no trace, stop
        adopt = _adoptions(result.record.next_parents, plain)  # strings or grammar
        parents, tokens = (result.record.next_parents.tolist(),
                           result.record.next_ids.tolist())
        out: dict[SequenceGroup, Outcome] = {}
        for g, (group, plain_g) in enumerate(zip(groups, plain.tolist())):
            if plain_g:
                old = group.seqs
                beams = [old[p] for p in parents[g]]
                pairs = []
                for j, u in adopt.get(g, ()):
                    pairs.append((old[u], beams[j]))
                    beams[j] = old[u]
                out[group] = BeamMove(group, beams, pairs, tokens[g])
            else:
                out[group] = policies[g].ops(group, states[g].step_of(result, g, []), tables)
        return out

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


def _adoptions(parents: np.ndarray, rows: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """For each chosen row ``g`` of ``parents`` ``[G, W]``: (j, u) pairs, next beam ``j`` (a
    parent's second or later child) continuing in beam ``u`` (a beam without children),
    children in order, childless beams in order (the order the per-group path frees them)."""
    w = parents.shape[1]
    again = np.zeros(parents.shape, bool)
    for j in range(1, w):
        again[:, j] = (parents[:, :j] == parents[:, j:j + 1]).any(1)
    childless = np.stack([~(parents == p).any(1) for p in range(w)], 1)
    g, j = np.nonzero(again & rows[:, None])
    _, u = np.nonzero(childless & rows[:, None])
    out: dict[int, list[tuple[int, int]]] = {}
    for gi, ji, ui in zip(g.tolist(), j.tolist(), u.tolist()):
        out.setdefault(gi, []).append((ji, ui))
    return out


def _policy(group: SequenceGroup) -> BeamPolicy:
    policy = group.policy
    assert isinstance(policy, BeamPolicy), "only beam groups score logits rows"
    return policy
