"""Torch paged backend vs a dense per-sequence reference on the same metadata, and the
metadata itself vs the chapter's block-table arithmetic."""

import random

import pytest
import torch

from batchgen.attention import registry
from batchgen.attention.flashinfer_backend import FlashInferBackend
from batchgen.attention.flashinfer_mla import FlashInferMlaBackend
from batchgen.attention.kernel_backend import CpuKernelBackend
from batchgen.attention.metadata import SeqChunk, StepRows
from batchgen.attention.spec import AttentionSpec
from batchgen.attention.torch_backend import TorchBackend
from batchgen.kv import BlockManager, KVCache, kv_cache_bytes
from batchgen.kv.cache import kv_pool_shape
from batchgen.model.inputs import StepInputs
from tests.helpers import cpu_kernel_or_skip


def prepare(chunks, block_size, cache=None, min_rows=0):
    """The runner's step batch for these chunks (buffers sized for them)."""
    pages = sum(len(c.block_table) for c in chunks)
    scratch = cache.scratch_block if cache is not None else 10**6
    return StepInputs(sum(c.num_new for c in chunks), len(chunks), pages, block_size, scratch,
                      min_rows, torch.device("cpu")).prepare(StepRows.from_chunks(chunks))


def make_backend(kernel, cache, hq, hkv, d, scale, window, softcap, sinks):
    """The torch backend, or the CPU kernel backend, for one layer with this spec."""
    spec = AttentionSpec(hq, hkv, d, d, scale, window, softcap, torch.float32, sinks)
    if kernel is None:
        return TorchBackend([spec], cache)
    return CpuKernelBackend([spec], cache, kernel)


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
    return cpu_kernel_or_skip() if use else None


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
    rng.shuffle(bm._free)  # scattered physical blocks
    # (cached tokens, new tokens): decodes, fresh prefills, chunks on a cached prefix, exact
    # block multiples
    # long chunks (> 32 queries) are cut into query tiles, also mid-sequence
    shapes = [(0, 7), (9, 1), (3 * block_size, 1), (0, 2 * block_size), (5, 6), (12, 1),
              (block_size, block_size), (0, 1), (0, 70), (41, 50), (600, 1)]
    shapes.sort(key=lambda cn: (cn[1], cn[0]))  # the runner's row order: packed rows = chunks
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
        chunks.append(SeqChunk([0] * new, bm.table(sid), cached, 1))
    batch = prepare(chunks, block_size)
    meta = batch.meta
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    cache.write(0, new_k, new_v, batch.slot_mapping)
    q = torch.randn(meta.num_tokens, hq, d)
    sink_t = torch.randn(hq) if sinks else None
    backend = make_backend(_kernel(kernel), cache, hq, hkv, d, 0.3, window, softcap, sink_t)
    backend.plan(meta)
    assert (getattr(backend, "rows", None) is not None) == kernel  # decode rows to the kernel
    out = backend.run(0, q)
    for i in range(len(shapes)):
        a, b = meta.qo_indptr[i].item(), meta.qo_indptr[i + 1].item()
        ref = _dense_reference(q[a:b], full_k[i], full_v[i], 0.3, window, softcap, sink_t)
        torch.testing.assert_close(out[a:b], ref, atol=2e-5, rtol=1e-4)


