"""Stand-in for vLLM's tests/utils.py in the acceptance run: the marks and helpers vLLM's
offline test files import from it, answering for a CPU-only batchgen (no GPU, no server)."""

from __future__ import annotations

import pytest


def large_gpu_mark(*args, **kwargs):
    """A test marked for a large GPU is skipped: batchgen's acceptance runs on the CPU."""
    return pytest.mark.skip(reason="needs a large GPU")


large_gpu_test = large_gpu_mark


class RemoteOpenAIServer:
    """vLLM's OpenAI server: batchgen has none (offline only)."""

    def __init__(self, *args, **kwargs) -> None:
        pytest.skip("needs vLLM's OpenAI server (batchgen is offline only)")
