"""Prefix caching: identical outputs with caching on and off, exact hit counts, no leaks."""

import random

import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams
from tests.helpers import cpu_kernel_available

B = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama", eos_boost=0.06)


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _shared(prefix_len, n, seed=0, qmin=5, qmax=30):
    rng = random.Random(seed)
    prefix = [1] + _tokens(prefix_len - 1, seed + 1000)
    return [prefix + _tokens(rng.randint(qmin, qmax), seed + i) for i in range(n)]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _pair(model_dir, **kw):
    return (LLM(model_dir, block_size=B, enable_prefix_caching=True, **kw),
            LLM(model_dir, block_size=B, enable_prefix_caching=False, **kw))


def _same(a, b, bits=True):
    """Identical tokens; with `bits`, bit-identical logprobs too. A reused prompt block holds
    exactly the bits a recompute would write (batch-invariant prefill shapes). Where rows share
    blocks while decoding (cascade attention) or blocks come from decode steps or other chunk
    splits, rounding differs: there the tokens must match and logprobs agree to float noise."""
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            if bits:
                assert cx.cumulative_logprob == cy.cumulative_logprob
                assert cx.logprobs == cy.logprobs
            else:
                assert cx.cumulative_logprob == pytest.approx(cy.cumulative_logprob, abs=1e-4)


def _no_leak(llm):
    bm = llm.engine.kv.block_manager
    assert bm.num_free_blocks() == bm.num_blocks and not bm.num_tables()
    assert all(r == 0 for r in bm.ref_count)


SP = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


@pytest.mark.parametrize("prefix_len", [64, 40, 1])  # block multiple, mid-block, no sharing
def test_shared_system_prompt_in_one_call(model_dir, prefix_len):
    prompts = _shared(prefix_len, 10)
    on, off = _pair(model_dir, num_kv_blocks=512)
    a = on.generate(_ids(prompts), SP, use_tqdm=False)
    b = off.generate(_ids(prompts), SP, use_tqdm=False)
    full = prefix_len // B * B  # the shared full blocks
    # with the kernel rows sharing cached blocks decode as they would alone (no cascade)
    _same(a, b, bits=full == 0 or cpu_kernel_available())
    assert on.kv_stats().prefix_hit_tokens == 9 * full
    assert off.kv_stats().prefix_hit_tokens == 0
    # the shared prefix is computed once
    assert on.kv_stats().prompt_tokens_computed == sum(map(len, prompts)) - 9 * full
    assert off.kv_stats().prompt_tokens_computed == sum(map(len, prompts))
    _no_leak(on)
    _no_leak(off)


def test_cached_prefix_gives_the_bits_of_a_cold_run(model_dir):
    """A hit's suffix sits in the same SDPA rows as in a cold prefill, and the cached blocks
    hold the bits a cold prefill writes, whatever the length of the prompt that wrote them (its
    tile had fewer or more queries): bit-identical logprobs. A resumed dataset job relies on
    this (its cache holds other rows than an uninterrupted run's)."""
    prefix = [1] + _tokens(15, 21)  # one full block
    on, off = _pair(model_dir, num_kv_blocks=256)
    for c in (1, 5, 17):  # the writer's tile: 17 (failed before padded tiles), 21, 33 queries
        for k in (2, 9, 40):
            on.reset_prefix_cache()
            on.generate(_ids([prefix + _tokens(c, 99)]), SP, use_tqdm=False)
            p = prefix + _tokens(k, 30 + k)
            hit = on.generate(_ids([p]), SP, use_tqdm=False)
            assert on.kv_stats().prefix_hit_tokens == B
            _same(hit, off.generate(_ids([p]), SP, use_tqdm=False))


def test_full_prompt_hit_still_computes_the_last_token(model_dir):
    on, off = _pair(model_dir, num_kv_blocks=256)
    exact = [1] + _tokens(47, 5)  # 48 tokens = 3 full blocks
    ragged = [1] + _tokens(49, 6)  # 50 tokens
    first = on.generate(_ids([exact, ragged]), SP, use_tqdm=False)
    again = on.generate(_ids([exact, ragged]), SP, use_tqdm=False)
    # at most len - 1 tokens may hit: 2 of the 3 blocks of `exact`, all 3 full blocks of `ragged`
    assert on.kv_stats().prefix_hit_tokens == 32 + 48
    _same(first, again)
    _same(again, off.generate(_ids([exact, ragged]), SP, use_tqdm=False))
    _no_leak(on)


def test_generated_blocks_are_reused_across_calls(model_dir):
    """A follow-up prompt = earlier prompt + its answer hits the answer's blocks too."""
    on, off = _pair(model_dir, num_kv_blocks=256)
    p = [1] + _tokens(20, 7)
    out = on.generate(_ids([p]), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0].token_ids
    follow = p + out + _tokens(5, 8)
    a = on.generate(_ids([follow]), SP, use_tqdm=False)
    assert on.kv_stats().prefix_hit_tokens == (len(p) + len(out) - 1) // B * B
    _same(a, off.generate(_ids([follow]), SP, use_tqdm=False), bits=False)


