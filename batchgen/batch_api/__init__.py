"""OpenAI Batch API files on batchgen (`batchgen run-batch`): chat and completion requests
from a JSONL file, answered in one streamed call, one output line per input line.

`run_batch` and `BatchSummary` are imported on first use (they bring the engine), so the
command's checks of its paths (`batchgen.batch_api.paths`) run before torch is imported."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.batch_api.runner import BatchSummary, run_batch

__all__ = ["BatchSummary", "run_batch"]


def __getattr__(name: str) -> Any:
    """`run_batch` and `BatchSummary`, from batchgen.batch_api.runner when first asked for."""
    if name in __all__:
        from batchgen.batch_api import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'batchgen.batch_api' has no attribute {name!r}")
