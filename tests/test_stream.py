"""`LLM.generate_stream` / `beam_search_stream` and `Engine.stream`: the same outputs as the
batch calls, a full batch while inputs remain, a bounded window of pending requests, memory that
does not grow with the input, and clean ends (early close, bad input mid-stream, busy LLM)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.kinds import SAMPLES
from batchgen.llm import STREAM_WINDOW
from tests.fake_engine import FakeLLM

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the cat", "a dog runs over the river", "blue", "red house under a green tree",
           "the river runs", "a", "tree house", "the blue dog jumps over a red cat"]


def completions(out) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.cumulative_logprob, c.finish_reason)
            for c in out.outputs]


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama", eos_boost=0.06)), device="cpu", max_num_seqs=4,
               block_size=4, num_kv_blocks=96)


def test_stream_equals_generate(llm: LLM) -> None:
    """A generator in, every output once, tagged with its input index, equal to generate's."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    expected = llm.generate(PROMPTS * 3, params, use_tqdm=False)
    got = dict(llm.generate_stream((p for p in PROMPTS * 3), params, use_tqdm=False))
    assert sorted(got) == list(range(len(expected)))
    for i, out in enumerate(expected):
        assert completions(got[i]) == completions(out), i
        assert got[i].prompt_token_ids == out.prompt_token_ids


def test_stream_with_params_per_prompt(llm: LLM) -> None:
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=3 + i) for i in range(5)]
    expected = llm.generate(PROMPTS[:5], params, use_tqdm=False)
    got = dict(llm.generate_stream(iter(PROMPTS[:5]), iter(params), use_tqdm=False))
    assert [completions(got[i]) for i in range(5)] == [completions(o) for o in expected]
    with pytest.raises(ValueError, match="sampling_params and prompts must have the same "
                                         "length: one ended at item 4"):
        list(llm.generate_stream(iter(PROMPTS[:5]), iter(params[:4]), use_tqdm=False))
    assert llm.engine.kv.block_manager.num_blocks_in_use() == 0


def test_beam_stream_equals_beam_search(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    expected = llm.beam_search(PROMPTS, params, use_tqdm=False)
    got = dict(llm.beam_search_stream(iter(PROMPTS), params, use_tqdm=False))
    for i, out in enumerate(expected):
        assert [(s.token_ids, s.score) for s in got[i].sequences] == [
            (s.token_ids, s.score) for s in out.sequences], i


def test_early_close_frees_every_block_and_the_llm(llm: LLM) -> None:
    stream = llm.generate_stream(PROMPTS * 4, SamplingParams(n=2, max_tokens=20, seed=1),
                                 use_tqdm=False)
    next(stream)
    assert llm.engine.kv.block_manager.num_blocks_in_use() > 0
    with pytest.raises(RuntimeError, match="already running a call"):
        llm.generate("the cat", use_tqdm=False)
    stream.close()
    assert llm.engine.kv.block_manager.num_blocks_in_use() == 0
    assert not llm.engine.scheduler.has_unfinished()
    out = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


def test_bad_prompt_mid_stream_names_it_and_keeps_earlier_outputs(llm: LLM) -> None:
    """A prompt that can never run raises when its chunk is reached (input index named); what
    was yielded before stays valid and the pool is whole afterwards."""
    def prompts() -> Iterator[str | dict]:
        yield from PROMPTS * 2
        yield {"prompt_token_ids": [1] * (llm.max_model_len + 5)}
        yield from PROMPTS
    got = {}
    params = SamplingParams(temperature=0, max_tokens=5)
    with pytest.raises(ValueError, match=rf"prompts\[{2 * len(PROMPTS)}\] has"):
        for i, out in llm.generate_stream(prompts(), params, use_tqdm=False):
            got[i] = out
    expected = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    assert got and all(completions(o) == completions(expected[i]) for i, o in got.items())
    assert llm.engine.kv.block_manager.num_blocks_in_use() == 0


# ---- the window and the full batch, on the fake engine (no weights: fast) -----------------
def test_stream_keeps_the_batch_full_with_a_bounded_window() -> None:
    max_seqs, total = 16, 3000
    fake = FakeLLM(num_blocks=4096, block_size=4, max_num_seqs=max_seqs,
                   max_num_batched_tokens=512)
    pulled = 0

    def prompts() -> Iterator[dict]:
        nonlocal pulled
        for i in range(total):
            pulled += 1
            yield {"prompt_token_ids": [3 + i % 40, 4 + i % 7, 5 + i % 11][: 1 + i % 3]}

    window = STREAM_WINDOW * max_seqs
    groups = fake.requests.stream(prompts(), SamplingParams(max_tokens=6, seed=0),
                                  SAMPLES, max_seqs)
    running: list[int] = []  # sequences in each step's batch
    exhausted: list[bool] = []  # whether the input had run out by that step
    execute = fake.engine.runner.execute

    def counting_execute(rows):
        running.append(rows.num_rows)
        exhausted.append(pulled == total)
        return execute(rows)

    fake.engine.runner.execute = counting_execute
    finished = 0
    for _group in fake.engine.stream(groups, window):
        finished += 1
        # pending = pulled but not finished: the window, one tokenized chunk, the batch
        assert pulled - finished <= window + max_seqs + max_seqs
    assert finished == total
    while_inputs_remain = [r for r, done in zip(running, exhausted) if not done]
    assert len(while_inputs_remain) > 100
    assert sum(r < max_seqs for r in while_inputs_remain) <= 2, running[:10]


def test_engine_stream_abort_on_error_frees_everything() -> None:
    fake = FakeLLM(num_blocks=256, block_size=4, max_num_seqs=8)

    def prompts() -> Iterator[dict]:
        yield from ({"prompt_token_ids": [3, 4, 5 + i % 9]} for i in range(40))
        raise KeyboardInterrupt

    groups = fake.requests.stream(prompts(), SamplingParams(max_tokens=30, n=2, seed=0),
                                  SAMPLES, 8)
    with pytest.raises(KeyboardInterrupt):
        for _ in fake.engine.stream(groups, 16):
            pass
    assert fake.engine.kv.block_manager.num_blocks_in_use() == 0
    assert not fake.engine.scheduler.has_unfinished()


# ---- memory: a generator of 100k prompts through the real engine --------------------------
STREAM_100K = """
import resource, sys, torch
torch.set_num_threads(1)
from batchgen import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", max_num_seqs=256)
prompts = ({"prompt_token_ids": [1, 3 + i % 50, 3 + (i * 7) % 50]} for i in range(100_000))
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
seen, early = 0, None
for i, out in llm.generate_stream(prompts, SamplingParams(max_tokens=2, temperature=0),
                                  use_tqdm=False):
    seen += 1
    if seen == 25_000:
        early = rss()
print(seen, early, rss())
"""


def test_memory_stays_bounded_on_a_generator_of_100k_prompts(tiny_model_factory) -> None:
    """Peak RSS after 100k streamed requests is within a few MiB of the peak after 25k: nothing
    per request is kept (a list-based generate would hold 100k requests and their outputs).
    The first 25k warm the allocator up (RSS rises ~15-25 MiB over them, then stays flat: 300k
    requests measured), so growth is measured from there."""
    model = tiny_model_factory("llama")
    proc = subprocess.run([sys.executable, "-c", STREAM_100K, str(model)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen, early_kib, final_kib = map(int, proc.stdout.split())
    assert seen == 100_000
    assert final_kib - early_kib < 24 * 1024, (early_kib, final_kib)
