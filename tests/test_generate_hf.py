"""HF is the oracle: greedy tokens and packed-prefill logits on tiny random models of eight
families, with exact block multiples, block_size 1, forced preemption and chunked prefill."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import LLM, SamplingParams
from batchgen.attention.interface import StepContext
from batchgen.attention.metadata import SeqChunk, StepRows
from batchgen.tools.make_tiny_model import RECOMMENDED_EOS_BOOST
from tests.helpers import (
    first_divergence_out_of_top,
    hf_greedy,
    hf_greedy_top,
    load_hf_model,
    make_prompt_token_ids,
    top_ids,
)

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt_oss", "gpt2", "gpt_neox", "opt"]
MAX_NEW = 24

# (block_size, num_kv_blocks, max_num_batched_tokens, max_num_seqs, attention_backend);
# None = default (the compiled CPU decode kernel where it builds), "torch" = pure PyTorch
LAYOUTS = {
    "block16": (16, 512, None, 256, None),
    "block16-torch": (16, 512, None, 256, "torch"),
    "block1": (1, 4096, None, 256, None),
    "preempt+chunked": (4, 48, 24, 8, None),  # ~2 sequences fit; prompts exceed the budget
}


@pytest.fixture(scope="module")
def prompts():
    return make_prompt_token_ids(16, 1, 60, vocab_size=512, seed=7, include_lengths=(16, 32, 48))


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tiny_model_factory, prompts):
    path = tiny_model_factory(request.param, eos_boost=RECOMMENDED_EOS_BOOST)
    return request.param, path, hf_greedy(path, prompts, MAX_NEW)


# every layout with the serial engine; the async engine (planning the next step while this
# one's forward runs) on the layout where it has most to get wrong: preemption + chunking
ENGINE_CASES = [(layout, "serial") for layout in LAYOUTS] + [("preempt+chunked", "async")]


@pytest.mark.parametrize("layout, engine_mode", ENGINE_CASES, indirect=["engine_mode"])
def test_greedy_equals_hf_generate(family_case, prompts, layout, engine_mode):
    family, path, expected = family_case
    block_size, blocks, budget, seqs, backend = LAYOUTS[layout]
    llm = LLM(path, block_size=block_size, num_kv_blocks=blocks, max_num_batched_tokens=budget,
              max_num_seqs=seqs, attention_backend=backend)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{family} {layout} prompt {i} (len {len(prompts[i])})"
    eos = [o.outputs[0].finish_reason for o in outs]
    assert "stop" in eos and "length" in eos, "EOS must be reachable and not always reached"
    stats = llm.kv_stats()
    assert llm.engine.kv.block_manager.num_free_blocks() == blocks, "blocks leaked"
    if layout == "preempt+chunked":
        assert stats.preemptions > 0
        assert stats.peak_blocks_in_use <= blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_prefill_logits_equal_hf(tiny_model_factory, prompts, family):
    """Every position of a packed ragged prefill equals HF eager on each prompt alone.
    (Unboosted weights: the EOS boost's large lm_head row would amplify float rounding.)"""
    path = tiny_model_factory(family)
    llm = LLM(path, block_size=4, num_kv_blocks=512)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    batch = sorted(prompts[:8], key=len)  # the runner packs rows by length: keep this order
    bm = llm.engine.kv.block_manager
    chunks = []
    for i, p in enumerate(batch):
        bm.allocate(("packed", i), len(p))
        chunks.append(SeqChunk(p, bm.table(("packed", i)), 0, 1))
    runner = llm.engine.runner
    step = runner.inputs.prepare(StepRows.from_chunks(chunks))
    meta = step.meta
    runner.backend.plan(meta)
    with torch.inference_mode():  # every position's logits, not only the sampled rows
        got = runner.model(input_ids=step.input_ids[None], position_ids=step.positions[None],
                           use_cache=False, batchgen_step=StepContext(
                               runner.cache, runner.backend, step.slot_mapping)).logits[0]
    for i in range(len(batch)):
        bm.free_seq(("packed", i))
    with torch.no_grad():
        for i, p in enumerate(batch):
            want = ref(input_ids=torch.tensor([p]), use_cache=False).logits[0]
            a, b = meta.qo_indptr[i].item(), meta.qo_indptr[i + 1].item()
            torch.testing.assert_close(got[a:b], want, atol=1e-5, rtol=0)


def test_bf16_greedy_parts_from_hf_only_between_near_top_candidates(tiny_model_factory):
    """In bf16 batchgen's packed steps and HF's one-prompt forwards round differently, so
    greedy runs may part (here they do, at logit gaps up to 8 bf16 ulps): each parting must be
    between tokens both runs rank in their top 5 (the criterion the CUDA tests use in bf16)."""
    path = tiny_model_factory("llama", head_dim=64, eos_boost=RECOMMENDED_EOS_BOOST,
                              dtype=torch.bfloat16)
    prompts = make_prompt_token_ids(8, 1, 200, vocab_size=512, seed=3)
    outs = LLM(path, num_kv_blocks=512).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24, logprobs=5), use_tqdm=False)
    hf = load_hf_model(path).to(torch.bfloat16)
    try:
        for p, o in zip(prompts, outs):
            got = o.outputs[0]
            want, want_top = hf_greedy_top(hf, p, 24)
            assert first_divergence_out_of_top(
                got.token_ids, [top_ids(lp, 5) for lp in got.logprobs], want, want_top) is None
    finally:
        hf.float()
