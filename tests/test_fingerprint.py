"""scripts/fingerprint.py, the behaviour-as-bytes check for refactors: its workloads preempt
by recompute and by swap, hit the prefix cache and copy on write, and two runs of the same
checkout give the same bytes, the second with async scheduling (the next step planned while
this one's forward runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_fingerprint_covers_preemption_swaps_and_sharing_and_repeats(tiny_model_factory):
    model = tiny_model_factory("llama")
    cmd = [sys.executable, str(ROOT / "scripts" / "fingerprint.py"), str(model.parent),
           model.name]
    runs = [subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "BATCHGEN_ASYNC_SCHEDULING": mode}).stdout
            for mode in ("0", "1")]
    assert runs[0] == runs[1]
    fp = json.loads(runs[0])
    assert sorted(fp) == sorted(f"{model.name}/{p}" for p in ("roomy", "tight", "swap", "bs1"))
    kv = {pool.split("/")[1]: rec for pool, rec in fp.items()}
    # [peak, cow copies, preemptions, prefix hits, prompt tokens, swap outs, ...]
    assert kv["tight"]["n4_kv"][2] > 0 and kv["tight"]["n4_kv"][5] == 0
    assert kv["swap"]["greedy_kv"][5] > 0
    assert kv["roomy"]["shared_kv"][3] > 0 and kv["roomy"]["beams_kv"][1] > 0
