"""distributed_executor_backend="external_launcher": under `torchrun --nproc-per-node 2` and `4`
(gloo, CPU) every rank runs the whole script (SPMD, as TRL's colocated tensor parallelism does). At
tensor_parallel_size 2 the world is two groups of consecutive ranks, each generating for its own
prompts, and each gets the outputs of tensor_parallel_size 1 on them; load_weights sends each
rank the full tensor (each keeps its shard); level-2 sleep frees every rank's shards and
wake_up + load_weights brings them back; a LoRA adapter on column- and row-parallel layers
gives one rank's tokens. At tensor_parallel_size 1 each rank is its own engine."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import save_lora_adapter

from batchgen import LLM, SamplingParams

SCRIPT = """
import json, os, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from batchgen import LLM, SamplingParams
from batchgen.lora import LoRARequest

def run_lora(llm, i, folder):
    # the i-th copy's prompts under a LoRA adapter (split along the layers' plan) and the base
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    req = LoRARequest("a", 1, folder)
    outs = llm.generate([{"prompt_token_ids": [1, 7, 21 + i, 4]}, {"prompt_token_ids": [1, 9]}],
                        greedy, lora_request=[req, None], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]

def run(llm, i):
    # the i-th data-parallel copy's prompts
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=0.7, top_k=20, max_tokens=6, ignore_eos=True, seed=3,
                             logprobs=0, n=2)
    outs = llm.generate([{"prompt_token_ids": [1, 5, 9, 33 + i, 70]},
                         {"prompt_token_ids": [1, 8 + i]}], greedy, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": [1, 44, 45, 46 + i]}], sampled, use_tqdm=False)
    return [[list(c.token_ids), [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]]
            for o in outs for c in o.outputs]

def weight_bytes(llm):
    # this rank's: a DTensor's shard, or a replicated (norm) weight
    return sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes()
               for p in llm.model.parameters())

def lm_head(llm):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(llm.vocab_size, llm.config.hidden_size, generator=gen) * 0.2

def steps(llm, i, path):
    first = run(llm, i)
    head = lm_head(llm)
    llm.load_weights([("lm_head.weight", head)])
    second = run(llm, i)
    llm.sleep(level=2)  # every rank frees its own shards, and its pool
    freed = weight_bytes(llm) == 0 and llm.cache.pool.untyped_storage().nbytes() == 0
    llm.wake_up(tags=["weights"])  # TRL's order: weights, load, then the cache
    state = load_file(str(next(Path(path).glob("*.safetensors"))))
    llm.load_weights(list(state.items()) + [("lm_head.weight", head)])
    llm.wake_up(tags=["kv_cache"])
    return [first, second, run(llm, i)], freed

