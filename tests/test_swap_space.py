"""`LLM(swap_space=GiB)` on real (tiny) models: swap and recompute preemption under tight pools
give the bits of a pool that never preempts (tokens, logprobs, beams), on several families and
block sizes; the knobs are checked before loading; the capacity line, the progress bar and
kv_stats() show the host pool; an interrupt mid-swap returns every device and host block."""

from __future__ import annotations

import random

import pytest

import batchgen
from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.engine.kv_manager import request_peak_blocks
from batchgen.kv.swap import GIB, host_available_bytes
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import (
    assert_pool_whole,
    interrupt_tracer,
    make_prompt_token_ids,
    traced_workload,
)

T = 10


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _gib(model_dir, blocks: int, block_size: int) -> float:
    """swap_space (GiB) for `blocks` host blocks of this model (half a block over, so the
    float never rounds a block away)."""
    beta = LLM(model_dir, block_size=block_size, num_kv_blocks=4).cache.bytes_per_token
    return (blocks + 0.5) * block_size * beta / GIB


def _samples(outs):
    return [[(c.token_ids, c.cumulative_logprob,
              [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]) for c in o.outputs]
            for o in outs]


def _beams(outs):
    return [[(s.token_ids, s.cumulative_logprob, s.score) for s in o.sequences] for o in outs]


def _assert_close(got, want) -> None:
    """Same tokens, logprobs within float32 rounding of each other."""
    for g, w in zip(got, want):
        assert [c[0] for c in g] == [c[0] for c in w]
        for (_, cg, lg), (_, cw, lw) in zip(g, w):
            assert cg == pytest.approx(cw, rel=1e-4, abs=1e-4)
            assert [sorted(d) for d in lg] == [sorted(d) for d in lw]
            assert [v for d in lg for v in d.values()] == pytest.approx(
                [v for d in lw for v in d.values()], rel=1e-4, abs=1e-4)


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen3"])
def family_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param, eos_boost=RECOMMENDED_EOS_BOOST)


@pytest.mark.parametrize("bs", [1, 4])
def test_swap_gives_the_bits_of_a_pool_that_never_preempts(family_dir, bs):
    """Greedy and seeded n=3 samples (with logprobs) and beams of width 3 over prompts that
    share a prefix (the prefix cache is on): a pool of the largest request's exact bound
    preempts many times. Swapped out and back, the KV is the same bytes: no bit changes.
    Recomputed, the tokens are the same but the logprobs only close: a recomputed generated
    token's K/V comes from a prefill tile, not the decode row that first computed it, and
    their attention kernels round differently (see engine/chunking.py)."""
    prompts = make_prompt_token_ids(5, 4, 24, vocab_size=512, seed=bs)
    prompts = [prompts[0][:6] + p[1:] for p in prompts]  # a shared head: prefix hits
    sps = [SamplingParams(n=3 if i % 2 else 1, temperature=0 if i % 2 == 0 else 1.0, seed=i,
                          max_tokens=T, logprobs=2, ignore_eos=True) for i in range(5)]
    beam = BeamSearchParams(beam_width=3, max_tokens=T)
    need = max(max(request_peak_blocks(len(p), 3, T, bs) for p in prompts), 8 // bs + 4)
    kw = dict(block_size=bs, max_num_batched_tokens=16)
    roomy = LLM(family_dir, num_kv_blocks=4096, **kw)
    want = _samples(roomy.generate(_ids(prompts), sps, use_tqdm=False))
    want_beams = _beams(roomy.beam_search(_ids(prompts), beam, use_tqdm=False))
    assert roomy.kv_stats().preemptions == 0
    gib = _gib(family_dir, 4 * need, bs)
    for mode, space in (("swap", gib), ("recompute", 0)):
        tight = LLM(family_dir, num_kv_blocks=need, swap_space=space, **kw)
        got = _samples(tight.generate(_ids(prompts), sps, use_tqdm=False))
        if mode == "swap":
            assert got == want
        else:
            _assert_close(got, want)
        s = tight.kv_stats()
        assert s.preemptions > 2
        assert (s.swap_outs == s.preemptions) if mode == "swap" else (s.swap_outs == 0)
        assert s.swap_ins == s.swap_outs and s.blocks_swapped_in == s.blocks_swapped_out
        got_beams = _beams(tight.beam_search(_ids(prompts), beam, use_tqdm=False))
        if mode == "swap":
            assert got_beams == want_beams
        else:
            assert [[b[0] for b in o] for o in got_beams] == [[b[0] for b in o] for o in want_beams]
        assert tight.kv_stats().preemptions > 0
        assert_pool_whole(tight)
        assert tight.engine.kv.block_manager.host_blocks_in_use() == 0


def test_swap_recomputes_no_prompt_token(tiny_model_factory):
    """n=4 over long prompts in a tight pool: recompute runs prompts again, swap never."""
    model = tiny_model_factory("llama")
    prompts = make_prompt_token_ids(4, 40, 60, vocab_size=512, seed=3)
    sp = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=12, ignore_eos=True)
    need = max(request_peak_blocks(len(p), 4, 12, 4) for p in prompts)
    stats = {}
    for space in (_gib(model, 8 * need, 4), 0):
        llm = LLM(model, block_size=4, num_kv_blocks=need, swap_space=space)
        llm.generate(_ids(prompts), sp, use_tqdm=False)
        stats[space > 0] = llm.kv_stats()
    assert stats[True].preemptions > 0 and stats[False].preemptions > 0
    assert stats[True].prompt_tokens_computed == sum(map(len, prompts))
    assert stats[False].prompt_tokens_computed > sum(map(len, prompts))
    assert stats[True].num_host_blocks == 8 * need and stats[True].blocks_swapped_out > 0


