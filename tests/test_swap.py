"""Swap preemption (`swap_space`): the block manager's host tables, the scheduler swapping
groups out and back as units, without changing a token, over the weightless fake engine."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine.kv_manager import request_peak_blocks
from batchgen.kv import BlockManager, KVCache, PoolExhausted
from batchgen.kv.block_manager import chain_hashes
from batchgen.kv.swap import HostPool
from batchgen.params import BeamSearchParams, SamplingParams
from tests.fake_engine import VOCAB, FakeLLM, reference_beams, reference_samples
from tests.helpers import check_pool_invariants


def assert_all_free(llm: FakeLLM) -> None:
    """After a call: every device and host block free, no table on either side."""
    bm = llm.engine.kv.block_manager
    check_pool_invariants(bm)
    check_pool_invariants(bm)
    assert not bm.num_tables() and bm.num_free_blocks() == bm.num_blocks
    assert bm.host_blocks_in_use() == 0 and not bm.host_tables()
    assert not llm.engine.scheduler.has_unfinished() and not llm.engine.kv.batch.num_seqs


# ---- the block manager ------------------------------------------------------------------------
def test_a_shared_block_moves_once_and_its_reference_counts_survive_the_round_trip():
    bm = BlockManager(8, 4, num_host_blocks=6)
    bm.allocate("a", 10)  # 3 blocks, the last partial
    bm.fork("a", "b")
    bm.fork("a", "c", 8)  # shares only the first two
    out = bm.swap_out(["a", "b", "c"])
    assert len(out) == 3 and bm.blocks_swapped_out == 3  # each distinct block once
    assert bm.num_free_blocks() == 8 and not bm.num_tables()
    assert sorted(bm.host_ref_count) == [0, 0, 0, 2, 3, 3]
    check_pool_invariants(bm)
    check_pool_invariants(bm)
    bm.allocate("x", 8)  # the device pool is free for others meanwhile
    back = bm.swap_in(["a", "b", "c"])
    assert len(back) == 3 and bm.host_blocks_in_use() == 0
    assert bm.table("a") == bm.table("b") and bm.table("c") == bm.table("a")[:2]
    assert [bm.ref_count[b] for b in bm.table("a")] == [3, 3, 2]
    assert not set(bm.table("a")) & set(bm.table("x"))
    host_of = dict(out)
    assert {host_of[d] for d in host_of} == {h for h, _ in back}  # every host block came back
    check_pool_invariants(bm)
    check_pool_invariants(bm)


def test_swaps_are_all_or_nothing():
    bm = BlockManager(6, 2, num_host_blocks=2)
    bm.allocate("a", 6)  # 3 blocks: more than the host pool
    assert not bm.can_swap_out(["a"])
    with pytest.raises(PoolExhausted):
        bm.swap_out(["a"])
    assert bm.table("a") and bm.host_blocks_in_use() == 0
    bm.allocate("b", 4)
    bm.swap_out(["b"])
    bm.allocate("c", 6)  # the device pool is full again: b cannot come back
    assert not bm.can_swap_in(["b"])
    with pytest.raises(PoolExhausted):
        bm.swap_in(["b"])
    assert bm.is_swapped("b") and bm.host_blocks_in_use() == 2
    bm.free_all()  # an aborted call returns the host pool too
    assert bm.host_blocks_in_use() == 0 and not bm.is_swapped("b")
    check_pool_invariants(bm)


def test_a_swapped_out_block_is_a_prefix_hit_only_while_its_device_bytes_stand():
    """The prefix cache maps hashes to device blocks only. A published block swapped out
    stays cached on the device (its bytes are untouched until reused): a hit there is the
    same KV. Once the pool hands it out again it is no hit, and the swapped sequence comes
    back into fresh blocks, never into the hash table's."""
    bm = BlockManager(4, 2, enable_prefix_caching=True, num_host_blocks=4)
    tokens = [1, 2, 3, 4, 5]
    hashes = chain_hashes(tokens, 2, [])
    bm.allocate("a", 5)
    bm.register("a", hashes)
    published = bm.table("a")[:2]
    bm.swap_out(["a"])
    assert bm.lookup(hashes) == published  # evictable, bytes intact
    assert bm.num_evictable(published) == len(published)
    bm.allocate("b", 8)  # the whole pool: the cached blocks are evicted and reused
    assert bm.lookup(hashes) == []
    bm.free_seq("b")
    bm.swap_in(["a"])
    assert bm.lookup(hashes) == []  # the fresh blocks carry no hash until published again
    check_pool_invariants(bm)
    check_pool_invariants(bm)
    bm.register("a", hashes)
    assert bm.lookup(hashes) == bm.table("a")[:2]


