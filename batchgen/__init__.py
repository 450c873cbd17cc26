"""batchgen: offline batch inference for HuggingFace LLMs on a paged KV cache.

The names a vLLM offline script imports (`LLM`, `SamplingParams`, `TextPrompt`, ...) live here,
so such a script runs with `from vllm import` changed to `from batchgen import`.

Importing the package is cheap: the values (params, prompts, outputs) are plain Python, and
`LLM` (which brings torch and the engine) is imported on first use of the name, so the
`batchgen` command's `--help` and argument errors never wait for torch. Asking for `LLM` also
registers the pooling runner (batchgen.pooling.llm): `LLM(folder, runner="pooling")`, or "auto"
on a reward/classifier/embedding folder, is a PoolingLLM.
"""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from batchgen.llm import LLM

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "TextPrompt",
           "TokensPrompt", "PromptType", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchOutput", "BeamSequence", "KVStats"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`batchgen.LLM`, imported (with torch and the engine) the first time it is asked for."""
    if name == "LLM":
        from batchgen.llm import LLM
        from batchgen.pooling.llm import PoolingLLM  # noqa: F401  (the "pooling" runner)

        globals()["LLM"] = LLM
        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"LLM"})
