"""Tensor parallelism on the CPU: 2 ranks over gloo (rank 0 in this process, one spawned
worker), tiny llama and qwen3 models (4 heads, 2 KV heads), against the same engine at
tensor_parallel_size=1: greedy tokens and beams with chunked prefill, preemption and prefix
hits; seeded samples; workers that stop with their LLM; a worker killed mid-generation."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams

# a pool of 40 blocks of 4 tokens for 8 rows of up to 60 tokens forces preemption; 24-token
# chunks split the prompts; two prompt families share 20-token prefixes (prefix hits)
CFG = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=8,
           enable_prefix_caching=True)
PREFIXES = [[3 + i for i in range(20)], [200 + i for i in range(20)]]
PROMPTS = [{"prompt_token_ids": PREFIXES[i % 2] + [30 + i, 40 + i, 7 * i % 50 + 1]}
           for i in range(8)] + [{"prompt_token_ids": list(range(60, 90))}]


def _tokens(outs):
    return [list(c.token_ids) for o in outs for c in o.outputs]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engines(request, tiny_model_factory):
    path = tiny_model_factory(request.param)
    one = LLM(path, **CFG)
    two = LLM(path, tensor_parallel_size=2, **CFG)
    yield one, two
    two._executor.shutdown()


def test_greedy_and_beams_equal_one_rank(engines):
    one, two = engines
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, got = _tokens(one.generate(PROMPTS, sp, use_tqdm=False)), None
    got = _tokens(two.generate(PROMPTS, sp, use_tqdm=False))
    stats = two.kv_stats()
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0
    assert got == want
    bp = BeamSearchParams(beam_width=3, max_tokens=10)
    a = one.beam_search(PROMPTS[:4], bp, use_tqdm=False)
    b = two.beam_search(PROMPTS[:4], bp, use_tqdm=False)
    for x, y in zip(a, b):
        assert [s.token_ids for s in x.sequences] == [s.token_ids for s in y.sequences]
        assert [s.score for s in x.sequences] == pytest.approx([s.score for s in y.sequences],
                                                                abs=1e-4)


def test_seeded_samples_are_distinct_and_match_one_rank(engines):
    one, two = engines
    sp = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    a = one.generate(PROMPTS[:3], sp, use_tqdm=False)
    b = two.generate(PROMPTS[:3], sp, use_tqdm=False)
    for o in b:
        assert len({tuple(c.token_ids) for c in o.outputs}) == 4
    assert _tokens(a) == _tokens(b)


def test_an_interrupt_leaves_the_group_usable(engines):
    """Ctrl-C while steps run: the call is interrupted, every block comes back, and the ranks
    stay in step (the next call equals one rank's)."""
    one, two = engines
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(50):  # until the interrupt lands
                two.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        timer.cancel()
    assert two.engine.kv.block_manager.num_free_blocks() == two.cache.num_blocks
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert _tokens(two.generate(PROMPTS[:2], sp, use_tqdm=False)) == _tokens(
        one.generate(PROMPTS[:2], sp, use_tqdm=False))


def test_streams_and_dataset_jobs_run_on_the_group(engines, tmp_path):
    """A generator of prompts streamed through the group, and a dataset job written to disk,
    give one rank's tokens."""
    from datasets import Dataset

    from batchgen.data import generate_dataset

    one, two = engines
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = dict(two.generate_stream((p for p in PROMPTS), sp, use_tqdm=False))
    want = one.generate(PROMPTS, sp, use_tqdm=False)
    assert [list(got[i].outputs[0].token_ids) for i in range(len(PROMPTS))] == _tokens(want)
    rows = Dataset.from_list([{"prompt": p["prompt_token_ids"]} for p in PROMPTS[:4]])
    ds = generate_dataset(two, rows, sp, output_dir=tmp_path / "out", use_tqdm=False)
    assert [list(r["outputs"][0]["token_ids"]) for r in ds] == _tokens(want)[:4]
