"""notebooks/tour.ipynb runs top to bottom (its code cells, in order, in one namespace)."""

import json
import tempfile
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "tour.ipynb"


def test_tour_notebook_runs(tmp_path, monkeypatch):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert len(code) >= 5
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the tiny model goes here
    namespace: dict = {"__name__": "__notebook__"}
    for i, cell in enumerate(code):
        src = "".join(cell["source"])
        try:
            exec(compile(src, f"{NOTEBOOK.name}[code cell {i}]", "exec"), namespace)
        except Exception as e:  # name the cell that broke
            pytest.fail(f"code cell {i} raised {type(e).__name__}: {e}")
