"""The overlapped engine (async scheduling) without weights (tests/fake_engine.py): the same
steps, block operations, KV figures and outputs as the serial engine on workloads that end
rows by EOS and length, preempt by recompute and by swap, share prefixes and search beams;
steady decoding is planned ahead, and the host applies a step while the next one's forward
runs; an error in the forward, or a stream closed early, leaves the pool whole."""

from __future__ import annotations

import random
import threading

import pytest

from batchgen.attention.metadata import StepRows
from batchgen.config import EngineConfig
from batchgen.engine import lookahead
from batchgen.kinds import SAMPLES
from batchgen.params import BeamSearchParams, SamplingParams
from tests.fake_engine import VOCAB, FakeLLM, FakeRunner
from tests.helpers import check_pool_invariants

POOLS = {"roomy": dict(num_blocks=400, block_size=4),
         "tight": dict(num_blocks=40, block_size=2, max_num_batched_tokens=16),
         "swap": dict(num_blocks=40, block_size=2, max_num_batched_tokens=16,
                      num_host_blocks=48, preemption_mode="swap"),
         "few rows": dict(num_blocks=200, block_size=1, max_num_seqs=5)}


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    head = [1] + [rng.randrange(3, VOCAB) for _ in range(7)]
    return [(head if i % 3 == 0 else [1]) + [rng.randrange(3, VOCAB)
                                             for _ in range(rng.randint(2, 12))]
            for i in range(n)]


