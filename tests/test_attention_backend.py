"""Torch paged backend vs a dense per-sequence reference on the same metadata, and the
metadata itself vs the chapter's block-table arithmetic."""

import random

import pytest
import torch

from batchgen.attention import cpu_kernel
from batchgen.attention.metadata import SeqChunk, StepMetadata
from batchgen.attention.torch_backend import TorchPagedAttention
from batchgen.kv.block_manager import BlockManager
from batchgen.kv.cache import KVCache, kv_cache_bytes


def _dense_reference(q, k, v, scale, window, softcap, sinks):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] of ONE sequence whose last Tq keys are the queries."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(tk - tq, tk)[:, None]
    kpos = torch.arange(tk)[None]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(hq, 1, 1).expand(hq, tq, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v.double()).float()


def _kernel(use: bool):
    """The compiled decode kernel for use=True (skipping where it cannot be built)."""
    if not use:
        return None
    kernel = cpu_kernel.try_load()
    if kernel is None:
        pytest.skip("CPU decode kernel unavailable here")
    return kernel


BACKENDS = pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu-kernel"])

CASES = [  # (block_size, hq, hkv, window, softcap, sinks)
    (4, 4, 2, None, None, False),
    (1, 4, 4, None, None, False),
    (16, 8, 1, None, None, False),   # MQA
    (4, 6, 2, 5, None, False),       # sliding window
    (3, 4, 2, None, 20.0, False),    # softcap
    (4, 4, 2, None, None, True),     # sinks
    (2, 4, 2, 3, 10.0, True),
]


@BACKENDS
@pytest.mark.parametrize("block_size,hq,hkv,window,softcap,sinks", CASES)
def test_paged_attention_matches_dense(block_size, hq, hkv, window, softcap, sinks, kernel):
    torch.manual_seed(0)
    rng = random.Random(block_size * 31 + hq)
    d, num_blocks = 8, 1200
    cache = KVCache(1, num_blocks, block_size, hkv, d, torch.float32, "cpu")
    bm = BlockManager(num_blocks, block_size)
    rng.shuffle(bm.free)  # scattered physical blocks
    # (cached tokens, new tokens): decodes, fresh prefills, chunks on a cached prefix, exact
    # block multiples
    # long chunks (> 32 queries) are cut into query tiles, also mid-sequence
    shapes = [(0, 7), (9, 1), (3 * block_size, 1), (0, 2 * block_size), (5, 6), (12, 1),
              (block_size, block_size), (0, 1), (0, 70), (41, 50), (600, 1)]
    full_k, full_v, chunks = [], [], []
    for sid, (cached, new) in enumerate(shapes):
        n = cached + new
        bm.allocate(sid, n)
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        full_k.append(k)
        full_v.append(v)
        if cached:  # the prefix was written in an earlier step
            slots = torch.tensor([bm.slot_index(sid, p) for p in range(cached)])
            cache.write(0, k[:cached], v[:cached], slots)
        chunks.append(SeqChunk(bm.block_tables[sid], cached, new, 1))
    meta = StepMetadata.build(chunks, block_size)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    cache.write(0, new_k, new_v, meta.slot_mapping.long())
    q = torch.randn(meta.num_tokens, hq, d)
    sink_t = torch.randn(hq) if sinks else None
    backend = TorchPagedAttention(decode_kernel=_kernel(kernel))
    backend.plan(meta)
    assert (backend.kernel_rows is not None) == kernel  # decode rows go to the kernel
    out = backend.run(0, q, cache, 0.3, window, softcap, sink_t)
    for i in range(len(shapes)):
        a, b = meta.qo_indptr[i].item(), meta.qo_indptr[i + 1].item()
        ref = _dense_reference(q[a:b], full_k[i], full_v[i], 0.3, window, softcap, sink_t)
        torch.testing.assert_close(out[a:b], ref, atol=2e-5, rtol=1e-4)


def test_step_metadata_matches_block_tables():
    bm = BlockManager(32, 4)
    bm.free.reverse()
    bm.allocate("a", 10)
    bm.allocate("b", 8)  # exact block multiple
    bm.allocate("c", 1)
    chunks = [SeqChunk(bm.block_tables["a"], 7, 3, 1), SeqChunk(bm.block_tables["b"], 0, 8, 2),
              SeqChunk(bm.block_tables["c"], 0, 1, 0)]
    m = StepMetadata.build(chunks, 4)
    for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len, m.slot_mapping,
              m.positions, m.logits_indices):
        assert t.dtype == torch.int32
    assert m.qo_indptr.tolist() == [0, 3, 11, 12]
    assert m.kv_indptr.tolist() == [0, 3, 5, 6]
    assert m.kv_indices.tolist() == bm.block_tables["a"] + bm.block_tables["b"] + bm.block_tables["c"]
    assert m.kv_last_page_len.tolist() == [2, 4, 1]  # 1..block_size, never 0
    assert m.kv_lens().tolist() == [10, 8, 1]
    expect = ([bm.slot_index("a", p) for p in (7, 8, 9)] + [bm.slot_index("b", p) for p in range(8)]
              + [bm.slot_index("c", 0)])
    assert m.slot_mapping.tolist() == expect
    assert m.positions.tolist() == [7, 8, 9, *range(8), 0]
    assert m.logits_indices.tolist() == [2, 10, 10]  # last row of each, duplicated for n=2
    assert (m.max_q_len, m.max_kv_len) == (8, 10)


