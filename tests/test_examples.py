"""The examples run on a tiny model: quickstart in-process (the README's demo, `scripts/demo.sh`)
and every other script in examples/ as a fresh `python examples/X.py MODEL` process, plus one
with no argument (it makes its own tiny model under $BATCHGEN_CACHE_DIR)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240

QUICKSTART = ["sample 3:", "stop at 'e'", "chat:", "Logprob(logprob=", "KVStats("]
# Script -> strings its stdout must contain (quickstart runs in-process only, below: as a
# process it ran the same main on the same model folder again).
MARKERS = {
    "chat": ["user:      What is the capital of France?", "assistant: ", "sample 2:"],
    "samples_over_dataset": ["12 rows x n=4 samples", "reloaded 12 rows", "sample 3:",
                             "resume=True: 0 prompt tokens computed", "-> no new work"],
    "beam_search_experiment": ["mean best score", "   16 |", "all widths agree with HF"],
    "prefix_sharing": ["32 questions sharing one system prompt", "prefix caching",
                       "greedy outputs identical with and without caching: True"],
    "structured_outputs": ["JSON schema: 6 rows x n=4 samples", "finished and valid",
                           "every returned beam matches the regex"],
    "hybrid_model": ["state per sequence: ", "greedy equals HF generate: True", "sample 3:",
                     "beam score"],
    "caption_images": ["captioned 12 images -> captions.parquet", "from the prefix cache",
                       "outputs equal a run without the cache: True"],
}
# make their own tiny model (a hybrid; a vision-language model), not the llama
OWN_MODEL = {"hybrid_model", "caption_images"}
NO_ARG = "samples_over_dataset"  # the one run without a model folder


def test_quickstart_runs(tiny_model_factory, capsys, runs):
    # `runs` only starts the example processes first, to overlap them with this in-process run.
    quickstart = runpy.run_path(str(ROOT / "examples" / "quickstart.py"))
    # what `python examples/quickstart.py MODEL` runs
    quickstart["main"](quickstart["demo_model"](str(tiny_model_factory("llama",
                                                                       eos_boost=0.06))))
    out = capsys.readouterr().out
    for marker in QUICKSTART:
        assert marker in out, f"quickstart: {marker!r} missing from its output:\n{out}"


@pytest.fixture(scope="module")
def runs(tiny_model_factory, tmp_path_factory) -> Iterator[dict[str, subprocess.Popen]]:
    """Every example started at once (they are mostly start-up time: together they take about
    as long as the slowest), each in its own working folder; tests wait on their own."""
    model = str(tiny_model_factory("llama", eos_boost=0.06))
    procs: dict[str, subprocess.Popen] = {}
    jobs = [(name, [] if name in OWN_MODEL else [model]) for name in MARKERS]
    jobs += [("no-arg", [])]
    for key, args in jobs:
        name = NO_ARG if key == "no-arg" else key
        script = ROOT / "examples" / f"{name}.py"
        if not script.is_file():
            continue
        cwd = tmp_path_factory.mktemp(f"example-{key}")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        if key == "no-arg":  # the tiny model is made here, not in ~/.cache
            env["BATCHGEN_CACHE_DIR"] = str(cwd / "cache")
        procs[key] = subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _output(runs: dict[str, subprocess.Popen], key: str) -> str:
    if key not in runs:
        pytest.skip(f"examples/{key}.py does not exist (yet)")
    try:
        out, err = runs[key].communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        runs[key].kill()
        pytest.fail(f"{key} ran over {TIMEOUT_S} s")
    assert runs[key].returncode == 0, f"{key} exited {runs[key].returncode}:\n{err[-3000:]}"
    return out


@pytest.mark.parametrize("name", list(MARKERS))
def test_example_script_runs(runs, name):
    if name == "structured_outputs":
        pytest.importorskip("xgrammar")
    out = _output(runs, name)
    for marker in MARKERS[name]:
        assert marker in out, f"{name}: {marker!r} missing from its output:\n{out}"


def test_example_without_a_model_argument(runs, tmp_path_factory):
    out = _output(runs, "no-arg")
    for marker in MARKERS[NO_ARG]:
        assert marker in out, out
    made = list(tmp_path_factory.getbasetemp().glob("example-no-arg*/cache/batchgen/models/*/config.json"))
    assert made, "the example did not make its tiny model under $BATCHGEN_CACHE_DIR"
