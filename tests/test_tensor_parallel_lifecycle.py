"""Tensor parallelism's lifecycle on the CPU (2 ranks over gloo): a worker killed mid-generation
raises on rank 0 within seconds, so does one that dies at start-up, heads that do not split are
refused before loading, a script without a main guard works, and no worker outlives its LLM
or its script. (One tensor-parallel LLM per process at a time: the engines of
tests/test_tensor_parallel.py are gone before these run.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from batchgen import LLM, SamplingParams
from batchgen.distributed import group, launch
from batchgen.distributed.group import WorkerDied
from tests.test_tensor_parallel import CFG, PROMPTS


def test_a_worker_killed_mid_generation_raises_on_rank_0(tiny_model_factory, caplog):
    with caplog.at_level("INFO", logger="batchgen"):
        llm = LLM(tiny_model_factory("llama"), tensor_parallel_size=2, **CFG)
    assert ("tensor parallel: 2 ranks, each with that pool over 1 of the model's 2 KV heads"
            in caplog.text)  # the capacity line, per rank and in all
    worker = llm._executor.group.procs[0]
    calls = []

    def kill_on_third_step(token_ids, logits):
        calls.append(1)
        if len(calls) == 3:
            os.kill(worker.pid, signal.SIGKILL)
        return logits

    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                        logits_processors=[kill_on_third_step])
    start = time.monotonic()
    with pytest.raises(WorkerDied, match="batchgen-tp1 exited with code -9"):
        llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert llm.engine.kv.block_manager.num_free_blocks() == llm.cache.num_blocks
    with pytest.raises(WorkerDied, match="make a new one"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)


def test_heads_that_do_not_split_are_refused_before_loading(tiny_model_factory):
    path = tiny_model_factory("llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's "
                                         r"attention heads \(4\) and KV heads \(2\)"):
        LLM(path, tensor_parallel_size=3, num_kv_blocks=16)
    mqa = tiny_model_factory("llama", num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"KV heads \(1\)"):
        LLM(mqa, tensor_parallel_size=2, num_kv_blocks=16)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=0)


SCRIPT = """
import sys
from batchgen import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
    print("worker", llm._executor.group.procs[0].pid, flush=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3),
                       use_tqdm=False)
    print("tokens", len(out[0].outputs[0].token_ids), flush=True)
    if sys.argv[2] == "del":
        del llm
        print("deleted", flush=True)
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("end", ["del", "exit"])
def test_no_worker_outlives_its_llm(tiny_model_factory, tmp_path, end):
    """`del llm`, or the end of the script, stops the workers: no process remains."""
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    res = subprocess.run([sys.executable, str(script), str(tiny_model_factory("llama")), end],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0, res.stderr[-2000:]
    lines = dict((line + " ").split(" ", 1) for line in res.stdout.splitlines())
    assert lines["tokens"].strip() == "3"
    assert _gone(int(lines["worker"]), within=10), "a worker outlived the script"
    assert ("deleted" in lines) == (end == "del")


TORCHRUN_SCRIPT = """
import os, sys
from batchgen import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
print("rank", os.environ["RANK"], "tokens", *out[0].outputs[0].token_ids, flush=True)
"""


def test_under_torchrun_rank_0_runs_the_script_and_the_others_serve_it(tiny_model_factory,
                                                                         tmp_path):
    path = tiny_model_factory("llama")
    script = tmp_path / "tp_torchrun.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(script), str(path)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0, res.stderr[-3000:]
    printed = [line.split() for line in res.stdout.splitlines() if line.startswith("rank")]
    assert [p[1] for p in printed] == ["0"]  # the other rank served rank 0, then exited
    want = LLM(path, num_kv_blocks=32, block_size=4).generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=5,
                                                          ignore_eos=True), use_tqdm=False)
    assert [int(t) for t in printed[0][3:]] == list(want[0].outputs[0].token_ids)


COUNTED_IN_THEN_GONE = ("import pickle, sys; from batchgen.distributed.rendezvous import announce;"
                        " announce(pickle.load(sys.stdin.buffer)); sys.exit('counted in, gone')")
