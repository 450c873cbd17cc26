"""Prefill-only (pooling) requests in a KV pool too small for all of them at once (issue 42):
they wait and are admitted as finished requests free their blocks; no deadlock, no
preemption, and every reward / per-token score equals HF's own head."""

from __future__ import annotations

import shutil

import pytest
import torch

PROMPTS = [f"Candidate {i}: " + " ".join(["the answer is four"] * (1 + i % 4)) for i in range(8)]


@pytest.mark.parametrize("kind", ["SequenceClassification", "TokenClassification"])
def test_prefill_only_requests_progress_in_a_small_pool(kind, tiny_model_factory, tmp_path):
    import transformers

    from batchgen import LLM

    src = tiny_model_factory("llama")
    config = transformers.AutoConfig.from_pretrained(src)
    config.num_labels, config.pad_token_id = 2, 0
    torch.manual_seed(4)
    hf = getattr(transformers, "AutoModelFor" + kind).from_config(config).float().eval()
    hf.save_pretrained(tmp_path)
    for f in src.iterdir():
        if "token" in f.name:
            shutil.copy(f, tmp_path / f.name)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    lengths = [len(tok(p)["input_ids"]) for p in PROMPTS]
    llm = LLM(tmp_path, seed=0, block_size=4, num_kv_blocks=10, enable_prefix_caching=False)
    assert sum(-(-n // 4) for n in lengths) > 2 * 10 >= -(-max(lengths) // 4)  # waits needed
    if kind == "SequenceClassification":
        got = [torch.tensor(o.outputs.probs) for o in llm.reward(PROMPTS)]
    else:
        got = [o.outputs.data for o in llm.encode(PROMPTS, pooling_task="token_classify")]
    stats = llm.kv_stats()
    assert stats.preemptions == 0 and stats.peak_blocks_in_use <= 10
    with torch.no_grad():
        for p, g in zip(PROMPTS, got):
            logits = hf(**tok(p, return_tensors="pt")).logits[0]  # [L] or [T, L]
            assert torch.allclose(g, logits, atol=1e-5)
