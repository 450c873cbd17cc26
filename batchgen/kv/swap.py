"""The host swap pool (`swap_space`): preempted groups' KV blocks in CPU RAM, block for block
in the device pool's shape, so a swap is one indexed copy per direction per step.

The BlockManager decides which host block holds which device block; HostPool owns the bytes
(pinned memory when the device pool is on a GPU) and makes the copies: the blocks of a
direction are gathered by one index and scattered by one index, in every layer, K and V.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from batchgen.kv.cache import KVCache
from batchgen.transfer import to_device

GIB = 2**30


def host_blocks_for(swap_space: float, block_size: int, bytes_per_token: int) -> int:
    """Whole blocks of `block_size` tokens in `swap_space` GiB (vLLM's unit)."""
    return int(swap_space * GIB) // (block_size * bytes_per_token)


def host_available_bytes() -> int:
    """RAM the host can still give (Linux's MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class HostPool:
    """`num_blocks` host blocks shaped as each of the device pool's tensors ([layers, 2 (or 1
    for K and V apart), blocks, block_size, kv_heads, width]; no scratch block: padding never
    writes here)."""

    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        self.cache = cache
        self.num_blocks = num_blocks
        pin = cache.device.type == "cuda"
        self.tensors = tuple(
            torch.zeros((*t.shape[:2], num_blocks, *t.shape[3:]), dtype=t.dtype, pin_memory=pin)
            for t in cache.tensors)
        self.pool = self.tensors[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block → device block for every (host, device) pair, one indexed copy per
        pool tensor."""
        if pairs:
            src, dst = np.array(pairs, np.int64).T
            dev = self.cache.device
            for host, device in zip(self.tensors, self.cache.tensors):
                blocks = host[:, :, torch.from_numpy(src)].to(dev, non_blocking=True)
                _bytes(device)[:, :, to_device(dst, dev)] = _bytes(blocks)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block → host block for every (device, host) pair, one indexed copy per
        pool tensor."""
        if pairs:
            src, dst = np.array(pairs, np.int64).T
            for host, device in zip(self.tensors, self.cache.tensors):
                blocks = device[:, :, to_device(src, self.cache.device)].cpu()
                _bytes(host)[:, :, torch.from_numpy(dst)] = _bytes(blocks)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (indexed copies have no float8 kernel everywhere)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