@pytest.mark.parametrize("kw,match", [
    (dict(swap_space=-1), "swap_space must be a number of GiB >= 0, got -1"),
    (dict(swap_space="4"), "swap_space must be a number of GiB >= 0, got '4'"),
    (dict(swap_space=True), "swap_space must be a number of GiB >= 0, got True"),
    (dict(swap_space=float("nan")), "swap_space must be a number of GiB >= 0"),
    (dict(swap_space=2**40), "swap_space must fit the host's available memory"),
    (dict(swap_space=1e-9), "swap_space must hold at least one block"),
    (dict(preemption_mode="swap"), "preemption_mode 'swap' needs swap_space > 0"),
    (dict(preemption_mode="evict", swap_space=1), "preemption_mode must be one of"),
])
def test_bad_swap_knobs_are_refused_before_any_work(tiny_model_factory, kw, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("'", "'")):
        LLM(tiny_model_factory("llama"), num_kv_blocks=64, **kw)


def test_the_available_memory_bound_is_the_hosts():
    assert 0 < host_available_bytes()


class _Bar:
    """A tqdm stand-in that keeps its postfixes."""

    def __init__(self, **kw):
        self.n, self.total, self.postfixes = 0, kw.get("total"), []
        _Bar.last = self

    def update(self, k):
        self.n += k

    def set_postfix_str(self, s, refresh=True):
        self.postfixes.append(s)

    def close(self):
        pass