def test_kv_cache_bytes_and_pool_layout():
    # the chapter's worked numbers
    assert kv_cache_bytes(40, 40, 128, 2048) == 1_677_721_600
    assert kv_cache_bytes(30, 2, 64, 1) == 15_360
    cache = KVCache(3, 5, 4, 2, 8, torch.float16, "cpu")
    assert cache.pool.shape == (3, 2, 6, 4, 2, 8)  # + the scratch block for padding tokens
    assert cache.scratch_block == 5
    assert cache.bytes_per_token == kv_cache_bytes(3, 2, 8, 1, 2)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cache.write(1, k, v, torch.tensor([5, 19]))  # block 1 offset 1, block 4 offset 3
    torch.testing.assert_close(cache.pool[1, 0, 1, 1], k[0].half())
    torch.testing.assert_close(cache.pool[1, 1, 4, 3], v[1].half())
    cache.copy_blocks(torch.tensor([1, 4]), torch.tensor([0, 2]))
    assert torch.equal(cache.pool[:, :, 0], cache.pool[:, :, 1])
    assert torch.equal(cache.pool[:, :, 2], cache.pool[:, :, 4])


@BACKENDS
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (9, None, False),
                                                  (None, 15.0, True), (40, None, False)])
def test_cascade_decode_of_forked_siblings_matches_dense(window, softcap, sinks, kernel):
    """Rows sharing leading blocks are attended in two levels (shared prefix once, own tails
    apart) and must equal plain attention over each row's own sequence."""
    torch.manual_seed(1)
    bs, hq, hkv, d = 4, 4, 2, 8
    cache = KVCache(1, 300, bs, hkv, d, torch.float32, "cpu")
    bm = BlockManager(300, bs)
    prompt = 37
    bm.allocate("p", prompt)
    k_prompt, v_prompt = torch.randn(prompt, hkv, d), torch.randn(prompt, hkv, d)
    cache.write(0, k_prompt, v_prompt, torch.tensor([bm.slot_index("p", i) for i in range(prompt)]))
    full_k, full_v, chunks, other = [], [], [], []
    for c, extra in enumerate([5, 9, 1, 14]):  # siblings at different lengths (beams differ too)
        sid = f"c{c}"
        bm.fork("p", sid, num_tokens=prompt)
        n = prompt + extra
        src, dst = bm.cow_append(sid, prompt // bs)
        cache.copy_blocks(torch.tensor([src]), torch.tensor([dst]))
        bm.ensure_capacity(sid, n)
        k_own, v_own = torch.randn(extra, hkv, d), torch.randn(extra, hkv, d)
        cache.write(0, k_own, v_own,
                    torch.tensor([bm.slot_index(sid, i) for i in range(prompt, n)]))
        full_k.append(torch.cat([k_prompt, k_own]))
        full_v.append(torch.cat([v_prompt, v_own]))
        chunks.append(SeqChunk(bm.block_tables[sid], n - 1, 1, 1))
    bm.allocate("x", 20)  # an unrelated decode row in the same step
    kx, vx = torch.randn(20, hkv, d), torch.randn(20, hkv, d)
    cache.write(0, kx, vx, torch.tensor([bm.slot_index("x", i) for i in range(20)]))
    other.append(SeqChunk(bm.block_tables["x"], 19, 1, 1))
    q = torch.randn(5, hq, d)
    sink_t = torch.randn(hq) if sinks else None
    outs = {}
    meta = StepMetadata.build(chunks + other, bs)
    for share in (True, False):
        backend = TorchPagedAttention(use_cascade=share, decode_kernel=_kernel(kernel))
        backend.plan(meta)
        assert (backend.cascade is not None) == (share and not kernel)  # the kernel needs none
        outs[share] = backend.run(0, q, cache, 0.3, window, softcap, sink_t)
    torch.testing.assert_close(outs[True], outs[False], atol=2e-5, rtol=1e-4)
    for i in range(4):
        ref = _dense_reference(q[i:i + 1], full_k[i], full_v[i], 0.3, window, softcap, sink_t)
        torch.testing.assert_close(outs[True][i:i + 1], ref, atol=2e-5, rtol=1e-4)
    ref_x = _dense_reference(q[4:5], kx, vx, 0.3, window, softcap, sink_t)
    torch.testing.assert_close(outs[True][4:5], ref_x, atol=2e-5, rtol=1e-4)
