"""Engine guarantees on a real (tiny) model: no admitted request hangs, an interrupt anywhere
leaves the pool whole, near-zero temperatures are safe, and a request's logprobs are the same
bits alone or batched, chunked or not, cached or not (the CPU decode kernel)."""

from __future__ import annotations

import random

import pytest

import batchgen
from batchgen import LLM, SamplingParams
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import (
    assert_pool_whole,
    cpu_kernel_or_skip,
    interrupt_tracer,
    make_prompt_token_ids,
    traced_workload,
)

ROOT = (batchgen.__path__[0],)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_the_reported_n2_hang_is_refused_and_runs_in_its_exact_pool(model_dir):
    prompt = {"prompt_token_ids": list(range(3, 14))}
    sp = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=7, ignore_eos=True)
    with pytest.raises(ValueError, match="needs 8 KV blocks and can never fit the pool of 7"):
        LLM(model_dir, block_size=4, num_kv_blocks=7).generate(prompt, sp, use_tqdm=False)
    llm = LLM(model_dir, block_size=4, num_kv_blocks=8)
    out = llm.generate(prompt, sp, use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [7, 7]
    assert llm.kv_stats().peak_blocks_in_use == 8 and llm.kv_stats().preemptions == 0
    assert_pool_whole(llm)


def test_a_tiny_temperature_samples_like_greedy(model_dir):
    prompts = make_prompt_token_ids(4, 5, 30, vocab_size=512, seed=21)
    llm = LLM(model_dir, block_size=16, num_kv_blocks=256)
    greedy = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=8),
                          use_tqdm=False)
    cold = llm.generate(_ids(prompts), SamplingParams(temperature=1e-40, seed=0, max_tokens=8,
                                                      logprobs=1), use_tqdm=False)
    for g, c in zip(greedy, cold):
        assert c.outputs[0].token_ids == g.outputs[0].token_ids
        assert all(v.logprob > -1e30 for d in c.outputs[0].logprobs for v in d.values())


def test_an_interrupt_anywhere_in_a_real_run_leaves_the_pool_whole(model_dir):
    """Ctrl-C at 25 points over every batchgen line of a run (scheduler, runner inputs,
    attention plans, sampler, stop checks): each leaves the pool whole; the next call is
    unchanged. A small pool makes the run preempt and fork. (Caching off keeps every run the
    same length; tests/test_scheduler.py interrupts runs with the prefix cache.)"""
    llm = LLM(model_dir, block_size=4, num_kv_blocks=20, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    counter = [0]
    want = traced_workload(llm, interrupt_tracer(0, ROOT, counter))
    assert llm.kv_stats().cow_copies > 0 and llm.engine.scheduler.num_preemptions > 0
    total = counter[0]
    for event in sorted(random.Random(1).sample(range(1, total), 25)):
        with pytest.raises(KeyboardInterrupt):
            traced_workload(llm, interrupt_tracer(event, ROOT, [0]))
        assert_pool_whole(llm)
    assert traced_workload(llm, None) == want


def test_batch_composition_leaves_the_bits_unchanged_with_an_odd_ffn(tiny_model_factory):
    """ffn 688 (not a multiple of 32): for an odd step size T the T x 688 activations end
    mid-vector, and the elementwise kernels' scalar tail rounds differently from their vector
    body, so a row's bits depended on its batch until CPU steps were padded to a multiple of 16
    tokens. The same 96 sampled requests, in one call and in calls of 11."""
    cpu_kernel_or_skip()
    llm = LLM(tiny_model_factory("llama", eos_boost=0.06, intermediate_size=688),
              num_kv_blocks=2048, enable_prefix_caching=False)
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(4, 40))]
               for _ in range(96)]
    sps = [SamplingParams(temperature=1.0, seed=i, max_tokens=12) for i in range(96)]
    together = llm.generate(_ids(prompts), sps, use_tqdm=False)
    apart = [o for s in range(0, 96, 11)
             for o in llm.generate(_ids(prompts[s:s + 11]), sps[s:s + 11], use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in apart]
    assert [o.outputs[0].cumulative_logprob for o in together] == [
        o.outputs[0].cumulative_logprob for o in apart]


@pytest.mark.parametrize("block_size", [4, 16])
def test_caching_chunking_and_batching_leave_the_bits_unchanged(model_dir, block_size):
    """Each request alone, with caching off and its prompt in one chunk, against: all of them
    together with prefix caching on (shared prefixes hit at block boundaries) and a small token
    budget that chunks the prompts. Tokens and every logprob are the same bits (with the CPU
    kernel; the PyTorch path's cascade is not batch-invariant)."""
    cpu_kernel_or_skip()
    rng = random.Random(block_size)
    base = [1] + [rng.randrange(3, 512) for _ in range(150)]
    prompts = [base[:rng.randint(10, 150)] + [rng.randrange(3, 512)
                                              for _ in range(rng.randint(1, 50))]
               for _ in range(10)]
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)
    ref = LLM(model_dir, block_size=block_size, num_kv_blocks=2048, enable_prefix_caching=False)
    alone = [ref.generate(_ids([p]), sp, use_tqdm=False)[0].outputs[0] for p in prompts]
    for budget in (20, 8192):
        llm = LLM(model_dir, block_size=block_size, num_kv_blocks=2048,
                  max_num_batched_tokens=budget)
        llm.generate(_ids(prompts[:3]), sp, use_tqdm=False)  # cache some prefixes first
        outs = llm.generate(_ids(prompts), sp, use_tqdm=False)
        assert llm.kv_stats().prefix_hit_tokens > 0
        for a, o in zip(alone, outs):
            assert o.outputs[0].token_ids == a.token_ids
            assert o.outputs[0].logprobs == a.logprobs
            assert o.outputs[0].cumulative_logprob == a.cumulative_logprob
