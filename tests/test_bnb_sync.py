"""TRL's QLoRA weight sync into a bitsandbytes 4-bit generator: a 4-bit policy with a LoRA
adapter (peft) merges it and sends each layer's `param.data` (packed bytes, no quant state),
the way TRL's GRPO colocate does; batchgen's generator then gives the merged policy's own
greedy tokens (HF generate on it), before and after the policy's CPU kernel repacked its
layers, and after an unmerge and another merge."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

IDS = [[5, 17, 99, 3, 42, 7, 8, 9], [200, 4, 61]]
NEW = 10


def _sync(llm: LLM, policy) -> None:
    """TRL 1.16's colocate sync of a PEFT policy (its _iter_named_params, no gathering)."""
    for name, param in policy.named_parameters():
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if policy.prefix not in name:
            llm.load_weights([(name, param.data)])


def _hf(model) -> list[list[int]]:
    out = []
    for ids in IDS:
        with torch.inference_mode():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.append(seq[0, len(ids):].tolist())
    return out


def _ours(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": i} for i in IDS],
                        SamplingParams(temperature=0, max_tokens=NEW), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_qlora_sync_gives_the_merged_policys_tokens(tiny_model_factory) -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = tiny_model_factory("llama", vocab_size=300, seed=21)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_compute_dtype=torch.float32)
    policy = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=q),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
    llm = LLM(path, quantization="bitsandbytes", dtype="float32", num_kv_blocks=64)
    base = _ours(llm)
    assert base == _hf(policy)  # B = 0: the adapter adds nothing yet
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter, far from the base
    policy.merge_adapter()
    _sync(llm, policy)  # the merged layers as fresh (portable) 4-bit bytes
    merged = _hf(policy)  # its forward repacks them for the CPU kernel
    assert _ours(llm) == merged != base
    _sync(llm, policy)  # the same values, now from CPU-packed layers
    assert _ours(llm) == merged
    policy.unmerge_adapter()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.zero_()
    policy.merge_adapter()  # after an unmerge: the base as the round trips left it
    _sync(llm, policy)
    assert _ours(llm) == _hf(policy)
    with pytest.raises(ValueError, match="packed 4-bit bytes without the quant state"):
        llm.load_weights([("model.layers.0.self_attn.q_proj.weight",
                           torch.zeros(2048, 1, dtype=torch.uint8))])
