"""Rank 0 starts its tensor-parallel group for an LLM (its own worker processes, see group.py
and launch.py, or torchrun's ranks), and ties the workers' lives to it."""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from batchgen.config import EngineConfig
from batchgen.distributed.group import TPGroup
from batchgen.distributed.rendezvous import WorkerSpec
from batchgen.distributed.worker import serve
from batchgen.log import logger

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def start_group(owner: object, path: Path, config: PretrainedConfig, dtype: torch.dtype,
                device: torch.device, cfg: EngineConfig) -> TPGroup | None:
    """None for tensor_parallel_size 1; else the started group, stopped when `owner` is
    collected or the interpreter exits. Under torchrun the group is torchrun's processes:
    rank 0 returns it, every other rank serves rank 0 here and then exits its process."""
    k = cfg.tensor_parallel_size
    if k == 1:
        return None
    if dist.is_initialized():  # transformers' TP plan shards over the one default group
        raise ValueError(f"tensor_parallel_size={k}: this process already has a "
                         "torch.distributed group (another tensor-parallel LLM, or torchrun's "
                         "own, initialised); one tensor-parallel LLM per process at a time: "
                         "delete the other first (del llm)")
    rank = _torchrun_rank(k)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("LOCAL_RANK", "0")  # transformers binds rank 0's GPU by it
    spec = WorkerSpec(str(path), config, dtype, device, k, cfg.trust_remote_code,
                      max(1, torch.get_num_threads() // k))
    if rank:  # a torchrun rank other than 0: a worker until rank 0 is done
        serve(rank, spec)
        sys.exit(0)
    if rank is None:
        logger.info("tensor parallel: starting %d worker processes (ranks 1..%d)", k - 1, k - 1)
    group = TPGroup.start(spec, spawn=rank is None)
    weakref.finalize(owner, group.shutdown)
    atexit.register(group.shutdown)  # before torch's own exit hooks tear the group down
    return group


def _torchrun_rank(k: int) -> int | None:
    """This process's rank when torchrun (or another launcher setting RANK and WORLD_SIZE)
    started k of them; None when batchgen starts its own workers."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != k:
        raise ValueError(f"tensor_parallel_size={k}, but the launcher started {world} "
                         "processes (WORLD_SIZE): they must be equal")
    return int(os.environ["RANK"])
