"""Scale-out on Ray Data: the dataset job of `batchgen.data` over an actor pool, one `LLM` per
actor, every sample or beam of every row kept; with `score=`, the score and select stages in
the same pipeline (best_of_n.py). Needs the `batchgen[ray]` extra; importing `batchgen` never
needs Ray."""

from batchgen.ray.processor import (
    BatchgenProcessorConfig,
    Processor,
    build_processor,
    numbered_blocks,
    with_row_ids,
)

__all__ = ["BatchgenProcessorConfig", "Processor", "build_processor", "numbered_blocks",
           "with_row_ids"]