def test_step_inputs_match_block_tables():
    """The runner's packed batch: rows sorted by (query length, cached length), logits rows in
    chunk order, FlashInfer's int32 metadata, the chapter's slot arithmetic."""
    bm = BlockManager(32, 4)
    bm._free.reverse()
    bm.allocate("a", 10)
    bm.allocate("b", 8)  # exact block multiple
    bm.allocate("c", 1)
    chunks = [SeqChunk([5, 6, 7], bm.table("a"), 7, 1),
              SeqChunk(list(range(10, 18)), bm.table("b"), 0, 1),
              SeqChunk([9], bm.table("c"), 0, 0)]
    batch = prepare(chunks, 4)
    m = batch.meta
    for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len):
        assert t.dtype == torch.int32
    for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices):
        assert t.dtype == torch.int64
    # packed order: c (1 token), a (3), b (8)
    assert batch.input_ids.tolist() == [9, 5, 6, 7, *range(10, 18)]
    assert m.qo_indptr.tolist() == [0, 1, 4, 12]
    assert m.kv_indptr.tolist() == [0, 1, 4, 6]
    assert m.kv_indices.tolist() == bm.table("c") + bm.table("a") + bm.table("b")
    assert m.kv_last_page_len.tolist() == [1, 2, 4]  # 1..block_size, never 0
    assert m.kv_lens().tolist() == [1, 10, 8]
    expect = ([bm.slot_index("c", 0)] + [bm.slot_index("a", p) for p in (7, 8, 9)]
              + [bm.slot_index("b", p) for p in range(8)])
    assert batch.slot_mapping.tolist() == expect
    assert batch.positions.tolist() == [0, 7, 8, 9, *range(8)]
    assert batch.logits_indices.tolist() == [3, 11] and batch.num_logits == 2  # a's, then b's


def test_a_step_wider_than_the_buffers_packs_as_into_buffers_sized_for_it():
    """A beam group wider than max_num_seqs decodes in one step: its rows go into a second,
    wider set of buffers, packed as buffers sized for them would hold them; narrower steps
    keep the first set (CUDA graphs captured its addresses)."""
    bm = BlockManager(32, 4)
    for name in "abcde":
        bm.allocate(name, 6)
    chunks = [SeqChunk([i + 3], bm.table(name), 5, 1) for i, name in enumerate("abcde")]
    inputs = StepInputs(8, 2, 4, 4, 10**6, 0, torch.device("cpu"))
    wide, sized = inputs.prepare(StepRows.from_chunks(chunks)), prepare(chunks, 4)
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices"):
        assert getattr(wide, name).tolist() == getattr(sized, name).tolist()
    assert wide.meta.as_lists() == sized.meta.as_lists()
    assert inputs.wide is not None and wide.input_ids.data_ptr() == inputs.wide.host[
        "input_ids"].data_ptr()
    narrow = inputs.prepare(StepRows.from_chunks(chunks[:2]))
    assert narrow.input_ids.data_ptr() == inputs.main.host["input_ids"].data_ptr()
    assert narrow.meta.kv_indices.tolist() == bm.table("a") + bm.table("b")


def test_tiny_steps_are_padded_in_the_scratch_block():
    bm = BlockManager(8, 4)
    bm.allocate("a", 6)
    cache = KVCache(1, 8, 4, 1, 2, torch.float32, "cpu")
    batch = prepare([SeqChunk([3, 4], bm.table("a"), 4, 1)], 4, cache, min_rows=16)
    m = batch.meta
    assert m.num_tokens == 16 and m.num_seqs == 15  # the chunk + 14 one-token dummies
    assert batch.input_ids.tolist() == [3, 4] + [0] * 14  # dummies after the real rows
    assert batch.slot_mapping.tolist()[2:] == [cache.scratch_block * 4] * 14
    assert m.kv_indices.tolist()[-14:] == [cache.scratch_block] * 14
    assert batch.num_logits == 1 and batch.logits_indices.tolist() == [1] * 16


def test_kv_cache_bytes_and_pool_layout():
    # the chapter's worked numbers
    assert kv_cache_bytes(40, 40, 128, 2048) == 1_677_721_600
    assert kv_cache_bytes(30, 2, 64, 1) == 15_360
    cache = KVCache(3, 5, 4, 2, 8, torch.float16, "cpu")
    assert cache.pool.shape == (3, 2, 6, 4, 2, 8)  # + the scratch block for padding tokens
    assert cache.pool.shape == kv_pool_shape(3, 5, 4, 2, 8) and cache.layout == "NHD"
    assert cache.scratch_block == 5
    assert cache.bytes_per_token == kv_cache_bytes(3, 2, 8, 1, 2)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cache.write(1, k, v, torch.tensor([5, 19]))  # block 1 offset 1, block 4 offset 3
    torch.testing.assert_close(cache.pool[1, 0, 1, 1], k[0].half())
    torch.testing.assert_close(cache.pool[1, 1, 4, 3], v[1].half())
    cache.copy_blocks([(1, 0), (4, 2)])
    assert torch.equal(cache.pool[:, :, 0], cache.pool[:, :, 1])
    assert torch.equal(cache.pool[:, :, 2], cache.pool[:, :, 4])


