"""The FlashInfer MLA backend (latent pools) on the CPU, two ways. Through the installed
FlashInfer's own MLA wrapper code, its kernels replaced by recorders (tests/flashinfer_recorder.py):
the pool's latent and the absorbed query reach the kernel binding in place (packed, no copy),
the plan gets the step's CSR metadata, kv lengths, heads, widths and scale, one plan serves
every layer of a step, and a machine that cannot build the kernels falls back. And end to end
through a PyTorch stand-in with FlashInfer's signatures (tests/flashinfer_mla_standin.py):
DeepSeek-V3 and Kimi-K2-shaped models equal HF. This checks our use of FlashInfer's API, not
its kernels."""

from __future__ import annotations

import inspect
from functools import partial

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.attention import flashinfer_mla, registry
from batchgen.attention.backend import BackendUnavailable, KernelBuildFailed
from batchgen.attention.flashinfer_mla import FlashInferMlaBackend
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.spec import AttentionSpec
from batchgen.kv import KVCache
from tests import flashinfer_mla_standin
from tests.families import save_family_model
from tests.flashinfer_recorder import reaches, real_flashinfer
from tests.helpers import hf_greedy, load_hf_model, make_prompt_token_ids

HEADS, LORA, ROPE, PAGE, LAYERS = 16, 512, 64, 16, 2
SCALE = 0.0737  # distinctive, so a match is no accident
NO_NVCC = RuntimeError("Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't "
                       "exist")


@pytest.fixture
def fi(monkeypatch):
    with real_flashinfer(monkeypatch) as (module, recorder):
        yield module, recorder


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def _cache(dtype=torch.bfloat16, latent=True):
    return KVCache(LAYERS, 8, PAGE, 1, LORA + ROPE, dtype, "cpu", head_dim_v=LORA,
                   v_in_k=latent)


def _specs():
    return [AttentionSpec(HEADS, 1, LORA + ROPE, LORA, SCALE, None, None, torch.bfloat16)
            for _ in range(LAYERS)]


# a prefill step (5 new tokens after none cached; 3 new after 16 cached) and a decode step
PREFILL = StepMetadata(_i32([0, 5, 8]), _i32([0, 1, 3]), _i32([3, 4, 5]), _i32([5, 3]), PAGE)
DECODE = StepMetadata(_i32([0, 1, 2]), _i32([0, 1, 3]), _i32([3, 4, 5]), _i32([6, 4]), PAGE)


@pytest.mark.parametrize("meta, lens", [(PREFILL, [5, 19]), (DECODE, [6, 20])])
def test_the_latent_and_the_absorbed_query_reach_the_kernel_in_place(fi, meta, lens):
    module, recorder = fi
    backend = FlashInferMlaBackend(_specs(), _cache(), 64, fi=module)
    recorder.out = backend.out
    plans = len([c for c in recorder.calls if c.fn.startswith("plan")])
    backend.plan(meta)
    q = torch.randn(meta.num_tokens, HEADS, LORA + ROPE).bfloat16()
    for layer in range(LAYERS):
        out = backend.run(layer, q)
        assert out.shape == (meta.num_tokens, HEADS, LORA)
        assert torch.equal(out, torch.ones_like(out))  # the kernel's output, in place
        run = recorder.last("run")
        latent = backend.cache.k_blocks[layer][:, :, 0]
        ptrs = {a.data_ptr() for a in run.args if torch.is_tensor(a)}
        # q's two parts and the latent's two parts are views: no copy on the way
        assert {q.data_ptr(), q.data_ptr() + LORA * 2} <= ptrs
        assert {latent.data_ptr(), latent.data_ptr() + LORA * 2} <= ptrs
        assert reaches(run, SCALE) and reaches(run, HEADS) and reaches(run, PAGE)
    calls = [c for c in recorder.calls if c.fn.startswith("plan")]
    assert len(calls) == plans + 1  # one plan for both layers
    plan = calls[-1]
    assert reaches(plan, HEADS) and reaches(plan, LORA)
    tensors = [a for a in plan.args if torch.is_tensor(a) and a.dtype == torch.int32]
    assert any(t.tolist() == lens for t in tensors)  # kv lengths
    assert any(t.tolist() == meta.qo_indptr.tolist() for t in tensors)