def _params(seed: int, n: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [SamplingParams(n=rng.randint(1, 3), temperature=rng.choice([0.0, 0.8, 1.0]),
                           seed=rng.randrange(99), max_tokens=rng.randint(1, 24),
                           logprobs=rng.choice([None, 2]),
                           ignore_eos=seed == 2 or rng.random() < 0.2)
            for _ in range(n)]


def _run(overlap: bool, pool: dict, seed: int) -> tuple[FakeLLM, list]:
    """Samples, then beams, on one engine: every output field, the KV figures of each call
    and the query tokens of every step."""
    llm = FakeLLM(**pool, overlap=overlap)
    prompts = _prompts(seed, 14)
    rec: list = []
    for o in llm.generate(prompts, _params(seed, len(prompts))):
        rec.append([(c.token_ids, c.cumulative_logprob, c.finish_reason, c.logprobs)
                    for c in o.outputs])
    rec.append(llm.kv_stats())
    beams = BeamSearchParams(beam_width=2, max_tokens=6)
    for o in llm.beam_search(prompts[:4], beams):
        rec.append([(s.token_ids, s.cumulative_logprob, s.score) for s in o.sequences])
    rec.append(llm.kv_stats())
    rec.append(llm.runner.step_tokens)
    return llm, rec


def _assert_whole(llm: FakeLLM) -> None:
    bm = llm.engine.kv.block_manager
    check_pool_invariants(bm)
    assert not bm.num_tables() and bm.num_free_blocks() == bm.num_blocks
    assert not llm.engine.scheduler.has_unfinished() and not llm.engine.kv.batch.num_seqs


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_engine_equals_the_serial_one(pool, seed):
    """Seed 2: every sample ignores EOS, so steps are launched before the previous one's
    tokens (blind) while no row reaches its max_tokens."""
    serial, expected = _run(False, POOLS[pool], seed)
    overlapped, got = _run(True, POOLS[pool], seed)
    assert got == expected
    assert overlapped.engine.overlap.steps_ahead > 0
    if seed == 2 and pool in ("roomy", "few rows"):  # (the others admit, then preempt)
        assert overlapped.engine.overlap.steps_blind > 0
    _assert_whole(overlapped)
    if pool == "tight":
        assert got[14].preemptions > 0  # the workload preempts
    if pool == "swap":
        assert got[14].swap_outs > 0


def test_beams_are_not_planned_ahead():
    llm = FakeLLM(num_blocks=200, overlap=True)
    llm.beam_search(_prompts(3, 4), BeamSearchParams(beam_width=3, max_tokens=8))
    assert llm.engine.overlap.steps_ahead == 0


class HandshakeRunner(FakeRunner):
    """A forward that runs while the host works, as a device's does: a marked step (one
    launched ahead) says when it starts and returns only once the host's apply of the
    previous step has seen it running."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.marked: list = []  # the marked steps' slot arrays (held: ids stay unique)
        self.started, self.applied = threading.Event(), threading.Event()
        self.running = False

    def execute(self, rows: StepRows):
        if not any(rows.slots is m for m in self.marked):
            return super().execute(rows)
        self.running = True
        self.started.set()
        try:
            assert self.applied.wait(10), "the host never applied the previous step"
            return super().execute(rows)
        finally:
            self.running = False
            self.applied.clear()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_host_applies_a_step_while_the_next_forward_runs(ignore_eos):
    """With EOS possible the next step is launched once this one's tokens are in; without,
    before them (blind: the device feeds them in)."""
    llm = FakeLLM(num_blocks=400, block_size=4, overlap=True)
    runner = HandshakeRunner(400, 4, 256, 256, 256)
    llm.engine.runner = runner
    outputs, overlap = llm.engine.outputs, llm.engine.overlap
    apply, seen, during = outputs.apply, [0], []

    def watched_apply(*args, **kw):
        if overlap.steps_ahead > seen[0]:  # the next step is in flight
            seen[0] = overlap.steps_ahead
            assert runner.started.wait(10)
            runner.started.clear()
            during.append(runner.running)
            runner.applied.set()
        return apply(*args, **kw)

    outputs.apply = watched_apply

    def marking(launch):
        def marked(plan, *rest):
            runner.marked.append(plan.slots)
            return launch(plan, *rest)
        return marked

    overlap.launch_ahead = marking(overlap.launch_ahead)
    overlap.launch_blind = marking(overlap.launch_blind)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=ignore_eos)
    llm.generate(_prompts(5, 8), sp)
    assert len(during) == overlap.steps_ahead > 3 and all(during)
    assert (overlap.steps_blind > 8) == ignore_eos and overlap.steps_dropped == 0


def test_blind_steps_dropped_when_a_row_ends_change_nothing(monkeypatch):
    """Steps launched before the previous one's tokens even where a row may end: those
    after a step where one did are dropped, and the outputs stay the serial engine's."""
    _, expected = _run(False, POOLS["roomy"], 4)
    monkeypatch.setattr(lookahead, "may_end", lambda scheduler, n: False)
    llm, got = _run(True, POOLS["roomy"], 4)
    assert got[:-1] == expected[:-1]  # the runner ran the dropped steps too
    assert len(got[-1]) == len(expected[-1]) + llm.engine.overlap.steps_dropped
    assert llm.engine.overlap.steps_dropped > 0 and llm.engine.overlap.steps_blind > 0
    _assert_whole(llm)


class FailingRunner(FakeRunner):
    """Raises in its `fail_at`-th forward."""

    fail_at = 6

    def execute(self, rows: StepRows):
        self.fail_at -= 1
        if self.fail_at == 0:
            raise RuntimeError("device lost")
        return super().execute(rows)


def test_a_failing_forward_or_a_stream_closed_early_leaves_the_pool_whole():
    llm = FakeLLM(num_blocks=100, block_size=2, overlap=True)
    llm.engine.runner = FailingRunner(100, 2, 256, 256, 256)
    sp = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(_prompts(7, 6), sp)
    _assert_whole(llm)
    groups = llm.requests.build([{"prompt_token_ids": p} for p in _prompts(8, 6)],
                                SamplingParams(temperature=0, max_tokens=30), SAMPLES)
    stream = llm.engine.stream(groups, 64)
    next(stream)
    stream.close()
    _assert_whole(llm)


def test_async_scheduling_resolves_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("BATCHGEN_ASYNC_SCHEDULING", raising=False)
    assert EngineConfig(async_scheduling=True).async_scheduling is True
    monkeypatch.setenv("BATCHGEN_ASYNC_SCHEDULING", "1")
    assert EngineConfig().async_scheduling is True
    assert EngineConfig(tensor_parallel_size=2).async_scheduling is False
    monkeypatch.setenv("BATCHGEN_ASYNC_SCHEDULING", "0")
    assert EngineConfig().async_scheduling is False
    monkeypatch.setenv("BATCHGEN_ASYNC_SCHEDULING", "yes")
    with pytest.raises(ValueError, match="BATCHGEN_ASYNC_SCHEDULING must be one of"):
        EngineConfig()
    with pytest.raises(ValueError, match="async_scheduling must be True or False, got 1"):
        EngineConfig(async_scheduling=1)
    with pytest.raises(ValueError, match="async_scheduling must be False with tensor_par"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)


def test_the_worker_runs_on_the_callers_cuda_device(monkeypatch):
    """A bare "cuda" device is the caller's current one: the worker thread is set to its
    index (torch.cuda.set_device refuses a device without one: the first run on a GPU hung
    there). Without CUDA here, torch.cuda's two calls are recorded instead."""
    import torch

    from batchgen.model.forward_queue import ForwardQueue

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device, want in (("cuda", [1]), ("cuda:2", [2]), ("cpu", [])):
        calls.clear()
        queue = ForwardQueue(torch.device(device))
        assert queue.submit(lambda: 7).result(timeout=10) == 7
        queue.close()
        assert calls == want, device


def test_a_worker_that_cannot_start_fails_the_step_instead_of_hanging(monkeypatch):
    """The worker's set-up raising (a device it cannot take) reaches the caller through the
    step's future; submit returns instead of waiting for a step that never starts."""
    import torch

    from batchgen.model.forward_queue import ForwardQueue

    queue = ForwardQueue(torch.device("cpu"))
    monkeypatch.setattr(ForwardQueue, "_enter", lambda self: 1 / 0)
    box: list = []
    t = threading.Thread(target=lambda: box.append(queue.submit(lambda: 7)), daemon=True)
    t.start()
    t.join(10)
    assert box, "submit hung on a worker that could not start"
    with pytest.raises(Exception, match="initializer|division"):
        box[0].result(timeout=10)
