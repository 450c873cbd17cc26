"""Sequence and SequenceGroup: the engine's per-request state (tokens, progress, stop state)."""

from __future__ import annotations

import enum
import hashlib
import itertools
from dataclasses import dataclass, field

import torch

from batchgen.engine.beam import BeamSearchState
from batchgen.params import BeamSearchParams, SamplingParams
from batchgen.sampling.stop import StopChecker

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed`: (seed, index) mixed by SHA-256,
    so each sample is reproducible alone and independent of its batch neighbours."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(eq=False)
class Sequence:
    """One token stream. Its KV lives in the blocks of `block_manager.block_tables[seq_id]`."""

    group: SequenceGroup
    index: int
    token_ids: list[int]
    stop: StopChecker | None  # None for beams: their stops are decided by the beam search
    generator: torch.Generator | None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # prefix cache: chained hashes of the full blocks of token_ids (a memo that may run ahead of
    # the KV; tokens only grow, so it stays valid), and how many blocks have been published
    block_hashes: list[bytes] = field(default_factory=list)
    cached_blocks: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.group.num_prompt_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.group.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V is not yet in the cache (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.group.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class SequenceGroup:
    """One prompt and its n samples (or W beams). The prompt is computed once by a single
    leader sequence; the siblings are then forked from it and share its blocks. After a
    preemption the same happens again: the leader recomputes the prompt, the siblings are
    re-forked from it (`share_pending`) and each recomputes only its own tokens."""

    index: int  # position in the user's input list
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    max_tokens: int  # params.max_tokens capped by max_model_len
    beam: BeamSearchState | None = None  # beam search state (HF semantics), else sampling
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # siblings exist (n > 1 samples, or beams after their first step)
    share_pending: bool = False  # preempted with siblings: re-fork them from the leader
    done: bool = False  # beam search finished (its live beams are freed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def width(self) -> int:
        """Sequences this group runs at once: n samples or W beams."""
        return self.beam.beam_width if self.beam is not None else self.params.n

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.done
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)

    def max_chunk(self, seq: Sequence) -> int:
        """Tokens `seq` may compute now: a waiting sibling computes nothing until it is
        forked from the leader; beams leave their last token to the group-wide decode step."""
        n = seq.num_uncomputed
        if self.share_pending:
            if seq is not self.unfinished()[0]:
                return 0
            return max(0, min(n, self.num_prompt_tokens - seq.num_computed_tokens))
        if self.beam is not None and self.forked:
            return n - 1
        return n
