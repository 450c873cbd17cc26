"""batchgen: offline batch inference for HuggingFace LLMs on a paged KV cache.

The names a vLLM offline script imports (`LLM`, `SamplingParams`, `TextPrompt`, ...) live here,
so such a script runs with `from vllm import` changed to `from batchgen import`.
"""

from batchgen.llm import LLM
from batchgen.outputs import (
    BeamSearchOutput,
    BeamSequence,
    CompletionOutput,
    KVStats,
    Logprob,
    RequestOutput,
)
from batchgen.params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.prompts import PromptType, TextPrompt, TokensPrompt

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "TextPrompt", "TokensPrompt",
           "PromptType", "RequestOutput", "CompletionOutput", "Logprob", "BeamSearchOutput",
           "BeamSequence", "KVStats"]
__version__ = "0.1.0"
