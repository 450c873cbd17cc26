"""batchgen: offline batch inference for HuggingFace LLMs on a paged KV cache."""

from batchgen.llm import LLM
from batchgen.outputs import (
    BeamSearchOutput,
    BeamSequence,
    CompletionOutput,
    KVStats,
    RequestOutput,
)
from batchgen.params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSequence", "KVStats"]
__version__ = "0.1.0"
