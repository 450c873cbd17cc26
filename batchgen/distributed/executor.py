"""The executor seam under tensor parallelism: rank 0's view of its group as the factory's
Executor (workers build and size what rank 0 does; each step reaches them through TPRunner)."""

from __future__ import annotations

from collections.abc import Callable

from batchgen.config import EngineConfig, PoolSize
from batchgen.distributed.driver import start_group
from batchgen.distributed.external import ExternalExecutor, join_world
from batchgen.distributed.group import TPGroup, WorkerDied
from batchgen.distributed.runner import TPRunner
from batchgen.engine.engine import Runner
from batchgen.factory import EnginePlan, Executor, LocalExecutor, RunnerSetup
from batchgen.model.runner import ModelRunner


class TPExecutor:
    """Rank 0 of a tensor-parallel group."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.tp_size = group.spec.tp_size
        self.tp_mesh = None  # the group is the whole world: transformers builds its mesh

    def agree(self, pool: PoolSize) -> PoolSize:
        """Rank 0 sizes the pool and sends it with the setup."""
        return pool

    def setup(self, setup: RunnerSetup) -> None:
        """Every worker builds the same runner over its local heads."""
        self.group.send(("setup", setup))

    def kv_budget(self, profile: tuple[int, int, float, int], local: Callable[[], int]) -> int:
        """Every rank profiles the largest step; the pool is what the tightest can hold."""
        self.group.send(("profile", *profile))
        return self.group.min_over_ranks(local())

    def runner(self, local: ModelRunner) -> Runner:
        return TPRunner(local, self.group)

    def start_failed(self, error: BaseException) -> BaseException:
        """What a failed start raises: when a worker died (its shard failed to load, say) and
        rank 0's collective failed with it, WorkerDied naming the worker. The group stops."""
        if isinstance(error, RuntimeError) and not isinstance(error, WorkerDied):
            dead = self.group.died()
            if dead is not None:
                return dead
        self.group.shutdown()
        return error

    def shutdown(self) -> None:
        self.group.shutdown()


def start_executor(owner: object, plan: EnginePlan, cfg: EngineConfig) -> Executor:
    """This process alone (tensor_parallel_size 1), one rank of the caller's world
    (external_launcher), or the started group's rank 0 (stopped when `owner` is collected or
    the interpreter exits)."""
    k = cfg.tensor_parallel_size
    if cfg.distributed_executor_backend == "external_launcher" and k > 1:
        join_world(k, plan.device)
        return ExternalExecutor(k, plan.device)
    group = start_group(owner, plan.path, plan.config, plan.dtype, plan.device, cfg)
    return LocalExecutor() if group is None else TPExecutor(group)
