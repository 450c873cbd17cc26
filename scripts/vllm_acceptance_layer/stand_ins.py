"""Stand-ins for the vLLM internals that vLLM's offline test files import at module level
(platform probes, cleanup helpers, enum names), registered for the acceptance run only: they
are test scaffolding, not part of batchgen.vllm_compat. Each answers what a CPU-only run of
batchgen is (no CUDA, nothing to clean up) or raises when a test reaches a server-only or
engine-internal path."""

from __future__ import annotations

import sys
import types
from typing import Any, Literal


class _Platform:
    """vllm.platforms.current_platform on a machine batchgen runs on the CPU."""

    device_type = "cpu"

    def is_cuda(self) -> bool:
        return False

    is_rocm = is_tpu = is_xpu = is_cuda_alike = is_cuda

    def is_cpu(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("is_"):
            return lambda *a, **k: False
        raise AttributeError(name)


# vLLM's logprobs modes, as vLLM spells the type: a Literal, whose get_args() its tests
# parametrize over (batchgen's LLM takes the same strings)
LogprobsMode = Literal["raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"]


class AudioAsset:
    """vLLM's audio fixtures: batchgen serves no audio model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("audio inputs: batchgen serves text models only")


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []
    mod.__dict__.update(attrs)
    return mod


def install() -> None:
    """Add the stand-ins under vLLM's names (after batchgen.vllm_compat.install())."""
    mods = {
        "vllm.platforms": _module("vllm.platforms", current_platform=_Platform()),
        "vllm.distributed": sys.modules.get("vllm.distributed") or _module("vllm.distributed"),
        "vllm.config": _module("vllm.config"),
        "vllm.config.model": _module("vllm.config.model", LogprobsMode=LogprobsMode),
        "vllm.assets": _module("vllm.assets"),
        "vllm.assets.audio": _module("vllm.assets.audio", AudioAsset=AudioAsset),
    }
    mods["vllm.distributed"].cleanup_dist_env_and_memory = lambda *a, **k: None
    inputs = sys.modules["vllm.inputs"]
    inputs.TokensInput = inputs.TokensPrompt
    for name, mod in mods.items():
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
