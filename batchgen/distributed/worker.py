"""A tensor-parallel worker (ranks 1..k-1): loads its shard of the weights, probes its layers,
and then runs whatever rank 0 sends on the control channel: the pool and backend to build
("setup"), a profiling forward on a GPU ("profile"), a step's block swaps, copies and
forward ("step"), "stop". Its logits are dropped: rank 0 samples. It owns its shard, its KV pool of
local heads (same block ids as every rank) and its step buffers; rank 0 owns everything else.
Run by worker_process.py in the workers rank 0 starts, or inside `LLM(...)` under torchrun.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from batchgen.attention.registry import BACKENDS
from batchgen.distributed.plan import rank_device
from batchgen.distributed.rendezvous import WorkerSpec, announce, join
from batchgen.factory import RunnerSetup, build_runner
from batchgen.model import loader
from batchgen.model.profile import device_kv_budget
from batchgen.model.runner import ModelRunner
from batchgen.model.state_probe import fill_specs, probe_layers


def serve(rank: int, spec: WorkerSpec) -> None:
    """Join the group, load the shard, and run rank 0's messages until "stop"."""
    launched = spec.store_port is None  # by torchrun: its LOCAL_RANK is the GPU index
    local = int(os.environ.get("LOCAL_RANK", rank)) if launched else rank
    device = rank_device(spec.device, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ["LOCAL_RANK"] = str(local)  # transformers binds the rank's GPU by it
    control = join(rank, spec, None if launched else announce(spec))
    model = loader.load_model(spec.path, spec.config, spec.dtype, device,
                              spec.trust_remote_code, tp_size=spec.tp_size)
    # the same probe forward as rank 0's (its collectives must match; state mixers never
    # reach here: tensor parallelism refuses them before the weights load)
    geo = loader.kv_geometry(spec.config)
    probed, _ = probe_layers(model, geo.num_layers, device)
    specs = fill_specs(probed, geo.num_kv_heads // spec.tp_size, geo.head_dim,
                       geo.head_dim_v or geo.head_dim, spec.dtype)
    runner: ModelRunner | None = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        kind, *args = box[0]
        if kind == "stop":
            return
        if kind == "setup":
            runner = _build(model, specs, args[0], device)
        elif kind == "profile":  # rank 0 sizes the pool by the tightest rank's budget
            budget = torch.tensor([device_kv_budget(model, *args[:2], device, *args[2:])])
            dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=control)
        elif kind == "step":
            block_ops, rows = args
            _block_ops(runner, block_ops)
            runner.execute(rows)


def _block_ops(runner: ModelRunner, ops: list[tuple[str, Any]]) -> None:
    """Rank 0's swaps, copies and calls on the runner (LoRA slot loads) since the last step,
    in its order."""
    for kind, pairs in ops:
        if kind == "call":
            pairs(runner)
        elif kind == "copy":
            runner.copy_blocks(pairs)
        else:
            runner.swap_blocks(pairs if kind == "swap_in" else [],
                               pairs if kind == "swap_out" else [])


def _build(model: torch.nn.Module, specs: list, setup: RunnerSetup, device: torch.device
           ) -> ModelRunner:
    """The rank's runner as rank 0 sized it, with the backend rank 0 chose."""
    load = BACKENDS[setup.backend].load()
    return build_runner(model, setup, device,
                        lambda cache: load(specs, cache, setup.max_step_tokens))
