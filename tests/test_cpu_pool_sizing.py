"""The CPU pool's default size: what max_num_seqs sequences of max_model_len tokens can use
(an RL trainer's few rollouts do not get 4 GiB), within 4 GiB and half the host's free memory."""

from __future__ import annotations

import pytest
import torch

from batchgen import config
from batchgen.config import EngineConfig, pool_blocks
from batchgen.kv.block_manager import blocks_for

CPU = torch.device("cpu")
BETA = 92_160  # SmolLM2-135M in float32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes


def test_the_pool_holds_max_num_seqs_sequences_of_max_model_len(monkeypatch) -> None:
    monkeypatch.setattr(config, "host_available_bytes", lambda: 64 << 30)
    cfg = EngineConfig(max_num_seqs=8)
    assert pool_blocks(cfg, BETA, CPU, None, 256) == 8 * blocks_for(256, 16) + 1
    # 8 x 8192 tokens would take 6 GB: the 4 GiB default caps it
    assert pool_blocks(cfg, BETA, CPU, None, 8192) == config.DEFAULT_CPU_KV_BYTES // (16 * BETA)


def test_the_default_takes_at_most_half_the_available_memory(monkeypatch) -> None:
    monkeypatch.setattr(config, "host_available_bytes", lambda: 1 << 30)
    assert config.cpu_kv_budget() == 512 << 20
    assert pool_blocks(EngineConfig(max_num_seqs=64), BETA, CPU, None, 2048) == \
        (512 << 20) // (16 * BETA)
    with pytest.raises(ValueError, match="the CPU default is 536870912 .*pass kv_cache_memory"):
        pool_blocks(EngineConfig(), BETA, CPU, None, 8192)  # 755 MB for one sequence