def test_eviction_and_preemption_keep_outputs_identical(model_dir):
    prompts = _shared(48, 12, seed=3) + _shared(33, 8, seed=4)
    sp = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, logprobs=1)
          for i in range(len(prompts))]
    on, off = _pair(model_dir, num_kv_blocks=24, max_num_batched_tokens=48)
    a = on.generate(_ids(prompts), sp, use_tqdm=False)
    b = off.generate(_ids(prompts), sp, use_tqdm=False)
    _same(a, b, bits=False)  # recomputed chunks differ from the first pass in rounding only
    assert on.kv_stats().preemptions > 0 and on.kv_stats().prefix_hit_tokens > 0
    # a second call must evict the first call's cached blocks to make room
    c = on.generate(_ids(_shared(64, 6, seed=9)), SP, use_tqdm=False)
    _same(c, off.generate(_ids(_shared(64, 6, seed=9)), SP, use_tqdm=False), bits=False)
    _no_leak(on)


def test_n_samples_and_beams_with_caching(model_dir):
    prompts = _shared(40, 4, seed=12)
    on, off = _pair(model_dir, num_kv_blocks=400)
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, logprobs=0)
    # on the PyTorch path siblings decode as a cascade, whose shapes follow the co-scheduled
    # groups: identical tokens, logprobs equal to float noise; the kernel is exact
    _same(on.generate(_ids(prompts), sp, use_tqdm=False),
          off.generate(_ids(prompts), sp, use_tqdm=False), bits=cpu_kernel_available())
    bp = BeamSearchParams(beam_width=4, max_tokens=8)
    x = on.beam_search(_ids(prompts), bp, use_tqdm=False)
    y = off.beam_search(_ids(prompts), bp, use_tqdm=False)
    assert on.kv_stats().prefix_hit_tokens > 0
    for u, v in zip(x, y):
        assert [s.token_ids for s in u.sequences] == [s.token_ids for s in v.sequences]
        assert [s.score for s in u.sequences] == pytest.approx([s.score for s in v.sequences],
                                                               abs=1e-4)
    _no_leak(on)


@pytest.mark.parametrize("start, hit, chunk", [(0, 0, None), (17, 16, None), (48, 32, None),
                                               (49, 48, None), (50, 48, 7)])
def test_prompt_logprobs_from_a_start_share_the_blocks_before_it(model_dir, start, hit, chunk):
    """The logprob of token `start` is read from the logits of token `start - 1`, so a hit
    covers at most `start - 1` tokens (whole blocks): 48 shared tokens, block size 16; also
    with prompts computed in chunks of 7 tokens (a chunk's tail holds the wanted rows)."""
    prompts = _shared(48, 6, seed=3, qmin=3, qmax=9)
    on, off = _pair(model_dir, num_kv_blocks=256, max_num_batched_tokens=chunk)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1,
                        prompt_logprobs_start=start)
    a = on.generate(_ids(prompts), sp, use_tqdm=False)
    b = off.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=1,
                                                   prompt_logprobs=1), use_tqdm=False)
    assert on.kv_stats().prefix_hit_tokens == 5 * hit  # every prompt but the first
    assert [o.num_cached_tokens for o in a] == [0] + [hit] * 5
    assert on.kv_stats().prompt_tokens_computed == sum(map(len, prompts)) - 5 * hit
    for x, y, ids in zip(a, b, prompts):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.prompt_logprobs[:max(start, 1)] == [None] * max(start, 1)
        for pos in range(max(start, 1), len(ids)):
            got, want = x.prompt_logprobs[pos], y.prompt_logprobs[pos]
            assert got.keys() == want.keys()
            for t in want:
                assert got[t].rank == want[t].rank
                assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-5)
    _no_leak(on)


def test_prompt_logprobs_do_not_wait_for_blocks_they_cannot_use(model_dir, monkeypatch):
    """Prompts sharing 48 tokens but asking for logprobs from position 10 on can use no cached
    block: they are admitted together, as with the cache off (same number of steps)."""
    prompts = _shared(48, 6, seed=4, qmin=3, qmax=9)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=10)
    steps = []
    for llm in _pair(model_dir, num_kv_blocks=256):
        count = [0]
        real = llm.engine.step
        monkeypatch.setattr(llm.engine, "step", lambda out, real=real, count=count: (
            count.__setitem__(0, count[0] + 1), real(out))[1])
        llm.generate(_ids(prompts), sp, use_tqdm=False)
        steps.append(count[0])
    assert steps[0] == steps[1]


def test_lru_keeps_the_most_recent_prefixes(model_dir):
    llm = LLM(model_dir, block_size=B, num_kv_blocks=20)
    old, new = [1] + _tokens(63, 20), [1] + _tokens(63, 21)
    llm.generate(_ids([old]), SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate(_ids([new]), SamplingParams(max_tokens=1), use_tqdm=False)
    # 12 blocks are free; a third prompt needs 14: the two least recently used cached blocks
    # (the older prompt's first two) are evicted, which breaks its whole chain
    llm.generate(_ids([[1] + _tokens(219, 22)]), SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate(_ids([new]), SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.kv_stats().prefix_hit_tokens == 48
    llm.generate(_ids([old]), SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.kv_stats().prefix_hit_tokens == 0


def test_prefix_caching_flag_is_validated(model_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model_dir, enable_prefix_caching="yes")
