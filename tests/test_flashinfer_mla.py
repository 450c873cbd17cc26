"""The FlashInfer MLA backend (latent pools) driven through the installed FlashInfer's own
MLA wrapper code on the CPU, its kernels replaced by recorders (tests/flashinfer_recorder.py):
the pool's latent and the absorbed query reach the kernel binding in place (packed, no copy),
the plan gets the step's CSR metadata, kv lengths, heads, widths and scale, one plan serves
every layer of a step, and a machine that cannot build the kernels falls back. This checks
our use of FlashInfer's API, not its kernels."""

from __future__ import annotations

import pytest
import torch

from batchgen.attention.backend import BackendUnavailable, KernelBuildFailed
from batchgen.attention.flashinfer_mla import FlashInferMlaBackend
from batchgen.attention.metadata import StepMetadata
from batchgen.attention.spec import AttentionSpec
from batchgen.kv import KVCache
from tests.flashinfer_recorder import reaches, real_flashinfer

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
