"""Every benchmark script runs end to end on a very small model and workload (the figures in
benchmarks/RESULTS.md come from the same scripts at full size)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--hidden-size", "64", "--num-layers", "1", "--num-heads", "4", "--num-kv-heads", "2",
         "--intermediate-size", "128", "--vocab-size", "512", "--num-prompts", "3",
         "--repeats", "1", "--hf-batch-sizes", "2", "--output-len", "3"]
RUNS = {
    "throughput.py": ["--min-prompt-len", "4", "--max-prompt-len", "20"],
    "sampling.py": ["--min-prompt-len", "4", "--max-prompt-len", "20", "--n", "2",
                    "--beam-widths", "2", "--skip-generate-batch"],
    "prefix_cache.py": ["--system-len", "40", "--min-question-len", "4",
                        "--max-question-len", "8"],
}


ALONE = {  # scripts with their own small settings
    "gpu_bench.py": ["--device", "cpu", "--quick"],
    "kv_quality.py": [*SMALL[:12], "--num-prompts", "3", "--output-len", "3"],
    "ray_scaling.py": ["--model-size", "tiny", "--rows", "24", "--n", "2", "--max-tokens", "3",
                       "--batch-size", "6"],
    "dataset.py": [*SMALL[:12], "--rows", "40", "--n", "2", "--max-tokens", "4",
                   "--rss-rows", "50,200", "--rss-max-tokens", "2", "--repeats", "1"],
}


@pytest.mark.parametrize("script", sorted(RUNS) + sorted(ALONE))
def test_benchmark_script_runs(script, tmp_path):
    if script == "ray_scaling.py":
        pytest.importorskip("ray")
    out = tmp_path / "result.json"
    argv = ALONE[script] if script in ALONE else [*SMALL, *RUNS[script]]
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *argv,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.is_file() and proc.stdout
