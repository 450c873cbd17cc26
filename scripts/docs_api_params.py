"""Griffe extension (mkdocs.yml, mkdocstrings' `extensions:`): the API reference's parameter
tables come from docs/api.md, the one place each public parameter is written down (and checked
against the signatures by tests/test_api_docs.py). When the site is built, each object named in
TARGETS gets an `Args:` section made of its api.md table's rows, so mkdocstrings renders every
parameter with its default and what it accepts under the object itself; the docstrings in the
code stay short and nothing is typed twice. tests/test_docs_site.py checks that every parameter
of these signatures has a row with text on its reference page."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"
ROW = re.compile(r"\| `(\w+)` \| (.+?) \| (.+) \|$")

# docs/api.md heading -> the objects (griffe paths) whose reference entries show its rows: all of
# them, or the named ones where one table serves several functions
OUTPUTS = ("RequestOutput", "CompletionOutput", "Logprob", "BeamSearchOutput", "BeamSequence",
           "KVStats")
LOAD = "`LLM.load_weights(weights, lora_request=None)`, `LLM.sleep(level=1)`, `LLM.wake_up(tags=None)`, `LLM.is_sleeping()`"  # noqa: E501
TARGETS: dict[str, list[tuple[str, set[str] | None]]] = {
    "`LLM(model, **kwargs)`": [("llm.LLM", None)],
    "`LLM.generate(prompts, sampling_params=None, use_tqdm=True)`": [("llm.LLM.generate", None)],
    "`LLM.generate_stream(prompts, sampling_params=None, use_tqdm=True)`":
        [("llm.LLM.generate_stream", None)],
    "`LLM.beam_search(prompts, params, use_tqdm=True)`": [("llm.LLM.beam_search", None)],
    "`LLM.beam_search_stream(prompts, params, use_tqdm=True)`":
        [("llm.LLM.beam_search_stream", None)],
    "`LLM.chat(messages, sampling_params=None, ...)`": [("llm.LLM.chat", None)],
    "`LLM.get_tokenizer(lora_request=None)`": [("llm.LLM.get_tokenizer", None)],
    LOAD: [("llm.LLM.load_weights", {"weights", "lora_request"}), ("llm.LLM.sleep", {"level"}),
           ("llm.LLM.wake_up", {"tags"})],
    **{f"Outputs: `{name}(...)`": [(f"outputs.{name}", None)] for name in OUTPUTS},
    "`SamplingParams(...)`": [("params.SamplingParams", None)],
    "`BeamSearchParams(...)`": [("params.BeamSearchParams", None)],
    "`StructuredOutputsParams(...)`": [("params.StructuredOutputsParams", None)],
    "`batchgen.data.generate_dataset(llm, data, params=None, **kwargs)`":
        [("data.stages.generate_dataset", None)],
    "`batchgen.data.row_params(params, seed, row_id)`, `batchgen.data.row_seed(seed, row_id)`":
        [("data.rows.row_params", None), ("data.rows.row_seed", {"seed", "row_id"})],
    "`batchgen.ray.BatchgenProcessorConfig(...)` (the `[ray]` extra)":
        [("ray.processor.BatchgenProcessorConfig", None)],
    "`batchgen.ray.build_processor(config, preprocess=None, postprocess=None)`":
        [("ray.processor.build_processor", None), ("ray.processor.Processor", None)],
    "`batchgen.ray.numbered_blocks(data, size)`, `batchgen.ray.with_row_ids(ds)`":
        [("ray.processor.numbered_blocks", {"data", "size"}), ("ray.processor.with_row_ids", {"ds"})],
}


def api_rows(path: Path = API) -> dict[str, dict[str, tuple[str, str]]]:
    """Heading -> {parameter: (default as written, what it accepts)} of docs/api.md's tables."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    heading = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        m = ROW.match(line)
        if m and heading is not None:
            out.setdefault(heading, {})[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return out


def _text(accepts: str) -> str:
    """A table cell as docstring text: `\\|` unescaped, relative links one folder up (the
    reference pages are in docs/reference/, api.md in docs/). The default is the signature's,
    which mkdocstrings shows in its own column (equal to api.md's: tests/test_api_docs.py)."""
    return re.sub(r"\]\((?!https?:|#)([^)]+)\)", r"](../\1)", accepts.replace("\\|", "|"))


def args_section(rows: dict[str, tuple[str, str]], names: set[str] | None = None) -> str:
    lines = ["Args:"]
    for name, (default, accepts) in rows.items():
        if names is not None and name not in names:
            continue
        label = f"**{name}" if default == "**" else name
        lines.append(f"    {label}: {_text(accepts)}")
    return "\n".join(lines)


def _append(obj: griffe.Object, section: str) -> None:
    if obj.docstring is None:
        obj.docstring = griffe.Docstring(section, parent=obj)
    else:
        obj.docstring.value = obj.docstring.value.rstrip() + "\n\n" + section


class ApiParams(griffe.Extension):
    """Adds docs/api.md's rows to the docstrings of TARGETS once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **_: Any) -> None:
        if pkg.name != "batchgen":
            return
        tables = api_rows()
        for heading, objects in TARGETS.items():
            if heading not in tables:
                raise ValueError(f"docs/api.md has no table under {heading!r}")
            for path, names in objects:
                _append(pkg[path], args_section(tables[heading], names))
