"""The docs site (`mkdocs.yml`, `docs/`): `mkdocs build --strict` passes (a broken link, an
anchor that is gone, a page outside the nav or an API reference object that no longer imports
fails it), the guide's code blocks marked ```python title="runnable"``` run on a tiny random
model, and the README's benchmark figures are ones `benchmarks/RESULTS.md` records."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = re.compile(r'```python title="runnable"\n(.*?)```', re.S)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once with `mkdocs build --strict` (and timed: the issue's 30 s bound)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("docs") / "site"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - start < 30, "the site's build must stay under 30 s"
    return out


def test_site_builds_strictly(site: Path) -> None:
    assert (site / "search" / "search_index.json").is_file()
    params = (site / "reference" / "params" / "index.html").read_text()
    for name in ("max_tokens", "beam_width", "length_penalty"):
        assert f'id="batchgen.params.SamplingParams.{name}"' in params or \
            f'id="batchgen.params.BeamSearchParams.{name}"' in params, name
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("generate", "beam", "kv-plan", "bench", "run-batch", "eval"):
        assert f"usage: batchgen {command}" in cli, command
    families = pytest.importorskip("tests.families")
    models = (site / "guide" / "models" / "index.html").read_text()
    for name in list(families.MATRIX)[:3] + list(families.MATRIX)[-3:]:
        assert f"<code>{name}</code>" in models, name


def _public_callables() -> list[tuple[str, str, Any]]:
    """(reference page, the object's id there, the object) for everything a user calls with
    arguments: `LLM` and its public methods, the params classes, batchgen.data's and
    batchgen.ray's public names."""
    import batchgen.data as bg_data
    import batchgen.ray as bg_ray
    from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams

    out: list[tuple[str, str, Any]] = [("llm", "batchgen.llm.LLM", LLM)]
    out += [("llm", f"batchgen.llm.LLM.{n}", m) for n, m in vars(LLM).items()
            if not n.startswith("_") and inspect.isfunction(m)]
    out += [("params", f"batchgen.params.{c.__name__}", c)
            for c in (SamplingParams, BeamSearchParams, StructuredOutputsParams)]
    out += [("data", f"batchgen.data.{n}", getattr(bg_data, n)) for n in bg_data.__all__]
    out += [("ray", f"batchgen.ray.{n}", getattr(bg_ray, n)) for n in bg_ray.__all__]
    return out


def _parameter_texts(html: str, object_id: str) -> dict[str, str]:
    """{parameter: its text} of the Parameters table in the object's own entry."""
    start = html.find(f'id="{object_id}"')
    assert start >= 0, f"no reference entry for {object_id}"
    entry = html[start:html.find('<div class="doc doc-object ', start)]
    table = entry.split('class="doc-section-title">Parameters:', 1)[-1].split("</table>", 1)[0]
    texts = {}
    for row in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', table, re.S):
        name = re.search(r"<code>([*\w]+)</code>", row)
        text = re.search(r'class="doc-md-description">(.*?)</div>', row, re.S)
        if name and text:
            texts[name.group(1).lstrip("*")] = re.sub(r"<[^>]+>|\s+", " ", text.group(1)).strip()
    return texts


def test_reference_documents_every_parameter(site: Path) -> None:
    """Every parameter of every public callable has a row with text on its reference page (the
    rows come from docs/api.md through scripts/docs_api_params.py)."""
    pages: dict[str, str] = {}
    missing = []
    for page, object_id, obj in _public_callables():
        html = pages.setdefault(page, (site / "reference" / page / "index.html").read_text())
        texts = _parameter_texts(html, object_id)
        names = [p for p in inspect.signature(obj).parameters if p != "self"]
        missing += [f"{object_id}({name})" for name in names if not texts.get(name)]
    assert not missing, f"parameters without text on their reference page: {missing}"


def _runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        name = page.relative_to(ROOT / "docs").as_posix()
        blocks += [(name, code) for code in RUNNABLE.findall(page.read_text())]
    return blocks


def test_docs_have_runnable_blocks() -> None:
    assert _runnable_blocks(), 'no ```python title="runnable"``` block left in docs/'


@pytest.mark.parametrize(("page", "code"), _runnable_blocks(), ids=lambda v: str(v)[:24])
def test_runnable_block_runs(page: str, code: str, tiny_model_factory) -> None:
    exec(compile(code, f"docs/{page}", "exec"), {"MODEL": str(tiny_model_factory("llama"))})


def _figures(text: str) -> list[str]:
    return re.findall(r"\d[\d,]*\.?\d*(?:x|%)?", text)


def test_readme_benchmark_table_is_from_results() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")
            and not line.startswith(("| workload", "| memory"))]
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    cells = [c.strip() for row in rows for c in row.strip("|").split("|")[1:]]
    figures = [f for c in cells for f in _figures(c.split(" (")[0]) if f]
    assert len(figures) >= 10, figures
    missing = [f for f in figures if f not in results]
    assert not missing, f"README figures not in benchmarks/RESULTS.md: {missing}"
