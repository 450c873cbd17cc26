"""Pooling (vLLM's pooling API) on batchgen: which runner a model gets, PoolingParams, the
poolers that turn a model's hidden states into rewards, step scores and embeddings, and
vLLM's output classes; `PoolingLLM` (batchgen.pooling.llm) runs reward and process reward
models on the paged engine. See docs/pooling.md."""

from batchgen.pooling.outputs import (
                                      ClassificationOutput,
                                      ClassificationRequestOutput,
                                      EmbeddingOutput,
                                      EmbeddingRequestOutput,
                                      PoolingOutput,
                                      PoolingRequestOutput,
                                      ScoringOutput,
                                      ScoringRequestOutput,
)
from batchgen.pooling.params import POOLING_TASKS, RUNNERS, PoolingParams, resolve_runner
from batchgen.pooling.poolers import pool

__all__ = ["POOLING_TASKS", "RUNNERS", "ClassificationOutput", "ClassificationRequestOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "PoolingOutput",
           "PoolingParams", "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput",
           "pool", "resolve_runner"]
