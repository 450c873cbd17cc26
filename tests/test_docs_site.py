"""The docs site (`mkdocs.yml`, `docs/`): `mkdocs build --strict` passes (a broken link, an
anchor that is gone, a page outside the nav or an API reference object that no longer imports
fails it) within the issue's 30 s, every public parameter has its text on its reference page,
the guide's code blocks marked ```python title="runnable"``` run on a tiny random model, the
README's benchmark tables are RESULTS.md's newest, rendered from the JSON the benchmarks wrote,
and the notebooks' exported plots are current and shown on the How it works page."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import resource
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
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    # CPU seconds: on this shared 2-core machine the wall clock also counts other jobs' load
    assert cpu < 30, f"the site's build must stay under 30 s (it took {cpu:.1f} s of CPU, " \
        f"{time.monotonic() - start:.1f} s wall)"
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
    arguments or reads fields of: `LLM` and its public methods, the params classes, the output
    classes of `batchgen.__all__`, batchgen.data's and batchgen.ray's public names."""
    import batchgen
    import batchgen.data as bg_data
    import batchgen.ray as bg_ray
    from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams

    out: list[tuple[str, str, Any]] = [("llm", "batchgen.llm.LLM", LLM)]
    out += [("llm", f"batchgen.llm.LLM.{n}", m) for n, m in vars(LLM).items()
            if not n.startswith("_") and inspect.isfunction(m)]
    out += [("params", f"batchgen.params.{c.__name__}", c)
            for c in (SamplingParams, BeamSearchParams, StructuredOutputsParams)]
    out += [("outputs", f"batchgen.outputs.{n}", getattr(batchgen, n)) for n in batchgen.__all__
            if inspect.isclass(getattr(batchgen, n))
            and getattr(batchgen, n).__module__ == "batchgen.outputs"]
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


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_benchmark_table_is_results_newest() -> None:
    """The README's tables are the newest ones in benchmarks/RESULTS.md, and those are what the
    benchmarks wrote to benchmarks/figures/*.json (scripts/readme_figures.py renders both)."""
    figures = _script("readme_figures")
    block = figures.render()
    results, readme = figures.RESULTS.read_text(), figures.README.read_text()
    newest = results[results.index(figures.BEGIN):results.index(figures.END) + len(figures.END)]
    assert newest == block, "benchmarks/RESULTS.md's newest table is not benchmarks/figures/'s"
    assert block in readme.split("## Benchmarks", 1)[1], "README's table is not RESULTS.md's"
    assert len(re.findall(r"\d\.\d\dx", block)) >= 6, block  # the ratios were rendered


def test_notebook_figures_are_exported_and_shown() -> None:
    """Each notebook's figures are in docs/assets/notebooks/, exported from the notebook as it
    is now (scripts/export_notebook_figures.py), and the How it works page shows each one."""
    export = _script("export_notebook_figures")
    manifest = json.loads(export.MANIFEST.read_text())
    page = (ROOT / "docs" / "guide" / "how-it-works.md").read_text()
    for notebook in sorted(export.NOTEBOOKS.glob("*.ipynb")):
        entry = manifest.get(notebook.name)
        assert entry and entry["figures"], f"{notebook.name}: no exported figures"
        assert entry["sha256"] == export.digest(notebook), (
            f"{notebook.name} changed since its figures were exported: run "
            "scripts/export_notebook_figures.py")
        for name in entry["figures"]:
            assert (export.OUT / name).stat().st_size > 1000, name
            assert f"../assets/notebooks/{name})" in page, f"how-it-works.md does not show {name}"