LOAD_FAILS = """
from batchgen.model import loader
def cannot_load(*args, **kwargs):
    raise OSError("cannot read this rank's shard")
loader.load_model = cannot_load
from batchgen.distributed.worker_process import main
main()
"""


def _dies_at_start(how, tmp_path, monkeypatch):
    """Make rank 1 die at start-up: its command exits 1; it is killed as soon as it starts; it
    counts itself in at rank 0's store and exits instead of joining; or it joins and then
    fails to load its shard. Returns the list the started workers go to."""
    started, start = [], launch.start_worker

    def recorded(rank, spec):
        started.append(start(rank, spec))
        if how == "killed":
            os.kill(started[-1].pid, signal.SIGKILL)
        return started[-1]

    monkeypatch.setattr(launch, "start_worker", recorded)
    if how == "load fails":
        (tmp_path / "worker.py").write_text(textwrap.dedent(LOAD_FAILS))
    command = {"exits": ["-c", "import sys; sys.exit('no shard for this rank here')"],
               "counted in": ["-c", COUNTED_IN_THEN_GONE],
               "load fails": [str(tmp_path / "worker.py")]}.get(how)
    if command:
        monkeypatch.setattr(launch, "worker_command",
                            lambda rank: [sys.executable, *command, str(rank)])
    return started


@pytest.mark.parametrize("how, error, match", [
    pytest.param("exits", WorkerDied, "batchgen-tp1 exited with code 1 during start-up\n"
                 "batchgen-tp1's last stderr lines:\n    no shard for this rank here", id="exits"),
    pytest.param("killed", WorkerDied, "batchgen-tp1 exited with code -9 during start-up",
                 id="killed"),
    pytest.param("counted in", WorkerDied, "batchgen-tp1 exited with code 1 during start-up",
                 id="counted-in-then-gone"),
    pytest.param("load fails", WorkerDied, "batchgen-tp1 exited with code 1", id="load-fails")])
def test_a_worker_that_dies_at_start_up_is_named_within_seconds(
        tiny_model_factory, tmp_path, monkeypatch, caplog, how, error, match):
    """Rank 0 watches its starting workers: one that dies before joining, even after it has
    counted itself in (rank 0 is joining then), fails `LLM(...)` at once, naming it; one that
    joins and then fails to load fails rank 0's first collective, which is reported as that
    worker's death. No process, and no process group, is left behind."""
    path = tiny_model_factory("llama")
    started = _dies_at_start(how, tmp_path, monkeypatch)
    start = time.monotonic()
    with pytest.raises(error, match=match):
        LLM(path, tensor_parallel_size=2, num_kv_blocks=16)
    assert time.monotonic() - start < 30
    assert [w.name for w in started] == ["batchgen-tp1"]
    assert _gone(started[0].pid, within=5)
    assert not dist.is_initialized()
    if how == "counted in":  # rank 0's abandoned join does not stop the next group's
        monkeypatch.undo()
        monkeypatch.setattr(group, "START_TIMEOUT_S", 60.0)  # were they to wait on each other
        llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=16)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        llm._executor.shutdown()


NO_GUARD_SCRIPT = """
import os, signal, sys
from batchgen import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
print("worker", llm._executor.group.procs[0].pid, flush=True)
sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
print("tokens", *out[0].outputs[0].token_ids, flush=True)
if sys.argv[2] == "kill":  # rank 0 dies without stopping its worker
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_script_without_a_main_guard_runs_and_leaves_no_worker(tiny_model_factory, tmp_path,
                                                                  end):
    """The workers are fresh interpreters that do not re-run the script (multiprocessing's
    spawn would): the script gives one rank's tokens and exits; killed, its worker follows."""
    path = tiny_model_factory("llama")
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(NO_GUARD_SCRIPT))
    res = subprocess.run([sys.executable, str(script), str(path), end], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == (0 if end == "exit" else -signal.SIGKILL), res.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    assert _gone(int(lines["worker"]), within=10), "a worker outlived the script"
    want = LLM(path, num_kv_blocks=32, block_size=4).generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=5,
                                                          ignore_eos=True), use_tqdm=False)
    assert [int(t) for t in lines["tokens"].split()] == list(want[0].outputs[0].token_ids)
