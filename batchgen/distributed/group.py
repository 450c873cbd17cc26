"""The tensor-parallel group as rank 0 sees it: the worker processes it started, the process
group every rank's forward communicates through, and the control channel that carries each
step to the workers.

Rank 0 owns the workers: it starts them (spawn), and stops them when the LLM is deleted, when
the interpreter exits, or when one of them dies (the others are stopped too, and the call that
noticed raises). Workers ignore Ctrl-C (the terminal sends it to every process) and exit on
their own when rank 0 goes away (a pipe they watch closes).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

logger = logging.getLogger("batchgen")

# Workers wait on the control channel between generate calls for as long as the user likes.
CONTROL_TIMEOUT = timedelta(days=30)
# One forward's collectives; a rank that dies mid-forward fails gloo at once, NCCL by then.
FORWARD_TIMEOUT = timedelta(minutes=30)
STOP_GRACE_S = 5.0


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited: the group cannot run another forward."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard, the same for every rank but its own."""

    path: str
    config: PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    tp_size: int
    init_method: str
    trust_remote_code: bool
    threads: int


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_rank(rank: int, spec: WorkerSpec) -> Any:
    """Join the process group as `rank`; returns the control group (gloo on every device)."""
    dist.init_process_group(dist_backend(spec.device), init_method=spec.init_method, rank=rank,
                            world_size=spec.tp_size, timeout=FORWARD_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


@dataclass
class TPGroup:
    """Rank 0's handle on the workers (ranks 1..k-1) and the control channel."""

    spec: WorkerSpec
    procs: list[Any] = field(default_factory=list)
    pipes: list[Any] = field(default_factory=list)  # rank 0's ends of the workers' life pipes
    control: Any = None
    failed: str | None = None

    @classmethod
    def start(cls, spec: WorkerSpec, spawn: bool = True) -> TPGroup:
        """Start ranks 1..k-1 (unless a launcher did) and join the group as rank 0 (blocks
        until all have joined)."""
        from batchgen.distributed.worker import worker_main

        group = cls(spec)
        ctx = mp.get_context("spawn")
        for rank in range(1, spec.tp_size if spawn else 1):
            theirs, ours = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(rank, spec, theirs),
                               name=f"batchgen-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            group.procs.append(proc)
            group.pipes.append(ours)
        try:
            group.control = init_rank(0, spec)
        except BaseException:
            group.failed = "rank 0 could not join the group"
            group.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        return group

    def send(self, message: tuple[Any, ...]) -> None:
        """Broadcast one message to every worker (a pickled object over the control group)."""
        self.check()
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except RuntimeError as e:
            raise self.failure(e) from e

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (each worker contributes its own)."""
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except RuntimeError as e:
            raise self.failure(e) from e
        return int(t.item())

    def check(self) -> None:
        """WorkerDied if the group has failed or a worker has exited."""
        if self.failed is None:
            dead = [(p.name, p.exitcode) for p in self.procs if not p.is_alive()]
            if dead:
                self.failed = ", ".join(f"{n} exited with code {c}" for n, c in dead)
        if self.failed is not None:
            self.shutdown()
            raise WorkerDied(f"tensor-parallel worker failed ({self.failed}); this LLM cannot "
                             "run again: make a new one")

    def failure(self, error: BaseException) -> WorkerDied:
        """The error to raise for a collective that failed: names the dead worker if one is."""
        for p in self.procs:
            if p.is_alive():
                p.join(timeout=2.0)  # a worker on its way out: let it finish dying
        try:
            self.check()
        except WorkerDied as dead:
            return dead
        self.failed = f"a collective failed: {error}"
        self.shutdown()
        return WorkerDied(f"tensor-parallel group failed ({error}); make a new LLM")

    def shutdown(self) -> None:
        """Stop every worker (asked, then terminated, then killed) and leave the group."""
        if self.failed is None and self.control is not None:
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.control)
            except RuntimeError:
                pass
        for pipe in self.pipes:
            pipe.close()  # a worker still waiting sees its life pipe close and exits
        for p in self.procs:
            p.join(timeout=STOP_GRACE_S)
            if p.is_alive():
                p.terminate()
                p.join(timeout=STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs, self.pipes = [], []
        if self.control is not None:  # this group joined the default one: leave it
            dist.destroy_process_group()
        self.control = None
