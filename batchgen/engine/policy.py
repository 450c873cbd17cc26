"""Group policies: what one request's sequences compute and, for beams, how a step's
log-probabilities become plain operations on them.

A policy only decides; the OutputProcessor applies the operations. Two policies (both
implement sequence.GroupPolicy): n samples (each sample draws its own token from the sampler
and finishes on its own; the output processor applies those tokens for the whole batch at
once) and beams (the group's W beams advance together through HF's beam selection, a
BeamSelector, on log-probabilities the engine hands over).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.beam import BeamSelector, BeamStep, StopFn
from batchgen.engine.beam_trace import Tables, TraceRecorder
from batchgen.engine.sequence import Sequence, SequenceGroup


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


class SamplePolicy:
    """n independent samples. They share the prompt: the leader's last prompt row is sampled
    once per sample that has not drawn a token yet; afterwards each decodes on its own."""

    def held_tokens(self, group: SequenceGroup) -> int:
        """Uncomputed tokens each sequence leaves to the decode step (none for samples)."""
        return 0

    def decode_units(self, group: SequenceGroup, ready: list[Sequence]
                     ) -> list[list[Sequence]]:
        """Each ready sample decodes on its own."""
        return [[s] for s in ready]

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

    def __init__(self, state: BeamSelector, trace: TraceRecorder | None = None) -> None:
        self.state = state
        self.trace = trace

    def held_tokens(self, group: SequenceGroup) -> int:
        return 1 if self.state.gen_len > 0 else 0

    def decode_units(self, group: SequenceGroup, ready: list[Sequence]
                     ) -> list[list[Sequence]]:
        """The live beams decode together, once every one of them is ready."""
        return [ready] if ready and len(ready) == len(group.seqs) else []

    def samples_from(self, group: SequenceGroup, seq: Sequence) -> list[Sequence]:
        return []  # beams read their logits rows directly

    def update(self, group: SequenceGroup, logprobs: torch.Tensor, tables: Tables
               ) -> list[Op]:
        """One beam step over the live beams' float32 log-probabilities (rows in beam order);
        `tables` reads a beam's block table for the trace. Every live beam has computed all
        its tokens (it decoded its last one this step), so a child shares them all."""
        return self.ops(group, self.state.step(logprobs, self.stop_fn(group.seqs)), tables)

    def ops(self, group: SequenceGroup, step: BeamStep, tables: Tables) -> list[Op]:
        """The operations that carry out one step of the group's beams (recorded first)."""
        beams = group.seqs
        if self.trace is not None:
            self.trace.record(beams, step, self.state, tables)
        if step.done:
            return [Free(b) for b in beams]
        ops: list[Op] = []
        nxt: list[Sequence] = []
        taken: set[int] = set()
        for j, p in enumerate(step.parents):
            parent = beams[p]
            if p in taken:
                child = parent.clone(j)
                ops.append(Fork(parent, child, len(parent.token_ids)))
                nxt.append(child)
            else:
                taken.add(p)
                nxt.append(parent)
        ops += [Free(b) for p, b in enumerate(beams) if p not in taken]
        ops.append(SetSeqs(group, nxt))
        ops += [Append(c, t) for c, t in zip(nxt, step.tokens)]
        return ops

    def stop_fn(self, beams: list[Sequence]) -> StopFn | None:
        """is_stop(parent, token): does the token complete a stop string on that beam?"""
        if beams[0].stop is None:
            return None
        n = self.state.gen_len + 1
        return lambda parent, token: beams[parent].stop.would_stop(token, n)

    def finished(self, group: SequenceGroup) -> bool:
        return self.state.done

