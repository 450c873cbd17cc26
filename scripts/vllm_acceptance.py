"""Run vLLM's own offline test files, unmodified, on batchgen.

    PYTHONPATH=. python scripts/vllm_acceptance.py [--version 0.34.0] [--out RESULT.json]
    PYTHONPATH=. python scripts/vllm_acceptance.py --fetch-only   # unpack the sdist only

vLLM's files are never committed here: this script takes them from vLLM's sdist on PyPI at run
time (`pip download --no-deps --no-binary :all:`; that command builds the package's metadata,
which vLLM's build backend cannot do without its toolchain, so when it fails the same file is
taken from the index pip reads, by the PEP 691 JSON of its simple page, and checked against
the sha256 pinned below), unpacks it under ~/.cache/batchgen/vllm-src, and lays a run folder:
vLLM's test files as they are, plus this project's fixture layer in place of vLLM's
tests/conftest.py and tests/utils.py (scripts/vllm_acceptance_layer/: `vllm_runner`,
`hf_runner`, `example_prompts` on batchgen and HF, hub ids mapped to tiny local models through
a throwaway HF cache, and stand-ins for the vLLM internals the files import). It then runs
pytest on the files and writes the outcome of every test (docs/vllm_acceptance.md explains it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = Path(__file__).resolve().parent / "vllm_acceptance_layer"
CACHE = Path(os.environ.get("BATCHGEN_CACHE_DIR", Path.home() / ".cache" / "batchgen")) / "vllm-src"
# the sdist the names in batchgen/vllm_api.json were read from
SHA256 = {"0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"}
# the twelve files (vLLM 0.34 merged samplers/test_ranks.py into test_logprobs.py)
FILES = [
    "samplers/test_logprobs.py", "samplers/test_ignore_eos.py", "samplers/test_no_bad_words.py",
    "samplers/test_beam_search.py", "samplers/test_non_finite_params.py",
    "v1/sample/test_sampling_params_e2e.py", "v1/sample/test_logprobs.py",
    "v1/sample/test_logprobs_e2e.py", "entrypoints/llm/test_generate.py",
    "entrypoints/llm/test_chat.py", "entrypoints/llm/test_prompt_validation.py",
    "detokenizer/test_stop_reason.py",
]
SUPPORT = ["prompts/example.txt", "v1/sample/utils.py"]  # vLLM's own, read by the files


def sdist(version: str) -> Path:
    """vLLM's sdist, downloaded once into CACHE and checked against its pinned sha256."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"vllm-{version}.tar.gz"
    if not path.exists():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                              "--no-binary", ":all:", "--no-build-isolation", "-d", str(CACHE),
                              f"vllm=={version}"], capture_output=True, text=True)
        if not path.exists():  # pip stopped at vLLM's metadata build: take the same file
            print("pip download could not prepare vLLM's metadata "
                  f"({got.stderr.strip().splitlines()[-1:]}); reading the index's JSON")
            _from_index(version, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    want = SHA256.get(version)
    if want and digest != want:
        path.unlink()
        raise SystemExit(f"vllm-{version}.tar.gz has sha256 {digest}, expected {want}")
    return path


def _from_index(version: str, path: Path) -> None:
    """The sdist's file from PyPI's simple index (PEP 691 JSON)."""
    req = urllib.request.Request("https://pypi.org/simple/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        files = json.load(r)["files"]
    entry = next(f for f in files if f["filename"] == path.name)
    urllib.request.urlretrieve(entry["url"], path)


def unpack(version: str) -> Path:
    """The sdist's tree (unpacked once)."""
    tree = CACHE / f"vllm-{version}"
    if not (tree / "tests").is_dir():
        with tarfile.open(sdist(version)) as tar:
            tar.extractall(CACHE, filter="data")
    return tree


def lay_out(tree: Path, run: Path) -> None:
    """The run folder: vLLM's files untouched, packages' __init__.py, our fixture layer."""
    if run.exists():
        shutil.rmtree(run)
    for rel in FILES + SUPPORT:
        dst = run / "tests" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / "tests" / rel, dst)
        for pkg in [dst.parent, *dst.parent.parents]:
            if pkg == run:
                break
            (pkg / "__init__.py").touch()
    for name in ("conftest.py", "utils.py"):  # ours, in place of vLLM's (never copied)
        shutil.copy2(LAYER / name, run / "tests" / name)
    shutil.copy2(LAYER / "stand_ins.py", run / "vllm_stand_ins.py")
    (run / "pytest.ini").write_text("[pytest]\nmarkers =\n    skip_global_cleanup\n"
                                    "    core_model\n    slow_test\n    cpu_model\n")


def run_pytest(run: Path, out: Path, extra: list[str]) -> dict:
    """pytest over the files; returns {"counts": ..., "tests": {nodeid: outcome}}."""
    report = run / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(run), str(ROOT)]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
           "--continue-on-collection-errors",
           "-o", "addopts=", f"--rootdir={run}", "-p", "tests.conftest_report",
           *[f"tests/{f}" for f in FILES], *extra]
    (run / "tests" / "conftest_report.py").write_text(_REPORTER.format(path=str(report)))
    proc = subprocess.run(cmd, cwd=run, env=env, text=True, capture_output=True)
    (run / "pytest.log").write_text(proc.stdout + proc.stderr)
    result = json.loads(report.read_text()) if report.exists() else {"tests": {}}
    counts: dict[str, int] = {}
    for outcome in result["tests"].values():
        counts[outcome["outcome"]] = counts.get(outcome["outcome"], 0) + 1
    result["counts"] = counts
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(proc.stdout[-3000:])
    return result


# A tiny pytest plugin: each test's outcome (its worst phase) and the first line of its reason.
_REPORTER = '''
import json
_TESTS = {{}}

def pytest_runtest_logreport(report):
    rank = {{"passed": 0, "skipped": 1, "failed": 2}}
    outcome = report.outcome
    if report.when != "call" and outcome == "failed":
        outcome = "error"
    old = _TESTS.get(report.nodeid)
    if old is None or rank.get(outcome, 3) > rank.get(old["outcome"], 3):
        reason = ""
        if report.longrepr is not None:
            text = getattr(report.longrepr, "reprcrash", None)
            reason = text.message if text is not None else str(report.longrepr)
        _TESTS[report.nodeid] = {{"outcome": outcome, "reason": reason.splitlines()[0][:300]
                                  if reason else ""}}

def pytest_collectreport(report):
    if report.failed:
        _TESTS[report.nodeid] = {{"outcome": "error", "reason": str(report.longrepr)
                                  .strip().splitlines()[-1][:300]}}

def pytest_sessionfinish(session):
    with open({path!r}, "w") as f:
        json.dump({{"tests": _TESTS}}, f)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="0.34.0")
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/batchgen-vllm-acceptance"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/batchgen-vllm-acceptance.json"))
    ap.add_argument("--fetch-only", action="store_true")
    a, extra = ap.parse_known_args()
    tree = unpack(a.version)
    if a.fetch_only:
        print(tree)
        return
    lay_out(tree, a.run_dir)
    result = run_pytest(a.run_dir, a.out, extra)
    print(f"vLLM {a.version}'s offline tests on batchgen: {result['counts']} -> {a.out}")


if __name__ == "__main__":
    main()
