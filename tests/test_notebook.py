"""Every notebook in notebooks/ runs top to bottom (its code cells, in order, in one namespace),
offline, with matplotlib on the non-interactive Agg backend; a notebook that uses matplotlib
must draw at least one figure."""

import json
import tempfile
import time
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_found():
    assert {"tour.ipynb", "kv_memory.ipynb", "beam_search.ipynb", "throughput.ipynb"} <= {
        nb.name for nb in NOTEBOOKS}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(notebook, tmp_path, monkeypatch):
    cells = json.loads(notebook.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert len(code) >= 3
    # Stored without outputs: small files, clean diffs.
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code"), (
        f"{notebook.name} has stored outputs: clear them before committing")
    plots = any("matplotlib" in src for src in code)
    assert plots, f"{notebook.name} draws no plot"
    figures = 0
    if plots:
        pytest.importorskip("matplotlib")
        monkeypatch.setenv("MPLBACKEND", "Agg")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.close("all")
        # Agg cannot show: keep the figures open so each cell's can be counted, then closed.
        monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the tiny models go here
    monkeypatch.setenv("BATCHGEN_DEMO_MODEL", "tiny")  # tests stay on tiny random models
    namespace: dict = {"__name__": "__notebook__"}
    start = time.perf_counter()
    try:
        for i, src in enumerate(code):
            try:
                exec(compile(src, f"{notebook.name}[code cell {i}]", "exec"), namespace)
            except Exception as e:  # name the cell that broke
                pytest.fail(f"{notebook.name} code cell {i} raised {type(e).__name__}: {e}")
            if plots:
                figures += len(plt.get_fignums())
                plt.close("all")
    finally:
        if plots:
            plt.close("all")
    print(f"{notebook.name}: {time.perf_counter() - start:.1f} s, {figures} figures")
    if plots:
        assert figures > 0, f"{notebook.name} imports matplotlib but drew no figure"
