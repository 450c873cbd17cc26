"""The module objects `batchgen.vllm_compat.install()` registers under vLLM's names: each a real
module with a `ModuleSpec` (so `importlib.util.find_spec` finds it), holding batchgen's classes
where vLLM's offline API has them, and stand-ins for the server-mode names that TRL imports
when it loads."""

from __future__ import annotations

import importlib.machinery
import socket
import types
from typing import Any

from batchgen import outputs, params, prompts, stats
from batchgen.checks import ValidationError
from batchgen.lora.request import LoRARequest
from batchgen.pooling import PoolingParams
from batchgen.pooling import outputs as pooled
from batchgen.vllm_compat.engine_shims import InputProcessor, LogprobsProcessor

# A vLLM version inside the range TRL 1.16 accepts (0.22.0 to 0.31.0), at or above the ones its
# code paths test for (0.26.0, 0.28.0).
VERSION = "0.30.0"
# vLLM's pooling output classes (vllm.outputs), batchgen.pooling's
_POOLED_OUTPUTS = ("PoolingOutput", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput",
                   "PoolingRequestOutput", "EmbeddingRequestOutput",
                   "ClassificationRequestOutput", "ScoringRequestOutput")


def get_ip() -> str:
    """This host's address as vLLM's get_ip gives it (the loopback one when unresolvable)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def get_open_port() -> int:
    """A free TCP port on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _server_only(name: str) -> Any:
    """A stand-in for a vLLM server-mode function: importable, raising when called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"vllm.{name} is part of vLLM's server mode, which batchgen "
                                  "does not provide: use colocate mode (TRL: vllm_mode="
                                  "'colocate') or a real vLLM server")

    call.__name__ = name.rpartition(".")[2]
    return call


def _module(name: str, **attrs: Any) -> types.ModuleType:
    """A package-like module `name` with a spec and these attributes."""
    mod = types.ModuleType(name, f"batchgen's stand-in for {name} (batchgen.vllm_compat)")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []  # a package: its submodules import from sys.modules
    mod.__dict__.update(attrs)
    return mod


def _top(llm_class: type) -> types.ModuleType:
    """The `vllm` package itself: its top-level names."""
    return _module("vllm", __version__=VERSION, LLM=llm_class,
                   SamplingParams=params.SamplingParams,
                   BeamSearchParams=params.BeamSearchParams,
                   RequestOutput=outputs.RequestOutput,
                   CompletionOutput=outputs.CompletionOutput,
                   TextPrompt=prompts.TextPrompt, TokensPrompt=prompts.TokensPrompt,
                   PoolingParams=PoolingParams,
                   PoolingRequestOutput=pooled.PoolingRequestOutput,
                   EmbeddingRequestOutput=pooled.EmbeddingRequestOutput,
                   ClassificationRequestOutput=pooled.ClassificationRequestOutput,
                   ScoringRequestOutput=pooled.ScoringRequestOutput)


def build_modules(llm_class: type) -> dict[str, types.ModuleType]:
    """Every stand-in module by dotted name, parents holding their children."""
    wt = "distributed.weight_transfer"
    mods = {
        "vllm": _top(llm_class),
        "vllm.pooling_params": _module("vllm.pooling_params", PoolingParams=PoolingParams),
        "vllm.sampling_params": _module(
            "vllm.sampling_params", SamplingParams=params.SamplingParams,
            BeamSearchParams=params.BeamSearchParams,
            StructuredOutputsParams=params.StructuredOutputsParams,
            RequestOutputKind=params.RequestOutputKind),
        "vllm.entrypoints": _module("vllm.entrypoints"),
        "vllm.entrypoints.llm": _module("vllm.entrypoints.llm", LLM=llm_class),
        # batchgen's ValueError that names the argument (vLLM's is not a ValueError)
        "vllm.exceptions": _module("vllm.exceptions", VLLMValidationError=ValidationError),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.metrics": _module("vllm.v1.metrics"),
        "vllm.v1.engine": _module("vllm.v1.engine"),
        "vllm.v1.engine.logprobs": _module("vllm.v1.engine.logprobs",
                                           LogprobsProcessor=LogprobsProcessor),
        "vllm.v1.engine.input_processor": _module("vllm.v1.engine.input_processor",
                                                  InputProcessor=InputProcessor),
        "vllm.v1.metrics.reader": _module(
            "vllm.v1.metrics.reader", Metric=stats.Metric, Counter=stats.Counter,
            Gauge=stats.Gauge, Histogram=stats.Histogram),
        "vllm.lora": _module("vllm.lora"),
        "vllm.lora.request": _module("vllm.lora.request", LoRARequest=LoRARequest),
        "vllm.outputs": _module("vllm.outputs", RequestOutput=outputs.RequestOutput,
                                CompletionOutput=outputs.CompletionOutput,
                                RequestMetrics=outputs.RequestMetrics,
                                **{n: getattr(pooled, n) for n in _POOLED_OUTPUTS}),
        "vllm.logprobs": _module("vllm.logprobs", Logprob=outputs.Logprob,
                                 FlatLogprobs=outputs.FlatLogprobs,
                                 SampleLogprobs=outputs.SampleLogprobs,
                                 PromptLogprobs=outputs.PromptLogprobs),
        "vllm.inputs": _module("vllm.inputs", TextPrompt=prompts.TextPrompt,
                               TokensPrompt=prompts.TokensPrompt),
        "vllm.utils": _module("vllm.utils", get_ip=get_ip, get_open_port=get_open_port),
        "vllm.utils.network_utils": _module("vllm.utils.network_utils", get_ip=get_ip,
                                            get_open_port=get_open_port),
        "vllm.distributed": _module("vllm.distributed"),
        f"vllm.{wt}": _module(f"vllm.{wt}"),
        f"vllm.{wt}.nccl_common": _module(
            f"vllm.{wt}.nccl_common", trainer_init=_server_only(f"{wt}.nccl_common.trainer_init")),
        f"vllm.{wt}.packed_tensor": _module(
            f"vllm.{wt}.packed_tensor", packed_nccl_broadcast_producer=_server_only(
                f"{wt}.packed_tensor.packed_nccl_broadcast_producer")),
    }
    for name, mod in mods.items():  # `import vllm.x.y` binds y on vllm.x
        parent, _, child = name.rpartition(".")
        if parent in mods:
            setattr(mods[parent], child, mod)
    return mods
