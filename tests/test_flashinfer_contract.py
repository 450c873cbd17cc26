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
    # one wrapper plan per distinct (window, softcap, scale) per step, never one per layer
    assert backend.plans_made == backend.steps * len(keys)
    assert len(standin.PLAN_LOG) == backend.plans_made
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
    K and V with different strides, or a run before any plan raise."""
    ws = torch.zeros(64, dtype=torch.uint8)
    w = standin.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    k = torch.zeros(4, 2, 1, 64)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, (k, k))
    i32 = partial(torch.tensor, dtype=torch.int32)
    w.plan(i32([0, 1]), i32([0]), i32([1]), 2, 1, 64, 2, q_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(q, (k.bfloat16(), k.bfloat16()))
    with pytest.raises(ValueError, match="same strides"):
        w.run(q.bfloat16(), (k.bfloat16(), k.bfloat16().transpose(0, 1).contiguous()
                             .transpose(0, 1)))
    with pytest.raises(ValueError, match="int32"):
        w.plan(torch.tensor([0, 1]), i32([0]), i32([1]), 2, 1, 64, 2)
