"""The OutputProcessor applies a step's results to the requests, after the forward.

Two calls per step. `advance`: the forward wrote the step's K/V (the KVManager advances the
rows and publishes completed blocks), waiting siblings of a leader that finished its prompt
are forked, and the samplers' slots are found. `apply`: prompt logprobs are stored, the
sampled tokens go into the batch's columns (vector ops) and the sequences' lists (one loop),
stops are checked on the columns (stop-string rows through their checkers, constrained rows'
matchers accept their token), finished sequences give their blocks back, and the beam
groups' steps (the BeamStepper's: a BeamMoves for a bank's plain steps, carried out by array ops and
KVManager.adopt; else their policy's operations, Fork / Append / Free / SetSeqs) are carried
out here. It returns the step's StepStats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.beam_step import BeamMoves, BeamOutcome, BeamSpans, BeamStepper
from batchgen.engine.kv_manager import KVManager
from batchgen.engine.layout import LogitsLayout, first_scored
from batchgen.engine.policy import Append, Fork, Free, Op, SetSeqs
from batchgen.engine.scheduler import StepPlan
from batchgen.engine.sequence import Sequence, SequenceGroup, slots_of
from batchgen.log import logger
from batchgen.sampling.sampler import RankedLogprobs, SamplerOutput
from batchgen.sampling.stop import EOS_STOP, GOES_ON, ID_STOP, finish_of

Reasons = dict[int, tuple[str, int | str | None]]


@dataclass(frozen=True)
class StepStats:
    """Tokens computed in one step, for the progress bar, and the groups it finished."""

    prompt_tokens: int
    output_tokens: int
    finished: list[SequenceGroup]


@dataclass(frozen=True)
class SampleSlots:
    """The samplers' batch slots once the step's forks are made, and their index into the
    batch's columns (a slice when they are slots 0..k-1 in order)."""

    slots: np.ndarray
    index: np.ndarray | slice


