"""Every benchmark script runs end to end on a very small model and workload (the figures in
benchmarks/RESULTS.md come from the same scripts at full size)."""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
    "beam_trace.py": [*SMALL[:12], "--num-prompts", "3", "--output-len", "3",
                      "--min-prompt-len", "4", "--max-prompt-len", "20", "--beam-widths", "2",
                      "--repeats", "1"],
    "kv_quality.py": [*SMALL[:12], "--num-prompts", "3", "--output-len", "3"],
    "ray_scaling.py": ["--model-size", "tiny", "--rows", "24", "--n", "2", "--max-tokens", "3",
                       "--batch-size", "6", "--actors", "1"],  # 2 actors: test_ray.py
    "dataset.py": [*SMALL[:12], "--rows", "40", "--n", "2", "--max-tokens", "4",
                   "--rss-rows", "50", "--rss-max-tokens", "2", "--repeats", "1"],
    "host_overhead.py": ["--rows", "16", "--window", "3,10", "--long-tokens", "20",
                         "--threads", "1", "--repeats", "1"],
    "eval.py": ["--model", "tiny", "--limit", "3", "--max-length", "128", "--threads", "1",
                "--num-fewshot", "2", "--no-cache-too"],
    "structured.py": ["--model", "tiny", "--num-prompts", "2", "--n", "2", "--max-tokens", "8",
                      "--bench-tokens", "4", "--repeats", "1", "--threads", "1", "--check"],
    # the tiny random model (batchgen.tools.demo_model); no vLLM there, so it says it skips
    # TP=1 and TP=2 (one worker process, a few seconds to start) on the smallest model
    "tensor_parallel.py": [*SMALL[:12], "--num-prompts", "3", "--output-len", "3",
                           "--min-prompt-len", "4", "--max-prompt-len", "20"],
    "swap.py": [*SMALL[:12], "--num-prompts", "3", "--output-len", "4", "--repeats", "1",
                "--min-prompt-len", "8", "--max-prompt-len", "30", "--n", "2",
                "--beam-width", "2", "--block-size", "4"],
    "startup.py": ["--repeats", "1", "--top", "3"],
    "spec_decode.py": [*SMALL[:12], "--num-prompts", "2", "--output-len", "4", "--threads", "1"],
    "lora.py": ["--prompts", "3", "--prompt-len", "6", "--new", "3", "--adapters", "0,2",
                "--hidden-size", "64"],  # fresh interpreters: no model at all
    # TRL's GRPO on the tiny model (its continuous-batching path is left out: minutes on a CPU)
    "rl_rollouts.py": ["--model", "tiny", "--steps", "2", "--prompts-per-step", "2",
                       "--num-generations", "2", "--max-completion-length", "4", "--repeats",
                       "1", "--threads", "1", "--systems", "hf,shared"],
    "hybrid.py": ["--num-prompts", "2", "--output-len", "2", "--min-len", "4", "--max-len",
                  "12", "--beam-prompts", "1", "--hidden-size", "64", "--vocab-size", "512",
                  "--hf-batch", "2", "--threads", "1"],
    "quantization.py": ["--model", "tiny", "--num-prompts", "2", "--output-len", "3",
                        "--methods", "full precision,torchao int8 (online)", "--threads", "1"],
    "vlm.py": ["--images", "6", "--max-tokens", "3", "--hf-batch-size", "3", "--threads", "1"],
    "vs_vllm.py": ["--model", "tiny", "--num-prompts", "3", "--sampling-prompts", "2", "--n", "2",
                   "--max-tokens", "3", "--repeats", "1", "--hf-batch-size", "2",
                   "--kv-cache-gib", "1", "--vllm-python", "/nonexistent/vllm-venv/bin/python"],
}

EXPECT = {  # lines a script must print with the settings above
    "eval.py": ["| bg_mc  | acc_norm,none", "| bg_ppl | bits_per_byte,none", "metrics agree",
                "| bg_mc  | batchgen, no prefix cache |"],
    "swap.py": ["swap gave the roomy pool's tokens", "| samples, width 2 | swap",
                "| beams, width 2   | recompute"],
    "beam_trace.py": ["| W | config", "| 2 | trace+logprobs |"],
    "structured.py": ["constrained / unconstrained tok/s", "| regex / beams w=4"],
    "host_overhead.py": ["| HF generate | greedy", "growth (penalties + stop, 64 rows)",
                         "function calls per decode step (penalties + stop, 64 rows)"],
    "tensor_parallel.py": ["| TP | wall s", "| all-reduce (rowwise o_proj, down_proj)",
                           "communication share of the step forward: ",
                           "greedy agreement TP=2 vs TP=1: "],
    "rl_rollouts.py": ["| TRL, HF generate ", "| batchgen, weights shared (no copy) "],
    "hybrid.py": ["greedy agreement with HF one prompt at a time: 2/2 prompts",
                  "| beams W=4 | batchgen", "| n=8 top-p | HF generate"],
    "spec_decode.py": ["| batchgen + ngram |", "batchgen ngram vs plain: "],
    "lora.py": ["| adapters | batchgen tok/s | vs base alone | PEFT mixed-batch tok/s"],
    "startup.py": ["| command | first s | warm median s | warm min s |",
                   "| `batchgen --help` |", "`import batchgen` imports none of torch"],
    "quantization.py": ["full precision: weights", "KV fp8, checkpoint scales vs the "
                        "model-dtype pool"],
    "vlm.py": ["| system | wall s | images/s | output tok/s | processor s | processor share |",
               "greedy agreement batchgen vs HF generate (batched): 6/6 prompts",
               "| processor | wall s | device busy s | device idle share |",
               "| ahead, in the workers |", "| when each chunk is pulled |"],
    "vs_vllm.py": ["vLLM: skipped (no python with vllm at /nonexistent/vllm-venv/bin/python",
                   "greedy agreement batchgen vs HF generate"],
}


