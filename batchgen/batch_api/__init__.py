"""OpenAI Batch API files on batchgen (`batchgen run-batch`): chat and completion requests
from a JSONL file, answered in one streamed call, one output line per input line."""

from batchgen.batch_api.runner import BatchSummary, run_batch

__all__ = ["BatchSummary", "run_batch"]
