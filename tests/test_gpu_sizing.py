"""Sizing the GPU pool: the budget arithmetic, and the profiling forward it measures (run here
on the CPU, where it must equal HF's own forward since it attends causally over the tokens)."""

import pytest
import torch

from batchgen.config import EngineConfig, pool_blocks
from batchgen.model.profile import ProfileContext, gpu_kv_budget
from tests.helpers import load_hf_model

GiB = 1 << 30


def test_budget_is_utilization_minus_weights_activations_and_memory_outside_torch():
    # 80 GiB card, 2 GiB used by another process and the CUDA context, torch holds 16 GiB of
    # weights (reserved 17), the largest step peaks 3 GiB, FlashInfer will take 0.5 GiB
    budget = gpu_kv_budget(total=80 * GiB, free=80 * GiB - 19 * GiB, allocated=16 * GiB,
                           reserved=17 * GiB, activation_peak=3 * GiB, utilization=0.9,
                           other=GiB // 2)
    assert budget == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB - 2 * GiB - GiB // 2


def test_a_pool_that_cannot_hold_one_sequence_says_what_it_needs():
    cfg = EngineConfig(block_size=16, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"max_model_len=4096 tokens needs 134217728 bytes.*"
                                         r"raise gpu_memory_utilization, lower max_model_len, "
                                         r"or pass kv_cache_memory"):
        pool_blocks(cfg, 32768, torch.device("cuda"), 1 << 20, 4096)
    assert pool_blocks(cfg, 32768, torch.device("cuda"), 16 * GiB, 4096) == \
        16 * GiB // (16 * 32768)


def test_the_profiling_forward_is_a_real_forward(tiny_model_factory):
    """The profile attends every token causally as one sequence: HF's logits exactly."""
    from batchgen import LLM

    path = tiny_model_factory("llama")
    llm = LLM(path, num_kv_blocks=16)
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 42]])
    with torch.inference_mode():
        got = llm.model(input_ids=ids, position_ids=torch.arange(7)[None], use_cache=False,
                        batchgen_step=ProfileContext()).logits[0]
        want = load_hf_model(path)(input_ids=ids, use_cache=False).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