class OutputProcessor:
    """Applies results; the KVManager carries out what changes blocks."""

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.batch = kv.batch
        self.beams = BeamStepper()

    def advance(self, plan: StepPlan, layout: LogitsLayout) -> SampleSlots:
        """The step's forward ran: its rows' K/V is computed, leaders that finished their
        prompt fork their waiting siblings (who then take slots), and the samplers' slots
        are known."""
        kv, k = self.kv, plan.decode_rows
        kv.computed(plan.seqs, plan.slots, plan.starts, plan.num_new)
        pending = np.flatnonzero(self.batch.cols["fork_pending"][plan.slots[k:]]) + k
        forking = {s.group: None for s in (plan.seqs[j] for j in pending.tolist())
                   if kv.num_computed(s.group.leader) >= s.group.num_prompt_tokens}
        for group in forking:
            kv.fork_siblings(group)
        rest = slots_of(layout.samplers[k:], len(layout.samplers) - k)
        slots = plan.slots[:k] if not len(rest) else np.concatenate((plan.slots[:k], rest))
        return SampleSlots(slots, self.batch.rows(slots))

    def settle(self, at: SampleSlots, sampled: SamplerOutput) -> np.ndarray:
        """The samplers' tokens into the batch's columns (vector ops), and each row's stop
        code (stop.py's; stop strings and grammars are decided in `apply`). An overlapped
        engine calls it first, to know whether any row ends before it launches the next
        step; `apply` then takes the codes."""
        self.batch.append(at.slots, sampled.token_ids, sampled.logprobs, at.index)
        return self.batch.stop_codes(at.slots, sampled.token_ids, at.index)

    def apply(self, layout: LogitsLayout, at: SampleSlots, sampled: SamplerOutput | None,
              beam_logprobs: tuple[torch.Tensor, BeamSpans] | None,
              prompt_logprobs: PromptScores, codes: np.ndarray | None = None) -> StepStats:
        """Apply one step's results: prompt logprobs (the entries of the layout's prompt
        rows, in order, and the scores of the ids they name), the samplers' tokens (`codes`:
        `settle` already ran), then the beam groups' steps (their log-probs and each group's
        rows in them) as operations."""
        _store_prompt_logprobs(layout, *prompt_logprobs)
        done: dict[SequenceGroup, None] = {}
        new_tokens = 0
        if sampled is not None and layout.samplers:
            if codes is None:
                codes = self.settle(at, sampled)
            new_tokens = self._apply_samples(list(layout.samplers), sampled, codes, at, done)
        if beam_logprobs is not None:
            lps, spans = beam_logprobs
            new_tokens += self._apply_beams(self.beams.step(lps, spans, self.kv.table))
            done.update(dict.fromkeys(spans))
        return StepStats(layout.num_prompt_tokens, new_tokens, [g for g in done if g.finished])

    def _apply_samples(self, seqs: list[Sequence], res: SamplerOutput, codes: np.ndarray,
                       at: SampleSlots, done: dict[SequenceGroup, None]) -> int:
        """Every sampler's new token (already in the batch's columns, with its stop code):
        the token lists in one loop, stop-string rows through their checkers, grammars;
        per-row Python for rows that finish or asked for logprobs. Returns the tokens added."""
        index = at.index
        token_list = res.token_ids.tolist()
        for seq, t in zip(seqs, token_list):
            seq.token_ids.append(t)
        reasons: Reasons = {}
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
            _advance_grammars(seqs, token_list, np.flatnonzero(constrained), codes, reasons)
        for j in sorted([*np.flatnonzero(codes).tolist(), *reasons]):
            seq = seqs[j]
            if j in reasons:
                self._finish(seq, *reasons[j])
            else:
                seq.stop_token = int(codes[j]) in (EOS_STOP, ID_STOP)
                self._finish(seq, *finish_of(int(codes[j]), token_list[j]))
            done[seq.group] = None
        return len(token_list)

    def _apply_beams(self, outcome: BeamOutcome) -> int:
        """The beam groups' steps. Blocks change in the groups' order: the plain groups'
        adoptions (KVManager.adopt) up to each other group, then that group's operations.
        Then, for the plain groups at once: batch rows copied, beams and tokens set."""
        moves = outcome.moves
        pairs = [pair for m in moves for pair in m.adopt]
        added = 0
        if outcome.ops:  # keep the adoptions' order against the other groups' operations
            pos = np.concatenate([m.adopt_at for m in moves]) if moves else np.zeros(0)
            order = np.argsort(pos, kind="stable")
            pairs = [pairs[i] for i in order.tolist()]
            cuts = np.searchsorted(pos[order], [at for at, _ in outcome.ops]).tolist()
            done, same = 0, []
            for cut, (_, ops) in zip(cuts, outcome.ops):
                same += self.kv.adopt(pairs[done:cut])
                added += self._apply(ops)
                done = cut
            same += self.kv.adopt(pairs[done:])
        else:
            same = self.kv.adopt(pairs)
        for (seq, parent), n in zip(pairs, same):  # only the tokens past their shared blocks
            seq.token_ids[n:] = parent.token_ids[n:]
            seq.cumulative_logprob, seq.seed = parent.cumulative_logprob, parent.seed
        if pairs:
            self.kv.adopt_rows(pairs)
        for m in moves:
            added += self._set_beams(m)
        return added

    def _set_beams(self, m: BeamMoves) -> int:
        """A bank's plain groups take their next beams; each beam appends its token."""
        w, beams = m.width, m.beams
        for g, group in enumerate(m.groups):
            group.seqs = beams[g * w:(g + 1) * w]
        tokens = m.tokens.tolist()
        for j, (seq, token) in enumerate(zip(beams, tokens)):
            seq.index = j % w
            seq.token_ids.append(token)
        slots = slots_of(beams, len(beams))
        self.batch.append(slots, m.tokens.astype(np.int64, copy=False), None)
        return len(tokens)

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
                    self.kv.fork(parent, child, num_tokens)
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
        """The sequence ends with this reason; its slot and blocks go back now."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.kv.finish(seq)


# a step's prompt scores: the entries of its prompt rows in order (None where a request asks
# no top-k), and per PromptRows the scores of the ids its request names (or None)
PromptScores = tuple[list[RankedLogprobs | None], list[np.ndarray | None]]


def _store_prompt_logprobs(layout: LogitsLayout, entries: list[RankedLogprobs | None],
                           named: list[np.ndarray | None]) -> None:
    """Each scored prompt position's entry, and the row of its named ids' scores, kept the
    first time (a recompute scores again)."""
    it = iter(entries)
    for p, scores in zip(layout.prompt_rows, named):
        stored = p.group.prompt_logprobs
        for pos in range(p.first, p.first + p.count):
            entry = next(it)
            if stored is not None and stored[pos] is None:
                stored[pos] = entry
        if scores is not None:
            table = p.group.prompt_token_id_logprobs
            at = p.first - first_scored(p.group)
            fresh = np.isnan(table[at:at + p.count, 0])
            table[at:at + p.count][fresh] = scores[fresh]


def _advance_grammars(seqs: list[Sequence], tokens: list[int], rows: np.ndarray,
                      codes: np.ndarray, reasons: Reasons) -> None:
    """Each constrained sampler's matcher accepts its new token. A matcher that ended on its
    stop token ends the sequence ("stop", also under min_tokens or ignore_eos, and before a
    stop string or max_tokens); a rejected token (a logits processor revived a masked one)
    ends it too, with a warning."""
    for j in rows.tolist():
        c = seqs[j].constraint
        if not c.accept(tokens[j]):
            logger.warning("request %d: its grammar rejected token %d; the sample ends there",
                           seqs[j].group.index, tokens[j])
            codes[j], reasons[j] = GOES_ON, ("stop", None)
        elif c.terminated:
            codes[j] = EOS_STOP
            reasons.pop(j, None)
