"""Engine settings and the KV capacity maths (blocks from memory, max concurrency)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batchgen.kv.cache import num_blocks_for_memory

# CPU pools default to at most this much memory (vLLM's CPU default is 4 GiB too).
DEFAULT_CPU_KV_BYTES = 4 << 30
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    bytes_per_token: int  # β

    @property
    def num_tokens(self) -> int:
        return self.block_size * self.num_blocks

    def max_concurrency(self, seq_len: int) -> float:
        """How many sequences of `seq_len` tokens fit at once."""
        per_seq = math.ceil(seq_len / self.block_size)
        return self.num_blocks / per_seq

    def capacity_line(self, max_model_len: int) -> str:
        """The start-up log line that capacity planning needs."""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.bytes_per_token} bytes/token (beta), "
                f"{self.num_tokens * self.bytes_per_token / 2**20:.1f} MiB; maximum concurrency "
                f"for {max_model_len} tokens per request: {self.max_concurrency(max_model_len):.2f}x")


def check_positive_int(value: object, name: str, allow_none: bool = False) -> None:
    """ValueError naming `name` unless value is an int >= 1 (or None when allowed)."""
    if value is None and allow_none:
        return
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name} must be an integer >= 1{' or None' if allow_none else ''}, "
                         f"got {value!r}")


def pool_blocks(block_size: int, bytes_per_token: int, device: torch.device,
                num_kv_blocks: int | None, kv_cache_memory: int | None,
                gpu_free_bytes: int | None, max_blocks_useful: int) -> int:
    """Blocks in the pool: given outright, from a byte budget, or from the device's free memory
    (GPU) / a 4 GiB default (CPU), never more than the engine could ever use."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_memory is not None:
        blocks = num_blocks_for_memory(kv_cache_memory, block_size, bytes_per_token)
        if blocks < 1:
            raise ValueError(f"kv_cache_memory must hold at least one block of {block_size} "
                             f"tokens ({block_size * bytes_per_token} bytes), got {kv_cache_memory}")
        return blocks
    budget = gpu_free_bytes if device.type == "cuda" else DEFAULT_CPU_KV_BYTES
    if budget is None or budget < block_size * bytes_per_token:
        raise ValueError(
            "gpu_memory_utilization leaves no memory for the KV cache after the weights and "
            f"activations ({budget} bytes); raise gpu_memory_utilization or pass kv_cache_memory")
    return max(1, min(num_blocks_for_memory(budget, block_size, bytes_per_token),
                      max_blocks_useful))
