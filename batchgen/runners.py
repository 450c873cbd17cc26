"""Which runner serves a model (vLLM's `runner="auto"|"generate"|"pooling"`), and the class
that runs it: `LLM(model, runner=...)` is built through `RunnerDispatch`, which hands a pooling
model to the class registered for "pooling" (batchgen.pooling.llm registers PoolingLLM when
imported; `batchgen.LLM` imports it). Read from config.json alone, before any weight."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchgen.checks import ValidationError, check_choice

RUNNERS = ("auto", "generate", "pooling")
# architecture suffixes served by the pooling runner (a bare `*Model` is an embedding model)
POOLING_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForRewardModel",
                    "ForProcessRewardModel", "Model", "EmbeddingModel")
# `*Model` names that are generators (GPT-2's LM head, its double heads, XLM's ...WithLMHead)
GENERATIVE_MODELS = ("LMHeadModel", "DoubleHeadsModel")
REGISTRY: dict[str, type] = {}  # runner name -> the class serving it (besides "generate")


def is_pooling_architecture(name: str) -> bool:
    """Whether an architecture name is served by the pooling runner."""
    return name.endswith(POOLING_SUFFIXES) and not name.endswith(GENERATIVE_MODELS)


def resolve_runner(runner: object, architectures: Sequence[str] | None) -> str:
    """"generate" or "pooling": `runner` itself, or under "auto" from the config's
    architectures (all of them pooling ones: pooled; anything else generates)."""
    check_choice(runner, "runner", RUNNERS)
    if runner != "auto":
        return str(runner)
    names = list(architectures or [])
    if names and all(is_pooling_architecture(n) for n in names):
        return "pooling"
    return "generate"


def folder_architectures(model: object) -> list[str] | None:
    """A local folder's config.json architectures, or None (not a folder with a config)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return None
    return list(json.loads(config.read_text()).get("architectures") or [])


def wants_pooling(model: object, runner: object = "auto") -> bool:
    """Whether `LLM(model, runner=...)` is the pooling runner: "pooling" itself, or "auto" on
    a folder whose config names only pooling architectures; "generate" on such a folder is
    refused, naming the runner."""
    archs = folder_architectures(model)
    if resolve_runner(runner, archs) == "pooling":
        return True
    if runner == "generate" and archs and resolve_runner("auto", archs) == "pooling":
        raise ValidationError(
            f"runner='generate' cannot serve {str(model)!r}: its architectures {archs} are a "
            "pooling model's (reward, classifier or embedding); use runner='pooling' or "
            "'auto'", parameter="runner", value=runner)
    return False


def register_runner(name: str, cls: type) -> None:
    """Serve runner `name` with `cls` (batchgen.pooling.llm registers PoolingLLM)."""
    check_choice(name, "name", ("pooling",))
    REGISTRY[name] = cls


class RunnerDispatch(type):
    """The metaclass of `LLM`: building a generate-runner class on a pooling model (runner=
    "pooling", or "auto" on a pooling folder) builds the registered pooling class instead,
    with the same arguments. A pooling class itself is built as asked."""

    @property
    def __signature__(cls) -> inspect.Signature:
        """The class's own `__init__` signature (without self), not this `__call__`'s, for
        `inspect.signature(LLM)` and the reference pages."""
        sig = inspect.signature(cls.__init__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if getattr(cls, "runner_kind", "generate") == "pooling":
            return super().__call__(*args, **kwargs)
        model, runner = args[0] if args else kwargs.get("model"), kwargs.get("runner", "auto")
        if not (isinstance(runner, str) and runner in RUNNERS):  # refused by LLM's own checks
            return super().__call__(*args, **kwargs)
        if not wants_pooling(model, runner):
            return super().__call__(*args, **kwargs)
        if "pooling" not in REGISTRY:
            raise ValidationError(
                "runner='pooling' needs batchgen.pooling (import batchgen.pooling.llm, or "
                "build the model through batchgen.LLM, which does)", parameter="runner",
                value=runner)
        return REGISTRY["pooling"](*args, **kwargs)
