"""Sequence and SequenceGroup: the engine's per-request state (tokens, status, results).

Who writes what once a group is queued: `status` and `fork_pending` follow where the KV is, so
the KVManager alone writes them (admission, forks, swaps, frees); the OutputProcessor appends
tokens and records finish reasons and logprobs; the PersistentBatch writes `slot` (and hands a
leaving sequence its cumulative logprob back); policies only read and return operations.
How many tokens a sequence has computed is the KVManager's (`KVManager.num_computed`): the
batch's column while the sequence holds a slot."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from batchgen.sampling.sampler import NUM_PARAMS, TopLogprobs
from batchgen.sampling.stop import StopChecker

if TYPE_CHECKING:
    from collections.abc import Callable

    from batchgen.multimodal.items import MMPrompt
    from batchgen.outputs import RequestMetrics
    from batchgen.params import BeamSearchParams, SamplingParams
    from batchgen.sampling.grammar import Constraint


class SequenceStatus(enum.Enum):
    """Where a sequence's KV is (written by the KVManager alone)."""

    WAITING = "waiting"  # no block table (not admitted yet, preempted, or waiting for a fork)
    RUNNING = "running"  # has a block table and a batch slot
    SWAPPED = "swapped"  # its block table maps to the host swap pool; no batch slot
    FINISHED = "finished"  # its blocks are freed


_SLOT = attrgetter("slot")


def slots_of(seqs: Iterable[Sequence], n: int) -> np.ndarray:
    """The batch slots of `n` sequences as int64, read in C (no Python frame per sequence:
    a step reads every beam's)."""
    return np.fromiter(map(_SLOT, seqs), np.int64, n)


