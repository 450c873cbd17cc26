"""Scale-out on Ray Data: the dataset job of `batchgen.data` over an actor pool, one `LLM` per
actor, every sample or beam of every row kept. Needs the `batchgen[ray]` extra; importing
`batchgen` never needs Ray."""

from batchgen.ray.processor import (
    BatchgenProcessorConfig,
    Processor,
    build_processor,
    numbered_blocks,
    with_row_ids,
)

__all__ = ["BatchgenProcessorConfig", "Processor", "build_processor", "numbered_blocks",
           "with_row_ids"]
