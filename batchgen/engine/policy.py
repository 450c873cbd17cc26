"""Group policies: what one request's sequences compute and, for beams, how a step's
log-probabilities become plain operations on them.

The Scheduler owns every sequence and applies the operations; a policy only decides. Two
policies: n samples (each sample draws its own token from the sampler and finishes on its own;
the scheduler applies those tokens for the whole batch at once) and beams (the group's W beams
advance together through HF's beam selection, on log-probabilities the engine hands over).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.beam import BeamSearchState, StopFn
from batchgen.engine.beam_trace import BeamTrace
from batchgen.engine.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class Fork:
    """`child` (new, no blocks) shares the blocks holding `parent`'s first `num_tokens`."""

    parent: Sequence
    child: Sequence
    num_tokens: int


@dataclass
class Append:
    """`token` is beam `seq`'s next token (the beam state decided its stop)."""

    seq: Sequence
    token: int


@dataclass
class Free:
    """`seq` ends without a token of its own (a beam without children, a finished group)."""

    seq: Sequence


@dataclass
class SetSeqs:
    """The group's live sequences are now `seqs`, in this order (the next beams)."""

    group: SequenceGroup
    seqs: list[Sequence]


Op = Fork | Append | Free | SetSeqs


def ready(seqs: list[Sequence]) -> list[Sequence]:
    """The sequences that hold blocks and have exactly one token left to compute."""
    return [s for s in seqs if s.status is SequenceStatus.RUNNING and s.num_uncomputed == 1]


class SamplePolicy:
    """n independent samples. They share the prompt: the leader's last prompt row is sampled
    once per sample that has not drawn a token yet; afterwards each decodes on its own."""

    def held_tokens(self, group: SequenceGroup) -> int:
        """Uncomputed tokens each sequence leaves to the decode step (none for samples)."""
        return 0

    def decode_units(self, group: SequenceGroup) -> list[list[Sequence]]:
        return [[s] for s in ready(group.seqs)]

    def samples_from(self, group: SequenceGroup, seq: Sequence) -> list[Sequence]:
        """The sequences whose next token is drawn from `seq`'s logits row."""
        if not group.fork_pending:
            return [seq]
        p = group.num_prompt_tokens
        return [seq, *(s for s in group.seqs
                       if s is not seq and not s.finished and len(s.token_ids) == p)]

    def finished(self, group: SequenceGroup) -> bool:
        return all(s.finished for s in group.seqs)


class BeamPolicy:
    """HF beam search over the group's W live beams. After the first step the beams decode
    together (one step needs all their logits), so each leaves its last token to that step.
    The first child of a parent takes over its sequence, other children fork it, parents
    without children end. With a `trace`, each step is recorded there (the beams' block
    tables included), behind one check per group step."""

    def __init__(self, state: BeamSearchState, trace: BeamTrace | None = None) -> None:
        self.state = state
        self.trace = trace

    def held_tokens(self, group: SequenceGroup) -> int:
        return 1 if self.state.gen_len > 0 else 0

    def decode_units(self, group: SequenceGroup) -> list[list[Sequence]]:
        beams = ready(group.seqs)
        return [beams] if beams and len(beams) == len(group.seqs) else []

    def samples_from(self, group: SequenceGroup, seq: Sequence) -> list[Sequence]:
        return []  # beams read their logits rows directly

    def update(self, group: SequenceGroup, logprobs: torch.Tensor) -> list[Op]:
        """One beam step over the live beams' float32 log-probabilities (rows in beam order)."""
        beams = group.seqs
        step = self.state.step(logprobs, self._stop_fn(beams))
        if self.trace is not None:
            self.trace.record(beams, step, self.state)
        if step.done:
            return [Free(b) for b in beams]
        ops: list[Op] = []
        nxt: list[Sequence] = []
        taken: set[int] = set()
        for j, p in enumerate(step.parents):
            parent = beams[p]
            if p in taken:
                child = parent.clone(j)
                ops.append(Fork(parent, child, parent.num_computed_tokens))
                nxt.append(child)
            else:
                taken.add(p)
                nxt.append(parent)
        ops += [Free(b) for p, b in enumerate(beams) if p not in taken]
        ops.append(SetSeqs(group, nxt))
        ops += [Append(c, t) for c, t in zip(nxt, step.tokens)]
        return ops

    def _stop_fn(self, beams: list[Sequence]) -> StopFn | None:
        """is_stop(parent, token): does the token complete a stop string on that beam?"""
        if beams[0].stop is None:
            return None
        n = self.state.gen_len + 1
        return lambda parent, token: beams[parent].stop.would_stop(token, n)

    def finished(self, group: SequenceGroup) -> bool:
        return self.state.done


GroupPolicy = SamplePolicy | BeamPolicy