def test_keys_and_values_of_different_widths_get_a_tensor_each():
    """MLA decompressed: 12-wide keys, 8-wide values; writes, layer views and COW copies."""
    cache = KVCache(2, 5, 4, 2, 12, torch.float32, "cpu", head_dim_v=8)
    assert cache.pool is None and [t.shape for t in cache.tensors] == [
        (2, 1, 6, 4, 2, 12), (2, 1, 6, 4, 2, 8)]
    assert cache.bytes_per_token == kv_cache_bytes(2, 2, 12, 1, 4, head_dim_v=8) == 2 * 2 * 20 * 4
    assert cache.nbytes == 6 * 4 * cache.bytes_per_token
    k, v = torch.randn(2, 2, 12), torch.randn(2, 2, 8)
    cache.write(1, k, v, torch.tensor([5, 19]))
    kb, vb = cache.layer_kv(1)
    assert torch.equal(kb[1, 1], k[0]) and torch.equal(vb[4, 3], v[1])
    cache.copy_blocks([(1, 0), (4, 2)])
    for t in cache.tensors:
        assert torch.equal(t[:, :, 0], t[:, :, 1]) and torch.equal(t[:, :, 2], t[:, :, 4])


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
        cache.copy_blocks(bm.reserve([(sid, prompt, extra)]))
        k_own, v_own = torch.randn(extra, hkv, d), torch.randn(extra, hkv, d)
        cache.write(0, k_own, v_own,
                    torch.tensor([bm.slot_index(sid, i) for i in range(prompt, n)]))
        full_k.append(torch.cat([k_prompt, k_own]))
        full_v.append(torch.cat([v_prompt, v_own]))
        chunks.append(SeqChunk([0], bm.table(sid), n - 1, 1))
    bm.allocate("x", 20)  # an unrelated decode row in the same step
    kx, vx = torch.randn(20, hkv, d), torch.randn(20, hkv, d)
    cache.write(0, kx, vx, torch.tensor([bm.slot_index("x", i) for i in range(20)]))
    other.append(SeqChunk([0], bm.table("x"), 19, 1))
    q = torch.randn(5, hq, d)
    sink_t = torch.randn(hq) if sinks else None
    meta = prepare(chunks + other, bs).meta  # rows sorted by length: find each by its length
    full_k, full_v = full_k + [kx], full_v + [vx]
    backend = make_backend(_kernel(kernel), cache, hq, hkv, d, 0.3, window, softcap, sink_t)
    backend.plan(meta)
    if not kernel:
        assert backend.cascade is not None  # the siblings share their prompt blocks
    out = backend.run(0, q)
    lens = [len(k) for k in full_k]
    for row in range(5):
        i = lens.index(meta.kv_lens()[row].item())
        ref = _dense_reference(q[row:row + 1], full_k[i], full_v[i], 0.3, window, softcap, sink_t)
        torch.testing.assert_close(out[row:row + 1], ref, atol=2e-5, rtol=1e-4)


def test_an_fp8_pool_saturates_scales_and_copies_bytes():
    cache = KVCache(2, 4, 4, 1, 8, torch.float8_e4m3fn, "cpu")
    assert cache.bytes_per_token == kv_cache_bytes(2, 1, 8, 1, 1)  # half a 16-bit pool's
    cache.k_scales[1], cache.v_scales[1] = 2.0, 0.5
    k = torch.full((1, 1, 8), 1000.0)
    v = torch.full((1, 1, 8), 0.75)
    cache.write(1, k, v, torch.tensor([5]))
    assert torch.equal(cache.pool[1, 0, 1, 1].float(), torch.full((1, 8), 448.0))  # 500 saturates
    assert torch.equal(cache.pool[1, 1, 1, 1].float(), torch.full((1, 8), 1.5))  # 0.75 / 0.5
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.pool[:, :, 3].view(torch.uint8), cache.pool[:, :, 1].view(torch.uint8))


