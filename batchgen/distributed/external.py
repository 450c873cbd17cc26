"""`distributed_executor_backend="external_launcher"` (vLLM's name): the LLM lives inside a
torch.distributed world someone else started (torchrun, a trainer's accelerate launch). No
worker processes and no control channel: every rank runs the whole engine on the same prompts
with the same seed (SPMD), so every rank schedules the same steps and calls the same forwards,
whose collectives are transformers' tensor-parallel ones; every rank gets every output.
The world (a multiple of tensor_parallel_size k) is split into groups of k consecutive ranks,
each sharding one copy of the model (model/submesh.py) and generating for its own prompts: a
data-parallel copy per group, as vLLM and TRL lay it out. With k = 1 each rank is its own
engine and no process group is needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from batchgen.config import PoolSize
from batchgen.engine.engine import Runner
from batchgen.factory import RunnerSetup
from batchgen.model.runner import ModelRunner
from batchgen.model.submesh import world_mesh

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def join_world(tp_size: int, device: torch.device) -> int:
    """The world's size, joining it from the launcher's environment when no process group
    exists yet (gloo on the CPU, NCCL on a GPU); ValueError when that cannot be, or when the
    world does not split into groups of tensor_parallel_size ranks."""
    if not dist.is_initialized():
        missing = [v for v in _ENV if v not in os.environ]
        if missing:
            raise ValueError("distributed_executor_backend 'external_launcher' runs inside a "
                             "torch.distributed world: start the script with torchrun (or "
                             f"init_process_group first); {', '.join(missing)} not set")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tensor_parallel_size must divide the world size ({world}) with "
                         "distributed_executor_backend 'external_launcher' (each group of "
                         f"that many consecutive ranks holds one copy of the model), got {tp_size}")
    return world


class ExternalExecutor:
    """One rank of an SPMD tensor-parallel group inside a larger world: its own engine, pools
    sized alike on every rank of its group."""

    def __init__(self, tp_size: int, device: torch.device) -> None:
        self.tp_size = tp_size
        self.tp_mesh = world_mesh(tp_size, device)  # every rank of the world builds it
        self.group = self.tp_mesh.get_group("tp")
        self.device = device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def setup(self, setup: RunnerSetup) -> None:
        pass

    def agree(self, pool: PoolSize) -> PoolSize:
        """The pool every rank of the group can hold (each sized it from its host's memory)."""
        n = self._min([pool.num_blocks, pool.max_model_len, pool.num_host_blocks])
        return replace(pool, num_blocks=n[0], max_model_len=n[1], num_host_blocks=n[2])

    def kv_budget(self, profile: tuple[int, int, float, int], local: Callable[[], int]) -> int:
        """Every rank profiles its own step; the pool is what the group's tightest can hold."""
        return self._min([local()])[0]

    def runner(self, local: ModelRunner) -> Runner:
        return local

    def start_failed(self, error: BaseException) -> BaseException:
        return error

    def shutdown(self) -> None:
        pass  # the world is the launcher's

    def _min(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the tensor-parallel group."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]
