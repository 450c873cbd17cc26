"""An fp8 (e4m3, or e5m2) KV cache is exactly HF with its keys and values rounded to fp8: the
oracle is HF's own SDPA attention, registered with K and V passed through the same saturating
cast."""

import functools

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchgen import LLM, SamplingParams
from batchgen.attention.interface import StepContext
from batchgen.attention.metadata import SeqChunk, StepRows
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import make_prompt_token_ids, strip_after_eos

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _fp8_sdpa(dtype, module, query, key, value, attention_mask, **kw):
    """HF's SDPA attention over fp8-rounded K/V (scale 1.0, saturated like the pool)."""
    big = torch.finfo(dtype).max
    r = lambda x: x.clamp(-big, big).to(dtype).to(x.dtype)  # noqa: E731
    return sdpa_attention_forward(module, query, r(key), r(value), attention_mask, **kw)


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    path = tiny_model_factory("qwen2", eos_boost=RECOMMENDED_EOS_BOOST)
    refs = {}
    for name, dtype in FP8.items():
        AttentionInterface.register(f"{name}_reference", functools.partial(_fp8_sdpa, dtype))
        refs[name] = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation=f"{name}_reference").eval()
    prompts = make_prompt_token_ids(6, 3, 50, vocab_size=512, seed=9)
    return path, refs, prompts


@pytest.mark.parametrize("backend, kv", [("cpu_kernel", "fp8"), ("torch", "fp8"),
                                         ("cpu_kernel", "fp8_e5m2"), ("torch", "fp8_e5m2")])
def test_fp8_greedy_equals_hf_with_fp8_rounded_kv(setup, backend, kv):
    path, refs, prompts = setup
    ref = refs[kv]
    llm = LLM(path, block_size=4, num_kv_blocks=256, kv_cache_dtype=kv,
              attention_backend=backend)
    assert llm.engine.runner.cache.dtype == FP8[kv]
    assert llm.cache_config.bytes_per_token * 2 == LLM(path, num_kv_blocks=8, kv_cache_dtype=(
        "bfloat16")).cache_config.bytes_per_token  # fp8 halves beta
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        with torch.no_grad():
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                do_sample=False, eos_token_id=2, pad_token_id=0)
        assert o.outputs[0].token_ids == strip_after_eos(want[0, len(p):].tolist())


def test_fp8_prefill_logits_equal_hf_with_fp8_rounded_kv(setup):
    path, refs, prompts = setup
    ref = refs["fp8"]
    llm = LLM(path, block_size=4, num_kv_blocks=256, kv_cache_dtype="fp8")
    runner, bm = llm.engine.runner, llm.engine.kv.block_manager
    batch = sorted(prompts, key=len)
    chunks = []
    for i, p in enumerate(batch):
        bm.allocate(("p", i), len(p))
        chunks.append(SeqChunk(p, bm.table(("p", i)), 0, 1))
    step = runner.inputs.prepare(StepRows.from_chunks(chunks))
    runner.backend.plan(step.meta)
    with torch.inference_mode():
        got = runner.model(input_ids=step.input_ids[None], position_ids=step.positions[None],
                           use_cache=False, batchgen_step=StepContext(
                               runner.cache, runner.backend, step.slot_mapping)).logits[0]
    qo = step.meta.qo_indptr.tolist()
    with torch.no_grad():
        for i, p in enumerate(batch):
            want = ref(input_ids=torch.tensor([p]), use_cache=False).logits[0]
            torch.testing.assert_close(got[qo[i]:qo[i + 1]], want, atol=2e-5, rtol=0)
