"""How the ranks meet: what every rank is told (WorkerSpec) and how each joins the process group.

Workers that rank 0 starts meet at a TCPStore that rank 0 serves (it is the store's master, so
it never waits on a socket for a worker that may be dead): each worker connects, counts itself
in (`announce`) and only then joins; rank 0 joins once every worker has counted itself in (see
TPGroup.start). Under torchrun (or another launcher setting RANK and WORLD_SIZE) the ranks meet
through the launcher's `env://` rendezvous instead. Imported by both sides; imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HOST = "127.0.0.1"  # batchgen's own workers run on rank 0's machine
ANNOUNCED = "batchgen/announced"  # the store's count of workers about to join
# Workers wait on the control channel between generate calls for as long as the user likes.
CONTROL_TIMEOUT = timedelta(days=30)
# One forward's collectives; a rank that dies mid-forward fails gloo at once, NCCL by then.
FORWARD_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard, the same for every rank but its own."""

    path: str
    config: PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    tp_size: int
    trust_remote_code: bool
    threads: int
    store_port: int | None = None  # rank 0's store on HOST; None: the launcher's env://


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(rank: int, spec: WorkerSpec, store: Any = None) -> Any:
    """Join the process group as `rank` (through `store`, else the launcher's env://); returns
    the control group (gloo on every device)."""
    meet = {"init_method": "env://"} if store is None else {"store": store}
    dist.init_process_group(dist_backend(spec.device), rank=rank, world_size=spec.tp_size,
                            timeout=FORWARD_TIMEOUT, **meet)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def announce(spec: WorkerSpec) -> Any:
    """A started worker's client of rank 0's store, after counting itself in: rank 0 now
    joins, and this worker must join at once."""
    store = dist.TCPStore(HOST, spec.store_port, is_master=False, timeout=FORWARD_TIMEOUT)
    store.add(ANNOUNCED, 1)
    return store