def test_capacity_line_progress_bar_and_stats_show_the_host_pool(tiny_model_factory):
    model = tiny_model_factory("llama")
    llm = LLM(model, block_size=4, num_kv_blocks=40, swap_space=_gib(model, 100, 4))
    line = llm.cache_config.capacity_line(llm.max_model_len)  # what LLM logs at start-up
    beta = llm.cache.bytes_per_token
    assert (f"host swap pool: 100 blocks = 400 tokens, {400 * beta / 2**20:.1f} MiB of CPU RAM"
            in line)
    assert llm.engine.runner.host.pool.shape[2] == 100 and llm.engine.runner.host.pool.shape[3:] == \
        llm.cache.pool.shape[3:]
    assert llm.engine.scheduler.preemption_mode == "swap"
    prompts = make_prompt_token_ids(6, 20, 30, vocab_size=512, seed=1)
    llm.generate(_ids(prompts), SamplingParams(n=3, seed=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=_Bar)
    assert _Bar.last.postfixes and all("host KV: " in p and "/100 blocks" in p
                                       for p in _Bar.last.postfixes)
    s = llm.kv_stats()
    assert s.num_host_blocks == 100 and s.swap_outs > 0 and s.swap_ins == s.swap_outs
    assert_pool_whole(llm)


SWAP_CODE = ("swap_out", "swap_in", "_swap_out", "_swap_in", "swap_blocks", "can_swap_out",
             "can_swap_in", "_block_ops")


def _swap_tracer(event: int, counter: list[int]):
    """Like interrupt_tracer, counting only lines of batchgen's swap functions (the block
    manager's, the scheduler's, the runner's and the host pool's)."""
    root = batchgen.__path__[0]

    def local(frame, what, arg):
        if what == "line":
            counter[0] += 1
            if counter[0] == event:
                raise KeyboardInterrupt
        return local

    return lambda frame, what, arg: (local if frame.f_code.co_name in SWAP_CODE
                                     and frame.f_code.co_filename.startswith(root) else None)


def test_an_interrupt_mid_swap_returns_every_device_and_host_block(tiny_model_factory):
    """Ctrl-C at 12 points inside the swap code (block manager, scheduler, runner, host
    pool) and 6 anywhere in batchgen, of a real run that swaps: each leaves both pools whole;
    the next call is unchanged."""
    model = tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)
    llm = LLM(model, block_size=4, num_kv_blocks=20, max_num_batched_tokens=16,
              swap_space=_gib(model, 60, 4))
    swap_lines, all_lines = [0], [0]
    want = traced_workload(llm, _swap_tracer(0, swap_lines))
    assert llm.engine.scheduler.num_swap_outs > 0 and swap_lines[0] > 50
    traced_workload(llm, interrupt_tracer(0, (batchgen.__path__[0],), all_lines))
    rng = random.Random(2)
    tracers = [_swap_tracer(e, [0]) for e in sorted(rng.sample(range(1, swap_lines[0]), 12))]
    # an interrupted run publishes blocks the next run hits, so a later run may execute a few
    # percent fewer lines than the counted one: the points are drawn from its first 90%
    tracers += [interrupt_tracer(e, (batchgen.__path__[0],), [0])
                for e in sorted(rng.sample(range(1, all_lines[0] * 9 // 10), 6))]
    for tracer in tracers:
        with pytest.raises(KeyboardInterrupt):
            traced_workload(llm, tracer)
        assert_pool_whole(llm)
        bm = llm.engine.kv.block_manager
        assert bm.host_blocks_in_use() == 0 and not bm.host_tables()
    assert traced_workload(llm, None) == want


def test_tensor_parallel_ranks_swap_their_own_host_pools(tiny_model_factory):
    """2 ranks (gloo, CPU), each with a host pool over its local KV heads: the swaps reach the
    worker in the step's block ops, in order, so greedy tokens and beams under swap
    preemption equal one rank's without it (a worker that skipped a swap would read stale
    K/V after the swap-in)."""
    path = tiny_model_factory("llama")
    prompts = [{"prompt_token_ids": [3 + i] * 5 + list(range(30 + i, 50 + i))} for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    bp = BeamSearchParams(beam_width=3, max_tokens=8)
    kw = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24)
    one = LLM(path, **kw)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    want_beams = [[s.token_ids for s in o.sequences]
                  for o in one.beam_search(prompts[:3], bp, use_tqdm=False)]
    two = LLM(path, tensor_parallel_size=2, swap_space=_gib(path, 200, 4), **kw)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, sp, use_tqdm=False)]
        assert two.kv_stats().swap_outs > 0 and got == want
        beams = two.beam_search(prompts[:3], bp, use_tqdm=False)
        assert [[s.token_ids for s in o.sequences] for o in beams] == want_beams
        assert_pool_whole(two)
    finally:
        two._executor.shutdown()


def test_an_fp8_pool_swaps_its_bytes_unchanged(tiny_model_factory):
    """fp8 KV blocks go to the host pool and back as bytes: the same samples and logprobs as
    an fp8 pool that never preempts."""
    model = tiny_model_factory("qwen3")
    prompts = make_prompt_token_ids(4, 10, 30, vocab_size=512, seed=6)
    sp = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=T, logprobs=1, ignore_eos=True)
    need = max(request_peak_blocks(len(p), 3, T, 4) for p in prompts)
    kw = dict(block_size=4, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    want = _samples(LLM(model, num_kv_blocks=1024, **kw).generate(_ids(prompts), sp,
                                                                   use_tqdm=False))
    # _gib sizes by the model dtype's beta: at least 4 * need fp8 blocks
    tight = LLM(model, num_kv_blocks=need, swap_space=_gib(model, 4 * need, 4), **kw)
    assert tight.engine.runner.host.pool.dtype == tight.cache.pool.dtype
    assert _samples(tight.generate(_ids(prompts), sp, use_tqdm=False)) == want
    assert tight.kv_stats().swap_outs > 0
    assert_pool_whole(tight)