# ---- the scheduler over the fake engine ----------------------------------------------------------
def _prompts(rng: random.Random, n: int, shared: int, lo: int, hi: int) -> list[list[int]]:
    head = [1] + [rng.randrange(3, VOCAB) for _ in range(shared - 1)] if shared else []
    return [head + [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def _tight(prompts, params, bs: int, host: int, mode: str = "swap", **kw) -> FakeLLM:
    """A pool of exactly the largest request's bound: groups preempt each other often."""
    need = max(request_peak_blocks(len(q), p.n, p.max_tokens, bs) for q, p in zip(prompts, params))
    return FakeLLM(num_blocks=need, block_size=bs, num_host_blocks=host, preemption_mode=mode,
                   **kw)


@pytest.mark.parametrize("bs,caching", [(1, False), (2, True), (4, True), (3, False)])
def test_swapped_samples_equal_the_reference(bs, caching):
    rng = random.Random(bs)
    prompts = _prompts(rng, 7, 5 if caching else 0, 2, 11)
    params = [SamplingParams(n=rng.randint(1, 5), seed=i, temperature=1.0, max_tokens=12,
                             ignore_eos=i % 3 == 0) for i in range(7)]
    llm = _tight(prompts, params, bs, host=64, max_num_batched_tokens=16,
                 enable_prefix_caching=caching)
    outs = llm.generate(prompts, params)
    for prompt, p, o in zip(prompts, params, outs):
        assert [c.token_ids for c in o.outputs] == reference_samples(prompt, p, p.max_tokens)
    s = llm.engine.scheduler
    assert s.num_swap_outs > 3 and s.num_swap_ins == s.num_swap_outs
    assert llm.engine.kv.block_manager.blocks_swapped_out == llm.engine.kv.block_manager.blocks_swapped_in > 0
    assert llm.engine.runner.swaps == 2 * llm.engine.kv.block_manager.blocks_swapped_out
    assert_all_free(llm)


@pytest.mark.parametrize("bs", [1, 2, 4])
def test_swapped_beams_equal_the_reference(bs):
    rng = random.Random(30 + bs)
    prompts = _prompts(rng, 4, 0, 3, 9)
    p = BeamSearchParams(beam_width=4, max_tokens=8)
    need = max(request_peak_blocks(len(q), 4, 8, bs) for q in prompts)
    llm = FakeLLM(num_blocks=need, block_size=bs, num_host_blocks=64, preemption_mode="swap",
                  max_num_batched_tokens=16)
    outs = llm.beam_search(prompts, p)
    for prompt, o in zip(prompts, outs):
        assert [s.token_ids for s in o.sequences] == reference_beams(prompt, p, 8)
    assert llm.engine.scheduler.num_swap_outs > 0
    assert_all_free(llm)


def test_a_group_the_host_pool_cannot_hold_is_recomputed_instead():
    """Host room for small groups only: some preemptions swap, the others recompute, and
    every sample is still the reference's."""
    rng = random.Random(5)
    prompts = _prompts(rng, 8, 0, 2, 14)
    params = [SamplingParams(n=1 + i % 4, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(8)]
    llm = _tight(prompts, params, 2, host=6, max_num_batched_tokens=12)
    outs = llm.generate(prompts, params)
    for prompt, p, o in zip(prompts, params, outs):
        assert [c.token_ids for c in o.outputs] == reference_samples(prompt, p, p.max_tokens)
    s = llm.engine.scheduler
    assert 0 < s.num_swap_outs < s.num_preemptions
    assert_all_free(llm)


def test_swap_recomputes_fewer_prompt_tokens_than_recompute():
    rng = random.Random(9)
    prompts = _prompts(rng, 6, 0, 20, 30)
    params = [SamplingParams(n=4, seed=i, max_tokens=10, ignore_eos=True) for i in range(6)]
    runs = {}
    for mode, host in (("recompute", 0), ("swap", 256)):
        llm = _tight(prompts, params, 4, host=host, mode=mode, max_num_batched_tokens=32)
        outs = llm.generate(prompts, params)
        runs[mode] = ([[c.token_ids for c in o.outputs] for o in outs],
                      llm.kv_stats().prompt_tokens_computed, llm.kv_stats().preemptions)
    assert runs["swap"][0] == runs["recompute"][0]
    assert runs["recompute"][2] > 0 and runs["swap"][2] > 0
    assert runs["swap"][1] == sum(map(len, prompts)) < runs["recompute"][1]


def test_swap_mode_needs_a_host_pool():
    from batchgen.engine.batch import PersistentBatch
    from batchgen.engine.kv_manager import KVManager
    from batchgen.engine.scheduler import Scheduler

    kv = KVManager(BlockManager(4, 2), PersistentBatch(4, VOCAB, 4, [2], "cpu"))
    with pytest.raises(ValueError, match="swap_space"):
        Scheduler(kv, 4, 8, "swap")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_the_host_pool_moves_blocks_bit_for_bit(dtype):
    """Blocks 1 and 3 out to host blocks 2 and 0, the device blocks overwritten, then back
    into blocks 4 and 0: every layer's K and V bytes are the originals."""
    cache = KVCache(2, 5, 4, 2, 8, dtype, "cpu")
    cache.pool.view(torch.uint8).copy_(torch.randint(0, 120, cache.pool.view(torch.uint8).shape,
                                                     dtype=torch.uint8))
    before = cache.pool.clone()
    host = HostPool(cache, 3)
    assert host.pool.shape[2] == 3 and host.pool.shape[3:] == cache.pool.shape[3:]
    host.swap_out([(1, 2), (3, 0)])
    cache.pool.view(torch.uint8).zero_()
    host.swap_in([(2, 4), (0, 0)])
    got, want = cache.pool.view(torch.uint8), before.view(torch.uint8)
    assert torch.equal(got[:, :, 4], want[:, :, 1]) and torch.equal(got[:, :, 0], want[:, :, 3])
    assert not got[:, :, 1].any()


def test_the_host_pool_moves_keys_and_values_of_different_widths():
    cache = KVCache(2, 5, 4, 2, 12, torch.float32, "cpu", head_dim_v=8)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in cache.tensors]
    host = HostPool(cache, 3)
    assert host.nbytes == cache.nbytes * 3 // 6
    host.swap_out([(1, 2), (3, 0)])
    for t in cache.tensors:
        t.zero_()
    host.swap_in([(2, 4), (0, 0)])
    for got, want in zip(cache.tensors, before):
        assert torch.equal(got[:, :, 4], want[:, :, 1]) and torch.equal(got[:, :, 0], want[:, :, 3])
        assert not got[:, :, 1].any()
