"""A hybrid model (Gated DeltaNet linear attention + full attention, transformers' qwen3_next):
batchgen keeps each sequence's mixer state in a pool beside the paged KV cache and runs HF's
own mixer code on it, so greedy output equals HF `generate`, n samples fork the prompt's
state, beams gather it by parent and prefix caching resumes from state snapshots.

    python examples/hybrid_model.py [MODEL_DIR]

MODEL_DIR: any hybrid or state-space model folder (Qwen3-Next, Qwen3.5, Granite 4, Nemotron-H,
Jamba, Bamba, Falcon-H1, LFM2, Kimi-Linear, OLMo-hybrid, MiniMax, Mamba2). Without it, a tiny
random qwen3_next is made in a temporary folder (the outputs are then random tokens).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen import LLM, BeamSearchParams, SamplingParams


def tiny_hybrid(folder: Path) -> Path:
    """A random 4-layer qwen3_next (DeltaNet, attention, DeltaNet, attention)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def main(model_dir: str) -> None:
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32)
    head = list(range(3, 40))  # a shared 37-token head, then a question each
    prompts = [{"prompt_token_ids": head + [50 + i, 60 + i, 70 + i]} for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    stats = llm.kv_stats()
    print(f"state per sequence: {stats.state_bytes_per_seq:,} bytes, whatever its length")
    print(f"prefix-cache hits: {stats.prefix_hit_tokens} prompt tokens served from snapshots")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=llm.dtype).eval()
    same = True
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p["prompt_token_ids"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        same &= ref[0, ids.shape[1]:].tolist() == list(o.outputs[0].token_ids)
    print(f"greedy equals HF generate: {same}")
    samples = llm.generate(prompts[:1], SamplingParams(n=4, temperature=1.0, seed=0,
                                                       max_tokens=8), use_tqdm=False)
    for i, c in enumerate(samples[0].outputs):
        print(f"sample {i}: {list(c.token_ids)}")
    beams = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=3, max_tokens=8),
                            use_tqdm=False)
    for b in beams[0].sequences:
        print(f"beam score {b.score:.3f}: {b.token_ids}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(str(tiny_hybrid(Path(tmp))))
