"""Sequence and SequenceGroup: the engine's per-request state (tokens, progress, stop state)."""

from __future__ import annotations

import enum
import hashlib
import itertools
from dataclasses import dataclass, field

import torch

from batchgen.params import SamplingParams
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
    stop: StopChecker
    generator: torch.Generator | None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

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
    """One prompt and its n samples. Before the prompt is computed it holds a single sequence;
    the n-1 siblings are forked from it once the prompt's last token has been computed."""

    index: int  # position in the user's input list
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens capped by max_model_len
    seqs: list[Sequence] = field(default_factory=list)
    admitted_at: int = -1  # scheduler stamp; the newest group is preempted first

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def forked(self) -> bool:
        return len(self.seqs) == self.params.n

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.seqs)
