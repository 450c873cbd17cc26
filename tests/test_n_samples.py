"""n > 1 samples: the prompt is computed once and forked; blocks are shared until written."""

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.kv_manager import request_peak_blocks
from tests.helpers import make_prompt_token_ids


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_chapter_exercise_4_peaks_at_exactly_90_blocks(model_dir):
    """800-token prompt, n=4, 150 new tokens, block 16: 50 shared + 4 x 10 private blocks."""
    llm = LLM(model_dir, block_size=16, num_kv_blocks=512)
    prompt = make_prompt_token_ids(1, 800, 800, vocab_size=512, seed=4)[0]
    out = llm.generate(_ids([prompt]), SamplingParams(n=4, temperature=1.0, seed=0,
                                                      max_tokens=150, ignore_eos=True),
                       use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [150] * 4
    assert llm.kv_stats().peak_blocks_in_use == 90
    assert llm.kv_stats().cow_copies == 0  # 800 is a block multiple: nothing shared is written
    assert llm.engine.kv.block_manager.num_free_blocks() == 512


@pytest.mark.parametrize("s,n,t,bs", [(37, 4, 20, 16), (33, 8, 5, 4), (10, 3, 30, 1),
                                      (64, 16, 16, 16)])
def test_n_samples_stay_within_the_sharing_bound(model_dir, s, n, t, bs):
    llm = LLM(model_dir, block_size=bs, num_kv_blocks=2048)
    prompt = make_prompt_token_ids(1, s, s, vocab_size=512, seed=s)[0]
    llm.generate(_ids([prompt]), SamplingParams(n=n, seed=1, max_tokens=t, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.kv_stats()
    assert stats.peak_blocks_in_use == request_peak_blocks(s, n, t, bs)  # the exact bound
    partial = s % bs != 0
    assert stats.cow_copies == (n - 1 if partial else 0)  # the last writer keeps the original
    assert llm.engine.kv.block_manager.num_free_blocks() == 2048


def test_prompt_is_computed_once(model_dir):
    llm = LLM(model_dir, block_size=16, num_kv_blocks=512)
    prompt = make_prompt_token_ids(1, 50, 50, vocab_size=512, seed=2)[0]
    out = llm.generate(_ids([prompt]), SamplingParams(n=6, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert llm.kv_stats().prompt_tokens_computed == 50  # one prefill shared by the 6 samples
    assert [len(c.token_ids) for c in out[0].outputs] == [3] * 6


def test_samples_are_seeded_per_index_and_batch_invariant(model_dir):
    llm = LLM(model_dir, block_size=4, num_kv_blocks=1024)
    prompts = make_prompt_token_ids(4, 5, 30, vocab_size=512, seed=8)
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=77)
    alone = llm.generate(_ids(prompts[:1]), sp, use_tqdm=False)[0]
    mixed = llm.generate(_ids([prompts[2], prompts[0], prompts[3]]),
                         [SamplingParams(n=3, temperature=0.5, max_tokens=20), sp,
                          SamplingParams(max_tokens=7)], use_tqdm=False)[1]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 4  # independent samples
    # sample i alone with n=i+1 is the same stream: it depends on (seed, i) only
    three = llm.generate(_ids(prompts[:1]), SamplingParams(n=3, temperature=1.0, max_tokens=12,
                                                           seed=77), use_tqdm=False)[0]
    assert [c.token_ids for c in three.outputs] == [c.token_ids for c in alone.outputs[:3]]


def test_preempted_n_groups_recompute_with_sharing(model_dir):
    prompts = make_prompt_token_ids(6, 10, 40, vocab_size=512, seed=9)
    sp = [SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=i, ignore_eos=True)
          for i in range(6)]
    roomy = LLM(model_dir, block_size=4, num_kv_blocks=2048)
    # the longest request alone: ceil(40/4) + 4 * ceil(17/4) = 30 blocks
    tight = LLM(model_dir, block_size=4, num_kv_blocks=30, max_num_batched_tokens=16)
    a = roomy.generate(_ids(prompts), sp, use_tqdm=False)
    b = tight.generate(_ids(prompts), sp, use_tqdm=False)
    assert tight.kv_stats().preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in a] == \
        [[c.token_ids for c in o.outputs] for o in b]
    assert tight.kv_stats().peak_blocks_in_use <= 30
    assert tight.engine.kv.block_manager.num_free_blocks() == 30


def test_thousands_of_samples(model_dir):
    llm = LLM(model_dir, block_size=16, num_kv_blocks=4096, max_num_seqs=256)
    prompt = make_prompt_token_ids(1, 40, 40, vocab_size=512, seed=5)[0]
    out = llm.generate(_ids([prompt]), SamplingParams(n=2000, temperature=1.0, max_tokens=4,
                                                      seed=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs) == 2000
    assert all(len(c.token_ids) == 4 for c in out[0].outputs)
    # 256 samples decode at a time (max_num_seqs): far below the all-at-once bound of 2002
    assert llm.kv_stats().peak_blocks_in_use <= request_peak_blocks(40, 2000, 4, 16) == 2002
    assert llm.engine.kv.block_manager.num_free_blocks() == 4096
