"""vLLM's offline API names that batchgen's own signatures do not spell out: every argument of
vLLM's `LLM.__init__` and `EngineArgs` (what `vllm.LLM(**kwargs)` takes) is either a parameter
of batchgen's `LLM`, or checked here: accepted at vLLM's default and refused otherwise with a
ValueError naming it (batchgen has no such feature), accepted with any value where it changes
nothing batchgen computes, or an alias of a batchgen parameter. So a vLLM script gets a clear
ValueError, never a TypeError, for any vLLM argument.

The names and defaults are vLLM's, read from its source (`vllm_api.json`: the version, commit
and sdist it came from; `scripts/vllm_api_names.py` writes it).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from batchgen.checks import ValidationError

# vLLM arguments with no counterpart here whose values change no output batchgen computes:
# accepted with any value (the reason is what `engine_arg_status` reports).
NO_EFFECT = {
    "hf_token": "batchgen never downloads (hub ids are read from the local cache only)",
    "served_model_name": "offline outputs carry no model name",
    "disable_custom_all_reduce": "tensor parallelism all-reduces through torch.distributed",
    "use_tqdm_on_load": "weights load without a progress bar",
    "aggregate_engine_logging": "batchgen has one engine per LLM",
    "enable_logging_iteration_details": "batchgen logs no per-step lines",
    "max_parallel_loading_workers": "transformers loads the weights",
    "shutdown_timeout": "an LLM stops its workers when it is deleted",
    "skip_mm_profiling": "the image encoder cache has a fixed byte budget, not profiled",
}
# vLLM arguments batchgen honours with vLLM's meaning beyond its LLM's own parameters: taken
# by a feature's seam before these checks (where each is served).
HONOURED = {
    "enable_lora": "batchgen/lora (LoRASeam)", "max_loras": "batchgen/lora (LoRASeam)",
    "max_lora_rank": "batchgen/lora (LoRASeam)", "max_cpu_loras": "batchgen/lora (LoRASeam)",
    "speculative_config": "batchgen/speculative (SpecSeam): method 'ngram'",
    "enable_trace_replay": "batchgen/speculative (SpecSeam): SamplingParams."
                           "trace_decode_token_ids",
}
# Values beyond vLLM's default that mean what batchgen does anyway.
ALSO_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "runner": ("generate",),        # batchgen runs generative models only
    "convert": ("none",),           # no model conversion
    "tokenizer_mode": ("hf",),      # transformers' tokenizer is the one loaded
    "compilation_config": (0,),     # mode 0: no compilation, what batchgen does
    "load_format": ("safetensors",),  # the only format batchgen reads
}
# vLLM names of batchgen parameters that batchgen spells otherwise.
ALIASES = {"num_gpu_blocks_override": "num_kv_blocks"}
# Where a refused value is served by another class.
ELSEWHERE = {"runner": "; runner='pooling' builds a batchgen.pooling.llm.PoolingLLM"}


@functools.cache
def vllm_api() -> dict[str, Any]:
    """vLLM's offline API as read from its source: per signature, parameter -> default."""
    return json.loads(resources.files("batchgen").joinpath("vllm_api.json").read_text())


def vllm_engine_defaults() -> dict[str, dict[str, Any]]:
    """Every argument `vllm.LLM(...)` takes (its own and EngineArgs'), with its default
    record ({"default": v}, or {"expr": source} when not a literal)."""
    api = vllm_api()
    return {**api["EngineArgs"], **api["LLM.__init__"]}


def is_default(value: Any, record: dict[str, Any]) -> bool:
    """Whether `value` asks for nothing beyond vLLM's default: the default itself, None, or an
    empty dict/list/set where the default is empty, None or a config object."""
    if value is None:
        return True
    default = record.get("default")
    if "default" in record and _same(value, default):
        return True
    empty = isinstance(value, (dict, list, set, tuple, str)) and not value
    return empty and (default in (None, "", {}, []) or "expr" in record)


def _same(value: Any, default: Any) -> bool:
    """Equality without bool/int confusion (False is not 0 here) and without raising."""
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default) or (isinstance(default, list) and list(value) == default)
    except Exception:  # an object whose == raises or does not give a bool
        return False


def split_engine_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Check `LLM(**kwargs)` beyond batchgen's own parameters: a ValidationError (a
    ValueError) naming the first argument batchgen cannot honour; returns the aliases as
    batchgen's parameters (`num_gpu_blocks_override` -> `num_kv_blocks`)."""
    known = vllm_engine_defaults()
    version = vllm_api()["vllm_version"]
    renamed: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in ALIASES:
            renamed[ALIASES[name]] = value
        elif name not in known:
            raise ValidationError(f"{name} is not an argument of batchgen's LLM nor one of vLLM "
                                  f"{version}'s engine arguments", parameter=name, value=value)
        elif name in NO_EFFECT or is_default(value, known[name]) or _also(name, value):
            continue
        else:
            raise ValidationError(_refusal(name, value, known[name]), parameter=name,
                                  value=value)
    return renamed


def _also(name: str, value: Any) -> bool:
    return any(_same(value, v) for v in ALSO_ACCEPTED.get(name, ()))


def _refusal(name: str, value: Any, record: dict[str, Any]) -> str:
    """Why a vLLM argument is refused: batchgen lacks the feature; its default is what runs."""
    default = record["default"] if "default" in record else None
    extra = ALSO_ACCEPTED.get(name, ())
    allowed = " or ".join(repr(v) for v in (default, *extra))
    return (f"{name} must be {allowed} (vLLM's default{', or what batchgen does' if extra else ''}"
            f"), got {_short(value)}: batchgen does not implement vLLM's {name} here"
            + ELSEWHERE.get(name, ""))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_call_args(method: str, **kwargs: Any) -> None:
    """vLLM's per-call arguments batchgen has no use for (`mm_processor_kwargs`,
    `tokenization_kwargs`): None (or empty) only, else a ValidationError naming it."""
    why = {"mm_processor_kwargs": "give it in each prompt dict or to LLM(...)",
           "tokenization_kwargs": "prompts are tokenized with the tokenizer's defaults"}
    for name, value in kwargs.items():
        if value is not None and not (isinstance(value, (dict, list)) and not value):
            raise ValidationError(f"{method}: {name} must be None, got {_short(value)}: "
                                  f"{why[name]}", parameter=name, value=value)