NEEDS = {"ray_scaling.py": "ray", "eval.py": "lm_eval", "structured.py": "xgrammar",
         "rl_rollouts.py": "trl", "lora.py": "peft"}
FIRST = ("dataset.py", "gpu_bench.py", "rl_rollouts.py", "ray_scaling.py")  # the longest


def _run(script: str, out: Path) -> subprocess.CompletedProcess:
    argv = ALONE[script] if script in ALONE else [*SMALL, *RUNS[script]]
    return subprocess.run([sys.executable, f"benchmarks/{script}", *argv, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The selected scripts started up front, two at a time (each is mostly one interpreter's
    start-up on one core; the suite's 2 cores run two): the tests below wait for their own."""
    chosen = {item.callspec.params["script"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_benchmark_script_runs"}
    scripts = [s for s in (*FIRST, *sorted(RUNS), *sorted(ALONE)) if s in chosen
               and importlib.util.find_spec(NEEDS.get(s, "json")) is not None]
    folder = tmp_path_factory.mktemp("bench")
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {s: (pool.submit(_run, s, folder / f"{s}.json"), folder / f"{s}.json")
               for s in dict.fromkeys(scripts)}


@pytest.mark.parametrize("script", sorted(RUNS) + sorted(ALONE))
def test_benchmark_script_runs(script, launched):
    if script not in launched:
        pytest.skip(f"{NEEDS[script]} is not installed")
    future, out = launched[script]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.is_file() and proc.stdout
    words = " ".join(proc.stdout.split())  # table cells compared without their padding
    for line in EXPECT.get(script, []):
        assert " ".join(line.split()) in words, proc.stdout[-3000:]


def test_model_line_names_the_model_dir_model(tmp_path):
    """The benchmarks' header describes a --model-dir model from its config, and the random
    Llama from the model flags otherwise."""
    from benchmarks import common as h

    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)))
    flags = dict(dtype="float32", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                 intermediate_size=688, vocab_size=4096)
    line = h.model_line(argparse.Namespace(model_dir=tmp_path, **flags), 134_520_000)
    assert line == (f"model: {tmp_path.name} (llama), 134.52M params, hidden 576, 30 layers, "
                    "9/3 q/kv heads, ffn 1536, vocab 49152, float32")
    assert h.model_line(argparse.Namespace(model_dir=None, **flags)) == (
        "model: random Llama, hidden 256, 4 layers, 8/2 q/kv heads, ffn 688, vocab 4096, "
        "float32")


def test_host_overhead_beam_case(tmp_path):
    """`host_overhead.py --beams`: 64 prompts x width 4, batchgen early and late (the real
    forward, stubbed, stubbed reading the K/V's bytes), HF's own."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--beams",
                           "--beam-windows", "2,3,5,6", "--threads", "1", "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = re.sub(r" +", " ", proc.stdout)  # table cells without their padding
    for line in ("| batchgen | 64 x W=4 | 2-3", "| batchgen | 64 x W=4 | 5-6",
                 "| HF generate | 64 x W=4 | 2-3", "| batchgen, forward stubbed | 64 x W=4 | 5-6",
                 "growth (beams, batchgen): host ms at tokens 5-6",
                 "growth (beams, batchgen, forward stubbed): host ms at tokens 5-6",
                 "| batchgen, forward stubbed, K/V read | 64 x W=4 | 5-6",
                 "growth (beams, batchgen, forward stubbed, K/V read): host ms at tokens 5-6",
                 "function calls per decode step (beams):"):
        assert line in text, proc.stdout[-3000:]
    result = json.loads(out.read_text())
    assert {"growth", "growth_stubbed", "growth_stubbed_kv_read"} <= set(result)
    assert len(result["calls_per_step"]) == 2 and min(result["calls_per_step"]) > 0
def test_host_overhead_overlap_case_runs(tmp_path):
    """host_overhead.py --overlap: serial vs async steps around the stand-in device, and
    around the random model's forward (same tokens asserted inside)."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--overlap",
                           "--overlap-model", "--rows", "8", "--window", "3,10", "--repeats",
                           "1", "--threads", "1", "--standin-ms", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("| random Llama", "| serial |", "| async  |"):
        assert line in proc.stdout, proc.stdout[-3000:]
