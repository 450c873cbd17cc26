"""Shared pytest fixtures: tiny offline HF model folders built once per session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Everything is built in-process: never reach for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Tiny models run fastest on one thread, and intra-op threads on a busy 2-core machine slow
# HF generate down 10-20x. Override with BATCHGEN_TEST_THREADS=N.
torch.set_num_threads(int(os.environ.get("BATCHGEN_TEST_THREADS", "1")))

# Make `import batchgen` work under a bare `pytest` run from a source checkout.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Callable ``(family="llama", **kw) -> Path`` that writes each distinct model once.

    ``kw`` goes to :func:`batchgen.tools.make_tiny_model.make_tiny_model` (``vocab_size``,
    ``seed``, ``eos_boost``, ``dtype``, config overrides such as ``num_hidden_layers``).
    """
    from batchgen.tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[tuple[Any, ...], Path] = {}

    def factory(family: str = "llama", **kw: Any) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_tiny_model(root / f"{family}-{len(cache)}", family=family, **kw)
        return cache[key]

    return factory


@pytest.fixture(params=["serial", "async"])
def engine_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with both engines: serial, and async scheduling (the next step planned while
    this one's forward runs), by flipping the LLM's default through BATCHGEN_ASYNC_SCHEDULING.

    The async duplicate runs only where it proves something beyond tests/test_fingerprint.py
    (every fingerprint workload, serial and async, byte for byte: preemption by recompute and
    swap, n samples, prefix hits, copy on write, beams) and tests/test_overlap.py:
    test_generate_hf.py narrows it (indirect parametrization) to the preempt+chunked layout
    of every family; test_beam_search.py keeps both. `BATCHGEN_ASYNC_SCHEDULING=1 pytest`
    runs every other test with the async engine too."""
    monkeypatch.setenv("BATCHGEN_ASYNC_SCHEDULING", "1" if request.param == "async" else "0")
    return request.param


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The family matrix's families without an expectation (tests/test_families.py records
    each as a "new_family" user property of its test report): one line each."""
    lines = dict.fromkeys(
        value for reports in terminalreporter.stats.values() for report in reports
        for key, value in getattr(report, "user_properties", ()) if key == "new_family")
    if lines:
        terminalreporter.section("family matrix: families new to the expectations")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_vlm_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Callable ``(family="llava", seed=0) -> Path``: a tiny vision-language model folder
    (weights, tokenizer, image processor, processor), written once per session."""
    from batchgen.tools.make_tiny_vlm import make_tiny_vlm

    root = tmp_path_factory.mktemp("tiny-vlms")
    cache: dict[tuple[str, int], Path] = {}

    def factory(family: str = "llava", seed: int = 0) -> Path:
        if (family, seed) not in cache:
            cache[family, seed] = make_tiny_vlm(root / f"{family}-{seed}", family, seed)
        return cache[family, seed]

    return factory
