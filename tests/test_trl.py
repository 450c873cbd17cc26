"""TRL 1.16's GRPOTrainer(use_vllm=True, vllm_mode="colocate") on batchgen (examples/grpo_trl.py's
main, every run in one fresh process: `batchgen.vllm_compat.install()` is process-wide and TRL
is slow to import): at least 5 steps,
the trainable parameters change, and TRL's own check of the generator's logprobs against its
recomputation stays at float rounding at temperature 1.0 and 0.7, with weights copied (vLLM's
way) or shared, with sleep mode on or off; and QLoRA (a 4-bit NF4 policy with a LoRA adapter,
the generator in 4-bit too: TRL's merged 4-bit bytes reach it, batchgen/quantization/
bnb_sync.py), where after the first step the gap is the merged adapter's 4-bit rounding. The
driver turns off bitsandbytes' bf16 CPU kernel (inference only) so the generator multiplies as
the training forward does (else the gap is that kernel's bf16 rounding, ~2e-2)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"t1.0": ["--temperature", "1.0"], "t0.7": ["--temperature", "0.7"],
        "t0.7-sleep": ["--temperature", "0.7", "--sleep-mode"],
        "t0.7-shared-sleep": ["--temperature", "0.7", "--sleep-mode", "--share-weights"]}
if importlib.util.find_spec("bitsandbytes") and importlib.util.find_spec("peft"):
    RUNS["qlora"] = ["--temperature", "1.0", "--qlora"]


DRIVER = """
import runpy, sys
try:  # the generator's 4-bit matmul = the training one's (the qlora run)
    import bitsandbytes.nn.modules as bnb
    init = bnb.Linear4bit.__init__
    def same_kernel(self, *args, **kw):
        init(self, *args, **kw)
        self.support_avx512bf16_for_cpu = False
    bnb.Linear4bit.__init__ = same_kernel
except ImportError:
    pass
example = runpy.run_path(sys.argv[1])  # installs batchgen.vllm_compat, then imports TRL
for key, args in {runs!r}.items():
    print("=== run", key, flush=True)
    example["main"]([sys.argv[2], "--steps", "5", "--json", key + ".json", *args])
"""


@pytest.fixture(scope="module")
def results(tiny_model_factory, tmp_path_factory) -> dict[str, dict]:
    """Every run, one after the other in one process, then read back."""
    model = str(tiny_model_factory("llama", vocab_size=300, seed=21))
    out = tmp_path_factory.mktemp("grpo")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER.format(runs=RUNS), str(ROOT / "examples" / "grpo_trl.py"),
         model], cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = dict(part.split("\n", 1) for part in proc.stdout.split("=== run ")[1:])
    return {k: json.loads((out / f"{k}.json").read_text()) | {"log": logs[k]} for k in RUNS}


@pytest.mark.parametrize("run", list(RUNS))
def test_grpo_colocate_on_batchgen(results, run: str) -> None:
    r = results[run]
    assert len(r["steps"]) >= 5 and r["changed"] == r["params"]  # every parameter trained
    assert r["shared"] == ("shared" in run)
    for i, step in enumerate(r["steps"]):
        bound = 2e-3 if run == "qlora" and i else 1e-5  # merged into 4-bit: rounding
        assert step["sampling/sampling_logp_difference/mean"] <= bound, step
        assert step["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=bound)
    assert "batchgen.vllm_compat.compat_llm.CompatLLM" in r["log"]
