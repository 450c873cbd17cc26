"""The README's demo (`scripts/demo.sh` runs examples/quickstart.py) works on a tiny model."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs(tiny_model_factory, capsys):
    quickstart = runpy.run_path(str(ROOT / "examples" / "quickstart.py"))
    quickstart["main"](str(tiny_model_factory("llama", eos_boost=0.06)))
    out = capsys.readouterr().out
    assert "sample 3:" in out and "stop at 'e'" in out and "chat:" in out
    assert "Logprob(logprob=" in out and "KVStats(" in out
