"""The FlashInfer MLA backend on a real GPU (marked `cuda`; skipped without CUDA or
FlashInfer): a DeepSeek-V3-shaped tiny model with the real latent shape (kv_lora_rank 512 +
rope 64) in bf16 gives the same greedy tokens through "flashinfer_mla" as through the torch
backend over the same latent pool. Run by scripts/gpu_check.sh (`-m cuda`)."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from tests.families import save_family_model
from tests.helpers import first_divergence_out_of_top, make_prompt_token_ids, top_ids

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LATENT_576 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64)


def test_flashinfer_mla_equals_the_torch_backend_on_the_latent(tmp_path):
    """Same latent pool, two backends, bf16: where greedy runs part (the two round
    differently), both tokens rank in the other's top 5."""
    path = save_family_model("deepseek_v3", tmp_path, **LATENT_576)
    prompts = [{"prompt_token_ids": p}
               for p in make_prompt_token_ids(8, 2, 60, vocab_size=512, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    got = {}
    for backend in ("flashinfer_mla", "torch"):
        llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=256, block_size=16,
                  max_num_batched_tokens=64, attention_backend=backend)
        assert llm.attention_backend == backend and llm.cache.v_in_k
        got[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    far = [where for a, b in zip(got["flashinfer_mla"], got["torch"])
           if (where := first_divergence_out_of_top(
               a.token_ids, [top_ids(p, 5) for p in a.logprobs],
               b.token_ids, [top_ids(p, 5) for p in b.logprobs])) is not None]
    assert not far, f"partings outside the top 5 (position, flashinfer_mla's, torch's): {far}"
