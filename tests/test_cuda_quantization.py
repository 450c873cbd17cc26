"""Quantized checkpoints on a CUDA device (what the CPU cannot check; docs/quantization.md): an
FP8 and an INT4 model equal HF `generate` on the same checkpoint on the GPU, online fp8 on an
sm89+ GPU parts from HF only at near-ties, and FlashInfer gets the checkpoint's fp8 k/v scales.
Skipped without CUDA (scripts/gpu_check.sh runs them)."""

import importlib.util

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests import quant_models
from tests.helpers import (
    first_divergence_out_of_top,
    hf_greedy_top,
    make_prompt_token_ids,
    strip_after_eos,
    top_ids,
)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = make_prompt_token_ids(8, 3, 60, vocab_size=512, seed=43)
NEW = 16


@pytest.fixture(scope="module")
def src(tiny_model_factory):
    return tiny_model_factory("llama", eos_boost=RECOMMENDED_EOS_BOOST)


def _hf(folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", **kw).eval()


@torch.no_grad()
def _hf_greedy(model, prompt):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=2, pad_token_id=0)
    return strip_after_eos(out[0, len(prompt):].tolist())


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                    reason="compressed-tensors not installed")
@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_compressed_tensors_on_cuda_equals_hf(src, tmp_path, scheme):
    folder = quant_models.compressed_tensors(src, tmp_path / scheme, scheme)
    llm = LLM(folder, device="cuda", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)
    hf = _hf(folder)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p) for p in PROMPTS]


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9), reason="needs sm89+")
def test_online_fp8_parts_from_hf_only_at_near_ties(src):
    from transformers import FineGrainedFP8Config

    llm = LLM(src, device="cuda", dtype="bfloat16", quantization="fp8", num_kv_blocks=256)
    assert llm.quantization.online
    hf = _hf(src, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config())
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW, logprobs=5),
                        use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        got = o.outputs[0]
        want, want_top = hf_greedy_top(hf, p, NEW)
        assert first_divergence_out_of_top(got.token_ids, [top_ids(x, 5) for x in got.logprobs],
                                           want, want_top) is None


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None
                    or importlib.util.find_spec("flashinfer") is None,
                    reason="compressed-tensors or flashinfer not installed")
def test_flashinfer_fp8_pool_takes_the_checkpoint_scales(src, tmp_path):
    folder = quant_models.compressed_tensors(src, tmp_path / "kv", "int8", kv_scales=True)
    runs = {}
    for backend in ("flashinfer", "torch"):
        llm = LLM(folder, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                  attention_backend=backend, num_kv_blocks=256)
        assert all(s != 1.0 for s in llm.cache.k_scales)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=NEW, logprobs=5),
                            use_tqdm=False)
        runs[backend] = [(o.outputs[0].token_ids, [top_ids(x, 5) for x in o.outputs[0].logprobs])
                         for o in outs]
    for (a, a_top), (b, b_top) in zip(runs["flashinfer"], runs["torch"]):
        assert first_divergence_out_of_top(a, a_top, b, b_top) is None
