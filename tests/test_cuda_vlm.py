"""Vision-language models on a GPU (scripts/gpu_check.sh): every served image family's
greedy tokens equal HF generate on CUDA (float32, the torch backend), and Gemma 3's
bidirectional images through FlashInfer's custom mask (bfloat16) follow the torch backend.
Skipped without CUDA; the CPU suite covers the same paths (tests/test_vlm.py)."""

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.test_vlm import EOS_ID, as_prompt, strip_after_eos, workload

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FAMILIES = ("llava", "llava_next", "idefics3", "qwen2_5_vl", "qwen3_vl", "gemma3")


def _hf_cuda(path, prompts, new):
    from transformers import AutoModelForImageTextToText

    from batchgen.multimodal.processor import load_processor

    model = AutoModelForImageTextToText.from_pretrained(path).eval().to("cuda")
    processor = load_processor(path)
    out = []
    for text, images in prompts:
        inputs = processor(text=[text], images=[images] if images else None,
                           return_tensors="pt").to("cuda")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=new, do_sample=False,
                                 eos_token_id=EOS_ID, pad_token_id=0)
        out.append(strip_after_eos(ids[0, inputs["input_ids"].shape[1]:].tolist()))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_image_families_on_cuda_equal_hf(tiny_vlm_factory, family):
    path = tiny_vlm_factory(family)
    prompts = workload(family)
    llm = LLM(path, device="cuda", attention_backend="torch", limit_mm_per_prompt={"image": 2},
              block_size=8, num_kv_blocks=256, max_num_batched_tokens=24)
    outs = llm.generate([as_prompt(t, i) for t, i in prompts],
                        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_cuda(path, prompts, 12)


def test_gemma3_images_through_flashinfer_follow_the_torch_backend(tiny_vlm_factory):
    path = tiny_vlm_factory("gemma3")
    prompts = [as_prompt(t, i) for t, i in workload("gemma3")]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    kw = dict(device="cuda", dtype="bfloat16", limit_mm_per_prompt={"image": 2}, block_size=16,
              num_kv_blocks=256)
    fi = LLM(path, **kw)
    if fi.attention_backend != "flashinfer":
        pytest.skip(f"FlashInfer does not run here ({fi.attention_backend} was chosen)")
    ref = LLM(path, attention_backend="torch", **kw)
    a = fi.generate(prompts, params, use_tqdm=False)
    b = ref.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):  # the first token's logprob: the prefill, image masks included
        lx = next(iter(x.outputs[0].logprobs[0].values())).logprob
        ly = next(iter(y.outputs[0].logprobs[0].values())).logprob
        assert abs(lx - ly) < 0.05, (lx, ly)
    same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b))
    assert same >= len(prompts) - 1