def priority_key(group: SequenceGroup) -> tuple[int, int]:
    """vLLM's priority order: lower priority first, ties by arrival (the input index)."""
    return group.priority, group.index


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed`: (seed, index) mixed by SHA-256,
    so each sample is reproducible alone and independent of its batch neighbours."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class RowSpec:
    """A request's constant columns in the persistent batch, made once per request: sampling
    parameters (sampler.PARAM_NAMES order), which stages and checks its rows need, limits."""

    params: np.ndarray = field(default_factory=lambda: np.zeros(NUM_PARAMS, np.float32))
    greedy: bool = True
    penalized: bool = False  # keeps penalty counts
    controls: bool = False  # logit controls (per-row Python in the sampler)
    stop_strings: bool = False  # stops are its StopChecker's
    max_tokens: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int = -2  # sampler.NO_LOGPROBS (NAMED_LOGPROBS: those of `logprob_ids`)
    logprob_ids: tuple[int, ...] = ()  # vLLM's logprob_token_ids: the ids each token reports
    stop_ids: tuple[int, ...] = ()
    beam: bool = False  # its sequences are beams (decoded together, never sampled)
    constrained: bool = False  # structured outputs: each sequence has a Constraint
    trace: np.ndarray | None = None  # vLLM's trace_decode_token_ids: the tokens decode emits


class GroupPolicy(Protocol):
    """What the engine asks of every group's policy (engine/policy.py): the scheduler how
    its sequences decode, the logits layout who samples from a row, the output processor
    whether it is done. A beam policy also turns a step's log-probabilities into operations
    (`BeamPolicy.update`, the BeamSelector protocol behind it)."""

    def held_tokens(self, group: SequenceGroup) -> int:
        """Uncomputed tokens each sequence leaves to its decode step."""
        ...

    def decode_units(self, group: SequenceGroup, ready: list[Sequence]
                     ) -> list[list[Sequence]]:
        """Which of the `ready` sequences (running, one token to compute) decode together."""
        ...

    def samples_from(self, group: SequenceGroup, seq: Sequence) -> list[Sequence]:
        """The sequences that draw their next token from `seq`'s logits row."""
        ...

    def finished(self, group: SequenceGroup) -> bool: ...


@dataclass(eq=False)
class Sequence:
    """One token stream. The object itself is its key in the BlockManager."""

    group: SequenceGroup
    index: int  # sample index, or the beam's slot
    token_ids: list[int]
    stop: StopChecker | None  # only with stop strings (their text is matched incrementally)
    seed: int = 0  # its draws' key (samples); beams draw nothing
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0  # while in a slot, the batch's column is the live value
    # per token, when the request asked: (that step's top logprobs, this sequence's row in it)
    logprobs: list[tuple[TopLogprobs, int]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_token: bool = False  # it ended on an EOS / stop id (that token's text is dropped)
    slot: int = -1  # its row in the persistent batch while RUNNING (the batch's to write)
    # structured outputs: its grammar matcher, advanced by every token it keeps (never
    # replayed: a preempted sequence keeps it, since its tokens are unchanged)
    constraint: Constraint | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"Sequence(request={self.group.index}, index={self.index}, "
                f"tokens={len(self.token_ids)}, {self.status.value})")

    @property
    def num_prompt_tokens(self) -> int:
        return self.group.num_prompt_tokens

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.group.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.group.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def clone(self, index: int) -> Sequence:
        """A new sequence continuing this one (a beam's extra child): same tokens, score, stop
        and grammar state, no KV yet (the KVManager forks this one's blocks to it)."""
        return Sequence(self.group, index, list(self.token_ids),
                        self.stop.fork() if self.stop is not None else None, self.seed,
                        cumulative_logprob=self.cumulative_logprob,
                        constraint=None if self.constraint is None else self.constraint.fork())


@dataclass(eq=False)
class SequenceGroup:
    """One request: its prompt and params, its sequences (n samples, or the W live beams in beam
    order) and the policy that turns its results into operations.

    The prompt is computed once, by a leader (the first unfinished sequence); while
    `fork_pending` the other sequences wait without blocks until the leader has the prompt's
    K/V, then they are forked from it and share its blocks. That holds at the start of an n > 1
    request and again after a preemption, where each sibling then recomputes only its own tail.
    """

    index: int  # position in the user's input list
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    max_tokens: int  # params.max_tokens capped by max_model_len
    policy: GroupPolicy
    spec: RowSpec = field(default_factory=RowSpec)
    seqs: list[Sequence] = field(default_factory=list)
    fork_pending: bool = False  # the KVManager's: set when the leader is admitted
    bad_word_ids: list[list[int]] | None = None  # params.bad_words, tokenized
    num_cached_tokens: int | None = None  # prefix-cache hit at its first admission
    order: int = 0  # its place in the scheduler's running order (set at each admission)
    priority: int = 0  # vLLM's: under the priority policy lower starts first (ties: index)
    num_preemptions: int = 0  # times the scheduler preempted it (recompute or swap)
    # with disable_log_stats=False: its timestamps (outputs.RequestMetrics), else None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # prompt logprobs, filled position by position as the leader computes the prompt
    prompt_logprobs: list | None = None
    # vLLM's prompt_logprob_token_ids: the named ids' scores, [rows, ids] float32, a row
    # filled (NaN until then) when its position is first computed
    prompt_token_id_logprobs: np.ndarray | None = None
    scores_prompt: bool = field(init=False)  # either of the two: its prompt rows keep logits
    # structured outputs: the prompt's matcher, never advanced (samples and beams fork it)
    constraint: Constraint | None = field(default=None, repr=False)
    # images: each one's placeholders, key and tensors (vision-language models), else None
    mm: MMPrompt | None = field(default=None, repr=False)
    num_prompt_tokens: int = field(init=False)  # len(prompt_token_ids), read every step
    lora_id: int = 0  # its LoRA adapter's lora_int_id (batchgen/lora), 0: the base model
    lora: int = 0  # the adapter's device slot while it runs (the scheduler's LoRA gate)
    lora_key: bytes = b""  # the adapter's identity, in every prefix-cache block hash
    # its text side (a stop factory and logprob texts of its adapter's own tokenizer:
    # batchgen/lora/tokenizers.py TextSide), None: the LLM's tokenizer
    text_side: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        table = self.params.prompt_logprob_token_ids
        if table is not None:
            self.prompt_token_id_logprobs = np.full(table.shape, np.nan, np.float32)
        self.scores_prompt = self.prompt_logprobs is not None or table is not None

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def leader(self) -> Sequence:
        """The sequence that computes the prompt for the group."""
        return next(s for s in self.seqs if not s.finished)

    @property
    def finished(self) -> bool:
        return self.policy.finished(self)

    @property
    def chunk_cut(self) -> Callable[[int, int], int] | None:
        """Where its prompt chunks must stop short (inside no bidirectional image), if
        anywhere."""
        return self.mm.cut if self.mm is not None and self.mm.bidirectional else None

    @property
    def block_key(self) -> Callable[[int, int], bytes] | None:
        """What its prefix-cache block hashes add: the images a block overlaps, its adapter."""
        key = self.mm.block_key if self.mm is not None else None
        if not self.lora_key:
            return key
        return lambda i, bs: self.lora_key + (key(i, bs) if key is not None else b"")
