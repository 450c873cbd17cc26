"""distributed_executor_backend="external_launcher": under `torchrun --nproc-per-node 2` (gloo,
CPU) every rank runs the whole script (SPMD, as TRL's colocated tensor parallelism does) and
gets the same outputs as tensor_parallel_size=1; load_weights sends each rank the full tensor
(each keeps its shard); sleep / wake_up work on every rank."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import textwrap

import pytest
import torch

from batchgen import LLM, SamplingParams

SCRIPT = """
import json, os, sys
import torch
from batchgen import LLM, SamplingParams

def run(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=0.7, top_k=20, max_tokens=6, ignore_eos=True, seed=3,
                             logprobs=0, n=2)
    outs = llm.generate([{"prompt_token_ids": [1, 5, 9, 33, 70]}, {"prompt_token_ids": [1, 8]}],
                        greedy, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": [1, 44, 45, 46]}], sampled, use_tqdm=False)
    return [[list(c.token_ids), [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]]
            for o in outs for c in o.outputs]

def steps(llm, lm_head):
    first = run(llm)
    llm.load_weights([("lm_head.weight", lm_head)])
    second = run(llm)
    llm.sleep(level=1)  # the pool goes and comes back (level 2 is tested at one rank)
    assert llm.cache.pool.untyped_storage().nbytes() == 0
    llm.wake_up()
    return [first, second, run(llm)]

def main(path, k):
    kw = dict(num_kv_blocks=32, block_size=4, enable_sleep_mode=True,
              logprobs_mode="processed_logprobs", seed=0)
    if k > 1:
        kw.update(tensor_parallel_size=k, distributed_executor_backend="external_launcher")
    llm = LLM(path, **kw)
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(llm.vocab_size, llm.config.hidden_size, generator=gen) * 0.2
    return steps(llm, lm_head)

if __name__ == "__main__":
    path, k, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = json.dumps(main(path, k))  # a file per rank: their stdout lines interleave
    with open(os.path.join(out, "result-" + os.environ.get("RANK", "-") + ".json"), "w") as f:
        f.write(result)
"""


def results(folder) -> dict[str, list]:
    return {f.stem.removeprefix("result-"): json.loads(f.read_text())
            for f in folder.glob("result-*.json")}


def test_tp2_under_torchrun_equals_tp1_on_every_rank(tiny_model_factory, tmp_path) -> None:
    path = tiny_model_factory("llama")
    script = tmp_path / "external.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    (two := tmp_path / "tp2").mkdir()
    tp2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(script), str(path), "2", str(two)], capture_output=True, text=True,
                         timeout=180, env=env)
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    # the same script at tensor_parallel_size 1, here (JSON: the form the ranks wrote)
    want, got = json.loads(json.dumps(runpy.run_path(str(script))["main"](str(path), 1))), \
        results(two)
    assert sorted(got) == ["0", "1"]  # both ranks ran the script and got every output
    for rank in ("0", "1"):
        for stage_got, stage_want in zip(got[rank], want):
            assert [t for t, _ in stage_got] == [t for t, _ in stage_want], rank
            for (_, lp_got), (_, lp_want) in zip(stage_got, stage_want):
                assert lp_got == pytest.approx(lp_want, abs=1e-4)
    assert got["0"] == got["1"]  # the ranks agree bit for bit
    assert [t for t, _ in want[0]] != [t for t, _ in want[1]]  # load_weights changed them
    assert want[1] == want[2]  # slept, woke: the same


def test_external_launcher_without_a_world_is_refused(tiny_model_factory, monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="runs inside a torch.distributed world: start the "
                                         "script with torchrun"):
        LLM(tiny_model_factory("llama"), tensor_parallel_size=2, num_kv_blocks=32,
            distributed_executor_backend="external_launcher")
    assert SamplingParams  # the module's imports stay used
