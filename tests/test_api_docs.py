"""docs/api.md cannot drift: each of its tables lists exactly the parameters of the signature it
names, with the defaults the code has; and every public name has a docstring."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import batchgen
import batchgen.data as bg_data
from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.data import generate_dataset

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"
REQUIRED = "required"


def sections() -> dict[str, dict[str, str]]:
    """Heading -> {parameter: default as written} of every table in docs/api.md."""
    out: dict[str, dict[str, str]] = {}
    heading = None
    for line in API.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        m = re.match(r"\| `(\w+)` \| (.+?) \|", line)
        if m and heading is not None:
            out.setdefault(heading, {})[m.group(1)] = m.group(2).strip().strip("`")
    return out


def signature_defaults(fn: Callable[..., Any]) -> dict[str, str]:
    """Parameter -> repr of its default ('required' when it has none, '**' for **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    return {p.name: "**" if p.kind is p.VAR_KEYWORD else
            REQUIRED if p.default is inspect.Parameter.empty else repr(p.default)
            for p in params if p.name != "self"}


def dataclass_defaults(cls: type) -> dict[str, str]:
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            out[f.name] = "{}" if value == {} else f"{type(value).__name__}()"
        else:
            out[f.name] = REQUIRED
    return out


def documented() -> list[tuple[str, dict[str, str]]]:
    cases = [
        ("`LLM(model, **kwargs)`", signature_defaults(LLM.__init__)),
        ("`LLM.generate(prompts, sampling_params=None, use_tqdm=True)`",
         signature_defaults(LLM.generate)),
        ("`LLM.generate_stream(prompts, sampling_params=None, use_tqdm=True)`",
         signature_defaults(LLM.generate_stream)),
        ("`LLM.beam_search(prompts, params, use_tqdm=True)`", signature_defaults(LLM.beam_search)),
        ("`LLM.beam_search_stream(prompts, params, use_tqdm=True)`",
         signature_defaults(LLM.beam_search_stream)),
        ("`LLM.chat(messages, sampling_params=None, ...)`", signature_defaults(LLM.chat)),
        *[(f"Outputs: `{name}(...)`", dataclass_defaults(getattr(batchgen, name)))
          for name in ("RequestOutput", "CompletionOutput", "Logprob", "BeamSearchOutput",
                       "BeamSequence", "KVStats")],
        ("`SamplingParams(...)`", dataclass_defaults(SamplingParams)),
        ("`BeamSearchParams(...)`", dataclass_defaults(BeamSearchParams)),
        ("`StructuredOutputsParams(...)`", dataclass_defaults(StructuredOutputsParams)),
        ("`batchgen.data.generate_dataset(llm, data, params=None, **kwargs)`",
         signature_defaults(generate_dataset)),
        ("`batchgen.data.row_params(params, seed, row_id)`, `batchgen.data.row_seed(seed, row_id)`",
         {**signature_defaults(bg_data.row_params), **signature_defaults(bg_data.row_seed)}),
        ("`LLM.load_weights(weights, lora_request=None)`, `LLM.sleep(level=1)`, "
         "`LLM.wake_up(tags=None)`, `LLM.is_sleeping()`",
         {**signature_defaults(LLM.load_weights), **signature_defaults(LLM.sleep),
          **signature_defaults(LLM.wake_up)}),
    ]
    try:  # batchgen.ray imports without Ray; only running it needs Ray
        from batchgen.ray import (
            BatchgenProcessorConfig,
            build_processor,
            numbered_blocks,
            with_row_ids,
        )
    except ImportError:  # pragma: no cover - batchgen.ray never imports ray at module level
        return cases
    return cases + [
        ("`batchgen.ray.BatchgenProcessorConfig(...)` (the `[ray]` extra)",
         dataclass_defaults(BatchgenProcessorConfig)),
        ("`batchgen.ray.build_processor(config, preprocess=None, postprocess=None)`",
         signature_defaults(build_processor)),
        ("`batchgen.ray.numbered_blocks(data, size)`, `batchgen.ray.with_row_ids(ds)`",
         {**signature_defaults(numbered_blocks), **signature_defaults(with_row_ids)}),
    ]


@pytest.mark.parametrize("heading, expected", documented(), ids=lambda x: str(x)[:40])
def test_api_table_matches_the_signature(heading: str, expected: dict[str, str]) -> None:
    tables = sections()
    assert heading in tables, f"docs/api.md has no section {heading!r}"
    assert tables[heading] == expected


def public_names() -> list[tuple[str, Any]]:
    import batchgen.ray as bg_ray

    names = [(f"batchgen.{n}", getattr(batchgen, n)) for n in batchgen.__all__]
    names += [(f"batchgen.data.{n}", getattr(bg_data, n)) for n in bg_data.__all__]
    names += [(f"batchgen.ray.{n}", getattr(bg_ray, n)) for n in bg_ray.__all__]
    for cls in (LLM,):
        names += [(f"batchgen.LLM.{n}", m) for n, m in vars(cls).items()
                  if not n.startswith("_") and callable(m)]
    return names


def test_every_public_name_has_a_docstring() -> None:
    missing = [name for name, obj in public_names()  # type aliases (PromptType) carry none
               if (inspect.isclass(obj) or inspect.isroutine(obj))
               and not (inspect.getdoc(obj) or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"
