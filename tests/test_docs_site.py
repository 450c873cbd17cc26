"""The docs site (`mkdocs.yml`, `docs/`): `mkdocs build --strict` passes (a broken link, an
anchor that is gone, a page outside the nav or an API reference object that no longer imports
fails it), the guide's code blocks marked ```python title="runnable"``` run on a tiny random
model, and the README's benchmark figures are ones `benchmarks/RESULTS.md` records."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = re.compile(r'```python title="runnable"\n(.*?)```', re.S)


def test_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - start < 30, "the site's build must stay under 30 s"
    site = tmp_path / "site"
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


def _runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        blocks += [(page.name, code) for code in RUNNABLE.findall(page.read_text())]
    return blocks


def test_docs_have_runnable_blocks() -> None:
    assert _runnable_blocks(), 'no ```python title="runnable"``` block left in docs/'


@pytest.mark.parametrize(("page", "code"), _runnable_blocks(), ids=lambda v: str(v)[:20])
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