def test_a_machine_without_nvcc_falls_back(fi):
    module, recorder = fi
    recorder.fail = NO_NVCC
    with pytest.raises(KernelBuildFailed, match="could not be built or loaded here"):
        FlashInferMlaBackend(_specs(), _cache(), 64, fi=module)


def test_pools_and_layers_it_does_not_serve(fi):
    module, _ = fi
    with pytest.raises(BackendUnavailable, match="not an MLA latent"):
        FlashInferMlaBackend(_specs(), _cache(latent=False), 64, fi=module)
    with pytest.raises(BackendUnavailable, match="float8"):
        FlashInferMlaBackend(_specs(), _cache(torch.float8_e4m3fn), 64, fi=module)
    windowed = [AttentionSpec(HEADS, 1, LORA + ROPE, LORA, SCALE, 8, None, torch.bfloat16)] * 2
    with pytest.raises(BackendUnavailable, match="window"):
        FlashInferMlaBackend(windowed, _cache(), 64, fi=module)


# ---- the stand-in keeps FlashInfer's signatures, and runs models end to end -----------------
@pytest.mark.parametrize("method", ["__init__", "plan", "run"])
def test_the_standins_signatures_are_flashinfers(fi, method):
    """Every stand-in parameter exists in the real method, of the same kind and default."""
    real = inspect.signature(getattr(fi[0].mla.BatchMLAPagedAttentionWrapper, method)).parameters
    ours = inspect.signature(getattr(flashinfer_mla_standin.BatchMLAPagedAttentionWrapper,
                                     method)).parameters
    assert list(ours)[:1] == list(real)[:1] == ["self"]
    real_pos = [n for n, p in real.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    our_pos = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert our_pos == real_pos[:len(our_pos)]
    for n, p in ours.items():
        assert n in real and real[n].kind == p.kind, n
        if p.default is not p.empty:
            assert p.default == real[n].default, (n, p.default, real[n].default)


@pytest.fixture
def mla_standin(monkeypatch):
    """The stand-in in the registry's "flashinfer_mla" entry, on the CPU, in float32 (HF
    float32 stays the oracle), for the tiny models' latent (32 + 8)."""
    monkeypatch.setattr(flashinfer_mla, "Q_DTYPES", (torch.float32,))
    monkeypatch.setattr(flashinfer_mla, "KV_DTYPES", (torch.float32,))
    monkeypatch.setattr(flashinfer_mla, "WORKSPACE_BYTES", 1 << 16)
    entry = registry.BackendEntry("flashinfer_mla", ("cpu",), (torch.float32,),
                                  (torch.float32,), (40,),
                                  lambda: partial(FlashInferMlaBackend, fi=flashinfer_mla_standin))
    monkeypatch.setitem(registry.BACKENDS, "flashinfer_mla", entry)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2"])
def test_mla_models_equal_hf_through_the_flashinfer_mla_backend(mla_standin, family, tmp_path):
    path = save_family_model(family, tmp_path)
    prompts = make_prompt_token_ids(6, 2, 40, vocab_size=512, seed=9)
    llm = LLM(path, attention_backend="flashinfer_mla", block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=16, max_num_seqs=6)
    assert llm.attention_backend == "flashinfer_mla" and llm.cache.v_in_k
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 8)
    assert llm.kv_stats().preemptions > 0
    beams = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]],
                            BeamSearchParams(beam_width=3, max_tokens=6), use_tqdm=False)
    model = load_hf_model(path)
    for p, o in zip(prompts[:2], beams):
        ids = torch.tensor([p])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=3,
                              num_return_sequences=3, max_new_tokens=6, do_sample=False,
                              eos_token_id=2, pad_token_id=0, early_stopping=False)
        rows = [r[:r.index(2) + 1] if 2 in r else r for r in want[:, len(p):].tolist()]
        assert [s.token_ids for s in o.sequences] == rows


def test_a_gpu_pool_that_is_not_latent_never_gets_the_mla_backend(mla_standin, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("BATCHGEN_MLA_CACHE", "decompressed")
    path = save_family_model("deepseek_v3", tmp_path)
    with pytest.raises(ValueError, match="attention_backend='flashinfer_mla' cannot run here: "
                                         "serves head_dim"):
        LLM(path, attention_backend="flashinfer_mla", num_kv_blocks=16)
