"""Rank 0 starts its tensor-parallel group for an LLM, and ties the workers' lives to it."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
from transformers import PretrainedConfig

from batchgen.config import EngineConfig
from batchgen.distributed.group import TPGroup, WorkerSpec, free_port
from batchgen.log import logger


def start_group(owner: object, path: Path, config: PretrainedConfig, dtype: torch.dtype,
                device: torch.device, cfg: EngineConfig) -> TPGroup | None:
    """None for tensor_parallel_size 1; else the started group, stopped when `owner` is
    collected or the interpreter exits."""
    k = cfg.tensor_parallel_size
    if k == 1:
        return None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("LOCAL_RANK", "0")  # transformers binds rank 0's GPU by it
    spec = WorkerSpec(str(path), config, dtype, device, k, f"tcp://127.0.0.1:{free_port()}",
                      cfg.trust_remote_code, max(1, torch.get_num_threads() // k))
    logger.info("tensor parallel: starting %d worker processes (ranks 1..%d)", k - 1, k - 1)
    group = TPGroup.start(spec)
    weakref.finalize(owner, group.shutdown)
    return group
