"""The FlashInfer backend end to end on the CPU, through a PyTorch stand-in for FlashInfer's
wrappers (tests/flashinfer_standin.py). These tests check batchgen's *use* of FlashInfer's API
(plans, metadata, buffers, dtypes, fallbacks) against HF as the oracle; they are no evidence
that FlashInfer's kernels work, which only scripts/gpu_check.sh on a GPU can give."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.attention import flashinfer_backend, registry
from batchgen.attention.flashinfer_backend import FlashInferBackend
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests import flashinfer_standin as standin_module
from tests.helpers import hf_greedy, make_prompt_token_ids

FAMILIES = ["llama", "qwen3", "gemma2", "gpt_oss"]  # plain, qk-norm, softcap+windows, sinks
MAX_NEW = 16


@pytest.fixture
def standin(monkeypatch):
    """Put the stand-in in the registry's "flashinfer" entry, on the CPU and in float32 (so HF
    float32 stays the oracle), with a small workspace."""
    q_dtypes = (*flashinfer_backend.Q_DTYPES, torch.float32)
    kv_dtypes = (*flashinfer_backend.KV_DTYPES, torch.float32)
    monkeypatch.setattr(flashinfer_backend, "Q_DTYPES", q_dtypes)
    monkeypatch.setattr(flashinfer_backend, "KV_DTYPES", kv_dtypes)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1 << 16)
    entry = registry.BackendEntry("flashinfer", ("cpu",), q_dtypes, kv_dtypes,
                                  flashinfer_backend.HEAD_DIMS,
                                  lambda: partial(FlashInferBackend, fi=standin_module))
    monkeypatch.setitem(registry.BACKENDS, "flashinfer", entry)
    standin_module.PLAN_LOG.clear()
    return standin_module


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param, head_dim=64, eos_boost=RECOMMENDED_EOS_BOOST)


@pytest.fixture(scope="module")
def prompts():
    return make_prompt_token_ids(10, 1, 60, vocab_size=512, seed=7, include_lengths=(16, 32))


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("layout", ["roomy", "preempt+chunked"])
def test_greedy_equals_hf_through_the_flashinfer_backend(standin, family_dir, prompts, layout):
    kw = (dict(block_size=16, num_kv_blocks=512) if layout == "roomy" else
          dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=24, max_num_seqs=8))
    llm = LLM(family_dir, attention_backend="flashinfer", **kw)
    assert llm.attention_backend == "flashinfer"
    outs = llm.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(family_dir, prompts, MAX_NEW)
    if layout != "roomy":
        assert llm.kv_stats().preemptions > 0
    backend = llm.engine.runner.backend
    keys = {s.plan_key for s in backend.specs}
    # one wrapper plan per distinct (window, softcap, scale, sinks) per step, never one per
    # layer; plus, when the backend was made, one prefill and one decode plan per key that
    # built the kernels
    assert backend.plans_made == backend.steps * len(keys)
    assert len(standin.PLAN_LOG) == backend.plans_made + 2 * len(keys)
    kinds = {k for k, _ in standin.PLAN_LOG}
    assert kinds == {"prefill", "decode"}


def test_samples_and_beams_through_the_flashinfer_backend(standin, tiny_model_factory, prompts):
    """n > 1 (forks, copy-on-write of the shared partial block) and beams, against the
    PyTorch backend on the same weights; beams also against HF."""
    from tests.test_beam_search import hf_beams

    path = tiny_model_factory("qwen3", head_dim=64, eos_boost=0.2)
    sp = SamplingParams(n=3, temperature=0.8, seed=4, max_tokens=10, logprobs=1)
    bp = BeamSearchParams(beam_width=4, max_tokens=10)
    runs = {}
    for backend in ("flashinfer", "torch"):
        llm = LLM(path, block_size=4, num_kv_blocks=256, attention_backend=backend)
        runs[backend] = (llm.generate(_ids(prompts[:4]), sp, use_tqdm=False),
                         llm.beam_search(_ids(prompts[:4]), bp, use_tqdm=False))
        assert llm.kv_stats().cow_copies > 0
    (fs, fb), (ts, tb) = runs["flashinfer"], runs["torch"]
    for a, b in zip(fs, ts):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
    for p, a, b in zip(prompts[:4], fb, tb):
        seqs, scores = hf_beams(str(path), tuple(p), 4, 1.0, False)  # 10 new tokens, as bp
        assert [s.token_ids for s in a.sequences] == seqs == [s.token_ids for s in b.sequences]
        for s, want in zip(a.sequences, scores):
            assert math.isclose(s.score, want, rel_tol=1e-5, abs_tol=1e-4)


def test_an_fp8_pool_through_the_flashinfer_backend(standin, tiny_model_factory, prompts):
    """kv_data_type / k_scale / v_scale: the same quantised pool read by the stand-in and by
    the PyTorch backend gives the same tokens."""
    path = tiny_model_factory("llama", head_dim=64, eos_boost=RECOMMENDED_EOS_BOOST)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for backend in ("flashinfer", "torch"):
        llm = LLM(path, block_size=16, num_kv_blocks=128, kv_cache_dtype="fp8",
                  attention_backend=backend)
        assert llm.cache.pool.dtype == torch.float8_e4m3fn
        outs.append([o.outputs[0].token_ids for o in llm.generate(_ids(prompts), sp,
                                                                   use_tqdm=False)])
    assert outs[0] == outs[1]


def test_head_dims_flashinfer_does_not_serve_fall_back(standin, tiny_model_factory, caplog):
    path = tiny_model_factory("llama")  # head_dim 16
    with pytest.raises(ValueError, match="attention_backend='flashinfer' cannot run here: "
                                         "serves head_dim"):
        LLM(path, num_kv_blocks=64, attention_backend="flashinfer")
    with caplog.at_level("INFO", logger="batchgen"):
        llm = LLM(path, num_kv_blocks=64)
    assert llm.attention_backend != "flashinfer" and "'flashinfer' unavailable" in caplog.text


def test_the_standin_refuses_what_flashinfer_refuses(standin):
    """So that the end-to-end runs above mean something: a q in another dtype than planned,
    an `out` of the wrong shape, dtype or layout, an unknown keyword, `sinks=` on a plain
    wrapper (FlashInfer drops it) or a run before any plan raise; K and V with different
    strides are accepted, as by FlashInfer 0.7.4."""
    ws = torch.zeros(64, dtype=torch.uint8)
    w = standin.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    k = torch.zeros(4, 2, 1, 64)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, (k, k))
    i32 = partial(torch.tensor, dtype=torch.int32)
    w.plan(i32([0, 1]), i32([0]), i32([1]), 2, 1, 64, 2, q_data_type=torch.bfloat16)
    kb = k.bfloat16()
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(q, (kb, kb))
    with pytest.raises(TypeError, match="unexpected keyword"):
        w.run(q.bfloat16(), (kb, kb), return_lse_maybe=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        standin.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensorcores=True)
    with pytest.raises(ValueError, match="sinks"):
        w.run(q.bfloat16(), (kb, kb), sinks=torch.zeros(2))
    for bad, what in ((torch.empty(1, 2, 64), "dtype"), (torch.empty(2, 2, 64).bfloat16(),
                                                          "shape"),
                      (torch.empty(1, 64, 2).bfloat16().transpose(1, 2), "contiguous")):
        with pytest.raises(ValueError, match=what):
            w.run(q.bfloat16(), (kb, kb), out=bad)
    strided_v = kb.transpose(0, 1).contiguous().transpose(0, 1)
    assert w.run(q.bfloat16(), (kb, strided_v)).shape == (1, 2, 64)
    with pytest.raises(ValueError, match="int32"):
        w.plan(torch.tensor([0, 1]), i32([0]), i32([1]), 2, 1, 64, 2)


class EagerCapturer:
    """Stands in for torch.cuda graphs on the CPU: capture runs the step once and keeps its
    output as the graph's static output; replay runs it again into that output. A replay must
    not plan (a real graph replays kernels only), so plans must come before it."""

    def __init__(self, backend):
        self.backend = backend
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, fn):
        out = fn()
        self.captured.append(out.shape[0])

        def replay():
            plans = self.backend.plans_made
            new = fn()
            assert self.backend.plans_made == plans, "a plan inside a graph"
            out.copy_(new)
            self.replays += 1

        return replay, out


def test_graph_decode_pads_to_captured_sizes_and_equals_eager(standin, tiny_model_factory,
                                                              prompts):
    """Decode steps replay the graph of the next size up: padded rows in the scratch block,
    one decode wrapper per size over shared index buffers, planned before every replay."""
    from batchgen.kv import blocks_for
    from batchgen.model.cuda_graphs import capture_sizes

    path = tiny_model_factory("gemma2", head_dim=64, eos_boost=RECOMMENDED_EOS_BOOST)
    kw = dict(block_size=4, num_kv_blocks=256, attention_backend="flashinfer", max_num_seqs=12)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0)
    want = LLM(path, **kw).generate(_ids(prompts), sp, use_tqdm=False)
    llm = LLM(path, **kw)
    backend = llm.engine.runner.backend
    capturer = EagerCapturer(backend)
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    llm.engine.runner.use_graphs(capture_sizes(12), 12 * blocks_for(llm.max_model_len, 4),
                                 capturer)
    assert capturer.captured == [12, 8, 4, 2, 1]  # largest first
    got = llm.generate(_ids(prompts), sp, use_tqdm=False)
    assert capturer.replays > 0
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob,
                                                                abs=1e-4)
    bufs = backend.graph_buffers
    graph_wrappers = {k: w for k, w in backend.wrappers.items() if len(k) == 3}
    assert {k[2] for k in graph_wrappers} == {1, 2, 4, 8, 12}
    assert len({k[1] for k in graph_wrappers}) == 2  # gemma2: sliding and global layers
    for (_, _, size), w in graph_wrappers.items():
        indptr, indices, last = w.buffers
        assert indptr.data_ptr() == bufs["indptr"].data_ptr() and len(indptr) == size + 1
        assert indices.data_ptr() == bufs["indices"].data_ptr()
        assert last.data_ptr() == bufs["last_page_len"].data_ptr() and len(last) == size
    # the last replay: 10 live rows in a graph of 12, two dummies in the scratch block
    meta_rows = backend.meta.num_seqs
    assert meta_rows in (1, 2, 4, 8, 12)
    scratch = llm.cache.scratch_block
    kv = backend.meta.kv_indptr.tolist()
    live = sum(1 for i in range(meta_rows) if backend.meta.kv_indices[kv[i]] != scratch)
    assert all(backend.meta.kv_indices[kv[i]] == scratch for i in range(live, meta_rows))
    assert backend.meta.kv_last_page_len[live:].tolist() == [1] * (meta_rows - live)


def test_gemma3_images_through_flashinfers_custom_mask(standin, tiny_vlm_factory, monkeypatch):
    """Bidirectional image attention through the FlashInfer backend: steps with image chunks
    plan the prefill wrapper with a custom mask (the layer's window on top), and the tokens
    equal HF's."""
    from tests.test_vlm import greedy, hf_greedy, workload

    path = tiny_vlm_factory("gemma3")
    prompts = workload("gemma3")
    llm = LLM(path, attention_backend="flashinfer", limit_mm_per_prompt={"image": 2},
              block_size=4, num_kv_blocks=256, max_num_batched_tokens=20)
    assert llm.attention_backend == "flashinfer"
    masks = []
    plan = standin.BatchPrefillWithPagedKVCacheWrapper.plan

    def recording(self, *args, custom_mask=None, **kw):
        masks.append(custom_mask)
        return plan(self, *args, custom_mask=custom_mask, **kw)

    monkeypatch.setattr(standin.BatchPrefillWithPagedKVCacheWrapper, "plan", recording)
    assert greedy(llm, prompts, 12) == hf_greedy(path, prompts, 12)
    assert any(m is not None for m in masks) and any(m is None for m in masks)