@BACKENDS
def test_fp8_pools_are_read_back_with_their_scales(kernel):
    """Both CPU backends attend over stored fp8 values times the layer's scales."""
    torch.manual_seed(2)
    bs, hq, hkv, d = 4, 4, 2, 8
    cache = KVCache(1, 64, bs, hkv, d, torch.float8_e4m3fn, "cpu")
    cache.k_scales[0], cache.v_scales[0] = 0.5, 2.0
    bm = BlockManager(64, bs)
    shapes = [(9, 1), (0, 11), (4, 1)]
    chunks, keys = [], []
    for sid, (cached, new) in enumerate(shapes):
        bm.allocate(sid, cached + new)
        k, v = torch.randn(cached + new, hkv, d), torch.randn(cached + new, hkv, d)
        cache.write(0, k, v, torch.tensor([bm.slot_index(sid, p) for p in range(cached + new)]))
        stored = [cache.pool[0, j][bm.table(sid)].reshape(-1, hkv, d)[:cached + new]
                  .float() * s for j, s in ((0, 0.5), (1, 2.0))]
        keys.append(stored)
        chunks.append(SeqChunk([0] * new, bm.table(sid), cached, 1))
    shapes_order = sorted(range(3), key=lambda i: (shapes[i][1], shapes[i][0]))
    batch = prepare([chunks[i] for i in shapes_order], bs)
    q = torch.randn(batch.meta.num_tokens, hq, d)
    backend = make_backend(_kernel(kernel), cache, hq, hkv, d, 0.3, None, None, None)
    backend.plan(batch.meta)
    out = backend.run(0, q)
    qo = batch.meta.qo_indptr.tolist()
    for row, i in enumerate(shapes_order):
        ref = _dense_reference(q[qo[row]:qo[row + 1]], *keys[i], 0.3, None, None, None)
        torch.testing.assert_close(out[qo[row]:qo[row + 1]], ref, atol=2e-5, rtol=1e-4)


def test_backends_declare_what_the_engine_needs():
    """Each registry entry's graph flag is its backend's `supports_graphs`; every entry reads
    the pool's layout; only FlashInfer's backends keep memory beyond the pool."""
    classes = {"flashinfer": FlashInferBackend, "cpu_kernel": CpuKernelBackend,
               "torch": TorchBackend, "flashinfer_mla": FlashInferMlaBackend}
    for name, entry in registry.BACKENDS.items():
        assert entry.graphs == classes[name].supports_graphs == (name == "flashinfer")
        assert entry.kv_layout == KVCache.layout
    spec = AttentionSpec(4, 2, 64, 64, 0.125, None, None, torch.bfloat16)
    assert registry.BACKENDS["torch"].reserve([spec], 64, [1, 2]) == 0
    assert registry.BACKENDS["flashinfer"].reserve([spec], 64, [1, 2]) > 256 << 20
    assert registry.BACKENDS["flashinfer_mla"].reserve([spec], 64, None) > 256 << 20


def test_a_backend_reading_another_pool_layout_is_refused_before_loading(monkeypatch):
    entry = registry.BACKENDS["torch"]
    monkeypatch.setitem(registry.BACKENDS, "torch", registry.BackendEntry(
        "torch", entry.devices, None, None, None, entry.load, kv_layout="HND"))
    query = registry.BackendQuery(torch.device("cpu"), torch.float32, torch.float32, 64)
    with pytest.raises(ValueError, match=r"attention_backend='torch' cannot run here: reads a "
                                         r"HND KV pool, but the pool is NHD"):
        registry.backend_candidates("torch", query)
    assert "torch" not in [e.name for e, _ in registry.backend_candidates(None, query)]


def test_graphs_need_a_backend_that_supports_them():
    from batchgen.model.runner import ModelRunner

    cache = KVCache(1, 4, 4, 1, 8, torch.float32, "cpu")
    spec = AttentionSpec(1, 1, 8, 8, 0.5, None, None, torch.float32)
    runner = ModelRunner(torch.nn.Identity(), cache, TorchBackend([spec], cache), None)
    with pytest.raises(ValueError, match="supports_graphs.*'torch'"):
        runner.use_graphs([1], 4, None)
