"""vLLM's pooling output classes and fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PoolingOutput:
    """vLLM's PoolingOutput: `data`, the pooled tensor."""
    data: torch.Tensor


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: `embedding` (a list of floats); `hidden_size`."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """vLLM's ClassificationOutput: `probs` (or raw scores), `num_classes`."""
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """vLLM's ScoringOutput: `score`, one float."""
    score: float


@dataclass
class PoolingRequestOutput:
    """vLLM's PoolingRequestOutput: request_id, outputs, prompt_token_ids, finished."""
    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """An embed request's output (`outputs` an EmbeddingOutput)."""


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """A classify/reward request's output (`outputs` a ClassificationOutput)."""


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """A score request's output (`outputs` a ScoringOutput)."""