def main(path, out, folder):
    rank = int(os.environ["RANK"])
    kw = dict(num_kv_blocks=32, block_size=4, enable_sleep_mode=True, seed=0,
              logprobs_mode="processed_logprobs", distributed_executor_backend="external_launcher")
    tp = LLM(path, tensor_parallel_size=2, enable_lora=True, max_lora_rank=8, **kw)
    q = tp.model.model.layers[0].self_attn.q_proj.weight  # this rank's half of the heads
    assert q.to_local().shape[0] * 2 == q.shape[0] and q.device_mesh.size() == 2
    lora = run_lora(tp, rank // 2, folder)
    tp_runs, freed = steps(tp, rank // 2, path)
    dp = run(LLM(path, **kw), rank)  # tensor_parallel_size 1: this rank's own engine
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:  # their stdout interleaves
        json.dump({"tp": tp_runs, "freed": freed, "dp": dp, "lora": lora}, f)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
"""


def results(folder) -> dict[str, dict]:
    return {f.stem.removeprefix("result-"): json.loads(f.read_text())
            for f in folder.glob("result-*.json")}


def assert_same(got: list, want: list, where: str) -> None:
    """Tokens equal, logprobs to 1e-4 (the shards' sums round differently)."""
    assert [t for t, _ in got] == [t for t, _ in want], where
    for (_, lp_got), (_, lp_want) in zip(got, want):
        assert lp_got == pytest.approx(lp_want, abs=1e-4), where


@pytest.mark.parametrize("nproc", [2, 4])  # one TP group spanning the world; two groups
def test_tp_groups_and_data_parallel_ranks_under_torchrun_equal_one_rank(tiny_model_factory,
                                                                         tmp_path, nproc) -> None:
    path = tiny_model_factory("llama")
    script = tmp_path / "external.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    (out := tmp_path / "out").mkdir()
    folder = _adapter(path, tmp_path / "adapter")
    world = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                            str(nproc), str(script), str(path), str(out), folder],
                           capture_output=True, text=True, timeout=300, env=env)
    assert world.returncode == 0, world.stderr[-3000:]
    got = results(out)
    assert sorted(got) == [str(r) for r in range(nproc)]
    # the same prompts at tensor_parallel_size 1 in this process, before and after the new
    # lm_head (JSON: the form the ranks wrote)
    ns = runpy.run_path(str(script))
    llm = LLM(path, num_kv_blocks=32, block_size=4, seed=0, logprobs_mode="processed_logprobs")
    before = json.loads(json.dumps([ns["run"](llm, i) for i in range(4)]))
    llm.load_weights([("lm_head.weight", ns["lm_head"](llm))])
    after = json.loads(json.dumps([ns["run"](llm, i) for i in range(2)]))
    assert before[0] != before[1] and before[0] != after[0]  # the groups' prompts, the weights
    for rank, res in got.items():
        group = int(rank) // 2
        assert res["freed"], rank
        assert_same(res["tp"][0], before[group], f"rank {rank}: tensor parallel")
        assert_same(res["tp"][1], after[group], f"rank {rank}: after load_weights")
        assert res["tp"][2] == res["tp"][1], rank  # slept, woke, reloaded: the same
        assert_same(res["dp"], before[int(rank)], f"rank {rank}: data parallel")
    for r in range(0, nproc, 2):  # a group's two ranks: bit for bit
        assert got[str(r)]["tp"] == got[str(r + 1)]["tp"]
    # LoRA: each group's adapter and base prompts equal one rank's (tests/test_lora.py: PEFT's)
    one = LLM(path, num_kv_blocks=32, block_size=4, enable_lora=True, max_lora_rank=8)
    want = [ns["run_lora"](one, i, folder) for i in range(2)]
    base = one.generate([{"prompt_token_ids": [1, 7, 21, 4]}], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert want[0][0] != list(base)  # the adapter changes the tokens
    for rank, res in got.items():
        assert res["lora"] == want[int(rank) // 2], f"rank {rank}: LoRA"


def _adapter(model_dir, folder) -> str:
    """A PEFT adapter on column- (q, up) and row-parallel (o, down) layers, visible deltas."""
    pytest.importorskip("peft")
    save_lora_adapter(model_dir, folder, 4, ["q_proj", "o_proj", "up_proj", "down_proj"], 5)
    return str(folder)


def test_external_launcher_without_a_world_or_with_an_uneven_one_is_refused(
        tiny_model_factory, monkeypatch, tmp_path) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not torch.distributed.is_initialized()
    kw = dict(tensor_parallel_size=2, num_kv_blocks=32,
              distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="runs inside a torch.distributed world: start the "
                                         "script with torchrun"):
        LLM(tiny_model_factory("llama"), **kw)
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:  # a world of 1 does not split into groups of 2
        with pytest.raises(ValueError, match=r"tensor_parallel_size must divide the world size "
                                             r"\(1\) .* got 2"):
            LLM(tiny_model_factory("llama"), **kw)
    finally:
        torch.distributed.destroy_process_group()
    assert SamplingParams  # the module's imports stay used
