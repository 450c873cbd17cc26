"""Results returned to the user; field names follow vLLM so code ports with one import."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All samples of one prompt, in the order the prompts were given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class BeamSequence:
    """One finished beam hypothesis."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """Beam hypotheses of one prompt, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)


@dataclass(frozen=True)
class KVStats:
    """KV figures of the last `generate` / `beam_search` call."""

    num_blocks: int
    block_size: int
    peak_blocks_in_use: int
    cow_copies: int
    preemptions: int
    prefix_hit_tokens: int
    prompt_tokens_computed: int = 0  # prompt positions the model ran (after hits, with recomputes)
